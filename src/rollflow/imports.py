"""Resolve user code named by import path in config (``package.module:attribute``)."""

from __future__ import annotations

import importlib
from typing import Any

from rollflow.errors import ConfigError


def import_object(spec: str, *, key: str) -> Any:
    """Import ``package.module:attribute`` (dots after the colon walk attributes).

    Raises:
        ConfigError: naming the config ``key``, when the path is malformed or does not resolve.
    """
    module_name, sep, attribute_path = spec.partition(":")
    if not sep or not module_name or not attribute_path:
        raise ConfigError(f"{key} = {spec!r}: expected an import path 'package.module:attribute'")
    try:
        target: Any = importlib.import_module(module_name)
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
