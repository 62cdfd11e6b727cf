"""Translating text with a trained model: which checkpoint, batching, truncation, search, detokenization, original
order; and the line-oriented input and output of `mtcli translate` (stdin streaming, n-best lines).

`Translator` is what `mtcli translate`, `mtcli eval`, validation during training and the Python API all use, so a
score computed while training and one computed afterwards come from the same code:

    from mtcli import Translator
    Translator.from_run("runs/toy").translate(["I love apples"], beam=5)   # ['我喜欢苹果']
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from copy import deepcopy
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch

from mtcli.batching import collate, token_budget_batches
from mtcli.checkpoint import best_checkpoint, checkpoint_dir, last_checkpoint, load_model, read_tokenizer
from mtcli.config import Config, DecodeConfig
from mtcli.device import choose_precision, resolve_device
from mtcli.ensemble import Ensemble
from mtcli.errors import MtcliError
from mtcli.log import logger, progress_bar
from mtcli.search import beam_search, greedy_search, max_output_lengths, sample
from mtcli.tokenizer import Tokenizer

DECODE_OPTIONS = {f.name for f in fields(DecodeConfig)}


@dataclass
class Translation:
    text: str
    score: float  # log-probability (with EOS) divided by the length penalty
    log_prob: float  # log-probability (with EOS)
    tokens: list[int]  # output subword ids, without BOS and EOS


# ---------------------------------------------------------------------------------------------------------------------
# Which checkpoint


def find_run(runs_root: Path = Path("runs")) -> Path:
    """The most recently trained run under ./runs (the one whose newest checkpoint is newest)."""
    candidates = []
    if runs_root.is_dir():
        for run in runs_root.iterdir():
            ckpt = last_checkpoint(run)
            if ckpt is not None:
                candidates.append((ckpt.stat().st_mtime, str(run)))
    if not candidates:
        raise MtcliError(
            f"no trained run found under {runs_root}/; train one (mtcli train --config toy.yaml) "
            "or pass --run DIR or --checkpoint PATH"
        )
    return Path(max(candidates)[1])


def resolve_checkpoint(run: Path | str | None = None, checkpoint: Path | str | None = None) -> Path:
    """--checkpoint as given; else the best (or, before any validation, the newest) checkpoint of --run or of the
    latest run under ./runs. What was picked by default is said on the log."""
    if checkpoint is not None:
        return Path(checkpoint)
    latest = run is None
    run = find_run() if latest else Path(run)
    if not run.is_dir():
        raise MtcliError(f"--run {run}: no such run directory")
    best = best_checkpoint(run)
    ckpt = best or last_checkpoint(run)
    if ckpt is None:
        raise MtcliError(f"run {run} has no checkpoint yet; train it first (mtcli train ... --run-dir {run})")
    which = "best by validation" if best else "newest; no validation yet"
    logger.info(f"checkpoint: {ckpt} ({which}{', latest run under ./runs' if latest else ''})")
    return ckpt


def resolve_member(path: Path | str) -> Path:
    """An ensemble member given as a run directory (its best checkpoint) or as a checkpoint folder."""
    path = Path(path)
    return resolve_checkpoint(path) if checkpoint_dir(path).is_dir() else path


# ---------------------------------------------------------------------------------------------------------------------
# The translator


class PackedLinear(torch.nn.Module):
    """nn.Linear for inference on a CPU, its weight reordered once into oneDNN's blocked layout. In bf16, F.linear
    reorders the weight on every call, which at decoding sizes (5-320 rows) costs as much as the product: packed,
    a beam-5 step's projections run 1.6-2x faster, with identical results. In fp32, F.linear runs on MKL, whose
    products on an AMD EPYC (Zen 5) reached 130-165 GFLOP/s against oneDNN's 355-385 at decoding shapes (320 x 256
    @ 256 x 768..8000, 2 threads); results differ from MKL's by float rounding (~2e-6). It uses torch's private
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


def translation_precision(precision: str, model_config, device: torch.device) -> str:
    """`auto` resolved for this device and model (device.choose_precision); the decision is logged once."""
    name, why = choose_precision(precision, device, model_config.d_model, model_config.d_ff, training=False)
    message = f"translation precision: {name} ({why})"
    if precision == "auto" and message not in _logged_decisions:
        _logged_decisions.add(message)
        logger.info(message)
    return name


class Translator:
    def __init__(self, model, tokenizer: Tokenizer, config: Config, device: torch.device, precision: str = "fp32"):
        """`model` already in `precision` (see inference_model); from_checkpoint / from_run do that."""
        self.model, self.tokenizer, self.config, self.device = model, tokenizer, config, device
        self.precision = precision
        self.max_src_tokens = config.model.max_positions - 1  # room for EOS
        # A megabyte-long line is cut to far more characters than the positions hold before SentencePiece sees it,
        # so one such line costs no more than a long sentence (the subwords kept are the same in practice).
        self.max_chars = 64 * config.model.max_positions
        self.generator: torch.Generator | None = None
        self.checkpoint: Path | None = None  # where the weights came from, when loaded from a checkpoint
        self.ensemble: list[Path] = []  # the other members' checkpoints, when it translates as an ensemble
        # Lines longer than the positions: cut into pieces that fit and their translations joined (mtcli.segment;
        # `mtcli serve`, `mtcli translate --split-long`), instead of truncated with a warning
        self.split_long = False

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: Path | str,
        device: str = "auto",
        precision: str | None = None,
        ensemble: Iterable[Path | str] = (),
    ) -> Translator:
        """precision: auto, fp32, bf16 or int8; default the checkpoint's decode.precision. `ensemble`: more
        checkpoint folders or run directories (their best checkpoint) with the same SentencePiece model(s); their
        next-token probabilities are averaged with this one's (see mtcli.ensemble). The decode settings are this
        checkpoint's."""
        dev = resolve_device(device)
        model, config, tokenizer = load_model(Path(checkpoint), dev)
        name = translation_precision(precision or config.decode.precision, config.model, dev)
        model = inference_model(model, name)
        members, others = [model], [resolve_member(p) for p in ensemble]
        for other in others:
            # The vocabulary first: loading refuses a tokenizer that is not its own model's, but here the mistake is
            # mixing vocabularies
            if not read_tokenizer(other).same_as(tokenizer):
                raise MtcliError(
                    f"{other}: its SentencePiece model differs from that of {checkpoint}; an ensemble needs models "
                    "trained on one vocabulary (the same data cache)"
                )
            member, member_config, _ = load_model(other, dev)
            members.append(inference_model(member, name))
            if member_config.model.max_positions < config.model.max_positions:  # the shortest limit holds for all
                config = config.replace(**{"model.max_positions": member_config.model.max_positions})
        translator = cls(Ensemble(members) if len(members) > 1 else model, tokenizer, config, dev, name)
        translator.checkpoint = Path(checkpoint)
        translator.ensemble = others
        return translator

    @classmethod
    def from_run(
        cls,
        run: Path | str | None = None,
        checkpoint: Path | str | None = None,
        device: str = "auto",
        precision: str | None = None,
        ensemble: Iterable[Path | str] = (),
    ) -> Translator:
        """A run's best checkpoint (or `checkpoint`); without either, the latest run under ./runs. `ensemble`: as
        in from_checkpoint."""
        return cls.from_checkpoint(resolve_checkpoint(run, checkpoint), device, precision, ensemble)

    def decode_config(self, decode: DecodeConfig | None = None, **options) -> DecodeConfig:
        """The run's decode section (or `decode`) with options such as beam=5 applied and checked. The precision is
        the translator's own (chosen when it was loaded)."""
        if options.get("precision") not in (None, self.precision):
            raise MtcliError("the precision is chosen when the translator is loaded (from_run(..., precision=...))")
        decode = decode_settings(decode or self.config.decode, **options)
        vocab = self.tokenizer.tgt_vocab_size  # the model's too (load_model checks they agree)
        if decode.beam > vocab:  # the search keeps the beam's best tokens of the vocabulary: it needs that many
            raise MtcliError(f"--beam {decode.beam}: larger than the model's target vocabulary of {vocab:,} subwords")
        return decode

    def translate(self, lines: list[str], decode: DecodeConfig | None = None, progress=False, **options) -> list[str]:
        """The best translation of each line, in order; options are decode settings, e.g. beam=5, lenpen=1.0."""
        return [hyps[0].text for hyps in self.translate_nbest(lines, decode, progress, **options)]

    def translate_nbest(
        self, lines: list[str], decode: DecodeConfig | None = None, progress=False, **options
    ) -> list[list[Translation]]:
        """decode.nbest translations (best first, with scores) for each line, in order. Empty lines give empty
        outputs; lines longer than the model's positions are truncated, with one warning (split, with split_long)."""
        decode = self.decode_config(decode, **options)
        if self.split_long:
            from mtcli.segment import translate_long_lines  # mtcli.segment builds on this module

            return translate_long_lines(self, lines, decode, progress)
        return self.translate_lines(lines, decode, progress)

    def translate_lines(self, lines: list[str], decode: DecodeConfig, progress=False) -> list[list[Translation]]:
        """translate_nbest without options or splitting: over-long lines are truncated, with one warning."""
        cut = [len(line) > self.max_chars for line in lines]
        lines = [line[: self.max_chars].strip() for line in lines]
        ids = self.source_ids(lines, decode)
        n_truncated = sum(len(x) > self.max_src_tokens or c for x, c in zip(ids, cut))
        if n_truncated:
            logger.warning(
                f"warning: {n_truncated} input line(s) longer than the model's limit of {self.max_src_tokens} "
                "subwords were truncated"
            )
            ids = [x[: self.max_src_tokens] for x in ids]
        results: list[list[Translation]] = [[Translation("", 0.0, 0.0, [])] if not line else [] for line in lines]
        todo = [i for i, line in enumerate(lines) if line]
        lengths = np.array([len(x) + 1 for x in ids])  # with EOS
        order = np.array(sorted(todo, key=lambda i: -lengths[i]), dtype=np.int64)  # longest first, stable
        bar = progress_bar(len(lines), unit="line", enabled=bool(progress))
        bar.update(len(lines) - len(todo))
        for batch in token_budget_batches(order, lengths, None, decode.batch_tokens, decode.batch_sentences):
            for i, hyps in zip(batch, self._search([ids[i] for i in batch], decode)):
                results[i] = hyps
            bar.update(len(batch))
        bar.close()
        return results

    def source_ids(self, lines: list[str], decode: DecodeConfig | None = None) -> list[list[int]]:
        """Source subword ids of each line, after the source prefix (decode.src_prefix, else data.src_prefix: the
        target-language token of a multilingual model such as `>>deu<<`)."""
        prefix = (decode or self.config.decode).src_prefix
        return self.tokenizer.encode_src(lines, self.config.data.src_prefix if prefix is None else prefix)

    def _search(self, src_ids: list[list[int]], decode: DecodeConfig) -> list[list[Translation]]:
        batch = collate(src_ids, specials=self.model.specials).to(self.device)
        lengths = torch.tensor([len(x) for x in src_ids])
        max_lens = max_output_lengths(lengths, decode.max_len_a, decode.max_len_b, self.config.model.max_positions)
        args = (self.model, batch.src, batch.src_pad_mask, max_lens.to(self.device))
        if decode.sampling:
            if self.generator is None:  # one stream for the whole session: a line's sample must not depend on batching
                self.generator = torch.Generator(device=self.device).manual_seed(self.config.train.seed)
            d = decode
            found = sample(*args, d.temperature, d.top_k, d.top_p, d.min_len, self.generator)
            hyps = [[h] for h in found]
        elif decode.beam == 1 and not decode.no_repeat_ngram:  # beam 1 is greedy; the n-gram ban lives in beam search
            hyps = [[h] for h in greedy_search(*args, decode.min_len)]
        else:
            d = decode
            hyps = beam_search(*args, d.beam, d.lenpen, d.min_len, d.nbest, d.no_repeat_ngram)
        texts = iter(self.tokenizer.decode_tgt([h.tokens for sentence in hyps for h in sentence]))
        return [[Translation(next(texts), h.score, h.log_prob, h.tokens) for h in sentence] for sentence in hyps]


def decode_settings(decode: DecodeConfig, **options) -> DecodeConfig:
    """`decode` with options (None = keep) applied and checked; a new beam caps nbest unless nbest is given too."""
    unknown = set(options) - DECODE_OPTIONS
    if unknown:
        raise MtcliError(
            f"unknown decode option(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(DECODE_OPTIONS))}"
        )
    values = {k: v for k, v in options.items() if v is not None}
    if "beam" in values and "nbest" not in values:
        values["nbest"] = min(decode.nbest, values["beam"])
    try:
        return replace(decode, **values)
    except MtcliError as e:
        raise MtcliError(str(e).replace("decode.", "--").replace("_", "-")) from None
