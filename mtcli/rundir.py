"""What a run directory is and who may write it: the manifest that marks one (`.mtcli-output.json` naming `train`,
`import` or `distill`, or an older mtcli's checkpoints/ and config.yaml), the check that refuses a folder of the
user's before anything is written there, and an exclusive lock (one writer per directory). Then `mtcli train`'s
opening of its run: the checks that a new run or a resume fits what is there, train.log, and torchrun's restarts
(which resume by themselves). The rule for the folders and files other commands write is in outputs.py.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from mtcli import checkpoint as ckpt
from mtcli.distributed import Dist, restart_count
from mtcli.errors import MtcliError
from mtcli.log import add_log_file, logger, remove_log_file
from mtcli.outputs import MANIFEST, read_manifest

RUN_COMMANDS = ("train", "import", "distill")  # the commands whose folders are run directories


def check_run_dir(run_dir: Path, doing: str, made_by: tuple[str, ...] = RUN_COMMANDS) -> None:
    """`--run-dir` of a command that writes into a run (`doing` it: "train into", "resume", "distill into"): a
    missing or empty folder, or a run one of `made_by` left; a folder of the user's is refused before anything is
    written."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise MtcliError(f"--run-dir {run_dir}: exists and is not a folder")
    entries = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else []
    if entries in ([], [".lock"]) or run_command(run_dir) in made_by:  # .lock alone: a run killed as it started
        return
    what = "run directory" if made_by == RUN_COMMANDS else f"{' or '.join(made_by)} run directory"
    raise MtcliError(
        f"--run-dir {run_dir}: not a {what} (it holds {entries[0]}); cannot {doing} it: give a new or empty folder"
    )


def run_command(folder: Path) -> str | None:
    """The command that made the run directory `folder` (its manifest; "train" for an older mtcli's run, which has
    checkpoints/ and config.yaml), or None for a folder that is not a run directory."""
    manifest = read_manifest(folder)
    if manifest is not None:
        return manifest["command"] if manifest["command"] in RUN_COMMANDS else None
    before_manifests = (Path(folder) / "checkpoints").is_dir() and (Path(folder) / "config.yaml").is_file()
    return "train" if before_manifests else None


def mark_run_dir(run_dir: Path, command: str) -> None:
    """A run's manifest names the command that made it; runs grow, so it lists no files. A run already marked keeps
    its mark (a distill run stays one when its student trains)."""
    if read_manifest(run_dir) is None:
        (Path(run_dir) / MANIFEST).write_text(json.dumps({"command": command}, ensure_ascii=False), encoding="utf-8")


class RunLock:
    """An exclusive lock on a run directory while one training process writes it, so a second `mtcli train` on the
    same directory is refused instead of interleaving checkpoints. The kernel releases it when the process ends,
    however it ends, so a killed run never leaves a stale lock; the file names the holder for the error message.
    `mtcli distill` and `mtcli data synthesize` lock their folders the same way, under their own file name."""

    def __init__(self, run_dir: Path, name: str = ".lock", doing: str = "trained", other: str = "--run-dir"):
        self.path = Path(run_dir) / name
        self.file = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise MtcliError(
                f"{run_dir} is being {doing} by {holder} (lock file {self.path}); wait for it to finish, or "
                f"choose another {other}"
            ) from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        self.file.flush()

    def release(self) -> None:
        if not self.file.closed:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()


@dataclass
class OpenRunDir:
    """What rank 0 holds while it trains into a run directory: the lock, and train.log's handler."""

    lock: RunLock | None = None
    log_file: logging.Handler | None = None

    def close(self) -> None:
        remove_log_file(self.log_file)
        if self.lock is not None:
            self.lock.release()


def open_run_dir(run_dir: Path, resume: bool, d: Dist) -> OpenRunDir:
    """Lock the run directory (rank 0), check that it fits the request, and start its train.log."""
    if not d.main:
        logger.setLevel("WARNING")  # one process reports
        return OpenRunDir()
    # a folder of the user's gets no .lock, config.yaml or checkpoints
    check_run_dir(run_dir, "resume" if resume else "train into")
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(run_dir)  # before looking inside: another process may be writing it
    try:
        existing = ckpt.last_checkpoint(run_dir)
        if existing is not None and not resume:
            raise MtcliError(
                f"{run_dir} already holds checkpoints (newest: {existing.name}); continue it with --resume, "
                "or choose another --run-dir"
            )
        if resume and existing is None:
            raise MtcliError(f"--resume: {run_dir} has no checkpoint to resume from")
        ckpt.remove_temporary(run_dir)
        mark_run_dir(run_dir, "train")
    except MtcliError:
        lock.release()
        raise
    return OpenRunDir(lock, add_log_file(run_dir / "train.log"))


def torchrun_restart(run_dir: Path) -> bool:
    """Whether this is a worker group that torchrun restarted (--max-restarts) after a failure: it then continues
    from the run's last checkpoint by itself, since torchrun repeats the original command line."""
    restarts = restart_count()
    if restarts and ckpt.last_checkpoint(run_dir) is not None:
        logger.warning(f"torchrun restart {restarts}: resuming from {ckpt.last_checkpoint(run_dir)}")
        return True
    return False
