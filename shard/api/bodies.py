"""Request bodies: what all of them together may hold, and a large one checked before it is
decoded.

Two costs a client can put on the front door before any worker is asked:

* **Memory across connections.** ``Limits.max_body_bytes`` bounds one body; ``BodyBudget``
  bounds the bytes of every body being received or checked at once
  (``Limits.max_total_body_bytes``), so many clients trickling large bodies cannot add up to
  more than that. A body whose next chunk would pass the total is refused with 503 (retryable,
  ``Retry-After``) and its connection closed; the bytes it held are given back at once.
* **The event loop.** ``json.loads`` of a 4 MiB body of 135,000 two-character messages is one
  C call that holds the GIL for tens of milliseconds, in a worker thread or not, stalling every stream
  the door serves. ``count_values`` first walks a large body with ijson's C tokenizer, 64 KiB
  at a time with a checkpoint between chunks, counting JSON values, and refuses the body (400)
  as soon as it holds more than a request for the served contexts can use; only a body within
  that bound is decoded, which then takes a few milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import ijson
import trio

from .errors import RETRY_AFTER_SECONDS, ApiError

__all__ = ["CHUNK_BYTES", "BodyBudget", "count_values", "value_limit"]

#: Bytes of a body tokenized between two checkpoints (a couple of milliseconds of the C
#: tokenizer: short enough not to stall the event loop's other streams).
CHUNK_BYTES = 64 * 1024


def value_limit(context: int) -> int:
    """The most JSON values a request for a session of ``context`` positions can use: a message
    is six parser events (its object, two keys, two strings, its end) and renders to one
    position at least, a prompt's token id is one; plus room for every other parameter."""
    return 8 * max(context, 1) + 1024


class BodyBudget:
    """The bytes held by request bodies being received or checked, across every connection."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("the total body budget must be positive")
        self.total = total
        self.held = 0

    @contextmanager
    def hold(self) -> Iterator[Holding]:
        """One request's share: grows with ``Holding.add``, given back when the block ends."""
        holding = Holding(self)
        try:
            yield holding
        finally:
            self.held -= holding.bytes
            holding.bytes = 0


class Holding:
    """What one request's body holds of a ``BodyBudget``."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.bytes = 0

    def add(self, n: int) -> None:
        """Count ``n`` more bytes of this body; a 503 (connection closed) past the total."""
        budget = self.budget
        if budget.held + n > budget.total:
            raise ApiError(503, f"the server holds {budget.total} bytes of request bodies at "
                           "once and has no room for this one now: retry later",
                           type="server_error", code="server_busy",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS), "Connection": "close"})
        budget.held += n
        self.bytes += n


async def count_values(data: bytes, limit: int) -> None:
    """Raise a 400 when ``data`` holds more than ``limit`` JSON values (events of the
    tokenizer), checkpointing every ``CHUNK_BYTES``, or is not valid JSON (as the tokenizer
    reads it: ``NaN`` and ``Infinity``, which Python's decoder would take, are refused by both,
    so no body reaches the decoder uncounted)."""
    events: list[object] = ijson.sendable_list()
    parser = ijson.basic_parse_coro(events)
    seen = 0
    view = memoryview(data)
    try:
        for start in range(0, len(data), CHUNK_BYTES):
            parser.send(bytes(view[start:start + CHUNK_BYTES]))
            seen += len(events)
            del events[:]
            if seen > limit:
                raise ApiError(400, f"the body holds more than {limit} JSON values, more than a "
                               "request for this server's contexts can use",
                               code="context_length_exceeded")
            await trio.lowlevel.checkpoint()
        parser.close()
    except ijson.JSONError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
