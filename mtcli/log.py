"""Console and file logging, the training progress line, and a thin TensorBoard wrapper."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

logger = logging.getLogger("mtcli")


def setup_logging(log_file: Path | None = None, quiet: bool = False) -> None:
    """Messages to stderr (warnings only when quiet, e.g. on ranks other than 0) and, if given, to a file."""
    logger.handlers.clear()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("%(message)s"))
    console.setLevel(logging.WARNING if quiet else logging.INFO)
    logger.addHandler(console)
    if log_file is not None:
        handler = logging.FileHandler(log_file, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
        logger.addHandler(handler)


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Progress:
    """One status line rewritten in place on a terminal; nothing extra when stderr is a file or pipe (the periodic
    log lines carry the same figures there)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total = total
        self.enabled = enabled and sys.stderr.isatty()
        self.last_draw = 0.0
        self.width = 0

    def update(self, done: int, text: str, eta_s: float | None) -> None:
        now = time.time()
        if not self.enabled or now - self.last_draw < 0.5:
            return
        self.last_draw = now
        bar_width = 20
        filled = int(bar_width * done / max(self.total, 1))
        eta = f" | ETA {format_duration(eta_s)}" if eta_s is not None else ""
        line = f"[{'#' * filled}{'.' * (bar_width - filled)}] {text}{eta}"
        sys.stderr.write("\r" + line.ljust(self.width))
        sys.stderr.flush()
        self.width = len(line)

    def clear(self) -> None:
        if self.enabled and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()
            self.width = 0


class TensorBoard:
    """`log(step, **scalars)` into a run's `tb/` folder; a no-op where disabled (ranks other than 0)."""

    def __init__(self, folder: Path | None):
        self.writer = None
        if folder is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(folder))

    def log(self, step: int, prefix: str = "", **scalars: float) -> None:
        if self.writer is None:
            return
        for name, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(f"{prefix}{name}", value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
