"""From YAML to a `Config`: `load_config(path, overrides)` reads a file (or a shipped config by name), applies
`--set key=value` overrides, rejects unknown keys (naming the closest valid one) and values of the wrong type (naming
the key); each section's own checks (config.py) reject impossible values.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from mtcli.config import SHIPPED_CONFIGS, Config, ConfigError


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


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (a path, or the name of a shipped config) and apply `key=value` overrides."""
    path = resolve_config_path(path)
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping with sections data, model, train, decode")
    tree.setdefault("name", path.stem)
    _apply_overrides(tree, overrides)
    config = config_from_dict(tree, source=str(path))
    try:
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
            raise ConfigError(f"--set {item}: this command takes only {allowed}")
    tree = config.to_dict()
    _apply_overrides(tree, overrides)
    return config_from_dict(tree, source="--set")


def _apply_overrides(tree: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> None:
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item}: expected KEY=VALUE, e.g. --set train.lr=5e-4")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
        set_dotted(tree, key.strip(), value)


def config_from_dict(tree: dict[str, Any], source: str = "<dict>") -> Config:
    return _build(Config, tree, prefix="", source=source)


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
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean `{prefix}{close[0]}`?" if close else f"; valid keys: {', '.join(fields)}"
            raise ConfigError(f"unknown key `{prefix}{key}` in {source}{hint}")
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
        if value not in args:
            choices = ", ".join(str(a) for a in args)
            raise ConfigError(f"{key}: `{value}` is not one of: {choices} (in {source})")
        return value
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # a list of any length, e.g. data.train_corpora
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got `{value}` (in {source})")
        return tuple(_coerce(args[0], v, f"{key}[{i}]", source) for i, v in enumerate(value))
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got `{value}` (in {source})")
        return tuple(_coerce(a, v, f"{key}[{i}]", source) for i, (a, v) in enumerate(zip(args, value)))
    if hint is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got `{value}` (in {source})")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got `{value}` (in {source})")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got `{value}` (in {source})")
    if hint is str:
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got `{value}` (in {source})")
    raise TypeError(f"unsupported config type {hint} for {key}")
