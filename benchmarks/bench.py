"""`make bench`: training and decoding speed on Multi30k en->de with the model fixed in benchmarks/bench.yaml, in
every precision this CPU runs well.

1. GEMM peaks (2048 x 2048 torch.mm, best of several, the benchmark's threads) in fp32 and, where the CPU has bf16
   matrix units, bf16; what `train.precision: auto` picks here and why;
2. training: `mtcli train` in a child process for one epoch and 110 updates, in rounds of alternating order (fp32,
   bf16; then bf16, fp32; `--rounds`, default 2), the GEMM peaks measured again after each run. A shared host lends
   its matrix units unevenly (the bf16 rate was seen to swing 650-2,170 GFLOP/s within minutes); alternation
   exposes both precisions to the same stretches, and each precision's best round is reported (interference only
   slows a run down), with every round's figures and the peaks' largest change beside it. Updates 11-110 (the
   peers' window) and updates 11-110 of the second epoch (steady state) are timed from the per-update timestamps in
   metrics.jsonl: target tokens/s, wall time, peak RSS of the child, padding efficiency, and model FLOPs utilisation
   = analytic training FLOPs of exactly those batches / wall time / the highest GEMM peak of that precision in the
   run;
3. Transformer-base shapes (6+6 layers, d_model 512, 8 heads, d_ff 2048) on the same data: a few timed updates of
   ~8k target tokens in fp32 and bf16, tok/s and MFU;
4. decoding: models trained for 800 updates in fp32 and in bf16 (kept in benchmarks/cache/ between runs),
   test_2016_flickr in batches of 64 sentences, greedy and beam 5, with the fp32 model translated in fp32, bf16 and
   int8: sentences/s, target tokens/s and BLEU.
Writes benchmarks/results.json and prints a table. Needs ../shared/data/multi30k. `--quick` skips the 800-update
models and decoding; `--skip-base` the base-size part.

`--peers` measures the peers in the same run, back to back (set them up first: `bash ../shared/peers/setup.sh all`):
fairseq and HF Marian (`../shared/peers/bench.sh all`) and Marian C++ (`benchmarks/marian_peer.py`) train the same
spec first, each under the peers' CPU lock; then mtcli's own figures above, holding that lock; then CTranslate2 and
mtcli decode the same exported model (`benchmarks/decode_vs_ct2.py`). results.json gets their figures and the ratios.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from flops import FORMULA, training_flops  # noqa: E402
from marian_peer import LOCK, PEERS  # noqa: E402

from mtcli.batching import collate, epoch_batches, padding_counts  # noqa: E402
from mtcli.checkpoint import last_checkpoint  # noqa: E402
from mtcli.config import ModelConfig  # noqa: E402
from mtcli.config_loader import load_config  # noqa: E402
from mtcli.corpus import fingerprint_hash  # noqa: E402
from mtcli.data import cache_key, eval_texts, prepare  # noqa: E402
from mtcli.device import DTYPES, choose_precision, cpu_bf16_units, keep_freed_memory, keep_onednn_kernels  # noqa: E402
from mtcli.model import Transformer  # noqa: E402
from mtcli.scoring import score  # noqa: E402
from mtcli.translate import Translator  # noqa: E402
from mtcli.update import Trainer, train_step  # noqa: E402

CONFIG = ROOT / "benchmarks" / "bench.yaml"
CACHE = ROOT / "benchmarks" / "cache"
WARMUP_UPDATES, TIMED_UPDATES, DECODE_MODEL_UPDATES = 10, 100, 800
BASE = ModelConfig(layers=6, d_model=512, heads=8, d_ff=2048, dropout=0.1, norm="pre", max_positions=256)
BASE_TOKENS, BASE_WARMUP, BASE_TIMED = 8192, 2, 5


def machine() -> dict:
    cpu, flags = platform.processor() or platform.machine(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "avx512_vnni")
    return {
        "cpu": cpu,
        "cpu_flags": [f for f in wanted if f in flags],
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
    }


def gemm_peak_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 10) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def train_run(run: Path, updates: int, log_every: int, precision: str) -> float:
    """`mtcli train` with the benchmark config in a child process; returns the child's own peak RSS in MB (wait4's
    usage is that child's alone, where RUSAGE_CHILDREN would give the largest of all children so far)."""
    shutil.rmtree(run, ignore_errors=True)
    sets = [f"train.max_updates={updates}", f"train.log_every={log_every}", f"train.precision={precision}"]
    args = ["train", "--config", str(CONFIG), "--run-dir", str(run), *[x for s in sets for x in ("--set", s)]]
    child = subprocess.Popen([sys.executable, "-m", "mtcli", *args], cwd=ROOT)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise subprocess.CalledProcessError(child.returncode, child.args)
    return usage.ru_maxrss / 1024  # KB on Linux


def bench_training(cfg, data, precision: str) -> dict:
    """Two windows of one run: updates 11-110 (the peers' spec: the first epoch, where CPU bf16 also pays for
    building a oneDNN kernel per new batch shape) and updates 11-110 of the second epoch (steady state). Returns each
    window's target tokens/s and model GFLOP/s (MFU needs a peak: see combine_rounds)."""
    split, tc = data.split("train"), cfg.train
    epoch_len = len(epoch_batches(split.src_lens, split.tgt_lens, tc.max_tokens, tc.seed, 0))
    run = CACHE / f"train-run-{precision}"
    rss_mb = train_run(run, epoch_len + WARMUP_UPDATES + TIMED_UPDATES, log_every=10, precision=precision)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    vocab = data.tokenizer.tgt_vocab_size
    results = {}
    for epoch, suffix in ((0, ""), (1, "_epoch2")):
        first = epoch * epoch_len + WARMUP_UPDATES  # index of the first timed update's record
        timed = records[first : first + TIMED_UPDATES]
        wall = timed[-1]["time"] - records[first - 1]["time"]
        tokens = sum(r["tokens"] for r in timed)
        # The same batches the run consumed (one process, one micro-batch per update, this epoch of the seed).
        batches = epoch_batches(split.src_lens, split.tgt_lens, tc.max_tokens, tc.seed, epoch)
        used = batches[WARMUP_UPDATES : WARMUP_UPDATES + TIMED_UPDATES]
        assert sum(int(split.tgt_lens[b].sum()) for b in used) == tokens, "batches differ from the run's"
        flops = sum(training_flops(split.src_lens[b], split.tgt_lens[b], cfg.model, vocab) for b in used)
        results[f"train_tgt_tok_per_s{suffix}_{precision}"] = tokens / wall
        results[f"train_model_gflops{suffix}_{precision}"] = flops / wall / 1e9
        if epoch == 0:
            src_pad, tgt_pad = padding_counts(used, split.src_lens), padding_counts(used, split.tgt_lens)
            results.update(
                {
                    f"train_wall_s_{precision}": wall,
                    "train_updates_timed": len(timed),
                    "train_tgt_tokens_per_batch": tokens / len(timed),
                    "train_padding_efficiency": (src_pad + tgt_pad).efficiency,
                    "train_padding_efficiency_tgt": tgt_pad.efficiency,
                    "train_flops_per_tgt_token": flops / tokens,
                }
            )
    results[f"peak_rss_mb_{precision}"] = rss_mb
    return results


def training_rounds(cfg, data, peaks: dict, rounds: int) -> tuple[list[dict], dict]:
    """Training runs in alternating order (fp32, bf16, then bf16, fp32, ...), the GEMM peaks measured before and
    after each. On a shared host the matrix units are lent unevenly (the bf16 rate was seen to swing 650-2,170
    GFLOP/s within minutes); alternating exposes both precisions to the same stretches, and the best round of each
    is the host's uncontended speed (interference only ever slows a run down). `peaks`: the precisions to train and
    their peaks at the start. Returns the rounds and every peak measured."""
    precisions, seen, measured = list(peaks), {p: [v] for p, v in peaks.items()}, []
    for i in range(rounds):
        for precision in precisions if i % 2 == 0 else precisions[::-1]:
            result = bench_training(cfg, data, precision)
            for p in seen:
                seen[p].append(gemm_peak_gflops(DTYPES[p]))
            after = {p: v[-1] for p, v in seen.items()}
            measured.append({"round": i + 1, "precision": precision, "peaks_after": after, **result})
    return measured, seen


def combine_rounds(measured: list[dict], seen: dict) -> dict:
    """Each precision's best round per window, MFU against the highest peak of that precision seen in the run (the
    best speed against the best rate the host lent), every round's figures, and the peaks' largest change."""
    results = {"train_rounds": measured, "gemm_peaks_gflops_before_and_after_each_training_run": seen}
    results["gemm_peak_drift"] = max(max(v) / min(v) - 1 for v in seen.values())
    for p in seen:  # the precisions trained
        mine = [m for m in measured if m["precision"] == p]
        best_first_epoch = max(mine, key=lambda m: m[f"train_tgt_tok_per_s_{p}"])
        results.update({k: v for k, v in best_first_epoch.items() if k not in ("round", "precision", "peaks_after")})
        for suffix in ("", "_epoch2"):
            best = max(mine, key=lambda m: m[f"train_tgt_tok_per_s{suffix}_{p}"])
            for key in (f"train_tgt_tok_per_s{suffix}_{p}", f"train_model_gflops{suffix}_{p}"):
                results[key] = best[key]
            results[f"train_mfu{suffix}_{p}"] = best[f"train_model_gflops{suffix}_{p}"] / max(seen[p])
            results[f"train_tgt_tok_per_s{suffix}_rounds_{p}"] = [m[f"train_tgt_tok_per_s{suffix}_{p}"] for m in mine]
        results[f"peak_rss_mb_{p}"] = max(m[f"peak_rss_mb_{p}"] for m in mine)
    return results


def bench_base(data, precision: str, peak: float) -> dict:
    """Transformer-base shapes on the benchmark's data: BASE_TIMED updates of ~8k target tokens after a warm-up,
    through mtcli's own Trainer and train_step, in this process."""
    torch.manual_seed(0)
    vocab = data.tokenizer.tgt_vocab_size
    model = Transformer(BASE, vocab, vocab, joint_vocab=True)
    train_cfg = load_config(CONFIG).train
    trainer = Trainer.build(model, train_cfg, DTYPES[precision], torch.device("cpu"))
    split = data.split("train")
    batches = epoch_batches(split.src_lens, split.tgt_lens, BASE_TOKENS, 1, 0)[: BASE_WARMUP + BASE_TIMED]
    tokens, flops, start = 0, 0.0, 0.0
    for i, b in enumerate(batches):
        if i == BASE_WARMUP:
            start = time.perf_counter()
        batch = collate([split.src(j) for j in b], [split.tgt(j) for j in b])
        train_step(trainer, [batch], batch.n_tgt_tokens, 1e-4, 0.0)
        if i >= BASE_WARMUP:
            tokens += batch.n_tgt_tokens
            flops += training_flops(split.src_lens[b], split.tgt_lens[b], BASE, vocab)
    wall = time.perf_counter() - start
    return {
        f"base_train_tgt_tok_per_s_{precision}": tokens / wall,
        f"base_train_mfu_{precision}": flops / wall / 1e9 / peak,
        "base_train_tgt_tokens_per_update": tokens / BASE_TIMED,
        "base_parameters": model.num_parameters(),
    }


def decode_model(precision: str) -> Path:
    """The cached 800-update model of this precision, trained again when missing or when the prepared data changed
    (a model from other data, e.g. before the default clean filters, would blur the fp32 / bf16 BLEU gap)."""
    run = CACHE / f"decode-run-{DECODE_MODEL_UPDATES}" if precision == "fp32" else CACHE / f"decode-run-{precision}"
    data_key, stamp = data_stamp(load_config(CONFIG).data), run / "bench-data"
    ckpt = last_checkpoint(run)
    fresh = ckpt is not None and ckpt.name.endswith(f"{DECODE_MODEL_UPDATES:08d}")
    if not (fresh and stamp.exists() and stamp.read_text() == data_key):
        print(f"training the {precision} decoding model ({DECODE_MODEL_UPDATES} updates, once; kept in {run})")
        train_run(run, DECODE_MODEL_UPDATES, log_every=100, precision=precision)
        stamp.write_text(data_key)
        ckpt = last_checkpoint(run)
    return ckpt


def data_stamp(data_cfg) -> str:
    """The data cache's key with the corpus files' contents in place of their modification times, which change each
    time ../shared is provisioned again (the cache folder's name would retrain both models every session)."""
    key = cache_key(data_cfg)
    key["source"] = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(data_cfg.path).iterdir()) if p.is_file()
    }
    return fingerprint_hash(key)


def peers_decode_spec(translator: Translator, beam: int):
    """The peers' decoding spec as mtcli decode settings: batches of 64 sentences, length penalty exponent 1.0 (HF and
    CTranslate2 divide by length ** 1.0, mtcli by GNMT's ((5 + length) / 6) ** 1.0)."""
    return replace(translator.config.decode, beam=beam, nbest=1, lenpen=1.0, batch_tokens=10**9, batch_sentences=64)


def bench_decoding(cfg, checkpoint: Path, precision: str, modes=(("greedy", 1), ("beam5", 5))) -> dict:
    translator = Translator.from_checkpoint(checkpoint, device="cpu", precision=precision)
    sources, references = eval_texts(cfg, "test")
    results = {}
    for name, beam in modes:
        decode = peers_decode_spec(translator, beam)
        translator.translate(sources[:64], decode)  # warm-up
        start = time.perf_counter()
        hyps = translator.translate_nbest(sources, decode)
        wall = time.perf_counter() - start
        tokens = sum(len(h[0].tokens) + 1 for h in hyps)  # with EOS
        results.update(
            {
                f"decode_{name}_sent_per_s_{precision}": len(sources) / wall,
                f"decode_{name}_tok_per_s_{precision}": tokens / wall,
                f"bleu_{name}_{precision}": score([h[0].text for h in hyps], references, "de")["bleu"],
            }
        )
    results["decode_sentences"] = len(sources)
    return results


def peer_training() -> dict:
    """fairseq, HF Marian and Marian C++ on the M30K-small spec: each peer's bench.sh / marian_peer.py figures (target
    tokens/s of updates 11-110, wall time, peak RSS, versions). The scripts take the CPU lock themselves."""
    if not (PEERS / "bench.sh").exists():
        sys.exit(f"bench: --peers needs {PEERS} (the peers' scripts)")
    peers = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = (
            ["bash", str(PEERS / "bench.sh"), "all", "--json", f"{tmp}/peers.json"],
            [sys.executable, str(ROOT / "benchmarks" / "marian_peer.py"), "--json", f"{tmp}/marian.json"],
        )
        for cmd in runs:
            if subprocess.run(cmd, cwd=ROOT).returncode:
                sys.exit(f"bench: {' '.join(cmd[:2])} failed (set the peers up with: bash {PEERS}/setup.sh all)")
            peers.update(json.loads(Path(cmd[-1]).read_text())["peers"])
    return peers


def same_model_decoding(rounds: int) -> dict:
    """mtcli and CTranslate2 decoding the same exported model (benchmarks/decode_vs_ct2.py), its figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "decode.json"
        script = ROOT / "benchmarks" / "decode_vs_ct2.py"
        subprocess.run([sys.executable, str(script), "--rounds", str(rounds), "--json", str(out)], check=True, cwd=ROOT)
        return json.loads(out.read_text())


@contextmanager
def cpu_lock():
    """The peers' CPU lock (../shared/peers/README.md): no peer runs while mtcli is timed, and the reverse."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "a") as lock:
        print(f"bench: waiting for the CPU lock {LOCK}", flush=True)
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="training only: no 800-update models, no decoding")
    parser.add_argument("--skip-base", action="store_true", help="leave out the Transformer-base training figures")
    parser.add_argument("--rounds", type=int, default=2, help="training runs per precision, in alternating order")
    parser.add_argument("--peers", action="store_true", help="the peers in the same run (see above)")
    args = parser.parse_args()
    os.chdir(ROOT)
    if not (ROOT.parent / "shared" / "data" / "multi30k").is_dir():
        sys.exit("bench: ../shared/data/multi30k not found (the benchmark runs on the shared Multi30k copy)")
    if args.peers and args.quick:
        sys.exit("bench: --peers compares decoding too; leave out --quick")
    cfg = load_config(CONFIG)
    torch.set_num_threads(cfg.train.threads)
    keep_freed_memory()  # as the mtcli command does
    keep_onednn_kernels()
    data = prepare(cfg)
    results = {"machine": machine(), "config": str(CONFIG.relative_to(ROOT)), "command": "make bench"}
    if args.peers:
        results["command"] = "make bench BENCH_ARGS=--peers"
        results["peers_train"] = peer_training()
    with cpu_lock() if args.peers else nullcontext():
        results.update(measure(cfg, data, args))
        if args.peers:  # decode_vs_ct2.py builds on this module: run as its own script, it imports nothing back
            results["peers_decode_same_model"] = same_model_decoding(rounds=3)
    if args.peers:
        results["mtcli_over_peers_train"] = {
            f"{precision}_over_{peer}": results[f"train_tgt_tok_per_s_{precision}"] / figures["train_tgt_tok_per_s"]
            for peer, figures in results["peers_train"].items()
            for precision in ("fp32", "bf16")
            if results.get(f"train_tgt_tok_per_s_{precision}")
        }
    results["flops_formula"] = FORMULA
    (ROOT / "benchmarks" / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print_table(results)


def measure(cfg, data, args) -> dict:
    """mtcli's own figures: GEMM peaks, training rounds, base shapes, decoding (steps 1-4 of the docstring)."""
    results = {}
    has_bf16 = cpu_bf16_units() is not None
    peaks = {"fp32": gemm_peak_gflops(torch.float32)}
    if has_bf16:  # ~100x slower without bf16 units
        peaks["bf16"] = gemm_peak_gflops(torch.bfloat16)
    auto, why = choose_precision("auto", torch.device("cpu"))
    results["train_precision_auto"] = f"{auto} ({why})"
    print(f"GEMM peaks: fp32 {peaks['fp32']:.0f}, bf16 {peaks.get('bf16', 0):.0f} GFLOP/s; auto: {auto} ({why})")
    measured, seen = training_rounds(cfg, data, peaks, args.rounds)
    results.update(combine_rounds(measured, seen))
    peaks = {p: max(v) for p, v in seen.items()}  # the host's best rate in this run: what MFU is measured against
    results["gemm_peak_gflops_fp32"], results["gemm_peak_gflops_bf16"] = peaks["fp32"], peaks.get("bf16")
    if not has_bf16:
        results.update(train_tgt_tok_per_s_bf16=None, train_mfu_bf16=None, train_tgt_tok_per_s_epoch2_bf16=None)
    for suffix in ("", "_epoch2"):
        bf16_speed = results.get(f"train_tgt_tok_per_s{suffix}_bf16")
        fp32_speed = results[f"train_tgt_tok_per_s{suffix}_fp32"]
        results[f"bf16_speedup{suffix}"] = bf16_speed / fp32_speed if bf16_speed else None
    if has_bf16:  # the ratio within each round, for the spread
        pairs = zip(results["train_tgt_tok_per_s_rounds_fp32"], results["train_tgt_tok_per_s_rounds_bf16"])
        results["bf16_speedup_rounds"] = [bf16 / fp32 for fp32, bf16 in pairs]
    if not args.skip_base:
        for precision, peak in peaks.items():
            results.update(bench_base(data, precision, peak))
    if not args.quick:
        fp32_model = decode_model("fp32")
        for precision in ["fp32", "bf16", "int8"] if has_bf16 else ["fp32", "int8"]:
            results.update(bench_decoding(cfg, fp32_model, precision))
        if has_bf16:  # the training precision's effect on quality: the bf16-trained model, decoded in fp32
            trained = bench_decoding(cfg, decode_model("bf16"), "fp32", modes=(("beam5", 5),))
            results["bleu_beam5_bf16_trained"] = trained["bleu_beam5_fp32"]
    return results


def print_table(r: dict) -> None:
    m = r["machine"]
    print(f"\nmtcli benchmark: {m['cpu']} ({', '.join(m['cpu_flags'])}), {m['threads']} threads, torch {m['torch']}")
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    rows = [
        (
            "GEMM peak fp32 / bf16 (the highest in the run)",
            f"{fmt(r['gemm_peak_gflops_fp32'], '.0f')} / {fmt(r['gemm_peak_gflops_bf16'], '.0f')} GFLOP/s",
        ),
        ("train.precision auto", r["train_precision_auto"]),
    ]
    if "gemm_peak_drift" in r:  # a shared host can lend less of its matrix units for minutes at a time
        drift = r["gemm_peak_drift"]
        note = "steady" if drift < 0.15 else "the host lent its matrix units unevenly: see the rounds"
        rows.append(("GEMM peaks' largest change during training", f"{100 * drift:.0f} % ({note})"))
    for p in ("fp32", "bf16"):
        if r.get(f"train_tgt_tok_per_s_rounds_{p}"):
            rounds = ", ".join(f"{v:,.0f}" for v in r[f"train_tgt_tok_per_s_rounds_{p}"])
            rows.append((f"train {p}, target tokens/s of each round", rounds))
    if r.get("bf16_speedup_rounds"):
        rows.append(("train bf16 / fp32 within each round", ", ".join(f"{v:.2f}" for v in r["bf16_speedup_rounds"])))
    for p in ("fp32", "bf16"):
        if r.get(f"train_tgt_tok_per_s_{p}"):
            rows.append(
                (
                    f"train {p} (best round): target tokens/s, MFU, peak RSS",
                    f"{r[f'train_tgt_tok_per_s_{p}']:,.0f}, {100 * r[f'train_mfu_{p}']:.1f} %, "
                    f"{r[f'peak_rss_mb_{p}']:,.0f} MB",
                )
            )
    for p in ("fp32", "bf16"):
        if r.get(f"train_tgt_tok_per_s_epoch2_{p}"):
            rows.append(
                (
                    f"train {p}, second epoch (best round): target tokens/s, MFU",
                    f"{r[f'train_tgt_tok_per_s_epoch2_{p}']:,.0f}, {100 * r[f'train_mfu_epoch2_{p}']:.1f} %",
                )
            )
    rows.append(
        (
            "train bf16 / fp32 (first epoch, second epoch)",
            f"{fmt(r['bf16_speedup'], '.2f')}, {fmt(r['bf16_speedup_epoch2'], '.2f')}",
        )
    )
    rows.append(
        (
            "train: target tokens per batch, padding efficiency",
            f"{r['train_tgt_tokens_per_batch']:,.0f}, {r['train_padding_efficiency']:.3f}",
        )
    )
    for p in ("fp32", "bf16"):
        if f"base_train_tgt_tok_per_s_{p}" in r:
            rows.append(
                (
                    f"base-size train {p}: target tokens/s, MFU",
                    f"{r[f'base_train_tgt_tok_per_s_{p}']:,.0f}, {100 * r[f'base_train_mfu_{p}']:.1f} %",
                )
            )
    for p in ("fp32", "bf16", "int8"):
        for name in ("greedy", "beam5"):
            if f"decode_{name}_sent_per_s_{p}" in r:
                rows.append(
                    (
                        f"decode {name} {p}: sentences/s, BLEU",
                        f"{r[f'decode_{name}_sent_per_s_{p}']:.1f}, {r[f'bleu_{name}_{p}']:.2f}",
                    )
                )
    if "bleu_beam5_bf16_trained" in r:
        rows.append(("beam-5 BLEU of the bf16-trained model (fp32 decoding)", f"{r['bleu_beam5_bf16_trained']:.2f}"))
    for peer, figures in r.get("peers_train", {}).items():
        over = r["mtcli_over_peers_train"]
        ratios = ", ".join(f"mtcli {p} {over[f'{p}_over_{peer}']:.2f}x" for p in DTYPES if f"{p}_over_{peer}" in over)
        rows.append((f"peer {peer}: train target tokens/s", f"{figures['train_tgt_tok_per_s']:,.0f} ({ratios})"))
    if "peers_decode_same_model" in r:
        same = r["peers_decode_same_model"]
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in same["mtcli_over_ctranslate2"].items())
        backends = ", ".join(f"{k} {v}" for k, v in same.get("ctranslate2_best_backend", {}).items())
        rows.append(("decode, same model: mtcli / CTranslate2 at its best", f"{ratios} ({backends})"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    print(f"\nFLOPs counted:\n{r['flops_formula']}\nresults: benchmarks/results.json")


if __name__ == "__main__":
    main()
