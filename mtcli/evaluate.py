"""Scoring: sacreBLEU's BLEU, chrF, chrF++ and TER on detokenized text, the one path for validation and `mtcli eval`;
sentence-level scores; and the validation loss. Paired significance tests live in compare.py.

BLEU uses sacreBLEU's `zh` tokenizer for Chinese targets and `13a` otherwise; TER splits Chinese and Japanese
characters (sacreBLEU's asian support). Every score comes with the `sacrebleu` command that reproduces it from the
hypothesis and reference files written beside it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch
from sacrebleu.metrics import BLEU, CHRF, TER

from mtcli.batching import collate, epoch_batches
from mtcli.checkpoint import read_config, run_of
from mtcli.config import Config, DecodeConfig
from mtcli.config_loader import load_config
from mtcli.corpus import describe_source, read_lines
from mtcli.data import eval_texts
from mtcli.errors import MtcliError
from mtcli.loss import projection_cross_entropy, target_states
from mtcli.translate import Translator, inference_model, translation_precision

CHINESE = {"zh", "zh-cn", "zh-tw", "zho", "cmn"}
ASIAN = CHINESE | {"ja", "jpn"}  # TER splits these characters apart: their words are not separated by spaces
METRICS = ("bleu", "chrf", "chrf++", "ter")
BOOTSTRAP = 1000  # resamples for --confidence: sacreBLEU's --confidence-n default, so its command repeats ours


@dataclass(frozen=True)
class ScoreOptions:
    """What `mtcli eval` scores: which metrics, case-insensitively or not, with 95% confidence intervals or not."""

    metrics: tuple[str, ...] = METRICS
    lowercase: bool = False
    confidence: bool = False


def parse_metrics(text: str) -> tuple[str, ...]:
    """--metrics bleu,chrf++ -> ("bleu", "chrf++"), in the order given."""
    names = tuple(dict.fromkeys(name.strip().lower() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in METRICS]
    if unknown or not names:
        raise MtcliError(f"--metrics {text}: choose one or more of {', '.join(METRICS)}, comma-separated")
    return names


def bleu_tokenizer(tgt_lang: str) -> str:
    return "zh" if tgt_lang.lower() in CHINESE else "13a"


def make_metric(name: str, tgt_lang: str, lowercase: bool = False, sentence: bool = False):
    """The sacreBLEU metric object; sentence-level BLEU uses the effective order, as `sacrebleu --sentence-level`
    does. TER stays case-insensitive, sacreBLEU's default."""
    if name == "bleu":
        return BLEU(tokenize=bleu_tokenizer(tgt_lang), lowercase=lowercase, effective_order=sentence)
    if name in ("chrf", "chrf++"):
        return CHRF(word_order=2 if name == "chrf++" else 0, lowercase=lowercase)
    return TER(asian_support=tgt_lang.lower() in ASIAN)


def sacrebleu_flags(names: tuple[str, ...] | list[str], tgt_lang: str, lowercase: bool) -> list[str]:
    """Command-line options that make `sacrebleu` compute `names` as make_metric does (one call cannot hold both
    chrF and chrF++: -cw applies to every chrF of the call)."""
    flags = ["-m", *("chrf" if n == "chrf++" else n for n in names)]
    if "bleu" in names and bleu_tokenizer(tgt_lang) == "zh":
        flags += ["-tok", "zh"]
    if "chrf++" in names:
        flags += ["-cw", "2"]
    if "ter" in names and tgt_lang.lower() in ASIAN:
        flags += ["--ter-asian-support"]
    if lowercase and "bleu" in names:
        flags += ["-lc"]  # BLEU's only: chrF has its own option
    if lowercase and ("chrf" in names or "chrf++" in names):
        flags += ["--chrf-lowercase"]
    return flags


def metric_groups(names: tuple[str, ...]) -> list[tuple[str, ...]]:
    """`names` split into the fewest `sacrebleu` calls: chrF++ needs a call of its own when chrF is there too."""
    if "chrf++" in names and "chrf" in names:
        return [tuple(n for n in names if n != "chrf++"), ("chrf++",)]
    return [names]


def sacrebleu_command(refs: list[Path], hyps: list[Path], flags: list[str]) -> str:
    return shlex.join(["sacrebleu", *map(str, refs), "-i", *map(str, hyps), *flags, "-w", "2"])


def corpus_scores(hypotheses: list[str], references: list[list[str]], tgt_lang: str, options: ScoreOptions) -> dict:
    """Corpus scores of detokenized hypotheses against one or more reference streams (each as long as the
    hypotheses): per metric its name, score, signature and detail (BLEU's n-gram precisions), and with
    options.confidence the bootstrap mean and 95% interval (sacreBLEU's, seed SACREBLEU_SEED, default 12345)."""
    for i, stream in enumerate(references):
        if len(stream) != len(hypotheses):
            raise ValueError(f"{len(hypotheses)} hypotheses for {len(stream)} references (reference {i + 1})")
    if not hypotheses:  # sacreBLEU's own error is an IndexError
        raise MtcliError("nothing to score: no sentences")
    scores = {}
    for name in options.metrics:
        metric = make_metric(name, tgt_lang, options.lowercase)
        result = metric.corpus_score(hypotheses, references, n_bootstrap=BOOTSTRAP if options.confidence else 1)
        entry = {"name": result.name, "score": result.score, "signature": str(metric.get_signature())}
        entry["detail"] = result.format(width=2)  # e.g. "BLEU = 39.12 (μ = 39.10 ± 0.90) 70.1/45.0/..."
        if options.confidence:
            entry["mean"], entry["ci"] = float(result._mean), float(result._ci)  # sacreBLEU keeps them there only
        scores[name] = entry
    return scores


def score(hypotheses: list[str], references: list[str], tgt_lang: str, lowercase: bool = False) -> dict:
    """Corpus BLEU and chrF against one reference each (validation during training and the benchmarks): the same
    code as `mtcli eval`'s, so the logged validation BLEU is what eval repeats."""
    scores = corpus_scores(hypotheses, [references], tgt_lang, ScoreOptions(("bleu", "chrf"), lowercase))
    bleu, chrf = scores["bleu"], scores["chrf"]
    return {
        "bleu": bleu["score"],
        "chrf": chrf["score"],
        "signature": bleu["signature"],
        "chrf_signature": chrf["signature"],
        "bleu_detail": bleu["detail"],
    }


def sentence_scores(hypotheses: list[str], references: list[list[str]], tgt_lang: str, options: ScoreOptions):
    """Per segment, each metric's sentence-level score (what `sacrebleu --sentence-level` prints)."""
    metrics = {name: make_metric(name, tgt_lang, options.lowercase, sentence=True) for name in options.metrics}
    rows = []
    for i, hypothesis in enumerate(hypotheses):
        refs = [stream[i] for stream in references]
        rows.append({name: metric.sentence_score(hypothesis, refs).score for name, metric in metrics.items()})
    return rows


def write_lines(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line.replace("\n", " ") + "\n" for line in lines), encoding="utf-8")


def score_files(
    hypotheses: list[str],
    hyp_path: Path,
    references: list[list[str]],
    ref_paths: list[Path],
    tgt_lang: str,
    options: ScoreOptions,
) -> dict:
    """Scores of hypotheses already written to `hyp_path` (references to `ref_paths`), each metric with the
    `sacrebleu` call that repeats it on those files; the scores also stand at the top level (`bleu`, `chrf`, ...)."""
    scores = corpus_scores(hypotheses, references, tgt_lang, options)
    commands = []
    for group in metric_groups(options.metrics):
        flags = sacrebleu_flags(group, tgt_lang, options.lowercase) + (["--confidence"] if options.confidence else [])
        commands.append(sacrebleu_command(ref_paths, [hyp_path], flags))
        for name in group:
            scores[name]["command"] = commands[-1]
    return {
        **{name: entry["score"] for name, entry in scores.items()},
        "signature": scores[options.metrics[0]]["signature"],
        "scores": scores,
        "hypotheses": str(hyp_path),
        "references": [str(p) for p in ref_paths],
        "command": commands[0],
    }


def evaluate(
    translator: Translator,
    sources: list[str],
    references: list[list[str]],
    decode: DecodeConfig,
    out_dir: Path,
    stem: str,
    options: ScoreOptions = ScoreOptions(),
    compare: list[str] | tuple[str, ...] = (),
    sentence_file: Path | None = None,
    progress: bool = False,
) -> dict:
    """Translate `sources`, write hypotheses and references under `out_dir` and score them; with `compare` (runs,
    checkpoint folders or hypothesis files), paired tests of each against this system; with `sentence_file`, the
    sentence-level scores there, one JSON line per segment."""
    from mtcli.compare import compare_systems  # compare.py builds on this module

    for other in compare:  # before translating: a typo should not cost a translation of the whole set first
        if not Path(other).exists():
            raise MtcliError(f"--compare {other}: no such run directory, checkpoint folder or file of hypotheses")
    tgt_lang = translator.config.data.tgt_lang
    hypotheses = translator.translate(sources, decode, progress)
    references = [[" ".join(r.split()) for r in stream] for stream in references]
    hyp_path = out_dir / f"{stem}.beam{decode.beam}.hyp.{tgt_lang}"
    write_lines(hyp_path, hypotheses)
    names = [f"ref{i + 1}" for i in range(len(references))] if len(references) > 1 else ["ref"]
    ref_paths = [out_dir / f"{stem}.{name}.{tgt_lang}" for name in names]
    for path, stream in zip(ref_paths, references):
        write_lines(path, stream)
    result = score_files(hypotheses, hyp_path, references, ref_paths, tgt_lang, options)
    result.update(
        {"sentences": len(sources), "beam": decode.beam, "lenpen": decode.lenpen, "precision": translator.precision}
    )
    if sentence_file is not None:
        result["sentence_scores"] = write_sentence_scores(
            sentence_file, sources, hypotheses, references, (hyp_path, ref_paths), tgt_lang, options
        )
    if compare:
        baseline = (hyp_path.name, hyp_path, hypotheses)
        result["comparison"] = compare_systems(
            translator, baseline, compare, sources, (references, ref_paths), decode, options, progress
        )
    return result


def write_sentence_scores(
    path: Path,
    sources: list[str],
    hypotheses: list[str],
    references: list[list[str]],
    files,
    tgt_lang: str,
    options: ScoreOptions,
) -> dict:
    """One JSON line per segment (line number, each metric's sentence score, source, hypothesis, references), and
    the `sacrebleu --sentence-level` call that prints each metric's column from `files` (hypotheses, references)."""
    hyp_path, ref_paths = files
    rows = sentence_scores(hypotheses, references, tgt_lang, options)
    try:
        with open(path, "w", encoding="utf-8") as f:
            for i, row in enumerate(rows):
                refs = [stream[i] for stream in references]
                line = {"line": i + 1, **row, "source": sources[i], "hypothesis": hypotheses[i], "references": refs}
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
    except OSError as e:
        raise MtcliError(f"--sentence-scores {path}: cannot write ({e.strerror})") from None
    commands = {
        name: sacrebleu_command(
            ref_paths, [hyp_path], sacrebleu_flags((name,), tgt_lang, options.lowercase) + ["--sentence-level", "-b"]
        )
        for name in options.metrics
    }
    return {"file": str(path), "commands": commands}


def format_report(result: dict) -> str:
    """The text `mtcli eval` prints: each score with its signature, the files and the commands that repeat them."""
    lines = [f"{entry['detail']}  [{entry['signature']}]" for entry in result["scores"].values()]
    lines.append(f"precision: {result['precision']}, beam {result['beam']}, length penalty {result['lenpen']}")
    if result.get("ensemble"):
        lines.append(f"ensemble: {result['checkpoint']}, {', '.join(result['ensemble'])} (probabilities averaged)")
    lines.append(f"hypotheses: {result['hypotheses']}\nreferences: {', '.join(result['references'])}")
    lines += [f"check: {command}" for command in dict.fromkeys(e["command"] for e in result["scores"].values())]
    if "sentence_scores" in result:
        lines.append(f"sentence scores: {result['sentence_scores']['file']} (one JSON line per segment)")
    if "comparison" in result:
        from mtcli.compare import format_comparison

        lines.append(format_comparison(result["comparison"]))
    return "\n".join(lines)


def eval_config(checkpoint: Path, run: Path | None) -> Config:
    """The checkpoint's own config; when --run names another run as well, with that run's data settings (its test
    and valid splits), after checking that the checkpoint was trained with the run's SentencePiece model."""
    config = read_config(checkpoint)
    if run is None or run_of(checkpoint).resolve() == Path(run).resolve():
        return config
    run_spm, ckpt_folder = Path(run) / "spm.model", Path(checkpoint)
    ckpt_spm = (ckpt_folder if ckpt_folder.is_dir() else ckpt_folder.parent) / "spm.model"
    if not run_spm.is_file() or not (Path(run) / "config.yaml").is_file():
        raise MtcliError(f"--run {run}: not a run directory (no config.yaml and spm.model)")
    if not ckpt_spm.is_file() or ckpt_spm.read_bytes() != run_spm.read_bytes():
        raise MtcliError(
            f"--checkpoint {checkpoint} was trained with another vocabulary than run {run} ({ckpt_spm} differs "
            f"from {run_spm}); evaluate it without --run (on its own run's data), or pick a checkpoint of {run}"
        )
    return config.replace(data=load_config(Path(run) / "config.yaml").to_dict()["data"])


def evaluation_set(config: Config, split: str | None, src: Path | None, refs: list[Path]) -> tuple[list, list, str]:
    """Sources, reference streams and a name: a split of the run's data (default test, one reference), or a source
    file with one or more line-aligned reference files."""
    if (src is None) != (not refs):
        raise MtcliError("--src and --ref go together (--ref may be given several times)")
    if src is not None and split is not None:
        raise MtcliError("give either --split or --src/--ref, not both")
    if src is None:
        role = split or "test"
        sources, references = eval_texts(config, role)
        named = [(f"--split {role}: the sources of", describe_source(config.data), sources)]
        _check_not_blank(named + [(f"--split {role}: the references of", describe_source(config.data), references)])
        return sources, [references], role
    sources = read_lines(src)
    streams = []
    for ref in refs:
        streams.append(read_lines(ref))
        if len(streams[-1]) != len(sources):
            raise MtcliError(f"line counts differ: {src} has {len(sources)} lines, {ref} has {len(streams[-1])}")
    _check_not_blank([("--src", src, sources)] + [("--ref", ref, lines) for ref, lines in zip(refs, streams)])
    return sources, streams, Path(src).name


def _check_not_blank(named: list[tuple[str, Path | str, list[str]]]) -> None:
    """Each (option, file, lines) holds a non-blank line: sacreBLEU fails on no lines at all, and scores blank ones
    0 as if that said something about the model."""
    for option, path, lines in named:
        if not any(line.strip() for line in lines):
            what = "is empty" if not lines else f"has only blank lines ({len(lines):,})"
            raise MtcliError(f"{option} {path} {what}: nothing to evaluate")


# ---------------------------------------------------------------------------------------------------------------------
# Validation during training


@torch.inference_mode()
def validation_loss(model, split, cfg: Config, device, autocast) -> dict:
    """Label-smoothed loss, negative log-likelihood and perplexity per target token of an encoded split."""
    model.eval()
    nll_sum, smoothed_sum, tokens = 0.0, 0.0, 0
    for indices in epoch_batches(split.src_lens, split.tgt_lens, cfg.train.max_tokens, 0, 0, shuffle=False):
        srcs, tgts = [split.src(i) for i in indices], [split.tgt(i) for i in indices]
        batch = collate(srcs, tgts, cfg.model.max_positions, model.specials).to(device)
        with autocast:
            real = target_states(model, batch.src, batch.src_pad_mask, batch.tgt_in, batch.tgt_index)
            weight, bias, labels = model.output.weight, model.output_bias, batch.labels
            nll_sum += float(projection_cross_entropy(real, weight, labels, 0.0, bias))
            smoothed_sum += float(projection_cross_entropy(real, weight, labels, cfg.train.label_smoothing, bias))
        tokens += batch.n_tgt_tokens
    nll = nll_sum / max(tokens, 1)
    return {"loss": smoothed_sum / max(tokens, 1), "nll": nll, "ppl": math.exp(min(nll, 50))}


def validation_bleu(model, tokenizer, split, cfg: Config, device) -> float:
    """Greedy BLEU on (the first valid_max_sentences of) an eval split, through the same path as `mtcli eval`."""
    sources, references = split.texts()
    if cfg.train.valid_max_sentences:
        sources, references = sources[: cfg.train.valid_max_sentences], references[: cfg.train.valid_max_sentences]
    # The precision `mtcli eval` picks by default, on a converted copy: the logged score is what eval repeats.
    precision = translation_precision(cfg.decode.precision, cfg.model, device)
    translator = Translator(inference_model(model, precision, copy=True), tokenizer, cfg, device, precision)
    decode = dataclasses.replace(cfg.decode, beam=1, nbest=1, sampling=False)
    return score(translator.translate(sources, decode), references, cfg.data.tgt_lang)["bleu"]
