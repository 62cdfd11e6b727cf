"""mtcli: train, run and score Transformer machine-translation models from one config file.

Python API: `from mtcli import Translator`; `Translator.from_run("runs/toy").translate(["I love apples"], beam=5)`.
"""

__version__ = "0.1.0"
__all__ = ["Translator", "__version__"]


def __getattr__(name: str):
    if name == "Translator":  # imported on first use, so `mtcli --version` does not wait for torch
        from mtcli.translate import Translator

        return Translator
    raise AttributeError(f"module 'mtcli' has no attribute {name!r}")
