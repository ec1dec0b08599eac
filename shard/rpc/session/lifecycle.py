"""A session's life on its stream: open (fresh, resumed or attached to a route), close, and
release or retain at the end.

Resource handling: the stream's task owns the engine session from OpenSession until it either
releases it or hands it to the registry as *retained* (kept for ``resume_ttl`` so a new stream
can resume it). The cleanup runs shielded, so a cancelled or failed stream never leaks KV cells.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from shard.engine import EngineError, EngineState, SessionInfo, TooManySessions
from shard.v1 import shard_pb2 as pb

from .. import convert
from ..errors import ErrorCode, ShardError
from ..positions import Positions
from . import inputs
from .forks import fork_source
from .phase import CLOSED_REASON, RETAIN_ON_END, Phase, StreamEnd
from .protocols import NOT_ALLOWED, Retained


class Lifecycle:
    """``SessionCall``'s open and close (a mixin: the call's own life; the session's fields
    it sets are its step context's, ``SessionCall.ctx``)."""

    # ---- open ----------------------------------------------------------------------------

    async def _open(self, req: pb.OpenSession, version: tuple[int, int]) -> None:
        sid = req.session_id
        inputs.check_session_id(sid)
        try:
            caps = self._engine.capabilities()
        except EngineError as exc:
            raise ShardError.from_engine(exc) from None
        if self._registry.draining:
            raise ShardError(ErrorCode.DRAINING, session_id=sid)
        inputs.check_model(req, caps, sid)
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
        source = fork_source(self, req, routed) if req.fork_of else None
        retained = self._registry.claim(sid, self, resuming=expectation is not None)
        ctx = self.ctx
        # claimed: from here on the cleanup frees or returns it
        ctx.opened(sid, caps, version, wire_dtype,
                   req.step_timeout_ms / 1000 if req.step_timeout_ms else None, req.batch_group)
        if source is not None:
            cache = await self._open_fork(sid, source)
        else:
            cache = await self._attach_kv(sid, req.kv_budget or None, expectation, retained)
        if routed:
            assert self._relay is not None and self._nursery is not None
            self.routed = await self._relay.open(ctx, req, nursery=self._nursery)
            ctx.positions = self.routed.positions
            ctx.kv_capacity = min(ctx.kv_capacity, self.routed.kv_capacity)
            if source is not None:
                self.routed.positions.forked(source.positions)
        elif returning:
            assert self._relay is not None and self._nursery is not None
            self.returner = await self._relay.open_return(
                req.route.return_to, deadline=self._deadline, nursery=self._nursery
            )
            # The chain's copy of each answer is the fallback: it leaves through the handler,
            # after the direct copy the returner sends (which is why the route asked for one).
            ctx.outbox.through_handler = True
        self._queue_ok = returning
        prefix_held = self._prefix_held(req)
        credit = ctx.credits.open(req.initial_credit or self._limits.default_credit)
        self.phase.value = Phase.IDLE
        await ctx.outbox.respond(
            pb.SessionResponse(
                opened=pb.SessionOpened(
                    session_id=sid,
                    cache=cache,
                    kv_capacity=self.ctx.kv_capacity,
                    n_past=ctx.positions.end,
                    credit=credit,
                    version=pb.ProtocolVersion(major=version[0], minor=version[1]),
                    # echoed only when asked, so that v1.0 clients see the same bytes as before
                    hidden_wire_dtype=wire_dtype if req.hidden_wire_dtype else "",
                    prefix_cached_tokens=prefix_held,
                )
            )
        )

    def _prefix_held(self, req: pb.OpenSession) -> int:
        """The answer to ``prefix_probe``: how many of its leading ids this worker's prefix
        cache holds now, and with a route the least of that and what the route holds (a hop
        that cannot say does not lower it: the client's retry covers it)."""
        if not req.prefix_probe:
            return 0
        try:
            own = self._engine.cached_prefix(req.prefix_probe)
        except EngineError as exc:
            raise ShardError.from_engine(exc) from None
        down = self.routed.prefix_held if self.routed is not None else None
        return own if down is None else min(own, down)

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
                self.ctx.positions.resumed(held, retained.engine_len)
                self.ctx.kv_capacity = retained.kv_capacity
                self._registry.count("sessions_resumed_total")
                return R(outcome=outcome, tokens_held=held, reason=reason)
            # Mismatch: the held cache is of no use to this client. Release it (with a prefix
            # cache its history becomes an entry, which serves what the client's replay shares
            # with it) and start empty.
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

    async def _open_fork(self, sid: str, source: Lifecycle) -> pb.CacheResult:
        """Open the engine session as a fork of ``source``'s (``OpenSession.fork_of``)."""
        info = await self._engine_open(
            lambda: self._engine.fork_session(source.session_id, sid,
                                              batch_group=self.ctx.batch_group))
        self.ctx.positions.forked(source.positions)
        self._registry.count("sessions_forked_total")
        return pb.CacheResult(outcome=pb.CacheResult.OUTCOME_NEW)

    async def _open_fresh(self, sid: str, kv_budget: int | None) -> None:
        await self._engine_open(lambda: self._engine.open_session(
            sid, kv_budget=kv_budget, batch_group=self.ctx.batch_group))

    async def _engine_open(self, open_: Callable[[], Awaitable[SessionInfo]]) -> SessionInfo:
        """The engine session ``open_`` opens, evicting retained sessions for room; the stream
        owns it from here and starts counting from what it holds."""
        while True:
            try:
                info = await open_()
                break
            except TooManySessions as exc:
                # Retained sessions are a best-effort cache: evict the oldest before refusing
                # (released: with a prefix cache, its history stays as an entry).
                if not await self._registry.evict_one():
                    raise ShardError.from_engine(exc) from None
            except EngineError as exc:
                raise ShardError.from_engine(exc) from None
        self._owns_engine_session = True
        self.ctx.kv_capacity = info.kv_budget
        self.ctx.positions = Positions()
        return info

    # ---- close ---------------------------------------------------------------------------

    async def _close_requested(self, *, retain: bool, half_close: bool) -> None:
        """CloseSession or half-close: let the running step finish, then release or retain."""
        self.phase.value = Phase.CLOSING
        self.ctx.credits.unlimited()  # the client can no longer grant credit
        await self._cancel.active.wait_value(False)
        if self.routed is not None:
            await self.routed.close()
        C = pb.SessionClosed
        reason = C.REASON_CLIENT_HALF_CLOSE if half_close else C.REASON_CLIENT_CLOSE
        closed = await self._close(retain=retain, reason=reason)
        await self.ctx.outbox.respond(pb.SessionResponse(closed=closed))
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
                    kv_capacity=self.ctx.kv_capacity,
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
        retain = self.error is None and reason in RETAIN_ON_END
        closed_reason = pb.SessionClosed.REASON_ERROR if reason is None else CLOSED_REASON[reason]
        closed = await self._close(retain=retain, reason=closed_reason)
        if reason is StreamEnd.RELEASED:
            try:
                self.ctx.outbox.send_nowait(pb.SessionResponse(closed=closed))
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client is not reading; the stream still ends cleanly
