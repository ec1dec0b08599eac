"""The Cancel region of a step: what an out-of-band Cancel RPC stops, and when.

A Cancel is remembered from the moment a step is dispatched (``begin``) and stops it at its next
credit wait or engine call (a ``region``); handing a computed result to the transport is never
cancelled by it, so ``Usage`` counts exactly the results sent and the session holds what they
say. Once the step's work is over (``finished``) a Cancel finds no step.
"""

from __future__ import annotations

from typing import Any, Protocol

import trio
from trio_util import AsyncBool

from ..errors import ErrorCode, ShardError


class Stoppable(Protocol):
    """What a Cancel stops: a region's cancel scope, or a grouped row's engine step."""

    def cancel(self) -> None: ...


def cancelled(session_id: str) -> ShardError:
    """The error of a step a Cancel stopped."""
    return ShardError(ErrorCode.CANCELLED, "the step was cancelled (Cancel RPC)",
                      session_id=session_id)


class StepCancel:
    """The running step's cancellation state (one per stream)."""

    __slots__ = ("active", "_requested", "_finishing", "_scope")

    def __init__(self) -> None:
        self.active = AsyncBool(False)  # from dispatch until the step's Usage is queued
        self._requested = False  # a Cancel for the current step (survives region gaps)
        self._finishing = False  # the step's work is over; only its Error/Usage remain
        self._scope: Stoppable | None = None  # the running region's (or a grouped row's)

    @property
    def requested(self) -> bool:
        """A Cancel for the current step was asked for."""
        return self._requested

    def begin(self) -> None:
        """A step was dispatched: from here on a Cancel is never lost."""
        self.active.value = True

    def started(self) -> None:
        """The step's task is being started (also a queued step, which follows one ended)."""
        self._requested = self._finishing = False

    def cancel(self) -> bool:
        """Stop the running step (also before it entered a region); False: no step to stop."""
        if not self.active.value or self._finishing:
            return False
        self._requested = True
        if self._scope is not None:
            self._scope.cancel()
        return True

    def watch(self, stop: Stoppable) -> bool:
        """A step that runs outside a region (a grouped row: ``session.group``) is stopped by
        ``stop.cancel()``; True: a Cancel was requested already (the step must not start)."""
        self._scope = stop
        return self._requested

    def finished(self) -> None:
        """Nothing is left to stop: a Cancel now finds no step."""
        self._scope = None
        self._finishing = True

    def ended(self) -> None:
        """The step's Usage is queued."""
        self.active.value = False


class Region:
    """A region a Cancel stops (``SessionCall.cancellable``): a cancel scope the Cancel RPC
    finds. (A class, not a generator-based context manager: it is entered once per token.)"""

    __slots__ = ("_cancel", "_scope", "_session_id")

    def __init__(self, cancel: StepCancel, session_id: str) -> None:
        self._cancel = cancel
        self._scope = trio.CancelScope()
        self._session_id = session_id

    def __enter__(self) -> None:
        cancel, scope = self._cancel, self._scope
        if cancel._requested:
            scope.cancel()
        cancel._scope = scope
        scope.__enter__()

    def __exit__(self, *exc: Any) -> bool:
        scope = self._scope
        try:
            swallowed = scope.__exit__(*exc)
        finally:
            self._cancel._scope = None
        if scope.cancelled_caught:
            raise cancelled(self._session_id)
        return bool(swallowed)
