"""Your files are safe: every command that writes a folder or a file, pointed at a folder holding someone's file, at
the run itself, at `.`, and at a file, refuses in one line and leaves every byte as it was; its own earlier output is
replaced only with --force, and never together with a file it did not write; a failed command leaves nothing."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtcli.cli import app
from mtcli.errors import MtcliError
from mtcli.outputs import MANIFEST


def run_cli(*args):
    """The command in-process; returns None on success, the MtcliError it raised otherwise."""
    try:
        result = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    except MtcliError as e:
        return e
    assert result.exit_code == 0, result.output
    return None


def snapshot(*folders: Path) -> dict[str, str]:
    """Every file below the folders (or the files themselves) with a checksum of its bytes."""
    found = {}
    for top in folders:
        paths = [top] if top.is_file() else [Path(r) / f for r, _, files in os.walk(top) for f in files]
        for path in paths:
            found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture
def places(tmp_path, toy_run, monkeypatch):
    """The four targets of the issue: a folder with a foreign file, the run itself, `.` (a folder of the user's that
    is the working directory), and an existing file."""
    foreign = tmp_path / "thesis"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "notes.txt").write_text("mine\n")
    monkeypatch.chdir(cwd)
    afile = tmp_path / "out.txt"
    afile.write_text("someone's text\n")
    return {"foreign": foreign, "run": toy_run, "dot": Path("."), "file": afile}


PROBE = ("--probe-lines", "0")


def folder_commands(toy_run, hf_source):
    commands = {
        # --probe-lines 0: the parity report (test_parity's subject) on its stress lines alone
        "export hf": lambda out, *extra: ("export", "--run", toy_run, "--format", "hf", "--out", out, *PROBE, *extra),
        "export ctranslate2": lambda out, *extra: (
            "export",
            "--run",
            toy_run,
            "--format",
            "ctranslate2",
            "--out",
            out,
            *PROBE,
            *extra,
        ),
        "average": lambda out, *extra: ("average", "--run", toy_run, "--last", "2", "--out", out, *extra),
    }
    if hf_source is not None:
        commands["import"] = lambda out, *extra: ("import", "--hf", hf_source, "--out", out, *PROBE, *extra)
    return commands


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
    """A small MarianMT folder to import (None without transformers)."""
    try:
        from test_marian import build_marian
    except ImportError:
        return None
    folder = tmp_path_factory.mktemp("marian") / "hf"
    build_marian(folder, separate=False)
    return folder


@pytest.mark.system
@pytest.mark.parametrize("target", ["foreign", "run", "dot", "file"])
def test_folder_writers_refuse_what_they_did_not_write_and_change_nothing(target, places, toy_run, hf_source):
    pytest.importorskip("ctranslate2")
    where = places[target]
    for name, command in folder_commands(toy_run, hf_source).items():
        before = snapshot(places["foreign"], toy_run, Path.cwd(), places["file"])
        error = run_cli(*command(where))
        assert isinstance(error, MtcliError), f"{name} --out {target} was not refused"
        assert "\n" not in str(error) and str(where) in str(error), (name, str(error))
        assert snapshot(places["foreign"], toy_run, Path.cwd(), places["file"]) == before, f"{name} changed files"
    assert list(places["foreign"].parent.rglob(".*.tmp-*")) == [] and list(toy_run.rglob(".*.tmp-*")) == []


@pytest.mark.system
def test_folder_writers_replace_their_own_output_only_with_force_and_never_a_foreign_file(tmp_path, toy_run, hf_source):
    pytest.importorskip("ctranslate2")
    for name, command in folder_commands(toy_run, hf_source).items():
        out = tmp_path / name.replace(" ", "-")
        assert run_cli(*command(out)) is None, name
        assert (out / MANIFEST).is_file()
        first = snapshot(out)
        error = run_cli(*command(out))  # again, without --force
        assert isinstance(error, MtcliError) and "--force" in str(error), name
        assert snapshot(out) == first
        assert run_cli(*command(out, "--force")) is None, name  # replaced: every file is the command's own
        (out / "mine.txt").write_text("the user's\n")
        error = run_cli(*command(out, "--force"))
        assert isinstance(error, MtcliError) and "mine.txt" in str(error), name
        assert (out / "mine.txt").read_text() == "the user's\n"
        empty = tmp_path / f"{out.name}-empty"
        empty.mkdir()
        assert run_cli(*command(empty)) is None, name  # an empty folder is taken, in place
        assert (empty / MANIFEST).is_file()
    assert list(tmp_path.glob(".*.tmp-*")) == [] and list(tmp_path.glob(".*.old-*")) == []


@pytest.mark.system
def test_a_folder_writer_that_fails_halfway_leaves_nothing_behind(tmp_path, toy_run, monkeypatch):
    pytest.importorskip("ctranslate2")
    import mtcli.outputs

    def disk_full(folder):  # every file is written by now; making them durable fails
        assert any(folder.iterdir())
        raise MtcliError("cannot write: no space left on device")

    monkeypatch.setattr(mtcli.outputs, "_durable", disk_full)
    empty = tmp_path / "empty"
    empty.mkdir()
    for name, command in folder_commands(toy_run, None).items():
        for out in (tmp_path / name.replace(" ", "-"), empty, tmp_path / "new" / "parents" / name.replace(" ", "-")):
            assert isinstance(run_cli(*command(out)), MtcliError), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and list(empty.iterdir()) == []


@pytest.mark.system
def test_import_refuses_its_own_source_as_out(hf_source, tmp_path):
    if hf_source is None:
        pytest.skip("needs transformers")
    before = snapshot(hf_source)
    for out in (hf_source, hf_source / "inside", hf_source.parent):
        error = run_cli("import", "--hf", hf_source, "--out", out)
        assert isinstance(error, MtcliError), out
    assert snapshot(hf_source) == before


@pytest.mark.system
def test_file_writers_refuse_inputs_folders_and_existing_files(places, toy_run, tmp_path):
    source = tmp_path / "in.en"
    source.write_text("I love apples\n")
    before = snapshot(source, places["file"], Path.cwd(), toy_run)
    for args in (
        ("translate", "--run", toy_run, "--input", source, "--output", source),  # the input itself
        ("translate", "--run", toy_run, "--input", source, "--output", places["file"]),  # someone's file
        ("translate", "--run", toy_run, "--input", source, "--output", "."),  # a folder
        ("translate", "--run", toy_run, "--input", source, "--output", toy_run),  # the run
        ("translate", "--run", toy_run, "--output", toy_run / "config.yaml", "I love apples"),  # a file of the run
        ("eval", "--run", toy_run, "--src", source, "--ref", source, "--sentence-scores", source),
        ("eval", "--run", toy_run, "--sentence-scores", places["file"]),
        ("attention", "I love apples", "--run", toy_run, "--out", places["file"]),
    ):
        error = run_cli(*args)
        assert isinstance(error, MtcliError) and "\n" not in str(error), args
    assert snapshot(source, places["file"], Path.cwd(), toy_run) == before


@pytest.mark.system
def test_translate_output_is_written_whole_or_not_at_all(tmp_path, toy_run):
    source, out = tmp_path / "in.en", tmp_path / "out.zh"
    source.write_text("I love apples\nthe cat\n")
    out.write_text("yesterday's translations\n")
    for bad in (("--beam", "0"), ("--checkpoint", tmp_path / "nowhere")):  # errors after --output was checked
        error = run_cli("translate", "--run", toy_run, "--input", source, "--output", out, "--force", *bad)
        assert isinstance(error, MtcliError), bad
        assert out.read_text() == "yesterday's translations\n"
    result = CliRunner().invoke(  # a line that is not UTF-8 stops the stream after the lines before it
        app, ["translate", "--run", str(toy_run), "--output", str(out), "--force"], input=b"I love apples\n\xff\n"
    )
    assert isinstance(result.exception, MtcliError) and "line 2" in str(result.exception)
    assert out.read_text() == "yesterday's translations\n"
    assert run_cli("translate", "--run", toy_run, "--input", source, "--output", out, "--force") is None
    assert len(out.read_text().splitlines()) == 2
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.system
def test_train_refuses_a_folder_that_is_not_a_run_and_a_name_that_is_a_path(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    for name in ("config.yaml", "spm.model", "metrics.jsonl"):
        (folder / name).write_text(f"the user's {name}\n")
    before = snapshot(folder)
    sets = ["--set", "train.max_updates=1", "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    for resume in ([], ["--resume"]):
        error = run_cli("train", "--config", "toy.yaml", "--run-dir", folder, *sets, *resume)
        assert isinstance(error, MtcliError) and "not a run directory" in str(error)
    assert snapshot(folder) == before and sorted(p.name for p in folder.iterdir()) == sorted(
        ["config.yaml", "spm.model", "metrics.jsonl"]
    )
    monkeypatch.chdir(tmp_path)
    for name in (str(tmp_path / "elsewhere"), "../up", "a/b", ".."):
        error = run_cli("train", "--config", "toy.yaml", "--set", f"name={name}", *sets)
        assert isinstance(error, MtcliError) and "plain run name" in str(error), name
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path.parent / "up").exists()


def _dead_pid() -> int:
    """The id of a process that has ended (reused this soon only on a machine that cycles through every id)."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def test_a_killed_writers_temporary_sibling_is_removed_by_the_next_writer_there(tmp_path, log):
    """A command killed mid-write leaves `.<target>.tmp-<pid>` (or argos' `.work-<pid>`, or an earlier output moved
    aside, `.old-<pid>`): the next folder or file writer to that target removes it when its process is gone, and keeps
    one whose process still runs (a command writing there now) and siblings of other targets."""
    from mtcli.outputs import new_file, new_folder, write_file_atomic

    dead, alive = _dead_pid(), os.getppid()
    left = {
        "folder": tmp_path / f".export.tmp-{dead}",
        "moved aside": tmp_path / f".export.old-{dead}",
        "work": tmp_path / f".toy.argosmodel.work-{dead}",
        "running": tmp_path / f".export.tmp-{alive}",
        "other": tmp_path / f".another.tmp-{dead}",
    }
    for folder in left.values():
        folder.mkdir()
        (folder / "model.bin").write_bytes(b"half a model")
    stale_file = tmp_path / f".out.zh.tmp-{dead}"
    stale_file.write_text("half the translations\n")
    with new_folder(tmp_path / "export", "export --format hf") as folder:
        (folder / "config.json").write_text("{}")
    assert not left["folder"].exists() and not left["moved aside"].exists()
    assert left["running"].is_dir() and left["other"].is_dir()
    assert any(f"process {dead} is gone" in line for line in log)
    with new_file(tmp_path / "out.zh") as handle:
        handle.write("translations\n")
    assert not stale_file.exists() and (tmp_path / "out.zh").read_text() == "translations\n"
    with new_file(tmp_path / "toy.argosmodel", binary=True) as handle:
        handle.write(b"PK")
    assert not left["work"].exists() and left["running"].is_dir()
    record = tmp_path / f".distill.json.tmp-{dead}"  # a run's record, rewritten whole at every step
    record.write_text('{"steps": ')
    write_file_atomic(tmp_path / "distill.json", '{"steps": {}}')
    assert not record.exists() and (tmp_path / "distill.json").read_text() == '{"steps": {}}'


def test_a_run_directory_is_one_a_run_made_and_a_folder_of_the_users_is_refused(tmp_path):
    """train takes a new or empty folder, or a run that train, import or distill made (an older mtcli's: checkpoints/
    and config.yaml); distill only its own. Refused in one line naming what is there, before anything is written."""
    from mtcli.rundir import check_run_dir, mark_run_dir

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    with pytest.raises(MtcliError, match=rf"^--run-dir {mine}: not a run directory \(it holds notes.txt\); cannot t"):
        check_run_dir(mine, "train into")
    with pytest.raises(MtcliError, match=rf"^--run-dir {mine}: not a distill run directory \(it holds notes.txt\)"):
        check_run_dir(mine, "distill into", ("distill",))
    with pytest.raises(MtcliError, match="exists and is not a folder"):
        check_run_dir(mine / "notes.txt", "train into")
    runs = {command: tmp_path / command for command in ("train", "import", "distill", "export")}
    for command, run in runs.items():
        run.mkdir()
        mark_run_dir(run, command)
        (run / "config.yaml").write_text("name: x\n")
    older = tmp_path / "older"
    (older / "checkpoints").mkdir(parents=True)
    (older / "config.yaml").write_text("name: x\n")
    for run in (runs["train"], runs["import"], runs["distill"], older, tmp_path / "new", tmp_path / "new" / "er"):
        check_run_dir(run, "train into")
    check_run_dir(runs["distill"], "distill into", ("distill",))
    for run in (runs["export"], runs["train"], older):
        with pytest.raises(MtcliError):
            check_run_dir(run, "distill into", ("distill",))
    with pytest.raises(MtcliError, match="not a run directory"):
        check_run_dir(runs["export"], "resume")
    mark_run_dir(runs["distill"], "train")  # a distill run's student trains there: it stays distill's
    check_run_dir(runs["distill"], "distill into", ("distill",))
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


@pytest.mark.system
def test_a_full_disk_while_translating_to_a_file_is_one_line_and_the_file_is_kept(tmp_path, toy_run, monkeypatch):
    import errno

    import mtcli.line_io

    source, out = tmp_path / "in.en", tmp_path / "out.zh"
    source.write_text("I love apples\nthe cat\n")
    out.write_text("yesterday's translations\n")
    write = mtcli.line_io.write_translations

    def disk_full(translator, chunks, decode, handle, total, alignments=False):
        write(translator, chunks, decode, handle, total, alignments)
        raise OSError(errno.ENOSPC, "No space left on device")  # as a write or flush past the last free block

    monkeypatch.setattr(mtcli.line_io, "write_translations", disk_full)
    error = run_cli("translate", "--run", toy_run, "--input", source, "--output", out, "--force")
    assert isinstance(error, MtcliError) and "\n" not in str(error), error
    assert str(out) in str(error) and "no space left" in str(error)
    assert out.read_text() == "yesterday's translations\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "in.en",
        "out.zh",
    ]
