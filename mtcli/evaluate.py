"""Scoring: sacreBLEU BLEU and chrF on detokenized text, the one path for validation and `mtcli eval`; and the
validation loss.

BLEU uses sacreBLEU's `zh` tokenizer for Chinese targets and `13a` otherwise; the written hypothesis and reference
files reproduce the score with the printed `sacrebleu` command.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from sacrebleu.metrics import BLEU, CHRF

from mtcli.batching import collate, epoch_batches
from mtcli.checkpoint import read_config, run_of
from mtcli.config import Config, DecodeConfig
from mtcli.config_loader import load_config
from mtcli.corpus import read_lines
from mtcli.data import eval_texts
from mtcli.errors import MtcliError
from mtcli.loss import projection_cross_entropy, target_states
from mtcli.translate import Translator, inference_model, translation_precision

CHINESE = {"zh", "zh-cn", "zh-tw", "zho", "cmn"}


def bleu_tokenizer(tgt_lang: str) -> str:
    return "zh" if tgt_lang.lower() in CHINESE else "13a"


def score(hypotheses: list[str], references: list[str], tgt_lang: str, lowercase: bool = False) -> dict:
    """Corpus BLEU and chrF of detokenized hypotheses against one reference each; lowercase is sacreBLEU's -lc (it
    shows in the signature as case:lc)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    bleu_metric = BLEU(tokenize=bleu_tokenizer(tgt_lang), lowercase=lowercase)
    chrf_metric = CHRF(lowercase=lowercase)
    bleu = bleu_metric.corpus_score(hypotheses, [references])
    chrf = chrf_metric.corpus_score(hypotheses, [references])
    return {
        "bleu": bleu.score,
        "chrf": chrf.score,
        "signature": str(bleu_metric.get_signature()),
        "chrf_signature": str(chrf_metric.get_signature()),
        "bleu_detail": str(bleu),
    }


def write_lines(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line.replace("\n", " ") + "\n" for line in lines), encoding="utf-8")


def evaluate(
    translator: Translator,
    sources: list[str],
    references: list[str],
    decode: DecodeConfig,
    out_dir: Path,
    stem: str,
    lowercase: bool = False,
    progress: bool = False,
) -> dict:
    """Translate `sources`, write hypotheses and references under `out_dir`, and score them."""
    tgt_lang = translator.config.data.tgt_lang
    hypotheses = translator.translate(sources, decode, progress)
    references = [" ".join(r.split()) for r in references]
    hyp_path = out_dir / f"{stem}.beam{decode.beam}.hyp.{tgt_lang}"
    ref_path = out_dir / f"{stem}.ref.{tgt_lang}"
    write_lines(hyp_path, hypotheses)
    write_lines(ref_path, references)
    result = score(hypotheses, references, tgt_lang, lowercase)
    tok = bleu_tokenizer(tgt_lang)
    flags = (" -tok zh" if tok == "zh" else "") + (" -lc" if lowercase else "")
    result.update(
        {
            "hypotheses": str(hyp_path),
            "references": str(ref_path),
            "sentences": len(sources),
            "beam": decode.beam,
            "lenpen": decode.lenpen,
            "precision": translator.precision,
            "command": f"sacrebleu {ref_path} -i {hyp_path} -m bleu chrf{flags}",
        }
    )
    return result


def eval_config(checkpoint: Path, run: Path | None) -> Config:
    """The checkpoint's own config; when --run names another run as well, with that run's data settings (its test
    and valid splits), after checking that the checkpoint was trained with the run's SentencePiece model."""
    config = read_config(checkpoint)
    if run is None or run_of(checkpoint).resolve() == Path(run).resolve():
        return config
    run_spm, ckpt_folder = Path(run) / "spm.model", Path(checkpoint)
    ckpt_spm = (ckpt_folder if ckpt_folder.is_dir() else ckpt_folder.parent) / "spm.model"
    if not run_spm.is_file() or not (Path(run) / "config.yaml").is_file():
        raise MtcliError(f"--run {run}: not a run directory (no config.yaml and spm.model)")
    if not ckpt_spm.is_file() or ckpt_spm.read_bytes() != run_spm.read_bytes():
        raise MtcliError(
            f"--checkpoint {checkpoint} was trained with another vocabulary than run {run} ({ckpt_spm} differs "
            f"from {run_spm}); evaluate it without --run (on its own run's data), or pick a checkpoint of {run}"
        )
    return config.replace(data=load_config(Path(run) / "config.yaml").to_dict()["data"])


def evaluation_set(config: Config, split: str | None, src: Path | None, ref: Path | None) -> tuple[list, list, str]:
    """Sources, references and a name: a split of the run's data (default test), or a pair of line-aligned files."""
    if (src is None) != (ref is None):
        raise MtcliError("--src and --ref go together")
    if src is not None and split is not None:
        raise MtcliError("give either --split or --src/--ref, not both")
    if src is None:
        role = split or "test"
        return (*eval_texts(config, role), role)
    sources, references = read_lines(src), read_lines(ref)
    if len(sources) != len(references):
        raise MtcliError(f"line counts differ: {src} has {len(sources)} lines, {ref} has {len(references)}")
    return sources, references, Path(src).name


# ---------------------------------------------------------------------------------------------------------------------
# Validation during training


@torch.inference_mode()
def validation_loss(model, split, cfg: Config, device, autocast) -> dict:
    """Label-smoothed loss, negative log-likelihood and perplexity per target token of an encoded split."""
    model.eval()
    nll_sum, smoothed_sum, tokens = 0.0, 0.0, 0
    for indices in epoch_batches(split.src_lens, split.tgt_lens, cfg.train.max_tokens, 0, 0, shuffle=False):
        srcs, tgts = [split.src(i) for i in indices], [split.tgt(i) for i in indices]
        batch = collate(srcs, tgts, cfg.model.max_positions).to(device)
        with autocast:
            real = target_states(model, batch.src, batch.src_pad_mask, batch.tgt_in, batch.tgt_index)
            nll_sum += float(projection_cross_entropy(real, model.output.weight, batch.labels, 0.0))
            smoothed_sum += float(
                projection_cross_entropy(real, model.output.weight, batch.labels, cfg.train.label_smoothing)
            )
        tokens += batch.n_tgt_tokens
    nll = nll_sum / max(tokens, 1)
    return {"loss": smoothed_sum / max(tokens, 1), "nll": nll, "ppl": math.exp(min(nll, 50))}


def validation_bleu(model, tokenizer, split, cfg: Config, device) -> float:
    """Greedy BLEU on (the first valid_max_sentences of) an eval split, through the same path as `mtcli eval`."""
    sources, references = split.texts()
    if cfg.train.valid_max_sentences:
        sources, references = sources[: cfg.train.valid_max_sentences], references[: cfg.train.valid_max_sentences]
    # The precision `mtcli eval` picks by default, on a converted copy: the logged score is what eval repeats.
    precision = translation_precision(cfg.decode.precision, cfg.model, device)
    translator = Translator(inference_model(model, precision, copy=True), tokenizer, cfg, device, precision)
    decode = dataclasses.replace(cfg.decode, beam=1, nbest=1, sampling=False)
    return score(translator.translate(sources, decode), references, cfg.data.tgt_lang)["bleu"]
