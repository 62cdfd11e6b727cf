"""The model worker behind `mtcli serve`, and the server's counters (shown at /metrics in Prometheus' text format).

The main thread owns the Translator (Worker.run). Requests wait in a queue bounded by sentences; each sentence is
already cut to fit the model's positions and counted in source subwords.

Greedy and beam search run as continuous batches (mtcli.stream), one per set of decode settings: a waiting sentence
joins the running batch at its next decoder step, and each sentence is answered as soon as its own search ends. A
request is answered when its last sentence is. The batch holds at most decode.batch_tokens source subwords (and
decode.batch_sentences sentences, when set); what joins is shared fairly: first each waiting request, in order of
arrival, gets up to an equal share of the room (at least one sentence when the batch is empty), then what is left
goes to them in order of arrival. So a big request is spread over many steps, and a small one that arrives meanwhile
joins beside it. With 64 clients, beam 5 (2 cores of an Intel Xeon): 91% of offline `mtcli translate` throughput,
where whole batches (below) gave 72%.

Sampling and ensembles translate whole batches through Translator.translate_nbest, which sorts them by length and
cuts token-budget batches. Before such a batch starts (and only while no continuous batch runs) the worker waits for
more requests, for at most max_wait and until a batch's worth of subwords is queued. It stops early after a gap of
GAP seconds without a new request, unless requests outside the queue are still being cut or answered: a client that
has just had its answer usually sends its next request at once, and without this wait concurrent clients split into
groups that take turns in part-filled batches. Requests whose body is still arriving do not count, so a slow
uploader does not hold up everyone's batches. A lone client waits for nothing but the gap.

Failures stay with their request: when sentences of several requests fail to join a batch, each request's part
joins alone; when a decoder step fails, each request in that batch is translated again alone, whole-batch; a part
that fails alone fails its request (500), the others go on. A request whose client gave up (timeout, disconnect) or
whose part failed leaves the queue at once; its sentences already in a running batch finish unanswered.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from mtcli.config import DecodeConfig
from mtcli.log import logger
from mtcli.stream import Stream

GAP = 0.002  # seconds without a new request that end the gathering of a batch (see above)
# A running continuous batch takes newcomers once they are an eighth of it, or the first has waited JOIN_WAIT: each
# join runs the encoder once, and a join for every sentence cost more than the steps it saved.
JOIN_SHARE, JOIN_WAIT = 8, 0.02
KEPT_STREAMS = 4  # continuous batches kept when empty, with their buffers, for the next sentences with their settings
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
    arrived: float = field(default_factory=time.monotonic)
    taken: int = 0  # sentences handed to batches so far; the rest wait in the queue
    results: list = field(default_factory=list)  # each sentence's n-best list, None until it is translated
    answered: int = 0  # sentences translated so far
    cancelled: bool = False  # its client is gone or a part failed: nothing more of it is translated

    def __post_init__(self):
        self.results = [None] * len(self.sentences)

    def translated(self, index: int, hyps) -> None:
        """Sentence `index` is translated; the request is answered with its last one."""
        if self.results[index] is None:
            self.answered += 1
        self.results[index] = hyps
        if self.answered == len(self.sentences) and not self.cancelled:
            self.finish(self.results)

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
        self.steps = self.step_sentences = 0  # continuous batches: decoder steps, and live sentences summed over them
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

    def step(self, live: int, ended: int, seconds: float) -> None:
        """A continuous batch's decoder step over `live` sentences, `ended` of which were done after it."""
        with self.lock:
            self.sentences += ended
            self.steps += 1
            self.step_sentences += live
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
                ("mtcli_batches_total", "counter", self.batches, "Whole batches translated (sampling, ensembles)."),
                ("mtcli_decoder_steps_total", "counter", self.steps, "Decoder steps of continuous batches."),
                ("mtcli_step_sentences_total", "counter", self.step_sentences, "Sentences in them, step by step."),
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
        self.rate_window = [0, 0.0]  # sentences and seconds of continuous steps not yet in `rate`
        self.dropping = False  # set by a second stop signal: queued requests are answered Dropped
        # The worker thread's own: a continuous batch per decode settings (kept when empty: KEPT_STREAMS), and
        # whether settings can run as one (Translator.stream), decided once per settings.
        self.streams: dict[DecodeConfig, Stream] = {}
        self.streamable: dict[DecodeConfig, bool] = {}
        self.live = 0  # sentences in the continuous batches

    def stop(self) -> None:
        """run() returns once what is queued now is translated."""
        with self.changed:
            self.stopping = True
            self.changed.notify()

    def retry_after(self) -> int:
        """Seconds until the queue has likely drained, at the recent rate: 1 to 60."""
        return int(min(60, max(1, math.ceil(self.queued / self.rate) if self.rate else 1)))

    def submit(
        self, sentences: list[str], lengths: list[int], decode: DecodeConfig, loop: asyncio.AbstractEventLoop
    ) -> Job:
        """Queue a request's sentences (their lengths in source subwords); QueueFull (with a Retry-After estimate)
        when they do not fit."""
        job = Job(sentences, lengths, decode, loop, loop.create_future())
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
        """Translate queued requests until stop(): each round, waiting sentences join the continuous batches (or
        make a whole batch), then every continuous batch takes one decoder step."""
        while True:
            work = self._next_work()
            if work is None:
                return
            joining, batch = work
            for decode, parts in joining.items():
                self._join(decode, parts)
            if batch:
                self._translate(batch)
            self._step()

    def _is_streamable(self, decode: DecodeConfig) -> bool:
        if decode not in self.streamable:
            self.streamable[decode] = self.translator.stream(decode) is not None
            if len(self.streamable) > 64:  # settings of past requests: forget the oldest
                del self.streamable[next(iter(self.streamable))]
        return self.streamable[decode]

    def _next_work(self) -> tuple[dict, list] | None:
        """What this round does: ({decode: parts joining its continuous batch}, whole batch), parts being (job,
        start, end) for each job's sentences; None once stop() was called and nothing is queued or running."""
        with self.changed:
            while not self.waiting and not self.live:
                if self.stopping:
                    return None
                self.changed.wait()
            if self.dropping:
                dropped, self.waiting = list(self.waiting), deque()
                self.queued = self.queued_tokens = 0
            else:
                dropped = []
                if self.waiting and not self.live and not self._is_streamable(self.waiting[0].decode):
                    self._gather(self.waiting[0].decode.batch_tokens)
                joining: dict[DecodeConfig, list] = {}
                now = time.monotonic()
                for decode in dict.fromkeys(job.decode for job in self.waiting):  # in order of first arrival
                    if not self._is_streamable(decode):
                        continue
                    stream = self.streams.get(decode)
                    live = len(stream) if stream is not None else 0
                    jobs = [job for job in self.waiting if job.decode == decode]
                    newcomers = sum(len(job.sentences) - job.taken for job in jobs)
                    if live and newcomers < live / JOIN_SHARE and now - jobs[0].arrived < JOIN_WAIT:
                        continue  # not worth an encoder call yet
                    room = decode.batch_tokens - (stream.source_tokens if live else 0)
                    seats = decode.batch_sentences - live if decode.batch_sentences else None
                    parts = self._take(room, decode, seats, at_least_one=not live)
                    if parts:
                        joining[decode] = parts
                first_whole = next((job for job in self.waiting if not self._is_streamable(job.decode)), None)
                batch = self._take(first_whole.decode.batch_tokens, None) if first_whole else []
                return joining, batch
        for job in dropped:
            job.finish(error=Dropped("the server is stopping; this request was not translated"))
        return {}, []

    def _gather(self, budget: int) -> None:
        """The whole-batch path's wait for more requests (see the module's docstring). Called with the lock held."""
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

    def _take(
        self, budget: int, decode: DecodeConfig | None, seats: int | None = None, at_least_one: bool = True
    ) -> list[tuple[Job, int, int]]:
        """Up to `budget` subwords (and `seats` sentences) of the sentences of waiting jobs (those with `decode`, else
        those that cannot join a continuous batch): first up to an equal share for each job in order of arrival,
        then what is left in order of arrival; at_least_one: one sentence even over the budget. Called with the lock
        held."""
        if decode is None:
            jobs = [job for job in self.waiting if not self._is_streamable(job.decode)]
        else:
            jobs = [job for job in self.waiting if job.decode == decode]
        if not jobs or (seats is not None and seats <= 0):
            return []
        ends = [job.taken for job in jobs]
        share, used, count = budget // len(jobs), 0, 0
        for fair in (True, False):
            for i, job in enumerate(jobs):
                mine = 0
                while ends[i] < len(job.sentences) and (seats is None or count < seats):
                    n = job.lengths[ends[i]]
                    if ((used or not at_least_one) and used + n > budget) or (fair and mine and mine + n > share):
                        break
                    ends[i] += 1
                    used += n
                    mine += n
                    count += 1
        batch = []
        for job, end in zip(jobs, ends):
            if end > job.taken:
                batch.append((job, job.taken, end))
                self.queued -= end - job.taken
                self.queued_tokens -= sum(job.lengths[job.taken : end])
                job.taken = end
        self.waiting = deque(job for job in self.waiting if job.taken < len(job.sentences))
        return batch

    # -----------------------------------------------------------------------------------------------------------------
    # Continuous batches

    def _join(self, decode: DecodeConfig, parts: list[tuple[Job, int, int]]) -> None:
        """The parts' sentences join the continuous batch for `decode` (made when none runs)."""
        stream = self.streams.get(decode)
        stream = self.translator.stream(decode) if stream is None else stream
        before = len(stream)
        try:
            self._join_parts(stream, parts)
        except Exception:  # noqa: BLE001 - below, each request alone: the failure is its own or a bug for all
            if len(parts) == 1:
                self._fail(parts[0][0])
            else:
                logger.warning(f"{len(parts)} requests failed to join a batch; each joins alone")
                for part in parts:
                    try:
                        self._join_parts(stream, [part])
                    except Exception:  # noqa: BLE001 - answered 500, logged; the others go on
                        self._fail(part[0])
        self.live += len(stream) - before
        if len(stream):
            self.streams[decode] = stream

    def _join_parts(self, stream: Stream, parts: list[tuple[Job, int, int]]) -> None:
        lines = [s for job, start, end in parts for s in job.sentences[start:end]]
        tags = [(job, i) for job, start, end in parts for i in range(start, end)]
        for (job, i), hyps in self.translator.join(stream, lines, tags):  # empty lines: answered at once
            job.translated(i, hyps)

    def _step(self) -> None:
        """One decoder step of each continuous batch; sentences done are answered."""
        for decode, stream in list(self.streams.items()):
            live, start = len(stream), time.perf_counter()
            if not live:
                continue
            try:
                ended = self.translator.texts(stream.step())
            except Exception:  # noqa: BLE001 - the batch's state is lost: its requests go again, each alone
                logger.exception(f"a decoder step over {live} sentences failed; translating each request alone")
                del self.streams[decode]
                self.live -= live
                self._again_alone(stream.tags, decode)
                continue
            seconds = time.perf_counter() - start
            self.live -= live - len(stream)
            self.metrics.step(live, len(ended), seconds)
            self._update_rate(len(ended), seconds)
            for (job, i), hyps in ended:
                job.translated(i, hyps)
        empty = [decode for decode, stream in self.streams.items() if not len(stream)]
        for decode in empty[: max(0, len(self.streams) - KEPT_STREAMS)]:  # the oldest settings first
            del self.streams[decode]

    def _again_alone(self, tags: list[tuple[Job, int]], decode: DecodeConfig) -> None:
        """After a failed step: each request's sentences of that batch translated alone (whole batches)."""
        by_job: dict[Job, list[int]] = {}
        for job, i in tags:
            by_job.setdefault(job, []).append(i)
        for job, indices in by_job.items():
            if job.cancelled:
                continue
            try:
                hyps = self.translator.translate_nbest([job.sentences[i] for i in indices], decode)
            except Exception:  # noqa: BLE001 - answered 500, logged; the others go on
                self._fail(job)
                continue
            for i, h in zip(indices, hyps):
                job.translated(i, h)

    def _update_rate(self, sentences: int, seconds: float) -> None:
        """The Retry-After rate from continuous steps, a quarter of a second of them at a time."""
        self.rate_window[0] += sentences
        self.rate_window[1] += seconds
        if self.rate_window[1] >= 0.25:
            rate = self.rate_window[0] / self.rate_window[1]
            self.rate = rate if not self.rate else 0.8 * self.rate + 0.2 * rate
            self.rate_window = [0, 0.0]

    # -----------------------------------------------------------------------------------------------------------------
    # Whole batches

    def _translate(self, batch: list[tuple[Job, int, int]]) -> None:
        groups: dict[DecodeConfig, list[tuple[Job, int, int]]] = {}
        for part in batch:
            if not part[0].cancelled:
                groups.setdefault(part[0].decode, []).append(part)
        for decode, parts in groups.items():
            try:
                self._translate_parts(parts, decode)
                continue
            except Exception:  # noqa: BLE001 - below, each request alone: the failure is its own or a bug for all
                if len(parts) == 1:
                    self._fail(parts[0][0])
                    continue
                logger.warning(f"a batch of {len(parts)} requests failed; translating each alone")
            for part in parts:  # one bad sentence must not fail the requests batched with it
                try:
                    self._translate_parts([part], decode)
                except Exception:  # noqa: BLE001 - answered 500, logged; the others go on
                    self._fail(part[0])

    def _translate_parts(self, parts: list[tuple[Job, int, int]], decode: DecodeConfig) -> None:
        sentences = [s for job, start, end in parts for s in job.sentences[start:end]]
        start_time = time.perf_counter()
        hyps = self.translator.translate_nbest(sentences, decode)  # long sentences were cut before they were queued
        seconds = time.perf_counter() - start_time
        self.metrics.batch(len(sentences), seconds)
        rate = len(sentences) / max(seconds, 1e-6)
        self.rate = rate if not self.rate else 0.8 * self.rate + 0.2 * rate
        results = iter(hyps)
        for job, start, end in parts:
            for i in range(start, end):
                job.translated(i, next(results))

    def _fail(self, job: Job) -> None:
        """Called in an except block: the traceback goes to the log, the request gets a bare error."""
        logger.exception(f"translation failed for a request of {len(job.sentences)} sentences")
        self.withdraw(job)
        job.finish(error=TranslationFailed())
