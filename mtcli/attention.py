"""Multi-head attention over `torch.nn.functional.scaled_dot_product_attention` (SDPA) on GPUs and in fp32 training;
on a CPU under bf16 autocast or without gradients (translation), two batched products with an fp32 softmax (_attend).

Self-attention projects queries, keys and values with one fused `qkv` matrix; cross-attention projects queries with
`q` and keys/values of the encoder output with one fused `kv`. Masks are boolean, True where a key may be attended.
No query row ever has all its keys masked: sources always end in EOS, and decoder steps only see written positions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mtcli.cache import LayerCache

ROW_MULTIPLE = 64


def padded_rows(x: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """Under CPU autocast (bf16 training): x as 2-D rows in the autocast dtype, zero rows appended up to a multiple
    of ROW_MULTIPLE, and the real row count. None elsewhere (fp32 (MKL) and GPU products, decoding without autocast).

    oneDNN builds a bf16 matrix-product kernel for each exact shape, and a token-budget batch's sentences x length
    is new almost every batch, so building kernels was a tenth of an update (docs/benchmarks.md, "Figures behind the
    code"). Zero rows make the shapes repeat; their outputs are dropped and their gradients are zero, so the weight
    gradients are unchanged. They add <2% rows."""
    if not _cpu_autocast(x):
        return None
    rows = x.reshape(-1, x.shape[-1]).to(torch.get_autocast_dtype("cpu"))
    return _PadRows.apply(rows), rows.shape[0]


def _cpu_autocast(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and torch.is_autocast_enabled("cpu")


def _padded_count(rows: int) -> int:
    return -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE


def pad_to_row_multiple(rows: torch.Tensor) -> torch.Tensor:
    """(n, d) rows with zero rows appended up to a multiple of ROW_MULTIPLE (rows itself if n is one), one pass;
    not differentiable (the fused losses and _PadRows call it)."""
    padded = _padded_count(rows.shape[0])
    return rows if padded == rows.shape[0] else _with_zero_tail(rows, padded)


# Padding and unpadding rows, splitting heads off padded rows and merging them back, each as one memory pass in
# both directions. Autograd's own versions take two to four: F.pad fills its whole output and then copies, a
# slice's backward fills a zero gradient and copies into it, unbind's backward stacks the head gradients and the
# permute's backward copies them again (docs/benchmarks.md, "Figures behind the code").


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
    the product's own epilogue: torch's bf16 addmm first writes the bias into the output and then adds the product
    to it, and ReLU is a pass of its own. The backward is addmm's (the bias gradient summed in the rows' dtype) and
    casts the gradients to the parameters' dtypes, as autocast's does."""

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


_HAS_ONEDNN_LINEAR = hasattr(torch.ops.mkldnn, "_linear_pointwise")


def rows_linear(layer: nn.Linear, rows: torch.Tensor, relu: bool = False) -> torch.Tensor:
    """`layer` (then ReLU if asked) on padded_rows' rows (CPU autocast): oneDNN's linear with its bias and ReLU fused
    where this torch has it, else F.linear."""
    if not _HAS_ONEDNN_LINEAR:
        y = F.linear(rows, layer.weight, layer.bias)
        return torch.relu_(y) if relu else y
    return _RowsLinear.apply(rows, layer.weight, layer.bias, relu)


def unpad_rows(rows: torch.Tensor, n: int) -> torch.Tensor:
    """The first n of padded rows (a view), for autograd with a one-pass backward."""
    return _UnpadRows.apply(rows, n)


def project_heads(layer: nn.Linear, x: torch.Tensor, parts: int, heads: int) -> tuple[torch.Tensor, ...]:
    """A fused projection of x (B, T, d) split into `parts` tensors (B, H, T, D)."""
    padded = padded_rows(x) if type(layer) is nn.Linear else None
    if padded is None:
        return _split_heads(layer(x), parts, heads)
    rows, _ = padded
    return _SplitHeads.apply(rows_linear(layer, rows), x.shape[0], x.shape[1], parts, heads)


def output_projection(layer: nn.Linear, y: torch.Tensor) -> torch.Tensor:
    """Heads y (B, H, T, D) merged and projected by `layer`: (B, T, d)."""
    B, H, T, D = y.shape
    if not _cpu_autocast(y) or type(layer) is not nn.Linear:
        return layer(_merge_heads(y))
    merged = _MergeHeads.apply(y.to(torch.get_autocast_dtype("cpu")), _padded_count(B * T))
    return unpad_rows(rows_linear(layer, merged), B * T).view(B, T, layer.out_features)


def _split_heads(x: torch.Tensor, parts: int, heads: int) -> tuple[torch.Tensor, ...]:
    B, T, _ = x.shape
    return x.view(B, T, parts, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)  # parts x (B, H, T, D)


def _attend(q, k, v, mask, causal: bool, dropout: float) -> torch.Tensor:
    """SDPA, except on a CPU under autocast (bf16 training) or without gradients (translation, validation): there,
    batched matrix products with an fp32 softmax. The CPU flash kernel's bf16 backward runs tiny matrix products one
    (sentence, head, block) at a time, slower than fp32 at sentence lengths of ~15-50 tokens, and at decoding shapes
    (one query per beam against a few dozen cached keys) its per-call overhead dominates; both measured in
    docs/benchmarks.md ("Figures behind the code"). GPUs keep SDPA's flash/efficient kernels."""
    if q.dtype != k.dtype:  # a bf16 model decoding with an fp32 cache (see KVCache.for_model)
        return _attend(q.to(k.dtype), k, v, mask, causal, dropout).to(q.dtype)
    on_cpu_fast_path = q.device.type == "cpu" and (torch.is_autocast_enabled("cpu") or not torch.is_grad_enabled())
    if not on_cpu_fast_path:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout)
    scores = (q @ k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)  # (B, H, T, S) in the autocast dtype
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if causal:  # top-left aligned, as SDPA's is_causal
        T, S = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    if dropout:
        weights = F.dropout(weights, dropout)
    return weights @ v


def _merge_heads(y: torch.Tensor) -> torch.Tensor:
    B, H, T, D = y.shape
    return y.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        cache: LayerCache | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """x: (B, T, d). mask: (B, 1, 1, T) key mask. causal: decoder self-attention. With a cache, this call's
        keys/values are written at positions start..start+T and the query attends to everything written so far."""
        q, k, v = project_heads(self.qkv, x, 3, self.heads)  # each (B, H, T, D)
        T = q.shape[2]
        if cache is not None:
            cache.k[:, :, start : start + T] = k
            cache.v[:, :, start : start + T] = v
            k, v = cache.k[:, :, : start + T], cache.v[:, :, : start + T]  # (B, H, start+T, D)
        # SDPA's causal mask is aligned top-left, which is right only when queries and keys start together: a
        # one-token step attends to every cached position, and a multi-token call must start at an empty cache.
        if causal and T > 1 and start > 0:
            raise ValueError("a multi-token decoder call with a cache must start at position 0")
        y = _attend(q, k, v, mask, causal and T > 1, self.dropout if self.training else 0.0)
        return output_projection(self.out, y)


class CrossAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor | None, cache: LayerCache | None = None
    ) -> torch.Tensor:
        """x: (N, T, d) queries, N = B * beams. memory: (B, S, d) encoder output. mask: (B, 1, 1, S)."""
        if cache is not None and cache.cross_k is not None:
            k, v = cache.cross_k, cache.cross_v
        else:
            k, v = project_heads(self.kv, memory, 2, self.heads)  # each (B, H, S, D)
            if cache is not None:
                # contiguous: as views into the fused projection, every step's products would copy them again
                k, v = k.to(cache.k.dtype).contiguous(), v.to(cache.k.dtype).contiguous()
                cache.cross_k, cache.cross_v = k, v
        (q,) = project_heads(self.q, x, 1, self.heads)  # (N, H, T, D)
        N, H, T, D = q.shape
        B = k.shape[0]
        beams = N // B
        if beams > 1:  # a sentence's beams become extra query rows against its one copy of the keys/values
            q = q.view(B, beams, H, T, D).transpose(1, 2).reshape(B, H, beams * T, D)
        y = _attend(q, k, v, mask, False, self.dropout if self.training else 0.0)
        if beams > 1:
            y = y.view(B, H, beams, T, D).transpose(1, 2).reshape(N, H, T, D)
        return output_projection(self.out, y)
