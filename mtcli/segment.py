"""Cutting text into what the model translates and putting the translations back together.

Three cuts, each keeping everything between the pieces (the glue) so the output keeps the input's layout:
- plain text into lines, and lines into sentences with sentencex (Wikimedia's rule-based segmenter for ~300
  languages: a compiled wheel with no dependencies and no models to download);
- HTML into text runs between tags (tags, comments and the contents of script, style, code and pre are kept as
  they are), each run then cut as plain text;
- a sentence longer than the model's positions into pieces of at most that many subwords, cut at word starts and
  preferably after punctuation, so a long input is translated whole instead of truncated.

A text cut into pieces p0, p1, ... is `glue[0] + p0 + glue[1] + p1 + ... + glue[-1]`; `join` puts translations in
the pieces' places. Runs with no letter in them (numbers, emoji, punctuation) stay in the glue, untranslated.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from html.parser import HTMLParser

from mtcli.tokenizer import CJK_LANGS

VERBATIM_TAGS = {"script", "style", "code", "pre"}  # HTML whose text is not prose to translate


@dataclass
class Segments:
    pieces: list[str]  # what the model translates, in order
    glue: list[str]  # len(pieces) + 1 strings around them (HTML: markup, already escaped)
    html: bool = False  # translations are escaped when joined


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
    """HTML as a list of (is_text, string): markup verbatim, text unescaped (and verbatim inside VERBATIM_TAGS)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[tuple[bool, str]] = []
        self.verbatim_depth = 0

    def markup(self, text: str) -> None:
        self.parts.append((False, text))

    def handle_starttag(self, tag, attrs):
        self.markup(self.get_starttag_text())
        if tag in VERBATIM_TAGS:
            self.verbatim_depth += 1

    def handle_startendtag(self, tag, attrs):
        self.markup(self.get_starttag_text())

    def handle_endtag(self, tag):
        self.markup(f"</{tag}>")
        if tag in VERBATIM_TAGS and self.verbatim_depth:
            self.verbatim_depth -= 1

    def handle_data(self, data):
        if self.verbatim_depth or self.cdata_elem:  # script/style bodies arrive raw: keep them raw
            self.markup(data if self.cdata_elem else html.escape(data, quote=False))
        else:
            self.parts.append((True, data))

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
    """The text runs of an HTML fragment, each cut as plain text; the markup between them is glue."""
    parser = _MarkupSplitter()
    parser.feed(text)
    parser.close()
    pieces, glue = [], [""]
    for is_text, part in parser.parts:
        if not is_text:
            glue[-1] += part
            continue
        run = split_text(part, lang)
        glue[-1] += html.escape(run.glue[0], quote=False)
        pieces += run.pieces
        glue += [html.escape(g, quote=False) for g in run.glue[1:]]
    return Segments(pieces, glue, html=True)


def join(segments: Segments, translations: list[str], tgt_lang: str) -> str:
    """The glue with each piece replaced by its translation. Between two pieces, spaces alone are dropped when
    the target language writes without them (Chinese, Japanese)."""
    no_spaces = tgt_lang.lower() in CJK_LANGS
    out = [segments.glue[0]]
    for i, translation in enumerate(translations):
        out.append(html.escape(translation, quote=False) if segments.html else translation)
        between = segments.glue[i + 1]
        last = i + 1 == len(translations)
        out.append("" if no_spaces and not last and between.strip(" ") == "" else between)
    return "".join(out)
