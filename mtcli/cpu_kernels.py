"""The CPU fast path: what oneDNN needs to run bf16 training and CPU translation fast, and why. The model's layers
(attention.py, model.py) read as the paper's; each calls one function here that picks the fast path where it
applies and the plain PyTorch one everywhere else (GPUs, fp32 training, CPUs whose oneDNN lacks an op).

bf16 training under CPU autocast:
- Row padding. oneDNN builds a bf16 matrix-product kernel for each exact shape, and a token-budget batch's
  sentences x length is new almost every batch, so building kernels was a tenth of an update. Zero rows appended up
  to a multiple of ROW_MULTIPLE make the shapes repeat; their outputs are dropped and their gradients are zero, so
  the weight gradients are unchanged. They add <2% rows.
- Padding, unpadding, splitting heads off padded rows and merging them back as autograd functions of one memory pass
  each way: autograd's own versions take two to four (F.pad fills its whole output and then copies; a slice's
  backward fills a zero gradient and copies into it; unbind's backward stacks the head gradients and the permute's
  backward copies them again).
- Projections through oneDNN's linear with the bias (and ReLU) in the product's epilogue: torch's bf16 addmm first
  writes the bias into the output and then adds the product to it, and ReLU is a pass of its own.
- Dropout from 64-bit random integers cut into four 16-bit lanes (a quarter of the draws of torch's CPU Bernoulli
  sampler), and x + dropout(y) as one pass each way.

Translation on a CPU: linear layers packed once into oneDNN's blocked layout (PackedLinear).

The oneDNN ops are torch's private `torch.ops.mkldnn` ops, as torch.compile's CPU backend uses them. Each is probed
once on a small input against the public op (it must exist, run on this CPU and agree); where a probe fails, the
public op is used. Figures: docs/benchmarks.md, "Figures behind the code".
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

ROW_MULTIPLE = 64


# ---------------------------------------------------------------------------------------------------------------------
# Probes: does this torch, on this CPU, have the private op, and does it compute what the public op does?


@functools.cache
def onednn_linear_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN's fused linear (`mkldnn._linear_pointwise`, plain and with ReLU) runs here on `dtype` rows and
    agrees with F.linear. It is missing from some builds, and on CPUs without bf16 instructions (AVX2 only) oneDNN
    has no bf16 kernel for it."""
    try:
        with torch.random.fork_rng(devices=[]):  # the probe's random numbers must not shift training's dropout
            torch.manual_seed(0)
            x, w, b = torch.randn(5, 64).to(dtype), torch.randn(96, 64).to(dtype), torch.randn(96).to(dtype)
        for relu in (False, True):
            fused = torch.ops.mkldnn._linear_pointwise(x, w, b, "relu" if relu else "none", [], "")
            plain = F.linear(x.float(), w.float(), b.float())
            plain = torch.relu(plain) if relu else plain
            if not torch.allclose(fused.float(), plain, rtol=2e-2, atol=2e-2):
                return False
        return True
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def packed_linear_works(dtype: torch.dtype) -> bool:
    """Whether PackedLinear (a weight reordered once by `mkldnn._reorder_linear_weight`) runs here and agrees with
    nn.Linear: bf16 exactly (the same kernel, its weight reordered ahead), fp32 to float rounding (oneDNN vs MKL)."""
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            probe = nn.Linear(64, 96).to(dtype)
            x = torch.randn(5, 64).to(dtype)
        with torch.no_grad():
            packed, plain = PackedLinear(probe)(x), probe(x)
        return torch.equal(packed, plain) if dtype == torch.bfloat16 else torch.allclose(packed, plain, atol=1e-5)
    except (AttributeError, RuntimeError):
        return False


# ---------------------------------------------------------------------------------------------------------------------
# Rows padded to a multiple of ROW_MULTIPLE (bf16 training under CPU autocast)


def cpu_autocast(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and torch.is_autocast_enabled("cpu")


def padded_count(rows: int) -> int:
    return -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE


def pad_to_row_multiple(rows: torch.Tensor) -> torch.Tensor:
    """(n, d) rows with zero rows appended up to a multiple of ROW_MULTIPLE (rows itself if n is one), one pass;
    not differentiable (the fused losses and _PadRows call it)."""
    padded = padded_count(rows.shape[0])
    return rows if padded == rows.shape[0] else _with_zero_tail(rows, padded)


def _padded_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x as 2-D rows in the autocast dtype, zero rows appended, and the real row count."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.get_autocast_dtype("cpu"))
    return _PadRows.apply(rows), rows.shape[0]


def _with_zero_tail(rows: torch.Tensor, padded: int) -> torch.Tensor:
    out = rows.new_empty(padded, *rows.shape[1:])
    out[: rows.shape[0]] = rows
    out[rows.shape[0] :] = 0
    return out


class _PadRows(torch.autograd.Function):
    """(n, d) rows -> pad_to_row_multiple(rows); the gradient is a view of the first n rows."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor) -> torch.Tensor:
        ctx.n = rows.shape[0]
        return pad_to_row_multiple(rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[: ctx.n]


class _UnpadRows(torch.autograd.Function):
    """(padded, d) rows -> their first n, a view; the gradient gets zero rows appended."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, n: int) -> torch.Tensor:
        ctx.padded = rows.shape[0]
        return rows[:n]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _with_zero_tail(grad, ctx.padded), None


class _SplitHeads(torch.autograd.Function):
    """Padded rows of a fused projection, (padded, parts * H * D) -> parts views of shape (B, H, T, D); the gradients
    are written back into one padded row buffer."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, B: int, T: int, parts: int, heads: int):
        ctx.shape, ctx.padded = (B, T, parts, heads, rows.shape[1] // (parts * heads)), rows.shape[0]
        return rows[: B * T].view(ctx.shape).permute(2, 0, 3, 1, 4).unbind(0)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        B, T = ctx.shape[:2]
        grad = grads[0].new_empty(ctx.padded, math.prod(ctx.shape[2:]))
        grad[B * T :] = 0
        heads = grad[: B * T].view(ctx.shape).permute(2, 0, 3, 1, 4)
        for i, g in enumerate(grads):
            if g is None:
                heads[i].zero_()
            else:
                heads[i].copy_(g)
        return grad, None, None, None, None


class _MergeHeads(torch.autograd.Function):
    """(B, H, T, D) -> (padded, H * D) rows, zero rows appended; the gradient is a view."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, padded: int) -> torch.Tensor:
        B, H, T, D = ctx.shape = y.shape
        out = y.new_empty(padded, H * D)
        out[B * T :] = 0
        out[: B * T].view(B, T, H, D).copy_(y.transpose(1, 2))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        B, H, T, D = ctx.shape
        return grad[: B * T].view(B, T, H, D).transpose(1, 2), None


class _RowsLinear(torch.autograd.Function):
    """F.linear (and optionally ReLU) of bf16 rows through oneDNN's linear, with the bias (and the ReLU) applied in
    the product's own epilogue. The backward is addmm's (the bias gradient summed in the rows' dtype) and casts the
    gradients to the parameters' dtypes, as autocast's does."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool) -> torch.Tensor:
        w = weight.to(rows.dtype)
        b = bias.to(rows.dtype) if bias is not None else None
        y = torch.ops.mkldnn._linear_pointwise(rows, w, b, "relu" if relu else "none", [], "")
        ctx.save_for_backward(rows, w, y if relu else None)
        ctx.weight_dtype, ctx.bias_dtype, ctx.relu = weight.dtype, bias.dtype if bias is not None else None, relu
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, w, y = ctx.saved_tensors
        if ctx.relu:
            grad = torch.ops.aten.threshold_backward(grad, y, 0)
        grad_rows = grad @ w if ctx.needs_input_grad[0] else None
        grad_weight = (grad.t() @ rows).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        return grad_rows, grad_weight, grad_bias, None


def _rows_linear(layer: nn.Linear, rows: torch.Tensor, relu: bool = False) -> torch.Tensor:
    """`layer` (then ReLU if asked) on padded rows: oneDNN's fused linear where it works here, else F.linear."""
    if not onednn_linear_works(rows.dtype):
        y = F.linear(rows, layer.weight, layer.bias)
        return torch.relu_(y) if relu else y
    return _RowsLinear.apply(rows, layer.weight, layer.bias, relu)


# ---------------------------------------------------------------------------------------------------------------------
# What the layers call: each picks the padded-rows path under CPU autocast, the plain one elsewhere


def _fast_rows(x: torch.Tensor, *layers: nn.Module) -> bool:
    # plain nn.Linear only: translation's PackedLinear and int8 layers are not trained. Not under torch.compile,
    # whose CPU backend makes its own kernels (and cannot trace the probes' fork_rng).
    return cpu_autocast(x) and not torch.compiler.is_compiling() and all(type(layer) is nn.Linear for layer in layers)


def split_heads(x: torch.Tensor, parts: int, heads: int) -> tuple[torch.Tensor, ...]:
    B, T, _ = x.shape
    return x.view(B, T, parts, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)  # parts x (B, H, T, D)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    B, H, T, D = y.shape
    return y.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)


def project_heads(layer: nn.Linear, x: torch.Tensor, parts: int, heads: int) -> tuple[torch.Tensor, ...]:
    """A fused projection of x (B, T, d) split into `parts` tensors (B, H, T, D)."""
    if not _fast_rows(x, layer):
        return split_heads(layer(x), parts, heads)
    rows, _ = _padded_rows(x)
    return _SplitHeads.apply(_rows_linear(layer, rows), x.shape[0], x.shape[1], parts, heads)


def output_projection(layer: nn.Linear, y: torch.Tensor) -> torch.Tensor:
    """Heads y (B, H, T, D) merged and projected by `layer`: (B, T, d)."""
    if not _fast_rows(y, layer):
        return layer(merge_heads(y))
    B, H, T, D = y.shape
    merged = _MergeHeads.apply(y.to(torch.get_autocast_dtype("cpu")), padded_count(B * T))
    return _UnpadRows.apply(_rows_linear(layer, merged), B * T).view(B, T, layer.out_features)


def feed_forward_rows(up: nn.Linear, down: nn.Linear, activation, dropout, x: torch.Tensor) -> torch.Tensor | None:
    """down(dropout(activation(up(x)))) under CPU autocast, both products on the same padded rows, unpadded once (a
    padding copy and a slice's zero-filled gradient fewer per layer), ReLU in the product's epilogue; None elsewhere
    (the caller computes the plain expression)."""
    if not _fast_rows(x, up, down):
        return None
    rows, n = _padded_rows(x)
    if activation is torch.relu_:
        hidden = dropout(_rows_linear(up, rows, relu=True))
    else:
        hidden = dropout(activation(_rows_linear(up, rows)))
    return _UnpadRows.apply(_rows_linear(down, hidden), n).view(*x.shape[:-1], -1)


# ---------------------------------------------------------------------------------------------------------------------
# Dropout


class Dropout(nn.Module):
    """nn.Dropout, with a faster mask on CPU: torch's CPU Bernoulli sampler draws one random number per element,
    while 64-bit random integers cut into four 16-bit lanes need a quarter of the draws (rate resolution 1/65536).
    `residual(x, y)` is x + dropout(y) in one pass (and one in the backward). GPUs keep F.dropout."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        # int16 lanes are uniform on [-32768, 32767]: drop the lowest round(p * 65536) values
        self.threshold = round(p * 65536) - 32768

    def _scaled_keep(self, x: torch.Tensor) -> torch.Tensor | None:
        """1 / (1 - p) where an element is kept and 0 where dropped, in x's dtype; None where F.dropout is used."""
        if x.device.type != "cpu" or torch.compiler.is_compiling() or x.numel() % 4:
            return None
        lanes = torch.randint(-(2**63), 2**63 - 1, (x.numel() // 4,), dtype=torch.int64).view(torch.int16)
        return (lanes.view(x.shape) >= self.threshold).to(x.dtype).mul_(1.0 / (1.0 - self.p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = self._scaled_keep(x)
        return F.dropout(x, self.p, training=True) if keep is None else x * keep

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x + dropout(y)."""
        if not self.training or self.p == 0.0:
            return x + y
        keep = self._scaled_keep(y)
        if keep is None or x.dtype != y.dtype or x.shape != y.shape:
            return x + self(y)
        return _AddScaled.apply(x, y, keep)


class _AddScaled(torch.autograd.Function):
    """x + y * scale, with scale a constant tensor: one pass forward and one backward, where autograd's mul and add
    take two forward (and addcmul two backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return torch.addcmul(x, y, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (scale,) = ctx.saved_tensors
        return grad, grad * scale, None


# ---------------------------------------------------------------------------------------------------------------------
# Translation: linear layers packed once


class PackedLinear(nn.Module):
    """nn.Linear for inference on a CPU, its weight reordered once into oneDNN's blocked layout. In bf16, F.linear
    reorders the weight on every call, which at decoding sizes (5-320 rows) costs as much as the product; packed, the
    results are identical. In fp32, F.linear runs on MKL, slower than oneDNN at decoding shapes on the CPUs measured;
    results differ from MKL's by float rounding (~2e-6)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> nn.Module:
    """Every nn.Linear of a bf16 or fp32 CPU model replaced by a PackedLinear where packed_linear_works for its dtype;
    else the model unchanged."""
    if not packed_linear_works(next(model.parameters()).dtype):
        return model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child))
    return model
