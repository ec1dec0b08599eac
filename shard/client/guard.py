"""The conflict guard of a session: one task uses it at a time.

A session's steps never overlap, and its results are read in order: a call from a second task
while another task is inside a call, or while another task's ``generate()`` is still being
iterated, would read (or skip) the other task's results. It raises
``ShardError(ILLEGAL_TRANSITION)`` instead and leaves the first task alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import trio

from shard.rpc.errors import ErrorCode, ShardError

__all__ = ["TaskGuard"]


class TaskGuard:
    """Which task is inside a call of the session now, and which one sent its pending request
    (with that request's ``StepStream``, if any)."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self._user: trio.lowlevel.Task | None = None  # the task inside a call right now
        self._owner: trio.lowlevel.Task | None = None  # who sent the pending request
        self._stream: Any = None  # the pending request's StepStream (``_done``), if any

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the session for the current task for the block (re-entrant)."""
        task = trio.lowlevel.current_task()
        if self._user is not None and self._user is not task:
            raise ShardError(
                ErrorCode.ILLEGAL_TRANSITION,
                "this session is in use by another task (steps never overlap; use one "
                "session per task)",
                session_id=self.session_id,
            )
        outer = self._user is None
        self._user = task
        try:
            yield
        finally:
            if outer:
                self._user = None

    def sent(self, stream: Any = None) -> None:
        """The current task sent the request now pending (iterated by ``stream``, if any)."""
        self._owner = trio.lowlevel.current_task()
        self._stream = stream

    def check_skip(self) -> None:
        """Refuse to skip the pending request while another task still iterates it."""
        stream = self._stream
        if self._owner is not trio.lowlevel.current_task() and stream is not None \
                and not stream._done:
            raise ShardError(
                ErrorCode.ILLEGAL_TRANSITION,
                "another task is still iterating this session's generate(); finish or "
                "aclose() it first",
                session_id=self.session_id,
            )
