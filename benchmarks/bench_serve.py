"""`make bench-serve`: `mtcli serve` under 1, 8 and 64 concurrent clients, beside offline `mtcli translate --input` on
the same sentences, in one run.

1. The model: --run DIR, or the benchmark's decoding model (benchmarks/bench.yaml, 800 updates on Multi30k en->de;
   trained once and kept in benchmarks/cache/, as `make bench` does). The precision is resolved once (auto: what
   this CPU runs best) and passed to every command, so all of them translate alike.
2. Offline: `mtcli translate --input` on the Multi30k test_2016_flickr sources (1,000 sentences) in a child process,
   before the served rounds, between them (--pairs) and after them; the fastest is the reference of the table (on a
   shared machine interference only slows a run down). Its rate counts the translation only: the wall time of the
   command less that of the same command on one line (start-up: imports and loading the model).
3. Served: `mtcli serve` in a child process; N client threads (N = 1, 8, 64) on 127.0.0.1, each on its own
   keep-alive connection, send one sentence per request (LibreTranslate's POST /translate) until the sentences run
   out: sentences/s over the whole round and p50/p95/p99 request latency. One client sends the first --one
   sentences (default 200); 8 and 64 send all of them.
4. The model's own time for a sentence: the same sentences translated one at a time in this process (the
   Translator the server runs), for the latency goal (p50 at 1 client <= 2x this median).
5. The 64-client goal: offline swung between 92 and 221 sentences/s within an hour on one host, so one ratio says
   little. After the 1, 8 and 64 rounds come --pairs more (offline, 64 clients) pairs (default 2): each 64-client
   round is divided by the mean of the offline runs just before and after it, and the goal line gives the median
   of those ratios.
Checks that the served translations equal the offline ones. Prints a table; writes benchmarks/serve_results.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TEST_SOURCES = ROOT.parent / "shared" / "data" / "multi30k" / "test_2016_flickr.en"
MTCLI = [sys.executable, "-m", "mtcli"]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def offline(checkpoint: Path, sentences: list[str], precision: str) -> dict:
    """`mtcli translate --input` on all sentences and on one, in child processes: the translation rate."""
    with tempfile.TemporaryDirectory() as tmp:
        walls, outputs = [], []
        for lines in (sentences[:1], sentences):
            source, out = Path(tmp) / f"src{len(lines)}.txt", Path(tmp) / f"out{len(lines)}.txt"
            source.write_text("\n".join(lines) + "\n", encoding="utf-8")
            command = [*MTCLI, "translate", "--checkpoint", str(checkpoint), "--input", str(source)]
            start = time.perf_counter()
            subprocess.run([*command, "--output", str(out), "--precision", precision], check=True, cwd=ROOT)
            walls.append(time.perf_counter() - start)
            outputs = out.read_text(encoding="utf-8").splitlines()
    seconds = walls[1] - walls[0]
    return {"wall_s": walls[1], "startup_s": walls[0], "sent_per_s": len(sentences) / seconds, "outputs": outputs}


class ServerProcess:
    def __init__(self, checkpoint: Path, precision: str):
        command = [*MTCLI, "serve", "--checkpoint", str(checkpoint), "--port", "0", "--precision", precision]
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        for line in self.proc.stderr:
            sys.stderr.write(line)
            if match := re.search(r"at http://127\.0\.0\.1:(\d+)/", line):
                self.port = int(match[1])
                break
        else:
            sys.exit("bench-serve: mtcli serve did not start")
        threading.Thread(target=lambda: [sys.stderr.write(x) for x in self.proc.stderr], daemon=True).start()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=120)


def batch_counts(port: int) -> tuple[int, int]:
    """(sentences, batches) the server's model worker has translated so far, from /metrics."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    connection.close()
    sentences = int(re.search(r"^mtcli_sentences_total (\d+)$", text, re.M)[1])
    return sentences, int(re.search(r"^mtcli_batches_total (\d+)$", text, re.M)[1])


def clients_round(port: int, sentences: list[str], clients: int, target: str) -> dict:
    """`clients` threads, each with a keep-alive connection, send one sentence per request until none is left."""
    done_before = batch_counts(port)
    latencies: list[float] = []
    errors: list[str] = []
    outputs: list[str | None] = [None] * len(sentences)
    next_index = iter(range(len(sentences)))
    lock = threading.Lock()

    def client() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                break
            body = json.dumps({"q": sentences[i], "source": "auto", "target": target}).encode()
            start = time.perf_counter()
            connection.request("POST", "/translate", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            answer = json.loads(response.read())
            latency = time.perf_counter() - start
            if response.status != 200:
                errors.append(f"HTTP {response.status}: {answer}")
                break
            outputs[i] = answer["translatedText"]
            with lock:
                latencies.append(latency)
        connection.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        sys.exit(f"bench-serve: {len(errors)} request(s) failed, e.g. {errors[0]}")
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    done = [after - before for after, before in zip(batch_counts(port), done_before)]
    return {
        "clients": clients,
        "sentences": len(sentences),
        "sent_per_s": len(sentences) / wall,
        "p50_ms": q[49] * 1000,
        "p95_ms": q[94] * 1000,
        "p99_ms": q[98] * 1000,
        "sentences_per_batch": done[0] / max(done[1], 1),
        "outputs": outputs,
    }


def model_time(checkpoint: Path, sentences: list[str], precision: str) -> float:
    """Median seconds the server's Translator takes for one sentence alone, measured in this process."""
    from mtcli.device import keep_freed_memory, keep_onednn_kernels
    from mtcli.translate import Translator

    keep_freed_memory()  # as the mtcli command does for the server
    keep_onednn_kernels()
    translator = Translator.from_checkpoint(checkpoint, "cpu", precision)
    translator.split_long = True  # as the server translates
    translator.translate(sentences[:5])  # warm-up
    times = []
    for sentence in sentences:
        start = time.perf_counter()
        translator.translate([sentence])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, help="run directory (default: the benchmark's decoding model)")
    parser.add_argument("--one", type=int, default=200, help="sentences sent by the single client")
    parser.add_argument("--precision", help="fp32, bf16, int8 (default: the model's decode.precision, auto resolved)")
    parser.add_argument("--pairs", type=int, default=2, help="more (offline, 64 clients) pairs for the goal's ratio")
    args = parser.parse_args()
    if not TEST_SOURCES.is_file():
        sys.exit(f"bench-serve: {TEST_SOURCES} not found (the benchmark sends the shared Multi30k test sentences)")
    sentences = TEST_SOURCES.read_text(encoding="utf-8").splitlines()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench import cpu_lock, decode_model

    from mtcli.checkpoint import read_config, resolve_checkpoint
    from mtcli.inference import translation_precision

    checkpoint = resolve_checkpoint(args.run) if args.run else decode_model("fp32")
    cfg = read_config(checkpoint)
    precision, _ = translation_precision(args.precision or cfg.decode.precision, torch.device("cpu"))
    results = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "checkpoint": os.path.relpath(checkpoint, ROOT),
        "precision": precision,
        "beam": cfg.decode.beam,
    }
    print(f"bench-serve: {checkpoint}, precision {precision}, beam {cfg.decode.beam}, {len(sentences)} sentences")
    with cpu_lock():  # no peer benchmark runs meanwhile, and the reverse
        runs = [offline(checkpoint, sentences, precision)]
        server = ServerProcess(checkpoint, precision)
        try:
            target = cfg.data.tgt_lang
            clients_round(server.port, sentences[:16], 4, target)  # warm-up
            results["served"] = [
                clients_round(server.port, sentences[: args.one] if n == 1 else sentences, n, target)
                for n in (1, 8, 64)
            ]
            many = [results["served"][-1]]
            for _ in range(args.pairs):  # the server idles while offline runs
                runs.append(offline(checkpoint, sentences, precision))
                many.append(clients_round(server.port, sentences, 64, target))
        finally:
            server.stop()
        runs.append(offline(checkpoint, sentences, precision))
        results["paired_64"] = [
            {
                "sent_per_s": row["sent_per_s"],
                "of_offline": row["sent_per_s"] / statistics.mean([runs[i]["sent_per_s"], runs[i + 1]["sent_per_s"]]),
            }
            for i, row in enumerate(many)
        ]
        results["offline"] = max(runs, key=lambda run: run["sent_per_s"])
        results["offline_sent_per_s_runs"] = [run["sent_per_s"] for run in runs]
        results["model_s_per_sentence"] = model_time(checkpoint, sentences[: args.one], precision)
    report(results)


def report(r: dict) -> None:
    offline_rate, model_ms = r["offline"]["sent_per_s"], r["model_s_per_sentence"] * 1000
    reference = r["offline"].pop("outputs")
    for row in r["served"]:
        outputs = row.pop("outputs")
        row["differ_from_offline"] = sum(a != b for a, b in zip(outputs, reference))
        row["of_offline"] = row["sent_per_s"] / offline_rate
    print(f"\n{r['cpu']}, {r['cores']} cores, torch {r['torch']}, precision {r['precision']}, beam {r['beam']}")
    print(
        f"offline mtcli translate --input: {offline_rate:.1f} sentences/s (command {r['offline']['wall_s']:.1f} s, "
        f"of which start-up {r['offline']['startup_s']:.1f} s; the fastest of runs at "
        f"{', '.join(f'{x:.1f}' for x in r['offline_sent_per_s_runs'])}); model alone, one sentence: median "
        f"{model_ms:.1f} ms"
    )
    head = f"{'clients':>7} {'sentences/s':>11} {'of offline':>10} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8}"
    print(f"{head} {'batch':>6} {'differ':>6}")
    for row in r["served"]:
        print(
            f"{row['clients']:>7} {row['sent_per_s']:>11.1f} {row['of_offline']:>10.0%} {row['p50_ms']:>8.1f} "
            f"{row['p95_ms']:>8.1f} {row['p99_ms']:>8.1f} {row['sentences_per_batch']:>6.1f} "
            f"{row['differ_from_offline']:>6}"
        )
    one, paired = r["served"][0], [row["of_offline"] for row in r["paired_64"]]
    r["paired_64_median"] = statistics.median(paired)
    print(
        f"goals: 64 clients at {r['paired_64_median']:.0%} of offline, the median of "
        f"{', '.join(f'{x:.0%}' for x in paired)} against the offline runs around each round (goal >= 90%); "
        f"1 client p50 {one['p50_ms'] / model_ms:.2f}x the model's own time (goal <= 2x)"
    )
    (ROOT / "benchmarks" / "serve_results.json").write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
