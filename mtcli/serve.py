"""`mtcli serve`: a trained model behind HTTP, on FastAPI and uvicorn (the `serve` extra).

Routes: POST /translate and GET /languages speak LibreTranslate's API, so its clients (Mastodon and others) work
unchanged; POST /v1/translate takes every decode setting and returns scores and n-best lists; GET /health, GET
/metrics (Prometheus text) and GET / (a page to try the model). Each request is read and checked here (size
limits, types, API keys; every error is JSON {"error": "one line"}), cut into sentences (mtcli.segment) and handed
to the model worker (mtcli.serve_worker), which batches the requests that arrive together and shares its batches
fairly between them. SIGTERM drains: uvicorn stops accepting connections, every accepted request is answered (one
whose body is still arriving with a 503 at once), and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
import threading
import time
from dataclasses import replace
from importlib import resources

from mtcli.config import DecodeConfig
from mtcli.errors import MtcliError
from mtcli.glossary import MARKERS
from mtcli.line_io import format_links
from mtcli.log import counted, logger
from mtcli.segment import Segments, join, split_html, split_text
from mtcli.serve_requests import (
    NATIVE_FIELDS,
    NATIVE_OPTIONS,
    HTTPError,
    ServeLimits,
    check_key,
    decode_options,
    language,
    listed,
    read_alternatives,
    read_fields,
    read_glossary,
    read_texts,
    shown,
    text_format,
    typed,
)
from mtcli.serve_worker import Dropped, QueueFull, ServerCounters, Worker
from mtcli.tokenizer import word_separator
from mtcli.translate import combine_nbest, split_long

try:
    import sentencex  # noqa: F401 - mtcli.segment imports it where it cuts sentences
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError as e:
    raise MtcliError(f"mtcli serve needs the serve extra ({e.name} is missing): pip install 'mtcli[serve]'") from None

ROUTES = ("/", "/translate", "/languages", "/v1/translate", "/health", "/metrics")
LANGUAGE_NAMES = {
    "ar": "Arabic", "cs": "Czech", "de": "German", "en": "English", "es": "Spanish", "fr": "French", "it": "Italian",
    "ja": "Japanese", "ko": "Korean", "nl": "Dutch", "pl": "Polish", "pt": "Portuguese", "ru": "Russian",
    "tr": "Turkish", "uk": "Ukrainian", "zh": "Chinese",
}  # fmt: skip
MAX_MESSAGE = 1000  # characters of an error message, whatever it quotes
CONTROL = re.compile("[\x00-\x1f\x7f]")


class Server:
    """The routes, over one Translator and its model worker."""

    def __init__(self, translator, decode: DecodeConfig, limits: ServeLimits):
        # no beam (or alternatives + 1) wider than the target vocabulary: the search keeps that many best tokens
        limits = replace(limits, max_beam=min(limits.max_beam, translator.tokenizer.tgt_vocab_size))
        self.translator, self.decode, self.limits = translator, decode, limits
        self.src, self.tgt = translator.config.data.src_lang, translator.config.data.tgt_lang
        self.metrics = ServerCounters()
        self.worker = Worker(translator, limits.queue_size, limits.max_wait_ms / 1000, self.metrics)
        self.page = resources.files("mtcli").joinpath("static/index.html").read_text(encoding="utf-8")
        self.loop: asyncio.AbstractEventLoop | None = None  # uvicorn's, once it has started
        self.stopping = asyncio.Event()  # set at the first stop signal: bodies still arriving are not waited for

    def app(self) -> Accounting:
        # No docs pages or OpenAPI schema (the pages load from a CDN); no redirects to a slash-less path, which
        # would be built from the client's Host header
        app = FastAPI(title="mtcli", docs_url=None, redoc_url=None, openapi_url=None, lifespan=self.lifespan)
        app.router.redirect_slashes = False
        read = ["GET", "HEAD"]
        app.add_api_route("/", self.index, methods=read, response_class=HTMLResponse)
        app.add_api_route("/translate", self.libre_translate, methods=["POST"])
        app.add_api_route("/languages", self.languages, methods=read)
        app.add_api_route("/v1/translate", self.native_translate, methods=["POST"])
        app.add_api_route("/health", self.health, methods=read)
        app.add_api_route("/metrics", self.render_metrics, methods=read, response_class=PlainTextResponse)
        app.add_exception_handler(HTTPError, error_response)
        app.add_exception_handler(StarletteHTTPException, http_exception)
        app.add_exception_handler(Exception, internal_error)
        return Accounting(app, self.metrics)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.loop = asyncio.get_running_loop()
        yield

    def stop_reading(self) -> None:
        """Answer requests whose body is still arriving with a 503 now (called from the stop signal's handler)."""
        try:
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self.stopping.set)
        except RuntimeError:  # the loop has closed: nothing is being read
            pass

    # -----------------------------------------------------------------------------------------------------------------
    # Routes

    async def index(self) -> HTMLResponse:
        return HTMLResponse(self.page)

    async def languages(self) -> list[dict]:
        return [{"code": self.src, "name": LANGUAGE_NAMES.get(self.src, self.src), "targets": [self.tgt]}]

    async def health(self) -> dict:
        t, busy = self.translator, self.worker.status()
        return {
            "status": "ok",
            "model": {
                "source": self.src,
                "target": self.tgt,
                "checkpoint": str(t.checkpoint) if t.checkpoint else None,  # as given: run folder included
                "ensemble": len(t.ensemble) + 1,
                "precision": t.precision,
            },
            # what is busy: a 503 with an empty queue means the batch in progress holds the model
            "queue": {**busy["queue"], "limit": self.limits.queue_size},
            "batch": busy["batch"],
            "api_key_required": bool(self.limits.api_keys),
        }

    async def render_metrics(self) -> PlainTextResponse:
        text = self.metrics.render(self.worker.queued, self.limits.queue_size)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def libre_translate(self, request: Request) -> JSONResponse:
        """LibreTranslate's /translate: q (a string or a list), source (or auto), target, format, alternatives."""
        fields = await self.read_checked(request)
        texts, single = read_texts(fields, "q", self.limits)
        source = language(fields.get("source"), self.src, f"{self.src} to {self.tgt}", auto=True)
        language(fields.get("target"), self.tgt, f"{self.src} to {self.tgt}")
        n = read_alternatives(fields.get("alternatives"), self.limits)
        decode = replace(self.decode, beam=max(self.decode.beam, n + 1), nbest=n + 1) if n else self.decode
        glossary = self.read_glossary(fields)
        self.check_constraints(decode, glossary, texts)
        results = await self.translate_texts(request, texts, decode, text_format(fields.get("format")), True, glossary)
        best = [hyps[0].text for hyps in results]
        answer: dict = {"translatedText": best[0] if single else best}
        if n:
            alternatives = [[h.text for h in hyps[1:]] for hyps in results]
            answer["alternatives"] = alternatives[0] if single else alternatives
        if source == "auto":  # no detection: the model reads one language, so that is what it was given
            detected = {"confidence": 100.0, "language": self.src}
            answer["detectedLanguage"] = detected if single else [detected] * len(texts)
        return JSONResponse(answer)

    async def native_translate(self, request: Request) -> JSONResponse:
        """texts, any decode setting in NATIVE_OPTIONS, format, split_sentences -> translations with scores."""
        fields = await self.read_checked(request)
        unknown = set(fields) - NATIVE_FIELDS
        if unknown:
            known = ", ".join(sorted(NATIVE_FIELDS))
            raise HTTPError(422, f"unknown field(s) {listed(sorted(unknown))}; known: {known}")
        texts, _ = read_texts(fields, "texts", self.limits)
        fmt = text_format(fields.get("format"))
        split = typed("split_sentences", fields.get("split_sentences", True), bool)
        if fmt == "html" and not split:
            raise HTTPError(422, "split_sentences: false applies to format text only")
        decode = decode_options(fields, self.decode, self.limits, self.translator.config.model.max_positions)
        glossary = self.read_glossary(fields)
        self.check_constraints(decode, glossary, texts)
        alignments = typed("alignments", fields.get("alignments", False), bool)
        if alignments and fmt == "html":
            raise HTTPError(422, "alignments: for format text only (HTML's words include its markup)")
        results = await self.translate_texts(request, texts, decode, fmt, split, glossary, alignments)
        translations = []
        for hyps in results:
            item = {"text": hyps[0].text, "score": hyps[0].score, "log_prob": hyps[0].log_prob}
            if alignments:
                item["alignment"] = format_links(hyps[0].alignment or [])
            if decode.nbest > 1:
                item["nbest"] = [{"text": h.text, "score": h.score, "log_prob": h.log_prob} for h in hyps]
                if alignments:
                    for entry, h in zip(item["nbest"], hyps):
                        entry["alignment"] = format_links(h.alignment or [])
            translations.append(item)
        settings = {key: getattr(decode, key) for key in NATIVE_OPTIONS}
        return JSONResponse({"translations": translations, "source": self.src, "target": self.tgt, "decode": settings})

    # -----------------------------------------------------------------------------------------------------------------
    # Reading and translating

    async def read_checked(self, request: Request) -> dict:
        """The request's fields, once its body is read and its API key (where keys are configured) checked."""
        self.metrics.receiving += 1  # the worker does not wait for requests whose body is still arriving
        try:
            fields = await read_fields(request, self.limits, self.stopping)
        finally:
            self.metrics.receiving -= 1
        check_key(request, fields, self.limits.api_keys)
        return fields

    def cut(self, text: str, fmt: str, split: bool) -> Segments:
        if fmt == "html":
            return split_html(text, self.src)
        return split_text(text, self.src) if split else Segments([text], ["", ""])

    async def translate_texts(
        self,
        request: Request,
        texts: list[str],
        decode: DecodeConfig,
        fmt: str,
        split: bool,
        glossary=None,
        alignments: bool = False,
    ):
        """Each text's n-best list (one entry without nbest): cut into sentences, a sentence longer than the
        positions into pieces that fit (as `mtcli translate --split-long` does), the pieces translated by the
        worker (with the request's glossary, else the server's), and all joined back. `alignments`: each
        translation's word alignment, as Translation.alignment (words of the whole text, sentences one after
        another)."""
        segments = [self.cut(text, fmt, split) for text in texts]
        # HTML: a model trained to align puts inline elements back by its word alignments; for another, each inline
        # element's text is translated too, to find its words in the sentence's translation
        by_links = fmt == "html" and self.translator.guided_alignment
        mark_texts = [[] if by_links else s.mark_texts() for s in segments]
        sentences = [piece for s, marks in zip(segments, mark_texts) for piece in [*s.pieces, *marks]]
        self.check_count(len(sentences), "sentences")
        t = self.translator
        ids = t.source_ids(sentences, decode)  # one call for all: a 1 MiB body takes a tenth of a second or so
        tokens = sum(len(x) + 1 for x in ids)  # with EOS, as the model reads them
        if tokens > self.limits.max_tokens:
            limit = f"the limit is {self.limits.max_tokens:,} per request (--max-tokens)"
            raise HTTPError(413, f"the texts hold {tokens:,} source subwords; {limit}")
        cut, lengths = [], []
        for sentence, sentence_ids in zip(sentences, ids):
            if len(sentence_ids) <= t.max_src_tokens:
                cut.append([sentence])
                lengths.append(len(sentence_ids) + 1)
            else:
                cut.append(split_long(t.tokenizer, sentence, t.max_src_tokens))
                lengths += [len(x) + 1 for x in t.source_ids(cut[-1], decode)]
        pieces = [piece for parts in cut for piece in parts]
        self.check_count(len(pieces), "sentences and pieces of long ones")
        aligned = alignments or by_links
        hyps = iter(await self.run(request, pieces, lengths, decode, glossary, aligned) if pieces else [])
        sep = word_separator(self.tgt)
        whole = iter([combine_nbest([next(hyps) for _ in parts], sep.join) for parts in cut])
        results = []
        for s, texts in zip(segments, mark_texts):
            pieces = [next(whole) for _ in s.pieces]
            marks = [next(whole)[0].text for _ in texts]
            links = [hyps[0].alignment for hyps in pieces] if by_links else None
            results.append(combine_nbest(pieces, lambda t, s=s, m=marks, a=links: join(s, t, self.tgt, m, a)))
        return results

    def read_glossary(self, fields: dict):
        """The request's own glossary (None: the server's), its terms checked against the model's positions."""
        glossary = read_glossary(fields.get("glossary"), self.limits)
        if glossary is not None:
            try:
                self.translator.check_terms(glossary)
            except MtcliError as e:
                raise HTTPError(400, str(e)) from None
        return glossary

    def check_constraints(self, decode: DecodeConfig, glossary, texts: list[str]) -> None:
        """A glossary in effect (the request's, else the server's) that this search cannot apply: 422."""
        in_effect = glossary or self.translator.glossary
        if not in_effect:
            return
        if decode.sampling and decode.constraints == "hard" and any(map(in_effect.matches, texts)):
            raise HTTPError(422, "sampling cannot write a glossary's terms (beam search does): set constraints off")
        if decode.constraints == "soft" and not self.translator.tokenizer.has_source_symbols(MARKERS):
            raise HTTPError(422, "constraints soft needs a model trained with data.terminology; use hard")

    def check_count(self, count: int, what: str) -> None:
        if count > self.limits.max_sentences:
            limit = f"the limit is {self.limits.max_sentences:,} per request (--max-sentences)"
            raise HTTPError(413, f"the texts hold {count:,} {what}; {limit}")

    async def run(
        self,
        request: Request,
        sentences: list[str],
        lengths: list[int],
        decode: DecodeConfig,
        glossary=None,
        alignments: bool = False,
    ) -> list:
        """The worker's n-best lists for `sentences`; a 503 (with Retry-After) when the queue is full or the
        request's time runs out. Whatever ends the wait, what is left of the job leaves the queue."""
        try:
            job = self.worker.submit(sentences, lengths, decode, asyncio.get_running_loop(), glossary, alignments)
        except QueueFull as e:
            queued, size = self.worker.queued, self.limits.queue_size
            busy = f"the server is busy ({queued:,} sentences queued, --queue-size {size})"
            raise HTTPError(503, f"{busy}; retry in {e.retry_after} s", {"Retry-After": str(e.retry_after)}) from None
        gone = asyncio.ensure_future(client_gone(request))
        remaining = request.scope["mtcli.start"] + self.limits.timeout - time.monotonic()
        try:
            await asyncio.wait({job.future, gone}, timeout=max(remaining, 0), return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this task is cancelled (uvicorn gave up on the drain)
            disconnected = gone.done()
            gone.cancel()
            if not job.future.done():
                self.worker.withdraw(job)
                job.future.cancel()
        if not job.future.cancelled():
            error = job.future.exception()
            if isinstance(error, Dropped):
                raise HTTPError(503, str(error), {"Retry-After": "5"})
            if error is not None:  # the traceback is in the log; the client learns only that it was not its fault
                raise HTTPError(500, "translation failed: a server error (see the server's log)")
            return job.future.result()
        if disconnected:
            raise HTTPError(499, "the client closed the connection")
        retry = str(self.worker.retry_after())
        raise HTTPError(503, f"not answered within {self.limits.timeout:g} s (--timeout)", {"Retry-After": retry})


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects: with the body read, the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def one_line(message: str) -> str:
    """An error message as sent: at most MAX_MESSAGE characters, one line and encodable whatever it quotes (a path
    may hold a %0A, a JSON string a lone surrogate)."""
    message = message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE] + "..."
    message = CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", message)
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


async def error_response(request: Request, exc: HTTPError) -> JSONResponse:
    return JSONResponse({"error": one_line(exc.message)}, exc.status, headers=exc.headers)


async def http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and wrong methods, in the same {"error": ...} shape."""
    message = f"{exc.detail}: {request.method} {shown(request.url.path, 200)}"
    return JSONResponse({"error": one_line(message)}, exc.status_code, headers=exc.headers)


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug: the client learns only that; uvicorn logs the traceback."""
    return JSONResponse({"error": "internal server error (see the server's log)"}, 500)


class JSONErrorProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol (httptools), but a request it cannot parse gets the API's JSON error, not text."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps({"error": "the request is not valid HTTP/1.1"}).encode()
        head = [b"HTTP/1.1 400 Bad Request"]
        head += [name + b": " + value for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json", b"content-length: %d" % len(body), b"connection: close"]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        self.transport.close()


class Accounting:
    """ASGI wrapper around the app: every request is counted and timed (/metrics, the summary at exit) and its
    arrival noted, which its timeout counts from."""

    def __init__(self, app, metrics: ServerCounters):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = scope["mtcli.start"] = time.monotonic()
        self.metrics.arrived()
        status = 0

        async def send_noting_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.request(route, status, time.monotonic() - start)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free port, chosen by the kernel)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on such sockets, and without it a keep-alive
        # client waits 40 ms (delayed ACK) for each answer sent in two writes
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        raise MtcliError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    return sock


def serve(translator, decode: DecodeConfig, limits: ServeLimits, host: str = "127.0.0.1", port: int = 5000) -> None:
    """Serve `translator` until SIGTERM or Ctrl-C, then answer every accepted request and return.

    The model runs on the main thread and HTTP (uvicorn's event loop) on another: torch's OpenMP ops launched from a
    thread other than the main one ran about 2x slower (docs/serve.md)."""
    if not 0 <= port <= 65535:  # the socket module would wrap 70000 around to 4464
        raise MtcliError(f"--port must be between 0 and 65535, not {port}")
    server = Server(translator, decode, limits)
    sock = listen(host, port)
    config = uvicorn.Config(
        server.app(),
        http=JSONErrorProtocol,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(limits.timeout) + 5,  # requests time out before this; a backstop
    )
    http = uvicorn.Server(config)

    def serve_http() -> None:
        try:
            http.run(sockets=[sock])  # off the main thread, uvicorn leaves the signals to us
        finally:
            server.worker.stop()  # after the drain: the model loop ends once the queue is empty

    def stop(signum, frame) -> None:
        if http.should_exit:  # a second signal: queued requests are answered 503 instead of translated
            server.worker.dropping = True
        http.should_exit = True  # stop accepting, answer what was accepted, then end
        server.stop_reading()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    thread = threading.Thread(target=serve_http, name="mtcli-http")
    thread.start()
    url_host = f"[{host}]" if ":" in host else host
    logger.info(
        f"serving {server.src}->{server.tgt} at http://{url_host}:{sock.getsockname()[1]}/ "
        f"(precision {translator.precision}, beam {decode.beam}); SIGTERM or Ctrl-C stops after answering"
    )
    try:
        server.worker.run()
    finally:
        thread.join()
        m = server.metrics
        accepted, sentences = counted(m.accepted, "accepted request"), counted(m.sentences, "sentence")
        logger.info(f"stopped: answered {m.answered:,} of {accepted}, {sentences}")
    if not http.started:
        raise MtcliError(f"the HTTP server on {host}:{port} did not start (see the messages above)")
