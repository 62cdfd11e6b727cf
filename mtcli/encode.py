"""Encoding a split on every core: chunks of raw pairs -> cleaned text -> SentencePiece ids -> filter verdicts.

`encoded_chunks` reads the split in the main process and hands chunks of 10,000 pairs to `data.workers` worker
processes (started with `spawn`: this module and what it imports are all a worker loads), a few chunks ahead and no
more, so memory stays flat; results come back in the corpus's order. What a worker computes depends on its chunk
alone (the duplicate check, which needs the corpus's order, is the main process's: clean.Deduplicator), so the cache
is byte-identical for any number of workers.
"""

from __future__ import annotations

import multiprocessing
import os
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mtcli.align import piece_links, piece_words, source_piece_words
from mtcli.clean import ChunkFilter, clean_line, flatten
from mtcli.config import DataConfig
from mtcli.glossary import augmented_source
from mtcli.tokenizer import Tokenizer

CHUNK = 10_000  # pairs a worker encodes at a time
# Splits smaller than this are encoded in this process: starting workers (a second or two each) costs more than
# they save on a few chunks
MIN_PARALLEL = 100_000
AHEAD = 2  # chunks in flight per worker: enough to keep every worker busy, few enough to keep memory flat


@dataclass
class Job:
    """What every chunk of one split shares: sent to each worker once."""

    tokenizer_folder: Path
    cfg: DataConfig
    is_train: bool
    tags: list[list[int]]  # source ids put first in the pairs of each of data.train_corpora (empty: none)


@dataclass
class EncodedChunk:
    start: int  # the first pair's row in the split
    src: np.ndarray  # the ids of every pair's source, concatenated (int32)
    tgt: np.ndarray
    src_len: np.ndarray  # ids per pair (int64)
    tgt_len: np.ndarray
    before: np.ndarray | None  # train: ChunkFilter verdicts (uint8 codes, uint64 keys, uint8 codes)
    keys: np.ndarray | None
    after: np.ndarray | None
    texts: tuple[list[str], list[str]] | None  # eval splits: the cleaned lines, which the cache keeps as text
    marked: int = 0  # train pairs whose source got terms marked (data.terminology)
    # data.alignments: each pair's links between source and target pieces, (n, 2) uint16 (none for a marked pair)
    links: list[np.ndarray] | None = None


_worker: dict = {}  # this process's tokenizer and filter (set by _start)


def _start(job: Job, threads: int) -> None:
    tokenizer = Tokenizer.from_folder(job.tokenizer_folder)
    tokenizer.threads = threads  # one per worker: the workers are the parallelism
    _worker.update(job=job, tokenizer=tokenizer, filter=ChunkFilter(job.cfg) if job.is_train else None)


def _encode(task: tuple[int, list, list, np.ndarray | None, list | None]) -> EncodedChunk:
    start, sources, targets, corpus, links = task
    job, tokenizer, pair_filter = _worker["job"], _worker["tokenizer"], _worker["filter"]
    sources, targets = [clean_line(s) for s in sources], [clean_line(t) for t in targets]
    src_ids, tgt_ids = tokenizer.encode_src(sources, job.cfg.src_prefix), tokenizer.encode_tgt(targets)
    # the filters judge the pair as the corpus has it; the cache keeps its marked source (data.terminology)
    terms = links and job.cfg.terminology
    kept_ids = _with_terms(start, sources, targets, src_ids, links, tokenizer, job.cfg) if terms else src_ids
    marked = sum(a is not b for a, b in zip(kept_ids, src_ids))
    pieces = None
    if links and job.cfg.alignments:
        pieces = _piece_links(sources, targets, src_ids, tgt_ids, kept_ids, links, tokenizer, job.cfg.src_prefix)
    if corpus is not None:  # data.train_corpora tags: first in the source of their own corpus's pairs
        corpus = corpus.tolist()
        if pieces is not None:  # the tag's pieces come first: source positions move by its length
            pieces = [
                p + np.array([len(job.tags[c]), 0], np.uint16) if ids and len(p) else p
                for c, p, ids in zip(corpus, pieces, src_ids)
            ]
        src_ids = [job.tags[c] + ids if job.tags[c] and ids else ids for c, ids in zip(corpus, src_ids)]
        kept_ids = [job.tags[c] + ids if job.tags[c] and ids else ids for c, ids in zip(corpus, kept_ids)]
    src, src_bounds = flatten(src_ids)
    tgt, tgt_bounds = flatten(tgt_ids)
    flat = ((src, src_bounds), (tgt, tgt_bounds))
    verdicts = pair_filter.verdicts(sources, targets, *flat) if pair_filter else (None, None, None)
    if marked:
        src, src_bounds = flatten(kept_ids)
    texts = None if job.is_train else (sources, targets)
    return EncodedChunk(
        start,
        src.astype(np.int32),
        tgt.astype(np.int32),
        np.diff(src_bounds),
        np.diff(tgt_bounds),
        *verdicts,
        texts,
        marked,
        pieces,
    )


def _piece_links(sources, targets, src_ids, tgt_ids, kept_ids, links, tokenizer, prefix: str) -> list[np.ndarray]:
    """data.alignments: each pair's word links (train.align) as links between its source and target pieces; a pair
    whose source got terms marked (data.terminology) has none (its words moved)."""
    out = []
    for source, target, s_ids, t_ids, kept, pair_links in zip(sources, targets, src_ids, tgt_ids, kept_ids, links):
        if kept is not s_ids or not pair_links:
            out.append(np.zeros((0, 2), np.uint16))
            continue
        src_words = source_piece_words(tokenizer.src_pieces(s_ids), source, prefix)
        tgt_words = piece_words(tokenizer.tgt_pieces(t_ids), target)
        out.append(np.array(piece_links(pair_links, src_words, tgt_words), np.uint16).reshape(-1, 2))
    return out


def _with_terms(start, sources, targets, src_ids, links, tokenizer, cfg: DataConfig) -> list:
    """src_ids with data.terminology's share of the pairs re-encoded from their marked source (glossary.
    augmented_source). Which pairs, and which of their words, depend on the pair's row alone (a generator seeded by
    it), so the cache is the same for any number of workers."""
    marked: dict[int, str] = {}
    for i, (source, target, pair_links) in enumerate(zip(sources, targets, links)):
        rng = random.Random(f"terminology {start + i}")
        if pair_links and rng.random() < cfg.terminology:
            text = augmented_source(source, target, pair_links, rng)
            if text is not None:
                marked[i] = text
    out = list(src_ids)
    for i, ids in zip(marked, tokenizer.encode_src(list(marked.values()), cfg.src_prefix)):
        if len(ids) <= cfg.max_len:  # a marked source past the length limit: the pair as it is
            out[i] = ids
    return out


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def workers_for(rows: int, workers: int) -> int:
    """The worker processes a split of `rows` pairs gets (1: encoded in this process)."""
    return 1 if rows < MIN_PARALLEL else max(workers, 1)


def encoded_chunks(source, job: Job, workers: int, corpus_ids=None, alignments=None) -> Iterator[EncodedChunk]:
    """The split's chunks, encoded, in order. `corpus_ids(start, n)`: which of data.train_corpora each pair of a
    chunk comes from (tags), or None; `alignments(n)`: the word alignments of the chunk's n pairs, read in order
    (data.terminology), or None."""
    tasks = (
        (start, s, t, corpus_ids(start, len(s)) if corpus_ids else None, alignments(len(s)) if alignments else None)
        for start, (s, t) in zip(range(0, source.num_rows, CHUNK), source.batches(CHUNK))
    )
    if workers_for(source.num_rows, workers) == 1:
        _start(job, available_cores())
        yield from map(_encode, tasks)
        return
    context = multiprocessing.get_context("spawn")  # fork would copy the parent's memory (and torch's threads)
    with context.Pool(workers, initializer=_start, initargs=(job, 1)) as pool:
        pending: deque = deque()
        for task in tasks:
            pending.append(pool.apply_async(_encode, (task,)))
            if len(pending) >= AHEAD * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
