"""Word alignments of a parallel corpus with eflomal (Östling & Tiedemann 2016, the aligner of Mozilla's pipeline),
symmetrized with grow-diag-final-and, as Pharaoh lines (`i-j`: source word i is aligned to target word j).

Words are those of glossary.words (a run of letters and digits, one character of a script written without spaces,
one punctuation mark), so the alignments, the terminology augmentation built on them (glossary.augmented_source)
and glossary matching all count words the same way. `mtcli data` aligns the train split once, chunk by chunk (memory
stays bounded in the corpus's size), and keeps the links beside the encoded corpus as `train.align`, one line per
train row of the source before filtering.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from mtcli.clean import clean_line
from mtcli.errors import MtcliError
from mtcli.glossary import words
from mtcli.line_io import format_links
from mtcli.log import progress_bar
from mtcli.tokenizer import word_separator

# Pairs aligned by one eflomal run: bounds memory (eflomal holds its chunk in memory) while giving each run enough
# text to estimate its lexical statistics; eflomal sets its iterations from the chunk's size.
ALIGN_CHUNK = 250_000
# Sentences longer than this (in words) are not aligned (eflomal itself skips those of 1,024 tokens or more).
MAX_ALIGN_WORDS = 250
NEIGHBOURS = ((-1, 0), (0, -1), (1, 0), (0, 1), (-1, -1), (-1, 1), (1, -1), (1, 1))

Links = list[tuple[int, int]]


def eflomal_module():
    """The eflomal package, or one line saying how to install it."""
    try:
        import eflomal
    except ImportError:
        raise MtcliError(
            "word alignment needs eflomal, which is not installed: pip install 'mtcli[align]' (it builds with a C "
            "compiler), or set data.terminology to 0"
        ) from None
    return eflomal


def eflomal_version() -> str:
    from importlib.metadata import version

    return version("eflomal")


def alignment_words(text: str) -> list[str]:
    """The words eflomal sees for a line: glossary.words', case-folded."""
    return [w for _, _, w in words(text)]


def parse_links(line: str) -> Links:
    """Pharaoh `i-j i-j ...` as (i, j) pairs."""
    return [(int(i), int(j)) for i, _, j in (link.partition("-") for link in line.split())]


def symmetrize(forward: Links, reverse: Links) -> Links:
    """grow-diag-final-and (Koehn et al. 2005, as Moses and fast_align's atools do it): the links both directions
    agree on, grown into their union's neighbouring links (diagonals included) that cover a word not yet aligned on
    either side, then the links of each direction that align two words both still unaligned."""
    forward_set, reverse_set = set(forward), set(reverse)
    union = forward_set | reverse_set
    links = forward_set & reverse_set
    src_aligned = {i for i, _ in links}
    tgt_aligned = {j for _, j in links}

    def add(i: int, j: int) -> None:
        links.add((i, j))
        src_aligned.add(i)
        tgt_aligned.add(j)

    grown = True
    while grown:
        grown = False
        for i, j in sorted(links):
            for di, dj in NEIGHBOURS:
                new = (i + di, j + dj)
                if new in union and new not in links and (new[0] not in src_aligned or new[1] not in tgt_aligned):
                    add(*new)
                    grown = True
    for direction in (forward_set, reverse_set):
        for i, j in sorted(direction):
            if (i, j) not in links and i not in src_aligned and j not in tgt_aligned:
                add(i, j)
    return sorted(links)


def align_chunk(sources: list[str], targets: list[str]) -> list[Links]:
    """Symmetrized links of each pair (empty for a pair with an empty or over-long side), from one eflomal run."""
    eflomal = eflomal_module()
    src_words = [alignment_words(s) for s in sources]
    tgt_words = [alignment_words(t) for t in targets]
    usable = [i for i, (s, t) in enumerate(zip(src_words, tgt_words)) if 0 < max(len(s), len(t)) <= MAX_ALIGN_WORDS]
    usable = [i for i in usable if src_words[i] and tgt_words[i]]
    out: list[Links] = [[] for _ in sources]
    if not usable:
        return out
    with tempfile.TemporaryDirectory(prefix="mtcli-align-") as tmp:
        forward_file, reverse_file = os.path.join(tmp, "fwd"), os.path.join(tmp, "rev")
        try:
            eflomal.Aligner().align(
                [" ".join(src_words[i]) + "\n" for i in usable],
                [" ".join(tgt_words[i]) + "\n" for i in usable],
                links_filename_fwd=forward_file,
                links_filename_rev=reverse_file,
                quiet=True,
            )
        except Exception as e:  # the aligner is a separate program: its failure is one line, not a traceback
            raise MtcliError(f"eflomal failed on {len(usable):,} pairs: {type(e).__name__}: {e}") from None
        with open(forward_file, encoding="utf-8") as fwd, open(reverse_file, encoding="utf-8") as rev:
            for i, forward, reverse in zip(usable, fwd, rev):
                links = symmetrize(parse_links(forward), parse_links(reverse))
                # eflomal never links past a sentence's words; a link that does means a mismatch of the two files
                n, m = len(src_words[i]), len(tgt_words[i])
                out[i] = [(a, b) for a, b in links if a < n and b < m]
    return out


def align_split(source, out_path: Path, chunk: int = ALIGN_CHUNK) -> dict:
    """Align every pair of a split (a corpus.SplitSource) and write one Pharaoh line per row to `out_path`;
    returns counts for meta.json."""
    eflomal_module()  # before any work: a missing aligner fails at once
    bar = progress_bar(source.num_rows, unit="pair")
    bar.set_description("align train")
    aligned = links_total = 0
    try:
        with open(out_path, "w", encoding="utf-8") as out:
            for sources, targets in source.batches(chunk):
                # the text exactly as the encoder cleans it: the augmentation's word offsets are in that text
                for links in align_chunk([clean_line(s) for s in sources], [clean_line(t) for t in targets]):
                    out.write(format_links(links) + "\n")
                    aligned += bool(links)
                    links_total += len(links)
                bar.update(len(sources))
    finally:
        bar.close()
    return {"pairs": source.num_rows, "aligned": aligned, "links": links_total}


# ---------------------------------------------------------------------------------------------------------------------
# Words and subwords: links between words carried to the pieces that spell them, and back


def piece_words(pieces: list[str], text: str) -> list[list[int]]:
    """The words (glossary.words of `text`, by index) each SentencePiece piece spells: usually one, none for a lone
    "▁", several for a piece that spans them (苹果: two Chinese words of one character; "Mann." a word and a mark).
    Pieces are walked along the text one non-space character at a time; a byte-fallback piece (<0xE4>) counts one
    character at the first byte of each UTF-8 character, its continuation bytes belong to that character's word.
    Normalization that changes a text's length (NFKC's "ﬁ" -> "fi") can shift later pieces by a word, never past
    the text."""
    owner = [-1] * len(text)
    for w, (start, end, _) in enumerate(words(text)):
        owner[start:end] = [w] * (end - start)
    out: list[list[int]] = []
    pos = 0
    for piece in pieces:
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            byte = int(piece[3:5], 16)
            if 0x80 <= byte < 0xC0:  # a continuation byte: the character its first byte began
                out.append(out[-1][-1:] if out else [])
                continue
            chars = 1
        else:
            chars = sum(not c.isspace() for c in piece.replace("▁", " "))
        spelled: list[int] = []
        for _ in range(chars):
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if pos < len(text):
                if owner[pos] >= 0 and owner[pos] not in spelled:
                    spelled.append(owner[pos])
                pos += 1
        out.append(spelled)
    return out


def source_piece_words(pieces: list[str], line: str, prefix: str = "") -> list[list[int]]:
    """piece_words of a source line encoded after a prefix (`>>deu<<`, see Tokenizer.encode_src): the line's words
    count from 0, the prefix's are left out."""
    if not prefix:
        return piece_words(pieces, line)
    skipped = len(words(prefix))
    return [[w - skipped for w in spelled if w >= skipped] for spelled in piece_words(pieces, f"{prefix} {line}")]


def piece_links(links: Links, src_words: list[list[int]], tgt_words: list[list[int]]) -> list[tuple[int, int]]:
    """Word links as links between the pieces of the linked words: every piece that spells source word i with every
    piece that spells target word j (once, however many of their words are linked)."""
    src_pieces: dict[int, list[int]] = {}
    tgt_pieces: dict[int, list[int]] = {}
    for p, spelled in enumerate(src_words):
        for w in spelled:
            src_pieces.setdefault(w, []).append(p)
    for q, spelled in enumerate(tgt_words):
        for w in spelled:
            tgt_pieces.setdefault(w, []).append(q)
    found = {(p, q) for i, j in links for p in src_pieces.get(i, ()) for q in tgt_pieces.get(j, ())}
    return sorted(found)


def attention_links(attention, one_to_many: bool = False) -> list[tuple[int, int]]:
    """Links (source piece, target piece) read from an attention matrix (target pieces x source pieces, the
    source's EOS left out, a numpy array). By default where each is the other's most attended: the intersection of
    the two directions' best links that symmetrization starts from (Och & Ney 2003). On Multi30k valid (en-de) it
    was ahead of target-to-source links alone, for the guided head (F1 against eflomal 89.1 against 85.8; tags
    placed exactly 82 % against 77 %) and for the averaged heads of a model trained without it (80.0 against 72.3;
    67 % against 55 %); growing it towards the union (grow-diag, with or without final) lost 2-5 points of tags.
    one_to_many (targets written without spaces, whose words are single characters): each target piece linked to
    the source piece it attends to most, so that one source word can hold several characters (love -> 喜欢)."""
    if attention.size == 0:
        return []
    best_source = attention.argmax(1).tolist()
    if one_to_many:
        return [(s, t) for t, s in enumerate(best_source)]
    best_target = attention.argmax(0)
    return [(s, t) for t, s in enumerate(best_source) if best_target[s] == t]


def attention_word_links(attention, src_pieces, line: str, prefix: str, tgt_pieces, text: str, tgt_lang: str) -> Links:
    """The word links of one translation, from its alignment heads' attention (output pieces x source pieces, the
    source's EOS left out): attention_links, one to many for a target written without spaces, carried from the
    pieces to the words of the source line (after `prefix`) and of the translation's `text`. What mtcli's
    translations and its CTranslate2 export's both go through."""
    one_to_many = word_separator(tgt_lang) == ""  # Chinese, Japanese: a word is a character
    pairs = attention_links(attention, one_to_many)
    return word_links(pairs, source_piece_words(src_pieces, line, prefix), piece_words(tgt_pieces, text))


def word_links(piece_pairs, src_words: list[list[int]], tgt_words: list[list[int]]) -> Links:
    """Links between pieces (source piece, target piece) as sorted, distinct links between the words they spell
    (every word of the one with every word of the other)."""
    return sorted({(i, j) for p, q in piece_pairs for i in src_words[p] for j in tgt_words[q]})


def read_alignments(path: Path) -> Iterator[Links]:
    """The links of each row of a `train.align` file, in order."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield parse_links(line)
