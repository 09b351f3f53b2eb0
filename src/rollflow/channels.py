"""Typed bounded channels between components.

A channel is an anyio memory object stream of one message type. It is always bounded: a full channel
makes the producer wait, so back-pressure, not a queue growing without limit, paces the pipeline.
"""

from __future__ import annotations

from typing import Generic, NamedTuple, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

T = TypeVar("T")


class Channel(NamedTuple, Generic[T]):
    """The two ends of one bounded channel carrying messages of type ``T``."""

    send: MemoryObjectSendStream[T]
    receive: MemoryObjectReceiveStream[T]


def channel(message_type: type[T], capacity: int) -> Channel[T]:
    """A bounded channel for ``message_type`` messages holding at most ``capacity`` unread messages.

    ``message_type`` documents (and type-checks) what flows through; anyio streams are untyped at runtime.
    """
    if capacity < 1:
        raise ValueError(f"channel capacity must be at least 1, got {capacity}")
    send, receive = anyio.create_memory_object_stream[message_type](max_buffer_size=capacity)
    return Channel(send, receive)
