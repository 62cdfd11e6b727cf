"""`mtcli distill`: a big teacher into a small, fast student (sequence-level knowledge distillation, Kim & Rush
2016), one resumable step at a time, in one run directory:

    synthesize  the teacher (a run, an ensemble, an imported opus-mt, a LibreTranslate server) translates the
                student's training sources, and --mono text, with beam search: <run>/distill/train, .../mono
    train       the student's config on distilled + original data (data.train_corpora, weighted by distill.*)
    average     the student's last distill.average_last checkpoints, kept only if better on valid
    score       teacher and student on distill.eval_split: BLEU and chrF with signatures, paired tests, sentences/s
    export      the student to CTranslate2 (distill.quantization), scored and timed there too
    card        MODEL_CARD.md and model_card.json (mtcli/model_card.py): every figure with the file it comes from

<run>/distill.json records each finished step and its wall time; a rerun skips what is done, so a killed distill
goes on where it stopped (synthesis after its last chunk, training from its last checkpoint).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch

from mtcli.average import average_last
from mtcli.checkpoint import (
    best_checkpoint,
    checkpoint_dir,
    config_differences,
    last_checkpoint,
    list_checkpoints,
    read_config,
    resolve_member,
)
from mtcli.config import Config, TrainCorpusConfig
from mtcli.config_loader import replaced
from mtcli.corpus import split_names
from mtcli.data import eval_texts
from mtcli.errors import MtcliError
from mtcli.export import export_ctranslate2
from mtcli.log import format_duration, logger
from mtcli.model_card import CARD_JSON, write_card
from mtcli.outputs import write_file_atomic
from mtcli.parity import CTranslate2Engine, EngineSettings, ParityOptions
from mtcli.rundir import RunLock, check_run_dir, mark_run_dir
from mtcli.scoring import ScoreOptions, score, score_files, write_lines
from mtcli.synthetic import Filters, file_lines, split_lines, synthesize
from mtcli.teachers import HTTP_TIMEOUT, is_url, open_teacher
from mtcli.train import plain_run_name, train
from mtcli.translate import Translator, load_translator

STATE = "distill.json"
METRICS = ("bleu", "chrf")  # the scores of the rows (model_card.py adds paired tests of the same)


@dataclass
class Plan:
    """What one `mtcli distill` call works with."""

    cfg: Config  # the student's config as given
    teachers: list[str]
    run_dir: Path
    mono: Path | None
    device: str
    timeout: float = HTTP_TIMEOUT  # seconds one request to an HTTP teacher may take
    lock: RunLock | None = None  # held while this command works in the run directory


def distill(
    cfg: Config,
    teachers: list[str],
    run_dir: Path | None = None,
    mono: Path | None = None,
    device="auto",
    timeout: float = HTTP_TIMEOUT,
):
    """Run every step not yet done (see the module's description); returns the model card's JSON with `run_dir`
    (absolute; the card itself holds no path of this machine), or None when training was interrupted (the run then
    resumes with the same command)."""
    run_dir = Path(os.path.abspath(run_dir or Path("runs") / plain_run_name(cfg.name)))  # absolute: the corpora's paths
    plan = Plan(cfg, [str(t) for t in teachers], run_dir, mono, device, timeout)
    check_inputs(plan)
    state = read_state(plan)
    cfg = plan.cfg  # as the run was started (read_state)
    teacher = None
    if not done(state, "synthesize") or (mono and not done(state, "synthesize_mono")):
        teacher = teacher_for_synthesis(plan)  # its languages: checked by check_inputs (a run), by asking (a URL)
    filters, chunk = synthesis_filters(cfg), cfg.distill.chunk_lines
    train_lines = split_lines(cfg, "train", cfg.data.src_lang)
    open_distill_dir(plan, state)  # only now: every input has been checked
    plan.lock = RunLock(plan.run_dir, ".distill.lock", "distilled")  # train takes .lock itself
    run_step(
        plan, state, "synthesize", lambda: synthesize(teacher, train_lines, corpus_dir(plan, "train"), chunk, filters)
    )
    if mono:
        run_step(
            plan,
            state,
            "synthesize_mono",
            lambda: synthesize(teacher, file_lines(mono), corpus_dir(plan, "mono"), chunk, filters),
        )
    teacher = None  # its memory, before the student trains
    student_cfg = student_config(plan)
    if not done(state, "train"):
        started = time.time()
        result = train(student_cfg, plan.run_dir, resume=last_checkpoint(plan.run_dir) is not None)
        if result.stopped_by in ("SIGINT", "SIGTERM"):
            return None
        finish(plan, state, "train", time.time() - started, {"updates": result.update, "stopped_by": result.stopped_by})
    run_step(plan, state, "average", lambda: choose_student(plan, student_cfg))
    run_step(plan, state, "score", lambda: score_systems(plan, state))
    if cfg.distill.quantization != "none":
        run_step(plan, state, "export", lambda: export_student(plan, state))
    run_step(plan, state, "card", lambda: write_card(plan.run_dir, plan.cfg, state))
    card = json.loads((plan.run_dir / CARD_JSON).read_text(encoding="utf-8"))
    return card | {"run_dir": str(plan.run_dir)}


# ---------------------------------------------------------------------------------------------------------------------
# Checks before any work, the run directory and its record of finished steps


def check_inputs(plan: Plan) -> None:
    """Every input that can be checked without translating: one line each, before anything is written."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise MtcliError(
            "mtcli distill runs in one process; under torchrun, run `mtcli data synthesize` first, then train with "
            "its folder in data.train_corpora"
        )
    if not plan.teachers:
        raise MtcliError("--teacher: give the teacher, a run directory (repeat it for an ensemble) or a URL")
    for teacher in plan.teachers:
        if not is_url(teacher) and not Path(teacher).exists():
            raise MtcliError(f"--teacher {teacher}: no such run directory or checkpoint folder")
    if is_url(plan.teachers[0]) and plan.cfg.distill.drop_worst:
        raise MtcliError("distill.drop_worst needs the teacher's scores; an HTTP teacher gives none: set it to 0")
    student = (plan.cfg.data.src_lang, plan.cfg.data.tgt_lang)
    for teacher in plan.teachers:
        if not is_url(teacher):
            data = read_config(resolve_member(teacher)).data
            if (data.src_lang, data.tgt_lang) != student:
                raise MtcliError(
                    f"--teacher {teacher}: translates {data.src_lang}->{data.tgt_lang}, the student {student[0]}->"
                    f"{student[1]}; a teacher must translate what its student learns"
                )
    if plan.mono is not None and not Path(plan.mono).is_file():
        raise MtcliError(f"--mono {plan.mono}: no such file")
    if not (plan.cfg.data.path or plan.cfg.data.dataset or plan.cfg.data.train_corpora):
        raise MtcliError("the student's config names no training data (data.path, data.dataset or data.train_corpora)")
    if plan.cfg.distill.quantization != "none":
        try:
            import ctranslate2  # noqa: F401
        except ImportError:
            raise MtcliError(
                f"distill.quantization {plan.cfg.distill.quantization} exports to CTranslate2, which is not "
                "installed: pip install 'mtcli[export]', or set distill.quantization=none"
            ) from None


def read_state(plan: Plan) -> dict:
    """The record of finished steps of the run directory: new (missing or empty), or an earlier distill's (its
    manifest says `distill`) with the same teachers, --mono and config; anything else is refused. Writes nothing."""
    run_dir = plan.run_dir
    check_run_dir(run_dir, "distill into", ("distill",))
    state_file = run_dir / STATE
    state = {"steps": {}}
    if state_file.is_file():
        try:
            state = json.loads(state_file.read_text(encoding="utf-8"))
            if not isinstance(state.get("steps"), dict):
                raise ValueError("no steps")
        except (ValueError, AttributeError, TypeError, KeyError) as e:
            raise MtcliError(f"{state_file}: damaged ({e}); give a new --run-dir") from None
    given = {"teachers": [t if is_url(t) else str(Path(t).resolve()) for t in plan.teachers]}
    given["mono"] = str(Path(plan.mono).resolve()) if plan.mono else None
    given["config"] = plan.cfg.to_dict()
    earlier = state.get("inputs", given)
    if {k: earlier.get(k) for k in ("teachers", "mono")} != {k: given[k] for k in ("teachers", "mono")}:
        raise MtcliError(
            f"--run-dir {run_dir}: was distilled from {', '.join(earlier['teachers'])} (--mono {earlier['mono']}); "
            "give the same teachers and --mono to continue it, or a new --run-dir"
        )
    started_ratio = ((earlier.get("config") or {}).get("distill") or {}).get("max_ratio")
    if plan.cfg.distill.max_ratio is None and started_ratio is not None:
        # a run started when distill.max_ratio had a number of its own (3.0 by default) goes on with it
        plan.cfg = replaced(plan.cfg, **{"distill.max_ratio": started_ratio})
        given["config"] = plan.cfg.to_dict()
    changed = config_differences(earlier.get("config") or {}, given["config"])
    if changed:
        key, was, now = changed[0]
        raise MtcliError(
            f"--run-dir {run_dir}: was started with another config ({key}: {was} -> {now}); give the same config and "
            "--set to continue it, or a new --run-dir"
        )
    state["inputs"] = given
    return state


def open_distill_dir(plan: Plan, state: dict) -> None:
    """Create the run directory (marked as distill's) and its record of steps, if they are not there yet."""
    try:
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        mark_run_dir(plan.run_dir, "distill")
        save_state(plan, state)
    except OSError as e:
        raise MtcliError(f"--run-dir {plan.run_dir}: cannot write there ({e.strerror})") from None


def save_state(plan: Plan, state: dict) -> None:
    write_file_atomic(plan.run_dir / STATE, json.dumps(state, indent=1, ensure_ascii=False) + "\n")


def done(state: dict, name: str) -> bool:
    return name in state["steps"]


def finish(plan: Plan, state: dict, name: str, seconds: float, record: dict) -> None:
    state["steps"][name] = {"seconds": round(seconds, 1), **record}
    save_state(plan, state)
    logger.info(f"distill: {name} done in {format_duration(seconds)}")


def run_step(plan: Plan, state: dict, name: str, work) -> None:
    """`work()` unless the step is done; recorded (its returned dict, its wall time) only when it succeeds."""
    if done(state, name):
        logger.info(f"distill: {name}: done earlier, skipped")
        return
    logger.info(f"distill: {name}")
    started = time.time()
    record = work()
    finish(plan, state, name, time.time() - started, record if isinstance(record, dict) else {})


# ---------------------------------------------------------------------------------------------------------------------
# Synthesis and the student's data


def teacher_for_synthesis(plan: Plan):
    d = plan.cfg.distill
    langs = (plan.cfg.data.src_lang, plan.cfg.data.tgt_lang)
    if is_url(plan.teachers[0]):
        return open_teacher(plan.teachers, langs, timeout=plan.timeout)
    return open_teacher(plan.teachers, (None, None), [], plan.device, beam=d.beam, lenpen=d.lenpen, sampling=False)


def synthesis_filters(cfg: Config) -> Filters:
    """distill.max_ratio unset: the data's own ratio (the toy's templates, or Chinese against English, differ in length
    by design, and their configs say so in data.max_ratio)."""
    max_ratio = cfg.data.max_ratio if cfg.distill.max_ratio is None else cfg.distill.max_ratio
    return Filters(max_ratio=max_ratio, drop_worst=cfg.distill.drop_worst)


def corpus_dir(plan: Plan, name: str) -> Path:
    return plan.run_dir / "distill" / name


def student_config(plan: Plan) -> Config:
    """The student's config with its training data: the distilled corpus (and distilled --mono text) beside its own
    data, each a data.train_corpora entry with its distill.* weight; the original data is left out at weight 0."""
    cfg, d = plan.cfg, plan.cfg.distill
    data = cfg.data
    if data.train_corpora:
        original = [replace(c, weight=c.weight * d.original_weight) for c in data.train_corpora]
    else:
        where = {"path": data.path} if data.path else {"dataset": data.dataset, "subset": data.subset}
        split = split_names(data)["train"]
        original = [TrainCorpusConfig(**where, revision=data.revision, split=split, weight=d.original_weight)]
    # the distilled folders hold plain text whatever data.format the original corpus has
    corpora = [TrainCorpusConfig(path=str(corpus_dir(plan, "train")), weight=d.distilled_weight, format="text")]
    if plan.mono:
        corpora.append(TrainCorpusConfig(path=str(corpus_dir(plan, "mono")), weight=d.mono_weight, format="text"))
    corpora += [c for c in original if c.weight > 0]
    return replaced(cfg, **{"data.train_corpora": [asdict(c) for c in corpora]})


# ---------------------------------------------------------------------------------------------------------------------
# After training: the checkpoint to ship, scores, speed, export


def choose_student(plan: Plan, student_cfg: Config) -> dict:
    """The run's best checkpoint, or the average of its last checkpoints where that is better on valid (greedy)."""
    best = best_checkpoint(plan.run_dir) or last_checkpoint(plan.run_dir)
    if best is None:
        raise MtcliError(f"{plan.run_dir}: the student's training left no checkpoint")
    n = plan.cfg.distill.average_last

    def valid_bleu(ckpt: Path) -> float:
        sources, refs = eval_texts(student_cfg, "valid")
        translator = Translator.from_checkpoint(ckpt, plan.device)
        return score(translator.translate(sources, beam=1), refs, student_cfg.data.tgt_lang)["bleu"]

    if n < 2 or len(list_checkpoints(plan.run_dir)) < n:
        record = {"checkpoint": str(best), "why": "the best on valid (no averaging)"}
        with contextlib.suppress(MtcliError):  # measured all the same for the card, where there is a valid split
            record["valid_bleu"] = {str(best): valid_bleu(best)}
        return record
    averaged = average_last(plan.run_dir, n, checkpoint_dir(plan.run_dir) / f"average_last{n}", force=True)
    scores = {str(ckpt): valid_bleu(ckpt) for ckpt in (best, averaged)}
    chosen = str(averaged) if scores[str(averaged)] > scores[str(best)] else str(best)
    logger.info(f"distill: valid BLEU (greedy) {', '.join(f'{k}: {v:.2f}' for k, v in scores.items())}; {chosen}")
    return {"checkpoint": chosen, "why": "the higher valid BLEU (greedy)", "valid_bleu": scores}


def student_checkpoint(state: dict) -> Path:
    return Path(state["steps"]["average"]["checkpoint"])


def timed(translate, sources: list[str]) -> tuple[list[str], float]:
    """Translations of `sources` and sentences per second, after a warm-up on the first few (kernels, caches)."""
    translate(sources[:16])
    start = time.perf_counter()
    hyps = translate(sources)
    return hyps, len(sources) / (time.perf_counter() - start)


def score_systems(plan: Plan, state: dict) -> dict:
    """Teacher (its own decode settings) and student (greedy int8, and its own beam) on distill.eval_split: scores,
    hypotheses files, sentences/s (the card adds the paired tests)."""
    cfg = plan.cfg
    role = cfg.distill.eval_split
    sources, refs = eval_texts(cfg, role)
    tgt = cfg.data.tgt_lang
    out = plan.run_dir / "distill" / "eval"
    ref_path = out / f"{role}.ref.{tgt}"
    write_lines(ref_path, refs)
    rows = []
    if is_url(plan.teachers[0]):
        http = open_teacher(plan.teachers, (cfg.data.src_lang, tgt), timeout=plan.timeout)

        def translate(lines: list[str]) -> list[str]:
            return [o.text for o in http.translate(lines, 0)]

        # the server's search, precision and machine are its own: unknown here
        settings = {"engine": "LibreTranslate API", "beam": None, "lenpen": None, "precision": None, "device": None}
        systems = [("teacher", plan.teachers[0], translate, settings | {"threads": None})]
    else:
        teacher_ckpt = resolve_member(plan.teachers[0])
        tr, decode = load_translator(teacher_ckpt, read_config(teacher_ckpt), [], plan.device, plan.teachers[1:])
        members = {"members": [str(p) for p in [teacher_ckpt, *tr.ensemble]]}
        systems = [("teacher", str(teacher_ckpt), _translate_with(tr, decode), _settings(tr, decode) | members)]
    student = student_checkpoint(state)
    # int8 is a CPU precision (torch's dynamic quantization): that row runs on the CPU whatever --device says
    for name, device, options in (("student greedy int8", "cpu", {"beam": 1, "precision": "int8"}),
                                  ("student", plan.device, {})):  # fmt: skip
        tr, decode = load_translator(student, read_config(student), [], device, **options)
        if name == "student" and decode.beam == 1:
            continue  # the student's own decode settings are greedy: the int8 row covers them in its precision
        systems.append(
            (
                f"{name} beam {decode.beam}" if name == "student" else name,
                str(student),
                _translate_with(tr, decode),
                _settings(tr, decode),
            )
        )
    for i, (name, model, translate, settings) in enumerate(systems):
        logger.info(f"distill: scoring {name} on {role} ({len(sources):,} sentences)")
        hyps, speed = timed(translate, sources)
        path = out / f"{role}.{i}-{name.replace(' ', '-')}.hyp.{tgt}"
        write_lines(path, hyps)
        rows.append(
            {
                "system": name,
                "model": model,
                **settings,
                "sentences_per_second": round(speed, 1),
                "hypotheses": str(path),
                **_scores(hyps, refs, tgt, ref_path, path),
            }
        )
    return {"split": role, "references": str(ref_path), "sentences": len(sources), "systems": rows}


def _translate_with(translator: Translator, decode):
    return lambda lines: translator.translate(lines, decode)


def _settings(translator: Translator, decode) -> dict:
    return {
        "beam": decode.beam,
        "lenpen": decode.lenpen,
        "precision": translator.precision,
        "engine": "mtcli",
        "device": str(translator.device),
        "threads": torch.get_num_threads(),
    }


def _scores(hyps: list[str], refs: list[str], tgt: str, ref_path: Path, hyp_path: Path) -> dict:
    """BLEU and chrF (rounded as the card shows them), their signatures and the `sacrebleu` call that repeats both."""
    scores = score_files(hyps, hyp_path, [refs], [ref_path], tgt, ScoreOptions(METRICS))
    result = {m: round(scores[m], 2) for m in METRICS}
    result["signatures"] = {m: scores["scores"][m]["signature"] for m in METRICS}
    result["command"] = scores["command"]
    return result


def export_student(plan: Plan, state: dict) -> dict:
    """The student in CTranslate2 (distill.quantization), and its greedy translation of the eval split there: BLEU,
    chrF, sentences/s on this machine's threads."""
    import ctranslate2  # an optional extra (check_inputs has made sure it is there)

    kind = plan.cfg.distill.quantization
    student = student_checkpoint(state)
    # with its parity report (parity.json) beside it; the card's own figures say how good the export is
    parity = ParityOptions(check=False)
    folder = export_ctranslate2(student, plan.run_dir / "export" / f"ct2-{kind}", kind, True, parity)
    cfg, role = plan.cfg, plan.cfg.distill.eval_split
    sources, refs = eval_texts(cfg, role)
    config = read_config(student)
    limit = config.model.max_positions - 1  # one position for BOS / EOS
    prefix = config.source_prefix()
    threads = torch.get_num_threads()  # as the PyTorch rows run
    engine = CTranslate2Engine(folder, prefix, limit, threads)
    # greedy at CTranslate2's defaults (no minimum length, no repeat blocking): the search the row names
    greedy = EngineSettings(beam=1, lenpen=0.0, early_stopping=True, min_len=0, max_len=limit, no_repeat_ngram=0)
    hyps, speed = timed(partial(engine.translate, s=greedy, beam=1), sources)
    tgt = cfg.data.tgt_lang
    score_dir = plan.run_dir / "distill" / "eval"
    path = score_dir / f"{role}.ct2-{kind}-greedy.hyp.{tgt}"
    write_lines(path, hyps)
    ref_path = Path(state["steps"]["score"]["references"])
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    row = {
        "system": f"student greedy, CTranslate2 {kind}",
        "model": str(folder),
        "beam": 1,
        "precision": kind,
        "engine": f"ctranslate2 {ctranslate2.__version__}",
        "device": "cpu",
        "threads": threads,
        "sentences_per_second": round(speed, 1),
        "hypotheses": str(path),
        **_scores(hyps, refs, tgt, ref_path, path),
    }
    failures = _parity_failures(folder)
    if failures:  # kept (the card says so), where `mtcli export` would refuse it
        logger.warning(f"distill: the export failed its parity check ({'; '.join(failures)}); see {folder}/parity.json")
    return {"folder": str(folder), "bytes": size, "row": row}


def _parity_failures(folder: Path) -> list[str]:
    try:
        return list(json.loads((folder / "parity.json").read_text(encoding="utf-8"))["failures"])
    except (OSError, ValueError, KeyError, TypeError):
        return ["no readable parity.json"]
