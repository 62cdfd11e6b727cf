"""Exports of a trained checkpoint to the tools people deploy: Hugging Face Transformers and CTranslate2.

- Hugging Face (`export_hf`): post-norm models become MarianMT (the paper's layout: post-norm layers, scaled
  embeddings, sinusoidal positions stored as a table); pre-norm models become Blenderbot's encoder-decoder (pre-norm
  layers with a final LayerNorm on each stack, scaled embeddings, a stored position table). mtcli's own position table
  (interleaved sin/cos, or the learned one) is written into the model's position weights, so no permutation of the
  model dimension is needed. The tokenizer is a MarianTokenizer over mtcli's SentencePiece model with mtcli's ids,
  so `AutoTokenizer` segments exactly as mtcli does. (M2M100/NLLB, the other pre-norm family, computes its
  sinusoids with other frequencies and offsets them by the pad id, in a table it does not load: it cannot hold an
  mtcli model exactly.) MarianMT holds every embedding layout mtcli trains (one shared matrix, separate
  vocabularies, untied output); Blenderbot has one embedding for encoder and decoder, so a pre-norm model with
  separate vocabularies or untied embeddings goes to CTranslate2 instead.
- CTranslate2 (`export_ctranslate2`): a TransformerSpec filled from the checkpoint through CTranslate2's converter
  API (a `Converter` subclass), quantized as asked, with the SentencePiece model(s) beside it under a run
  directory's names (`spm.model`, or `spm.src.model` and `spm.tgt.model`). Any layout mtcli trains.

What cannot be expressed exactly is refused with the reason, never exported approximately. `transformers` and
`ctranslate2` are optional: `pip install 'mtcli[export]'`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from mtcli.checkpoint import load_model
from mtcli.errors import MtcliError
from mtcli.log import logger
from mtcli.tokenizer import BOS, EOS, PAD, UNK


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


def export_hf(checkpoint: Path, out: Path) -> Path:
    """Write a Transformers model directory (config, safetensors weights, generation config, tokenizer) to `out`."""
    transformers = _need("transformers")
    model, config, tokenizer = load_model(checkpoint, "cpu")
    _check_exportable_hf(model)
    c = config.model
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
        activation_function=c.activation,  # HF's "gelu" is the exact (erf) GELU, as torch's default
        max_position_embeddings=c.max_positions,
        dropout=c.dropout,
        attention_dropout=c.attention_dropout,
        activation_dropout=c.activation_dropout,
        scale_embedding=True,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        decoder_start_token_id=BOS,
        forced_eos_token_id=EOS,
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
    hf_model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=BOS,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        suppress_tokens=[PAD, BOS],  # as mtcli's search: never emit padding or a second BOS
        num_beams=config.decode.beam,
        length_penalty=config.decode.lenpen,
        max_length=c.max_positions,
    )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(out)
    _save_hf_tokenizer(tokenizer, config, out, transformers)
    logger.info(f"exported {checkpoint} as {type(hf_model).__name__} ({c.norm}-norm) to {out}")
    return out


def _interleaved_to_halves(d: int) -> torch.Tensor:
    """The permutation of the model dimension that turns mtcli's sinusoid layout (sin on even dimensions, cos on odd
    ones) into MarianMT's (sin on the first half, cos on the second): HF dimension j is mtcli dimension perm[j]."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def _permute_model_dimension(sd: dict[str, torch.Tensor], perm: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same network with its residual stream's dimensions reordered by `perm`: embeddings, LayerNorms, the
    inputs of every projection that reads the stream and the outputs of every one that writes it. LayerNorm and
    attention are indifferent to the order, so every output is unchanged."""
    out = {}
    for name, t in sd.items():
        if name.endswith(("embed.weight", "output.weight", "learned_positions.weight")):
            t = t[:, perm]  # (rows, d)
        elif "norm" in name:
            t = t[perm]
        elif name.endswith((".out.weight", ".down.weight")):
            t = t[perm]  # writes the stream: output rows
        elif name.endswith((".out.bias", ".down.bias")):
            t = t[perm]
        elif name.endswith(("qkv.weight", ".q.weight", ".kv.weight", ".up.weight")):
            t = t[:, perm]  # reads the stream: input columns
        out[name] = t
    return out


def _hf_state_dict(model, reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """mtcli's weights under the names of HF's Marian/Blenderbot models (same structure, fused matrices split).
    MarianMT computes its own sinusoid table on loading (sin half, cos half), so for it the model dimension is
    permuted to that layout; Blenderbot loads mtcli's table as it is."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    d = model.cfg.d_model
    marian = model.cfg.norm == "post"
    if marian:
        if model.cfg.positions != "sinusoidal":
            raise MtcliError(
                "export: a post-norm model with learned positions cannot be expressed in MarianMT (it computes its "
                "sinusoid table when loading)"
            )
        perm = _interleaved_to_halves(d)
        sd = _permute_model_dimension(sd, perm)
        if not torch.allclose(model.sinusoids[:, perm], reference["model.encoder.embed_positions.weight"], atol=1e-5):
            raise MtcliError("export: MarianMT's sinusoid table does not match mtcli's in this transformers version")
    out = {"final_logits_bias": torch.zeros_like(reference["final_logits_bias"])}
    if "model.shared.weight" in reference:  # one matrix for both sides; otherwise each stack has its own
        out["model.shared.weight"] = sd["src_embed.weight"]
    out["model.encoder.embed_tokens.weight"] = sd["src_embed.weight"]
    out["model.decoder.embed_tokens.weight"] = sd["tgt_embed.weight"]
    out["lm_head.weight"] = sd["output.weight"]
    positions = reference["model.encoder.embed_positions.weight"] if marian else _position_table(model)
    out["model.encoder.embed_positions.weight"] = positions
    out["model.decoder.embed_positions.weight"] = positions

    def linear(dst: str, weight: torch.Tensor, bias: torch.Tensor) -> None:
        out[f"{dst}.weight"], out[f"{dst}.bias"] = weight, bias

    def norm(dst: str, src: str) -> None:
        out[f"{dst}.weight"], out[f"{dst}.bias"] = sd[f"{src}.weight"], sd[f"{src}.bias"]

    def split(dst: str, names: list[str], src: str) -> None:  # a fused [q; k; v] (or [k; v]) matrix into parts
        for i, name in enumerate(names):
            linear(f"{dst}.{name}", sd[f"{src}.weight"][i * d : (i + 1) * d], sd[f"{src}.bias"][i * d : (i + 1) * d])

    for side, layers in (("encoder", model.encoder), ("decoder", model.decoder)):
        for i in range(len(layers)):
            hf, mt = f"model.{side}.layers.{i}", f"{side}.{i}"
            split(f"{hf}.self_attn", ["q_proj", "k_proj", "v_proj"], f"{mt}.self_attn.qkv")
            linear(f"{hf}.self_attn.out_proj", sd[f"{mt}.self_attn.out.weight"], sd[f"{mt}.self_attn.out.bias"])
            norm(f"{hf}.self_attn_layer_norm", f"{mt}.norm1")
            linear(f"{hf}.fc1", sd[f"{mt}.ffn.up.weight"], sd[f"{mt}.ffn.up.bias"])
            linear(f"{hf}.fc2", sd[f"{mt}.ffn.down.weight"], sd[f"{mt}.ffn.down.bias"])
            if side == "encoder":
                norm(f"{hf}.final_layer_norm", f"{mt}.norm2")
                continue
            linear(f"{hf}.encoder_attn.q_proj", sd[f"{mt}.cross_attn.q.weight"], sd[f"{mt}.cross_attn.q.bias"])
            split(f"{hf}.encoder_attn", ["k_proj", "v_proj"], f"{mt}.cross_attn.kv")
            linear(f"{hf}.encoder_attn.out_proj", sd[f"{mt}.cross_attn.out.weight"], sd[f"{mt}.cross_attn.out.bias"])
            norm(f"{hf}.encoder_attn_layer_norm", f"{mt}.norm2")
            norm(f"{hf}.final_layer_norm", f"{mt}.norm3")
    if model.cfg.norm == "pre":
        norm("model.encoder.layer_norm", "encoder_norm")
        norm("model.decoder.layer_norm", "decoder_norm")
    return {k: v.contiguous().clone() for k, v in out.items()}


def _save_hf_tokenizer(tokenizer, config, out: Path, transformers) -> None:
    """A MarianTokenizer over mtcli's SentencePiece model(s): the pieces SentencePiece makes, mapped to mtcli's ids
    (with separate vocabularies, a vocabulary for each side)."""

    def vocab(spm) -> str:
        return json.dumps({spm.id_to_piece(i): i for i in range(spm.get_piece_size())}, ensure_ascii=False)

    spm = tokenizer.src
    work = out / ".tokenizer-src"
    work.mkdir(exist_ok=True)
    try:
        shutil.copyfile(tokenizer.src_model_path, work / "source.spm")
        shutil.copyfile(tokenizer.tgt_model_path, work / "target.spm")
        (work / "vocab.json").write_text(vocab(tokenizer.src), encoding="utf-8")
        separate = {}
        if not tokenizer.joint:
            (work / "target_vocab.json").write_text(vocab(tokenizer.tgt), encoding="utf-8")
            separate = dict(separate_vocabs=True, target_vocab_file=str(work / "target_vocab.json"))
        hf_tokenizer = transformers.MarianTokenizer(
            source_spm=str(work / "source.spm"),
            target_spm=str(work / "target.spm"),
            vocab=str(work / "vocab.json"),
            source_lang=config.data.src_lang,
            target_lang=config.data.tgt_lang,
            unk_token=spm.id_to_piece(UNK),
            eos_token=spm.id_to_piece(EOS),
            pad_token=spm.id_to_piece(PAD),
            model_max_length=config.model.max_positions - 1,
            **separate,
        )
        hf_tokenizer.save_pretrained(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------------
# CTranslate2


def export_ctranslate2(checkpoint: Path, out: Path, quantization: str | None = None) -> Path:
    """Write a CTranslate2 model directory (weights quantized as asked) with the SentencePiece model beside it."""
    ctranslate2 = _need("ctranslate2")
    from ctranslate2.converters.converter import Converter

    model, config, tokenizer = load_model(checkpoint, "cpu")

    class MtcliConverter(Converter):
        def _load(self):
            return _ctranslate2_spec(model, tokenizer, ctranslate2)

    out = Path(out)
    MtcliConverter().convert(
        str(out), quantization=None if quantization in (None, "none") else quantization, force=True
    )
    tokenizer.copy_to(out)  # spm.model, or spm.src.model and spm.tgt.model: the names a run directory uses
    (out / "mtcli.json").write_text(
        json.dumps({"checkpoint": str(checkpoint), "src_lang": config.data.src_lang, "tgt_lang": config.data.tgt_lang})
    )
    logger.info(f"exported {checkpoint} to CTranslate2 ({quantization or 'float32'}) in {out}")
    return out


def _ctranslate2_spec(model, tokenizer, ctranslate2):
    from ctranslate2.specs import common_spec, transformer_spec

    c = model.cfg
    activation = common_spec.Activation.GELU if c.activation == "gelu" else common_spec.Activation.RELU
    spec = transformer_spec.TransformerSpec.from_config(
        (c.n_encoder_layers, c.n_decoder_layers), c.heads, pre_norm=c.norm == "pre", activation=activation
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
        stack_spec.scale_embeddings = True
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
    src_pieces = [tokenizer.src.id_to_piece(i) for i in range(tokenizer.src_vocab_size)]
    pieces = [tokenizer.tgt.id_to_piece(i) for i in range(tokenizer.tgt_vocab_size)]
    spec.register_source_vocabulary(src_pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.bos_token, spec.config.eos_token = pieces[BOS], pieces[EOS]
    spec.config.unk_token, spec.config.decoder_start_token = pieces[UNK], pieces[BOS]
    spec.config.add_source_eos = True  # mtcli's sources end in EOS
    return spec
