"""Synthetic parallel corpora: a teacher translates text into a corpus folder that `data.path` and
`data.train_corpora` read as they are (`mtcli data synthesize`; `mtcli distill` uses it too).

    lines (a text file, or one side of a config's split), streamed in chunks of `chunk_lines`
      -> the teacher (a run, an ensemble of runs, or any LibreTranslate /translate endpoint)
      -> one file per chunk in a work folder beside the output, each written whole
      -> when every chunk is there: the filters (empty, copy, length ratio, lowest teacher scores per subword)
      -> <out>/train.<source lang>, train.<target lang>, train.scores, dropped.tsv, synthesis.json

The files are named by language, so the same machinery serves distillation (the teacher's output is the target) and
back-translation (a target->source teacher: its output is the source side, the original text the target).

Resumable and cached: the work folder is named by a content key (teacher files, input, decode settings; the finished
corpus's key adds the filters), a killed run continues after its last finished chunk, and each chunk's translation
depends on nothing else (its own batches; sampling seeded by the chunk's number), so the result is byte-identical to
an uninterrupted run. A finished output with the same key is reused as it is.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from mtcli.clean import clean_line
from mtcli.config import Config
from mtcli.corpus import fingerprint_hash, source_fingerprint, split_names
from mtcli.data import open_sources
from mtcli.errors import MtcliError, error_text
from mtcli.line_io import check_utf8
from mtcli.log import counted, format_duration, logger, progress_bar
from mtcli.mixture import corpora_fingerprint
from mtcli.outputs import check_folder_target, new_folder, read_manifest, write_file_atomic
from mtcli.rundir import RunLock
from mtcli.teachers import HttpTeacher

COMMAND = "data synthesize"
REPORT = "synthesis.json"
FILTERS = ("empty", "copy", "ratio", "score")
# a filter dropping more than this share is said so (a ratio of 3 dropped 901 of 4,000 perfect en->zh translations)
DROP_WARNING_SHARE = 0.05


@dataclass(frozen=True)
class Filters:
    """What is dropped from the teacher's output; each dropped pair is counted under the first filter that drops it."""

    max_ratio: float = 3.0  # longer side / shorter side in the teacher's subwords (characters for an HTTP teacher)
    min_score: float | None = None  # teacher log-probability per subword (with EOS)
    drop_worst: float = 0.0  # share of the scored pairs with the lowest score per subword


# ---------------------------------------------------------------------------------------------------------------------
# What is translated: a text file, or one side of a config's split


@dataclass
class Lines:
    """The lines to translate, streamed in chunks: `total` of them, described by `name` and `identity`."""

    name: str
    total: int
    identity: dict
    # (chunk_lines, first_chunk) -> the lines of each chunk from `first_chunk` on
    chunks: Callable[[int, int], Iterator[list[str]]]
    changed: Callable[[], bool] = lambda: False  # whether the input differs from what `identity` describes


def file_lines(path: Path) -> Lines:
    """A monolingual text file, one sentence per line (whitespace cleaned as the data path cleans it)."""
    path = Path(path)
    if not path.is_file():
        raise MtcliError(f"--input {path}: no such file")
    stat = path.stat()
    total = check_utf8(path)  # the newlines, counted in the same pass
    if stat.st_size and not _ends_with_newline(path):
        total += 1

    def chunks(size: int, first: int) -> Iterator[list[str]]:
        with open(path, encoding="utf-8", newline="\n") as f:
            batch: list[str] = []
            for i, line in enumerate(f):
                if i < first * size:
                    continue
                batch.append(clean_line(line))
                if len(batch) == size:
                    yield batch
                    batch = []
            if batch:
                yield batch

    identity = {"file": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}

    def changed() -> bool:
        now = path.stat()
        return (now.st_size, now.st_mtime_ns) != (stat.st_size, stat.st_mtime_ns)

    return Lines(str(path), total, identity, chunks, changed)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def split_lines(cfg: Config, role: str, lang: str) -> Lines:
    """The `lang` side of a split of `cfg`'s data (train: data.train_corpora when it names them), read as the data
    path reads it."""
    data = cfg.data
    if lang not in (data.src_lang, data.tgt_lang):
        raise MtcliError(
            f"the teacher reads {lang}; the config's data is {data.src_lang}->{data.tgt_lang}: pick a teacher that "
            f"translates from {data.src_lang} (or from {data.tgt_lang}, for back-translation)"
        )
    cache_dir = Path(data.cache_dir)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MtcliError(
            f"data.cache_dir {cache_dir}: cannot hold the data cache ({e.strerror or error_text(e)}); set "
            "data.cache_dir to a folder you can write to"
        ) from None
    sources = open_sources(data, cache_dir)
    if role not in sources:
        raise MtcliError(f"--split {role}: the config's data has no {role} split (data.splits.{role})")
    split = sources[role]
    side = 0 if lang == data.src_lang else 1

    def chunks(size: int, first: int) -> Iterator[list[str]]:
        for start in range(first * size, split.num_rows, size):
            yield [clean_line(x) for x in split.rows(start, start + size)[side]]

    corpora = role == "train" and data.train_corpora
    identity = {
        "split": split_names(data).get(role, role),
        "side": lang,
        "source": corpora_fingerprint(data) if corpora else source_fingerprint(data),
    }
    return Lines(f"the {lang} side of {split.description}", split.num_rows, identity, chunks)


# ---------------------------------------------------------------------------------------------------------------------
# The synthesis


def synthesis_key(teacher, lines: Lines, chunk_lines: int, filters: Filters | None) -> str:
    """What identifies the translation (filters None: the work folder's chunks) or the finished corpus."""
    key = {"version": 1, "teacher": teacher.identity(), "input": lines.identity, "chunk_lines": chunk_lines}
    return fingerprint_hash(key | ({"filters": asdict(filters)} if filters is not None else {}))


def synthesize(
    teacher,
    lines: Lines,
    out: Path,
    chunk_lines: int = 2000,
    filters: Filters = Filters(),
    force: bool = False,
    progress: bool = True,
) -> dict:
    """Translate `lines` with `teacher` into the corpus folder `out` (see the module's description); returns the
    report also written to out/synthesis.json. An output with the same key is reused without translating."""
    out = Path(os.path.abspath(out))
    if (filters.min_score is not None or filters.drop_worst) and isinstance(teacher, HttpTeacher):
        raise MtcliError("--min-score and --drop-worst need the teacher's scores; an HTTP teacher gives none")
    if lines.total == 0:
        raise MtcliError(f"{lines.name}: nothing to translate (no lines)")
    key = synthesis_key(teacher, lines, chunk_lines, filters)
    # the chunks do not depend on the filters: a run whose filters dropped everything reruns without translating
    work = out.parent / f".{out.name}.synthesis-{synthesis_key(teacher, lines, chunk_lines, None)}"
    earlier = _finished(out, key)
    if earlier is not None:
        shutil.rmtree(work, ignore_errors=True)  # left by a run killed right after it published
        logger.info(f"synthesis: {out} already holds this teacher's translation of {lines.name}; reusing it")
        return earlier
    check_folder_target(out, COMMAND, force)  # before any work: what would be refused at the end is refused now
    made = [p for p in reversed(out.parents) if not p.exists()]
    try:
        work.mkdir(parents=True, exist_ok=True)
        lock = RunLock(work, ".lock", "written", "--out")
    except OSError as e:
        raise MtcliError(f"--out {out}: cannot write beside it ({e.strerror})") from None
    try:
        start = time.time()
        n_chunks = math.ceil(lines.total / chunk_lines)
        translated, seconds = _translate_chunks(teacher, lines, work, out, chunk_lines, n_chunks, progress)
        if lines.changed():
            raise MtcliError(f"{lines.name} changed while it was translated; run again to translate the new version")
        report = {
            "key": key,
            "teacher": teacher.name,
            "teacher_identity": teacher.identity(),
            "input": lines.name,
            "languages": {"source": teacher.src_lang, "target": teacher.tgt_lang},
            "filters": asdict(filters),
            "translation_seconds": round(seconds, 1),  # this call's; chunks a killed run left are not timed
            "sentences_per_second": round(translated / seconds, 1) if seconds else None,
        }
        with new_folder(out, COMMAND, force) as tmp:
            try:
                counts = _write_corpus(work, n_chunks, tmp, teacher, filters)
                if counts["kept"] == 0:
                    dropped = ", ".join(f"{n:,} {reason}" for reason, n in counts["dropped"].items() if n)
                    raise MtcliError(f"{lines.name}: the filters dropped all {counts['lines']:,} lines ({dropped})")
                report |= counts | {"warnings": drop_warnings(counts, filters, teacher)}
                report["seconds"] = round(time.time() - start, 1)
                if getattr(teacher, "retried", 0):
                    report["http_retries"] = teacher.retried
                text = json.dumps(report, indent=1, ensure_ascii=False) + "\n"
                (tmp / REPORT).write_text(text, encoding="utf-8")
            except OSError as e:  # a full disk: the translated chunks stay, for a rerun that translates nothing again
                raise MtcliError(
                    f"--out {out}: cannot write in {out.parent} ({e.strerror or error_text(e)}); the translation is "
                    f"kept in {work.name} there: make room and run the same command again"
                ) from None
        shutil.rmtree(work, ignore_errors=True)  # still locked: no other process can be using it
    except BaseException:
        if not any(work.glob("chunk-*")):  # nothing worth resuming: leave no trace
            shutil.rmtree(work, ignore_errors=True)
            for parent in reversed(made):
                with contextlib.suppress(OSError):
                    parent.rmdir()
        raise
    finally:
        lock.release()
    logger.info(describe(report, out))
    for warning in report["warnings"]:
        logger.warning(f"synthesis: {warning}")
    return report


def _finished(out: Path, key: str) -> dict | None:
    manifest = read_manifest(out)
    if manifest is None or manifest["command"] != COMMAND:
        return None
    try:
        report = json.loads((out / REPORT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return report if report.get("key") == key else None


def _chunk_path(work: Path, index: int) -> Path:
    return work / f"chunk-{index:07d}.jsonl"


def _translate_chunks(
    teacher, lines: Lines, work: Path, out: Path, size: int, n_chunks: int, progress: bool
) -> tuple[int, float]:
    """Translate every chunk that has no file yet, in order; returns the lines translated and the seconds spent."""
    done = 0
    while done < n_chunks and _chunk_path(work, done).is_file():
        done += 1
    if done:
        logger.info(f"synthesis: resuming after {counted(done, 'finished chunk')} of {n_chunks} in {work}")
    if done == n_chunks:
        return 0, 0.0
    first_line = done * size
    bar = progress_bar(lines.total, initial=min(first_line, lines.total), unit="line", enabled=progress)
    logger.info(f"synthesis: {teacher.name} translates {counted(lines.total, 'line')} of {lines.name}")
    start = last_log = time.time()
    translated = 0
    for index, chunk in enumerate(itertools.islice(lines.chunks(size, done), n_chunks - done), done):
        outputs = teacher.translate(chunk, index)
        rows = [
            json.dumps({"x": x, "t": o.text, "s": _rounded(o.score), "n": [o.src_len, o.out_len]}, ensure_ascii=False)
            for x, o in zip(chunk, outputs)
        ]
        try:
            write_file_atomic(_chunk_path(work, index), "".join(row + "\n" for row in rows))
        except OSError as e:  # a full disk: what is written stays, and a rerun resumes after it
            kept = f"{counted(index, 'finished chunk')} kept in {work.name}" if index else "nothing was kept"
            raise MtcliError(
                f"--out {out}: cannot write in {work.parent} ({e.strerror or error_text(e)}); {kept}: "
                "make room and run the same command again"
            ) from None
        translated += len(chunk)
        bar.update(len(chunk))
        now = time.time()
        if now - last_log > 30 or index == n_chunks - 1:
            rate = translated / (now - start)
            left = lines.total - first_line - translated
            logger.info(
                f"synthesis: {first_line + translated:,}/{lines.total:,} lines, {rate:,.1f} lines/s, "
                f"ETA {format_duration(left / rate if rate else 0)}"
            )
            last_log = now
    bar.close()
    return translated, time.time() - start


def _rounded(score: float) -> float | None:
    return None if math.isnan(score) else round(score, 6)


def _read_chunks(work: Path, n_chunks: int) -> Iterator[dict]:
    for index in range(n_chunks):
        path = _chunk_path(work, index)
        try:
            with open(path, encoding="utf-8") as f:
                yield from (json.loads(line) for line in f)
        except (OSError, ValueError) as e:
            raise MtcliError(
                f"{path}: unreadable ({e}); delete it and run again to translate that chunk anew"
            ) from None


def _write_corpus(work: Path, n_chunks: int, folder: Path, teacher, filters: Filters) -> dict:
    """The corpus files from the chunks, filtered, never the whole corpus in memory: one pass over the chunks, and a
    first one for --drop-worst (one float per line for the scores' quantile)."""
    threshold = -math.inf if filters.min_score is None else filters.min_score
    if filters.drop_worst:
        scores = np.array([row["s"] for row in _read_chunks(work, n_chunks) if row["s"] is not None])
        if len(scores):
            threshold = max(threshold, float(np.quantile(scores, filters.drop_worst, method="lower")))
    score_sum, scored = 0.0, 0
    counts = dict.fromkeys(FILTERS, 0)
    src, tgt = teacher.src_lang, teacher.tgt_lang
    names = {"source": f"train.{src}", "target": f"train.{tgt}", "scores": "train.scores"}
    with (
        open(folder / names["source"], "w", encoding="utf-8") as f_src,
        open(folder / names["target"], "w", encoding="utf-8") as f_tgt,
        open(folder / names["scores"], "w", encoding="utf-8") as f_score,
        open(folder / "dropped.tsv", "w", encoding="utf-8") as f_drop,
    ):
        f_drop.write("line\treason\tsource\ttranslation\tscore\n")
        kept = 0
        for number, row in enumerate(_read_chunks(work, n_chunks), 1):
            source, text, score, (src_len, out_len) = row["x"], row["t"], row["s"], row["n"]
            if score is not None:
                score_sum, scored = score_sum + score, scored + 1
            reason = None
            if not source or not text:
                reason = "empty"
            elif text.casefold() == source.casefold():
                reason = "copy"
            elif filters.max_ratio and max(src_len, out_len) > filters.max_ratio * max(min(src_len, out_len), 1):
                reason = "ratio"
            elif score is not None and (score < threshold or (filters.drop_worst and score <= threshold)):
                reason = "score"
            shown = "" if score is None else f"{score:.4f}"
            if reason is not None:
                counts[reason] += 1
                f_drop.write(f"{number}\t{reason}\t{source}\t{text}\t{shown}\n")
                continue
            kept += 1
            f_src.write(source + "\n")
            f_tgt.write(text + "\n")
            f_score.write((shown or "nan") + "\n")
    total = sum(counts.values()) + kept
    return {
        "lines": total,
        "kept": kept,
        "dropped": counts,
        "mean_score": round(score_sum / scored, 4) if scored else None,
        "files": names | {"dropped": "dropped.tsv"},
    }


def drop_warnings(counts: dict, filters: Filters, teacher) -> list[str]:
    """A line for each filter that dropped more than DROP_WARNING_SHARE of the lines, with what to check; not for
    --drop-worst, which drops the share it is given."""
    unit = "characters" if isinstance(teacher, HttpTeacher) else "the teacher's subwords"
    advice = {
        "copy": "the teacher copied its input: does it translate the languages asked for?",
        "ratio": f"lengths in {unit} differ more than {filters.max_ratio:g} times: where these are good translations "
        "(scripts differ in length), raise --max-ratio / distill.max_ratio (0: off)",
        "score": "lower --min-score",
    }
    warnings = []
    for reason, n in counts["dropped"].items():
        if (
            reason in advice
            and not (reason == "score" and filters.drop_worst)
            and n > DROP_WARNING_SHARE * counts["lines"]
        ):
            warnings.append(
                f"the {reason} filter dropped {n:,} of {counts['lines']:,} lines ({n / counts['lines']:.0%}; they are "
                f"in dropped.tsv): {advice[reason]}"
            )
    return warnings


def describe(report: dict, out: Path) -> str:
    dropped = ", ".join(f"{n:,} {reason}" for reason, n in report["dropped"].items() if n) or "none"
    return (
        f"synthesis: {out}: {report['kept']:,} of {report['lines']:,} pairs kept (dropped: {dropped}); "
        f"{report['sentences_per_second'] or '-'} lines/s"
    )
