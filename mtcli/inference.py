"""The model as translation runs it: the precision chosen for the device (`auto`), bf16 weights, int8 linear layers,
and on a CPU linear layers packed once into oneDNN's layout. Translation, validation and the server use it; training
never does.
"""

from __future__ import annotations

import warnings
from copy import deepcopy

import torch

from mtcli.device import choose_precision
from mtcli.errors import MtcliError
from mtcli.log import logger


class PackedLinear(torch.nn.Module):
    """nn.Linear for inference on a CPU, its weight reordered once into oneDNN's blocked layout. In bf16, F.linear
    reorders the weight on every call, which at decoding sizes (5-320 rows) costs as much as the product; packed,
    the results are identical. In fp32, F.linear runs on MKL, slower than oneDNN at decoding shapes on the CPUs
    measured (docs/benchmarks.md, "Figures behind the code"); results differ from MKL's by float rounding
    (~2e-6). It uses torch's private
    mkldnn ops, as torch.compile's CPU backend does; where they are missing, `pack_linears` leaves the layers as
    they are."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: torch.nn.Module) -> torch.nn.Module:
    """Every nn.Linear of a bf16 or fp32 CPU model replaced by a PackedLinear, if this torch has the ops and they
    agree with F.linear on a probe (bf16: exactly; fp32: to float rounding); else the model unchanged."""
    dtype = next(model.parameters()).dtype
    try:
        with torch.random.fork_rng(devices=[]):  # the probe's random weights must not shift training's dropout
            probe = torch.nn.Linear(64, 96).to(dtype)
            x = torch.randn(5, 64).to(dtype)
        packed, plain = PackedLinear(probe)(x), probe(x)
        if not (torch.equal(packed, plain) if dtype == torch.bfloat16 else torch.allclose(packed, plain, atol=1e-5)):
            return model
    except (AttributeError, RuntimeError):
        return model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child))
    return model


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
