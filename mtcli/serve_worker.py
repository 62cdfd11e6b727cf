"""The model worker behind `mtcli serve`, and the server's counters (shown at /metrics in Prometheus' text format).

The main thread owns the Translator (Worker.run). Requests wait in a queue bounded by sentences; each sentence is
already cut to fit the model's positions and counted in source subwords. A batch holds at most decode.batch_tokens
subwords (at least one sentence), shared fairly: first each waiting request, in order of arrival, gets up to an
equal share of them (at least one sentence), then what is left goes to them in order of arrival. So a big request
is spread over several batches, and a small one that arrives meanwhile waits only for the batch in progress.

Before a batch starts the worker waits for more requests, for at most max_wait and until a batch's worth of
subwords is queued. It stops early after a gap of GAP seconds without a new request, unless requests outside the
queue are still being cut or answered: a client that has just had its answer usually sends its next request at
once, and without this wait concurrent clients split into groups that take turns in part-filled batches (64
clients, beam 5: 35 sentences a batch, against 60 with it). Requests whose body is still arriving do not count, so
a slow uploader does not hold up everyone's batches. A lone client waits for nothing but the gap.

The sentences of a batch with the same decode settings are cut into the model batches Translator.translate_nbest
would cut them into (longest first, decode.batch_tokens and decode.batch_sentences), and the worker translates
those one at a time; each request gets its own sentences back, in order. When one fails, each request's part of it
is translated alone, so a sentence that breaks the model fails only its own request. A request whose client gave
up (timeout, disconnect) or whose part failed leaves the queue at once, and its sentences in model batches not yet
begun are skipped: work nobody waits for must not hold up the next requests. A model batch that has begun runs to
its end (the search has no way to stop midway).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from mtcli.batching import translation_batches
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


class TranslationFailed(Exception):
    """The model failed on a request's sentences (the traceback is in the server's log)."""


@dataclass(eq=False)
class Job:
    """One request's sentences; its future is resolved on the event loop that made it."""

    sentences: list[str]
    lengths: list[int]  # source subwords of each sentence (with EOS), for the batch budget
    decode: DecodeConfig
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    taken: int = 0  # sentences handed to batches so far; the rest wait in the queue
    results: list = field(init=False)  # each sentence's n-best list (None until translated)
    translated: int = 0  # sentences with results (changed by the worker thread only)
    cancelled: bool = False  # its client is gone or a part failed: nothing more of it is translated
    glossary: object = None  # the request's own glossary (a mtcli.glossary.Glossary), else the server's
    alignments: bool = False  # its translations need word alignments (Translation.alignment)

    def __post_init__(self):
        self.results = [None] * len(self.sentences)

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


class ServerCounters:
    """Counters shared by the event loop and the worker thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter = Counter()  # (route, status) -> answered requests
        self.latency: dict[str, list[float]] = {}  # route -> [bucket counts..., +Inf count, sum of seconds]
        self.accepted = 0  # requests that reached the application
        self.open = 0  # requests in the application now: being read, queued, translated or answered
        self.receiving = 0  # of those, requests whose body is still arriving (changed on the event loop only)
        self.sentences = self.batches = 0
        self.skipped = 0  # sentences not translated: their request was answered (timeout, disconnect) or failed
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

    def skip(self, sentences: int) -> None:
        with self.lock:
            self.skipped += sentences

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
                ("mtcli_batches_total", "counter", self.batches, "Model batches the worker translated."),
                ("mtcli_skipped_sentences_total", "counter", self.skipped, "Sentences skipped: nobody waited."),
                ("mtcli_model_seconds_total", "counter", round(self.model_seconds, 6), "Time spent translating."),
                ("mtcli_queue_sentences", "gauge", queued, "Sentences waiting for the model."),
                ("mtcli_queue_limit_sentences", "gauge", queue_size, "The queue's bound (--queue-size)."),
            ):
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(lines) + "\n"


class Worker:
    def __init__(self, translator, queue_size: int, max_wait: float, metrics: ServerCounters):
        self.translator, self.queue_size, self.max_wait, self.metrics = translator, queue_size, max_wait, metrics
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # a job arrived, or stop() was called
        self.waiting: deque[Job] = deque()  # jobs with sentences not yet taken into a batch, in order of arrival
        self.queued = 0  # their sentences not yet taken (what --queue-size bounds)
        self.queued_tokens = 0  # and those sentences' subwords
        self.arrivals = 0  # jobs submitted so far: tells the gathering wait that one came
        self.stopping = False
        self.rate = 0.0  # sentences per second of recent batches (a moving average), for Retry-After
        self.dropping = False  # set by a second stop signal: queued requests are answered Dropped
        # the batch in progress, for /health: its parts, when it began, its sentences translated and skipped so far
        self.running: list[tuple[Job, int, int]] = []
        self.running_since = 0.0
        self.running_translated = self.running_skipped = 0

    def stop(self) -> None:
        """run() returns once what is queued now is translated."""
        with self.changed:
            self.stopping = True
            self.changed.notify()

    def retry_after(self) -> int:
        """Seconds until the queue has likely drained, at the recent rate: 1 to 60."""
        return int(min(60, max(1, math.ceil(self.queued / self.rate) if self.rate else 1)))

    def status(self) -> dict:
        """What is busy, for /health: the queue, and the batch in progress (None when idle)."""
        with self.lock:
            queue = {"sentences": self.queued, "requests": len(self.waiting)}
            if not self.running:
                return {"queue": queue, "batch": None}
            jobs = {job for job, _, _ in self.running}
            batch = {
                "requests": len(jobs),
                "cancelled": sum(job.cancelled for job in jobs),  # answered already: the rest of them is skipped
                "sentences": sum(end - start for _, start, end in self.running),
                "translated": self.running_translated,
                "skipped": self.running_skipped,
                "seconds": round(time.monotonic() - self.running_since, 3),
            }
        return {"queue": queue, "batch": batch}

    def submit(
        self,
        sentences: list[str],
        lengths: list[int],
        decode: DecodeConfig,
        loop: asyncio.AbstractEventLoop,
        glossary=None,
        alignments: bool = False,
    ) -> Job:
        """Queue a request's sentences (their lengths in source subwords) and its own glossary, if any; QueueFull
        (with a Retry-After estimate) when they do not fit. `alignments`: translate with word alignments."""
        job = Job(sentences, lengths, decode, loop, loop.create_future(), glossary=glossary, alignments=alignments)
        with self.changed:
            if self.queued + len(sentences) > self.queue_size:
                raise QueueFull(self.retry_after())
            self.waiting.append(job)
            self.queued += len(sentences)
            self.queued_tokens += sum(lengths)
            self.arrivals += 1
            self.changed.notify()
        return job

    def withdraw(self, job: Job) -> None:
        """Nothing more of `job` is translated: its sentences still queued leave the queue."""
        with self.lock:
            job.cancelled = True
            if job in self.waiting:
                self.waiting.remove(job)
                self.queued -= len(job.sentences) - job.taken
                self.queued_tokens -= sum(job.lengths[job.taken :])

    def run(self) -> None:
        """Translate batches of queued requests until stop()."""
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._translate(batch)

    def _next_batch(self) -> list[tuple[Job, int, int]] | None:
        """The next batch, gathered as the module's docstring says: (job, start, end) for each job's sentences in
        it. None once stop() was called and nothing is queued."""
        with self.changed:
            while not self.waiting:
                if self.stopping:
                    return None
                self.changed.wait()
            budget = self.waiting[0].decode.batch_tokens
            deadline = time.monotonic() + self.max_wait
            while self.queued_tokens < budget and not self.stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                seen = self.arrivals
                self.changed.wait(min(GAP, left))
                outside = self.metrics.open - self.metrics.receiving - len(self.waiting)  # being cut or answered
                if self.arrivals == seen and outside <= 0:
                    break
            if self.dropping:
                dropped, self.waiting = list(self.waiting), deque()
                self.queued = self.queued_tokens = 0
            else:
                return self._take(budget)
        for job in dropped:
            job.finish(error=Dropped("the server is stopping; this request was not translated"))
        return []

    def _take(self, budget: int) -> list[tuple[Job, int, int]]:
        """Up to `budget` subwords of the waiting jobs' sentences (at least one sentence): first up to an equal share
        for each job in order of arrival, then what is left in order of arrival. Called with the lock held."""
        jobs = list(self.waiting)
        if not jobs:  # all withdrawn while the batch was gathered
            return []
        ends = [job.taken for job in jobs]
        share, used = budget // len(jobs), 0
        for fair in (True, False):
            for i, job in enumerate(jobs):
                mine = 0
                while ends[i] < len(job.sentences) and used < budget:
                    n = job.lengths[ends[i]]
                    if (used and used + n > budget) or (fair and mine and mine + n > share):
                        break
                    ends[i] += 1
                    used += n
                    mine += n
        batch = []
        for job, end in zip(jobs, ends):
            if end > job.taken:
                batch.append((job, job.taken, end))
                self.queued -= end - job.taken
                self.queued_tokens -= sum(job.lengths[job.taken : end])
                job.taken = end
        self.waiting = deque(job for job in jobs if job.taken < len(job.sentences))
        return batch

    def _translate(self, batch: list[tuple[Job, int, int]]) -> None:
        """Each decode group's model batches in turn; before each, the sentences of requests given up are dropped."""
        with self.lock:
            self.running, self.running_since = batch, time.monotonic()
            self.running_translated = self.running_skipped = 0
        groups: dict[DecodeConfig, list[tuple[Job, int]]] = {}
        for job, start, end in batch:
            groups.setdefault(job.decode, []).extend((job, i) for i in range(start, end))
        try:
            for decode, items in groups.items():
                for chunk in model_batches(items, decode):
                    # read without the lock: a request given up meanwhile costs at most this model batch
                    live = [(job, i) for job, i in chunk if not job.cancelled]
                    self._skipped(len(chunk) - len(live))
                    if live:
                        self._translate_chunk(live, decode)
        finally:
            with self.lock:
                self.running = []

    def _translate_chunk(self, items: list[tuple[Job, int]], decode: DecodeConfig) -> None:
        try:
            self._translate_items(items, decode)
            return
        except Exception:  # noqa: BLE001 - below, each request alone: the failure is its own or a bug for all
            jobs = list(dict.fromkeys(job for job, _ in items))
            if len(jobs) == 1:
                self._fail(jobs[0])
                return
            logger.warning(f"a batch of {len(jobs)} requests failed; translating each alone")
        for job in jobs:  # one bad sentence must not fail the requests batched with it
            mine = [(j, i) for j, i in items if j is job]
            if job.cancelled:
                self._skipped(len(mine))
                continue
            try:
                self._translate_items(mine, decode)
            except Exception:  # noqa: BLE001 - answered 500, logged; the others go on
                self._fail(job)

    def _translate_items(self, items: list[tuple[Job, int]], decode: DecodeConfig) -> None:
        sentences = [job.sentences[i] for job, i in items]
        options = {}
        if any(job.glossary is not None for job, _ in items):  # each sentence its request's glossary, else the server's
            options["glossary"] = [job.glossary or self.translator.glossary for job, _ in items]
        if any(job.alignments for job, _ in items):  # for all of the batch: one more decoder pass either way
            options["alignments"] = True
        start_time = time.perf_counter()
        hyps = self.translator.translate_nbest(sentences, decode, **options)  # long sentences were cut before queueing
        seconds = time.perf_counter() - start_time
        self.metrics.batch(len(sentences), seconds)
        rate = len(sentences) / max(seconds, 1e-6)
        self.rate = rate if not self.rate else 0.8 * self.rate + 0.2 * rate
        with self.lock:
            self.running_translated += len(sentences)
        for (job, i), h in zip(items, hyps):
            job.results[i] = h
            job.translated += 1
            if job.translated == len(job.sentences):
                job.finish(job.results)

    def _skipped(self, count: int) -> None:
        if count:
            self.metrics.skip(count)
            with self.lock:
                self.running_skipped += count

    def _fail(self, job: Job) -> None:
        """Called in an except block: the traceback goes to the log, the request gets a bare error."""
        logger.exception(f"translation failed for a request of {len(job.sentences)} sentences")
        self.withdraw(job)
        job.finish(error=TranslationFailed())


def model_batches(items: list[tuple[Job, int]], decode: DecodeConfig) -> list[list[tuple[Job, int]]]:
    """(job, sentence index) items cut as Translator.translate_nbest cuts one list of them (batching's
    translation_batches, on the lengths the server measured as translate does: source subwords with EOS). Each batch
    keeps the items' own order; translate_nbest sorts it back the same way, so a batch translated alone is the model
    batch it would have been in one call for all."""
    lengths = np.array([job.lengths[i] for job, i in items], dtype=np.int64)
    batches = translation_batches(lengths, decode.batch_tokens, decode.batch_sentences)
    return [[items[k] for k in sorted(batch.tolist())] for batch in batches]
