"""TITO (token-in/token-out): an OpenAI-compatible proxy that records the exact tokens an agent's model
calls sampled, and turns them into training samples.

    async with TITOProxy(client, renderer, tokenizer, model_name="rollflow:tiny") as proxy:
        session = await proxy.open_session()
        reward = await agent(session.base_url, task)          # any OpenAI-compatible agent
        trace = await proxy.close_session(session)
        samples = compose(trace, reward=reward, mode="per_branch", max_seq_len=4096)

This package never imports torch or transformers at module scope.
"""

from rollflow.errors import RequestError, RoutedExpertsError, TraceSealedError
from rollflow.tito.composer import COMPOSE_MODES, TITOSample, compose, resolve_composer, trace_metrics
from rollflow.tito.proxy import TITOProxy
from rollflow.tito.renderer import TITORenderer
from rollflow.tito.session import Session
from rollflow.tito.trace import Node, RenderRecord, Trace, Turn

__all__ = [
    "COMPOSE_MODES",
    "Node",
    "RenderRecord",
    "RequestError",
    "RoutedExpertsError",
    "Session",
    "TITOProxy",
    "TITORenderer",
    "TITOSample",
    "Trace",
    "TraceSealedError",
    "Turn",
    "compose",
    "resolve_composer",
    "trace_metrics",
]
