"""The model worker behind `mtcli serve`, and the server's counters (shown at /metrics in Prometheus' text format).

The main thread owns the Translator (Worker.run). Requests wait in a queue bounded by sentences; the worker takes
the first, then whatever else arrives, for at most max_wait and until a batch's worth of source subwords is
gathered. It stops early after a gap of GAP seconds without a new request, unless requests outside the batch are
still being read or answered: a client that has just had its answer usually sends its next request at once, and
without this wait concurrent clients split into groups that take turns in part-filled batches (64 clients, beam 5:
35 sentences a batch, against 60 with it). A lone client waits for nothing but the gap. Requests with the same
decode settings are translated as one list by Translator.translate_nbest, which sorts them by length and cuts
token-budget batches; each request gets its own sentences back, in order. A request whose client gave up (timeout,
disconnect) before its batch started is skipped.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass

from mtcli.config import DecodeConfig
from mtcli.log import logger

GAP = 0.002  # seconds without a new request that end the gathering of a batch (see above)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"retry after {retry_after} s")
        self.retry_after = retry_after


class Dropped(Exception):
    """A queued request not translated because the server is stopping at once (a second stop signal)."""


@dataclass(eq=False)
class Job:
    """One request's sentences; its future is resolved on the event loop that made it."""

    sentences: list[str]
    decode: DecodeConfig
    tokens: int  # source subwords (with EOS), for the batch budget
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    cancelled: bool = False  # set by the request handler when its client is gone: skipped if not started

    def finish(self, result=None, error: BaseException | None = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self._resolve, result, error)
        except RuntimeError:  # the event loop has ended (HTTP stopped without waiting): nobody to answer
            pass

    def _resolve(self, result, error) -> None:
        if self.future.done():  # the handler stopped waiting (timeout or disconnect)
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)


class Metrics:
    """Counters shared by the event loop and the worker thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter = Counter()  # (route, status) -> answered requests
        self.latency: dict[str, list[float]] = {}  # route -> [bucket counts..., +Inf count, sum of seconds]
        self.accepted = 0  # requests that reached the application
        self.open = 0  # requests in the application now: being read, queued, translated or answered
        self.sentences = self.batches = 0
        self.model_seconds = 0.0

    def arrived(self) -> None:
        with self.lock:
            self.accepted += 1
            self.open += 1

    def request(self, route: str, status: int, seconds: float) -> None:
        """A request answered (status 0: ended without an answer)."""
        with self.lock:
            self.open -= 1
            self.requests[route, status] += 1
            hist = self.latency.setdefault(route, [0.0] * (len(LATENCY_BUCKETS) + 2))
            for i, bound in enumerate(LATENCY_BUCKETS):
                hist[i] += seconds <= bound
            hist[-2] += 1
            hist[-1] += seconds

    @property
    def answered(self) -> int:
        with self.lock:
            return sum(n for (_, status), n in self.requests.items() if status)

    def batch(self, sentences: int, seconds: float) -> None:
        with self.lock:
            self.sentences += sentences
            self.batches += 1
            self.model_seconds += seconds

    def render(self, queued: int, queue_size: int) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        with self.lock:
            lines = ["# HELP mtcli_requests_total HTTP requests answered, by route and status."]
            lines += ["# TYPE mtcli_requests_total counter"]
            for (route, status), n in sorted(self.requests.items()):
                lines.append(f'mtcli_requests_total{{route="{route}",status="{status}"}} {n}')
            lines += ["# HELP mtcli_request_seconds Time from a request's arrival to its answer."]
            lines += ["# TYPE mtcli_request_seconds histogram"]
            for route, hist in sorted(self.latency.items()):
                for bound, n in zip(LATENCY_BUCKETS, hist):
                    lines.append(f'mtcli_request_seconds_bucket{{route="{route}",le="{bound}"}} {int(n)}')
                lines.append(f'mtcli_request_seconds_bucket{{route="{route}",le="+Inf"}} {int(hist[-2])}')
                lines.append(f'mtcli_request_seconds_sum{{route="{route}"}} {hist[-1]:.6f}')
                lines.append(f'mtcli_request_seconds_count{{route="{route}"}} {int(hist[-2])}')
            for name, kind, value, help_text in (
                ("mtcli_sentences_total", "counter", self.sentences, "Sentences translated."),
                ("mtcli_batches_total", "counter", self.batches, "Batches the model worker translated."),
                ("mtcli_model_seconds_total", "counter", round(self.model_seconds, 6), "Time spent translating."),
                ("mtcli_queue_sentences", "gauge", queued, "Sentences waiting for the model."),
                ("mtcli_queue_limit_sentences", "gauge", queue_size, "The queue's bound (--queue-size)."),
            ):
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(lines) + "\n"


class Worker:
    def __init__(self, translator, queue_size: int, max_wait: float, metrics: Metrics):
        self.translator, self.queue_size, self.max_wait, self.metrics = translator, queue_size, max_wait, metrics
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.queued = 0  # sentences submitted and not yet taken into a batch
        self.rate = 0.0  # sentences per second of recent batches (a moving average), for Retry-After
        self.dropping = False  # set by a second stop signal: queued requests are answered Dropped

    def stop(self) -> None:
        """run() returns once what is queued now is translated."""
        self.jobs.put(None)

    def retry_after(self) -> int:
        """Seconds until the queue has likely drained, at the recent rate: 1 to 60."""
        return int(min(60, max(1, math.ceil(self.queued / self.rate) if self.rate else 1)))

    def submit(self, sentences: list[str], decode: DecodeConfig, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a request's sentences; QueueFull (with a Retry-After estimate) when they do not fit."""
        with self.lock:
            if self.queued + len(sentences) > self.queue_size:
                raise QueueFull(self.retry_after())
            self.queued += len(sentences)
        tokens = sum(len(ids) + 1 for ids in self.translator.source_ids(sentences))
        job = Job(sentences, decode, tokens, loop, loop.create_future())
        self.jobs.put(job)
        return job

    def run(self) -> None:
        """Translate batches of queued requests until stop()."""
        while True:
            first = self.jobs.get()
            if first is None:
                return
            jobs, stop = self._gather(first)
            self._translate(jobs)
            if stop:
                return

    def _gather(self, first: Job) -> tuple[list[Job], bool]:
        """`first` and the requests that follow it closely (see above), within max_wait and the token budget."""
        jobs, tokens, stop = [first], first.tokens, False
        deadline = time.monotonic() + self.max_wait
        while tokens < first.decode.batch_tokens:
            left = deadline - time.monotonic()
            try:
                job = self.jobs.get(timeout=min(GAP, left)) if left > 0 else self.jobs.get_nowait()
            except queue.Empty:
                if left > 0 and self.metrics.open > len(jobs):  # others are being read or answered: wait on
                    continue
                break
            if job is None:  # stop() was called: this batch is the last
                stop = True
                break
            jobs.append(job)
            tokens += job.tokens
        with self.lock:
            self.queued -= sum(len(job.sentences) for job in jobs)
        return jobs, stop

    def _translate(self, jobs: list[Job]) -> None:
        groups: dict[DecodeConfig, list[Job]] = {}
        for job in jobs:
            if self.dropping:
                job.finish(error=Dropped("the server is stopping; this request was not translated"))
            elif not job.cancelled:
                groups.setdefault(job.decode, []).append(job)
        for decode, group in groups.items():
            sentences = [s for job in group for s in job.sentences]
            start = time.perf_counter()
            try:
                hyps = self.translator.translate_nbest(sentences, decode)
            except Exception as e:  # noqa: BLE001 - a failed batch answers its requests with an error; others go on
                logger.exception(f"translation of a batch of {len(sentences)} sentences failed")
                for job in group:
                    job.finish(error=e)
                continue
            seconds = time.perf_counter() - start
            self.metrics.batch(len(sentences), seconds)
            rate = len(sentences) / max(seconds, 1e-6)
            self.rate = rate if not self.rate else 0.8 * self.rate + 0.2 * rate
            results = iter(hyps)
            for job in group:
                job.finish([next(results) for _ in job.sentences])
