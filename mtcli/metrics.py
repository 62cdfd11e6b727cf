"""Training metrics: per-update records, the periodic log line, `metrics.jsonl`, TensorBoard and the progress bar.

Losses stay on the device until a log line is due, so reading them costs one host sync per log line rather than per
update; with several processes they are summed over ranks first. Rank 0 alone writes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtcli.batching import PaddingCounts
from mtcli.config import TrainConfig
from mtcli.distributed import Dist
from mtcli.log import format_duration, logger, progress_bar
from mtcli.outputs import write_file_atomic


class TensorBoard:
    """`log(step, **scalars)` into a run's `tb/` folder; a no-op where disabled (ranks other than 0) or where the
    optional `tensorboard` package is missing (metrics.jsonl holds the same figures)."""

    def __init__(self, folder: Path | None, purge_step: int | None = None):
        self.writer = None
        if folder is None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            logger.info(
                "note: TensorBoard curves need the tensorboard package (pip install 'mtcli[tensorboard]'); "
                "metrics.jsonl in the run directory has the same figures"
            )
            return
        self.writer = SummaryWriter(str(folder), purge_step=purge_step)
        logger.info(f"TensorBoard: tensorboard --logdir {folder.parent}")

    def log(self, step: int, prefix: str = "", **scalars: float) -> None:
        if self.writer is None:
            return
        for name, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(f"{prefix}{name}", value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@dataclass
class UpdateRecord:
    update: int
    loss_sum: torch.Tensor  # this process's, on the device; summed over processes when written
    lr: float
    gnorm: float
    tgt_tokens: int
    time: float  # wall clock at the end of the update


@dataclass
class Throughput:
    """Target tokens and padding since the last log line."""

    start: float
    first_update: int
    tgt_tokens: int = 0
    padding: PaddingCounts = field(default_factory=PaddingCounts)

    def tokens_per_s(self) -> float:
        return self.tgt_tokens / max(time.time() - self.start, 1e-9)


class Metrics:
    """Per-update records, kept until the next log line so that reading the loss costs no extra host sync; the log
    line, metrics.jsonl and TensorBoard (rank 0), and the progress bar."""

    def __init__(self, run_dir: Path, d: Dist, tc: TrainConfig, first_update: int):
        self.d, self.tc = d, tc
        # A run repeats the updates after its checkpoint (or, killed before its first one, starts over): records of
        # those updates from before the stop go, so that metrics.jsonl and TensorBoard hold one record per update,
        # as an uninterrupted run's do.
        self.tb = TensorBoard(run_dir / "tb" if d.main else None, purge_step=first_update + 1)
        if d.main:
            _truncate_records(run_dir / "metrics.jsonl", first_update)
        self.file = open(run_dir / "metrics.jsonl", "a", encoding="utf-8") if d.main else None
        self.pending: list[UpdateRecord] = []
        self.window = Throughput(time.time(), first_update)
        self.bar = progress_bar(tc.max_updates, initial=first_update, unit="update", enabled=d.main)
        self.last_loss: float | None = None

    def add(self, record: UpdateRecord, padding: PaddingCounts) -> None:
        self.pending.append(record)
        self.window.tgt_tokens += record.tgt_tokens
        self.window.padding += padding
        loss = f"loss {self.last_loss:.3f} | " if self.last_loss is not None else ""  # as of the last log line
        self.bar.set_postfix_str(f"{loss}lr {record.lr:.2e} | {self.window.tokens_per_s():,.0f} tgt tok/s", False)
        self.bar.update(1)

    def flush(self, epoch: int) -> None:
        """Per-update losses (reduced over processes) to metrics.jsonl and TensorBoard, one log line; new window."""
        if not self.pending:
            return
        sums = torch.stack([r.loss_sum for r in self.pending]).float()
        if self.d.world > 1:
            torch.distributed.all_reduce(sums)
        losses = [s / r.tgt_tokens for s, r in zip(sums.tolist(), self.pending)]
        w, last = self.window, self.pending[-1]
        speed, eff = w.tokens_per_s(), w.padding.efficiency
        self.last_loss = sum(losses) / len(losses)
        if self.d.main:
            for r, loss in zip(self.pending, losses):
                fields = {"update": r.update, "loss": loss, "lr": r.lr, "gnorm": r.gnorm, "tokens": r.tgt_tokens}
                self.file.write(json.dumps({**fields, "time": r.time}) + "\n")
                self.tb.log(r.update, "train/", loss=loss, lr=r.lr, gnorm=r.gnorm)
            self.file.flush()
            self.tb.log(last.update, "train/", tokens_per_s=speed, padding_efficiency=eff)
            eta = (time.time() - w.start) / max(last.update - w.first_update, 1) * (self.tc.max_updates - last.update)
            logger.info(
                f"update {last.update:>7} | epoch {epoch + 1:>3} | loss {self.last_loss:.3f} | lr {last.lr:.2e} | "
                f"gnorm {last.gnorm:.2f} | {speed:,.0f} tgt tok/s | pad eff {eff:.2f} | ETA {format_duration(eta)}"
            )
        self.pending.clear()
        self.window = Throughput(time.time(), last.update)

    def close(self) -> None:
        self.bar.close()
        self.tb.close()
        if self.file:
            self.file.close()


def _truncate_records(path: Path, last_update: int) -> None:
    """Keep the records of updates up to `last_update` (a killed run may have logged a few beyond its checkpoint)."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    keep = []
    for line in lines:
        try:
            if json.loads(line)["update"] <= last_update:
                keep.append(line)
        except (ValueError, KeyError, TypeError):  # a line cut by the kill
            continue
    if len(keep) != len(lines):
        write_file_atomic(path, "".join(keep))
