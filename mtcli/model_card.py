"""The model card of a distilled student, `mtcli distill`'s last step: MODEL_CARD.md and model_card.json in the run
directory.

Every figure comes from a file of the run: distill.json (the steps' records), the hypotheses and references the
scores were computed on, the export's parity.json, metrics.jsonl and the corpora's synthesis.json. So the card is
recomputed whole from what the run holds, and a card step that failed reruns from there. The card is meant to be
shared: paths are relative to the run directory, the teacher is named by its folder name or URL, and it says what a
user must know before shipping the student (a parity check the export failed, outputs that repeat, the data the
filters dropped).
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
from pathlib import Path

import torch
import yaml
from safetensors import safe_open

from mtcli.checkpoint import checkpoint_dir, read_config
from mtcli.compare import TESTS, paired_tests
from mtcli.config import Config
from mtcli.device import cpu_name
from mtcli.line_io import read_lines
from mtcli.log import format_duration, logger
from mtcli.outputs import write_file_atomic
from mtcli.parity import REPEAT_TIMES, count_repeating
from mtcli.scoring import ScoreOptions
from mtcli.tokenizer import Tokenizer

METRICS = ("bleu", "chrf")
CARD_JSON, CARD_MD = "model_card.json", "MODEL_CARD.md"
CONFIG = "distill/config.yaml"  # the student's config as given, so the card's command repeats the run


def write_card(run_dir: Path, cfg: Config, state: dict) -> None:
    """Write the run's MODEL_CARD.md, model_card.json and distill/config.yaml from `state` (distill.json)."""
    steps = state["steps"]
    student = Path(steps["average"]["checkpoint"])
    rows = list(steps["score"]["systems"]) + ([steps["export"]["row"]] if "export" in steps else [])
    systems = [dict(row) for row in rows]  # copies: the figures added below belong to the card, not to distill.json
    signatures = _add_paired_tests(systems, Path(steps["score"]["references"]), cfg.data.tgt_lang)
    tokenizer = Tokenizer.from_folder(student)
    for row in systems:
        hyps = read_lines(Path(row["hypotheses"]))
        row["repeating"] = count_repeating(hyps, tokenizer)  # in the student's target subwords, for every row
        row["empty"] = sum(not h for h in hyps)
    teachers = state["inputs"]["teachers"]
    card = {
        "name": cfg.name,
        "languages": {"source": cfg.data.src_lang, "target": cfg.data.tgt_lang},
        "command": _command(teachers, state["inputs"]["mono"]),
        "teacher": {"models": teachers},
        "student": _student(run_dir, steps, student),
        "machine": {
            "cpu": cpu_name(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "eval": {
            "split": steps["score"]["split"],
            "sentences": steps["score"]["sentences"],
            "references": steps["score"]["references"],
        },
        "systems": systems,
        "repeating_means": f"outputs in which a 1-4 subword n-gram occurs {REPEAT_TIMES} times in a row (a model "
        "stuck in a loop: such an output runs to the length limit, which makes a system slow as well as wrong)",
        "tests": TESTS,
        "test_signatures": signatures,
        "data": {name: _corpus(run_dir / "distill" / name) for name in ("train", "mono")},
        "steps": {name: record["seconds"] for name, record in steps.items()},
    }
    card["data"] = {name: summary for name, summary in card["data"].items() if summary is not None}
    if "members" in systems[0]:  # a model teacher (an HTTP one has no weights to count)
        card["teacher"]["parameters"], card["teacher"]["bytes"] = _parameters(systems[0]["members"])
    card["summary"] = [_compared(systems[0], row) for row in systems[1:]]
    card["usage"] = _usage(card["student"])
    card = _shareable(card, _places(run_dir, cfg, state))
    write_file_atomic(run_dir / CONFIG, yaml.safe_dump(state["inputs"]["config"], sort_keys=False, allow_unicode=True))
    write_file_atomic(run_dir / CARD_JSON, json.dumps(card, indent=1, ensure_ascii=False) + "\n")
    write_file_atomic(run_dir / CARD_MD, card_markdown(card))
    logger.info(f"distill: model card {run_dir / CARD_MD}")
    for line in card["summary"]:
        logger.info(f"  {line}")
    if card["student"].get("export", {}).get("parity", {}).get("failures"):
        logger.warning(f"distill: the export {_parity_line(card['student']['export'])}")


def _add_paired_tests(systems: list[dict], references: Path, tgt_lang: str) -> dict:
    """Paired tests of every row against the first (the teacher), on the hypothesis files the rows name, added to the
    rows; returns the tests' signatures."""
    hypotheses = [(row["system"], read_lines(Path(row["hypotheses"]))) for row in systems]
    tests, signatures = paired_tests(hypotheses, [read_lines(references)], tgt_lang, ScoreOptions(METRICS))
    for i, row in enumerate(systems):
        row["paired"] = {m: {k: tests[m][i].get(k) for k in ("delta", "p_bs", "p_ar")} for m in METRICS} if i else None
    return signatures


def _command(teachers: list[str], mono: str | None) -> str:
    """The command that made the run, as run in the run directory (the teacher where it is on your machine)."""
    command = "mtcli distill " + " ".join(f"--teacher {t}" for t in teachers)
    command += f" --config {CONFIG} --run-dir ."
    return command + (f" --mono {mono}" if mono else "")


# ---------------------------------------------------------------------------------------------------------------------
# The student: shape, training, valid BLEU, export


def _student(run_dir: Path, steps: dict, checkpoint: Path) -> dict:
    model = read_config(checkpoint).model
    parameters, size = _parameters([checkpoint])
    average = steps["average"]
    student = {
        "checkpoint": str(checkpoint),
        "chosen": average["why"],
        "parameters": parameters,
        "bytes": size,
        "shape": {
            "encoder_layers": model.n_encoder_layers,
            "decoder_layers": model.n_decoder_layers,
            "d_model": model.d_model,
            "heads": model.heads,
            "d_ff": model.d_ff,
            "parameters": parameters,
        },
        "training": {
            "updates": steps["train"]["updates"],
            "target_tokens": _target_tokens(run_dir, steps["train"]["updates"]),
            "stopped_by": steps["train"].get("stopped_by"),
        },
        # greedy, with mtcli (a distill.json from before it was measured without averaging has none)
        "valid_bleu": _rounded(average.get("valid_bleu", {}).get(str(checkpoint))),
    }
    if "export" in steps:
        folder = Path(steps["export"]["folder"])
        student["export"] = {"folder": str(folder), "bytes": steps["export"]["bytes"], "parity": _parity(folder)}
        student["export"] |= _export_search(folder)
    return student


def _parameters(checkpoints: list[Path]) -> tuple[int, int]:
    """Parameters and bytes of the checkpoints' weights files (an ensemble: all its members)."""
    count = size = 0
    for checkpoint in checkpoints:
        path = Path(checkpoint) / "model.safetensors"
        with safe_open(str(path), "pt") as f:
            count += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
        size += path.stat().st_size
    return count, size


def _target_tokens(run_dir: Path, updates: int) -> int | None:
    """Target tokens the student trained on, from metrics.jsonl (None where it is unreadable)."""
    tokens = 0
    try:
        with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                if record["update"] <= updates:
                    tokens += record["tokens"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return tokens


def _parity(folder: Path) -> dict:
    """What the export's parity.json says (mtcli/parity.py): its failures, and per search the outputs that repeat and
    come back empty, with mtcli and with the export."""
    try:
        report = json.loads((folder / "parity.json").read_text(encoding="utf-8"))
        rows = [
            {"search": r["mode"], "identical": r["identical"], "lines": r["lines"], "repeating": r["repeating"],
             "empty": r["empty"], "bleu": r.get("bleu")}
            for r in report["rows"]
        ]  # fmt: skip
        return {
            "report": str(folder / "parity.json"),
            "engine": report["engine"],
            "precision": report["precision"],
            "probe": report["probe"],
            "failures": list(report["failures"]),
            "rows": rows,
        }
    except (OSError, ValueError, KeyError, TypeError) as e:
        return {"report": None, "failures": [f"no readable parity report in the export ({type(e).__name__})"]}


def _export_search(folder: Path) -> dict:
    """The tokenizer files and translate_batch arguments an export's user needs (from its mtcli.json)."""
    try:
        meta = json.loads((folder / "mtcli.json").read_text(encoding="utf-8"))
        search, prefix = dict(meta["translate_batch"]), meta.get("src_prefix") or ""
    except (OSError, ValueError, KeyError, TypeError):
        search, prefix = {}, ""
    names = ["spm.model"] if (folder / "spm.model").is_file() else ["spm.src.model", "spm.tgt.model"]
    return {"spm": [str(folder / name) for name in names], "translate_batch": search, "src_prefix": prefix}


def _parity_line(export: dict) -> str:
    parity = export["parity"]
    if not parity["failures"]:
        return f"passed its parity check against mtcli ({parity['report']})"
    return (
        f"FAILED its parity check against mtcli ({'; '.join(parity['failures'])}): it does not translate as the "
        f"checkpoint does, and `mtcli export` would refuse it; ship the checkpoint, or export again "
        f"({parity['report']})"
    )


def _usage(student: dict) -> list[str]:
    """How to translate with the student: mtcli with the checkpoint, and CTranslate2 with the export."""
    lines = ["# PyTorch, with mtcli (any device):", f'mtcli translate --checkpoint {student["checkpoint"]} "..."']
    export = student.get("export")
    if export is None:
        return lines
    options = "".join(f", {k}={v!r}" for k, v in export["translate_batch"].items())
    prefix = f"{export['src_prefix'] + ' '!r} + " if export["src_prefix"] else ""
    warning = [] if not export["parity"]["failures"] else ["# this export FAILED its parity check: see above"]
    tgt = "tgt = src"  # one vocabulary for both sides
    if len(export["spm"]) == 2:
        tgt = f'tgt = sentencepiece.SentencePieceProcessor(model_file="{export["spm"][1]}")'
    return lines + [
        "",
        "# CTranslate2 (pip install ctranslate2 sentencepiece):",
        *warning,
        "import ctranslate2, sentencepiece",
        f'translator = ctranslate2.Translator("{export["folder"]}", device="cpu")',
        f'src = sentencepiece.SentencePieceProcessor(model_file="{export["spm"][0]}")',
        tgt,
        'lines = ["..."]  # the sentences to translate',
        f"pieces = src.encode([{prefix}line for line in lines], out_type=str)",
        f"results = translator.translate_batch(pieces{options})",
        "translations = [tgt.decode(r.hypotheses[0]) for r in results]",
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Data, comparisons, shareable paths


def _corpus(folder: Path) -> dict | None:
    try:
        report = json.loads((folder / "synthesis.json").read_text(encoding="utf-8"))
    except OSError:
        return None
    keys = ("input", "lines", "kept", "dropped", "mean_score", "sentences_per_second", "teacher")
    return {k: report.get(k) for k in keys} | {"warnings": report.get("warnings", []), "folder": str(folder)}


def _compared(teacher: dict, row: dict) -> str:
    ratio = row["sentences_per_second"] / teacher["sentences_per_second"]
    return (
        f"{row['system']}: BLEU {row['bleu']:.2f} ({row['bleu'] - teacher['bleu']:+.2f} against the teacher's "
        f"{teacher['bleu']:.2f}), {row['sentences_per_second']:,.1f} sentences/s ({ratio:.1f}x the teacher's)"
    )


def _places(run_dir: Path, cfg: Config, state: dict) -> dict[str, str]:
    """Absolute paths (and URLs) the card may hold -> what it shows instead: the run directory's own files relative
    to it (""), the teachers by folder name or URL without credentials, the data and --mono by their names."""
    places = {str(run_dir): ""}
    for teacher in state["inputs"]["teachers"]:
        places[teacher] = _teacher_name(teacher)
    if state["inputs"]["mono"]:
        places[state["inputs"]["mono"]] = Path(state["inputs"]["mono"]).name
    for path in [cfg.data.path, *(c.path for c in cfg.data.train_corpora)]:
        if path:
            places[str(Path(path).resolve())] = Path(path).name
    return places


def _teacher_name(teacher: str) -> str:
    if teacher.startswith(("http://", "https://")):
        address = urllib.parse.urlsplit(teacher)
        host = address.hostname or ""
        netloc = f"[{host}]" if ":" in host else host
        netloc += f":{address.port}" if address.port else ""
        return urllib.parse.urlunsplit(address._replace(netloc=netloc))  # without user:password@
    path = Path(teacher)
    if checkpoint_dir(path).is_dir() or path.parent.name != "checkpoints":
        return path.name  # a run (or a folder of its own)
    return f"{path.parent.parent.name}/checkpoints/{path.name}"  # a checkpoint of a run


def _shareable(value, places: dict[str, str]):
    """`value` with every path in `places` (as a whole path, or the start of one) replaced; "" drops the folder, so
    the path reads relative to it."""
    if isinstance(value, dict):
        return {_shareable(k, places): _shareable(v, places) for k, v in value.items()}
    if isinstance(value, list):
        return [_shareable(v, places) for v in value]
    if not isinstance(value, str):
        return value
    end = r"(?=[/\s'\"`),;]|$)"  # the whole path, or a folder of it: never the start of a longer name
    for where in sorted(places, key=len, reverse=True):  # the longest first: a run inside the teacher's folder
        name = places[where]
        if not name:
            value = value.replace(where + "/", "")
        value = re.sub(re.escape(where) + end, lambda _, shown=name or ".": shown, value)
    return value


# ---------------------------------------------------------------------------------------------------------------------
# MODEL_CARD.md


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _shown(value) -> str:
    return "server's own" if value is None else str(value)


def card_markdown(card: dict) -> str:
    teacher, student = card["teacher"], card["student"]
    lines = [f"# {card['name']}: a distilled {card['languages']['source']}->{card['languages']['target']} model", ""]
    lines.append(
        f"- Teacher: {', '.join(teacher['models'])}"
        + (f" ({teacher['parameters']:,} parameters, {_size(teacher['bytes'])})" if "parameters" in teacher else "")
    )
    s = student["shape"]
    lines.append(
        f"- Student: {student['checkpoint']}: {s['encoder_layers']}+{s['decoder_layers']} layers, d_model "
        f"{s['d_model']}, {s['heads']} heads, d_ff {s['d_ff']}; {student['parameters']:,} parameters, "
        f"{_size(student['bytes'])} in float32; chosen as {student['chosen']}"
    )
    t = student["training"]
    tokens = f"{t['target_tokens']:,} target tokens" if t["target_tokens"] is not None else "target tokens unknown"
    bleu = f"{student['valid_bleu']:.2f}" if student["valid_bleu"] is not None else "not measured"
    lines.append(
        f"- Training: {t['updates']:,} updates, {tokens} (stopped by {t['stopped_by']}); valid BLEU {bleu} "
        "(greedy, mtcli)"
    )
    if "export" in student:
        export = student["export"]
        lines.append(f"- Export: {export['folder']} ({_size(export['bytes'])}): {_parity_line(export)}")
    m = card["machine"]
    lines.append(f"- Measured on: {m['cuda'] or m['cpu']}, {m['threads']} threads, torch {m['torch']}")
    lines.append(f"- Made with (in the run directory; the teacher where it is on your machine): `{card['command']}`")
    lines.append("- Paths here are relative to the run directory.")

    e = card["eval"]
    lines += ["", f"## Scores on {e['split']} ({e['sentences']:,} sentences; references {e['references']})", ""]
    lines.append(
        "| system | engine | beam | precision | BLEU | chrF | sentences/s | repeating | p (BLEU, bootstrap / AR) |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for row in card["systems"]:
        paired = row.get("paired")
        p = f"{paired['bleu']['p_bs']:.4f} / {paired['bleu']['p_ar']:.4f}" if paired else "baseline"
        lines.append(
            f"| {row['system']} | {row.get('engine', 'LibreTranslate API')} | {_shown(row.get('beam'))} | "
            f"{_shown(row.get('precision'))} | {row['bleu']:.2f} | {row['chrf']:.2f} | "
            f"{row['sentences_per_second']:,.1f} | {row['repeating']} | {p} |"
        )
    lines += ["", *[f"- {s}" for s in card["summary"]], f"- Repeating: {card['repeating_means']}.", ""]
    lines.append(
        f"BLEU: `{card['systems'][0]['signatures']['bleu']}`; chrF: `{card['systems'][0]['signatures']['chrf']}`"
    )
    lines.append(
        "Paired tests against the teacher (sacreBLEU): "
        + "; ".join(f"`{sig}`" for sig in card["test_signatures"]["bleu"].values())
    )
    lines += ["", "Each score repeats with (in the run directory):", ""]
    lines += [f"    {row['command']}" for row in card["systems"]]

    if "export" in student and student["export"]["parity"].get("rows"):
        parity = student["export"]["parity"]
        lines += ["", f"## Parity of the export: {parity['engine']} {parity['precision']} against mtcli", ""]
        lines.append(f"{parity['probe']}; {parity['report']}")
        lines += [
            "",
            "| search | identical lines | repeating mtcli / export | empty mtcli / export |",
            "|---|---|---|---|",
        ]
        for r in parity["rows"]:
            lines.append(
                f"| {r['search']} | {r['identical']}/{r['lines']} | {r['repeating'][0]} / {r['repeating'][1]} | "
                f"{r['empty'][0]} / {r['empty'][1]} |"
            )
        lines += ["", *[f"- FAILED: {failure}" for failure in parity["failures"]]]

    lines += ["", "## Use", "", "```", *card["usage"], "```", "", "## Data", ""]
    for name, d in card["data"].items():
        dropped = ", ".join(f"{n:,} {k}" for k, n in d["dropped"].items() if n) or "none"
        mean = "none (an HTTP teacher gives no scores)" if d["mean_score"] is None else d["mean_score"]
        lines.append(
            f"- {name}: {d['input']}: {d['lines']:,} lines translated by the teacher, {d['kept']:,} kept "
            f"(dropped: {dropped}); mean teacher score per subword {mean}; {d['folder']}"
        )
        lines += [f"  - warning: {w}" for w in d["warnings"]]
    lines += ["", "## Wall time of each step (of the call that finished it)", ""]
    lines += [f"- {name}: {format_duration(seconds)}" for name, seconds in card["steps"].items()]
    return "\n".join(lines) + "\n"


def _rounded(score: float | None) -> float | None:
    return None if score is None else round(score, 2)
