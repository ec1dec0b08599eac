"""The ShardEngine contract and the lifecycle rules every implementation inherits.

Why a base class rather than a bare Protocol: the lifecycle semantics (states, busy sessions,
idempotent cancel/release, validation, rollback on failure, honest health) must be *identical*
across engines. They are written once here; implementations only provide the numeric work
through a handful of ``_impl`` hooks (``shard.engine.hooks``). The contract suite in
``shard.testing`` still checks every engine end to end, so a hook that breaks a rule is caught.

What the engine owns lives beside it, one module per concept: the session table
(``sessions``), slots and cancel flags (``slots``), plans and stream runs (``plans``), request
checks (``validation``), result checks (``results``), health and counters (``status``), the
rules of running an operation on a session (``operations``), and the prefix cache kept across
sessions (``prefix_reuse``). This class is the public API that ties them together.

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

import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import TypeVar

import numpy as np
import trio

from .errors import (
    EngineError,
    EngineFailure,
    IllegalTransition,
    InvalidInput,
    NotReady,
    SessionBusy,
    UnsupportedFeature,
)
from . import grammar
from .grammar import GrammarBook
from .hooks import EngineHooks
from .operations import GroupRow, OperationRunner, begin_operation
from .plans import ComputePlan, StreamRun
from .prefix_reuse import PrefixReuse, commit_history
from .results import step_history, step_outputs
from .sessions import SessionTable, new_session_id
from .slots import CancelFlag, CancelReason, Claimed, Slot
from .status import EngineStatus
from .tick_stats import TickDistributions, TickStats
from .types import (
    GRAMMAR_KINDS,
    Capabilities,
    DecodeRequest,
    EngineHealth,
    EngineMetrics,
    EngineState,
    LoadSpec,
    PrefillRequest,
    SamplingParams,
    SessionInfo,
    SessionSnapshot,
    SessionState,
    StepResult,
    StreamRequest,
    validate_tokens,
)
from .validation import (
    MAX_SESSION_ID_LEN,
    MAX_TOP_K_LOGPROBS,
    check_snapshot,
    check_stream,
    check_embed,
    check_tokenize,
    decode_plan,
    is_int,
    prefill_plan,
)

# Also importable from here (their owners are named in the module doc).
__all__ = [
    "MAX_SESSION_ID_LEN", "MAX_TOP_K_LOGPROBS", "CancelFlag", "CancelReason", "Claimed",
    "ComputePlan", "ShardEngine", "Slot", "StreamRun", "new_session_id",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


class ShardEngine(EngineHooks):
    """Project-owned engine contract: load, capabilities, prefill/decode, cancel, release,
    health, metrics, close. See docs/engine.md for the state machines."""

    def __init__(self) -> None:
        self._status = EngineStatus()
        self._counters = self._status.counters  # (implementations and schedulers add to it)
        self._tick_stats = TickStats(self._counters)  # (a batching implementation's scheduler)
        self._caps: Capabilities | None = None
        self._sessions = SessionTable()
        self._slots = self._sessions.slots  # (implementations read it)
        self._runner = OperationRunner(self, self._status, self._sessions)
        self._prefix = PrefixReuse(self, self._runner, self._sessions, self._counters)
        self._closed = trio.Event()  # set once aclose() has freed everything
        # Tokenizations running in worker threads (tokenize_async); aclose waits for them
        # before it frees the vocabulary they read.
        self._readers = 0
        self._readers_done = trio.Event()
        self._readers_done.set()
        self._compute_stops_itself = False  # (``EngineHooks``: an implementation sets it)
        self._grammars: GrammarBook | None = None  # (last shards with the grammar library)
        self._forking: set[str] = set()  # sessions a fork is copying now (others wait for it)

    @property
    def _state(self) -> EngineState:
        """The lifecycle state (implementations read it; ``_status`` owns it)."""
        return self._status.state

    def _impl_stream(self, slot: Slot, run: StreamRun) -> Awaitable[None]:
        """Compute ``run.plan``, then each plan ``run.step(raw)`` returns, until it returns None
        (``StreamRun``). The default runs each step in the caller's task as ``decode`` does
        (``OperationRunner.stream_steps``; its coroutine, so that no frame of this method sits
        above every step); a batching or look-ahead implementation delivers a step where it
        finished instead, so the caller's task sleeps through the run. Cancellation as for
        ``_impl_compute``. An implementation overrides it with an ``async def``."""
        return self._runner.stream_steps(slot, run)

    # ---- lifecycle -------------------------------------------------------------------------

    async def load(self, spec: LoadSpec) -> Capabilities:
        """CREATED -> LOADING -> READY (or FAILED). A second load is an IllegalTransition."""
        status = self._status
        if status.state is EngineState.FAILED:
            raise status.not_ready()
        if status.state is not EngineState.CREATED:
            raise IllegalTransition(f"engine is {status.state.value}; load is allowed only once")
        status.state, status.detail = EngineState.LOADING, "loading"
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
        if status.state is EngineState.CLOSED:
            # aclose() ran while loading: it left the native cleanup to us.
            with trio.CancelScope(shield=True):
                await self._impl_close()
            raise NotReady("engine was closed while loading")
        if caps.is_last and grammar.available():
            self._grammars = GrammarBook(self._impl_grammar_tokenizer)
            caps = dataclasses.replace(caps, grammar_kinds=GRAMMAR_KINDS)
        self._caps = caps
        self._sessions.reset(caps.max_sessions, self._prefix.reset(caps))
        status.state, status.detail = EngineState.READY, ""
        return caps

    async def aclose(self) -> None:
        """Release every session and free native resources. Idempotent.

        The engine turns CLOSED at once, so no new work starts while running operations are
        stopped and waited for; native resources are freed exactly once (a concurrent second
        ``aclose`` waits for the first to finish).
        """
        status = self._status
        with trio.CancelScope(shield=True):
            if status.state is EngineState.CLOSED:
                await self._closed.wait()
                return
            loading = status.state is EngineState.LOADING
            status.state, status.detail = EngineState.CLOSED, "closed"
            try:
                await self._sessions.close_all()
                self._prefix.cache.clear()  # (its cells go with the context)
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
        return self._status.health()

    def metrics(self) -> EngineMetrics:
        """Counters since load and gauges now. ``kv_cells_used`` counts the sessions' cells;
        the prefix cache's are ``prefix_cache_tokens``."""
        ready = self._status.state is EngineState.READY
        cache = self._prefix.cache
        return self._status.metrics(
            sessions=len(self._slots),
            running=self._sessions.running(),
            kv_cells=self._impl_kv_cells_used() - cache.tokens if ready else 0,
            lookahead_cells=self._impl_lookahead_cells() if ready else 0,
            cache_entries=len(cache),
            cache_tokens=cache.tokens,
        )

    def tick_distributions(self) -> TickDistributions:
        """Per-tick distributions since load (duration, rows, sessions, idle gaps; see
        ``shard.engine.tick_stats``); all empty for an engine that does not batch."""
        return self._tick_stats.snapshot()

    def session_info(self, session_id: str) -> SessionInfo:
        """Snapshot of an open session, also while it is RUNNING (never SessionBusy)."""
        return self._sessions.get(session_id, idle=False).info()

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ids of ``tokens`` the prefix cache could serve now (0 without a
        cache). A question only: no entry is marked used, so asking never changes what is
        evicted next; a prefill may still find less (an eviction in between)."""
        self._require_ready()
        return self._prefix.held(tokens)

    def sessions(self) -> tuple[SessionInfo, ...]:
        return self._sessions.infos()

    def tokenize(
        self, text: str, *, add_bos: bool = True, parse_special: bool = False
    ) -> tuple[int, ...]:
        """Token ids for ``text`` (first shards only: a later shard holds no usable vocab).
        ``parse_special``: the texts of special tokens in ``text`` (``<|im_end|>``, the chat
        template's markers) become those tokens; otherwise they are plain text, so that a
        user's text can never forge a turn of a conversation."""
        check_tokenize(text, self._require_ready())
        return tuple(self._impl_tokenize(text, add_bos, parse_special))

    async def tokenize_async(
        self, text: str, *, add_bos: bool = True, parse_special: bool = False
    ) -> tuple[int, ...]:
        """``tokenize`` in a worker thread: a long text from a remote caller must not stall the
        event loop. ``aclose`` waits for it; the caller bounds the text's size first
        (``Capabilities.max_token_bytes``)."""
        check_tokenize(text, self._require_ready())
        return tuple(await self._read_in_thread(self._impl_tokenize, text, add_bos, parse_special))

    async def _read_in_thread(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``, which reads the loaded model (its vocabulary), in a worker thread;
        ``aclose`` waits for it before it frees what it reads."""
        if self._readers == 0:
            self._readers_done = trio.Event()
        self._readers += 1
        try:
            return await trio.to_thread.run_sync(fn, *args)
        finally:
            self._readers -= 1
            if self._readers == 0:
                self._readers_done.set()

    def token_piece(self, token_id: int) -> bytes:
        caps = self._require_ready()
        validate_tokens((token_id,), caps.n_vocab)
        return self._impl_token_piece(int(token_id))

    async def embed(self, tokens: Sequence[int], *, normalize: bool = True) -> np.ndarray:
        """The pooled embedding of ``tokens`` (a float32 vector of ``n_embd``), as the model's
        pooling type pools its last block's output; ``normalize``: scaled to unit L2 norm, as
        llama-server's ``/v1/embeddings`` answers by default. A whole-model engine of a model
        that declares a pooling type only (``Capabilities.embeds``; a partial shard:
        ``IllegalTransition``, no pooling: ``UnsupportedFeature``). The input is one transient
        sequence that no session sees and no cell outlives: between 1 and
        ``n_ctx_per_session`` ids (``InvalidInput``/``ContextExceeded`` otherwise)."""
        await trio.lowlevel.checkpoint()
        ids = check_embed(tokens, self._require_ready())
        vector = await self._guard_impl(self._impl_embed(ids))
        if self._status.state is not EngineState.READY:  # closed (or failed) meanwhile
            raise self._status.not_ready()
        vector = np.asarray(vector, dtype=np.float32).reshape(-1)
        if not np.isfinite(vector).all():
            raise InvalidInput("the embedding holds NaN or infinite values")
        if normalize:
            norm = float(np.linalg.norm(vector.astype(np.float64)))
            vector = (vector / norm if norm > 0 else vector).astype(np.float32)
        return vector

    def check_embeds(self) -> None:
        """Raise what ``embed`` would for any input here (a partial shard, a model that does
        not pool), so a caller refuses a batch before it tokenizes a text of it."""
        check_embed((0,), self._require_ready())

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
        slot = self._sessions.open(session_id, kv_budget, batch_group, caps)
        self._counters["sessions_opened_total"] += 1
        return slot.info()

    async def fork_session(self, source_id: str, session_id: str, *,
                           batch_group: int | None = None) -> SessionInfo:
        """Open ``session_id`` holding a copy of the idle session ``source_id``'s history: its
        KV cells, token ids, positions and KV budget; ``batch_group`` as ``open_session``'s
        (None: the source's). Each then goes on by itself; releasing either leaves the other
        intact.

        Why: ``n`` choices of one prompt prefill it once and fork it, instead of computing the
        same prompt ``n`` times. A step the source computed ahead is dropped first (as an
        export does). Errors as ``open_session`` (``SessionExists``, ``TooManySessions``,
        ``InvalidInput``) and ``UnknownSession``/``SessionBusy`` for the source; on any failure
        the new session is gone again and holds no cells. Forks of one source made at once
        wait for each other (the source is RUNNING only while a copy runs)."""
        await trio.lowlevel.checkpoint()
        while True:  # forks of one source run one after another (each copy is short)
            caps = self._require_ready()
            source = self._sessions.get(source_id, idle=source_id not in self._forking)
            if source.state is not SessionState.RUNNING:
                break
            await source.wait_idle()
        group = source.batch_group if batch_group is None else batch_group
        slot = self._sessions.open(session_id, source.kv_budget, group, caps)
        slot.state, slot.idle = SessionState.RUNNING, trio.Event()  # nothing else runs on it yet
        self._forking.add(source_id)
        try:
            await self._runner.exclusive(source, self._impl_fork(source, slot))
        except BaseException:
            with trio.CancelScope(shield=True):
                self._sessions.forget(slot)
                try:
                    if self._status.state is EngineState.READY:
                        await self._runner.guard(self._impl_truncate(slot, 0))
                finally:
                    self._sessions.free(slot)
            raise
        finally:
            self._forking.discard(source_id)
            slot.state = SessionState.IDLE
            slot.idle.set()
        slot.n_past = source.n_past
        slot.tokens = None if source.tokens is None else list(source.tokens)
        self._counters["sessions_opened_total"] += 1
        self._counters["sessions_forked_total"] += 1
        return slot.info()

    def cancel(self, session_id: str) -> bool:
        """Stop the session's running operation within one step. Idempotent: returns whether
        an operation was running; an unknown session returns False (nothing to stop)."""
        slot = self._sessions.lookup(session_id)
        if slot is None or slot.state is not SessionState.RUNNING:
            return False
        slot.cancel.set()
        return True

    async def release(self, session_id: str) -> bool:
        """Cancel any running operation, free the session's KV cells and forget it. With a
        prefix cache, its history and cells become a cache entry instead (``prefix_reuse``).

        Idempotent: returns False if the session was not open (or another release of it is
        already in progress). Completes even if the caller is cancelled meanwhile (the cleanup
        is shielded), so no KV cells can leak. From the moment release starts, every other
        operation on the session fails with UnknownSession, so no new operation can slip in
        between the running one stopping and the cells being freed. Never raises because of
        the engine state: on a FAILED or CLOSED engine it only forgets the session.
        """
        slot = self._sessions.lookup(session_id)
        if slot is None:
            await trio.lowlevel.checkpoint()
            return False
        slot.releasing = True
        with trio.CancelScope(shield=True):
            slot.cancel.set()
            await slot.wait_idle()
            self._sessions.forget(slot)
            cached = False
            try:
                if self._status.state is EngineState.READY:
                    cached = await self._prefix.keep(slot)
                    if not cached:
                        await self._runner.guard(self._impl_truncate(slot, 0))
            finally:
                self._sessions.free(slot, cached=cached)
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
        slot = self._sessions.get(session_id)
        if not is_int(keep) or keep < 0:
            raise InvalidInput(f"keep must be an integer >= 0, got {keep!r}", session_id=session_id)
        if keep >= slot.n_past:
            await trio.lowlevel.checkpoint()
            return slot.info()
        slot.cut(keep)
        await self._runner.exclusive(slot, self._impl_truncate(slot, keep))
        return slot.info()

    # ---- moving a session (hand-off on drain) ----------------------------------------------

    def state_bytes_bound(self, n_past: int) -> int:
        """The most bytes a snapshot of ``n_past`` positions can hold on this engine (0: it
        cannot move sessions). What a transport checks before it buffers an import."""
        caps = self._require_ready()
        if not caps.kv_layout or not is_int(n_past) or n_past < 0:
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
        slot = self._sessions.get(session_id)
        data = await self._runner.exclusive(slot, self._impl_export(slot))  # short: it only reads
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
        slot = self._sessions.get(session_id)
        check_snapshot(snapshot, slot, caps, self._impl_state_bound)
        await self._runner.exclusive(slot, self._impl_import(slot, snapshot.data, snapshot.n_past))
        slot.n_past = snapshot.n_past
        slot.tokens = None if snapshot.tokens is None else list(snapshot.tokens)
        self._counters["sessions_imported_total"] += 1
        return slot.info()

    # ---- steps -----------------------------------------------------------------------------

    async def prefill(self, request: PrefillRequest) -> StepResult:
        """Write prompt tokens or hidden states at ``request.position`` (see PrefillRequest);
        a start the prefix cache holds is copied, not computed (``StepResult.cached_tokens``)."""
        if getattr(request.sampling, "grammar", None) is not None:
            await self._compile_grammar(request.sampling)
        caps = self._require_ready()
        slot = self._sessions.get(request.session_id)
        plan, reused = prefill_plan(request, slot, caps)
        if request.sampling.grammar is not None and caps.is_last:
            grammar.check_history(slot, plan)
        self._attach_grammar(slot, request.sampling)
        plan = self._prefix.plan(slot, plan, request.cache_limit)
        try:
            return await self._runner.step(slot, caps, plan, request.sampling,
                                           request.top_k_logprobs, reused, "prefill_tokens_total")
        finally:
            self._prefix.done(plan)

    async def decode(self, request: DecodeRequest) -> StepResult:
        """Append one token or hidden-state row and compute one step."""
        if getattr(request.sampling, "grammar", None) is not None:
            await self._compile_grammar(request.sampling)
        caps = self._require_ready()
        slot = self._sessions.get(request.session_id)
        plan = decode_plan(request, slot, caps)
        if request.sampling.grammar is not None and caps.is_last:
            grammar.check_history(slot, plan)
        self._attach_grammar(slot, request.sampling)
        return await self._runner.step(slot, caps, plan, request.sampling,
                                       request.top_k_logprobs, 0, "decode_tokens_total")

    async def decode_group(self, requests: Sequence[DecodeRequest]) -> list[StepResult | EngineError]:
        """Each request's ``decode`` (one row of its own session), submitted together: a
        batching engine queues the rows at once and the caller waits once for all of them
        (one wake-up per tick, not one per row). Returns each row's outcome, in order: its
        result, or the ``EngineError`` its ``decode`` would have raised; a row's failure is
        that row's only. Each row keeps what a decode of its session is: checked alone, its
        session RUNNING while it runs (a session named twice: ``SessionBusy`` for the second),
        stopped alone by ``cancel`` or ``release`` of its session and by its own step timeout
        (``StepTimeout``), rolled back alone. A caller's cancellation stops every row (each
        rolled back as a cancelled decode) and is raised once they all stopped. Every row is
        RUNNING before this yields, except a row with a grammar (compiled first: it runs as
        ``decode`` runs it). Rows a batch cannot take at once (a step computed ahead to claim;
        an engine without a batching scheduler: every row) run as steps of their own,
        concurrently."""
        await trio.lowlevel.checkpoint_if_cancelled()
        outcomes: list[StepResult | EngineError | None] = [None] * len(requests)
        scheduler = self._impl_group_scheduler()
        grouped: list[tuple[int, GroupRow]] = []
        begun: list[tuple[int, Slot, Capabilities, ComputePlan]] = []  # each a step of its own
        grammars: list[int] = []  # compiled first, so RUNNING later: plain decodes
        named: set[str] = set()
        for i, request in enumerate(requests):
            sid = request.session_id
            if sid in named:  # (whichever row of it would start first: the earlier one runs)
                outcomes[i] = SessionBusy(f"session {sid!r} is running an operation", session_id=sid)
                continue
            named.add(sid)
            if getattr(request.sampling, "grammar", None) is not None:
                grammars.append(i)
                continue
            try:
                caps = self._require_ready()
                slot = self._sessions.get(sid)
                plan = decode_plan(request, slot, caps)
                self._attach_grammar(slot, request.sampling)
                job = None if scheduler is None else self._impl_group_job(slot, plan)
            except EngineError as exc:
                outcomes[i] = exc
                continue
            # RUNNING from here, every row before the first checkpoint: a cancel of its session
            # from now on stops it.
            begin_operation(slot)
            if job is None:
                begun.append((i, slot, caps, plan))
            else:
                grouped.append((i, GroupRow(slot, caps, plan, request.sampling, request.top_k_logprobs, job)))

        async def alone(i: int, slot: Slot, caps: Capabilities, plan: ComputePlan) -> None:
            r = requests[i]
            try:
                outcomes[i] = await self._runner.step(slot, caps, plan, r.sampling, r.top_k_logprobs,
                                                      0, "decode_tokens_total", begun=True)
            except EngineError as exc:
                outcomes[i] = exc

        async def decode(i: int) -> None:
            try:
                outcomes[i] = await self.decode(requests[i])
            except EngineError as exc:
                outcomes[i] = exc

        if begun or grammars:
            async with trio.open_nursery() as nursery:
                for i, slot, caps, plan in begun:  # (each task ends its row, even if cancelled)
                    nursery.start_soon(alone, i, slot, caps, plan)
                for i in grammars:
                    nursery.start_soon(decode, i)
                if grouped:
                    assert scheduler is not None
                    await self._runner.group([row for _, row in grouped], scheduler)
        elif grouped:
            assert scheduler is not None
            await self._runner.group([row for _, row in grouped], scheduler)
        for i, row in grouped:
            outcomes[i] = row.result if row.error is None else row.error
        assert all(o is not None for o in outcomes)
        return outcomes  # type: ignore[return-value]

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
        if not isinstance(request, StreamRequest):
            raise InvalidInput("stream takes a StreamRequest")
        if getattr(request.sampling, "grammar", None) is not None:
            await self._compile_grammar(request.sampling)
        caps = self._require_ready()
        sid = request.session_id
        slot = self._sessions.get(sid)
        check_stream(request, slot, caps, deliver)
        self._attach_grammar(slot, request.sampling)
        run = StreamRun(self._make_result, slot, caps, request, deliver)

        async def work() -> None:
            try:
                await self._impl_stream(slot, run)
            finally:
                run.closed = True  # (before the rollback: a late step must not commit)
            if run.fault is not None:
                raise run.fault
            if slot.cancel.is_set():
                raise slot.cancel.error(sid)

        await self._runner.running(slot, None, work)
        if run.caller_error is not None:
            raise run.caller_error
        return run.delivered

    # ---- internals -------------------------------------------------------------------------

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Compile ``params.grammar`` (last shards; a later step finds it cached) in a worker
        thread: a large schema takes longer than a step. InvalidInput when it does not compile;
        UnsupportedFeature on a last shard without the grammar library."""
        caps = self._require_ready()
        spec = params.grammar
        if not caps.is_last:
            await trio.lowlevel.checkpoint()
            return
        book = self._grammars
        if book is None:
            raise UnsupportedFeature("constrained decoding (grammar) is not available here")
        if book.cached(spec):
            await trio.lowlevel.checkpoint()
            return
        await self._read_in_thread(book.compile, spec)

    def _attach_grammar(self, slot: Slot, params: SamplingParams) -> None:
        """The session's matcher for the operation about to run (``GrammarBook.attach``)."""
        book = self._grammars
        if book is not None and (params.grammar is not None or slot.grammar is not None):
            book.attach(slot, params.grammar)

    def _mask_tick(self, steps: Sequence[tuple[Slot, ComputePlan]]) -> None:
        """Where an implementation finished a tick (any thread, before the steps' callers are
        woken): the grammar masks of its one-row steps, computed together
        (``GrammarBook.mask_tick``). Never raises: a mask not computed here is computed alone
        when the step's result is built."""
        book, caps = self._grammars, self._caps
        if book is None or caps is None:
            return
        try:
            book.mask_tick(steps, caps.n_vocab)
        except Exception:  # noqa: BLE001 - each mask is then computed alone, or fails there
            log.exception("grammar masks of a tick could not be computed together")

    def _require_ready(self) -> Capabilities:
        if self._status.state is EngineState.READY:
            assert self._caps is not None
            return self._caps
        raise self._status.not_ready()

    # The runner's methods under the names implementations call. Each returns the runner's
    # coroutine rather than awaiting it, so a step pays a plain call, not another frame.

    def _fail(self, detail: str) -> None:
        """Turn the engine FAILED (first failure wins) and stop every running operation."""
        self._runner.fail(detail)

    def _guard_impl(self, awaitable: Awaitable[T]) -> Awaitable[T]:
        """Turn unexpected implementation exceptions into EngineFailure + FAILED health."""
        return self._runner.guard(awaitable)

    def _claim(self, slot: Slot, plan: ComputePlan) -> Awaitable[Claimed | None]:
        """``_impl_claim`` within the step's deadline (past it: ``StepTimeout``)."""
        return self._runner.claim(slot, plan)

    def _run_guarded(
        self, slot: Slot, fn: Callable[[], Awaitable[T]], deadline: float = math.inf
    ) -> Awaitable[T]:
        """``fn()`` shielded, never abandoned; the caller's cancellation or ``deadline`` sets
        the slot's cancel flag (``OperationRunner.run_guarded``)."""
        return self._runner.run_guarded(slot, fn, deadline)

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
        implementation from this very row, which it found finite (``results.step_outputs``)."""
        n_new = plan.n_new
        book = self._grammars
        constrain = (book.constrain(slot, plan, params.grammar)
                     if params.grammar is not None and book is not None else None)
        history = (step_history(slot, plan, params.penalty_last_n)
                   if params.penalized and caps.is_last else None)
        logits, per_position, boundary, input_logprobs = step_outputs(
            caps, plan, n_new, raw, params, top_k, chosen, self._impl_token_piece, self._impl_is_eog,
            constrain, history)
        new_len = plan.keep + n_new
        counters = self._counters
        # Commit the new history.
        if plan.tokens is not None and slot.tokens is not None and not plan.cached_ids:
            del slot.tokens[plan.keep :]
            slot.tokens.extend(plan.tokens)
        else:  # hidden states, or a start copied from the prefix cache
            commit_history(slot, plan, counters)
        slot.n_past = new_len
        counters["steps_total"] += 1
        counters[counter] += n_new
        counters["reused_tokens_total"] += reused
        return StepResult(
            session_id=slot.session_id,
            n_past=new_len,
            tokens_processed=n_new,
            reused_tokens=reused,
            cached_tokens=len(plan.cached_ids),
            logits=logits,
            boundary=boundary,
            position_logits=per_position,
            input_logprobs=input_logprobs,
        )
