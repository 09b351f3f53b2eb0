"""The router's two response sinks write the same answer in their own wire form: hop-by-hop headers dropped,
the answering server named in ``X-Rollflow-Worker``, errors as vLLM-shaped JSON."""

from __future__ import annotations

import json

from rollflow.inference.router_sinks import WORKER_HEADER, AiohttpSink, FrontSink

UPSTREAM_HEADERS = [
    ("Content-Type", "application/json"),
    ("Content-Length", "2"),
    ("Connection", "keep-alive"),
    ("Transfer-Encoding", "chunked"),
    ("X-Request-Id", "r1"),
]
WORKER = "http://127.0.0.1:8001"


class RecordingFront:
    """What ``FrontSink`` needs of ``HttpFront``: the bytes written, and how often it waited to drain."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.drains = 0

    def write(self, data: bytes) -> None:
        self.written += data

    async def drain(self) -> None:
        self.drains += 1


def _head_and_body(raw: bytes) -> tuple[list[str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return head.decode("latin-1").split("\r\n"), body


def test_front_sink_writes_a_whole_answer_without_hop_headers():
    front = RecordingFront()
    FrontSink(front).answer(200, UPSTREAM_HEADERS, WORKER, b"{}")  # type: ignore[arg-type]
    lines, body = _head_and_body(bytes(front.written))
    assert lines[0] == "HTTP/1.1 200 OK"
    assert sorted(lines[1:]) == sorted(
        [
            "Content-Type: application/json",
            "X-Request-Id: r1",
            f"{WORKER_HEADER}: {WORKER}",
            "Content-Length: 2",
        ]
    )
    assert body == b"{}"


async def test_front_sink_streams_in_chunked_coding():
    front = RecordingFront()
    sink = FrontSink(front)  # type: ignore[arg-type]
    await sink.start(200, [("Content-Type", "text/event-stream"), ("Connection", "close")], WORKER)
    await sink.write(b"data: 1\n\n")
    await sink.write(b"data: [DONE]\n\n")
    await sink.end()
    lines, body = _head_and_body(bytes(front.written))
    assert lines[1:] == [
        "Content-Type: text/event-stream",
        f"{WORKER_HEADER}: {WORKER}",
        "Transfer-Encoding: chunked",
    ]
    assert body == b"9\r\ndata: 1\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
    assert front.drains == 2  # a slow caller holds the stream back, chunk by chunk


def test_front_and_aiohttp_sinks_answer_the_same_error():
    front = RecordingFront()
    FrontSink(front).error(503, "no healthy inference server", type="EngineDeadError")  # type: ignore[arg-type]
    lines, body = _head_and_body(bytes(front.written))
    assert lines[0] == "HTTP/1.1 503 Service Unavailable"

    sink = AiohttpSink(request=None)  # type: ignore[arg-type]  # errors need no request
    sink.error(503, "no healthy inference server", type="EngineDeadError")
    assert sink.response is not None and sink.response.status == 503
    assert json.loads(body) == json.loads(sink.response.body)  # type: ignore[arg-type]
    assert json.loads(body)["error"]["type"] == "EngineDeadError"


def test_aiohttp_sink_keeps_the_end_to_end_headers_and_names_the_worker():
    sink = AiohttpSink(request=None)  # type: ignore[arg-type]
    sink.answer(201, UPSTREAM_HEADERS, WORKER, b"{}")
    response = sink.response
    assert response is not None and response.status == 201 and response.body == b"{}"
    assert response.headers[WORKER_HEADER] == WORKER
    assert response.headers["X-Request-Id"] == "r1"
    assert "Connection" not in response.headers and "Transfer-Encoding" not in response.headers
