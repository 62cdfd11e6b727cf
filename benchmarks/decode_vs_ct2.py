"""mtcli's decoder against CTranslate2 on the same model: `make bench`'s 800-update model (benchmarks/cache), exported
with `mtcli export --format ctranslate2`, translating test_2016_flickr with the peers' decoding spec (length-sorted
batches of 64 sentences, one untimed warm-up batch, beam 5 and greedy) in alternating rounds, each engine in fp32
and int8 (mtcli also in bf16 where the CPU has bf16 units), 2 threads. CTranslate2 runs with each of its CPU
backends, Intel MKL (CT2_USE_MKL=1, its default on Intel CPUs) and oneDNN (CT2_USE_MKL=0), and mtcli is compared
with the faster of the two for each precision and search (which is faster depends on the CPU: docs/benchmarks.md).
CTranslate2 has no bf16 on CPUs: mtcli's bf16 is compared with its best float32.

Each timed pass runs in a process of its own (`--engine NAME`), and CTranslate2's runs no torch operation before
it is timed (it reads the checkpoint's tokenizer files only): torch and CTranslate2 each ship their own OpenMP
runtime, and once torch had run a parallel operation in a process, CTranslate2 ran 1.6-2x slower there (greedy
float32 211-237 against 370-450 sentences/s, Zen 4); with all engines in one process mtcli ran 17-33 % slower as
well. The cause inside the runtimes was not isolated (docs/benchmarks.md). `--one-process` keeps every engine in
this process, to see the effect.

The same weights and vocabulary on both sides, so speed differences are the decoders' own; the peers' decode.sh
compares against a separately trained HF Marian model instead. Length penalty: CTranslate2 divides by length ** 1.0,
mtcli by GNMT's ((5 + length) / 6) ** 1.0 (the spec's setting, as make bench); the BLEU of each is printed, and the
outputs' total length so that a speed gap is not a length gap. Output lengths: CTranslate2 at most 128 tokens, mtcli
2 x source + 20.

    python benchmarks/decode_vs_ct2.py [--rounds 3] [--json PATH] [--one-process]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import CACHE, CONFIG, decode_model, machine, peers_decode_spec  # noqa: E402

from mtcli.config_loader import load_config  # noqa: E402
from mtcli.data import eval_texts  # noqa: E402
from mtcli.device import cpu_bf16_units, keep_freed_memory, keep_onednn_kernels  # noqa: E402
from mtcli.export import export_ctranslate2  # noqa: E402
from mtcli.scoring import score  # noqa: E402
from mtcli.tokenizer import Tokenizer  # noqa: E402
from mtcli.translate import Translator  # noqa: E402

BATCH = 64
CT2_BACKENDS = {"ctranslate2-mkl": "1", "ctranslate2-onednn": "0"}  # engine name -> CT2_USE_MKL


def mtcli_engine(checkpoint: Path, precision: str, beam: int, sources: list[str]):
    translator = Translator.from_checkpoint(checkpoint, device="cpu", precision=precision)
    decode = peers_decode_spec(translator, beam)
    translator.translate(sources[:BATCH], decode)  # warm-up

    def run() -> list[str]:
        return translator.translate(sources, decode)

    return run


def ct2_engine(model_dir: Path, compute_type: str, beam: int, sources: list[str], tokenizer):
    import ctranslate2

    engine = ctranslate2.Translator(str(model_dir), device="cpu", compute_type=compute_type, intra_threads=2)
    pieces = [tokenizer.src.encode(s, out_type=str) for s in sources]  # the model's config appends EOS
    order = sorted(range(len(pieces)), key=lambda i: len(pieces[i]))
    options = dict(beam_size=beam, length_penalty=1.0, max_decoding_length=128, max_batch_size=BATCH)
    engine.translate_batch([pieces[i] for i in order[:BATCH]], **options)  # warm-up

    def run() -> list[str]:
        hyps = [""] * len(pieces)
        for start in range(0, len(order), BATCH):
            batch = order[start : start + BATCH]
            for i, result in zip(batch, engine.translate_batch([pieces[i] for i in batch], **options)):
                hyps[i] = tokenizer.tgt.decode(result.hypotheses[0]).strip()
        return hyps

    return run


def engine_names(one_process: bool = False) -> list[str]:
    """`<engine>_<precision>_<beam5|greedy>`, in the order of a round. In one process CTranslate2 keeps the backend
    it chose when it was loaded (engine `ctranslate2`)."""
    mtcli_precisions = ["fp32", "bf16", "int8"] if cpu_bf16_units() else ["fp32", "int8"]
    names = []
    for mode in ("beam5", "greedy"):
        names += [f"mtcli_{p}_{mode}" for p in mtcli_precisions]
        for kind in ["ctranslate2"] if one_process else CT2_BACKENDS:
            names += [f"{kind}_{p}_{mode}" for p in ("float32", "int8")]
    return names


def build_engine(name: str, checkpoint: Path, sources: list[str]):
    """A warmed-up engine: a function translating all of `sources`."""
    kind, precision, mode = name.split("_")
    beam = 5 if mode == "beam5" else 1
    if kind == "mtcli":
        return mtcli_engine(checkpoint, precision, beam, sources)
    return ct2_engine(CACHE / "ct2-800", precision, beam, sources, Tokenizer.from_folder(checkpoint))


def timed(run, sources: list[str]) -> tuple[float, list[str]]:
    start = time.perf_counter()
    hyps = run()
    return len(sources) / (time.perf_counter() - start), hyps


def run_in_child(name: str, checkpoint: Path) -> tuple[float, list[str]]:
    """One timed pass of one engine in a fresh process (this script with --engine)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pass.json"
        command = [sys.executable, __file__, "--engine", name, "--checkpoint", str(checkpoint), "--pass-out", str(out)]
        env = dict(os.environ)
        if name.split("_")[0] in CT2_BACKENDS:  # read by CTranslate2 when it loads
            env["CT2_USE_MKL"] = CT2_BACKENDS[name.split("_")[0]]
        subprocess.run(command, check=True, env=env)
        figures = json.loads(out.read_text())
    return figures["sent_per_s"], figures["hyps"]


def compare(cfg, rounds: int, one_process: bool = False) -> dict:
    """Every engine `rounds` times in alternating order, each pass in its own process unless `one_process`; prints the
    table and returns the figures."""
    checkpoint = decode_model("fp32")
    export_ctranslate2(checkpoint, CACHE / "ct2-800", force=True)  # its own earlier export of this model
    sources, references = eval_texts(cfg, "test")
    names = engine_names(one_process)
    engines = {name: build_engine(name, checkpoint, sources) for name in names} if one_process else {}
    speeds = {name: [] for name in names}
    quality = {}
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:  # alternate the order: a drifting host
            speed, hyps = timed(engines[name], sources) if one_process else run_in_child(name, checkpoint)
            speeds[name].append(speed)
            if name not in quality:
                words = sum(len(h.split()) for h in hyps)
                quality[name] = {"bleu": score(hyps, references, "de")["bleu"], "words": words}
        print(f"round {i + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in speeds.items()), flush=True)
    results = {
        "machine": machine(),
        "checkpoint": str(checkpoint.relative_to(ROOT)),
        "sentences": len(sources),
        "processes": "one for all engines" if one_process else "one per timed pass",
    }
    for name, values in speeds.items():
        results[name] = {"sent_per_s_rounds": values, "sent_per_s_median": statistics.median(values), **quality[name]}
    print(f"\n{'engine':<28} sentences/s (median; rounds)          BLEU   words")
    for name in names:
        r = results[name]
        rounds_text = ", ".join(f"{v:.1f}" for v in r["sent_per_s_rounds"])
        print(f"{name:<28} {r['sent_per_s_median']:7.1f} ({rounds_text})  {r['bleu']:6.2f}  {r['words']}")
    ratios, best_backend = {}, {}
    for mode in ("beam5", "greedy"):
        for mine, theirs in (("fp32", "float32"), ("bf16", "float32"), ("int8", "int8")):
            if f"mtcli_{mine}_{mode}" not in results:
                continue
            a = results[f"mtcli_{mine}_{mode}"]["sent_per_s_median"]
            kind = max(
                (n.split("_")[0] for n in names if n.endswith(f"_{theirs}_{mode}") and n.startswith("ctranslate2")),
                key=lambda kind: results[f"{kind}_{theirs}_{mode}"]["sent_per_s_median"],
            )
            ratios[f"{mode}_{mine}"] = a / results[f"{kind}_{theirs}_{mode}"]["sent_per_s_median"]
            best_backend[f"{mode}_{theirs}"] = kind
            print(f"{mode} {mine}: mtcli / CTranslate2 {theirs} at its best ({kind}) = {ratios[f'{mode}_{mine}']:.2f}")
    results["mtcli_over_ctranslate2"] = ratios  # against CTranslate2's faster backend
    results["ctranslate2_best_backend"] = best_backend
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--one-process", action="store_true", help="every engine in this process (see above)")
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # a child: one timed pass of this engine
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)  # the parent's decode_model("fp32")
    parser.add_argument("--pass-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    cfg = load_config(CONFIG)
    torch.set_num_threads(cfg.train.threads)
    keep_freed_memory()
    keep_onednn_kernels()
    if args.engine:
        sources, _ = eval_texts(cfg, "test")
        speed, hyps = timed(build_engine(args.engine, args.checkpoint, sources), sources)
        args.pass_out.write_text(json.dumps({"sent_per_s": speed, "hyps": hyps}))
        return
    results = compare(cfg, args.rounds, args.one_process)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
