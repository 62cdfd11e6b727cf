"""Translating text with a trained model: batching, truncation, search, detokenization, original order.

`Translator` is what `mtcli translate`, `mtcli eval` and validation during training all use, so a score computed
while training and one computed afterwards come from the same code.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mtcli.checkpoint import best_checkpoint, last_checkpoint, load_model
from mtcli.config import Config, DecodeConfig
from mtcli.device import keep_freed_memory, resolve_device
from mtcli.errors import MtcliError
from mtcli.search import beam_search, greedy_search, max_output_lengths, sample
from mtcli.tokenizer import EOS, PAD, Tokenizer


@dataclass
class Translation:
    text: str
    score: float
    tokens: list[int]


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


def resolve_checkpoint(run: Path | None = None, checkpoint: Path | None = None) -> Path:
    """--checkpoint as given; else the best (or, before any validation, the newest) checkpoint of --run or the
    latest run."""
    if checkpoint is not None:
        return Path(checkpoint)
    run = Path(run) if run is not None else find_run()
    if not run.is_dir():
        raise MtcliError(f"--run {run}: no such run directory")
    ckpt = best_checkpoint(run) or last_checkpoint(run)
    if ckpt is None:
        raise MtcliError(f"run {run} has no checkpoint yet; train it first (mtcli train ... --run-dir {run})")
    return ckpt


class Translator:
    def __init__(
        self,
        model,
        tokenizer: Tokenizer,
        config: Config,
        device: torch.device,
        warn: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
    ):
        self.model, self.tokenizer, self.config, self.device = model, tokenizer, config, device
        self.warn = warn
        self.max_src_tokens = config.model.max_positions - 1  # room for EOS
        self.generator: torch.Generator | None = None

    @classmethod
    def load(cls, checkpoint: Path, device: str = "auto", **kwargs) -> Translator:
        dev = resolve_device(device)
        if dev.type == "cpu":
            keep_freed_memory()
        model, config, tokenizer = load_model(checkpoint, dev)
        return cls(model, tokenizer, config, dev, **kwargs)

    def translate(
        self, lines: list[str], decode: DecodeConfig | None = None, progress: Callable[[int], None] | None = None
    ) -> list[list[Translation]]:
        """n-best translations (best first) for each line, in the order given. Empty lines give empty outputs."""
        decode = decode or self.config.decode
        lines = [line.strip() for line in lines]
        ids = self.tokenizer.encode_src(lines)
        n_truncated = sum(len(x) > self.max_src_tokens for x in ids)
        if n_truncated:
            self.warn(
                f"warning: {n_truncated} input line(s) longer than the model's limit of {self.max_src_tokens} "
                "subwords were truncated"
            )
            ids = [x[: self.max_src_tokens] for x in ids]
        results: list[list[Translation] | None] = [None] * len(lines)
        for i, line in enumerate(lines):
            if not line:
                results[i] = [Translation("", 0.0, [])]
        order = sorted((i for i in range(len(lines)) if results[i] is None), key=lambda i: -len(ids[i]))
        if progress and len(order) < len(lines):
            progress(len(lines) - len(order))
        for batch in _token_batches(order, ids, decode.batch_tokens, decode.batch_sentences):
            for i, hyps in zip(batch, self._search([ids[i] for i in batch], decode)):
                results[i] = hyps
            if progress:
                progress(len(batch))
        return results  # type: ignore[return-value]

    def translate_best(self, lines: list[str], decode: DecodeConfig | None = None, progress=None) -> list[str]:
        return [hyps[0].text for hyps in self.translate(lines, decode, progress)]

    def _search(self, src_ids: list[list[int]], decode: DecodeConfig) -> list[list[Translation]]:
        lengths = torch.tensor([len(x) for x in src_ids])
        src = torch.full((len(src_ids), int(lengths.max()) + 1), PAD, dtype=torch.long)
        for row, x in enumerate(src_ids):
            src[row, : len(x)] = torch.tensor(x, dtype=torch.long)
            src[row, len(x)] = EOS
        src = src.to(self.device)
        src_pad_mask = src == PAD
        max_lens = max_output_lengths(lengths, decode.max_len_a, decode.max_len_b, self.config.model.max_positions).to(
            self.device
        )
        model = self.model
        if decode.sampling:
            if self.generator is None:  # one stream for the whole session: a line's sample must not depend on batching
                self.generator = torch.Generator(device=self.device).manual_seed(self.config.train.seed)
            generator = self.generator
            hyps = [
                [h]
                for h in sample(
                    model,
                    src,
                    src_pad_mask,
                    max_lens,
                    decode.temperature,
                    decode.top_k,
                    decode.top_p,
                    decode.min_len,
                    generator,
                )
            ]
        elif decode.beam == 1 and not decode.no_repeat_ngram:  # beam 1 is greedy; the n-gram ban lives in beam search
            hyps = [[h] for h in greedy_search(model, src, src_pad_mask, max_lens, decode.min_len)]
        else:
            hyps = beam_search(
                model,
                src,
                src_pad_mask,
                max_lens,
                decode.beam,
                decode.lenpen,
                decode.min_len,
                decode.nbest,
                decode.no_repeat_ngram,
            )
        texts = self.tokenizer.decode_tgt([h.tokens for sentence in hyps for h in sentence])
        out, pos = [], 0
        for sentence in hyps:
            out.append([Translation(texts[pos + j], h.score, h.tokens) for j, h in enumerate(sentence)])
            pos += len(sentence)
        return out


def _token_batches(
    order: list[int], ids: list[list[int]], batch_tokens: int, batch_sentences: int = 0
) -> list[list[int]]:
    """Consecutive runs of `order` (sorted longest first) with sentences x longest (with EOS) <= batch_tokens and at
    most batch_sentences sentences (when set)."""
    batches, current, longest = [], [], 0
    for i in order:
        length = len(ids[i]) + 1
        full = batch_sentences and len(current) == batch_sentences
        if current and (full or (len(current) + 1) * max(longest, length) > batch_tokens):
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        batches.append(current)
    return batches


def decode_settings(config: Config, **overrides) -> DecodeConfig:
    """The run's decode section with command-line values (None = keep) applied and checked."""
    values = {k: v for k, v in overrides.items() if v is not None}
    if "beam" in values and "nbest" not in values:
        values["nbest"] = min(config.decode.nbest, values["beam"])
    try:
        return replace(config.decode, **values)
    except MtcliError as e:
        raise MtcliError(str(e).replace("decode.", "--").replace("_", "-")) from None
