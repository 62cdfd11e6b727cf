"""Text in lines: files read whole with their UTF-8 checked (the line of the first bad byte named), and `mtcli
translate`'s input and output: sentences, a file in chunks or stdin as lines arrive (batched when piped, one at a
time when typed), written one output line per input line (or Moses n-best lines) to stdout or, whole or not at all,
to a file. The translator is anything with translate_nbest (mtcli.translate.Translator).
"""

from __future__ import annotations

import codecs
import queue
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from mtcli.config import DecodeConfig
from mtcli.errors import MtcliError
from mtcli.log import progress_bar
from mtcli.outputs import check_file_target, new_file


def write_translations(
    translator, chunks: Iterable[list[str]], decode: DecodeConfig, out: TextIO, total: int = 0, alignments=False
) -> int:
    """Translate chunks of lines in order, one output line per input line, or with decode.nbest > 1 Moses-style
    n-best lines `i ||| text ||| features ||| score`. `alignments`: each translation is followed by ` ||| ` and its
    word alignment in Pharaoh format (`0-0 1-2 ...`, source word - target word), as Marian prints them. A progress
    bar counts `total` lines when given. Returns the number of input lines."""
    count = 0
    bar = progress_bar(total, unit="line", enabled=total > 0)
    for chunk in chunks:
        for hyps in translator.translate_nbest(chunk, decode, alignments=alignments):
            if decode.nbest > 1:
                out.writelines(format_nbest(count, h, alignments) + "\n" for h in hyps)
            else:
                out.write(with_alignment(hyps[0], alignments) + "\n")
            count += 1
        out.flush()
        bar.update(len(chunk))
    bar.close()
    return count


def format_nbest(index: int, t, alignments: bool = False) -> str:
    """Moses n-best format: sentence index, translation, feature values (`name= value`), total score. The score is
    the log-probability divided by the length penalty of the output length (subwords + EOS)."""
    text = with_alignment(t, alignments)
    return f"{index} ||| {text} ||| log_prob= {t.log_prob:.4f} length= {len(t.tokens) + 1} ||| {t.score:.4f}"


def format_links(links) -> str:
    """Word links (source word i, target word j) in Pharaoh format, `i-j i-j ...` in order."""
    return " ".join(f"{i}-{j}" for i, j in sorted(links))


def with_alignment(t, alignments: bool) -> str:
    """A translation's text, and with `alignments` its Pharaoh links after ` ||| `."""
    return f"{t.text} ||| {format_links(t.alignment or [])}" if alignments else t.text


def chunked(lines: list[str], size: int = 10_000) -> Iterator[list[str]]:
    """A long file in chunks, so output is written as it is made (each chunk is batched by length on its own)."""
    for start in range(0, len(lines), size):
        yield lines[start : start + size]


def stdin_chunks(max_lines: int = 256, max_chars: int = 1 << 20, stream=None) -> Iterator[list[str]]:
    """Lines from stdin in order, grouped by what has arrived: one at a time when typed, in batches when piped.

    A reader thread decodes each line; the consumer takes everything already queued as one chunk, so a pipe is
    translated in batches while an interactive user gets each line back as soon as it is typed. Memory stays
    bounded: at most 4 x max_lines lines of at most max_chars characters wait in the queue (longer lines are cut,
    as the translator would cut them). Bytes that are not UTF-8 end the stream with an error naming the line, after
    the lines before it are translated."""
    stream = stream if stream is not None else sys.stdin.buffer
    lines: queue.Queue = queue.Queue(maxsize=4 * max_lines)

    def reader():
        try:
            for number, raw in enumerate(stream, start=1):
                try:
                    line = raw.decode("utf-8").rstrip("\n").removesuffix("\r")
                    line = line.removeprefix("\ufeff") if number == 1 else line
                    lines.put(line[: max_chars + 1])  # one more than the cap: still counted as cut
                except UnicodeDecodeError as e:
                    fix = "convert the input to UTF-8, e.g. with iconv"
                    lines.put(MtcliError(f"stdin line {number}: not valid UTF-8 ({e.reason}); {fix}"))
                    return
        except OSError as e:
            lines.put(MtcliError(f"reading stdin failed: {e}"))
            return
        lines.put(None)

    threading.Thread(target=reader, daemon=True).start()
    chunk: list[str] = []
    while True:
        item = lines.get() if not chunk else _get_nowait(lines)
        if isinstance(item, MtcliError):
            if chunk:
                yield chunk  # translate what came before the bad line, then stop
            raise item
        if item is None or item is _EMPTY:
            if chunk:
                yield chunk
                chunk = []
            if item is None:
                return
            continue
        chunk.append(item)
        if len(chunk) == max_lines:
            yield chunk
            chunk = []


_EMPTY = object()


def _get_nowait(q: queue.Queue):
    try:
        return q.get_nowait()
    except queue.Empty:
        return _EMPTY


@dataclass
class Source:
    """What `mtcli translate` reads: sentences given as arguments, the lines of --input, or (both None) stdin."""

    sentences: list[str] | None = None
    lines: list[str] | None = None


def open_source(text: list[str] | None, input_file: Path | None, output_file: Path | None, force: bool, inputs=()):
    """The translate command's input, checked together with --output before anything is loaded: the output may not
    be an input (the file, the run, a checkpoint in `inputs`) nor, without --force, someone's file."""
    if text and text != ["-"] and input_file is not None:
        raise MtcliError("give sentences or --input FILE, not both")
    stdin = input_file is None and text in ([], None, ["-"])
    if stdin and sys.stdin.isatty() and text != ["-"]:
        raise MtcliError("nothing to translate: give sentences, --input FILE, or pipe text into stdin")
    if output_file is not None:
        check_file_target(output_file, force, [input_file, *inputs])
    if input_file is not None:
        return Source(lines=read_lines(input_file))
    return Source() if stdin else Source(sentences=list(text))


def translate_source(
    translator, decode: DecodeConfig, source: Source, output_file: Path | None, force: bool, alignments=False
) -> None:
    """Translate `source` to stdout or to `output_file`: through a temporary sibling renamed onto it only when every
    line is written, so an error leaves an existing file as it was."""
    max_chars = 1 << 26 if translator.split_long else translator.max_chars  # split: keep a long line whole
    chunks, total = source_chunks(source, max_chars)
    if output_file is None:
        write_translations(translator, chunks, decode, sys.stdout, total, alignments)
        return
    with new_file(output_file, force) as out:
        write_translations(translator, chunks, decode, out, total, alignments)


def source_chunks(source: Source, max_chars: int) -> tuple[Iterable[list[str]], int]:
    """A Source's lines in chunks, and their number where it is known (0 for sentences and stdin); lines read from
    stdin are cut at max_chars."""
    if source.lines is not None:
        return chunked(source.lines), len(source.lines)
    if source.sentences is not None:
        return [source.sentences], 0
    return stdin_chunks(max_chars=max_chars), 0


def rewrite_source(source: Source, output_file: Path | None, force: bool, rewrite: Callable[[str], str]) -> None:
    """Each line of `source` through `rewrite` (`mtcli mark-terms`), to stdout or through a temporary sibling onto
    `output_file`."""
    chunks, _ = source_chunks(source, 1 << 26)

    def write(out: TextIO) -> None:
        for chunk in chunks:
            out.writelines(rewrite(line) + "\n" for line in chunk)
            out.flush()

    if output_file is None:
        write(sys.stdout)
        return
    with new_file(output_file, force) as out:
        write(out)


def read_lines(path: Path) -> list[str]:
    """A text file's lines, checked as UTF-8 first. Only "\\n" ends a line: universal newlines would split at a lone
    "\\r", str.splitlines at form feeds and U+2028, and either would shift every later line against its reference."""
    path = Path(path)
    if not path.is_file():
        raise MtcliError(f"{path}: no such file")
    check_utf8(path)
    with open(path, encoding="utf-8", newline="\n") as f:
        lines = [line.rstrip("\n").removesuffix("\r") for line in f]
    if lines:
        lines[0] = lines[0].removeprefix("\ufeff")  # a byte-order mark is not part of the first sentence
    return lines


def check_utf8(path: Path, chunk_size: int = 1 << 24) -> int:
    """Raise an error naming the file and line of the first byte sequence that is not UTF-8; return the number of
    newlines (the lines of a file that ends with one)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    line = 1
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                # Bytes left over from the previous chunk belong to the sequence that failed.
                line += chunk.count(b"\n", 0, max(e.start - len(e.object) + len(chunk), 0))
                raise MtcliError(
                    f"{path}:{line}: not valid UTF-8 ({e.reason} at byte "
                    f"{e.object[e.start : e.end]!r}); convert the file to UTF-8, e.g. with iconv"
                ) from None
            line += chunk.count(b"\n")
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise MtcliError(f"{path}:{line}: not valid UTF-8 (the file ends inside a character)") from None
    return line - 1


def has_bare_cr(path: Path, chunk_size: int = 1 << 24) -> bool:
    """Whether the file holds a carriage return that is not part of a \\r\\n line end."""
    with open(path, "rb") as f:
        held = b""  # a \r at the end of a chunk: its \n may start the next one
        while chunk := f.read(chunk_size):
            data = held + chunk
            held = b"\r" if data.endswith(b"\r") else b""
            body = data[:-1] if held else data
            if body.count(b"\r") != body.count(b"\r\n"):
                return True
    return bool(held)
