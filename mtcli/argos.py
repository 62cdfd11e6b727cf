"""`.argosmodel` packages: what Argos Translate (and LibreTranslate, built on it) installs.

A package is a zip holding one folder (`translate-<from>_<to>-<version>`, the name it is installed under) with
`metadata.json` (language codes and names, versions), `model/` (a CTranslate2 model: mtcli.export writes it),
`sentencepiece.model` (one model for both sides: Argos encodes sources and decodes outputs with it), `minisbd/`
(the sentence splitter Argos runs first) and a README. Argos Translate 1.10+ splits sentences with MiniSBD, an ONNX
model it would otherwise download per language; the package carries its own, written here: a rule that ends a
sentence at . ! ? (and their CJK forms) followed by a space or the end, so no network is needed.

The ONNX file is a few hundred bytes of protobuf, encoded below field by field (onnx.proto's field numbers), rather
than with the `onnx` package, a dependency for one tiny file.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zipfile
from pathlib import Path

from mtcli.checkpoint import read_tokenizer
from mtcli.config import DecodeConfig
from mtcli.errors import MtcliError
from mtcli.export import write_ctranslate2
from mtcli.log import logger
from mtcli.outputs import MANIFEST, check_file_target, new_file, remove_stale_siblings
from mtcli.parity import ParityOptions, file_record, report_text
from mtcli.tokenizer import Tokenizer

ARGOS_VERSION = "1.11"  # the Argos Translate version the layout was tested with (tests/test_argos.py)
SENTENCE_ENDS = [".", "!", "?", "\u3002", "\uff01", "\uff1f"]  # . ! ? and the full-width 。！？
LANGUAGE_NAMES = {
    "ar": "Arabic", "bg": "Bulgarian", "bn": "Bengali", "ca": "Catalan", "cs": "Czech", "da": "Danish",
    "de": "German", "el": "Greek", "en": "English", "eo": "Esperanto", "es": "Spanish", "et": "Estonian",
    "eu": "Basque", "fa": "Persian", "fi": "Finnish", "fr": "French", "ga": "Irish", "gl": "Galician",
    "he": "Hebrew", "hi": "Hindi", "hu": "Hungarian", "id": "Indonesian", "it": "Italian", "ja": "Japanese",
    "ko": "Korean", "lt": "Lithuanian", "lv": "Latvian", "ms": "Malay", "nb": "Norwegian", "nl": "Dutch",
    "pl": "Polish", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian", "sk": "Slovak", "sl": "Slovenian",
    "sq": "Albanian", "sv": "Swedish", "th": "Thai", "tl": "Tagalog", "tr": "Turkish", "uk": "Ukrainian",
    "ur": "Urdu", "vi": "Vietnamese", "zh": "Chinese",
}  # fmt: skip


def export_argos(
    checkpoint: Path,
    out: Path,
    quantization: str | None = None,
    force: bool = False,
    parity: ParityOptions | None = None,
    decode: DecodeConfig | None = None,
    version: str = "1.0",
) -> Path:
    """Write `out` (a .argosmodel file): the CTranslate2 export of `checkpoint` (quantized as asked, with its parity
    report) in Argos Translate's package layout."""
    out = Path(out)
    if out.suffix != ".argosmodel":
        raise MtcliError(f"--out {out}: name a .argosmodel file (Argos Translate installs packages by that name)")
    check_file_target(out, force, [checkpoint], "--out")
    tokenizer = read_tokenizer(checkpoint)
    if type(tokenizer) is not Tokenizer or not tokenizer.joint:
        raise MtcliError(
            "export --format argos: Argos Translate encodes and decodes with one SentencePiece model; this model has "
            "separate source and target vocabularies (or an imported vocab.json): use --format ctranslate2"
        )
    # the work folder is named after `out` with this process's id, so a killed export's is removed by the next one
    work = out.parent / f".{out.name}.work-{os.getpid()}"
    remove_stale_siblings(out)
    shutil.rmtree(work, ignore_errors=True)
    try:
        write_ctranslate2(checkpoint, work / "model", quantization, parity, decode, f"--out {out}")
        ct2 = work / "model"
        meta = json.loads((ct2 / "mtcli.json").read_text(encoding="utf-8"))
        if meta.get("src_prefix"):
            raise MtcliError(
                f"export --format argos: the model needs the source prefix {meta['src_prefix']!r}, which Argos "
                "Translate cannot add; use --format ctranslate2"
            )
        src, tgt = meta["src_lang"], meta["tgt_lang"]
        top = f"translate-{src}_{tgt}-{version.replace('.', '_')}"
        metadata = {
            "package_version": version,
            "argos_version": ARGOS_VERSION,
            "from_code": src,
            "from_name": LANGUAGE_NAMES.get(src, src),
            "to_code": tgt,
            "to_name": LANGUAGE_NAMES.get(tgt, tgt),
            "type": "translate",
            "links": [],
        }
        card = _model_card(checkpoint)
        if card is not None:
            metadata["model_card"] = card
        # the package's files (a path, or bytes) under their names inside its folder
        files: dict[str, Path | bytes] = {"metadata.json": json.dumps(metadata, indent=1, ensure_ascii=False).encode()}
        for path in sorted(ct2.iterdir()):  # CTranslate2's files into model/
            if path.name not in ("spm.model", "mtcli.json", "parity.json", MANIFEST):
                files[f"model/{path.name}"] = path
        files["sentencepiece.model"] = ct2 / "spm.model"
        files[f"minisbd/{src}.onnx"] = sentence_splitter_onnx(src)
        files["README.md"] = _readme(metadata, checkpoint, meta["translate_batch"]).encode()
        with new_file(out, force, [checkpoint], "--out", binary=True) as handle:
            with zipfile.ZipFile(handle, "w", zipfile.ZIP_DEFLATED) as package:
                for name, data in files.items():
                    if isinstance(data, Path):
                        package.write(data, f"{top}/{name}")
                    else:
                        package.writestr(f"{top}/{name}", data)
                if (ct2 / "parity.json").is_file():  # the report, bound to the package's own files
                    report = json.loads((ct2 / "parity.json").read_text(encoding="utf-8"))
                    report["files"] = {name: _record(data) for name, data in files.items()}
                    package.writestr(f"{top}/parity.json", report_text(report))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    logger.info(f"exported {checkpoint} as an Argos Translate package ({src} -> {tgt}) to {out}")
    return out


def _record(data: Path | bytes) -> dict:
    if isinstance(data, bytes):
        return file_record(data)
    with open(data, "rb") as f:
        return file_record(f)


def _model_card(checkpoint: Path) -> dict | None:
    """The figures of the run's model_card.json (mtcli distill writes one), when there is one."""
    for folder in (checkpoint.parent.parent, checkpoint.parent):
        path = folder / "model_card.json"
        if path.is_file():
            try:
                return json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return None
    return None


def _readme(metadata: dict, checkpoint: Path, search: dict) -> str:
    return (
        f"# {metadata['from_name']} -> {metadata['to_name']}\n\n"
        f"Trained with mtcli; exported from {checkpoint.name}. The parity report of the CTranslate2 model inside "
        "is parity.json.\n\n"
        "Argos Translate decodes with its own settings (beam ARGOS_BEAM_SIZE, default 4; length penalty 0.2; "
        "compute type ARGOS_COMPUTE_TYPE, default auto, which is int8 on many CPUs). The run's own search is "
        f"translate_batch({', '.join(f'{k}={v}' for k, v in search.items())}).\n"
    )


# ---------------------------------------------------------------------------------------------------------------------
# A rule-based MiniSBD model in ONNX


def sentence_splitter_onnx(lang: str) -> bytes:
    """MiniSBD's interface: inputs `units` (int64 [B, T], character ids from the vocabulary in the metadata) and
    `features` (float [B, T, F], unused here); output [B, T, 5] scores over (no break, token end, sentence end, two
    multi-word-token classes). A character in SENTENCE_ENDS followed by a space or the end gets "sentence end"."""
    units = ["<PAD>", "<UNK>", " ", *SENTENCE_ENDS]  # MiniSBD pads with id 0
    ends = [2 if u in SENTENCE_ENDS else 0 for u in units]  # 2: the "sentence end" class
    after = [1 if u in ("<PAD>", " ") else 0 for u in units]  # what may follow a sentence end
    classes = [[1.0, 0, 0, 0, 0], [1.0, 0, 0, 0, 0], [0, 0, 1.0, 0, 0]]  # class index 0 or 2 -> scores
    initializers = [
        _tensor("ends", [len(units)], 7, struct.pack(f"<{len(ends)}q", *ends)),
        _tensor("after", [len(units)], 7, struct.pack(f"<{len(after)}q", *after)),
        _tensor("starts", [1], 7, struct.pack("<q", 1)),
        _tensor("stops", [1], 7, struct.pack("<q", 2**62)),
        _tensor("axes", [1], 7, struct.pack("<q", 1)),
        _tensor("pads", [4], 7, struct.pack("<4q", 0, 0, 0, 1)),  # one PAD after the last character
        _tensor("classes", [3, 5], 1, struct.pack("<15f", *[x for row in classes for x in row])),
    ]
    nodes = [
        _node("Gather", ["ends", "units"], "is_end"),
        _node("Slice", ["units", "starts", "stops", "axes"], "next_units"),  # the character after each
        _node("Pad", ["next_units", "pads"], "next_padded"),
        _node("Gather", ["after", "next_padded"], "then_break"),
        _node("Mul", ["is_end", "then_break"], "class_index"),
        _node("Gather", ["classes", "class_index"], "logits"),
    ]
    graph = (
        b"".join(_field(1, n) for n in nodes)
        + _field(2, b"mtcli_sentence_ends")
        + b"".join(_field(5, t) for t in initializers)
        + _field(11, _value_info("units", 7, ["B", "T"]))
        + _field(11, _value_info("features", 1, ["B", "T", "F"]))
        + _field(12, _value_info("logits", 1, ["B", "T", 5]))
    )
    config = {"skip_newline": False, "max_seqlen": 1000, "no_ssplit": False, "batch_size": 32, "feat_funcs": []}
    vocab = {"lang": lang, "idx": 0, "cutoff": 0, "lower": False, "_unit2id": {u: i for i, u in enumerate(units)}}
    vocab["_id2unit"] = units
    config_text, vocab_text = json.dumps(config), json.dumps(vocab, ensure_ascii=False)
    metadata = {"lang_code": lang, "config": config_text, "vocab": vocab_text, "lexicon": "null"}
    return (
        _varint_field(1, 8)  # ir_version
        + _field(2, b"mtcli")  # producer_name
        + _field(7, graph)
        + _field(8, _field(1, b"") + _varint_field(2, 13))  # opset_import: the default domain, opset 13
        + b"".join(_field(14, _field(1, k.encode()) + _field(2, v.encode())) for k, v in metadata.items())
    )


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _varint_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _field(number: int, data: bytes | str) -> bytes:
    """A length-delimited field (a string, bytes or an embedded message)."""
    data = data.encode() if isinstance(data, str) else data
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _tensor(name: str, dims: list[int], data_type: int, raw: bytes) -> bytes:
    """TensorProto: dims (1), data_type (2: 1 float, 7 int64), name (8), raw_data (9, little-endian)."""
    return b"".join(_varint_field(1, d) for d in dims) + _varint_field(2, data_type) + _field(8, name) + _field(9, raw)


def _node(op: str, inputs: list[str], output: str) -> bytes:
    """NodeProto: input (1), output (2), name (3), op_type (4)."""
    return b"".join(_field(1, i) for i in inputs) + _field(2, output) + _field(3, output) + _field(4, op)


def _value_info(name: str, elem_type: int, shape: list[str | int]) -> bytes:
    """ValueInfoProto: name (1), type (2) = TypeProto.tensor_type (1) = elem_type (1), shape (2) of dims (1), each a
    dim_value (1) or a dim_param (2)."""
    dims = b"".join(_field(1, _varint_field(1, d) if isinstance(d, int) else _field(2, d)) for d in shape)
    return _field(1, name) + _field(2, _field(1, _varint_field(1, elem_type) + _field(2, dims)))
