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
import math
import os
import random
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model as load_safetensors_into
from safetensors.torch import save_model as save_safetensors

from mtcli.config import Config, ModelConfig, shown
from mtcli.config_loader import config_from_dict
from mtcli.errors import MtcliError, error_text
from mtcli.log import logger
from mtcli.model import Transformer
from mtcli.outputs import publish_folder, remove_stale, write_file_atomic
from mtcli.tokenizer import Tokenizer

CHECKPOINT_RE = re.compile(r"^update_(\d+)$")
# What older checkpoints' configs meant, in today's keys (nobody chose these: they were the only behaviour):
# 2: decode.min_len defaults to 1; before, 0 let beam search return empty translations: read as 1.
# 3: data.clean filters; before, none ran: read as all off, so an old run resumes on the data it was trained on.
CONFIG_VERSION = 3
CLEAN_OFF = {"duplicates": False, "copies": False, "max_repeat": 0, "max_other_script": 1.0, "langid": False}
# What restore_training reads from state.pt (training_payload writes them)
STATE_KEYS = (
    "update",
    "epoch",
    "next_in_epoch",
    "best_score",
    "bad_validations",
    "world_size",
    "optimizer",
    "scaler",
    "rng",
)


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
    """The checkpoint `best.json` names, or None when there is no best.json yet (before the first validation). A
    best.json that is damaged or names a checkpoint that is gone is an error: falling back to another checkpoint
    would score it as the best without saying so."""
    name = best_name(run_dir)
    if name is None:
        return None
    path = checkpoint_dir(run_dir) / name
    if not (path / "model.safetensors").is_file():
        raise MtcliError(
            f"{checkpoint_dir(run_dir) / 'best.json'}: names checkpoint `{name}`, which is not in "
            f"{checkpoint_dir(run_dir)}; pass --checkpoint with the one to use, or delete best.json to use the newest"
        )
    return path


def best_metric(run_dir: Path) -> str | None:
    """What best.json's pick was made by: a validation metric (bleu, loss, ...) or "imported"."""
    try:
        return json.loads((checkpoint_dir(run_dir) / "best.json").read_text(encoding="utf-8")).get("metric")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, RecursionError):
        return None


def best_name(run_dir: Path) -> str | None:
    """The checkpoint folder name in a run's best.json (None without one); a damaged file is a one-line error."""
    pointer = checkpoint_dir(run_dir) / "best.json"
    if not pointer.is_file():
        return None
    try:
        name = json.loads(pointer.read_text(encoding="utf-8")).get("checkpoint")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, RecursionError):
        name = None  # unreadable, not JSON, or not an object: all the same to the user
    # A plain folder name: `../other-run/...` or an absolute path would load a checkpoint from outside the run.
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
        raise MtcliError(
            f'{pointer}: damaged; expected a JSON object like {{"checkpoint": "update_00001000"}} naming a '
            f"folder in {pointer.parent}. Rewrite it (or delete it to use the newest checkpoint), or pass --checkpoint"
        )
    return name


def write_best(run_dir: Path, checkpoint: Path, update: int, metric: str, score: float | None = None) -> None:
    """Point best.json at `checkpoint` (atomically: a kill leaves the old pointer or the new one)."""
    record = {"checkpoint": Path(checkpoint).name, "update": update, "metric": metric}
    if score is not None:
        record["score"] = score
    write_file_atomic(checkpoint_dir(run_dir) / "best.json", json.dumps(record, indent=1))


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
        remove_temporary(run_dir)  # what saves killed earlier left, whether or not the run was resumed
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
    # durable bytes before the rename makes them visible; the same update saved twice (a stop right after a
    # validation) replaces the earlier folder
    publish_folder(tmp, final)


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
    reason = getattr(error, "strerror", None) or error_text(error)
    return (
        f"cannot write checkpoint {final}: {reason} (it needs about {needed / 2**20:,.0f} MB in {folder}; {free}); "
        f"{keep}. Free some space (or fix the folder's permissions), then resume with --resume"
    )


def remove_temporary(run_dir: Path) -> None:
    """Remove what killed saves left in checkpoints/ (`.update_<N>.tmp-<pid>` folders, best.json's temporary file,
    never loaded) once their process is gone, by outputs' rule: one still writing keeps its own."""
    folder = checkpoint_dir(run_dir)
    if folder.is_dir():
        remove_stale(folder)


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Remove numbered checkpoints beyond the newest `keep_last`, never the best one (a damaged best.json stops
    this with an error rather than let the best checkpoint go)."""
    best = best_name(run_dir)
    for path in list_checkpoints(run_dir)[:-keep_last]:
        if path.name != best:
            shutil.rmtree(path, ignore_errors=True)


def read_metadata(path: Path) -> dict[str, str]:
    model_file = checkpoint_file(path)
    try:
        with safe_open(str(model_file), framework="pt") as f:
            return f.metadata() or {}
    except (OSError, SafetensorError) as e:
        raise MtcliError(f"{model_file}: not a readable safetensors file ({error_text(e)})") from None


def checkpoint_config(meta: dict[str, str], source: str = "checkpoint metadata") -> Config:
    """The resolved config in a checkpoint's metadata, brought up to CONFIG_VERSION; metadata that is missing or
    damaged is a one-line error naming `source` (the file)."""
    if "config" not in meta:
        raise MtcliError(f"{source}: not an mtcli checkpoint (its metadata has no `config`)")
    try:
        tree, version = json.loads(meta["config"]), int(meta.get("config_version", 1))
    except (ValueError, RecursionError) as e:  # RecursionError: thousands of nested brackets
        raise MtcliError(f"{source}: damaged config in its metadata ({error_text(e)})") from None
    if not isinstance(tree, dict):
        raise MtcliError(f"{source}: damaged config in its metadata (not a JSON object)")
    decode, data = tree.get("decode"), tree.setdefault("data", {})
    if version < 2 and isinstance(decode, dict) and decode.get("min_len") == 0:
        decode["min_len"] = 1
    if version < 3 and isinstance(data, dict):
        data.setdefault("clean", CLEAN_OFF)
    return config_from_dict(tree, source=source)


def read_config(path: Path) -> Config:
    """The resolved config a checkpoint was trained with (from its metadata; the weights are not read)."""
    model_file = checkpoint_file(path)
    return checkpoint_config(read_metadata(model_file), str(model_file))


def build_model(model_file: Path, meta: dict[str, str], tokenizer: Tokenizer) -> tuple[Transformer, Config]:
    """The model a checkpoint's metadata describes, checked against the tensors its weights file declares (read
    from the file's header, without loading one): metadata edited to 100,000 layers or a billion-piece vocabulary
    is refused before memory is spent on it, and a model built is then compared tensor by tensor."""
    config = checkpoint_config(meta, str(model_file))
    sizes = []
    for side, tokenizer_size in (("src", tokenizer.src_vocab_size), ("tgt", tokenizer.tgt_vocab_size)):
        size = meta.get(f"{side}_vocab_size")
        if size != str(tokenizer_size):  # the model and its tokenizer are saved together: they always agree
            raise MtcliError(
                f"{model_file}: its metadata has {side}_vocab_size `{shown(size)}`, but the tokenizer beside it has "
                f"{tokenizer_size:,} pieces; the folder mixes files of different models (or the metadata was edited)"
            )
        sizes.append(tokenizer_size)
    joint = meta.get("joint_vocab") == "True"
    declared = declared_shapes(model_file)
    held, needed = sum(math.prod(shape) for shape in declared.values()), stored_weights(config.model, *sizes, joint)
    if needed > held:  # then building the model would spend more memory than the file holds
        m = config.model
        raise MtcliError(
            f"{model_file}: its metadata describes a model of at least {needed:,} weights ({m.n_encoder_layers}+"
            f"{m.n_decoder_layers} layers, d_model {m.d_model}, d_ff {m.d_ff}), but the file holds {held:,}; "
            "the metadata does not match the weights (edited or damaged)"
        )
    model = Transformer(config.model, *sizes, joint, tokenizer.specials)
    check_declared_shapes(model, model_file, declared)
    return model, config


def stored_weights(cfg: ModelConfig, src_vocab: int, tgt_vocab: int, joint: bool) -> int:
    """The weights a Transformer of this shape stores in its file, biases and norms left out (so never more than the
    file of such a model holds): what is checked before the model is built. Computed, not built: building even an
    empty (meta-device) model first imports torch's compiler, 3 seconds of every `mtcli translate`."""
    d = cfg.d_model
    shared = cfg.tie_embeddings and joint and src_vocab == tgt_vocab  # one matrix for both embeddings
    count = cfg.layer_parameters() + src_vocab * d + (0 if shared else tgt_vocab * d)
    count += 0 if cfg.tie_embeddings else tgt_vocab * d  # the output projection
    count += cfg.max_positions * d if cfg.positions == "learned" else 0
    return count + (tgt_vocab if cfg.output_bias else 0)


def declared_shapes(model_file: Path) -> dict[str, list[int]]:
    """Each tensor's shape as the weights file's header declares it (no tensor is read)."""
    try:
        with safe_open(str(model_file), framework="pt") as f:
            return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    except (OSError, SafetensorError) as e:
        raise MtcliError(f"{model_file}: not a readable safetensors file ({error_text(e)})") from None


def check_declared_shapes(model: torch.nn.Module, model_file: Path, declared: dict[str, list[int]]) -> None:
    """Every tensor of `model` in the weights file with the same shape, and nothing else there. Tied weights are
    stored once, under any one of their names."""
    tensors = model.state_dict(keep_vars=True)
    tied: dict[int, list[str]] = {}
    for name, tensor in tensors.items():
        tied.setdefault(id(tensor), []).append(name)
    for names in tied.values():
        stored = [name for name in names if name in declared] or names[:1]
        for name in stored:
            expected = list(tensors[name].shape)
            if name not in declared:
                raise MtcliError(
                    f"{model_file}: the model its metadata describes has a tensor `{name}` (shape {expected}) that "
                    "the file lacks; the metadata does not match the weights (edited or damaged)"
                )
            if declared[name] != expected:
                raise MtcliError(
                    f"{model_file}: tensor `{name}` has shape {declared[name]}, but the model its metadata describes "
                    f"needs {expected}; the metadata does not match the weights (edited or damaged)"
                )
    extra = sorted(set(declared) - set(tensors))
    if extra:
        raise MtcliError(
            f"{model_file}: tensor `{shown(extra[0])}` ({len(extra)} such) is not part of the model its metadata "
            "describes; the metadata does not match the weights (edited or damaged)"
        )


def load_weights(model: Transformer, path: Path) -> None:
    """Load a checkpoint's weights into `model` in place; a file that does not fit it, or that holds a NaN or an
    infinity, is a one-line error."""
    model_file = checkpoint_file(path)
    try:
        missing, unexpected = load_safetensors_into(model, str(model_file), strict=False)
    except (OSError, KeyError, ValueError, RuntimeError, SafetensorError) as e:
        raise MtcliError(f"{model_file}: not a loadable mtcli checkpoint ({error_text(e, 300)})") from None
    if unexpected or [m for m in missing if not m.startswith("sinusoids")]:
        raise MtcliError(
            f"{model_file}: weights do not match the model its config describes "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    # A non-finite weight makes every score NaN: beam search then finds no hypothesis and greedy search returns an
    # empty line without a word, so it is refused here, by the name the file stores it under (one per tied group).
    with safe_open(str(model_file), framework="pt") as f:
        stored = set(f.keys())
    for name, tensor in model.state_dict().items():
        if name in stored and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise MtcliError(
                f"{model_file}: tensor `{name}` holds NaN or infinite values; the checkpoint is damaged or was saved "
                "from a run that diverged. Use an earlier checkpoint (--checkpoint)"
            )


def load_model(path: Path, device: torch.device | str = "cpu") -> tuple[Transformer, Config, Tokenizer]:
    """A checkpoint folder (or its model.safetensors) -> model in eval mode, its config and its tokenizer (whose
    special ids the model uses)."""
    model_file = checkpoint_file(path)
    tokenizer = read_tokenizer(model_file)
    model, config = build_model(model_file, read_metadata(model_file), tokenizer)
    load_weights(model, model_file)
    return model.to(device).eval(), config, tokenizer


def read_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer beside a checkpoint (a folder or its model.safetensors)."""
    folder = checkpoint_file(path).parent
    try:
        return Tokenizer.from_folder(folder)
    except (OSError, RuntimeError) as e:
        reason = error_text(e)
        raise MtcliError(f"{folder}: no usable tokenizer next to the checkpoint ({reason})") from None


def load_state(path: Path) -> dict:
    """A training checkpoint's state.pt. weights_only: loading it can never run code; anything but tensors and plain
    containers (a pickled object, a damaged file) is refused with one line."""
    state_file = Path(path) / "state.pt"
    if not state_file.is_file():
        raise MtcliError(f"{state_file}: missing; this checkpoint holds weights only and cannot be resumed from")
    try:
        with warnings.catch_warnings():  # a damaged file can draw a warning before the error: the error says it all
            warnings.simplefilter("ignore")
            payload = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ... here
        reason = error_text(e)
        raise MtcliError(
            f"{state_file}: refused ({type(e).__name__}: {reason}); it holds something other than mtcli's training "
            "state, or it is damaged. Resume from an earlier checkpoint or retrain"
        ) from None
    if isinstance(payload, dict) and "group" in payload and "next_in_epoch" not in payload:
        payload["next_in_epoch"] = payload.pop("group")  # the name checkpoints before 2026-12-06 gave it
    missing = [key for key in STATE_KEYS if key not in payload] if isinstance(payload, dict) else list(STATE_KEYS)
    if missing:
        raise MtcliError(
            f"{state_file}: refused (no {', '.join(missing[:3])}); it holds something other than mtcli's training "
            "state. Resume from an earlier checkpoint or retrain"
        )
    return payload


def checkpoint_file(path: Path) -> Path:
    """A checkpoint folder's model.safetensors (or the file itself); a one-line error when there is none."""
    path = Path(path)
    model_file = path / "model.safetensors" if path.is_dir() else path
    if not model_file.is_file():
        raise MtcliError(f"no checkpoint at {path} (expected a checkpoint folder or its model.safetensors)")
    return model_file


# ---------------------------------------------------------------------------------------------------------------------
# Which checkpoint a command uses: --checkpoint, or a run's best, or the latest run's


def find_run(runs_root: Path = Path("runs")) -> Path:
    """The most recently trained run under ./runs (the one whose newest checkpoint is newest)."""
    candidates = []
    if runs_root.is_dir():
        for run in runs_root.iterdir():
            ckpt = last_checkpoint(run)
            if ckpt is not None:
                candidates.append((ckpt.stat().st_mtime, str(run)))
    if not candidates:
        raise MtcliError(
            f"no trained run found under {runs_root}/; train one (mtcli train --config toy.yaml) "
            "or pass --run DIR or --checkpoint PATH"
        )
    return Path(max(candidates)[1])


def resolve_checkpoint(run: Path | str | None = None, checkpoint: Path | str | None = None) -> Path:
    """--checkpoint as given; else the best (or, before any validation, the newest) checkpoint of --run or of the
    latest run under ./runs. What was picked by default is said on the log."""
    if checkpoint is not None:
        return Path(checkpoint)
    latest = run is None
    run = find_run() if latest else Path(run)
    if not run.is_dir():
        raise MtcliError(f"--run {run}: no such run directory")
    best = best_checkpoint(run)
    ckpt = best or last_checkpoint(run)
    if ckpt is None:
        raise MtcliError(f"run {run} has no checkpoint yet; train it first (mtcli train ... --run-dir {run})")
    if best is None:
        which = "newest; no validation yet"
    else:  # an imported run's only checkpoint was never validated: say what it is
        which = "the imported model" if best_metric(run) == "imported" else "best by validation"
    logger.info(f"checkpoint: {ckpt} ({which}{', latest run under ./runs' if latest else ''})")
    return ckpt


def resolve_member(path: Path | str) -> Path:
    """An ensemble member given as a run directory (its best checkpoint) or as a checkpoint folder."""
    path = Path(path)
    return resolve_checkpoint(path) if checkpoint_dir(path).is_dir() else path


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


def rng_state(device: torch.device) -> dict:
    """The random streams training draws from: CPU (and Python), plus the GPU's when training runs on one; a CPU run
    on a GPU machine leaves CUDA alone (reading its state would create a CUDA context)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def training_payload(state: TrainState, optimizer, scaler, rngs: list[dict]) -> dict:
    """The `state.pt` of a training checkpoint; `rngs` holds every rank's RNG streams, in rank order."""
    return {
        "update": state.update,
        "epoch": state.epoch,
        "next_in_epoch": state.next_in_epoch,
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
    saved = read_config(path).to_dict()  # keys added since it was written: what they meant then
    current = config.to_dict()
    for tree in (saved, current):
        tree["data"].pop("cache_dir", None)  # where the cache lives does not change what is in it
    for section in ("model", "data"):
        changes = config_differences({section: saved[section]}, {section: current[section]})
        if changes:
            diff = "; ".join(f"{key} (run: {was}, now: {now})" for key, was, now in changes)
            raise MtcliError(
                f"--resume: {run_dir} was trained with different {section} settings: {diff}. Resume with "
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
        device = next(model.parameters()).device
        if "cuda" in rng and device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], device)
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
        next_in_epoch=payload["next_in_epoch"],
        best_score=payload["best_score"],
        bad_validations=payload["bad_validations"],
        skipped_total=payload.get("skipped_total", 0),
    )


def config_differences(was: dict, now: dict) -> list[tuple[str, object, object]]:
    """Every key (dotted: `data.clean.copies`) whose value differs between two config trees (Config.to_dict()), in
    sorted order, as (key, was, now); a key one tree lacks is None there."""
    was, now = _flat(was), _flat(now)
    return [(key, was.get(key), now.get(key)) for key in sorted(set(was) | set(now)) if was.get(key) != now.get(key)]


def _flat(tree: dict, prefix: str = "") -> dict:
    """{"data.clean.copies": False, ...}: nested config sections as dotted keys."""
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _as_tuple(value):
    """random.setstate needs tuples; a loaded checkpoint may hold lists."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list | tuple) else value
