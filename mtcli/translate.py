"""Translating text with a trained model: batching, truncation or splitting of long lines, search, detokenization,
original order.

`Translator` is what `mtcli translate`, `mtcli eval`, validation during training and the Python API all use, so a
score computed while training and one computed afterwards come from the same code:

    from mtcli import Translator
    Translator.from_run("runs/toy").translate(["I love apples"], beam=5)   # ['我喜欢苹果']
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from mtcli.align import Links, attention_word_links
from mtcli.batching import collate, translation_batches
from mtcli.checkpoint import load_model, read_tokenizer, resolve_checkpoint, resolve_member
from mtcli.config import Config, DecodeConfig
from mtcli.config_loader import replaced, with_overrides
from mtcli.constrained import constrained_beam_search
from mtcli.device import allow_tf32, resolve_device
from mtcli.ensemble import Ensemble
from mtcli.errors import MtcliError
from mtcli.glossary import MARKERS, Glossary, load_glossary, soft_marked, words
from mtcli.inference import inference_model, translation_precision
from mtcli.line_io import Source
from mtcli.log import logger, progress_bar
from mtcli.outputs import new_file
from mtcli.search import beam_search, greedy_search, max_output_lengths, sample
from mtcli.segment import join, split_html
from mtcli.tokenizer import Tokenizer, word_separator

DECODE_OPTIONS = {f.name for f in fields(DecodeConfig)}
PUNCTUATION = tuple(",;:.!?)]}…，。；：！？、）")  # a long sentence is best cut right after one of these


@dataclass
class Translation:
    text: str
    score: float  # log-probability (with EOS) divided by the length penalty
    log_prob: float  # log-probability (with EOS)
    tokens: list[int]  # output subword ids, without BOS and EOS
    # with alignments: links (source word, target word) between the words (glossary.words) of the source line and
    # of `text`, read from the model's alignment heads (Translator.align); source_words: the words of the line
    alignment: Links | None = None
    source_words: int = 0


# a character a term of a language without spaces follows in a sentence (Translator.term_ids)
TERM_CONTEXT = "。"

# ---------------------------------------------------------------------------------------------------------------------
# The translator


class Translator:
    def __init__(
        self,
        model,
        tokenizer: Tokenizer,
        config: Config,
        device: torch.device,
        precision: str = "fp32",
        split_long: bool = False,
    ):
        """`model` already in `precision` (see inference_model); from_checkpoint / from_run do that. split_long:
        lines longer than the positions are cut into pieces that fit and their translations joined (`mtcli
        translate --split-long`), instead of truncated with a warning."""
        self.model, self.tokenizer, self.config, self.device = model, tokenizer, config, device
        self.precision = precision
        self.precision_reason = "as set"  # why this precision: what `auto` saw (from_checkpoint), for eval's report
        self.max_src_tokens = config.model.max_positions - 1  # room for EOS
        # A megabyte-long line is cut to far more characters than the positions hold before SentencePiece sees it,
        # so one such line costs no more than a long sentence (the subwords kept are the same in practice).
        self.max_chars = 64 * config.model.max_positions
        self.generator: torch.Generator | None = None
        self.checkpoint: Path | None = None  # where the weights came from, when loaded from a checkpoint
        self.ensemble: list[Path] = []  # the other members' checkpoints, when it translates as an ensemble
        self.split_long = split_long
        # applied as decode.constraints says: a Glossary, or one per line of what it translates next (eval --terms)
        self.glossary: Glossary | list[Glossary] | None = None
        self._term_ids: dict[str, list[int]] = {}
        self._piece_texts: list[str] | None = None  # piece_texts(), made once

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: Path | str,
        device: str = "auto",
        precision: str | None = None,
        ensemble: Iterable[Path | str] = (),
        split_long: bool = False,
    ) -> Translator:
        """precision: auto, fp32, bf16 or int8; default the checkpoint's decode.precision. `ensemble`: more
        checkpoint folders or run directories (their best checkpoint) with the same SentencePiece model(s); their
        next-token probabilities are averaged with this one's (see mtcli.ensemble). The decode settings are this
        checkpoint's."""
        dev = resolve_device(device)
        allow_tf32(dev)  # fp32 translation on a GPU
        model, config, tokenizer = load_model(Path(checkpoint), dev)
        name, why = translation_precision(precision or config.decode.precision, dev)
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
                config = replaced(config, **{"model.max_positions": member_config.model.max_positions})
        translator = cls(Ensemble(members) if len(members) > 1 else model, tokenizer, config, dev, name, split_long)
        translator.checkpoint = Path(checkpoint)
        translator.ensemble = others
        translator.precision_reason = why
        return translator

    @classmethod
    def from_run(
        cls,
        run: Path | str | None = None,
        checkpoint: Path | str | None = None,
        device: str = "auto",
        precision: str | None = None,
        ensemble: Iterable[Path | str] = (),
        split_long: bool = False,
    ) -> Translator:
        """A run's best checkpoint (or `checkpoint`); without either, the latest run under ./runs. The rest as in
        from_checkpoint."""
        return cls.from_checkpoint(resolve_checkpoint(run, checkpoint), device, precision, ensemble, split_long)

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
        self,
        lines: list[str],
        decode: DecodeConfig | None = None,
        progress=False,
        glossary=None,
        alignments: bool = False,
        **options,
    ) -> list[list[Translation]]:
        """decode.nbest translations (best first, with scores) for each line, in order. Empty lines give empty
        outputs; lines longer than the model's positions are truncated, with one warning (split, with split_long).
        `glossary` (a Glossary, or one per line; default the translator's own) is applied as decode.constraints
        says. `alignments`: each translation gets its word alignment (Translation.alignment)."""
        decode = self.decode_config(decode, **options)
        if self.split_long:
            return translate_long_lines(self, lines, decode, progress, glossary, alignments)
        return self.translate_lines(lines, decode, progress, glossary, alignments)

    def translate_lines(
        self, lines: list[str], decode: DecodeConfig, progress=False, glossary=None, alignments: bool = False
    ) -> list[list[Translation]]:
        """translate_nbest without options or splitting: over-long lines are truncated, with one warning."""
        cut = [len(line) > self.max_chars for line in lines]
        lines = [line[: self.max_chars].strip() for line in lines]
        glossary = glossary if glossary is not None else self.glossary
        terms = self.glossary_terms(lines, decode, glossary)
        if glossary is not None and decode.constraints == "soft":
            if alignments:  # the model reads the marked line: its words are not the user's
                raise MtcliError(
                    "alignments with decode.constraints soft: the source the model reads holds marked terms, so its "
                    "words are not the line's; use decode.constraints hard or off"
                )
            lines = self.marked_lines(lines, glossary)
        ids = self.source_ids(lines, decode)
        n_truncated = sum(len(x) > self.max_src_tokens or c for x, c in zip(ids, cut))
        if n_truncated:
            logger.warning(
                f"warning: {n_truncated} input line(s) longer than the model's limit of {self.max_src_tokens} "
                "subwords were truncated"
            )
            ids = [x[: self.max_src_tokens] for x in ids]
        results: list[list[Translation]] = [[Translation("", 0.0, 0.0, [])] if not line else [] for line in lines]
        todo = np.array([i for i, line in enumerate(lines) if line], dtype=np.int64)
        lengths = np.array([len(ids[i]) + 1 for i in todo], dtype=np.int64)  # with EOS
        bar = progress_bar(len(lines), unit="line", enabled=bool(progress))
        bar.update(len(lines) - len(todo))
        for batch in translation_batches(lengths, decode.batch_tokens, decode.batch_sentences):
            batch = todo[batch]
            batch_terms = [terms[i] for i in batch] if terms else None
            found = self._search(
                [ids[i] for i in batch], decode, batch_terms, [lines[i] for i in batch] if alignments else None
            )
            for i, hyps in zip(batch, found):
                results[i] = hyps
            bar.update(len(batch))
        bar.close()
        return results

    @property
    def guided_alignment(self) -> bool:
        """Whether the model was trained to align (train.guided_alignment): else alignments come from the averaged
        heads of model.alignment_layer, a rougher guide."""
        return self.config.train.guided_alignment > 0

    def note_alignment_source(self) -> None:
        """Say where alignments come from when the model was not trained to align."""
        if not self.guided_alignment:
            layer = self.config.model.alignment_layer_index
            logger.warning(
                "note: this model was trained without train.guided_alignment: its alignments come from the averaged "
                f"cross-attention heads of decoder layer {layer}, which align words less reliably"
            )

    @torch.inference_mode()
    def align(
        self, src_ids: list[list[int]], lines: list[str], hyps: list[list[Translation]], decode, memory=None
    ) -> None:
        """Set each translation's word alignment: the decoder reads the source and the translation once more (as
        training does, up to model.alignment_layer only), and a target piece is linked to a source piece where each
        is the other's most attended (EOS aside); links between pieces become links between the words they spell
        (align.attention_word_links). The heads: Config.alignment_heads. `memory`: the search's encoder output for
        src_ids, in their order (else the source is encoded again)."""
        model = self.model.members[0] if isinstance(self.model, Ensemble) else self.model
        flat = [(i, h) for i, sentence in enumerate(hyps) for h in sentence]
        if not flat:
            return
        batch = collate([src_ids[i] for i, _ in flat], [h.tokens for _, h in flat], specials=model.specials)
        batch = batch.to(self.device)
        if memory is None:
            memory = model.encode(batch.src, batch.src_pad_mask)
        else:  # one row per translation (n-best lists repeat their sentence), the first member's part of an ensemble's
            rows = torch.tensor([i for i, _ in flat], device=memory.device)
            memory = memory[..., : model.cfg.d_model].index_select(0, rows)[:, : batch.src.shape[1]]
        heads = self.config.alignment_heads
        weights = model.decode_aligned(batch.tgt_in, memory, batch.src_pad_mask, None, heads, True)[1]
        weights = weights.float().cpu().numpy()
        prefix, tgt_lang = self.config.source_prefix(decode), self.config.data.tgt_lang
        for row, (i, h) in enumerate(flat):
            h.source_words = len(words(lines[i]))
            # the rows that write the output's pieces, the columns of the source's pieces (EOS and padding aside)
            attention = weights[row, : len(h.tokens), : len(src_ids[i])]
            src_pieces, tgt_pieces = self.tokenizer.src_pieces(src_ids[i]), self.tokenizer.tgt_pieces(h.tokens)
            h.alignment = attention_word_links(attention, src_pieces, lines[i], prefix, tgt_pieces, h.text, tgt_lang)

    def source_ids(self, lines: list[str], decode: DecodeConfig | None = None) -> list[list[int]]:
        """Source subword ids of each line, after the source prefix (decode.src_prefix, else data.src_prefix: the
        target-language token of a multilingual model such as `>>deu<<`)."""
        return self.tokenizer.encode_src(lines, self.config.source_prefix(decode))

    def glossary_terms(self, lines: list[str], decode: DecodeConfig, glossary) -> list[list[list[int]]] | None:
        """The target terms each line's translation must hold (decode.constraints hard), as target subword ids: those
        of the glossary's matches in the line; None without a glossary or with constraints off. `glossary`: a
        Glossary, one per line, or None."""
        if glossary is None or decode.constraints != "hard":
            return None
        per_line = glossary if isinstance(glossary, list) else [glossary] * len(lines)
        found = [g.matches(line) if g is not None else [] for g, line in zip(per_line, lines)]
        if decode.sampling and any(found):
            raise MtcliError(
                "a glossary's terms are written by beam search (decode.constraints hard), not by sampling: drop "
                "--sampling, or set decode.constraints=soft (a model trained with data.terminology) or off"
            )
        return [[self.term_ids(m.target) for m in matches] for matches in found]

    def marked_lines(self, lines: list[str], glossary) -> list[str]:
        """decode.constraints soft: each line with its glossary terms marked (glossary.soft_marked), which a model
        trained with data.terminology learnt to copy. `glossary`: a Glossary or one per line."""
        self.check_soft()
        per_line = glossary if isinstance(glossary, list) else [glossary] * len(lines)
        return [soft_marked(line, g.matches(line)) if g is not None else line for g, line in zip(per_line, lines)]

    def piece_texts(self) -> list[str] | None:
        """Each target id's text, where the target language is written without spaces (constrained search then
        counts a term as written wherever the text holds it); None elsewhere."""
        if word_separator(self.config.data.tgt_lang):
            return None
        if self._piece_texts is None:
            pieces = self.tokenizer.tgt_pieces(list(range(self.tokenizer.tgt_vocab_size)))
            specials = self.tokenizer.specials
            skip = {specials.pad, specials.bos, specials.eos, specials.unk}
            self._piece_texts = ["" if i in skip else p.replace("▁", "") for i, p in enumerate(pieces)]
        return self._piece_texts

    def check_soft(self) -> None:
        """Refuse soft constraints for a model that was not trained to read marked terms."""
        if not self.tokenizer.has_source_symbols(MARKERS):
            raise MtcliError(
                "decode.constraints soft needs a model trained with data.terminology (its vocabulary has no "
                f"{', '.join(MARKERS)} pieces); use decode.constraints=hard, which works with any model"
            )

    def term_ids(self, term: str) -> list[int]:
        """A target term as the target subwords the model writes for it inside a sentence: after a space (a word start)
        where the target language writes spaces, after other text where it does not (Chinese, Japanese: no word-start
        piece), found by encoding the term behind a context character and dropping that character's pieces."""
        if term not in self._term_ids:
            if word_separator(self.config.data.tgt_lang):
                ids = self.tokenizer.encode_tgt([term])[0]
            else:
                ids = self.tokenizer.encode_tgt([TERM_CONTEXT + term])[0]
                pieces, seen = self.tokenizer.tgt_pieces(ids), ""
                for n, piece in enumerate(pieces):
                    seen += piece.replace("▁", "")
                    if seen == TERM_CONTEXT:
                        ids = ids[n + 1 :]
                        break
                else:  # the context merged with the term's first piece: the term as it encodes alone
                    ids = self.tokenizer.encode_tgt([term])[0]
            if self.tokenizer.specials.unk in ids:
                logger.warning(
                    f"warning: the target term {term[:50]!r} holds characters the model's vocabulary lacks; it is "
                    "written with unknown-piece markers where they are"
                )
            self._term_ids[term] = ids
        return self._term_ids[term]

    def check_terms(self, glossary: Glossary) -> None:
        """Refuse a glossary whose target term is longer than any output can be (the model's positions). Only terms
        with more characters than the positions are encoded: a term has at most one subword per character, plus one."""
        limit = self.config.model.max_positions - 1
        for key, target in glossary.terms.items():
            if len(target) + 1 > limit and (pieces := len(self.term_ids(target))) > limit:
                raise MtcliError(
                    f"{glossary.origins.get(key) or 'glossary'}: the target term is {pieces} subwords; no "
                    f"translation of this model is longer than {limit}"
                )

    def _search(
        self,
        src_ids: list[list[int]],
        decode: DecodeConfig,
        terms: list[list[list[int]]] | None = None,
        lines: list[str] | None = None,
    ) -> list[list[Translation]]:
        """The n-best lists of one model batch; with `lines` (the sources' text), their word alignments too."""
        batch = collate(src_ids, specials=self.model.specials).to(self.device)
        lengths = torch.tensor([len(x) for x in src_ids])
        max_lens = max_output_lengths(lengths, decode.max_len_a, decode.max_len_b, self.config.model.max_positions)
        with torch.inference_mode():  # once for the search and the alignments
            memory = self.model.encode(batch.src, batch.src_pad_mask)
        args = (self.model, batch.src, batch.src_pad_mask, max_lens.to(self.device))
        d = decode
        beam_args = (d.beam, d.lenpen, d.min_len, d.nbest, d.no_repeat_ngram, d.length_norm, d.early_stopping)
        if terms is not None and any(terms):
            hyps = constrained_beam_search(*args, terms, *beam_args, self.piece_texts(), memory=memory)
        elif decode.sampling:
            if self.generator is None:  # one stream for the whole session: a line's sample must not depend on batching
                self.generator = torch.Generator(device=self.device).manual_seed(self.config.train.seed)
            found = sample(*args, d.temperature, d.top_k, d.top_p, d.min_len, self.generator, memory=memory)
            hyps = [[h] for h in found]
        elif decode.beam == 1 and not decode.no_repeat_ngram:  # beam 1 is greedy; the n-gram ban lives in beam search
            hyps = [[h] for h in greedy_search(*args, decode.min_len, memory=memory)]
        else:
            hyps = beam_search(*args, *beam_args, memory=memory)
        texts = iter(self.tokenizer.decode_tgt([h.tokens for sentence in hyps for h in sentence]))
        found = [[Translation(next(texts), h.score, h.log_prob, h.tokens) for h in sentence] for sentence in hyps]
        if lines is not None:
            self.align(src_ids, lines, found, decode, memory)
        return found


# ---------------------------------------------------------------------------------------------------------------------
# Sentences longer than the model's positions: cut where a sentence is best cut, translated, joined back


def split_long(tokenizer, line: str, limit: int) -> list[str]:
    """`line` as pieces of at most `limit` source subwords (the line itself when it fits). Each cut is at the last
    word start in the second half of the window, right after punctuation where there is one; where neither is
    (a long unspaced run), at the window's end."""
    pieces = tokenizer.src.encode(line, out_type=str)
    if len(pieces) <= limit:
        return [line]
    size = max(limit - 4, 2)  # margin: a piece re-encoded on its own may gain a subword at its start
    chunks, start = [], 0
    while len(pieces) - start > size:
        window = range(start + size, start + size // 2, -1)  # candidate cut positions, latest first
        after_punct = [c for c in window if pieces[c - 1].endswith(PUNCTUATION)]
        word_start = [c for c in window if pieces[c].startswith("▁")]
        cut = (after_punct or word_start or [start + size])[0]
        chunks.append(pieces[start:cut])
        start = cut
    chunks.append(pieces[start:])
    return [tokenizer.src.decode_pieces(chunk).strip() for chunk in chunks]


def combine_nbest(hyp_lists: list[list], join_texts: Callable[[list[str]], str]):
    """One n-best list for a text from its pieces' n-best lists: alternative i joins each piece's i-th hypothesis
    (its last where it has fewer); scores and log-probabilities add up, as for one long output, and alignments
    join with each piece's words counted after those of the pieces before it."""
    n = max((len(hyps) for hyps in hyp_lists), default=1)
    combined = []
    for i in range(n):
        picked = [hyps[min(i, len(hyps) - 1)] for hyps in hyp_lists]
        tokens = [t for h in picked for t in h.tokens]
        score, log_prob = sum(h.score for h in picked), sum(h.log_prob for h in picked)
        joined = Translation(join_texts([h.text for h in picked]), score, log_prob, tokens)
        if len(picked) == 1:
            joined.alignment, joined.source_words = picked[0].alignment, picked[0].source_words
        elif picked and all(h.alignment is not None for h in picked):
            joined.alignment, src_shift, tgt_shift = [], 0, 0
            for h in picked:
                joined.alignment += [(a + src_shift, b + tgt_shift) for a, b in h.alignment]
                src_shift, tgt_shift = src_shift + h.source_words, tgt_shift + len(words(h.text))
            joined.source_words = src_shift
        combined.append(joined)
    return combined


def translate_long_lines(translator, lines: list[str], decode, progress=False, glossary=None, alignments=False) -> list:
    """Translator.translate_nbest with split_long: lines over the positions are cut (split_long), all pieces
    translated as one list, and each line's translations joined with a space (nothing for Chinese or Japanese)."""
    cut = [split_long(translator.tokenizer, line, translator.max_src_tokens) for line in lines]
    if isinstance(glossary, list):  # one per line: each piece takes its line's
        glossary = [g for g, pieces in zip(glossary, cut) for _ in pieces]
    pieces = [p for pieces in cut for p in pieces]
    hyps = iter(translator.translate_lines(pieces, decode, progress, glossary, alignments))
    sep = word_separator(translator.config.data.tgt_lang)
    return [combine_nbest([next(hyps) for _ in pieces], sep.join) for pieces in cut]


def translate_html(
    translator: Translator, documents: list[str], decode: DecodeConfig, by_links: bool | None = None
) -> list[str]:
    """HTML documents (or fragments) translated, their sentences in one batch: markup outside sentences (DOCTYPE,
    comments, CDATA, scripts, styles, block tags) kept as it is, each sentence translated whole, and its inline
    elements put back around the words aligned to their own (`by_links`; default: for a model trained with guided
    alignment), else around the words that translate their own text (segment.place_marks)."""
    by_links = translator.guided_alignment if by_links is None else by_links
    src_lang, tgt_lang = translator.config.data.src_lang, translator.config.data.tgt_lang
    segments = [split_html(document, src_lang) for document in documents]
    marks = [[] if by_links else s.mark_texts() for s in segments]
    sentences = [text for s, m in zip(segments, marks) for text in [*s.pieces, *m]]
    best = iter([h[0] for h in translator.translate_nbest(sentences, decode, alignments=by_links)])
    out = []
    for s, m in zip(segments, marks):
        pieces = [next(best) for _ in s.pieces]
        mark_translations = [next(best).text for _ in m]
        links = [h.alignment for h in pieces] if by_links else None
        out.append(join(s, [h.text for h in pieces], tgt_lang, mark_translations, links))
    return out


MAX_HTML_CHARS = 1 << 24  # one HTML document is read and translated whole


def translate_html_source(
    translator, decode: DecodeConfig, source: Source, input_file: Path | None, output_file: Path | None, force: bool
):
    """`mtcli translate --html`: each sentence given, or the whole of --input or stdin, as one HTML document
    (translate.translate_html), to stdout or whole to `output_file`."""
    if source.sentences is not None:
        documents, ends = source.sentences, "\n"
    elif input_file is not None:  # as it is, line ends and all (open_source checked it is UTF-8)
        with open(input_file, encoding="utf-8", newline="") as f:
            documents, ends = [f.read().removeprefix("\ufeff")], ""
    else:
        documents, ends = [sys.stdin.read(MAX_HTML_CHARS + 1)], ""
    for document in documents:
        if len(document) > MAX_HTML_CHARS:
            raise MtcliError(f"--html: a document of over {MAX_HTML_CHARS:,} characters; cut it into smaller documents")
    translated = [d + ends for d in translate_html(translator, documents, decode)]
    if output_file is None:
        sys.stdout.writelines(translated)
        return
    with new_file(output_file, force) as out:
        out.writelines(translated)


def load_translator(
    checkpoint: Path,
    config: Config,
    overrides: list[str] | tuple[str, ...] = (),
    device: str = "auto",
    ensemble: Iterable[Path | str] = (),
    split_long: bool = False,
    glossary: Path | None = None,
    **options,
) -> tuple[Translator, DecodeConfig]:
    """What `translate`, `eval` and `serve` do before translating: `config` (the checkpoint's own, or eval's with a
    run's data) with `--set decode.KEY=VALUE` overrides, the decode settings with the command line's options (None
    = keep), and the Translator in the precision they name, with `--glossary` (read before the model loads).
    Returns the translator and its decode settings."""
    decode = decode_settings(with_overrides(config, overrides, ("decode",)).decode, **options)
    terms = load_glossary(glossary) if glossary is not None else None
    translator = Translator.from_checkpoint(checkpoint, device, decode.precision, ensemble, split_long)
    if terms is not None:
        translator.check_terms(terms)
        if decode.constraints == "soft":  # before the first line, not at it
            translator.check_soft()
    translator.glossary = terms
    return translator, translator.decode_config(decode)


def decode_settings(decode: DecodeConfig, **options) -> DecodeConfig:
    """`decode` with options (None = keep) applied and checked; a new beam caps nbest unless nbest is given too."""
    unknown = set(options) - DECODE_OPTIONS
    if unknown:
        raise MtcliError(
            f"unknown decode option(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(DECODE_OPTIONS))}"
        )
    try:
        return decode.with_options(**{k: v for k, v in options.items() if v is not None})
    except MtcliError as e:
        raise MtcliError(str(e).replace("decode.", "--").replace("_", "-")) from None
