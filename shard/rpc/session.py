"""One ``Session`` stream: an explicit state machine running in its own nursery.

Why a separate task tree: a purerpc handler for a bidi stream is an async generator, and a
nursery or cancel scope must never stay open across a ``yield`` (the consumer's code would run
inside it). So each stream's work runs in a ``SessionCall`` task owned by the registry's
nursery; the handler only moves messages from ``SessionCall.responses`` to the wire and, when the
wire goes away, calls ``SessionCall.end(reason)`` and waits for ``done``.

State machine (``Phase``)::

    AWAITING_OPEN --OpenSession--> IDLE --Prefill/Decode/Generate--> RUNNING --done--> IDLE
    IDLE|RUNNING --CloseSession / half-close--> CLOSING --running step done--> CLOSED
    any --fatal error / deadline / end(reason)--> CLOSED

Anything else is a protocol violation and ends the stream with ILLEGAL_TRANSITION (a message
before OpenSession, a second OpenSession, a step while a step runs, anything after
CloseSession; the one exception is a session opened with a filled-in ``route.return_to``,
where one step may queue behind the running one, see ``shard.rpc.relaying``). Request-level problems (bad token ids, wrong hidden-state shape or dtype, a full
KV budget, a step deadline, an out-of-band Cancel) are *step-level*: reported in-stream as
``SessionResponse.error`` and the session stays usable. Every Prefill/Decode/Generate is answered
by zero or more ``StepResult``, an optional ``Error``, then exactly one ``Usage``.

Resource handling: the task owns the engine session from OpenSession until it either releases
it or hands it to the registry as *retained* (kept for ``resume_ttl`` so a new stream can resume
it). The cleanup runs shielded, so a cancelled or failed stream never leaks KV cells.

Cancellation: an out-of-band Cancel is remembered from the moment a step is dispatched and stops
it at its next credit wait or engine call (``_cancellable``); handing a computed result to the
transport is never cancelled by it, so ``Usage`` counts exactly the results sent and the session
holds what they say. If the stream itself ends first, a retained session resumes from what was
handed to the transport (``_delivered_end``).

Flow control: responses leave through a bounded memory channel (capacity ``max_credit`` + a few
control messages). Each result needs one credit, taken *before* the engine computes it (and
given back if the step ends without a result), so a client that stops granting credit parks
generation at once and at most ``credit`` results are ever buffered. A boundary result larger
than one message is sent as several ``StepResult`` chunks (``more_chunks``) for one credit.
After the client half-closes or sends CloseSession it can no longer grant credit; from then on
only HTTP/2 flow control (through the same bounded channel) paces the stream.

Deadlines: the task's cancel scope carries the call deadline (``grpc-timeout``); expiry releases
the session and ends the stream with DEADLINE_EXCEEDED. ``OpenSession.step_timeout_ms`` bounds
each engine call; expiry is a step-level DEADLINE_EXCEEDED (the engine rolls the step back).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import sys
from collections.abc import AsyncIterable, Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import trio
from google.protobuf.message import DecodeError
from trio_util import AsyncBool, AsyncValue

from shard.engine import (
    Capabilities,
    DecodeRequest,
    EngineError,
    EngineState,
    InvalidInput,
    KvCacheFull,
    Lookahead,
    PrefillRequest,
    SamplingParams,
    ShardEngine,
    StepResult,
    StepTimeout,
    TooManySessions,
)
from shard.v1 import shard_pb2 as pb

from . import convert
from .errors import FATAL_IN_SESSION, ErrorCode, ShardError, internal_error
from .relaying import Downstream, RelayOpener, RelaySteps, Returner, check_return, check_route
from .returns import DirectReturns
from .versions import check_version

log = logging.getLogger(__name__)
R = TypeVar("R", PrefillRequest, DecodeRequest)

UNLIMITED_CREDIT = sys.maxsize
MAX_SESSION_ID_BYTES = 128
_CONTROL_SLOTS = 4  # opened + error + usage + closed never need credit
# Room left in each message for everything but the hidden-state rows (step fields, framing).
_CHUNK_OVERHEAD = 4096
_FLOAT32_BYTES = 4  # the widest wire dtype: a row never takes more than 4 * n_embd bytes
#: A text longer than this many times ``max_token_bytes`` per position of room is refused
#: before tokenization (slack for tokenizers that normalise text away, e.g. runs of spaces).
_TEXT_SLACK = 4


LOOKAHEAD_MODES = ("auto", "generate", "off")


@dataclass(frozen=True)
class SessionLimits:
    """Per-stream bounds; test defaults are the production defaults."""

    default_credit: int = 16  # OpenSession.initial_credit == 0
    max_credit: int = 64  # outstanding step messages a client may grant (channel capacity)
    resume_ttl: float = 30.0  # seconds a retained session keeps its KV cache
    close_linger: float = 5.0  # seconds to wait for the client's half-close after CloseSession
    #: Which steps ask the engine to compute the next one ahead (docs/engine.md, "Look-ahead"):
    #: "auto" (Generate, and client steps of a client that decoded the token the worker sampled
    #: last time), "generate" (Generate only) or "off".
    lookahead: str = "auto"

    def __post_init__(self) -> None:
        if not 1 <= self.default_credit <= self.max_credit:
            raise ValueError("need 1 <= default_credit <= max_credit")
        if self.lookahead not in LOOKAHEAD_MODES:
            raise ValueError(f"lookahead must be one of {', '.join(LOOKAHEAD_MODES)}")
        for name in ("resume_ttl", "close_linger"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0")

    @property
    def resume_ttl_ms(self) -> int:
        return int(self.resume_ttl * 1000)


@dataclass(frozen=True)
class Retained:
    """A session whose stream ended but whose KV cache is kept for resume."""

    session_id: str
    expires_at: float  # trio.current_time() based
    end: int  # positions the client may resume from (what it was sent)
    engine_len: int  # positions the engine holds (>= end)
    kv_capacity: int


class SessionHost(Protocol):
    """What a ``SessionCall`` needs from the table of sessions it lives in (the ``Registry``).

    Why a protocol: the registry creates and owns calls, so the call must not import it back;
    tests can also host a call in something smaller.
    """

    draining: bool

    def claim(self, session_id: str, call: SessionCall, *, resuming: bool) -> Retained | None: ...

    def unclaim(self, session_id: str, call: SessionCall) -> None: ...

    def retain(self, session_id: str, *, end: int, engine_len: int, kv_capacity: int) -> bool: ...

    async def release_owned(self, session_id: str) -> None: ...

    async def evict_one(self) -> bool: ...

    def count(self, name: str, n: int = 1) -> None: ...

    def count_error(self, code: ErrorCode) -> None: ...


class Phase(enum.Enum):
    AWAITING_OPEN = "awaiting_open"
    IDLE = "idle"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class StreamEnd(enum.Enum):
    """Why a stream ended from outside the state machine; decides release vs. retain."""

    DEADLINE = "deadline"  # released
    CLIENT_CANCELLED = "client_cancelled"  # RST_STREAM: released
    CONNECTION_LOST = "connection_lost"  # retained for resume_ttl
    SHUTDOWN = "shutdown"  # released
    RELEASED = "released"  # Release RPC: released
    SEND_STALLED = "send_stalled"  # the client read no response for send_idle_timeout: released


_RETAIN_ON_END = frozenset({StreamEnd.CONNECTION_LOST})
_CLOSED_REASON = {
    StreamEnd.DEADLINE: pb.SessionClosed.REASON_ERROR,
    StreamEnd.CLIENT_CANCELLED: pb.SessionClosed.REASON_ERROR,
    StreamEnd.CONNECTION_LOST: pb.SessionClosed.REASON_ERROR,
    StreamEnd.SHUTDOWN: pb.SessionClosed.REASON_SHUTDOWN,
    StreamEnd.RELEASED: pb.SessionClosed.REASON_RELEASED,
    StreamEnd.SEND_STALLED: pb.SessionClosed.REASON_ERROR,
}


def _illegal(message: str, session_id: str = "") -> ShardError:
    return ShardError(ErrorCode.ILLEGAL_TRANSITION, message, session_id=session_id)


class SessionCall(RelaySteps):
    """The server side of one ``Session`` stream (see the module docstring).

    Created and started by ``Registry.start_call``. Public surface for the handler and the
    registry: ``responses`` (receive channel), ``end(reason)``, ``done``, ``error``;
    ``cancel_step()`` for the Cancel RPC; ``phase``, ``credit``, ``parked`` and ``buffered()`` for
    observers and tests.
    """

    def __init__(
        self,
        *,
        engine: ShardEngine,
        registry: SessionHost,
        limits: SessionLimits,
        requests: AsyncIterable[pb.SessionRequest],
        deadline: float = math.inf,
        max_message_bytes: int = 16 * 1024 * 1024,
        relay: RelayOpener | None = None,
    ) -> None:
        self._engine = engine
        self._relay = relay  # opens a routed session's downstream (None: routes are refused)
        self._downstream: Downstream | None = None  # a routed session's next hop
        #: A routed first hop's return address (the Return RPC hands results to it), if any.
        self.direct_returns: DirectReturns | None = None
        self._returner: Returner | None = None  # a last hop's pusher to the return address
        self._queue_ok = False  # on a route with a return address: one step may queue
        self._queued: pb.SessionRequest | None = None  # the step queued behind the running one
        self._registry = registry
        self._limits = limits
        self._max_message_bytes = max_message_bytes
        self._requests = requests
        self._deadline = deadline
        send, recv = trio.open_memory_channel[pb.SessionResponse](limits.max_credit + _CONTROL_SLOTS)
        self._outbox = send
        self.responses: trio.MemoryReceiveChannel[pb.SessionResponse] = recv

        self.phase: AsyncValue[Phase] = AsyncValue(Phase.AWAITING_OPEN)
        self.credit: AsyncValue[int] = AsyncValue(0)
        self.parked = AsyncBool(False)  # a step waits for credit
        self.done = trio.Event()
        self.error: ShardError | None = None  # the fatal error the stream ends with, if any
        self.session_id = ""

        self._scope = trio.CancelScope(deadline=deadline)
        self._end_reason: StreamEnd | None = None
        self.ended_at: float | None = None  # trio time the stream was told to stop (observers)
        self._nursery: trio.Nursery | None = None
        self._reader_scope = trio.CancelScope()
        self._step_scope: trio.CancelScope | None = None  # the running cancellable region
        self._step_active = AsyncBool(False)  # from dispatch until the step's Usage is queued
        self._cancel_requested = False  # a Cancel for the current step (survives region gaps)
        self._step_finishing = False  # the step's work is over; only its Error/Usage remain
        self._credit_unspent = False  # a credit was taken for a result not sent (yet)
        self._owns_engine_session = False  # the engine session exists and is ours to free
        self._caps: Capabilities | None = None
        self._wire_dtype = convert.HIDDEN_DTYPE  # hidden states on the wire, both directions
        self._kv_capacity = 0
        self._step_timeout: float | None = None  # seconds per engine step (step_timeout_ms)
        self._version = (1, 0)  # the protocol version the session was opened with
        self._end = 0  # logical end of the session (positions the client may build on)
        self._engine_len = 0  # positions the engine holds (>= _end after a partial resume)
        self._delivered_end = 0  # positions whose results were handed to the transport
        self._next_token: int | None = None  # token chosen by the last logits step
        # The client's last Decode sent the token the worker had sampled (look-ahead pays).
        self._follows = False
        self._step_no = 0
        self._totals = pb.Usage()

    # ---- control from outside -------------------------------------------------------------

    def end(self, reason: StreamEnd) -> None:
        """Stop the stream because its consumer went away (or Release/shutdown). Idempotent."""
        if self._end_reason is None:
            self._end_reason = reason
            self.ended_at = trio.current_time()
        self._scope.cancel()

    def cancel_step(self) -> bool:
        """Out-of-band Cancel: stop the running step (the engine stops within one step).

        The request is remembered from the moment the step is dispatched, so a Cancel that
        lands before the step's task starts, or while a committed result waits for room in
        the response channel, still stops the step at its next credit wait or engine call.
        Results already computed are delivered, never dropped.
        """
        if not self._step_active.value or self._step_finishing:
            return False
        self._cancel_requested = True
        if self._step_scope is not None:
            self._step_scope.cancel()
        if self._downstream is not None:
            self._downstream.cancel()  # a step in flight downstream stops there too
        return True

    def buffered(self) -> int:
        """Responses produced but not yet taken by the transport (bounded by the channel)."""
        return self._outbox.statistics().current_buffer_used

    @property
    def running(self) -> bool:
        return self._step_active.value

    @property
    def deadline(self) -> float:
        """The call deadline (trio clock); ``inf`` without ``grpc-timeout``."""
        return self._deadline

    # ---- the task -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The stream's task; started by the registry in its nursery."""
        task_status.started()
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    nursery.start_soon(self._guarded, self._read_requests)
            if (
                self._scope.cancelled_caught
                and self._end_reason is None
                and self.error is None
                and trio.current_time() >= self._deadline
            ):
                self._end_reason = StreamEnd.DEADLINE
                self.ended_at = self._deadline
                self.error = ShardError(
                    ErrorCode.DEADLINE_EXCEEDED, "the call deadline expired", session_id=self.session_id
                )
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await self._finish()
                except Exception:  # never leak KV cells because of a bug in the cleanup
                    log.exception("session %r: cleanup failed", self.session_id)
            self._outbox.close()
            self.done.set()

    async def _guarded(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run a child task; errors become the stream's fatal error instead of escaping."""
        try:
            await fn()
        except ShardError as err:
            self._fail(err)
        except EngineError as exc:  # e.g. a release on a failing engine: keep its meaning
            self._fail(ShardError.from_engine(exc))
        except Exception:
            log.exception("session %r: internal error", self.session_id)
            self._fail(internal_error(self.session_id))

    def _fail(self, err: ShardError) -> None:
        """End the stream with ``err`` (first error wins); the session is released."""
        if self.error is None:
            if not err.session_id:
                err.session_id = self.session_id
            self.error = err
        if self.ended_at is None:
            self.ended_at = trio.current_time()
        self._scope.cancel()

    # ---- reading requests -----------------------------------------------------------------

    async def _read_requests(self) -> None:
        requests = self._requests
        try:
            with self._reader_scope:
                try:
                    async for req in requests:
                        await self._dispatch(req)
                except DecodeError:
                    raise convert.invalid("a SessionRequest could not be parsed", self.session_id) from None
                if self.phase.value is not Phase.CLOSED:
                    await self._on_half_close()
        finally:
            aclose = getattr(requests, "aclose", None)
            if aclose is not None:
                with trio.CancelScope(shield=True):
                    await aclose()

    async def _dispatch(self, req: pb.SessionRequest) -> None:
        sid = self.session_id
        version = check_version(req, sid)
        kind = req.WhichOneof("kind")
        phase = self.phase.value
        if phase in (Phase.CLOSING, Phase.CLOSED):
            raise _illegal(f"{kind or 'a message'} after CloseSession", sid)
        if kind is None:
            raise convert.invalid("empty SessionRequest (no kind set)", sid)
        if phase is Phase.AWAITING_OPEN:
            if kind != "open":
                raise _illegal(f"{kind} before OpenSession", sid)
            await self._open(req.open, version)
            return
        if kind == "open":
            raise _illegal("a second OpenSession on the same stream", sid)
        if kind == "credit":
            self._grant(req.credit.messages)
        elif kind == "close":
            await self._close_requested(retain=req.close.retain, half_close=False)
        elif phase is Phase.RUNNING:
            if self._queue_ok and self._queued is None:
                self._queued = req  # a direct-return route's next step: run when this one ends
                return
            raise _illegal(f"{kind} while a step is running (steps never interleave)", sid)
        else:
            assert self._nursery is not None
            self.phase.value = Phase.RUNNING
            self._cancel_requested = self._step_finishing = False
            self._step_active.value = True  # from here on a Cancel is never lost
            self._nursery.start_soon(self._guarded, lambda: self._run_step(req))

    async def _on_half_close(self) -> None:
        if self.phase.value is Phase.AWAITING_OPEN:
            raise _illegal("the request stream ended before OpenSession")
        await self._close_requested(retain=True, half_close=True)

    def _grant(self, messages: int) -> None:
        if self.credit.value != UNLIMITED_CREDIT:
            self.credit.value = min(self.credit.value + messages, self._limits.max_credit)

    # ---- open -----------------------------------------------------------------------------

    async def _open(self, req: pb.OpenSession, version: tuple[int, int]) -> None:
        sid = req.session_id
        if not sid or len(sid.encode("utf-8")) > MAX_SESSION_ID_BYTES:
            raise convert.invalid(f"session_id must be 1..{MAX_SESSION_ID_BYTES} bytes")
        try:
            caps = self._engine.capabilities()
        except EngineError as exc:
            raise ShardError.from_engine(exc) from None
        if self._registry.draining:
            raise ShardError(ErrorCode.DRAINING, session_id=sid)
        self._check_model(req, caps, sid)
        routed = req.HasField("route") and len(req.route.hops) > 0
        if routed:
            check_route(self._relay, req, caps, sid)
        returning = req.HasField("route") and bool(req.route.return_to.session_id)
        if returning and not routed:
            check_return(self._relay, req, caps, sid)
        wire_dtype = convert.wire_dtype(req.hidden_wire_dtype, sid)
        if req.kv_budget > caps.n_ctx_per_session:
            raise convert.invalid(
                f"kv_budget {req.kv_budget} exceeds n_ctx_per_session {caps.n_ctx_per_session}", sid
            )
        expectation = req.cache if req.HasField("cache") else None
        retained = self._registry.claim(sid, self, resuming=expectation is not None)
        self.session_id = sid  # claimed: from here on the cleanup frees or returns it
        self._caps = caps
        self._version = version
        self._wire_dtype = wire_dtype
        self._step_timeout = req.step_timeout_ms / 1000 if req.step_timeout_ms else None
        cache = await self._attach_kv(sid, req.kv_budget or None, expectation, retained)
        if routed:
            assert self._relay is not None and self._nursery is not None
            return_to = req.route.return_to if returning else None
            if req.route.return_to.target and not returning and len(req.route.hops) >= 2:
                # the client asks for a direct return to this (first) hop: this worker owns it
                self.direct_returns = DirectReturns(sid)
                return_to = self.direct_returns.address(req.route.return_to.target)
            self._downstream = await self._relay.open(
                req.route, session_id=sid, deadline=self._deadline, hidden_dtype=wire_dtype,
                nursery=self._nursery, return_to=return_to,
            )
            if not self._downstream.pipelined:
                self.direct_returns = None  # the next hop takes no part: answers come up the chain
            self._kv_capacity = min(self._kv_capacity, self._downstream.kv_capacity)
        elif returning:
            assert self._relay is not None and self._nursery is not None
            self._returner = await self._relay.open_return(
                req.route.return_to, deadline=self._deadline, nursery=self._nursery
            )
        self._queue_ok = returning
        self._delivered_end = self._end
        credit = min(req.initial_credit or self._limits.default_credit, self._limits.max_credit)
        self.credit.value = credit
        self.phase.value = Phase.IDLE
        await self._send(
            pb.SessionResponse(
                opened=pb.SessionOpened(
                    session_id=sid,
                    cache=cache,
                    kv_capacity=self._kv_capacity,
                    n_past=self._end,
                    credit=credit,
                    version=pb.ProtocolVersion(major=version[0], minor=version[1]),
                    # echoed only when asked, so that v1.0 clients see the same bytes as before
                    hidden_wire_dtype=wire_dtype if req.hidden_wire_dtype else "",
                )
            )
        )

    @staticmethod
    def _check_model(req: pb.OpenSession, caps: Capabilities, sid: str) -> None:
        if req.expected_model_fingerprint and req.expected_model_fingerprint != caps.model_fingerprint:
            raise ShardError(
                ErrorCode.INCOMPATIBLE_MODEL,
                f"this worker serves model {caps.model_fingerprint}, "
                f"not {req.expected_model_fingerprint}",
                session_id=sid,
            )
        if req.HasField("expected_layer_range"):
            want, have = req.expected_layer_range, caps.layer_range
            if (want.start, want.end) != (have.start, have.end):
                raise ShardError(
                    ErrorCode.INCOMPATIBLE_MODEL,
                    f"this worker serves layers [{have.start}, {have.end}), "
                    f"not [{want.start}, {want.end})",
                    session_id=sid,
                )

    async def _attach_kv(
        self,
        sid: str,
        kv_budget: int | None,
        expectation: pb.CacheExpectation | None,
        retained: Retained | None,
    ) -> pb.CacheResult:
        """Resume a retained session or open a fresh one; return the cache outcome."""
        R = pb.CacheResult
        if retained is not None:
            assert expectation is not None
            self._owns_engine_session = True
            outcome, held, reason = self._compare(sid, retained, expectation)
            if outcome in (R.OUTCOME_HIT, R.OUTCOME_PARTIAL):
                self._end = held
                self._engine_len = retained.engine_len
                self._kv_capacity = retained.kv_capacity
                self._registry.count("sessions_resumed_total")
                return R(outcome=outcome, tokens_held=held, reason=reason)
            # Mismatch: the held cache is of no use to this client. Clear it, start empty.
            await self._engine.release(sid)
            self._owns_engine_session = False
            await self._open_fresh(sid, kv_budget)
            return R(outcome=outcome, tokens_held=0, reason=reason)
        await self._open_fresh(sid, kv_budget)
        if expectation is None:
            return R(outcome=R.OUTCOME_NEW)
        return R(outcome=R.OUTCOME_MISS, reason="no retained session with this id (expired or released)")

    def _compare(
        self, sid: str, retained: Retained, exp: pb.CacheExpectation
    ) -> tuple[int, int, str]:
        """Check a CacheExpectation against what the retained session holds."""
        R = pb.CacheResult
        try:
            tokens = self._engine.session_info(sid).tokens
        except EngineError:
            return R.OUTCOME_MISMATCH, 0, "the retained session is gone from the engine"
        held = retained.end
        if not exp.prefix_sha256:  # count-only expectation (e.g. a hidden-state shard)
            if exp.n_tokens <= held:
                return R.OUTCOME_HIT, exp.n_tokens, ""
            return R.OUTCOME_PARTIAL, held, f"only {held} of {exp.n_tokens} positions are held"
        if tokens is None:
            return R.OUTCOME_MISMATCH, 0, "the session holds hidden states; token digests cannot be checked"
        if exp.n_tokens > held:
            return R.OUTCOME_MISMATCH, 0, f"the expectation covers {exp.n_tokens} tokens, {held} are held"
        if convert.prefix_sha256(tokens[: exp.n_tokens]) != exp.prefix_sha256:
            return R.OUTCOME_MISMATCH, 0, "the held tokens differ from the expected prefix"
        return R.OUTCOME_HIT, exp.n_tokens, ""

    async def _open_fresh(self, sid: str, kv_budget: int | None) -> None:
        while True:
            try:
                info = await self._engine.open_session(sid, kv_budget=kv_budget)
                break
            except TooManySessions as exc:
                # Retained sessions are a best-effort cache: evict the oldest before refusing.
                if not await self._registry.evict_one():
                    raise ShardError.from_engine(exc) from None
            except EngineError as exc:
                raise ShardError.from_engine(exc) from None
        self._owns_engine_session = True
        self._kv_capacity = info.kv_budget
        self._end = self._engine_len = 0

    # ---- close ----------------------------------------------------------------------------

    async def _close_requested(self, *, retain: bool, half_close: bool) -> None:
        """CloseSession or half-close: let the running step finish, then release or retain."""
        self.phase.value = Phase.CLOSING
        self.credit.value = UNLIMITED_CREDIT  # the client can no longer grant credit
        await self._step_active.wait_value(False)
        if self._downstream is not None:
            await self._downstream.close()
        C = pb.SessionClosed
        reason = C.REASON_CLIENT_HALF_CLOSE if half_close else C.REASON_CLIENT_CLOSE
        closed = await self._close(retain=retain, reason=reason)
        await self._send(pb.SessionResponse(closed=closed))
        if not half_close:
            # Keep reading until the client half-closes, so that anything it sends after
            # CloseSession is refused with ILLEGAL_TRANSITION rather than silently dropped.
            self._reader_scope.deadline = trio.current_time() + self._limits.close_linger

    async def _close(self, *, retain: bool, reason: int) -> pb.SessionClosed:
        """Release or retain the engine session; move to CLOSED. Runs once."""
        sid = self.session_id
        healthy = self._engine.health().state is EngineState.READY
        retained = False
        if self._downstream is not None:
            retain = False  # the chain behind it cannot be resumed
            self._downstream.abort()  # (a no-op after a graceful close)
        if self._returner is not None:
            retain = False  # a hop of a chain, which cannot be resumed
            self._returner.close()  # its task ends with the stream
        if self._owns_engine_session:
            self._owns_engine_session = False
            if retain and healthy:
                # Resume from what the client was sent: a result computed but never handed to the
                # transport (the stream ended first) is not part of the session it knows.
                retained = self._registry.retain(
                    sid,
                    end=min(self._end, self._delivered_end),
                    engine_len=self._engine_len,
                    kv_capacity=self._kv_capacity,
                )
            if not retained:
                await self._registry.release_owned(sid)
        elif sid:
            self._registry.unclaim(sid, self)
        self.phase.value = Phase.CLOSED
        return pb.SessionClosed(
            reason=reason,  # type: ignore[arg-type]
            totals=self._totals,
            kv_retained=retained,
            resume_ttl_ms=self._limits.resume_ttl_ms if retained else 0,
        )

    async def _finish(self) -> None:
        """Cleanup at the end of the task (shielded): release or retain if not done yet."""
        if self.phase.value is Phase.CLOSED:
            return
        reason = self._end_reason
        if reason is None and self.error is None:
            # Cancelled from outside without a reason: the worker is stopping.
            reason = StreamEnd.SHUTDOWN
            self.error = ShardError(
                ErrorCode.NOT_READY, "the worker is shutting down", session_id=self.session_id
            )
        retain = self.error is None and reason in _RETAIN_ON_END
        closed_reason = pb.SessionClosed.REASON_ERROR if reason is None else _CLOSED_REASON[reason]
        closed = await self._close(retain=retain, reason=closed_reason)
        if reason is StreamEnd.RELEASED:
            try:
                self._outbox.send_nowait(pb.SessionResponse(closed=closed))
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client is not reading; the stream still ends cleanly

    # ---- steps ----------------------------------------------------------------------------

    async def _run_step(self, req: pb.SessionRequest) -> None:
        """One Prefill/Decode/Generate: StepResult*, optional Error, then Usage.

        Only credit waits and engine calls are cancellable by an out-of-band Cancel
        (``_cancellable``); handing a computed result to the transport is not, so a Cancel can
        never drop a committed result, and ``Usage`` counts exactly the results sent.
        """
        usage = pb.Usage()
        err: ShardError | None = None
        try:
            kind = req.WhichOneof("kind")
            if self._downstream is not None:
                await self._relay_step(req, usage)
            elif kind == "prefill":
                await self._prefill(req.prefill, usage)
            elif kind == "decode":
                await self._decode(req.decode, usage)
            else:
                await self._generate(req.generate, usage)
        except ShardError as exc:
            if exc.code in FATAL_IN_SESSION:
                raise
            err = exc
        finally:
            self.parked.value = False
            self._step_scope = None
            self._step_finishing = True  # nothing left to stop: a Cancel now finds no step
            if self._credit_unspent:  # the step failed before its result: give the credit back
                self._credit_unspent = False
                self._grant(1)
        if err is not None:
            if not err.session_id:
                err.session_id = self.session_id
            self._registry.count_error(err.code)
            await self._send(pb.SessionResponse(error=err.to_proto()))
        for field in ("prompt_tokens", "generated_tokens", "reused_tokens"):
            setattr(self._totals, field, getattr(self._totals, field) + getattr(usage, field))
        if self._version >= (1, 1):
            usage.n_past = self._end  # what the session holds now, also after a failed step
        await self._send(pb.SessionResponse(usage=usage))
        queued, self._queued = self._queued, None
        if queued is not None and self.phase.value is Phase.RUNNING:
            if err is None:
                assert self._nursery is not None
                self._cancel_requested = self._step_finishing = False
                self._nursery.start_soon(self._guarded, lambda: self._run_step(queued))
                return
            # it was sent for the state the failed step would have left: it must not run
            await self._send(pb.SessionResponse(error=ShardError(
                ErrorCode.CANCELLED, "not run: the step queued before it failed",
                session_id=self.session_id, reason="QUEUED_STEP_DROPPED",
            ).to_proto()))
            dropped = pb.Usage()
            if self._version >= (1, 1):
                dropped.n_past = self._end
            await self._send(pb.SessionResponse(usage=dropped))
        if self.phase.value is Phase.RUNNING:
            self.phase.value = Phase.IDLE
        self._step_active.value = False

    @contextmanager
    def _cancellable(self) -> Iterator[None]:
        """A region an out-of-band Cancel stops (also one requested before it was entered)."""
        scope = trio.CancelScope()
        if self._cancel_requested:
            scope.cancel()
        self._step_scope = scope
        try:
            with scope:
                yield
        finally:
            self._step_scope = None
        if scope.cancelled_caught:
            raise ShardError(
                ErrorCode.CANCELLED, "the step was cancelled (Cancel RPC)", session_id=self.session_id
            )

    async def _prefill_input(
        self, p: pb.Prefill
    ) -> tuple[int, SamplingParams, tuple[int, ...] | None, np.ndarray | None, int]:
        """A Prefill's checked input, before any engine work: (position, sampling, tokens or
        hidden rows, positions). Shared with the relaying path (``shard.rpc.relaying``)."""
        caps, sid = self._require_caps(), self.session_id
        position = p.position.value if p.HasField("position") else self._end
        if position > self._end:
            raise convert.invalid(f"position {position} is beyond the session end {self._end}", sid)
        sampling = convert.sampling_from_proto(p.sampling, sid)
        which = p.WhichOneof("input")
        tokens = hidden = None
        if which == "tokens":
            self._check_room(position, len(p.tokens.ids))  # before copying millions of ids
            tokens = tuple(p.tokens.ids)
        elif which == "text":
            tokens = await self._tokenize(p.text, add_bos=position == 0, position=position)
        elif which == "hidden_states":
            hidden = convert.tensor_to_array(p.hidden_states, caps.n_embd, sid, dtype=self._wire_dtype)
        else:
            raise convert.invalid("Prefill needs tokens, text or hidden_states", sid)
        self._check_row_fits(caps)
        n = len(tokens) if tokens is not None else len(hidden)  # type: ignore[arg-type]
        return position, sampling, tokens, hidden, n

    def _decode_input(
        self, d: pb.Decode
    ) -> tuple[SamplingParams, int | None, np.ndarray | None]:
        """A Decode's checked input: (sampling, token or one hidden row)."""
        caps, sid = self._require_caps(), self.session_id
        sampling = convert.sampling_from_proto(d.sampling, sid)
        which = d.WhichOneof("input")
        if which == "token":
            token, hidden = d.token, None
        elif which == "hidden_state":
            token, hidden = None, convert.tensor_to_array(
                d.hidden_state, caps.n_embd, sid, dtype=self._wire_dtype, rows=1
            )
        else:
            raise convert.invalid("Decode needs a token or a hidden_state", sid)
        self._check_row_fits(caps)
        return sampling, token, hidden

    async def _prefill(self, p: pb.Prefill, usage: pb.Usage) -> None:
        """One StepResult for the whole input, or one per ``chunk_tokens`` positions, each sent
        as soon as it is computed (a failed chunk leaves the earlier chunks in the session)."""
        sid = self.session_id
        position, sampling, tokens, hidden, n = await self._prefill_input(p)
        chunk = p.chunk_tokens or max(n, 1)
        hint = self._client_hint() if tokens is not None and not p.all_logits else None
        echo = tokens if p.WhichOneof("input") == "text" and p.echo_tokens else None
        for offset in range(0, max(n, 1), chunk):
            with self._cancellable():
                await self._take_credit()
                result = await self._engine_call(
                    self._engine.prefill,
                    PrefillRequest(
                        sid,
                        None if tokens is None else tokens[offset : offset + chunk],
                        None if hidden is None else hidden[offset : offset + chunk],
                        position=position + offset, sampling=sampling,
                        top_k_logprobs=p.top_logprobs,
                        lookahead=hint if offset + chunk >= n else None,
                        all_logits=p.all_logits,
                    ),
                )
            await self._send_step(result, position + offset, input_tokens=echo,
                                  usage_follows=offset + chunk >= n)
            echo = None
            # Counted once delivered: Usage reports only what the client received.
            usage.prompt_tokens += result.tokens_processed
            usage.reused_tokens += result.reused_tokens

    async def _decode(self, d: pb.Decode, usage: pb.Usage) -> None:
        sampling, token, hidden = self._decode_input(d)
        if token is not None:
            self._follows = self._next_token is not None and token == self._next_token
        hint = self._client_hint() if token is not None else None
        with self._cancellable():
            await self._take_credit()
            start = self._end
            result = await self._decode_one(token, hidden, sampling, d.top_logprobs, hint)
        if self._returner is not None and d.relay_tag and result.logits is not None:
            # the chain's first hop may start its next step before this reaches it up the chain
            self._returner.push(d.relay_tag, convert.step_to_proto(
                result, self._step_no + 1, start, self._wire_dtype))
        await self._send_step(result, start, usage_follows=True)
        usage.generated_tokens += 1

    async def _generate(self, g: pb.Generate, usage: pb.Usage) -> None:
        caps, sid = self._require_caps(), self.session_id
        if not (caps.is_first and caps.is_last):
            raise ShardError(
                ErrorCode.UNSUPPORTED_FEATURE,
                "Generate needs a worker that serves the whole model (first and last shard)",
                session_id=sid,
            )
        sampling, prompt = await self._generate_input(g)
        stop = frozenset(g.stop_tokens)
        emitted = 0
        while True:
            # The steps that may follow this one: the engine may compute the next ahead.
            hint = None
            if self._limits.lookahead != "off" and g.max_tokens - emitted > 1:
                hint = Lookahead(g.max_tokens - emitted - 1, stop, stop_at_eog=not g.ignore_eos)
            with self._cancellable():
                await self._take_credit()
                start = self._end
                if emitted == 0 and prompt is not None:
                    request = PrefillRequest(
                        sid, prompt, position=start, sampling=sampling,
                        top_k_logprobs=g.top_logprobs, lookahead=hint,
                    )
                    result = await self._engine_call(self._engine.prefill, request)
                else:
                    assert self._next_token is not None
                    result = await self._decode_one(
                        self._next_token, None, sampling, g.top_logprobs, hint
                    )
            assert result.logits is not None
            emitted += 1
            finish = self._finish_reason(result.logits.token_id, result.logits.is_eog, g, stop, emitted)
            await self._send_step(result, start, finish,
                                  usage_follows=finish != pb.FINISH_REASON_UNSPECIFIED)
            if emitted == 1 and prompt is not None:
                usage.prompt_tokens += result.tokens_processed
                usage.reused_tokens += result.reused_tokens
            usage.generated_tokens += 1
            if finish != pb.FINISH_REASON_UNSPECIFIED:
                return

    async def _generate_input(self, g: pb.Generate) -> tuple[SamplingParams, tuple[int, ...] | None]:
        """A Generate's checked input: (sampling, prompt ids; None: continue from the token
        the previous step chose). Shared with the relaying path."""
        sid = self.session_id
        if g.max_tokens == 0:
            raise convert.invalid("Generate.max_tokens must be >= 1", sid)
        sampling = convert.sampling_from_proto(g.sampling, sid)
        which = g.WhichOneof("prompt")
        prompt: tuple[int, ...] | None = None
        if which == "tokens":
            self._check_room(self._end, len(g.tokens.ids))
            prompt = tuple(g.tokens.ids)
        elif which == "text":
            prompt = await self._tokenize(g.text, add_bos=self._end == 0, position=self._end)
        elif self._next_token is None:
            raise _illegal("Generate without a prompt needs a previous step to continue from", sid)
        return sampling, prompt

    def _finish_reason(
        self, token: int, is_eog: bool, g: pb.Generate, stop: frozenset[int], emitted: int
    ) -> int:
        """Whether a Generate ends with this token: the worker's stop rules, in order."""
        if is_eog and not g.ignore_eos:
            return pb.FINISH_REASON_EOG
        if token in stop:
            return pb.FINISH_REASON_STOP_TOKEN
        if emitted >= g.max_tokens:
            return pb.FINISH_REASON_LENGTH
        if self._end + 1 > self._kv_capacity:
            return pb.FINISH_REASON_CONTEXT_FULL
        return pb.FINISH_REASON_UNSPECIFIED

    def _client_hint(self) -> Lookahead | None:
        """A client-driven step's look-ahead hint: only for a client that decoded the token the
        worker sampled last time (a router that samples for itself would waste the work)."""
        return Lookahead() if self._limits.lookahead == "auto" and self._follows else None

    async def _decode_one(
        self,
        token: int | None,
        hidden: np.ndarray | None,
        sampling: SamplingParams,
        top_k: int,
        lookahead: Lookahead | None = None,
    ) -> StepResult:
        """Append one position at the logical end.

        After a resume that kept fewer positions than the engine holds, the engine's own end is
        past the logical one; a one-position prefill at the logical end drops the surplus.
        """
        sid = self.session_id
        if self._end != self._engine_len:
            request = PrefillRequest(
                session_id=sid,
                tokens=None if token is None else (token,),
                hidden_states=hidden,
                position=self._end,
                sampling=sampling,
                top_k_logprobs=top_k,
                lookahead=lookahead,
            )
            return await self._engine_call(self._engine.prefill, request)
        return await self._engine_call(
            self._engine.decode,
            DecodeRequest(
                session_id=sid,
                token=token,
                hidden_state=hidden,
                sampling=sampling,
                top_k_logprobs=top_k,
                lookahead=lookahead,
            ),
        )

    async def _engine_call(
        self, fn: Callable[[R], Awaitable[StepResult]], request: R
    ) -> StepResult:
        """One engine step under the per-step timeout; engine errors become ShardErrors.

        The engine owns the step timeout (``step_timeout`` of the request): it keeps the step
        out of shared steps that cannot end in time and delivers a result computed in time.
        After any failure the positions are read back from the engine (``_resync``).
        """
        position = getattr(request, "position", None)
        start = self._engine_len if position is None else position
        try:
            if request.step_timeout != self._step_timeout:  # (a copy per step only when needed)
                request = dataclasses.replace(request, step_timeout=self._step_timeout)
            result = await fn(request)
        except StepTimeout as exc:
            self._resync()
            assert self._step_timeout is not None
            raise ShardError(
                ErrorCode.DEADLINE_EXCEEDED,
                f"the step exceeded step_timeout_ms={round(self._step_timeout * 1000)}",
                session_id=self.session_id,
                reason=exc.code,
            ) from None
        except EngineError as exc:
            self._resync()
            raise ShardError.from_engine(exc) from None
        except BaseException:  # a Cancel RPC, the call deadline, a reset: the step was rolled back
            self._resync()
            raise
        self._end = self._engine_len = result.n_past
        # Positions from ``start`` on now differ from what the client was sent.
        self._delivered_end = min(self._delivered_end, start)
        if result.logits is not None:
            self._next_token = result.logits.token_id
        return result

    def _resync(self) -> None:
        """Read back what the engine holds after a failed step.

        A failed step normally leaves the session as it was, but a prefill that rewrote from an
        earlier position keeps only ``[0, position + reused)`` once it began computing (the old
        positions after it were being replaced). Every position reported afterwards (``Usage``,
        the next ``StepResult.start_position``, a resume) must be the engine's, never a stale one.
        """
        try:
            held = self._engine.session_info(self.session_id).n_past
        except EngineError:
            return  # released or the engine failed: the stream ends anyway
        if held < self._end:
            self._next_token = None  # it was chosen for a position that is gone
        self._end = min(self._end, held)
        self._engine_len = held
        self._delivered_end = min(self._delivered_end, held)

    async def _tokenize(self, text: str, *, add_bos: bool, position: int) -> tuple[int, ...]:
        """Tokenize a remote caller's text off the event loop, after refusing (before any work)
        a text too long to fit: a token stands for at most ``max_token_bytes`` bytes, and a
        character is at least one, so the text needs at least ``len / max_token_bytes`` tokens
        (``_TEXT_SLACK`` for tokenizers that normalise text away)."""
        caps = self._require_caps()
        if caps.max_token_bytes:
            self._check_room(position, len(text) // (_TEXT_SLACK * caps.max_token_bytes))
        try:
            return await self._engine.tokenize_async(text, add_bos=add_bos)
        except EngineError as exc:
            raise ShardError.from_engine(exc) from None

    def _check_room(self, position: int, n_tokens: int) -> None:
        """Refuse, before any work, input that cannot fit: the errors the engine would give."""
        caps, sid = self._require_caps(), self.session_id
        new_len = position + n_tokens
        if new_len > caps.n_ctx_per_session:
            raise ShardError.from_engine(InvalidInput(
                f"{new_len} positions exceed the per-session context of {caps.n_ctx_per_session}",
                session_id=sid,
            ))
        if new_len > self._kv_capacity:
            raise ShardError.from_engine(KvCacheFull(
                f"{new_len} positions exceed this session's KV budget of {self._kv_capacity}",
                session_id=sid,
            ))

    def _require_caps(self) -> Capabilities:
        assert self._caps is not None
        return self._caps

    def _check_row_fits(self, caps: Capabilities) -> None:
        """Refuse, before any compute, a boundary result that no chunking could send."""
        if caps.is_last:
            return
        if _FLOAT32_BYTES * caps.n_embd + _CHUNK_OVERHEAD > self._max_message_bytes:
            raise ShardError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"one hidden-state row ({caps.n_embd} values) does not fit in max_message_bytes="
                f"{self._max_message_bytes}",
                retryable=False,
                session_id=self.session_id,
                reason="MESSAGE_TOO_LARGE",
            )

    async def _take_credit(self) -> None:
        """Wait for one credit: a client that grants none parks the step before it computes."""
        if self.credit.value <= 0:
            self.parked.value = True
            try:
                await self.credit.wait_value(lambda c: c > 0)
            finally:
                self.parked.value = False
        if self.credit.value != UNLIMITED_CREDIT:
            self.credit.value -= 1
        self._credit_unspent = True

    async def _send_step(
        self, result: StepResult, start: int, finish: int = pb.FINISH_REASON_UNSPECIFIED,
        input_tokens: Sequence[int] | None = None, *, usage_follows: bool = False,
    ) -> None:
        """Send one result (one credit), split into chunks when it exceeds one message.
        ``usage_follows``: the step's ``Usage`` comes next (see ``_send``)."""
        msg = convert.step_to_proto(result, self._step_no + 1, start, self._wire_dtype)
        if input_tokens is not None:
            msg.input_tokens.ids.extend(input_tokens)
        self._step_no += 1
        msg.finish_reason = finish  # type: ignore[assignment]
        self._credit_unspent = False  # spent now, even if the stream ends during the send
        for chunk in _chunks(msg, self._max_message_bytes - _CHUNK_OVERHEAD):
            # only the last chunk: chunks are far larger than one write, and each waits its turn
            await self._send(pb.SessionResponse(step=chunk),
                             more_follows=usage_follows and not chunk.more_chunks)
        self._registry.count("steps_sent_total")
        self._delivered_end = result.n_past

    async def _send(self, msg: pb.SessionResponse, *, more_follows: bool = False) -> None:
        """Hand a response to the transport; blocks while the bounded channel is full.

        ``more_follows``: this task sends another response right after this one (a step's
        result, then its ``Usage``). It is queued without a scheduler pass when there is room,
        so the transport finds both and frames them into one socket write (the next ``_send``
        is the schedule point). ``send_nowait`` is no cancel point: a result may be queued
        just after the stream ended, and is then counted as delivered, as ``_send_step`` does
        for any result handed over."""
        try:
            if more_follows:
                try:
                    self._outbox.send_nowait(msg)
                    return
                except trio.WouldBlock:
                    pass
            await self._outbox.send(msg)
        except trio.BrokenResourceError:
            # The handler stopped reading without telling us why: the connection is gone.
            self.end(StreamEnd.CONNECTION_LOST)
            await trio.lowlevel.checkpoint()  # raises Cancelled: our scope was just cancelled


def _chunks(msg: pb.StepResult, budget: int) -> Iterator[pb.StepResult]:
    """Split a boundary result over several messages of at most ``budget`` bytes each.

    Every chunk repeats the step's fields and carries consecutive rows of ``hidden_states``;
    ``more_chunks`` is set on all but the last, so an unsplit result looks exactly as before.
    """
    if msg.WhichOneof("output") != "hidden_states" or msg.ByteSize() <= budget:
        yield msg
        return
    tensor = msg.hidden_states
    n_rows = tensor.shape[0]
    row_bytes = len(tensor.data) // max(n_rows, 1)
    per_chunk = max(1, budget // max(row_bytes, 1))
    head = pb.StepResult()
    head.CopyFrom(msg)
    head.ClearField("hidden_states")
    for first in range(0, n_rows, per_chunk):
        rows = min(per_chunk, n_rows - first)
        chunk = pb.StepResult()
        chunk.CopyFrom(head)
        chunk.hidden_states.dtype = tensor.dtype
        chunk.hidden_states.shape.extend([rows, *tensor.shape[1:]])
        chunk.hidden_states.data = tensor.data[first * row_bytes : (first + rows) * row_bytes]
        chunk.more_chunks = first + rows < n_rows
        yield chunk


__all__ = [
    "Phase",
    "Retained",
    "SessionCall",
    "SessionHost",
    "SessionLimits",
    "StreamEnd",
    "UNLIMITED_CREDIT",
]
