"""Processes: which rank this is (torchrun sets the environment; one process otherwise), collective helpers that work
on gloo and NCCL alike, the one-process-prepares rule for the data cache, and the SIGINT/SIGTERM stop request.

Multi-GPU and multi-node runs go through `torchrun` (NCCL on GPUs, gloo on CPU); there is no launcher here.
"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtcli.config import Config
from mtcli.data import PreparedData, cache_folder, prepare
from mtcli.device import resolve_device
from mtcli.errors import MtcliError
from mtcli.log import logger


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device_name: str) -> tuple[Dist, torch.device]:
        """The process group torchrun describes in the environment (joined here), or a single process."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            device = resolve_device(device_name)
            if device.type == "cuda" and device.index is not None:
                torch.cuda.set_device(device)  # so RNG state saved and restored is this GPU's
            return cls(), device
        d = cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
        device = resolve_device(device_name)
        if device.type == "cuda":
            gpus = torch.cuda.device_count()
            if d.local_rank >= gpus:
                raise MtcliError(
                    f"torchrun started more processes on this node than it has GPUs ({gpus}): process "
                    f"{d.local_rank} has none; use --nproc_per_node {gpus} (or train.device=cpu)"
                )
            device = torch.device("cuda", d.local_rank)
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            backend, timeout = "nccl" if device.type == "cuda" else "gloo", datetime.timedelta(hours=1)
            # device_id: NCCL binds this process's communicator to its GPU now, not lazily on a guessed device
            bound = {"device_id": device} if device.type == "cuda" else {}
            store = restarted_worker_store(d, timeout)
            if store is None:
                dist.init_process_group(backend, timeout=timeout, **bound)
            else:
                dist.init_process_group(backend, store=store, rank=d.rank, world_size=d.world, timeout=timeout, **bound)
            atexit.register(_leave_process_group)
        return d, device

    def all_reduce_max(self, value: int) -> int:
        if self.world == 1:
            return value
        flag = torch.tensor([value], device=comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag)

    def broadcast(self, values: list[float]) -> list[float]:
        """Rank 0's values on every rank (float64, so step counts and scores survive exactly)."""
        if self.world == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=comm_device())
        dist.broadcast(tensor, src=0)  # fills the tensor in place, on the device NCCL needs
        return tensor.tolist()

    def gather_objects(self, obj) -> list:
        """`obj` from every rank, in rank order (e.g. RNG states, which every rank's checkpoint entry needs)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def _leave_process_group() -> None:
    """At exit: release the process group's resources (NCCL warns of leaks when a process ends without this)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def restart_count() -> int:
    """How many times torchrun (--max-restarts) has restarted this worker group; 0 outside torchrun."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def restarted_worker_store(d: Dist, timeout: datetime.timedelta) -> dist.Store | None:
    """The store for a worker group that torchrun restarted (--max-restarts), scoped to this attempt; None otherwise.

    torchrun's c10d rendezvous shares one TCPStore across restarts (TORCHELASTIC_USE_AGENT_STORE) without scoping
    the keys per attempt, so a restarted group can read the killed workers' gloo/NCCL addresses and fail with
    "Connection refused" (pytorch/pytorch#135712; seen here with torch 2.13 whenever the cores are busy). On one node
    every worker has the same restart count, so it scopes the keys safely; across nodes the counts can differ (an
    agent only counts its own failures), so there torch's behaviour stays and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    in torchrun's environment is the remedy."""
    attempt = restart_count()
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    one_node = os.environ.get("LOCAL_WORLD_SIZE") == str(d.world)
    if not (attempt and shared and one_node):
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), d.world, False, timeout)
    return dist.PrefixStore(f"mtcli/attempt_{attempt}", store)


def comm_device() -> torch.device:
    """Where collective tensors must live: NCCL needs a GPU tensor, gloo a CPU one."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def prepare_once(cfg: Config, d: Dist) -> PreparedData:
    """Local rank 0 builds the data cache; the other processes on the node wait for it, then read it."""
    if d.local_rank == 0:
        return prepare(cfg)
    meta = cache_folder(cfg.data) / "meta.json"
    while not meta.is_file():
        time.sleep(2)
    return prepare(cfg)


class StopSignal:
    """SIGINT/SIGTERM ask the loop to finish the current update, save and stop; a second Ctrl-C stops at once."""

    def __init__(self):
        self.name: str | None = None
        self.previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a test runner's worker): no handlers
                pass

    def _handle(self, signum, frame):
        if self.name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.name = signal.Signals(signum).name
        logger.warning(f"\n{self.name}: finishing this update, then saving a checkpoint (Ctrl-C again to abort)")

    def requested(self, d: Dist) -> bool:
        """Whether any rank was signalled; all ranks then stop at the same update."""
        flag = d.all_reduce_max({None: 0, "SIGINT": 1, "SIGTERM": 2}[self.name])
        if flag and self.name is None:
            self.name = "SIGTERM" if flag == 2 else "SIGINT"
        return flag > 0

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
