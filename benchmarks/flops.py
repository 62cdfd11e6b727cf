"""Analytic model FLOPs of the Transformer, counted on real (non-padding) tokens; a multiply-add is 2 FLOPs.

Matrix products only (embedding lookups, LayerNorm, softmax and the optimizer are left out), as in the usual model
FLOPs utilisation (MFU). Backward costs twice the forward, so training is 3x.
"""

from __future__ import annotations

import numpy as np

FORMULA = """forward FLOPs of a batch (s_i, t_i: source/target lengths with EOS/BOS; Ns = sum s_i, Nt = sum t_i):
  encoder  Le * [ Ns * 2 * (4 d^2 + 2 d dff)                       (qkv, out, ffn)
                + 4 d * sum s_i^2 ]                                (QK^T and AV)
  decoder  Ld * [ Nt * 2 * (4 d^2 + 2 d^2 + 2 d dff)               (self qkv+out, cross q+out, ffn)
                + Ns * 2 * 2 d^2                                   (cross k,v of the encoder output)
                + 4 d * sum t_i (t_i + 1) / 2 + 4 d * sum s_i t_i ] (causal self-attention, cross-attention)
  output   Nt * 2 d V
training = 3 x forward; per target token = training / Nt"""


def forward_flops(
    src_lens: np.ndarray, tgt_lens: np.ndarray, d: int, d_ff: int, enc_layers: int, dec_layers: int, vocab: int
) -> float:
    s, t = np.asarray(src_lens, dtype=np.float64), np.asarray(tgt_lens, dtype=np.float64)
    ns, nt = s.sum(), t.sum()
    encoder = enc_layers * (ns * 2 * (4 * d * d + 2 * d * d_ff) + 4 * d * (s * s).sum())
    decoder = dec_layers * (
        nt * 2 * (6 * d * d + 2 * d * d_ff) + ns * 4 * d * d + 4 * d * (t * (t + 1) / 2).sum() + 4 * d * (s * t).sum()
    )
    return float(encoder + decoder + nt * 2 * d * vocab)


def training_flops(src_lens, tgt_lens, model_cfg, vocab: int) -> float:
    return 3.0 * forward_flops(
        src_lens,
        tgt_lens,
        model_cfg.d_model,
        model_cfg.d_ff,
        model_cfg.n_encoder_layers,
        model_cfg.n_decoder_layers,
        vocab,
    )
