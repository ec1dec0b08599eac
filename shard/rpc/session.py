"""One ``Session`` stream: an explicit state machine running in its own nursery.

Why a separate task tree: a purerpc handler for a bidi stream is an async generator, and a
nursery or cancel scope must never stay open across a ``yield`` (the consumer's code would run
inside it). So each stream's work runs in a ``SessionCall`` task owned by the registry's
nursery; the handler only moves messages from ``SessionCall.responses`` to the wire and, when the
wire goes away, calls ``SessionCall.end(reason)`` and waits for ``done``.

State machine (``Phase``)::

    AWAITING_OPEN --OpenSession--> IDLE --Prefill/Decode/Generate/Rewind--> RUNNING --done--> IDLE
    IDLE|RUNNING --CloseSession / half-close--> CLOSING --running step done--> CLOSED
    any --fatal error / deadline / end(reason)--> CLOSED

Anything else is a protocol violation and ends the stream with ILLEGAL_TRANSITION (a message
before OpenSession, a second OpenSession, a step while a step runs, anything after
CloseSession; the one exception is a session opened with a filled-in ``route.return_to``,
where one step may queue behind the running one, see ``shard.relay``). Request-level
problems (bad token ids, wrong hidden-state shape or dtype, a full KV budget, a step deadline,
an out-of-band Cancel) are *step-level*: reported in-stream as ``SessionResponse.error`` and the
session stays usable. Every Prefill/Decode/Generate/Rewind is answered by zero or more
``StepResult``, an optional ``Error``, then exactly one ``Usage``.

Positions: what the session holds lives in one object (``self.positions``, ``Positions``; a
routed session's is its relay's ``ChainLedger``), moved only by its event methods.

Chain relay: a session opened with a route is served by a ``Routed`` object the worker's relay
(``serve(relay=...)``, ``shard.relay``) opens; this module only dispatches to it through the
``Relay``/``Routed`` protocols and gives it the step API of ``StepHost`` (credit, cancellation,
engine calls, sending results), so the relay never touches the stream's internals.

Resource handling: the task owns the engine session from OpenSession until it either releases
it or hands it to the registry as *retained* (kept for ``resume_ttl`` so a new stream can resume
it). The cleanup runs shielded, so a cancelled or failed stream never leaks KV cells.

Cancellation: an out-of-band Cancel is remembered from the moment a step is dispatched and stops
it at its next credit wait or engine call (``cancellable``); handing a computed result to the
transport is never cancelled by it, so ``Usage`` counts exactly the results sent and the session
holds what they say. If the stream itself ends first, a retained session resumes from what was
handed to the transport (``positions.delivered``).

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

import contextlib
import contextvars
import dataclasses
import enum
import logging
import math
import sys
from collections.abc import AsyncIterable, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeVar

import numpy as np
import trio
from google.protobuf.message import DecodeError
from trio_util import AsyncBool, AsyncValue

from shard.engine import (
    Capabilities,
    ContextExceeded,
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
    StreamRequest,
    TooManySessions,
)
from shard.stops import StopRules
from shard.v1 import shard_pb2 as pb

from . import convert, handoff
from .errors import FATAL_IN_SESSION, ErrorCode, ShardError, internal_error
from .positions import Positions
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


NOT_ALLOWED = (
    "this worker does not relay: its operator did not allow relay (start it with "
    "`trio-shard serve --allow-relay`); use client relay instead"
)


def return_refused(session_id: str = "") -> ShardError:
    """The one answer to a ``Return`` that no routed session takes (no such session, or not
    with that secret): one message for both, so it tells nothing about which sessions exist."""
    return ShardError(ErrorCode.PERMISSION_DENIED,
                      "Return: no routed session of this worker has that return address",
                      session_id=session_id, reason="RETURN_REFUSED")


class StepHost(Protocol):
    """The step API of a session stream: what a step's implementation (the plain steps here,
    a routed session's in ``shard.relay``) may use of its session. ``SessionCall`` is one."""

    session_id: str
    positions: Positions
    credit: AsyncValue[int]

    @property
    def engine(self) -> ShardEngine: ...

    @property
    def caps(self) -> Capabilities: ...

    @property
    def kv_capacity(self) -> int: ...

    @property
    def wire_dtype(self) -> str: ...

    @property
    def batch_group(self) -> int: ...

    @property
    def deadline(self) -> float: ...

    def cancellable(self) -> contextlib.AbstractContextManager[None]: ...

    async def take_credit(self) -> None: ...

    async def engine_call(self, fn: Callable[[R], Awaitable[StepResult]], request: R) -> StepResult: ...

    async def prefill_input(
        self, p: pb.Prefill
    ) -> tuple[int, SamplingParams, tuple[int, ...] | None, np.ndarray | None, int]: ...

    def decode_input(self, d: pb.Decode) -> tuple[SamplingParams, int | None, np.ndarray | None]: ...

    async def generate_input(self, g: pb.Generate) -> tuple[SamplingParams, tuple[int, ...] | None]: ...

    def rewind_position(self, r: pb.Rewind) -> int: ...

    async def truncate_engine(self, keep: int) -> None: ...

    def finish_reason(self, rules: StopRules, token: int, is_eog: bool, emitted: int, n_past: int) -> int: ...

    async def send_result(self, msg: pb.StepResult, *, usage_follows: bool = False) -> None: ...

    async def end_with(self, err: ShardError) -> NoReturn: ...


class Routed(Protocol):
    """This worker's side of a routed session (chain relay), opened by ``Relay.open``:
    ``shard.relay.RoutedSession``."""

    #: The session's positions, the next hop's included (the stream reads ``end``).
    positions: Positions
    #: The least KV capacity of the chain from this worker on.
    kv_capacity: int

    async def step(self, req: pb.SessionRequest, usage: pb.Usage) -> None:
        """Run one Prefill/Decode/Generate/Rewind through the chain (results sent with the
        host's ``send_result``); a step-level failure raises its ``ShardError``."""
        ...

    async def settle(self) -> None:
        """After every request, failed ones included: bring this worker and its next hop to
        the same positions (the ledger's one rule); raises a fatal error if it cannot."""
        ...

    def cancel(self) -> None:
        """A Cancel of the running step: forward it to the next hop (sync, never raises)."""
        ...

    def deadline_error(self) -> ShardError | None:
        """The error for the call deadline passing now: naming the next hop when a step was
        waiting for its answer, else None (the deadline is this worker's)."""
        ...

    def offer_return(self, secret: bytes, tag: int, step: pb.StepResult) -> bool:
        """A ``Return`` for this session (direct return): True if a step used it; raises
        ``return_refused`` for a wrong secret or a session that takes none."""
        ...

    async def close(self) -> None:
        """Close the downstream session gracefully (released); never raises."""
        ...

    def abort(self) -> None:
        """Reset the downstream stream now (the next worker releases its session)."""
        ...


class Returner(Protocol):
    """A last hop's sender of tagged results to the route's return address."""

    def push(self, tag: int, step: pb.StepResult) -> None:
        """Hand one result over, never blocking the step (a full queue drops it: the chain's
        own answer still carries it)."""
        ...

    def close(self) -> None:
        """No more results: the pusher's task ends (sync, idempotent)."""
        ...


class Relay(Protocol):
    """Opens the routed side of sessions (``serve(relay=...)``: ``shard.relay.ChainRelay``).
    Without one a route is refused with PERMISSION_DENIED, so no worker becomes an open relay."""

    def check(self, req: pb.OpenSession, caps: Capabilities, sid: str) -> None:
        """Refuse, before any session is claimed, a route or return address this worker will
        not serve (synchronous checks; where it may connect is checked by ``open``)."""
        ...

    async def open(self, host: StepHost, req: pb.OpenSession, *, nursery: trio.Nursery) -> Routed:
        """Open the next hop of ``req.route`` (held by a task in ``nursery``, the stream's)."""
        ...

    async def open_return(
        self, address: pb.ReturnAddress, *, deadline: float, nursery: trio.Nursery
    ) -> Returner:
        """A last hop's pusher to ``address`` (held by a task in ``nursery``)."""
        ...

    async def run(self, local: str, *, task_status: trio.TaskStatus[None]) -> None:
        """Own the relay's connections until cancelled (``serve`` starts it once bound);
        ``local``: the worker's bound HOST:PORT."""
        ...


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


class Responses:
    """Where a session's responses go: a bounded channel its handler forwards to the
    transport, or, while that handler waits on an empty channel, straight to the transport
    from the session's own task (``direct``, set by the handler).

    Why: a token that travels session task -> channel -> handler task -> transport costs a
    task step and a scheduler pass more than one framed by the task that produced it. The
    channel stays the bound and the path for anything that must wait (no window, a slow
    reader): ``direct`` refuses those, and once a response went through the channel, every
    later one follows it there until the handler has forwarded them all (order is kept)."""

    def __init__(self, size: int) -> None:
        self._send, self.receive = trio.open_memory_channel[pb.SessionResponse](size)
        self.direct: Callable[[pb.SessionResponse, bool], bool] | None = None
        self.idle = False  # the handler waits on an empty channel, holding nothing
        self.through_handler = False  # every response takes the channel (a slower path)

    def statistics(self) -> Any:
        return self._send.statistics()

    def _sent_directly(self, msg: pb.SessionResponse, more_follows: bool) -> bool:
        return (self.idle and self.direct is not None and not self.through_handler
                and self.direct(msg, more_follows))

    def send_nowait(self, msg: pb.SessionResponse, *, more_follows: bool = False) -> None:
        """``more_follows``: another response follows in this task step (they are written
        together)."""
        if not self._sent_directly(msg, more_follows):
            self.idle = False
            self._send.send_nowait(msg)

    async def send(self, msg: pb.SessionResponse) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()  # a cancel point, as the channel is
        if self._sent_directly(msg, False):
            await trio.lowlevel.cancel_shielded_checkpoint()  # and a scheduler pass
        else:
            self.idle = False
            await self._send.send(msg)

    def close(self) -> None:
        self._send.close()


class _Cancellable:
    """``SessionCall.cancellable``'s region: a cancel scope the Cancel RPC finds. (A class,
    not a generator-based context manager: it is entered once per token.)"""

    __slots__ = ("_call", "_scope")

    def __init__(self, call: SessionCall) -> None:
        self._call = call
        self._scope = trio.CancelScope()

    def __enter__(self) -> None:
        call, scope = self._call, self._scope
        if call._cancel_requested:
            scope.cancel()
        call._step_scope = scope
        scope.__enter__()

    def __exit__(self, *exc: Any) -> bool:
        scope = self._scope
        try:
            swallowed = scope.__exit__(*exc)
        finally:
            self._call._step_scope = None
        if scope.cancelled_caught:
            raise ShardError(ErrorCode.CANCELLED, "the step was cancelled (Cancel RPC)",
                             session_id=self._call.session_id)
        return bool(swallowed)


def _illegal(message: str, session_id: str = "") -> ShardError:
    return ShardError(ErrorCode.ILLEGAL_TRANSITION, message, session_id=session_id)


class SessionCall:
    """The server side of one ``Session`` stream (see the module docstring).

    Created and started by ``Registry.start_call``. Public surface for the handler and the
    registry: ``responses`` (receive channel), ``end(reason)``, ``done``, ``error``;
    ``cancel_step()`` for the Cancel RPC, ``offer_return()`` for the Return RPC; ``phase``,
    ``credit``, ``parked``, ``positions`` and ``buffered()`` for observers and tests; and the
    ``StepHost`` API for the steps' implementations.
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
        relay: Relay | None = None,
    ) -> None:
        self._engine = engine
        self._relay = relay  # opens a routed session's next hop (None: routes are refused)
        self.routed: Routed | None = None  # a routed session's side of the chain
        self.returner: Returner | None = None  # a last hop's pusher to the return address
        self._queue_ok = False  # on a route with a return address: one step may queue
        self._queued: pb.SessionRequest | None = None  # the step queued behind the running one
        self._registry = registry
        self._limits = limits
        self._max_message_bytes = max_message_bytes
        self._requests = requests
        # The caller's context (its call, peer, principal): the steps ``take_request_now``
        # starts from the connection's task run in it, as the reader task's do.
        self._context = contextvars.copy_context()
        self._deadline = deadline
        self._outbox = Responses(limits.max_credit + _CONTROL_SLOTS)
        self.responses: trio.MemoryReceiveChannel[pb.SessionResponse] = self._outbox.receive

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
        # Credits the running step took and results it sent: the difference goes back.
        self._credits_taken = self._credits_spent = 0
        self._owns_engine_session = False  # the engine session exists and is ours to free
        self._caps: Capabilities | None = None
        self._wire_dtype = convert.HIDDEN_DTYPE  # hidden states on the wire, both directions
        self._batch_group = 0  # OpenSession.batch_group
        self._kv_capacity = 0
        self._step_timeout: float | None = None  # seconds per engine step (step_timeout_ms)
        self._version = (1, 0)  # the protocol version the session was opened with
        self._importing: handoff.StateImport | None = None  # a state's chunks so far
        self.positions = Positions()  # what the session holds (a routed one's: its ledger)
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
        if self.routed is not None:
            self.routed.cancel()  # a step in flight downstream stops there too
        return True

    def offer_return(self, secret: bytes, tag: int, step: pb.StepResult) -> bool:
        """The Return RPC: a routed first hop's result handed over directly (direct return).
        ``return_refused`` unless this is a routed session that takes one with that secret."""
        if self.routed is None:
            raise return_refused(self.session_id)
        return self.routed.offer_return(secret, tag, step)

    def send_directly(self, direct: Callable[[pb.SessionResponse, bool], bool]) -> None:
        """The handler's way to take responses straight to the transport (``Responses``)."""
        self._outbox.direct = direct

    @property
    def outbox(self) -> Responses:
        return self._outbox

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

    @property
    def engine(self) -> ShardEngine:
        return self._engine

    @property
    def caps(self) -> Capabilities:
        """The engine's capabilities as the session was opened with them."""
        assert self._caps is not None
        return self._caps

    @property
    def kv_capacity(self) -> int:
        """The most positions the session may hold (a routed one: the chain's least)."""
        return self._kv_capacity

    @property
    def wire_dtype(self) -> str:
        """Hidden states on the wire, both directions."""
        return self._wire_dtype

    @property
    def batch_group(self) -> int:
        """``OpenSession.batch_group`` (a relaying worker opens its next hop in the same)."""
        return self._batch_group

    def count(self, name: str) -> None:
        """Bump a worker counter (``GetMetrics``' ``worker.<name>``)."""
        self._registry.count(name)

    # ---- the task -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The stream's task; started by the registry in its nursery."""
        task_status.started()
        try:
            try:
                with self._scope:
                    async with trio.open_nursery() as nursery:
                        self._nursery = nursery
                        nursery.start_soon(self._guarded, self._read_requests)
            except Exception:  # (a group that _guarded could not see whole): one stream's bug
                log.exception("session %r: internal error", self.session_id)  # ends one stream
                self._fail(internal_error(self.session_id))
            if (
                self._scope.cancelled_caught
                and self._end_reason is None
                and self.error is None
                and trio.current_time() >= self._deadline
            ):
                self._end_reason = StreamEnd.DEADLINE
                self.ended_at = self._deadline
                blamed = self.routed.deadline_error() if self.routed is not None else None
                self.error = blamed or ShardError(
                    ErrorCode.DEADLINE_EXCEEDED, "the call deadline expired", session_id=self.session_id
                )
                self.error.session_id = self.session_id
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

    async def end_with(self, err: ShardError) -> NoReturn:
        """End the stream with ``err`` now (``_fail``; the step's task is cancelled here)."""
        self._fail(err)
        await trio.lowlevel.checkpoint()  # raises Cancelled: the stream's scope was cancelled
        raise AssertionError("unreachable")

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
            self._begin_step(req)

    def _begin_step(self, req: pb.SessionRequest) -> None:
        """RUNNING first, then the step's task: a Cancel that arrives right after the request
        finds the step running (the RPC fuzzer's ``cancel_right_after_dispatch``)."""
        self.phase.value = Phase.RUNNING
        self._step_active.value = True  # from here on a Cancel is never lost
        self._start_step(req)

    def take_request_now(self, req: pb.SessionRequest) -> bool:
        """``_dispatch`` without a task step, for the two requests that need no wait: a step
        request while the session is IDLE, and a credit grant; False for anything else (the
        reader task then gets it). Called by the transport only while this stream's reader
        waits for the next request with none queued, so order is kept (``CallContext.take_now``).
        Why: a client-driven step's request would otherwise wake the reader task only to start
        the step's task, a task step and a scheduler pass per request."""
        if self.error is not None or self._end_reason is not None:
            return False
        kind = req.WhichOneof("kind")
        phase = self.phase.value
        if kind == "credit":
            if phase is not Phase.IDLE and phase is not Phase.RUNNING:
                return False
        elif kind not in _STEP_KINDS or phase is not Phase.IDLE:
            return False
        try:
            check_version(req, self.session_id)
        except ShardError:
            return False  # the reader raises it
        if kind == "credit":
            self._grant(req.credit.messages)
        else:
            self._context.run(self._begin_step, req)  # (a task inherits its spawner's context)
        return True

    async def _on_half_close(self) -> None:
        if self.phase.value is Phase.AWAITING_OPEN:
            raise _illegal("the request stream ended before OpenSession")
        await self._close_requested(retain=True, half_close=True)

    def _start_step(self, req: pb.SessionRequest) -> None:
        assert self._nursery is not None
        self._cancel_requested = self._step_finishing = False
        self._credits_taken = self._credits_spent = 0
        self._nursery.start_soon(self._guarded, lambda: self._run_step(req))

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
        # a filled-in return address: a later hop of a chain with a direct return
        returning = req.HasField("route") and bool(req.route.return_to.session_id)
        if routed or returning:
            if self._relay is None:
                raise ShardError(ErrorCode.PERMISSION_DENIED, NOT_ALLOWED, session_id=sid,
                                 reason="RELAY_NOT_ALLOWED")
            self._relay.check(req, caps, sid)
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
        self._batch_group = req.batch_group
        cache = await self._attach_kv(sid, req.kv_budget or None, expectation, retained)
        if routed:
            assert self._relay is not None and self._nursery is not None
            self.routed = await self._relay.open(self, req, nursery=self._nursery)
            self.positions = self.routed.positions
            self._kv_capacity = min(self._kv_capacity, self.routed.kv_capacity)
        elif returning:
            assert self._relay is not None and self._nursery is not None
            self.returner = await self._relay.open_return(
                req.route.return_to, deadline=self._deadline, nursery=self._nursery
            )
            # The chain's copy of each answer is the fallback: it leaves through the handler,
            # after the direct copy the returner sends (which is why the route asked for one).
            self._outbox.through_handler = True
        self._queue_ok = returning
        credit = min(req.initial_credit or self._limits.default_credit, self._limits.max_credit)
        self.credit.value = credit
        self.phase.value = Phase.IDLE
        await self._send(
            pb.SessionResponse(
                opened=pb.SessionOpened(
                    session_id=sid,
                    cache=cache,
                    kv_capacity=self._kv_capacity,
                    n_past=self.positions.end,
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
                self.positions.resumed(held, retained.engine_len)
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
                info = await self._engine.open_session(sid, kv_budget=kv_budget,
                                                       batch_group=self._batch_group)
                break
            except TooManySessions as exc:
                # Retained sessions are a best-effort cache: evict the oldest before refusing.
                if not await self._registry.evict_one():
                    raise ShardError.from_engine(exc) from None
            except EngineError as exc:
                raise ShardError.from_engine(exc) from None
        self._owns_engine_session = True
        self._kv_capacity = info.kv_budget
        self.positions = Positions()

    # ---- close ----------------------------------------------------------------------------

    async def _close_requested(self, *, retain: bool, half_close: bool) -> None:
        """CloseSession or half-close: let the running step finish, then release or retain."""
        self.phase.value = Phase.CLOSING
        self.credit.value = UNLIMITED_CREDIT  # the client can no longer grant credit
        await self._step_active.wait_value(False)
        if self.routed is not None:
            await self.routed.close()
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
        if self.routed is not None:
            retain = False  # the chain behind it cannot be resumed
            self.routed.abort()  # (a no-op after a graceful close)
        if self.returner is not None:
            retain = False  # a hop of a chain, which cannot be resumed
            self.returner.close()  # its task ends with the stream
        if self._owns_engine_session:
            self._owns_engine_session = False
            if retain and healthy:
                # Resume from what the client was sent: a result computed but never handed to the
                # transport (the stream ended first) is not part of the session it knows.
                positions = self.positions
                retained = self._registry.retain(
                    sid,
                    end=min(positions.end, positions.delivered),
                    engine_len=positions.engine,
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
        """One Prefill/Decode/Generate/Rewind: StepResult*, optional Error, then Usage.

        Only credit waits and engine calls are cancellable by an out-of-band Cancel
        (``cancellable``); handing a computed result to the transport is not, so a Cancel can
        never drop a committed result, and ``Usage`` counts exactly the results sent.
        """
        usage = pb.Usage()
        err: ShardError | None = None
        try:
            kind = req.WhichOneof("kind")
            if kind != "import_state":
                self._importing = None  # an import's chunks come one after another, or not at all
            if kind in ("export_state", "import_state") and (
                    self.routed is not None or self.returner is not None):
                raise ShardError(ErrorCode.UNSUPPORTED_FEATURE, "a session of a chain relay route "
                                 "cannot be moved (its hops hold it together)",
                                 session_id=self.session_id)
            if self.routed is not None:
                await self.routed.step(req, usage)
            elif kind == "prefill":
                await self._prefill(req.prefill, usage)
            elif kind == "decode":
                await self._decode(req.decode, usage)
            elif kind == "rewind":
                await self._rewind(req.rewind)
            elif kind == "export_state":
                await self._export_state(req.export_state)
            elif kind == "import_state":
                await self._import_state(req.import_state)
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
            unspent = self._credits_taken - self._credits_spent
            if unspent > 0:  # credits taken for results never sent go back
                self._grant(unspent)
            self._credits_taken = self._credits_spent = 0
        if self.routed is not None:
            # the one rule, after every request: this worker and its next hop hold the same
            # positions again (a fatal error if they cannot be made to)
            await self.routed.settle()
        if err is not None:
            if not err.session_id:
                err.session_id = self.session_id
            if err.reason == handoff.YIELDED:  # a drain's doing, not a failure
                self._registry.count("generations_yielded_total")
            else:
                self._registry.count_error(err.code)
            await self._send(pb.SessionResponse(error=err.to_proto()))
        for field in ("prompt_tokens", "generated_tokens", "reused_tokens"):
            setattr(self._totals, field, getattr(self._totals, field) + getattr(usage, field))
        if self._version >= (1, 1):
            usage.n_past = self.positions.end  # what the session holds now, also after a failure
        ended = pb.SessionResponse(usage=usage)
        queued, self._queued = self._queued, None
        if queued is None:
            await self._end_request(ended)
            return
        # A direct-return route's next step, sent before this one ended (also before a
        # CloseSession: the close waits for it).
        await self._send(ended)
        if err is None:
            self._start_step(queued)  # (the session stays RUNNING: no request slips in)
            return
        # it was sent for the state the failed step would have left: it must not run
        await self._send(pb.SessionResponse(error=ShardError(
            ErrorCode.CANCELLED, "not run: the step queued before it failed",
            session_id=self.session_id, reason="QUEUED_STEP_DROPPED",
        ).to_proto()))
        dropped = pb.Usage()
        if self._version >= (1, 1):
            dropped.n_past = self.positions.end
        await self._end_request(pb.SessionResponse(usage=dropped))

    async def _end_request(self, usage: pb.SessionResponse) -> None:
        """Queue a request's last ``Usage`` and leave RUNNING with no scheduler pass between
        the two: a client may send its next request the moment it reads the Usage, and that
        request must find the session idle (a pass in between let it find the step still
        RUNNING and end the stream with ILLEGAL_TRANSITION: seen with a relaying worker,
        which sends its next hop a Rewind as soon as the failed step's Usage arrives).
        With the channel full (never, by the credit bound) the Usage waits first in line.
        Queued, it is the step task's last act: no checkpoint (it would only cost the task one
        more scheduler pass before it ends)."""
        try:
            self._outbox.send_nowait(usage)
            queued = True
        except trio.WouldBlock:
            queued = False
        except trio.BrokenResourceError:
            self.end(StreamEnd.CONNECTION_LOST)
            await trio.lowlevel.checkpoint()  # raises Cancelled: our scope was just cancelled
            raise AssertionError("unreachable") from None
        if self.phase.value is Phase.RUNNING:
            self.phase.value = Phase.IDLE
        self._step_active.value = False
        if not queued:  # blocked senders go first when room frees: no later response overtakes it
            await self._send(usage)

    def cancellable(self) -> _Cancellable:
        """A region an out-of-band Cancel stops (also one requested before it was entered);
        ends with ``ShardError(CANCELLED)`` when it did."""
        return _Cancellable(self)

    async def prefill_input(
        self, p: pb.Prefill
    ) -> tuple[int, SamplingParams, tuple[int, ...] | None, np.ndarray | None, int]:
        """A Prefill's checked input, before any engine work: (position, sampling, tokens or
        hidden rows, positions)."""
        caps, sid = self.caps, self.session_id
        end = self.positions.end
        position = p.position.value if p.HasField("position") else end
        if position > end:
            raise convert.invalid(f"position {position} is beyond the session end {end}", sid)
        sampling = convert.sampling_from_proto(p.sampling, sid)
        which = p.WhichOneof("input")
        tokens = hidden = None
        if which == "tokens":
            self._check_room(position, len(p.tokens.ids))  # before copying millions of ids
            tokens = tuple(p.tokens.ids)
        elif which == "text":
            tokens = await self._tokenize(p.text, add_bos=position == 0, position=position,
                                          parse_special=p.parse_special)
        elif which == "hidden_states":
            hidden = convert.tensor_to_array(p.hidden_states, caps.n_embd, sid, dtype=self._wire_dtype)
        else:
            raise convert.invalid("Prefill needs tokens, text or hidden_states", sid)
        self._check_row_fits(caps)
        n = len(tokens) if tokens is not None else len(hidden)  # type: ignore[arg-type]
        # Before any chunk is computed: a prompt in chunks that cannot fit is refused whole (it
        # used to be refused at the first chunk past the context, the earlier ones computed).
        self._check_room(position, n)
        return position, sampling, tokens, hidden, n

    def decode_input(
        self, d: pb.Decode
    ) -> tuple[SamplingParams, int | None, np.ndarray | None]:
        """A Decode's checked input: (sampling, token or one hidden row)."""
        caps, sid = self.caps, self.session_id
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

    def rewind_position(self, r: pb.Rewind) -> int:
        """A Rewind's checked position."""
        if r.position > self.positions.end:
            raise convert.invalid(
                f"Rewind position {r.position} is beyond the session end {self.positions.end}",
                self.session_id)
        return r.position

    async def truncate_engine(self, keep: int) -> None:
        """Drop the engine's positions from ``keep`` on (nothing if it holds no more)."""
        if keep < self.positions.engine:
            try:
                await self._engine.truncate(self.session_id, keep)
            except EngineError as exc:
                raise ShardError.from_engine(exc) from None
        self.positions.rewound(keep)

    async def _rewind(self, r: pb.Rewind) -> None:
        await self.truncate_engine(self.rewind_position(r))

    # ---- session hand-off (shard.rpc.handoff) --------------------------------------------

    async def _export_state(self, e: pb.ExportState) -> None:
        """The session's state as StateChunk responses, one credit each; the session is left
        as it is (a surplus a partial resume left is dropped first: it is not the session's)."""
        sid = self.session_id
        if e.max_chunk_bytes and e.max_chunk_bytes < handoff.MIN_CHUNK_BYTES:
            raise convert.invalid(f"max_chunk_bytes must be 0 or >= {handoff.MIN_CHUNK_BYTES}", sid)
        if self.positions.end == 0:
            raise _illegal("the session holds no positions to export", sid)
        await self.truncate_engine(self.positions.end)
        try:
            snapshot = await self._engine.export_session(sid)
        except EngineError as exc:
            raise ShardError.from_engine(exc) from None
        limit = self._max_message_bytes - _CHUNK_OVERHEAD
        size = min(e.max_chunk_bytes or limit, limit)
        next_token = self.positions.next_token
        for chunk in handoff.export_chunks(snapshot, self.caps, next_token, size):
            with self.cancellable():
                await self.take_credit()
            self._credits_spent += 1
            await self._send(pb.SessionResponse(state=chunk), more_follows=chunk.last)

    async def _import_state(self, c: pb.StateChunk) -> None:
        """One chunk of a state; the last resumes the (empty) session from the whole state.
        Checked before a byte is kept (``handoff.StateImport``); any refusal drops the chunks
        received and leaves the session empty."""
        sid, pending = self.session_id, self._importing
        self._importing = None
        if pending is None:
            if not c.HasField("header"):
                raise convert.invalid("a state's first chunk carries its header", sid)
            if self.positions.end or self.positions.engine:
                raise _illegal(f"the session holds {self.positions.end} positions: a state is "
                               "imported only into an empty session", sid)
            try:
                pending = handoff.StateImport(c.header, self.caps, kv_capacity=self._kv_capacity,
                                              bound=self._engine.state_bytes_bound, session_id=sid)
            except EngineError as exc:  # (the engine stopped serving meanwhile)
                raise ShardError.from_engine(exc) from None
        elif c.HasField("header"):
            raise convert.invalid("a header in a later chunk of a state", sid)
        pending.add(c.data)
        if not c.last:
            self._importing = pending
            return
        snapshot = pending.snapshot()
        try:
            info = await self._engine.import_session(sid, snapshot)
        except EngineError as exc:
            raise ShardError.from_engine(exc) from None
        self.positions.resumed(info.n_past, info.n_past)
        self.positions.next_token = pending.next_token

    async def _prefill(self, p: pb.Prefill, usage: pb.Usage) -> None:
        """One StepResult for the whole input, or one per ``chunk_tokens`` positions, each sent
        as soon as it is computed (a failed chunk leaves the earlier chunks in the session)."""
        sid = self.session_id
        position, sampling, tokens, hidden, n = await self.prefill_input(p)
        chunk = p.chunk_tokens or max(n, 1)
        hint = self._client_hint() if tokens is not None and not p.all_logits else None
        echo = tokens if p.WhichOneof("input") == "text" and p.echo_tokens else None
        for offset in range(0, max(n, 1), chunk):
            with self.cancellable():
                await self.take_credit()
                result = await self.engine_call(
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
            await self.send_step(result, position + offset, input_tokens=echo,
                                 usage_follows=offset + chunk >= n)
            echo = None
            # Counted once delivered: Usage reports only what the client received.
            usage.prompt_tokens += result.tokens_processed
            usage.reused_tokens += result.reused_tokens

    async def _decode(self, d: pb.Decode, usage: pb.Usage) -> None:
        sampling, token, hidden = self.decode_input(d)
        if token is not None:
            self._follows = (self.positions.next_token is not None
                             and token == self.positions.next_token)
        hint = self._client_hint() if token is not None else None
        with self.cancellable():
            await self.take_credit()
            start = self.positions.end
            result = await self.decode_one(token, hidden, sampling, d.top_logprobs, hint)
        if self.returner is not None and d.relay_tag and result.logits is not None:
            # the chain's first hop may start its next step before this reaches it up the chain
            self.returner.push(d.relay_tag, convert.step_to_proto(
                result, self._step_no + 1, start, self._wire_dtype))
        await self.send_step(result, start, usage_follows=True)
        usage.generated_tokens += 1

    async def _generate(self, g: pb.Generate, usage: pb.Usage) -> None:
        caps, sid = self.caps, self.session_id
        if not (caps.is_first and caps.is_last):
            raise ShardError(
                ErrorCode.UNSUPPORTED_FEATURE,
                "Generate needs a worker that serves the whole model (first and last shard)",
                session_id=sid,
            )
        sampling, prompt = await self.generate_input(g)
        rules = stop_rules(g)
        ahead = self._limits.lookahead != "off"
        emitted = 0
        while True:
            if emitted and self._step_timeout is None and self.positions.end == self.positions.engine:
                # The steady state: the next tokens as one engine stream (no task step per token)
                emitted, finish = await self._stream(g, sampling, rules, emitted, usage, ahead)
            else:
                # The steps that may follow this one: the engine may compute the next ahead.
                hint = None
                if ahead and g.max_tokens - emitted > 1:
                    hint = Lookahead(g.max_tokens - emitted - 1, rules.stop_tokens,
                                     stop_at_eog=not g.ignore_eos)
                with self.cancellable():
                    await self.take_credit()
                    start = self.positions.end
                    if emitted == 0 and prompt is not None:
                        request = PrefillRequest(
                            sid, prompt, position=start, sampling=sampling,
                            top_k_logprobs=g.top_logprobs, lookahead=hint,
                        )
                        result = await self.engine_call(self._engine.prefill, request)
                    else:
                        token = self.positions.next_token
                        assert token is not None
                        result = await self.decode_one(token, None, sampling, g.top_logprobs, hint)
                assert result.logits is not None
                emitted += 1
                finish = self.finish_reason(rules, result.logits.token_id, result.logits.is_eog,
                                            emitted, result.n_past)
                # (queued without a scheduler pass: the next step's engine call is one)
                await self.send_step(result, start, finish, now=True,
                                     usage_follows=finish != pb.FINISH_REASON_UNSPECIFIED)
                count_generated(usage, result, prompt_step=emitted == 1 and prompt is not None)
            if finish != pb.FINISH_REASON_UNSPECIFIED:
                return
            if g.yield_on_drain and self._registry.draining and caps.kv_layout:
                raise ShardError(ErrorCode.DRAINING, "the worker is draining: the generation "
                                 "yields its session to be moved (export_state)",
                                 session_id=sid, reason=handoff.YIELDED)

    async def _stream(
        self, g: pb.Generate, sampling: SamplingParams, rules: StopRules, emitted: int,
        usage: pb.Usage, ahead: bool,
    ) -> tuple[int, int]:
        """A Generate's next tokens as one engine stream (``ShardEngine.stream``): each token is
        framed by ``deliver`` where the engine finished its step (for a batching engine, one
        pass over a tick's sessions), not by this task, which sleeps until the stream ends:
        the generation finished, the credit ran out (the next stream waits for it), a
        response must wait for room, or a drain asks the generation to yield. The same
        messages, credits, counts and positions as step by step (``send_step``); returns
        (tokens emitted, the last one's finish reason)."""
        token = self.positions.next_token
        assert token is not None
        finish = pb.FINISH_REASON_UNSPECIFIED
        held: pb.SessionResponse | None = None
        positions, outbox, capacity = self.positions, self._outbox, self._kv_capacity
        registry = self._registry
        yields = g.yield_on_drain and bool(self.caps.kv_layout)
        credit = self.credit

        def deliver(result: StepResult) -> bool:
            nonlocal emitted, finish, held
            start = positions.end
            positions.computed(start, result)
            logits = result.logits
            emitted += 1
            finish = rules.finish_reason(logits.token_id, logits.is_eog, emitted=emitted,
                                         n_past=result.n_past, capacity=capacity)
            self._step_no += 1
            self._credits_spent += 1  # spent now, even if the stream ends before it is sent
            msg = convert.token_response(result, self._step_no, start, finish)
            usage.generated_tokens += 1
            last = finish != pb.FINISH_REASON_UNSPECIFIED
            try:
                outbox.send_nowait(msg, more_follows=last)
            except (trio.WouldBlock, trio.BrokenResourceError):
                held = msg  # sent by the task once the stream ended (it may wait)
                return False
            registry.count("steps_sent_total")
            positions.sent(result.n_past)
            if last or (yields and registry.draining):
                return False
            left = credit.value
            if left <= 0:
                return False  # the next step waits for credit in this task
            if left != UNLIMITED_CREDIT:
                credit.value = left - 1
            self._credits_taken += 1
            return True

        try:
            with self.cancellable():
                await self.take_credit()
                try:
                    await self._engine.stream(StreamRequest(
                        self.session_id, token, g.max_tokens - emitted, sampling, g.top_logprobs,
                        lookahead=ahead, stop_tokens=rules.stop_tokens,
                        stop_at_eog=not g.ignore_eos), deliver)
                except EngineError as exc:
                    self._resync()
                    raise ShardError.from_engine(exc) from None
                except BaseException:  # a Cancel, the call deadline, a reset: rolled back
                    self._resync()
                    raise
        finally:
            if held is not None:  # a delivered token that found no room: it waits its turn
                await self._send(held, more_follows=finish != pb.FINISH_REASON_UNSPECIFIED)
                self._registry.count("steps_sent_total")
                positions.sent(positions.end)
        return emitted, finish

    async def generate_input(self, g: pb.Generate) -> tuple[SamplingParams, tuple[int, ...] | None]:
        """A Generate's checked input: (sampling, prompt ids; None: continue from the token
        the previous step chose)."""
        sid = self.session_id
        if g.max_tokens == 0:
            raise convert.invalid("Generate.max_tokens must be >= 1", sid)
        sampling = convert.sampling_from_proto(g.sampling, sid)
        which = g.WhichOneof("prompt")
        prompt: tuple[int, ...] | None = None
        end = self.positions.end
        if which == "tokens":
            self._check_room(end, len(g.tokens.ids))
            prompt = tuple(g.tokens.ids)
        elif which == "text":
            prompt = await self._tokenize(g.text, add_bos=end == 0, position=end,
                                          parse_special=g.parse_special)
            self._check_room(end, len(prompt))
        elif self.positions.next_token is None:
            raise _illegal("Generate without a prompt needs a previous step to continue from", sid)
        return sampling, prompt

    def finish_reason(
        self, rules: StopRules, token: int, is_eog: bool, emitted: int, n_past: int
    ) -> int:
        """Whether a Generate ends with this token (the shared stop rules, ``shard.stops``),
        against this session's capacity."""
        return rules.finish_reason(token, is_eog, emitted=emitted, n_past=n_past,
                                   capacity=self._kv_capacity)

    def _client_hint(self) -> Lookahead | None:
        """A client-driven step's look-ahead hint: only for a client that decoded the token the
        worker sampled last time (a router that samples for itself would waste the work)."""
        return Lookahead() if self._limits.lookahead == "auto" and self._follows else None

    async def decode_one(
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
        end = self.positions.end
        if end != self.positions.engine:
            request = PrefillRequest(
                session_id=sid,
                tokens=None if token is None else (token,),
                hidden_states=hidden,
                position=end,
                sampling=sampling,
                top_k_logprobs=top_k,
                lookahead=lookahead,
            )
            return await self.engine_call(self._engine.prefill, request)
        return await self.engine_call(
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

    async def engine_call(
        self, fn: Callable[[R], Awaitable[StepResult]], request: R
    ) -> StepResult:
        """One engine step under the per-step timeout; engine errors become ShardErrors.

        The engine owns the step timeout (``step_timeout`` of the request): it keeps the step
        out of shared steps that cannot end in time and delivers a result computed in time.
        After any failure the positions are read back from the engine (``_resync``).
        """
        position = getattr(request, "position", None)
        start = self.positions.engine if position is None else position
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
        self.positions.computed(start, result)
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
        self.positions.resync(held)

    async def _tokenize(
        self, text: str, *, add_bos: bool, position: int, parse_special: bool = False
    ) -> tuple[int, ...]:
        """Tokenize a remote caller's text off the event loop, after refusing (before any work)
        a text too long to fit: a token stands for at most ``max_token_bytes`` bytes, and a
        character is at least one, so the text needs at least ``len / max_token_bytes`` tokens
        (``_TEXT_SLACK`` for tokenizers that normalise text away)."""
        caps = self.caps
        if caps.max_token_bytes:
            self._check_room(position, len(text) // (_TEXT_SLACK * caps.max_token_bytes))
        try:
            return await self._engine.tokenize_async(text, add_bos=add_bos, parse_special=parse_special)
        except EngineError as exc:
            raise ShardError.from_engine(exc) from None

    def _check_room(self, position: int, n_tokens: int) -> None:
        """Refuse, before any work, input that cannot fit: the errors the engine would give."""
        caps, sid = self.caps, self.session_id
        new_len = position + n_tokens
        if new_len > caps.n_ctx_per_session:
            raise ShardError.from_engine(ContextExceeded(
                f"{new_len} positions exceed the per-session context of {caps.n_ctx_per_session}",
                session_id=sid,
            ))
        if new_len > self._kv_capacity:
            raise ShardError.from_engine(KvCacheFull(
                f"{new_len} positions exceed this session's KV budget of {self._kv_capacity}",
                session_id=sid,
            ))

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

    async def take_credit(self) -> None:
        """Wait for one credit: a client that grants none parks the step before it computes.
        A credit the step takes and never spends on a result goes back when the step ends."""
        if self.credit.value <= 0:
            self.parked.value = True
            try:
                await self.credit.wait_value(lambda c: c > 0)
            finally:
                self.parked.value = False
        if self.credit.value != UNLIMITED_CREDIT:
            self.credit.value -= 1
        self._credits_taken += 1

    async def send_step(
        self, result: StepResult, start: int, finish: int = pb.FINISH_REASON_UNSPECIFIED,
        input_tokens: Sequence[int] | None = None, *, usage_follows: bool = False,
        now: bool = False,
    ) -> None:
        """Send one of this engine's results (one credit), split into chunks when it exceeds
        one message. ``usage_follows``: the step's ``Usage`` comes next (see ``_send``).
        ``now``: queued without a scheduler pass when there is room (see ``_send``)."""
        msg = convert.step_to_proto(result, self._step_no + 1, start, self._wire_dtype)
        if input_tokens is not None:
            msg.input_tokens.ids.extend(input_tokens)
        msg.finish_reason = finish  # type: ignore[assignment]
        await self._send_numbered(msg, usage_follows, now)
        self.positions.sent(result.n_past)

    async def send_result(self, msg: pb.StepResult, *, usage_follows: bool = False) -> None:
        """Send a result built by the step (a routed session's: the last shard's answer, with
        this worker's own accounting), numbered as this session's next step (one credit)."""
        await self._send_numbered(msg, usage_follows)

    async def _send_numbered(self, msg: pb.StepResult, usage_follows: bool, now: bool = False) -> None:
        self._step_no += 1
        msg.step = self._step_no
        self._credits_spent += 1  # spent now, even if the stream ends during the send
        for chunk in _chunks(msg, self._max_message_bytes - _CHUNK_OVERHEAD):
            # only the last chunk: chunks are far larger than one write, and each waits its turn
            await self._send(pb.SessionResponse(step=chunk),
                             more_follows=usage_follows and not chunk.more_chunks, now=now)
        self._registry.count("steps_sent_total")

    async def _send(
        self, msg: pb.SessionResponse, *, more_follows: bool = False, now: bool = False
    ) -> None:
        """Hand a response to the transport; blocks while the bounded channel is full.

        ``more_follows``: this task sends another response right after this one (a step's
        result, then its ``Usage``). It is queued without a scheduler pass when there is room,
        so the transport finds both and frames them into one socket write (the next ``_send``
        is the schedule point). ``send_nowait`` is no cancel point: a result may be queued
        just after the stream ended, and is then counted as delivered, as ``send_step`` does
        for any result handed over. ``now``: queued so too (the caller's next await is a
        scheduler pass anyway), though nothing follows."""
        try:
            if more_follows or now:
                try:
                    self._outbox.send_nowait(msg, more_follows=more_follows)
                    return
                except trio.WouldBlock:
                    pass
            await self._outbox.send(msg)
        except trio.BrokenResourceError:
            # The handler stopped reading without telling us why: the connection is gone.
            self.end(StreamEnd.CONNECTION_LOST)
            await trio.lowlevel.checkpoint()  # raises Cancelled: our scope was just cancelled


#: The requests that run as a step (``_run_step``).
_STEP_KINDS = frozenset(("prefill", "decode", "generate", "rewind", "export_state", "import_state"))


def count_generated(usage: pb.Usage, result: StepResult, *, prompt_step: bool) -> None:
    """A Generate's token delivered: the request's ``Usage`` counts it (and, for the step that
    prefilled the prompt, the prompt's positions computed and reused)."""
    if prompt_step:
        usage.prompt_tokens += result.tokens_processed
        usage.reused_tokens += result.reused_tokens
    usage.generated_tokens += 1


def stop_rules(g: pb.Generate) -> StopRules:
    """A Generate's stop rules (``shard.stops``)."""
    return StopRules.of(g.max_tokens, g.stop_tokens, g.ignore_eos)


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
    "StepHost",
    "StreamEnd",
    "UNLIMITED_CREDIT",
    "NOT_ALLOWED",
    "Relay",
    "Returner",
    "Routed",
    "count_generated",
    "return_refused",
    "stop_rules",
]
