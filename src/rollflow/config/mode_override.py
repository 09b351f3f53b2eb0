"""The test suite's one hook in library code: ``$ROLLFLOW_INFERENCE_MODE`` overrides ``inference.mode``.

CI runs the suite twice, the second time with ``ROLLFLOW_INFERENCE_MODE=http`` (``nox -s tests_http``), so
that every run a test starts goes over real HTTP servers. Most of those runs are ``rollflow run`` /
``rollflow generate`` subprocesses started by tests that inherit the environment and know nothing of the
mode; no pytest fixture reaches into them, so the override has to be read where every config is built
(``build_config``). This module is that one place; the suite's own handling of the variable (checking it,
choosing the shared inference client) is in ``tests/conftest.py`` and ``tests/helpers/clients.py``.
Outside the suite, leave the variable unset: a config's ``inference.mode`` is then what it says.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import structlog

from rollflow.errors import ConfigError

log = structlog.get_logger(__name__)

INFERENCE_MODE_ENV = "ROLLFLOW_INFERENCE_MODE"


def apply_mode_override(data: dict[str, Any]) -> dict[str, Any]:
    """``ROLLFLOW_INFERENCE_MODE`` overrides ``inference.mode`` (so one test suite runs in either mode)."""
    mode = os.environ.get(INFERENCE_MODE_ENV)
    if not mode:
        return data
    if mode not in ("local", "http"):
        raise ConfigError(f"environment variable {INFERENCE_MODE_ENV}={mode!r} must be 'local' or 'http'")
    inference = data.get("inference")
    inference = dict(inference) if isinstance(inference, Mapping) else {}
    configured = inference.get("mode")
    if configured is not None and configured != mode:
        log.warning(
            f"{INFERENCE_MODE_ENV}={mode} overrides inference.mode = {configured!r} of the config; unset "
            f"{INFERENCE_MODE_ENV} to use the config's",
            env=mode,
            config=configured,
        )
    return {**data, "inference": {**inference, "mode": mode}}
