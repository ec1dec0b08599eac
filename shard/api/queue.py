"""A bounded FIFO wait per model for a free session: a request that finds a model's sessions
all taken waits its turn instead of being refused, as llama-server, vLLM and SGLang queue.

Why in the door: a worker refuses an OpenSession past its ``max_sessions``
(``RESOURCE_EXHAUSTED``, reason ``TOO_MANY_SESSIONS``) and keeps no queue of its own. The door
knows how many sessions the model's routes have (``capacity``: the workers' ``max_sessions``)
and when each of its own generations ends, so a request that finds them all taken waits in line
and is woken when one ends, without asking the workers again and again. A worker may still
refuse (sessions opened by other clients of the worker, or one still being released): the
request keeps its place and tries again after a short backoff, or at once when one of the
door's generations ends, until its wait is over.

Bounds: at most ``length`` requests wait per model (``0``: no queue, a full worker's refusal is
answered at once) and each waits at most ``timeout`` seconds from its arrival; past either,
429 with ``Retry-After``. A waiting request's task is cancelled when its client disconnects, which
takes it out of the line at once (nothing is left behind: ``depth`` counts the waiters).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from shard.rpc.errors import ErrorCode, ShardError

from .errors import RETRY_AFTER_SECONDS, ApiError, from_shard_error
from .metrics import ApiMetrics

__all__ = ["TOO_MANY_SESSIONS", "Queues", "WaitQueue", "refused_for_capacity"]

#: ``ShardError.reason`` of a worker's refusal to open a session past ``max_sessions``.
TOO_MANY_SESSIONS = "TOO_MANY_SESSIONS"
#: Seconds before the first retry after a worker refused for capacity, doubled at each further
#: refusal up to ``MAX_BACKOFF`` (one of the door's own generations ending wakes it sooner).
FIRST_BACKOFF = 0.05
MAX_BACKOFF = 1.0
#: Seconds between a waiter's looks at the model's capacity, which can grow without any of the
#: door's generations ending (a pool's worker joins).
RECHECK = 0.5


def refused_for_capacity(err: ShardError) -> bool:
    """Whether ``err`` is a worker's refusal to open one more session (worth waiting for)."""
    return (err.code == ErrorCode.RESOURCE_EXHAUSTED and err.retryable
            and err.reason == TOO_MANY_SESSIONS)


@dataclass(eq=False)
class _Waiter:
    places: int = 1  # sessions it needs (a request of ``n`` choices: ``n``)
    woken: trio.Event = field(default_factory=trio.Event)
    granted: bool = False  # its places were given to it (counted in ``running``)


class WaitQueue:
    """One model's line (see the module docstring). ``capacity()``: the sessions its routes
    have now, None when not known (no bound of the door's own: only the workers refuse)."""

    def __init__(
        self, model: str, capacity: Callable[[], int | None], *, length: int, timeout: float,
        metrics: ApiMetrics | None = None,
    ) -> None:
        if length < 0 or not timeout > 0:
            raise ValueError("length must be >= 0 and timeout > 0")
        self.model = model
        self.length = length
        self.timeout = timeout
        self._capacity = capacity
        self._metrics = metrics if metrics is not None else ApiMetrics()
        self._waiting: deque[_Waiter] = deque()
        #: The door's generations of this model holding a place (running, or retrying after a
        #: worker's refusal).
        self.running = 0
        self._freed = trio.Event()  # set (and replaced) whenever one of them ends
        self._show()

    @property
    def depth(self) -> int:
        """Requests waiting now."""
        return len(self._waiting)

    async def run(self, attempt: Callable[[], Awaitable[None]], *,
                  started: Callable[[], bool] = lambda: False, places: int = 1) -> None:
        """Run ``attempt`` (one generation) in its turn; again after a worker's refusal for
        capacity that came before anything was ``started()`` (a token sent), within the wait's
        bound. ``places``: the sessions it takes (a request of ``n`` choices holds ``n``; it
        waits until that many are free, never more than the capacity). Raises ``ApiError``
        429 past the queue's length or its timeout; other errors of ``attempt`` pass
        through."""
        arrived = trio.current_time()
        deadline = arrived + self.timeout
        await self._enter(deadline, places)
        began, backoff = trio.current_time(), FIRST_BACKOFF
        try:
            while True:
                try:
                    await attempt()
                    return
                except ShardError as err:
                    if not refused_for_capacity(err) or started():
                        raise
                    if not self.length:  # no queue: refused at once, as before there was one
                        self._metrics.queue_refused.labels(self.model, "full").inc()
                        raise
                    if trio.current_time() >= deadline:
                        began = trio.current_time()
                        raise self._refusal("timeout", from_shard_error(err).message) from None
                freed = self._freed
                with trio.move_on_at(min(deadline, trio.current_time() + backoff)):
                    await freed.wait()
                backoff = min(2 * backoff, MAX_BACKOFF)
                began = trio.current_time()
        finally:
            self._metrics.queue_wait.labels(self.model).observe(began - arrived)
            self._give_back(places)

    async def _enter(self, deadline: float, places: int) -> None:
        """Take ``places`` now, or wait in line for them (``ApiError`` 429 past the bounds)."""
        if not self._waiting and self._room(places):
            self.running += places
            return
        if len(self._waiting) >= self.length:
            queued = (f" and {len(self._waiting)} requests wait already, the most the queue "
                      "holds" if self.length else "")
            raise self._refusal("full", f"all sessions of {self.model!r} are in use{queued}")
        waiter = _Waiter(places)
        self._waiting.append(waiter)
        self._show()
        arrived, admitted = trio.current_time(), False
        try:
            with trio.move_on_at(deadline):
                while not waiter.granted:
                    with trio.move_on_after(RECHECK):
                        await waiter.woken.wait()
                    self._grant()
            admitted = waiter.granted
        finally:  # the wait is over, or the client left (its task is cancelled): out of line
            if not admitted:
                self._leave(waiter)
        if not admitted:
            self._metrics.queue_wait.labels(self.model).observe(trio.current_time() - arrived)
            raise self._refusal("timeout", f"all sessions of {self.model!r} are in use")

    def _leave(self, waiter: _Waiter) -> None:
        """A waiter that will not run: out of line, or its place (given as it left) passed on."""
        if waiter.granted:
            self._give_back(waiter.places)
        else:
            self._waiting.remove(waiter)
            self._show()

    def _room(self, places: int = 1) -> bool:
        capacity = self._capacity()
        # (a request of more places than there are takes them all once every one is free)
        return capacity is None or self.running + min(places, capacity) <= capacity

    def _grant(self) -> None:
        """Give the free places to the longest waiting, in order."""
        while self._waiting and self._room(self._waiting[0].places):
            waiter = self._waiting.popleft()
            waiter.granted = True
            self.running += waiter.places
            waiter.woken.set()
        self._show()

    def _give_back(self, places: int = 1) -> None:
        self.running -= places
        self._freed.set()
        self._freed = trio.Event()
        self._grant()

    def _show(self) -> None:
        self._metrics.queue_depth.labels(self.model).set(len(self._waiting))

    def _refusal(self, why: str, message: str) -> ApiError:
        self._metrics.queue_refused.labels(self.model, why).inc()
        if why == "timeout":
            message += f"; none came free within {self.timeout:g} s"
        message += "; retry later"
        return ApiError(429, message, type="rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


class Queues:
    """Each model's ``WaitQueue``, made when the model is first asked for."""

    def __init__(self, *, length: int, timeout: float, metrics: ApiMetrics) -> None:
        self.length = length
        self.timeout = timeout
        self.metrics = metrics
        self._queues: dict[str, WaitQueue] = {}

    def of(self, model: str, capacity: Callable[[], int | None]) -> WaitQueue:
        """``model``'s queue; ``capacity`` (its routes' sessions) is read on each decision."""
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = WaitQueue(
                model, capacity, length=self.length, timeout=self.timeout, metrics=self.metrics)
        return queue
