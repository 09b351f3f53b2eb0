"""Loading a config: TOML (or a saved JSON) files merged left to right, ``--set`` overrides, relative paths
resolved against the file that names them, then validation."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from rollflow.config.mode_override import apply_mode_override
from rollflow.config.run import RunConfig, cross_field_errors
from rollflow.errors import ConfigError

_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(?P<field>[^`]+)`(?: - at `\$(?P<path>[^`]*)`)?")
_AT_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")


def _key_path(path: str) -> str:
    """``.trainer.betas[0]`` → ``trainer.betas[0]``."""
    return path.lstrip(".")


def _translate(error: msgspec.ValidationError, source: str) -> ConfigError:
    message = str(error)
    if match := _UNKNOWN_FIELD.match(message):
        parent = _key_path(match["path"] or "")
        key = f"{parent}.{match['field']}" if parent else match["field"]
        return ConfigError(f"{source}: unknown config key '{key}' (check its spelling and section)")
    if match := _AT_PATH.search(message):
        key = _key_path(match["path"])
        reason = message[: match.start()]
        return ConfigError(f"{source}: invalid value for '{key}': {reason}")
    return ConfigError(f"{source}: {message}")


def deep_merge(base: dict[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """Merge ``overlay`` into a copy of ``base``; tables merge key by key, everything else is replaced."""
    merged = dict(base)
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_override(override: str) -> dict[str, Any]:
    """``trainer.lr=3e-4`` → ``{"trainer": {"lr": 3e-4}}``. Values are TOML (``true``, ``[1, 2]``,
    ``"text"``); anything that is not valid TOML is taken as a string."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key or not all(part.isidentifier() for part in key.split(".")):
        raise ConfigError(f"--set {override!r}: expected KEY=VALUE with a dotted key, e.g. trainer.lr=3e-4")
    try:
        value = tomllib.loads(f"value = {raw.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    nested: dict[str, Any] = {}
    cursor = nested
    *parents, leaf = key.split(".")
    for part in parents:
        cursor = cursor.setdefault(part, {})
    cursor[leaf] = value
    return nested


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read one TOML file; a missing file or a syntax error is a ConfigError naming the file."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None


def read_toml_or_json(path: str | Path) -> dict[str, Any]:
    """Read a config file by its suffix: ``.json`` (a saved resolved config) or TOML."""
    path = Path(path)
    if path.suffix != ".json":
        return read_toml(path)
    try:
        data = msgspec.json.decode(path.read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except msgspec.DecodeError as error:
        raise ConfigError(f"{path}: invalid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level")
    return data


def build_config(data: Mapping[str, Any], source: str = "config") -> RunConfig:
    """Validate a merged config dict into a RunConfig; ``ROLLFLOW_INFERENCE_MODE``, when set, overrides
    ``inference.mode``.

    Raises:
        ConfigError: an unknown key, a wrong type or value, a broken cross-field rule, or a bad
            ``ROLLFLOW_INFERENCE_MODE``.
    """
    data = apply_mode_override(dict(data))
    try:
        config = msgspec.convert(data, RunConfig)
    except msgspec.ValidationError as error:
        raise _translate(error, source) from None
    if errors := cross_field_errors(config):
        raise ConfigError(f"{source}: " + "; ".join(errors))
    return config


#: Config keys whose values name a file or directory. ``load_config`` resolves them relative to the file
#: that sets them.
FILE_PATH_KEYS: tuple[tuple[str, ...], ...] = (
    ("data", "path"),
    ("eval", "path"),
    ("env", "id"),
    ("env", "server_dir"),
)
#: Config keys whose values may be code specs ``path/to/file.py:attribute`` (``[]``: each entry of a list);
#: ``load_config`` resolves the file part likewise. Built-in names and module paths are left alone.
CODE_SPEC_KEYS: tuple[tuple[str, ...], ...] = (
    ("data", "task"),
    ("data", "reward"),
    ("data", "rewards", "[]", "fn"),
    ("agent", "callable"),
    ("agent", "composer"),
    ("agent", "side_calls", "predicate"),
)


def resolve_file_paths(data: Mapping[str, Any], base_dir: Path) -> dict[str, Any]:
    """``data`` (one config file's contents) with each relative path of ``FILE_PATH_KEYS``, and the file part
    of each code spec ``file.py:attribute`` of ``CODE_SPEC_KEYS``, made absolute where it exists under
    ``base_dir``. Anything else (built-in names, module paths, names of cached datasets, paths that do not
    exist there) is kept as written."""

    def resolve(value: Any, keys: tuple[str, ...], spec: bool) -> Any:
        if keys:
            key, rest = keys[0], keys[1:]
            if key == "[]":
                return [resolve(item, rest, spec) for item in value] if isinstance(value, list) else value
            if isinstance(value, Mapping) and key in value:
                return {**value, key: resolve(value[key], rest, spec)}
            return value
        if not isinstance(value, str):
            return value
        if not spec:
            return _under(value, base_dir)
        module, sep, attribute = value.rpartition(":")
        return f"{_under(module, base_dir)}:{attribute}" if sep and module.endswith(".py") else value

    resolved = dict(data)
    for keys in FILE_PATH_KEYS:
        resolved = resolve(resolved, keys, spec=False)
    for keys in CODE_SPEC_KEYS:
        resolved = resolve(resolved, keys, spec=True)
    return resolved


def _under(text: str, base_dir: Path) -> str:
    """``base_dir / text`` as an absolute path when ``text`` is relative and exists there, else ``text``."""
    path = Path(text).expanduser()
    if path.is_absolute() or not text:
        return text
    candidate = base_dir / path
    return os.path.abspath(candidate) if candidate.exists() else text


def load_config(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] = (),
    overrides: str | Iterable[str] = (),
    base: Mapping[str, Any] | None = None,
) -> RunConfig:
    """Load and validate the run config from TOML files (one path, or several merged left to right) and
    ``KEY=VALUE`` overrides.

    ``base`` (e.g. a resumed run's saved config) sits below the files. Relative file paths a file names
    (``FILE_PATH_KEYS``) are taken relative to that file's directory where they exist there, so a config
    works from any working directory; otherwise they stay relative to the working directory.

    Raises:
        ConfigError: a missing or malformed file, an unknown key, a bad value or a broken cross-field rule.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    if isinstance(overrides, str):
        overrides = [overrides]
    merged: dict[str, Any] = dict(base or {})
    for path in paths:
        data = read_toml_or_json(path)
        merged = deep_merge(merged, resolve_file_paths(data, Path(path).parent))
    overrides = list(overrides)
    for override in overrides:
        merged = deep_merge(merged, parse_override(override))
    sources = [str(path) for path in paths] + [f"--set {o}" for o in overrides]
    return build_config(merged, source=", ".join(sources) or "defaults")


def to_dict(config: RunConfig) -> dict[str, Any]:
    """The resolved config as plain JSON-able data (every field, defaults included)."""
    return msgspec.to_builtins(config)


def to_json(config: RunConfig) -> bytes:
    return msgspec.json.format(msgspec.json.encode(config), indent=2)
