"""From YAML to a `Config`: `load_config(path, overrides)` reads a file (or a shipped config by name), applies
`--set key=value` overrides, rejects unknown keys (naming the closest valid one) and values of the wrong type (naming
the key); each section's own checks (config.py) reject impossible values. Messages show values cut to 100 characters,
and YAML aliases may not expand a document by more than MAX_ALIAS_EXPANSION (a "billion laughs" file).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from mtcli.config import SHIPPED_CONFIGS, Config, ConfigError, shown
from mtcli.errors import error_text

# Values that YAML aliases (`*name`) may add to a document, counted as nodes plus characters of text: a config of ~100
# values needs a few hundred, while nine levels of nine aliases in 600 bytes expand to 400 million values, which
# formatting the type error alone took 10 GB for.
MAX_ALIAS_EXPANSION = 100_000
MAX_BRACKET_DEPTH = 100


class UnsafeYAML(yaml.YAMLError):
    """YAML that is well-formed but refused: aliases that blow it up or refer to themselves, nesting too deep."""


class BoundedLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, refusing a document that refers to itself or whose aliases expand it by more than
    MAX_ALIAS_EXPANSION; checked on the composed nodes, before anything is built from them."""

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            check_alias_expansion(node)
        return node


def check_alias_expansion(root: yaml.Node) -> None:
    """Refuse a node graph that has a cycle or whose expanded size (aliases copied out) exceeds its own size by more
    than MAX_ALIAS_EXPANSION. Iterative: a deep document must not exhaust Python's stack here."""
    expanded: dict[int, int] = {}  # id(node) -> size with every alias expanded
    own = 0  # the size with each node counted once: what the text itself holds
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        children = _children(node)
        if children_done:
            open_nodes.discard(id(node))
            size = 1 + (len(node.value) if isinstance(node, yaml.ScalarNode) else 0)
            own += size
            expanded[id(node)] = size + sum(expanded[id(c)] for c in children)
            if expanded[id(node)] - own > MAX_ALIAS_EXPANSION:
                raise UnsafeYAML(
                    f"its aliases (*name) expand it by more than {MAX_ALIAS_EXPANSION:,} values and characters; "
                    "a config needs far fewer: write the values out"
                )
            continue
        if id(node) in open_nodes:
            raise UnsafeYAML(f"an alias refers to a value that contains it{_where(node)}")
        if id(node) in expanded:
            continue
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in expanded)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _where(node: yaml.Node) -> str:
    mark = node.start_mark
    return f" (line {mark.line + 1})" if mark is not None else ""


def parse_yaml(text: str):
    """YAML text to Python values, through BoundedLoader; ValueError (an integer of over 4,300 digits) comes out as
    yaml.YAMLError and RecursionError (a thousand nested levels) as UnsafeYAML, with what went wrong."""
    # PyYAML's time grows with the square of the bracket depth (1,500 levels: 5 s, 100 KB of them: hours), so a
    # depth no config needs (they nest 3 deep) is refused before parsing; brackets inside strings count too.
    depth = deepest = 0
    for bracket in re.sub(r"[^\[\]{}]", "", text):
        depth = depth + 1 if bracket in "[{" else max(depth - 1, 0)
        deepest = max(deepest, depth)
    if deepest > MAX_BRACKET_DEPTH:
        raise UnsafeYAML(f"brackets nested {deepest:,} deep; a config needs a few")
    try:
        return yaml.load(text, Loader=BoundedLoader)  # a SafeLoader: builds plain values only
    except ValueError as e:
        raise yaml.YAMLError(error_text(e)) from None
    except RecursionError:
        raise UnsafeYAML("nested too deeply") from None


def shipped_config_names() -> list[str]:
    return sorted(p.name for p in SHIPPED_CONFIGS.glob("*.yaml"))


def resolve_config_path(name: str | Path) -> Path:
    """A path as given, else the same name among the configs shipped with the package."""
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (SHIPPED_CONFIGS / path.name, SHIPPED_CONFIGS / f"{path.name}.yaml"):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"config file not found: {name} (shipped configs: {', '.join(shipped_config_names())})")


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = (), need_source: bool = True) -> Config:
    """Read a YAML config (a path, or the name of a shipped config) and apply `key=value` overrides. need_source:
    it must name its data (an imported model's run names none)."""
    path = resolve_config_path(path)
    try:
        tree = parse_yaml(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid YAML: {shown(' '.join(str(e).split()), 300)}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping with sections data, model, train, decode (and distill)")
    tree.setdefault("name", path.stem)
    config = config_from_dict(copy.deepcopy(tree), source=str(path))  # the file alone: its own mistakes name it
    if overrides:  # the file is valid, so what fails now is an override's doing: name --set, not the file
        _apply_overrides(tree, overrides)
        config = config_from_dict(tree, source="--set")
    try:
        if need_source:
            config.data.check_source()
    except ConfigError as e:
        raise ConfigError(f"{e} (in {path})") from None
    return config


def with_overrides(config: Config, overrides: list[str] | tuple[str, ...], sections: tuple[str, ...]) -> Config:
    """`config` with `--set KEY=VALUE` overrides applied, each allowed only in `sections` (e.g. ("decode",) for a
    trained model, whose architecture and data are fixed)."""
    for item in overrides:
        if item.partition("=")[0].strip().split(".")[0] not in sections:
            allowed = " or ".join(f"{s}.KEY=VALUE" for s in sections)
            raise ConfigError(f"--set {shown(item)}: this command takes only {allowed}")
    tree = config.to_dict()
    _apply_overrides(tree, overrides)
    return config_from_dict(tree, source="--set")


def _apply_overrides(tree: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> None:
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {shown(item)}: expected KEY=VALUE, e.g. --set train.lr=5e-4")
        try:
            value = parse_yaml(text) if text.strip() else None
        except UnsafeYAML as e:
            raise ConfigError(f"--set {shown(item)}: {e}") from None
        except yaml.YAMLError:
            value = text  # not YAML (e.g. >>deu<<): the text itself, which a string key takes and others refuse
        set_dotted(tree, key.strip(), value)


def config_from_dict(tree: dict[str, Any], source: str = "<dict>") -> Config:
    return _build(Config, tree, prefix="", source=source)


def replaced(config: Config, **changes: Any) -> Config:
    """A copy with whole sections or dotted keys replaced and checked: replaced(cfg, **{"train.seed": 3})."""
    tree = config.to_dict()
    for key, value in changes.items():
        set_dotted(tree, key, value)
    return config_from_dict(tree, source="<replace>")


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = tree
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[last] = value


def _build(cls: type, values: Any, prefix: str, source: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys in {source}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            close = difflib.get_close_matches(shown(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean `{prefix}{close[0]}`?" if close else f"; valid keys: {', '.join(fields)}"
            raise ConfigError(f"unknown key `{prefix}{shown(key)}` in {source}{hint}")
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}", source)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{e} (in {source})") from None


def _coerce(hint: Any, value: Any, key: str, source: str) -> Any:
    """Check `value` against a type hint; YAML gives `5e-4` as a string, so floats are parsed here."""
    if dataclasses.is_dataclass(hint):
        return _build(hint, value if value is not None else {}, f"{key}.", source)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(option, value, key, source)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is Literal:
        if value is False and "off" in args:  # YAML 1.1 reads a bare `off` as false
            value = "off"
        if value not in args:
            choices = ", ".join(str(a) for a in args)
            raise ConfigError(f"{key}: `{shown(value)}` is not one of: {choices} (in {source})")
        return value
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # a list of any length, e.g. data.train_corpora
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got `{shown(value)}` (in {source})")
        return tuple(_coerce(args[0], v, f"{key}[{i}]", source) for i, v in enumerate(value))
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got `{shown(value)}` (in {source})")
        return tuple(_coerce(a, v, f"{key}[{i}]", source) for i, (a, v) in enumerate(zip(args, value)))
    if hint is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got `{shown(value)}` (in {source})")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: {value} is not allowed; give a finite integer (in {source})")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got `{shown(value)}` (in {source})")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got `{shown(value)}` (in {source})")
    if hint is str:
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got `{shown(value)}` (in {source})")
    raise TypeError(f"unsupported config type {hint} for {key}")
