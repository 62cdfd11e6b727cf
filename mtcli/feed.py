"""The training loop's supply of updates: each update's micro-batches collated (and pinned, for a GPU) on the host.

On a GPU the feed works ahead: while one update runs, a background thread collates and pins the next one's
micro-batches, and another plans the next epoch as soon as the current one starts (planning an epoch of millions
of pairs takes tens of seconds, which would otherwise leave the GPU idle at each epoch's end). On a CPU the same
work runs in line, when it is needed: the update itself keeps every core busy, so a thread would only compete.

Either way the loop asks for the update at a position (epoch, index in epoch) and gets the same micro-batches: what
a run sees depends on the seed and the position only, so a resumed run continues exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from mtcli.batching import Batch, UpdatePlan


@dataclass
class EpochPlan:
    split: object  # what the plans' example indices index: an EncodedSplit, or a SampledSplit of this epoch
    updates: list[UpdatePlan]


@dataclass
class PreparedUpdate:
    epoch: int
    index: int  # of the update in its epoch
    plan: UpdatePlan
    batches: list[Batch]  # on the host; pinned when the feed pins


class UpdateFeed:
    """`take(epoch, index)`: the update at that position, or the first of a later epoch when that epoch is used up;
    None from epoch `max_epochs` (0: no limit) on.

    plan_epoch(epoch) -> EpochPlan and collate(split, example indices) -> Batch are the loop's own functions; with
    `ahead` they run on background threads, one update and one epoch ahead of the loop."""

    def __init__(
        self,
        plan_epoch: Callable[[int], EpochPlan],
        collate: Callable[[object, np.ndarray], Batch],
        max_epochs: int,
        ahead: bool,
        pin: bool,
    ):
        self.plan_epoch, self.collate, self.max_epochs, self.pin = plan_epoch, collate, max_epochs, pin
        self.epochs: dict[int, Future | EpochPlan] = {}
        self.lock = threading.Lock()
        self.planner = ThreadPoolExecutor(1, thread_name_prefix="mtcli-plan") if ahead else None
        self.collator = ThreadPoolExecutor(1, thread_name_prefix="mtcli-batches") if ahead else None
        self.next: Future | None = None  # the update being prepared ahead, and its position
        self.next_at: tuple[int, int] | None = None

    def take(self, epoch: int, index: int) -> PreparedUpdate | None:
        if self.next is not None and self.next_at == (epoch, index):
            prepared = self.next.result()  # raises what preparing it raised
        else:
            prepared = self._prepare(epoch, index)
        self.next = self.next_at = None
        if prepared is not None and self.collator is not None:
            self.next_at = (prepared.epoch, prepared.index + 1)
            self.next = self.collator.submit(self._prepare, *self.next_at)
        return prepared

    def close(self) -> None:
        for pool in (self.collator, self.planner):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    def _prepare(self, epoch: int, index: int) -> PreparedUpdate | None:
        while True:
            if self.max_epochs and epoch >= self.max_epochs:
                return None
            plan = self._epoch(epoch)
            if index < len(plan.updates):
                break
            epoch, index = epoch + 1, 0
        update = plan.updates[index]
        batches = [self.collate(plan.split, examples) for examples in update.batches]
        if self.pin:
            batches = [batch.pin_memory() for batch in batches]
        return PreparedUpdate(epoch, index, update, batches)

    def _epoch(self, epoch: int) -> EpochPlan:
        """Epoch `epoch`'s plan (waiting for the planner if it is at work on it); with a planner, the next epoch's
        planning starts now. Earlier epochs are forgotten."""
        with self.lock:
            for old in [e for e in self.epochs if e < epoch]:
                del self.epochs[old]
            if epoch not in self.epochs:
                planned = self.planner.submit(self.plan_epoch, epoch) if self.planner else self.plan_epoch(epoch)
                self.epochs[epoch] = planned
            following = epoch + 1
            if self.planner is not None and following not in self.epochs:
                if not (self.max_epochs and following >= self.max_epochs):
                    self.epochs[following] = self.planner.submit(self.plan_epoch, following)
            entry = self.epochs[epoch]
        return entry.result() if isinstance(entry, Future) else entry
