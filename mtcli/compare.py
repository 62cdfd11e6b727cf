"""Comparing systems on the same source and references: sacreBLEU's paired bootstrap resampling and paired
approximate randomization (its `--paired-bs` and `--paired-ar`), every system against a baseline.

A p-value under 0.05 says that the difference is unlikely to be chance, not which system is better: the sign of the
delta says that. Both tests draw from sacreBLEU's seed (SACREBLEU_SEED, default 12345), so the `sacrebleu` commands
in the result repeat every figure.
"""

from __future__ import annotations

from pathlib import Path

from sacrebleu.significance import PairedTest

from mtcli.checkpoint import resolve_member
from mtcli.config import DecodeConfig
from mtcli.errors import MtcliError
from mtcli.glossary import TermCheck, term_accuracy
from mtcli.line_io import read_lines
from mtcli.scoring import (
    ScoreOptions,
    make_metric,
    metric_groups,
    sacrebleu_command,
    sacrebleu_flags,
    write_lines,
)
from mtcli.translate import Translator

# sacreBLEU's defaults for --paired-bs-n and --paired-ar-n, which PairedTest takes for n_samples=0
TESTS = {
    "bs": "paired bootstrap resampling (1,000 resamples)",
    "ar": "paired approximate randomization (10,000 trials)",
}


def paired_tests(systems: list[tuple[str, list[str]]], references: list[list[str]], tgt_lang: str, options):
    """Both tests of every system against systems[0], the baseline (`systems` holds (name, hypotheses) pairs). Per
    metric, one row per system: score, delta to the baseline, bootstrap mean and 95% CI, p-value of each test (None
    for the baseline); and per metric the signature of each test.

    A system whose translations equal the baseline's line for line gets p = 1 without a test: sacreBLEU counts only
    resampled differences *above* the observed one, so a zero difference gets its smallest p-value (1/1001,
    1/10001) and would read as significant (the same in MultEval, whose test it follows: its issue 5)."""
    tested = [0] + [i for i in range(1, len(systems)) if systems[i][1] != systems[0][1]]
    table = {name: [{} for _ in systems] for name in options.metrics}
    signatures: dict[str, dict[str, str]] = {name: {} for name in options.metrics}
    for test in TESTS:
        metrics = {name: make_metric(name, tgt_lang, options.lowercase) for name in options.metrics}
        test_signatures, results = PairedTest([systems[i] for i in tested], metrics, references, test_type=test)()
        # sacreBLEU keys its results by its own metric names (BLEU, chrF2, ...), in the order of `metrics`
        keys = [key for key in results if key != "System"]
        for name, key in zip(options.metrics, keys):
            signatures[name][test] = str(test_signatures[key])
            for i, result in zip(tested, results[key]):
                table[name][i].update({"score": result.score, f"p_{test}": result.p_value})
                if test == "bs":  # the bootstrap estimates the mean and the interval too
                    table[name][i].update({"mean": float(result.mean), "ci": float(result.ci)})
    for rows in table.values():
        for i, row in enumerate(rows):
            if i not in tested:  # the same resamples as the baseline's, so the same mean and interval
                row.update({**rows[0], "p_bs": 1.0, "p_ar": 1.0, "identical_to_baseline": True})
            row["delta"] = row["score"] - rows[0]["score"]
    return table, signatures


def compare_systems(
    translator: Translator,
    baseline: tuple[str, Path, list[str]],
    others: list[str] | tuple[str, ...],
    sources: list[str],
    refs: tuple[list[list[str]], list[Path]],
    decode: DecodeConfig,
    options: ScoreOptions,
    progress: bool = False,
    term_checks: list[TermCheck] | None = None,
) -> dict:
    """Hypotheses of each of `others` (a run, a checkpoint folder, or a file of line-aligned translations), written
    beside the baseline's (name, file, hypotheses), then both paired tests against the baseline, with the
    `sacrebleu` calls that repeat them; with `term_checks`, each system's term accuracy."""
    tgt_lang = translator.config.data.tgt_lang
    references, ref_paths = refs
    name, base_path, base_hyps = baseline
    systems = [(name, base_path, base_hyps)]
    for i, other in enumerate(others, 1):
        hypotheses = other_hypotheses(other, translator, sources, decode, progress)
        path = base_path.with_name(f"{base_path.name.removesuffix('.' + tgt_lang)}.compare{i}.{tgt_lang}")
        write_lines(path, hypotheses)
        systems.append((str(other), path, hypotheses))
    table, signatures = paired_tests([(n, h) for n, _, h in systems], references, tgt_lang, options)
    commands: dict[str, dict[str, str]] = {}
    for group in metric_groups(options.metrics):
        flags = sacrebleu_flags(group, tgt_lang, options.lowercase)
        for test in TESTS:
            # -f text: sacreBLEU 2.6 fails to write this table as JSON (numpy floats)
            command = sacrebleu_command(
                ref_paths, [p for _, p, _ in systems], flags + [f"--paired-{test}", "-f", "text"]
            )
            for metric in group:
                commands.setdefault(metric, {})[test] = command
    rows = [
        {"name": n, "hypotheses": str(p), "scores": {metric: table[metric][i] for metric in options.metrics}}
        for i, (n, p, _) in enumerate(systems)
    ]
    if term_checks is not None:
        for row, (_, _, hypotheses) in zip(rows, systems):
            row["terms"] = term_accuracy(term_checks, hypotheses)
    return {
        "tests": TESTS,
        "systems": rows,
        "signatures": signatures,
        "commands": commands,
    }


def other_hypotheses(other: str, translator: Translator, sources: list[str], decode: DecodeConfig, progress: bool):
    """A compared system's translations of `sources`: read from a file, or made by a run or checkpoint folder with
    the baseline's decode settings, precision and glossary."""
    path = Path(other)
    if path.is_file():
        lines = [" ".join(line.split()) for line in read_lines(path)]
        if len(lines) != len(sources):
            raise MtcliError(
                f"--compare {path}: {len(lines)} lines for {len(sources)} source sentences; a file of hypotheses "
                "must hold one translation per source line"
            )
        return lines
    model = Translator.from_checkpoint(resolve_member(path), str(translator.device), translator.precision)
    tgt_lang, other_lang = translator.config.data.tgt_lang, model.config.data.tgt_lang
    if other_lang != tgt_lang:
        raise MtcliError(f"--compare {other}: translates into {other_lang}, the baseline into {tgt_lang}")
    model.glossary = translator.glossary  # the same terms asked of every system
    return model.translate(sources, decode, progress)


def format_terms(terms: dict) -> str:
    """Term accuracy as eval prints it."""
    if not terms["terms"]:
        return "no glossary term in the sources"
    return f"{terms['accuracy']:.2f}% (ignoring case {terms['accuracy_lc']:.2f}%) of {terms['terms']:,} terms"


def format_comparison(comparison: dict) -> str:
    """The comparison as a table: one row per system and metric, the baseline first."""
    header = ("system", "metric", "score", "delta", "bootstrap mean ± 95% CI", "p (bootstrap)", "p (AR)")
    rows = [header]
    for i, system in enumerate(comparison["systems"]):
        for metric, s in system["scores"].items():
            name = f"baseline: {system['name']}" if i == 0 else system["name"]
            delta = "" if i == 0 else f"{s['delta']:+.2f}"
            p = [f"{s[k]:.4f}" + ("*" if s[k] < 0.05 else "") for k in ("p_bs", "p_ar")] if i else ["", ""]
            if s.get("identical_to_baseline"):
                p = ["1 (same translations)"] * 2
            rows.append((name, metric, f"{s['score']:.2f}", delta, f"{s['mean']:.2f} ± {s['ci']:.2f}", *p))
        if "terms" in system:
            rows.append((name, "terms", format_terms(system["terms"]), "", "", "", ""))
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    tests = "; ".join(comparison["tests"].values())
    commands = dict.fromkeys(c for by_test in comparison["commands"].values() for c in by_test.values())
    return "\n".join(
        [f"paired tests against the baseline: {tests}; * p < 0.05 (a difference unlikely to be chance)", *lines]
        + [f"check: {command}" for command in commands]
    )
