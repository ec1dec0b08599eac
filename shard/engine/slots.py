"""One open session as the engine sees it: its slot, its cancel flag, a step claimed ready.

A ``Slot`` is engine-internal bookkeeping (never leaves the engine): the session's sequence id,
budget, history and lifecycle state. Implementations read it and mark it (``touch``); the
engine changes its state (``shard.engine.operations``, ``shard.engine.base``).
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field

import numpy as np
import trio

from .errors import EngineCancelled, StepTimeout
from .types import SamplingParams, SessionInfo, SessionState


class CancelReason(enum.Enum):
    """Why a cancel flag is set: a caller stopped the step, or its own step timeout passed."""

    CANCEL = "cancel"
    TIMEOUT = "timeout"


class CancelFlag:
    """A thread-safe flag an engine thread polls to stop between (or inside) steps.

    It remembers why it was set: a step stopped by its timeout fails with ``StepTimeout`` and,
    unlike a cancelled one, keeps a result that was already computed. A cancel wins over a
    timeout (a step that is both never returns a result).
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._reason = CancelReason.CANCEL
        self._watchers: set[trio.Event] = set()

    def set(self, reason: CancelReason = CancelReason.CANCEL) -> None:
        """Set the flag (from the Trio thread) and wake the tasks watching it."""
        if reason is CancelReason.CANCEL or not self._event.is_set():
            self._reason = reason
        self._event.set()
        for event in self._watchers:
            event.set()

    def set_timeout(self) -> None:
        self.set(CancelReason.TIMEOUT)

    def add_watcher(self, event: trio.Event) -> None:
        """``event`` is set when the flag is (a waiting task can leave a queue at once)."""
        self._watchers.add(event)

    def remove_watcher(self, event: trio.Event) -> None:
        self._watchers.discard(event)

    def clear(self) -> None:
        self._event.clear()
        self._reason = CancelReason.CANCEL

    def is_set(self) -> bool:
        return self._event.is_set()

    @property
    def timed_out(self) -> bool:
        """Set only by the step's timeout (no cancel)."""
        return self._event.is_set() and self._reason is CancelReason.TIMEOUT

    def error(self, session_id: str) -> EngineCancelled:
        """The error a step stopped by this flag fails with."""
        if self.timed_out:
            return StepTimeout("the step timeout passed before its result was computed", session_id=session_id)
        return EngineCancelled("operation cancelled", session_id=session_id)

    def raise_if_set(self, session_id: str) -> None:
        if self._event.is_set():
            raise self.error(session_id)


@dataclass
class Slot:
    """Engine-internal bookkeeping for one open session (never leaves the engine).

    ``seq_id`` is a small integer in ``[0, max_sessions)``, the sequence id the implementation
    uses for this session's KV cells.
    """

    session_id: str
    seq_id: int
    kv_budget: int
    tokens: list[int] | None = field(default_factory=list)  # None once hidden states were fed
    n_past: int = 0
    state: SessionState = SessionState.IDLE
    cancel: CancelFlag = field(default_factory=CancelFlag)
    idle: trio.Event = field(default_factory=trio.Event)
    releasing: bool = False  # release() has started: the session is already unknown to callers
    #: Ticks hold the steps of one batch group (``shard.engine.batching``, rule 5); 0: none.
    batch_group: int = 0
    # The running operation's implementation began changing the KV cells (see ``touch``).
    touched: bool = False
    #: Constrained decoding: the session's matcher (``shard.engine.grammar.SessionGrammar``).
    grammar: object | None = None

    def touch(self) -> None:
        """Called by an implementation right before it first changes the session's KV cells for
        the running operation. An operation stopped before that (cancelled while it waited for
        a batched step, say) leaves the session exactly as it was, even a rewinding prefill."""
        self.touched = True

    def cut(self, keep: int) -> None:
        """Forget the history from position ``keep`` on (the KV cells are the caller's)."""
        self.n_past = keep
        if self.tokens is not None:
            del self.tokens[keep:]

    async def wait_idle(self) -> None:
        """Until no operation runs on the session."""
        while self.state is SessionState.RUNNING:
            await self.idle.wait()

    def info(self) -> SessionInfo:
        return SessionInfo(
            session_id=self.session_id,
            state=self.state,
            n_past=self.n_past,
            kv_budget=self.kv_budget,
            tokens=None if self.tokens is None else tuple(self.tokens),
        )


@dataclass(frozen=True)
class Claimed:
    """A step computed ahead as ``_impl_claim`` hands it over: its output, and ``chosen``
    (sampling, token, log-sum-exp) when the implementation already chose the token from this
    very row, which it found finite; used when that sampling is the step's, so the event loop
    does not pass over the vocabulary again."""

    raw: np.ndarray
    chosen: tuple[SamplingParams, int, float] | None = None


def known_choice(chosen: tuple[SamplingParams, int, float] | None, params: SamplingParams
                 ) -> tuple[int, float] | None:
    """(token, log-sum-exp) of ``chosen`` when it was chosen with ``params``."""
    if chosen is not None and (chosen[0] is params or chosen[0] == params):
        return chosen[1], chosen[2]
    return None
