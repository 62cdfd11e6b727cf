"""Raw parallel text, from wherever it lives.

Sources: a Hub dataset (or a local folder laid out like one) and local JSONL files through Hugging Face `datasets`,
streamed from Arrow's memory map; local plain text (`<split>.<lang>`) and TSV files read line by line as they are
(LineFiles: no Arrow copy the size of the corpus on disk, memory flat in its size); the built-in toy corpus
(generated into the cache folder, then read as local files). Each split comes back as a `SplitSource` that yields
(sources, targets) in batches, never the whole split in Python lists.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtcli.config import DataConfig
from mtcli.errors import MtcliError, error_text
from mtcli.hub import hub_offline, require_hub
from mtcli.line_io import check_utf8
from mtcli.toy import TOY_VERSION, write_toy_corpus

ROLES = ("train", "valid", "test")


@dataclass
class SplitSource:
    """One split of a parallel corpus: `num_rows` pairs that `batches()` and `rows()` yield as two lists of
    strings."""

    role: str
    name: str
    num_rows: int
    description: str
    _dataset: Any  # what `_read` reads: a datasets.Dataset, LineFiles, or the parts of data.train_corpora
    _read: Any  # function(dataset, rows) -> (sources, targets); rows: a range, or a list of ascending row indices
    corpora: tuple[tuple[str, int], ...] = ()  # (name, rows) of each of data.train_corpora, read one after the other

    def batches(self, batch_size: int = 10_000, indices: list[int] | None = None) -> Iterator[tuple[list, list]]:
        if indices is not None:
            for start in range(0, len(indices), batch_size):
                yield self._read(self._dataset, indices[start : start + batch_size])
            return
        for start in range(0, self.num_rows, batch_size):
            yield self._read(self._dataset, range(start, min(start + batch_size, self.num_rows)))

    def rows(self, start: int, stop: int) -> tuple[list, list]:
        """The (sources, targets) of rows start ... stop - 1 (a stop past the end: up to the last row)."""
        return self._read(self._dataset, range(start, min(stop, self.num_rows)))


def describe_source(cfg: DataConfig) -> str:
    if cfg.path:
        return f"{cfg.path} (local files)"
    if cfg.dataset == "toy":
        return "the built-in toy corpus"
    subset = f", subset {cfg.subset}" if cfg.subset else ""
    where = "a local folder laid out like a Hub dataset" if Path(cfg.dataset).is_dir() else "Hugging Face Hub"
    return f"{cfg.dataset} ({where}{subset})"


def split_names(cfg: DataConfig) -> dict[str, str]:
    """Role (train/valid/test) -> split name in the source; roles set to null are left out."""
    splits = cfg.splits
    if not cfg.path and cfg.dataset not in (None, "toy") and cfg.hub_splits is not None:
        splits = cfg.hub_splits
    return {role: getattr(splits, role) for role in ROLES if getattr(splits, role)}


def source_fingerprint(cfg: DataConfig) -> dict[str, Any]:
    """What identifies the raw data, for the cache key: file stats for local files, name and revision on the Hub."""
    if cfg.path:
        folder = Path(cfg.path)
        files = sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
        return {
            "local": str(folder.resolve()),
            "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files],
        }
    if cfg.dataset == "toy":
        return {"toy": TOY_VERSION}
    hub = {"hub": cfg.dataset, "subset": cfg.subset, "revision": cfg.revision}
    if Path(cfg.dataset).is_dir():  # a local folder laid out like a Hub dataset
        folder = Path(cfg.dataset)
        hub["files"] = [
            [str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        ]
    return hub


def open_splits(cfg: DataConfig, cache_dir: Path, notes: list[str] | None = None) -> dict[str, SplitSource]:
    """Every split the config names that exists; a missing train split is an error, others are skipped with a note
    (appended to `notes`). With data.train_corpora, those make the train split (mtcli.mixture, which the caller
    opens): the source of data.path or data.dataset gives only valid and test."""
    names = split_names(cfg)
    if cfg.train_corpora:
        names.pop("train", None)
    if cfg.path:
        found = _open_local(cfg, Path(cfg.path), names)
    elif cfg.dataset == "toy":
        folder = cache_dir / "toy-corpus"
        try:
            write_toy_corpus(folder)
        except OSError as e:
            raise MtcliError(
                f"data.cache_dir {cache_dir}: cannot write the toy corpus there ({e.strerror or error_text(e)}); set "
                "data.cache_dir to a folder you can write to"
            ) from None
        found = _open_local(cfg, folder, names)
    else:
        found = _open_hub(cfg, names)
    if "train" not in found and not cfg.train_corpora:
        raise MtcliError(
            f"no train split `{names.get('train')}` in {describe_source(cfg)}: "
            "set data.splits.train to the name of the training split"
        )
    for role, name in names.items():
        if role not in found and notes is not None:
            notes.append(f"note: no {role} split `{name}` in {describe_source(cfg)}; skipping it")
    return found


# ---------------------------------------------------------------------------------------------------------------------
# Local files


def _open_local(cfg: DataConfig, folder: Path, names: dict[str, str]) -> dict[str, SplitSource]:
    if not folder.is_dir():
        raise MtcliError(
            f"data.path: {folder} is not a folder (expected files like train.{cfg.src_lang} "
            f"and train.{cfg.tgt_lang}, train.tsv or train.jsonl)"
        )
    found = {}
    for role, name in names.items():
        layout = _local_layout(cfg, folder, name)
        if layout is None:
            if role == "train":
                raise MtcliError(
                    f"no train split `{name}` in {folder}: looked for {name}.{cfg.src_lang} + {name}.{cfg.tgt_lang}, "
                    f"{name}.tsv and {name}.jsonl; set data.splits.train to the file name stem"
                )
            continue
        found[role] = layout(role, name)
    return found


def _local_layout(cfg: DataConfig, folder: Path, name: str):
    """A function building the split from whichever file layout is present (or None if none is)."""
    src, tgt = folder / f"{name}.{cfg.src_lang}", folder / f"{name}.{cfg.tgt_lang}"
    tsv, jsonl = folder / f"{name}.tsv", folder / f"{name}.jsonl"
    layouts = {
        "text": (src.is_file() and tgt.is_file(), lambda role, name: _open_text_pair(role, name, src, tgt)),
        "tsv": (tsv.is_file(), lambda role, name: _open_tsv(role, name, tsv)),
        "jsonl": (jsonl.is_file(), lambda role, name: _open_jsonl(cfg, role, name, jsonl)),
    }
    if cfg.format != "auto":
        present, build = layouts[cfg.format]
        return build if present else None
    for present, build in layouts.values():
        if present:
            return build
    return None


_ARROW_CACHE: list[Path] = []  # where local files' Arrow copies go inside `arrow_cache_in` (innermost last)


@contextlib.contextmanager
def arrow_cache_in(folder: Path):
    """Local files opened inside this block leave the Arrow copy the datasets library makes of them (the size of the
    text) in `folder`, which the caller removes when done, instead of in the user's Hugging Face cache for good."""
    _ARROW_CACHE.append(folder)
    try:
        yield
    finally:
        _ARROW_CACHE.remove(folder)


def _load_files(builder: str, path: Path, **kwargs):
    import datasets

    if _ARROW_CACHE:
        kwargs["cache_dir"] = str(_ARROW_CACHE[-1])

    check_text_file(path)
    # Critical only: the json builder logs its parse error ("Failed to load JSON from file ...") before raising, and
    # the one line the user gets is the MtcliError below.
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    with _quiet_progress(), _no_download_count():
        try:
            return datasets.load_dataset(builder, data_files={"data": str(path)}, split="data", **kwargs)
        except Exception as e:  # the library's own error, cut to one line and tied to the file
            if builder == "json":  # its error names no line ("An error occurred while generating the dataset")
                check_jsonl_lines(path)
            raise MtcliError(f"{path}: could not read as {builder}: {error_text(e, 400)}") from None


def check_jsonl_lines(path: Path) -> None:
    """Raise an error naming the first line of a JSON-lines file that is not a JSON object, or whose field holds
    another kind of value than on the first line that has it (a list where the others hold text: the reader infers one
    type per column and fails without naming the line). Blank lines are skipped, as the reader skips them."""
    first: dict[str, tuple[str, int]] = {}  # field -> (its kind, the line it was first seen on)
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                raise MtcliError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})") from None
            except (ValueError, RecursionError) as e:  # a number of over 4,300 digits; thousands of nested brackets
                raise MtcliError(f"{path}:{number}: not valid JSON ({error_text(e)})") from None
            if not isinstance(value, dict):
                raise MtcliError(
                    f"{path}:{number}: expected a JSON object such as "
                    f'{{"translation": {{"en": "...", "de": "..."}}}}, found {_kind(value)}'
                )
            fields = list(value.items())
            fields += [(f"{key}.{k}", x) for key, v in value.items() if isinstance(v, dict) for k, x in v.items()]
            for field, v in fields:
                if v is None:  # null fits any column
                    continue
                kind = "text" if isinstance(v, str) else _kind(v)
                was, line_number = first.setdefault(field, (kind, number))
                if kind != was:
                    raise MtcliError(f"{path}:{number}: `{field}` is {kind}, but {was} on line {line_number}")


def jsonl_line(path: Path, row: int) -> int:
    """The line number of row `row` (from 0) of a JSON-lines file: the reader skips blank lines."""
    rows = -1
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            rows += bool(line.strip())
            if rows == row:
                return number
    return rows + 1


class LineFiles:
    """Line-aligned text files read together, a line at a time. Rows are asked for in increasing order (batches, a
    sorted sample, corpora one after the other); an earlier row starts the files again. Only "\n" ends a line (a
    "\r" before it is dropped, a lone "\r" stays inside its line, as in check_utf8's count and `wc -l`)."""

    def __init__(self, paths: tuple[Path, ...]):
        self.paths = paths
        self.files: list = []
        self.row = 0

    def read(self, rows) -> list[list[str]]:
        columns: list[list[str]] = [[] for _ in self.paths]
        for row in rows:
            if row < self.row or not self.files:
                self.restart()
            while self.row < row:  # rows left out (a sample): skip them
                for f in self.files:
                    f.readline()
                self.row += 1
            for column, f in zip(columns, self.files):
                column.append(f.readline().removesuffix("\n").removesuffix("\r"))
            self.row += 1
        return columns

    def restart(self) -> None:
        for f in self.files:
            f.close()
        self.files = [open(p, encoding="utf-8", newline="\n") for p in self.paths]  # noqa: SIM115
        self.row = 0


def check_text_file(path: Path) -> int:
    """A split's file must hold something and be UTF-8 (check_utf8 names the line); returns its "\n" count."""
    if path.stat().st_size == 0:
        raise MtcliError(
            f"{path}: the file is empty; a split needs at least one sentence (check data.path and data.splits)"
        )
    return check_utf8(path)


def count_lines(path: Path) -> int:
    """The lines of a text file (a last line without "\n" counts), after check_text_file."""
    newlines = check_text_file(path)
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return newlines + (f.read(1) != b"\n")


def _open_text_pair(role: str, name: str, src_path: Path, tgt_path: Path) -> SplitSource:
    src_rows, tgt_rows = count_lines(src_path), count_lines(tgt_path)
    if src_rows != tgt_rows:
        raise MtcliError(
            f"line counts differ: {src_path} has {src_rows} lines, {tgt_path} has {tgt_rows}; "
            "parallel files must be line-aligned"
        )

    def read(files: LineFiles, rows):
        return tuple(files.read(rows))

    pair = LineFiles((src_path, tgt_path))
    return SplitSource(role, name, src_rows, f"{src_path.name} + {tgt_path.name}", pair, read)


def _open_tsv(role: str, name: str, path: Path) -> SplitSource:
    # Split on the tab here: a CSV parser would unquote, drop blank lines and turn "NA" into NaN.
    rows = count_lines(path)

    def read(files: LineFiles, rows):
        sources, targets = [], []
        rows = list(rows)
        for row, line in zip(rows, files.read(rows)[0]):
            fields = line.split("\t")
            if len(fields) != 2:
                raise MtcliError(
                    f"{path}:{row + 1}: expected `source<TAB>target` (exactly one tab), found {len(fields) - 1} tabs"
                )
            sources.append(fields[0])
            targets.append(fields[1])
        return sources, targets

    return SplitSource(role, name, rows, path.name, LineFiles((path,)), read)


def _open_jsonl(cfg: DataConfig, role: str, name: str, path: Path) -> SplitSource:
    ds = _load_files("json", path)
    return _columns_source(cfg, role, name, ds, str(path), lambda row: f"{path}:{jsonl_line(path, row)}")


# ---------------------------------------------------------------------------------------------------------------------
# The Hub (or a local folder laid out like a Hub dataset)


def _open_hub(cfg: DataConfig, names: dict[str, str]) -> dict[str, SplitSource]:
    import datasets

    name = cfg.dataset
    local_folder = Path(name).is_dir()
    if not local_folder and not hub_offline():
        require_hub(
            f"`{name}`",
            "Use local files instead: --set data.path=FOLDER (with train.<src_lang>/train.<tgt_lang>, train.tsv "
            "or train.jsonl), or set HF_HUB_OFFLINE=1 to use a copy already in the datasets cache",
        )
    datasets.utils.logging.set_verbosity_error()
    try:
        with _quiet_progress() if local_folder else contextlib.nullcontext():
            dd = datasets.load_dataset(name, cfg.subset, revision=cfg.revision)
    except Exception as e:  # network, missing dataset or subset, bad layout: one line that says which
        raise MtcliError(
            f"could not load dataset `{name}`{f' subset `{cfg.subset}`' if cfg.subset else ''}: "
            f"{error_text(e, 400)}. To use local files instead: --set data.path=FOLDER"
        ) from None
    found = {}
    for role, split in names.items():
        if split not in dd:
            if role == "train":
                raise MtcliError(
                    f"no train split `{split}` in `{name}` (it has: {', '.join(dd)}); "
                    "set data.hub_splits.train (or data.splits.train)"
                )
            continue
        found[role] = _columns_source(
            cfg, role, split, dd[split], name, lambda row, split=split: f"`{name}` split `{split}` row {row + 1}"
        )
    return found


# ---------------------------------------------------------------------------------------------------------------------
# Shared helpers


def _columns_source(cfg: DataConfig, role: str, name: str, ds, where: str, locate) -> SplitSource:
    """Pairs from a table: a `translation: {lang: text}` column, or two flat columns. `locate(row)` names a row in
    errors (a JSON-lines file's line)."""
    columns = ds.column_names
    if cfg.src_column or cfg.tgt_column:
        src_col, tgt_col = cfg.src_column or cfg.src_lang, cfg.tgt_column or cfg.tgt_lang
    elif "translation" in columns:
        # The languages from the column's type (a `Translation` feature, or a struct read from JSON), else a row.
        feature = ds.features["translation"]
        languages = getattr(feature, "languages", None) or (list(feature) if isinstance(feature, dict) else None)
        if languages is None:
            languages = list((ds[0]["translation"] or {}) if ds.num_rows else {})
        missing = [lang for lang in (cfg.src_lang, cfg.tgt_lang) if lang not in languages]
        if missing:
            raise MtcliError(
                f"{where} split `{name}`: its `translation` column has languages "
                f"{', '.join(languages) or 'none'}, not {', '.join(missing)}; set data.src_lang/tgt_lang"
            )

        def read_nested(ds, rows):
            pairs = [p or {} for p in ds[_rows(rows)]["translation"]]  # a JSON null row: an empty pair
            for row, pair in zip(rows, pairs):
                if not isinstance(pair, dict):
                    raise MtcliError(
                        f"{locate(row)}: `translation` is {_kind(pair)}, not an object of languages to texts"
                    )
            sources, targets = [p.get(cfg.src_lang) for p in pairs], [p.get(cfg.tgt_lang) for p in pairs]
            _check_texts(rows, sources, f"translation.{cfg.src_lang}", locate)
            _check_texts(rows, targets, f"translation.{cfg.tgt_lang}", locate)
            return sources, targets

        return SplitSource(role, name, ds.num_rows, f"{where} [{name}]", ds, read_nested)
    else:
        src_col, tgt_col = cfg.src_lang, cfg.tgt_lang
    for key, col in (("data.src_column", src_col), ("data.tgt_column", tgt_col)):
        if col not in columns:
            raise MtcliError(f"{where} split `{name}` has no column `{col}` (columns: {', '.join(columns)}); set {key}")

    def read_flat(ds, rows):
        table = ds[_rows(rows)]
        _check_texts(rows, table[src_col], src_col, locate)
        _check_texts(rows, table[tgt_col], tgt_col, locate)
        return table[src_col], table[tgt_col]

    return SplitSource(role, name, ds.num_rows, f"{where} [{name}]", ds, read_flat)


def _check_texts(rows, values: list, field: str, locate) -> None:
    """Each value a sentence: text, a number (read as its text) or null (an empty side). A list or an object would
    otherwise become its Python repr and be trained on."""
    for row, value in zip(rows, values):
        if value is not None and (isinstance(value, bool) or not isinstance(value, str | int | float)):
            raise MtcliError(f"{locate(row)}: `{field}` is {_kind(value)}, not a sentence")


def _kind(value) -> str:
    """What a JSON value is, in words."""
    kinds = {
        dict: "an object",
        list: "a list",
        bool: "true or false",
        str: "a string",
        int: "a number",
        float: "a number",
    }
    return kinds.get(type(value), type(value).__name__)


def _rows(rows):
    """datasets indexes fast by slice; use one when the rows are contiguous."""
    if isinstance(rows, range) and rows.step == 1:
        return slice(rows.start, rows.stop)
    return list(rows)


@contextlib.contextmanager
def _quiet_progress():
    import datasets

    was_enabled = datasets.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


@contextlib.contextmanager
def _no_download_count():
    """Local files need no network, but `load_dataset("text", ...)` first sends the Hub a HEAD request to count the
    download: on a machine without network that waits for a DNS or connect timeout (seconds) on every file."""
    import datasets

    was = datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = was


def fingerprint_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]
