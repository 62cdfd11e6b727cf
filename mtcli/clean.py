"""Filters of the training pairs, applied while data.py encodes the train split (valid and test are never filtered).

In order, a pair is dropped for: an empty side, a side over data.max_len subwords, a length ratio over
data.max_ratio, and then (data.clean) being a duplicate of a pair already kept, a copy (source = target), a subword
piece repeated more than max_repeat times in a row, a side with more than max_other_script of its letters outside
its language's script, a side that py3langid puts in another language. Each pair counts under the first of these.
"""

from __future__ import annotations

import hashlib
from itertools import groupby

import regex

from mtcli.config import DataConfig
from mtcli.errors import MtcliError

REASONS = ("empty", "too_long", "ratio", "duplicate", "copy", "repeat", "script", "langid")

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


def base_language(code: str) -> str:
    """`zh-CN` -> `zh`: the part of a language code before the region or script."""
    return code.lower().replace("_", "-").split("-")[0]


def script_pattern(lang: str) -> regex.Pattern | None:
    scripts = SCRIPTS.get(base_language(lang))
    if scripts is None:
        return None
    # letters only: CJK punctuation has Han among its scripts too
    return regex.compile(r"(?=\p{L})[" + "".join(rf"\p{{scx={s}}}" for s in scripts) + "]")


def other_script_share(text: str, inside: regex.Pattern) -> float:
    """The share of the letters of `text` outside the scripts `inside` matches (digits and punctuation left out)."""
    letters = len(LETTER.findall(text))
    return (letters - len(inside.findall(text))) / letters if letters else 0.0


def longest_run(ids: list[int]) -> int:
    """The most times one piece follows itself in `ids`."""
    return max((sum(1 for _ in run) for _, run in groupby(ids)), default=0)


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


class PairFilter:
    """The train split's filters; `reason()` names the first one that drops a pair (None: keep it). It remembers
    the pairs it kept, to find duplicates, so one filter serves one pass over the split."""

    def __init__(self, cfg: DataConfig):
        self.cfg, self.clean = cfg, cfg.clean
        self.kept: set[int] = set()
        self.scripts = (script_pattern(cfg.src_lang), script_pattern(cfg.tgt_lang))
        self.notes = [
            f"note: data.clean.max_other_script: no script known for `{lang}`, so that side is not checked"
            for lang, pattern in zip((cfg.src_lang, cfg.tgt_lang), self.scripts)
            if pattern is None and self.clean.max_other_script < 1
        ]
        c = self.clean
        self.langid = LanguageId(cfg.src_lang, cfg.tgt_lang, c.langid_min_prob) if c.langid else None

    def reason(self, src: str, tgt: str, src_ids: list[int], tgt_ids: list[int]) -> str | None:
        cfg, c = self.cfg, self.clean
        if not src or not tgt:
            return "empty"
        longer, shorter = max(len(src_ids), len(tgt_ids)), min(len(src_ids), len(tgt_ids))
        if longer > cfg.max_len:
            return "too_long"
        if cfg.max_ratio > 0 and longer > cfg.max_ratio * shorter:
            return "ratio"
        key = pair_key(src, tgt) if c.duplicates else 0
        if c.duplicates and key in self.kept:
            return "duplicate"
        if c.copies and src == tgt:
            return "copy"
        if c.max_repeat and max(longest_run(src_ids), longest_run(tgt_ids)) > c.max_repeat:
            return "repeat"
        if c.max_other_script < 1 and self.other_script(src, tgt):
            return "script"
        if self.langid is not None and self.langid.other_language(src, tgt):
            return "langid"
        if c.duplicates:
            self.kept.add(key)
        return None

    def other_script(self, src: str, tgt: str) -> bool:
        limit = self.clean.max_other_script
        return any(
            pattern is not None and other_script_share(text, pattern) > limit
            for text, pattern in zip((src, tgt), self.scripts)
        )


def describe_drops(counts: dict, cfg: DataConfig) -> str:
    """The report's account of the dropped training pairs, one figure per filter that is on."""
    c = cfg.clean
    parts = [
        f"{counts['empty']:,} with an empty side",
        f"{counts['too_long']:,} over {cfg.max_len} subwords",
        f"{counts['ratio']:,} over length ratio {cfg.max_ratio:g}",
    ]
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
