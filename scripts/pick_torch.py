"""Which torch `make install` asks pip for, printed as pip arguments (the reason goes to stderr).

PyTorch's default wheel on Linux is a CUDA build: several GB of libraries that a machine without an NVIDIA GPU never
uses. So, unless TORCH names a requirement:
- with an NVIDIA GPU: the default build (`torch`);
- without one: a CPU build. First one that pip's own configuration already offers (a `torch-*+cpu` wheel for this
  Python in a `find-links` folder), else PyTorch's CPU wheel index when it answers, else the default build with a
  warning that says how to get the CPU one.

Runs with the Python of the virtual environment being set up, before torch is installed: standard library only.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def nvidia_gpu() -> bool:
    """An NVIDIA GPU with its driver loaded (what a CUDA build of torch needs to be of any use)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir() and any(gpus.iterdir()):
        return True
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def find_links() -> list[Path]:
    """The local folders pip's configuration points `find-links` at (pip.conf files and PIP_FIND_LINKS)."""
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        listed = ""
    values = re.findall(r"find-links='([^']*)'", listed) + [os.environ.get("PIP_FIND_LINKS", "")]
    folders = [Path(v.removeprefix("file://")) for value in values for v in shlex.split(value)]
    return [f for f in dict.fromkeys(folders) if f.is_dir()]


def version_key(version: str) -> tuple:
    return tuple(int(n) if n.isdigit() else -1 for n in version.split("+")[0].split("."))


def local_cpu_build(folders: list[Path]) -> str | None:
    """The newest `torch==X+cpu` among the wheels in `folders` that install on this Python and machine."""
    python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    machine = platform.machine()
    versions = []
    for folder in folders:
        for wheel in folder.glob("torch-*+cpu-*.whl"):
            name, version, *tags = wheel.stem.split("-")
            if name == "torch" and python in tags and any(machine in tag for tag in tags[-1:]):
                versions.append(version)
    return max(versions, key=version_key) if versions else None


def cpu_index_answers(timeout: float = 10) -> bool:
    try:
        with urllib.request.urlopen(f"{CPU_INDEX}/torch/", timeout=timeout) as response:
            return response.status == 200
    except OSError:
        return False


def pick(requested: str, gpu: bool, local: str | None, index: bool) -> tuple[list[str], str]:
    """The pip arguments for torch, and why."""
    if requested not in ("", "auto"):
        return [requested], f"TORCH={requested}, as asked"
    if gpu:
        return ["torch"], "an NVIDIA GPU is present: torch's default (CUDA) build"
    if local:
        return [f"torch=={local}"], f"no NVIDIA GPU: the CPU build {local} that pip's configuration offers"
    if index:
        return ["torch", "--index-url", CPU_INDEX, "--extra-index-url", "https://pypi.org/simple"], (
            f"no NVIDIA GPU: the CPU build from {CPU_INDEX}"
        )
    return ["torch"], (
        f"warning: no NVIDIA GPU, but {CPU_INDEX} does not answer and pip's configuration offers no CPU build: "
        "installing torch's default build (on Linux a CUDA build of several GB); TORCH='torch==X+cpu' picks another"
    )


def main() -> None:
    requested = sys.argv[1] if len(sys.argv) > 1 else "auto"
    # each probe only when the ones before it leave the choice open (the index is a network call)
    asked = requested not in ("", "auto")
    gpu = not asked and nvidia_gpu()
    local = None if asked or gpu else local_cpu_build(find_links())
    index = not (asked or gpu or local) and cpu_index_answers()
    arguments, why = pick(requested, gpu, local, index)
    print(f"torch: {why}", file=sys.stderr)
    print(" ".join(arguments))  # for the shell's word splitting in the Makefile: no argument holds a space


if __name__ == "__main__":
    main()
