"""One optimizer update: the `Trainer` (model, loss module wrapped for DDP or torch.compile, AdamW, grad scaler,
autocast) and `train_step`, which accumulates micro-batches, clips, and steps or skips a non-finite update. The loop
around it is in train.py; benchmarks time this same step.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from mtcli.batching import Batch
from mtcli.config import TrainConfig
from mtcli.loss import LossModel
from mtcli.model import Transformer


@dataclass
class Trainer:
    """What one update needs: the model, its loss module (DDP-wrapped or compiled as configured), the optimizer, the
    loss scaler (enabled for fp16 only) and the autocast context of the chosen precision."""

    model: Transformer
    loss_model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    autocast: contextlib.AbstractContextManager
    dtype: torch.dtype
    device: torch.device
    world: int = 1

    @classmethod
    def build(cls, model: Transformer, tc: TrainConfig, dtype: torch.dtype, device: torch.device, world: int = 1):
        decay = [p for p in model.parameters() if p.dim() >= 2]  # biases and LayerNorm gains are not decayed
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=tc.lr,
            betas=tc.betas,
            eps=tc.eps,
            fused=device.type in ("cuda", "cpu"),
        )
        scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
        loss_model: nn.Module = LossModel(model, tc.label_smoothing, tc.rdrop, tc.guided_alignment)
        if world > 1:
            ids = [device.index] if device.type == "cuda" else None
            # broadcast_buffers=False: the model's buffers (the sinusoid table, a fixed output bias) never change,
            # and DDP would otherwise send them from rank 0 before every forward
            loss_model = nn.parallel.DistributedDataParallel(loss_model, device_ids=ids, broadcast_buffers=False)
        if tc.compile:
            loss_model = torch.compile(loss_model, dynamic=True)
        return cls(model, loss_model, optimizer, scaler, autocast, dtype, device, world)


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # summed loss over this process's target tokens, on the device (reading it syncs)
    gnorm: float  # gradient norm before clipping; not finite when the update was skipped

    @property
    def finite(self) -> bool:
        return math.isfinite(self.gnorm)


def train_step(trainer: Trainer, batches: list[Batch], tgt_tokens: int, lr: float, clip_norm: float) -> StepResult:
    """One optimizer update from this process's micro-batches (on the device). Each loss is normalised by the
    update's target tokens over all processes; DDP all-reduces gradients on the last micro-batch only. When the
    gradient norm is not finite, the gradients are dropped and nothing is stepped."""
    t = trainer
    t.model.train()
    loss_sum = torch.zeros((), device=t.device)
    for i, batch in enumerate(batches):
        accumulate_only = t.world > 1 and i < len(batches) - 1
        with t.loss_model.no_sync() if accumulate_only else contextlib.nullcontext():
            with t.autocast:
                loss = t.loss_model(
                    batch.src,
                    batch.src_pad_mask,
                    batch.tgt_in,
                    batch.tgt_index,
                    batch.labels,
                    batch.align_index,
                    batch.align_weight,
                )
            # DDP averages gradients over processes, hence * world: the result is the mean over all target tokens.
            t.scaler.scale(loss * (t.world / tgt_tokens)).backward()
        loss_sum += loss.detach()
    for group in t.optimizer.param_groups:
        group["lr"] = lr
    t.scaler.unscale_(t.optimizer)
    norm = torch.nn.utils.clip_grad_norm_(t.model.parameters(), clip_norm if clip_norm > 0 else math.inf)
    gnorm = float(norm)  # one host sync per update, needed to skip non-finite steps
    if math.isfinite(gnorm):
        t.scaler.step(t.optimizer)
    t.scaler.update()  # fp16: a skipped step lowers the loss scale
    t.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum, gnorm)
