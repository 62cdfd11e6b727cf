"""SentencePiece: train a joint (or one per side) subword model, and encode/decode.

Ids 0-3 are the same in every model mtcli makes: pad, unk, bos, eos (`MTCLI_SPECIALS`). An imported MarianMT model
keeps its own vocabulary instead (`MarianVocabTokenizer`: pieces map to model ids through vocab.json; eos 0, unk 1,
pad = decoder start = the last id), so the special ids are the tokenizer's, and the model, the batches and the search
read them from there. The model files are copied into each run directory, so `translate` needs nothing but the run.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path

import sentencepiece as spm

from mtcli.config import DataConfig
from mtcli.errors import MtcliError, error_text

PAD, UNK, BOS, EOS = 0, 1, 2, 3


@dataclass(frozen=True)
class Specials:
    """A vocabulary's special ids. bos is what the decoder starts from; MarianMT starts from its pad id."""

    pad: int = PAD
    unk: int = UNK
    bos: int = BOS
    eos: int = EOS


MTCLI_SPECIALS = Specials()
CJK_LANGS = {"zh", "ja", "zh-cn", "zh-tw", "zho", "jpn", "cmn"}


def word_separator(lang: str) -> str:
    """What goes between the translations of two pieces of one text: nothing for languages written without spaces
    (Chinese, Japanese), a space otherwise."""
    return "" if lang.lower() in CJK_LANGS else " "


def character_coverage(cfg: DataConfig) -> float:
    if cfg.character_coverage is not None:
        return cfg.character_coverage
    return 0.9995 if {cfg.src_lang, cfg.tgt_lang} & CJK_LANGS else 1.0


def normalization(cfg: DataConfig) -> str:
    # NFKC would turn Chinese full-width punctuation (，？！) into ASCII, so outputs would no longer match references.
    if cfg.spm_normalization is not None:
        return cfg.spm_normalization
    return "identity" if {cfg.src_lang, cfg.tgt_lang} & CJK_LANGS else "nmt_nfkc"


def train_sentencepiece(sentences: Iterable[str], out_path: Path, cfg: DataConfig, symbols: list[str] = ()) -> None:
    """Fit one SentencePiece model on `sentences` and write it to `out_path`; `symbols` (tags such as `<BT>`) become
    pieces of their own."""
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
            **({"user_defined_symbols": list(symbols)} if symbols else {}),
        )
    except RuntimeError as e:  # SentencePiece reports bad settings as RuntimeError("INTERNAL: <file>(<line>) ...")
        text = error_text(e, limit=1000)
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
    """Source and target SentencePiece models (the same object twice for a joint vocabulary); ids are SentencePiece's.

    `src_prefix` (data.src_prefix, e.g. `>>deu<<` for a multilingual opus-mt model) is put before every source line."""

    specials = MTCLI_SPECIALS

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
        if (folder / MarianVocabTokenizer.VOCAB).is_file():
            return MarianVocabTokenizer(folder)
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
        """The same kind of tokenizer with the same files, byte for byte: the same ids mean the same pieces."""
        mine, theirs = self.files(), other.files()
        return type(self) is type(other) and [p.read_bytes() for p in mine] == [p.read_bytes() for p in theirs]

    def files(self) -> list[Path]:
        """The files that define the vocabulary: what a cache key or a comparison must cover."""
        return [self.src_model_path] if self.joint else [self.src_model_path, self.tgt_model_path]

    def encode_src(self, lines: list[str], prefix: str = "") -> list[list[int]]:
        lines = [f"{prefix} {line}" for line in lines] if prefix else lines
        return self.src.encode(lines, out_type=int, num_threads=self.threads)

    def encode_tgt(self, lines: list[str]) -> list[list[int]]:
        return self.tgt.encode(lines, out_type=int, num_threads=self.threads)

    def src_pieces(self, ids: list[int]) -> list[str]:
        return [self.src.id_to_piece(i) for i in ids]

    def tgt_pieces(self, ids: list[int]) -> list[str]:
        return [self.tgt.id_to_piece(i) for i in ids]

    def has_source_symbols(self, symbols: Iterable[str]) -> bool:
        """Whether each symbol is one source piece of its own (a SentencePiece user-defined symbol, such as the term
        markers of a model trained with data.terminology), so that it survives anywhere in a line."""
        for symbol in symbols:
            pieces = [p for p in self.src_pieces(self.encode_src([f"a{symbol}a"])[0]) if p != "▁"]
            if symbol not in pieces:
                return False
        return True

    def decode_tgt(self, ids: list[list[int]]) -> list[str]:
        """Subword ids (specials are dropped) back to detokenized text, without surrounding whitespace (a lone final
        "▁" piece would leave a trailing space; MarianTokenizer strips it too, so exports decode alike)."""
        clean = [[i for i in seq if i > EOS] for seq in ids]
        return [text.strip() for text in self.tgt.decode(clean, num_threads=self.threads)]


class MarianVocabTokenizer(Tokenizer):
    """A MarianMT (opus-mt) tokenizer, as Transformers' MarianTokenizer computes it: SentencePiece cuts text into
    pieces (source.spm, target.spm), vocab.json maps pieces to model ids (target_vocab.json for the target side when
    the vocabularies are separate); a piece missing from it is <unk>. A leading language code such as `>>deu<<` is
    one token. Decoding maps ids back to pieces and joins them with SentencePiece (the source model's when the
    vocabulary is joint, as MarianTokenizer does)."""

    VOCAB, TARGET_VOCAB, SOURCE_SPM, TARGET_SPM = "vocab.json", "target_vocab.json", "source.spm", "target.spm"
    SPECIALS = "special_ids.json"  # from the model's config.json (written by the import): pad, unk, bos, eos

    def __init__(self, folder: Path):
        folder = Path(folder)
        self.folder = folder
        self.src_model_path, self.tgt_model_path = folder / self.SOURCE_SPM, folder / self.TARGET_SPM
        self.src = spm.SentencePieceProcessor(model_file=str(self.src_model_path))
        self.tgt = spm.SentencePieceProcessor(model_file=str(self.tgt_model_path))
        self.src_vocab = _read_vocab(folder / self.VOCAB)
        separate = (folder / self.TARGET_VOCAB).is_file()
        self.tgt_vocab = _read_vocab(folder / self.TARGET_VOCAB) if separate else self.src_vocab
        self.joint = not separate
        self.src_piece_of = {i: piece for piece, i in self.src_vocab.items()}
        self.tgt_piece_of = {i: piece for piece, i in self.tgt_vocab.items()}
        self.threads = os.cpu_count() or 1
        if (folder / self.SPECIALS).is_file():
            self.specials = _read_specials(folder / self.SPECIALS, min(len(self.src_vocab), len(self.tgt_vocab)))
        else:  # opus-mt's layout: the decoder starts from the pad token
            pad = self.tgt_vocab.get("<pad>", len(self.tgt_vocab) - 1)
            self.specials = Specials(pad=pad, unk=self.tgt_vocab["<unk>"], bos=pad, eos=self.tgt_vocab["</s>"])
        self._decoder_spm = self.tgt if separate else self.src

    def files(self) -> list[Path]:
        names = [self.SOURCE_SPM, self.TARGET_SPM, self.VOCAB] + ([] if self.joint else [self.TARGET_VOCAB])
        names += [self.SPECIALS] if (self.folder / self.SPECIALS).is_file() else []
        return [self.folder / name for name in names]

    def copy_to(self, folder: Path) -> None:
        for path in self.files():
            shutil.copyfile(path, Path(folder) / path.name)

    @property
    def src_vocab_size(self) -> int:
        return len(self.src_vocab)

    @property
    def tgt_vocab_size(self) -> int:
        return len(self.tgt_vocab)

    @staticmethod
    def _ids(lines: list[str], model, vocab: dict[str, int]) -> list[list[int]]:
        unk, out = vocab["<unk>"], []
        for line in lines:
            code = []
            if line.startswith(">>") and (end := line.find("<<")) != -1:  # MarianTokenizer.remove_language_code
                code, line = [line[: end + 2]], line[end + 2 :]
            out.append([vocab.get(piece, unk) for piece in code + model.encode(line, out_type=str)])
        return out

    def encode_src(self, lines: list[str], prefix: str = "") -> list[list[int]]:
        lines = [f"{prefix} {line}" for line in lines] if prefix else lines
        return self._ids(lines, self.src, self.src_vocab)

    def encode_tgt(self, lines: list[str]) -> list[list[int]]:
        return self._ids(lines, self.tgt, self.tgt_vocab)

    def src_pieces(self, ids: list[int]) -> list[str]:
        return [self.src_piece_of[i] for i in ids]

    def tgt_pieces(self, ids: list[int]) -> list[str]:
        return [self.tgt_piece_of[i] for i in ids]

    def decode_tgt(self, ids: list[list[int]]) -> list[str]:
        """Ids to text as MarianTokenizer.decode(skip_special_tokens=True) does: specials (and <unk>) dropped."""
        skip = {self.specials.pad, self.specials.bos, self.specials.eos, self.specials.unk}
        texts = []
        for seq in ids:
            pieces = self.tgt_pieces([i for i in seq if i not in skip])
            texts.append(self._decoder_spm.decode_pieces(pieces).replace("\u2581", " ").strip())
        return texts


def _read_vocab(path: Path) -> dict[str, int]:
    """A MarianMT vocabulary file: {piece: id}, the ids 0..n-1 each once."""
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MtcliError(f"{path}: not a readable vocabulary ({error_text(e)})") from None
    # every id an int (true and 1.0 are not ids; ids of mixed types cannot even be sorted), each of 0..n-1 once
    ids = list(vocab.values()) if isinstance(vocab, dict) else None
    if ids is None or any(type(i) is not int for i in ids) or sorted(ids) != list(range(len(ids))):
        raise MtcliError(f"{path}: expected a JSON object of pieces to the ids 0..n-1, each id once")
    for token in ("<unk>", "</s>"):
        if token not in vocab:
            raise MtcliError(f"{path}: no `{token}` entry; this is not a MarianMT vocabulary")
    return vocab


def _read_specials(path: Path, vocab_size: int) -> Specials:
    """special_ids.json: {"pad": id, "unk": id, "bos": id, "eos": id}, each id in the vocabulary (an id past it
    would fail deep inside the model, as an embedding's padding index)."""
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MtcliError(f"{path}: not readable JSON ({error_text(e)})") from None
    names = [f.name for f in fields(Specials)]
    if not isinstance(ids, dict) or sorted(ids) != sorted(names):
        raise MtcliError(f"{path}: expected a JSON object with exactly the ids {', '.join(names)}")
    bad = [k for k in names if type(ids[k]) is not int or not 0 <= ids[k] < vocab_size]
    if bad:
        raise MtcliError(f"{path}: the {', '.join(bad)} id must be an integer from 0 to {vocab_size - 1}")
    return Specials(**ids)
