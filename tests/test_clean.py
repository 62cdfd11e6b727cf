"""Cleaning the training pairs (data.clean) and mixing several training corpora by weight (data.train_corpora):
exact counts of each defect, settings that re-prepare, and exact resume of a weighted run."""

import itertools
import sys

import numpy as np
import pytest
import torch
import yaml
from conftest import losses

from mtcli import checkpoint as ckpt
from mtcli.clean import (
    REASONS,
    ChunkFilter,
    LanguageId,
    describe_drops,
    flatten,
    letter_classes,
    longest_runs,
    other_script_shares,
)
from mtcli.config_loader import load_config
from mtcli.data import prepare
from mtcli.errors import MtcliError
from mtcli.mixture import epoch_examples
from mtcli.train import train

SPLITS = {"train": "train", "valid": "valid", "test": None}


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """Keep the Arrow files `datasets` writes for local files out of the user's ~/.cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


def sentence_pairs() -> list[tuple[str, str]]:
    """480 distinct English/German pairs that py3langid names English and German."""
    en = (["red", "big", "small", "old", "young", "happy"], ["man", "woman", "child", "dog", "cat"])
    de = (["rote", "große", "kleine", "alte", "junge", "fröhliche"], ["Mann", "Frau", "Kind", "Hund", "Katze"])
    verbs = [("sees", "sieht"), ("likes", "mag"), ("finds", "findet"), ("draws", "malt")]
    objects = [("the house", "das Haus"), ("a tree", "einen Baum"), ("the ball", "den Ball"), ("a car", "ein Auto")]
    pairs = []
    for (a, b), (c, d), (e, f), (g, h) in itertools.product(zip(en[0], de[0]), zip(en[1], de[1]), verbs, objects):
        pairs.append((f"The {a} {c} {e} {g}.", f"Der {b} {d} {f} {h}."))
    return pairs


NORMAL = sentence_pairs()[:120]
DEFECTS = {
    "empty": [("", "Der Hund sieht den Ball.")],
    "too_long": [(" ".join(["The dog sees the cat."] * 12), " ".join(["Der Hund sieht die Katze."] * 12))],
    "duplicate": [NORMAL[0], NORMAL[1], NORMAL[2], (f"  {NORMAL[3][0]}  ", NORMAL[3][1].replace(" ", "   "))],
    "copy": [("Hund Katze Maus", "Hund Katze Maus"), ("The dog.", "The dog.")],
    "repeat": [(" ".join(["the"] * 10), "Der Hund sieht den Ball.")],
    "script": [("The dog sees the ball.", "Собака видит мяч."), ("Собака видит мяч.", "Der Hund sieht den Ball.")],
    "langid": [
        ("Der Mann sieht das rote Haus.", "Der Mann sieht das Haus."),
        ("Un homme regarde la maison.", "Ein Mann"),
    ],
}


def write_corpus(folder, split: str, pairs) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{split}.en").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    (folder / f"{split}.de").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")


def make_config(tmp_path, data: dict, overrides=()):
    tree = {"data": {"src_lang": "en", "tgt_lang": "de", "vocab_size": 100, "cache_dir": str(tmp_path / "cache")}}
    tree["data"].update({"splits": SPLITS, "max_len": 40, "max_ratio": 0, **data})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree, allow_unicode=True), encoding="utf-8")
    return load_config(path, list(overrides))


def test_the_report_counts_exactly_the_defects_of_each_kind(tmp_path, log):
    pytest.importorskip("py3langid")
    folder = tmp_path / "corpus"
    defects = [pair for pairs in DEFECTS.values() for pair in pairs]
    write_corpus(folder, "train", NORMAL + defects)
    write_corpus(folder, "valid", defects + NORMAL[:5])
    data = prepare(make_config(tmp_path, {"path": str(folder), "clean": {"langid": True}}))
    assert len(data.tokenizer.encode_src(["the"])[0]) == 1, "the repeat defect needs `the` to be one piece"
    train_counts = data.meta["splits"]["train"]
    assert {reason: train_counts[reason] for reason in DEFECTS} == {k: len(v) for k, v in DEFECTS.items()}
    assert train_counts["ratio"] == 0 and train_counts["kept"] == len(NORMAL) == len(data.split("train"))
    expected = (
        "dropped 1 with an empty side, 1 over 40 subwords, 4 duplicates, 2 copies (source = target), 1 with a piece "
        "repeated over 6 times, 2 over 80% letters in another script, 2 in another language"
    )
    assert any(expected in line for line in log), log
    text = data.tokenizer.src.decode([data.split("train").src(i).tolist() for i in range(len(NORMAL))])
    assert text == [s for s, _ in NORMAL]  # the kept pairs, in their order
    valid = data.meta["splits"]["valid"]
    assert valid["total"] == valid["kept"] == len(defects) + 5  # eval splits are never filtered

    # Each setting is part of the cache key: turned off, the same corpus is prepared again and keeps more.
    off = {"duplicates": False, "copies": False, "max_repeat": 0, "max_other_script": 1.0}
    unfiltered = prepare(make_config(tmp_path, {"path": str(folder), "clean": off}))
    assert unfiltered.folder != data.folder
    assert unfiltered.meta["splits"]["train"]["kept"] == len(NORMAL + defects) - 2  # the empty and the too long
    defaults = prepare(make_config(tmp_path, {"path": str(folder)}))  # langid off
    assert defaults.meta["splits"]["train"]["kept"] == len(NORMAL) + len(DEFECTS["langid"])
    assert not any("another language" in line for line in log[-3:])


def test_the_report_names_the_ratio_filter_only_when_it_is_on(tmp_path):
    counts = dict.fromkeys(REASONS, 0) | {"ratio": 7}
    config = lambda ratio: make_config(tmp_path, {"path": str(tmp_path), "max_ratio": ratio}).data  # noqa: E731
    assert "ratio" not in describe_drops(counts, config(0))  # 0: off
    assert "7 over length ratio 2.5" in describe_drops(counts, config(2.5))


def test_script_shares_runs_and_languages_without_a_script(tmp_path):
    zh = letter_classes("zh-CN")
    assert other_script_shares(["Tom知道。", "1984"], zh).tolist() == pytest.approx([3 / 5, 0])  # 。 is no letter
    assert other_script_shares(["ラーメンを食べた"], letter_classes("ja"))[0] == 0  # ー is Hiragana and Katakana's
    assert other_script_shares(["Привет, мир"], letter_classes("sr"))[0] == 0 and letter_classes("xx") is None
    assert longest_runs(*flatten([[5, 5, 7, 7, 7, 5], []])).tolist() == [3, 0]
    notes = ChunkFilter(make_config(tmp_path, {"path": "corpus", "src_lang": "xx"}).data).notes
    assert notes == ["note: data.clean.max_other_script: no script known for `xx`, so that side is not checked"]


def test_language_identification_errors_are_one_line(monkeypatch):
    pytest.importorskip("py3langid")
    with pytest.raises(MtcliError, match="py3langid does not know data.tgt_lang `tlh`"):
        LanguageId("en", "tlh", 0.5)
    assert LanguageId("en", "zh", 0.5).other_language("I love apples.", "我喜欢苹果。") is False  # named Cantonese
    monkeypatch.setitem(sys.modules, "py3langid", None)
    monkeypatch.setitem(sys.modules, "py3langid.langid", None)
    with pytest.raises(MtcliError, match=r"pip install 'mtcli\[langid\]'"):
        LanguageId("en", "de", 0.5)


# ---------------------------------------------------------------------------------------------------------------------
# Several training corpora


def write_two_corpora(tmp_path) -> None:
    """Corpus `a` (60 pairs, with the valid split) and `b` (40 pairs and 2 of a's again)."""
    pairs = sentence_pairs()
    write_corpus(tmp_path / "a", "train", pairs[:60])
    write_corpus(tmp_path / "a", "valid", pairs[200:210])
    write_corpus(tmp_path / "b", "train", pairs[60:100] + pairs[:2])


def two_corpora(tmp_path, weights=(1.0, 2.5)) -> dict:
    """Data settings that train on corpora `a` and `b` with `weights`."""
    corpora = [{"path": str(tmp_path / name), "weight": w} for name, w in zip("ab", weights)]
    return {"path": str(tmp_path / "a"), "train_corpora": corpora}


def test_corpora_are_read_as_one_split_tallied_and_sampled_by_weight(tmp_path, log):
    write_two_corpora(tmp_path)
    cfg = make_config(tmp_path, two_corpora(tmp_path))
    data = prepare(cfg)
    train_counts = data.meta["splits"]["train"]
    assert train_counts["total"] == 102 and train_counts["kept"] == 100 and train_counts["duplicate"] == 2
    assert [(c["total"], c["kept"]) for c in train_counts["corpora"]] == [(60, 60), (42, 40)]
    assert any(line.strip().endswith("42 pairs, kept 40, weight 2.5") for line in log)
    corpus = np.load(data.folder / "train.corpus.npy")
    assert corpus.tolist() == [0] * 60 + [1] * 40
    split, usable = data.split("train"), np.arange(100)
    first = epoch_examples(split, usable, cfg, epoch=0)
    assert np.bincount(corpus[first]).tolist() == [60, 100]  # b: twice, and a random half once more
    assert np.array_equal(first, epoch_examples(split, usable, cfg, epoch=0))  # seeded: every rank, every resume
    assert not np.array_equal(first, epoch_examples(split, usable, cfg, epoch=1))  # a new half each epoch
    equal = make_config(tmp_path, two_corpora(tmp_path, weights=(1.0, 1.0)))
    assert prepare(equal).folder == data.folder  # weights are read at training time, not cached
    assert epoch_examples(split, usable, equal, epoch=0) is usable
    write_corpus(tmp_path / "b", "train", sentence_pairs()[60:101])  # a corpus's content is in the cache key
    assert prepare(make_config(tmp_path, two_corpora(tmp_path))).folder != data.folder


@pytest.mark.model
def test_resume_with_corpus_weights_gives_the_same_losses(tmp_path):
    """Stopped at update 7 and resumed: the per-update losses and weights of an uninterrupted run, across epochs
    whose examples are drawn anew by weight."""
    write_two_corpora(tmp_path)
    data = two_corpora(tmp_path, weights=(0.5, 1.5))
    settings = {"model.layers": 1, "model.d_model": 32, "model.heads": 2, "model.d_ff": 64, "train.max_tokens": 600}
    settings |= {"train.max_updates": 16, "train.valid_every": 8, "train.log_every": 1, "train.warmup": 4}
    settings |= {"train.threads": 1, "train.precision": "fp32", "decode.precision": "fp32", "model.max_positions": 64}
    overrides = [f"{k}={v}" for k, v in settings.items()]
    full = train(make_config(tmp_path, data, overrides), tmp_path / "full")
    train(make_config(tmp_path, data, [*overrides, "train.max_updates=7"]), tmp_path / "part")
    resumed = train(make_config(tmp_path, data, overrides), tmp_path / "part", resume=True)
    assert resumed.update == full.update == 16
    assert losses(tmp_path / "part") == losses(tmp_path / "full")
    state = torch.load(ckpt.last_checkpoint(tmp_path / "part") / "state.pt", weights_only=True)
    assert state["epoch"] >= 2  # the resumed part drew the examples of new epochs
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
