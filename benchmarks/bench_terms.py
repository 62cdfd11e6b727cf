"""What a glossary costs in translation speed: a run translates the same lines (its test split, or --source) with no
glossary, with a generated glossary of 100,000 entries that matches nothing (the cost of matching alone), and with a
glossary of one term for each line (hard constraints: constrained beam search), greedy and beam 5.

    python benchmarks/bench_terms.py --run runs/multi30k [--source test.en] [--lines 1000] [--rounds 3]

Each setting is timed in rounds of alternating order after a warm-up; the best round counts (interference only slows
a run down). The term glossary maps one word of each line to a word of another line's translation (words the
model's vocabulary can write), so the search must place terms the model would not have chosen. Prints a table and
writes benchmarks/terms_results.json (--json elsewhere).
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mtcli.checkpoint import resolve_checkpoint  # noqa: E402
from mtcli.data import eval_texts  # noqa: E402
from mtcli.device import cpu_name  # noqa: E402
from mtcli.glossary import Glossary, TermCheck, expected_terms, term_accuracy, words  # noqa: E402
from mtcli.line_io import read_lines  # noqa: E402
from mtcli.outputs import new_file  # noqa: E402
from mtcli.tokenizer import word_separator  # noqa: E402
from mtcli.translate import Translator  # noqa: E402

OWN_JSON = ROOT / "benchmarks" / "terms_results.json"  # replaced by each run; another existing file is refused


def matching_nothing(size: int, seed: int = 0) -> Glossary:
    """`size` entries of made-up words (1-3 of them, 8-12 letters each), which no real line holds."""
    rng, glossary = random.Random(seed), Glossary()
    while len(glossary) < size:
        made_up = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(8, 12))) for _ in range(rng.randint(1, 3))]
        glossary.add(" ".join(made_up), "x")
    return glossary


def one_term_a_line(sources: list[str], translations: list[str], spaced: bool, seed: int = 0) -> list[Glossary]:
    """One glossary per line (as eval --terms gives them), holding one term: the line's longest word, mapped to a word
    of another line's translation (its longest; two characters where the target language has no spaces)."""
    rng = random.Random(seed)
    if spaced:
        targets = [max(t.split(), key=len) for t in translations if t.split()]
    else:
        targets = [t[i : i + 2] for t in translations for i in range(0, len(t) - 1, 2) if t[i : i + 2].isalpha()]
    glossaries = []
    for source in sources:
        glossary = Glossary()
        found = [w for _, _, w in words(source) if w.isalpha()]
        if found:
            glossary.add(max(found, key=len), rng.choice(targets))
        glossaries.append(glossary)
    return glossaries


def timed(translator: Translator, lines: list[str], beam: int, glossary) -> tuple[float, list[str]]:
    start = time.perf_counter()
    out = translator.translate(lines, beam=beam, glossary=glossary)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--source", type=Path, help="lines to translate (default: the run's test split)")
    parser.add_argument("--lines", type=int, default=1000, help="lines translated (a shorter split is repeated)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=OWN_JSON)
    args = parser.parse_args()
    own_json = args.json.resolve() == OWN_JSON
    if args.json.exists() and not own_json:  # before the measuring, not after
        sys.exit(f"terms: --json {args.json}: exists; give a new name (only {OWN_JSON} is replaced)")
    translator = Translator.from_checkpoint(resolve_checkpoint(args.run, None), "cpu")
    sources = read_lines(args.source) if args.source else eval_texts(translator.config, "test")[0]
    sources = (sources * -(-args.lines // len(sources)))[: args.lines]  # a short split is repeated up to --lines
    plain_out = translator.translate(sources, beam=1)
    glossaries = {
        "none": None,
        "100,000 entries, no match": matching_nothing(100_000),
        "1 term a line (hard)": one_term_a_line(
            sources, plain_out, bool(word_separator(translator.config.data.tgt_lang))
        ),
    }
    checks = [TermCheck(i, c.source, c.target) for i, g in enumerate(glossaries["1 term a line (hard)"])
              for c in expected_terms(g, [sources[i]])]  # fmt: skip
    translator.translate(sources[:32], beam=5)  # warm-up: kernels, caches
    best: dict[tuple[str, int], float] = {}
    outputs: dict[tuple[str, int], list[str]] = {}
    for round_ in range(args.rounds):
        order = list(glossaries.items())
        for name, glossary in order if round_ % 2 == 0 else reversed(order):
            for beam in (1, 5):
                seconds, out = timed(translator, sources, beam, glossary)
                key = (name, beam)
                best[key] = min(best.get(key, float("inf")), seconds)
                outputs[key] = out
    rows = []
    for (name, beam), seconds in best.items():
        base = best[("none", beam)]
        row = {"glossary": name, "beam": beam, "seconds": round(seconds, 2)}
        row |= {"sentences_per_second": round(len(sources) / seconds, 1), "time_vs_none": round(seconds / base, 2)}
        if name.startswith("1 term"):
            row["term_accuracy"] = term_accuracy(checks, outputs[(name, beam)])["accuracy"]
            row["term_accuracy_without"] = term_accuracy(checks, outputs[("none", beam)])["accuracy"]
        rows.append(row)
        print(
            f"{name:28s} beam {beam}: {row['sentences_per_second']:8.1f} sentences/s, {row['time_vs_none']:.2f}x the "
            f"time without a glossary"
            + (
                f"; term accuracy {row['term_accuracy']}% (without: {row['term_accuracy_without']}%)"
                if "term_accuracy" in row
                else ""
            )  # fmt: skip
        )
    report = {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "run": str(args.run),
        "lines": len(sources),
        "terms": len(checks),
        "rounds": args.rounds,
        "rows": rows,
    }
    with new_file(args.json, force=own_json, option="--json") as out:
        out.write(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(sources)} lines, {len(checks)} terms; {cpu_name()}; wrote {args.json}")


if __name__ == "__main__":
    main()
