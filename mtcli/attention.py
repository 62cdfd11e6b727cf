"""Multi-head attention, softmax(Q K^T / sqrt(D)) V, over `torch.nn.functional.scaled_dot_product_attention` (SDPA)
on GPUs and in fp32 training; on a CPU under bf16 autocast or without gradients (translation), two batched products
with an fp32 softmax (`attend`).

Self-attention projects queries, keys and values with one fused `qkv` matrix; cross-attention projects queries with
`q` and keys/values of the encoder output with one fused `kv` (the layout CTranslate2's specs expect). The
projections go through cpu_kernels.py, which runs them on padded rows under CPU autocast and as plain nn.Linear
calls everywhere else. Masks are boolean, True where a key may be attended. No query row ever has all its keys
masked: sources always end in EOS, and decoder steps only see written positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtcli.cache import LayerCache
from mtcli.cpu_kernels import output_projection, project_heads


def attend(q, k, v, mask, causal: bool, dropout: float) -> torch.Tensor:
    """SDPA, except on a CPU under autocast (bf16 training) or without gradients (translation, validation): there,
    batched matrix products with an fp32 softmax. The CPU flash kernel's bf16 backward runs tiny matrix products one
    (sentence, head, block) at a time, slower than fp32 at sentence lengths of ~15-50 tokens, and at decoding shapes
    (one query per beam against a few dozen cached keys) its per-call overhead dominates; both measured in
    docs/benchmarks.md ("Figures behind the code"). GPUs keep SDPA's flash/efficient kernels."""
    if q.dtype != k.dtype:  # a bf16 model decoding with an fp32 cache (see KVCache.for_model)
        return attend(q.to(k.dtype), k, v, mask, causal, dropout).to(q.dtype)
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
        # The flag is a plain bool made of Python values only: `T > 1` is symbolic under torch.compile(dynamic=True),
        # and a symbolic is_causal breaks the graph at every decoder layer.
        if cache is not None and start > 0 and T > 1:
            raise ValueError("a multi-token decoder call with a cache must start at position 0")
        y = attend(q, k, v, mask, causal and start == 0, self.dropout if self.training else 0.0)
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
        y = attend(q, k, v, mask, False, self.dropout if self.training else 0.0)
        if beams > 1:
            y = y.view(B, H, beams, T, D).transpose(1, 2).reshape(N, H, T, D)
        return output_projection(self.out, y)

    def alignment_weights(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        mask: torch.Tensor | None,
        heads: int,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """The attention probabilities of the first `heads` heads for the queries of `x` (the input this layer's
        forward got), averaged over those heads, in fp32: (N, T, S), each row summing to 1 over the unmasked keys.
        Computed beside the forward (the same weights SDPA uses inside, without dropout), from the cached keys when
        decoding: what guided alignment trains and what alignments are read from."""
        d = x.shape[-1]
        width = heads * (d // self.heads)
        q = self.q(x)[..., :width]  # (N, T, heads * D); whole projections: an inference model's are packed (oneDNN)
        N, T = q.shape[:2]
        q = q.view(N, T, heads, -1).transpose(1, 2).float()  # (N, heads, T, D)
        if cache is not None and cache.cross_k is not None:
            k = cache.cross_k[:, :heads].float()
        else:
            k = self.kv(memory)[..., :width]  # kv is [k; v]: k's first heads
            k = k.view(memory.shape[0], memory.shape[1], heads, -1).transpose(1, 2).float()  # (B, heads, S, D)
        B = k.shape[0]
        beams = N // B
        q = q.view(B, beams, heads, T, -1).transpose(1, 2).reshape(B, heads, beams * T, -1)
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, heads, beams * T, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(-1).mean(1)  # (B, beams * T, S)
        return weights.view(B, beams, T, -1).reshape(N, T, -1)
