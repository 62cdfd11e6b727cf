"""Parity reports: does an exported (or imported) model translate as mtcli does?

Every `mtcli export` and `mtcli import` translates a probe set twice, with mtcli and with the other engine
(CTranslate2, Transformers' `generate`), greedy and beam, at the decode settings the engine can express, and compares
line by line: identical lines, BLEU of the engine's output against mtcli's, reference BLEU and chrF of both, empty and
repeating outputs, length. Converters that silently change a model are a known failure (CTranslate2#1781, #847);
this report is what catches them. Thresholds depend on the engine's precision (float32: the same lines; int8 and
other reduced precisions: the same quality), and an export past them is refused unless `--no-check`.

Settings an engine cannot express (mtcli's length limit a * source + b, GNMT length normalization, and in
CTranslate2 the patient beam stopping rule) are replaced on mtcli's side by what the engine does, and listed, so the
comparison isolates the conversion; where the run's own beam search differs, one more row says by how much.

The report records the size and sha256 of every file of the export it describes (`files`), so `mtcli verify`
can tell later whether the folder (or .argosmodel package) is still the one that was checked.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import time
import warnings
import zipfile
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import BinaryIO

import numpy as np

from mtcli.align import Links, attention_word_links
from mtcli.config import DecodeConfig
from mtcli.data import eval_texts
from mtcli.errors import MtcliError, error_text
from mtcli.glossary import MARKERS, expected_terms, load_glossary, soft_marked, term_accuracy
from mtcli.line_io import read_lines
from mtcli.log import counted, format_duration, logger
from mtcli.outputs import MANIFEST, files_under
from mtcli.scoring import score
from mtcli.tokenizer import Tokenizer

PROBE_LINES = 500  # lines of the valid split in a probe: enough to see a 1% difference, seconds to translate
REPEAT_TIMES = 4  # an output "repeats" when some 1-4 subword n-gram occurs this many times in a row
FLOAT32 = "float32"  # the engine precision held to line identity; the others to equal quality
REPORT = "parity.json"


@dataclass
class Probe:
    sources: list[str]
    references: list[str]  # for the first len(references) sources (the rest are stress lines)
    origin: str  # where the lines came from, for the report


@dataclass(frozen=True)
class EngineSettings:
    """A search as an engine takes it: what CTranslate2's translate_batch and Transformers' generate share."""

    beam: int
    lenpen: float  # power: log-probability / length ** lenpen (length with EOS)
    early_stopping: bool  # a sentence's search ends at `beam` finished hypotheses
    min_len: int
    max_len: int  # a fixed limit in output subwords (neither engine has mtcli's a * source + b)
    no_repeat_ngram: int


@dataclass
class Row:
    mode: str  # "greedy", "beam 5", "beam 5, run's search"
    lines: int
    identical: int
    bleu_vs_mtcli: float
    empty: tuple[int, int]  # (mtcli, engine)
    repeating: tuple[int, int]
    length_ratio: float  # engine characters / mtcli characters
    bleu: tuple[float, float] | None = None  # reference BLEU (mtcli, engine), on the lines that have references
    chrf: tuple[float, float] | None = None
    checked: bool = True  # held to the thresholds (rows at the run's own search are information)
    examples: list[dict] = field(default_factory=list)  # a few differing lines

    @property
    def identical_rate(self) -> float:
        return self.identical / max(self.lines, 1)


# ---------------------------------------------------------------------------------------------------------------------
# The probe set


def probe_set(config, tokenizer: Tokenizer, probe: Path | None, probe_ref: Path | None, limit: int) -> Probe:
    """--probe FILE (and --probe-ref FILE), else the run's valid split (its first `limit` lines), then the stress
    lines. A run whose data is not here (or an imported model) is probed with the stress lines alone, said so."""
    references: list[str] = []
    if probe is not None:
        sources = read_lines(probe)[:limit]
        if probe_ref is not None:
            references = read_lines(probe_ref)[:limit]
            if len(references) != len(sources):
                raise MtcliError(f"--probe-ref {probe_ref}: {len(references)} lines for {len(sources)} in --probe")
        origin = f"{probe} ({len(sources)} lines)"
    else:
        try:
            sources, references = (x[:limit] for x in eval_texts(config, "valid"))
            origin = f"the valid split ({len(sources)} lines)"
        except MtcliError as e:  # no data here: the stress lines still test the conversion
            sources, references = [], []
            imported = not (config.data.dataset or config.data.path)
            origin = "no valid split (an imported model)" if imported else f"no valid split ({error_text(e, 120)})"
    keep = [i for i, s in enumerate(sources) if s.strip()]
    sources = [sources[i] for i in keep]
    references = [references[i] for i in keep] if references else []
    stress = stress_lines(tokenizer, config.model.max_positions, config.source_prefix())
    return Probe(sources + stress, references, f"{origin} + {len(stress)} stress lines")


def stress_lines(tokenizer: Tokenizer, max_positions: int, prefix: str = "") -> list[str]:
    """Lines that break converted models where ordinary sentences do not: one word, a repeated word, numbers, all
    capitals, a URL, a line of frequent words, and one just inside the position limit. Built from the source
    vocabulary's most frequent whole words, so they suit any language."""
    spm = tokenizer.src
    words = []
    for i in range(spm.get_piece_size()):
        piece = spm.id_to_piece(i)
        if piece.startswith("\u2581") and len(piece) > 3 and piece[1:].isalpha() and not spm.is_control(i):
            words.append(piece[1:])
        if len(words) == 40:
            break
    words = words or ["a"]
    line = " ".join(words[:10])
    long_words = " ".join(words[i % len(words)] for i in range(2 * max_positions))
    budget = max_positions - 8 - len(tokenizer.encode_src([""], prefix)[0])  # room for EOS, prefix and a margin
    long_line = spm.decode_pieces(spm.encode(long_words, out_type=str)[: max(budget, 1)]).strip()
    return [
        words[0],
        " ".join([words[1 % len(words)]] * 8),
        "1 2 3 10 42 99.5 1999 2026 1,000,000",
        line.upper(),
        f"https://www.example.com/{words[2 % len(words)]}/index.html?id=42",
        line,
        long_line,
    ]


# ---------------------------------------------------------------------------------------------------------------------
# What the engine can express


def engine_settings(decode: DecodeConfig, target: str, max_positions: int) -> tuple[EngineSettings, list[str]]:
    """The search an export to `target` (ctranslate2, whose Argos package runs it too, or hf) runs for a run's
    decode settings, and what it cannot express (one line each)."""
    notes = []
    beam = decode.beam if decode.beam > 1 else 4  # a greedy run is still checked at a beam
    max_len = max_positions - 1
    notes.append(
        f"decode.max_len_a/max_len_b ({decode.max_len_a:g} x source + {decode.max_len_b}): a fixed limit of "
        f"{max_len} subwords (engines have no per-sentence limit)"
    )
    if decode.length_norm == "gnmt" and decode.lenpen > 0:
        notes.append(
            f"decode.length_norm gnmt: divided by length ** {decode.lenpen:g} instead of ((5 + length) / 6) ** "
            f"{decode.lenpen:g} (set decode.length_norm: power for a run that beams as its exports)"
        )
    early_stopping = decode.early_stopping
    if target == "ctranslate2" and not early_stopping and decode.lenpen > 0:
        notes.append(
            "decode.early_stopping false: CTranslate2 ends a sentence's search at `beam` finished hypotheses "
            "(set decode.early_stopping: true for a run that beams as its exports)"
        )
        early_stopping = True
    if decode.sampling:
        notes.append("decode.sampling: the report compares searches (greedy and beam), not samples")
    settings = EngineSettings(beam, decode.lenpen, early_stopping, decode.min_len, max_len, decode.no_repeat_ngram)
    return settings, notes


def mtcli_decode(decode: DecodeConfig, settings: EngineSettings, beam: int) -> DecodeConfig:
    """mtcli's decode settings for the search the engine runs (beam 1: greedy)."""
    return replace(
        decode,
        beam=beam,
        nbest=1,
        lenpen=settings.lenpen,
        length_norm="power",
        early_stopping=settings.early_stopping,
        min_len=settings.min_len,
        max_len_a=0.0,
        max_len_b=settings.max_len,
        no_repeat_ngram=settings.no_repeat_ngram,
        sampling=False,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Engines


class CTranslate2Engine:
    """A CTranslate2 model folder with its SentencePiece model(s), as `mtcli export --format ctranslate2` writes, on
    the CPU: its own quantization, `threads` threads (default: every core)."""

    def __init__(self, folder: Path, prefix: str = "", max_src_tokens: int = 1023, threads: int | None = None):
        import ctranslate2

        self.tokenizer = Tokenizer.from_folder(folder)
        threads = threads or os.cpu_count() or 1
        self.translator = ctranslate2.Translator(str(folder), device="cpu", intra_threads=threads)
        self.prefix, self.max_src_tokens = prefix, max_src_tokens
        pieces = self.tokenizer.tgt_pieces(range(self.tokenizer.tgt_vocab_size))
        self.id_of = {p: i for i, p in enumerate(pieces)}
        meta = folder / "mtcli.json"  # the export's languages: alignments read as mtcli reads them for the target
        self.tgt_lang = json.loads(meta.read_text(encoding="utf-8")).get("tgt_lang", "") if meta.is_file() else ""

    def translate(self, lines: list[str], s: EngineSettings, beam: int) -> list[str]:
        """Each line after the source prefix, cut at max_src_tokens, translated; an empty line gives an empty
        translation without being decoded, as mtcli gives it."""
        return [text for text, _ in self.translate_aligned(lines, s, beam, alignments=False)]

    def translate_aligned(
        self, lines: list[str], s: EngineSettings, beam: int, alignments: bool = True
    ) -> list[tuple[str, Links | None]]:
        """translate, with each translation's word links read from the attention CTranslate2 returns (the heads
        the export declares, Config.alignment_heads), as Translator.align reads mtcli's (align.attention_links)."""
        out: list[tuple[str, Links | None]] = [("", [] if alignments else None)] * len(lines)
        todo = [i for i, line in enumerate(lines) if line.strip()]
        if not todo:
            return out
        ids = [x[: self.max_src_tokens] for x in self.tokenizer.encode_src([lines[i] for i in todo], self.prefix)]
        found = self.translator.translate_batch(
            [self.tokenizer.src_pieces(x) for x in ids],
            max_batch_size=64,
            beam_size=beam,
            length_penalty=s.lenpen if beam > 1 else 0.0,
            min_decoding_length=s.min_len,
            max_decoding_length=s.max_len,
            no_repeat_ngram_size=s.no_repeat_ngram,
            return_attention=alignments,
        )
        tokens = [[self.id_of[p] for p in r.hypotheses[0]] for r in found]
        texts = self.tokenizer.decode_tgt(tokens)
        for i, src_ids, output, text, result in zip(todo, ids, tokens, texts, found):
            links = None
            if alignments:
                attention = np.asarray(result.attention[0], dtype=np.float32).reshape(len(output), -1)
                links = attention_word_links(
                    attention[:, : len(src_ids)],  # the source's EOS aside
                    self.tokenizer.src_pieces(src_ids),
                    lines[i],
                    self.prefix,
                    self.tokenizer.tgt_pieces(output),
                    text,
                    self.tgt_lang,
                )
            out[i] = (text, links)
        return out


class TransformersEngine:
    """A Transformers model folder (an `mtcli export --format hf`, or the MarianMT model an import read)."""

    def __init__(self, folder: Path, prefix: str = ""):
        import torch
        import transformers

        self.torch = torch
        with quiet_transformers(transformers):
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
            self.model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(folder)).eval()
        self.prefix = prefix

    def translate(self, lines: list[str], s: EngineSettings, beam: int) -> list[str]:
        lines = [f"{self.prefix} {line}" for line in lines] if self.prefix else lines
        order = sorted(range(len(lines)), key=lambda i: len(lines[i]))  # similar lengths share a batch
        out = [""] * len(lines)
        for start in range(0, len(order), 32):
            batch = [order[i] for i in range(start, min(start + 32, len(order)))]
            inputs = self.tokenizer([lines[i] for i in batch], return_tensors="pt", padding=True, truncation=True)
            # every setting given: the folder's generation_config.json holds the run's own, which may differ. At
            # beam 1 the beam-only settings get their neutral values (any other one draws a warning per call), and
            # the limit is max_length (decoder start + s.max_len): max_new_tokens beside the config's max_length
            # draws another
            options = dict(num_beams=beam, length_penalty=s.lenpen, early_stopping=s.early_stopping)
            if beam == 1:
                options = dict(num_beams=1, length_penalty=1.0, early_stopping=False)
            with self.torch.inference_mode():
                generated = self.model.generate(
                    **inputs,
                    do_sample=False,
                    max_length=s.max_len + 1,
                    min_new_tokens=s.min_len,
                    no_repeat_ngram_size=s.no_repeat_ngram,
                    **options,
                )
            for i, text in zip(batch, self.tokenizer.batch_decode(generated, skip_special_tokens=True)):
                out[i] = text.strip()
        return out


# ---------------------------------------------------------------------------------------------------------------------
# The report


def parity_report(translator, engine, target: str, precision: str, probe: Probe, glossary=None) -> dict:
    """Translate `probe` with `translator` (mtcli, float32) and `engine` at the settings the engine can express;
    return the report (what parity.json holds). With a glossary (a model trained with data.terminology), one more
    pass compares the two on the probe lines that hold a term, marked (glossary_probe)."""
    decode = translator.config.decode
    settings, notes = engine_settings(decode, target, translator.config.model.max_positions)
    tgt_lang = translator.config.data.tgt_lang
    differs = decode.length_norm != "power" or decode.early_stopping != settings.early_stopping
    own_search = decode.lenpen > 0 and differs  # what a user of the export sees against `mtcli translate`
    passes = 4 + own_search + 2 * (glossary is not None)
    searches = f"greedy and beam {settings.beam}" + (", and the run's own search" if own_search else "")
    logger.info(f"parity: translating {counted(len(probe.sources), 'probe line')} {passes} times ({searches})")
    timed = _PassTimer(passes, len(probe.sources))
    rows = []
    alignments = None
    for beam in (1, settings.beam):
        mode = "greedy" if beam == 1 else f"beam {beam}"
        if beam == 1 and hasattr(engine, "translate_aligned"):  # the greedy pass compares word alignments too
            found = timed(
                f"mtcli {mode}", aligned_translations, translator, probe.sources, mtcli_decode(decode, settings, 1)
            )
            pairs = timed(f"{target} {mode}", engine.translate_aligned, probe.sources, settings, 1)
            ours, theirs = [t for t, _ in found], [t for t, _ in pairs]
            alignments = compare_alignments(found, pairs, translator)
        else:
            ours = timed(f"mtcli {mode}", translator.translate, probe.sources, mtcli_decode(decode, settings, beam))
            theirs = timed(f"{target} {mode}", engine.translate, probe.sources, settings, beam)
        rows.append(compare(mode, ours, theirs, probe, tgt_lang, translator.tokenizer))
        if beam > 1 and own_search:
            own_decode = replace(decode, beam=beam, nbest=1, sampling=False)
            own = timed(f"mtcli {mode}, run's search", translator.translate, probe.sources, own_decode)
            rows.append(compare(f"{mode}, run's search", own, theirs, probe, tgt_lang, translator.tokenizer, False))
    report = {
        "engine": target,
        "precision": precision,
        "mtcli_precision": translator.precision,
        "probe": probe.origin,
        "lines": len(probe.sources),
        "settings": asdict(settings),
        "not_expressible": notes,
        "thresholds": thresholds(precision),
        "rows": [asdict(r) | {"identical_rate": r.identical_rate} for r in rows],
    }
    report["failures"] = failures(rows, precision)
    if alignments is not None:
        report["alignments"] = alignments
        if precision == FLOAT32 and alignments["links"] and alignments["identical_rate"] < 0.95:
            report["failures"].append(f"alignments: {100 * alignments['identical_rate']:.1f}% of links identical")
    if glossary is not None:
        report["glossary"] = glossary_probe(translator, engine, settings, probe, glossary, timed)
        report["failures"] += glossary_failures(report["glossary"], precision)
    return report


def aligned_translations(translator, lines: list[str], decode) -> list[tuple[str, Links]]:
    """mtcli's best translation of each line with its word links (Translator.align)."""
    return [(h[0].text, h[0].alignment) for h in translator.translate_nbest(lines, decode, alignments=True)]


def compare_alignments(ours: list[tuple[str, Links]], theirs: list[tuple[str, Links]], translator) -> dict:
    """The alignments row of a parity report: on the lines both translate identically (greedy), how many of the
    word links either side gives both give. The engine aligns with the layer and heads the export declares."""
    same = [(a, b) for (text, a), (other, b) in zip(ours, theirs) if text and text == other]
    union = sum(len(set(a) | set(b or [])) for a, b in same)
    common = sum(len(set(a) & set(b or [])) for a, b in same)
    return {
        "lines": len(same),
        "links": union,
        "identical_links": common,
        "identical_rate": common / union if union else 1.0,
        "layer": translator.config.model.alignment_layer_index,
        "heads": translator.config.alignment_heads,
        "guided": translator.guided_alignment,
    }


def glossary_probe(translator, engine, settings: EngineSettings, probe: Probe, glossary, timed=None) -> dict:
    """The glossary row of a parity report (export --glossary, a model trained with data.terminology): the probe
    lines that hold a glossary term, marked as decode.constraints soft marks them (glossary.soft_marked), translated
    by mtcli and by the engine at the beam the engine runs; term accuracy of each, and identical lines."""
    found = [(line, glossary.matches(line)) for line in probe.sources]
    lines = [line for line, matches in found if matches]
    checks = expected_terms(glossary, lines)
    marked = [soft_marked(line, matches) for line, matches in found if matches]
    row = {"lines": len(lines), "terms": len(checks), "beam": settings.beam}
    if not lines:
        return row | {"note": "no probe line holds a glossary term"}
    timed = timed or (lambda name, translate, *args: translate(*args))
    decode = mtcli_decode(translator.config.decode, settings, settings.beam)
    ours = timed("mtcli, glossary marked", translator.translate, marked, decode)
    theirs = timed("export, glossary marked", engine.translate, marked, settings, settings.beam)
    return row | {
        "term_accuracy": [term_accuracy(checks, ours)["accuracy"], term_accuracy(checks, theirs)["accuracy"]],
        "identical": sum(a == b for a, b in zip(ours, theirs)),
    }


def glossary_failures(row: dict, precision: str) -> list[str]:
    """float32: the marked lines translate identically (99%); other precisions: term accuracy within 2 points."""
    if "term_accuracy" not in row:
        return []
    ours, theirs = row["term_accuracy"]
    if precision == FLOAT32 and row["identical"] < 0.99 * row["lines"]:
        return [f"glossary: {row['identical']}/{row['lines']} marked lines identical"]
    if precision != FLOAT32 and theirs < ours - 2:
        return [f"glossary: term accuracy {ours:.1f}% -> {theirs:.1f}%"]
    return []


class _PassTimer:
    """Runs one translation pass of the report and logs a line when it is done: a probe of 500 lines takes minutes
    on a busy machine, and the table comes only at the end."""

    def __init__(self, passes: int, lines: int):
        self.passes, self.lines, self.done = passes, lines, 0

    def __call__(self, name: str, translate, *args) -> list[str]:
        began = time.time()
        out = translate(*args)
        self.done += 1
        took = format_duration(time.time() - began)
        logger.info(f"parity: {self.done}/{self.passes} {name}: {counted(self.lines, 'line')} in {took}")
        return out


def compare(mode, ours, theirs, probe: Probe, tgt_lang, tokenizer, checked=True) -> Row:
    n_ref = len(probe.references)
    row = Row(
        mode=mode,
        lines=len(ours),
        identical=sum(a == b for a, b in zip(ours, theirs)),
        bleu_vs_mtcli=round(score(theirs, ours, tgt_lang)["bleu"], 2) if any(ours) else 0.0,
        empty=(sum(not a for a in ours), sum(not b for b in theirs)),
        repeating=(count_repeating(ours, tokenizer), count_repeating(theirs, tokenizer)),
        length_ratio=round(sum(map(len, theirs)) / max(sum(map(len, ours)), 1), 4),
        checked=checked,
    )
    if n_ref:
        a, b = score(ours[:n_ref], probe.references, tgt_lang), score(theirs[:n_ref], probe.references, tgt_lang)
        row.bleu = (round(a["bleu"], 2), round(b["bleu"], 2))
        row.chrf = (round(a["chrf"], 2), round(b["chrf"], 2))
    row.examples = [{"source": s, "mtcli": a, "export": b} for s, a, b in zip(probe.sources, ours, theirs) if a != b][
        :3
    ]
    return row


def count_repeating(texts: list[str], tokenizer: Tokenizer) -> int:
    """Outputs in which a 1-4 subword n-gram occurs REPEAT_TIMES times in a row (a model stuck in a loop)."""
    return sum(repeats(ids) for ids in tokenizer.encode_tgt(texts))


def repeats(ids: list[int], times: int = REPEAT_TIMES) -> bool:
    for n in range(1, 5):
        for start in range(0, len(ids) - n * times + 1):
            gram = ids[start : start + n]
            if all(ids[start + k * n : start + (k + 1) * n] == gram for k in range(1, times)):
                return True
    return False


def thresholds(precision: str) -> dict:
    if precision == FLOAT32:
        return {"min_identical_rate": 0.99, "max_bleu_delta": 0.2}
    return {"max_bleu_delta": 1.0, "extra_empty_or_repeating": "max(2, 1% of lines) more than mtcli's"}


def slack(lines: int) -> int:
    """Extra empty or repeating outputs a reduced-precision export may have: a line or two flips either way (an int8
    Multi30k model had 5 repeating outputs where mtcli had 4), while a collapsed model repeats on most lines."""
    return max(2, lines // 100)


def failures(rows: list[Row], precision: str) -> list[str]:
    """What diverged past the thresholds, one phrase each (empty: the export passes)."""
    limits, found = thresholds(precision), []
    for r in (r for r in rows if r.checked):
        if r.bleu is not None and abs(r.bleu[1] - r.bleu[0]) > limits["max_bleu_delta"]:
            found.append(f"{r.mode}: reference BLEU {r.bleu[0]:.2f} -> {r.bleu[1]:.2f}")
        if precision == FLOAT32:
            if r.identical_rate < limits["min_identical_rate"]:
                found.append(f"{r.mode}: {r.identical}/{r.lines} lines identical ({r.identical_rate:.1%} < 99%)")
        else:
            if r.empty[1] > r.empty[0] + slack(r.lines):
                found.append(f"{r.mode}: {r.empty[1]} empty outputs (mtcli {r.empty[0]})")
            if r.repeating[1] > r.repeating[0] + slack(r.lines):
                found.append(f"{r.mode}: {r.repeating[1]} repeating outputs (mtcli {r.repeating[0]})")
    return found


def format_report(report: dict) -> list[str]:
    """The report as the lines the command prints."""
    lines = [
        f"parity: {report['engine']} ({report['precision']}) against mtcli ({report['mtcli_precision']}) on "
        f"{report['lines']} lines: {report['probe']}",
        f"  {'search':<24} {'identical':>16} {'BLEU vs mtcli':>13} {'ref BLEU mtcli -> export':>25} "
        f"{'chrF':>15} {'empty':>6} {'repeat':>6} {'length':>6}",
    ]
    for r in report["rows"]:
        bleu = f"{r['bleu'][0]:.2f} -> {r['bleu'][1]:.2f} ({r['bleu'][1] - r['bleu'][0]:+.2f})" if r["bleu"] else "-"
        chrf = f"{r['chrf'][0]:.2f} -> {r['chrf'][1]:.2f}" if r["chrf"] else "-"
        identical = f"{r['identical']}/{r['lines']} {r['identical_rate']:.1%}"
        lines.append(
            f"  {r['mode']:<24} {identical:>16} {r['bleu_vs_mtcli']:>13.2f} {bleu:>25} {chrf:>15} "
            f"{'{}/{}'.format(*r['empty']):>6} {'{}/{}'.format(*r['repeating']):>6} {r['length_ratio']:>6.3f}"
        )
    for note in report["not_expressible"]:
        lines.append(f"  not expressible: {note}")
    if "glossary" in report:
        g = report["glossary"]
        if "term_accuracy" in g:
            lines.append(
                f"  glossary (beam {g['beam']}, {g['lines']} lines with {g['terms']} terms, marked): term accuracy "
                f"mtcli {g['term_accuracy'][0]:.1f}% -> export {g['term_accuracy'][1]:.1f}%, "
                f"{g['identical']}/{g['lines']} lines identical"
            )
        else:
            lines.append(f"  glossary: {g['note']}")
    for failure in report["failures"]:
        lines.append(f"  DIVERGED: {failure}")
    return lines


def check_and_write(report: dict, folder: Path, name: str, check: bool) -> None:
    """Print the report, write it to folder/parity.json with a record of every file already in `folder` (see
    file_records), and refuse past the thresholds (unless not `check`)."""
    for line in format_report(report):
        logger.info(line)
    report["files"] = file_records(folder)
    write_report(report, folder / REPORT)
    if report["failures"] and check:
        raise MtcliError(
            f"{name}: the export does not translate as mtcli does ({'; '.join(report['failures'][:3])}); nothing "
            "was written (--no-check writes it anyway, with parity.json)"
        )


@dataclass
class ParityOptions:
    """What `mtcli export` and `mtcli import` take for the report: --probe, --probe-ref, --probe-lines, --no-check."""

    probe: Path | None = None
    probe_ref: Path | None = None
    lines: int = PROBE_LINES
    check: bool = True
    glossary: Path | None = None  # export --glossary: the glossary row (a model trained with data.terminology)
    terms: object = field(default=None, init=False)  # the glossary, read before any export work

    def __post_init__(self):  # before any export work
        if self.lines < 0:
            raise MtcliError(f"--probe-lines {self.lines}: must be 0 or more")
        if self.probe_ref is not None and self.probe is None:
            raise MtcliError("--probe-ref needs --probe (the source lines it is the reference of)")
        for option, path in (("--probe", self.probe), ("--probe-ref", self.probe_ref), ("--glossary", self.glossary)):
            if path is not None and not Path(path).is_file():
                raise MtcliError(f"{option} {path}: no such file")
        if self.glossary is not None:
            self.terms = load_glossary(self.glossary)


def run_parity(translator, engine, target: str, precision: str, folder: Path, name: str, options: ParityOptions):
    """Probe, compare, print, write folder/parity.json; refuse past the thresholds when options.check."""
    probe = probe_set(translator.config, translator.tokenizer, options.probe, options.probe_ref, options.lines)
    if options.terms is not None and not translator.tokenizer.has_source_symbols(MARKERS):
        raise MtcliError(
            f"--glossary {options.glossary}: the glossary row compares marked text, which only a model trained with "
            "data.terminology reads; drop --glossary"
        )
    report = parity_report(translator, engine, target, precision, probe, options.terms)
    check_and_write(report, folder, name, options.check)
    return report


@contextlib.contextmanager
def quiet_transformers(transformers):
    """Without Transformers' progress bars ("Writing model shards", "Loading weights") and its advice to install
    sacremoses (which MarianTokenizer never uses for SentencePiece models): mtcli reports its own results."""
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Recommended: pip install sacremoses")
            yield
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()


# ---------------------------------------------------------------------------------------------------------------------
# The files a report describes


def write_report(report: dict, path: Path) -> None:
    path.write_text(report_text(report), encoding="utf-8")


def report_text(report: dict) -> str:
    return json.dumps(report, indent=1, ensure_ascii=False) + "\n"  # sentences in any script, as they are


def file_record(handle: BinaryIO | bytes) -> dict:
    """{"bytes": size, "sha256": hex digest} of an open binary file (read to its end) or of bytes."""
    handle = io.BytesIO(handle) if isinstance(handle, bytes) else handle
    digest, size = hashlib.sha256(), 0
    while chunk := handle.read(1 << 20):
        digest.update(chunk)
        size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def file_records(folder: Path) -> dict[str, dict]:
    """The record of every file below `folder` (by relative path) but the report itself and the output manifest:
    the files the report vouches for."""
    records = {}
    for name in files_under(folder):
        if name not in (REPORT, MANIFEST) and not (folder / name).is_symlink():
            with open(folder / name, "rb") as f:
                records[name] = file_record(f)
    return records


def verify_export(path: Path) -> tuple[list[str], list[str], int]:
    """Check an export folder (or an .argosmodel package) against the files its parity.json records: (one line per
    recorded file that is missing or differs, files present that the report does not record, files recorded)."""
    path = Path(path)
    with contextlib.ExitStack() as stack:
        # each file present, by its path inside the export -> a function that opens it for reading bytes
        if path.is_dir():
            names = [n for n in files_under(path) if n != MANIFEST and (path / n).is_file()]
            present = {n: partial(open, path / n, "rb") for n in names}
        elif path.is_file() and zipfile.is_zipfile(path):
            package = stack.enter_context(zipfile.ZipFile(path))
            members = [m for m in package.namelist() if not m.endswith("/")]
            if len({m.split("/")[0] for m in members}) != 1 or not all("/" in m for m in members):
                raise MtcliError(f"{path}: not an .argosmodel package (one folder at its top)")
            present = {m.split("/", 1)[1]: partial(package.open, m) for m in members}
        else:
            raise MtcliError(f"{path}: no such export folder or .argosmodel package")
        if REPORT not in present:
            raise MtcliError(f"{path}: holds no {REPORT}; give the folder (or package) an mtcli export wrote")
        try:
            with present[REPORT]() as f:
                report = json.loads(f.read().decode("utf-8"))
        except (OSError, zipfile.BadZipFile, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise MtcliError(f"{path}: its {REPORT} is not readable JSON ({error_text(e)})") from None
        records = report.get("files") if isinstance(report, dict) else None
        if not isinstance(records, dict) or not records:
            raise MtcliError(
                f"{path}: its {REPORT} records no files (an export by an older mtcli): export again to check it later"
            )
        problems = []
        for name, record in sorted(records.items()):
            if name not in present:
                problems.append(f"{name}: missing")
                continue
            try:
                with present[name]() as f:
                    found = file_record(f)
            except (OSError, zipfile.BadZipFile) as e:  # a damaged package member fails its CRC check
                problems.append(f"{name}: unreadable ({error_text(e)})")
                continue
            if found != record:
                recorded = record if isinstance(record, dict) else {}
                problems.append(
                    f"{name}: differs from the report ({found['bytes']} bytes, sha256 {found['sha256'][:16]}...; "
                    f"recorded {recorded.get('bytes')} bytes, sha256 {str(recorded.get('sha256'))[:16]}...)"
                )
        unrecorded = sorted(set(present) - set(records) - {REPORT})
        return problems, unrecorded, len(records)
