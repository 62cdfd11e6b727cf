"""Device, precision and allocator choices, made in one place for training and translation."""

from __future__ import annotations

import ctypes
import platform

import torch

from mtcli.errors import MtcliError


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise MtcliError(f"unknown device `{name}` (use auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MtcliError(f"device `{name}` asked for, but CUDA is not available here; use cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise MtcliError(f"device `{name}`: this machine has {torch.cuda.device_count()} GPU(s), numbered from 0")
    return device


def choose_precision(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA where supported, else fp16 on CUDA, fp32 elsewhere (CPUs without bf16 units run it ~100x
    slower)."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def precision_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of returning it to the OS.

    By default every buffer over a size threshold is a fresh mmap, and the kernel zero-fills its pages again on first
    touch: a CPU training step that frees and reallocates its activations spent a third of its time in page faults
    (benchmark setting: 2,450 -> 3,800 target tokens/s with this). The cost is that the process keeps its peak
    memory until it exits, which a training or translation process does anyway. No-op off glibc."""
    if platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    largest = 2**31 - 1
    return bool(libc.mallopt(M_MMAP_THRESHOLD, largest)) and bool(libc.mallopt(M_TRIM_THRESHOLD, largest))
