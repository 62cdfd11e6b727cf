"""`make gpu-check`: what a session with a GPU for a few minutes (and no network) should learn, in one command.

Each step runs in a process of its own with its own time limit, so one failure or hang does not hide the rest;
the report (printed, and written as JSON) says for each step: ok, failed (with the error's last line), timed out,
or skipped (with why, e.g. a CPU-only machine). On a CPU the CPU-possible steps run, in a few minutes.

    environment     torch, CUDA, the device, the precision `auto` picks for training and for translation
    sdpa_kernels    which SDPA kernel each attention call uses (encoder, decoder self, cross; training and decoding
                    steps; padded and unpadded batches)
    host_reads      device reads from the host per training update and per greedy / beam step
    fused_loss      the fused projection + loss in bf16 and fp16 against fp32 (loss and gradients)
    fp16_step       training steps in fp16 with the loss scaler (the loss must fall)
    graph_breaks    torch.compile of model + loss over batches of new shapes: graph breaks and graphs made
    toy_smoke       `mtcli train --config toy.yaml` on the device, then eval (BLEU) and translate (我喜欢苹果);
                    sentences/s through Translator (what `mtcli translate` runs), beam 4 and greedy
    base_bench      Transformer-base training tokens/s and MFU, eager then compiled, beam-4 and greedy decoding
                    (GPU only: on a CPU, `make bench` measures training)

Runs from a plain checkout: mtcli is read from here (PYTHONPATH), never installed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mtcli import attention  # noqa: E402
from mtcli.batching import collate  # noqa: E402
from mtcli.config import ModelConfig, TrainConfig  # noqa: E402
from mtcli.device import DTYPES, choose_precision, cpu_bf16_units, cpu_name  # noqa: E402
from mtcli.host_reads import count_host_reads  # noqa: E402
from mtcli.loss import projection_cross_entropy  # noqa: E402
from mtcli.model import Transformer  # noqa: E402
from mtcli.outputs import write_file_atomic  # noqa: E402
from mtcli.search import beam_search, greedy_search  # noqa: E402
from mtcli.update import Trainer, train_step  # noqa: E402

# (name, seconds allowed, GPU only)
STEPS = (
    ("environment", 60, False),
    ("sdpa_kernels", 90, False),
    ("host_reads", 120, False),
    ("fused_loss", 90, False),
    ("fp16_step", 90, False),
    ("graph_breaks", 180, False),
    ("toy_smoke", 300, False),
    ("base_bench", 330, True),
)


def tiny_model(device, vocab: int = 300, dropout: float = 0.1) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(layers=2, d_model=128, heads=4, d_ff=256, dropout=dropout)
    return Transformer(cfg, vocab, vocab, joint_vocab=True).to(device)


def random_batches(shapes, device, vocab: int = 300, seed: int = 0):
    """One batch per (sentences, source length, target length); `-` lengths: every other sentence 3 shorter, so the
    batch has padding."""
    rng = np.random.default_rng(seed)
    out = []
    for B, S, T in shapes:
        src_lens = [abs(S) - (3 if S < 0 and i % 2 else 0) for i in range(B)]
        tgt_lens = [abs(T) - (3 if T < 0 and i % 2 else 0) for i in range(B)]
        srcs = [rng.integers(4, vocab, n) for n in src_lens]
        out.append(collate(srcs, [rng.integers(4, vocab, n) for n in tgt_lens]).to(device))
    return out


def training_dtype(device) -> torch.dtype:
    return DTYPES[choose_precision("auto", device)[0]]


# ---------------------------------------------------------------------------------------------------------------------
# Steps: each returns a JSON-able dict


def environment(device) -> dict:
    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu": cpu_name(),
        "cpu_bf16_units": cpu_bf16_units(),
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gb": round(props.total_memory / 2**30, 1),
            "cudnn": torch.backends.cudnn.version(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
        }
    info["training_precision"] = choose_precision("auto", device)
    info["translation_precision"] = choose_precision("auto", device, training=False)
    return info


def sdpa_kernels(device) -> dict:
    """Every attention call of a training forward/backward and of a greedy search, labelled by the layer kind; the
    kernel SDPA picks for those arguments (torch._fused_sdp_choice), or the CPU fast path's batched products."""
    backends = {int(b.value): name for name, b in torch.nn.attention.SDPBackend.__members__.items()}
    seen: dict[str, set] = {}
    label = ["?"]

    def hook(kind):
        def pre(module, args, kwargs):
            label[0] = kind if kind != "decoder self" or not kwargs.get("cache") else "decoder self, cached step"

        return pre

    original_sdpa, original_attend = F.scaled_dot_product_attention, attention.attend

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        choice = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal)
        detail = f"{backends.get(choice, choice)} (mask {'yes' if attn_mask is not None else 'no'}, causal {is_causal})"
        seen.setdefault(f"{phase[0]}: {label[0]}", set()).add(detail)
        return original_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    def attend(q, k, v, mask, causal, dropout):
        on_cpu_fast_path = q.device.type == "cpu" and (torch.is_autocast_enabled("cpu") or not torch.is_grad_enabled())
        if on_cpu_fast_path and q.dtype == k.dtype:
            seen.setdefault(f"{phase[0]}: {label[0]}", set()).add("CPU fast path (batched products, fp32 softmax)")
        return original_attend(q, k, v, mask, causal, dropout)

    phase = ["?"]
    model = tiny_model(device)
    for layer in model.encoder:
        layer.self_attn.register_forward_pre_hook(hook("encoder self"), with_kwargs=True)
    for layer in model.decoder:
        layer.self_attn.register_forward_pre_hook(hook("decoder self"), with_kwargs=True)
        layer.cross_attn.register_forward_pre_hook(hook("cross"), with_kwargs=True)
    dtype = training_dtype(device)
    F.scaled_dot_product_attention, attention.attend = sdpa, attend
    try:
        # a CPU trains fp32 through SDPA and bf16 through its fast path: both are shown
        for train_dtype in [dtype] + ([torch.float32] if device.type == "cpu" and dtype != torch.float32 else []):
            trainer = Trainer.build(model, TrainConfig(lr=1e-4), train_dtype, device)
            for padding, shape in (("padded", (8, -24, -26)), ("unpadded", (8, 24, 26))):
                phase[0] = f"training {str(train_dtype)[6:]}, {padding} batch"
                (batch,) = random_batches([shape], device)
                train_step(trainer, [batch], batch.n_tgt_tokens, 1e-4, 1.0)
        phase[0] = "decoding (greedy)"
        model.eval()
        decode_dtype = DTYPES.get(choose_precision("auto", device, training=False)[0], torch.float32)
        (batch,) = random_batches([(8, -24, 2)], device)
        with torch.autocast(device.type, dtype=decode_dtype, enabled=decode_dtype != torch.float32):
            greedy_search(model, batch.src, batch.src_pad_mask, torch.full((8,), 8, device=device))
    finally:
        F.scaled_dot_product_attention, attention.attend = original_sdpa, original_attend
    return {"precision": str(dtype), "calls": {key: sorted(value) for key, value in sorted(seen.items())}}


def host_reads(device) -> dict:
    """Reads of tensor values from the host (each one waits for the GPU): per update of 4 micro-batches, and per
    greedy and beam step (the length limits are read once before the steps). On a CPU the fused loss takes the
    GPU's branch-free path here (on a CPU it branches, since a read costs nothing there)."""
    import mtcli.loss

    mtcli.loss.branch_free = lambda device: True
    model = tiny_model(device)
    trainer = Trainer.build(model, TrainConfig(lr=1e-4), training_dtype(device), device)
    batches = random_batches([(8, -12, -14), (5, -30, -21), (16, 6, 7), (3, -40, -41)], device)
    train_step(trainer, batches, sum(b.n_tgt_tokens for b in batches), 1e-4, 1.0)  # warm-up
    with count_host_reads(device.type) as reads:
        train_step(trainer, batches, sum(b.n_tgt_tokens for b in batches), 1e-4, 1.0)
    result = {"per_update_of_4_micro_batches": reads.total, "update_reads": dict(reads.by_name)}
    model.eval()
    (batch,) = random_batches([(6, -9, 2)], device)
    max_lens = torch.tensor([1, 3, 6, 9, 12, 20], device=device)
    for name, search in (
        ("greedy", lambda: greedy_search(model, batch.src, batch.src_pad_mask, max_lens)),
        ("beam4", lambda: beam_search(model, batch.src, batch.src_pad_mask, max_lens, beam_size=4, lenpen=0.6)),
    ):
        steps = [0]

        def counted(*args, decode=model.decode, steps=steps, **kwargs):
            steps[0] += 1
            return decode(*args, **kwargs)

        model.decode = counted
        with count_host_reads(device.type) as reads:
            search()
        del model.decode
        result[f"{name}_steps"], result[f"{name}_reads"] = steps[0], reads.total
        result[f"{name}_reads_per_step"] = round(reads.total / steps[0], 3)
    if device.type == "cuda":  # torch's own count of synchronizing calls, which also sees reads inside C++ ops
        result["cuda_sync_warnings_per_update"] = cuda_sync_warnings(
            lambda: train_step(trainer, batches, 100, 1e-4, 1.0)
        )
    return result


def cuda_sync_warnings(fn) -> int:
    import warnings

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def fused_loss(device) -> dict:
    """The fused projection + label-smoothed loss (sum over rows) and its gradients under bf16 and fp16 autocast,
    against fp32; relative errors."""
    torch.manual_seed(0)
    rows, d, vocab = (4096, 512, 32000) if device.type == "cuda" else (1500, 256, 8000)
    hidden = (torch.randn(rows, d, device=device) * 0.5).requires_grad_()
    weight = (torch.randn(vocab, d, device=device) * d**-0.5).requires_grad_()
    labels = torch.randint(4, vocab, (rows,), device=device)

    def run(dtype):
        hidden.grad = weight.grad = None
        with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = projection_cross_entropy(hidden, weight, labels, 0.1)
        loss.backward()
        return float(loss), hidden.grad.float().clone(), weight.grad.float().clone()

    reference = run(None)
    result = {"rows": rows, "d_model": d, "vocab": vocab, "fp32_loss_per_token": reference[0] / rows}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        try:
            loss, g_hidden, g_weight = run(dtype)
        except RuntimeError as e:  # e.g. a CPU without fp16 kernels
            result[name] = f"not available: {str(e).splitlines()[0]}"
            continue
        result[name] = {
            "loss_rel_error": abs(loss - reference[0]) / abs(reference[0]),
            "grad_hidden_rel_error": float((g_hidden - reference[1]).norm() / reference[1].norm()),
            "grad_weight_rel_error": float((g_weight - reference[2]).norm() / reference[2].norm()),
            "finite": bool(np.isfinite(loss) and torch.isfinite(g_hidden).all() and torch.isfinite(g_weight).all()),
        }
    return result


def fp16_step(device) -> dict:
    """Five fp16 updates with the loss scaler: finite, the scale, the loss going down on a repeated batch."""
    trainer = Trainer.build(tiny_model(device), TrainConfig(lr=1e-3), torch.float16, device)
    (batch,) = random_batches([(16, -20, -22)], device)
    losses, norms = [], []
    for _ in range(5):
        step = train_step(trainer, [batch], batch.n_tgt_tokens, 1e-3, 1.0)
        losses.append(float(step.loss_sum) / batch.n_tgt_tokens)
        norms.append(step.gnorm)
    return {
        "scaler_enabled": trainer.scaler.is_enabled(),
        "scale": trainer.scaler.get_scale() if trainer.scaler.is_enabled() else None,
        "loss_per_token": losses,
        "grad_norms": norms,
        "ok": all(np.isfinite(losses)) and losses[-1] < losses[0],
    }


def graph_breaks(device) -> dict:
    """torch.compile(dynamic=True) of the model and its loss (train.compile) on batches of five shapes."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    trainer = Trainer.build(
        tiny_model(device, dropout=0.0), TrainConfig(lr=1e-4, compile=True), training_dtype(device), device
    )
    shapes = [(8, -12, -14), (6, -20, -9), (9, -7, -23), (4, -30, -31), (12, 5, 6)]
    start = time.perf_counter()
    for batch in random_batches(shapes, device):
        train_step(trainer, [batch], batch.n_tgt_tokens, 1e-4, 1.0)
    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "break_reasons": {k.splitlines()[0]: v for k, v in counters["graph_break"].items()},
        "graphs": counters["stats"]["unique_graphs"],
        "batch_shapes": len(shapes),
        "seconds": round(time.perf_counter() - start, 1),
    }


def toy_smoke(device) -> dict:
    """The README's first command on this device: train the toy model, score its test split, translate."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    mtcli = [sys.executable, "-m", "mtcli"]
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "toy"
        start = time.perf_counter()
        trained = subprocess.run(
            [*mtcli, "train", "--config", "toy.yaml", "--run-dir", str(run), "--set", f"train.device={device}",
             "--set", f"data.cache_dir={tmp}/cache"],
            capture_output=True, text=True, cwd=tmp, env=env,
        )  # fmt: skip
        if trained.returncode:
            raise RuntimeError(f"mtcli train failed: {trained.stderr.strip().splitlines()[-1]}")
        train_s = time.perf_counter() - start
        scored = subprocess.run(
            [*mtcli, "eval", "--run", str(run), "--json", "--device", str(device)],
            capture_output=True, text=True, cwd=tmp, env=env, check=True,
        )  # fmt: skip
        translated = subprocess.run(
            [*mtcli, "translate", "--run", str(run), "--device", str(device), "I love apples"],
            capture_output=True, text=True, cwd=tmp, env=env, check=True,
        )  # fmt: skip
        log = trained.stderr
        speed = translation_speed(run, device)
    bleu = json.loads(scored.stdout)["bleu"]
    output = translated.stdout.strip()
    precision = next((line.split("precision: ", 1)[1] for line in log.splitlines() if "precision: " in line), None)
    return {
        "train_seconds": round(train_s, 1),
        "precision": precision,
        "test_bleu": bleu,
        "i_love_apples": output,
        "ok": bleu >= 80 and output == "我喜欢苹果",
        "translate_sentences_per_s": speed,
    }


def translation_speed(run: Path, device) -> dict:
    """Sentences per second through Translator (what `mtcli translate` and the server call) on 2,000 toy sentences,
    beam 4 and greedy, in the translation precision auto picks; after a warm-up pass."""
    from mtcli.toy import toy_pairs
    from mtcli.translate import Translator

    translator = Translator.from_run(run, device=str(device))
    lines = [en for en, _ in toy_pairs(2000, 0, 0, seed=7)["train"]]
    speed = {"precision": translator.precision}
    for beam in (4, 1):
        translator.translate(lines[:200], beam=beam)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        translator.translate(lines, beam=beam)
        speed[f"beam{beam}"] = round(len(lines) / (time.perf_counter() - start), 1)
    return speed


def base_bench(device) -> dict:
    import gpu_bench

    return gpu_bench.run(device, tiny=False, log=lambda m: print(m, file=sys.stderr, flush=True))


# ---------------------------------------------------------------------------------------------------------------------
# The driver


def run_step(name: str, limit: int, device: str, gpu_only: bool) -> dict:
    if gpu_only and not device.startswith("cuda"):
        return {"status": "skipped", "why": "needs a GPU (on a CPU, make bench measures training)"}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, "--step", name, "--device", device, "--result", out.name]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            return {"status": "timed out", "limit_s": limit}
        seconds = round(time.perf_counter() - start, 1)
        if proc.returncode:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            return {"status": "failed", "error": last, "seconds": seconds}
        result = json.loads(Path(out.name).read_text())
        # a step that ran but whose check did not hold (e.g. the toy smoke under BLEU 80)
        return {"status": "ok" if result.get("ok", True) else "not ok", "seconds": seconds, "result": result}


def foreign_report(out: Path) -> str | None:
    """Why --out must not be written (a folder, a missing folder, a file that is not an earlier gpu-check report:
    nothing this command did not write is replaced), or None."""
    if out.is_dir():
        return "is a folder; give a file name"
    if not out.parent.is_dir():
        return f"the folder {out.parent} does not exist"
    if out.exists() and out.stat().st_size:
        try:
            earlier = json.loads(out.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            earlier = None
        if not (isinstance(earlier, dict) and {"started", "device", "steps"} <= set(earlier)):
            return "exists and is not a gpu-check report; give another file"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", default="", help="comma-separated step names")
    parser.add_argument("--out", default=str(Path(os.environ.get("OUT") or ROOT / "benchmarks") / "gpu_check.json"))
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:  # one step, in its own process
        try:
            result = globals()[args.step](torch.device(args.device))
        except Exception:
            traceback.print_exc()
            return 1
        Path(args.result).write_text(json.dumps(result, default=str))
        return 0
    refusal = foreign_report(Path(args.out))
    if refusal:
        print(f"gpu-check: --out {args.out}: {refusal}", file=sys.stderr)
        return 2
    wanted = set(filter(None, args.only.split(",")))
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "device": args.device, "steps": {}}
    print(f"gpu-check on {args.device} ({cpu_name()} host); report: {args.out}", flush=True)
    for name, limit, gpu_only in STEPS:
        if wanted and name not in wanted:
            continue
        outcome = run_step(name, limit, args.device, gpu_only)
        report["steps"][name] = outcome
        shown = outcome.get("result", {k: v for k, v in outcome.items() if k != "status"})
        summary = json.dumps(shown, default=str, ensure_ascii=False)
        print(f"{name:13} {outcome['status']:9} {outcome.get('seconds', '')!s:>6} s  {summary[:600]}", flush=True)
        write_file_atomic(Path(args.out), json.dumps(report, indent=1, default=str, ensure_ascii=False) + "\n")
    failed = [n for n, o in report["steps"].items() if o["status"] in ("failed", "timed out", "not ok")]
    skipped = [n for n, o in report["steps"].items() if o["status"] == "skipped"]
    print(f"gpu-check: {len(report['steps']) - len(failed) - len(skipped)} ok, failed {failed or 'none'}, skipped "
          f"{skipped or 'none'}; {args.out}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
