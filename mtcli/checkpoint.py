"""Checkpoints: saved and loaded here only.

A checkpoint is a folder `<run>/checkpoints/update_<N>/` holding
- `model.safetensors`: the weights (tied matrices stored once), with the resolved config and vocabulary sizes in its
  metadata, so the file alone rebuilds the model; loading it can never run code;
- `state.pt` (training checkpoints): optimizer, grad scaler, every rank's RNG streams and the loop's position
  (`TrainState`), loadable with `torch.load(weights_only=True)`;
- the SentencePiece model(s), so the folder translates on its own.
Each folder is written under a temporary name and renamed into place, so a kill at any moment leaves every earlier
checkpoint loadable. The newest `update_*` folder is `last`; `best.json` names the best one. The run directory's
lock is in rundir.py, averaging in average.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model as load_safetensors_into
from safetensors.torch import save_model as save_safetensors

from mtcli.config import Config
from mtcli.config_loader import config_from_dict
from mtcli.errors import MtcliError
from mtcli.log import logger
from mtcli.model import Transformer
from mtcli.tokenizer import MTCLI_SPECIALS, Specials, Tokenizer

CHECKPOINT_RE = re.compile(r"^update_(\d+)$")
# What older checkpoints' configs meant, in today's keys (nobody chose these: they were the only behaviour):
# 2: decode.min_len defaults to 1; before, 0 let beam search return empty translations: read as 1.
# 3: data.clean filters; before, none ran: read as all off, so an old run resumes on the data it was trained on.
CONFIG_VERSION = 3
CLEAN_OFF = {"duplicates": False, "copies": False, "max_repeat": 0, "max_other_script": 1.0, "langid": False}


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def run_of(checkpoint: Path) -> Path:
    """The run directory a checkpoint folder belongs to (its own folder for one outside a run's checkpoints/)."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_file():
        checkpoint = checkpoint.parent
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent


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
    metadata: dict[str, str] | None = None,
    name: str | None = None,
) -> Path:
    """Write checkpoint `name` (default `update_<N>`) atomically; returns its folder. A write that fails (a full disk,
    an unwritable folder) is a one-line error naming the folder and the space needed; earlier checkpoints are left
    as they were."""
    folder = checkpoint_dir(run_dir)
    final = folder / (name or f"update_{update:08d}")
    tmp = folder / f".{final.name}.tmp-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        _write_checkpoint(tmp, final, update, model, config, tokenizer, state, metadata or {})
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as RuntimeError("... file write failed")
        raise MtcliError(_write_error(final, e, model, state is not None)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_checkpoint(tmp: Path, final: Path, update: int, model, config: Config, tokenizer, state, extra) -> None:
    """Fill `tmp`, make its bytes durable, then rename it to `final` (the step that makes it visible)."""
    metadata = {
        **extra,
        "config": json.dumps(config.to_dict()),
        "config_version": str(CONFIG_VERSION),
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
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)  # and the rename itself
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_error(final: Path, error: OSError, model, with_state: bool) -> str:
    """What a failed checkpoint write tells the user: the folder, the reason, the space needed and what is left."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    needed = weights * (4 if with_state else 1)  # weights, plus Adam's two moments and the RNG in state.pt
    folder = final.parent
    try:
        free = f"{shutil.disk_usage(folder if folder.exists() else folder.parent).free / 2**20:,.0f} MB free"
    except OSError:
        free = "free space unknown"
    previous = last_checkpoint(folder.parent)
    keep = f"the last checkpoint, {previous}, is intact" if previous else "no earlier checkpoint was written"
    reason = getattr(error, "strerror", None) or " ".join(str(error).split())[:200]
    return (
        f"cannot write checkpoint {final}: {reason} (it needs about {needed / 2**20:,.0f} MB in {folder}; {free}); "
        f"{keep}. Free some space (or fix the folder's permissions), then resume with --resume"
    )


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
    model_file = checkpoint_file(path)
    try:
        with safe_open(str(model_file), framework="pt") as f:
            return f.metadata() or {}
    except (OSError, SafetensorError) as e:
        raise MtcliError(f"{model_file}: not a readable safetensors file ({' '.join(str(e).split())[:200]})") from None


def checkpoint_config(meta: dict[str, str]) -> Config:
    """The resolved config in a checkpoint's metadata, brought up to CONFIG_VERSION."""
    tree, version = json.loads(meta["config"]), int(meta.get("config_version", 1))
    if version < 2 and tree.get("decode", {}).get("min_len") == 0:
        tree["decode"]["min_len"] = 1
    if version < 3:
        tree.setdefault("data", {}).setdefault("clean", CLEAN_OFF)
    return config_from_dict(tree, source="checkpoint metadata")


def read_config(path: Path) -> Config:
    """The resolved config a checkpoint was trained with (from its metadata; the weights are not read)."""
    try:
        return checkpoint_config(read_metadata(path))
    except (KeyError, ValueError) as e:
        raise MtcliError(
            f"{checkpoint_file(path)}: not a loadable mtcli checkpoint ({' '.join(str(e).split())[:300]})"
        ) from None


def build_model(meta: dict[str, str], specials: Specials = MTCLI_SPECIALS) -> tuple[Transformer, Config]:
    config = checkpoint_config(meta)
    model = Transformer(
        config.model,
        int(meta["src_vocab_size"]),
        int(meta["tgt_vocab_size"]),
        meta.get("joint_vocab") == "True",
        specials,
    )
    return model, config


def load_weights(model: Transformer, path: Path) -> None:
    """Load a checkpoint's weights into `model` in place; a file that does not fit it is a one-line error."""
    model_file = checkpoint_file(path)
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
    """A checkpoint folder (or its model.safetensors) -> model in eval mode, its config and its tokenizer (whose
    special ids the model uses)."""
    model_file = checkpoint_file(path)
    try:
        tokenizer = Tokenizer.from_folder(model_file.parent)
    except (OSError, RuntimeError) as e:
        raise MtcliError(f"{model_file.parent}: no usable SentencePiece model next to the checkpoint ({e})") from None
    try:
        model, config = build_model(read_metadata(model_file), tokenizer.specials)
    except (KeyError, ValueError) as e:
        raise MtcliError(f"{model_file}: not a loadable mtcli checkpoint ({' '.join(str(e).split())[:300]})") from None
    load_weights(model, model_file)
    return model.to(device).eval(), config, tokenizer


def load_state(path: Path) -> dict:
    """A training checkpoint's state.pt. weights_only: loading it can never run code; anything but tensors and plain
    containers (a pickled object, a damaged file) is refused with one line."""
    state_file = Path(path) / "state.pt"
    if not state_file.is_file():
        raise MtcliError(f"{state_file}: missing; this checkpoint holds weights only and cannot be resumed from")
    try:
        with warnings.catch_warnings():  # a damaged file can draw a warning before the error: the error says it all
            warnings.simplefilter("ignore")
            return torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ... here
        reason = " ".join(str(e).split())[:200]
        raise MtcliError(
            f"{state_file}: refused ({type(e).__name__}: {reason}); it holds something other than mtcli's training "
            "state, or it is damaged. Resume from an earlier checkpoint or retrain"
        ) from None


def checkpoint_file(path: Path) -> Path:
    """A checkpoint folder's model.safetensors (or the file itself); a one-line error when there is none."""
    path = Path(path)
    model_file = path / "model.safetensors" if path.is_dir() else path
    if not model_file.is_file():
        raise MtcliError(f"no checkpoint at {path} (expected a checkpoint folder or its model.safetensors)")
    return model_file


# ---------------------------------------------------------------------------------------------------------------------
# Training state: what `--resume` needs besides the weights


@dataclass
class TrainState:
    """The training loop's position and bookkeeping; saved in every training checkpoint."""

    update: int = 0  # optimizer steps taken
    epoch: int = 0
    next_in_epoch: int = 0  # index of the next update in this epoch's plan
    best_score: float | None = None
    bad_validations: int = 0
    skipped: int = 0  # updates skipped in a row for a non-finite loss (not saved: a resume starts afresh)
    skipped_total: int = 0  # all updates skipped for a non-finite loss or gradient


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def training_payload(state: TrainState, optimizer, scaler, rngs: list[dict]) -> dict:
    """The `state.pt` of a training checkpoint; `rngs` holds every rank's RNG streams, in rank order."""
    return {
        "update": state.update,
        "epoch": state.epoch,
        "group": state.next_in_epoch,
        "best_score": state.best_score,
        "bad_validations": state.bad_validations,
        "skipped_total": state.skipped_total,
        "world_size": len(rngs),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": rngs,
    }


def restore_training(path: Path, model, optimizer, scaler, config: Config, rank: int, world: int) -> TrainState:
    """Load checkpoint `path` into the model, optimizer and scaler, put back this rank's RNG streams, and return the
    loop's position. The model and data settings must be the ones the run was trained with."""
    run_dir = path.parent.parent
    saved = checkpoint_config(read_metadata(path)).to_dict()  # keys added since it was written: what they meant then
    current = config.to_dict()
    for tree in (saved, current):
        tree["data"].pop("cache_dir", None)  # where the cache lives does not change what is in it
    for section in ("model", "data"):
        was, now = _flat(saved[section], section), _flat(current[section], section)
        diff = [
            f"{k} (run: {was.get(k)}, now: {now.get(k)})"
            for k in sorted(set(was) | set(now))
            if was.get(k) != now.get(k)
        ]
        if diff:
            raise MtcliError(
                f"--resume: {run_dir} was trained with different {section} settings: {'; '.join(diff)}. Resume with "
                f"the run's own config (--config {run_dir / 'config.yaml'}), with --set for any key it lacks"
            )
    load_weights(model, path)
    payload = load_state(path)
    optimizer.load_state_dict(payload["optimizer"])
    if scaler.is_enabled() and payload["scaler"]:
        scaler.load_state_dict(payload["scaler"])
    elif scaler.is_enabled() or payload["scaler"]:
        logger.warning(
            "note: the run's precision changed (fp16 loss scaling on one side only); the loss scale starts afresh"
        )
    if payload["world_size"] == world:
        rng = payload["rng"][rank]
        torch.set_rng_state(rng["torch"])
        random.setstate(_as_tuple(rng["python"]))
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        logger.warning(
            f"note: resuming with {world} processes instead of {payload['world_size']}: data order and "
            "dropout streams differ from an uninterrupted run"
        )
        torch.manual_seed(config.train.seed * 1000 + rank + payload["update"])
    logger.info(f"resumed from {path} (update {payload['update']}, epoch {payload['epoch'] + 1})")
    return TrainState(
        update=payload["update"],
        epoch=payload["epoch"],
        next_in_epoch=payload["group"],
        best_score=payload["best_score"],
        bad_validations=payload["bad_validations"],
        skipped_total=payload.get("skipped_total", 0),
    )


def _flat(tree: dict, prefix: str) -> dict:
    """{"data.clean.copies": False, ...}: nested config sections as dotted keys."""
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}.{key}") if isinstance(value, dict) else {f"{prefix}.{key}": value})
    return out


def _as_tuple(value):
    """random.setstate needs tuples; a loaded checkpoint may hold lists."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list | tuple) else value
