"""The data path: raw pairs -> SentencePiece -> cleaned, encoded, cached splits (batches: `mtcli/batching.py`).

`prepare(cfg)` builds (or finds) a cache folder keyed by everything that shapes its content; a second call with
nothing changed returns at once. Encoded ids live in flat memory-mapped arrays (one per side, plus offsets), so a
WMT-size corpus never has to fit in RAM. A half-written cache has a temporary name and is never taken for a complete
one; a complete one that was damaged later (a truncated copy, a disk error) is refused when it is opened: meta.json
records every file's size, and each split's offsets must fit its ids.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import random
import resource
import shutil
import time
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import sentencepiece

from mtcli.align import align_split, eflomal_module, eflomal_version, read_alignments
from mtcli.clean import REASONS, ChunkFilter, Deduplicator, clean_line, describe_drops, langid_version
from mtcli.config import Config, DataConfig
from mtcli.corpus import arrow_cache_in, describe_source, fingerprint_hash, open_splits, source_fingerprint
from mtcli.encode import Job, available_cores, encoded_chunks, workers_for
from mtcli.errors import MtcliError, error_text
from mtcli.glossary import MARKERS, TERMINOLOGY_VERSION
from mtcli.log import logger, progress_bar
from mtcli.mixture import CorpusTally, corpora_fingerprint, describe_corpora, open_train_corpora
from mtcli.outputs import publish_folder, remove_stale
from mtcli.tokenizer import Tokenizer, character_coverage, train_sentencepiece

CACHE_VERSION = 1
LINKS_VERSION = 2  # bump when the piece links of data.alignments change (encode._piece_links, align.piece_words)
DTYPES = ("uint16", "int32")  # of the cached ids: uint16 while the vocabulary fits
EVAL_ROLES = ("valid", "test")
TRAIN_TIME_SETTINGS = ("cache_dir", "sampling_alpha", "sampling_nbest", "workers")  # never change the cached content
CHECK_BLOCK = 1 << 22  # offsets checked a block at a time: memory flat in the split's size


# ---------------------------------------------------------------------------------------------------------------------
# The cache


def open_sources(cfg: DataConfig, cache_dir: Path, notes: list[str] | None = None) -> dict:
    """The corpus's splits (mtcli.corpus), the train split made of data.train_corpora when it names them."""
    sources = open_splits(cfg, cache_dir, notes)
    if cfg.train_corpora:
        sources = {"train": open_train_corpora(cfg, cache_dir, notes), **sources}
    return sources


def cache_key(cfg: DataConfig) -> dict:
    """Everything that changes the cached content; the folder name carries its hash."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in TRAIN_TIME_SETTINGS}
    # corpus weights apply at training time; a list, as meta.json reads it back
    settings["train_corpora"] = [{k: v for k, v in c.items() if k != "weight"} for c in settings["train_corpora"]]
    key = {
        "version": CACHE_VERSION,
        "sentencepiece": sentencepiece.__version__,
        "source": source_fingerprint(cfg),
        "settings": settings,
    }
    if cfg.train_corpora:
        key["train_corpora"] = corpora_fingerprint(cfg)
    if cfg.terminology or cfg.alignments:  # how terms are drawn and marked, links carried to pieces, the aligner
        key["terminology"] = {"version": TERMINOLOGY_VERSION, "eflomal": eflomal_version()}
    if cfg.alignments:
        key["alignments"] = LINKS_VERSION
    if cfg.clean.langid:  # another model may name other languages
        key["py3langid"] = langid_version(cfg)
    if cfg.tokenizer:  # the vocabulary's content, not only its folder's name
        files = given_tokenizer(cfg).files()
        key["tokenizer"] = hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()[:16]
    return key


def given_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The tokenizer of data.tokenizer: a checkpoint folder's, or a run directory's own."""
    folder = Path(cfg.tokenizer)
    try:
        return Tokenizer.from_folder(folder)
    except (OSError, RuntimeError, MtcliError) as e:
        reason = error_text(e)
        raise MtcliError(f"data.tokenizer: no usable tokenizer in {folder} ({reason})") from None


def cache_folder(cfg: DataConfig) -> Path:
    if cfg.path:
        stem = Path(cfg.path).resolve().name
    else:
        stem = Path(str(cfg.dataset)).name.replace("/", "_")
    return Path(cfg.cache_dir) / f"{stem}-{cfg.src_lang}-{cfg.tgt_lang}-{fingerprint_hash(cache_key(cfg))}"


@dataclass
class EncodedSplit:
    """One cached split: token ids of both sides, memory-mapped."""

    folder: Path
    role: str

    @cached_property
    def _arrays(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        return open_split(self.folder, self.role, read_meta(self.folder))

    @cached_property
    def _offsets(self) -> tuple[np.ndarray, np.ndarray]:
        return self._arrays[0]

    @cached_property
    def _tokens(self) -> tuple[np.ndarray, np.ndarray]:
        return self._arrays[1]

    def __len__(self) -> int:
        return len(self._offsets[0]) - 1

    @cached_property
    def src_lens(self) -> np.ndarray:
        """Source lengths with EOS."""
        return (np.diff(self._offsets[0]) + 1).astype(np.int64)

    @cached_property
    def tgt_lens(self) -> np.ndarray:
        """Target lengths with BOS (input side) or EOS (output side)."""
        return (np.diff(self._offsets[1]) + 1).astype(np.int64)

    def src(self, i: int) -> np.ndarray:
        off = self._offsets[0]
        return self._tokens[0][off[i] : off[i + 1]]

    def tgt(self, i: int) -> np.ndarray:
        off = self._offsets[1]
        return self._tokens[1][off[i] : off[i + 1]]

    @cached_property
    def _links(self) -> tuple[np.ndarray, np.ndarray] | None:
        """data.alignments: the offsets of each pair's piece links and the links, (n, 2) uint16; None without."""
        idx, bin_path = self.folder / f"{self.role}.links.idx.npy", self.folder / f"{self.role}.links.bin"
        if not idx.exists():
            return None
        try:
            offsets = np.load(idx, mmap_mode="r")
            size = bin_path.stat().st_size
        except (OSError, ValueError, EOFError) as e:
            raise damaged_cache(idx, error_text(e)) from None
        if offsets.ndim != 1 or len(offsets) != len(self) + 1 or size != 4 * int(offsets[-1]):
            raise damaged_cache(bin_path, f"{size} bytes; its offsets in {idx.name} do not fit them")
        links = np.memmap(bin_path, "<u2", mode="r").reshape(-1, 2) if size else np.zeros((0, 2), np.uint16)
        return offsets, links

    @property
    def has_links(self) -> bool:
        return self._links is not None

    def links(self, i: int) -> np.ndarray:
        """Pair i's links between source and target pieces, (n, 2): source piece, target piece (no EOS)."""
        offsets, links = self._links
        return links[offsets[i] : offsets[i + 1]]

    def texts(self) -> tuple[list[str], list[str]]:
        """The raw (stripped) source and reference lines of an eval split: what translation and BLEU read."""
        texts = []
        for side in ("src", "tgt"):
            path = self.folder / f"{self.role}.{side}.txt"
            try:
                lines = path.read_text(encoding="utf-8").split("\n")[:-1]
            except (OSError, UnicodeDecodeError) as e:
                raise damaged_cache(path, error_text(e)) from None
            if len(lines) != len(self):
                raise damaged_cache(path, f"{len(lines)} lines for {len(self)} pairs")
            texts.append(lines)
        return texts[0], texts[1]


class SampledSplit:
    """The training split re-encoded with sampled segmentations for one epoch (data.sampling_alpha): the same pairs
    in the same order as `base`, so batching and collation read it like an EncodedSplit. The seed is (seed, epoch),
    so every rank and a resumed run see the same pieces. A pair whose sample outgrows `limit` keeps its cached ids."""

    def __init__(self, base: EncodedSplit, tokenizer: Tokenizer, cfg: DataConfig, seed: int, epoch: int, limit: int):
        if type(tokenizer) is not Tokenizer:
            raise MtcliError(
                "data.sampling_alpha: subword sampling needs a SentencePiece vocabulary mtcli fitted; this one maps "
                "pieces to ids through a vocabulary file (an imported model): set data.sampling_alpha=0"
            )
        options = {"out_type": int, "enable_sampling": True, "alpha": cfg.sampling_alpha}
        if cfg.spm_model_type == "unigram":
            options["nbest_size"] = cfg.sampling_nbest
        sentencepiece.set_random_generator_seed((seed * 100_003 + epoch) % 2**32)  # it takes 32 bits
        flat: dict[str, list[np.ndarray]] = {"src": [], "tgt": []}
        lens: dict[str, list[np.ndarray]] = {"src": [], "tgt": []}
        for start in range(0, len(base), 10_000):  # in chunks: a WMT-size split never sits in RAM as Python lists
            rows = range(start, min(start + 10_000, len(base)))
            cached = {"src": [base.src(i).tolist() for i in rows], "tgt": [base.tgt(i).tolist() for i in rows]}
            # One sentence at a time on this thread: a batched call would spread over threads and lose the order.
            sampled = {
                side: [sp.encode(line, **options) for line in sp.decode(cached[side])]
                for side, sp in (("src", tokenizer.src), ("tgt", tokenizer.tgt))
            }
            for j in range(len(rows)):
                if len(sampled["src"][j]) >= limit or len(sampled["tgt"][j]) >= limit:  # with EOS over the limit
                    sampled["src"][j], sampled["tgt"][j] = cached["src"][j], cached["tgt"][j]
            for side, seqs in sampled.items():
                flat[side].append(np.fromiter((i for x in seqs for i in x), dtype=np.int32))
                lens[side].append(np.fromiter((len(x) for x in seqs), dtype=np.int64, count=len(seqs)))
        self._tokens = {side: np.concatenate(flat[side] or [np.zeros(0, np.int32)]) for side in flat}
        self._offsets = {side: np.concatenate([[0], np.cumsum(np.concatenate(lens[side] or [[]]))]) for side in lens}
        self.src_lens = (np.diff(self._offsets["src"]) + 1).astype(np.int64)  # with EOS, as EncodedSplit's
        self.tgt_lens = (np.diff(self._offsets["tgt"]) + 1).astype(np.int64)

    def __len__(self) -> int:
        return len(self.src_lens)

    def src(self, i: int) -> np.ndarray:
        off = self._offsets["src"]
        return self._tokens["src"][off[i] : off[i + 1]]

    def tgt(self, i: int) -> np.ndarray:
        off = self._offsets["tgt"]
        return self._tokens["tgt"][off[i] : off[i + 1]]


def read_meta(folder: Path) -> dict:
    """A cache folder's meta.json; one that is damaged (an edit, a disk error) is a one-line error saying to rebuild."""
    path = folder / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        meta = {"error": error_text(e)}
    if not isinstance(meta, dict) or not isinstance(meta.get("splits"), dict) or meta.get("dtype") not in DTYPES:
        reason = meta["error"] if isinstance(meta, dict) and "error" in meta else "no splits or id type"
        raise damaged_cache(path, reason)
    return meta


def damaged_cache(path: Path, reason: str) -> MtcliError:
    """The one line for a cache file that does not hold what meta.json says: rebuilding is the only cure."""
    return MtcliError(
        f"{path}: damaged data cache ({reason}); rebuild it with `mtcli data prepare --force` and the same config "
        f"(or delete {path.parent})"
    )


def check_sizes(folder: Path, meta: dict, prefix: str = "") -> None:
    """The files (those whose names start with `prefix`) have the sizes meta.json recorded when the cache was
    written; a cache written before sizes were recorded has none, and its offsets are checked alone."""
    recorded = meta.get("files")
    if not isinstance(recorded, dict):
        return
    for name, size in recorded.items():
        if not name.startswith(prefix):
            continue
        path = folder / name
        try:
            actual = path.stat().st_size
        except OSError as e:
            raise damaged_cache(path, e.strerror or error_text(e)) from None
        if actual != size:
            raise damaged_cache(path, f"{actual} bytes; meta.json records {size}")


def open_split(folder: Path, role: str, meta: dict) -> tuple[tuple, tuple]:
    """A split's offsets and ids (both sides), memory-mapped, once they are known to fit each other: recorded sizes,
    offsets that start at 0, never decrease and end at the id file's length, and the pair and id counts of
    meta.json. Cost: a stat per file and one vectorized pass over the offsets, never a loop over sentences."""
    check_sizes(folder, meta, f"{role}.")
    counts = meta["splits"].get(role)
    counts = counts if isinstance(counts, dict) else {}
    itemsize = np.dtype(meta["dtype"]).itemsize
    offsets, tokens = [], []
    for side in ("src", "tgt"):
        idx, bin_path = folder / f"{role}.{side}.idx.npy", folder / f"{role}.{side}.bin"
        try:
            # memory-mapped: a split of tens of millions of pairs starts training without reading them into RAM
            off = np.load(idx, mmap_mode="r")
        except (OSError, ValueError, EOFError) as e:  # missing, or a header cut short
            raise damaged_cache(idx, error_text(e)) from None
        try:
            size = bin_path.stat().st_size
        except OSError as e:
            raise damaged_cache(bin_path, e.strerror or error_text(e)) from None
        if off.dtype != np.int64 or off.ndim != 1 or len(off) == 0 or off[0] != 0:
            raise damaged_cache(idx, "not offsets starting at 0")
        if len(off) - 1 != counts.get("kept", len(off) - 1):
            raise damaged_cache(idx, f"{len(off) - 1} pairs; meta.json records {counts['kept']}")
        for start in range(0, len(off) - 1, CHECK_BLOCK):
            block = np.asarray(off[start : start + CHECK_BLOCK + 1])
            if (block[1:] < block[:-1]).any():
                row = start + int(np.argmax(block[1:] < block[:-1]))
                raise damaged_cache(idx, f"pair {row + 1} ends before it starts")
        ids, extra = divmod(size, itemsize)
        if extra or off[-1] != ids:
            what = f"{size} bytes, {ids} ids" + (f" and {extra} bytes" if extra else "")
            raise damaged_cache(bin_path, f"{what}; its offsets in {idx.name} end at id {int(off[-1])}")
        if ids != counts.get(f"{side}_tokens", ids):
            raise damaged_cache(bin_path, f"{ids} ids; meta.json records {counts[f'{side}_tokens']}")
        offsets.append(off)
        tokens.append(np.zeros(0, dtype=meta["dtype"]) if size == 0 else np.memmap(bin_path, meta["dtype"], mode="r"))
    return (offsets[0], offsets[1]), (tokens[0], tokens[1])


@dataclass
class PreparedData:
    folder: Path
    meta: dict
    _splits: dict[str, EncodedSplit] = field(default_factory=dict, repr=False, compare=False)  # opened (checked) once

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_folder(self.folder)

    @property
    def roles(self) -> list[str]:
        return list(self.meta["splits"])

    def split(self, role: str) -> EncodedSplit:
        if role not in self.meta["splits"]:
            raise MtcliError(
                f"the prepared data in {self.folder} has no {role} split "
                f"(it has: {', '.join(self.roles)}); set data.splits.{role}"
            )
        if role not in self._splits:
            self._splits[role] = EncodedSplit(self.folder, role)
        return self._splits[role]

    def check(self) -> None:
        """Refuse a damaged cache before anything reads it: every file's recorded size, every split's offsets."""
        check_sizes(self.folder, self.meta)
        for role in self.roles:
            len(self.split(role))  # opening a split checks it


def prepare(cfg: Config, force: bool = False) -> PreparedData:
    """Build the cache for `cfg.data` unless an identical one exists; log what was done."""
    data_cfg = cfg.data
    data_cfg.check_source()
    folder = cache_folder(data_cfg)
    if (folder / "meta.json").is_file() and not force:
        data = PreparedData(folder, read_meta(folder))
        data.check()
        logger.info(
            f"data: {describe_source(data_cfg)}, {data_cfg.src_lang} -> {data_cfg.tgt_lang}: cached in {folder}"
        )
        return data

    start = time.time()
    tmp = _work_folder(folder)
    stack = contextlib.ExitStack()
    try:
        # The header comes once the source is open, so a source that cannot be read fails with its error alone.
        notes: list[str] = []
        phases: dict[str, dict] = {}  # seconds (and pairs/s) of each phase: meta.json keeps them (make bench-data)
        arrow = tmp / "arrow"
        stack.enter_context(arrow_cache_in(arrow))  # the datasets library's copies of the text: removed below
        sources = open_sources(data_cfg, folder.parent, notes)
        phases["open"] = _phase(start, sources["train"].num_rows)
        logger.info(f"data: {describe_source(data_cfg)}, {data_cfg.src_lang} -> {data_cfg.tgt_lang}")
        pair_filter = ChunkFilter(data_cfg)  # before SentencePiece: a missing py3langid fails at once
        for note in notes + pair_filter.notes:
            logger.info(note)
        if data_cfg.terminology or data_cfg.alignments:
            eflomal_module()  # a missing aligner fails before SentencePiece is fitted
        if data_cfg.tokenizer:
            given_tokenizer(data_cfg).copy_to(tmp)
            tokenizer = Tokenizer.from_folder(tmp)
            logger.info(f"tokenizer: {data_cfg.tokenizer}'s, as it is (no SentencePiece fitting)")
            if data_cfg.terminology and not tokenizer.has_source_symbols(MARKERS):
                raise MtcliError(
                    f"data.terminology: the tokenizer of data.tokenizer ({data_cfg.tokenizer}) has no pieces for the "
                    f"term markers {', '.join(MARKERS)}; fit a new vocabulary (drop data.tokenizer) or set "
                    "data.terminology to 0"
                )
        else:
            began = time.time()
            tokenizer = _train_tokenizer(sources["train"], tmp, data_cfg)
            phases["sentencepiece"] = _phase(began)
        alignments = None
        if data_cfg.terminology or data_cfg.alignments:
            began = time.time()
            alignments = tmp / "train.align"
            aligned = align_split(sources["train"], alignments)
            phases["align"] = _phase(began, sources["train"].num_rows)
            logger.info(
                f"align: eflomal linked {aligned['aligned']:,} of {aligned['pairs']:,} training pairs "
                f"({aligned['links']:,} links)"
            )
        dtype = "uint16" if max(tokenizer.src_vocab_size, tokenizer.tgt_vocab_size) <= 65535 else "int32"
        workers = data_cfg.workers or available_cores()
        splits = {}
        for role, source in sources.items():
            began = time.time()
            links = alignments if role == "train" else None
            splits[role] = _encode_split(source, tokenizer, tmp, data_cfg, dtype, workers, links)
            used = workers_for(source.num_rows, workers) if role == "train" else 1
            phases[f"encode {role}"] = {**_phase(began, source.num_rows), "workers": used}
        meta = {
            "key": cache_key(data_cfg),
            "source": describe_source(data_cfg),
            "dtype": dtype,
            "src_lang": data_cfg.src_lang,
            "tgt_lang": data_cfg.tgt_lang,
            "joint_vocab": tokenizer.joint,
            "src_vocab_size": tokenizer.src_vocab_size,
            "tgt_vocab_size": tokenizer.tgt_vocab_size,
            "splits": splits,
            "seconds": round(time.time() - start, 1),
            "workers": workers,
            "phases": phases,
            # what every file holds, in bytes: opening the cache checks them (check_sizes)
            "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False))
        shutil.rmtree(arrow, ignore_errors=True)
        # Durable, then renamed: a crash leaves no half-written cache under the real name. An existing folder (only
        # with force=True, or a half-removed one) is replaced.
        publish_folder(tmp, folder)
    finally:
        stack.close()
        shutil.rmtree(tmp, ignore_errors=True)
    for line in split_report(meta, data_cfg):
        logger.info(line)
    phases = [
        f"{k} {v['seconds']:.1f} s"
        + (f" ({v['pairs_per_s']:,} pairs/s)" if "pairs_per_s" in v else "")
        + (f" on {v['workers']} processes" if v.get("workers", 1) > 1 else "")
        for k, v in meta["phases"].items()
    ]
    logger.info(f"phases: {', '.join(phases)}")
    logger.info(f"cache: {folder} (prepared in {time.time() - start:.1f} s)")
    return PreparedData(folder, meta)


def _phase(began: float, pairs: int | None = None) -> dict:
    """A phase's seconds, pairs/s, and this process's peak memory so far (workers not included)."""
    seconds = max(time.time() - began, 1e-6)
    phase = {"seconds": round(seconds, 2), **({"pairs_per_s": round(pairs / seconds)} if pairs is not None else {})}
    phase["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # KiB on Linux
    return phase


# A cache folder's name ends in its key's hash: a prepare's leftovers (its work folder .<name>.tmp-<pid>, or the old
# cache it was replacing, .<name>.old-<pid>: outputs.publish_folder) are those of such names
CACHE_NAME = r".+-[0-9a-f]{12}"


def _work_folder(folder: Path) -> Path:
    """An empty temporary sibling of the cache folder to build it in, after removing dead prepares' leftovers. A
    data.cache_dir that cannot hold it (a file, a read-only or odd place such as /proc) is one line."""
    cache_dir = folder.parent
    tmp = cache_dir / f".{folder.name}.tmp-{os.getpid()}"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        remove_stale(cache_dir, CACHE_NAME)  # what prepares killed earlier left (their process is gone)
        shutil.rmtree(tmp, ignore_errors=True)  # this process's own leftover only (the pid is in the name)
        tmp.mkdir()
    except OSError as e:
        raise MtcliError(
            f"data.cache_dir {cache_dir}: cannot write the data cache there ({e.strerror or error_text(e)}); set "
            "data.cache_dir to a folder you can write to"
        ) from None
    return tmp


def eval_texts(cfg: Config, role: str) -> tuple[list[str], list[str]]:
    """Source and reference lines of an eval split: from the data cache, else read from the corpus itself."""
    if role not in EVAL_ROLES:
        raise MtcliError(f"--split {role}: choose one of {', '.join(EVAL_ROLES)} (roles in data.splits)")
    if not (cfg.data.dataset or cfg.data.path):
        raise MtcliError(f"--split {role}: this run names no data (an imported model); score files with --src/--ref")
    folder = cache_folder(cfg.data)
    if (folder / "meta.json").is_file() and role in read_meta(folder)["splits"]:
        return EncodedSplit(folder, role).texts()
    sources = open_sources(cfg.data, folder.parent)
    if role not in sources:
        raise MtcliError(f"no {role} split in {describe_source(cfg.data)} (data.splits.{role})")
    src_lines, tgt_lines = [], []
    for s, t in sources[role].batches():
        src_lines += [clean_line(x) for x in s]
        tgt_lines += [clean_line(x) for x in t]
    return src_lines, tgt_lines


def split_report(meta: dict, cfg: DataConfig) -> list[str]:
    lines = []
    for role, s in meta["splits"].items():
        line = f"  {role:5} {s['name']:18} {s['total']:>9,} pairs: kept {s['kept']:,}"
        if role == "train":
            line += f"; dropped {describe_drops(s, cfg)}"
            if "terms_marked" in s:
                line += f"; terms marked in {s['terms_marked']:,} (data.terminology {cfg.terminology:g})"
            if "links" in s:
                line += f"; {s['links']:,} subword links (data.alignments)"
        else:
            if s["too_long"]:
                line += f" ({s['too_long']:,} over {cfg.max_len} subwords, kept: eval splits are never filtered)"
            if s["empty"]:
                line += f" ({s['empty']:,} with an empty side, kept)"
        lines.append(line)
        lines += describe_corpora(s.get("corpora", []), cfg) if role == "train" else []
    return lines


def _train_tokenizer(train, folder: Path, cfg: DataConfig) -> Tokenizer:
    # data.spm_sample counts sentences: a joint vocabulary reads both sides of half as many pairs
    n = min(train.num_rows, cfg.spm_sample // 2 if cfg.joint_vocab else cfg.spm_sample)
    rows = sorted(random.Random(0).sample(range(train.num_rows), n)) if n < train.num_rows else None
    src_lines, tgt_lines = [], []
    for sources, targets in train.batches(indices=rows):
        src_lines += [s for s in map(clean_line, sources) if s]  # the text exactly as _encode_split will encode it
        tgt_lines += [t for t in map(clean_line, targets) if t]
    kind = "joint" if cfg.joint_vocab else "separate"
    logger.info(
        f"sentencepiece: {kind} {cfg.spm_model_type} vocabulary of {cfg.vocab_size} (character coverage "
        f"{character_coverage(cfg):g}), fitted on {n:,} of {train.num_rows:,} training pairs (data.spm_sample)"
    )
    if not src_lines or not tgt_lines:
        raise MtcliError(
            f"the train split `{train.name}` ({train.description}) has no non-empty sentences: its lines are all "
            "blank; check data.path and data.splits.train"
        )
    tags = sorted({c.tag for c in cfg.train_corpora if c.tag})  # one piece each (data.train_corpora tags)
    if cfg.terminology:  # and the term markers (glossary.MARKERS), in the source's vocabulary
        tags += list(MARKERS)
    if cfg.joint_vocab:
        train_sentencepiece(src_lines + tgt_lines, folder / "spm.model", cfg, tags)
        return Tokenizer(folder / "spm.model")
    train_sentencepiece(src_lines, folder / "spm.src.model", cfg, tags)
    train_sentencepiece(tgt_lines, folder / "spm.tgt.model", cfg)
    return Tokenizer(folder / "spm.src.model", folder / "spm.tgt.model")


def tag_ids(tokenizer: Tokenizer, tag: str) -> list[int]:
    """A data.train_corpora tag's source ids: its one piece in a vocabulary mtcli fitted (without the word-start
    piece SentencePiece puts before it), its pieces in a given one."""
    if not tag:
        return []
    ids = tokenizer.encode_src([tag])[0]
    return ids[1:] if len(ids) > 1 and tokenizer.src_pieces(ids[:1]) == ["▁"] else ids


def _encode_split(
    source, tokenizer: Tokenizer, folder: Path, cfg: DataConfig, dtype: str, workers: int, alignments: Path | None
) -> dict:
    """Encode one split on `workers` processes (mtcli.encode), appending to flat id files; train pairs go through
    the filters (clean.ChunkFilter, then the duplicate check in order), eval pairs are kept as they are.
    `alignments`: the split's train.align, whose links mark terms in data.terminology's share of the pairs."""
    role, is_train = source.role, source.role == "train"
    counts = {
        "name": source.name,
        "total": 0,
        "kept": 0,
        **dict.fromkeys(REASONS, 0),
        "src_tokens": 0,
        "tgt_tokens": 0,
        **({"terms_marked": 0} if alignments and cfg.terminology else {}),
        **({"links": 0} if alignments and cfg.alignments else {}),
    }
    tally = CorpusTally(source.corpora) if source.corpora else None  # several training corpora: which pair is whose
    tags = [tag_ids(tokenizer, c.tag) for c in cfg.train_corpora] if any(c.tag for c in cfg.train_corpora) else []
    job = Job(folder, cfg, is_train, tags)
    dedup = Deduplicator(cfg.clean.duplicates)
    corpus_ids = tally.ids if tally is not None and tags else None
    bar = progress_bar(source.num_rows, unit="pair")
    bar.set_description(f"encode {role}")
    files = {side: open(folder / f"{role}.{side}.bin", "wb") for side in ("src", "tgt")}
    lengths = {side: open(folder / f"{role}.{side}.len.tmp", "wb") for side in ("src", "tgt")}
    texts = (
        {}
        if is_train
        else {side: open(folder / f"{role}.{side}.txt", "w", encoding="utf-8") for side in ("src", "tgt")}
    )
    reader = read_alignments(alignments) if alignments else None
    if alignments and cfg.alignments:  # train.links.bin: each kept pair's piece links, (source, target) uint16 pairs
        files["links"] = open(folder / f"{role}.links.bin", "wb")
        lengths["links"] = open(folder / f"{role}.links.len.tmp", "wb")
    try:
        links = (lambda n: list(itertools.islice(reader, n))) if reader else None
        for chunk in encoded_chunks(source, job, workers if is_train else 1, corpus_ids, links):
            n = len(chunk.src_len)
            counts["total"] += n
            if is_train:
                reasons = dedup.decide(chunk.before, chunk.keys, chunk.after)
                keep = reasons == 0
                found = np.bincount(reasons, minlength=len(REASONS) + 1)
                for code, reason in enumerate(REASONS, start=1):
                    counts[reason] += int(found[code])
            else:  # kept whatever they hold; the report notes the empty and the over-long ones
                keep = np.ones(n, dtype=bool)
                empty = np.array([not a or not b for a, b in zip(*chunk.texts)], dtype=bool)
                counts["empty"] += int(empty.sum())
                counts["too_long"] += int((~empty & (np.maximum(chunk.src_len, chunk.tgt_len) > cfg.max_len)).sum())
                for side, lines in zip(("src", "tgt"), chunk.texts):
                    texts[side].writelines(line + "\n" for line in lines)
            if tally is not None:
                tally.add(chunk.start, keep.tolist())
            for side, flat, length in (("src", chunk.src, chunk.src_len), ("tgt", chunk.tgt, chunk.tgt_len)):
                kept = flat[np.repeat(keep, length)]
                kept.astype(dtype).tofile(files[side])
                length[keep].astype(np.int64).tofile(lengths[side])
                counts[f"{side}_tokens"] += len(kept)
            counts["kept"] += int(keep.sum())
            if alignments and cfg.terminology:
                counts["terms_marked"] += chunk.marked
            if chunk.links is not None:
                kept_links = [pairs for pairs, k in zip(chunk.links, keep.tolist()) if k]
                for pairs in kept_links:
                    files["links"].write(pairs.astype("<u2").tobytes())
                np.array([len(p) for p in kept_links], np.int64).tofile(lengths["links"])
                counts["links"] += sum(len(p) for p in kept_links)
            bar.update(n)
    finally:
        bar.close()
        for f in (*files.values(), *lengths.values(), *texts.values()):
            f.close()
    for side in lengths:  # src, tgt, and links with data.alignments
        _write_offsets(folder / f"{role}.{side}.len.tmp", folder / f"{role}.{side}.idx.npy")
    if tally is not None:
        counts["corpora"] = tally.save(folder / f"{role}.corpus.npy")
    return counts


def _write_offsets(lengths_file: Path, out: Path, block: int = 1 << 20) -> None:
    """Offsets (0, then the running sum of the lengths) as a .npy file, a block at a time: memory flat in the
    split's size."""
    lengths = np.memmap(lengths_file, dtype=np.int64, mode="r") if lengths_file.stat().st_size else np.zeros(0, int)
    offsets = np.lib.format.open_memmap(out, mode="w+", dtype=np.int64, shape=(len(lengths) + 1,))
    offsets[0] = total = 0
    for start in range(0, len(lengths), block):
        part = np.cumsum(lengths[start : start + block]) + total
        offsets[start + 1 : start + 1 + len(part)] = part
        total = int(part[-1])
    offsets.flush()
    del offsets, lengths
    lengths_file.unlink()
