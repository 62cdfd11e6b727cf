"""Device, precision and allocator choices, made in one place for training and translation."""

from __future__ import annotations

import ctypes
import os
import platform

import torch

from mtcli.errors import MtcliError
from mtcli.log import logger


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


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), for figures that depend on the machine."""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_bf16_units() -> str | None:
    """The CPU's bf16 matrix instructions: "AMX" (amx_bf16 tiles), "AVX512-BF16" (dot products), or None."""
    if torch.cpu._is_amx_tile_supported():
        return "AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return "AVX512-BF16"
    return None


def cuda_bf16_units(device: torch.device) -> bool:
    """Whether the GPU computes bf16 in hardware: compute capability 8.0 (Ampere) or later, or ROCm.
    `torch.cuda.is_bf16_supported()` also answers yes for emulated bf16 (V100, T4), which runs far slower than the
    fp16 tensor cores those cards have."""
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device)[0] >= 8


def allow_tf32(device: torch.device) -> None:
    """fp32 matrix products on a CUDA device through TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation),
    as fairseq and most training code do: several times faster on Ampere and later. CPUs are left as they are."""
    if device.type != "cuda":
        return
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "tf32"
    else:
        matmul.allow_tf32 = True


def choose_precision(name: str, device: torch.device, training: bool = True) -> tuple[str, str]:
    """The precision to use ("fp32", "bf16", "fp16" or, for translation, "int8") and the reason.

    auto decides from what the hardware is, never from a timing, so one command on one machine gives one answer
    whatever else runs there. On CUDA: bf16 where supported, else fp16 for training (with a loss scaler) and fp32 for
    translation. On a CPU: bf16 where it has bf16 matrix units (AMX tiles or AVX512-BF16 dot products; bf16 products
    measured 2.7-7x fp32 on both, docs/design.md), fp32 otherwise (bf16 without them runs 4-100x slower). int8
    (translation only) is never picked by auto: it trades a little BLEU for speed, which is the user's call."""
    if name != "auto":
        if name == "int8" and (training or device.type != "cpu"):
            raise MtcliError("int8 is a translation precision for CPUs (dynamic quantization of the linear layers)")
        if device.type == "cpu" and name in ("bf16", "fp16") and cpu_bf16_units() is None:
            logger.warning(
                f"warning: {name} on a CPU without bf16 matrix units runs several times slower than fp32 (see "
                "docs/benchmarks.md); use fp32"
            )
        return name, "as set"
    if device.type == "cuda":
        card = torch.cuda.get_device_name(device)
        if cuda_bf16_units(device):
            return "bf16", f"{card} has bf16 tensor cores"
        why = f"{card} has no bf16 tensor cores (compute capability under 8.0)"
        return ("fp16", why) if training else ("fp32", why)
    if device.type != "cpu":
        return "fp32", f"{device.type} device"
    units = cpu_bf16_units()
    if units is None:
        return "fp32", "this CPU has no bf16 matrix units"
    return "bf16", f"this CPU has {units} bf16 matrix units"


def precision_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of returning it to the OS.

    By default every buffer over a size threshold is a fresh mmap, and the kernel zero-fills its pages again on first
    touch: a CPU training step that frees and reallocates its activations spent a third of its time in page faults
    (docs/benchmarks.md, "Figures behind the code"). The cost is that the process keeps its peak
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


def keep_onednn_kernels(capacity: int = 4096) -> None:
    """Let oneDNN keep more CPU kernels (its ONEDNN_PRIMITIVE_CACHE_CAPACITY, default 1,024) unless the user set it.

    CPU bf16 matrix products run kernels built for each exact shape. A Multi30k epoch at 4,096 tokens makes ~75
    distinct sentences x length products, ~15 product shapes each: more than 1,024 kernels, so with the default
    every epoch rebuilt most of them; with 4,096 only the first epoch does. oneDNN reads the variable when it makes
    its first kernel, so this must run before any CPU product."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))
