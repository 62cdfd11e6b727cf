"""The Transformer of "Attention Is All You Need": embeddings, positions, encoder and decoder stacks.

Public API: `encode(src, src_pad_mask) -> memory`, `decode(tgt, memory, src_pad_mask, cache) -> logits`, and
`forward`, which composes the two. `decode_hidden` and `logits` split `decode` so training can project only the
non-padding positions onto the vocabulary. Search drives `decode` one token at a time with a `KVCache` from `new_cache`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mtcli.attention import CrossAttention, SelfAttention
from mtcli.cache import KVCache
from mtcli.config import ModelConfig
from mtcli.cpu_kernels import Dropout, feed_forward_rows
from mtcli.tokenizer import MTCLI_SPECIALS, Specials


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.d_ff)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model)
        # in place where the function allows it: the products' outputs are not needed for their gradients, and a
        # fresh (tokens x d_ff) tensor costs as much as the activation itself
        self.activation = {"relu": torch.relu_, "gelu": F.gelu, "swish": lambda x: F.silu(x, inplace=True)}[
            cfg.activation
        ]
        self.dropout = Dropout(cfg.activation_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = feed_forward_rows(self.up, self.down, self.activation, self.dropout, x)  # bf16 on a CPU, else None
        return rows if rows is not None else self.down(self.dropout(self.activation(self.up(x))))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.self_attn = SelfAttention(cfg.d_model, cfg.heads, cfg.attention_dropout)
        self.ffn = FeedForward(cfg)
        self.norm1, self.norm2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if self.pre_norm:
            x = self.dropout.residual(x, self.self_attn(self.norm1(x), mask))
            return self.dropout.residual(x, self.ffn(self.norm2(x)))
        x = self.norm1(self.dropout.residual(x, self.self_attn(x, mask)))
        return self.norm2(self.dropout.residual(x, self.ffn(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.self_attn = SelfAttention(cfg.d_model, cfg.heads, cfg.attention_dropout)
        self.cross_attn = CrossAttention(cfg.d_model, cfg.heads, cfg.attention_dropout)
        self.ffn = FeedForward(cfg)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(cfg.d_model) for _ in range(3))
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x, memory, mask, cache=None, start: int = 0, align_heads: int = 0, weights_only: bool = False):
        """Returns the layer's output and, with align_heads, its cross-attention's alignment weights (N, T, S) (else
        None): CrossAttention.alignment_weights of the first align_heads heads, from the cross-attention's input.
        weights_only: the weights alone (the output is None), without the cross-attention and feed-forward."""
        if self.pre_norm:
            x = self.dropout.residual(x, self.self_attn(self.norm1(x), causal=True, cache=cache, start=start))
            h = self.norm2(x)
        else:
            h = x = self.norm1(self.dropout.residual(x, self.self_attn(x, causal=True, cache=cache, start=start)))
        weights = self.cross_attn.alignment_weights(h, memory, mask, align_heads, cache) if align_heads else None
        if weights_only:
            return None, weights
        if self.pre_norm:
            x = self.dropout.residual(x, self.cross_attn(h, memory, mask, cache=cache))
            return self.dropout.residual(x, self.ffn(self.norm3(x))), weights
        x = self.norm2(self.dropout.residual(x, self.cross_attn(h, memory, mask, cache=cache)))
        return self.norm3(self.dropout.residual(x, self.ffn(x))), weights


def sinusoidal_positions(max_positions: int, d_model: int) -> torch.Tensor:
    """The paper's table: sin on even dimensions, cos on odd ones. (max_positions, d_model), float32.

    Computed in float64 and rounded once, as MarianMT's table is: in float32, position x frequency is off by up to
    ~1.5e-5 at position 255, and the two tables (export, import) would differ by that much."""
    position = torch.arange(max_positions, dtype=torch.float64)[:, None]
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)
    return table.float()


class Transformer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        src_vocab_size: int,
        tgt_vocab_size: int,
        joint_vocab: bool,
        specials: Specials = MTCLI_SPECIALS,
    ):
        """`specials`: the vocabulary's special ids (the tokenizer's), which the batches and the search use too."""
        super().__init__()
        self.cfg, self.specials = cfg, specials
        d, pad = cfg.d_model, specials.pad
        self.src_embed = nn.Embedding(src_vocab_size, d, padding_idx=pad)
        share_src_tgt = cfg.tie_embeddings and joint_vocab and src_vocab_size == tgt_vocab_size
        self.tgt_embed = self.src_embed if share_src_tgt else nn.Embedding(tgt_vocab_size, d, padding_idx=pad)
        if cfg.positions == "learned":
            self.learned_positions = nn.Embedding(cfg.max_positions, d)
        else:
            self.register_buffer("sinusoids", sinusoidal_positions(cfg.max_positions, d), persistent=False)
        self.embed_dropout = Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        # Post-norm layers end in a LayerNorm already; pre-norm stacks need one at the top.
        self.encoder_norm = nn.LayerNorm(d) if cfg.norm == "pre" else nn.Identity()
        self.decoder_norm = nn.LayerNorm(d) if cfg.norm == "pre" else nn.Identity()
        self.output = nn.Linear(d, tgt_vocab_size, bias=False)
        if cfg.output_bias:
            self.register_buffer("output_bias", torch.zeros(tgt_vocab_size))
        else:
            self.output_bias = None
        self._init_weights()
        if cfg.tie_embeddings:
            self.output.weight = self.tgt_embed.weight

    def _init_weights(self) -> None:
        d = self.cfg.d_model
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "embed" in name or "learned_positions" in name:
                nn.init.normal_(p, mean=0.0, std=d**-0.5)  # with the sqrt(d) scale, inputs start at unit size
            elif p.dim() == 2:
                # Fused projections (qkv, kv) get Xavier per d x d block, as separate matrices would.
                for block in p.data.split(d, dim=0) if name.endswith(("qkv.weight", "kv.weight")) else (p.data,):
                    nn.init.xavier_uniform_(block)
        with torch.no_grad():
            self.src_embed.weight[self.specials.pad].zero_()
            self.tgt_embed.weight[self.specials.pad].zero_()

    def _embed(
        self, embedding: nn.Embedding, ids: torch.Tensor, start: int = 0, word_dropout: float = 0.0
    ) -> torch.Tensor:
        T = ids.shape[1]
        if start + T > self.cfg.max_positions:
            raise ValueError(f"sequence of {start + T} tokens exceeds model.max_positions={self.cfg.max_positions}")
        if self.cfg.positions == "learned":
            positions = self.learned_positions.weight[start : start + T]
        else:
            positions = self.sinusoids[start : start + T]
        tokens = embedding(ids)
        if word_dropout:
            # Whole tokens vanish (not rescaled: test inputs are never missing words); their positions stay.
            keep = torch.rand(ids.shape, device=ids.device) >= word_dropout
            tokens = tokens * keep.unsqueeze(-1).to(tokens.dtype)
        if self.cfg.scale_embedding:
            tokens = tokens * math.sqrt(self.cfg.d_model)
        x = tokens + positions.to(embedding.weight.dtype)
        if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            # CPU autocast: carry the residual stream in the autocast dtype. In fp32 (as on GPUs) every LayerNorm
            # output is cast down for the next projection and every gradient cast back, a memory pass each way.
            x = x.to(torch.get_autocast_dtype("cpu"))
        return self.embed_dropout(x)  # (B, T, d)

    @staticmethod
    def attention_mask(src_pad_mask: torch.Tensor) -> torch.Tensor:
        return ~src_pad_mask[:, None, None, :]  # (B, 1, 1, S), True where a key may be attended

    def encode(self, src: torch.Tensor, src_pad_mask: torch.Tensor) -> torch.Tensor:
        """src: (B, S) ids ending in EOS, right-padded. Returns memory: (B, S, d)."""
        mask = self.attention_mask(src_pad_mask)
        x = self._embed(self.src_embed, src, word_dropout=self.cfg.src_word_dropout if self.training else 0.0)
        for layer in self.encoder:
            x = layer(x, mask)
        return self.encoder_norm(x)

    def decode_hidden(
        self, tgt: torch.Tensor, memory: torch.Tensor, src_pad_mask: torch.Tensor, cache: KVCache | None = None
    ) -> torch.Tensor:
        """tgt: (N, T) ids starting with BOS; N = B * beams when a cache groups beams. Returns (N, T, d).

        Without a cache the whole prefix is decoded with a causal mask (right padding needs no other mask). With a
        cache, tgt holds the next position(s) only, written at cache.length, which then advances."""
        return self.decode_aligned(tgt, memory, src_pad_mask, cache)[0]

    def decode_aligned(
        self,
        tgt: torch.Tensor,
        memory: torch.Tensor,
        src_pad_mask: torch.Tensor,
        cache: KVCache | None = None,
        align_heads: int = 0,
        stop_at_alignment: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """decode_hidden, plus the alignment weights (N, T, S) of model.alignment_layer's first `align_heads` heads
        (none with 0). stop_at_alignment: only the layers up to the alignment layer run, for the weights alone
        (hidden is then None; not with a cache, which every layer must fill)."""
        start = cache.length if cache is not None else 0
        mask = self.attention_mask(src_pad_mask)
        x = self._embed(self.tgt_embed, tgt, start)
        align_layer, weights = self.cfg.alignment_layer_index, None
        stop_at_alignment = stop_at_alignment and cache is None
        for i, layer in enumerate(self.decoder):
            here = i == align_layer
            layer_cache = cache.layers[i] if cache is not None else None
            x, layer_weights = layer(
                x, memory, mask, layer_cache, start, align_heads if here else 0, here and stop_at_alignment
            )
            if here:
                weights = layer_weights
                if stop_at_alignment:
                    return None, weights
        if cache is not None:
            cache.length += tgt.shape[1]
        return self.decoder_norm(x), weights

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.output(hidden)
        return logits if self.output_bias is None else logits + self.output_bias.to(logits.dtype)

    def decode(
        self, tgt: torch.Tensor, memory: torch.Tensor, src_pad_mask: torch.Tensor, cache: KVCache | None = None
    ) -> torch.Tensor:
        return self.logits(self.decode_hidden(tgt, memory, src_pad_mask, cache))  # (N, T, V)

    def new_cache(self, rows: int, max_len: int, device, dtype=None) -> KVCache:
        return KVCache.for_model(self, rows, max_len, device, dtype)

    def forward(self, src: torch.Tensor, src_pad_mask: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        return self.decode(tgt_in, self.encode(src, src_pad_mask), src_pad_mask)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied matrices count once

    def describe(self) -> str:
        c = self.cfg
        tied = ", tied" if c.tie_embeddings else ""
        return (
            f"{c.n_encoder_layers}+{c.n_decoder_layers} layers, d_model {c.d_model}, {c.heads} heads, d_ff {c.d_ff}, "
            f"{c.norm}-norm, vocabulary {self.output.out_features}{tied}"
        )
