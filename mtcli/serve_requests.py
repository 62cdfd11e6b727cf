"""What `mtcli serve` accepts: its limits, and the reading and checking of a request's body and fields.

Every function here either returns clean values or raises HTTPError with a status and one line for the client:
400 for a body or field that cannot be read (malformed JSON, wrong types, bytes that are not UTF-8, a lone
surrogate, an unknown language), 401 for a missing or wrong API key, 408 for a body that does not arrive in time,
413 for a body, text or request over a limit (the message names the option that sets it), 422 for a well-formed
value the server will not take (a beam over --max-beam, a length penalty of 1e308). A value from the client is
quoted in a message only cut short (`shown`), so no answer grows with what was sent.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mtcli.config import DecodeConfig
from mtcli.errors import MtcliError
from mtcli.glossary import Glossary, add_pair

if TYPE_CHECKING:
    from starlette.requests import Request

SURROGATE = re.compile("[\ud800-\udfff]")
DRAIN_LIMIT = 16 << 20  # an over-limit body is read (and dropped) up to this size, so its sender gets the 413
NATIVE_OPTIONS = {  # the decode settings a /v1/translate request may set, with their JSON types
    "beam": int,
    "nbest": int,
    "lenpen": float,
    "length_norm": str,
    "early_stopping": bool,
    "max_len_a": float,
    "max_len_b": int,
    "min_len": int,
    "no_repeat_ngram": int,
    "sampling": bool,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "constraints": str,
}
NATIVE_FIELDS = {"texts", "format", "split_sentences", "api_key", "glossary", "alignments", *NATIVE_OPTIONS}
# Where decoding stays well-defined, with a wide margin: past them, scores and probabilities overflow or underflow (on
# the toy model a length penalty of 1,000 overflowed, temperature 1e308 and top_p 1e-300 left no token to sample;
# 500, 1e30 and 1e-40 still worked)
DECODE_RANGES = {"lenpen": (0.0, 10.0), "temperature": (0.01, 100.0), "top_p": (1e-6, 1.0)}


@dataclass(frozen=True)
class ServeLimits:
    max_body_bytes: int = 1 << 20
    max_sentences: int = 512  # per request, after cutting paragraphs into sentences
    max_chars: int = 20_000  # per text
    queue_size: int = 4096  # sentences waiting for the model
    timeout: float = 60.0  # seconds from a request's arrival to its answer
    max_wait_ms: float = 40.0  # the longest the first request of a batch waits for others
    max_beam: int = 16
    api_keys: frozenset[str] = frozenset()
    max_tokens: int = 16_384  # source subwords per request, after cutting and tokenizing
    max_glossary: int = 1000  # pairs in a request's glossary
    body_timeout: float = 10.0  # seconds for a request's body to arrive (at most timeout)

    def __post_init__(self):
        for flag, value in (
            ("--max-body-bytes", self.max_body_bytes),
            ("--max-sentences", self.max_sentences),
            ("--max-chars", self.max_chars),
            ("--queue-size", self.queue_size),
            ("--timeout", self.timeout),
            ("--max-beam", self.max_beam),
            ("--max-tokens", self.max_tokens),
            ("--max-glossary", self.max_glossary),
            ("--body-timeout", self.body_timeout),
        ):
            if not 0 < value < math.inf:  # also refuses NaN
                raise MtcliError(f"{flag} must be a positive finite number, not {value}")
        if not 0 <= self.max_wait_ms < math.inf:
            raise MtcliError(f"--max-wait-ms must be a finite number >= 0, not {self.max_wait_ms}")
        if self.max_sentences > self.queue_size:
            raise MtcliError(
                f"--max-sentences ({self.max_sentences}) cannot exceed --queue-size ({self.queue_size}): such a "
                "request could never be queued; lower --max-sentences too"
            )


def read_api_keys(path: Path | None) -> frozenset[str]:
    """One key per line; blank lines and lines starting with # are skipped. No file: no keys (open access)."""
    if path is None:
        return frozenset()
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise MtcliError(f"--api-keys {path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    keys = frozenset(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise MtcliError(f"--api-keys {path}: no keys in the file (one per line)")
    return keys


class HTTPError(Exception):
    """An answer other than 200: its status, one line for {"error": ...}, and headers such as Retry-After."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


def shown(text: str, limit: int = 40) -> str:
    """A value from the client, for an error message: at most `limit` characters."""
    return text if len(text) <= limit else text[:limit] + "..."


def listed(names: list[str], limit: int = 10) -> str:
    """Names for an error message: at most `limit` of them, then how many more."""
    head = ", ".join(shown(name) for name in names[:limit])
    return head if len(names) <= limit else f"{head} and {len(names) - limit:,} more"


def json_type(value) -> str:
    if isinstance(value, float) and not math.isfinite(value):  # JSON's NaN and Infinity (1e999 too) parse to these
        return "NaN" if math.isnan(value) else f"{'-' if value < 0 else ''}Infinity"
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return names.get(type(value), "null")


def typed(name: str, value, kind: type):
    """`value` if it has the JSON type `kind` (int: not a boolean; float: any finite number), else a 400 that says
    what was sent (NaN and Infinity by name)."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is str:
        ok = isinstance(value, str)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            raise HTTPError(400, f"{name}: must be a finite number, got {json_type(value)}")
    if not ok:
        expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
        # a number is named as sent: "expected an integer, got a number" would say nothing for 2.5
        got = shown(repr(value)) if isinstance(value, float) and math.isfinite(value) else json_type(value)
        raise HTTPError(400, f"{name}: expected {expected}, got {got}")
    return value


async def read_fields(request: Request, limits: ServeLimits, stopping: asyncio.Event) -> dict:
    """The body as a dict: JSON, or a urlencoded form (LibreTranslate takes both). Over-limit, non-UTF-8 or
    malformed bodies end here with a 413 or 400; a body that has not arrived within limits.body_timeout (or
    limits.timeout, if shorter) with a 408, and one still arriving when the server starts to stop with a 503: a
    slow sender holds neither a connection nor the shutdown."""
    wait = min(limits.body_timeout, limits.timeout)
    reading = asyncio.ensure_future(read_body(request, limits.max_body_bytes))
    stopped = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({reading, stopped}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        arrived = reading.done()
        if not arrived:
            reading.cancel()
    if not arrived:
        close = {"Connection": "close"}  # the rest of the body would be read as the next request
        if stopping.is_set():
            raise HTTPError(
                503, "the server is stopping; the request body had not arrived", {"Retry-After": "5", **close}
            )
        raise HTTPError(408, f"the request body did not arrive within {wait:g} s", close)
    return parse_body(request, reading.result())


async def read_body(request: Request, limit: int) -> bytes:
    """The body's bytes; a 413 when it is over `limit`, a 499 when the client leaves before it is sent."""
    from starlette.requests import ClientDisconnect  # here: starlette comes with the serve extra

    declared = request.headers.get("content-length", "")
    too_big = HTTPError(413, f"the request body is over the limit of {limit:,} bytes (--max-body-bytes)")
    expects_continue = "100-continue" in request.headers.get("expect", "").lower()
    if declared.isdigit() and int(declared) > limit and (expects_continue or int(declared) > DRAIN_LIMIT):
        raise too_big  # answered before the body is sent (or too big to read through)
    body, size = bytearray(), 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > DRAIN_LIMIT:
                break
            if size <= limit:
                body += chunk
    except ClientDisconnect:
        raise HTTPError(499, "the client closed the connection") from None
    if size > limit:
        raise too_big
    return bytes(body)


def parse_body(request: Request, body: bytes) -> dict:
    """JSON or a urlencoded form, as a dict of fields."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"byte {body[e.start]:#04x} at offset {e.start}"
        raise HTTPError(400, f"the request body is not UTF-8 ({where})") from None
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    # curl -d sends JSON labelled as a form; a form body never starts with { or [, so such a body is read as JSON
    if kind == "application/x-www-form-urlencoded" and not text.lstrip().startswith(("{", "[")):
        try:  # q may repeat: a list of texts
            form = urllib.parse.parse_qs(text, keep_blank_values=True, errors="strict")
        except UnicodeDecodeError:
            raise HTTPError(400, "the form holds a percent-encoded value that is not UTF-8") from None
        return {key: values if key == "q" and len(values) > 1 else values[-1] for key, values in form.items()}
    if kind.startswith("multipart/"):
        raise HTTPError(400, "multipart bodies are not supported; send JSON or a urlencoded form")
    if not text.strip():
        raise HTTPError(400, 'the request body is empty; send JSON such as {"q": "Hello", "target": "..."}')
    try:
        fields = json.loads(text)
    except RecursionError:
        raise HTTPError(400, "the JSON body is nested too deeply") from None
    except ValueError as e:
        raise HTTPError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(fields, dict):
        raise HTTPError(400, f"the JSON body must be an object, not {json_type(fields)}")
    surrogate = lone_surrogate(fields)
    if surrogate is not None:
        where = f"\\u{ord(surrogate):04x}"
        raise HTTPError(400, f"the JSON body holds a lone surrogate ({where}), which is not a character")
    return fields


def lone_surrogate(value) -> str | None:
    """The first lone surrogate in a parsed JSON value's strings (keys too): JSON's \\ud800 escapes give them, and
    no tokenizer or UTF-8 encoder takes them. Iterative: the JSON may be nested as deep as the parser allows."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                found = SURROGATE.search(item)
                if found:
                    return found[0]
        elif isinstance(item, dict):
            stack += item.keys()
            stack += item.values()
        elif isinstance(item, list):
            stack += item
    return None


def check_key(request: Request, fields: dict, keys: frozenset[str]) -> None:
    """Nothing when no keys are configured or a valid one is given (the api_key field, or a Bearer token)."""
    if not keys:
        return
    key = fields.get("api_key")
    auth = request.headers.get("authorization", "")
    if not key and auth[:7].lower() == "bearer ":
        key = auth[7:].strip()
    # surrogatepass: a key that is no valid text is a wrong key (a 401), not an encoding error
    given = key.encode("utf-8", "surrogatepass") if isinstance(key, str) else None
    valid = given is not None and any(hmac.compare_digest(given, k.encode()) for k in keys)
    if not valid:
        message = "a valid API key is required (the api_key field or an Authorization: Bearer header)"
        raise HTTPError(401, message, {"WWW-Authenticate": "Bearer"})


def read_texts(fields: dict, name: str, limits: ServeLimits) -> tuple[list[str], bool]:
    """The texts to translate, and whether a single string was given (answered with a single string)."""
    value = fields.get(name)
    if value is None or value == [] or value == "":
        raise HTTPError(400, f"missing {name} parameter: the text(s) to translate")
    if isinstance(value, str):
        value, single = [value], True
    elif isinstance(value, list) and all(isinstance(t, str) for t in value):
        single = False
    else:
        raise HTTPError(400, f"{name}: expected a string or a list of strings, got {json_type(value)}")
    if len(value) > limits.max_sentences:
        raise HTTPError(
            413, f"{len(value):,} texts; the limit is {limits.max_sentences:,} per request (--max-sentences)"
        )
    for i, text in enumerate(value):
        if len(text) > limits.max_chars:
            limit = f"the limit is {limits.max_chars:,} per text (--max-chars)"
            raise HTTPError(413, f"{name}[{i}] has {len(text):,} characters; {limit}")
        if "\x00" in text:
            raise HTTPError(400, f"{name}[{i}] contains a NUL character")
    return value, single


def language(value, lang: str, pair: str, auto: bool = False) -> str:
    """A language code that names this model's `lang` (a regional variant such as en-US does; "auto" where
    `auto`), as given; missing: `lang`. Else the 400 LibreTranslate answers."""
    if value is None or value == "":
        return "auto" if auto else lang
    if not isinstance(value, str):
        raise HTTPError(400, f"a language code must be a string, not {json_type(value)}")
    code = value.strip().lower().replace("_", "-")
    if auto and code == "auto":
        return code
    if code.split("-")[0] != lang.lower().split("-")[0]:
        raise HTTPError(400, f"{shown(value)} is not supported: this server translates {pair}")
    return code


def text_format(value) -> str:
    if value in (None, "", "text", "html"):
        return value or "text"
    if not isinstance(value, str):
        raise HTTPError(400, f"format: expected a string (text or html), got {json_type(value)}")
    raise HTTPError(400, f"{shown(value)} format is not supported (text or html)")


def read_alternatives(value, limits: ServeLimits) -> int:
    """LibreTranslate's alternatives: a number (or a numeric string, as forms send), at most max_beam - 1."""
    if value is None or value == "":
        return 0
    # ASCII digits only, and few: int() also reads "²"-like digits (and fails on them) and refuses 5,000 digits
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,9}", value.strip()):
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise HTTPError(400, "alternatives parameter is not a number")
    if value > limits.max_beam - 1:
        raise HTTPError(422, f"alternatives {shown(str(value))} is over this server's limit of {limits.max_beam - 1}")
    return max(value, 0)


def read_glossary(value, limits: ServeLimits) -> Glossary | None:
    """A request's own glossary: a list of [source term, target term] pairs, at most --max-glossary of them, each
    checked as a glossary file's line is (the request's `glossary[i]` named in the error)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise HTTPError(400, f"glossary: expected a list of [source term, target term] pairs, got {json_type(value)}")
    if len(value) > limits.max_glossary:
        raise HTTPError(
            413, f"glossary: {len(value):,} pairs; the limit is {limits.max_glossary:,} per request (--max-glossary)"
        )
    glossary = Glossary()
    for i, pair in enumerate(value):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise HTTPError(400, f"glossary[{i}]: expected [source term, target term] (two strings)")
        if len(pair[0]) + len(pair[1]) > limits.max_chars:
            raise HTTPError(413, f"glossary[{i}]: longer than a text may be (--max-chars {limits.max_chars:,})")
        try:
            add_pair(glossary, pair[0].strip(), pair[1].strip(), f"glossary[{i}]")
        except MtcliError as e:
            raise HTTPError(400, str(e)) from None
    return glossary


def decode_options(fields: dict, decode: DecodeConfig, limits: ServeLimits, positions: int) -> DecodeConfig:
    """The server's decode settings with the request's own applied, as `mtcli translate --beam ...` would."""
    values = {key: typed(key, fields[key], kind) for key, kind in NATIVE_OPTIONS.items() if key in fields}
    if values.get("beam", 0) > limits.max_beam:
        raise HTTPError(422, f"beam {shown(str(values['beam']))} is over this server's limit of {limits.max_beam}")
    for key in ("max_len_a", "max_len_b"):  # no output is longer than the positions anyway
        if key in values:
            values[key] = min(values[key], positions)
    for key, (low, high) in DECODE_RANGES.items():
        if key in values and not low <= values[key] <= high:
            raise HTTPError(422, f"{key}: must be between {low:g} and {high:g}, not {shown(str(values[key]))}")
    try:
        return decode.with_options(**values)
    except MtcliError as e:
        raise HTTPError(422, str(e).removeprefix("decode.")) from None
