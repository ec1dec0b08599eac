"""``SessionCall``: one ``Session`` stream's task tree, phase, request dispatch and end.

Why a separate task tree: a purerpc handler for a bidi stream is an async generator, and a
nursery or cancel scope must never stay open across a ``yield`` (the consumer's code would run
inside it). So each stream's work runs in a ``SessionCall`` task owned by the registry's
nursery; the handler only moves messages from ``SessionCall.responses`` to the wire and, when the
wire goes away, calls ``SessionCall.end(reason)`` and waits for ``done``.
"""

from __future__ import annotations

import contextvars
import logging
import math
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import NoReturn

import trio
from google.protobuf.message import DecodeError
from trio_util import AsyncValue

from shard.engine import Capabilities, EngineError, ShardEngine
from shard.v1 import shard_pb2 as pb

from .. import convert, handoff
from ..errors import ErrorCode, ShardError, internal_error
from ..positions import Positions
from ..versions import check_version
from .cancellation import StepCancel
from .context import StepContext
from .credit import Credit
from .lifecycle import Lifecycle
from .limits import SessionLimits
from .outbox import DirectPath, Outbox, Responses
from .phase import STEP_KINDS, Phase, StreamEnd, illegal
from .protocols import Relay, Returner, Routed, SessionHost, return_refused
from .steps import Steps
from .transfer import StateTransfer

log = logging.getLogger(__name__)


_CONTROL_SLOTS = 4  # opened + error + usage + closed never need credit


class SessionCall(StepContext, Lifecycle, Steps, StateTransfer):
    """The server side of one ``Session`` stream (see ``shard.rpc.session``).

    Created and started by ``Registry.start_call``. Public surface for the handler and the
    registry: ``responses`` (receive channel), ``end(reason)``, ``done``, ``error``;
    ``cancel_step()`` for the Cancel RPC, ``offer_return()`` for the Return RPC; ``phase``,
    ``credit``, ``parked``, ``positions`` and ``buffered()`` for observers and tests; and the
    ``StepHost`` API (``StepContext``) for the steps' implementations.
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
        self._requests = requests
        # The caller's context (its call, peer, principal): the steps ``take_request_now``
        # starts from the connection's task run in it, as the reader task's do.
        self._context = contextvars.copy_context()
        self._deadline = deadline
        self._credits = credits = Credit(limits.max_credit)
        self.credit: AsyncValue[int] = credits.value
        self.parked = credits.parked  # a step waits for credit
        self.take_credit = credits.take  # (StepHost: the credit's own method, no layer between)
        self._outbox = Outbox(limits.max_credit + _CONTROL_SLOTS, max_message_bytes=max_message_bytes,
                              credit=credits, count=registry.count, lost=self._connection_lost)
        self.responses: trio.MemoryReceiveChannel[pb.SessionResponse] = self._outbox.receive
        self._cancel = StepCancel()

        self.phase: AsyncValue[Phase] = AsyncValue(Phase.AWAITING_OPEN)
        self.done = trio.Event()
        self.error: ShardError | None = None  # the fatal error the stream ends with, if any
        self.session_id = ""

        self._scope = trio.CancelScope(deadline=deadline)
        self._end_reason: StreamEnd | None = None
        self.ended_at: float | None = None  # trio time the stream was told to stop (observers)
        self._nursery: trio.Nursery | None = None
        self._reader_scope = trio.CancelScope()
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
        self._totals = pb.Usage()

    # ---- control from outside ------------------------------------------------------------

    def end(self, reason: StreamEnd) -> None:
        """Stop the stream because its consumer went away (or Release/shutdown). Idempotent."""
        if self._end_reason is None:
            self._end_reason = reason
            self.ended_at = trio.current_time()
        self._scope.cancel()

    def _connection_lost(self) -> None:
        self.end(StreamEnd.CONNECTION_LOST)

    def cancel_step(self) -> bool:
        """Out-of-band Cancel: stop the running step (the engine stops within one step).

        The request is remembered from the moment the step is dispatched, so a Cancel that
        lands before the step's task starts, or while a committed result waits for room in
        the response channel, still stops the step at its next credit wait or engine call.
        Results already computed are delivered, never dropped.
        """
        if not self._cancel.cancel():
            return False
        if self.routed is not None:
            self.routed.cancel()  # a step in flight downstream stops there too
        return True

    def offer_return(self, secret: bytes, tag: int, step: pb.StepResult) -> bool:
        """The Return RPC: a routed first hop's result handed over directly (direct return).
        ``return_refused`` unless this is a routed session that takes one with that secret."""
        if self.routed is None:
            raise return_refused(self.session_id)
        return self.routed.offer_return(secret, tag, step)

    def send_directly(self, direct: DirectPath | None) -> None:
        """The handler's way to take responses straight to the transport (``Responses``)."""
        self._outbox.send_directly(direct)

    @property
    def outbox(self) -> Responses:
        return self._outbox

    def buffered(self) -> int:
        """Responses produced but not yet taken by the transport (bounded by the channel)."""
        return self._outbox.statistics().current_buffer_used

    @property
    def running(self) -> bool:
        return self._cancel.active.value

    # ---- the task ------------------------------------------------------------------------

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
            raise illegal(f"{kind or 'a message'} after CloseSession", sid)
        if kind is None:
            raise convert.invalid("empty SessionRequest (no kind set)", sid)
        if phase is Phase.AWAITING_OPEN:
            if kind != "open":
                raise illegal(f"{kind} before OpenSession", sid)
            await self._open(req.open, version)
            return
        if kind == "open":
            raise illegal("a second OpenSession on the same stream", sid)
        if kind == "credit":
            self._credits.grant(req.credit.messages)
        elif kind == "close":
            await self._close_requested(retain=req.close.retain, half_close=False)
        elif phase is Phase.RUNNING:
            if self._queue_ok and self._queued is None:
                self._queued = req  # a direct-return route's next step: run when this one ends
                return
            raise illegal(f"{kind} while a step is running (steps never interleave)", sid)
        else:
            self._begin_step(req)

    def _begin_step(self, req: pb.SessionRequest) -> None:
        """RUNNING first, then the step's task: a Cancel that arrives right after the request
        finds the step running (the RPC fuzzer's ``cancel_right_after_dispatch``)."""
        self.phase.value = Phase.RUNNING
        self._cancel.begin()  # from here on a Cancel is never lost
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
        elif kind not in STEP_KINDS or phase is not Phase.IDLE:
            return False
        try:
            check_version(req, self.session_id)
        except ShardError:
            return False  # the reader raises it
        if kind == "credit":
            self._credits.grant(req.credit.messages)
        else:
            self._context.run(self._begin_step, req)  # (a task inherits its spawner's context)
        return True

    async def _on_half_close(self) -> None:
        if self.phase.value is Phase.AWAITING_OPEN:
            raise illegal("the request stream ended before OpenSession")
        await self._close_requested(retain=True, half_close=True)

    def _start_step(self, req: pb.SessionRequest) -> None:
        assert self._nursery is not None
        self._cancel.started()
        self._credits.begin_step()
        self._nursery.start_soon(self._guarded, lambda: self._run_step(req))
