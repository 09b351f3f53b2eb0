"""The TITO proxy stays light: importing it pulls in neither torch nor transformers."""

from __future__ import annotations

from tests.helpers.imports import assert_light_imports


def test_tito_proxy_imports_light():
    assert_light_imports(
        "rollflow.tito, rollflow.tito.proxy, rollflow.tito.composer, rollflow.tito.workers, rollflow.tito.worker"
    )
