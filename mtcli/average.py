"""Checkpoint averaging (`mtcli average`): the mean of a run's last N checkpoints' weights, as the paper does for its
final models, written as a checkpoint folder that every command takes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mtcli.checkpoint import checkpoint_config, checkpoint_dir, checkpoint_file, list_checkpoints, read_metadata
from mtcli.errors import MtcliError
from mtcli.log import logger
from mtcli.outputs import check_folder_target, new_folder, refuse_input_overlap
from mtcli.tokenizer import Tokenizer


def average_last(run_dir: Path, last: int, out: Path | None = None, force: bool = False) -> Path:
    """Average a run's last `last` numbered checkpoints into `out` (default <run>/checkpoints/average_last<N>); an
    earlier average there is replaced only with `force`."""
    found = list_checkpoints(run_dir)
    if last < 1:
        raise MtcliError(f"--last {last}: average at least 1 checkpoint")
    if len(found) < last:
        raise MtcliError(
            f"{run_dir} has {len(found)} checkpoint(s), fewer than --last {last}; raise train.keep_last to keep more"
        )
    out = Path(out) if out else checkpoint_dir(run_dir) / f"average_last{last}"
    average_checkpoints(found[-last:], out, force)
    logger.info(f"averaged {', '.join(p.name for p in found[-last:])}")
    return out


def average_checkpoints(paths: list[Path], out: Path, force: bool = False) -> Path:
    """Average the weights of `paths` (as the paper does for its final models) into checkpoint folder `out`: a new
    or empty folder, or with `force` an earlier average (mtcli.outputs' rule)."""
    from safetensors.torch import load_file, save_file

    if not paths:
        raise MtcliError("no checkpoints to average")
    refuse_input_overlap(out, paths, "--out")
    check_folder_target(out, "average", force)
    metas = [read_metadata(p) for p in paths]
    reference = checkpoint_config(metas[0], str(checkpoint_file(paths[0]))).model
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for path, meta in zip(paths, metas):
        model = checkpoint_config(meta, str(checkpoint_file(path))).model  # damaged metadata: one line naming it
        same = model == reference and all(
            meta.get(k) == metas[0].get(k) for k in ("src_vocab_size", "tgt_vocab_size", "joint_vocab")
        )
        if not same:
            raise MtcliError(f"cannot average {path} with {paths[0]}: different architectures or vocabularies")
        weights = load_file(str(checkpoint_file(path)))
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
    metadata = dict(metas[-1])
    metadata["averaged"] = json.dumps([p.name for p in paths])
    with new_folder(out, "average", force) as folder:
        save_file(averaged, str(folder / "model.safetensors"), metadata=metadata)
        Tokenizer.from_folder(checkpoint_file(paths[-1]).parent).copy_to(folder)
    return out
