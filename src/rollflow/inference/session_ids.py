"""Session ids as the router and the servers read them: one decoding and one bound for every path.

A session id names a multi-turn session for routing affinity (``X-Session-ID`` header, else a ``session_id``
string in the JSON body). The header's bytes are decoded as UTF-8 here and only here, so the router's raw
fast path and its aiohttp path (and the servers) see the same id for the same bytes, whether the body came
with a Content-Length or chunked. Ids are bounded (``MAX_SESSION_ID_BYTES``) before anything remembers them:
the router pins every session it sees, so an unbounded id is unbounded memory.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

#: The request header naming a request's session.
SESSION_ID_HEADER = "X-Session-ID"
_HEADER_LOWER = SESSION_ID_HEADER.lower().encode()
#: Longest session id accepted, in UTF-8 bytes (ids rollflow makes are ~20 bytes; a UUID is 36).
MAX_SESSION_ID_BYTES = 256


class SessionIdError(ValueError):
    """A session id the caller must fix (too long, or a header that is not UTF-8); answered with a 400.

    Attributes:
        param: where the id came from: ``X-Session-ID`` (the header) or ``session_id`` (the body field).
    """

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def decode_session_id_header(raw: bytes) -> str:
    """The session id an ``X-Session-ID`` header value (bytes as received) names.

    Raises:
        SessionIdError: longer than ``MAX_SESSION_ID_BYTES`` or not valid UTF-8.
    """
    if len(raw) > MAX_SESSION_ID_BYTES:
        raise SessionIdError(
            f"{SESSION_ID_HEADER} header is {len(raw)} bytes; session ids may be at most "
            f"{MAX_SESSION_ID_BYTES} bytes: send a shorter id (e.g. a UUID or a hash of yours)",
            SESSION_ID_HEADER,
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise SessionIdError(
            f"{SESSION_ID_HEADER} header is not valid UTF-8 ({error.reason} at byte {error.start}): "
            "send the id as UTF-8 (or ASCII)",
            SESSION_ID_HEADER,
        ) from None


def session_id_from_raw_headers(raw_headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The session id of the first ``X-Session-ID`` header in ``raw_headers`` (aiohttp's
    ``request.raw_headers``); None without one or when it is empty.

    Raises:
        SessionIdError: see ``decode_session_id_header``.
    """
    for name, value in raw_headers:
        if name.lower() == _HEADER_LOWER:
            return decode_session_id_header(value) or None
    return None


def check_body_session_id(session_id: str | None) -> str | None:
    """A ``session_id`` body field as given (None when absent or empty), bounded as the header is.

    Raises:
        SessionIdError: longer than ``MAX_SESSION_ID_BYTES`` in UTF-8.
    """
    if not session_id:
        return None
    # Characters bound bytes from below by a quarter: skip encoding short ids (the common case).
    if len(session_id) * 4 > MAX_SESSION_ID_BYTES:
        size = len(session_id.encode("utf-8", "surrogatepass"))
        if size > MAX_SESSION_ID_BYTES:
            raise SessionIdError(
                f"session_id is {size} bytes in UTF-8; session ids may be at most {MAX_SESSION_ID_BYTES} "
                "bytes: send a shorter id (e.g. a UUID or a hash of yours)",
                "session_id",
            )
    return session_id


class SessionField(msgspec.Struct):
    """The only body field the router reads; decoding into it also checks the body is a JSON object."""

    session_id: str | None = None
