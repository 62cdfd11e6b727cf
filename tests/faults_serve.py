"""The server's section of the fault matrix (tests/faults.py calls serve_faults): `mtcli serve` on a trained toy run
against hostile clients, all at once. It checks that (a) the queue's count returns to 0 after the mix, (b) a
sentence that breaks the model fails only its own request, (c) the server still answers a good request correctly
afterwards, and (d) SIGTERM ends it promptly with every accepted request answered.

A sentence that breaks the model is made by a wrapper, as faults.py injects its faults: `python
tests/faults_serve.py poisoned -- <mtcli args>` runs the real `mtcli` with Translator.translate_nbest failing on any
list that holds the word POISON. mtcli itself has no fault hooks. The Server class here is also the test suite's
(tests/test_serve.py)."""

from __future__ import annotations

import http.client
import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

POISON = "POISONED"
LIBRE = {"source": "en", "target": "zh"}


def poisoned_command() -> list[str]:
    """The command that runs `mtcli` with the model failing on any sentence that holds POISON."""
    return [sys.executable, str(Path(__file__).resolve()), "poisoned", "--"]


def poisoned_main(args: list[str]) -> None:
    import mtcli.translate

    original = mtcli.translate.Translator.translate_nbest

    def translate_nbest(self, lines, *rest, **options):
        if any(POISON in line for line in lines):
            raise RuntimeError(f"a {POISON} sentence")  # an internal text the client must not see
        return original(self, lines, *rest, **options)

    mtcli.translate.Translator.translate_nbest = translate_nbest
    sys.argv = ["mtcli", *args]
    from mtcli.cli import main

    main()


class Server:
    """`mtcli serve` on 127.0.0.1 at a free port (read from its start line); stop() sends SIGTERM. `command`: what
    runs `mtcli` (default python -m mtcli), such as poisoned_command()."""

    def __init__(self, run: Path, *args: str, command: list[str] | None = None):
        mtcli = command or [sys.executable, "-m", "mtcli"]
        command = [*mtcli, "serve", "--run", str(run), "--port", "0", *args]
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=run.parent)
        self.log: list[str] = []
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(lines,), daemon=True).start()
        deadline = time.monotonic() + 120
        while True:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            if line is None:
                raise RuntimeError(f"mtcli serve exited: {''.join(self.log)}")
            if match := re.search(r"at http://127\.0\.0\.1:(\d+)/", line):
                self.port = int(match[1])
                break
        self.responses = 0  # answers received through request() (compared with the server's own count at exit)

    def _read(self, lines: queue.Queue) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            lines.put(line)
        lines.put(None)

    def request(self, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 60):
        """(status, headers, parsed JSON or text); `body` as bytes goes as it is, anything else as JSON."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            connection.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
            response = connection.getresponse()
            raw = response.read()
        finally:
            connection.close()
        self.responses += 1
        kind = response.getheader("Content-Type", "")
        return response.status, dict(response.getheaders()), json.loads(raw) if "json" in kind and raw else raw.decode()

    def post(self, path: str, body, **kwargs):
        return self.request("POST", path, body, **kwargs)

    def queued(self) -> int:
        """The sentences waiting for the model, from /metrics."""
        return int(re.search(r"^mtcli_queue_sentences (\d+)$", self.request("GET", "/metrics")[2], re.M)[1])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)

    def answered(self) -> tuple[int, int]:
        """The server's own count at exit: (answered, accepted)."""
        match = re.search(r"answered ([\d,]+) of ([\d,]+) accepted", "".join(self.log))
        if not match:
            raise RuntimeError(f"no count of answered requests in the log: {''.join(self.log)[-500:]}")
        return int(match[1].replace(",", "")), int(match[2].replace(",", ""))


def slow_upload(port: int) -> socket.socket:
    """A connection that sends its headers and the start of a body, and then nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    sock.sendall(head + b'{"q": "I lo')
    return sock


def answer_of(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body the server sends on `sock`, read until it closes the connection."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    finally:
        sock.close()
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def send_raw(port: int, data: bytes) -> tuple[int, dict]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(data)
    return answer_of(sock)


def bad_answer(answer, statuses: set[int]) -> str:
    """Why `answer` (status, headers, body) is not one of `statuses` with the API's one-line JSON error (200s
    aside); "" when it is. A 503 must say when to retry."""
    status, headers, body = answer
    if status not in statuses:
        return f"status {status}: {str(body)[:120]}"
    if status == 200:
        return ""
    if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str)):
        return f"{status} without the JSON error: {str(body)[:120]}"
    message = body["error"]
    if "\n" in message or len(message) > 1100 or re.search(r"Traceback|[A-Z][a-z]+(Error|Exception)\b", message):
        return f"{status} with an internal or unbounded message: {message[:120]}"
    if status == 503 and "retry-after" not in {k.lower() for k in headers}:
        return "503 without Retry-After"
    return ""


def hostile_cases(sentences: list[str]) -> list[tuple[str, object, set[int]]]:
    """(kind, request, statuses it may get): the body (bytes as they are), or a callable for raw and slow clients."""
    surrogate = b'"\\ud800"'
    cases: list[tuple[str, object, set[int]]] = [
        ("malformed JSON", b'{"q": "I love apples", "target": ', {400}),
        ("not an object", b'["I love apples"]', {400}),
        ("empty body", b"", {400}),
        ("bytes not UTF-8", b'{"q": "\xff\xfe", "target": "zh"}', {400}),
        ("lone surrogate in q", b'{"q": ' + surrogate + b', "source": "en", "target": "zh"}', {400}),
        (
            "lone surrogates, one line",
            b'{"texts": [' + b",".join([surrogate] * 40) + b'], "split_sentences": false}',
            {400},
        ),
        ("lone surrogate in api_key", b'{"q": "Hi", "target": "zh", "api_key": ' + surrogate + b"}", {400}),
        ("alternatives ²", {"q": "Hi", **LIBRE, "alternatives": "²"}, {400}),
        ("alternatives --5", {"q": "Hi", **LIBRE, "alternatives": "--5"}, {400}),
        ("alternatives of 5,000 digits", {"q": "Hi", **LIBRE, "alternatives": "9" * 5000}, {400}),
        ("top_p 1e-300", ("/v1/translate", {"texts": ["Hi"], "sampling": True, "top_p": 1e-300}), {422}),
        ("temperature 1e308", ("/v1/translate", {"texts": ["Hi"], "sampling": True, "temperature": 1e308}), {422}),
        ("lenpen 1e308", ("/v1/translate", {"texts": ["Hi"], "lenpen": 1e308}), {422}),
        ("15,000 unknown fields", ("/v1/translate", {"texts": ["Hi"], **{f"f{i}": 0 for i in range(15_000)}}), {422}),
        ("too many texts", {"q": ["Hi."] * 49, **LIBRE}, {413}),
        ("too many subwords", {"q": ["我" * 2999] * 12, **LIBRE}, {413}),
        ("body over the limit", b'{"q": "' + b"a" * 250_000 + b'"}', {413}),
        ("a request of 48 sentences, the most", {"q": sentences[:48], **LIBRE}, {200, 503}),
        ("wrong method", ("GET", "/translate"), {405}),
        ("HTML with CDATA", {"q": "<p>I love apples <![CDATA[x < y]]></p>", **LIBRE, "format": "html"}, {200, 503}),
    ]
    return cases


def fire(srv: Server, kind: str, request, statuses: set[int]) -> tuple[str, str]:
    """Send one hostile request; (kind, "" or what was wrong with the answer)."""
    try:
        if kind == "slow body":
            status, body = answer_of(slow_upload(srv.port))
            return kind, bad_answer((status, {}, body), statuses)
        if kind == "malformed HTTP":
            status, body = send_raw(srv.port, request)
            return kind, bad_answer((status, {}, body), statuses)
        if kind == "client leaves":
            connection = http.client.HTTPConnection("127.0.0.1", srv.port)
            connection.request("POST", "/translate", json.dumps(request).encode())
            connection.close()
            return kind, ""
        if isinstance(request, tuple) and request[0] == "GET":
            return kind, bad_answer(srv.request("GET", request[1]), statuses)
        path, body = request if isinstance(request, tuple) else ("/translate", request)
        answer = srv.post(path, body, timeout=60)
        if kind == "HTML with CDATA" and answer[0] == 200 and "<![CDATA[x < y]]>" not in answer[2]["translatedText"]:
            return kind, f"CDATA not kept: {answer[2]['translatedText']}"
        return kind, bad_answer(answer, statuses)
    except (OSError, http.client.HTTPException, ValueError) as e:
        return kind, f"{type(e).__name__}: {e}"


def hostile_mix(srv: Server, sentences: list[str], expected: dict[str, str], rounds: int) -> tuple[int, list, list]:
    """`rounds` rounds of every hostile case, slow bodies, malformed HTTP, clients that leave and good requests, all
    sent at once from 32 threads. Returns (hostile requests sent, problems with hostile answers, problems with
    good answers)."""
    work = []
    for r in range(rounds):
        work += [(kind, request, statuses) for kind, request, statuses in hostile_cases(sentences)]
        work += [("slow body", None, {408})] * 2
        work += [("malformed HTTP", b"GARBAGE / HTTP/1.1\r\n\x00\r\n\r\n", {400})]
        work += [("client leaves", {"q": sentences[:40], **LIBRE}, set())]
        work += [("good", sentences[(r * 16 + i) % len(sentences)], {200, 503}) for i in range(16)]
    hostile_sent = sum(kind != "good" for kind, _, _ in work)

    def one(item):
        kind, request, statuses = item
        if kind != "good":
            return fire(srv, kind, request, statuses)
        answer = srv.post("/translate", {"q": request, **LIBRE}, timeout=60)
        wrong = bad_answer(answer, statuses)
        if not wrong and answer[0] == 200 and answer[2]["translatedText"] != expected[request]:
            wrong = f"{request!r} -> {answer[2]['translatedText']!r}, alone {expected[request]!r}"
        return kind, wrong

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, work))
    hostile = [f"{kind}: {why}" for kind, why in results if why and kind != "good"]
    good = [why for kind, why in results if why and kind == "good"]
    return hostile_sent, hostile, good


def queue_drains(srv: Server, seconds: float = 10) -> int:
    """The queue's count once it reaches 0 or `seconds` pass (a client that left is noticed within moments)."""
    deadline = time.monotonic() + seconds
    while (count := srv.queued()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return count


def poisoned_batches(srv: Server, sentences: list[str], expected: dict[str, str], rounds: int) -> tuple[int, list]:
    """Rounds of 8 good requests and one poisoned one, sent at once: (poisoned requests sent, problems)."""
    problems = []
    for r in range(rounds):
        texts = [sentences[(r * 8 + i) % len(sentences)] for i in range(8)] + [f"I love {POISON} apples"]
        with ThreadPoolExecutor(len(texts)) as pool:
            answers = list(pool.map(lambda q: srv.post("/translate", {"q": q, **LIBRE}), texts))
        for text, answer in zip(texts[:8], answers):
            if answer[0] != 200 or answer[2]["translatedText"] != expected[text]:
                problems.append(f"good request batched with the poison: {answer[0]} {str(answer[2])[:100]}")
        status, _, body = answers[8]
        if bad_answer(answers[8], {500}) or "server error" not in body["error"] or POISON in body["error"]:
            problems.append(f"poisoned request: {status} {str(body)[:120]}")
        deadline = time.monotonic() + 1  # the log is read on a thread: give it a moment
        while time.monotonic() < deadline:
            if any("translating each alone" in line for line in srv.log):
                return r + 1, problems
            time.sleep(0.02)
    return rounds, problems + ["the poisoned sentence never shared a batch with good ones"]


def sigterm_drain(srv: Server, sentences: list[str], timeout: float) -> tuple[bool, str]:
    """SIGTERM with four bodies still arriving and eight good requests in flight: the slow ones must get a 503 at
    once, the good ones be answered (200, or 503 where their `timeout` ran out), the process exit 0 within the
    timeout and a margin, and its count of answered requests equal that of accepted."""
    slow = [slow_upload(srv.port) for _ in range(4)]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(srv.post, "/translate", {"q": sentences[i : i + 5], **LIBRE}) for i in range(8)]
        time.sleep(0.2)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        slow_statuses = [answer_of(sock)[0] for sock in slow]
        slow_seconds = time.monotonic() - start
        try:
            code = srv.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.proc.kill()
            return False, "still running 30 s after SIGTERM"
        seconds = time.monotonic() - start
        good = [bad_answer(f.result(), {200, 503}) or f.result()[0] for f in futures]
    answered, accepted = srv.answered()
    ok = code == 0 and seconds < timeout + 3 and set(good) <= {200, 503} and answered == accepted
    ok = ok and slow_statuses == [503] * 4 and slow_seconds < 2
    detail = f"exit {code} after {seconds:.1f} s; in flight {good}; slow bodies {slow_statuses} in {slow_seconds:.1f} s"
    return ok, f"{detail}; answered {answered} of {accepted} accepted"


def serve_faults(work: Path, run_dir: Path, record) -> int:
    """The server's section of the matrix on the trained run `run_dir`; record(name, ok, detail) for each check.
    Returns the number of hostile requests sent. `work`, the matrix's scratch folder, is not written to: the
    server writes nothing, and the clients keep what they check in memory."""
    from mtcli.toy import toy_pairs

    print("the server under hostile clients:", flush=True)
    sentences = [en for en, _ in toy_pairs()["test"][:48]]
    limits = ["--queue-size", "96", "--max-sentences", "48", "--max-chars", "3000", "--max-body-bytes", "200000"]
    limits += ["--timeout", "5", "--precision", "fp32"]  # a body must arrive within 5 s; fp32: batch-independent
    tried = 0
    srv = Server(run_dir, *limits)
    try:
        expected = {}  # fp32 translations do not depend on the batch: these are each sentence's translation alone
        for i in range(0, len(sentences), 12):
            answer = srv.post("/translate", {"q": sentences[i : i + 12], **LIBRE})[2]["translatedText"]
            expected.update(zip(sentences[i : i + 12], answer))
        sent, hostile, good = hostile_mix(srv, sentences, expected, rounds=2)
        tried += sent
        record(
            "serve: hostile requests get the documented 4xx, one short JSON line",
            not hostile,
            "; ".join(hostile[:3]) or f"{sent} requests",
        )
        record("serve: good requests sent among them are answered correctly", not good, "; ".join(good[:3]))
        count = queue_drains(srv)
        record("serve: the queue returns to 0 after the mix", count == 0, f"{count} sentences still counted")
        answer = srv.post("/translate", {"q": sentences[0], **LIBRE})
        record(
            "serve: a good request is answered afterwards",
            answer[2] == {"translatedText": expected[sentences[0]]},
            str(answer[2])[:120],
        )
        ok, detail = sigterm_drain(srv, sentences, timeout=5)
        record("serve: SIGTERM exits promptly, accepted requests answered, slow bodies not waited for", ok, detail)
    finally:
        srv.stop()

    srv = Server(run_dir, "--max-wait-ms", "200", "--precision", "fp32", command=poisoned_command())
    try:
        sent, problems = poisoned_batches(srv, sentences, expected, rounds=6)
        tried += sent
        record("serve: a poisoned sentence fails only its own request", not problems, "; ".join(problems[:3]))
        count = queue_drains(srv)
        record("serve: the queue returns to 0 after poisoned batches", count == 0, f"{count} sentences still counted")
    finally:
        srv.stop()
    return tried


if __name__ == "__main__":
    if sys.argv[1:3] == ["poisoned", "--"]:
        poisoned_main(sys.argv[3:])
    else:
        sys.exit("usage: python tests/faults_serve.py poisoned -- <mtcli args>  (the matrix: python tests/faults.py)")
