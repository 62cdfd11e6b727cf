"""MarianMT (Hugging Face Transformers; the ~1,500 Helsinki-NLP opus-mt models) and mtcli: one map between their
weight names, used both ways (`mtcli import --hf` here, `mtcli export --format hf` in export.py).

An opus-mt model is the paper's post-norm Transformer with a few choices of its own, each held exactly by mtcli:
swish (SiLU) activations, a fixed output bias (`final_logits_bias`), embeddings scaled by sqrt(d_model), sinusoids
laid out as [sin | cos] halves, and its own vocabulary: vocab.json maps SentencePiece pieces to model ids (eos 0,
unk 1, pad = decoder start = the last id). mtcli keeps the model's ids (`MarianVocabTokenizer`) and turns the halves
layout into its interleaved one by permuting the model dimension, which changes no output. Blenderbot's
encoder-decoder, which mtcli's pre-norm models export to, imports back too (its layout is mtcli's; its stored
position table becomes mtcli's sinusoids when it holds them, a learned table otherwise). What mtcli cannot hold
exactly is refused with the reason, never imported approximately.
"""

from __future__ import annotations

import json
import pickle
import shutil
import warnings
from pathlib import Path

import torch

from mtcli.checkpoint import save_checkpoint, write_best
from mtcli.config import Config, DataConfig, DecodeConfig, ModelConfig
from mtcli.errors import MtcliError, error_text
from mtcli.hub import hub_offline, require_hub
from mtcli.log import logger
from mtcli.model import Transformer, sinusoidal_positions
from mtcli.outputs import check_folder_target, new_folder, refuse_input_overlap
from mtcli.parity import ParityOptions, TransformersEngine, run_parity
from mtcli.tokenizer import MarianVocabTokenizer
from mtcli.translate import Translator

# decode settings an HF export keeps for `mtcli import` (generation_config.json's mtcli_decode), beside those the
# generation config expresses itself: GNMT normalization and the per-sentence length limit have no place there
ROUND_TRIP = ("lenpen", "length_norm", "early_stopping", "max_len_a", "max_len_b", "min_len", "no_repeat_ngram")

# mtcli's names inside a layer -> the HF names whose rows, concatenated, make the tensor (fused q/k/v and k/v)
_SHARED_LAYER = {
    "self_attn.qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "self_attn.out": ["self_attn.out_proj"],
    "norm1": ["self_attn_layer_norm"],
    "ffn.up": ["fc1"],
    "ffn.down": ["fc2"],
}
_ENCODER_LAYER = {"norm2": ["final_layer_norm"]}
_DECODER_LAYER = {
    "cross_attn.q": ["encoder_attn.q_proj"],
    "cross_attn.kv": ["encoder_attn.k_proj", "encoder_attn.v_proj"],
    "cross_attn.out": ["encoder_attn.out_proj"],
    "norm2": ["encoder_attn_layer_norm"],
    "norm3": ["final_layer_norm"],
}


def layer_weight_map(n_encoder: int, n_decoder: int, pre_norm: bool) -> dict[str, list[str]]:
    """mtcli parameter name -> the HF parameter names (MarianMT, or Blenderbot for pre-norm) whose tensors,
    concatenated along dim 0, make it. Embeddings, output and positions are mapped by the callers."""
    names: dict[str, list[str]] = {}
    for side, n, own in (("encoder", n_encoder, _ENCODER_LAYER), ("decoder", n_decoder, _DECODER_LAYER)):
        for i in range(n):
            for mt, hf in {**_SHARED_LAYER, **own}.items():
                for kind in ("weight", "bias"):
                    names[f"{side}.{i}.{mt}.{kind}"] = [f"model.{side}.layers.{i}.{h}.{kind}" for h in hf]
    if pre_norm:  # the final LayerNorm of each stack
        for side in ("encoder", "decoder"):
            for kind in ("weight", "bias"):
                names[f"{side}_norm.{kind}"] = [f"model.{side}.layer_norm.{kind}"]
    return names


def interleaved_to_halves(d: int) -> torch.Tensor:
    """The permutation of the model dimension that turns mtcli's sinusoid layout (sin on even dimensions, cos on odd
    ones) into MarianMT's (sin on the first half, cos on the second): HF dimension j is mtcli dimension perm[j]."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def permute_model_dimension(sd: dict[str, torch.Tensor], perm: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same network with its residual stream's dimensions reordered by `perm` (new dimension j = old perm[j]):
    embeddings, LayerNorms, the inputs of every projection that reads the stream and the outputs of every one that
    writes it. LayerNorm and attention are indifferent to the order, so every output is unchanged."""
    out = {}
    for name, t in sd.items():
        if name.endswith(("embed.weight", "output.weight", "learned_positions.weight")):
            t = t[:, perm]  # (rows, d)
        elif "norm" in name or name.endswith((".out.weight", ".down.weight", ".out.bias", ".down.bias")):
            t = t[perm]  # LayerNorms, and the projections that write the stream: output rows
        elif name.endswith(("qkv.weight", ".q.weight", ".kv.weight", ".up.weight")):
            t = t[:, perm]  # reads the stream: input columns
        out[name] = t
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Import: an opus-mt folder (or Hub name) -> an mtcli run directory

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json")
ACTIVATIONS = {"swish": "swish", "silu": "swish", "relu": "relu", "gelu": "gelu"}


def resolve_source(source: str, revision: str | None = None) -> tuple[Path, Path]:
    """The model folder, and the folder its files may point into: a local MarianMT folder as it is (itself); a Hub
    name (`Helsinki-NLP/opus-mt-en-de`) downloaded with huggingface_hub, after a probe that fails within seconds when
    the Hub is out of reach (the snapshot's files link into the cached repository's blobs/)."""
    path = Path(source)
    if path.is_dir():
        return path, path
    if path.exists() or source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise MtcliError(f"--hf {source}: no such folder (give a MarianMT model folder or a Hub name)")
    if not hub_offline():
        require_hub(f"the model `{source}`", "A local folder works instead: mtcli import --hf PATH_TO_MODEL_FOLDER")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.spm", "*.safetensors", "pytorch_model.bin"]
    try:
        snapshot = Path(snapshot_download(source, revision=revision, allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001 - huggingface_hub raises many kinds: not found, gated, offline, ...
        reason = error_text(e, 300)
        raise MtcliError(f"--hf {source}: download failed ({reason}); a local model folder works too") from None
    return snapshot, snapshot.parents[1]  # <cache>/models--org--name/snapshots/<commit>


def inside(path: Path, root: Path) -> Path:
    """`path`, refused when it is a link that leads out of `root` (a model folder must not copy /etc/passwd)."""
    real, real_root = path.resolve(), root.resolve()
    if path.exists() and real != real_root and real_root not in real.parents:
        raise MtcliError(f"{path}: refused: it links to {real}, outside the model folder {root}; copy the real file in")
    return path


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise MtcliError(f"{path}: missing; a MarianMT model folder has config.json, {', '.join(TOKENIZER_FILES)}")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MtcliError(f"{path}: not valid JSON ({error_text(e)})") from None
    if not isinstance(value, dict):
        raise MtcliError(f"{path}: expected a JSON object")
    return value


# The Transformers architectures mtcli imports, and their layer norm: MarianMT (opus-mt, and mtcli's post-norm
# exports) and Blenderbot's encoder-decoder (mtcli's pre-norm exports: pre-norm layers, a final LayerNorm on each stack,
# one embedding matrix for both sides, a stored position table).
ARCHITECTURES = {"marian": "post", "blenderbot": "pre"}


def check_marian_config(hf: dict, where: Path) -> None:
    """Refuse, with the reason, what mtcli's Transformer cannot compute exactly."""

    def refuse(why: str) -> None:
        raise MtcliError(f"{where}: {why}; mtcli imports only what it computes exactly")

    if hf.get("model_type") not in ARCHITECTURES:
        refuse(
            f"model_type is `{hf.get('model_type')}`, not `marian` or `blenderbot` (mtcli imports MarianMT / opus-mt "
            "models, and the Blenderbot models its own pre-norm exports write)"
        )
    activation = hf.get("activation_function", "gelu")
    if activation not in ACTIVATIONS:
        refuse(f"activation_function `{activation}` (mtcli has {', '.join(sorted(ACTIVATIONS))})")
    for key in ("encoder_attention_heads", "encoder_ffn_dim"):
        other = key.replace("encoder", "decoder")
        if hf.get(key) != hf.get(other):
            refuse(f"{key} ({hf.get(key)}) differs from {other} ({hf.get(other)}): mtcli's stacks share one value")
    if hf["model_type"] == "blenderbot":
        return  # one embedding matrix for both sides, output tied or not: every layout mtcli holds
    if not hf.get("static_position_embeddings", True):
        refuse("learned position embeddings (static_position_embeddings: false)")
    if hf.get("normalize_before") or hf.get("normalize_embedding") or hf.get("add_final_layer_norm"):
        refuse("pre-norm or extra embedding LayerNorms (normalize_before / normalize_embedding)")
    shared = hf.get("share_encoder_decoder_embeddings", True)
    if shared and not hf.get("tie_word_embeddings", True):
        refuse("shared encoder/decoder embeddings with a separate output matrix (mtcli ties all three or none)")


def read_weights(folder: Path, root: Path | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, from model.safetensors or pytorch_model.bin. The .bin file is read with
    weights_only=True: a pickle that would run code is refused, never executed."""
    path = next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), None)
    if path is None:
        raise MtcliError(f"{folder}: no model.safetensors or pytorch_model.bin")
    inside(path, root or folder)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            weights = load_file(str(path))
        else:
            with warnings.catch_warnings():  # torch warns about pickle protocols before refusing: the error says it
                warnings.simplefilter("ignore")
                weights = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise MtcliError(
            f"{path}: refused: it holds pickled objects besides tensors, and loading them could run code; use a "
            "copy with model.safetensors from a source you trust"
        ) from None
    except Exception as e:  # noqa: BLE001 - a damaged or truncated file: one line whatever the library raised
        reason = error_text(e)
        raise MtcliError(f"{path}: not a readable checkpoint ({type(e).__name__}: {reason})") from None
    if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise MtcliError(f"{path}: expected a mapping of names to tensors")
    # Some older files omit the base model's `model.` prefix
    return {
        k if k.startswith(("model.", "lm_head", "final_logits_bias")) else f"model.{k}": v for k, v in weights.items()
    }


MAX_POSITIONS = 1 << 16  # no MarianMT model has more; a hostile config.json's 1e9 would allocate a 1e9 x d table


def check_weight_shapes(hf: dict, hf_sd: dict[str, torch.Tensor], where: Path) -> None:
    """config.json's sizes checked against the tensors the weights file holds, before a model of that size is built:
    a hostile or damaged config (a million layers, a billion positions) is refused instead of allocating gigabytes."""
    keys = ("d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads", "encoder_ffn_dim", "vocab_size")
    for key in (*keys, "max_position_embeddings", "decoder_vocab_size"):
        value = hf.get(key)
        if value is None and key in keys:
            raise MtcliError(f"{where}: `{key}` is missing; a MarianMT config.json names {', '.join(keys)}")
        if value is not None and (type(value) is not int or value < 1):
            raise MtcliError(f"{where}: `{key}` is {str(value)[:40]!r}; expected a positive whole number")
    if hf.get("max_position_embeddings", 1024) > MAX_POSITIONS:
        raise MtcliError(f"{where}: max_position_embeddings {hf['max_position_embeddings']} is over {MAX_POSITIONS}")
    if hf["d_model"] % hf["encoder_attention_heads"]:
        raise MtcliError(f"{where}: d_model {hf['d_model']} is not a multiple of {hf['encoder_attention_heads']} heads")
    embed = next((hf_sd[n] for n in ("model.shared.weight", "model.encoder.embed_tokens.weight") if n in hf_sd), None)
    found = {"d_model": None if embed is None else embed.shape[-1]}
    for side in ("encoder", "decoder"):
        layers = {int(n.split(".")[3]) for n in hf_sd if n.startswith(f"model.{side}.layers.") and n.count(".") > 4}
        found[f"{side}_layers"] = max(layers) + 1 if layers else 0
    fc1 = hf_sd.get("model.encoder.layers.0.fc1.weight")
    found["encoder_ffn_dim"] = None if fc1 is None else fc1.shape[0]
    for key, value in found.items():
        if value != hf[key]:
            raise MtcliError(f"{where}: `{key}` is {hf[key]}, but the weights file has {value}; the two do not match")


def position_table(hf_sd: dict[str, torch.Tensor], hf: dict, where: Path) -> torch.Tensor | None:
    """A Blenderbot model's stored position table (None for MarianMT, which computes its sinusoids). mtcli holds one
    table for both stacks, so the encoder's and the decoder's must be equal."""
    if hf["model_type"] != "blenderbot":
        return None
    names = [f"model.{side}.embed_positions.weight" for side in ("encoder", "decoder")]
    missing = [n for n in names if n not in hf_sd]
    if missing:
        raise MtcliError(f"{where}: the weights file has no {', '.join(missing)}")
    encoder, decoder = (hf_sd[n].float() for n in names)
    if encoder.shape != (hf.get("max_position_embeddings", 128), hf["d_model"]) or not torch.equal(encoder, decoder):
        raise MtcliError(
            f"{where}: the encoder's and decoder's position tables differ or do not have max_position_embeddings x "
            "d_model rows; mtcli's model has one table for both stacks"
        )
    return encoder


def positions_kind(table: torch.Tensor | None) -> str:
    """ "sinusoidal" when the model's positions are the paper's sinusoids (MarianMT; a Blenderbot table that holds
    them, as mtcli's own exports do), else "learned" (the table loaded as it is)."""
    if table is None or torch.allclose(table, sinusoidal_positions(*table.shape), atol=1e-6, rtol=0):
        return "sinusoidal"
    return "learned"


def mtcli_weights(hf_sd: dict[str, torch.Tensor], hf: dict, cfg) -> dict[str, torch.Tensor]:
    """HF MarianMT or Blenderbot tensors under mtcli's names (MarianMT's in mtcli's interleaved model dimension
    order)."""

    def first(*names: str) -> torch.Tensor:
        for name in names:
            if name in hf_sd:
                return hf_sd[name]
        raise MtcliError(f"the checkpoint has none of {', '.join(names)}")

    shared = hf.get("share_encoder_decoder_embeddings", True)
    src = first("model.encoder.embed_tokens.weight", "model.shared.weight")
    tgt = first("model.shared.weight") if shared else first("model.decoder.embed_tokens.weight")
    sd = {"src_embed.weight": src, "tgt_embed.weight": tgt}
    sd["output.weight"] = tgt if hf.get("tie_word_embeddings", True) else first("lm_head.weight")
    if "final_logits_bias" in hf_sd:
        sd["output_bias"] = hf_sd["final_logits_bias"].reshape(-1)
    else:
        sd["output_bias"] = torch.zeros(tgt.shape[0])
    pre_norm = hf["model_type"] == "blenderbot"
    for mt, names in layer_weight_map(cfg.n_encoder_layers, cfg.n_decoder_layers, pre_norm).items():
        sd[mt] = torch.cat([first(name) for name in names])
    if pre_norm:  # Blenderbot's layout is mtcli's: no permutation; its table is loaded when it is not the sinusoids
        if cfg.positions == "learned":
            sd["learned_positions.weight"] = first("model.encoder.embed_positions.weight")
        return {k: v.float().contiguous() for k, v in sd.items()}
    inverse = torch.argsort(interleaved_to_halves(cfg.d_model))  # halves -> mtcli's interleaved sinusoids
    return {k: v.float().contiguous() for k, v in permute_model_dimension(sd, inverse).items()}


def write_special_ids(hf: dict, folder: Path, out: Path) -> Path:
    """The model's special ids from config.json (opus-mt: eos 0, pad = decoder start = the last id; a model mtcli
    exported: its own 0-3), beside the vocabulary, where MarianVocabTokenizer reads them."""
    vocab = json.loads((out / "vocab.json").read_text(encoding="utf-8"))
    ids = {"pad": hf.get("pad_token_id"), "bos": hf.get("decoder_start_token_id"), "eos": hf.get("eos_token_id")}
    ids["unk"] = vocab.get("<unk>")
    size = hf.get("decoder_vocab_size") or hf.get("vocab_size")
    bad = [k for k, v in ids.items() if not isinstance(v, int) or not 0 <= v < (size or 0)]
    if bad:
        raise MtcliError(
            f"{folder / 'config.json'}: no valid {', '.join(bad)} token id (pad_token_id, eos_token_id, ...)"
        )
    path = out / "special_ids.json"
    path.write_text(json.dumps(ids), encoding="utf-8")
    return path


def copy_tokenizer_files(folder: Path, root: Path, separate: bool, out: Path) -> list[Path]:
    names = [*TOKENIZER_FILES, *(["target_vocab.json"] if separate else [])]
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise MtcliError(f"{folder}: missing {', '.join(missing)} (a MarianMT tokenizer needs {', '.join(names)})")
    for name in names:
        if name.endswith(".json"):
            check_vocab_json(inside(folder / name, root))
        shutil.copyfile(inside(folder / name, root), out / name)
    return [out / name for name in names]


def check_vocab_json(path: Path) -> None:
    """A vocabulary file is a JSON object of pieces to whole-number ids (MarianTokenizer's layout); anything else
    is refused here, naming the model's own file (the tokenizer checks the ids themselves later)."""
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MtcliError(f"{path}: not valid JSON ({error_text(e)})") from None
    expected = 'a JSON object of pieces to ids, {"</s>": 0, "<unk>": 1, ...} (as MarianTokenizer writes it)'
    if not isinstance(vocab, dict):
        kind = {list: "an array", str: "a string"}.get(type(vocab), "a single value")
        raise MtcliError(f"{path}: expected {expected}, found {kind}")
    wrong = next((piece for piece, i in vocab.items() if type(i) is not int), None)
    if wrong is not None:
        raise MtcliError(f"{path}: expected {expected}; the id of {wrong[:40]!r} is not a whole number")


def import_marian(
    source: str, out: Path, revision: str | None = None, force: bool = False, parity: ParityOptions | None = None
) -> Path:
    """Write an mtcli run directory (config.yaml, the tokenizer, checkpoints/update_00000000 as `best`) holding the
    MarianMT model at `source`; `translate`, `eval`, `export`, `train --set train.init_from=...` take it. `out` is a
    new or empty folder (or, with `force`, an earlier import): it is written whole or not at all (mtcli.outputs).
    With `parity`, the imported run and Transformers' `generate` on `source` translate a probe set and the run gets
    parity.json (mtcli.parity; refused past its thresholds); without transformers installed, a note says so."""

    out = Path(out)
    refuse_input_overlap(out, [source] if Path(source).exists() else [], "--out")
    check_folder_target(out, "import", force)  # before a download
    folder, root = resolve_source(source, revision)
    refuse_input_overlap(out, [folder], "--out")
    hf = read_json(inside(folder / "config.json", root))
    check_marian_config(hf, folder / "config.json")
    tokenizer_config = (
        read_json(inside(folder / "tokenizer_config.json", root))
        if (folder / "tokenizer_config.json").is_file()
        else {}
    )
    separate = bool(tokenizer_config.get("separate_vocabs", False))
    hf_sd = read_weights(folder, root)  # before anything is written
    check_weight_shapes(hf, hf_sd, folder / "config.json")  # before a model of config.json's size is built
    generation = read_optional_json(folder / "generation_config.json", root)
    with new_folder(out, "import", force) as work:
        copy_tokenizer_files(folder, root, separate, work)
        write_special_ids(hf, folder, work)
        try:
            tokenizer = MarianVocabTokenizer(work)
        except (RuntimeError, OSError, ValueError) as e:  # sentencepiece: "could not parse ModelProto", ...
            reason = error_text(e).replace(str(work), str(folder))
            raise MtcliError(f"{folder}: its tokenizer files (source.spm, target.spm) do not load ({reason})") from None
        except MtcliError as e:  # a vocabulary's ids: named as the model's own file, not the temporary copy
            raise MtcliError(str(e).replace(str(work), str(folder))) from None
        checkpoint = _import_into(
            work, out.name, folder, hf, hf_sd, tokenizer_config, generation, tokenizer, separate, source
        )
        if parity is not None:
            try:
                engine = TransformersEngine(folder)
            except ImportError:
                logger.info("note: no parity report: `transformers` is not installed (pip install 'mtcli[export]')")
            else:
                translator = Translator.from_checkpoint(checkpoint, "cpu", "fp32")
                run_parity(translator, engine, "hf", "float32", work, f"--out {out}", parity)
    return out


def _import_into(work: Path, name: str, folder, hf, hf_sd, tokenizer_config, generation, tokenizer, separate, source):
    """Fill the temporary run folder `work` (the run will be called `name`)."""

    sizes = {"vocab_size": tokenizer.src_vocab_size}
    sizes["decoder_vocab_size"] = tokenizer.tgt_vocab_size if separate else tokenizer.src_vocab_size
    for key, size in sizes.items():
        expected = hf.get(key) or hf.get("vocab_size")
        if size != expected:
            raise MtcliError(f"{folder}: config.json's {key} is {expected}, but the vocabulary file has {size} entries")
    positions = positions_kind(position_table(hf_sd, hf, folder / "config.json"))
    config = marian_run_config(hf, tokenizer_config, generation, name, separate, positions)
    model = Transformer(config.model, *sizes.values(), tokenizer.joint, tokenizer.specials)
    weights = mtcli_weights(hf_sd, hf, config.model)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise MtcliError(f"{folder}: the weights do not fit the model config.json describes ({str(e)[:300]})") from None
    (work / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
    path = save_checkpoint(work, 0, model, config, tokenizer, metadata={"imported_from": str(source)})
    write_best(work, path, 0, "imported")
    return path


def read_optional_json(path: Path, root: Path) -> dict:
    return read_json(inside(path, root)) if path.is_file() else {}


def marian_run_config(
    hf: dict, tokenizer_config: dict, generation: dict, name: str, separate: bool, positions: str = "sinusoidal"
):
    """The mtcli config of an imported model: its architecture, languages and the search `generate` runs with its
    generation config: beam size, length ** length_penalty (decode.length_norm power; Transformers' default 1.0)
    and its early_stopping; an mtcli export's own search where its generation config keeps it (mtcli_decode)."""

    model = ModelConfig(
        layers=hf["encoder_layers"],
        encoder_layers=hf["encoder_layers"],
        decoder_layers=hf["decoder_layers"],
        d_model=hf["d_model"],
        heads=hf["encoder_attention_heads"],
        d_ff=hf["encoder_ffn_dim"],
        dropout=hf.get("dropout", 0.1),
        attention_dropout=hf.get("attention_dropout", 0.0),
        activation_dropout=hf.get("activation_dropout", 0.0),
        activation=ACTIVATIONS[hf.get("activation_function", "gelu")],
        norm=ARCHITECTURES[hf["model_type"]],
        positions=positions,
        max_positions=hf.get("max_position_embeddings", 1024),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        scale_embedding=hf.get("scale_embedding", False),  # MarianConfig's defaults; opus-mt sets true
        output_bias=True,
    )
    src_lang, tgt_lang = tokenizer_config.get("source_lang") or "src", tokenizer_config.get("target_lang") or "tgt"
    data = DataConfig(src_lang=str(src_lang), tgt_lang=str(tgt_lang), joint_vocab=not separate)
    setting = lambda key, default: generation.get(key, hf.get(key, default))  # noqa: E731
    lenpen = float(setting("length_penalty", 1.0) or 0.0)
    if not 0 <= lenpen <= 10:
        logger.info(f"note: length_penalty {lenpen:g} is outside mtcli's 0 to 10: imported as 0")
        lenpen = 0.0
    beam = max(1, int(setting("num_beams", 4) or 4))
    if isinstance(generation.get("mtcli_decode"), dict):  # an mtcli export: the run's own search, GNMT included
        decode = DecodeConfig(beam=beam, **{k: v for k, v in generation["mtcli_decode"].items() if k in ROUND_TRIP})
    else:
        early = setting("early_stopping", False) is True  # "never" is the patient rule too
        decode = DecodeConfig(beam=beam, lenpen=lenpen, length_norm="power", early_stopping=early)
    return Config(name=name, data=data, model=model, decode=decode)
