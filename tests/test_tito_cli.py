"""``rollflow proxy CONFIG``: a standalone proxy that agents in any language drive over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.conftest import REPO_ROOT


@pytest.fixture
def proxy_process(tmp_path):
    config = tmp_path / "proxy.toml"
    config.write_text('[model]\npath = "rollflow:tiny"\n\n[inference]\nmax_model_len = 256\n')
    env = dict(os.environ, ROLLFLOW_ADMIN_TOKEN="", HF_HUB_OFFLINE="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "rollflow", "--log-level", "warning", "proxy", str(config), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO_ROOT,
    )
    try:
        line = process.stdout.readline()
        assert line, process.stderr.read()
        yield json.loads(line)
    finally:
        process.terminate()
        process.wait(timeout=20)


@pytest.mark.slow
def test_standalone_proxy_with_admin_endpoints(proxy_process):
    ready = proxy_process
    assert ready["event"] == "ready" and ready["url"].startswith("http://127.0.0.1:")
    auth = {"Authorization": f"Bearer {ready['admin_token']}"}
    with httpx.Client(base_url=ready["url"], timeout=30) as http:
        assert http.post("/sessions").status_code == 401
        opened = http.post("/sessions", headers=auth).json()
        chat = {"model": ready["model"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
        answer = http.post(f"{opened['base_url']}/chat/completions", json=chat)
        assert answer.status_code == 200, answer.text
        trace = http.get(f"/sessions/{opened['session_id']}/trace", headers=auth).json()
        assert trace["stats"]["turns"] == 1
        close = {"reward": 1.0, "mode": "per_branch", "max_seq_len": 256}
        closed = http.post(f"/sessions/{opened['session_id']}/close", json=close, headers=auth).json()
        (sample,) = closed["samples"]
        assert sum(sample["loss_mask"]) == answer.json()["usage"]["completion_tokens"]


@pytest.mark.slow
@pytest.mark.http_only(reason="the proxy CLI over external servers")
def test_standalone_proxy_uses_the_configs_inference_and_sampling(tmp_path, inference_servers):
    """With ``[inference]`` naming servers, the proxy starts a router over them (no engine of its own) and
    requests default to ``[sampling]``. Like ``run``, it merges several config files and ``--set``."""
    config = tmp_path / "proxy.toml"
    config.write_text(
        f'output_dir = "{tmp_path}"\n[model]\npath = "rollflow:tiny"\n[sampling]\nmax_tokens = 3\n'
    )
    overlay = tmp_path / "servers.toml"
    urls = ", ".join(f'"{url}"' for url in inference_servers.urls)
    overlay.write_text(f'[inference]\nmode = "http"\nexternal_server_urls = [{urls}]\nrouter_port = 0\n')
    output_dir = tmp_path / "from-set"
    env = dict(os.environ, ROLLFLOW_ADMIN_TOKEN="sesame", HF_HUB_OFFLINE="1")
    env.pop("ROLLFLOW_INFERENCE_MODE", None)
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "rollflow", "--log-level", "warning", "proxy", str(config), str(overlay)),
            *("--set", f"output_dir='{output_dir}'"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        line = process.stdout.readline()
        assert line, process.stderr.read()
        ready = json.loads(line)
        auth = {"Authorization": "Bearer sesame"}
        with httpx.Client(base_url=ready["url"], timeout=30) as http:
            opened = http.post("/sessions", headers=auth).json()
            chat = {
                "model": ready["model"],
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": None,
            }
            answer = http.post(f"{opened['base_url']}/chat/completions", json=chat)
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] <= 3
        # The router it started over the servers logs there (output_dir from --set); no server of its own
        # was started.
        logs = output_dir / "run" / "logs" / "inference"
        assert (logs / "router-0.log").exists() and not list(logs.glob("server-*.log"))
    finally:
        process.terminate()
        process.wait(timeout=20)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--set", "inference.max_model_len=-3"], "inference.max_model_len"),
        (["--set", "no_such_key=1"], "no_such_key"),
        (["--set", "=1"], "expected KEY=VALUE"),
    ],
)
def test_standalone_proxy_refuses_bad_overrides_naming_them(tmp_path, arguments, message):
    config = tmp_path / "proxy.toml"
    config.write_text('[model]\npath = "rollflow:tiny"\n')
    result = subprocess.run(
        [sys.executable, "-m", "rollflow", "proxy", str(config), *arguments],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
