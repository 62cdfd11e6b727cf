"""The shipped configs: each builds the model its header claims, and each trains (a few updates) as shipped."""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import losses

from mtcli.checkpoint import checkpoint_dir
from mtcli.config import SHIPPED_CONFIGS
from mtcli.config_loader import load_config, shipped_config_names
from mtcli.model import Transformer
from mtcli.train import train

SHIPPED = shipped_config_names()
FINE_TUNING = "finetune.yaml"  # its model and data come from the command line (train.init_from, data.path)
# The CPU recipes whose figures the README reports, with the shared corpus each is trained on.
RECIPES = {"multi30k.yaml": "multi30k", "tatoeba-en-zh.yaml": "tatoeba-zh-en"}


def claimed(name: str) -> tuple[int, int]:
    """(parameters, vocabulary size) from the config's `# Model: N parameters with the V-piece ...` header line."""
    found = re.search(
        r"^# Model: ([\d,]+) parameters with the ([\d,]+)-piece", (SHIPPED_CONFIGS / name).read_text(), re.M
    )
    assert found, f"{name} has no `# Model: N parameters with the V-piece ...` line"
    return int(found[1].replace(",", "")), int(found[2].replace(",", ""))


@pytest.mark.parametrize("name", [n for n in SHIPPED if n != FINE_TUNING])
def test_every_shipped_config_builds_the_model_its_header_claims(name):
    cfg = load_config(name)
    parameters, vocab = claimed(name)
    assert cfg.data.vocab_size == vocab
    with torch.device("meta"):  # shapes only: big.yaml's 200M parameters need no memory or initialisation time
        model = Transformer(cfg.model, vocab, vocab, cfg.data.joint_vocab)
    assert model.num_parameters() == parameters


def test_the_fine_tuning_config_asks_for_its_data_and_starts_from_a_checkpoint():
    from mtcli.config import ConfigError

    with pytest.raises(ConfigError, match="data.path"):
        load_config(FINE_TUNING)
    cfg = load_config(FINE_TUNING, ["data.path=corpus", "train.init_from=runs/opus-en-de"])
    assert cfg.train.schedule == "constant" and cfg.train.lr < 1e-4 and cfg.train.patience > 0


@pytest.mark.system
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_cpu_recipes_train_as_shipped_on_their_corpus(name, shared_data, corpus_cache, tmp_path):
    """The recipe itself (model, schedule, precision auto, validation), only shortened to a few updates. The corpus is
    prepared at the recipe's data settings, as test_data prepares it: one SentencePiece fit per corpus and session."""
    overrides = [
        f"data.path={shared_data / RECIPES[name]}",
        f"data.cache_dir={corpus_cache}",
        "train.max_updates=3",
        "train.valid_every=3",
        "train.valid_max_sentences=8",
    ]
    cfg = load_config(name, overrides)
    result = train(cfg, tmp_path / "run")
    assert result.model.num_parameters() == claimed(name)[0]  # SentencePiece filled the whole vocabulary
    assert math.isfinite(losses(tmp_path / "run")[-1])
    assert (checkpoint_dir(tmp_path / "run") / "update_00000003" / "model.safetensors").is_file()


@pytest.mark.model
@pytest.mark.parametrize("name", ["base.yaml", "opus100-en-zh.yaml"])
def test_gpu_configs_train_a_few_updates_on_the_toy_corpus(name, tmp_path, toy_cache):
    """Their full-size models on a CPU: the toy corpus and small batches stand in for WMT and OPUS. (big.yaml differs
    from base.yaml only in sizes and dropout, and its 214M parameters would cost CI a minute for nothing new.) The data
    settings are toy.yaml's, so the toy corpus prepared for the other tests is found in the shared cache."""
    overrides = [
        "data.dataset=toy",
        "data.path=null",
        "data.subset=null",
        "data.src_lang=en",
        "data.tgt_lang=zh",
        "data.vocab_size=600",
        "data.character_coverage=1.0",
        "data.byte_fallback=false",
        "data.max_ratio=0",
        "data.splits={train: train, valid: valid, test: test}",
        "data.hub_splits=null",
        "data.spm_sample=500000",
        f"data.cache_dir={toy_cache}",
        "train.max_tokens=256",
        "train.tokens_per_update=0",
        "train.precision=fp32",
        "train.max_updates=2",
        "train.valid_every=2",
        "train.valid_max_sentences=2",
        "decode.precision=fp32",
        "decode.max_len_b=5",
    ]
    cfg = load_config(name, overrides)
    train(cfg, tmp_path / "run")
    assert math.isfinite(losses(tmp_path / "run")[-1])
    assert (checkpoint_dir(tmp_path / "run") / "update_00000002" / "model.safetensors").is_file()


@pytest.mark.parametrize("paper", ["base.yaml", "big.yaml"])
def test_one_gpu_recipes_are_the_paper_recipes_with_one_micro_batch_per_update_and_compile(paper):
    """base-1gpu.yaml / big-1gpu.yaml: the same model, data, schedule and update size (~25k target tokens); only the
    micro-batch (the whole update at once) and torch.compile differ."""
    from mtcli.checkpoint import config_differences

    one_gpu = load_config(paper.replace(".yaml", "-1gpu.yaml"))
    changes = config_differences(load_config(paper).to_dict(), one_gpu.to_dict())
    assert {key for key, _, _ in changes} - {"name"} == {"train.max_tokens", "train.compile"}
    assert one_gpu.train.max_tokens == one_gpu.train.tokens_per_update == 25000 and one_gpu.train.compile
