"""Term accuracy and BLEU of glossaries on a real corpus: a model trained with data.terminology against the same recipe
without it, with no glossary, soft (marked source) and hard (constrained beam search), in mtcli and in its
CTranslate2 int8 export.

    python benchmarks/term_quality.py --base runs/multi30k --terms runs/multi30k-terms [--split test] [--lines 1000]

The terminology test set is built here, in the WMT 2021 style, from the split's own references: eflomal aligns the
split's (source, reference) pairs together with the training corpus (alignment statistics need more than a test
set), and each line gets 1-2 aligned phrase pairs as terms (glossary.phrase_pairs; a source word of 4 letters or
more). A term is "unusual" when the baseline model's translation of the line (no glossary) lacks its target words;
lines prefer unusual terms, so that a glossary has something to change (the issue asks for at least a third).
`--terms-out FILE` writes the set (`line<TAB>source term<TAB>target term`, as mtcli eval --terms reads it): corpus
text, so never into the project.

Prints a table and writes benchmarks/term_quality.json (--json elsewhere). Judge on a split nothing was tuned on.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mtcli.align import align_chunk  # noqa: E402
from mtcli.checkpoint import resolve_checkpoint  # noqa: E402
from mtcli.clean import clean_line  # noqa: E402
from mtcli.corpus import open_splits  # noqa: E402
from mtcli.data import eval_texts  # noqa: E402
from mtcli.device import cpu_name  # noqa: E402
from mtcli.glossary import Glossary, TermCheck, mark_terms, phrase_pairs, soft_marked, term_accuracy, words  # noqa: E402
from mtcli.outputs import new_file  # noqa: E402
from mtcli.scoring import score  # noqa: E402
from mtcli.translate import Translator  # noqa: E402

OWN_JSON = ROOT / "benchmarks" / "term_quality.json"  # replaced by each run; another existing file is refused


def aligned_split(translator: Translator, role: str, limit: int) -> tuple[list[str], list[str], list]:
    """The split's sources and references (at most `limit`) and their word alignments, from one eflomal run over
    them and the training corpus."""
    sources, references = eval_texts(translator.config, role)
    sources, references = sources[:limit], references[:limit]
    train = open_splits(translator.config.data, Path(translator.config.data.cache_dir))["train"]
    train_src, train_tgt = [], []
    for s, t in train.batches():
        train_src += [clean_line(x) for x in s]
        train_tgt += [clean_line(x) for x in t]
    print(f"aligning {len(sources):,} {role} pairs with {len(train_src):,} training pairs (eflomal) ...", flush=True)
    links = align_chunk(sources + train_src, references + train_tgt)[: len(sources)]
    return sources, references, links


def term_set(sources, references, links, baseline: list[str], seed: int = 0) -> tuple[list[Glossary], list[TermCheck]]:
    """1-2 terms a line (see the module's docstring); one glossary per line and the expected target terms."""
    rng = random.Random(seed)
    glossaries, checks = [], []
    for line, (source, reference, pair_links, plain) in enumerate(zip(sources, references, links, baseline)):
        src, tgt = words(source), words(reference)
        candidates = []
        for a, b, c, d in phrase_pairs(pair_links, max_words=2):
            if b > len(src) or d > len(tgt) or not any(len(w) >= 4 and w.isalpha() for *_, w in src[a:b]):
                continue
            target = reference[tgt[c][0] : tgt[d - 1][1]]
            candidates.append((a, b, source[src[a][0] : src[b - 1][1]], target, target not in plain))
        rng.shuffle(candidates)
        candidates.sort(key=lambda c: not c[4])  # unusual first
        glossary, taken = Glossary(), []
        for a, b, src_term, tgt_term, _ in candidates:
            if len(taken) == (2 if rng.random() < 0.3 else 1):
                break
            if all(b <= x or y <= a for x, y in taken) and glossary.add(src_term, tgt_term):
                taken.append((a, b))
        if glossary.matches(source):  # the term as the line says it (matching may pick a longer overlapping one)
            for m in glossary.matches(source):
                checks.append(TermCheck(line, m.source, m.target))
        glossaries.append(glossary)
    return glossaries, checks


def write_terms(path: Path, checks: list[TermCheck]) -> None:
    with new_file(path, force=True) as f:
        f.writelines(f"{c.line + 1}\t{c.source}\t{c.target}\n" for c in checks)


def checkpoint_of(path: Path) -> Path:
    """A checkpoint folder as it is; a run directory's best checkpoint."""
    return path if (path / "model.safetensors").is_file() else resolve_checkpoint(path)


def timed(function, *args, **kwargs):
    began = time.perf_counter()
    out = function(*args, **kwargs)
    return out, time.perf_counter() - began


def evaluate(translator, sources, references, glossaries, checks, beam: int, modes) -> dict:
    rows = {}
    for mode in modes:
        glossary = None if mode == "none" else glossaries
        if mode == "soft, source words kept":  # the form soft does not use, for the record (docs/benchmarks.md)
            sources_in = [mark_terms(s, g.matches(s)) for s, g in zip(sources, glossaries)]
            hyps, seconds = timed(translator.translate, sources_in, beam=beam)
        else:
            constraints = {"none": "off", "soft": "soft", "hard": "hard"}[mode]
            nbest, seconds = timed(
                translator.translate_nbest, sources, glossary=glossary, constraints=constraints, beam=beam
            )
            hyps = [h[0].text for h in nbest]
        bleu = score(hyps, references, translator.config.data.tgt_lang)
        rows[mode] = {
            "bleu": round(bleu["bleu"], 2),
            **term_accuracy(checks, hyps),
            "seconds": round(seconds, 1),
        }
        print(
            f"  {mode:<26} BLEU {rows[mode]['bleu']:6.2f}  term accuracy {rows[mode]['accuracy']}%  "
            f"({rows[mode]['seconds']} s)",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="run (its best checkpoint) or checkpoint folder")
    parser.add_argument("--terms", type=Path, required=True, help="the same recipe with data.terminology")
    parser.add_argument("--precision", default="auto", help="translation precision: auto, fp32, bf16, int8")
    parser.add_argument("--split", default="test", help="valid or test (default: test)")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--json", type=Path, default=OWN_JSON)
    parser.add_argument("--terms-out", type=Path, help="write the term set here (mtcli eval --terms reads it)")
    parser.add_argument("--ct2", type=Path, help="the CTranslate2 int8 export of --terms (soft row of the export)")
    args = parser.parse_args()
    if args.json.resolve() != OWN_JSON and args.json.exists():
        sys.exit(f"--json {args.json}: exists; this benchmark replaces only {OWN_JSON.name}")
    base = Translator.from_checkpoint(checkpoint_of(args.base), "cpu", args.precision)
    terms = Translator.from_checkpoint(checkpoint_of(args.terms), "cpu", args.precision)
    sources, references, links = aligned_split(base, args.split, args.lines)
    print(f"baseline translations of {len(sources):,} lines ...", flush=True)
    baseline = base.translate(sources, beam=args.beam)
    glossaries, checks = term_set(sources, references, links, baseline)
    unusual = sum(c.target not in baseline[c.line] for c in checks)
    print(
        f"terms: {len(checks):,} on {sum(bool(g.terms) for g in glossaries):,} lines, {unusual:,} unusual "
        f"({unusual / max(len(checks), 1):.0%})",
        flush=True,
    )
    if args.terms_out:  # corpus text: kept out of the project
        write_terms(args.terms_out, checks)
    result = {
        "cpu": cpu_name(),
        "split": args.split,
        "lines": len(sources),
        "terms": len(checks),
        "unusual_terms": unusual,
        "beam": args.beam,
        "base": str(checkpoint_of(args.base)),
        "terms_run": str(checkpoint_of(args.terms)),
        "precision": base.precision,
    }
    terms.translate(sources[:64], beam=args.beam)  # warm-up (the baseline's was its translations above)
    print(f"{args.base} (no terminology):", flush=True)
    result["base_rows"] = evaluate(base, sources, references, glossaries, checks, args.beam, ("none", "hard"))
    print(f"{args.terms} (data.terminology):", flush=True)
    modes = ("none", "soft", "soft, source words kept", "hard")
    result["terms_rows"] = evaluate(terms, sources, references, glossaries, checks, args.beam, modes)
    if args.ct2:
        from mtcli.parity import CTranslate2Engine, engine_settings

        engine = CTranslate2Engine(args.ct2)
        marked = [soft_marked(s, g.matches(s)) for s, g in zip(sources, glossaries)]
        settings, _ = engine_settings(terms.config.decode, "ctranslate2", terms.config.model.max_positions)
        hyps = engine.translate(marked, settings, args.beam)
        result["ct2_soft"] = {
            "bleu": round(score(hyps, references, terms.config.data.tgt_lang)["bleu"], 2),
            **term_accuracy(checks, hyps),
        }
        print(f"  CTranslate2 int8, soft: {result['ct2_soft']}", flush=True)
    with new_file(args.json, force=True) as f:
        f.write(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"written: {args.json}")


if __name__ == "__main__":
    main()
