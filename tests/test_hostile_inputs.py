"""Hostile and careless input ends in one line naming what and where, before memory is spent: YAML alias bombs,
NaN, infinite and huge numbers in any config key, absurd model sizes, checkpoint metadata edited against its weights,
non-finite weights, a damaged best.json, decode settings that overflow the search, empty evaluation files.

Each test is written from the class of input (every float key, every integer key, every kind of type error, every
tensor the metadata describes), not only from the example that was reported.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
import typing
from pathlib import Path

import pytest
import torch
import yaml
from conftest import tiny_pairs
from safetensors import safe_open
from safetensors.torch import save_file

import mtcli.checkpoint as ckpt
from mtcli.config import Config, ConfigError, DataConfig, DecodeConfig, ModelConfig
from mtcli.config_loader import MAX_ALIAS_EXPANSION, load_config
from mtcli.errors import MtcliError
from mtcli.evaluate import evaluation_set
from mtcli.model import Transformer
from mtcli.scoring import ScoreOptions, corpus_scores
from mtcli.search import max_output_lengths
from mtcli.tokenizer import Tokenizer, train_sentencepiece
from mtcli.translate import Translator, decode_settings


def one_line_error(call, *args, error=MtcliError, **kwargs) -> str:
    """The message of the MtcliError `call` raises, checked to be one line (what the CLI prints as `error: ...`)."""
    with pytest.raises(error) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and len(message) < 600, message
    return message


@pytest.fixture
def config_file(tmp_path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text("data: {path: corpus, cache_dir: cache}\n", encoding="utf-8")
    return path


def set_error(config_file: Path, item: str) -> str:
    return one_line_error(load_config, config_file, [item], error=ConfigError)


# ---------------------------------------------------------------------------------------------------------------------
# YAML: aliases, nesting, long values


def laughs(levels: int, width: int = 9) -> str:
    """A list whose aliases expand to width ** levels strings: 9 levels of 9 are 387 million."""
    items = [f"&a0 [{', '.join(['lol'] * width)}]"]
    items += [f"&a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


@pytest.mark.parametrize("key", ["data.src_lang", "model.layers", "train.betas", "model.norm", "name"])
def test_an_alias_bomb_is_refused_before_it_is_expanded(tmp_path, key):
    """The reported file took 10.7 GB formatting its type error; the bomb under a key of any type is refused at
    once, as a file and as a --set value."""
    section, _, last = key.rpartition(".")
    body = f"{last}: {laughs(9)}"
    text = f"data: {{path: corpus}}\n{section}:\n  {body}\n" if section else f"data: {{path: corpus}}\n{body}\n"
    if section == "data":
        text = f"data:\n  path: corpus\n  {body}\n"
    path = tmp_path / "bomb.yaml"
    path.write_text(text, encoding="utf-8")
    assert len(text) < 700
    start = time.perf_counter()
    message = one_line_error(load_config, path, error=ConfigError)
    assert str(path) in message and "aliases" in message
    clean = tmp_path / "clean.yaml"
    clean.write_text("data: {path: corpus}\n", encoding="utf-8")
    message = set_error(clean, f"{key}={laughs(9)}")
    assert message.startswith(f"--set {key}=") and "aliases" in message
    assert time.perf_counter() - start < 5


def test_aliases_a_config_would_use_still_work(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text(
        "data:\n  path: corpus\n  splits: &splits {train: tr, valid: va, test: te}\n  hub_splits: *splits\n"
        "model: &small {layers: 2, d_model: 64, heads: 2, d_ff: 128}\n"
        "train: {betas: &b [0.9, 0.98]}\n",
        encoding="utf-8",
    )
    cfg = load_config(path)
    assert cfg.data.hub_splits == cfg.data.splits and cfg.data.splits.valid == "va" and cfg.model.layers == 2
    # The bound is on what aliases add, about 4 x width**2 here (nodes and characters): under it the value is read
    # (and refused as a language code, being a list), over it refused unread
    under, over = int((MAX_ALIAS_EXPANSION / 4) ** 0.5 * 0.9), int((MAX_ALIAS_EXPANSION / 4) ** 0.5 * 1.1)
    for width, words in ((under, "expected a string"), (over, "aliases")):
        path.write_text(f"data: {{path: corpus, src_lang: {laughs(2, width)}}}\n", encoding="utf-8")
        assert words in one_line_error(load_config, path, error=ConfigError)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("&a [*a]", "refers to a value that contains it"),  # a cycle: every walk over it would loop
        ("&a {x: *a}", "refers to a value that contains it"),
        ("[" * 100_000 + "]" * 100_000, "brackets nested 100,000 deep"),  # PyYAML took hours
        ("{a: " * 300 + "1" + "}" * 300, "brackets nested 300 deep"),
        ("1" * 5000, "4300 digits"),  # Python refuses to parse it
        ("".join(f"\n{'  ' * (i + 2)}k{i}:" for i in range(1200)) + " 1", "nested too deeply"),  # indented levels
    ],
)
def test_self_reference_deep_nesting_and_huge_numbers_in_a_file(tmp_path, value, words):
    path = tmp_path / "odd.yaml"
    path.write_text(f"data: {{path: corpus}}\ntrain:\n  seed: {value}\n", encoding="utf-8")
    message = one_line_error(load_config, path, error=ConfigError)
    assert str(path) in message and words in message


LONG = "x" * 50_000


@pytest.mark.parametrize(
    ("item", "key"),
    [
        (f"model.norm={LONG}", "model.norm"),  # a choice
        (f"train.betas=[{LONG}]", "train.betas"),  # a pair
        (f"data.train_corpora={LONG}", "data.train_corpora"),  # a list
        (f"train.lr={LONG}", "train.lr"),  # a float
        (f"model.layers={LONG}", "model.layers"),  # an integer
        (f"train.seed={'9' * 5000}", "train.seed"),  # an integer Python will not print
        (f"train.compile={LONG}", "train.compile"),  # a bool
        (f"data.src_lang=[{LONG}]", "data.src_lang"),  # a string
        (f"model.{LONG}=1", "model.xxxx"),  # an unknown key
        (f"{LONG}", "--set xxxx"),  # not KEY=VALUE
    ],
)
def test_every_message_shows_a_long_value_cut_short(config_file, item, key):
    message = set_error(config_file, item)
    assert key in message and len(message) < 600, message[:700]  # the value cut to 100 characters


# ---------------------------------------------------------------------------------------------------------------------
# Numbers: every key, NaN, infinity, past 64 bits, absurd sizes


def keys_of(kind) -> list[str]:
    """Every dotted config key whose type is `kind` (float or int), optional ones included; lists of sections (the
    training corpora) are left out."""
    found = []

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            options = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            if typing.get_origin(hint) is tuple and Ellipsis in typing.get_args(hint):
                continue  # a list of sections (data.train_corpora)
            if dataclasses.is_dataclass(options[0]):
                walk(options[0], f"{prefix}{f.name}.")
            elif kind in options or (typing.get_origin(hint) is tuple and kind in typing.get_args(hint)):
                found.append(f"{prefix}{f.name}")

    walk(Config, "")
    return found


FLOAT_KEYS, INT_KEYS = keys_of(float), keys_of(int)


def test_the_key_lists_cover_the_config():
    assert {"train.lr", "train.betas", "decode.lenpen", "data.character_coverage"} <= set(FLOAT_KEYS)
    assert {"data.vocab_size", "model.encoder_layers", "decode.beam", "train.seed"} <= set(INT_KEYS)
    assert len(FLOAT_KEYS) >= 18 and len(INT_KEYS) >= 30


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_nan_and_infinity_are_refused_for_every_float_key(config_file, key):
    """NaN fails every comparison, so `lr > 0` called it "not positive"; infinity passed `max_len_a >= 0` and gave
    empty translations. Both are named for what they are."""
    for text in (".nan", ".inf", "-.inf", "nan", "1e400"):
        value = f"[{text}, 0.9]" if key == "train.betas" else text
        message = set_error(config_file, f"{key}={value}")
        assert message.startswith(f"{key}: ") and "is not allowed; give a finite number" in message, message


@pytest.mark.parametrize("key", INT_KEYS)
def test_integers_past_64_bits_and_non_finite_ones_are_refused_for_every_int_key(config_file, key):
    for text, words in (
        ("99999999999999999999", "too large for a 64-bit integer"),
        ("-99999999999999999999", "too large for a 64-bit integer"),
        (".nan", "is not allowed; give a finite integer"),
        (".inf", "is not allowed; give a finite integer"),
    ):
        message = set_error(config_file, f"{key}={text}")
        assert message.startswith(f"{key}: ") and words in message, message


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ("model.layers=100000", "model.layers: must be between 1 and 1,000"),
        ("model.encoder_layers=5000", "model.encoder_layers: must be between 1 and 1,000"),
        ("model.decoder_layers=5000", "model.decoder_layers: must be between 1 and 1,000"),
        ("model.max_positions=1000000000", "model.max_positions: must be between 1 and 65,536"),
        ("model.d_model=1048576", "model.d_model: must be between 1 and 65,536"),
        ("model.d_ff=100000000", "model.d_ff: must be between 1 and 262,144"),
        ("model.heads=100000", "model.heads: must be between 1 and 1,024"),
        ("model.d_model=16384", "billion parameters"),  # each key within its bound, the product not
        ("data.vocab_size=100000000000", "data.vocab_size: must be between 16 and 1,000,000"),
        ("data.sampling_nbest=100000000000", "data.sampling_nbest"),
        ("data.train_corpora=[{path: x, weight: 1e12}]", "data.train_corpora.weight"),
        ("train.seed=-1", "train.seed"),  # numpy's generators refuse it mid-training
        ("train.seed=4294967296", "train.seed"),
        ("train.threads=1000000", "train.threads"),
        ("decode.beam=1000000", "decode.beam: must be between 1 and 1,000"),
        ("decode.lenpen=1e308", "decode.lenpen: must be between 0 and 10"),  # ** overflowed the float
        ("decode.temperature=1e-300", "decode.temperature: must be between 0.01 and 100"),  # / 0 in float32
        ("decode.temperature=1e308", "decode.temperature: must be between 0.01 and 100"),
        ("decode.top_p=1e-300", "decode.top_p: must be between 1e-6 and 1"),  # 0 in float32: nothing kept
    ],
)
def test_absurd_sizes_and_settings_are_refused_by_the_config(config_file, item, words):
    assert words in set_error(config_file, item)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"lenpen": 1e308}, "--lenpen: must be between 0 and 10"),
        ({"lenpen": float("nan")}, "--lenpen: nan is not allowed"),
        ({"temperature": 1e-300}, "--temperature: must be between"),
        ({"temperature": float("inf")}, "--temperature: inf is not allowed"),
        ({"top_p": 1e-300}, "--top-p: must be between"),
        ({"max_len_a": float("inf")}, "--max-len-a: inf is not allowed"),
        ({"max_len_b": 10**20}, "--max-len-b: 100000000000000000000 is too large"),
        ({"beam": 10**20}, "--beam: 100000000000000000000 is too large"),
        ({"batch_tokens": 10**20}, "--batch-tokens: 100000000000000000000 is too large"),
    ],
)
def test_decode_options_are_checked_where_translate_eval_and_serve_read_them(options, words):
    assert words in one_line_error(decode_settings, DecodeConfig(), **options)


def test_the_output_length_limit_is_capped_before_it_becomes_an_integer():
    """a = 1e300 overflowed the conversion to a negative length: every translation came back empty."""
    for a, b, expected in (
        (1e300, 0, [0, 63, 63]),  # inf * 0 in float32 was NaN
        (0.0, 2**62, [63, 63, 63]),
        (1e300, 2**62, [63, 63, 63]),
        (3.0e9, 7, [7, 63, 63]),
        (2.0, 5, [5, 11, 63]),
    ):
        assert max_output_lengths(torch.tensor([0, 3, 40]), a, b, 64).tolist() == expected, (a, b)


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A run with one checkpoint of an untrained one-layer model and its SentencePiece model (~60 pieces): enough to
    load, translate and damage, in about a second."""
    home = tmp_path_factory.mktemp("tiny")
    cfg = Config(
        data=DataConfig(path="corpus", vocab_size=60),
        model=ModelConfig(layers=1, d_model=16, heads=2, d_ff=32, max_positions=16),
        decode=DecodeConfig(beam=2),
    )
    train_sentencepiece([s for pair in tiny_pairs(200, 1) for s in pair], home / "spm.model", cfg.data)
    tokenizer = Tokenizer(home / "spm.model")
    torch.manual_seed(0)
    model = Transformer(cfg.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint)
    run = home / "run"
    path = ckpt.save_checkpoint(run, 1, model, cfg, tokenizer)
    ckpt.write_best(run, path, 1, "bleu")
    return run


@pytest.fixture
def run_copy(tiny_run, tmp_path) -> Path:
    shutil.copytree(tiny_run, tmp_path / "run")
    return tmp_path / "run"


def model_file(run: Path) -> Path:
    return ckpt.list_checkpoints(run)[-1] / "model.safetensors"


def rewrite(run: Path, tensors=None, sections=None, **metadata) -> Path:
    """Rewrite the run's checkpoint with some tensors replaced, its config sections updated and metadata entries
    set (None removes one)."""
    path = model_file(run)
    with safe_open(str(path), framework="pt") as f:
        meta, weights = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    tree = json.loads(meta["config"])
    for section, values in (sections or {}).items():
        tree[section].update(values)
    meta["config"] = json.dumps(tree)
    for key, value in metadata.items():
        meta.pop(key) if value is None else meta.__setitem__(key, value)
    save_file({**weights, **(tensors or {})}, str(path), metadata=meta)
    return path


@pytest.fixture
def built_sizes(monkeypatch) -> list[int]:
    """The weights (elements, tied ones once) of every Transformer checkpoint.py builds in the test."""
    sizes = []

    class Recording(Transformer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            sizes.append(sum({t.data_ptr(): t.numel() for t in self.state_dict().values()}.values()))

    monkeypatch.setattr(ckpt, "Transformer", Recording)
    return sizes


def file_elements(path: Path) -> int:
    with safe_open(str(path), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


PRE = "its metadata describes a model of at least"  # refused from the header alone, nothing built


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ({"model": {"layers": 8}}, PRE),  # within the config's bounds, far more than the file holds
        ({"model": {"encoder_layers": 2}}, PRE),
        ({"model": {"decoder_layers": 3}}, PRE),
        ({"model": {"d_model": 4096, "heads": 2}}, PRE),
        ({"model": {"d_ff": 262144}}, PRE),
        ({"model": {"positions": "learned", "max_positions": 65536}}, PRE),
        # As large as the file, laid out otherwise: built (no larger than the file), compared tensor by tensor
        ({"model": {"positions": "learned"}}, "has a tensor `learned_positions.weight` (shape [16, 16]) that the file"),
        ({"model": {"output_bias": True}}, "has a tensor `output_bias`"),
        ({"model": {"tie_embeddings": False}}, "the metadata does not match the weights"),
        ({"model": {"norm": "pre"}}, "has a tensor `encoder_norm.weight`"),  # pre-norm stacks end in a norm
        ({"tensors": {"extra.weight": torch.zeros(3)}}, "tensor `extra.weight` (1 such) is not part of the model"),
        ({"src_vocab_size": "1000000000"}, "src_vocab_size `1000000000`, but the tokenizer beside it has"),
        ({"tgt_vocab_size": "-5"}, "tgt_vocab_size `-5`"),
        ({"tgt_vocab_size": "many"}, "tgt_vocab_size `many`"),
        ({"src_vocab_size": None}, "src_vocab_size `None`"),
    ],
)
def test_metadata_edited_against_its_weights_is_refused_before_memory_is_spent(run_copy, built_sizes, edit, words):
    metadata = {k: v for k, v in edit.items() if k not in ("model", "tensors")}
    path = rewrite(run_copy, edit.get("tensors"), {"model": edit.get("model", {})}, **metadata)
    message = one_line_error(Translator.from_run, run_copy, device="cpu")
    assert message.startswith(str(path)) and words in message, message
    # A model built before the comparison is about the file's size (biases and norms are not in the bound)
    assert all(size <= 2 * file_elements(path) for size in built_sizes)
    assert words != PRE or not built_sizes


@pytest.mark.parametrize(
    ("metadata", "words"),
    [
        ({"config": "not json"}, "damaged config in its metadata"),
        ({"config": "[1, 2]"}, "not a JSON object"),
        ({"config": "[" * 100_000 + "]" * 100_000}, "damaged config in its metadata"),
        ({"config": None}, "not an mtcli checkpoint"),
        ({"config_version": "x"}, "damaged config in its metadata"),
        ({"config": json.dumps({"data": 5}), "config_version": "1"}, "data: expected a mapping"),
        ({"config": json.dumps({"model": {"layers": 10**6}})}, "model.layers: must be between 1 and 1,000"),
        ({"config": json.dumps({"model": {"max_positions": 10**9}})}, "model.max_positions"),
    ],
)
def test_damaged_config_metadata_is_one_line(run_copy, built_sizes, metadata, words):
    path = rewrite(run_copy, **metadata)
    message = one_line_error(Translator.from_run, run_copy, device="cpu")
    assert str(path) in message and words in message, message
    assert words in one_line_error(ckpt.read_config, path.parent)  # what eval and translate read first
    assert not built_sizes


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("which", [0, -1])  # the first tensor and the last (the file's order is by name)
def test_non_finite_weights_are_refused_naming_the_tensor(run_copy, bad, which):
    """NaN weights made beam search fail with an IndexError and greedy search print an empty line, silently."""
    with safe_open(str(model_file(run_copy)), framework="pt") as f:
        name = sorted(f.keys())[which]
        tensor = f.get_tensor(name)
    tensor.view(-1)[tensor.numel() // 2] = bad
    path = rewrite(run_copy, tensors={name: tensor})
    message = one_line_error(Translator.from_run, run_copy, device="cpu")
    assert message.startswith(str(path)) and f"tensor `{name}` holds NaN or infinite values" in message


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        "[1, 2]",
        '"update_00000001"',
        "{}",
        '{"checkpoint": 5}',
        '{"checkpoint": null}',
        '{"checkpoint": ""}',
        '{"checkpoint": "."}',
        '{"checkpoint": "../../elsewhere/checkpoints/update_00000001"}',  # a checkpoint outside the run
        '{"checkpoint": "/etc"}',
        "\udcff".encode("utf-8", "surrogateescape"),  # not UTF-8
    ],
)
def test_a_damaged_best_json_is_one_line_and_prunes_nothing(run_copy, content):
    pointer = ckpt.checkpoint_dir(run_copy) / "best.json"
    pointer.write_bytes(content if isinstance(content, bytes) else content.encode())
    message = one_line_error(Translator.from_run, run_copy, device="cpu")
    assert message.startswith(f"{pointer}: damaged") and "--checkpoint" in message
    # Pruning keeps the best checkpoint: not knowing which it is, it stops rather than delete what may be it
    first = ckpt.list_checkpoints(run_copy)[0]
    shutil.copytree(first, first.parent / "update_00000002")
    one_line_error(ckpt.prune_checkpoints, run_copy, 1)
    assert len(ckpt.list_checkpoints(run_copy)) == 2


def test_a_best_json_naming_a_missing_checkpoint_is_an_error_not_a_silent_fallback(run_copy):
    pointer = ckpt.checkpoint_dir(run_copy) / "best.json"
    pointer.write_text('{"checkpoint": "update_00009999"}')
    message = one_line_error(Translator.from_run, run_copy, device="cpu")
    assert "names checkpoint `update_00009999`, which is not in" in message and "delete best.json" in message
    ckpt.prune_checkpoints(run_copy, 1)  # nothing of the run is the best: nothing to protect
    shutil.copytree(ckpt.list_checkpoints(run_copy)[0], ckpt.checkpoint_dir(run_copy) / "average_last2")
    pointer.write_text('{"checkpoint": "average_last2"}')  # any folder of the run's checkpoints
    assert Translator.from_run(run_copy, device="cpu").checkpoint.name == "average_last2"


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("{", "not readable JSON"),
        ("[0, 1, 2, 3]", "exactly the ids"),
        ('{"pad": 0, "unk": 1, "bos": 2}', "exactly the ids"),
        ('{"pad": 0, "unk": 1, "bos": 2, "eos": 99999}', "eos id must be an integer from 0 to"),
        ('{"pad": -1, "unk": 1, "bos": 2, "eos": 3}', "pad id"),
        ('{"pad": "0", "unk": 1, "bos": 2, "eos": 3}', "pad id"),
    ],
)
def test_damaged_special_ids_of_an_imported_vocabulary_are_one_line(tmp_path, content, words):
    """An imported (MarianMT) vocabulary's special_ids.json: an id past the vocabulary failed deep in the model."""
    folder = tmp_path / "vocab"
    folder.mkdir()
    pieces = ["</s>", "<unk>", *(f"▁{w}" for w in "abcdef"), "<pad>"]
    (folder / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}))
    train_sentencepiece([s for pair in tiny_pairs(100, 1) for s in pair], folder / "source.spm", DataConfig())
    shutil.copyfile(folder / "source.spm", folder / "target.spm")
    (folder / "special_ids.json").write_text(content)
    message = one_line_error(Tokenizer.from_folder, folder)
    assert str(folder / "special_ids.json") in message and words in message


def test_a_state_pt_without_the_training_state_is_refused(run_copy):
    folder = ckpt.list_checkpoints(run_copy)[-1]
    for payload in ({"update": 3}, [1, 2], {"weights": torch.zeros(2)}):
        torch.save(payload, folder / "state.pt")
        assert "refused (no " in one_line_error(ckpt.load_state, folder)


# ---------------------------------------------------------------------------------------------------------------------
# Translating and scoring


def test_a_beam_wider_than_the_vocabulary_is_refused_and_one_as_wide_works(tiny_run):
    translator = Translator.from_run(tiny_run, device="cpu", precision="fp32")
    vocab = translator.tokenizer.tgt_vocab_size
    for beam in (vocab + 1, 1000):
        message = one_line_error(translator.translate, ["the cat"], beam=beam)
        assert f"--beam {beam}: larger than the model's target vocabulary of {vocab}" in message
    assert len(translator.translate(["the cat"], beam=vocab, max_len_b=3)) == 1


def test_extreme_but_finite_length_limits_translate(tiny_run):
    translator = Translator.from_run(tiny_run, device="cpu", precision="fp32")
    for options in ({"max_len_a": 1e300}, {"max_len_b": 2**62, "beam": 2}):
        found = translator.translate_nbest(["the cat"], **options)
        assert found[0][0].tokens, options  # min_len 1: never empty


def test_eval_refuses_empty_and_blank_files_naming_them(tmp_path):
    files = {"empty": "", "blank": "\n \n\t\n", "text": "a b\nc d\ne f\n", "short": "a\n"}
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    cfg = Config(data=DataConfig(path="corpus"))
    for src, refs, words in (
        ("empty", ["empty"], f"--src {tmp_path / 'empty'} is empty: nothing to evaluate"),
        ("blank", ["blank"], f"--src {tmp_path / 'blank'} has only blank lines (3)"),
        ("text", ["blank"], f"--ref {tmp_path / 'blank'} has only blank lines (3)"),
        ("text", ["text", "blank"], f"--ref {tmp_path / 'blank'} has only blank lines (3)"),
        ("empty", ["short"], "line counts differ"),
    ):
        refs = [tmp_path / r for r in refs]
        assert words in one_line_error(evaluation_set, cfg, None, tmp_path / src, refs)
    assert "nothing to score" in one_line_error(corpus_scores, [], [[]], "de", ScoreOptions())


def test_a_checkpoint_with_another_tokenizer_beside_it_is_named(run_copy, tmp_path):
    """A folder whose SentencePiece model is another model's (a copy gone wrong): the vocabulary sizes differ."""
    other = tmp_path / "other.model"
    train_sentencepiece([s for pair in tiny_pairs(200, 2) for s in pair], other, DataConfig(vocab_size=40))
    folder = ckpt.list_checkpoints(run_copy)[-1]
    shutil.copyfile(other, folder / "spm.model")
    message = one_line_error(Translator.from_run, run_copy, device="cpu")
    assert "but the tokenizer beside it has" in message and "src_vocab_size" in message


def test_yaml_module_refusal_is_not_a_string_fallback(config_file):
    """--set values that are not YAML are taken as text (`>>deu<<`); values YAML refuses for their size are not."""
    assert load_config(config_file, ["data.src_prefix=>>deu<<"]).data.src_prefix == ">>deu<<"
    assert "refers to a value that contains it" in set_error(config_file, "data.src_prefix=&a [*a]")
    assert yaml.safe_load("&a [*a]")  # PyYAML itself builds the cycle: it is mtcli's loader that refuses it


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ("translate --run {run} --lenpen 1e308 x", "--lenpen: must be between 0 and 10"),
        ("translate --run {run} --sampling --temperature 1e-300 x", "--temperature: must be between 0.01 and 100"),
        ("translate --run {run} --sampling --top-p 1e-300 x", "--top-p: must be between 1e-6 and 1"),
        ("translate --run {run} --max-len-a inf x", "--max-len-a: inf is not allowed"),
        ("translate --run {run} --beam 1000 x", "--beam 1000: larger than the model's target vocabulary"),
        ("translate --run {run} --set decode.lenpen=.nan x", "decode.lenpen: nan is not allowed"),
        ("eval --run {run} --src {empty} --ref {empty}", "is empty: nothing to evaluate"),
        ("eval --run {run} --beam 1000 --src {text} --ref {text}", "larger than the model's target vocabulary"),
        ("data prepare --config {config} --set data.vocab_size=99999999999999999999", "data.vocab_size: 9999"),
        ("data prepare --config {config} --set model.layers=100000", "model.layers: must be between 1 and 1,000"),
        ("data prepare --config {config} --set train.lr=.inf", "train.lr: inf is not allowed"),
    ],
)
def test_the_commands_say_it_in_one_line(tiny_run, config_file, tmp_path, args, words):
    """The same refusals through the CLI (what `mtcli` prints as `error: ...` with status 2)."""
    from typer.testing import CliRunner

    from mtcli.cli import app

    (tmp_path / "empty").write_text("")
    (tmp_path / "text").write_text("the cat\n")
    names = {"run": tiny_run, "config": config_file, "empty": tmp_path / "empty", "text": tmp_path / "text"}
    argv = [word.format(**names) for word in args.split()]
    message = one_line_error(CliRunner().invoke, app, argv, catch_exceptions=False)
    assert words in message, message
