"""The remote client's data-plane retry policy (``DataRetry``): bounded retries with jittered backoff on
connection errors, and waiting while the servers answer 503 (paused), all within the call's timeout."""

from __future__ import annotations

import asyncio
import random
import time

from rollflow.errors import RemoteUnavailableError

# The router and servers answer 503 while paused in abort/wait mode; generate polls with this back-off
# (capped) until resume, so a caller sees the same "wait while paused" as with in-process engines.
PAUSED_RETRY_S = (0.02, 0.5)


def jittered(delay: float) -> float:
    """``delay`` scaled by a random factor in [0.5, 1): thousands of requests refused together (a pause, a
    restarting server) come back spread out instead of all at once."""
    return delay * (0.5 + 0.5 * random.random())


class DataRetry:
    """The data plane's retry policy for one call: bounded retries with backoff on connection errors, and
    waiting (backing off) while the servers answer 503 (paused, or no healthy server behind the router yet),
    all within ``timeout_s``."""

    def __init__(self, method: str, url: str, timeout_s: float, connect_retries: int):
        self.method, self.url, self.timeout_s = method, url, timeout_s
        self.connect_retries = connect_retries
        self.deadline = time.monotonic() + timeout_s
        self.connect_failures = 0
        self.paused_wait = PAUSED_RETRY_S[0]

    def remaining(self) -> float:
        """Seconds left for the next attempt.

        Raises:
            RemoteInferenceError: none are left.
        """
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise RemoteUnavailableError(
                f"{self.method} {self.url} did not complete within request_timeout_s = {self.timeout_s} s",
                url=self.url,
            )
        return remaining

    async def after_connection_error(self, error: BaseException) -> None:
        """Back off before the next attempt, or raise once the retries are spent."""
        self.connect_failures += 1
        if self.connect_failures > self.connect_retries:
            raise RemoteUnavailableError(
                f"{self.method} {self.url} failed after {self.connect_failures} connection attempts: {error!r}",
                url=self.url,
            ) from error
        delay = jittered(min(0.1 * 2**self.connect_failures, 2.0))
        await asyncio.sleep(min(delay, max(self.deadline - time.monotonic(), 0)))

    async def while_paused(self) -> None:
        """Wait (doubling up to a cap) before asking a paused server again."""
        await asyncio.sleep(min(jittered(self.paused_wait), max(self.deadline - time.monotonic(), 0)))
        self.paused_wait = min(self.paused_wait * 2, PAUSED_RETRY_S[1])
