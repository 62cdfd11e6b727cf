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

import concurrent.futures
import contextlib
import http.client
import itertools
import json
import math
import os
import random
import shutil
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from mtcli.checkpoint import read_config, resolve_member
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
from mtcli.translate import load_translator

COMMAND = "data synthesize"
REPORT = "synthesis.json"
FILTERS = ("empty", "copy", "ratio", "score")
# a filter dropping more than this share is said so (a ratio of 3 dropped 901 of 4,000 perfect en->zh translations)
DROP_WARNING_SHARE = 0.05
HTTP_BATCH = 32  # lines per request to an HTTP teacher (LibreTranslate's clients send one text at a time)
HTTP_PARALLEL = 4  # requests in flight, so a server that batches gets work to batch
HTTP_TIMEOUT = 120.0  # seconds one request may take as a whole (connect, send, the server's work, the answer)
HTTP_RETRIES = 5
BACKOFF_MAX = 30.0  # seconds between tries: 0.5, 1, 2, 4, ... (x 1 to 1.25, jitter), at most this
RETRY_AFTER_MAX = 60.0  # a server's Retry-After is honoured up to this
# The size an answer may have, derived from its request: a /translate answer ANSWER_FLOOR plus, per text sent,
# ANSWER_PER_LINE and ANSWER_PER_BYTE x its UTF-8 bytes; a /languages answer ANSWER_FLOOR. A teacher cannot make
# synthesis hold more than that (a 1.5 GB answer read whole ended in a MemoryError).
ANSWER_FLOOR = 1 << 20
ANSWER_PER_LINE = 4096
ANSWER_PER_BYTE = 24
ERROR_BYTES = 1 << 16  # of an error answer: only its start is shown


@dataclass(frozen=True)
class Filters:
    """What is dropped from the teacher's output; each dropped pair is counted under the first filter that drops it."""

    max_ratio: float = 3.0  # longer side / shorter side in the teacher's subwords (characters for an HTTP teacher)
    min_score: float | None = None  # teacher log-probability per subword (with EOS)
    drop_worst: float = 0.0  # share of the scored pairs with the lowest score per subword


@dataclass
class TeacherOutput:
    text: str
    score: float  # log-probability per output subword (with EOS); NaN where the teacher gives none (HTTP)
    src_len: int  # source length in the teacher's subwords (characters for an HTTP teacher)
    out_len: int  # output length, the same unit


# ---------------------------------------------------------------------------------------------------------------------
# Teachers


class ModelTeacher:
    """A run or checkpoint (with --teacher given more than once: an ensemble) translating with mtcli's search."""

    def __init__(self, paths: list[Path], overrides: list[str], device: str, **options):
        checkpoint = resolve_member(paths[0])
        self.config: Config = read_config(checkpoint)
        # split_long: a line over the positions is translated in pieces, never cut (a cut line would pair the whole
        # source with a translation of its start)
        self.translator, self.decode = load_translator(
            checkpoint, self.config, overrides, device, paths[1:], split_long=True, **options
        )
        self.src_lang, self.tgt_lang = self.config.data.src_lang, self.config.data.tgt_lang
        members = [checkpoint, *self.translator.ensemble]
        # what translates: weights and tokenizer files (a training checkpoint's state.pt changes nothing)
        self.files = [p for m in members for p in sorted(Path(m).iterdir()) if p.is_file() and p.name != "state.pt"]
        self.name = " + ".join(str(m) for m in members)

    def identity(self) -> dict:
        files = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in self.files]
        decode = asdict(self.decode) | {"precision": self.translator.precision}
        return {"kind": "model", "files": files, "decode": decode}

    def translate(self, lines: list[str], chunk: int) -> list[TeacherOutput]:
        if self.decode.sampling:  # each chunk its own stream: a resumed run samples what an uninterrupted one did
            seed = self.config.train.seed * 1_000_003 + chunk
            self.translator.generator = torch.Generator(device=self.translator.device).manual_seed(seed)
        hyps = self.translator.translate_nbest(lines, self.decode)
        src_lens = [len(ids) for ids in self.translator.source_ids(lines, self.decode)]
        out = []
        for line, best, n in zip(lines, (h[0] for h in hyps), src_lens):
            score = best.log_prob / (len(best.tokens) + 1) if line else float("nan")
            out.append(TeacherOutput(best.text, score, n, len(best.tokens)))
        return out


class HttpTeacher:
    """A server speaking LibreTranslate's API (LibreTranslate itself, or `mtcli serve`): POST /translate with a list
    of texts. Each request is bounded whole (`timeout` seconds, see fetch) and in size (answer_limit); failures and
    timeouts are retried with exponential backoff; it gives no scores."""

    def __init__(self, url: str, src_lang: str, tgt_lang: str, api_key: str | None, retries: int, timeout: float):
        self.url, self.src_lang, self.tgt_lang = url.rstrip("/"), src_lang, tgt_lang
        self.api_key, self.retries, self.timeout = api_key, retries, timeout
        address = urllib.parse.urlsplit(self.url)
        try:
            port = address.port
        except ValueError:  # a port that is not a number
            port = -1
        if address.scheme not in ("http", "https") or not address.hostname or port == -1:
            raise MtcliError(f"--teacher {url}: not an http(s) address such as http://127.0.0.1:5000")
        if not (math.isfinite(timeout) and timeout > 0):
            raise MtcliError(f"--timeout {timeout}: give the seconds one request may take, more than 0")
        if not 0 <= retries <= 100:
            raise MtcliError(f"--retries {retries}: give 0 to 100")
        self.address = address
        self.name = self.url
        self.retried = 0  # retries, for the report (requests run in threads: counted under a lock)
        self.lock = threading.Lock()
        self.check_languages()

    def identity(self) -> dict:
        return {"kind": "http", "url": self.url, "source": self.src_lang, "target": self.tgt_lang}

    def check_languages(self) -> None:
        """GET /languages: the server is reachable and translates src_lang -> tgt_lang. LibreTranslate before 1.3
        lists no `targets`: any of its languages is then taken to translate into any other."""
        offered = self.request("/languages", None, ANSWER_FLOOR)
        if not _is_language_list(offered):
            raise MtcliError(
                f"teacher {self.url}/languages: answered {_excerpt(offered)}, not a list of languages "
                '([{"code": "en", "targets": ["de", ...]}, ...]); is this a LibreTranslate server?'
            )
        codes = {item["code"] for item in offered}
        if offered and not any("targets" in item for item in offered):
            pairs = {(a, b) for a in codes for b in codes if a != b}
        else:
            pairs = {(item["code"], t) for item in offered for t in item.get("targets", [])}
        if (self.src_lang, self.tgt_lang) not in pairs:
            shown = ", ".join(f"{s}->{t}" for s, t in sorted(pairs)[:20]) or "nothing"
            raise MtcliError(
                f"teacher {self.url}: does not translate {self.src_lang}->{self.tgt_lang} (it offers {shown})"
            )

    def translate(self, lines: list[str], chunk: int) -> list[TeacherOutput]:
        todo = [line for line in lines if line]  # an empty line is not sent: its output is empty
        batches = [todo[i : i + HTTP_BATCH] for i in range(0, len(todo), HTTP_BATCH)]
        with concurrent.futures.ThreadPoolExecutor(HTTP_PARALLEL) as pool:
            futures = [pool.submit(self.translate_batch, batch) for batch in batches]
            try:
                answers = iter([t for future in futures for t in future.result()])
            except BaseException:
                for future in futures:  # the queued batches are not sent: the first failure ends the chunk
                    future.cancel()
                raise
        texts = [next(answers) if line else "" for line in lines]
        return [TeacherOutput(t, float("nan"), len(s), len(t)) for s, t in zip(lines, texts)]

    def translate_batch(self, lines: list[str]) -> list[str]:
        payload = {"q": lines, "source": self.src_lang, "target": self.tgt_lang, "format": "text"}
        if self.api_key:
            payload["api_key"] = self.api_key
        answer = self.request("/translate", payload, answer_limit(lines))
        texts = answer.get("translatedText") if isinstance(answer, dict) else None
        if not isinstance(texts, list) or len(texts) != len(lines) or not all(isinstance(t, str) for t in texts):
            raise MtcliError(
                f"teacher {self.url}/translate: answered {_excerpt(answer)}, not one text per line (translatedText)"
            )
        for line, text in zip(lines, texts):
            if not _is_unicode(text):  # JSON can carry half a surrogate pair; no file can hold it
                raise MtcliError(
                    f"teacher {self.url}/translate: its translation of {line[:60]!r} is not Unicode text (it holds "
                    "a lone surrogate); fix the server"
                )
        return [clean_line(t) for t in texts]

    def request(self, route: str, payload: dict | None, limit: int):
        """The JSON answer of GET (payload None) or POST `route`, at most `limit` bytes; connection failures,
        timeouts, 429 and 5xx are retried `retries` times with exponential backoff (Retry-After honoured); a 4xx ends
        with the server's word."""
        url = self.url + route
        body = None if payload is None else json.dumps(payload).encode()
        for attempt in range(self.retries + 1):
            wait = min(0.5 * 2**attempt, BACKOFF_MAX) * random.uniform(1.0, 1.25)  # jitter: parallel requests spread
            try:
                status, headers, data = self.fetch(route, body, limit)
            except AnswerTooLarge:
                raise MtcliError(
                    f"teacher {url}: the answer is larger than {limit:,} bytes (the most {describe_limit(payload)}); "
                    "is this a LibreTranslate server?"
                ) from None
            except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out, a bad status line
                problem = error_text(e)
            else:
                if status < 300:
                    return _parsed(url, data)
                if 300 <= status < 400:
                    moved = headers.get("Location", "another address")
                    raise MtcliError(f"teacher {url}: HTTP {status}: moved to {moved}; give that address") from None
                if status != 429 and status < 500:
                    raise MtcliError(f"teacher {url}: HTTP {status}: {_error_text(data)}") from None
                problem = f"HTTP {status}"
                wait = max(wait, _retry_after(headers))
            if attempt == self.retries:
                tries = "1 try" if self.retries == 0 else f"{self.retries + 1} tries"
                raise MtcliError(
                    f"teacher {url}: unreachable after {tries} ({problem}); check the address (a slow server: raise "
                    "--timeout)"
                ) from None
            with self.lock:
                self.retried += 1
            logger.warning(f"teacher {url}: {problem}; retrying in {wait:.1f} s")
            time.sleep(wait)

    def fetch(self, route: str, body: bytes | None, limit: int) -> tuple[int, http.client.HTTPMessage, bytes]:
        """One request: (status, headers, the answer's bytes, an error's cut at ERROR_BYTES). It takes at most
        `timeout` seconds as a whole: a socket's timeout bounds each read, so a server sending a byte a second would
        never time out; a timer shuts the socket down at the deadline instead, which ends any read in progress."""
        a = self.address
        connection_class = http.client.HTTPSConnection if a.scheme == "https" else http.client.HTTPConnection
        connection = connection_class(a.hostname, a.port, timeout=self.timeout)
        expired = threading.Event()
        # the socket, held here: the connection lets go of it when an answer ends with the connection
        sockets: list[socket.socket] = []

        def expire():
            expired.set()
            for sock in sockets:  # none yet: still connecting (checked after connect)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        timer = threading.Timer(self.timeout, expire)
        timer.daemon = True
        timer.start()
        try:
            connection.connect()
            sockets.append(connection.sock)
            if expired.is_set():
                raise TimeoutError
            headers = {"Content-Type": "application/json"} if body is not None else {}
            path = a.path + route + (f"?{a.query}" if a.query else "")
            connection.request("GET" if body is None else "POST", path, body, headers)
            response = connection.getresponse()
            ok = response.status < 300
            data = _read_capped(response, limit if ok else ERROR_BYTES, refuse=ok)
            if expired.is_set():  # the shutdown reads as the end of the answer
                raise TimeoutError
            return response.status, response.headers, data
        except (OSError, http.client.HTTPException):
            if expired.is_set():
                raise TimeoutError(f"no complete answer within {self.timeout:g} s") from None
            raise
        finally:
            timer.cancel()
            connection.close()


class AnswerTooLarge(Exception):
    """A teacher's answer past the size its request allows (answer_limit)."""


def answer_limit(lines: list[str]) -> int:
    """The most bytes a /translate answer to `lines` may have: room for translations several times longer than their
    sources with every character escaped by JSON (a Chinese character as \\uXXXX: 6 bytes)."""
    return ANSWER_FLOOR + sum(ANSWER_PER_LINE + ANSWER_PER_BYTE * len(line.encode("utf-8")) for line in lines)


def describe_limit(payload: dict | None) -> str:
    if payload is None:
        return "a list of languages may have"
    n = len(payload["q"])
    return (
        f"{counted(n, 'line')} may get: {ANSWER_FLOOR >> 20} MiB + {ANSWER_PER_LINE:,} bytes a line + "
        f"{ANSWER_PER_BYTE} per byte sent"
    )


def _read_capped(response: http.client.HTTPResponse, limit: int, refuse: bool) -> bytes:
    """The body, read as it arrives (never more than `limit` bytes and one piece in memory): past the limit,
    AnswerTooLarge when `refuse`, else the first `limit` bytes (an error page, only shown in part)."""
    declared = response.getheader("Content-Length", "")
    if refuse and declared.isdigit() and int(declared) > limit:
        raise AnswerTooLarge
    data = bytearray()
    while piece := response.read1(1 << 16):
        data += piece
        if len(data) > limit:
            if refuse:
                raise AnswerTooLarge
            return bytes(data[:limit])
    if response.length:  # the connection ended before the length it declared
        raise http.client.IncompleteRead(bytes(data), response.length)
    return bytes(data)


def _parsed(url: str, data: bytes):
    try:
        return json.loads(data)
    except RecursionError:  # [[[[...: Python's parser recurses once per level
        raise MtcliError(f"teacher {url}: the answer is nested too deep to be LibreTranslate's JSON") from None
    except ValueError:  # not JSON, or not UTF-8
        raise MtcliError(f"teacher {url}: the answer is not JSON; is this a LibreTranslate server?") from None


def _is_language_list(offered) -> bool:
    def is_language(item) -> bool:
        targets = item.get("targets", []) if isinstance(item, dict) else None
        return (
            isinstance(item, dict)
            and isinstance(item.get("code"), str)
            and isinstance(targets, list)
            and all(isinstance(t, str) for t in targets)
        )

    return isinstance(offered, list) and all(is_language(item) for item in offered)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _excerpt(answer) -> str:
    """A parsed answer as one short line (ASCII: it may hold what no terminal can print)."""
    try:
        return json.dumps(answer)[:200]
    except RecursionError:  # as deep as the parser could go: too deep to show from here
        return "a structure nested too deep to show"


def _error_text(data: bytes) -> str:
    """What an error answer says: LibreTranslate's {"error": ...}, else the start of the page."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        body = data.decode("utf-8", "replace")
    text = body.get("error", body) if isinstance(body, dict) else body
    if not isinstance(text, str) or not _is_unicode(text):
        text = _excerpt(text)
    return " ".join(text.split())[:300] or "error"


def _retry_after(headers) -> float:
    try:
        seconds = float(headers.get("Retry-After", 0))
    except (TypeError, ValueError):
        return 0.0
    return min(seconds, RETRY_AFTER_MAX) if math.isfinite(seconds) and seconds > 0 else 0.0


def is_url(teacher: str | Path) -> bool:
    return str(teacher).startswith(("http://", "https://"))


def open_teacher(
    teachers: list[str],
    langs: tuple[str | None, str | None] = (None, None),
    overrides: list[str] | tuple[str, ...] = (),
    device: str = "auto",
    api_key: str | None = None,
    retries: int = HTTP_RETRIES,
    timeout: float = HTTP_TIMEOUT,
    **options,
):
    """A ModelTeacher for runs or checkpoint folders (several: an ensemble), an HttpTeacher for one URL. `langs`:
    the language pair an HTTP teacher is asked for (a model teacher knows its own)."""
    if not teachers:
        raise MtcliError("--teacher: give a run, a checkpoint folder or a LibreTranslate URL")
    if any(is_url(t) for t in teachers):
        if len(teachers) > 1:
            raise MtcliError("--teacher: an HTTP teacher cannot be part of an ensemble; give one URL")
        if None in langs:
            raise MtcliError(f"--teacher {teachers[0]}: an HTTP teacher needs --src-lang and --tgt-lang")
        if overrides or any(v is not None for v in options.values()):
            raise MtcliError(f"--teacher {teachers[0]}: the server chooses its own decode settings; drop them")
        return HttpTeacher(teachers[0], langs[0], langs[1], api_key, retries, timeout)
    for path in teachers:
        if not Path(path).exists():
            raise MtcliError(f"--teacher {path}: no such run directory or checkpoint folder")
    teacher = ModelTeacher([Path(t) for t in teachers], list(overrides), device, **options)
    for given, own, side in zip(langs, (teacher.src_lang, teacher.tgt_lang), ("source", "target")):
        if given is not None and given != own:
            raise MtcliError(
                f"--teacher {teachers[0]}: translates {teacher.src_lang}->{teacher.tgt_lang}; the {side} language "
                f"asked for is {given}"
            )
    return teacher


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
    cache_dir.mkdir(parents=True, exist_ok=True)
    sources = open_sources(data, cache_dir)
    if role not in sources:
        raise MtcliError(f"--split {role}: the config's data has no {role} split (data.splits.{role})")
    split = sources[role]
    side = 0 if lang == data.src_lang else 1

    def chunks(size: int, first: int) -> Iterator[list[str]]:
        for start in range(first * size, split.num_rows, size):
            pair = split._read(split._dataset, range(start, min(start + size, split.num_rows)))
            yield [clean_line(x) for x in pair[side]]

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
