"""One YAML file describes a run: typed, frozen dataclasses for its four sections.

Each section checks its own values (naming the key). Reading YAML, `--set` overrides and type checks are in
config_loader.py. The resolved config is written into every run directory and checkpoint, so later commands rebuild
everything from it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from mtcli.errors import MtcliError

SHIPPED_CONFIGS = Path(__file__).parent / "configs"

# Sizes past any published model, so a typo or an edited checkpoint is refused before memory is spent rather than
# allocating gigabytes: the deepest Transformers have ~1,000 layers (DeepNet), the widest d_model ~20,000 and d_ff
# ~80,000 (PaLM, Megatron-Turing), encoder-decoder models 512-16,384 positions (a sinusoid table is
# positions x d_model, built whole). The layers of the largest dense translation models hold ~10 billion parameters
# (MADLAD-400); 20 billion is 80 GB in fp32.
MODEL_LIMITS = {
    "layers": 1000,
    "encoder_layers": 1000,
    "decoder_layers": 1000,
    "d_model": 65_536,
    "heads": 1024,
    "d_ff": 262_144,
    "max_positions": 65_536,
}
MAX_LAYER_PARAMETERS = 20_000_000_000
# CTranslate2's weight types (`mtcli export --quantization`, distill.quantization); none: float32
CT2_QUANTIZATIONS = ("none", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16")
MAX_VOCAB = 1_000_000  # the largest vocabularies in use (NLLB, mT5, Gemma) have about 256,000 pieces


class ConfigError(MtcliError):
    pass


@dataclass(frozen=True)
class SplitsConfig:
    """Split names of the source, by role. A role set to null is not used."""

    train: str = "train"
    valid: str | None = "validation"
    test: str | None = "test"


@dataclass(frozen=True)
class CleanConfig:
    """Filters of the training pairs after the empty, max_len and max_ratio ones (mtcli/clean.py); each dropped
    pair is counted under the first filter that drops it."""

    duplicates: bool = True  # a pair equal (after whitespace cleanup) to one already kept
    copies: bool = True  # the source equals the target
    max_repeat: int = 6  # drop a pair with a subword piece repeated more than this many times in a row; 0: off
    # drop a pair with a side whose letters are more than this share outside its language's script(s) (a Chinese
    # side in English); Latin names in Chinese text count one letter each, so keep it high for zh/ja; 1: off
    max_other_script: float = 0.8
    langid: bool = False  # py3langid on both sides (pip install 'mtcli[langid]'): drop a side in another language
    langid_min_prob: float = 0.5  # ... only when py3langid names that language with at least this probability

    def __post_init__(self):
        _check_numbers(self, "data.clean")
        _check(self.max_repeat >= 0, "data.clean.max_repeat", "must be 0 (off) or positive")
        _check(0 < self.max_other_script <= 1, "data.clean.max_other_script", "must be in (0, 1]; 1 turns it off")
        _check(0 <= self.langid_min_prob <= 1, "data.clean.langid_min_prob", "must be between 0 and 1")


@dataclass(frozen=True)
class TrainCorpusConfig:
    """One of several training corpora (data.train_corpora): a local folder or a Hub dataset, the split to read, and
    how many times each of its pairs is seen per epoch on average (0.5: a new random half every epoch)."""

    path: str | None = None
    dataset: str | None = None
    subset: str | None = None
    revision: str | None = None
    split: str = "train"
    weight: float = 1.0
    # A tag that starts the source of this corpus's pairs only (before data.src_prefix): `<BT>` marks back-translated
    # pairs (tagged back-translation, Caswell et al. 2019). A vocabulary mtcli fits keeps it as one piece.
    tag: str = ""
    format: Literal["auto", "text", "tsv", "jsonl"] | None = None  # null: data.format

    def __post_init__(self):
        where = self.path or self.dataset
        _check_numbers(self, "data.train_corpora")
        _check(bool(self.path) != bool(self.dataset), "data.train_corpora", "each needs a path or a dataset (one)")
        # An epoch holds `weight` copies of the corpus's pair indices: 100 is past any real upsampling.
        _check(0 < self.weight <= 100, "data.train_corpora.weight", f"must be in (0, 100] (the corpus {where})")
        _check(
            self.tag == "" or (len(self.tag) <= 64 and self.tag.split() == [self.tag]),
            "data.train_corpora.tag",
            f"must be one word without spaces, at most 64 characters, e.g. <BT> (the corpus {where})",
        )


@dataclass(frozen=True)
class DataConfig:
    # Where the corpus comes from: `path` (a local folder) wins over `dataset` (a Hub name, or `toy` for the built-in
    # toy corpus), so setting data.path switches any config to local files.
    dataset: str | None = None
    subset: str | None = None
    revision: str | None = None
    path: str | None = None
    format: Literal["auto", "text", "tsv", "jsonl"] = "auto"
    src_lang: str = "en"
    tgt_lang: str = "de"
    # Columns holding the two sides: default is a `translation: {src_lang, tgt_lang}` column when present, else
    # columns named after the languages. TSV files are `source<TAB>target`.
    src_column: str | None = None
    tgt_column: str | None = None
    splits: SplitsConfig = field(default_factory=SplitsConfig)
    # Split names on the Hub when they differ from those of the local release in `splits` (used without data.path).
    hub_splits: SplitsConfig | None = None
    # Cleaning of the train split (valid and test are never filtered, so scores stay comparable).
    max_len: int = 250  # subwords per side, without BOS/EOS
    max_ratio: float = 3.0  # longer/shorter side in subwords; 0 disables
    clean: CleanConfig = field(default_factory=CleanConfig)
    # Several training corpora, read as one train split (data.splits.train is then not read); valid and test still
    # come from data.path or data.dataset
    train_corpora: tuple[TrainCorpusConfig, ...] = ()
    # SentencePiece
    vocab_size: int = 8000
    joint_vocab: bool = True
    spm_model_type: Literal["unigram", "bpe"] = "unigram"
    character_coverage: float | None = None  # null: 0.9995 if a side is zh/ja, else 1.0
    byte_fallback: bool = False  # rare characters as UTF-8 bytes instead of <unk> (256 extra pieces)
    # null: `identity` if a side is zh/ja (NFKC would turn full-width punctuation into ASCII), else `nmt_nfkc`
    spm_normalization: Literal["nmt_nfkc", "nfkc", "identity"] | None = None
    # sentences sampled from train to fit SentencePiece (for a joint vocabulary, both sides of half as many pairs):
    # the fit's memory grows with the sample, not the corpus: about 1.7 GB for 500,000 sentences of 150 characters
    spm_sample: int = 500_000
    # Subword regularisation (Kudo 2018; BPE-dropout for bpe models): every epoch re-encodes the training pairs with
    # sampled segmentations, seeded by (train.seed, epoch). 0: off. Unigram: the smoothing exponent over the
    # sampling_nbest best segmentations (-1: all of them); bpe: the merge-dropout probability. Valid/test: never.
    sampling_alpha: float = 0.0
    sampling_nbest: int = -1
    cache_dir: str = "data/cache"
    workers: int = 0  # processes that encode and filter the pairs; 0: one per available core (same cache for any)
    # A folder holding the tokenizer to use instead of fitting SentencePiece (a run or checkpoint folder: spm.model, or
    # an imported MarianMT vocabulary); train.init_from sets it to the starting checkpoint's. The vocabulary settings
    # above are then unused.
    tokenizer: str | None = None
    # Text put before every source sentence, e.g. `>>deu<<`: the target-language token of a multilingual opus-mt
    # model (see its README for the codes). Translation uses decode.src_prefix when that is set.
    src_prefix: str = ""
    # Terminology training (Dinu et al. 2019, as OpusTrainer's terminology modifier): this share of the training
    # pairs gets 1-2 of its words followed by the target words eflomal aligns them to, `__source__ apples __target__
    # Äpfel __done__`, so that the model learns to copy a marked target term (decode.constraints soft). Needs eflomal
    # (pip install 'mtcli[align]'); the train split's word alignments are kept in the cache (train.align). 0: off.
    terminology: float = 0.0
    # Word alignments of the train split (eflomal, as for data.terminology, one step and one cache), kept per pair as
    # links between source and target subwords (train.links.*): what train.guided_alignment trains towards.
    alignments: bool = False

    def __post_init__(self):
        _check_numbers(self, "data")
        _check(0 <= self.terminology <= 1, "data.terminology", "must be a share between 0 (off) and 1")
        _check(self.max_len > 0, "data.max_len", "must be positive")
        # A ratio is longer side / shorter side, so it is at least 1: a limit under 1 would drop every pair.
        _check(
            self.max_ratio == 0 or self.max_ratio >= 1, "data.max_ratio", "must be 0 (no ratio filter) or at least 1"
        )
        _check(16 <= self.vocab_size <= MAX_VOCAB, "data.vocab_size", f"must be between 16 and {MAX_VOCAB:,}")
        _check(self.spm_sample > 1, "data.spm_sample", "must be at least 2 (sentences)")
        _check(self.workers >= 0, "data.workers", "must be 0 (one per core) or more")
        _check(self.sampling_alpha >= 0, "data.sampling_alpha", "must be 0 (off) or positive")
        _check(
            self.spm_model_type == "unigram" or self.sampling_alpha < 1,
            "data.sampling_alpha",
            "is the merge-dropout probability of a bpe model: keep it under 1 (0.1 is usual)",
        )
        _check(
            self.sampling_nbest == -1 or 2 <= self.sampling_nbest <= 10_000,
            "data.sampling_nbest",
            "must be -1 (sample from all segmentations) or between 2 and 10,000",
        )
        _check(self.src_lang != self.tgt_lang, "data.tgt_lang", "must differ from data.src_lang")
        cov = self.character_coverage
        _check(cov is None or 0.9 <= cov <= 1.0, "data.character_coverage", "must be between 0.9 and 1.0")

    def check_source(self) -> None:
        """A config that reads data names where it comes from (an imported model's run has no data of its own)."""
        _check(
            bool(self.dataset or self.path),
            "data.dataset",
            "set a Hub dataset name, `toy`, or data.path (a folder of local files)",
        )


@dataclass(frozen=True)
class ModelConfig:
    layers: int = 6
    encoder_layers: int | None = None  # default: `layers`
    decoder_layers: int | None = None  # default: `layers`
    d_model: int = 512
    heads: int = 8
    d_ff: int = 2048
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    # Training only: each source token's embedding is zeroed with this probability, so the encoder learns to read a
    # word from its context (word dropout, Sennrich et al. 2016); 0: off.
    src_word_dropout: float = 0.0
    activation: Literal["relu", "gelu", "swish"] = "relu"  # swish = SiLU, what opus-mt models use
    norm: Literal["post", "pre"] = "post"
    positions: Literal["sinusoidal", "learned"] = "sinusoidal"
    max_positions: int = 1024
    tie_embeddings: bool = True  # three-way with a joint vocabulary, else target embedding + output only
    scale_embedding: bool = True  # embeddings times sqrt(d_model) before the positions are added (the paper)
    # A fixed bias added to the output logits (MarianMT's final_logits_bias): a buffer, not trained, as in Transformers.
    output_bias: bool = False
    # The decoder layer whose cross-attention gives word alignments (negative: from the top; null: the penultimate,
    # or the only one, where Garg et al. 2019 found alignments best) and how many of its heads, from the first, are
    # averaged: the head(s) train.guided_alignment trains, and CTranslate2's alignment_layer / alignment_heads.
    alignment_layer: int | None = None
    alignment_heads: int = 1

    def __post_init__(self):
        _check_numbers(self, "model")
        for key, most in MODEL_LIMITS.items():
            value = getattr(self, key)
            if value is None and key in ("encoder_layers", "decoder_layers"):
                continue  # null: model.layers
            _check(0 < value <= most, f"model.{key}", f"must be between 1 and {most:,}")
        _check(
            self.d_model % self.heads == 0,
            "model.heads",
            f"d_model ({self.d_model}) must be divisible by heads ({self.heads})",
        )
        _check(
            (self.d_model // self.heads) % 2 == 0 or self.positions == "learned",
            "model.d_model",
            "sinusoidal positions need an even d_model",
        )
        for key in ("dropout", "attention_dropout", "activation_dropout", "src_word_dropout"):
            _check(0.0 <= getattr(self, key) < 1.0, f"model.{key}", "must be in [0, 1)")
        n = self.n_decoder_layers
        layer_ok = self.alignment_layer is None or -n <= self.alignment_layer < n
        _check(layer_ok, "model.alignment_layer", f"must be null or a decoder layer between {-n} and {n - 1}")
        _check(1 <= self.alignment_heads <= self.heads, "model.alignment_heads", f"must be between 1 and {self.heads}")
        billions = self.layer_parameters() / 1e9
        _check(
            billions <= MAX_LAYER_PARAMETERS / 1e9,
            "model",
            f"its layers alone would hold {billions:,.1f} billion parameters, over mtcli's limit of "
            f"{MAX_LAYER_PARAMETERS / 1e9:g} billion; check model.layers, d_model and d_ff",
        )

    def layer_parameters(self) -> int:
        """The weight matrices of the encoder and decoder layers (attention 4 d x d, cross-attention 4 more, the
        feed-forward 2 d x d_ff), without embeddings: what the model section alone decides."""
        d, ff = self.d_model, self.d_ff
        return self.n_encoder_layers * (4 * d * d + 2 * d * ff) + self.n_decoder_layers * (8 * d * d + 2 * d * ff)

    @property
    def n_encoder_layers(self) -> int:
        return self.encoder_layers or self.layers

    @property
    def n_decoder_layers(self) -> int:
        return self.decoder_layers or self.layers

    @property
    def alignment_layer_index(self) -> int:
        """model.alignment_layer as an index from 0."""
        n, layer = self.n_decoder_layers, self.alignment_layer
        return max(n - 2, 0) if layer is None else layer % n


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 1
    max_updates: int = 100_000  # absolute: a resumed run stops at the same update
    max_epochs: int = 0  # 0: no limit
    max_tokens: int = 4096  # per micro-batch and process, counted padded: sentences x longest, source and target each
    tokens_per_update: int = 0  # target tokens per optimizer step across processes; 0: one micro-batch per process
    lr: float = 7e-4  # peak learning rate
    schedule: Literal["inverse_sqrt", "constant", "cosine"] = "inverse_sqrt"
    warmup: int = 4000
    min_lr: float = 0.0  # floor of the cosine schedule
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-9
    weight_decay: float = 0.0
    clip_norm: float = 0.0  # 0: no clipping (the paper)
    label_smoothing: float = 0.1
    rdrop: float = 0.0  # R-Drop alpha (Liang et al. 2021); > 0 runs each batch twice: 2x the cost of an update
    # Guided alignment (Garg et al. 2019; Marian's --guided-alignment): the weight of a cross-entropy between the
    # alignment heads' attention (model.alignment_layer / alignment_heads) and the train split's word alignments
    # (data.alignments), added to the loss per target token; 0: off. Marian's default weight is 0.1.
    guided_alignment: float = 0.0
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    compile: bool = False
    device: str = "auto"  # auto: CUDA when available, else CPU
    threads: int = 0  # CPU threads for torch; 0: torch's default
    valid_every: int = 1000  # updates between validations (and checkpoints)
    valid_max_sentences: int = 0  # BLEU on the first N valid sentences; 0: all
    valid_metric: Literal["bleu", "loss"] = "bleu"  # what picks `best` and drives early stopping
    save_every: int = 0  # extra checkpoints between validations; 0: only at validation
    keep_last: int = 5  # numbered checkpoints kept (best is always kept)
    patience: int = 0  # validations without improvement before stopping; 0: never stop early
    log_every: int = 100
    max_nonfinite: int = 5  # consecutive non-finite losses before the run stops
    # Fine-tuning: start from this run's best checkpoint (or this checkpoint folder), e.g. one made by `mtcli import`:
    # its weights, architecture (the model section) and tokenizer, with a fresh optimizer. Valid BLEU at update 0.
    init_from: str | None = None

    def __post_init__(self):
        _check_numbers(self, "train")
        # numpy's generators take seeds from 0; torch and SentencePiece at most 64 and 32 bits
        _check(0 <= self.seed < 2**32, "train.seed", "must be between 0 and 4,294,967,295")
        _check(self.threads <= 4096, "train.threads", "must be at most 4,096 (0: torch's default)")
        for key in ("max_updates", "max_tokens", "valid_every", "log_every", "keep_last", "max_nonfinite"):
            _check(getattr(self, key) > 0, f"train.{key}", "must be positive")
        for key in (
            "max_epochs",
            "tokens_per_update",
            "warmup",
            "valid_max_sentences",
            "save_every",
            "patience",
            "weight_decay",
            "clip_norm",
            "min_lr",
            "threads",
            "rdrop",
            "guided_alignment",
        ):
            _check(getattr(self, key) >= 0, f"train.{key}", "must be >= 0")
        _check(self.lr > 0, "train.lr", "must be positive")
        _check(self.eps > 0, "train.eps", "must be positive")
        _check(all(0.0 <= b < 1.0 for b in self.betas), "train.betas", "both betas must be in [0, 1)")
        _check(0.0 <= self.label_smoothing < 1.0, "train.label_smoothing", "must be in [0, 1)")


@dataclass(frozen=True)
class DecodeConfig:
    beam: int = 4
    lenpen: float = 0.6  # length penalty alpha; 0 disables
    # how lenpen normalizes a finished hypothesis' log-probability: gnmt, ((5 + length) / 6) ** lenpen (Wu et al.
    # 2016; fairseq's and mtcli's recipes), or power, length ** lenpen (CTranslate2's, Transformers' generate)
    length_norm: Literal["gnmt", "power"] = "gnmt"
    # end a sentence's beam search once `beam` hypotheses have finished (CTranslate2's rule, Transformers'
    # early_stopping=True): with length_norm power, the search that CTranslate2, Argos and LibreTranslate run
    early_stopping: bool = False
    max_len_a: float = 2.0  # output length limit: a * source length + b (subwords), capped by model.max_positions
    max_len_b: int = 20
    min_len: int = 1  # output subwords before EOS is allowed (non-empty sources); 0 allows an empty output
    nbest: int = 1
    no_repeat_ngram: int = 0
    batch_tokens: int = 4096  # source subwords per translation batch (sentences x longest)
    batch_sentences: int = 0  # at most this many sentences per batch; 0: no limit
    sampling: bool = False  # sample instead of search (temperature, top_k, top_p)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    # auto: bf16 weights and cache where the device has fast bf16 (CUDA, CPUs with AMX), else fp32; int8: dynamic
    # quantization of the linear layers, an option for CPUs without bf16 units
    precision: Literal["auto", "fp32", "bf16", "int8"] = "auto"
    src_prefix: str | None = None  # null: data.src_prefix; e.g. `>>fra<<` to pick another target language
    # What a glossary (translate/eval/serve/data synthesize --glossary) does: hard, the target term of every source
    # term found in a line is written in its translation (constrained beam search, mtcli/constrained.py); soft, each
    # source term is followed by its target term in the marked syntax a model trained with data.terminology learnt
    # to copy (plain search, no guarantee; exports read the same marked text); off: the glossary is not applied
    # (eval still reports term accuracy)
    constraints: Literal["hard", "soft", "off"] = "hard"

    def __post_init__(self):
        _check_numbers(self, "decode")
        # The search keeps beam x sentences rows of cache; past a few dozen, wider beams lower BLEU (Koehn & Knowles
        # 2017), and 1,000 is the widest studied.
        _check(1 <= self.beam <= 1000, "decode.beam", "must be between 1 and 1,000")
        _check(1 <= self.nbest <= self.beam, "decode.nbest", f"must be between 1 and decode.beam ({self.beam})")
        # ((5 + length) / 6) ** lenpen overflows a float past ~70 at the longest outputs; tuned values are 0-2.
        _check(0 <= self.lenpen <= 10, "decode.lenpen", "must be between 0 and 10")
        _check(self.length_norm in ("gnmt", "power"), "decode.length_norm", "must be gnmt or power")
        _check(self.constraints in ("hard", "soft", "off"), "decode.constraints", "must be hard, soft or off")
        _check(self.max_len_a >= 0 and self.max_len_b >= 0, "decode.max_len_a", "max_len_a and max_len_b must be >= 0")
        _check(self.max_len_a > 0 or self.max_len_b > 0, "decode.max_len_b", "max_len_a and max_len_b cannot both be 0")
        _check(self.min_len >= 0, "decode.min_len", "must be >= 0")
        _check(self.no_repeat_ngram >= 0, "decode.no_repeat_ngram", "must be >= 0")
        _check(self.batch_tokens > 0, "decode.batch_tokens", "must be positive")
        _check(self.batch_sentences >= 0, "decode.batch_sentences", "must be >= 0 (0: no limit)")
        # Sampling divides float32 log-probabilities by the temperature and compares float32 sums with top_p; in
        # float32 1e-300 is 0 and 1e308 infinite, and either left nothing to sample (a NaN distribution). The bounds
        # (the server's as well, docs/serve.md) keep both far inside float32 and past any useful setting.
        _check(0.01 <= self.temperature <= 100, "decode.temperature", "must be between 0.01 and 100")
        _check(self.top_k >= 0, "decode.top_k", "must be >= 0")
        _check(1e-6 <= self.top_p <= 1, "decode.top_p", "must be between 1e-6 and 1")

    def with_options(self, **values) -> DecodeConfig:
        """These settings with `values` applied and checked (mtcli translate's options, a server request's fields):
        a new beam caps nbest unless nbest is given too, so `--beam 1` alone is never refused for a config's nbest."""
        if "beam" in values and "nbest" not in values:
            values["nbest"] = min(self.nbest, values["beam"])
        return dataclasses.replace(self, **values)


@dataclass(frozen=True)
class DistillConfig:
    """How `mtcli distill` makes this config's model a student of a teacher (mtcli/distill.py): the teacher's search
    for the distilled corpus, its filters, the mixture the student trains on, and the steps after training."""

    beam: int = 5  # the teacher's beam when it translates the training sources
    lenpen: float | None = None  # null: the teacher's own decode.lenpen
    distilled_weight: float = 1.0  # data.train_corpora weight of the distilled corpus
    original_weight: float = 1.0  # ... of the student's own training data (0: distilled data only)
    mono_weight: float = 1.0  # ... of distilled monolingual source text (`mtcli distill --mono FILE`)
    max_ratio: float | None = None  # drop distilled pairs whose longer side is this many times the shorter; 0: off;
    # null: the data's own data.max_ratio (a pair the data would keep is not dropped as distilled)
    drop_worst: float = 0.0  # drop this share of distilled pairs, those with the lowest teacher score per subword
    chunk_lines: int = 2000  # lines per resumable chunk of the synthesis
    average_last: int = 5  # average the student's last N checkpoints, kept if better on valid; 0: no averaging
    eval_split: str = "test"  # the split teacher and student are scored on for the model card
    quantization: str = "int8"  # the CTranslate2 export of the student; none: no export

    def __post_init__(self):
        _check_numbers(self, "distill")
        _check(1 <= self.beam <= 1000, "distill.beam", "must be between 1 and 1,000")
        _check(self.lenpen is None or 0 <= self.lenpen <= 10, "distill.lenpen", "must be null or between 0 and 10")
        for key in ("distilled_weight", "original_weight", "mono_weight"):
            _check(0 <= getattr(self, key) <= 100, f"distill.{key}", "must be between 0 and 100")
        _check(self.distilled_weight > 0, "distill.distilled_weight", "must be positive: it is what distillation adds")
        ratio_ok = self.max_ratio is None or self.max_ratio == 0 or self.max_ratio >= 1
        _check(ratio_ok, "distill.max_ratio", "must be null (data.max_ratio), 0 (off) or at least 1")
        _check(0 <= self.drop_worst < 1, "distill.drop_worst", "must be at least 0 and under 1 (a share)")
        _check(1 <= self.chunk_lines <= 1_000_000, "distill.chunk_lines", "must be between 1 and 1,000,000")
        _check(self.average_last >= 0, "distill.average_last", "must be 0 (no averaging) or positive")
        _check(self.eval_split in ("valid", "test"), "distill.eval_split", "must be valid or test")
        kinds = CT2_QUANTIZATIONS
        _check(self.quantization in kinds, "distill.quantization", f"must be one of {', '.join(kinds)}")


@dataclass(frozen=True)
class Config:
    name: str = "run"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self):
        _check(
            not self.train.guided_alignment or self.data.alignments,
            "train.guided_alignment",
            "trains towards the train split's word alignments: set data.alignments: true too",
        )
        _check(
            not self.train.guided_alignment or not self.data.sampling_alpha,
            "train.guided_alignment",
            "its links are between the cached pieces, which data.sampling_alpha re-segments: set one of them to 0",
        )

    @property
    def alignment_heads(self) -> int:
        """The heads of model.alignment_layer whose averaged attention aligns words: model.alignment_heads of a model
        trained with guided alignment, else all of them (mtcli's alignments, its CTranslate2 export's)."""
        return self.model.alignment_heads if self.train.guided_alignment else self.model.heads

    def source_prefix(self, decode: DecodeConfig | None = None) -> str:
        """What goes before every source line: decode.src_prefix where set (another target language of a
        multilingual model), else data.src_prefix (the one the model was trained with)."""
        prefix = (decode or self.decode).src_prefix
        return self.data.src_prefix if prefix is None else prefix

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _check_numbers(section, prefix: str) -> None:
    """Every number of a section finite and within 64 bits, checked first: NaN fails every comparison, so `lr > 0`
    would call it "not positive", and an integer past 64 bits overflows numpy and torch wherever it lands."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{prefix}.{f.name}: {v} is not allowed; give a finite number")
            if isinstance(v, int) and not isinstance(v, bool) and not -(2**63) <= v < 2**63:
                raise ConfigError(f"{prefix}.{f.name}: {shown(v)} is too large for a 64-bit integer")


def shown(value: Any, limit: int = 100) -> str:
    """A value as an error message shows it, cut to `limit` characters: a config value can be megabytes long."""
    if isinstance(value, int) and value.bit_length() > 3 * limit:  # str() refuses over 4,300 digits
        return f"an integer of about {int(value.bit_length() * 0.30103):,} digits"
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _plain(value: Any) -> Any:
    """Tuples to lists, so the YAML stays plain."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
