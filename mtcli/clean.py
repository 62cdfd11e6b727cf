"""Filters of the training pairs, applied while data.py encodes the train split (valid and test are never filtered).

In order, a pair is dropped for: an empty side, a side over data.max_len subwords, a length ratio over
data.max_ratio, and then (data.clean) being a duplicate of a pair already kept, a copy (source = target), a subword
piece repeated more than max_repeat times in a row, a side with more than max_other_script of its letters outside
its language's script, a side that py3langid puts in another language. Each pair counts under the first of these.
"""

from __future__ import annotations

import hashlib
from functools import cache

import numpy as np
import regex

from mtcli.config import DataConfig
from mtcli.errors import MtcliError

REASONS = ("empty", "too_long", "ratio", "duplicate", "copy", "repeat", "script", "langid")
CODES = {reason: code for code, reason in enumerate(REASONS, start=1)}  # 0: kept; a chunk's verdicts as uint8

# Unicode scripts (regex's Script_Extensions names) of each language; languages missing here are not checked
SCRIPTS = {
    **dict.fromkeys(
        "af az bs ca cs cy da de en eo es et eu fi fr fy ga gd gl ha hr ht hu id ig is it jv la lb lt lv mg ms mt "
        "nb nl nn no oc pl pt qu ro rm sk sl so sq sv sw tk tl tr uz vi wo xh yo zu".split(),
        ("Latn",),
    ),
    **dict.fromkeys("ba be bg kk ky mk mn ru tg tt uk".split(), ("Cyrl",)),
    "sr": ("Cyrl", "Latn"),  # Serbian is written in both
    **dict.fromkeys("ar fa ps ug ur".split(), ("Arab",)),
    **dict.fromkeys("hi mr ne sa".split(), ("Deva",)),
    **dict.fromkeys("bn as".split(), ("Beng",)),
    **dict.fromkeys("am ti".split(), ("Ethi",)),
    **dict.fromkeys("he yi".split(), ("Hebr",)),
    "el": ("Grek",),
    "hy": ("Armn",),
    "ka": ("Geor",),
    "pa": ("Guru",),
    "gu": ("Gujr",),
    "or": ("Orya",),
    "ta": ("Taml",),
    "te": ("Telu",),
    "kn": ("Knda",),
    "ml": ("Mlym",),
    "si": ("Sinh",),
    "th": ("Thai",),
    "lo": ("Laoo",),
    "km": ("Khmr",),
    "my": ("Mymr",),
    **dict.fromkeys("zh zho cmn yue".split(), ("Hani",)),
    "ja": ("Hani", "Hira", "Kana"),
    "ko": ("Hang", "Hani"),
}
LETTER = regex.compile(r"\p{L}")
# py3langid labels that count as the configured language: Wu and Cantonese for Chinese (it names plain Mandarin
# sentences Cantonese), Nynorsk for Norwegian, dialects for Arabic
LANGID_SAME = {"zh": {"wuu", "yue"}, "no": {"nn", "nb"}, "ar": {"ary", "arz"}, "uz": {"uzs"}}


def clean_line(line: str | None) -> str:
    """Whitespace runs (and newlines inside a field) to one space, stripped; None (a JSON null) to empty; a byte-order
    mark (U+FEFF, which a file may start with) removed."""
    if line is None:
        return ""
    text = line if isinstance(line, str) else str(line)  # a JSON number: its text
    return " ".join(text.replace("\ufeff", "").split())


def base_language(code: str) -> str:
    """`zh-CN` -> `zh`: the part of a language code before the region or script."""
    return code.lower().replace("_", "-").split("-")[0]


def script_pattern(lang: str) -> regex.Pattern | None:
    scripts = SCRIPTS.get(base_language(lang))
    if scripts is None:
        return None
    # letters only: CJK punctuation has Han among its scripts too
    return regex.compile(r"(?=\p{L})[" + "".join(rf"\p{{scx={s}}}" for s in scripts) + "]")


class LanguageId:
    """py3langid on both sides: a side is in another language when py3langid's best guess is another language
    with at least `min_prob` (normalised) probability; shorter, less certain guesses keep the pair."""

    def __init__(self, src_lang: str, tgt_lang: str, min_prob: float):
        try:
            from py3langid.langid import MODEL_FILE, LanguageIdentifier
        except ImportError:
            raise MtcliError(
                "data.clean.langid needs the py3langid package: pip install 'mtcli[langid]' (or set "
                "data.clean.langid: false)"
            ) from None
        self.identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        self.min_prob = min_prob
        self.accepted = []
        for key, lang in (("data.src_lang", src_lang), ("data.tgt_lang", tgt_lang)):
            base = base_language(lang)
            if base not in self.identifier.labels:
                raise MtcliError(
                    f"data.clean.langid: py3langid does not know {key} `{lang}`; set data.clean.langid: false"
                )
            self.accepted.append({base} | LANGID_SAME.get(base, set()))

    def other_language(self, src: str, tgt: str) -> bool:
        for text, accepted in zip((src, tgt), self.accepted):
            lang, prob = self.identifier.classify(text)
            if lang not in accepted and prob >= self.min_prob:
                return True
        return False


def pair_key(src: str, tgt: str) -> int:
    """64 bits of a stable hash of the pair: a set of these finds duplicates in a WMT-size corpus in about 60 bytes
    per kept pair; among 40M pairs, a collision (a pair dropped as a duplicate of another) has a chance of 4e-5."""
    digest = hashlib.blake2b(f"{src}\t{tgt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@cache
def letter_classes(lang: str) -> np.ndarray | None:
    """A table over all code points for `lang`'s script check: 0 not a letter, 1 a letter of its scripts, 2 another
    letter (what LETTER and script_pattern decide, one character at a time). Built once per process (about
    half a second), it makes the check a table lookup over a whole chunk instead of two regex scans per line."""
    inside = script_pattern(lang)
    if inside is None:
        return None
    points = np.arange(0x110000, dtype=np.uint32)
    points[0xD800:0xE000] = 0x20  # surrogates cannot be decoded; as spaces they are no letters either way
    everything = points.tobytes().decode("utf-32-le")  # every code point as one string (4 MB, no 1.1M objects)
    table = np.zeros(0x110000, dtype=np.uint8)
    table[[m.start() for m in LETTER.finditer(everything)]] = 2
    table[[m.start() for m in inside.finditer(everything)]] = 1
    return table


def code_points(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """All code points of `texts` in one array, and where each text starts in it (len(texts) + 1 bounds)."""
    bounds = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in texts], out=bounds[1:])
    points = np.frombuffer("".join(texts).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    return points, bounds


def per_text_sums(flags: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """For each text (bounds as code_points gives them), how many of its positions are flagged."""
    running = np.zeros(len(flags) + 1, dtype=np.int64)
    np.cumsum(flags, out=running[1:])
    return running[bounds[1:]] - running[bounds[:-1]]


def other_script_shares(texts: list[str], table: np.ndarray) -> np.ndarray:
    """The share of each text's letters outside its language's scripts (digits and punctuation left out), by table
    lookup (letter_classes)."""
    points, bounds = code_points(texts)
    classes = table[points]
    letters = per_text_sums(classes > 0, bounds)
    other = per_text_sums(classes == 2, bounds)
    return np.divide(other, letters, out=np.zeros(len(texts)), where=letters > 0)


def longest_runs(flat: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """The most times one id follows itself in each sequence of a chunk, its ids concatenated in `flat` (sequence i
    is flat[bounds[i]:bounds[i + 1]])."""
    n = len(bounds) - 1
    best = np.zeros(n, dtype=np.int64)
    if len(flat) == 0:
        return best
    starts = np.ones(len(flat), dtype=bool)  # where a run begins: a new id, or a new sequence
    starts[1:] = flat[1:] != flat[:-1]
    starts[bounds[:-1][bounds[:-1] < len(flat)]] = True
    run_starts = np.flatnonzero(starts)
    run_lengths = np.diff(np.append(run_starts, len(flat)))
    owner = np.searchsorted(bounds, run_starts, side="right") - 1  # the sequence each run belongs to
    np.maximum.at(best, owner, run_lengths)
    return best


def flatten(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Sequences of ids as one int64 array and their bounds."""
    bounds = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in seqs], out=bounds[1:])
    return np.fromiter((i for x in seqs for i in x), dtype=np.int64, count=int(bounds[-1])), bounds


class ChunkFilter:
    """The train split's filters over a chunk of pairs at a time, with no memory of other chunks, so worker processes
    can run them in any order: `verdicts()` gives each pair's first reason before the duplicate check, its key for
    that check, and its first reason after it; Deduplicator decides duplicates in the corpus's order."""

    def __init__(self, cfg: DataConfig):
        self.cfg, self.clean = cfg, cfg.clean
        self.notes = [
            f"note: data.clean.max_other_script: no script known for `{lang}`, so that side is not checked"
            for lang in (cfg.src_lang, cfg.tgt_lang)
            if script_pattern(lang) is None and self.clean.max_other_script < 1
        ]
        c = self.clean
        self.langid = LanguageId(cfg.src_lang, cfg.tgt_lang, c.langid_min_prob) if c.langid else None

    def verdicts(self, src: list[str], tgt: list[str], src_ids: tuple, tgt_ids: tuple):
        """(before, keys, after): uint8 reason codes (CODES; 0 none) before and after the duplicate check, uint64
        pair keys (0 where duplicates are not checked). src_ids, tgt_ids: each side's ids as `flatten` gives them."""
        cfg, c, n = self.cfg, self.clean, len(src)
        (src_flat, src_bounds), (tgt_flat, tgt_bounds) = src_ids, tgt_ids
        src_len, tgt_len = np.diff(src_bounds), np.diff(tgt_bounds)
        longer, shorter = np.maximum(src_len, tgt_len), np.minimum(src_len, tgt_len)
        before = np.zeros(n, dtype=np.uint8)
        if cfg.max_ratio > 0:
            before[longer > cfg.max_ratio * shorter] = CODES["ratio"]
        before[longer > cfg.max_len] = CODES["too_long"]  # the earlier reason wins: set last
        before[[not s or not t for s, t in zip(src, tgt)]] = CODES["empty"]
        keys = np.zeros(n, dtype=np.uint64)
        if c.duplicates:
            keys[:] = [pair_key(s, t) for s, t in zip(src, tgt)]
        after = np.zeros(n, dtype=np.uint8)  # the first reason wins: set in reverse order
        if c.max_other_script < 1:
            for texts, lang in ((src, cfg.src_lang), (tgt, cfg.tgt_lang)):
                table = letter_classes(base_language(lang))
                if table is not None:
                    after[other_script_shares(texts, table) > c.max_other_script] = CODES["script"]
        if c.max_repeat:
            runs = np.maximum(longest_runs(src_flat, src_bounds), longest_runs(tgt_flat, tgt_bounds))
            after[runs > c.max_repeat] = CODES["repeat"]
        if c.copies:
            after[[s == t for s, t in zip(src, tgt)]] = CODES["copy"]
        if self.langid is not None:  # slow: only for pairs no other filter drops
            todo = np.flatnonzero((before == 0) & (after == 0))
            after[todo] = [CODES["langid"] if self.langid.other_language(src[i], tgt[i]) else 0 for i in todo]
        return before, keys, after


class KeySet:
    """A set of uint64 keys in a few sorted NumPy runs (8 bytes a key, where a Python set takes about 60): a new
    chunk's keys become a run; runs of similar size merge, so there are O(log n) of them to search."""

    def __init__(self):
        self.runs: list[np.ndarray] = []

    def contains(self, keys: np.ndarray) -> np.ndarray:
        found = np.zeros(len(keys), dtype=bool)
        for run in self.runs:
            at = np.searchsorted(run, keys).clip(max=len(run) - 1)
            found |= run[at] == keys
        return found

    def add(self, keys: np.ndarray) -> None:
        if len(keys) == 0:
            return
        self.runs.append(np.sort(keys))
        while len(self.runs) > 1 and len(self.runs[-2]) <= 2 * len(self.runs[-1]):
            last = self.runs.pop()
            self.runs[-1] = np.sort(np.concatenate([self.runs[-1], last]), kind="mergesort")

    @property
    def nbytes(self) -> int:
        return sum(run.nbytes for run in self.runs)


class Deduplicator:
    """The duplicate check in the corpus's order, over the verdicts of ChunkFilter: a pair is a duplicate when an
    earlier pair with its key was kept. `decide()` returns each pair's final reason code (0: kept)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.kept = KeySet()

    def decide(self, before: np.ndarray, keys: np.ndarray, after: np.ndarray) -> np.ndarray:
        reasons = np.where(before > 0, before, after)
        if not self.enabled:
            return reasons
        candidates = np.flatnonzero(before == 0)
        seen_before = self.kept.contains(keys[candidates])
        first_kept: set[int] = set()  # keys kept earlier in this chunk
        for i, old in zip(candidates.tolist(), seen_before.tolist()):
            key = int(keys[i])
            if old or key in first_kept:
                reasons[i] = CODES["duplicate"]
            elif after[i] == 0:
                first_kept.add(key)
        self.kept.add(keys[candidates[reasons[candidates] == 0]])
        return reasons


def describe_drops(counts: dict, cfg: DataConfig) -> str:
    """The report's account of the dropped training pairs, one figure per filter that is on."""
    c = cfg.clean
    parts = [f"{counts['empty']:,} with an empty side", f"{counts['too_long']:,} over {cfg.max_len} subwords"]
    if cfg.max_ratio:
        parts.append(f"{counts['ratio']:,} over length ratio {cfg.max_ratio:g}")
    if c.duplicates:
        parts.append(f"{counts['duplicate']:,} duplicates")
    if c.copies:
        parts.append(f"{counts['copy']:,} copies (source = target)")
    if c.max_repeat:
        parts.append(f"{counts['repeat']:,} with a piece repeated over {c.max_repeat} times")
    if c.max_other_script < 1:
        parts.append(f"{counts['script']:,} over {c.max_other_script:.0%} letters in another script")
    if c.langid:
        parts.append(f"{counts['langid']:,} in another language (py3langid)")
    return ", ".join(parts)


def langid_version(cfg: DataConfig) -> str | None:
    """py3langid's version when the language filter is on: another model may identify differently (cache key)."""
    if not cfg.clean.langid:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("py3langid")
    except PackageNotFoundError:
        return "missing"
