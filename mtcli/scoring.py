"""Scores from sacreBLEU: BLEU, chrF, chrF++ and TER on detokenized text, corpus and sentence level, each with the
`sacrebleu` command that repeats it. The primitives under both `mtcli eval` (evaluate.py) and its paired tests
(compare.py); validation during training scores through the same functions.

BLEU uses sacreBLEU's `zh` tokenizer for Chinese targets and `13a` otherwise; TER splits Chinese and Japanese
characters (sacreBLEU's asian support).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from sacrebleu.metrics import BLEU, CHRF, TER

from mtcli.errors import MtcliError
from mtcli.tokenizer import CJK_LANGS

ASIAN = CJK_LANGS  # TER splits these characters apart: their words are not separated by spaces
CHINESE = CJK_LANGS - {"ja", "jpn"}
METRICS = ("bleu", "chrf", "chrf++", "ter")
BOOTSTRAP = 1000  # resamples for --confidence: sacreBLEU's --confidence-n default, so its command repeats ours


@dataclass(frozen=True)
class ScoreOptions:
    """What `mtcli eval` scores: which metrics, case-insensitively or not, with 95% confidence intervals or not."""

    metrics: tuple[str, ...] = METRICS
    lowercase: bool = False
    confidence: bool = False


def parse_metrics(text: str) -> tuple[str, ...]:
    """--metrics bleu,chrf++ -> ("bleu", "chrf++"), in the order given."""
    names = tuple(dict.fromkeys(name.strip().lower() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in METRICS]
    if unknown or not names:
        raise MtcliError(f"--metrics {text}: choose one or more of {', '.join(METRICS)}, comma-separated")
    return names


def bleu_tokenizer(tgt_lang: str) -> str:
    return "zh" if tgt_lang.lower() in CHINESE else "13a"


def make_metric(name: str, tgt_lang: str, lowercase: bool = False, sentence: bool = False):
    """The sacreBLEU metric object; sentence-level BLEU uses the effective order, as `sacrebleu --sentence-level`
    does. TER stays case-insensitive, sacreBLEU's default."""
    if name == "bleu":
        return BLEU(tokenize=bleu_tokenizer(tgt_lang), lowercase=lowercase, effective_order=sentence)
    if name in ("chrf", "chrf++"):
        return CHRF(word_order=2 if name == "chrf++" else 0, lowercase=lowercase)
    return TER(asian_support=tgt_lang.lower() in ASIAN)


def sacrebleu_flags(names: tuple[str, ...] | list[str], tgt_lang: str, lowercase: bool) -> list[str]:
    """Command-line options that make `sacrebleu` compute `names` as make_metric does (one call cannot hold both
    chrF and chrF++: -cw applies to every chrF of the call)."""
    flags = ["-m", *("chrf" if n == "chrf++" else n for n in names)]
    if "bleu" in names and bleu_tokenizer(tgt_lang) == "zh":
        flags += ["-tok", "zh"]
    if "chrf++" in names:
        flags += ["-cw", "2"]
    if "ter" in names and tgt_lang.lower() in ASIAN:
        flags += ["--ter-asian-support"]
    if lowercase and "bleu" in names:
        flags += ["-lc"]  # BLEU's only: chrF has its own option
    if lowercase and ("chrf" in names or "chrf++" in names):
        flags += ["--chrf-lowercase"]
    return flags


def metric_groups(names: tuple[str, ...]) -> list[tuple[str, ...]]:
    """`names` split into the fewest `sacrebleu` calls: chrF++ needs a call of its own when chrF is there too."""
    if "chrf++" in names and "chrf" in names:
        return [tuple(n for n in names if n != "chrf++"), ("chrf++",)]
    return [names]


def sacrebleu_command(refs: list[Path], hyps: list[Path], flags: list[str]) -> str:
    return shlex.join(["sacrebleu", *map(str, refs), "-i", *map(str, hyps), *flags, "-w", "2"])


def corpus_scores(hypotheses: list[str], references: list[list[str]], tgt_lang: str, options: ScoreOptions) -> dict:
    """Corpus scores of detokenized hypotheses against one or more reference streams (each as long as the
    hypotheses): per metric its name, score, signature and detail (BLEU's n-gram precisions), and with
    options.confidence the bootstrap mean and 95% interval (sacreBLEU's, seed SACREBLEU_SEED, default 12345)."""
    for i, stream in enumerate(references):
        if len(stream) != len(hypotheses):
            raise ValueError(f"{len(hypotheses)} hypotheses for {len(stream)} references (reference {i + 1})")
    if not hypotheses:  # sacreBLEU's own error is an IndexError
        raise MtcliError("nothing to score: no sentences")
    scores = {}
    for name in options.metrics:
        metric = make_metric(name, tgt_lang, options.lowercase)
        result = metric.corpus_score(hypotheses, references, n_bootstrap=BOOTSTRAP if options.confidence else 1)
        entry = {"name": result.name, "score": result.score, "signature": str(metric.get_signature())}
        entry["detail"] = result.format(width=2)  # e.g. "BLEU = 39.12 (μ = 39.10 ± 0.90) 70.1/45.0/..."
        if options.confidence:
            entry["mean"], entry["ci"] = float(result._mean), float(result._ci)  # sacreBLEU keeps them there only
        scores[name] = entry
    return scores


def score(hypotheses: list[str], references: list[str], tgt_lang: str, lowercase: bool = False) -> dict:
    """Corpus BLEU and chrF against one reference each (validation during training and the benchmarks): the same
    code as `mtcli eval`'s, so the logged validation BLEU is what eval repeats."""
    scores = corpus_scores(hypotheses, [references], tgt_lang, ScoreOptions(("bleu", "chrf"), lowercase))
    bleu, chrf = scores["bleu"], scores["chrf"]
    return {
        "bleu": bleu["score"],
        "chrf": chrf["score"],
        "signature": bleu["signature"],
        "chrf_signature": chrf["signature"],
        "bleu_detail": bleu["detail"],
    }


def sentence_scores(hypotheses: list[str], references: list[list[str]], tgt_lang: str, options: ScoreOptions):
    """Per segment, each metric's sentence-level score (what `sacrebleu --sentence-level` prints)."""
    metrics = {name: make_metric(name, tgt_lang, options.lowercase, sentence=True) for name in options.metrics}
    rows = []
    for i, hypothesis in enumerate(hypotheses):
        refs = [stream[i] for stream in references]
        rows.append({name: metric.sentence_score(hypothesis, refs).score for name, metric in metrics.items()})
    return rows


def write_lines(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line.replace("\n", " ") + "\n" for line in lines), encoding="utf-8")


def score_files(
    hypotheses: list[str],
    hyp_path: Path,
    references: list[list[str]],
    ref_paths: list[Path],
    tgt_lang: str,
    options: ScoreOptions,
) -> dict:
    """Scores of hypotheses already written to `hyp_path` (references to `ref_paths`), each metric with the
    `sacrebleu` call that repeats it on those files; the scores also stand at the top level (`bleu`, `chrf`, ...)."""
    scores = corpus_scores(hypotheses, references, tgt_lang, options)
    commands = []
    for group in metric_groups(options.metrics):
        flags = sacrebleu_flags(group, tgt_lang, options.lowercase) + (["--confidence"] if options.confidence else [])
        commands.append(sacrebleu_command(ref_paths, [hyp_path], flags))
        for name in group:
            scores[name]["command"] = commands[-1]
    return {
        **{name: entry["score"] for name, entry in scores.items()},
        "signature": scores[options.metrics[0]]["signature"],
        "scores": scores,
        "hypotheses": str(hyp_path),
        "references": [str(p) for p in ref_paths],
        "command": commands[0],
    }
