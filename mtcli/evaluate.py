"""Scoring: sacreBLEU BLEU and chrF on detokenized text, the one path for validation and `mtcli eval`.

BLEU uses sacreBLEU's `zh` tokenizer for Chinese targets and `13a` otherwise; the written hypothesis and reference
files reproduce the score with the printed `sacrebleu` command.
"""

from __future__ import annotations

from pathlib import Path

from sacrebleu.metrics import BLEU, CHRF

from mtcli.config import DecodeConfig
from mtcli.translate import Translator

CHINESE = {"zh", "zh-cn", "zh-tw", "zho", "cmn"}


def bleu_tokenizer(tgt_lang: str) -> str:
    return "zh" if tgt_lang.lower() in CHINESE else "13a"


def score(hypotheses: list[str], references: list[str], tgt_lang: str) -> dict:
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    bleu_metric, chrf_metric = BLEU(tokenize=bleu_tokenizer(tgt_lang)), CHRF()
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
    progress=None,
) -> dict:
    """Translate `sources`, write hypotheses and references under `out_dir`, and score them."""
    tgt_lang = translator.config.data.tgt_lang
    hypotheses = translator.translate_best(sources, decode, progress)
    references = [" ".join(r.split()) for r in references]
    hyp_path = out_dir / f"{stem}.beam{decode.beam}.hyp.{tgt_lang}"
    ref_path = out_dir / f"{stem}.ref.{tgt_lang}"
    write_lines(hyp_path, hypotheses)
    write_lines(ref_path, references)
    result = score(hypotheses, references, tgt_lang)
    tok = bleu_tokenizer(tgt_lang)
    result.update(
        {
            "hypotheses": str(hyp_path),
            "references": str(ref_path),
            "sentences": len(sources),
            "beam": decode.beam,
            "lenpen": decode.lenpen,
            "command": f"sacrebleu {ref_path} -i {hyp_path} -m bleu chrf" + (" -tok zh" if tok == "zh" else ""),
        }
    )
    return result
