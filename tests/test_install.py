"""make install's torch choice (scripts/pick_torch.py): the CPU build on a machine without an NVIDIA GPU, the
default (CUDA) build with one, and a TORCH the user names as it is. The GPU check and the index are faked."""

import importlib.util
import platform
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "pick_torch.py"


@pytest.fixture
def pick_torch():
    spec = importlib.util.spec_from_file_location("pick_torch", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wheel(folder: Path, version: str, python: str | None = None, machine: str | None = None) -> None:
    python = python or f"cp{sys.version_info.major}{sys.version_info.minor}"
    machine = machine or platform.machine()
    (folder / f"torch-{version}-{python}-{python}-manylinux_2_28_{machine}.whl").write_bytes(b"")


def run_main(pick_torch, monkeypatch, capsys, argument, gpu, folders=(), index=False):
    monkeypatch.setattr(pick_torch, "nvidia_gpu", lambda: gpu)
    monkeypatch.setattr(pick_torch, "find_links", lambda: list(folders))
    monkeypatch.setattr(pick_torch, "cpu_index_answers", lambda: index)
    monkeypatch.setattr(sys, "argv", ["pick_torch.py", argument])
    pick_torch.main()
    out, err = capsys.readouterr()
    return out.strip(), err.strip()


def test_without_a_gpu_the_cpu_build_pip_already_offers(pick_torch, monkeypatch, capsys, tmp_path):
    wheel(tmp_path, "2.9.1+cpu")
    wheel(tmp_path, "2.13.0+cpu")
    wheel(tmp_path, "2.14.1+cpu", python="cp27")  # another Python: not installable here
    wheel(tmp_path, "2.15.0+cpu", machine="riscv64")  # another machine
    wheel(tmp_path, "2.14.1")  # a default (CUDA) build
    out, err = run_main(pick_torch, monkeypatch, capsys, "auto", gpu=False, folders=[tmp_path], index=True)
    assert out == "torch==2.13.0+cpu"
    assert err == "torch: no NVIDIA GPU: the CPU build 2.13.0+cpu that pip's configuration offers"


def test_without_a_gpu_or_a_local_build_pytorchs_cpu_index(pick_torch, monkeypatch, capsys):
    out, err = run_main(pick_torch, monkeypatch, capsys, "auto", gpu=False, index=True)
    assert out.startswith("torch --index-url https://download.pytorch.org/whl/cpu")
    out, err = run_main(pick_torch, monkeypatch, capsys, "auto", gpu=False, index=False)
    assert out == "torch" and err.startswith("torch: warning: no NVIDIA GPU") and "TORCH=" in err


def test_with_a_gpu_the_default_build_and_a_named_torch_as_it_is(pick_torch, monkeypatch, capsys, tmp_path):
    wheel(tmp_path, "2.13.0+cpu")
    out, err = run_main(pick_torch, monkeypatch, capsys, "auto", gpu=True, folders=[tmp_path])
    assert (out, err) == ("torch", "torch: an NVIDIA GPU is present: torch's default (CUDA) build")
    out, err = run_main(pick_torch, monkeypatch, capsys, "torch==2.13.0", gpu=False, folders=[tmp_path])
    assert (out, err) == ("torch==2.13.0", "torch: TORCH=torch==2.13.0, as asked")


def test_the_makefile_installs_what_the_script_picks():
    makefile = (SCRIPT.parents[1] / "Makefile").read_text()
    assert "TORCH ?= auto" in makefile
    assert '$(BIN)/pip install --quiet $$($(BIN)/python scripts/pick_torch.py "$(TORCH)")' in makefile
