"""One long-lived thread that owns a native context, with a cheap hand-off from Trio.

Why not ``trio.to_thread.run_sync`` per call: a native context is not thread-safe, so its calls
are serial anyway, and a thread that outlives each call can go on working after it handed a
result back. The llama engine uses that to compute a session's next step ahead
(``shard.engine.lookahead``) while the event loop delivers the step before it: the thread
does not wait for a round trip through the event loop between two native steps.

Hand-off: a call is queued under a condition variable (one futex wake-up for the thread) and
its outcome comes back with ``TrioToken.run_sync_soon`` (one write to Trio's wake-up socket).
Calls are never abandoned: ``run`` waits shielded, like ``to_thread.run_sync`` without
``abandon_on_cancel``, because the caller must not touch the context again before the native
work stopped. Between calls the thread runs the owner's ``background`` work, if any.

Failure: an exception out of the background work (a bug: calls' own exceptions go back to their
callers) must not leave the thread dead with calls waiting shielded for it for ever. The thread
then fails every queued call and every later one with ``EngineFailure`` naming the fault, tells
its owner (``on_failure``, in the Trio thread: the engine turns FAILED) and ends.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

from .errors import EngineFailure

T = TypeVar("T")

#: The process's GIL switch interval while a native thread runs (seconds; CPython's default is
#: 5 ms). After each native step the thread needs the GIL back to hand its result over and
#: start the next step; while the event loop runs Python it gets it only when the loop waits or
#: this interval forces a switch: at 5 ms a served step's llama_decode (which includes taking
#: the GIL back) runs well above the raw loop's; at 0.5 ms it matches it.
GIL_SWITCH_INTERVAL = 0.0005

#: Background work: called in the thread when no call is queued; returns False when it found
#: nothing to do (the thread then sleeps until ``wake`` or a call).
Background = Callable[[], bool]

log = logging.getLogger(__name__)


class NativeThread:
    """A serial executor for native calls (see the module docs); ``start`` then ``aclose``."""

    def __init__(
        self, name: str, background: Background | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self._name = name
        self._background = background
        self._on_failure = on_failure
        self._failure: str | None = None  # why the thread stopped (its background work raised)
        self._token: trio.lowlevel.TrioToken | None = None
        self._cond = threading.Condition(threading.Lock())
        self._calls: deque[tuple[Callable[[], Any], trio.lowlevel.TrioToken, Callable[[outcome.Outcome], None]]] = deque()
        self._stopping = False
        self._woken = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread; lowers the GIL switch interval to ``GIL_SWITCH_INTERVAL`` (never
        raises it): process-wide, logged once."""
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL:
            log.info("GIL switch interval %.1f ms -> %.1f ms for the native thread",
                     sys.getswitchinterval() * 1e3, GIL_SWITCH_INTERVAL * 1e3)
            sys.setswitchinterval(GIL_SWITCH_INTERVAL)
        if self._thread is None:
            self._token = trio.lowlevel.current_trio_token()
            self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
            self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def failure(self) -> str | None:
        """Why the thread stopped (its background work raised), or None."""
        return self._failure

    def in_thread(self) -> bool:
        return threading.current_thread() is self._thread

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in the thread and return its result (or raise its exception);
        ``EngineFailure`` once the thread failed (see the module docs)."""
        if self._failure is not None:
            raise EngineFailure(self._failure)
        if not self.running:
            raise RuntimeError(f"{self._name} is not running")
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        box: list[outcome.Outcome] = []

        def deliver(result: outcome.Outcome) -> None:
            box.append(result)
            done.set()

        with self._cond:
            if self._failure is not None:  # (it failed between the look above and now)
                raise EngineFailure(self._failure)
            self._calls.append((lambda: fn(*args), token, deliver))
            self._cond.notify()
        with trio.CancelScope(shield=True):  # never abandoned: see the module docs
            await done.wait()
        return box[0].unwrap()

    def wake(self) -> None:
        """Tell an idle thread that background work may be waiting (any thread may call)."""
        with self._cond:
            self._woken = True
            self._cond.notify()

    def wait_for_wake(self, timeout: float) -> bool:
        """From background work: sleep until ``wake``, a queued call or ``timeout`` seconds;
        returns whether a call is queued (background work should then yield to it)."""
        with self._cond:
            if not self._woken and not self._calls and not self._stopping:
                self._cond.wait(timeout)
            self._woken = False
            return bool(self._calls) or self._stopping

    def calls_waiting(self) -> bool:
        return bool(self._calls)  # a racy read is fine: a hint for background work

    async def aclose(self) -> None:
        """Stop after the queued calls and wait for the thread to end."""
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await trio.to_thread.run_sync(thread.join)
        self._thread = None

    def _main(self) -> None:
        idle = True  # the last background run found nothing to do
        while True:
            with self._cond:
                while not self._calls and not self._stopping and (
                    self._background is None or (idle and not self._woken)
                ):
                    self._cond.wait()
                call = self._calls.popleft() if self._calls else None
                if call is None:
                    if self._stopping:
                        return
                    self._woken = False
            if call is None:
                assert self._background is not None
                try:
                    idle = not self._background()
                except BaseException as exc:  # noqa: BLE001 - a bug: fail loudly, hang nothing
                    self._fail(exc)
                    return
                continue
            fn, token, deliver = call
            result = outcome.capture(fn)
            idle = False  # a call may have left background work (offered once after each call)
            try:
                token.run_sync_soon(deliver, result)
            except trio.RunFinishedError:  # pragma: no cover - the engine outlived its run
                pass

    def _fail(self, exc: BaseException) -> None:
        """The background work raised: fail the queued calls (and later ones), tell the owner."""
        log.error("%s: background work failed; the thread stops", self._name, exc_info=exc)
        reason = f"the native thread failed: {type(exc).__name__} in its background work"
        with self._cond:
            self._failure = reason
            pending = list(self._calls)
            self._calls.clear()
        for _, token, deliver in pending:
            try:
                token.run_sync_soon(deliver, outcome.Error(EngineFailure(reason)))
            except trio.RunFinishedError:  # pragma: no cover
                pass
        if self._on_failure is not None and self._token is not None:
            try:
                self._token.run_sync_soon(self._on_failure, reason)
            except trio.RunFinishedError:  # pragma: no cover
                pass


__all__ = ["Background", "NativeThread"]
