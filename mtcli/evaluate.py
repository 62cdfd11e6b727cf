"""`mtcli eval` and validation: translate a split or files, score them (mtcli.scoring, the one path for both), test
other systems against this one (compare.py), write the hypotheses, references and per-sentence scores beside the
run; and the validation loss.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from mtcli.batching import collate, epoch_batches
from mtcli.checkpoint import read_config, read_tokenizer, run_of
from mtcli.compare import compare_systems, format_comparison, format_terms
from mtcli.config import Config, DecodeConfig
from mtcli.config_loader import load_config, replaced
from mtcli.corpus import describe_source
from mtcli.data import eval_texts
from mtcli.errors import MtcliError
from mtcli.glossary import TermCheck, term_accuracy
from mtcli.inference import inference_model, translation_precision
from mtcli.line_io import read_lines
from mtcli.loss import projection_cross_entropy, target_states
from mtcli.scoring import (
    ScoreOptions,
    sacrebleu_command,
    sacrebleu_flags,
    score,
    score_files,
    sentence_scores,
    write_lines,
)
from mtcli.tokenizer import Tokenizer
from mtcli.translate import Translator


def evaluate(
    translator: Translator,
    sources: list[str],
    references: list[list[str]],
    decode: DecodeConfig,
    out_dir: Path,
    stem: str,
    options: ScoreOptions = ScoreOptions(),
    compare: list[str] | tuple[str, ...] = (),
    sentence_file: Path | None = None,
    progress: bool = False,
    term_checks: list[TermCheck] | None = None,
) -> dict:
    """Translate `sources`, write hypotheses and references under `out_dir` and score them; with `compare` (runs,
    checkpoint folders or hypothesis files), paired tests of each against this system; with `sentence_file`, the
    sentence-level scores there, one JSON line per segment; with `term_checks` (the target terms each line's
    translation should hold), exact-match term accuracy, of every system compared too."""

    for other in compare:  # before translating: a typo should not cost a translation of the whole set first
        if not Path(other).exists():
            raise MtcliError(f"--compare {other}: no such run directory, checkpoint folder or file of hypotheses")
    tgt_lang = translator.config.data.tgt_lang
    hypotheses = translator.translate(sources, decode, progress)
    references = [[" ".join(r.split()) for r in stream] for stream in references]
    hyp_path = out_dir / f"{stem}.beam{decode.beam}.hyp.{tgt_lang}"
    write_lines(hyp_path, hypotheses)
    names = [f"ref{i + 1}" for i in range(len(references))] if len(references) > 1 else ["ref"]
    ref_paths = [out_dir / f"{stem}.{name}.{tgt_lang}" for name in names]
    for path, stream in zip(ref_paths, references):
        write_lines(path, stream)
    result = score_files(hypotheses, hyp_path, references, ref_paths, tgt_lang, options)
    result.update(
        {
            "sentences": len(sources),
            "beam": decode.beam,
            "lenpen": decode.lenpen,
            "precision": translator.precision,
            "precision_reason": translator.precision_reason,
        }
    )
    if term_checks is not None:
        result["terms"] = term_accuracy(term_checks, hypotheses)
    if sentence_file is not None:
        result["sentence_scores"] = write_sentence_scores(
            sentence_file, sources, hypotheses, references, (hyp_path, ref_paths), tgt_lang, options
        )
    if compare:
        baseline = (hyp_path.name, hyp_path, hypotheses)
        result["comparison"] = compare_systems(
            translator, baseline, compare, sources, (references, ref_paths), decode, options, progress, term_checks
        )
    return result


def write_sentence_scores(
    path: Path,
    sources: list[str],
    hypotheses: list[str],
    references: list[list[str]],
    files,
    tgt_lang: str,
    options: ScoreOptions,
) -> dict:
    """One JSON line per segment (line number, each metric's sentence score, source, hypothesis, references), and
    the `sacrebleu --sentence-level` call that prints each metric's column from `files` (hypotheses, references)."""
    hyp_path, ref_paths = files
    rows = sentence_scores(hypotheses, references, tgt_lang, options)
    try:
        with open(path, "w", encoding="utf-8") as f:
            for i, row in enumerate(rows):
                refs = [stream[i] for stream in references]
                line = {"line": i + 1, **row, "source": sources[i], "hypothesis": hypotheses[i], "references": refs}
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
    except OSError as e:
        raise MtcliError(f"--sentence-scores {path}: cannot write ({e.strerror})") from None
    commands = {
        name: sacrebleu_command(
            ref_paths, [hyp_path], sacrebleu_flags((name,), tgt_lang, options.lowercase) + ["--sentence-level", "-b"]
        )
        for name in options.metrics
    }
    return {"file": str(path), "commands": commands}


def format_report(result: dict) -> str:
    """The text `mtcli eval` prints: each score with its signature, the files and the commands that repeat them."""
    lines = [f"{entry['detail']}  [{entry['signature']}]" for entry in result["scores"].values()]
    if "terms" in result:
        lines.append(f"term accuracy (exact match): {format_terms(result['terms'])}")
    lines.append(f"precision: {result['precision']}, beam {result['beam']}, length penalty {result['lenpen']}")
    if result.get("ensemble"):
        lines.append(f"ensemble: {result['checkpoint']}, {', '.join(result['ensemble'])} (probabilities averaged)")
    lines.append(f"hypotheses: {result['hypotheses']}\nreferences: {', '.join(result['references'])}")
    lines += [f"check: {command}" for command in dict.fromkeys(e["command"] for e in result["scores"].values())]
    if "sentence_scores" in result:
        lines.append(f"sentence scores: {result['sentence_scores']['file']} (one JSON line per segment)")
    if "comparison" in result:
        lines.append(format_comparison(result["comparison"]))
    return "\n".join(lines)


def eval_config(checkpoint: Path, run: Path | None) -> Config:
    """The checkpoint's own config; when --run names another run as well, with that run's data settings (its test
    and valid splits), after checking that the checkpoint was trained with the run's SentencePiece model."""
    config = read_config(checkpoint)
    if run is None or run_of(checkpoint).resolve() == Path(run).resolve():
        return config
    run = Path(run)
    try:  # the run's tokenizer, whichever kind (one SentencePiece model, one per side, an imported vocabulary)
        run_tokenizer = Tokenizer.from_folder(run) if (run / "config.yaml").is_file() else None
    except (OSError, RuntimeError):
        run_tokenizer = None
    if run_tokenizer is None:
        raise MtcliError(f"--run {run}: not a run directory (no config.yaml and tokenizer files)")
    if not read_tokenizer(checkpoint).same_as(run_tokenizer):
        raise MtcliError(
            f"--checkpoint {checkpoint} was trained with another vocabulary than run {run}; evaluate it without "
            f"--run (on its own run's data), or pick a checkpoint of {run}"
        )
    return replaced(config, data=load_config(run / "config.yaml", need_source=False).to_dict()["data"])


def evaluation_set(config: Config, split: str | None, src: Path | None, refs: list[Path]) -> tuple[list, list, str]:
    """Sources, reference streams and a name: a split of the run's data (default test, one reference), or a source
    file with one or more line-aligned reference files."""
    if (src is None) != (not refs):
        raise MtcliError("--src and --ref go together (--ref may be given several times)")
    if src is not None and split is not None:
        raise MtcliError("give either --split or --src/--ref, not both")
    if src is None:
        role = split or "test"
        sources, references = eval_texts(config, role)
        named = [(f"--split {role}: the sources of", describe_source(config.data), sources)]
        _check_not_blank(named + [(f"--split {role}: the references of", describe_source(config.data), references)])
        return sources, [references], role
    sources = read_lines(src)
    streams = []
    for ref in refs:
        streams.append(read_lines(ref))
        if len(streams[-1]) != len(sources):
            raise MtcliError(f"line counts differ: {src} has {len(sources)} lines, {ref} has {len(streams[-1])}")
    _check_not_blank([("--src", src, sources)] + [("--ref", ref, lines) for ref, lines in zip(refs, streams)])
    return sources, streams, Path(src).name


def _check_not_blank(named: list[tuple[str, Path | str, list[str]]]) -> None:
    """Each (option, file, lines) holds a non-blank line: sacreBLEU fails on no lines at all, and scores blank ones
    0 as if that said something about the model."""
    for option, path, lines in named:
        if not any(line.strip() for line in lines):
            what = "is empty" if not lines else f"has only blank lines ({len(lines):,})"
            raise MtcliError(f"{option} {path} {what}: nothing to evaluate")


# ---------------------------------------------------------------------------------------------------------------------
# Validation during training


@torch.inference_mode()
def validation_loss(model, split, cfg: Config, device, autocast) -> dict:
    """Label-smoothed loss, negative log-likelihood and perplexity per target token of an encoded split."""
    model.eval()
    nll_sum, smoothed_sum, tokens = 0.0, 0.0, 0
    for indices in epoch_batches(split.src_lens, split.tgt_lens, cfg.train.max_tokens, 0, 0, shuffle=False):
        srcs, tgts = [split.src(i) for i in indices], [split.tgt(i) for i in indices]
        batch = collate(srcs, tgts, cfg.model.max_positions, model.specials).to(device)
        with autocast:
            real = target_states(model, batch.src, batch.src_pad_mask, batch.tgt_in, batch.tgt_index)
            weight, bias, labels = model.output.weight, model.output_bias, batch.labels
            nll_sum += float(projection_cross_entropy(real, weight, labels, 0.0, bias))
            smoothed_sum += float(projection_cross_entropy(real, weight, labels, cfg.train.label_smoothing, bias))
        tokens += batch.n_tgt_tokens
    nll = nll_sum / max(tokens, 1)
    return {"loss": smoothed_sum / max(tokens, 1), "nll": nll, "ppl": math.exp(min(nll, 50))}


def validation_bleu(model, tokenizer, split, cfg: Config, device) -> float:
    """Greedy BLEU on (the first valid_max_sentences of) an eval split, through the same path as `mtcli eval`."""
    sources, references = split.texts()
    if cfg.train.valid_max_sentences:
        sources, references = sources[: cfg.train.valid_max_sentences], references[: cfg.train.valid_max_sentences]
    # The precision `mtcli eval` picks by default, on a converted copy: the logged score is what eval repeats.
    precision, _ = translation_precision(cfg.decode.precision, device)
    translator = Translator(inference_model(model, precision, copy=True), tokenizer, cfg, device, precision)
    decode = dataclasses.replace(cfg.decode, beam=1, nbest=1, sampling=False)
    return score(translator.translate(sources, decode), references, cfg.data.tgt_lang)["bleu"]
