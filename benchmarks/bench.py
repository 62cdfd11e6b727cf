"""`make bench`: training and decoding speed on Multi30k en->de with the model fixed in benchmarks/bench.yaml.

1. float32 GEMM peak of this machine (a large torch.mm, best of several), with the benchmark's thread count;
2. training: `mtcli train` in a child process for 110 updates; updates 11-110 are timed from the per-update
   timestamps in metrics.jsonl: target tokens/s, wall time, peak RSS of the child, padding efficiency, and model
   FLOPs utilisation = analytic training FLOPs of exactly those batches / wall time / GEMM peak;
3. decoding: a model trained for 800 updates (kept in benchmarks/cache/ between runs), test_2016_flickr in batches of
   64 sentences, greedy and beam 5: sentences/s, target tokens/s and BLEU.
Writes benchmarks/results.json and prints a table. Needs ../shared/data/multi30k.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from flops import FORMULA, training_flops  # noqa: E402

from mtcli.batching import epoch_batches, padding_counts  # noqa: E402
from mtcli.checkpoint import last_checkpoint  # noqa: E402
from mtcli.config import load_config  # noqa: E402
from mtcli.data import eval_texts, prepare  # noqa: E402
from mtcli.device import keep_freed_memory  # noqa: E402
from mtcli.evaluate import score  # noqa: E402
from mtcli.translate import Translator  # noqa: E402

CONFIG = ROOT / "benchmarks" / "bench.yaml"
CACHE = ROOT / "benchmarks" / "cache"
WARMUP_UPDATES, TIMED_UPDATES, DECODE_MODEL_UPDATES = 10, 100, 800


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def gemm_peak_gflops(n: int = 2048, repeats: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def train_run(run: Path, updates: int, log_every: int) -> None:
    """`mtcli train` with the benchmark config in a child process (its peak RSS is then the child's own)."""
    shutil.rmtree(run, ignore_errors=True)
    sets = [f"train.max_updates={updates}", f"train.log_every={log_every}"]
    args = ["train", "--config", str(CONFIG), "--run-dir", str(run), *[x for s in sets for x in ("--set", s)]]
    subprocess.run([sys.executable, "-m", "mtcli", *args], cwd=ROOT, check=True)


def bench_training(cfg, data, peak: float) -> dict:
    run = CACHE / "train-run"
    train_run(run, WARMUP_UPDATES + TIMED_UPDATES, log_every=10)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the training child, the first one
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timed = records[WARMUP_UPDATES:]
    wall = timed[-1]["time"] - records[WARMUP_UPDATES - 1]["time"]
    tokens = sum(r["tokens"] for r in timed)
    # The same batches the run consumed (one process, one micro-batch per update, epoch 0 of the seed).
    split = data.split("train")
    tc = cfg.train
    batches = epoch_batches(split.src_lens, split.tgt_lens, tc.max_tokens, tc.seed, 0)
    used = batches[WARMUP_UPDATES : WARMUP_UPDATES + TIMED_UPDATES]
    assert sum(int(split.tgt_lens[b].sum()) for b in used) == tokens, "batches differ from the run's"
    flops = sum(
        training_flops(split.src_lens[b], split.tgt_lens[b], cfg.model, data.tokenizer.tgt_vocab_size) for b in used
    )
    src_pad, tgt_pad = padding_counts(used, split.src_lens), padding_counts(used, split.tgt_lens)
    return {
        "train_tgt_tok_per_s": tokens / wall,
        "train_wall_s": wall,
        "train_updates_timed": len(timed),
        "train_tgt_tokens_per_batch": tokens / len(timed),
        "train_padding_efficiency": (src_pad + tgt_pad).efficiency,
        "train_padding_efficiency_tgt": tgt_pad.efficiency,
        "train_flops_per_tgt_token": flops / tokens,
        "train_model_gflops": flops / wall / 1e9,
        "train_mfu": flops / wall / 1e9 / peak,
        "peak_rss_mb": peak_rss_mb,
    }


def decode_model() -> Path:
    run = CACHE / f"decode-run-{DECODE_MODEL_UPDATES}"
    ckpt = last_checkpoint(run)
    if ckpt is None or not ckpt.name.endswith(f"{DECODE_MODEL_UPDATES:08d}"):
        print(f"training the decoding model ({DECODE_MODEL_UPDATES} updates, once; kept in {run})", flush=True)
        train_run(run, DECODE_MODEL_UPDATES, log_every=100)
        ckpt = last_checkpoint(run)
    return ckpt


def bench_decoding(cfg) -> dict:
    translator = Translator.from_checkpoint(decode_model(), device="cpu")
    sources, references = eval_texts(cfg, "test")
    results = {}
    for name, beam in (("greedy", 1), ("beam5", 5)):
        decode = replace(
            translator.config.decode,
            beam=beam,
            nbest=1,
            lenpen=0.6,
            batch_tokens=10**9,
            batch_sentences=64,
            sampling=False,
        )
        translator.translate(sources[:64], decode)  # warm-up
        start = time.perf_counter()
        hyps = translator.translate_nbest(sources, decode)
        wall = time.perf_counter() - start
        tokens = sum(len(h[0].tokens) + 1 for h in hyps)  # with EOS
        texts = [h[0].text for h in hyps]
        results.update(
            {
                f"decode_{name}_sent_per_s": len(sources) / wall,
                f"decode_{name}_tok_per_s": tokens / wall,
                f"decode_{name}_wall_s": wall,
                f"bleu_{name}": score(texts, references, "de")["bleu"],
            }
        )
    results["decode_sentences"] = len(sources)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-decode", action="store_true", help="only the GEMM peak and training")
    args = parser.parse_args()
    os.chdir(ROOT)
    if not (ROOT.parent / "shared" / "data" / "multi30k").is_dir():
        sys.exit("bench: ../shared/data/multi30k not found (the benchmark runs on the shared Multi30k copy)")
    cfg = load_config(CONFIG)
    torch.set_num_threads(cfg.train.threads)
    keep_freed_memory()  # as the mtcli command does
    data = prepare(cfg)
    results = {"machine": machine(), "config": str(CONFIG.relative_to(ROOT)), "command": "make bench"}
    peak = gemm_peak_gflops()
    results["gemm_peak_gflops"] = peak
    print(f"float32 GEMM peak: {peak:.1f} GFLOP/s ({torch.get_num_threads()} threads)", flush=True)
    results.update(bench_training(cfg, data, peak))
    if not args.skip_decode:
        results.update(bench_decoding(cfg))
    results["flops_formula"] = FORMULA
    (ROOT / "benchmarks" / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print_table(results)


def print_table(r: dict) -> None:
    m = r["machine"]
    print(f"\nmtcli benchmark: {m['cpu']}, {m['threads']} threads, torch {m['torch']}")
    rows = [
        ("GEMM peak (float32)", f"{r['gemm_peak_gflops']:.1f} GFLOP/s"),
        ("train: target tokens/s", f"{r['train_tgt_tok_per_s']:,.0f}"),
        ("train: model FLOPs utilisation", f"{100 * r['train_mfu']:.1f} % ({r['train_model_gflops']:.1f} GFLOP/s)"),
        ("train: FLOPs per target token", f"{r['train_flops_per_tgt_token'] / 1e6:.1f} M"),
        ("train: target tokens per batch", f"{r['train_tgt_tokens_per_batch']:,.0f}"),
        ("train: padding efficiency", f"{r['train_padding_efficiency']:.3f}"),
        ("train: wall time (100 updates)", f"{r['train_wall_s']:.1f} s"),
        ("train: peak RSS", f"{r['peak_rss_mb']:,.0f} MB"),
    ]
    if "decode_greedy_sent_per_s" in r:
        for name in ("greedy", "beam5"):
            rows += [
                (f"decode {name}: sentences/s", f"{r[f'decode_{name}_sent_per_s']:.1f}"),
                (f"decode {name}: target tokens/s", f"{r[f'decode_{name}_tok_per_s']:,.0f}"),
                (f"decode {name}: BLEU (test_2016_flickr)", f"{r[f'bleu_{name}']:.2f}"),
            ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    print(f"\nFLOPs counted:\n{r['flops_formula']}\nresults: benchmarks/results.json")


if __name__ == "__main__":
    main()
