"""Line-oriented input and output for `mtcli translate`: a file in chunks, stdin as lines arrive (batched when piped,
one at a time when typed), and one output line per input line (or Moses n-best lines).
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import TextIO

from mtcli.config import DecodeConfig
from mtcli.errors import MtcliError
from mtcli.log import progress_bar
from mtcli.translate import Translation, Translator


def write_translations(
    translator: Translator, chunks: Iterable[list[str]], decode: DecodeConfig, out: TextIO, total: int = 0
) -> int:
    """Translate chunks of lines in order, one output line per input line, or with decode.nbest > 1 Moses-style
    n-best lines `i ||| text ||| features ||| score`. A progress bar counts `total` lines when given. Returns the
    number of input lines."""
    count = 0
    bar = progress_bar(total, unit="line", enabled=total > 0)
    for chunk in chunks:
        for hyps in translator.translate_nbest(chunk, decode):
            if decode.nbest > 1:
                out.writelines(format_nbest(count, h) + "\n" for h in hyps)
            else:
                out.write(hyps[0].text + "\n")
            count += 1
        out.flush()
        bar.update(len(chunk))
    bar.close()
    return count


def format_nbest(index: int, t: Translation) -> str:
    """Moses n-best format: sentence index, translation, feature values (`name= value`), total score. The score is
    the log-probability divided by the length penalty of the output length (subwords + EOS)."""
    return f"{index} ||| {t.text} ||| log_prob= {t.log_prob:.4f} length= {len(t.tokens) + 1} ||| {t.score:.4f}"


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
