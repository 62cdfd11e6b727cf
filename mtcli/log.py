"""Reporting: the `mtcli` logger (its console side is set up once, by the CLI) and progress bars (tqdm, shown only
when stderr is a terminal). Training's own figures (metrics.jsonl, TensorBoard) are in metrics.py."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger("mtcli")


def counted(n: int, noun: str) -> str:
    """`1 sentence`, `2 sentences`, `1,024 requests`: a count with its noun in the right number."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


class _ConsoleHandler(logging.Handler):
    """Messages to stderr through tqdm, so that they land above a live progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def setup_logging() -> None:
    """Messages (info and above) to stderr, without decoration. Called once by the command-line entry point; a
    library user who wants mtcli's messages configures the `mtcli` logger as they like."""
    logger.handlers.clear()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    console = _ConsoleHandler()
    console.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(console)


def add_log_file(path: Path) -> logging.Handler:
    """Copy every message, with a timestamp, into `path` (a run's train.log) until `remove_log_file`."""
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    return handler


def remove_log_file(handler: logging.Handler | None) -> None:
    if handler is not None:
        logger.removeHandler(handler)
        handler.close()


def progress_bar(total: int, initial: int = 0, unit: str = "it", enabled: bool = True) -> tqdm:
    """A tqdm bar on stderr; disabled (it prints nothing) when stderr is not a terminal or `enabled` is False, since
    the periodic log lines carry the same figures into files and pipes."""
    return tqdm(
        total=total,
        initial=initial,
        unit=unit,
        file=sys.stderr,
        disable=not (enabled and sys.stderr.isatty()),
        dynamic_ncols=True,
        leave=False,
    )


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
