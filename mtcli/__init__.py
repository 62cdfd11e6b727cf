"""mtcli: train, run and score Transformer machine-translation models from one config file.

Python API: `from mtcli import Translator`; `Translator.from_run("runs/toy").translate(["I love apples"], beam=5)`.
"""

import os

# OpenMP threads that finish their share of a parallel region wait for the others spinning before they sleep (libgomp
# spins 300,000 times by default, Intel's and LLVM's runtimes 200 ms). With more threads than free cores the spinning
# takes the cores from the threads that still have work, and every training on a shared machine collapses far below
# its fair share (benchmarks/bench_contention.py; figures in docs/benchmarks.md). A short spin keeps a lone run's speed.
# It must be set before torch loads its OpenMP runtime; values the user set win.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
os.environ.setdefault("KMP_BLOCKTIME", "1")

__version__ = "0.1.0"
__all__ = ["Translator", "__version__"]


def __getattr__(name: str):
    if name == "Translator":  # imported on first use, so `mtcli --version` does not wait for torch
        from mtcli.translate import Translator

        return Translator
    raise AttributeError(f"module 'mtcli' has no attribute {name!r}")
