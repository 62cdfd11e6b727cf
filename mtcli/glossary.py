"""Glossaries: a file of `source term<TAB>target term` pairs, the terms found in a text (constrained.py then writes
their target terms, or the text is marked for a model trained with terminology), and term accuracy.

File: UTF-8, one pair a line, `#` starts a comment line, blank lines are skipped. Matching rules, the same in every
command that takes a glossary:
- whole words: a term matches where the text has the same words, with any whitespace between them, and not inside a
  longer word; in scripts written without spaces (Chinese, Japanese, Thai, ...) every character is a word, so a
  term matches at any character;
- case is ignored (Unicode case folding): `apple` matches `Apple` and `APPLE`; the target term is used as written;
- longest first, then leftmost: of two matches that overlap, the one with more words wins (then the earlier one),
  and no two matches in a text overlap;
- a source term given twice keeps its first target term; the others are counted and warned about once.

Matching is a hash lookup of each word span that starts with a term's first word, so its cost grows with the text
and the longest term, not with the glossary's size (no automaton library needed: a 100,000-entry glossary is one
dict).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import regex

from mtcli.errors import MtcliError
from mtcli.line_io import check_utf8
from mtcli.log import logger

MAX_TERM_WORDS = 32  # a longer "term" is a sentence: refused (it would also make every lookup longer)
# A word: a run of letters, marks and digits (apostrophes and hyphens inside it kept), one character of a script
# written without spaces, or one other visible character (punctuation, symbols). Runs are maximal, so a term made of
# whole words never matches inside a longer word: `apple` is not found in `pineapple` or `pine-apple`.
WORD = regex.compile(
    r"[\p{Han}\p{Hiragana}\p{Katakana}\p{Thai}\p{Lao}\p{Khmer}\p{Myanmar}\p{Tibetan}]"
    r"|[\p{L}\p{M}\p{N}_]+(?:['’\-][\p{L}\p{M}\p{N}_]+)*"
    r"|[^\s\p{L}\p{M}\p{N}_]"
)


@dataclass(frozen=True)
class Match:
    start: int  # character offsets of the source term in the text
    end: int
    source: str  # the text's own words there
    target: str  # the glossary's target term


def words(text: str) -> list[tuple[int, int, str]]:
    """(start, end, case-folded word) of each word of `text`."""
    return [(m.start(), m.end(), m.group().casefold()) for m in WORD.finditer(text)]


@dataclass
class Glossary:
    """Source terms (as tuples of case-folded words) and their target terms."""

    terms: dict[tuple[str, ...], str] = field(default_factory=dict)
    # first word -> the word counts of the terms that start with it, longest first
    lengths: dict[str, list[int]] = field(default_factory=dict)
    conflicts: int = 0  # source terms given again with another target term (the first one is kept)
    origins: dict[tuple[str, ...], str] = field(default_factory=dict)  # where each term was given, for errors

    def add(self, source: str, target: str, where: str = "") -> bool:
        """Add a pair; False (and nothing changed) when the source term is there already."""
        key = tuple(w for _, _, w in words(source))
        if key in self.terms:
            if self.terms[key] != target:
                self.conflicts += 1
            return False
        self.terms[key] = target
        self.origins[key] = where
        counts = self.lengths.setdefault(key[0], [])
        if len(key) not in counts:
            counts.append(len(key))
            counts.sort(reverse=True)
        return True

    def __len__(self) -> int:
        return len(self.terms)

    def matches(self, text: str) -> list[Match]:
        """The glossary's terms in `text`: longest first, then leftmost, never overlapping (see the module's rules)."""
        found = words(text)
        out, i = [], 0
        while i < len(found):
            for n in self.lengths.get(found[i][2], ()):
                span = found[i : i + n]
                target = self.terms.get(tuple(w for _, _, w in span)) if len(span) == n else None
                if target is not None:
                    start, end = span[0][0], span[-1][1]
                    out.append(Match(start, end, text[start:end], target))
                    i += n
                    break
            else:
                i += 1
        return out


# ---------------------------------------------------------------------------------------------------------------------
# Terms marked in the source (decode.constraints soft; data.terminology trains a model to follow them)
#
# The inline syntax, OpusTrainer's (Dinu et al. 2019's append method): each source term is followed by the target
# term the translation should use, `__source__ apples __target__ Äpfel __done__`. The three markers are pieces of
# their own in the vocabulary of a model trained with data.terminology, so the same marked text works in mtcli, in
# every export (CTranslate2, Transformers, Argos) and typed into LibreTranslate: only the source text changes.

MARKERS = ("__source__", "__target__", "__done__")
TERMINOLOGY_VERSION = 2  # bump when augmented_source's output changes (it is part of the data cache's key)
MAX_AUGMENTED_TERMS = 2  # terms marked in one augmented training pair (1 or 2, drawn)
MAX_AUGMENTED_WORDS = 3  # words of a source or target term marked in training


# In training, this share of the marked terms loses its source words (`__source__ __target__ Äpfel __done__`): with
# the source words there, the marked target repeats what they already say, and a model can learn to ignore it; without
# them, copying the marked target is the only way to translate the term (the masking of Ailem et al. 2021).
DROP_SOURCE_TERM = 0.5


def marked(source: str, target: str) -> str:
    return (
        f"{MARKERS[0]} {source} {MARKERS[1]} {target} {MARKERS[2]}"
        if source
        else f"{MARKERS[0]} {MARKERS[1]} {target} {MARKERS[2]}"
    )


def mark_terms(text: str, matches: list[Match], drop: frozenset[int] = frozenset()) -> str:
    """`text` with each match followed by its target term in the inline syntax (matches do not overlap); the
    matches at the positions `drop` lose their source words (training only: DROP_SOURCE_TERM)."""
    out, at = [], 0
    for n, m in enumerate(sorted(matches, key=lambda m: m.start)):
        out += [text[at : m.start], marked("" if n in drop else text[m.start : m.end], m.target)]
        at = m.end
    return "".join(out) + text[at:]


def soft_marked(text: str, matches: list[Match]) -> str:
    """What decode.constraints soft (and `mtcli glossary mark`) hands the model: each matched source term replaced by
    `__source__ __target__ <target term> __done__`, the masked form training uses (DROP_SOURCE_TERM). Keeping the
    source words reads better but works worse: where the words and the marked target disagree, the toy model
    followed the words (5% term accuracy against 67-87% masked, docs/benchmarks.md)."""
    return mark_terms(text, matches, frozenset(range(len(matches))))


def phrase_pairs(links: list[tuple[int, int]], max_words: int = MAX_AUGMENTED_WORDS) -> list[tuple[int, int, int, int]]:
    """Aligned phrase pairs (source words [a, b), target words [c, d)) of at most `max_words` words a side, where
    every word of both spans is aligned and no link leaves the pair: the units that can be marked as a term."""
    by_src: dict[int, list[int]] = {}
    by_tgt: dict[int, list[int]] = {}
    for i, j in links:
        by_src.setdefault(i, []).append(j)
        by_tgt.setdefault(j, []).append(i)
    pairs = []
    for a in sorted(by_src):
        for b in range(a + 1, a + max_words + 1):
            if b - 1 not in by_src:
                break
            targets = [j for i in range(a, b) for j in by_src[i]]
            c, d = min(targets), max(targets) + 1
            if d - c > max_words:
                continue
            if all(j in by_tgt and all(a <= i < b for i in by_tgt[j]) for j in range(c, d)):
                pairs.append((a, b, c, d))
    return pairs


def augmented_source(source: str, target: str, links: list[tuple[int, int]], rng: random.Random) -> str | None:
    """The training source with 1 or 2 aligned terms marked (their target words as the target text writes them; each
    term's source words dropped with DROP_SOURCE_TERM's odds), or None when the pair has no term to mark. Terms are
    drawn among phrase_pairs whose source side holds a word of three letters or more (not punctuation, numbers or
    "a", "in") and never overlap."""
    src_words, tgt_words = words(source), words(target)

    def is_term(a: int, b: int, c: int, d: int) -> bool:
        return (
            b <= len(src_words) and d <= len(tgt_words) and any(len(w) >= 3 and w.isalpha() for *_, w in src_words[a:b])
        )

    candidates = [p for p in phrase_pairs(links) if is_term(*p)]
    rng.shuffle(candidates)
    wanted = rng.randint(1, MAX_AUGMENTED_TERMS)
    chosen: list[tuple[int, int, int, int]] = []
    for pair in candidates:
        if len(chosen) == wanted:
            break
        if all(pair[1] <= a or b <= pair[0] for a, b, _, _ in chosen):
            chosen.append(pair)
    if not chosen:
        return None
    matches = [
        Match(src_words[a][0], src_words[b - 1][1], "", target[tgt_words[c][0] : tgt_words[d - 1][1]])
        for a, b, c, d in sorted(chosen)
    ]
    return mark_terms(source, matches, frozenset(n for n in range(len(matches)) if rng.random() < DROP_SOURCE_TERM))


def _tsv_rows(path: Path | str, option: str) -> Iterator[tuple[str, list[str]]]:
    """(`file:line`, the line's tab-separated fields) of each line of a UTF-8 file that is neither blank nor a `#`
    comment; a missing file or bytes that are not UTF-8 are one error naming it."""
    path = Path(path)
    if not path.is_file():
        raise MtcliError(f"{option} {path}: no such file")
    check_utf8(path)
    with open(path, encoding="utf-8", newline="") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if line.strip() and not line.lstrip().startswith("#"):
                yield f"{path}:{number}", line.split("\t")


def load_glossary(path: Path | str, max_entries: int = 10_000_000) -> Glossary:
    """Read a glossary file; bad lines are one error naming the file and line."""
    glossary = Glossary()
    for where, fields in _tsv_rows(path, "--glossary"):
        if len(fields) < 2:
            raise MtcliError(f"{where}: no tab; a glossary line is `source term<TAB>target term`")
        if len(fields) > 2:
            raise MtcliError(f"{where}: more than one tab; a glossary line is `source term<TAB>target term`")
        add_pair(glossary, fields[0].strip(), fields[1].strip(), where)
        if len(glossary) > max_entries:
            raise MtcliError(f"{path}: over {max_entries:,} entries")
    warn_conflicts(glossary, str(path))
    return glossary


def add_pair(glossary: Glossary, source: str, target: str, where: str) -> None:
    """One pair, checked: `where` names it in an error (a file's line, a request's field)."""
    if not source or not target:
        raise MtcliError(f"{where}: an empty {'source' if not source else 'target'} term")
    n_words = len(words(source))
    if n_words == 0:
        raise MtcliError(f"{where}: the source term {source[:50]!r} has no word in it")
    if n_words > MAX_TERM_WORDS:
        raise MtcliError(f"{where}: a source term of {n_words} words; terms have at most {MAX_TERM_WORDS}")
    glossary.add(source, target, where)


def warn_conflicts(glossary: Glossary, name: str) -> None:
    if glossary.conflicts:
        logger.warning(
            f"warning: {name}: {glossary.conflicts} source term(s) given again with another target term; the first "
            "one is used"
        )


def load_line_terms(path: Path | str, lines: int) -> tuple[list[Glossary], list[TermCheck]]:
    """A terms file for a test set, as the WMT 2021 terminology task gives them: `line<TAB>source term<TAB>target
    term` (line numbers from 1; # comments). Returns one glossary per line (what its translation is asked to hold)
    and the expected target terms (term accuracy counts each, whether or not its source term matches the line)."""
    glossaries = [Glossary() for _ in range(lines)]
    checks = []
    for where, fields in _tsv_rows(path, "--terms"):
        if len(fields) != 3 or not fields[0].strip().isdigit():
            raise MtcliError(f"{where}: a terms line is `line number<TAB>source term<TAB>target term`")
        line, source, target = int(fields[0]), fields[1].strip(), fields[2].strip()
        if not 1 <= line <= lines:
            raise MtcliError(f"{where}: line {line} is not a line of the {lines:,} sources")
        add_pair(glossaries[line - 1], source, target, where)
        checks.append(TermCheck(line - 1, source, target))
    return glossaries, checks


# ---------------------------------------------------------------------------------------------------------------------
# Term accuracy


@dataclass(frozen=True)
class TermCheck:
    """One expected target term of one line."""

    line: int  # 0-based
    source: str
    target: str


def expected_terms(glossary: Glossary, sources: list[str]) -> list[TermCheck]:
    """The target terms a translation of each source line should hold: one per glossary match."""
    return [TermCheck(i, m.source, m.target) for i, text in enumerate(sources) for m in glossary.matches(text)]


def term_accuracy(checks: list[TermCheck], hypotheses: list[str]) -> dict:
    """Exact-match term accuracy: the share of expected target terms that occur in their line's translation, case
    sensitive and ignoring case (the WMT 2021 terminology task's exact-match measure). A term expected twice in a
    line must occur twice."""
    if not checks:
        return {"terms": 0, "accuracy": None, "accuracy_lc": None}
    wanted = Counter((c.line, c.target) for c in checks)
    hits = hits_lc = 0
    for (line, target), count in wanted.items():
        hyp = hypotheses[line]
        hits += min(count, hyp.count(target))
        hits_lc += min(count, hyp.casefold().count(target.casefold()))
    n = len(checks)
    return {"terms": n, "accuracy": round(100 * hits / n, 2), "accuracy_lc": round(100 * hits_lc / n, 2)}
