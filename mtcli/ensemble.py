"""Ensembles: several models with one vocabulary translate as one, their next-token probabilities averaged (what
fairseq's `--path a.pt:b.pt` does). Independently trained models make different mistakes, so their average is
usually better than any one of them, at the cost of running each.

Search sees one model. `encode` concatenates the members' encoder outputs along the feature axis, so search's
`memory[keep]` keeps every member's rows together (members may differ in width and depth); `decode` splits it again,
runs each member on its own cache and returns the log of the mean probability.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mtcli.cache import KVCache


class EnsembleCache:
    """One KVCache per member, reordered together."""

    def __init__(self, caches: list[KVCache]):
        self.caches = caches

    def reorder(self, rows: torch.Tensor, sentences: torch.Tensor | None = None) -> None:
        for cache in self.caches:
            cache.reorder(rows, sentences)


class Ensemble(nn.Module):
    def __init__(self, models: list[nn.Module]):
        super().__init__()
        self.members = nn.ModuleList(models)
        self.widths = [m.cfg.d_model for m in models]
        self.specials = models[0].specials  # one vocabulary: the translator checks the members share it

    def encode(self, src: torch.Tensor, src_pad_mask: torch.Tensor) -> torch.Tensor:
        """(B, S, sum of the members' d_model)."""
        return torch.cat([m.encode(src, src_pad_mask) for m in self.members], dim=-1)

    def new_cache(self, rows: int, max_len: int, device, dtype=None) -> EnsembleCache:
        return EnsembleCache([m.new_cache(rows, max_len, device, dtype) for m in self.members])

    def decode(
        self, tgt: torch.Tensor, memory: torch.Tensor, src_pad_mask: torch.Tensor, cache: EnsembleCache | None = None
    ) -> torch.Tensor:
        """log(mean of the members' probabilities), (N, T, V) in float32: search's log_softmax leaves it as it is."""
        memories = memory.split(self.widths, dim=-1)
        caches = cache.caches if cache is not None else [None] * len(self.members)
        log_probs = torch.stack(
            [
                torch.log_softmax(m.decode(tgt, mem, src_pad_mask, c), dim=-1, dtype=torch.float32)
                for m, mem, c in zip(self.members, memories, caches)
            ]
        )
        return torch.logsumexp(log_probs, dim=0) - math.log(len(self.members))
