"""What one request, and one API key, may take of the front door.

``Limits`` gathers the operator's bounds (``trio-shard api`` options) in one value that the app
and each generation read. ``KeySlots`` counts the generations each key's principal runs: with
``requests_per_key`` set, one key cannot take every session of the workers and the wait queue
(the others would wait behind it); its own extra requests get a 429 instead.
"""

from __future__ import annotations

from collections import Counter
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass

from .errors import RETRY_AFTER_SECONDS, ApiError

__all__ = ["DEFAULT_BODY_TIMEOUT", "DEFAULT_KEEPALIVE", "DEFAULT_LIMITS", "DEFAULT_MAX_BODY_BYTES",
           "DEFAULT_MAX_TOTAL_BODY_BYTES", "DEFAULT_QUEUE_LENGTH", "DEFAULT_QUEUE_TIMEOUT",
           "DEFAULT_SEND_TIMEOUT", "KeySlots", "Limits"]

#: Request bodies are bounded: 4 MiB holds any prompt a worker's context takes.
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
#: Bytes every request body being received or checked may hold together (``shard.api.bodies``):
#: 16 bodies of the largest size.
DEFAULT_MAX_TOTAL_BODY_BYTES = 16 * DEFAULT_MAX_BODY_BYTES
#: Seconds one write to the client may wait (its socket full: it stopped reading) before the
#: generation is cancelled and its sessions released, so a client that holds its connection
#: open without reading cannot hold a worker's session until the deadline.
DEFAULT_SEND_TIMEOUT = 30.0
#: Seconds of silence after which a stream sends an SSE comment (``shard.api.streaming``).
DEFAULT_KEEPALIVE = 15.0
#: Seconds a request's body may take to arrive whole (408 after): hypercorn bounds the wait for
#: a request's headers (its keep-alive timeout, 5 s) but not for its body, and a client that
#: sends a large Content-Length, then a byte now and then, would hold its connection and a
#: task of the door for ever.
DEFAULT_BODY_TIMEOUT = 30.0
#: Requests per model that may wait for a session when all are taken (``shard.api.queue``):
#: enough for a burst of a few dozen clients, few enough that a flood is told to come back.
DEFAULT_QUEUE_LENGTH = 64
#: Seconds one request may wait for a session before it gets 429: about what a client waits
#: for a first token before giving up.
DEFAULT_QUEUE_TIMEOUT = 60.0


@dataclass(frozen=True)
class Limits:
    """``max_body_bytes``: larger bodies get 413. ``send_timeout``: see
    ``DEFAULT_SEND_TIMEOUT``. ``keepalive``: None sends no comments. ``requests_per_key``:
    generations one key's principal may run at once (None: no bound). ``body_timeout``: see
    ``DEFAULT_BODY_TIMEOUT``. ``max_total_body_bytes``: what all bodies being received or
    checked at once may hold (503 past it; ``shard.api.bodies``). ``queue_length``: requests
    per model that may wait for a session (0: none, a full worker answers 429 at once);
    ``queue_timeout``: seconds each may wait (``shard.api.queue``)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    send_timeout: float = DEFAULT_SEND_TIMEOUT
    keepalive: float | None = DEFAULT_KEEPALIVE
    requests_per_key: int | None = None
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    max_total_body_bytes: int = DEFAULT_MAX_TOTAL_BODY_BYTES
    queue_length: int = DEFAULT_QUEUE_LENGTH
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT

    def __post_init__(self) -> None:
        if self.max_total_body_bytes < self.max_body_bytes:
            raise ValueError("max_total_body_bytes must be at least max_body_bytes")
        if self.max_body_bytes < 1 or self.send_timeout <= 0 or self.body_timeout <= 0:
            raise ValueError("max_body_bytes, send_timeout and body_timeout must be positive")
        if self.keepalive is not None and self.keepalive <= 0:
            raise ValueError("keepalive must be positive (None: off)")
        if self.requests_per_key is not None and self.requests_per_key < 1:
            raise ValueError("requests_per_key must be at least 1 (None: no bound)")
        if self.queue_length < 0 or not self.queue_timeout > 0:
            raise ValueError("queue_length must be >= 0 and queue_timeout positive")


#: The defaults above (a value: ``Limits`` is frozen).
DEFAULT_LIMITS = Limits()


class KeySlots:
    """Generations running per principal, bounded by ``limit`` (None: counted, not bounded)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._running: Counter[str] = Counter()

    def running(self, principal: str) -> int:
        return self._running[principal]

    def take(self, principal: str | None) -> AbstractContextManager[object]:
        """Take one slot of ``principal`` now (an ``ApiError`` 429 when it has none left); the
        returned context manager gives it back on exit: enter it at once. Requests without a
        principal (a door without keys) are not bounded here."""
        if principal is None:
            return nullcontext()
        if self.limit is not None and self._running[principal] >= self.limit:
            raise ApiError(429, f"this API key already runs {self.limit} request(s) at once, the "
                           "most it may; retry when one has finished", type="rate_limit_error",
                           code="too_many_requests_for_key",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        self._running[principal] += 1
        slot = ExitStack()
        slot.callback(self._give_back, principal)
        return slot

    def _give_back(self, principal: str) -> None:
        self._running[principal] -= 1
        if not self._running[principal]:
            del self._running[principal]
