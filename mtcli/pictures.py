"""Attention pictures: which source pieces each target piece looked at, from the real model.

SDPA does not return attention weights, so they are recomputed here, for this purpose only: the sentence is
translated (greedy), then decoded once more with the output as the target prefix while a forward pre-hook on the
chosen decoder layers' cross-attention captures its inputs; softmax(QK^T / sqrt(d)) is then computed explicitly from
those inputs and the layer's own projections. matplotlib is optional: pip install 'mtcli[plot]'.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from mtcli.errors import MtcliError
from mtcli.log import logger
from mtcli.outputs import check_file_target, new_file
from mtcli.translate import Translator


@dataclass
class AttentionMap:
    source: list[str]  # source pieces, then "</s>"
    target: list[str]  # output pieces, then "</s>"
    weights: torch.Tensor  # (layers, heads, target, source), rows sum to 1
    translation: str


@torch.inference_mode()
def cross_attention(translator: Translator, sentence: str) -> AttentionMap:
    """Greedy translation of `sentence` and the cross-attention weights of every decoder layer and head."""
    model, tokenizer = translator.model, translator.tokenizer
    if not sentence.strip():
        raise MtcliError("attention: give a non-empty sentence")
    best = translator.translate_nbest([sentence], beam=1, sampling=False)[0][0]
    specials = model.specials
    src_ids = translator.source_ids([sentence.strip()])[0][: translator.max_src_tokens] + [specials.eos]
    src = torch.tensor([src_ids], device=translator.device)
    tgt_in = torch.tensor([[specials.bos, *best.tokens]], device=translator.device)
    captured: dict[int, tuple] = {}
    hooks = [
        layer.cross_attn.register_forward_pre_hook(lambda mod, args, i=i: captured.__setitem__(i, args))
        for i, layer in enumerate(model.decoder)
    ]
    try:
        mask = src == -1  # no padding in a batch of one
        model.decode(tgt_in, model.encode(src, mask), mask)
    finally:
        for hook in hooks:
            hook.remove()
    weights = torch.stack([_weights(model.decoder[i].cross_attn, *captured[i][:2]) for i in range(len(model.decoder))])
    source, target = tokenizer.src_pieces(src_ids), tokenizer.tgt_pieces([*best.tokens, specials.eos])
    return AttentionMap(source, target, weights[:, 0].float().cpu(), best.text)


def _weights(attn, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
    """softmax(QK^T / sqrt(D)) of one cross-attention layer, from its inputs: (B, H, T, S)."""
    B, T, d = x.shape
    H = attn.heads
    q = attn.q(x).view(B, T, H, d // H).transpose(1, 2)  # (B, H, T, D)
    k = attn.kv(memory)[..., :d].view(B, memory.shape[1], H, d // H).transpose(1, 2)  # (B, H, S, D); kv is [k; v]
    return (q.float() @ k.float().transpose(-1, -2) / math.sqrt(d // H)).softmax(-1)


def plot_attention(
    result: AttentionMap, out: Path, layer: int | None = None, head: int | None = None, force: bool = False
) -> Path:
    """A heat map (target pieces down, source pieces across) of one layer and head, or their mean when None, written
    to `out` (an existing file is replaced only with `force`, and only once the picture is complete)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MtcliError("attention pictures need matplotlib: pip install 'mtcli[plot]'") from None
    layers, heads = result.weights.shape[:2]
    for name, value, count in (("--layer", layer, layers), ("--head", head, heads)):
        if value is not None and not 0 <= value < count:
            raise MtcliError(f"{name} {value}: this model has {count} (numbered from 0)")
    w = result.weights if layer is None else result.weights[layer : layer + 1]
    w = (w if head is None else w[:, head : head + 1]).mean(dim=(0, 1))
    what = f"layer {layer if layer is not None else 'mean'}, head {head if head is not None else 'mean'}"
    out = Path(out)
    check_file_target(out, force, option="--out")
    families, uncovered = fonts_for(result.source + result.target)
    with plt.rc_context({"font.family": families}):
        rows, cols = len(result.target), len(result.source)
        fig, ax = plt.subplots(figsize=(max(4, 0.45 * cols + 3), max(3, 0.45 * rows + 1.5)))
        image = ax.imshow(w.numpy(), cmap="Blues", vmin=0.0, vmax=float(w.max()), aspect="auto")
        fig.colorbar(image, ax=ax, label="attention weight", fraction=0.05, pad=0.03)
        ax.set_xticks(range(cols), result.source, rotation=60, ha="right")
        ax.set_yticks(range(rows), result.target)
        ax.set_xlabel("source pieces")
        ax.set_ylabel("output pieces")
        ax.set_title(f"cross-attention ({what})", fontsize=10)
        picture_format = out.suffix.lstrip(".").lower() or "png"
        if picture_format not in fig.canvas.get_supported_filetypes():
            plt.close(fig)
            raise MtcliError(f"--out {out}: .{picture_format} is not a picture format (use .png, .svg or .pdf)")
        out.parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings(), new_file(out, force, option="--out", binary=True) as handle:
            if uncovered:
                warnings.simplefilter("ignore")  # one "missing glyph" warning per character otherwise
                logger.warning(
                    f"note: no installed font has {uncovered[:12]!r}: those labels show as boxes; install one that "
                    "does (Debian: fonts-noto-cjk for Chinese, Japanese and Korean, fonts-noto for most other scripts)"
                )
            fig.tight_layout()
            fig.savefig(handle, dpi=120, format=picture_format)
        plt.close(fig)
    return out


def fonts_for(labels: list[str]) -> tuple[list[str], str]:
    """The font families to draw `labels` with: the default one, then installed fonts that have the characters it
    lacks (matplotlib falls back glyph by glyph through the list), fewest first; and the characters no installed font
    has. Matplotlib's own "Last Resort" font draws every character as a box, so it never counts."""
    import matplotlib
    from matplotlib import font_manager

    default = font_manager.findfont(font_manager.FontProperties(family=matplotlib.rcParams["font.family"]))
    families = [font_manager.get_font(default).family_name]
    missing = {ord(ch) for label in labels for ch in label if not ch.isspace()} - _charmap(default)
    fonts = {f.name: f.fname for f in font_manager.fontManager.ttflist if "last resort" not in f.name.lower()}
    covers = {name: missing & _charmap(path) for name, path in fonts.items()} if missing else {}
    while missing:
        name = max(covers, key=lambda n: len(covers[n] & missing), default=None)
        if name is None or not covers[name] & missing:
            break
        families.append(name)
        missing -= covers[name]
    return families, "".join(sorted(map(chr, missing)))


def _charmap(path: str) -> set[int]:
    """The code points a font file has glyphs for (none when it cannot be read)."""
    from matplotlib import font_manager

    try:
        return set(font_manager.get_font(path).get_charmap())
    except (OSError, RuntimeError, ValueError):
        return set()
