"""The data path: every source layout, its errors, cleaning, the cache, batching, and the shipped corpora."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import tiny_pairs

import mtcli.data
from mtcli.batching import epoch_batches, padding_counts
from mtcli.clean import clean_line
from mtcli.cli import main
from mtcli.config_loader import load_config
from mtcli.corpus import open_splits, split_names
from mtcli.data import eval_texts, prepare
from mtcli.errors import MtcliError
from mtcli.line_io import check_utf8, has_bare_cr
from mtcli.toy import REQUIRED_TRAIN_PAIR, toy_pairs, write_toy_corpus

SPLITS = {"train": "train", "valid": "valid", "test": "test"}


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """Keep the Arrow files `datasets` writes for local files out of the user's ~/.cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


def make_config(tmp_path, data: dict, name: str = "run.yaml", overrides=()):
    """A config loaded from a YAML file in tmp_path (as a user would write it), its cache in tmp_path."""
    tree = {"data": {"src_lang": "en", "tgt_lang": "de", "vocab_size": 100, "cache_dir": str(tmp_path / "cache")}}
    tree["data"].update(data)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(tree, allow_unicode=True), encoding="utf-8")
    return load_config(path, list(overrides))


def write_text_pair(folder: Path, split: str, pairs, src="en", tgt="de") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{split}.{src}").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    (folder / f"{split}.{tgt}").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")


def write_layout(folder: Path, layout: str, split: str, pairs) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "text":
        write_text_pair(folder, split, pairs)
    elif layout == "tsv":
        (folder / f"{split}.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in pairs), encoding="utf-8")
    else:
        rows = [{"en": s, "de": t} if layout == "jsonl" else {"translation": {"de": t, "en": s}} for s, t in pairs]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def decode_all(data, split):
    """Source and target ids of every pair of a prepared split, decoded back to text."""
    tok = data.tokenizer
    return (
        tok.src.decode([split.src(i).tolist() for i in range(len(split))]),
        tok.decode_tgt([split.tgt(i).tolist() for i in range(len(split))]),
    )


def no_leftovers(cache_dir: Path) -> bool:
    """A failed prepare leaves neither a temporary folder nor a cache folder behind."""
    return not cache_dir.exists() or not [p for p in cache_dir.iterdir() if p.name != "toy-corpus"]


# ---------------------------------------------------------------------------------------------------------------------
# Local formats


def noisy(pairs):
    """Some pairs with extra spaces around and inside (a TSV field cannot hold a tab, so spaces only)."""
    return [(f"  {s.replace(' ', '   ', 1)} ", f"{t}  ") if i % 3 == 0 else (s, t) for i, (s, t) in enumerate(pairs)]


@pytest.mark.parametrize("layout", ["text", "tsv", "jsonl", "jsonl-nested"])
def test_each_local_format_loads(tmp_path, layout):
    folder = tmp_path / "corpus"
    corpus = {"train": tiny_pairs(200, 1), "valid": noisy(tiny_pairs(15, 2)), "test": noisy(tiny_pairs(12, 3))}
    for split, pairs in corpus.items():
        write_layout(folder, layout, split, pairs)
    cfg = make_config(tmp_path, {"path": str(folder), "splits": SPLITS})
    data = prepare(cfg)

    assert data.roles == ["train", "valid", "test"]
    for role, pairs in corpus.items():
        counts = data.meta["splits"][role]
        assert counts["total"] == counts["kept"] == len(pairs) == len(data.split(role))
    for role in ("valid", "test"):
        split = data.split(role)
        expected = ([clean_line(s) for s, _ in corpus[role]], [clean_line(t) for _, t in corpus[role]])
        assert split.texts() == expected
        assert eval_texts(cfg, role) == expected  # what `mtcli eval` reads
        assert decode_all(data, split) == expected
    train = data.split("train")
    assert decode_all(data, train)[1] == [t for _, t in corpus["train"]]
    assert (train.src_lens == [len(train.src(i)) + 1 for i in range(len(train))]).all()


@pytest.mark.parametrize("layout", ["text", "tsv", "jsonl", "jsonl-nested"])
def test_a_split_source_reads_rows_by_range(tmp_path, layout):
    folder = tmp_path / "corpus"
    pairs = tiny_pairs(30, 1)
    write_layout(folder, layout, "train", pairs)
    split = open_splits(make_config(tmp_path, {"path": str(folder)}).data, tmp_path / "cache")["train"]
    for start, stop in ((5, 9), (0, 3), (28, 30), (2, 40)):  # an earlier row after a later one; a stop past the end
        sources, targets = split.rows(start, stop)
        assert (list(sources), list(targets)) == ([s for s, _ in pairs[start:stop]], [t for _, t in pairs[start:stop]])


def test_format_setting_picks_one_of_several_layouts(tmp_path):
    folder = tmp_path / "corpus"
    write_layout(folder, "text", "train", tiny_pairs(100, 1))
    write_layout(folder, "jsonl", "train", tiny_pairs(60, 2))
    train_total = lambda **data: prepare(  # noqa: E731
        make_config(tmp_path, {"path": str(folder), **data})
    ).meta["splits"]["train"]["total"]
    assert train_total() == 100  # auto: the text pair first
    assert train_total(format="jsonl") == 60
    with pytest.raises(MtcliError, match="no train split"):
        prepare(make_config(tmp_path, {"path": str(folder), "format": "tsv"}))


def test_column_settings_pick_named_columns(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    pairs = tiny_pairs(80, 1)
    rows = [{"source": s, "target": t, "id": i} for i, (s, t) in enumerate(pairs)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    with pytest.raises(MtcliError, match="no column `en`.*data.src_column"):
        prepare(make_config(tmp_path, {"path": str(folder)}))
    cfg = make_config(tmp_path, {"path": str(folder), "src_column": "source", "tgt_column": "target"})
    data = prepare(cfg)
    assert decode_all(data, data.split("train"))[1] == [t for _, t in pairs]


# ---------------------------------------------------------------------------------------------------------------------
# A folder laid out like a Hub dataset: read by datasets.load_dataset(name, subset), exactly like the Hub


HUB_README = """---
configs:
- config_name: en-de
  data_files:
  - split: train
    path: en-de/train.{ext}
  - split: validation
    path: en-de/validation.{ext}
  - split: test
    path: en-de/test.{ext}
---
# A tiny English-German corpus
"""


def write_hub_folder(root: Path, ext: str) -> dict[str, list[tuple[str, str]]]:
    corpus = {"train": tiny_pairs(150, 1), "validation": tiny_pairs(10, 2), "test": tiny_pairs(8, 3)}
    (root / "en-de").mkdir(parents=True)
    (root / "README.md").write_text(HUB_README.format(ext=ext))
    for split, pairs in corpus.items():
        path = root / "en-de" / f"{split}.{ext}"
        if ext == "jsonl":  # the `translation` column of the Hub's translation datasets
            rows = [{"translation": {"en": s, "de": t}} for s, t in pairs]
            path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        else:  # flat columns named after the languages
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"en": [s for s, _ in pairs], "de": [t for _, t in pairs]}), path)
    return corpus


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_hub_layout_folder_loads_subset(tmp_path, ext):
    corpus = write_hub_folder(tmp_path / "hub", ext)
    cfg = make_config(tmp_path, {"dataset": str(tmp_path / "hub"), "subset": "en-de"})
    data = prepare(cfg)
    assert {role: s["name"] for role, s in data.meta["splits"].items()} == {
        "train": "train",
        "valid": "validation",
        "test": "test",
    }
    assert data.meta["splits"]["train"]["kept"] == 150
    pairs = corpus["test"]
    assert data.split("test").texts() == ([s for s, _ in pairs], [t for _, t in pairs])
    assert decode_all(data, data.split("valid"))[1] == [t for _, t in corpus["validation"]]


def test_hub_splits_are_used_for_the_hub_and_splits_for_local_files(tmp_path):
    write_hub_folder(tmp_path / "hub", "jsonl")
    data_cfg = {
        "dataset": str(tmp_path / "hub"),
        "subset": "en-de",
        "splits": {"train": "train", "valid": "dev", "test": "newstest"},  # the names of the local release
        "hub_splits": {"train": "train", "valid": "validation", "test": None},
    }
    cfg = make_config(tmp_path, data_cfg)
    assert split_names(cfg.data) == {"train": "train", "valid": "validation"}
    data = prepare(cfg)
    assert data.roles == ["train", "valid"] and data.meta["splits"]["valid"]["name"] == "validation"

    local = tmp_path / "local"
    write_text_pair(local, "train", tiny_pairs(100, 4))
    write_text_pair(local, "dev", tiny_pairs(7, 5))
    write_text_pair(local, "newstest", tiny_pairs(6, 6))
    cfg = make_config(tmp_path, {**data_cfg, "path": str(local)})  # data.path wins over data.dataset
    assert split_names(cfg.data) == {"train": "train", "valid": "dev", "test": "newstest"}
    data = prepare(cfg)
    assert {role: s["total"] for role, s in data.meta["splits"].items()} == {"train": 100, "valid": 7, "test": 6}


def test_hub_layout_folder_with_unknown_subset_is_one_line_error(tmp_path):
    write_hub_folder(tmp_path / "hub", "jsonl")
    cfg = make_config(tmp_path, {"dataset": str(tmp_path / "hub"), "subset": "xx-yy"})
    with pytest.raises(MtcliError) as info:
        prepare(cfg)
    message = str(info.value)
    assert "subset `xx-yy`" in message and "data.path" in message and "\n" not in message


def test_local_sources_make_no_network_calls(tmp_path, tiny_corpus, monkeypatch):
    """Local files and folders must not wait on the network (an offline machine would stall on every file)."""
    calls = []

    def no_network(host, *args, **kwargs):
        calls.append(host)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    prepare(make_config(tmp_path, {"path": str(tiny_corpus), "splits": SPLITS}))
    write_hub_folder(tmp_path / "hub", "jsonl")
    prepare(make_config(tmp_path, {"dataset": str(tmp_path / "hub"), "subset": "en-de"}))
    assert calls == []


# ---------------------------------------------------------------------------------------------------------------------
# The Hub out of reach


def test_unreachable_hub_fails_fast_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a closed port
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cfg = make_config(tmp_path, {"dataset": "someone/nonexistent"})
    start = time.monotonic()
    with pytest.raises(MtcliError) as info:
        prepare(cfg)
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert "\n" not in message
    assert "someone/nonexistent" in message and "127.0.0.1:9" in message and "data.path" in message
    assert no_leftovers(tmp_path / "cache")


def run_cli(tmp_path, *args, env_extra=None):
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"), **(env_extra or {})}
    env.pop("HF_HUB_OFFLINE", None)
    return subprocess.run(
        [sys.executable, "-m", "mtcli", *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )


@pytest.mark.system
def test_cli_unreachable_hub_exits_2_with_one_error_line(tmp_path):
    config = tmp_path / "hub.yaml"
    config.write_text(yaml.safe_dump({"data": {"dataset": "someone/nonexistent"}}))
    result = run_cli(
        tmp_path,
        *("data", "prepare", "--config", str(config), "--set", f"data.cache_dir={tmp_path / 'cache'}"),
        env_extra={"HF_ENDPOINT": "http://127.0.0.1:9"},
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "data.path" in lines[0]


@pytest.mark.system
def test_cli_config_error_exits_2_with_one_error_line(tmp_path, tiny_corpus):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"data": {"path": str(tiny_corpus)}}))
    result = run_cli(tmp_path, "data", "prepare", "--config", str(config), "--set", "model.d_modle=64")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: unknown key `model.d_modle` in --set; did you mean `model.d_model`?"  # the typo is --set's
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Broken inputs


def test_line_count_mismatch_names_both_files_and_counts(tmp_path):
    folder = tmp_path / "corpus"
    write_text_pair(folder, "train", tiny_pairs(5, 1))
    (folder / "train.de").write_text("".join(t + "\n" for _, t in tiny_pairs(4, 1)), encoding="utf-8")
    with pytest.raises(MtcliError) as info:
        prepare(make_config(tmp_path, {"path": str(folder)}))
    message = str(info.value)
    assert f"{folder / 'train.en'} has 5 lines" in message and f"{folder / 'train.de'} has 4" in message
    assert no_leftovers(tmp_path / "cache")


@pytest.mark.parametrize("layout", ["text", "tsv", "jsonl"])
def test_non_utf8_bytes_name_file_and_line(tmp_path, layout):
    folder = tmp_path / "corpus"
    write_layout(folder, layout, "train", [("Grüße aus Köln", "x y"), ("中文 text", "ok"), ("a b", "c d")])
    path = folder / {"text": "train.en", "tsv": "train.tsv", "jsonl": "train.jsonl"}[layout]
    lines = path.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b"a b", b"a \xff\xfe b")
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(MtcliError) as info:
        prepare(make_config(tmp_path, {"path": str(folder)}))
    assert f"{path}:3:" in str(info.value) and "UTF-8" in str(info.value)


def test_check_utf8_line_numbers_across_chunk_boundaries(tmp_path):
    path = tmp_path / "f.txt"
    # Multi-byte characters everywhere, so chunks end inside characters; the bad bytes are on line 4, right before
    # a line end (bytes held over from the last chunk must not shift the count past it).
    good = "é中\n😀 ü\n中文中文\n".encode()
    cases = [
        (good + "ab中中".encode() + b"\xff\n" + "€\n".encode(), "not valid UTF-8 .invalid start byte"),
        (good + "ab中".encode() + b"\xe4\x41\n" + "€\n".encode(), "not valid UTF-8 .invalid continuation byte"),
        (good + b"ab" + "中".encode()[:2], "not valid UTF-8 .the file ends inside"),
    ]
    for content, message in cases:
        path.write_bytes(content)
        for chunk_size in [*range(1, 41), 1 << 24]:
            with pytest.raises(MtcliError, match=rf"^{re.escape(str(path))}:4: {message}"):
                check_utf8(path, chunk_size=chunk_size)
    path.write_bytes(good * 3)
    for chunk_size in [*range(1, 41), 1 << 24]:
        check_utf8(path, chunk_size=chunk_size)


def test_tsv_line_without_one_tab_names_file_and_line(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    lines = [f"{s}\t{t}" for s, t in tiny_pairs(10, 1)]
    lines[3] = "no tab on this line"
    (folder / "train.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(MtcliError, match=rf"{re.escape(str(folder / 'train.tsv'))}:4: expected `source<TAB>target`"):
        prepare(make_config(tmp_path, {"path": str(folder)}))


def test_missing_train_split_is_an_error(tmp_path):
    folder = tmp_path / "corpus"
    write_text_pair(folder, "training", tiny_pairs(10, 1))
    with pytest.raises(MtcliError) as info:
        prepare(make_config(tmp_path, {"path": str(folder)}))
    assert "no train split `train`" in str(info.value) and "data.splits.train" in str(info.value)
    assert no_leftovers(tmp_path / "cache")
    with pytest.raises(MtcliError, match="is not a folder"):
        prepare(make_config(tmp_path, {"path": str(tmp_path / "nowhere")}))


def test_missing_eval_split_is_skipped_with_a_note(tmp_path, tiny_corpus, log):
    (tiny_corpus / "test.en").unlink()
    log.clear()
    data = prepare(make_config(tmp_path, {"path": str(tiny_corpus), "splits": SPLITS}))
    assert data.roles == ["train", "valid"]
    notes = [line for line in log if "skipping" in line]
    assert len(notes) == 1 and "test" in notes[0]
    with pytest.raises(MtcliError, match="no test split"):
        data.split("test")


def test_null_splits_are_not_used(tmp_path, tiny_corpus, log):
    cfg = make_config(tmp_path, {"path": str(tiny_corpus), "splits": {"train": "train", "valid": None, "test": None}})
    log.clear()
    assert prepare(cfg).roles == ["train"]
    assert not [line for line in log if "skipping" in line]


def test_lone_carriage_return_stays_inside_its_line(tmp_path):
    """A \\r inside a line (not \\r\\n) must not split it: the two sides would silently shift against each other."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    en = [f"line {i} one two" for i in range(40)]
    de = [f"zeile {i} eins zwei" for i in range(40)]
    en[5], de[9] = "line five\rcontinued", "zeile neun\rweiter"
    (folder / "train.en").write_bytes("".join(s + "\n" for s in en).encode())
    (folder / "train.de").write_bytes("".join(s + "\n" for s in de).encode())
    # Windows line ends are plain line ends.
    (folder / "test.en").write_bytes(b"a b\r\nc  d\r\n")
    (folder / "test.de").write_bytes(b"A B\r\nC D\r\n")
    data = prepare(make_config(tmp_path, {"path": str(folder), "splits": SPLITS}))
    assert data.meta["splits"]["train"]["total"] == 40
    targets = decode_all(data, data.split("train"))[1]
    assert targets[9] == "zeile neun weiter" and targets[10] == "zeile 10 eins zwei"
    assert decode_all(data, data.split("train"))[0][5] == "line five continued"
    assert data.split("test").texts() == (["a b", "c d"], ["A B", "C D"])


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 1 << 24])
def test_has_bare_cr(tmp_path, chunk_size):
    path = tmp_path / "f.txt"
    for content, expected in [
        (b"a\r\nb\r\n", False),
        (b"a\nb", False),
        (b"a\rb\n", True),
        (b"a\r\nb\r", True),
        (b"a\r\r\n", True),
        (b"ab\r\n\r\ncd\r", True),
    ]:
        path.write_bytes(content)
        assert has_bare_cr(path, chunk_size=chunk_size) is expected, content


def test_json_nulls_are_empty_sides(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    pairs = tiny_pairs(60, 1)
    rows = [{"translation": {"en": s, "de": t}} for s, t in pairs]
    rows += [{"translation": {"en": None, "de": "der Hund"}}, {"translation": None}]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    test = [
        {"translation": None},
        {"translation": {"en": "the dog", "de": None}},
        {"translation": rows[0]["translation"]},
    ]
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test), encoding="utf-8")
    data = prepare(make_config(tmp_path, {"path": str(folder)}))
    train = data.meta["splits"]["train"]
    assert (train["total"], train["kept"], train["empty"]) == (62, 60, 2)
    assert data.split("test").texts() == (["", "the dog", pairs[0][0]], ["", "", pairs[0][1]])


NESTED = '{"translation": {"en": "a cat", "de": "eine Katze"}}'
FLAT = '{"en": "a cat", "de": "eine Katze"}'


@pytest.mark.parametrize(
    ("good", "bad", "words"),
    [
        (NESTED, '{"translation": {"en": "a", "de": "b"', "not valid JSON (Expecting ',' delimiter at column"),
        (NESTED, "not json at all", "not valid JSON (Expecting value at column 1)"),
        (NESTED, '["a cat", "eine Katze"]', "expected a JSON object"),
        (NESTED, '"a cat"', "expected a JSON object"),
        (NESTED, "1" * 5000, "not valid JSON"),  # Python's int() refuses the digits
        (NESTED, '{"translation": "a cat"}', "`translation` is"),
        (NESTED, '{"translation": {"en": ["a", "cat"], "de": "b"}}', "`translation.en` is a list"),
        (NESTED, '{"translation": {"en": "a", "de": {"text": "b"}}}', "`translation.de` is an object"),
        (FLAT, '{"en": {"text": "a"}, "de": "b"}', "`en` is an object"),
        (FLAT, '{"en": "a", "de": true}', "`de` is"),
    ],
)
@pytest.mark.parametrize("blank_lines", [0, 2])  # the reader skips blank lines: line numbers must not
def test_a_malformed_jsonl_line_is_named_by_file_and_line(tmp_path, good, bad, words, blank_lines):
    """Errors the datasets reader gives without a line ("An error occurred while generating the dataset"), values
    that are not sentences (a list would have been trained on as its Python repr): each names its line."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    lines = [good] * 40
    lines[5:5] = [""] * blank_lines
    lines.insert(30, bad)
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(MtcliError) as info:
        prepare(make_config(tmp_path, {"path": str(folder)}))
    message = str(info.value)
    assert message.startswith(f"{folder / 'train.jsonl'}:31: ") and words in message and "\n" not in message
    assert no_leftovers(tmp_path / "cache")


@pytest.mark.parametrize("content", ["{", "[]", '{"dtype": "uint16"}', '{"dtype": "float64", "splits": {}}'])
def test_a_damaged_cache_meta_json_is_one_line(tmp_path, tiny_corpus, content):
    cfg = make_config(tmp_path, {"path": str(tiny_corpus)})
    meta = prepare(cfg).folder / "meta.json"
    meta.write_text(content)
    split = mtcli.data.EncodedSplit(meta.parent, "train")
    for read in (lambda: prepare(cfg), lambda: eval_texts(cfg, "test"), lambda: split.src(0)):
        with pytest.raises(MtcliError, match=rf"^{re.escape(str(meta))}: damaged data cache \(.+\); rebuild it"):
            read()
    assert prepare(cfg, force=True).meta["splits"]["train"]["total"] == 300


def test_vocab_size_below_the_characters_is_a_config_error(tmp_path):
    folder = tmp_path / "corpus"
    chars = [chr(0x4E00 + i) for i in range(400)]  # 400 distinct Chinese characters
    pairs = [(" ".join(tiny_pairs(1, i)[0][0].split()[:2]), "".join(chars[i * 4 : i * 4 + 4])) for i in range(100)]
    write_text_pair(folder, "train", pairs, tgt="zh")
    cfg = make_config(tmp_path, {"path": str(folder), "tgt_lang": "zh", "character_coverage": 1.0})
    with pytest.raises(MtcliError, match="data.vocab_size: 100 is too small") as info:
        prepare(cfg)
    assert "\n" not in str(info.value)
    assert no_leftovers(tmp_path / "cache")


# ---------------------------------------------------------------------------------------------------------------------
# Cleaning


def test_train_pairs_are_cleaned_and_counted_eval_pairs_kept(tmp_path, log):
    normal = tiny_pairs(120, 1)
    bad = [
        ("", "der Hund"),  # empty side
        ("the dog", "   "),  # blank side
        (" ".join(["the cat"] * 30), " ".join(["die Katze"] * 30)),  # >= 60 subwords per side, over max_len 40
        (" ".join(["the cat"] * 30), "die Katze"),  # over max_len and over the ratio: counted once, as too long
        ("the", " ".join(["Hund"] * 8)),  # 1-2 subwords against >= 8: over max_ratio 3
        ("a", "Hund Katze Haus Baum Mann Frau Kind alt"),
    ]
    folder = tmp_path / "corpus"
    write_text_pair(folder, "train", normal + bad)
    write_text_pair(folder, "valid", bad + normal[:5])
    cfg = make_config(tmp_path, {"path": str(folder), "splits": SPLITS, "max_len": 40, "max_ratio": 3.0})
    log.clear()
    data = prepare(cfg)
    train = data.meta["splits"]["train"]
    assert (train["total"], train["kept"], train["empty"], train["too_long"], train["ratio"]) == (126, 120, 2, 2, 2)
    assert any("dropped 2 with an empty side, 2 over 40 subwords, 2 over length ratio 3" in line for line in log)
    split = data.split("train")
    assert len(split) == 120 and split.src_lens.max() <= 40 + 1 and split.tgt_lens.max() <= 40 + 1
    assert decode_all(data, split)[1] == [t for _, t in normal]

    valid = data.meta["splits"]["valid"]
    assert valid["total"] == valid["kept"] == len(data.split("valid")) == 11  # eval splits are never filtered
    assert data.split("valid").texts() == (
        [clean_line(s) for s, _ in bad + normal[:5]],
        [clean_line(t) for _, t in bad + normal[:5]],
    )

    # 0 disables the ratio filter; `Hund` 8 times in a row is then caught by data.clean.max_repeat (6)
    cfg = make_config(tmp_path, {"path": str(folder), "splits": SPLITS, "max_len": 40, "max_ratio": 0})
    assert prepare(cfg).meta["splits"]["train"]["kept"] == 121
    no_repeat = {"max_len": 40, "max_ratio": 0, "clean": {"max_repeat": 0}}
    cfg = make_config(tmp_path, {"path": str(folder), "splits": SPLITS, **no_repeat})
    assert prepare(cfg).meta["splits"]["train"]["kept"] == 122  # the two over the ratio only


# ---------------------------------------------------------------------------------------------------------------------
# The cache


def test_second_prepare_is_a_cache_hit(tmp_path, tiny_corpus, monkeypatch, log):
    cfg = make_config(tmp_path, {"path": str(tiny_corpus), "splits": SPLITS})
    first = prepare(cfg)
    assert first.folder.parent == tmp_path / "cache"

    def must_not_encode(*args, **kwargs):
        raise AssertionError("re-encoded a cached split")

    monkeypatch.setattr(mtcli.data, "_encode_split", must_not_encode)
    log.clear()
    again = prepare(make_config(tmp_path, {"path": str(tiny_corpus), "splits": SPLITS}))
    assert again.folder == first.folder and again.meta == first.meta
    assert len(log) == 1 and "cached" in log[0]
    # Settings outside `data` do not shape the cache.
    other = make_config(
        tmp_path, {"path": str(tiny_corpus), "splits": SPLITS}, overrides=["model.layers=2", "train.lr=1"]
    )
    assert prepare(other).folder == first.folder
    # Nor does where the cache lives.
    moved = make_config(tmp_path, {"path": str(tiny_corpus), "splits": SPLITS, "cache_dir": str(tmp_path / "c2")})
    assert mtcli.data.cache_folder(moved.data).name == first.folder.name
    # Nor subword sampling, which re-encodes the cached training pairs at training time.
    sampled = make_config(tmp_path, {"path": str(tiny_corpus), "splits": SPLITS, "sampling_alpha": 0.3})
    assert prepare(sampled).folder == first.folder


def test_force_rebuilds_the_same_folder(tmp_path, tiny_corpus, log):
    cfg = make_config(tmp_path, {"path": str(tiny_corpus)})
    first = prepare(cfg)
    log.clear()
    again = prepare(cfg, force=True)
    assert again.folder == first.folder and not any("cached" in line for line in log)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.folder.name]


@pytest.mark.parametrize("change", ["vocab_size", "max_len", "spm_model_type", "file"])
def test_cache_is_invalidated_by_what_shapes_it(tmp_path, tiny_corpus, change, log):
    data_cfg = {"path": str(tiny_corpus), "splits": SPLITS}
    first = prepare(make_config(tmp_path, data_cfg))
    new_refs = None
    if change == "file":
        new_refs = [t.upper() for _, t in tiny_pairs(20, 3)]  # same line count, new content and size
        path = tiny_corpus / "test.de"
        path.write_text("".join(t + "\n" for t in new_refs), encoding="utf-8")
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    else:
        data_cfg[change] = {"vocab_size": 80, "max_len": 30, "spm_model_type": "bpe"}[change]
    log.clear()
    second = prepare(make_config(tmp_path, data_cfg))
    assert second.folder != first.folder
    assert not any("cached" in line for line in log)
    if new_refs is not None:  # the new content, not a stale copy from some cache
        assert second.split("test").texts()[1] == new_refs
        assert first.split("test").texts()[1] != new_refs


@pytest.fixture(scope="module")
def prepared_cache(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny corpus and its data cache, prepared once: the tests that damage a cache damage copies of it."""
    home = tmp_path_factory.mktemp("prepared")
    for split, n, seed in (("train", 300, 1), ("valid", 20, 2), ("test", 20, 3)):
        write_text_pair(home / "corpus", split, tiny_pairs(n, seed))
    prepare(make_config(home, {"path": str(home / "corpus")}))
    return home / "corpus", home / "cache"


def files_of(*folders: Path) -> dict[Path, bytes]:
    """Every file below `folders` with its bytes: what a refused command must leave as it found it."""
    return {p: p.read_bytes() for folder in folders for p in sorted(folder.rglob("*")) if p.is_file()}


def damage(folder: Path, how: str) -> tuple[str, str]:
    """Damage a cache as a disk error or an interrupted copy would; returns the damaged split and the start of the
    paths of its files (the message names one of them)."""
    if how == "truncated ids":
        path = folder / "train.src.bin"
        os.truncate(path, path.stat().st_size // 2)
        return "train", str(folder / "train.src.")
    if how == "truncated header":
        os.truncate(folder / "test.src.idx.npy", 60)
        return "test", str(folder / "test.src.")
    if how == "truncated text":
        path = folder / "test.tgt.txt"
        os.truncate(path, path.stat().st_size // 2)
        return "test", str(folder / "test.tgt.")
    offsets = np.load(folder / "train.tgt.idx.npy", mmap_mode="r+")  # the files keep their sizes: the offsets tell
    if how == "offsets past the end":
        offsets[len(offsets) // 2 :] += 1000
    else:  # out of order
        offsets[5] = offsets[7] + 1
    offsets.flush()
    return "train", str(folder / "train.tgt.")


@pytest.mark.parametrize(
    ("how", "sizes"),  # sizes: meta.json records its files' sizes (a cache written before has none)
    [
        ("truncated ids", True),
        ("truncated ids", False),
        ("offsets past the end", True),
        ("offsets past the end", False),
        ("offsets out of order", False),
        ("truncated header", True),
        ("truncated header", False),
        ("truncated text", True),
    ],
)
def test_a_damaged_cache_is_one_line_and_never_read(tmp_path, prepared_cache, monkeypatch, capsys, how, sizes):
    corpus, cache = prepared_cache
    shutil.copytree(cache, tmp_path / "cache")
    cfg = make_config(tmp_path, {"path": str(corpus)})
    folder = mtcli.data.cache_folder(cfg.data)
    if not sizes:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        meta.pop("files", None)
        (folder / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    role, where = damage(folder, how)
    before = files_of(corpus, tmp_path / "cache")
    expected = rf"^{re.escape(where)}\S+: damaged data cache \(.+\); rebuild it with `mtcli data prepare --force`"
    with pytest.raises(MtcliError, match=expected) as info:
        prepare(cfg)  # what `data prepare` and training open
    assert "\n" not in str(info.value)
    split = mtcli.data.EncodedSplit(folder, role)
    with pytest.raises(MtcliError, match=expected):
        split.texts() if how == "truncated text" else split.src(0)
    monkeypatch.setattr(sys, "argv", ["mtcli", "data", "prepare", "--config", str(tmp_path / "run.yaml")])
    with pytest.raises(SystemExit) as exited:
        main()  # the installed command
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {info.value}"]
    assert files_of(corpus, tmp_path / "cache") == before
    rebuilt = prepare(cfg, force=True)  # what the message says to do
    assert len(rebuilt.split("train")) == rebuilt.meta["splits"]["train"]["kept"] > 250


def test_a_rebuild_replaces_the_cache_and_removes_what_killed_ones_left(tmp_path, prepared_cache):
    """--force moves the old cache aside (`.<name>.old-<pid>`) before removing it; one left by a prepare killed at that
    moment is removed by the next prepare, one whose process runs is kept."""
    corpus, cache = prepared_cache
    shutil.copytree(cache, tmp_path / "cache")
    cfg = make_config(tmp_path, {"path": str(corpus)})
    folder = mtcli.data.cache_folder(cfg.data)
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()  # its pid is now free
    dead, running = (folder.parent / f".{folder.name}.old-{pid}" for pid in (child.pid, os.getppid()))
    for left in (dead, running):
        shutil.copytree(folder, left)
    (folder / "train.src.bin").write_bytes(b"")
    assert len(prepare(cfg, force=True).split("train")) > 250
    assert not dead.exists() and running.is_dir()


@pytest.mark.parametrize("where", ["/proc/self", "a file"])
def test_a_cache_dir_that_cannot_hold_a_cache_is_one_line(tmp_path, tiny_corpus, monkeypatch, capsys, where):
    if where == "a file":
        where = tmp_path / "notes.txt"
        where.write_text("mine\n")
    cfg = make_config(tmp_path, {"path": str(tiny_corpus), "cache_dir": str(where)})
    before = files_of(tmp_path)
    expected = rf"^data.cache_dir {re.escape(str(where))}: cannot write"
    with pytest.raises(MtcliError, match=expected):
        prepare(cfg)
    toy = load_config("toy.yaml", [f"data.cache_dir={where}"])
    for read in (lambda: prepare(toy), lambda: eval_texts(toy, "test")):  # the toy corpus is written there too
        with pytest.raises(MtcliError, match=expected):
            read()
    argv = ["mtcli", "data", "prepare", "--config", str(tmp_path / "run.yaml"), "--set", f"data.cache_dir={where}"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and re.match(expected, lines[0].removeprefix("error: ")), lines
    assert files_of(tmp_path) == before


def test_touching_a_file_invalidates_the_cache(tmp_path, tiny_corpus):
    cfg = make_config(tmp_path, {"path": str(tiny_corpus)})
    first = prepare(cfg)
    path = tiny_corpus / "train.de"
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
    assert prepare(cfg).folder != first.folder


# ---------------------------------------------------------------------------------------------------------------------
# Subword sampling


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_subword_sampling_resegments_the_same_pairs_reproducibly(tmp_path, tiny_corpus, model_type):
    """Each epoch's sampled split holds the same pairs (same text when decoded) in new pieces; the same (seed, epoch)
    gives the same pieces, so every rank and a resumed run agree; a sample over the length limit keeps its ids."""
    cfg = make_config(tmp_path, {"path": str(tiny_corpus), "spm_model_type": model_type, "sampling_alpha": 0.3})
    data = prepare(cfg)
    base = data.split("train")
    tok = data.tokenizer

    def sampled(seed, epoch, limit=256):
        return mtcli.data.SampledSplit(base, tok, cfg.data, seed, epoch, limit)

    def pieces(split):
        return [(split.src(i).tolist(), split.tgt(i).tolist()) for i in range(len(split))]

    one = sampled(1, 0)
    assert len(one) == len(base)
    assert len(sampled(2**32 - 1, 7)) == len(base)  # the largest train.seed (SentencePiece's seed has 32 bits)
    assert pieces(one) == pieces(sampled(1, 0))
    assert pieces(one) != pieces(sampled(1, 1)) and pieces(one) != pieces(sampled(2, 0))
    assert pieces(one) != pieces(base)
    for i in range(len(base)):
        assert tok.src.decode(one.src(i).tolist()) == tok.src.decode(base.src(i).tolist())
        assert tok.decode_tgt([one.tgt(i).tolist()]) == tok.decode_tgt([base.tgt(i).tolist()])
    assert (one.src_lens == [len(one.src(i)) + 1 for i in range(len(one))]).all()
    assert one.tgt_lens.sum() > base.tgt_lens.sum()  # sampled segmentations are longer on average
    limit = int(max(base.src_lens.max(), base.tgt_lens.max()))
    tight = sampled(1, 0, limit)
    assert max(one.src_lens.max(), one.tgt_lens.max()) > limit  # so the limit matters here
    assert (tight.src_lens <= limit).all() and (tight.tgt_lens <= limit).all()


# ---------------------------------------------------------------------------------------------------------------------
# The shared corpora


@pytest.mark.system
def test_multi30k_local_files(shared_data, corpus_cache, log):
    """The recipe's data settings, so test_recipes trains on this cache (or this test finds the one it made)."""
    folder = shared_data / "multi30k"
    overrides = [f"data.path={folder}", f"data.cache_dir={corpus_cache}"]
    cfg = load_config("multi30k.yaml", overrides)
    data = prepare(cfg)
    splits = data.meta["splits"]
    assert {role: s["total"] for role, s in splits.items()} == {"train": 29_000, "valid": 1_014, "test": 1_000}
    assert splits["valid"]["kept"] == 1_014 and splits["test"]["kept"] == 1_000
    assert splits["train"]["kept"] > 28_900
    test = data.split("test")
    src_lines = (folder / "test_2016_flickr.en").read_text(encoding="utf-8").splitlines()
    tgt_lines = (folder / "test_2016_flickr.de").read_text(encoding="utf-8").splitlines()
    assert test.texts() == ([clean_line(x) for x in src_lines], [clean_line(x) for x in tgt_lines])
    decoded = decode_all(data, test)[1]
    assert sum(d == r for d, r in zip(decoded, test.texts()[1])) >= 0.99 * len(decoded)

    train = data.split("train")
    batches = epoch_batches(train.src_lens, train.tgt_lens, cfg.train.max_tokens, cfg.train.seed, 0)
    assert cfg.train.max_tokens == 4096
    padding = padding_counts(batches, train.src_lens) + padding_counts(batches, train.tgt_lens)
    assert padding.efficiency >= 0.9

    start = time.monotonic()
    log.clear()
    again = prepare(load_config("multi30k.yaml", overrides))
    assert again.folder == data.folder and "cached" in log[0]
    assert time.monotonic() - start < 3


@pytest.mark.system
def test_tatoeba_local_files_without_test_split(shared_data, corpus_cache):
    """The recipe's data settings, shared with test_recipes. The corpus has no test files: the split is skipped when
    prepared (the note itself: test_missing_eval_split_is_skipped_with_a_note), and asking for it later says so."""
    folder = shared_data / "tatoeba-zh-en"
    cfg = load_config("tatoeba-en-zh.yaml", [f"data.path={folder}", f"data.cache_dir={corpus_cache}"])
    assert cfg.data.splits.test == "test"  # named, but not in the folder
    data = prepare(cfg)
    assert data.roles == ["train", "valid"]
    assert data.meta["splits"]["train"]["total"] == 27_054 and data.meta["splits"]["valid"]["kept"] == 1_000
    with pytest.raises(MtcliError, match="no test split"):
        eval_texts(cfg, "test")
    valid = data.split("valid")
    references = (folder / "valid.zh").read_text(encoding="utf-8").splitlines()
    assert valid.texts()[1] == [clean_line(x) for x in references]
    assert decode_all(data, valid)[1] == valid.texts()[1]  # byte fallback: no <unk>, full-width punctuation kept


# ---------------------------------------------------------------------------------------------------------------------
# The toy corpus


def test_toy_corpus_sizes_disjoint_and_required_pair():
    splits = toy_pairs()
    assert len(splits["train"]) >= 3000 and len(splits["valid"]) >= 200 and len(splits["test"]) >= 200
    for side in (0, 1):
        sets = {name: {pair[side] for pair in pairs} for name, pairs in splits.items()}
        assert all(len(sets[name]) == len(pairs) for name, pairs in splits.items())  # no repeats within a split
        assert not sets["train"] & sets["valid"] and not sets["train"] & sets["test"]
        assert not sets["valid"] & sets["test"]
    assert REQUIRED_TRAIN_PAIR == ("I love apples", "我喜欢苹果")
    assert REQUIRED_TRAIN_PAIR in splits["train"]
    assert toy_pairs() == splits
    # Only n_train changing keeps valid and test the same.
    smaller = toy_pairs(n_train=3000)
    assert smaller["valid"] == splits["valid"] and smaller["test"] == splits["test"]
    assert REQUIRED_TRAIN_PAIR in smaller["train"]
    with pytest.raises(ValueError):
        toy_pairs(n_train=10**6)


@pytest.mark.system
def test_toy_corpus_is_the_same_in_another_process(tmp_path):
    write_toy_corpus(tmp_path / "here")
    code = "import sys; from mtcli.toy import write_toy_corpus; write_toy_corpus(sys.argv[1])"
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "there")], check=True, env=env, timeout=60)
    names = sorted(p.name for p in (tmp_path / "here").iterdir())
    assert names == ["test.en", "test.zh", "train.en", "train.zh", "valid.en", "valid.zh"]
    for name in names:
        assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "there" / name).read_bytes()
    for split in ("train", "valid", "test"):
        en = (tmp_path / "here" / f"{split}.en").read_text(encoding="utf-8").splitlines()
        zh = (tmp_path / "here" / f"{split}.zh").read_text(encoding="utf-8").splitlines()
        assert list(zip(en, zh)) == toy_pairs()[split]
    # A second write with the same content leaves the files alone.
    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "here").iterdir()}
    write_toy_corpus(tmp_path / "here")
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "here").iterdir()} == mtimes


def test_toy_config_prepares(tmp_path):
    cfg = load_config("toy.yaml", [f"data.cache_dir={tmp_path / 'cache'}"])
    data = prepare(cfg)
    assert {role: s["kept"] for role, s in data.meta["splits"].items()} == {"train": 4000, "valid": 200, "test": 200}
    assert (tmp_path / "cache" / "toy-corpus" / "train.zh").is_file()
    expected = toy_pairs()["test"]
    assert data.split("test").texts() == ([en for en, _ in expected], [zh for _, zh in expected])
    assert decode_all(data, data.split("test"))[1] == [zh for _, zh in expected]


# ---------------------------------------------------------------------------------------------------------------------
# Files of the kinds that break other toolkits


def test_empty_and_blank_training_files_are_one_line_errors(tmp_path):
    folder = tmp_path / "corpus"
    write_text_pair(folder, "train", [])
    with pytest.raises(MtcliError, match=r"train.en: the file is empty"):
        prepare(make_config(tmp_path, {"path": str(folder)}))
    (folder / "train.en").write_text("\n \n\n")
    (folder / "train.de").write_text("\n\n\n")
    with pytest.raises(MtcliError, match=r"\(train.en \+ train.de\) has no non-empty sentences"):
        prepare(make_config(tmp_path, {"path": str(folder)}))
    assert no_leftovers(tmp_path / "cache")


def test_byte_order_marks_and_crlf_are_accepted(tmp_path):
    pairs = tiny_pairs(200, 4)
    plain, marked = tmp_path / "plain", tmp_path / "marked"
    write_text_pair(plain, "train", pairs)
    write_text_pair(marked, "train", pairs)
    for lang in ("en", "de"):  # a BOM, and Windows line ends
        text = (marked / f"train.{lang}").read_text(encoding="utf-8").replace("\n", "\r\n")
        (marked / f"train.{lang}").write_bytes(b"\xef\xbb\xbf" + text.encode())
    a = prepare(make_config(tmp_path, {"path": str(plain), "spm_normalization": "identity"}))
    b = prepare(make_config(tmp_path, {"path": str(marked), "spm_normalization": "identity"}))
    first = lambda data: data.split("train").src(0).tolist()  # noqa: E731
    assert first(a) == first(b) and len(a.split("train")) == len(b.split("train")) == 200
    assert clean_line("\ufeffthe  cat ") == "the cat"


def test_a_megabyte_line_is_filtered_and_counted(tmp_path, log):
    pairs = tiny_pairs(100, 5)
    folder = tmp_path / "corpus"
    write_text_pair(folder, "train", [*pairs, (("the cat " * 131_072).strip(), "die Katze")])
    data = prepare(make_config(tmp_path, {"path": str(folder)}))
    counts = data.meta["splits"]["train"]
    assert counts["total"] == 101 and counts["kept"] == 100 and counts["too_long"] == 1
    assert any("1 over 250 subwords" in line for line in log)
