"""Counting the places where Python reads a tensor's values: on a GPU each one waits for every queued kernel (a
device-to-host sync), so a training update or a search step that makes many of them leaves the GPU idle while Python
catches up. Used by the tests (on any device) and by `make gpu-check`.

    with count_host_reads() as reads:
        train_step(...)
    reads.total, reads.by_name  # e.g. 1, {"__float__": 1}
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch

# The Tensor methods through which Python code reads values (`if t:`, int(t), t.tolist(), ...). Reads inside C++ ops
# (boolean-mask indexing, torch.nonzero called from C++) and `.to("cpu")` are not seen: hot paths avoid them.
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu")


@dataclass
class HostReads:
    by_name: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.by_name.values())


@contextlib.contextmanager
def count_host_reads(device_type: str | None = None):
    """Count calls of READS on tensors (on `device_type` only, if given) while the block runs. Not thread-safe: the
    methods of torch.Tensor are replaced for the duration."""
    reads = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name, original):
        def read(self, *args, **kwargs):
            if device_type is None or self.device.type == device_type:
                reads.by_name[name] += 1
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(name, original))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
