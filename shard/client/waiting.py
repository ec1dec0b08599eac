"""Connect to workers that may not be listening yet: a door or a command started together with
its workers (a ``docker compose up``, a script, a pod restart) must not fail because it won the
race to the port.

``connect_waiting(open, timeout)`` enters ``open()`` (a connection or a pipeline) and, while it
fails with a retryable ``ShardError`` (a connection refused or reset, a worker still loading,
``NOT_READY``), enters it again after a pause that doubles from ``FIRST_RETRY`` to
``MAX_RETRY`` seconds, until ``timeout``; an error that is not retryable (another model, bad
credentials, a bad chain) is raised at once, and so is the last one once the time is up.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import TypeVar

import trio

from shard.rpc.errors import ShardError

__all__ = ["FIRST_RETRY", "MAX_RETRY", "connect_waiting"]

#: Seconds before the second try, doubled at every try up to ``MAX_RETRY``.
FIRST_RETRY = 0.05
MAX_RETRY = 1.0

T = TypeVar("T")


@asynccontextmanager
async def connect_waiting(
    open: Callable[[], AbstractAsyncContextManager[T]], timeout: float | None, *,
    on_wait: Callable[[ShardError], None] | None = None,
) -> AsyncIterator[T]:
    """``open()``'s value for the block, tried again as the module docstring says (``timeout``
    None: without end). ``on_wait`` is called with the first error that is waited out."""
    deadline = math.inf if timeout is None else trio.current_time() + timeout
    delay = FIRST_RETRY
    async with AsyncExitStack() as stack:
        while True:
            try:
                value = await stack.enter_async_context(open())
                break
            except ShardError as err:
                if not err.retryable or trio.current_time() + delay >= deadline:
                    raise
                if on_wait is not None:
                    on_wait(err)
                    on_wait = None
            await trio.sleep(delay)
            delay = min(2 * delay, MAX_RETRY)
        yield value
