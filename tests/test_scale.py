"""Corpora of millions of pairs: encoding on every core gives the same cache as on one; the vectorized filters
decide as the per-pair rules they replace; memory stays flat (NumPy keys and offsets, not Python sets and lists); a
prepare killed with SIGKILL leaves nothing under the cache's name, and the next one cleans its work folder."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import tracemalloc
from itertools import groupby
from pathlib import Path

import numpy as np
import pytest
import yaml

import mtcli.encode
from mtcli.clean import (
    CODES,
    LETTER,
    REASONS,
    ChunkFilter,
    Deduplicator,
    KeySet,
    flatten,
    letter_classes,
    pair_key,
    script_pattern,
)
from mtcli.config_loader import load_config
from mtcli.data import prepare

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the cat dog sees a big small house tree runs eats green red blue old new".split()
GERMAN = "der die das Katze Hund sieht ein großes kleines Haus Baum läuft isst grün rot blau".split()


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


def defective_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """Ordinary pairs with every defect the filters look for mixed in: duplicates (of kept and of dropped pairs),
    copies, empty sides, repeated pieces, another script, long and lopsided lines."""
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        k = rng.randint(2, 12)
        pair = (" ".join(rng.choices(WORDS, k=k)), " ".join(rng.choices(GERMAN, k=k)))
        roll = rng.random()
        if roll < 0.05 and pairs:
            pair = pairs[rng.randrange(len(pairs))]
        elif roll < 0.07:
            pair = (pair[0], pair[0])
        elif roll < 0.08:
            pair = (pair[0], "") if i % 2 else ("", pair[1])
        elif roll < 0.09:
            pair = (pair[0], "ja " * 12)
        elif roll < 0.10:
            pair = (pair[0], "это другой алфавит совсем")
        elif roll < 0.11:
            pair = (pair[0] + " big" * 60, pair[1])
        pairs.append(pair)
    return pairs


def write_corpus(folder: Path, pairs, valid=50) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", pairs), ("valid", pairs[:valid])):
        (folder / f"{split}.en").write_text("".join(s + "\n" for s, _ in rows), encoding="utf-8")
        (folder / f"{split}.de").write_text("".join(t + "\n" for _, t in rows), encoding="utf-8")
    return folder


def config_for(tmp_path, corpus: Path, cache: Path, **data):
    tree = {
        "data": {
            "path": str(corpus),
            "src_lang": "en",
            "tgt_lang": "de",
            "vocab_size": 120,
            "max_len": 40,
            "splits": {"train": "train", "valid": "valid", "test": None},
            "cache_dir": str(cache),
            **data,
        }
    }
    path = tmp_path / f"config-{len(list(tmp_path.glob('config-*')))}.yaml"
    path.write_text(yaml.safe_dump(tree, allow_unicode=True), encoding="utf-8")
    return load_config(path)


def cache_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "meta.json"}


@pytest.mark.system  # encoding workers in processes of their own
def test_the_cache_is_byte_identical_with_one_and_two_workers(tmp_path, monkeypatch):
    """25,000 pairs (three chunks, so the two workers interleave; workers start from 100,000 pairs, here from any)
    with every defect: every file of the cache is the same byte for byte, and so are the counts of meta.json."""
    monkeypatch.setattr(mtcli.encode, "MIN_PARALLEL", 0)
    corpus = write_corpus(tmp_path / "corpus", defective_pairs(25_000, 1))
    prepared = {}
    for workers in (1, 2):
        cfg = config_for(tmp_path, corpus, tmp_path / f"cache-{workers}", workers=workers)
        prepared[workers] = prepare(cfg)
        assert prepared[workers].meta["workers"] == workers
    one, two = prepared[1], prepared[2]
    assert cache_files(one.folder) == cache_files(two.folder)
    assert one.meta["splits"] == two.meta["splits"]
    counts = one.meta["splits"]["train"]
    assert all(counts[r] > 0 for r in ("empty", "too_long", "ratio", "duplicate", "copy", "repeat", "script"))
    assert not list(one.folder.glob("*.tmp")) and not (one.folder / "arrow").exists()  # no work files left


def longest_run(ids: list[int]) -> int:
    return max((sum(1 for _ in run) for _, run in groupby(ids)), default=0)


def other_script_share(text: str, inside) -> float:
    letters = len(LETTER.findall(text))
    return (letters - len(inside.findall(text))) / letters if letters else 0.0


def reference_reasons(cfg, pairs, src_ids, tgt_ids) -> list[str | None]:
    """The filters one pair at a time, in their documented order: what the vectorized code must reproduce."""
    c, kept, reasons = cfg.clean, set(), []
    scripts = (script_pattern(cfg.src_lang), script_pattern(cfg.tgt_lang))
    for (s, t), si, ti in zip(pairs, src_ids, tgt_ids):
        longer, shorter = max(len(si), len(ti)), min(len(si), len(ti))
        key = pair_key(s, t)
        if not s or not t:
            reason = "empty"
        elif longer > cfg.max_len:
            reason = "too_long"
        elif cfg.max_ratio > 0 and longer > cfg.max_ratio * shorter:
            reason = "ratio"
        elif key in kept:
            reason = "duplicate"
        elif s == t:
            reason = "copy"
        elif max(longest_run(si), longest_run(ti)) > c.max_repeat:
            reason = "repeat"
        elif any(other_script_share(x, p) > c.max_other_script for x, p in zip((s, t), scripts)):
            reason = "script"
        else:
            reason = None
            kept.add(key)
        reasons.append(reason)
    return reasons


def test_the_vectorized_filters_decide_as_the_per_pair_rules(tmp_path):
    """Chunked verdicts (any chunk size) + the duplicate check in order = the rules applied pair by pair."""
    pairs = defective_pairs(1000, 2) + [("日本語の文です", "日本語の文です"), ("Ölçü café", "naïve Ñandú")]
    cfg = config_for(tmp_path, tmp_path, tmp_path / "cache").data
    rng = random.Random(3)
    src_ids = [[rng.randrange(4, 50) for _ in range(len(s.split()) * 2)] for s, _ in pairs]
    tgt_ids = [[rng.randrange(4, 50) for _ in range(len(t.split()) * 2)] for _, t in pairs]
    for i in range(0, len(pairs), 97):
        tgt_ids[i] = [7] * 9  # a run over max_repeat (6)
    expected = reference_reasons(cfg, pairs, src_ids, tgt_ids)
    for chunk in (1, 10, 400, 5000):
        check, dedup, found = ChunkFilter(cfg), Deduplicator(True), []
        for start in range(0, len(pairs), chunk):
            rows = slice(start, start + chunk)
            src, tgt = [p[0] for p in pairs[rows]], [p[1] for p in pairs[rows]]
            codes = dedup.decide(*check.verdicts(src, tgt, flatten(src_ids[rows]), flatten(tgt_ids[rows])))
            found += [REASONS[c - 1] if c else None for c in codes.tolist()]
        assert found == expected, chunk
    assert {r for r in expected} >= {None, "empty", "ratio", "duplicate", "copy", "repeat", "script"}


def test_keys_take_eight_bytes_each():
    keys = KeySet()
    rng = np.random.default_rng(1)
    values = rng.integers(1, 2**63, size=100_000, dtype=np.int64).astype(np.uint64)
    for start in range(0, len(values), 10_000):
        keys.add(values[start : start + 10_000])
    assert keys.contains(values).all() and not keys.contains(values + np.uint64(1)).any()
    assert keys.nbytes == 8 * len(values) and len(keys.runs) <= 10


@pytest.mark.system  # encoding workers in processes of their own
def test_memory_stays_flat_in_the_corpus_size(tmp_path):
    """Prepared in this process (one worker) under tracemalloc, with the SentencePiece sample bounded
    (data.spm_sample): the peak of Python and NumPy allocations while encoding 150,000 pairs is within 4 MB of that
    for 30,000. Offsets in Python lists and keys in a Python set (as before) grew by about 130 bytes a pair: 15 MB
    here."""
    import mtcli.data

    rng = random.Random(4)
    pairs = [(" ".join(rng.choices(WORDS, k=8)), " ".join(rng.choices(GERMAN, k=8))) for _ in range(150_000)]
    peaks = {}
    encode_split = mtcli.data._encode_split

    def traced(source, *args):
        tracemalloc.reset_peak()
        counts = encode_split(source, *args)
        peaks[source.role] = tracemalloc.get_traced_memory()[1]
        return counts

    letter_classes("en"), letter_classes("de")  # built once per process: not part of either measurement
    growth = []
    for n in (30_000, 150_000):
        corpus = write_corpus(tmp_path / f"corpus-{n}", pairs[:n])
        cfg = config_for(tmp_path, corpus, tmp_path / "cache", workers=1, spm_sample=10_000)
        tracemalloc.start()
        try:
            mtcli.data._encode_split = traced
            prepared = prepare(cfg)
        finally:
            mtcli.data._encode_split = encode_split
            tracemalloc.stop()
        assert prepared.meta["splits"]["train"]["total"] == n
        growth.append(peaks["train"])
    assert growth[1] - growth[0] < 4e6, [f"{p / 1e6:.1f} MB" for p in growth]


@pytest.mark.system  # encoding workers in processes of their own
def test_a_killed_prepare_leaves_nothing_and_the_next_cleans_up(tmp_path):
    """SIGKILL in the middle of encoding: no folder under the cache's name, its work folder stays behind (nothing can
    remove it at that moment); the next prepare succeeds and removes the leftover."""
    corpus = write_corpus(tmp_path / "corpus", defective_pairs(100_000, 5))
    cache = tmp_path / "cache"
    cfg = config_for(tmp_path, corpus, cache, workers=1, spm_sample=4000)
    config_file = sorted(tmp_path.glob("config-*.yaml"))[-1]
    env = dict(os.environ, HF_DATASETS_CACHE=str(tmp_path / "hf-datasets"))
    child = subprocess.Popen(
        [sys.executable, "-m", "mtcli", "data", "prepare", "--config", str(config_file)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not list(cache.glob(".*.tmp-*/train.src.bin")):
        time.sleep(0.05)
    time.sleep(0.3)  # inside the encoding (about 3 s)
    child.send_signal(signal.SIGKILL)
    child.wait()
    [work] = list(cache.glob(".*.tmp-*"))
    assert not [p for p in cache.iterdir() if not p.name.startswith(".")]
    prepared = prepare(cfg)
    assert not work.exists() and prepared.folder.is_dir()
    assert prepared.meta["splits"]["train"]["total"] == 100_000
    assert json.loads((prepared.folder / "meta.json").read_text())["splits"] == prepared.meta["splits"]


def test_reason_codes_cover_every_reason():
    assert sorted(CODES.values()) == list(range(1, len(REASONS) + 1))
