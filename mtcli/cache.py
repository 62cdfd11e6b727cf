"""The incremental-decoding cache: one explicit object that search passes to `Transformer.decode`.

Per decoder layer it holds
- self-attention keys/values, preallocated to the maximum output length and written in place at `length` (no
  concatenation, which would copy the whole cache every step), one row per hypothesis;
- cross-attention keys/values, computed once from the encoder output, one row per *sentence*: the beams of a
  sentence share them (the attention groups a sentence's beams as extra query positions).
"""

from __future__ import annotations

import torch


class LayerCache:
    def __init__(self, rows: int, heads: int, max_len: int, head_dim: int, device, dtype):
        self.k = torch.empty(rows, heads, max_len, head_dim, device=device, dtype=dtype)  # (N, H, Tmax, D)
        self.v = torch.empty_like(self.k)
        # Reordering writes into these spares, which then swap places with k and v: one pass over the written part,
        # not two (gather into a temporary, copy back), at twice the memory.
        self.spare_k, self.spare_v = torch.empty_like(self.k), torch.empty_like(self.k)
        self.cross_k: torch.Tensor | None = None  # (B, H, S, D), set by the first decode step
        self.cross_v: torch.Tensor | None = None


class KVCache:
    def __init__(self, layers: int, rows: int, heads: int, head_dim: int, max_len: int, device, dtype):
        self.max_len = max_len
        self.length = 0  # target positions written so far
        self.layers = [LayerCache(rows, heads, max_len, head_dim, device, dtype) for _ in range(layers)]

    @classmethod
    def for_model(cls, model, rows: int, max_len: int, device, dtype=None) -> KVCache:
        """A cache in `dtype` (default the model's), except on CPU, where it is fp32: for a bf16 model, attention over
        an fp32 cache decoded faster than over a bf16 one at decoding shapes (a few queries per row against a few
        dozen keys; docs/benchmarks.md, "Figures behind the code"); an fp32 cache for 64 sentences x 5 beams is a
        few MB."""
        head_dim = model.cfg.d_model // model.cfg.heads
        dtype = dtype or next(model.parameters()).dtype
        if torch.device(device).type == "cpu":
            dtype = torch.float32
        return cls(len(model.decoder), rows, model.cfg.heads, head_dim, max_len, device, dtype)

    @torch.no_grad()  # the cache is never differentiated through (search runs in inference mode)
    def reorder(self, rows: torch.Tensor, sentences: torch.Tensor | None = None) -> None:
        """Keep self-attention rows `rows` (in that order: beam back-pointers) and, when sentences leave the batch,
        the cross-attention entries of `sentences`."""
        n = self.length
        for layer in self.layers:
            if rows.numel() != layer.k.shape[0]:  # the batch shrank: smaller spares to gather into
                layer.spare_k = layer.k.new_empty(rows.numel(), *layer.k.shape[1:])
                layer.spare_v = torch.empty_like(layer.spare_k)
            torch.index_select(layer.k[:, :, :n], 0, rows, out=layer.spare_k[:, :, :n])
            torch.index_select(layer.v[:, :, :n], 0, rows, out=layer.spare_v[:, :, :n])
            layer.k, layer.spare_k = layer.spare_k, layer.k
            layer.v, layer.spare_v = layer.spare_v, layer.v
            if layer.spare_k.shape[0] != layer.k.shape[0]:  # the old, larger buffers: no longer needed
                layer.spare_k, layer.spare_v = torch.empty_like(layer.k), torch.empty_like(layer.v)
            if sentences is not None and layer.cross_k is not None:
                layer.cross_k = layer.cross_k.index_select(0, sentences)
                layer.cross_v = layer.cross_v.index_select(0, sentences)
