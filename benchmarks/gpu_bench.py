"""GPU benchmark: Transformer-base training throughput and MFU (against the card's datasheet peak and a GEMM peak
measured in the run) in the precision `mtcli train` picks, eager and compiled, and beam-4 and greedy decoding as
`mtcli translate` runs them. One step of `make gpu-check` (benchmarks/gpu_check.py); alone:
`python benchmarks/gpu_bench.py`; `--tiny` runs the same logic with a tiny model on any device, e.g. a CPU.

Batches are synthetic: sentence lengths drawn from a log-normal fitted by eye to WMT14 en-de subword lengths
(median ~25), random token ids, cut into token-budget batches of ~25k target tokens by mtcli's own batcher and
collate. The training step is mtcli's own `train_step` on a `Trainer` built as `mtcli train` builds it (fused
projection + label-smoothed loss, fused AdamW, autocast).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the checkout's mtcli, installed or not

from flops import FORMULA, training_flops  # noqa: E402

from mtcli.batching import collate, epoch_batches  # noqa: E402
from mtcli.config import ModelConfig, TrainConfig  # noqa: E402
from mtcli.device import DTYPES, allow_tf32, choose_precision, cpu_name  # noqa: E402
from mtcli.inference import inference_model  # noqa: E402
from mtcli.model import Transformer  # noqa: E402
from mtcli.search import beam_search, greedy_search, max_output_lengths  # noqa: E402
from mtcli.update import Trainer, train_step  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def gemm_peak_tflops(device, dtype, n: int) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    best = math.inf
    for _ in range(10):
        start = time.perf_counter()
        for _ in range(5):
            a @ b
        sync(device)
        best = min(best, (time.perf_counter() - start) / 5)
    return 2 * n**3 / best / 1e12


def synthetic_batches(n_sentences: int, max_tokens: int, vocab: int, max_len: int, device, seed: int = 0):
    """Token-budget batches of random ids (without specials: collate adds EOS and BOS), on the device."""
    rng = np.random.default_rng(seed)
    src_lens = np.clip(rng.lognormal(np.log(25), 0.5, n_sentences), 3, max_len).astype(np.int64)
    tgt_lens = np.clip(src_lens * rng.normal(1.05, 0.15, n_sentences), 3, max_len).astype(np.int64)
    batches = []
    for indices in epoch_batches(src_lens, tgt_lens, max_tokens, seed, 0):
        s, t = src_lens[indices], tgt_lens[indices]
        srcs = [rng.integers(4, vocab, n - 1) for n in s]  # the lengths count EOS (source) or BOS (target)
        tgts = [rng.integers(4, vocab, n - 1) for n in t]
        batches.append((collate(srcs, tgts).to(device), s, t))
    return batches


def bench_training(model, batches, device, dtype, steps: int, warmup: int, compiled: bool, peak: float) -> dict:
    tc = TrainConfig(lr=1e-4, compile=compiled, label_smoothing=0.1)
    trainer = Trainer.build(model, tc, dtype, device)

    def step(batch):
        train_step(trainer, [batch[0]], batch[0].n_tgt_tokens, tc.lr, tc.clip_norm)

    start = time.perf_counter()
    for i in range(max(warmup, len(batches) if compiled else warmup)):  # compiled: see every shape before timing
        step(batches[i % len(batches)])
    sync(device)
    warmup_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tokens, flops = 0, 0.0
    start = time.perf_counter()
    for i in range(steps):
        batch = batches[i % len(batches)]
        step(batch)
        tokens += int(batch[2].sum())
        flops += training_flops(batch[1], batch[2], model.cfg, model.output.out_features)
    sync(device)
    wall = time.perf_counter() - start
    result = {
        "tgt_tok_per_s": tokens / wall,
        "model_tflops": flops / wall / 1e12,
        "mfu": flops / wall / 1e12 / peak,
        "step_ms": wall / steps * 1000,
        "warmup_s": warmup_s,
        "tgt_tokens_per_step": tokens / steps,
    }
    if device.type == "cuda":
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return result


# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s, by a name fragment of
# torch.cuda.get_device_name (first match wins; fp16 for cards without bf16). MFU is reported against this, and
# against the GEMM peak measured in the same run.
DATASHEET_TFLOPS = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.4),
    ("GH200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM
    ("H800", 989.4),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.1),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("A6000", 154.8),
    ("V100", 125.0),  # fp16
    ("T4", 65.0),  # fp16
)


def datasheet_tflops(device_name: str) -> float | None:
    return next((peak for fragment, peak in DATASHEET_TFLOPS if fragment in device_name), None)


@torch.inference_mode()
def bench_decoding(model, device, precision: str, n_sentences: int, batch_sentences: int, beam: int, vocab: int):
    """Beam search (greedy for beam 1) on random sources, with the model as `mtcli translate` runs it
    (inference.inference_model: bf16 weights, KV cache in the model's dtype). Untrained weights rarely emit EOS, so
    hypotheses run to the length limit (1.2 x source + 10): the figure is a lower bound for a trained model of the
    same size."""
    rng = np.random.default_rng(1)
    lens = np.clip(rng.lognormal(np.log(25), 0.5, n_sentences), 3, 200).astype(np.int64)
    order = np.argsort(-lens)
    model = inference_model(model.eval(), precision, copy=True)
    out_tokens, start = 0, None
    for first in range(-batch_sentences, n_sentences, batch_sentences):  # the first batch is a warm-up
        rows = order[max(first, 0) : max(first, 0) + batch_sentences]
        batch = collate([rng.integers(4, vocab, n - 1) for n in lens[rows]]).to(device)  # lens count EOS
        max_lens = max_output_lengths(torch.as_tensor(lens[rows] - 1), 1.2, 10, model.cfg.max_positions).to(device)
        if beam == 1:
            hyps = [[h] for h in greedy_search(model, batch.src, batch.src_pad_mask, max_lens)]
        else:
            hyps = beam_search(model, batch.src, batch.src_pad_mask, max_lens, beam_size=beam, lenpen=0.6)
        if first < 0:
            sync(device)
            start = time.perf_counter()
            continue
        out_tokens += sum(len(h[0].tokens) + 1 for h in hyps)
    sync(device)
    wall = time.perf_counter() - start
    return {
        "beam": beam,
        "sentences": n_sentences,
        "batch_sentences": batch_sentences,
        "sent_per_s": n_sentences / wall,
        "tgt_tok_per_s": out_tokens / wall,
    }


def run(device: torch.device, tiny: bool, steps: int = 30, compiled: bool = True, log=print) -> dict:
    """Transformer-base (or a tiny model) training eager then compiled, and beam-4 and greedy decoding, in the
    precision `mtcli train` and `mtcli translate` choose on this device."""
    precision, why = choose_precision("auto", device)
    dtype = DTYPES[precision]
    decode_precision, _ = choose_precision("auto", device, training=False)
    if tiny:
        cfg, vocab, max_tokens, n_sent, gemm_n = (
            ModelConfig(layers=1, d_model=64, heads=4, d_ff=128),
            500,
            2000,
            400,
            512,
        )
        steps, warmup, decode_sentences, decode_batch = 3, 2, 32, 16
    else:
        cfg, vocab, max_tokens, n_sent, gemm_n = ModelConfig(), 37000, 27000, 40000, 8192
        warmup, decode_sentences, decode_batch = 10, 1000, 128
    torch.manual_seed(0)
    allow_tf32(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    peak = gemm_peak_tflops(device, dtype, gemm_n)
    datasheet = datasheet_tflops(name) if device.type == "cuda" else None
    log(f"device {device} ({name}), {precision} ({why}); GEMM peak measured {peak:.1f} TFLOP/s, datasheet {datasheet}")
    batches = synthetic_batches(n_sent, max_tokens, vocab, 200, device)
    results = {
        "device": str(device),
        "device_name": name,
        "precision": precision,
        "gemm_peak_tflops": peak,
        "datasheet_tflops": datasheet,
        "model": cfg.__dict__,
        "vocab": vocab,
        "batches": len(batches),
    }
    model = Transformer(cfg, vocab, vocab, joint_vocab=True).to(device)
    results["parameters"] = model.num_parameters()
    for compile_it in (False, True) if compiled else (False,):
        kind = "compiled" if compile_it else "eager"
        r = bench_training(model, batches, device, dtype, steps, warmup, compile_it, peak)
        if datasheet:
            r["mfu_datasheet"] = r["model_tflops"] / datasheet
        results[f"train_{kind}"] = r
        log(
            f"train {kind:8}: {r['tgt_tok_per_s']:,.0f} target tokens/s, MFU {100 * r['mfu']:.1f} % of the measured "
            f"peak"
            + (f", {100 * r['mfu_datasheet']:.1f} % of the datasheet's" if datasheet else "")
            + f" ({r['model_tflops']:.1f} TFLOP/s), {r['step_ms']:.0f} ms/step of {r['tgt_tokens_per_step']:,.0f} "
            f"tokens, peak memory {r.get('peak_memory_gb', float('nan')):.1f} GB, warm-up {r['warmup_s']:.0f} s"
        )
    for beam in (4, 1):
        model = Transformer(cfg, vocab, vocab, joint_vocab=True).to(device)
        r = bench_decoding(model, device, decode_precision, decode_sentences, decode_batch, beam, vocab)
        results[f"decode_beam{beam}"] = r
        log(
            f"decode beam {beam} ({decode_precision}): {r['sent_per_s']:,.1f} sentences/s, {r['tgt_tok_per_s']:,.0f} "
            f"target tokens/s (batches of {r['batch_sentences']}, untrained weights: outputs run to the length limit)"
        )
    results["flops_formula"] = FORMULA
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch: checks the logic on a CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu_results.json"))
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    results = run(
        torch.device(args.device), args.tiny, args.steps, not args.no_compile, log=lambda m: print(m, flush=True)
    )
    Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
