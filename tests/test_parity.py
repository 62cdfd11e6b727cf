"""Exports that prove they are the same model: every export and import prints and writes a parity report; a
`power` run with early stopping beams exactly as CTranslate2 and Transformers do; an export whose outputs collapse
is refused in one line and leaves nothing; the .argosmodel package installs in the real argostranslate and
translates as the CTranslate2 export does."""

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from conftest import invoke
from typer.testing import CliRunner

from mtcli.checkpoint import best_checkpoint
from mtcli.cli import app
from mtcli.data import eval_texts
from mtcli.errors import MtcliError
from mtcli.parity import CTranslate2Engine, EngineSettings, TransformersEngine, repeats, stress_lines
from mtcli.translate import Translator

pytestmark = pytest.mark.model


def refused(*args) -> str:
    """The one-line error of an mtcli command that must fail (the CLI prints it and exits with status 2)."""
    with pytest.raises(MtcliError) as error:
        CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    return str(error.value)


def test_every_export_writes_a_parity_report_that_holds(toy_run, tmp_path):
    """CTranslate2 float32 and int8 and Transformers: parity.json beside the model, the table printed; float32 is
    line-identical to mtcli at the settings the engine expresses, and the run's own (GNMT) search is reported
    beside, with the settings the engine cannot express."""
    pytest.importorskip("ctranslate2", reason="the export extra is not installed")
    for fmt, quantization in (("ctranslate2", "none"), ("ctranslate2", "int8"), ("hf", "none")):
        out = tmp_path / f"{fmt}-{quantization}"
        printed = invoke(
            "export", "--run", toy_run, "--format", fmt, "--quantization", quantization, "--out", out
        ).output
        report = json.loads((out / "parity.json").read_text())
        assert f"parity: {'hf' if fmt == 'hf' else 'ctranslate2'}" in printed and "DIVERGED" not in printed
        assert report["probe"].startswith("the valid split") and report["lines"] > 100
        assert report["failures"] == []
        rows = {r["mode"]: r for r in report["rows"]}
        assert set(rows) == {"greedy", "beam 4", "beam 4, run's search"}  # toy.yaml: beam 4, GNMT 0.6
        assert any("length_norm gnmt" in n for n in report["not_expressible"])
        if quantization == "none":
            assert rows["greedy"]["identical"] == rows["greedy"]["lines"]
            assert rows["beam 4"]["identical_rate"] >= 0.99
        else:
            assert abs(rows["beam 4"]["bleu"][1] - rows["beam 4"]["bleu"][0]) <= 1.0
    config = json.loads((tmp_path / "ctranslate2-none" / "mtcli.json").read_text())
    assert config["translate_batch"]["beam_size"] == 4 and config["translate_batch"]["length_penalty"] == 0.6
    generation = json.loads((tmp_path / "hf-none" / "generation_config.json").read_text())
    assert generation["num_beams"] == 4 and generation["length_penalty"] == 0.6 and not generation["early_stopping"]


def test_a_power_run_with_early_stopping_beams_as_ctranslate2_and_transformers(toy_run, tmp_path):
    """decode.length_norm power with early_stopping is CTranslate2's search and Transformers' generate with
    early_stopping=True; without early_stopping it is generate's default (the patient rule). Line for line, at
    length penalties that change the search."""
    pytest.importorskip("ctranslate2", reason="the export extra is not installed")
    pytest.importorskip("transformers", reason="the export extra is not installed")
    invoke("export", "--run", toy_run, "--format", "ctranslate2", "--out", tmp_path / "ct2", "--probe-lines", "0")
    invoke("export", "--run", toy_run, "--format", "hf", "--out", tmp_path / "hf", "--probe-lines", "0")
    translator = Translator.from_run(toy_run, device="cpu", precision="fp32")
    sources = eval_texts(translator.config, "valid")[0][:120]
    ct2, hf = CTranslate2Engine(tmp_path / "ct2"), TransformersEngine(tmp_path / "hf")
    limit = translator.config.model.max_positions - 1
    changed = 0
    for lenpen in (1.0, 2.0):
        for early in (True, False):
            settings = EngineSettings(4, lenpen, early, 1, limit, 0)
            ours = translator.translate(
                sources, beam=4, lenpen=lenpen, length_norm="power", early_stopping=early, max_len_a=0, max_len_b=limit
            )
            assert hf.translate(sources, settings, 4) == ours
            if early:
                assert ct2.translate(sources, settings, 4) == ours
            changed += sum(a != b for a, b in zip(ours, translator.translate(sources, beam=4, lenpen=0.0)))
    assert changed > 0  # the length penalties did change the search: the equalities above test something


def test_an_export_whose_outputs_collapse_is_refused_and_leaves_nothing(toy_run, tmp_path, monkeypatch):
    """A conversion that breaks the model (here: the output layer pushed towards one subword, so the engine repeats
    it) is refused in one line naming what diverged; nothing is written; --no-check writes it with the report."""
    pytest.importorskip("ctranslate2", reason="the export extra is not installed")
    import mtcli.export as export

    original = export._ctranslate2_spec

    def broken(model, tokenizer, ctranslate2, align_heads):
        spec = original(model, tokenizer, ctranslate2, align_heads)
        bias = torch.zeros(tokenizer.tgt_vocab_size)
        bias[10] = 50.0  # one ordinary subword outscores every other at every step
        spec.decoder.projection.bias = bias.numpy()
        return spec

    monkeypatch.setattr(export, "_ctranslate2_spec", broken)
    out = tmp_path / "int8"
    error = refused("export", "--run", toy_run, "--format", "ctranslate2", "--quantization", "int8", "--out", out)
    assert "does not translate as mtcli does" in error and "207 repeating outputs (mtcli 0)" in error, error
    assert "\n" not in error
    assert not out.exists() and not list(tmp_path.iterdir())
    invoke("export", "--run", toy_run, "--format", "ctranslate2", "--quantization", "int8", "--out", out, "--no-check")
    report = json.loads((out / "parity.json").read_text())
    assert report["failures"] and (out / "model.bin").is_file()


def test_an_export_records_its_files_and_verify_names_each_one_that_changed(toy_run, tmp_path):
    """parity.json holds the size and sha256 of every file of the export it describes; `mtcli verify` passes an
    intact folder, names each changed or missing file on a line of its own (status 2) and lists files the report
    does not know. The format's short name in any case is taken; JSON keeps a Chinese path as it is."""
    pytest.importorskip("ctranslate2", reason="the export extra is not installed")
    checkpoint = tmp_path / "模型" / "best"
    shutil.copytree(best_checkpoint(toy_run), checkpoint)
    out = tmp_path / "ct2"
    invoke("export", "--checkpoint", checkpoint, "--format", "CT2", "--out", out, "--probe-lines", "10")
    assert "模型" in (out / "mtcli.json").read_text(encoding="utf-8")
    report = json.loads((out / "parity.json").read_text(encoding="utf-8"))
    assert report["engine"] == "ctranslate2" and {"model.bin", "spm.model", "mtcli.json"} <= set(report["files"])
    data = (out / "model.bin").read_bytes()
    assert report["files"]["model.bin"] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert "the 5 files parity.json records are intact" in invoke("verify", out).stdout
    (out / "model.bin").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit of one weight
    (out / "spm.model").unlink()
    (out / "notes.txt").write_text("mine\n")
    result = CliRunner().invoke(app, ["verify", str(out)])
    assert isinstance(result.exception, MtcliError) and "2 of 5 files differ" in str(result.exception)
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["notes.txt", "model.bin", "spm.model"], lines
    assert "not in parity.json" in lines[0] and "differs" in lines[1] and "missing" in lines[2]
    assert "no such export" in refused("verify", tmp_path / "nowhere")


def test_an_argos_package_is_bound_to_its_report_and_the_export_names_the_package(toy_run, tmp_path):
    """The package's parity.json records its own files (model/, sentencepiece.model, metadata.json, ...); the
    command prints the package's path, never the work folder it was built in, which is gone."""
    pytest.importorskip("ctranslate2", reason="the export extra is not installed")
    package = tmp_path / "toy.argosmodel"
    result = invoke("export", "--run", toy_run, "--format", "Argos", "--out", package, "--probe-lines", "10")
    printed = result.output
    assert result.stdout == f"{package}\n" and f"package (en -> zh) to {package}" in printed
    assert ".work-" not in printed and "mtcli-argos" not in printed and sorted(tmp_path.iterdir()) == [package]
    assert "intact" in invoke("verify", package).stdout
    with zipfile.ZipFile(package) as z:
        members = {name: z.read(name) for name in z.namelist()}
    report = json.loads(members["translate-en_zh-1_0/parity.json"])
    assert {"model/model.bin", "sentencepiece.model", "metadata.json", "README.md"} <= set(report["files"])
    members["translate-en_zh-1_0/README.md"] += b"\nedited\n"
    with zipfile.ZipFile(package, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    assert "README.md: differs" in CliRunner().invoke(app, ["verify", str(package)]).stdout


def test_repeats_and_stress_lines(toy_run):
    assert repeats([5, 5, 5, 5]) and repeats([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3]) and not repeats([5, 5, 5, 6])
    translator = Translator.from_run(toy_run, device="cpu", precision="fp32")
    lines = stress_lines(translator.tokenizer, translator.config.model.max_positions)
    assert len(lines) == 7 and all(lines)
    lengths = [len(ids) for ids in translator.tokenizer.encode_src(lines)]
    assert max(lengths) == lengths[-1] <= translator.max_src_tokens  # the long line fits the positions, just


def test_parity_options_are_checked(toy_run, tmp_path):
    cases = [
        (["--probe-ref", tmp_path / "ref"], "--probe-ref needs --probe"),
        (["--probe-lines", "-1"], "--probe-lines -1"),
        (["--probe", tmp_path / "missing.txt"], "missing.txt: no such file"),
    ]
    for extra, message in cases:
        assert message in refused(
            "export", "--run", toy_run, "--format", "ctranslate2", "--out", tmp_path / "x", *extra
        )
    (tmp_path / "probe.txt").write_text("I love apples\nTom reads books\n")
    (tmp_path / "ref.txt").write_text("我喜欢苹果\n")
    error = refused(
        "export", "--run", toy_run, "--format", "ctranslate2", "--out", tmp_path / "x",
        "--probe", tmp_path / "probe.txt", "--probe-ref", tmp_path / "ref.txt",
    )  # fmt: skip
    assert "1 lines for 2 in --probe" in error
    assert "name a .argosmodel file" in refused(
        "export", "--run", toy_run, "--format", "argos", "--out", tmp_path / "x.zip"
    )
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.zip").exists()


ARGOS = importlib.util.find_spec("argostranslate") is not None

ARGOS_SCRIPT = """
import json, os, sys
import argostranslate.package, argostranslate.translate
argostranslate.package.install_from_path(sys.argv[1])
[package] = argostranslate.package.get_installed_packages()
lines = json.loads(sys.stdin.read())
out = [argostranslate.translate.translate(line, package.from_code, package.to_code) for line in lines]
print(json.dumps({"package": [package.from_code, package.to_code, str(package.package_version)], "out": out}))
"""


@pytest.mark.skipif(not ARGOS, reason="argostranslate is not installed (pip install argostranslate)")
def test_the_argos_package_installs_in_argostranslate_and_translates_as_the_ctranslate2_export(toy_run, tmp_path):
    """The real argostranslate, in a process of its own with its folders under tmp_path and no network needed:
    install_from_path takes the .argosmodel; its translations equal the CTranslate2 export's at Argos' settings
    (beam 4, length penalty 0.2, float32), a line of three sentences is split as three (not at "3.5")."""
    pytest.importorskip("ctranslate2", reason="the export extra is not installed")
    package = tmp_path / "toy.argosmodel"
    invoke("export", "--run", toy_run, "--format", "argos", "--out", package)
    with zipfile.ZipFile(package) as z:
        names = set(z.namelist())
        top = "translate-en_zh-1_0"
        assert {f"{top}/metadata.json", f"{top}/model/model.bin", f"{top}/sentencepiece.model"} <= names
        assert f"{top}/minisbd/en.onnx" in names and f"{top}/parity.json" in names
        metadata = json.loads(z.read(f"{top}/metadata.json"))
    assert (metadata["from_code"], metadata["to_code"], metadata["to_name"]) == ("en", "zh", "Chinese")
    translator = Translator.from_run(toy_run, device="cpu", precision="fp32")
    sources = eval_texts(translator.config, "test")[0][:60]
    env = dict(os.environ, ARGOS_PACKAGES_DIR=str(tmp_path / "packages"), ARGOS_DEVICE_TYPE="cpu")
    env.update({f"XDG_{kind}_HOME": str(tmp_path / kind.lower()) for kind in ("DATA", "CONFIG", "CACHE")})
    env.update(ARGOS_COMPUTE_TYPE="float32", ARGOS_BEAM_SIZE="4")
    three = f"{sources[0]} It costs 3.5 dollars! {sources[1]}"
    done = subprocess.run(
        [sys.executable, "-c", ARGOS_SCRIPT, str(package)],
        input=json.dumps([*sources, three]),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["package"] == ["en", "zh", "1.0"]
    invoke("export", "--run", toy_run, "--format", "ctranslate2", "--out", tmp_path / "ct2", "--probe-lines", "0")
    ct2 = CTranslate2Engine(tmp_path / "ct2")
    argos_settings = EngineSettings(4, 0.2, True, 1, 256, 0)
    assert result["out"][:-1] == ct2.translate(sources, argos_settings, 4)
    parts = ct2.translate([sources[0], "It costs 3.5 dollars!", sources[1]], argos_settings, 4)
    assert result["out"][-1] == " ".join(parts)  # Argos joins a line's sentences with a space
