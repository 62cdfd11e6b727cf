"""Checkpoints: saved and loaded here only.

A checkpoint is a folder `<run>/checkpoints/update_<N>/` holding
- `model.safetensors`: the weights (tied matrices stored once), with the resolved config and vocabulary sizes in its
  metadata, so the file alone rebuilds the model; loading it can never run code;
- `state.pt`: optimizer, grad scaler, RNG and data position, loadable with `torch.load(weights_only=True)`;
- the SentencePiece model(s), so the folder translates on its own.
Each folder is written under a temporary name and renamed into place, so a kill at any moment leaves every earlier
checkpoint loadable. The newest `update_*` folder is `last`; `best.json` names the best one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model as load_safetensors_into
from safetensors.torch import save_model as save_safetensors

from mtcli.config import Config, config_from_dict
from mtcli.errors import MtcliError
from mtcli.model import Transformer
from mtcli.tokenizer import Tokenizer

CHECKPOINT_RE = re.compile(r"^update_(\d+)$")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete numbered checkpoints of a run, oldest first (temporary folders start with a dot and are skipped)."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := CHECKPOINT_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found) if (p / "model.safetensors").is_file()]


def last_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def best_checkpoint(run_dir: Path) -> Path | None:
    pointer = checkpoint_dir(run_dir) / "best.json"
    if pointer.is_file():
        path = checkpoint_dir(run_dir) / json.loads(pointer.read_text())["checkpoint"]
        if (path / "model.safetensors").is_file():
            return path
    return None


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def save_checkpoint(
    run_dir: Path,
    update: int,
    model: Transformer,
    config: Config,
    tokenizer: Tokenizer,
    state: dict | None = None,
    name: str | None = None,
) -> Path:
    """Write checkpoint `name` (default `update_<N>`) atomically; returns its folder."""
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / (name or f"update_{update:08d}")
    tmp = folder / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        metadata = {
            "config": json.dumps(config.to_dict()),
            "update": str(update),
            "src_vocab_size": str(model.src_embed.num_embeddings),
            "tgt_vocab_size": str(model.output.out_features),
            "joint_vocab": str(tokenizer.joint),
        }
        save_safetensors(model, str(tmp / "model.safetensors"), metadata=metadata)
        if state is not None:
            torch.save(state, tmp / "state.pt")
        tokenizer.copy_to(tmp)
        for path in tmp.iterdir():  # make the bytes durable before the rename makes them visible
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        if final.exists():  # the same update saved twice (e.g. a stop right after a validation)
            old = folder / f".{final.name}.old-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def remove_temporary(run_dir: Path) -> None:
    """Remove what a killed save left behind (folders under a temporary name are never loaded)."""
    folder = checkpoint_dir(run_dir)
    if folder.is_dir():
        for path in folder.glob(".*"):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Remove numbered checkpoints beyond the newest `keep_last`, never the best one."""
    best = best_checkpoint(run_dir)
    for path in list_checkpoints(run_dir)[:-keep_last]:
        if best is None or path.resolve() != best.resolve():
            shutil.rmtree(path, ignore_errors=True)


def read_metadata(path: Path) -> dict[str, str]:
    model_file = _model_file(path)
    try:
        with safe_open(str(model_file), framework="pt") as f:
            return f.metadata() or {}
    except (OSError, SafetensorError) as e:
        raise MtcliError(f"{model_file}: not a readable safetensors file ({' '.join(str(e).split())[:200]})") from None


def build_model(meta: dict[str, str]) -> tuple[Transformer, Config]:
    config = config_from_dict(json.loads(meta["config"]), source="checkpoint metadata")
    model = Transformer(
        config.model, int(meta["src_vocab_size"]), int(meta["tgt_vocab_size"]), meta.get("joint_vocab") == "True"
    )
    return model, config


def load_weights(model: Transformer, path: Path) -> None:
    """Load a checkpoint's weights into `model` in place; a file that does not fit it is a one-line error."""
    model_file = _model_file(path)
    try:
        missing, unexpected = load_safetensors_into(model, str(model_file), strict=False)
    except (OSError, KeyError, ValueError, RuntimeError, SafetensorError) as e:
        raise MtcliError(f"{model_file}: not a loadable mtcli checkpoint ({' '.join(str(e).split())[:300]})") from None
    if unexpected or [m for m in missing if not m.startswith("sinusoids")]:
        raise MtcliError(
            f"{model_file}: weights do not match the model its config describes "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )


def load_model(path: Path, device: torch.device | str = "cpu") -> tuple[Transformer, Config, Tokenizer]:
    """A checkpoint folder (or its model.safetensors) -> model in eval mode, its config and its tokenizer."""
    model_file = _model_file(path)
    try:
        model, config = build_model(read_metadata(model_file))
    except (KeyError, ValueError) as e:
        raise MtcliError(f"{model_file}: not a loadable mtcli checkpoint ({' '.join(str(e).split())[:300]})") from None
    load_weights(model, model_file)
    try:
        tokenizer = Tokenizer.from_folder(model_file.parent)
    except (OSError, RuntimeError) as e:
        raise MtcliError(f"{model_file.parent}: no usable SentencePiece model next to the checkpoint ({e})") from None
    return model.to(device).eval(), config, tokenizer


def load_state(path: Path) -> dict:
    return torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=True)


def _model_file(path: Path) -> Path:
    path = Path(path)
    model_file = path / "model.safetensors" if path.is_dir() else path
    if not model_file.is_file():
        raise MtcliError(f"no checkpoint at {path} (expected a checkpoint folder or its model.safetensors)")
    return model_file


def average_checkpoints(paths: list[Path], out: Path) -> Path:
    """Average the weights of `paths` (as the paper does for its final models) into checkpoint folder `out`."""
    from safetensors.torch import load_file, save_file

    if not paths:
        raise MtcliError("no checkpoints to average")
    metas = [read_metadata(p) for p in paths]
    reference = json.loads(metas[0]["config"])
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for path, meta in zip(paths, metas):
        config = json.loads(meta["config"])
        same = config["model"] == reference["model"] and all(
            meta.get(k) == metas[0].get(k) for k in ("src_vocab_size", "tgt_vocab_size", "joint_vocab")
        )
        if not same:
            raise MtcliError(f"cannot average {path} with {paths[0]}: different architectures or vocabularies")
        weights = load_file(str(_model_file(path)))
        if total and set(weights) != set(total):
            raise MtcliError(f"cannot average {path} with {paths[0]}: different weights")
        for name, tensor in weights.items():
            if name in total and total[name].shape != tensor.shape:
                raise MtcliError(
                    f"cannot average {path} with {paths[0]}: `{name}` has shape "
                    f"{tuple(tensor.shape)}, not {tuple(total[name].shape)}"
                )
            total[name] = total[name] + tensor.double() if name in total else tensor.double()
            dtypes[name] = tensor.dtype
    averaged = {name: (t / len(paths)).to(dtypes[name]).contiguous() for name, t in total.items()}
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        metadata = dict(metas[-1])
        metadata["averaged"] = json.dumps([p.name for p in paths])
        save_file(averaged, str(tmp / "model.safetensors"), metadata=metadata)
        Tokenizer.from_folder(_model_file(paths[-1]).parent).copy_to(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
