"""Scoring: metrics and signatures, several references, confidence intervals, paired tests, sentence scores, and
every figure of `mtcli eval` against what the `sacrebleu` command it prints says about the same files."""

import json
import os
import random
import re
import shlex
import subprocess
import sys

import pytest
from conftest import invoke, tiny_pairs

from mtcli.compare import format_comparison, paired_tests
from mtcli.data import eval_texts
from mtcli.errors import MtcliError
from mtcli.evaluate import evaluation_set
from mtcli.scoring import ScoreOptions, corpus_scores, parse_metrics, sacrebleu_flags, sentence_scores
from mtcli.translate import Translator


def damaged(lines: list[str], drop: float, seed: int) -> list[str]:
    """Each line with every word dropped with probability `drop` (the first kept if all would go)."""
    rng = random.Random(seed)
    out = []
    for line in lines:
        words = line.split()
        out.append(" ".join(w for w in words if rng.random() > drop) or words[0])
    return out


REFS = [t for _, t in tiny_pairs(120, 5)]


def test_metrics_signatures_and_a_second_reference():
    hyps = damaged(REFS, 0.3, 1)
    one = corpus_scores(hyps, [REFS], "de", ScoreOptions())
    assert [s["name"] for s in one.values()] == ["BLEU", "chrF2", "chrF2++", "TER"]
    assert all("nrefs:1" in s["signature"] for s in one.values())
    assert "nw:2" in one["chrf++"]["signature"] and "nw:0" in one["chrf"]["signature"]
    # The hypotheses themselves as a second reference: a perfect match for every segment.
    two = corpus_scores(hyps, [REFS, hyps], "de", ScoreOptions())
    assert all("nrefs:2" in s["signature"] for s in two.values())
    assert two["bleu"]["score"] == pytest.approx(100) and two["ter"]["score"] == pytest.approx(0)
    assert one["bleu"]["score"] < 90 and one["ter"]["score"] > 10
    subset = corpus_scores(hyps, [REFS], "de", ScoreOptions(("ter", "bleu")))
    assert list(subset) == ["ter", "bleu"] and subset["bleu"]["score"] == one["bleu"]["score"]


def test_chinese_targets_and_lowercase_reach_the_metrics_and_the_command_flags():
    scores = corpus_scores(["我 喜欢 苹果"], [["我喜欢苹果"]], "zh", ScoreOptions(lowercase=True))
    assert "tok:zh" in scores["bleu"]["signature"] and "asian:yes" in scores["ter"]["signature"]
    assert "case:lc" in scores["bleu"]["signature"] and "case:lc" in scores["chrf"]["signature"]
    flags = sacrebleu_flags(("bleu", "chrf", "ter"), "zh", True)
    assert flags == ["-m", "bleu", "chrf", "ter", "-tok", "zh", "--ter-asian-support", "-lc", "--chrf-lowercase"]
    assert sacrebleu_flags(("chrf++",), "de", False) == ["-m", "chrf", "-cw", "2"]


def test_confidence_interval_around_the_score():
    scores = corpus_scores(damaged(REFS, 0.3, 1), [REFS], "de", ScoreOptions(("bleu",), confidence=True))
    bleu = scores["bleu"]
    assert abs(bleu["mean"] - bleu["score"]) < bleu["ci"] and 0 < bleu["ci"] < 20
    assert "bs:1000" in bleu["signature"] and "μ = " in bleu["detail"]


def test_sentence_scores_are_per_segment():
    hyps = damaged(REFS[:5], 0.3, 1)
    hyps[2] = REFS[2]
    rows = sentence_scores(hyps, [REFS[:5]], "de", ScoreOptions(("bleu", "ter")))
    assert len(rows) == 5 and rows[2] == {"bleu": pytest.approx(100), "ter": pytest.approx(0)}


def test_metrics_option_is_checked():
    assert parse_metrics("chrf++, BLEU") == ("chrf++", "bleu")
    for bad in ("bleu,meteor", "", ","):
        with pytest.raises(MtcliError, match="choose one or more of bleu, chrf, chrf\\+\\+, ter"):
            parse_metrics(bad)


def test_paired_tests_a_system_against_itself_and_a_clearly_better_one():
    base, other, better = damaged(REFS, 0.3, 1), damaged(REFS, 0.3, 2), damaged(REFS, 0.05, 3)
    systems = [("base", base), ("itself", list(base)), ("other", other), ("better", better)]
    table, signatures = paired_tests(systems, [REFS], "de", ScoreOptions(("bleu",)))
    rows = table["bleu"]
    assert rows[1]["p_bs"] == rows[1]["p_ar"] == 1.0 and rows[1]["delta"] == 0 and rows[1]["identical_to_baseline"]
    assert rows[3]["delta"] > 20 and rows[3]["p_bs"] < 0.01 and rows[3]["p_ar"] < 0.01
    assert rows[2]["p_bs"] > 0.05 and rows[2]["p_ar"] > 0.05  # the same damage drawn again: no real difference
    assert rows[0]["p_bs"] is None and rows[0]["ci"] > 0
    assert "bs:1000" in signatures["bleu"]["bs"] and "ar:10000" in signatures["bleu"]["ar"]
    comparison = {
        "tests": {"bs": "bootstrap", "ar": "randomization"},
        "systems": [{"name": n, "scores": {"bleu": rows[i]}} for i, (n, _) in enumerate(systems)],
        "commands": {"bleu": {"bs": "sacrebleu bs", "ar": "sacrebleu ar"}},
    }
    text = format_comparison(comparison).splitlines()
    assert text[2].startswith("baseline: base") and "*" in text[5] and text[-1] == "check: sacrebleu ar"


def test_evaluation_files_are_checked(tmp_path):
    src, ref, short = tmp_path / "src.en", tmp_path / "ref.de", tmp_path / "short.de"
    src.write_text("a\nb\n")
    ref.write_text("x\ny\n")
    short.write_text("x\n")
    assert evaluation_set(None, None, src, [ref, ref]) == (["a", "b"], [["x", "y"], ["x", "y"]], "src.en")
    with pytest.raises(MtcliError, match=f"line counts differ: {src} has 2 lines, {short} has 1"):
        evaluation_set(None, None, src, [ref, short])
    with pytest.raises(MtcliError, match="--src and --ref go together"):
        evaluation_set(None, None, None, [ref])


# ---------------------------------------------------------------------------------------------------------------------
# Every figure against the sacrebleu command line


def sacrebleu(command: str, *extra: str) -> str:
    """Run a `command` field (4 decimals, no colours) and return what it prints."""
    args = shlex.split(command)
    assert args[0] == "sacrebleu"
    env = {**os.environ, "NO_COLOR": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "sacrebleu", *args[1:], "-w", "4", *extra], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def grid(text: str) -> list[list[str]]:
    """The rows of sacreBLEU's paired-test table (a p-value line joined to its system's row), header first."""
    rows = []
    for line in text.splitlines():
        if line.startswith("│"):
            cells = [c.strip() for c in line.strip("│").split("│")]
            if cells[0]:
                rows.append(cells)
            else:
                rows[-1] = [a + " " + b for a, b in zip(rows[-1], cells)]
    return rows


def numbers(cell: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+\.\d+", cell)]


@pytest.mark.model
def test_every_figure_is_what_the_sacrebleu_command_prints(toy_run, tmp_path):
    sources, references = eval_texts(Translator.from_run(toy_run).config, "test")
    src, ref1, ref2, better = (tmp_path / name for name in ("src.en", "ref1.zh", "ref2.zh", "better.zh"))
    src.write_text("\n".join(sources) + "\n", encoding="utf-8")
    ref1.write_text("\n".join(references) + "\n", encoding="utf-8")
    ref2.write_text("\n".join(r[:-1] or r for r in references) + "\n", encoding="utf-8")  # last character cut
    better.write_text("\n".join(references) + "\n", encoding="utf-8")
    sentence_file = tmp_path / "sentences.jsonl"
    args = ["eval", "--run", toy_run, "--src", src, "--ref", ref1, "--ref", ref2, "--beam", "1", "--confidence"]
    args += ["--compare", toy_run, "--compare", better, "--sentence-scores", sentence_file, "--json"]
    result = json.loads(invoke(*args).stdout)

    for name, entry in result["scores"].items():
        printed = json.loads(sacrebleu(entry["command"]))  # a list of metrics, or one metric alone
        printed = {s["name"]: s for s in (printed if isinstance(printed, list) else [printed])}[entry["name"]]
        assert printed["nrefs"] == "2" and printed["signature"] == entry["signature"], name
        for key, ours in (("score", "score"), ("confidence_mean", "mean"), ("confidence_var", "ci")):
            assert printed[key] == pytest.approx(entry[ours], abs=6e-5), (name, key)

    systems = result["comparison"]["systems"]
    assert systems[1]["scores"]["bleu"]["identical_to_baseline"] and systems[2]["scores"]["bleu"]["p_ar"] < 0.01
    for name, by_test in result["comparison"]["commands"].items():
        for test, command in by_test.items():
            table = grid(sacrebleu(command))
            column = [i for i, head in enumerate(table[0]) if head.startswith(result["scores"][name]["name"] + " ")]
            column = column or [table[0].index(result["scores"][name]["name"])]
            for system, row in zip(systems, table[1:]):
                ours, printed = system["scores"][name], numbers(row[column[0]])
                expected = [ours["score"]] + ([ours["mean"], ours["ci"]] if test == "bs" else [])
                if system is not systems[0] and not ours.get("identical_to_baseline"):
                    expected.append(ours[f"p_{test}"])  # sacreBLEU tests an identical system (see paired_tests)
                assert printed[: len(expected)] == pytest.approx(expected, abs=6e-5), (name, test, system["name"])

    lines = [json.loads(line) for line in sentence_file.read_text(encoding="utf-8").splitlines()]
    assert len(lines) == len(sources) == 200 and lines[0]["line"] == 1
    for name, command in result["sentence_scores"]["commands"].items():
        printed = [float(x) for x in sacrebleu(command).split()]
        assert printed == pytest.approx([line[name] for line in lines], abs=6e-5), name
