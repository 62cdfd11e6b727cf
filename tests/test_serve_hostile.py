"""`mtcli serve` against hostile clients (issue 43). First the model worker alone, with a stand-in translator: the
queue's count returns to 0 after any mix of requests, a sentence that breaks the model fails only its own request,
batches are bounded in subwords and shared fairly, slow uploaders hold up no batch. Then a real server on the toy
model: client input never gets a 500 or an unbounded message, malformed HTTP gets JSON, slow bodies get 408 and do
not hold up SIGTERM, and a poisoned sentence batched with good ones fails only its own request."""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import random
import re
import signal
import threading
import time

import pytest
from faults_serve import Server, answer_of, poisoned_batches, poisoned_command, send_raw, slow_upload
from test_serve import LIBRE, SENTENCES, assert_error

from mtcli.config import DecodeConfig
from mtcli.errors import MtcliError
from mtcli.serve import serve
from mtcli.serve_requests import NATIVE_OPTIONS, HTTPError, ServeLimits, decode_options
from mtcli.serve_worker import Dropped, QueueFull, ServerCounters, TranslationFailed, Worker
from mtcli.translate import Translation

# ---------------------------------------------------------------------------------------------------------------------
# The worker, with a stand-in translator (no model, no HTTP)


class FakeTranslator:
    """translate_nbest as the worker calls it: each sentence reversed; a call holding a sentence with POISON in it
    raises. Records every call; `hold`, when set, keeps the first call waiting until it is set."""

    def __init__(self, hold: threading.Event | None = None):
        self.calls: list[list[str]] = []
        self.hold = hold

    def translate_nbest(self, sentences, decode):
        self.calls.append(list(sentences))
        if self.hold is not None and len(self.calls) == 1:
            assert self.hold.wait(10)
        if any("POISON" in s for s in sentences):
            raise RuntimeError("a sentence the model cannot take")
        return [[Translation(s[::-1], -1.0, -1.0, [])] for s in sentences]


def with_worker(
    translator, scenario, queue_size: int = 64, max_wait: float = 0.0, metrics: ServerCounters | None = None
):
    """Run `scenario(worker, loop)` (a coroutine function) on an event loop while the worker runs on a thread, as in
    the server; then stop the worker. Returns the worker."""
    worker = Worker(translator, queue_size, max_wait, metrics or ServerCounters())
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()

    async def main():
        await scenario(worker, asyncio.get_running_loop())

    try:
        asyncio.run(main())
    finally:
        worker.stop()
        thread.join(10)
    assert not thread.is_alive()
    return worker


def assert_queue_empty(worker: Worker) -> None:
    assert (worker.queued, worker.queued_tokens, len(worker.waiting)) == (0, 0, 0)


def test_the_queue_returns_to_zero_after_any_mix_of_requests():
    """Good, poisoned, full-queue, withdrawn-at-once and withdrawn-midway requests, at random, with jobs split over
    many batches: every future ends, every good request gets its own sentences back in order, and the count ends
    at 0 (the leak let bad requests fill the queue for good)."""
    rng = random.Random(43)
    decode = DecodeConfig(batch_tokens=200)
    translator = FakeTranslator()
    outcomes: dict[str, int] = {}

    async def scenario(worker: Worker, loop):
        def give_up(job):  # what the server does when a client leaves or its time is out
            if not job.future.done():
                worker.withdraw(job)
                job.future.cancel()

        jobs = []
        for n in range(300):
            kind = rng.choice(["good", "good", "poisoned", "withdrawn", "withdrawn-later", "huge"])
            count = 100 if kind == "huge" else rng.randint(1, 12)
            sentences = [f"{kind} {n} {i}" for i in range(count)]
            if kind == "poisoned":
                sentences[rng.randrange(count)] += " POISON"
            lengths = [rng.randint(1, 90) for _ in sentences]
            try:
                job = worker.submit(sentences, lengths, decode, loop)
            except QueueFull:
                outcomes["queue full"] = outcomes.get("queue full", 0) + 1
                continue
            jobs.append((kind, job))
            if kind == "withdrawn":
                give_up(job)
            elif kind == "withdrawn-later":
                loop.call_later(rng.random() * 0.01, give_up, job)
            if rng.random() < 0.3:
                await asyncio.sleep(rng.random() * 0.003)
        for kind, job in jobs:
            try:
                result = await asyncio.wait_for(job.future, 10)
            except TranslationFailed:
                assert kind == "poisoned", kind
                outcomes["failed"] = outcomes.get("failed", 0) + 1
                continue
            except asyncio.CancelledError:
                assert kind.startswith("withdrawn"), kind
                outcomes["withdrawn"] = outcomes.get("withdrawn", 0) + 1
                continue
            assert kind != "poisoned"
            assert [hyps[0].text for hyps in result] == [s[::-1] for s in job.sentences]
            outcomes["answered"] = outcomes.get("answered", 0) + 1
        assert_queue_empty(worker)

    worker = with_worker(translator, scenario, queue_size=120)
    assert_queue_empty(worker)
    assert min(outcomes.get(k, 0) for k in ("queue full", "failed", "withdrawn", "answered")) > 0, outcomes


def test_a_poisoned_sentence_fails_only_its_own_request():
    hold = threading.Event()
    translator = FakeTranslator(hold)
    decode = DecodeConfig()

    async def scenario(worker: Worker, loop):
        first = worker.submit(["warm up"], [3], decode, loop)
        while not translator.calls:  # the worker is busy with `first`; the next three wait and go in one batch
            await asyncio.sleep(0.001)
        good = worker.submit(["A man.", "A dog."], [3, 3], decode, loop)
        bad = worker.submit(["Fine.", "POISON here.", "Fine too."], [2, 3, 3], decode, loop)
        other = worker.submit(["A cat."], [3], decode, loop)
        hold.set()
        await first.future
        assert [h[0].text for h in await good.future] == [".nam A", ".god A"]
        assert [h[0].text for h in await other.future] == [".tac A"]
        with pytest.raises(TranslationFailed):
            await bad.future
        assert_queue_empty(worker)

    with_worker(translator, scenario)
    batched = ["A man.", "A dog.", "Fine.", "POISON here.", "Fine too.", "A cat."]
    assert translator.calls[1] == batched  # they did share a batch, which failed; then each was tried alone
    assert sorted(map(tuple, translator.calls[2:])) == sorted([("A man.", "A dog."), tuple(batched[2:5]), ("A cat.",)])


def test_batches_are_bounded_in_subwords_and_shared_with_requests_that_arrive_later():
    hold = threading.Event()
    translator = FakeTranslator(hold)
    decode = DecodeConfig(batch_tokens=100)
    big_sentences = [f"big {i}" for i in range(50)]  # 500 subwords: five batches' worth
    order: list[str] = []

    async def scenario(worker: Worker, loop):
        big = worker.submit(big_sentences, [10] * 50, decode, loop)
        while not translator.calls:
            await asyncio.sleep(0.001)
        small = worker.submit(["small 1", "small 2"], [10, 10], decode, loop)  # arrives while batch 1 runs
        big.future.add_done_callback(lambda _: order.append("big"))
        small.future.add_done_callback(lambda _: order.append("small"))
        hold.set()
        assert [h[0].text for h in await big.future] == [s[::-1] for s in big_sentences]
        await small.future
        assert_queue_empty(worker)

    with_worker(translator, scenario)
    assert order == ["small", "big"]
    assert all(len(call) <= 10 for call in translator.calls)  # 10 subwords each: at most 100 a batch
    assert translator.calls[0] == big_sentences[:10]
    # batch 2: an equal share (50 subwords) each, so the small request whole; the 30 left to the big one
    assert translator.calls[1] == big_sentences[10:18] + ["small 1", "small 2"]
    assert sum(map(len, translator.calls)) == 52


def test_a_sentence_longer_than_the_budget_still_goes_alone():
    decode = DecodeConfig(batch_tokens=100)
    translator = FakeTranslator()

    async def scenario(worker: Worker, loop):
        job = worker.submit(["long", "short"], [500, 5], decode, loop)
        assert len(await job.future) == 2

    with_worker(translator, scenario)
    assert translator.calls == [["long"], ["short"]]


def test_a_second_stop_signal_drops_what_is_queued_and_the_count_returns_to_zero():
    hold = threading.Event()
    translator = FakeTranslator(hold)
    decode = DecodeConfig()

    async def scenario(worker: Worker, loop):
        first = worker.submit(["busy"], [3], decode, loop)
        while not translator.calls:
            await asyncio.sleep(0.001)
        queued = [worker.submit([f"s{i}"] * 3, [3] * 3, decode, loop) for i in range(5)]
        worker.dropping = True  # what the second signal sets
        hold.set()
        await first.future  # the batch in progress finishes
        for job in queued:
            with pytest.raises(Dropped):
                await job.future
        assert_queue_empty(worker)

    with_worker(translator, scenario)


def test_a_request_given_up_is_translated_no_further_and_status_says_what_is_busy():
    """Issue 59: requests answered 503 by --timeout went on being translated, so the next ones timed out too while
    /health showed an empty queue. The rest of a request given up while its batch runs is skipped (the model batch
    in progress ends), the next request is answered, and status() names the batch in progress."""
    hold = threading.Event()
    translator = FakeTranslator(hold)
    decode = DecodeConfig(batch_sentences=2)  # model batches of two sentences: the request below makes three
    metrics = ServerCounters()
    seen: dict = {}

    async def scenario(worker: Worker, loop):
        given_up = worker.submit([f"s{i}" for i in range(6)], [3] * 6, decode, loop)
        while not translator.calls:
            await asyncio.sleep(0.001)
        seen["running"] = worker.status()
        worker.withdraw(given_up)  # what the server does when the request's time is out
        given_up.future.cancel()
        seen["cancelled"] = worker.status()["batch"]["cancelled"]
        after = worker.submit(["next"], [3], decode, loop)
        hold.set()
        assert [h[0].text for h in await asyncio.wait_for(after.future, 10)] == ["txen"]
        for _ in range(1000):  # the worker notes the end of the batch just after it answers
            if worker.status()["batch"] is None:
                break
            await asyncio.sleep(0.001)
        seen["idle"] = worker.status()

    with_worker(translator, scenario, metrics=metrics)
    assert translator.calls == [["s0", "s1"], ["next"]]
    running = seen["running"]
    assert running["queue"] == {"sentences": 0, "requests": 0}  # all of it taken: only the batch says it is busy
    batch = running["batch"]
    assert (batch["requests"], batch["cancelled"], batch["sentences"], batch["translated"]) == (1, 0, 6, 0)
    assert batch["skipped"] == 0 and 0 <= batch["seconds"] < 10
    assert seen["cancelled"] == 1
    assert seen["idle"] == {"queue": {"sentences": 0, "requests": 0}, "batch": None}
    assert metrics.skipped == 4 and metrics.sentences == 3


@pytest.mark.parametrize("receiving", [True, False])
def test_requests_still_uploading_do_not_hold_up_a_batch(receiving):
    """Requests being cut or answered make the worker wait (up to max_wait) for them to join the batch; requests
    whose body is still arriving must not, or one slow uploader adds max_wait to everyone's latency."""
    metrics = ServerCounters()
    metrics.open = 6  # one request queued, five others in the application
    metrics.receiving = 5 if receiving else 0
    waited: list[float] = []

    async def scenario(worker: Worker, loop):
        start = time.monotonic()
        await worker.submit(["hello"], [3], DecodeConfig(), loop).future
        waited.append(time.monotonic() - start)

    with_worker(FakeTranslator(), scenario, max_wait=0.6, metrics=metrics)
    assert waited[0] < 0.3 if receiving else waited[0] >= 0.55, waited


# ---------------------------------------------------------------------------------------------------------------------
# Options: every limit finite and in range, the port too (70000 wrapped around to 4464)


@pytest.mark.parametrize(
    "field, flag",
    [
        ("max_body_bytes", "--max-body-bytes"),
        ("max_sentences", "--max-sentences"),
        ("max_chars", "--max-chars"),
        ("queue_size", "--queue-size"),
        ("timeout", "--timeout"),
        ("max_beam", "--max-beam"),
        ("max_tokens", "--max-tokens"),
        ("body_timeout", "--body-timeout"),
        ("max_wait_ms", "--max-wait-ms"),
    ],
)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), -1, 0])
def test_every_limit_must_be_finite_and_positive(field, flag, value):
    if field == "max_wait_ms" and value == 0:
        assert ServeLimits(max_wait_ms=0).max_wait_ms == 0  # no waiting for others is a valid choice
        return
    with pytest.raises(MtcliError) as error:
        ServeLimits(**{field: value, **({"queue_size": 10**6} if field == "max_sentences" else {})})
    assert str(error.value).startswith(f"{flag} must be") and "\n" not in str(error.value)


FLOAT_OPTIONS = [name for name, kind in NATIVE_OPTIONS.items() if kind is float]
INT_OPTIONS = [name for name, kind in NATIVE_OPTIONS.items() if kind is int]


@pytest.mark.parametrize("name", FLOAT_OPTIONS + INT_OPTIONS)
@pytest.mark.parametrize("value, named", [(math.nan, "NaN"), (math.inf, "Infinity"), (-math.inf, "-Infinity")])
def test_a_decode_setting_that_is_no_finite_number_is_named_in_one_line(name, value, named):
    """JSON's NaN and Infinity parse to floats: `lenpen: NaN` got "expected a number, got a number"."""
    with pytest.raises(HTTPError) as error:
        decode_options({name: value}, DecodeConfig(), ServeLimits(), 128)
    expected = "must be a finite number" if name in FLOAT_OPTIONS else "expected an integer"
    assert (error.value.status, error.value.message) == (400, f"{name}: {expected}, got {named}")


def test_a_fraction_where_an_integer_is_expected_is_quoted():
    with pytest.raises(HTTPError, match=r"^beam: expected an integer, got 2\.5$"):
        decode_options({"beam": 2.5}, DecodeConfig(), ServeLimits(), 128)


@pytest.mark.parametrize("port", [-1, 65536, 70000])
def test_a_port_outside_0_to_65535_is_refused(port):
    with pytest.raises(MtcliError, match=f"--port must be between 0 and 65535, not {port}"):
        serve(None, DecodeConfig(), ServeLimits(), port=port)  # refused before the translator is touched


# ---------------------------------------------------------------------------------------------------------------------
# A real server on the toy model


@pytest.fixture(scope="module")
def hostile(toy_run):
    srv = Server(toy_run, "--max-sentences", "64", "--queue-size", "64", "--max-chars", "3000", "--max-beam", "8")
    yield srv
    assert srv.stop() == 0


def assert_client_error(answer, status: int, *words: str) -> None:
    """A 4xx with one short line that names no Python exception."""
    assert_error(answer, status, *words)
    message = answer[2]["error"]
    assert len(message) <= 1100, len(message)
    assert not re.search(r"[A-Z][a-z]+(Error|Exception)\b", message), message


SURROGATE = b'"\\ud800"'  # JSON's escape for a lone surrogate: json.dumps writes it as such


@pytest.mark.model
def test_client_input_gets_a_4xx_with_a_short_message_never_a_500(hostile):
    def native(**fields):
        return hostile.post("/v1/translate", {"texts": ["I love apples"], **fields})

    def libre(**fields):
        return hostile.post("/translate", {"q": "I love apples", **LIBRE, **fields})

    # lone surrogates, wherever they are in the JSON (before any check of keys or texts)
    for body in (
        b'{"q": ' + SURROGATE + b', "source": "en", "target": "zh"}',
        b'{"q": ["fine", ' + SURROGATE + b'], "source": "en", "target": "zh"}',
        b'{"texts": ' + SURROGATE + b', "split_sentences": false}',
        b'{"q": "Hi", "source": "en", "target": "zh", "api_key": ' + SURROGATE + b"}",
        b'{"q": "Hi", "source": ' + SURROGATE + b', "target": "zh"}',
        b'{"q": "Hi", ' + SURROGATE + b': 1, "target": "zh"}',
        b'{"q": "Hi", "target": "zh", "x": [[{"y": "\\udc00"}]]}',
    ):
        assert_client_error(hostile.post("/translate", body), 400, "lone surrogate")
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    assert_client_error(hostile.post("/translate", b"q=%ED%A0%80&target=zh", headers=form), 400, "not UTF-8")
    # alternatives that are no number of ours
    for value in ("²", "--5", "9" * 5000, "1e3", "0x10", "٣", [1], 2.5):
        assert_client_error(libre(alternatives=value), 400, "alternatives parameter is not a number")
    assert_client_error(libre(alternatives=int("9" * 4000)), 422, "limit of 7")
    assert libre(alternatives=" 2 ")[0] == 200 and libre(alternatives=-3)[0] == 200
    # decode settings past where decoding is defined, or not finite
    for name, value, word in (
        ("top_p", 1e-300, "top_p: must be between"),
        ("temperature", 1e308, "temperature: must be between"),
        ("temperature", 1e-300, "temperature: must be between"),
        ("lenpen", 1e308, "lenpen: must be between"),
        ("beam", 10**40, "limit of 8"),
    ):
        assert_client_error(native(**{name: value}), 422, word)
    for raw, named in ((b"NaN", "NaN"), (b"Infinity", "Infinity"), (b"-Infinity", "-Infinity"), (b"1e999", "Infinity")):
        body = b'{"texts": ["Hi"], "lenpen": ' + raw + b"}"
        assert_client_error(hostile.post("/v1/translate", body), 400, f"lenpen: must be a finite number, got {named}")
    # values quoted in messages are cut short, lists of names too
    assert_client_error(libre(source="e" * 100_000), 400, "is not supported")
    assert_client_error(libre(format="x" * 100_000), 400, "format is not supported")
    assert_client_error(libre(format=["html"] * 1000), 400, "format: expected a string")
    unknown = {f"field{i}": 1 for i in range(60_000)}
    assert_client_error(native(**unknown), 422, "unknown field(s)", "and 59,990 more")
    assert_client_error(hostile.request("GET", "/" + "a" * 50_000), 404)
    assert_client_error(hostile.request("GET", "/a%0Ab%00c"), 404, "b\\x00c")  # the path, decoded, is one line still
    # the work one request may cause is bounded in subwords, not characters: 12 texts of 2,999 Chinese characters
    # are 36,000 subwords; unspaced Latin letters the model does not know are one subword a run
    assert_client_error(libre(q=["我" * 2999] * 12), 413, "source subwords", "--max-tokens")
    assert hostile.queued() == 0
    assert libre()[2] == {"translatedText": "我喜欢苹果"}


def closed_early(srv: Server) -> int:
    """Requests to /translate whose client left before the answer (status 499 in /metrics)."""
    found = re.search(
        r'^mtcli_requests_total\{route="/translate",status="499"\} (\d+)$', srv.request("GET", "/metrics")[2], re.M
    )
    return int(found[1]) if found else 0


@pytest.mark.system
def test_requests_that_fail_leave_nothing_in_the_queue(hostile):
    """The leak: a request whose texts could not be tokenized stayed counted as queued. With a queue of 64 sentences,
    a few such requests of 64 texts each would have left every later request a 503."""
    bad = b'{"texts": [' + b", ".join([SURROGATE] * 64) + b'], "split_sentences": false}'
    for _ in range(5):
        assert_client_error(hostile.post("/v1/translate", bad), 400, "lone surrogate")
        assert_client_error(hostile.post("/translate", {"q": ["Hi."] * 65, **LIBRE}), 413, "--max-sentences")
        assert_client_error(hostile.post("/translate", {"q": ["我" * 2999] * 12, **LIBRE}), 413, "--max-tokens")
    left = closed_early(hostile)
    gone = http.client.HTTPConnection("127.0.0.1", hostile.port)  # leaves while its 64 sentences wait
    gone.request("POST", "/translate", json.dumps({"q": SENTENCES[:40] + SENTENCES[:24], **LIBRE}).encode())
    gone.close()
    deadline = time.monotonic() + 10
    while closed_early(hostile) == left and time.monotonic() < deadline:  # until the server has seen it leave
        time.sleep(0.02)
    assert hostile.queued() == 0
    full = hostile.post("/translate", {"q": (SENTENCES * 2)[:64], **LIBRE})  # the whole queue, for one request
    assert full[0] == 200 and len(full[2]["translatedText"]) == 64
    assert hostile.queued() == 0


@pytest.mark.model
def test_routes_head_no_redirects_no_openapi_and_json_for_malformed_http(hostile):
    for path in ("/", "/health", "/languages", "/metrics"):
        status, headers, body = hostile.request("HEAD", path)
        assert status == 200 and body == "", (path, status)
    status, headers, _ = hostile.request("GET", "/health/", headers={"Host": "evil.example"})
    assert status == 404 and "location" not in {k.lower() for k in headers}
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert_client_error(hostile.request("GET", path), 404)
    for raw in (
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"GET / HTTP/1.1\r\nHo\x00st: x\r\n\r\n",
        b"POST /translate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ):
        status, body = send_raw(hostile.port, raw)
        assert status == 400 and set(body) == {"error"}, (raw, status, body)
    assert hostile.request("GET", "/health")[0] == 200


@pytest.mark.system
def test_slow_bodies_get_408_and_do_not_hold_up_sigterm(toy_run):
    srv = Server(toy_run, "--timeout", "4")  # the body must arrive within --timeout (10 s at most)
    try:
        for _ in range(5):  # the first translations warm the model up, which may take more than 4 s here
            if srv.post("/translate", {"q": SENTENCES[:3], **LIBRE})[0] == 200:
                break
        sock, start = slow_upload(srv.port), time.monotonic()
        assert srv.post("/translate", {"q": "I love apples", **LIBRE})[2] == {"translatedText": "我喜欢苹果"}
        status, body = answer_of(sock)
        assert status == 408 and "did not arrive within 4 s" in body["error"]
        assert 3.9 < time.monotonic() - start < 10

        # SIGTERM with five bodies still arriving and good requests in flight: the good ones are answered, the
        # slow ones get a 503 at once (a 408 would mean the drain waited for their time to run out)
        slow = [slow_upload(srv.port) for _ in range(5)]
        answers: list = []
        threads = [
            threading.Thread(target=lambda: answers.append(srv.post("/translate", {"q": SENTENCES[:3], **LIBRE})))
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        time.sleep(0.1)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        statuses = [answer_of(sock) for sock in slow]
        slow_answered = time.monotonic() - start
        assert srv.proc.wait(timeout=30) == 0
        for t in threads:
            t.join()
    finally:
        srv.stop()
    assert all(s == 503 and "stopping" in b["error"] for s, b in statuses) and slow_answered < 3, statuses
    assert [a[0] for a in answers] == [200] * 3
    answered, accepted = srv.answered()
    assert answered == accepted == srv.responses + 6  # the slow ones were read here, not through srv.request


@pytest.mark.system
def test_a_poisoned_sentence_batched_with_good_ones_fails_only_its_own_request(toy_run):
    """The real server, with the model made to fail on one word (tests/faults_serve.py's wrapper): the requests
    batched with that sentence are answered, and it gets a 500 that says only that it is a server error."""
    srv = Server(toy_run, "--max-wait-ms", "200", command=poisoned_command())
    try:
        sentences = SENTENCES[:16]
        expected = dict(zip(sentences, srv.post("/translate", {"q": sentences, **LIBRE})[2]["translatedText"]))
        rounds, problems = poisoned_batches(srv, sentences, expected, rounds=6)
        assert not problems and rounds <= 6
        assert srv.queued() == 0
    finally:
        assert srv.stop() == 0
