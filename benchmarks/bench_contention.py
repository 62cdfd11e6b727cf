"""Training on a shared machine: target tokens/s of `mtcli train --config toy.yaml` alone, beside one and beside
three other copies of itself (each with the default thread count), and the share of its solo speed each copy gets.
A fair machine gives each of k copies about 1/k of the solo speed (the cores split k ways); OpenMP threads that
spin-wait at barriers while their partners are descheduled give far less.

    python benchmarks/bench_contention.py                       # 1, 2 and 4 copies, mtcli as it is
    python benchmarks/bench_contention.py --env OMP_WAIT_POLICY=ACTIVE   # the same with extra environment

Each copy is a separate `mtcli train` process on the toy corpus (prepared once, before timing); tokens/s are taken
from the per-update timestamps in metrics.jsonl, over the updates after the first 20 (start-up, kernel building)
and before the last validation. Copies start together. Prints a table and writes benchmarks/contention.json
(--json elsewhere). Run it on an otherwise idle machine: other load counts as competition.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MTCLI = [sys.executable, "-m", "mtcli"]
SKIP = 20  # updates left out at the start of each run


OWN_JSON = ROOT / "benchmarks" / "contention.json"  # replaced by each run; another existing file is refused


def train_command(run: Path, cache: Path, updates: int) -> list[str]:
    sets = {
        "data.cache_dir": cache,
        "train.max_updates": updates,
        "train.valid_every": updates,
        "train.log_every": 1,
        "train.keep_last": 1,
    }
    return [*MTCLI, "train", "--config", "toy.yaml", "--run-dir", str(run)] + [
        x for k, v in sets.items() for x in ("--set", f"{k}={v}")
    ]


def tokens_per_second(run: Path) -> tuple[float, float, float]:
    """Target tokens/s over updates SKIP+1..end, and that window's start and end (epoch seconds)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "tokens" in r and "time" in r]
    window = records[SKIP:]
    tokens = sum(r["tokens"] for r in window[1:])
    return tokens / (window[-1]["time"] - window[0]["time"]), window[0]["time"], window[-1]["time"]


def run_copies(copies: int, cache: Path, work: Path, updates: int, env: dict) -> list[dict]:
    runs = [work / f"copies{copies}-{i}" for i in range(copies)]
    procs = [
        subprocess.Popen(train_command(run, cache, updates), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for run in runs
    ]
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode:
            sys.exit(f"a training copy failed:\n{err.decode()[-2000:]}")
    rows = []
    for run in runs:
        speed, start, end = tokens_per_second(run)
        rows.append({"tok_s": round(speed), "start": start, "end": end})
    # the windows must overlap for the copies to have competed throughout
    overlap = min(r["end"] for r in rows) - max(r["start"] for r in rows)
    longest = max(r["end"] - r["start"] for r in rows)
    for r in rows:
        r["overlap"] = round(max(overlap, 0) / longest, 2)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", default="1,2,4", help="comma-separated numbers of concurrent trainings")
    parser.add_argument("--updates", type=int, default=150, help="updates per training (the first 20 untimed)")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE added to each copy's environment")
    parser.add_argument("--json", type=Path, default=OWN_JSON)
    args = parser.parse_args()
    own_json = args.json.resolve() == OWN_JSON
    if args.json.exists() and not own_json:  # before the measuring, not after
        sys.exit(f"contention: --json {args.json}: exists; give a new name (only {OWN_JSON} is replaced)")
    env = dict(os.environ)
    for item in args.env:
        key, _, value = item.partition("=")
        env[key] = value
    with tempfile.TemporaryDirectory(prefix="mtcli-contention-") as tmp:
        work, cache = Path(tmp), Path(tmp) / "cache"
        subprocess.run([*MTCLI, "data", "prepare", "--config", "toy.yaml", "--set", f"data.cache_dir={cache}"],
                       check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        results, solo = {}, None
        for copies in [int(c) for c in args.copies.split(",")]:
            began = time.time()
            rows = run_copies(copies, cache, work, args.updates, env)
            solo = solo or (rows[0]["tok_s"] if copies == 1 else None)
            results[copies] = {"rows": rows, "seconds": round(time.time() - began, 1)}
            speeds = ", ".join(f"{r['tok_s']:,}" for r in rows)
            share = ""
            if solo:
                shares = [r["tok_s"] / (solo / copies) for r in rows]
                share = f"; each {min(shares):.2f}-{max(shares):.2f}x a fair 1/{copies} of solo"
            overlap = min(r["overlap"] for r in rows)
            took = results[copies]["seconds"]
            print(
                f"{copies} copies: target tok/s {speeds}{share} (windows overlap {overlap:.0%}; {took} s)", flush=True
            )
    from mtcli.device import cpu_name  # imported late: importing mtcli sets the OpenMP wait the copies inherit
    from mtcli.outputs import new_file

    report = {"cpu": cpu_name(), "cores": os.cpu_count(), "env": args.env, "updates": args.updates, "results": results}
    with new_file(args.json, force=own_json, option="--json") as out:
        out.write(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
