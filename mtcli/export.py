"""Exports of a trained checkpoint to the tools people deploy: Hugging Face Transformers and CTranslate2.

- Hugging Face (`export_hf`): post-norm models become MarianMT (the paper's layout: post-norm layers, scaled
  embeddings, sinusoids that MarianMT computes itself as [sin | cos] halves, so the model dimension is permuted to
  that layout; mtcli.marian holds the map, which `mtcli import` reads the other way); pre-norm models become
  Blenderbot's encoder-decoder (pre-norm layers with a final LayerNorm on each stack, scaled embeddings, a stored
  position table into which mtcli's own table is written). The tokenizer is a MarianTokenizer over mtcli's
  SentencePiece model with mtcli's ids (or an imported model's own files), so `AutoTokenizer` segments as mtcli
  does. (M2M100/NLLB, the other pre-norm family, computes its sinusoids with other frequencies and offsets them by
  the pad id, in a table it does not load: it cannot hold an mtcli model exactly.) MarianMT holds every embedding
  layout mtcli trains (one shared matrix, separate vocabularies, untied output); Blenderbot has one embedding for
  encoder and decoder, so a pre-norm model with separate vocabularies or untied embeddings goes to CTranslate2.
- CTranslate2 (`export_ctranslate2`): a TransformerSpec filled from the checkpoint through CTranslate2's converter
  API (a `Converter` subclass), quantized as asked, with the SentencePiece model(s) beside it under a run
  directory's names (`spm.model`, or `spm.src.model` and `spm.tgt.model`). Any layout mtcli trains.

What cannot be expressed exactly is refused with the reason, never exported approximately. `transformers` and
`ctranslate2` are optional: `pip install 'mtcli[export]'`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from mtcli.checkpoint import load_model
from mtcli.config import DecodeConfig
from mtcli.errors import MtcliError
from mtcli.log import logger
from mtcli.marian import ROUND_TRIP, interleaved_to_halves, layer_weight_map, permute_model_dimension
from mtcli.outputs import check_folder_target, new_folder, refuse_input_overlap
from mtcli.parity import (
    CTranslate2Engine,
    ParityOptions,
    TransformersEngine,
    engine_settings,
    quiet_transformers,
    run_parity,
)
from mtcli.tokenizer import MarianVocabTokenizer
from mtcli.translate import Translator


def _need(module: str):
    try:
        return __import__(module)
    except ImportError:
        raise MtcliError(f"this export needs the `{module}` package: pip install 'mtcli[export]'") from None


def _position_table(model) -> torch.Tensor:
    """(max_positions, d_model): row t is what the model adds to the embedding of position t."""
    if model.cfg.positions == "learned":
        return model.learned_positions.weight.detach().clone()
    return model.sinusoids.detach().clone()


def _shares_embeddings(model) -> bool:
    """One embedding matrix for source and target tokens (a joint vocabulary with tied embeddings)."""
    return model.src_embed is model.tgt_embed


def _check_exportable_hf(model) -> None:
    """Refuse what Transformers cannot hold exactly. MarianMT (post-norm) holds every embedding layout: shared,
    separate vocabularies, untied; Blenderbot (pre-norm) has one embedding matrix for encoder and decoder."""
    if model.cfg.norm == "pre" and not _shares_embeddings(model):
        raise MtcliError(
            "export: a pre-norm model with separate source and target embeddings (data.joint_vocab: false or "
            "model.tie_embeddings: false) cannot be expressed in Transformers (its pre-norm architecture, Blenderbot, "
            "shares one embedding between encoder and decoder); export it with --format ctranslate2"
        )


# ---------------------------------------------------------------------------------------------------------------------
# Hugging Face Transformers


def export_hf(
    checkpoint: Path,
    out: Path,
    force: bool = False,
    parity: ParityOptions | None = None,
    decode: DecodeConfig | None = None,
) -> Path:
    """Write a Transformers model directory (config, safetensors weights, generation config, tokenizer) to `out`
    (a new or empty folder, or with `force` this export's own earlier output: see mtcli.outputs), with its parity
    report against mtcli (mtcli.parity; refused past its thresholds). parity None: no report. `decode`: the search
    settings to export (default: the checkpoint's own)."""
    transformers = _need("transformers")
    refuse_input_overlap(out, [checkpoint], "--out")
    check_folder_target(out, "export --format hf", force)  # before the model is built
    model, config, tokenizer = load_model(checkpoint, "cpu")
    config = replace(config, decode=decode or config.decode)
    _check_exportable_hf(model)
    c, specials = config.model, model.specials
    shared = _shares_embeddings(model)
    common = dict(
        vocab_size=tokenizer.src_vocab_size,
        d_model=c.d_model,
        encoder_layers=c.n_encoder_layers,
        decoder_layers=c.n_decoder_layers,
        encoder_attention_heads=c.heads,
        decoder_attention_heads=c.heads,
        encoder_ffn_dim=c.d_ff,
        decoder_ffn_dim=c.d_ff,
        activation_function=c.activation,  # HF's "gelu" is the exact (erf) GELU, as torch's; "swish" is SiLU
        max_position_embeddings=c.max_positions,
        dropout=c.dropout,
        attention_dropout=c.attention_dropout,
        activation_dropout=c.activation_dropout,
        scale_embedding=c.scale_embedding,
        pad_token_id=specials.pad,
        bos_token_id=specials.bos,
        eos_token_id=specials.eos,
        decoder_start_token_id=specials.bos,
        forced_eos_token_id=specials.eos,
        tie_word_embeddings=c.tie_embeddings,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
    )
    if c.norm == "post":
        hf_config = transformers.MarianConfig(
            decoder_vocab_size=tokenizer.tgt_vocab_size, share_encoder_decoder_embeddings=shared, **common
        )
        hf_model = transformers.MarianMTModel(hf_config)
    else:
        hf_model = transformers.BlenderbotForConditionalGeneration(transformers.BlenderbotConfig(**common))
    try:
        hf_model.load_state_dict(_hf_state_dict(model, hf_model.state_dict()), strict=True)
    except RuntimeError as e:  # a transformers version whose names differ
        raise MtcliError(f"export: weights do not map onto {type(hf_model).__name__}: {str(e)[:300]}") from None
    hf_model.generation_config = transformers.GenerationConfig(**_generation_settings(config, specials))
    with new_folder(out, "export --format hf", force) as folder, quiet_transformers(transformers):
        hf_model.save_pretrained(folder)
        _save_hf_tokenizer(tokenizer, config, folder, transformers)
        if parity is not None:
            translator = parity_translator(checkpoint, config)
            engine = TransformersEngine(folder, config.source_prefix())
            run_parity(translator, engine, "hf", "float32", folder, f"--out {out}", parity)
    logger.info(f"exported {checkpoint} as {type(hf_model).__name__} ({c.norm}-norm) to {out}")
    return out


def _generation_settings(config, specials) -> dict:
    """generation_config.json: the run's search, as far as Transformers expresses it. A greedy run (beam 1) gets no
    beam-only settings (length_penalty, early_stopping): Transformers refuses to save, or load, a config that sets
    them without beams; `mtcli import` finds them in mtcli_decode all the same."""
    search, _ = engine_settings(config.decode, "hf", config.model.max_positions)
    settings = dict(
        decoder_start_token_id=specials.bos,
        bos_token_id=specials.bos,
        eos_token_id=specials.eos,
        pad_token_id=specials.pad,
        suppress_tokens=sorted({specials.pad, specials.bos}),  # as mtcli's search: never padding or a second BOS
        min_new_tokens=search.min_len,  # as mtcli's search: no EOS before the first token (by default)
        num_beams=config.decode.beam,
        no_repeat_ngram_size=search.no_repeat_ngram,
        max_length=config.model.max_positions,
        mtcli_decode={k: getattr(config.decode, k) for k in ROUND_TRIP},  # `mtcli import` reads the run's search
    )
    if config.decode.beam > 1:
        settings["length_penalty"] = search.lenpen  # power: score / length ** lenpen (GNMT's is not expressible)
        settings["early_stopping"] = search.early_stopping
    return settings


def _hf_state_dict(model, reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """mtcli's weights under the names of HF's Marian/Blenderbot models (same structure, fused matrices split;
    mtcli.marian holds the map, which the import reads the other way). MarianMT computes its own sinusoid table on
    loading (sin half, cos half), so for it the model dimension is permuted to that layout; Blenderbot loads mtcli's
    table as it is."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    marian = model.cfg.norm == "post"
    if marian:
        if model.cfg.positions != "sinusoidal":
            raise MtcliError(
                "export: a post-norm model with learned positions cannot be expressed in MarianMT (it computes its "
                "sinusoid table when loading)"
            )
        perm = interleaved_to_halves(model.cfg.d_model)
        sd = permute_model_dimension(sd, perm)
        if not torch.allclose(model.sinusoids[:, perm], reference["model.encoder.embed_positions.weight"], atol=1e-5):
            raise MtcliError("export: MarianMT's sinusoid table does not match mtcli's in this transformers version")
    bias = sd.get("output_bias")
    out = {"final_logits_bias": (bias if bias is not None else torch.zeros(sd["output.weight"].shape[0]))[None]}
    if "model.shared.weight" in reference:  # one matrix for both sides; otherwise each stack has its own
        out["model.shared.weight"] = sd["src_embed.weight"]
    out["model.encoder.embed_tokens.weight"] = sd["src_embed.weight"]
    out["model.decoder.embed_tokens.weight"] = sd["tgt_embed.weight"]
    out["lm_head.weight"] = sd["output.weight"]
    positions = reference["model.encoder.embed_positions.weight"] if marian else _position_table(model)
    out["model.encoder.embed_positions.weight"] = positions
    out["model.decoder.embed_positions.weight"] = positions
    c = model.cfg
    for mt, hf_names in layer_weight_map(c.n_encoder_layers, c.n_decoder_layers, c.norm == "pre").items():
        for name, part in zip(hf_names, sd[mt].chunk(len(hf_names))):  # a fused [q; k; v] (or [k; v]) into parts
            out[name] = part
    return {k: v.contiguous().clone() for k, v in out.items()}


def _save_hf_tokenizer(tokenizer, config, out: Path, transformers) -> None:
    """A MarianTokenizer: an imported model's own files as they were; for mtcli's SentencePiece model(s), the pieces
    SentencePiece makes mapped to mtcli's ids (with separate vocabularies, a vocabulary for each side)."""
    work = out / ".tokenizer-src"
    work.mkdir(exist_ok=True)
    try:
        if isinstance(tokenizer, MarianVocabTokenizer):
            tokenizer.copy_to(work)
        else:
            shutil.copyfile(tokenizer.src_model_path, work / "source.spm")
            shutil.copyfile(tokenizer.tgt_model_path, work / "target.spm")
            for side, spm in (("vocab.json", tokenizer.src), ("target_vocab.json", tokenizer.tgt)):
                if side == "vocab.json" or not tokenizer.joint:
                    pieces = {spm.id_to_piece(i): i for i in range(spm.get_piece_size())}
                    (work / side).write_text(json.dumps(pieces, ensure_ascii=False), encoding="utf-8")
        separate = {}
        if not tokenizer.joint:
            separate = dict(separate_vocabs=True, target_vocab_file=str(work / "target_vocab.json"))
        s = tokenizer.specials
        pad, unk, eos = tokenizer.tgt_pieces([s.pad, s.unk, s.eos])
        hf_tokenizer = transformers.MarianTokenizer(
            source_spm=str(work / "source.spm"),
            target_spm=str(work / "target.spm"),
            vocab=str(work / "vocab.json"),
            source_lang=config.data.src_lang,
            target_lang=config.data.tgt_lang,
            unk_token=unk,
            eos_token=eos,
            pad_token=pad,
            model_max_length=config.model.max_positions - 1,
            **separate,
        )
        hf_tokenizer.save_pretrained(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------------
# CTranslate2


def export_ctranslate2(
    checkpoint: Path,
    out: Path,
    quantization: str | None = None,
    force: bool = False,
    parity: ParityOptions | None = None,
    decode: DecodeConfig | None = None,
) -> Path:
    """Write a CTranslate2 model directory (see write_ctranslate2) to `out`: a new or empty folder, or with `force`
    this export's own earlier output (see mtcli.outputs)."""
    _need("ctranslate2")
    refuse_input_overlap(out, [checkpoint], "--out")
    check_folder_target(out, "export --format ctranslate2", force)
    with new_folder(out, "export --format ctranslate2", force) as folder:
        write_ctranslate2(checkpoint, folder, quantization, parity, decode, f"--out {out}")
    logger.info(f"exported {checkpoint} to CTranslate2 ({quantization or 'float32'}) in {out}")
    return out


def write_ctranslate2(
    checkpoint: Path,
    folder: Path,
    quantization: str | None = None,
    parity: ParityOptions | None = None,
    decode: DecodeConfig | None = None,
    name: str = "export",
) -> None:
    """Fill `folder` (the converter empties it first) with a CTranslate2 model (weights quantized as asked), the
    SentencePiece model beside it, and its parity report against mtcli (refused past its thresholds; `name` is how
    the refusal names the export). mtcli.json records the languages and the translate_batch arguments of the run's
    search (CTranslate2 keeps no decode settings of its own); `decode` as in export_hf."""
    ctranslate2 = _need("ctranslate2")
    from ctranslate2.converters.converter import Converter

    model, config, tokenizer = load_model(checkpoint, "cpu")
    config = replace(config, decode=decode or config.decode)

    class MtcliConverter(Converter):
        def _load(self):
            return _ctranslate2_spec(model, tokenizer, ctranslate2, config.alignment_heads)

    # the converter empties its output folder first (force=True): a temporary folder, never the user's target
    MtcliConverter().convert(
        str(folder), quantization=None if quantization in (None, "none") else quantization, force=True
    )
    tokenizer.copy_to(folder)  # spm.model, or spm.src.model and spm.tgt.model: the names a run directory uses
    languages = {"src_lang": config.data.src_lang, "tgt_lang": config.data.tgt_lang}
    search, _ = engine_settings(config.decode, "ctranslate2", config.model.max_positions)
    translate_batch = {
        "beam_size": config.decode.beam,
        "length_penalty": search.lenpen,
        "min_decoding_length": search.min_len,
        "max_decoding_length": search.max_len,
        "no_repeat_ngram_size": search.no_repeat_ngram,
    }
    meta = {"checkpoint": str(checkpoint), **languages, "src_prefix": config.source_prefix()}
    text = json.dumps(meta | {"translate_batch": translate_batch}, indent=1, ensure_ascii=False)
    (folder / "mtcli.json").write_text(text, encoding="utf-8")
    if parity is not None:
        translator = parity_translator(checkpoint, config)
        engine = CTranslate2Engine(folder, config.source_prefix(), translator.max_src_tokens)
        precision = quantization if quantization not in (None, "none") else "float32"
        run_parity(translator, engine, "ctranslate2", precision, folder, name, parity)


def parity_translator(checkpoint: Path, config) -> Translator:
    """mtcli in float32 on the CPU, with the export's decode settings: the reference the export is compared with."""
    translator = Translator.from_checkpoint(checkpoint, "cpu", "fp32")
    translator.config = replace(translator.config, decode=config.decode)
    return translator


def _ctranslate2_spec(model, tokenizer, ctranslate2, align_heads: int):
    from ctranslate2.specs import common_spec, transformer_spec

    c, specials = model.cfg, model.specials
    activations = {"gelu": "GELU", "relu": "RELU", "swish": "SWISH"}
    activation = getattr(common_spec.Activation, activations[c.activation])
    spec = transformer_spec.TransformerSpec.from_config(
        (c.n_encoder_layers, c.n_decoder_layers),
        c.heads,
        pre_norm=c.norm == "pre",
        activation=activation,
        # return_attention gives these heads' averaged attention: the export aligns words as mtcli does
        alignment_layer=c.alignment_layer_index,
        alignment_heads=align_heads,
    )
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    positions = _position_table(model).numpy()

    def linear(spec_, name):
        spec_.weight, spec_.bias = sd[f"{name}.weight"], sd[f"{name}.bias"]

    def norm(spec_, name):
        spec_.gamma, spec_.beta = sd[f"{name}.weight"], sd[f"{name}.bias"]

    for stack_spec, side, embed in ((spec.encoder, "encoder", "src_embed"), (spec.decoder, "decoder", "tgt_embed")):
        embeddings = stack_spec.embeddings[0] if isinstance(stack_spec.embeddings, list) else stack_spec.embeddings
        embeddings.weight = sd[f"{embed}.weight"]
        stack_spec.scale_embeddings = c.scale_embedding
        stack_spec.position_encodings.encodings = positions
        if c.norm == "pre":
            norm(stack_spec.layer_norm, f"{side}_norm")
        for i, layer in enumerate(stack_spec.layer):
            mt = f"{side}.{i}"
            linear(layer.self_attention.linear[0], f"{mt}.self_attn.qkv")  # fused [q; k; v], as CTranslate2's
            linear(layer.self_attention.linear[1], f"{mt}.self_attn.out")
            norm(layer.self_attention.layer_norm, f"{mt}.norm1")
            linear(layer.ffn.linear_0, f"{mt}.ffn.up")
            linear(layer.ffn.linear_1, f"{mt}.ffn.down")
            if side == "encoder":
                norm(layer.ffn.layer_norm, f"{mt}.norm2")
                continue
            linear(layer.attention.linear[0], f"{mt}.cross_attn.q")
            linear(layer.attention.linear[1], f"{mt}.cross_attn.kv")  # fused [k; v]
            linear(layer.attention.linear[2], f"{mt}.cross_attn.out")
            norm(layer.attention.layer_norm, f"{mt}.norm2")
            norm(layer.ffn.layer_norm, f"{mt}.norm3")
    spec.decoder.projection.weight = sd["output.weight"]
    if "output_bias" in sd:
        spec.decoder.projection.bias = sd["output_bias"]
    pieces = tokenizer.tgt_pieces(range(tokenizer.tgt_vocab_size))
    spec.register_source_vocabulary(tokenizer.src_pieces(range(tokenizer.src_vocab_size)))
    spec.register_target_vocabulary(pieces)
    spec.config.bos_token, spec.config.eos_token = pieces[specials.bos], pieces[specials.eos]
    spec.config.unk_token, spec.config.decoder_start_token = pieces[specials.unk], pieces[specials.bos]
    spec.config.add_source_eos = True  # mtcli's sources end in EOS
    return spec
