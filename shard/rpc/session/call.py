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

import trio
from google.protobuf.message import DecodeError
from trio_util import AsyncValue

from shard.engine import EngineError, ShardEngine
from shard.v1 import shard_pb2 as pb

from .. import convert, handoff
from ..errors import FATAL_IN_SESSION, ErrorCode, ShardError, internal_error
from ..positions import Positions
from ..versions import check_version
from . import steps, transfer
from .cancellation import Stoppable
from .context import StepContext
from .forks import caller_of
from .lifecycle import Lifecycle
from .limits import SessionLimits
from .outbox import DirectPath, Responses
from .phase import STEP_KINDS, Phase, StreamEnd, illegal
from .protocols import Relay, Returner, Routed, SessionHost, return_refused

log = logging.getLogger(__name__)


class SessionCall(Lifecycle):
    """The server side of one ``Session`` stream (see ``shard.rpc.session``).

    Created and started by ``Registry.start_call``. Public surface for the handler and the
    registry: ``responses`` (receive channel), ``end(reason)``, ``done``, ``error``;
    ``cancel_step()`` for the Cancel RPC, ``offer_return()`` for the Return RPC; ``phase``,
    ``credit``, ``parked``, ``positions`` and ``buffered()`` for observers and tests; and its
    step context ``ctx`` (``StepHost``), which runs the steps.
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
        self._caller: tuple[str, str] | None = None  # (``caller``)
        self._deadline = deadline
        #: The session as its steps see it (``StepHost``: what a routed session is given too).
        self.ctx = ctx = StepContext(engine=engine, registry=registry, limits=limits,
                                     deadline=deadline, max_message_bytes=max_message_bytes,
                                     fail=self._fail, lost=self._connection_lost)
        self.credit: AsyncValue[int] = ctx.credit
        self.parked = ctx.parked  # a step waits for credit
        self._credits = ctx.credits
        self._outbox = ctx.outbox
        self.responses: trio.MemoryReceiveChannel[pb.SessionResponse] = ctx.outbox.receive
        self._cancel = ctx.cancel_state

        self.phase: AsyncValue[Phase] = AsyncValue(Phase.AWAITING_OPEN)
        self.done = trio.Event()
        self.error: ShardError | None = None  # the fatal error the stream ends with, if any

        self._scope = trio.CancelScope(deadline=deadline)
        self._end_reason: StreamEnd | None = None
        self.ended_at: float | None = None  # trio time the stream was told to stop (observers)
        self._nursery: trio.Nursery | None = None
        self._reader_scope = trio.CancelScope()
        self._owns_engine_session = False  # the engine session exists and is ours to free
        self._importing: handoff.StateImport | None = None  # a state's chunks so far
        self._totals = pb.Usage()

    @property
    def session_id(self) -> str:
        return self.ctx.session_id

    @property
    def deadline(self) -> float:
        """The call deadline (trio clock); ``inf`` without ``grpc-timeout``."""
        return self._deadline

    @property
    def caller(self) -> tuple[str, str]:
        """(principal, host) of the stream's caller: who may fork it (``forks``). (Read once:
        the stream's context is its own copy, which nothing sets either in later.)"""
        if self._caller is None:
            self._caller = caller_of(self._context)
        return self._caller

    @property
    def forkable(self) -> bool:
        """An idle session holding its engine session: what a fork may copy now."""
        return self._owns_engine_session and self.phase.value is Phase.IDLE

    @property
    def positions(self) -> Positions:
        """What the session holds (a routed one's: its relay's ledger)."""
        return self.ctx.positions

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

    # ---- a group's rows (GroupSteps, ``session.group``) ---------------------------------

    def row_refusal(self, caller: tuple[str, str]) -> ShardError | None:
        """Why a GroupSteps row of ``caller`` may not run on this session now (None: it may).
        Another caller's session is answered as an unknown id (as ``fork_of`` is)."""
        sid = self.session_id
        if caller != self.caller or self.phase.value is Phase.AWAITING_OPEN:
            return ShardError(ErrorCode.SESSION_NOT_FOUND,
                              "no live session of this caller with this id", session_id=sid)
        if self.routed is not None or self.returner is not None:
            return ShardError(ErrorCode.UNSUPPORTED_FEATURE, "a session of a chain relay route "
                              "takes its steps on its own stream", session_id=sid)
        if (self.phase.value is not Phase.IDLE or self.error is not None
                or self._end_reason is not None):
            return ShardError(ErrorCode.SESSION_BUSY, "the session is running a step or closing",
                              session_id=sid)
        return None

    def begin_row(self) -> None:
        """A group row of this (idle) session starts: RUNNING, as a step from its stream, so
        its stream's own step requests are refused meanwhile and a Cancel stops the row."""
        self.phase.value = Phase.RUNNING
        self._cancel.begin()
        self._cancel.started()

    def stop_row(self, stop: Stoppable) -> bool:
        """The running row is stopped by ``stop.cancel()`` when a Cancel comes (a grouped row
        runs in no cancel region of this stream); True: a Cancel came already."""
        return self._cancel.watch(stop)

    @property
    def row_cancel_requested(self) -> bool:
        """A Cancel was asked for the running row."""
        return self._cancel.requested

    def end_row(self, generated: int, fatal: ShardError | None = None) -> None:
        """The row ended (``generated``: 1 when its result was computed): IDLE again, and a
        close waiting for the step goes on. Counted in ``SessionClosed.totals``. ``fatal``: an
        error that ends a session's stream (``FATAL_IN_SESSION``) ends this one's."""
        if fatal is not None:
            self._fail(fatal)
        self._cancel.finished()
        self._totals.generated_tokens += generated
        if self.phase.value is Phase.RUNNING:
            self.phase.value = Phase.IDLE
        self._cancel.ended()

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

    # ---- a step and the end of its request -------------------------------------------------

    async def _run_step(self, req: pb.SessionRequest) -> None:
        """One Prefill/Decode/Generate/Rewind (or state move): StepResult*, optional Error,
        then Usage. Only credit waits and engine calls are cancellable by an out-of-band Cancel
        (``StepContext.cancellable``); handing a computed result to the transport is not, so a
        Cancel can never drop a committed result, and ``Usage`` counts exactly the results
        sent."""
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
            ctx = self.ctx
            if self.routed is not None:
                await self.routed.step(req, usage)
            elif kind == "prefill":
                await steps.prefill(ctx, req.prefill, usage)
            elif kind == "decode":
                await steps.decode(ctx, req.decode, usage, self.returner)
            elif kind == "rewind":
                await ctx.truncate_engine(ctx.rewind_position(req.rewind))
            elif kind == "export_state":
                await transfer.export_state(ctx, req.export_state)
            elif kind == "import_state":
                pending, self._importing = self._importing, None
                self._importing = await transfer.import_state(ctx, req.import_state, pending)
            else:
                await steps.run_generate(ctx, req.generate, usage, self._registry)
        except ShardError as exc:
            if exc.code in FATAL_IN_SESSION:
                raise
            err = exc
        finally:
            self._cancel.finished()  # nothing left to stop: a Cancel now finds no step
            self._credits.end_step()  # credits taken for results never sent go back
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
            await self._outbox.respond(pb.SessionResponse(error=err.to_proto()))
        for field in ("prompt_tokens", "generated_tokens", "reused_tokens", "cached_tokens"):
            setattr(self._totals, field, getattr(self._totals, field) + getattr(usage, field))
        if self.ctx.version >= (1, 1):
            usage.n_past = self.positions.end  # what the session holds now, also after a failure
        ended = pb.SessionResponse(usage=usage)
        queued, self._queued = self._queued, None
        if queued is None:
            await self._end_request(ended)
            return
        # A direct-return route's next step, sent before this one ended (also before a
        # CloseSession: the close waits for it).
        await self._outbox.respond(ended)
        if err is None:
            self._start_step(queued)  # (the session stays RUNNING: no request slips in)
            return
        # it was sent for the state the failed step would have left: it must not run
        await self._outbox.respond(pb.SessionResponse(error=ShardError(
            ErrorCode.CANCELLED, "not run: the step queued before it failed",
            session_id=self.session_id, reason="QUEUED_STEP_DROPPED",
        ).to_proto()))
        dropped = pb.Usage()
        if self.ctx.version >= (1, 1):
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
        self._cancel.ended()
        if not queued:  # blocked senders go first when room frees: no later response overtakes it
            await self._outbox.respond(usage)
