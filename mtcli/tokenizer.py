"""SentencePiece: train a joint (or one per side) subword model, and encode/decode with fixed special ids.

Ids 0-3 are the same in every model mtcli makes: pad, unk, bos, eos. The model files are copied into each run
directory, so `translate` needs nothing but the run.
"""

from __future__ import annotations

import io
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

from mtcli.config import DataConfig
from mtcli.errors import MtcliError

PAD, UNK, BOS, EOS = 0, 1, 2, 3
CJK_LANGS = {"zh", "ja", "zh-cn", "zh-tw", "zho", "jpn", "cmn"}


def character_coverage(cfg: DataConfig) -> float:
    if cfg.character_coverage is not None:
        return cfg.character_coverage
    return 0.9995 if {cfg.src_lang, cfg.tgt_lang} & CJK_LANGS else 1.0


def normalization(cfg: DataConfig) -> str:
    # NFKC would turn Chinese full-width punctuation (，？！) into ASCII, so outputs would no longer match references.
    if cfg.spm_normalization is not None:
        return cfg.spm_normalization
    return "identity" if {cfg.src_lang, cfg.tgt_lang} & CJK_LANGS else "nmt_nfkc"


def train_sentencepiece(sentences: Iterable[str], out_path: Path, cfg: DataConfig) -> None:
    """Fit one SentencePiece model on `sentences` and write it to `out_path`."""
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=cfg.vocab_size,
            model_type=cfg.spm_model_type,
            character_coverage=character_coverage(cfg),
            normalization_rule_name=normalization(cfg),
            byte_fallback=cfg.byte_fallback,
            pad_id=PAD,
            unk_id=UNK,
            bos_id=BOS,
            eos_id=EOS,
            hard_vocab_limit=False,  # a small corpus may not support the requested size: take what it supports
            num_threads=os.cpu_count() or 1,
            train_extremely_large_corpus=False,
            minloglevel=2,
        )
    except RuntimeError as e:  # SentencePiece reports bad settings as RuntimeError("INTERNAL: <file>(<line>) ...")
        text = " ".join(str(e).split())
        # hard_vocab_limit=False allows fewer pieces than asked, never fewer than the characters to keep.
        need = re.search(r"smaller than required_chars\. \d+ vs (\d+)", text)
        if need:
            raise MtcliError(
                f"data.vocab_size: {cfg.vocab_size} is too small for this corpus: its characters alone (character "
                f"coverage {character_coverage(cfg):g}{', plus 256 byte pieces' if cfg.byte_fallback else ''}) "
                f"need {need[1]} pieces; raise data.vocab_size or lower data.character_coverage"
            ) from None
        raise MtcliError(f"SentencePiece training failed: {text}") from None
    out_path.write_bytes(model.getvalue())


class Tokenizer:
    """Source and target SentencePiece models (the same object twice for a joint vocabulary)."""

    def __init__(self, src_model: Path, tgt_model: Path | None = None):
        self.src_model_path = Path(src_model)
        self.tgt_model_path = Path(tgt_model) if tgt_model else self.src_model_path
        self.src = spm.SentencePieceProcessor(model_file=str(self.src_model_path))
        self.joint = self.tgt_model_path == self.src_model_path
        self.tgt = self.src if self.joint else spm.SentencePieceProcessor(model_file=str(self.tgt_model_path))
        self.threads = os.cpu_count() or 1

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        folder = Path(folder)
        if (folder / "spm.model").is_file():
            return cls(folder / "spm.model")
        return cls(folder / "spm.src.model", folder / "spm.tgt.model")

    def copy_to(self, folder: Path) -> None:
        """Copy the model file(s) into a run directory under the names `from_folder` reads."""
        if self.joint:
            shutil.copyfile(self.src_model_path, folder / "spm.model")
        else:
            shutil.copyfile(self.src_model_path, folder / "spm.src.model")
            shutil.copyfile(self.tgt_model_path, folder / "spm.tgt.model")

    @property
    def src_vocab_size(self) -> int:
        return self.src.get_piece_size()

    @property
    def tgt_vocab_size(self) -> int:
        return self.tgt.get_piece_size()

    def same_as(self, other: Tokenizer) -> bool:
        """The same SentencePiece model(s), byte for byte: the same ids mean the same pieces."""
        return (self.src.serialized_model_proto(), self.tgt.serialized_model_proto()) == (
            other.src.serialized_model_proto(),
            other.tgt.serialized_model_proto(),
        )

    def encode_src(self, lines: list[str]) -> list[list[int]]:
        return self.src.encode(lines, out_type=int, num_threads=self.threads)

    def encode_tgt(self, lines: list[str]) -> list[list[int]]:
        return self.tgt.encode(lines, out_type=int, num_threads=self.threads)

    def decode_tgt(self, ids: list[list[int]]) -> list[str]:
        """Subword ids (specials are dropped) back to detokenized text."""
        clean = [[i for i in seq if i > EOS] for seq in ids]
        return self.tgt.decode(clean, num_threads=self.threads)
