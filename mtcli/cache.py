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
        self.cross_k: torch.Tensor | None = None  # (B, H, S, D), set by the first decode step
        self.cross_v: torch.Tensor | None = None


class KVCache:
    def __init__(self, layers: int, rows: int, heads: int, head_dim: int, max_len: int, device, dtype):
        self.max_len = max_len
        self.length = 0  # target positions written so far
        self.layers = [LayerCache(rows, heads, max_len, head_dim, device, dtype) for _ in range(layers)]

    @classmethod
    def for_model(cls, model, rows: int, max_len: int, device, dtype=None) -> KVCache:
        head_dim = model.cfg.d_model // model.cfg.heads
        dtype = dtype or next(model.parameters()).dtype
        return cls(len(model.decoder), rows, model.cfg.heads, head_dim, max_len, device, dtype)

    def reorder(self, rows: torch.Tensor, sentences: torch.Tensor | None = None) -> None:
        """Keep self-attention rows `rows` (in that order: beam back-pointers) and, when sentences leave the batch,
        the cross-attention entries of `sentences`."""
        n = self.length
        for layer in self.layers:
            if rows.numel() == layer.k.shape[0]:  # same size: overwrite the written part in place
                layer.k[:, :, :n] = layer.k[:, :, :n].index_select(0, rows)
                layer.v[:, :, :n] = layer.v[:, :, :n].index_select(0, rows)
            else:  # the batch shrank: copy only the written part into smaller buffers
                k = layer.k.new_empty(rows.numel(), *layer.k.shape[1:])
                v = torch.empty_like(k)
                k[:, :, :n] = layer.k[:, :, :n].index_select(0, rows)
                v[:, :, :n] = layer.v[:, :, :n].index_select(0, rows)
                layer.k, layer.v = k, v
            if sentences is not None and layer.cross_k is not None:
                layer.cross_k = layer.cross_k.index_select(0, sentences)
                layer.cross_v = layer.cross_v.index_select(0, sentences)
