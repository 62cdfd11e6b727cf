"""`make bench-data`: `mtcli data prepare` on seeded synthetic corpora of millions of pairs, and training start-up on
the largest cache: wall time, pairs/s per phase, peak memory of the whole process tree (workers included).

The corpus is made here (never copied from anywhere): 30,000 pseudo-words of Latin letters drawn with Zipf
frequencies into sentences of 3-40 words; the "translation" maps each word to another pseudo-word and reverses the
word order of every other sentence; 2% of pairs repeat an earlier pair, 0.5% are copies, 0.1% have an empty side,
so the filters have work. It is written once per size under benchmarks/cache/data-corpora/ and reused.

Each prepare starts from an empty cache (the Arrow copies of the datasets library included: they live under the
cache folder's `hf-datasets`). Peak memory is sampled every 50 ms as the sum of the RSS of the command and all its
descendants. Training start-up: `mtcli train` with a tiny model (d_model 64) and one update on the largest cache:
seconds to the first update and peak RSS (the data structures dominate it).

    make bench-data                                  # 4M and 16M pairs (about 40 minutes on 2 cores)
    make bench-data BENCH_DATA_ARGS="--pairs 250000" # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / "cache"
MTCLI = [sys.executable, "-m", "mtcli"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def pseudo_words(rng: np.random.Generator, n: int) -> np.ndarray:
    """n distinct words of 2-4 consonant-vowel syllables."""
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    words: set[str] = set()
    while len(words) < n:
        k = int(rng.integers(2, 5))
        words.add("".join(consonants[rng.integers(18)] + vowels[rng.integers(5)] for _ in range(k)))
    return np.array(sorted(words), dtype=object)


def write_corpus(folder: Path, pairs: int, seed: int = 1) -> Path:
    """train.en / train.de of `pairs` lines, valid and test of 1,000 (written once; a finished one is reused)."""
    done = folder / "done.json"
    if done.is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    src_words, tgt_words = pseudo_words(rng, 30_000), pseudo_words(rng, 30_000)
    mapping = rng.permutation(30_000)
    zipf = 1.0 / np.arange(1, 30_001)
    zipf /= zipf.sum()
    start = time.time()
    for name, n in (("train", pairs), ("valid", 1000), ("test", 1000)):
        with open(folder / f"{name}.en", "w") as en, open(folder / f"{name}.de", "w") as de:
            written: list[tuple[str, str]] = []
            for block in range(0, n, 100_000):
                size = min(100_000, n - block)
                lengths = rng.integers(3, 41, size)
                ids = rng.choice(30_000, size=int(lengths.sum()), p=zipf)
                cuts = np.cumsum(lengths)[:-1]
                src_lines, tgt_lines = [], []
                for i, sentence in enumerate(np.split(ids, cuts)):
                    target = mapping[sentence]
                    if i % 2:
                        target = target[::-1]
                    src_lines.append(" ".join(src_words[sentence]))
                    tgt_lines.append(" ".join(tgt_words[target]))
                if name == "train":  # defects for the filters: duplicates, copies, empty sides
                    roll = rng.random(size)
                    for i in np.flatnonzero(roll < 0.026):
                        if roll[i] < 0.02 and written:
                            src_lines[i], tgt_lines[i] = written[int(rng.integers(len(written)))]
                        elif roll[i] < 0.025:
                            tgt_lines[i] = src_lines[i]
                        else:
                            tgt_lines[i] = ""
                    written = list(zip(src_lines[:1000], tgt_lines[:1000]))
                en.write("\n".join(src_lines) + "\n")
                de.write("\n".join(tgt_lines) + "\n")
    done.write_text(json.dumps({"pairs": pairs, "seed": seed, "seconds": round(time.time() - start, 1)}))
    return folder


def tree_rss(pid: int) -> int:
    """Bytes resident in `pid` and all its descendants."""
    total, todo = 0, [pid]
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def run_measured(command: list[str], log: Path, until: str | None = None) -> dict:
    """Run `command` (output to `log`): wall seconds, peak RSS of its process tree, and the seconds until a log line
    matching `until` first appeared."""
    peak, seen = [0], [None]
    start = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

        def sample():
            while child.poll() is None:
                peak[0] = max(peak[0], tree_rss(child.pid))
                if until and seen[0] is None and re.search(until, log.read_text(errors="replace")):
                    seen[0] = time.perf_counter() - start
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        child.wait()
        sampler.join()
    if child.returncode:
        sys.exit(f"bench-data: {' '.join(command)} failed; see {log}")
    return {"seconds": round(time.perf_counter() - start, 1), "peak_rss_gb": round(peak[0] / 1e9, 2), "until": seen[0]}


def config(corpus: Path, cache: Path) -> list[str]:
    sets = {
        "data.path": corpus,
        "data.src_lang": "en",
        "data.tgt_lang": "de",
        "data.splits.valid": "valid",
        "data.splits.test": "test",
        "data.vocab_size": 8000,
        "data.cache_dir": cache,
    }
    return [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, nargs="+", default=[4_000_000, 16_000_000])
    parser.add_argument("--workers", type=int, default=0, help="data.workers (0: one per available core)")
    parser.add_argument("--no-train", action="store_true", help="skip the training start-up measurement")
    args = parser.parse_args()
    results = {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)), "runs": []}
    print(f"bench-data: {results['cpu']}, {results['cores']} cores", flush=True)
    env_sets = ["--set", f"data.workers={args.workers}"]
    for pairs in args.pairs:
        corpus = write_corpus(CACHE / "data-corpora" / f"synthetic-{pairs}", pairs)
        cache = CACHE / "data-prepare"
        shutil.rmtree(cache, ignore_errors=True)
        log = CACHE / f"data-prepare-{pairs}.log"
        command = [*MTCLI, "data", "prepare", "--config", "multi30k.yaml", *config(corpus, cache), *env_sets]
        measured = run_measured(command, log)
        [meta_file] = cache.glob("*/meta.json")
        meta = json.loads(meta_file.read_text())
        phases = meta.get("phases", {})
        row = {"pairs": pairs, **{k: measured[k] for k in ("seconds", "peak_rss_gb")}, "phases": phases}
        train = meta["splits"]["train"]
        row["kept"] = train["kept"]
        row["pairs_per_s"] = round(pairs / measured["seconds"])
        results["runs"].append(row)
        rates = ", ".join(f"{name} {p['pairs_per_s']:,.0f} pairs/s" for name, p in phases.items() if "pairs_per_s" in p)
        print(
            f"{pairs:>12,} pairs: {measured['seconds']:7.1f} s ({row['pairs_per_s']:,} pairs/s), peak RSS "
            f"{measured['peak_rss_gb']:.2f} GB; {rates}",
            flush=True,
        )
    if not args.no_train:
        pairs = args.pairs[-1]
        corpus = CACHE / "data-corpora" / f"synthetic-{pairs}"
        run_dir = CACHE / "data-train-startup"
        shutil.rmtree(run_dir, ignore_errors=True)
        tiny = ["--set", "model.d_model=64", "--set", "model.d_ff=128", "--set", "model.layers=1"]
        tiny += ["--set", "model.heads=2", "--set", "train.max_updates=1", "--set", "train.valid_every=1000"]
        command = [*MTCLI, "train", "--config", "multi30k.yaml", *config(corpus, CACHE / "data-prepare"), *tiny]
        measured = run_measured(
            [*command, "--run-dir", str(run_dir)], CACHE / "data-train.log", until=r"update\s+1 \||at update 1\b"
        )
        results["train_startup"] = {"pairs": pairs, **measured}
        print(
            f"training start-up on {pairs:,} pairs: first update after {measured['until']} s, whole run "
            f"{measured['seconds']} s, peak RSS {measured['peak_rss_gb']:.2f} GB",
            flush=True,
        )
    out = ROOT / "benchmarks" / "data_results.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"bench-data: wrote {out}")


if __name__ == "__main__":
    main()
