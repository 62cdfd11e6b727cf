"""Cutting text into what the model translates and putting the translations back together.

Two cuts, each keeping everything between the pieces (the glue) so the output keeps the input's layout:
- plain text into lines, and lines into sentences with sentencex (Wikimedia's rule-based segmenter for ~300
  languages: a compiled wheel with no dependencies and no models to download);
- HTML into blocks of text between tags (tags, comments and the contents of script, style, code and pre are kept
  as they are), each block then cut as plain text. Inline elements (b, i, a, span, ...) do not end a block: the
  sentence is translated whole, each element's own text is translated too, and `place_marks` puts the element back
  around the words of the sentence's translation that match its translation (exactly, ignoring case, or by shared
  runs of characters), else at the same relative place: how Argos Translate (LibreTranslate) keeps inline tags,
  without asking the model to copy placeholders it never saw in training.

(A sentence longer than the model's positions is cut into pieces by translate.split_long, not here.)

A text cut into pieces p0, p1, ... is `glue[0] + p0 + glue[1] + p1 + ... + glue[-1]`; `join` puts translations in
the pieces' places. Runs with no letter in them (numbers, emoji, punctuation) stay in the glue, untranslated.
"""

from __future__ import annotations

import bisect
import html
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from html.parser import HTMLParser

from mtcli.glossary import words
from mtcli.tokenizer import word_separator

VERBATIM_TAGS = {"script", "style", "code", "pre"}  # HTML whose text is not prose to translate
# Inline elements: their text is part of the surrounding sentence, which is translated whole, and the element is put
# back around the words that translate its own text (see `place_marks`). Every other tag ends a block of text.
INLINE_TAGS = {
    "a", "abbr", "b", "bdi", "bdo", "big", "cite", "del", "dfn", "em", "font", "i", "ins", "kbd", "label", "mark",
    "q", "s", "samp", "small", "span", "strike", "strong", "sub", "sup", "time", "tt", "u", "var",
}  # fmt: skip
MAX_INLINE_DEPTH = 32  # inline elements nested deeper than this are handled as unpaired tags (no recursion limits)


@dataclass
class Mark:
    """An inline element inside a piece: characters [start, end) of the piece's text, its tags as written, and the
    elements inside it."""

    start: int
    end: int
    open: str
    close: str
    children: list[Mark] = field(default_factory=list)
    translate: bool = False  # its text is translated alone to find where it went (see Segments.mark_texts)


@dataclass
class Segments:
    pieces: list[str]  # what the model translates, in order
    glue: list[str]  # len(pieces) + 1 strings around them (HTML: markup, already escaped)
    html: bool = False  # translations are escaped when joined
    marks: list[list[Mark]] = field(default_factory=list)  # HTML: each piece's inline elements (or none)

    def mark_texts(self) -> list[str]:
        """The texts of the inline elements to translate alone, in the order `join` takes their translations."""
        return [
            self.pieces[i][m.start : m.end] for i, marks in enumerate(self.marks) for m in _walk(marks) if m.translate
        ]


def split_text(text: str, lang: str) -> Segments:
    """Lines, then sentences (sentencex for `lang`); surrounding whitespace and letterless runs become glue."""
    import sentencex  # here: the serve extra has it; `mtcli translate --split-long` needs only split_long

    pieces, glue, pending = [], [], ""
    for line in text.splitlines(keepends=True):
        for sentence in sentencex.segment(lang, line):
            core = sentence.strip()
            if not any(ch.isalpha() for ch in core):  # nothing a translation model could improve: copy it
                pending += sentence
                continue
            start = len(sentence) - len(sentence.lstrip())
            glue.append(pending + sentence[:start])
            pieces.append(core)
            pending = sentence[start + len(core) :]
    glue.append(pending)
    return Segments(pieces, glue)


class _MarkupSplitter(HTMLParser):
    """HTML as a list of (kind, string, tag): kind "text" (unescaped; verbatim inside VERBATIM_TAGS is markup),
    "open" and "close" for the tags of inline elements, "markup" for everything else, all verbatim."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[tuple[str, str, str]] = []
        self.verbatim_depth = 0

    def markup(self, text: str) -> None:
        self.parts.append(("markup", text, ""))

    def handle_starttag(self, tag, attrs):
        if tag in INLINE_TAGS and not self.verbatim_depth:
            self.parts.append(("open", self.get_starttag_text(), tag))
            return
        self.markup(self.get_starttag_text())
        if tag in VERBATIM_TAGS:
            self.verbatim_depth += 1

    def handle_startendtag(self, tag, attrs):
        self.markup(self.get_starttag_text())

    def handle_endtag(self, tag):
        if tag in INLINE_TAGS and not self.verbatim_depth:
            self.parts.append(("close", f"</{tag}>", tag))
            return
        self.markup(f"</{tag}>")
        if tag in VERBATIM_TAGS and self.verbatim_depth:
            self.verbatim_depth -= 1

    def handle_data(self, data):
        if self.verbatim_depth or self.cdata_elem:  # script/style bodies arrive raw: keep them raw
            self.markup(data if self.cdata_elem else html.escape(data, quote=False))
        else:
            self.parts.append(("text", data, ""))

    def handle_comment(self, data):
        self.markup(f"<!--{data}-->")

    def handle_decl(self, decl):
        self.markup(f"<!{decl}>")

    def handle_pi(self, data):
        self.markup(f"<?{data}>")

    def parse_marked_section(self, i, report=1):
        try:
            return super().parse_marked_section(i, report)
        except AssertionError:  # "<![" and no section name after it: HTMLParser gives up; read it as text instead
            return -1

    def unknown_decl(self, data):
        # Marked sections as HTMLParser reads them: <![CDATA[...]]> (and the SGML kinds) end with ]]>, MS Office's
        # <![if ...]>, <![else]> and <![endif]> with ]>; the parser hands over what lies between <![ and the end
        name = re.match(r"\s*([a-zA-Z][-_.a-zA-Z0-9]*)?", data)[1] or ""
        self.markup(f"<![{data}]>" if name.lower() in {"if", "else", "endif"} else f"<![{data}]]>")


def split_html(text: str, lang: str) -> Segments:
    """An HTML fragment cut into blocks of text (what lies between tags other than inline ones), each block into
    sentences as plain text; markup between blocks and sentences is glue, and the inline elements inside a sentence
    are its marks (put back into its translation by `join`)."""
    parser = _MarkupSplitter()
    parser.feed(text)
    parser.close()
    out = Segments([], [""], html=True)
    block: list[tuple[str, str, str]] = []
    for part in [*parser.parts, ("markup", "", "")]:
        if part[0] != "markup":
            block.append(part)
            continue
        _add_block(out, block, lang)
        block = []
        out.glue[-1] += part[1]
    return out


def _add_block(out: Segments, block: list[tuple[str, str, str]], lang: str) -> None:
    text, roots = _inline_tree(block)
    if not roots:  # no inline elements, or tags that do not pair up inside the block: each text run on its own
        for kind, string, _ in block:
            if kind != "text":
                out.glue[-1] += string
                continue
            run = split_text(string, lang)
            out.glue[-1] += html.escape(run.glue[0], quote=False)
            out.pieces += run.pieces
            out.marks += [[] for _ in run.pieces]
            out.glue += [html.escape(g, quote=False) for g in run.glue[1:]]
        return
    run = split_text(text, lang)
    pos = 0
    for glue, piece in zip(run.glue, run.pieces):
        out.glue[-1] += _render(text, pos, pos + len(glue), _clip(roots, pos, pos + len(glue), text, glue=True))
        pos += len(glue)
        marks = _clip(roots, pos, pos + len(piece), text)
        for mark in _walk(marks):
            mark.start, mark.end = mark.start - pos, mark.end - pos
            mark.translate = any(ch.isalpha() for ch in piece[mark.start : mark.end]) and (
                mark.start > 0 or mark.end < len(piece)
            )
        out.pieces.append(piece)
        out.marks.append(marks)
        out.glue.append("")
        pos += len(piece)
    out.glue[-1] += _render(text, pos, len(text), _clip(roots, pos, len(text), text, glue=True))


def _inline_tree(block: list[tuple[str, str, str]]) -> tuple[str, list[Mark]]:
    """The block's text and its inline elements as a tree of Marks over it; no Marks when tags do not pair up."""
    text: list[str] = []
    length = 0
    stack: list[tuple[str, int, str, list[Mark]]] = [("", 0, "", [])]
    for kind, string, tag in block:
        if kind == "text":
            text.append(string)
            length += len(string)
        elif kind == "open":
            if len(stack) > MAX_INLINE_DEPTH:  # hostile nesting: each text run alone, as for unpaired tags
                return "".join(text), []
            stack.append((tag, length, string, []))
        elif len(stack) > 1 and stack[-1][0] == tag:
            _, start, opening, children = stack.pop()
            stack[-1][3].append(Mark(start, length, opening, string, children))
        else:
            return "".join(text), []
    return "".join(text), stack[0][3] if len(stack) == 1 else []


def _walk(marks: list[Mark]):
    for mark in marks:
        yield mark
        yield from _walk(mark.children)


def _clip(marks: list[Mark], a: int, b: int, text: str, glue: bool = False) -> list[Mark]:
    """Copies of the marks that overlap characters [a, b), cut to that range (empty elements go where they stand).
    In glue, an element cut down to whitespace is left out: `<b>One. Two</b>` gives `<b>Eins.</b> <b>Zwei</b>`."""
    out = []
    for mark in marks:
        start, end = max(mark.start, a), min(mark.end, b)
        empty_here = mark.start == mark.end and (a <= mark.start < b or mark.start == b == len(text))
        if end <= start and not empty_here:
            continue
        cut = (start, end) != (mark.start, mark.end)
        if glue and cut and not text[start:end].strip():
            continue
        out.append(Mark(start, end, mark.open, mark.close, _clip(mark.children, a, b, text, glue)))
    return out


def _render(text: str, a: int, b: int, marks: list[Mark]) -> str:
    """Characters [a, b) of `text`, escaped, with the marks' tags around their ranges (marks in order, disjoint)."""
    out, pos = [], a
    for mark in marks:
        out += [html.escape(text[pos : mark.start], quote=False), mark.open]
        out += [_render(text, mark.start, mark.end, mark.children), mark.close]
        pos = mark.end
    out.append(html.escape(text[pos:b], quote=False))
    return "".join(out)


def join(
    segments: Segments,
    translations: list[str],
    tgt_lang: str,
    mark_translations: list[str] | None = None,
    alignments: list | None = None,
) -> str:
    """The glue with each piece replaced by its translation. Between two pieces, spaces alone are dropped when
    the target language writes without them (Chinese, Japanese). HTML: translations are escaped, and each piece's
    inline elements are put back: with `alignments` (each piece's word links, glossary.words of the piece and of
    its translation), around the words aligned to their own words (`place_aligned`); else around the words of its
    translation that translate their text (`mark_translations`: the translations of segments.mark_texts(); without
    them, the texts themselves)."""
    no_spaces = word_separator(tgt_lang) == ""
    marks = iter(segments.mark_texts() if mark_translations is None else mark_translations)
    out = [segments.glue[0]]
    for i, translation in enumerate(translations):
        if not segments.html:
            out.append(translation)
        elif i < len(segments.marks) and segments.marks[i] and alignments is not None:
            out.append(place_aligned(translation, segments.pieces[i], segments.marks[i], alignments[i], no_spaces))
        elif i < len(segments.marks) and segments.marks[i]:
            out.append(place_marks(translation, segments.pieces[i], segments.marks[i], marks, no_spaces))
        else:
            out.append(html.escape(translation, quote=False))
        between = segments.glue[i + 1]
        last = i + 1 == len(translations)
        out.append("" if no_spaces and not last and between.strip(" ") == "" else between)
    return "".join(out)


def place_marks(translation: str, source: str, marks: list[Mark], translated: Iterator[str], no_spaces: bool) -> str:
    """`translation`, escaped, with the inline elements of `source` put back: each around the first place (not taken
    by a sibling) where its own translation occurs, exactly, ignoring case, or as the longest common run of at least
    half its characters; failing that, at the same relative position as in the source. Elements nested in the
    source stay nested, siblings stay apart, and, unless the language writes without spaces, whole words only."""
    placed = _place(translation, source, marks, (0, len(translation)), (0, len(source)), translated, no_spaces)
    return _render(translation, 0, len(translation), placed)


def _place(text, source, marks, bounds, source_bounds, translated, no_spaces) -> list[Mark]:
    lo, hi = bounds
    taken: list[tuple[int, int]] = []
    placed = []
    for mark in marks:
        own = next(translated, None) if mark.translate else None
        if mark.start <= source_bounds[0] and mark.end >= source_bounds[1]:
            region = bounds  # all of its parent's text
        else:
            part = own if own is not None else source[mark.start : mark.end]
            region = _find(text, part, bounds, taken) or _relative_position(mark, source_bounds, bounds)
            region = _whole_words(text, region, bounds, no_spaces)
        region = _free(region, taken, bounds)
        bisect.insort(taken, region)
        children = _place(text, source, mark.children, region, (mark.start, mark.end), translated, no_spaces)
        placed.append(Mark(*region, mark.open, mark.close, children))
    return sorted(placed, key=lambda m: (m.start, m.end))


def place_aligned(translation: str, source: str, marks: list[Mark], links, no_spaces: bool) -> str:
    """`translation`, escaped, with the inline elements of `source` put back by word alignment (`links`: source
    word, target word, as glossary.words counts them): each element around the target words aligned to the source
    words it holds, widened to the one span that covers them all (a contiguous element stays one element); an
    element none of whose words is aligned keeps its relative position in the sentence (so it is never dropped).
    Nesting is kept (a child inside its parent's span), siblings do not overlap, and unless the language writes
    without spaces, elements hold whole words."""
    targets: dict[int, list[int]] = {}
    for i, j in links:
        targets.setdefault(i, []).append(j)
    aligned = _Alignment([(a, b) for a, b, _ in words(source)], [(a, b) for a, b, _ in words(translation)], targets)
    placed = _place_by_links(translation, marks, (0, len(translation)), (0, len(source)), aligned, no_spaces)
    return _render(translation, 0, len(translation), placed)


@dataclass
class _Alignment:
    source_words: list[tuple[int, int]]  # character spans of the source's words
    target_words: list[tuple[int, int]]
    targets: dict[int, list[int]]  # source word -> the target words aligned to it

    def __post_init__(self):
        self.ends = [b for _, b in self.source_words]  # in order: words do not overlap

    def span(self, start: int, end: int) -> tuple[int, int] | None:
        """The characters of the translation that cover every target word aligned to a source word overlapping
        characters [start, end) of the source; None when none is aligned."""
        first = bisect.bisect_right(self.ends, start)
        found = []
        for i in range(first, len(self.source_words)):
            if self.source_words[i][0] >= end:
                break
            found += [self.target_words[j] for j in self.targets.get(i, ()) if j < len(self.target_words)]
        return (min(a for a, _ in found), max(b for _, b in found)) if found else None


def _place_by_links(text, marks, bounds, source_bounds, aligned: _Alignment, no_spaces) -> list[Mark]:
    lo, hi = bounds
    taken: list[tuple[int, int]] = []
    placed = []
    for mark in marks:
        if mark.start <= source_bounds[0] and mark.end >= source_bounds[1]:
            region = bounds  # all of its parent's text
        else:
            span = aligned.span(mark.start, mark.end)
            if span is not None:
                span = (max(span[0], lo), min(span[1], hi))  # inside the parent's span
            if span is None or span[0] >= span[1]:
                span = _relative_position(mark, source_bounds, bounds)
            region = _whole_words(text, span, bounds, no_spaces)
        region = _free(region, taken, bounds)
        bisect.insort(taken, region)
        children = _place_by_links(text, mark.children, region, (mark.start, mark.end), aligned, no_spaces)
        placed.append(Mark(*region, mark.open, mark.close, children))
    return sorted(placed, key=lambda m: (m.start, m.end))


def _find(text: str, part: str, bounds: tuple[int, int], taken: list[tuple[int, int]]) -> tuple[int, int] | None:
    lo, hi = bounds
    part, window = part.strip(), text[lo:hi]
    if not part:
        return None
    for haystack, needle in ((window, part), (window.lower(), part.lower())):
        if len(haystack) != len(window) or len(needle) != len(part):
            continue  # lowercasing changed the length: offsets would not match
        k = haystack.find(needle)
        while k >= 0:
            region = (lo + k, lo + k + len(needle))
            if not any(s < region[1] and region[0] < e for s, e in taken):
                return region
            k = haystack.find(needle, k + 1)
    # Inflected or reworded: the stretch from the first to the last run of 3+ shared characters (2+ in a short
    # text), when they hold at least half of it and the stretch is at most twice its length
    least = 2 if len(part) < 6 else 3
    blocks = [b for b in SequenceMatcher(None, window, part, autojunk=False).get_matching_blocks() if b.size >= least]
    while blocks:
        start, end = blocks[0].a, blocks[-1].a + blocks[-1].size
        if 2 * sum(b.size for b in blocks) >= len(part) and end - start <= 2 * len(part):
            return lo + start, lo + end
        blocks = [max(blocks, key=lambda b: b.size)] if len(blocks) > 1 else []
    return None


def _relative_position(mark: Mark, source_bounds: tuple[int, int], bounds: tuple[int, int]) -> tuple[int, int]:
    (src_lo, src_hi), (lo, hi) = source_bounds, bounds
    scale = (hi - lo) / max(src_hi - src_lo, 1)
    start = lo + round((mark.start - src_lo) * scale)
    return start, max(start, lo + round((mark.end - src_lo) * scale))


def _whole_words(text: str, region: tuple[int, int], bounds: tuple[int, int], no_spaces: bool) -> tuple[int, int]:
    (start, end), (lo, hi) = region, bounds
    start, end = max(lo, min(start, hi)), max(lo, min(end, hi))
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    if not no_spaces and start < end:
        while start > lo and text[start - 1].isalnum() and text[start].isalnum():
            start -= 1
        while end < hi and text[end - 1].isalnum() and text[end].isalnum():
            end += 1
    return start, end


def _free(region: tuple[int, int], taken: list[tuple[int, int]], bounds: tuple[int, int]) -> tuple[int, int]:
    """The part of `region` that lies in the largest stretch of `bounds` no sibling has taken (siblings must not
    overlap, nor may one hold an empty sibling inside it); an empty range where no such part is left. `taken`: the
    siblings' ranges, sorted (callers insert with bisect.insort): the free stretches are the gaps between them, and
    only those from the one ending after `region` starts are looked at, so that thousands of siblings cost
    thousands of steps, not their square."""
    lo, hi = bounds
    start, end = max(lo, min(region[0], hi)), max(lo, min(region[1], hi))
    best, best_overlap = None, 0
    first = max(bisect.bisect_right(taken, (start, hi)) - 1, 0)
    gap_start = lo if first == 0 else max(lo, taken[first - 1][1])  # disjoint and sorted: ends are in order too
    for s, e in [*taken[first:], (hi, hi)]:  # each gap ends where the next sibling starts (an empty one splits)
        if gap_start >= end:  # no later gap reaches into the region
            break
        overlap = min(s, end) - max(gap_start, start)
        if gap_start < s and overlap > best_overlap:
            best, best_overlap = (gap_start, s), overlap
        gap_start = max(gap_start, e)
    if best is not None:
        return max(best[0], start), min(best[1], end)
    point = start  # nothing left: an empty element where it would start, moved out of a sibling it falls into
    for s, e in taken:
        if s < point < e:
            point = e
    return point, point
