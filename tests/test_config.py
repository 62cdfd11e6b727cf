"""The config file: errors that name the key (and file), --set overrides, shipped configs, round trips."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from mtcli.config import SHIPPED_CONFIGS, ConfigError, ModelConfig, TrainConfig
from mtcli.config_loader import config_from_dict, load_config, replaced, resolve_config_path, shipped_config_names
from mtcli.errors import MtcliError

SHIPPED = shipped_config_names()


def write(tmp_path, tree: dict | str, name: str = "run.yaml"):
    path = tmp_path / name
    path.write_text(tree if isinstance(tree, str) else yaml.safe_dump(tree), encoding="utf-8")
    return path


def minimal(**sections) -> dict:
    """A valid tree (local files, so nothing is fetched) with some sections added or replaced."""
    tree = {"data": {"path": "corpus", "cache_dir": "cache"}}
    for name, values in sections.items():
        tree.setdefault(name, {}).update(values)
    return tree


def error_of(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert isinstance(info.value, MtcliError)  # what the CLI turns into `error: ...` and status 2
    message = str(info.value)
    assert "\n" not in message
    return message


def test_minimal_config_loads_with_defaults(tmp_path):
    cfg = load_config(write(tmp_path, minimal()))
    assert cfg.name == "run"  # the file's stem
    assert cfg.data.path == "corpus" and cfg.model == ModelConfig() and cfg.train == TrainConfig()


def test_unknown_key_names_closest_key_and_file(tmp_path):
    path = write(tmp_path, minimal(model={"d_modle": 256}))
    message = error_of(path)
    assert "`model.d_modle`" in message
    assert "did you mean `model.d_model`?" in message
    assert str(path) in message


def test_unknown_key_without_a_close_match_lists_valid_keys(tmp_path):
    message = error_of(write(tmp_path, minimal(decode={"zzzzzz": 1})))
    assert "decode.zzzzzz" in message and "beam" in message and "lenpen" in message


def test_unknown_section_names_closest_section(tmp_path):
    tree = minimal()
    tree["modle"] = {"layers": 2}
    path = write(tmp_path, tree)
    message = error_of(path)
    assert "`modle`" in message and "`model`" in message and str(path) in message


@pytest.mark.parametrize(
    ("section", "values", "key"),
    [
        ("model", {"d_model": 512, "heads": 7}, "model.heads"),
        ("model", {"dropout": -0.1}, "model.dropout"),
        ("model", {"src_word_dropout": 1.0}, "model.src_word_dropout"),
        ("model", {"layers": 0}, "model.layers"),
        ("model", {"layers": True}, "model.layers"),  # a bool is not an integer
        ("model", {"norm": "middle"}, "model.norm"),
        ("train", {"max_updates": "abc"}, "train.max_updates"),
        ("train", {"lr": "fast"}, "train.lr"),
        ("train", {"lr": 0}, "train.lr"),
        ("train", {"betas": [0.9]}, "train.betas"),
        ("train", {"label_smoothing": 1.0}, "train.label_smoothing"),
        ("decode", {"beam": 2, "nbest": 3}, "decode.nbest"),
        ("data", {"vocab_size": 8}, "data.vocab_size"),
        ("data", {"max_ratio": 0.5}, "data.max_ratio"),  # under 1 would drop every pair
        ("data", {"max_ratio": -1}, "data.max_ratio"),
        ("data", {"sampling_alpha": -0.1}, "data.sampling_alpha"),
        ("data", {"sampling_alpha": 1.0, "spm_model_type": "bpe"}, "data.sampling_alpha"),  # a dropout probability
        ("data", {"sampling_nbest": 1}, "data.sampling_nbest"),  # 0 or 1 would not sample
        ("data", {"tgt_lang": "en"}, "data.tgt_lang"),
        ("data", {"splits": "train"}, "data.splits"),
    ],
)
def test_bad_value_names_key_and_file(tmp_path, section, values, key):
    path = write(tmp_path, minimal(**{section: values}))
    message = error_of(path)
    assert message.startswith(f"{key}")
    assert str(path) in message


def test_missing_data_source_is_an_error(tmp_path):
    message = error_of(write(tmp_path, {"model": {"layers": 2}}))
    assert "data.dataset" in message and "data.path" in message


def test_not_a_mapping_and_bad_yaml_name_the_file(tmp_path):
    path = write(tmp_path, "- just\n- a list\n")
    assert str(path) in error_of(path)
    path = write(tmp_path, "data: {path: x\n", name="broken.yaml")
    message = error_of(path)
    assert str(path) in message and "YAML" in message


def test_set_overrides_are_typed(tmp_path):
    path = write(tmp_path, minimal())
    cfg = load_config(
        path,
        [
            "train.lr=5e-4",  # PyYAML reads 5e-4 as a string
            "model.layers=3",
            "train.betas=[0.9, 0.99]",
            "data.splits.valid=null",
            "data.hub_splits.test=test_2016",
            "decode.lenpen=1",  # an integer where a float is expected
            "name=renamed",
        ],
    )
    assert cfg.train.lr == 0.0005 and isinstance(cfg.train.lr, float)
    assert cfg.model.layers == 3 and isinstance(cfg.model.layers, int)
    assert cfg.train.betas == (0.9, 0.99)
    assert cfg.data.splits.valid is None and cfg.data.splits.train == "train"
    assert cfg.data.hub_splits.test == "test_2016" and cfg.data.hub_splits.train == "train"
    assert cfg.decode.lenpen == 1.0 and isinstance(cfg.decode.lenpen, float)
    assert cfg.name == "renamed"


def test_set_overrides_win_over_the_file(tmp_path):
    path = write(tmp_path, minimal(model={"layers": 2, "d_model": 64, "heads": 2}))
    assert load_config(path).model.layers == 2
    assert load_config(path, ["model.layers=5"]).model.layers == 5


@pytest.mark.parametrize("item", ["train.lr", "=5", "  =5"])
def test_set_without_key_value_is_an_error(tmp_path, item):
    message = error_of(write(tmp_path, minimal()), [item])
    assert "--set" in message and "KEY=VALUE" in message


def test_set_checks_keys_and_values_like_the_file(tmp_path):
    path = write(tmp_path, minimal())
    assert "did you mean `train.lr`?" in error_of(path, ["train.lrr=1"])
    assert error_of(path, ["model.dropout=-1"]).startswith("model.dropout")
    assert error_of(path, ["train.max_updates=abc"]).startswith("train.max_updates")
    # a --set mistake is blamed on --set, not on the (valid) file; the file's own mistakes still name the file
    for item in ("train.lrr=1", "model.dropout=-1", "train.max_updates=abc"):
        message = error_of(path, [item])
        assert "--set" in message and str(path) not in message, message
    broken = write(tmp_path, minimal(model={"d_modle": 256}))
    assert str(broken) in error_of(broken, ["train.lr=1e-3"])


@pytest.mark.parametrize("name", ["multi30k.yaml", "multi30k", "configs/multi30k.yaml"])
def test_resolve_config_path_finds_shipped_configs_from_any_cwd(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    assert resolve_config_path(name) == SHIPPED_CONFIGS / "multi30k.yaml"
    assert load_config(name).name == "multi30k"


def test_local_file_wins_over_shipped_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, minimal(model={"layers": 1}), name="toy.yaml")
    assert load_config("toy.yaml").model.layers == 1


def test_missing_config_lists_shipped_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = error_of("nope.yaml")
    assert "nope.yaml" in message and "multi30k.yaml" in message and "toy.yaml" in message


def test_shipped_configs_are_there():
    assert {"base.yaml", "big.yaml", "multi30k.yaml", "opus100-en-zh.yaml", "toy.yaml"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_loads_and_round_trips(tmp_path, name):
    # finetune.yaml names its data on the command line (data.path), as its header says
    cfg = load_config(name, ["data.path=corpus"] if name == "finetune.yaml" else [])
    assert cfg.name == name.removesuffix(".yaml")
    assert config_from_dict(cfg.to_dict()) == cfg
    again = write(tmp_path, cfg.to_yaml(), name="resolved.yaml")
    assert load_config(again) == cfg
    # The dict is plain YAML data (lists, not tuples), so the saved config is readable by anything.
    assert yaml.safe_load(cfg.to_yaml()) == cfg.to_dict()


def test_round_trip_keeps_non_default_values(tmp_path):
    cfg = load_config(
        write(tmp_path, minimal()),
        ["data.hub_splits={train: a, valid: b, test: null}", "train.betas=[0.8, 0.9]", "train.eps=1e-7"],
    )
    assert config_from_dict(cfg.to_dict()) == cfg
    assert load_config(write(tmp_path, cfg.to_yaml(), name="again.yaml")) == cfg


def test_replace_sets_dotted_keys_and_checks_them():
    cfg = load_config("toy.yaml")
    changed = replaced(cfg, **{"train.seed": 3, "model.layers": 4})
    assert changed.train.seed == 3 and changed.model.layers == 4 and cfg.train.seed == 1
    assert dataclasses.replace(changed.train, seed=1) == cfg.train
    with pytest.raises(ConfigError, match="model.heads"):
        replaced(cfg, **{"model.heads": 5})


def test_base_yaml_is_transformer_base():
    cfg = load_config("base.yaml")
    m, t, d = cfg.model, cfg.train, cfg.decode
    assert (m.n_encoder_layers, m.n_decoder_layers, m.d_model, m.heads, m.d_ff) == (6, 6, 512, 8, 2048)
    assert m.dropout == 0.1 and m.norm == "post" and m.positions == "sinusoidal" and m.tie_embeddings
    assert t.label_smoothing == 0.1 and t.betas == (0.9, 0.98) and t.eps == 1e-9
    assert t.schedule == "inverse_sqrt" and t.warmup == 4000
    assert t.lr == pytest.approx(512**-0.5 * 4000**-0.5, rel=0.02)
    assert (d.beam, d.lenpen) == (4, 0.6)
    assert 32_000 <= cfg.data.vocab_size <= 37_000 and cfg.data.joint_vocab
    assert (cfg.data.src_lang, cfg.data.tgt_lang) == ("en", "de")


@pytest.mark.parametrize("content", ["- data\n- model\n", "just words\n", "42\n"])
def test_a_config_that_is_not_a_mapping_names_the_file(tmp_path, content):
    path = write(tmp_path, content)
    assert error_of(path) == f"{path}: expected a mapping with sections data, model, train, decode (and distill)"
