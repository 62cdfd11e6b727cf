"""The model as translation runs it: the precision chosen for the device (`auto`), bf16 weights, int8 linear layers,
and on a CPU linear layers packed once into oneDNN's layout (cpu_kernels.PackedLinear). Translation, validation and
the server use it; training never does.
"""

from __future__ import annotations

import warnings
from copy import deepcopy

import torch

from mtcli.cpu_kernels import pack_linears
from mtcli.device import choose_precision
from mtcli.errors import MtcliError
from mtcli.log import logger


def inference_model(model: torch.nn.Module, precision: str, copy: bool = False) -> torch.nn.Module:
    """The model as translation runs it in `precision`: fp32 (on a CPU, linear layers packed for oneDNN); bf16
    weights (so the attention is bf16 too; scores are accumulated in fp32 by the search); int8: the linear layers
    dynamically quantized (int8 weights, activations quantized per call). copy=True leaves `model` untouched
    (validation during training translates with a converted copy)."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    if precision == "fp32":  # packed for oneDNN on a CPU, except for a copy (validation: not worth a copy)
        return pack_linears(model) if on_cpu and not copy else model
    if precision == "bf16":
        model = (deepcopy(model) if copy else model).to(torch.bfloat16)
        return pack_linears(model) if on_cpu else model
    if precision == "int8":
        with warnings.catch_warnings():  # torch.ao.quantization warns that it is deprecated; it is what torch has
            warnings.simplefilter("ignore")
            try:
                from torch.ao.quantization import quantize_dynamic

                return quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=not copy)
            except (ImportError, AttributeError, RuntimeError) as e:
                raise MtcliError(f"int8 translation is not available with this torch ({e}); use bf16 or fp32") from None
    raise MtcliError(f"unknown translation precision `{precision}` (auto, fp32, bf16 or int8)")


_logged_decisions: set[str] = set()


def translation_precision(precision: str, device: torch.device) -> tuple[str, str]:
    """`auto` resolved for this device (device.choose_precision), and the reason; an auto decision is logged once."""
    name, why = choose_precision(precision, device, training=False)
    message = f"translation precision: {name} ({why})"
    if precision == "auto" and message not in _logged_decisions:
        _logged_decisions.add(message)
        logger.info(message)
    return name, why
