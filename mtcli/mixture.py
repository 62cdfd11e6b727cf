"""Several training corpora (data.train_corpora): read as one train split, tallied by corpus while it is encoded,
and sampled by weight into each epoch's training examples.

A corpus of weight 2 is seen twice per epoch, one of weight 0.5 by a random half of its pairs (a new half every
epoch). The draw is seeded by (train.seed, epoch), like the batch order, so every process and a resumed run see the
same examples.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from mtcli.config import Config, DataConfig, SplitsConfig, TrainCorpusConfig
from mtcli.corpus import SplitSource, open_splits, source_fingerprint


def corpus_config(cfg: DataConfig, corpus: TrainCorpusConfig) -> DataConfig:
    """The data settings that read one training corpus: its source, split and format (when it names one), the rest
    (languages, columns) from `cfg`."""
    return dataclasses.replace(
        cfg,
        format=corpus.format or cfg.format,
        path=corpus.path,
        dataset=corpus.dataset,
        subset=corpus.subset,
        revision=corpus.revision,
        splits=SplitsConfig(train=corpus.split, valid=None, test=None),
        hub_splits=None,
        train_corpora=(),
    )


def corpora_fingerprint(cfg: DataConfig) -> list:
    """What identifies the training corpora's raw data, for the cache key (as corpus.source_fingerprint)."""
    return [source_fingerprint(corpus_config(cfg, c)) for c in cfg.train_corpora]


def corpus_name(corpus: TrainCorpusConfig) -> str:
    return f"{corpus.path or corpus.dataset} [{corpus.split}]"


def open_train_corpora(cfg: DataConfig, cache_dir: Path, notes: list[str] | None = None):
    """The training corpora as one SplitSource: their pairs one corpus after the other, in the order listed."""
    parts = [open_splits(corpus_config(cfg, c), cache_dir, notes)["train"] for c in cfg.train_corpora]
    starts = np.cumsum([0] + [part.num_rows for part in parts])

    def read(parts, rows):
        rows = np.asarray(rows, dtype=np.int64)  # ascending: a range, or the sorted sample SentencePiece is fitted on
        sources, targets = [], []
        for part, start, stop in zip(parts, starts[:-1], starts[1:]):
            local = rows[(rows >= start) & (rows < stop)] - start
            if not len(local):
                continue
            if local[-1] - local[0] + 1 == len(local):  # contiguous
                read = [part.rows(int(local[0]), int(local[-1]) + 1)]
            else:  # the sample: a batch of its rows at a time
                read = part.batches(indices=local.tolist())
            for s, t in read:
                sources += list(s)
                targets += list(t)
        return sources, targets

    names = tuple((corpus_name(c), part.num_rows) for c, part in zip(cfg.train_corpora, parts))
    description = " + ".join(part.description for part in parts)
    return SplitSource("train", "train_corpora", int(starts[-1]), description, parts, read, names)


class CorpusTally:
    """Which corpus each kept training pair came from (saved as train.corpus.npy for `epoch_examples`), and every
    corpus's pairs and kept pairs for the prepare report."""

    def __init__(self, corpora: tuple[tuple[str, int], ...]):
        self.names = [name for name, _ in corpora]
        self.bounds = np.cumsum([rows for _, rows in corpora])
        self.total = np.zeros(len(corpora), dtype=np.int64)
        self.kept = np.zeros(len(corpora), dtype=np.int64)
        self.kept_ids: list[np.ndarray] = []

    def ids(self, first_row: int, count: int) -> np.ndarray:
        """The corpus index of rows first_row ... first_row + count - 1."""
        return np.searchsorted(self.bounds, np.arange(first_row, first_row + count), side="right")

    def add(self, first_row: int, keep: list[bool]) -> None:
        """A chunk of the split's pairs, rows first_row, first_row + 1, ...; keep[i]: row first_row + i was kept."""
        ids = self.ids(first_row, len(keep))
        kept = np.asarray(keep, dtype=bool)
        self.total += np.bincount(ids, minlength=len(self.names))
        self.kept += np.bincount(ids[kept], minlength=len(self.names))
        self.kept_ids.append(ids[kept].astype(np.int16))

    def save(self, path: Path) -> list[dict]:
        np.save(path, np.concatenate(self.kept_ids or [np.zeros(0, dtype=np.int16)]))
        return [{"name": n, "total": int(t), "kept": int(k)} for n, t, k in zip(self.names, self.total, self.kept)]


def epoch_examples(split, usable: np.ndarray, cfg: Config, epoch: int) -> np.ndarray:
    """The training examples of one epoch: `usable` (indices into the cached train split) as it is, or with
    data.train_corpora, each corpus's usable pairs `weight` times: its whole part as many times as the weight's
    integer part, and a random share of them (the fractional part, drawn without replacement) once more."""
    weights = [c.weight for c in cfg.data.train_corpora]
    if all(w == 1 for w in weights):
        return usable
    corpus = np.load(Path(split.folder) / "train.corpus.npy")[usable]
    rng = np.random.default_rng([cfg.train.seed, epoch, 1])  # a stream of its own: epoch_batches draws [seed, epoch]
    parts = []
    for k, weight in enumerate(weights):
        mine = usable[corpus == k]
        parts += [mine] * int(weight)
        extra = round((weight - int(weight)) * len(mine))
        if extra:
            parts.append(np.sort(rng.choice(mine, extra, replace=False)))
    return np.concatenate(parts) if parts else usable[:0]


def describe_corpora(counts: list[dict], cfg: DataConfig) -> list[str]:
    """Report lines, one per training corpus: its pairs, how many were kept, and its weight."""
    return [
        f"        {c['name']}: {c['total']:,} pairs, kept {c['kept']:,}, weight {corpus.weight:g}"
        for c, corpus in zip(counts, cfg.train_corpora)
    ]
