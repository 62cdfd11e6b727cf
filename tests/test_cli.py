"""End to end through the command line: train the toy model, translate, evaluate, average; help and errors."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import typer
from conftest import tiny_pairs
from typer.testing import CliRunner

from mtcli.checkpoint import best_checkpoint, list_checkpoints
from mtcli.cli import app
from mtcli.errors import MtcliError

runner = CliRunner()


def invoke(*args, input=None):
    result = runner.invoke(app, [str(a) for a in args], input=input, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_help_lists_every_command_and_each_shows_an_example():
    group = typer.main.get_command(app)
    commands = [[name] for name in group.commands if name != "data"] + [
        ["data", name] for name in group.commands["data"].commands
    ]
    documented = {"train", "translate", "eval", "average", "export", "import", "attention", "serve"}
    assert documented <= {c[0] for c in commands} and ["data", "prepare"] in commands  # none lost
    listed = invoke("--help").output
    for command in commands:
        assert re.search(rf"^\W*{command[0]}\b", listed, re.M), command  # a line of its own in the command list
        assert "Example:" in invoke(*command, "--help").output, command


def test_help_shows_extras_and_plain_types_and_a_bare_command_exits_0():
    assert "pip install 'mtcli[export]'" in invoke("export", "--help").output  # not swallowed as markup
    assert "pip install 'mtcli[plot]'" in invoke("attention", "--help").output
    assert "pip install 'mtcli[serve]'" in invoke("serve", "--help").output
    for command in (["translate"], ["eval"], ["train"], ["export"], ["data", "prepare"]):
        text = invoke(*command, "--help").output
        assert "<bool>" not in text and "<list[" not in text, (command, text)
    assert "<path>" in invoke("translate", "--help").output  # --ensemble: the element's type
    for bare in ([], ["data"]):
        result = CliRunner().invoke(app, bare)
        assert result.exit_code == 0 and "Usage:" in result.output and "Commands" in result.output, result.output


def test_import_help_says_what_it_writes_and_export_formats_take_their_aliases():
    assert "Write the run even where" in invoke("import", "--help").output  # not "the export"
    for name in ("onnx", "ct3"):
        with pytest.raises(MtcliError, match=f"--format {name}: choose hf, ctranslate2 or argos"):
            runner.invoke(app, ["export", "--format", name, "--out", "x"], catch_exceptions=False)


def test_a_full_disk_is_one_line_naming_the_file(monkeypatch, capsys):
    """An OSError for a full disk or quota that no command turned into its own line: one line naming the path."""
    import errno

    import mtcli.cli

    for code, filename in ((errno.ENOSPC, "/data/runs/x/metrics.jsonl"), (errno.EDQUOT, None)):

        def full(code=code, filename=filename):
            raise OSError(code, "No space left on device", filename)

        monkeypatch.setattr(mtcli.cli, "app", full)
        with pytest.raises(SystemExit) as exit_:
            mtcli.cli.main()
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
        assert filename is None or filename in err
    monkeypatch.setattr(mtcli.cli, "app", lambda: open("/nonexistent-folder/x", "w"))
    with pytest.raises(FileNotFoundError):  # any other OSError is not dressed up as a full disk
        mtcli.cli.main()


@pytest.mark.system
def test_errors_are_one_line_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {dataset: toy}\nmodel: {d_modle: 64}\n")
    for args in (
        ["train", "--config", str(bad)],
        ["data", "prepare", "--config", "nope.yaml"],
        ["translate", "--run", str(tmp_path / "missing"), "hello"],
    ):
        proc = subprocess.run([sys.executable, "-m", "mtcli", *args], capture_output=True, text=True, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
        assert "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "mtcli", "train", "--config", str(bad)], capture_output=True, text=True
    )
    assert "model.d_model" in proc.stderr and str(bad) in proc.stderr


@pytest.mark.model
def test_toy_model_learns(toy_run):
    """A broken mask, shift or cache would not get near this score on the toy valid split."""
    best = json.loads((toy_run / "checkpoints" / "best.json").read_text())
    assert best["metric"] == "bleu" and best["score"] >= 60, best
    for name in ("config.yaml", "spm.model", "train.log", "metrics.jsonl"):
        assert (toy_run / name).is_file(), name
    assert list((toy_run / "tb").glob("events.out.tfevents.*"))


@pytest.mark.model
def test_translate_arguments_stdin_and_files(toy_run, tmp_path, monkeypatch):
    monkeypatch.chdir(toy_run.parent.parent)  # the latest run under ./runs is the default
    result = invoke("translate", "I love apples", "", "She really likes green apples")
    assert result.stdout.split("\n") == ["我喜欢苹果", "", "她真的喜欢青苹果", ""]
    piped = invoke("translate", "--beam", "1", input="I love apples\nDo you like tea?\n")
    assert piped.stdout.split("\n")[0] == "我喜欢苹果" and len(piped.stdout.split("\n")) == 3
    source = tmp_path / "in.en"
    source.write_text("I love apples\n" * 30 + ("very " * 400) + "long\n\n")
    out = tmp_path / "out.zh"
    result = runner.invoke(app, ["translate", "--input", str(source), "--output", str(out), "--nbest", "1"])
    assert result.exit_code == 0, result.output
    lines = out.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 33 and lines[0] == "我喜欢苹果" and lines[31] == "" and lines[32] == ""
    assert result.stderr.count("truncated") == 1 and "checkpoint: runs/toy/checkpoints/" in result.stderr
    nbest = invoke("translate", "--beam", "3", "--nbest", "3", "I love apples", "").stdout.strip().split("\n")
    assert len(nbest) == 4 and all(line.startswith("0 ||| ") for line in nbest[:3]) and nbest[3].startswith("1 ||| ")
    fields = [line.split(" ||| ") for line in nbest[:3]]  # Moses: index, text, features, score
    assert all(len(f) == 4 for f in fields) and fields[0][1] == "我喜欢苹果"
    scores = [float(f[3]) for f in fields]
    assert scores == sorted(scores, reverse=True)
    for f in fields:  # the score is the log-probability over the length penalty of the features' length
        features = dict(zip(f[2].split()[::2], map(float, f[2].split()[1::2])))
        assert float(f[3]) == pytest.approx(features["log_prob="] / ((5 + features["length="]) / 6) ** 0.6, abs=2e-4)


@pytest.mark.system
def test_eval_reports_what_sacrebleu_reports_on_the_written_files(toy_run):
    result = json.loads(invoke("eval", "--run", toy_run, "--json").stdout)
    for key in ("bleu", "chrf", "signature", "hypotheses", "references"):
        assert key in result
    assert "tok:zh" in result["signature"]
    # a score says which precision produced it, and why (auto: what the CPU has, never a timing)
    assert result["precision_reason"].startswith(("this CPU has", "as set")), result
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "sacrebleu",
            result["references"][0],
            "-i",
            result["hypotheses"],
            "-tok",
            "zh",
            "-b",
            "-w",
            "4",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert float(cli.stdout.strip()) == pytest.approx(result["bleu"], abs=1e-4)
    assert len(Path(result["hypotheses"]).read_text(encoding="utf-8").splitlines()) == 200


@pytest.mark.model
def test_validation_bleu_is_eval_bleu(toy_run):
    """One scoring path: greedy eval of the best checkpoint on the valid split repeats the validation score."""
    best = json.loads((toy_run / "checkpoints" / "best.json").read_text())
    result = json.loads(invoke("eval", "--run", toy_run, "--split", "valid", "--beam", "1", "--json").stdout)
    assert result["bleu"] == pytest.approx(best["score"], abs=1e-6)
    assert result["checkpoint"] == str(best_checkpoint(toy_run))


@pytest.mark.system
def test_average_last_checkpoints(toy_run, tmp_path):
    found = list_checkpoints(toy_run)
    assert len(found) >= 2
    result = invoke("average", "--run", toy_run, "--last", "2", "--out", tmp_path / "avg")
    out = Path(result.stdout.strip())
    assert out == tmp_path / "avg" and "deprecated" not in result.output
    assert invoke("translate", "--checkpoint", out, "I love apples").stdout == "我喜欢苹果\n"
    old_name = invoke("average", "--run", toy_run, "--last", "2", "--output", tmp_path / "old")  # for one release
    assert Path(old_name.stdout.strip()) == tmp_path / "old" and (tmp_path / "old" / "model.safetensors").is_file()
    assert [line for line in old_name.stderr.splitlines() if "--output is deprecated" in line and "--out" in line]
    for last, message in ((99, "fewer than --last 99"), (0, "--last 0: average at least 1")):
        proc = subprocess.run(
            [sys.executable, "-m", "mtcli", "average", "--run", str(toy_run), "--last", str(last)],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 2 and proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr


@pytest.mark.system
def test_ensemble_of_a_run_with_itself_scores_as_the_run_and_refuses_another_vocabulary(toy_run, tmp_path):
    alone = json.loads(invoke("eval", "--run", toy_run, "--split", "valid", "--json").stdout)
    twice = json.loads(invoke("eval", "--run", toy_run, "--split", "valid", "--ensemble", toy_run, "--json").stdout)
    assert twice["bleu"] == pytest.approx(alone["bleu"], abs=1e-6)
    assert twice["ensemble"] == [alone["checkpoint"]] and twice["hypotheses"] != alone["hypotheses"]
    assert invoke("translate", "--run", toy_run, "--ensemble", toy_run, "I love apples").stdout == "我喜欢苹果\n"
    # The same weights beside another SentencePiece model: the ids would mean other pieces.
    other = tmp_path / "other"
    shutil.copytree(best_checkpoint(toy_run), other)
    lines = [s for pair in tiny_pairs(200, 4) for s in pair]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(other / "spm"), vocab_size=60, minloglevel=2
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mtcli", "translate", "--run", str(toy_run), "--ensemble", str(other), "hello"],
        capture_output=True,
        text=True,
    )
    error = proc.stderr.strip().splitlines()[-1]  # after the log lines: which checkpoint, which precision
    assert proc.returncode == 2 and error.startswith("error: ") and "SentencePiece model differs" in error, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.system
def test_translate_input_edge_cases(toy_run, tmp_path):
    # A lone carriage return stays inside its line: two lines in, two lines out.
    source = tmp_path / "cr.en"
    source.write_bytes(b"I love apples\rreally\nDo you like tea?\n")
    out = tmp_path / "cr.zh"
    invoke("translate", "--run", toy_run, "--input", source, "--output", out)
    assert len(out.read_text(encoding="utf-8").split("\n")) == 3
    # An output path that cannot be written, and bytes on stdin that are not UTF-8: one line each, status 2.
    base = [sys.executable, "-m", "mtcli", "translate", "--run", str(toy_run)]
    bad_out = subprocess.run(
        base + ["--output", str(tmp_path / "missing" / "out.zh"), "I love apples"], capture_output=True, text=True
    )
    assert (
        bad_out.returncode == 2 and bad_out.stderr.startswith("error: --output") and "Traceback" not in bad_out.stderr
    )
    bad_in = subprocess.run(base, input=b"I love apples\n\xff\xfe oops\n", capture_output=True, timeout=120)
    assert bad_in.returncode == 2, bad_in.stderr
    assert bad_in.stdout.decode() == "我喜欢苹果\n"  # what came before the bad line is translated
    assert b"stdin line 2: not valid UTF-8" in bad_in.stderr and b"Traceback" not in bad_in.stderr


@pytest.mark.model
def test_no_repeat_ngram_applies_to_beam_one(toy_run):
    from dataclasses import replace

    from mtcli.data import eval_texts
    from mtcli.translate import Translator

    translator = Translator.from_checkpoint(best_checkpoint(toy_run), "cpu")
    sources, _ = eval_texts(translator.config, "test")
    greedy = replace(translator.config.decode, beam=1, nbest=1)
    repeats = lambda hyps: sum(len(set(h[0].tokens)) < len(h[0].tokens) for h in hyps)  # noqa: E731
    assert repeats(translator.translate_nbest(sources, greedy)) > 0  # the toy outputs do repeat subwords (妈妈)
    assert repeats(translator.translate_nbest(sources, replace(greedy, no_repeat_ngram=1))) == 0


@pytest.mark.model
def test_sampling_through_the_command_is_seeded_by_the_run_and_top_k_one_is_greedy(toy_run):
    """--sampling draws from one stream seeded by the run's train.seed, so the same command prints the same lines; it
    does sample (one sentence repeated comes out in several ways at a high temperature); --top-k 1 leaves only the
    most likely token at each step, which is greedy search whatever the temperature."""
    lines = ["I love apples"] * 8 + ["She really likes green apples", "Do you like tea?"]
    base = ["translate", "--run", toy_run, *lines]
    hot = invoke(*base, "--sampling", "--temperature", "3").stdout
    assert invoke(*base, "--sampling", "--temperature", "3").stdout == hot
    assert len(hot.splitlines()) == len(lines) and len(set(hot.splitlines()[:8])) > 1
    greedy = invoke(*base, "--beam", "1").stdout
    assert greedy.splitlines()[0] == "我喜欢苹果"
    assert invoke(*base, "--sampling", "--temperature", "3", "--top-k", "1").stdout == greedy
    assert invoke(*base, "--sampling", "--top-k", "1", "--beam", "4").stdout == greedy  # sampling, not the beam


def test_version_and_conflicting_inputs(tmp_path):
    from mtcli import __version__

    assert invoke("--version").stdout == f"mtcli {__version__}\n"
    source = tmp_path / "in.en"
    source.write_text("I love apples\n")
    with pytest.raises(MtcliError, match="not both"):  # text arguments would otherwise be dropped silently
        runner.invoke(app, ["translate", "--input", str(source), "hello"], catch_exceptions=False)


@pytest.mark.model
def test_decode_settings_from_set_and_what_was_picked(toy_run):
    """translate/eval take --set decode.KEY=VALUE (and nothing else), and say which checkpoint they picked."""
    base = ["translate", "--run", str(toy_run), "I love apples"]
    long = invoke(*base, "--set", "decode.min_len=12", "--set", "decode.beam=2")
    assert len(long.stdout.strip()) >= 6 and long.stdout != "我喜欢苹果\n"  # min_len forces a longer output
    assert f"checkpoint: {best_checkpoint(toy_run)} (best by validation)" in long.stderr
    with pytest.raises(MtcliError, match="takes only decode.KEY=VALUE"):
        runner.invoke(app, [*base, "--set", "model.layers=2"], catch_exceptions=False)
    result = json.loads(invoke("eval", "--run", toy_run, "--set", "decode.beam=1", "--lowercase", "--json").stdout)
    assert result["beam"] == 1 and "case:lc" in result["signature"] and "-tok zh" in result["command"]
    assert "-lc --chrf-lowercase" in result["command"]


def test_counts_agree_with_their_nouns():
    """What the server says when it stops ("answered 1 of 1 accepted request, 1 sentence"), never "1 sentences"."""
    from mtcli.log import counted

    assert [counted(n, "sentence") for n in (0, 1, 2, 1024)] == [
        "0 sentences",
        "1 sentence",
        "2 sentences",
        "1,024 sentences",
    ]


@pytest.mark.system
def test_importing_mtcli_sets_a_short_openmp_wait_before_torch_loads_and_keeps_the_users():
    """OpenMP's default spin-wait made trainings sharing a machine collapse (issue 59): mtcli sets a short one as it
    is imported, before torch, unless the user set their own."""
    import os
    import subprocess
    import sys

    probe = "import os, mtcli, torch; print(os.environ['GOMP_SPINCOUNT'], os.environ['KMP_BLOCKTIME'])"
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    run = lambda extra: subprocess.run(  # noqa: E731
        [sys.executable, "-c", probe], env=env | extra, capture_output=True, text=True, check=True
    ).stdout.split()
    assert run({}) == ["1000", "1"]
    assert run({"GOMP_SPINCOUNT": "300000"}) == ["300000", "1"]
