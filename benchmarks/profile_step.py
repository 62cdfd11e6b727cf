"""Where the time of a training update and of a decoding pass goes: torch.profiler over the benchmark's setting
(benchmarks/bench.yaml, Multi30k en->de), operators sorted by their own CPU time.

    python benchmarks/profile_step.py train --precision bf16      # updates of the bench model, first epoch
    python benchmarks/profile_step.py train --base --warmup 3 --updates 4   # Transformer-base shapes
    python benchmarks/profile_step.py decode --precision fp32 --beam 5 --checkpoint PATH

`train` builds the model in this process and runs `--warmup` updates, then profiles `--updates` more through
mtcli's own Trainer and train_step (the same step `mtcli train` runs); it prints the top operators, the share of
matrix products (mm, addmm, bmm, linear and oneDNN's) in the profiled wall time, model GFLOP/s against the
GEMM peak measured just before, and the ceiling the products alone set (model FLOPs over their own time); `--base`
does the same at Transformer-base shapes (bench.py's, ~8k target tokens per update). `decode` translates
test_2016_flickr's first `--sentences` in batches of 64.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import BASE, BASE_TOKENS, CONFIG, gemm_peak_gflops, peers_decode_spec  # noqa: E402
from flops import training_flops  # noqa: E402

from mtcli.batching import collate, epoch_batches  # noqa: E402
from mtcli.config_loader import load_config  # noqa: E402
from mtcli.data import eval_texts, prepare  # noqa: E402
from mtcli.device import DTYPES, keep_freed_memory, keep_onednn_kernels  # noqa: E402
from mtcli.model import Transformer  # noqa: E402
from mtcli.translate import Translator  # noqa: E402
from mtcli.update import Trainer, train_step  # noqa: E402

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "mkldnn::_linear_pointwise")


def report(prof, wall: float, top: int, flops: float | None = None, peak: float | None = None) -> None:
    """The top operators; with `flops` (model FLOPs of the profiled work) and `peak`, also the ceiling the matrix
    products alone set: the model GFLOP/s if every other operation took no time."""
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=top))
    matmul_us = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    total_us = sum(e.self_cpu_time_total for e in events)
    print(f"matrix products' own time: {matmul_us / 1e6:.2f} s of {total_us / 1e6:.2f} s of operator time")
    if flops and peak:
        ceiling = flops / (matmul_us / 1e6) / 1e9
        share = 100 * ceiling / peak
        print(f"products alone: {ceiling:.0f} model GFLOP/s, {share:.1f} % of the {peak:.0f} GFLOP/s peak")
    print(f"profiled wall time {wall:.2f} s (the profiler itself adds some)")


def profile_train(args, cfg, data) -> None:
    precision = DTYPES[args.precision]
    torch.manual_seed(0)
    vocab = data.tokenizer.tgt_vocab_size
    model_cfg, max_tokens = (BASE, BASE_TOKENS) if args.base else (cfg.model, cfg.train.max_tokens)
    model = Transformer(model_cfg, vocab, vocab, joint_vocab=True)
    trainer = Trainer.build(model, cfg.train, precision, torch.device("cpu"))
    split = data.split("train")
    batches = epoch_batches(split.src_lens, split.tgt_lens, max_tokens, cfg.train.seed, args.epoch)
    batches = batches[: args.warmup + args.updates]

    def step(b):
        batch = collate([split.src(j) for j in b], [split.tgt(j) for j in b])
        train_step(trainer, [batch], batch.n_tgt_tokens, 1e-4, 0.0)

    for b in batches[: args.warmup]:
        step(b)
    peak = gemm_peak_gflops(precision)
    timed = batches[args.warmup :]
    flops = sum(training_flops(split.src_lens[b], split.tgt_lens[b], model_cfg, vocab) for b in timed)
    start = time.perf_counter()
    for b in timed:
        step(b)
    plain = time.perf_counter() - start
    print(
        f"{args.updates} updates without the profiler: {plain:.2f} s, {flops / plain / 1e9:.0f} model GFLOP/s, "
        f"{100 * flops / plain / 1e9 / peak:.1f} % of the {args.precision} GEMM peak ({peak:.0f} GFLOP/s)"
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for b in timed:
            step(b)
        wall = time.perf_counter() - start
    report(prof, wall, args.top, flops, peak)


def profile_decode(args, cfg) -> None:
    translator = Translator.from_checkpoint(args.checkpoint, device="cpu", precision=args.precision)
    sources = eval_texts(cfg, "test")[0][: args.sentences]
    decode = peers_decode_spec(translator, args.beam)
    translator.translate(sources[:64], decode)  # warm-up
    start = time.perf_counter()
    translator.translate(sources, decode)
    plain = time.perf_counter() - start
    print(f"{len(sources)} sentences without the profiler: {len(sources) / plain:.1f} sentences/s")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        translator.translate(sources, decode)
        wall = time.perf_counter() - start
    report(prof, wall, args.top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["train", "decode"])
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "int8"])
    parser.add_argument("--warmup", type=int, default=10, help="train: updates before the timed ones")
    parser.add_argument("--updates", type=int, default=20, help="train: updates timed, then profiled")
    parser.add_argument("--epoch", type=int, default=0, help="train: the epoch whose batches are used")
    parser.add_argument("--base", action="store_true", help="train: Transformer-base shapes (bench.py's BASE)")
    parser.add_argument("--checkpoint", help="decode: the model to translate with")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--sentences", type=int, default=320)
    parser.add_argument("--top", type=int, default=30, help="operators to print")
    args = parser.parse_args()
    cfg = load_config(CONFIG)
    torch.set_num_threads(cfg.train.threads)
    keep_freed_memory()
    keep_onednn_kernels()
    if args.what == "train":
        if args.precision == "int8":
            sys.exit("profile_step: int8 is a translation precision")
        profile_train(args, cfg, prepare(cfg))
    else:
        if not args.checkpoint:
            sys.exit("profile_step: decode needs --checkpoint (e.g. benchmarks/cache/decode-run-800/checkpoints/...)")
        profile_decode(args, cfg)


if __name__ == "__main__":
    main()
