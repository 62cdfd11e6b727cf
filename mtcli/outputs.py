"""Where commands write, and the one rule they all follow: nothing of the user's is deleted or overwritten.

A command that makes a folder (`export`, `import`, `average`) fills a temporary sibling and renames it into place
only when it is complete, so a failure leaves the filesystem as it found it. The finished folder holds a manifest,
`.mtcli-output.json`, naming the command and the files it wrote. An existing target is taken only when it is
empty, or when it is this command's own earlier output and `--force` is given; even then a file the manifest does
not list (something the user put there) makes it refuse. Anything else non-empty is refused before any work, with
one line naming what is there. An output that is also an input (the same path, inside it, or holding it) is refused
before anything is opened.

Files (`translate --output`, `eval --sentence-scores`, `attention --out`) carry no manifest: an existing non-empty
file is replaced only with `--force`, through a temporary sibling renamed over it when the command has succeeded.

A temporary sibling is named `.<target>.tmp-<pid>` (a work folder `.<target>.work-<pid>`, an earlier output moved
aside `.<target>.old-<pid>`): a command killed before it cleaned up (SIGKILL, a crash) leaves one, and the next command
writing to that target removes it once its process is gone (`remove_stale`: `data prepare` and checkpoints follow the
same rule). A full disk while writing is one line naming the target, which is left as it was.

What a run directory is, and who may write one, is in rundir.py.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from mtcli.errors import MtcliError
from mtcli.log import logger

MANIFEST = ".mtcli-output.json"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left on the device; the user's disk quota is used up


def _resolved(path: Path) -> Path:
    return Path(os.path.abspath(Path(path).expanduser()))


def _overlaps(a: Path, b: Path) -> bool:
    """The same path, or one inside the other (through symlinks too)."""
    ra, rb = Path(a).resolve(), Path(b).resolve()
    return ra == rb or ra in rb.parents or rb in ra.parents


def refuse_input_overlap(target: Path, inputs: Iterable[Path | str], option: str) -> None:
    """`option TARGET` may not be an input, lie inside one, or hold one."""
    for source in inputs:
        if source is not None and Path(source).exists() and _overlaps(target, Path(source)):
            raise MtcliError(f"{option} {target}: it is also an input ({source}); write to a new folder or file")


def read_manifest(folder: Path) -> dict | None:
    """The manifest of a folder an mtcli command wrote, or None (absent or not ours)."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("command"), str) else None


def files_under(folder: Path) -> list[str]:
    """Every file and link below `folder`, as sorted relative paths (empty folders are not content)."""
    found = []
    for root, dirs, files in os.walk(folder):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            found.append(os.path.relpath(os.path.join(root, name), folder))
    return sorted(found)


def check_folder_target(target: Path, command: str, force: bool, option: str = "--out") -> None:
    """Refuse a target folder this command may not fill (see the module's rule). Nothing is written."""
    target = Path(target)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise MtcliError(f"{option} {target}: exists and is not a folder; give a new or empty folder")
    if not target.exists() or not any(target.iterdir()):
        return
    manifest = read_manifest(target)
    if manifest is None or manifest["command"] != command:
        first = sorted(p.name for p in target.iterdir())[0]
        whose = f"`mtcli {manifest['command']}`" if manifest else "you or another program"
        raise MtcliError(
            f"{option} {target}: the folder is not empty (it holds {first}, written by {whose}); "
            "give a new or empty folder"
        )
    if not force:
        raise MtcliError(
            f"{option} {target}: holds an earlier `mtcli {command}` output; pass --force to replace it, or give a "
            "new folder"
        )
    listed = set(manifest.get("files", [])) | {MANIFEST}
    foreign = [f for f in files_under(target) if f not in listed]
    if foreign:
        raise MtcliError(
            f"{option} {target}: holds {foreign[0]}, which `mtcli {command}` did not write; --force replaces only "
            "its own files: move it away first"
        )


@contextmanager
def new_folder(target: Path, command: str, force: bool = False, option: str = "--out") -> Iterator[Path]:
    """Yield an empty temporary sibling of `target` to fill; when the block ends without an error, the folder gets
    its manifest and takes `target`'s place (an earlier output of this command, with `force`, is replaced). On an
    error the temporary folder is removed and `target` is untouched. Checks `target` first."""
    target = _resolved(target)
    check_folder_target(target, command, force, option)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    made = [p for p in reversed(target.parents) if not p.exists()]  # parents this command creates, outermost first
    done = False
    try:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_siblings(target)
            shutil.rmtree(tmp, ignore_errors=True)  # this process's own leftover only (the pid is in the name)
            tmp.mkdir()
        except OSError as e:
            raise MtcliError(f"{option} {target}: cannot write there ({e.strerror})") from None
        with _disk_full_names(target, option):
            yield tmp
            files = [f for f in files_under(tmp) if f != MANIFEST]
            manifest = json.dumps({"command": command, "files": files}, indent=1, ensure_ascii=False)
            (tmp / MANIFEST).write_text(manifest, encoding="utf-8")
            _usual_permissions(tmp, files, (tmp / MANIFEST).stat().st_mode & 0o777)
            _durable(tmp)
        check_folder_target(target, command, force, option)  # again: something may have appeared meanwhile
        _replace_folder(tmp, target)
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in [] if done else reversed(made):  # a failure leaves no empty folders behind either
            with contextlib.suppress(OSError):
                parent.rmdir()


def _usual_permissions(folder: Path, files: list[str], mode: int) -> None:
    """Give the files a library wrote owner-only (Transformers' model.safetensors, through mkstemp: 0600) `mode`,
    the one a new file gets under the user's umask, so the output can be shared like everything else they write."""
    for name in files:
        path = folder / name
        if path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 != mode:
            path.chmod(mode)


@contextmanager
def _disk_full_names(target: Path, option: str) -> Iterator[None]:
    """A full disk (or quota) while the block writes `target`'s temporary sibling: one line naming the target."""
    try:
        yield
    except OSError as e:
        if e.errno not in DISK_FULL:
            raise
        reason = os.strerror(e.errno).lower()
        raise MtcliError(
            f"{option} {target}: {reason} while writing it; nothing was written there (an existing one is as it was): "
            "free some space and run the command again"
        ) from None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_siblings(target: Path) -> None:
    """Remove the temporary siblings of `target` whose process is gone (see remove_stale)."""
    remove_stale(target.parent, re.escape(target.name))


def remove_stale(folder: Path, names: str = ".+") -> None:
    """Remove what killed mtcli commands left in `folder`: the temporary entries `.<name>.tmp-<pid>` (being written),
    `.<name>.work-<pid>` (a work folder) and `.<name>.old-<pid>` (an earlier output moved aside while its replacement
    moved in), files or folders, whose `name` matches the regular expression `names` and whose process is gone. One
    whose process still runs (a command writing there now) is kept."""
    stale = re.compile(rf"\.(?:{names})\.(?:tmp|work|old)-(?P<pid>\d+)")
    for path in folder.iterdir():
        match = stale.fullmatch(path.name)
        if match is None or pid_alive(int(match["pid"])) or path.is_symlink():
            continue
        logger.info(f"removing {path}, left by an mtcli command that was stopped (process {match['pid']} is gone)")
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


@contextmanager
def _replaced_when_done(path: Path, binary: bool = True) -> Iterator[TextIO]:
    """An open temporary sibling of `path`, made durable and renamed onto `path` when the block ends without an
    error, removed otherwise: a reader, or a kill at any moment, finds the old file or the new one, never part of
    one. Opening raises OSError."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    handle = open(tmp, "wb" if binary else "w", encoding=None if binary else "utf-8")
    try:
        with handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_file_atomic(path: Path, data: str | bytes) -> None:
    """`data` written whole onto `path`, or not at all (see _replaced_when_done)."""
    remove_stale_siblings(Path(path))  # what a write killed earlier left
    with _replaced_when_done(Path(path)) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def publish_folder(tmp: Path, target: Path) -> None:
    """Make the filled folder `tmp` durable and rename it to `target` (see _replace_folder)."""
    _durable(tmp)
    _replace_folder(tmp, target)


def _durable(folder: Path) -> None:
    """fsync every file below `folder` and the folders themselves, so the rename publishes complete bytes."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_folder(tmp: Path, target: Path) -> None:
    """Rename `tmp` to `target`. A missing target is one rename. An empty folder keeps its inode (it may be a shell's
    working directory): the entries move in, the manifest last. A checked earlier output is first moved aside, then
    removed once the new folder is in place."""
    if not target.exists():
        os.rename(tmp, target)
    elif not any(target.iterdir()):
        for entry in sorted(tmp.iterdir(), key=lambda p: p.name == MANIFEST):
            os.rename(entry, target / entry.name)
        _fsync_dir(target)
    else:
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        os.rename(target, old)
        os.rename(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(target.parent)


def check_file_target(target: Path, force: bool, inputs: Iterable[Path | str] = (), option: str = "--output") -> None:
    """Refuse an output file that is also an input, a folder, or (without `force`) an existing non-empty file."""
    target = Path(target)
    refuse_input_overlap(target, inputs, option)
    if target.is_dir():
        raise MtcliError(f"{option} {target}: is a folder; give a file name")
    if not target.parent.is_dir():
        raise MtcliError(f"{option} {target}: the folder {target.parent} does not exist")
    if target.exists() and target.stat().st_size > 0 and not force:
        raise MtcliError(f"{option} {target}: exists and is not empty; pass --force to replace it, or give a new name")


@contextmanager
def new_file(
    target: Path, force: bool = False, inputs: Iterable[Path | str] = (), option: str = "--output", binary=False
) -> Iterator[TextIO]:
    """An open temporary sibling of `target`; when the block ends without an error it is made durable and renamed
    onto `target`. On an error `target` is untouched (an existing file keeps its bytes). Checks `target` first."""
    target = _resolved(target)
    check_file_target(target, force, inputs, option)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_disk_full_names(target, option))  # outermost: the final flush and fsync count too
        try:
            remove_stale_siblings(target)
            handle = stack.enter_context(_replaced_when_done(target, binary))
        except OSError as e:
            raise MtcliError(f"{option} {target}: cannot write ({e.strerror})") from None
        yield handle
