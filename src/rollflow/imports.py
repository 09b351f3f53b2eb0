"""Resolve user code named in config: ``package.module:attribute`` or ``path/to/file.py:attribute``."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from rollflow.errors import ConfigError


def import_object(spec: str, *, key: str) -> Any:
    """Import ``package.module:attribute`` (dots after the colon walk attributes). The module may also be a
    Python file, ``path/to/file.py:attribute`` (relative to the working directory), so examples and scripts
    need not be installed packages; each file is loaded once per process.

    Raises:
        ConfigError: naming the config ``key``, when the path is malformed or does not resolve.
    """
    module_name, sep, attribute_path = spec.rpartition(":")
    if not sep or not module_name or not attribute_path:
        raise ConfigError(f"{key} = {spec!r}: expected an import path 'package.module:attribute'")
    try:
        target: Any = _load_file(module_name) if module_name.endswith(".py") else None
        if target is None:
            target = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"{key} = {spec!r}: cannot import module {module_name!r}: {error}") from None
    for attribute in attribute_path.split("."):
        try:
            target = getattr(target, attribute)
        except AttributeError:
            raise ConfigError(
                f"{key} = {spec!r}: module {module_name!r} has no attribute {attribute_path!r}"
            ) from None
    if not callable(target):
        raise ConfigError(f"{key} = {spec!r}: {attribute_path!r} is not callable")
    return target


def _load_file(path_text: str) -> ModuleType:
    path = Path(path_text).resolve()
    if not path.is_file():
        raise ImportError(f"no such file: {path}")
    # A name unique per file, registered in sys.modules, so the file runs once and pickling/msgspec work.
    digest = hashlib.blake2b(str(path).encode(), digest_size=6).hexdigest()
    name = f"_rollflow_user_{path.stem.replace('-', '_')}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as error:
        del sys.modules[name]
        if isinstance(error, Exception) and not isinstance(error, ImportError):
            raise ImportError(f"{type(error).__name__}: {error}") from error
        raise
    return module
