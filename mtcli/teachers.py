"""Teachers: what translates text for a synthetic corpus (synthetic.py) and for distillation's scores (distill.py).

- ModelTeacher: a run or checkpoint folder (several: an ensemble) translating with mtcli's own search, with scores.
- HttpTeacher: any server speaking LibreTranslate's API (LibreTranslate itself, or `mtcli serve`): POST /translate
  with a list of texts, requests in parallel, failures retried with backoff. It is a stranger on the network, so
  every request has a deadline for the whole exchange and its answer a size derived from what was asked, and every
  answer is checked for shape before it is used.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import http.client
import json
import math
import random
import socket
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mtcli.checkpoint import read_config, resolve_member
from mtcli.clean import clean_line
from mtcli.config import Config
from mtcli.errors import MtcliError, error_text
from mtcli.log import counted, logger
from mtcli.translate import load_translator

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

    def __init__(self, paths: list[Path], overrides: list[str], device: str, glossary: Path | None = None, **options):
        checkpoint = resolve_member(paths[0])
        self.config: Config = read_config(checkpoint)
        # split_long: a line over the positions is translated in pieces, never cut (a cut line would pair the whole
        # source with a translation of its start)
        self.translator, self.decode = load_translator(
            checkpoint, self.config, overrides, device, paths[1:], split_long=True, glossary=glossary, **options
        )
        # a glossary changes the translations: its content is part of what identifies them
        self.glossary_hash = hashlib.sha256(Path(glossary).read_bytes()).hexdigest() if glossary else None
        self.src_lang, self.tgt_lang = self.config.data.src_lang, self.config.data.tgt_lang
        members = [checkpoint, *self.translator.ensemble]
        # what translates: weights and tokenizer files (a training checkpoint's state.pt changes nothing)
        self.files = [p for m in members for p in sorted(Path(m).iterdir()) if p.is_file() and p.name != "state.pt"]
        self.name = " + ".join(str(m) for m in members)

    def identity(self) -> dict:
        files = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in self.files]
        decode = asdict(self.decode) | {"precision": self.translator.precision}
        identity = {"kind": "model", "files": files, "decode": decode}
        return identity | ({"glossary": self.glossary_hash} if self.glossary_hash else {})

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
    glossary: Path | None = None,
    **options,
):
    """A ModelTeacher for runs or checkpoint folders (several: an ensemble), an HttpTeacher for one URL. `langs`:
    the language pair an HTTP teacher is asked for (a model teacher knows its own). `glossary`: a glossary file the
    model teacher's translations follow (decode.constraints)."""
    if not teachers:
        raise MtcliError("--teacher: give a run, a checkpoint folder or a LibreTranslate URL")
    if any(is_url(t) for t in teachers):
        if glossary is not None:
            raise MtcliError(
                f"--teacher {teachers[0]}: LibreTranslate's API has no glossary; --glossary needs a model teacher"
            )
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
    teacher = ModelTeacher([Path(t) for t in teachers], list(overrides), device, glossary, **options)
    for given, own, side in zip(langs, (teacher.src_lang, teacher.tgt_lang), ("source", "target")):
        if given is not None and given != own:
            raise MtcliError(
                f"--teacher {teachers[0]}: translates {teacher.src_lang}->{teacher.tgt_lang}; the {side} language "
                f"asked for is {given}"
            )
    return teacher
