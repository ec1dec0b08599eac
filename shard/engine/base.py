"""The ShardEngine contract and the lifecycle rules every implementation inherits.

Why a base class rather than a bare Protocol: the lifecycle semantics (states, busy sessions,
idempotent cancel/release, validation, rollback on failure, honest health) must be *identical*
across engines. They are written once here; implementations only provide the numeric work
through a handful of ``_impl`` hooks. The contract suite in ``shard.testing`` still checks every
engine end to end, so a hook that breaks a rule is caught.

Resource handling: an engine owns its native resources from ``load`` until ``aclose``; use it as
``async with engine:``. Sessions own KV cells from ``open_session`` until ``release``.

Error handling: every public method raises only ``EngineError`` subclasses (or
``trio.Cancelled`` when the *caller's* scope is cancelled). An unexpected exception from an
implementation turns the engine FAILED and surfaces as ``EngineFailure``.

Cancellation: ``cancel(session_id)`` sets a flag that the implementation checks between steps
(and, for llama.cpp, inside a step through the abort callback); the running operation then
raises ``EngineCancelled``. If the calling Trio task is cancelled instead (a deadline), the same
flag is set, the engine work is waited for (never abandoned while it touches native state) and
``trio.Cancelled`` propagates. Either way the session is left IDLE holding exactly what it held
before the operation's new positions (see docs/engine.md).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import heapq
import itertools
import logging
import math
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TypeVar

import numpy as np
import outcome
import trio

from . import sampling
from .lookahead import LookaheadPlan
from .seq_ids import pick_seq_id
from .errors import (
    ContextExceeded,
    EngineCancelled,
    EngineError,
    EngineFailure,
    IllegalTransition,
    IncompatibleState,
    InvalidInput,
    KvCacheFull,
    NotReady,
    SessionBusy,
    SessionExists,
    StepTimeout,
    TooManySessions,
    UnknownSession,
    UnsupportedFeature,
)
from .types import (
    BoundaryResult,
    Capabilities,
    DecodeRequest,
    EngineHealth,
    EngineMetrics,
    EngineState,
    LoadSpec,
    LogitsResult,
    Lookahead,
    PrefillRequest,
    SamplingParams,
    SessionInfo,
    SessionSnapshot,
    SessionState,
    StepResult,
    StreamRequest,
    check_reserved_hooks,
    validate_hidden_states,
    validate_tokens,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_TOP_K_LOGPROBS = 64
MAX_SESSION_ID_LEN = 128


def _is_int(value: object) -> bool:
    """A real integer: ``True`` is an ``int`` to Python but never a position or a count here."""
    return isinstance(value, int) and not isinstance(value, bool)


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

    def touch(self) -> None:
        """Called by an implementation right before it first changes the session's KV cells for
        the running operation. An operation stopped before that (cancelled while it waited for
        a batched step, say) leaves the session exactly as it was, even a rewinding prefill."""
        self.touched = True

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


def _known(chosen: tuple[SamplingParams, int, float] | None, params: SamplingParams
           ) -> tuple[int, float] | None:
    """(token, log-sum-exp) of ``chosen`` when it was chosen with ``params``."""
    if chosen is not None and (chosen[0] is params or chosen[0] == params):
        return chosen[1], chosen[2]
    return None


@dataclass(frozen=True)
class ComputePlan:
    """What an implementation must compute for one prefill or decode.

    Keep positions ``[0, keep)`` of the slot, drop the rest, then evaluate ``tokens`` (or
    ``hidden`` rows) at positions ``keep, keep+1, ...``. Return the logits of the last position
    (last shard) or the hidden states of every evaluated position (non-last shard).

    ``deadline`` (``trio.current_time()`` clock; ``inf``: none) is when the result is due; the
    base class sets the slot's cancel flag (reason TIMEOUT) then. A batching implementation
    uses it to size the steps it shares with this one.
    """

    keep: int
    tokens: tuple[int, ...] | None
    hidden: np.ndarray | None
    deadline: float = math.inf
    #: The caller's look-ahead hint, resolved (``shard.engine.lookahead``); implementations
    #: that do not look ahead ignore it.
    lookahead: LookaheadPlan | None = None
    #: Last shard: return the logits of every evaluated position ([n_new, n_vocab]), not only
    #: the last one's (``PrefillRequest.all_logits``).
    all_logits: bool = False

    @property
    def n_new(self) -> int:
        return len(self.tokens) if self.tokens is not None else int(self.hidden.shape[0])


class StreamRun:
    """One ``ShardEngine.stream`` call: the step to compute next and what to do with each
    step computed, shared by the base class and the implementation that runs the steps.

    ``step(raw)`` commits a computed step, hands its result to the caller's ``deliver`` and
    returns the next step's plan (None: the run ends). It never raises, so an implementation
    may call it from any task or callback on the event loop: the result check's error is kept
    in ``fault`` (an engine error), the caller's in ``caller_error``; either ends the run. A
    step whose session was stopped meanwhile (``slot.cancel``), or whose ``stream`` call has
    returned (``closed``), is not committed.
    """

    __slots__ = ("_engine", "_slot", "_caps", "_deliver", "_sampling", "_top_k", "_max",
                 "_lookahead", "_stops", "_eog", "_limit", "plan", "delivered", "fault",
                 "caller_error", "closed")

    def __init__(self, engine: ShardEngine, slot: Slot, caps: Capabilities,
                 request: StreamRequest, deliver: Callable[[StepResult], bool]) -> None:
        self._engine, self._slot, self._caps, self._deliver = engine, slot, caps, deliver
        self._sampling, self._top_k = request.sampling, request.top_k_logprobs
        self._max, self._lookahead = request.max_steps, request.lookahead
        self._stops, self._eog = request.stop_tokens, request.stop_at_eog
        self._limit = min(caps.n_ctx_per_session, slot.kv_budget)
        self.delivered = 0
        self.fault: EngineError | None = None
        self.caller_error: Exception | None = None
        #: The ``stream`` call is over (set before any rollback): nothing is committed after
        #: it, whoever still holds the run (a batched tick that finished its step meanwhile).
        self.closed = False
        self.plan: ComputePlan | None = self._plan(int(request.token))

    @property
    def sampling(self) -> SamplingParams:
        """How the run chooses its tokens (an implementation that chooses beside its rows
        passes its choice to ``step`` as ``chosen``)."""
        return self._sampling

    def _plan(self, token: int) -> ComputePlan:
        left = self._max - self.delivered - 1
        ahead = (LookaheadPlan(self._sampling, left, self._stops, self._eog, self._limit)
                 if self._lookahead and left > 0 else None)
        return ComputePlan(self._slot.n_past, (token,), None, math.inf, ahead)

    def step(self, raw: np.ndarray, chosen: tuple[SamplingParams, int, float] | None = None
             ) -> ComputePlan | None:
        """``chosen``: (sampling, token, log-sum-exp), the token a sampling chose from ``raw``
        and the row's log-sum-exp, when the implementation computed them already; used when
        that sampling is this run's (``_make_result``)."""
        plan, slot = self.plan, self._slot
        self.plan = None
        if plan is None or self.closed or slot.cancel.is_set():
            return None
        known = _known(chosen, self._sampling)
        try:
            result = self._engine._make_result(slot, self._caps, plan, raw, self._sampling,
                                               self._top_k, 0, "decode_tokens_total", known)
        except EngineError as exc:
            self.fault = exc
            return None
        except Exception as exc:  # noqa: BLE001 - a hook (piece, is_eog) misbehaved
            log.exception("engine implementation fault while building a result")
            self.fault = EngineFailure(f"engine fault: {type(exc).__name__}")
            return None
        slot.touched = False  # committed: a later failure keeps it
        self.delivered += 1
        try:
            go = self._deliver(result)
        except Exception as exc:  # noqa: BLE001 - raised to the caller by ShardEngine.stream
            self.caller_error = exc
            return None
        if not go or self.delivered >= self._max or slot.n_past >= self._limit:
            return None
        assert result.logits is not None
        self.plan = self._plan(result.logits.token_id)
        return self.plan


class ShardEngine(abc.ABC):
    """Project-owned engine contract: load, capabilities, prefill/decode, cancel, release,
    health, metrics, close. See docs/engine.md for the state machines."""

    def __init__(self) -> None:
        self._state = EngineState.CREATED
        self._detail = "not loaded"
        self._caps: Capabilities | None = None
        self._slots: dict[str, Slot] = {}
        # A min-heap: a new session takes the lowest free sequence id, so sessions open at the
        # same time hold neighbouring ids (llama.cpp batches runs of consecutive ids together);
        # a session of a batch group takes one next to its group's (shard.engine.seq_ids).
        self._free_seq_ids: list[int] = []
        self._closed = trio.Event()  # set once aclose() has freed everything
        # Tokenizations running in worker threads (tokenize_async); aclose waits for them
        # before it frees the vocabulary they read.
        self._readers = 0
        self._readers_done = trio.Event()
        self._readers_done.set()
        self._counters: dict[str, int] = {
            name: 0 for name in EngineMetrics.__dataclass_fields__ if name.endswith("_total")
        }
        #: ``_impl_compute`` stops by itself when its caller is cancelled: it sets the slot's
        #: cancel flag and returns (raising ``trio.Cancelled``) only once its work stopped
        #: (``BatchScheduler.compute``). Then a one-row step without a timeout (every decode)
        #: is awaited directly, not through ``_run_guarded``'s nursery and task, a third of a
        #: step's scaffolding. (It sets the flag once its tick ended, where the watching task
        #: sets it at once: a prompt chunk stops early only then, so prompts keep the task.)
        self._compute_stops_itself = False

    # ---- implementation hooks --------------------------------------------------------------

    @abc.abstractmethod
    async def _impl_load(self, spec: LoadSpec) -> Capabilities:
        """Load the model and return its capabilities. May block only inside worker threads."""

    @abc.abstractmethod
    async def _impl_compute(self, slot: Slot, plan: ComputePlan) -> np.ndarray:
        """Execute ``plan`` for ``slot``. Check ``slot.cancel`` between steps and raise
        ``EngineCancelled`` when set. Must not return before native work on the slot stops."""

    async def _impl_stream(self, slot: Slot, run: StreamRun) -> None:
        """Compute ``run.plan``, then each plan ``run.step(raw)`` returns, until it returns None
        (``StreamRun``). The default runs each step in the caller's task as ``decode`` does;
        a batching or look-ahead implementation delivers a step where it finished instead, so
        the caller's task sleeps through the run. Cancellation as for ``_impl_compute``."""
        plan = run.plan
        while plan is not None:
            claimed = await self._claim(slot, plan)
            if claimed is not None:
                if slot.cancel.is_set():
                    return
                plan = run.step(claimed.raw, claimed.chosen)
                continue
            if self._compute_stops_itself:
                raw = await self._guard_impl(self._impl_compute(slot, plan))
            else:
                step_plan = plan
                raw = await self._run_guarded(slot, lambda: self._impl_compute(slot, step_plan))
            if slot.cancel.is_set():
                return
            plan = run.step(raw)

    async def _impl_claim(self, slot: Slot, plan: ComputePlan) -> Claimed | None:
        """The result of ``plan`` if the implementation computes it already (a step computed
        ahead), waiting for it; None when it does not (``_impl_compute`` then runs).

        Runs in the caller's cancel scope, unshielded and in the caller's task (no nursery, no
        extra task: this is the path of every generated token), so it must own no native work:
        a claim cancelled while it waits leaves the step to its owner, ready for a later claim.
        It ends early, with ``slot.cancel``'s error, when that flag is set."""
        return None

    @abc.abstractmethod
    async def _impl_truncate(self, slot: Slot, keep: int) -> None:
        """Remove the slot's KV cells at positions ``>= keep`` (``keep=0``: all of them)."""

    @abc.abstractmethod
    def _impl_tokenize(self, text: str, add_bos: bool, parse_special: bool) -> list[int]: ...

    @abc.abstractmethod
    def _impl_token_piece(self, token_id: int) -> bytes: ...

    @abc.abstractmethod
    def _impl_is_eog(self, token_id: int) -> bool: ...

    @abc.abstractmethod
    def _impl_kv_cells_used(self) -> int:
        """KV cells in use, read from the implementation's own state (used to prove no leaks)."""

    async def _impl_export(self, slot: Slot) -> bytes:
        """The slot's KV cells ``[0, n_past)`` as bytes in ``Capabilities.kv_layout`` (engines
        that report a layout). Anything computed ahead is dropped first."""
        raise UnsupportedFeature("this engine cannot export a session")

    async def _impl_import(self, slot: Slot, data: bytes, n_past: int) -> None:
        """Load exported cells into the slot, which holds none: afterwards it holds exactly
        ``[0, n_past)``. On any failure it must hold none again and raise ``IncompatibleState``
        (cells that do not fit: ``KvCacheFull``)."""
        raise UnsupportedFeature("this engine cannot import a session")

    def _impl_state_bound(self, n_past: int) -> int:
        """An upper bound of the bytes ``_impl_export`` returns for ``n_past`` positions, so a
        transport can refuse a larger import before it buffers it."""
        return 0

    def _impl_lookahead_cells(self) -> int:
        """KV cells held by steps computed ahead and not claimed (engines that look ahead)."""
        return 0

    @abc.abstractmethod
    async def _impl_close(self) -> None:
        """Free every native resource. Called once, also after a failure."""

    # ---- lifecycle -------------------------------------------------------------------------

    async def load(self, spec: LoadSpec) -> Capabilities:
        """CREATED -> LOADING -> READY (or FAILED). A second load is an IllegalTransition."""
        if self._state is EngineState.FAILED:
            raise EngineFailure(f"engine failed: {self._detail}")
        if self._state is not EngineState.CREATED:
            raise IllegalTransition(f"engine is {self._state.value}; load is allowed only once")
        self._state, self._detail = EngineState.LOADING, "loading"
        try:
            caps = await self._impl_load(spec)
        except EngineError as exc:
            self._fail(f"load failed: {exc.message}")
            raise
        except trio.Cancelled:
            self._fail("load was cancelled")
            raise
        except Exception as exc:
            log.exception("engine load failed")
            self._fail(f"load failed: {type(exc).__name__}")
            raise EngineFailure(f"load failed: {type(exc).__name__}: {exc}") from exc
        if self._state is EngineState.CLOSED:
            # aclose() ran while loading: it left the native cleanup to us.
            with trio.CancelScope(shield=True):
                await self._impl_close()
            raise NotReady("engine was closed while loading")
        self._caps = caps
        self._free_seq_ids = list(range(caps.max_sessions))  # sorted: already a heap
        self._state, self._detail = EngineState.READY, ""
        return caps

    async def aclose(self) -> None:
        """Release every session and free native resources. Idempotent.

        The engine turns CLOSED at once, so no new work starts while running operations are
        stopped and waited for; native resources are freed exactly once (a concurrent second
        ``aclose`` waits for the first to finish).
        """
        with trio.CancelScope(shield=True):
            if self._state is EngineState.CLOSED:
                await self._closed.wait()
                return
            loading = self._state is EngineState.LOADING
            self._state, self._detail = EngineState.CLOSED, "closed"
            try:
                for slot in list(self._slots.values()):
                    slot.cancel.set()
                for slot in list(self._slots.values()):
                    while slot.state is SessionState.RUNNING:
                        await slot.idle.wait()
                self._slots.clear()
                await self._readers_done.wait()
                if not loading:  # a running load() frees what it loaded when it sees CLOSED
                    await self._impl_close()
            finally:
                self._closed.set()

    async def __aenter__(self) -> ShardEngine:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # ---- queries ---------------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        """NotReady before load and after close; EngineFailure once the engine failed."""
        return self._require_ready()

    def health(self) -> EngineHealth:
        """Never raises; ``ready`` only while the engine can serve new work."""
        return EngineHealth(state=self._state, detail=self._detail)

    def metrics(self) -> EngineMetrics:
        ready = self._state is EngineState.READY
        kv = self._impl_kv_cells_used() if ready else 0
        running = sum(1 for s in self._slots.values() if s.state is SessionState.RUNNING)
        return EngineMetrics(
            sessions_active=len(self._slots),
            kv_cells_used=kv,
            lookahead_cells=self._impl_lookahead_cells() if ready else 0,
            operations_running=running,
            **self._counters,
        )

    def session_info(self, session_id: str) -> SessionInfo:
        """Snapshot of an open session, also while it is RUNNING (never SessionBusy)."""
        return self._slot(session_id, idle=False).info()

    def sessions(self) -> tuple[SessionInfo, ...]:
        return tuple(slot.info() for slot in self._slots.values() if not slot.releasing)

    def tokenize(
        self, text: str, *, add_bos: bool = True, parse_special: bool = False
    ) -> tuple[int, ...]:
        """Token ids for ``text`` (first shards only: a later shard holds no usable vocab).
        ``parse_special``: the texts of special tokens in ``text`` (``<|im_end|>``, the chat
        template's markers) become those tokens; otherwise they are plain text, so that a
        user's text can never forge a turn of a conversation."""
        caps = self._require_ready()
        if not isinstance(text, str):
            raise InvalidInput("text must be a string")
        if not caps.is_first:
            raise IllegalTransition("only a first shard tokenizes text")
        return tuple(self._impl_tokenize(text, add_bos, parse_special))

    async def tokenize_async(
        self, text: str, *, add_bos: bool = True, parse_special: bool = False
    ) -> tuple[int, ...]:
        """``tokenize`` in a worker thread: a long text from a remote caller must not stall the
        event loop (16 MiB of text took 7.5 s on llama.cpp). ``aclose`` waits for it; the caller
        bounds the text's size first (``Capabilities.max_token_bytes``)."""
        caps = self._require_ready()
        if not isinstance(text, str):
            raise InvalidInput("text must be a string")
        if not caps.is_first:
            raise IllegalTransition("only a first shard tokenizes text")
        if self._readers == 0:
            self._readers_done = trio.Event()
        self._readers += 1
        try:
            ids = await trio.to_thread.run_sync(self._impl_tokenize, text, add_bos, parse_special)
        finally:
            self._readers -= 1
            if self._readers == 0:
                self._readers_done.set()
        return tuple(ids)

    def token_piece(self, token_id: int) -> bytes:
        caps = self._require_ready()
        validate_tokens((token_id,), caps.n_vocab)
        return self._impl_token_piece(int(token_id))

    # ---- sessions --------------------------------------------------------------------------

    async def open_session(
        self, session_id: str, *, kv_budget: int | None = None, batch_group: int = 0
    ) -> SessionInfo:
        """Create an empty IDLE session with its own sequence of KV cells. ``batch_group``
        (0..2**32-1; 0: none): a batching engine runs the steps of one group per tick (a
        pipeline's groups then stay out of phase; ``shard.engine.batching``, rule 5); an engine
        that does not batch ignores it."""
        await trio.lowlevel.checkpoint()
        caps = self._require_ready()  # after the checkpoint: the engine may have closed meanwhile
        if not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_SESSION_ID_LEN:
            raise InvalidInput(f"session id must be a non-empty string of <= {MAX_SESSION_ID_LEN}")
        if session_id in self._slots:
            raise SessionExists(f"session {session_id!r} is already open", session_id=session_id)
        if kv_budget is None:
            kv_budget = caps.n_ctx_per_session
        if (
            not isinstance(kv_budget, int)
            or isinstance(kv_budget, bool)
            or not 0 < kv_budget <= caps.n_ctx_per_session
        ):
            raise InvalidInput(
                f"kv_budget must be in [1, {caps.n_ctx_per_session}], got {kv_budget}",
                session_id=session_id,
            )
        if (not isinstance(batch_group, int) or isinstance(batch_group, bool)
                or not 0 <= batch_group < 2**32):
            raise InvalidInput(f"batch_group must be in [0, 2**32), got {batch_group!r}",
                               session_id=session_id)
        if not self._free_seq_ids:
            raise TooManySessions(f"all {caps.max_sessions} sessions are in use")
        if batch_group:  # next to its group's sessions (shard.engine.seq_ids)
            held = {s.seq_id: s.batch_group for s in self._slots.values()}
            seq_id = pick_seq_id(self._free_seq_ids, held, batch_group)
            self._free_seq_ids.remove(seq_id)
            heapq.heapify(self._free_seq_ids)
        else:
            seq_id = heapq.heappop(self._free_seq_ids)
        slot = Slot(session_id=session_id, seq_id=seq_id, kv_budget=kv_budget,
                    batch_group=batch_group)
        slot.idle.set()
        self._slots[session_id] = slot
        self._counters["sessions_opened_total"] += 1
        return slot.info()

    def cancel(self, session_id: str) -> bool:
        """Stop the session's running operation within one step. Idempotent: returns whether
        an operation was running; an unknown session returns False (nothing to stop)."""
        slot = self._lookup(session_id)
        if slot is None or slot.state is not SessionState.RUNNING:
            return False
        slot.cancel.set()
        return True

    async def release(self, session_id: str) -> bool:
        """Cancel any running operation, free the session's KV cells and forget it.

        Idempotent: returns False if the session was not open (or another release of it is
        already in progress). Completes even if the caller is cancelled meanwhile (the cleanup
        is shielded), so no KV cells can leak. From the moment release starts, every other
        operation on the session fails with UnknownSession, so no new operation can slip in
        between the running one stopping and the cells being freed. Never raises because of
        the engine state: on a FAILED or CLOSED engine it only forgets the session.
        """
        slot = self._lookup(session_id)
        if slot is None:
            await trio.lowlevel.checkpoint()
            return False
        slot.releasing = True
        with trio.CancelScope(shield=True):
            slot.cancel.set()
            while slot.state is SessionState.RUNNING:
                await slot.idle.wait()
            if self._slots.get(session_id) is slot:  # aclose() may have cleared the table
                del self._slots[session_id]
            try:
                if self._state is EngineState.READY:
                    await self._guard_impl(self._impl_truncate(slot, 0))
            finally:
                heapq.heappush(self._free_seq_ids, slot.seq_id)
                self._counters["sessions_released_total"] += 1
        return True

    async def truncate(self, session_id: str, keep: int) -> SessionInfo:
        """Drop the session's positions from ``keep`` on, computing nothing (``keep`` at or past
        its end: nothing changes). The session then holds ``[0, keep)`` exactly as before, and
        its next decode appends at ``keep``; a step computed ahead is dropped with the cells.

        Why a call of its own: a prefill at an earlier position also drops what follows it, but
        reuses a held prefix and must compute at least one position; a chain relay that failed
        to forward a step must give back exactly the positions its next hop does not hold.
        Completes even if the caller is cancelled meanwhile (shielded: the cells and the
        session's count never disagree)."""
        self._require_ready()
        slot = self._slot(session_id)
        if not _is_int(keep) or keep < 0:
            raise InvalidInput(f"keep must be an integer >= 0, got {keep!r}", session_id=session_id)
        if keep >= slot.n_past:
            await trio.lowlevel.checkpoint()
            return slot.info()
        slot.state = SessionState.RUNNING
        slot.idle = trio.Event()
        try:
            with trio.CancelScope(shield=True):
                slot.n_past = keep
                if slot.tokens is not None:
                    del slot.tokens[keep:]
                await self._guard_impl(self._impl_truncate(slot, keep))
        finally:
            slot.state = SessionState.IDLE
            slot.idle.set()
        return slot.info()

    # ---- moving a session (hand-off on drain) ----------------------------------------------

    def state_bytes_bound(self, n_past: int) -> int:
        """The most bytes a snapshot of ``n_past`` positions can hold on this engine (0: it
        cannot move sessions). What a transport checks before it buffers an import."""
        caps = self._require_ready()
        if not caps.kv_layout or not _is_int(n_past) or n_past < 0:
            return 0
        return self._impl_state_bound(n_past)

    async def export_session(self, session_id: str) -> SessionSnapshot:
        """The idle session's positions, tokens and KV cells, for another engine of the same
        model, range and ``kv_layout`` to resume (``import_session``). The session itself is
        left as it was (minus any step computed ahead). Why: a draining worker hands its
        sessions to a replica instead of the replica recomputing every history."""
        caps = self._require_ready()
        if not caps.kv_layout:
            raise UnsupportedFeature(f"{caps.engine} engine cannot export a session",
                                     session_id=session_id)
        slot = self._slot(session_id)
        slot.state = SessionState.RUNNING
        slot.idle = trio.Event()
        try:
            with trio.CancelScope(shield=True):  # short, and it only reads the cells
                data = await self._guard_impl(self._impl_export(slot))
        finally:
            slot.state = SessionState.IDLE
            slot.idle.set()
        self._counters["sessions_exported_total"] += 1
        tokens = None if slot.tokens is None else tuple(slot.tokens)
        return SessionSnapshot(slot.n_past, tokens, caps.kv_layout, bytes(data))

    async def import_session(self, session_id: str, snapshot: SessionSnapshot) -> SessionInfo:
        """Give an empty idle session the state another engine exported: afterwards it holds
        ``snapshot.n_past`` positions and continues as the exported one would. A snapshot of
        another layout, one that does not fit the session's budget or one the implementation
        cannot read is refused (``IncompatibleState``, ``KvCacheFull``, ``InvalidInput``) and
        the session stays empty (the caller recomputes the history instead)."""
        caps = self._require_ready()
        if not caps.kv_layout:
            raise UnsupportedFeature(f"{caps.engine} engine cannot import a session",
                                     session_id=session_id)
        slot = self._slot(session_id)
        if not isinstance(snapshot, SessionSnapshot):
            raise InvalidInput("snapshot must be a SessionSnapshot", session_id=session_id)
        if slot.n_past:
            raise IllegalTransition(
                f"session {session_id!r} holds {slot.n_past} positions: a state is imported "
                "only into an empty session", session_id=session_id)
        if snapshot.kv_layout != caps.kv_layout:
            raise IncompatibleState(
                f"the state's KV layout {snapshot.kv_layout!r} is not this engine's "
                f"{caps.kv_layout!r}", session_id=session_id)
        n_past = snapshot.n_past
        if not _is_int(n_past) or n_past < 1:
            raise InvalidInput(f"a state holds at least one position, got {n_past!r}",
                               session_id=session_id)
        self._check_length(slot, caps, n_past)
        if snapshot.tokens is not None:
            if len(snapshot.tokens) != n_past:
                raise InvalidInput(f"the state has {len(snapshot.tokens)} token ids for "
                                   f"{n_past} positions", session_id=session_id)
            validate_tokens(snapshot.tokens, caps.n_vocab)
        elif caps.is_first:
            raise InvalidInput("a first shard's state carries its token ids", session_id=session_id)
        if not isinstance(snapshot.data, bytes) or not snapshot.data:
            raise InvalidInput("the state holds no KV bytes", session_id=session_id)
        bound = self._impl_state_bound(n_past)
        if len(snapshot.data) > bound:
            raise InvalidInput(f"{len(snapshot.data)} bytes of state exceed the {bound} that "
                               f"{n_past} positions take here", session_id=session_id)
        slot.state = SessionState.RUNNING
        slot.idle = trio.Event()
        try:
            with trio.CancelScope(shield=True):
                await self._guard_impl(self._impl_import(slot, snapshot.data, n_past))
            slot.n_past = n_past
            slot.tokens = None if snapshot.tokens is None else list(snapshot.tokens)
        finally:
            slot.state = SessionState.IDLE
            slot.idle.set()
        self._counters["sessions_imported_total"] += 1
        return slot.info()

    async def prefill(self, request: PrefillRequest) -> StepResult:
        """Write prompt tokens or hidden states at ``request.position`` (see PrefillRequest)."""
        caps = self._require_ready()
        slot = self._slot(request.session_id)
        sid = request.session_id
        check_reserved_hooks(request.mtp, request.aux_state, caps)
        self._check_top_k(request.top_k_logprobs, sid)
        self._check_sampling(request.sampling, sid)
        deadline = self._deadline(request.step_timeout, sid)
        has_tokens, has_hidden = request.tokens is not None, request.hidden_states is not None
        if has_tokens == has_hidden:
            raise InvalidInput("prefill needs exactly one of tokens or hidden_states", session_id=sid)
        if not _is_int(request.position) or not 0 <= request.position <= slot.n_past:
            raise InvalidInput(
                f"position {request.position} is outside [0, {slot.n_past}] for this session",
                session_id=sid,
            )
        all_logits = bool(request.all_logits) and caps.is_last
        if all_logits and not 1 <= request.n_tokens <= caps.max_logits_positions:
            raise InvalidInput(
                f"all_logits takes 1 to {caps.max_logits_positions} positions, not "
                f"{request.n_tokens}", session_id=sid,
            )
        reused = 0
        if has_tokens:
            if not caps.is_first:
                raise InvalidInput("this shard does not start at layer 0: send hidden states", session_id=sid)
            validate_tokens(request.tokens, caps.n_vocab)
            if slot.tokens is not None and not all_logits:  # every position's logits are asked
                held = slot.tokens[request.position :]
                limit = min(len(held), len(request.tokens) - 1)  # recompute at least one position
                while reused < limit and held[reused] == request.tokens[reused]:
                    reused += 1
            plan = ComputePlan(
                request.position + reused, request.tokens[reused:], None, deadline,
                None if all_logits else
                self._lookahead_plan(request.lookahead, request.sampling, slot, caps),
                all_logits=all_logits,
            )
        else:
            if caps.is_first:
                raise InvalidInput("a first shard takes token ids, not hidden states", session_id=sid)
            validate_hidden_states(request.hidden_states, caps.n_embd)
            plan = ComputePlan(
                request.position, None, request.hidden_states, deadline, all_logits=all_logits
            )
        self._check_length(slot, caps, request.position + request.n_tokens)
        return await self._run(
            slot, plan, request.sampling, request.top_k_logprobs, reused, "prefill_tokens_total"
        )

    async def decode(self, request: DecodeRequest) -> StepResult:
        """Append one token or hidden-state row and compute one step."""
        caps = self._require_ready()
        slot = self._slot(request.session_id)
        sid = request.session_id
        check_reserved_hooks(request.mtp, request.aux_state, caps)
        self._check_top_k(request.top_k_logprobs, sid)
        self._check_sampling(request.sampling, sid)
        deadline = self._deadline(request.step_timeout, sid)
        if (request.token is None) == (request.hidden_state is None):
            raise InvalidInput("decode needs exactly one of token or hidden_state", session_id=sid)
        if slot.n_past == 0:
            raise IllegalTransition("decode needs a prefilled session", session_id=sid)
        if request.token is not None:
            if not caps.is_first:
                raise InvalidInput("this shard does not start at layer 0: send a hidden state", session_id=sid)
            validate_tokens((request.token,), caps.n_vocab)
            plan = ComputePlan(
                slot.n_past, (int(request.token),), None, deadline,
                self._lookahead_plan(request.lookahead, request.sampling, slot, caps),
            )
        else:
            if caps.is_first:
                raise InvalidInput("a first shard takes token ids, not hidden states", session_id=sid)
            validate_hidden_states(request.hidden_state, caps.n_embd, rows=1)
            plan = ComputePlan(slot.n_past, None, request.hidden_state, deadline)
        self._check_length(slot, caps, slot.n_past + 1)
        return await self._run(
            slot, plan, request.sampling, request.top_k_logprobs, 0, "decode_tokens_total"
        )

    async def stream(self, request: StreamRequest, deliver: Callable[[StepResult], bool]) -> int:
        """Decode ``request.token``, then the token each step chose, until ``deliver`` returns
        False or ``max_steps`` ran; returns the steps delivered (see ``StreamRequest``).

        ``deliver`` gets each step's result, already committed to the session, on the event
        loop but from wherever the implementation finished the step (another session's task
        that ran the tick, a callback of the native thread): it must not block or await, and
        returns whether the run goes on. An exception it raises ends the run and is raised
        here (the engine stays READY). A cancellation (the caller's scope, ``cancel``,
        ``release``) or a failure rolls back only the step in flight: steps delivered stay.
        """
        caps = self._require_ready()
        if not isinstance(request, StreamRequest):
            raise InvalidInput("stream takes a StreamRequest")
        sid = request.session_id
        slot = self._slot(sid)
        self._check_top_k(request.top_k_logprobs, sid)
        self._check_sampling(request.sampling, sid)
        if not (caps.is_first and caps.is_last):
            raise InvalidInput("a stream needs a shard that takes tokens and samples (the whole "
                               "model): decode step by step", session_id=sid)
        if slot.n_past == 0:
            raise IllegalTransition("a stream needs a prefilled session", session_id=sid)
        if not callable(deliver):
            raise InvalidInput("stream needs a deliver callable", session_id=sid)
        validate_tokens((request.token,), caps.n_vocab)
        self._check_length(slot, caps, slot.n_past + 1)
        run = StreamRun(self, slot, caps, request, deliver)

        async def work() -> None:
            try:
                await self._impl_stream(slot, run)
            finally:
                run.closed = True  # (before the rollback: a late step must not commit)
            if run.fault is not None:
                raise run.fault
            if slot.cancel.is_set():
                raise slot.cancel.error(sid)

        await self._running(slot, None, work)
        if run.caller_error is not None:
            raise run.caller_error
        return run.delivered

    # ---- internals -------------------------------------------------------------------------

    def _require_ready(self) -> Capabilities:
        if self._state is EngineState.READY:
            assert self._caps is not None
            return self._caps
        if self._state is EngineState.FAILED:
            raise EngineFailure(f"engine failed: {self._detail}")
        raise NotReady(f"engine is {self._state.value}")

    def _lookup(self, session_id: str) -> Slot | None:
        """The open (not releasing) session with this id; None for anything else."""
        slot = self._slots.get(session_id) if isinstance(session_id, str) else None
        return None if slot is None or slot.releasing else slot

    def _slot(self, session_id: str, *, idle: bool = True) -> Slot:
        slot = self._lookup(session_id)
        if slot is None:
            raise UnknownSession(f"session {session_id!r} is not open", session_id=session_id)
        if idle and slot.state is SessionState.RUNNING:
            raise SessionBusy(f"session {session_id!r} is running an operation", session_id=session_id)
        return slot

    @staticmethod
    def _lookahead_plan(
        hint: Lookahead | None, sampling: SamplingParams, slot: Slot, caps: Capabilities
    ) -> LookaheadPlan | None:
        """The hint as an implementation uses it; None where no step could follow (a step of
        a shard that does not sample, no steps left)."""
        if hint is None:
            return None
        if not isinstance(hint, Lookahead):
            raise InvalidInput("lookahead must be a Lookahead", session_id=slot.session_id)
        if hint.steps == 0 or not caps.is_last:
            return None
        limit = min(caps.n_ctx_per_session, slot.kv_budget)
        return LookaheadPlan(sampling, hint.steps, hint.stop_tokens, hint.stop_at_eog, limit)

    @staticmethod
    def _check_top_k(k: int, sid: str) -> None:
        if not _is_int(k) or not 0 <= k <= MAX_TOP_K_LOGPROBS:
            raise InvalidInput(f"top_k_logprobs must be in [0, {MAX_TOP_K_LOGPROBS}]", session_id=sid)

    @staticmethod
    def _check_sampling(params: SamplingParams, sid: str) -> None:
        # SamplingParams validates itself; anything else would only fail while building the
        # result, which would wrongly turn the engine FAILED.
        if not isinstance(params, SamplingParams):
            raise InvalidInput("sampling must be a SamplingParams", session_id=sid)

    @staticmethod
    def _deadline(timeout: float | None, sid: str) -> float:
        """The step's deadline on the Trio clock (``inf`` without a timeout)."""
        if timeout is None:
            return math.inf
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
            math.isfinite(timeout) and timeout > 0
        ):
            raise InvalidInput("step_timeout must be a finite number of seconds > 0", session_id=sid)
        return trio.current_time() + timeout

    @staticmethod
    def _check_length(slot: Slot, caps: Capabilities, new_len: int) -> None:
        sid = slot.session_id
        if new_len > caps.n_ctx_per_session:
            raise ContextExceeded(
                f"{new_len} positions exceed the per-session context of {caps.n_ctx_per_session}",
                session_id=sid,
            )
        if new_len > slot.kv_budget:
            raise KvCacheFull(
                f"{new_len} positions exceed this session's KV budget of {slot.kv_budget}",
                session_id=sid,
            )

    def _fail(self, detail: str) -> None:
        """Turn the engine FAILED (first failure wins) and stop every running operation."""
        if self._state not in (EngineState.LOADING, EngineState.READY):
            return
        self._state, self._detail = EngineState.FAILED, detail
        for slot in self._slots.values():
            slot.cancel.set()

    async def _guard_impl(self, awaitable: Awaitable[T]) -> T:
        """Turn unexpected implementation exceptions into EngineFailure + FAILED health."""
        try:
            return await awaitable
        except EngineFailure as exc:
            self._fail(exc.message)
            raise
        except (EngineError, trio.Cancelled):
            raise
        except Exception as exc:
            log.exception("engine implementation fault")
            self._fail(f"{type(exc).__name__} in engine")
            raise EngineFailure(f"engine fault: {type(exc).__name__}") from exc

    async def _run(
        self,
        slot: Slot,
        plan: ComputePlan,
        params: SamplingParams,
        top_k: int,
        reused: int,
        counter: str,
    ) -> StepResult:
        """Run one operation with the session marked RUNNING; roll back on any failure.

        A step that its timeout stopped after the result was computed still commits: the
        timeout bounds the wait for a result, and throwing a finished one away would only make
        the next step redo it.
        """
        caps = self._caps
        assert caps is not None

        async def work() -> StepResult:
            claimed = await self._claim(slot, plan)
            raw, chosen = (None, None) if claimed is None else (claimed.raw, _known(claimed.chosen, params))
            if raw is None:
                if self._compute_stops_itself and plan.deadline == math.inf and plan.n_new == 1:
                    # (one row: a prompt's chunks keep the watching task, whose flag stops
                    # a running chunk at once through the abort callback)
                    raw = await self._guard_impl(self._impl_compute(slot, plan))
                else:
                    raw = await self._run_guarded(
                        slot, lambda: self._impl_compute(slot, plan), plan.deadline)
            if slot.cancel.is_set() and not slot.cancel.timed_out:
                raise slot.cancel.error(slot.session_id)
            return self._make_result(slot, caps, plan, raw, params, top_k, reused, counter, chosen)

        return await self._running(slot, plan.keep, work)

    async def _running(self, slot: Slot, keep: int | None, work: Callable[[], Awaitable[T]]) -> T:
        """``work()`` with the session marked RUNNING, counted, and rolled back on failure to
        ``keep`` (None: to what the session holds committed, ``slot.n_past``; a stream commits
        step by step). Shared by single steps (``_run``) and streams.

        A caller whose scope is already cancelled gets ``trio.Cancelled`` before anything is
        touched (a step whose cancel arrived first never starts).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        slot.state = SessionState.RUNNING
        slot.cancel.clear()
        slot.touched = False
        slot.idle = trio.Event()
        committed = False
        try:
            try:
                out = await work()
            except (EngineError, trio.Cancelled, BaseExceptionGroup):
                raise
            except Exception as exc:  # a hook (piece, is_eog) or the result check misbehaved
                log.exception("engine implementation fault while building a result")
                raise EngineFailure(f"engine fault: {type(exc).__name__}") from exc
            committed = keep is not None
            return out
        except EngineCancelled:
            if self._state is EngineState.FAILED:
                # Stopped because the engine failed under it (see _fail), not by a caller.
                self._counters["errors_total"] += 1
                raise EngineFailure(f"engine failed: {self._detail}") from None
            self._counters["cancelled_total"] += 1
            raise
        except EngineFailure as exc:
            self._fail(exc.message)
            self._counters["errors_total"] += 1
            raise
        except EngineError:
            self._counters["errors_total"] += 1
            raise
        except BaseException as exc:
            # The caller's scope stopped the operation (an RPC Cancel, a client reset, a
            # deadline): a cancellation too, though it reaches us as trio.Cancelled (possibly
            # inside the exception group of _run_guarded's nursery).
            if _is_cancellation(exc):
                self._counters["cancelled_total"] += 1
            raise
        finally:
            try:
                if not committed and slot.touched:
                    # Leave the session exactly as it was up to ``keep``. (Untouched: as it was.)
                    with trio.CancelScope(shield=True):
                        back = slot.n_past if keep is None else min(slot.n_past, keep)
                        slot.n_past = back
                        if slot.tokens is not None:
                            del slot.tokens[back:]
                        if self._state is EngineState.READY:
                            try:
                                await self._guard_impl(self._impl_truncate(slot, back))
                            except EngineError:
                                log.warning("rollback of session %s failed", slot.session_id)
            finally:  # never leave a session RUNNING, whatever the rollback raised
                slot.touched = False
                slot.state = SessionState.IDLE
                slot.idle.set()

    async def _claim(self, slot: Slot, plan: ComputePlan) -> Claimed | None:
        """``_impl_claim`` within the step's deadline (past it: ``StepTimeout``)."""
        if plan.deadline == math.inf:  # no step timeout: no cancel scope per token
            return await self._guard_impl(self._impl_claim(slot, plan))
        with trio.move_on_at(plan.deadline):
            return await self._guard_impl(self._impl_claim(slot, plan))
        slot.cancel.set_timeout()
        raise slot.cancel.error(slot.session_id)

    async def _run_guarded(
        self, slot: Slot, fn: Callable[[], Awaitable[T]], deadline: float = math.inf
    ) -> T:
        """Run ``fn`` shielded; a cancellation of the caller sets the slot's cancel flag, and so
        does ``deadline`` (reason TIMEOUT).

        The engine work is never abandoned: if the caller's scope is cancelled, the work is told
        to stop (flag) and waited for, then ``trio.Cancelled`` propagates to the caller.
        """
        box: list[outcome.Outcome] = []
        done = trio.Event()
        async with trio.open_nursery() as nursery:

            async def worker() -> None:
                with trio.CancelScope(shield=True):
                    box.append(await outcome.acapture(self._guard_impl, fn()))
                done.set()

            nursery.start_soon(worker)
            # An event, not the nursery's cancellation, ends the wait: no Cancelled is raised
            # and caught per step, and the deadline needs no task of its own.
            try:
                if math.isfinite(deadline):
                    with trio.move_on_at(deadline):
                        await done.wait()
                    if not done.is_set():
                        slot.cancel.set_timeout()
                await done.wait()
            except trio.Cancelled:
                if not box:
                    slot.cancel.set()
                raise  # once the shielded work is done: the nursery waits for it
        return box[0].unwrap()

    def _make_result(
        self,
        slot: Slot,
        caps: Capabilities,
        plan: ComputePlan,
        raw: np.ndarray,
        params: SamplingParams,
        top_k: int,
        reused: int,
        counter: str,
        chosen: tuple[int, float] | None = None,
    ) -> StepResult:
        """Commit ``plan``'s computed step and build its result. ``chosen`` (a one-row step): the
        token ``params`` chooses and the row's log-sum-exp, computed already by the
        implementation from this very row, which it found finite (see ``_logits_result``)."""
        n_new = plan.n_new
        new_len = plan.keep + n_new
        logits_result = boundary = None
        per_position: tuple[LogitsResult, ...] = ()
        if caps.is_last:
            rows = n_new if plan.all_logits else 1
            logits = np.asarray(raw, dtype=np.float32).reshape(rows, -1)
            if logits.shape[1] != caps.n_vocab or (
                    (chosen is None or rows != 1) and not np.isfinite(logits).all()):
                raise EngineFailure("engine produced invalid logits")
            # Row i ends at position keep + i: sampled as a decode ending there would be (the
            # sampler's stream is keyed by the session length), so a verified draft gives the
            # very tokens plain decoding gives, sampled or greedy.
            if rows == 1:  # (every decode: no generator per step)
                logits_result = self._logits_result(logits[0], params, top_k, new_len, chosen)
                per_position = (logits_result,) if plan.all_logits else ()
            else:
                per_position = tuple(
                    self._logits_result(row, params, top_k, new_len - rows + 1 + i)
                    for i, row in enumerate(logits)
                )
                logits_result = per_position[-1]
        else:
            hidden = np.asarray(raw, dtype=np.float32)
            if hidden.shape != (n_new, caps.n_embd):
                raise EngineFailure("engine produced hidden states of the wrong shape")
            boundary = BoundaryResult(hidden_states=hidden, start_position=plan.keep)
        # Commit the new history.
        if plan.tokens is not None and slot.tokens is not None:
            del slot.tokens[plan.keep :]
            slot.tokens.extend(plan.tokens)
        elif plan.tokens is None:
            slot.tokens = None
        slot.n_past = new_len
        self._counters["steps_total"] += 1
        self._counters[counter] += n_new
        self._counters["reused_tokens_total"] += reused
        return StepResult(
            session_id=slot.session_id,
            n_past=new_len,
            tokens_processed=n_new,
            reused_tokens=reused,
            logits=logits_result,
            boundary=boundary,
            position_logits=per_position,
        )

    def _logits_result(
        self, logits: np.ndarray, params: SamplingParams, top_k: int, n_past: int,
        chosen: tuple[int, float] | None = None,
    ) -> LogitsResult:
        """The token chosen from one position's ``logits`` for a session of ``n_past``;
        ``chosen``: that token and the row's log-sum-exp, already computed."""
        if chosen is None:
            token = sampling.choose_token(logits, params, n_past)
            # greedy chose the (first) maximum: the row's largest value is known
            lse = sampling.logsumexp(logits, logits[token] if params.greedy else None)
        else:
            token, lse = chosen
        return LogitsResult(
            top=tuple(dataclasses.replace(t, piece=self._impl_token_piece(t.token_id))
                      for t in sampling.top_logprobs(logits, top_k, lse)) if top_k > 0 else (),
            token_id=token,
            logprob=float(logits[token]) - lse,
            piece=self._impl_token_piece(token),
            is_eog=self._impl_is_eog(token),
        )


def _is_cancellation(exc: BaseException) -> bool:
    """``trio.Cancelled``, alone or as the only kind of exception in a group."""
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(trio.Cancelled)
        return rest is None
    return isinstance(exc, trio.Cancelled)


_ids = itertools.count()


def new_session_id(prefix: str = "s") -> str:
    """A process-unique session id for callers that do not bring their own."""
    return f"{prefix}-{next(_ids)}"
