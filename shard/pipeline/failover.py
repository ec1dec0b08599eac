"""Where one hop of a generation runs, and moving it: the serving replica and its session,
failover to the next replica, a draining worker's hand-over, and chain relay's re-routing.

When a hop fails over (``should_fail_over``): the worker is gone or going (the connection
was lost, a status ``UNAVAILABLE``: ``NOT_READY``, ``DRAINING``, ``ENGINE_FAILURE``) or it
did not answer one step within ``step_timeout`` (a hung worker). The next replica opens a
session and replays the hop's history (``shard.pipeline.history``), so the step runs again
there and its caller sees each result once. A worker that sends GOAWAY (a drain) is handed
over at the next step without any error: the replacement takes the session's state
(``shard.pipeline.handoff``) or replays the history first, then the draining worker's session
is closed on its still-open stream. Any other error (``INVALID_ARGUMENT``,
``INCOMPATIBLE_MODEL``, a full KV budget, the caller's deadline) is the request's, not the
worker's, and ends the generation at once.

With chain relay (``route``: the first hop's, the only one) a later hop's failure comes as an
error with ``relay_depth``: the route moves to that hop's next replica
(``shard.pipeline.route.ChainRoute``) and a routed session is opened again, under a new name,
and replayed through the new route (the token log: every hop recomputes the history).

Sessions are never left behind (``shard.pipeline.held``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import trio

from shard.client import TOKEN_CREDIT, ClientSession
from shard.deadlines import HOP_DEADLINE_MARGIN, RELAY_DEADLINE_MARGIN, hop_timeout, time_left
from shard.rpc import convert
from shard.rpc.errors import ErrorCode, ShardError
from shard.rpc.handoff import YIELDED

from .errors import STEP_DEADLINE, Hop, PipelineError, should_fail_over
from .generation import Generation
from .handoff import MOVED, REPLICA, SOURCE, move_state, takes_state
from .held import HeldSession, HeldSessions
from .history import HopHistory
from .replicas import HopReplicas, Replica, listing
from .route import ChainRoute

__all__ = ["RELAY_NOT_ALLOWED", "REPLICA_REFUSALS", "HopFailover"]

log = logging.getLogger(__name__)
#: A fork's open refused for one of these opens a plain session instead: the source is gone
#: (released, failed over: its name there is another), busy, or the worker cannot fork.
_NO_FORK = frozenset({ErrorCode.SESSION_NOT_FOUND, ErrorCode.SESSION_BUSY,
                      ErrorCode.UNSUPPORTED_FEATURE})
T = TypeVar("T")

#: ``ShardError.reason`` of a route hop whose worker does not relay (a standby started without
#: ``serve --allow-relay``): with chain relay, not a replica that can take over.
RELAY_NOT_ALLOWED = "RELAY_NOT_ALLOWED"
#: Errors on opening or replaying on a replacement that say "not this replica": try the next.
REPLICA_REFUSALS = frozenset({
    ErrorCode.INCOMPATIBLE_MODEL, ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.SESSION_EXISTS,
    ErrorCode.UNSUPPORTED_VERSION,
})


class HopFailover:
    """The session one hop of one generation runs on (``session``, on ``replica``) and how it
    moves (see the module docstring): ``attempt`` runs a step there, failing over as needed;
    ``open`` and ``close`` start and end it; ``history`` is the runner's log of the hop."""

    def __init__(
        self, replicas: HopReplicas, gen: Generation, history: HopHistory, *,
        route: ChainRoute | None = None,
    ) -> None:
        self.replicas = replicas
        #: Chain relay: the hops after this one, opened by its worker; a later hop that fails
        #: moves the route to its next replica and a routed session is opened and replayed again.
        self.route = route
        self.gen = gen
        self.history = history
        self.index = replicas.index
        self.name = f"{gen.sid}.{self.index}"
        self._opened = 0  # sessions opened: a routed one is named afresh each time
        self.session: ClientSession | None = None
        self.replica = replicas.replica
        self.tried: dict[str, ShardError] = {}  # target -> its last error, in order tried
        self._tried_targets: set[str] = set()
        for replica in replicas.replicas:  # set aside at connect: never a candidate
            if replica.refused is not None:
                self.tried[replica.target] = replica.refused
                self._tried_targets.add(replica.target)
        self.sessions = HeldSessions(gen, replicas)
        self._handover_failed = False
        self._ahead = False  # the open being made may be sent ahead (``open``)
        # A routed session answers for every hop of its route: a step may take each of them
        # its step timeout (the workers on the route wait as long for the hops after them,
        # so the one nearest a hung hop reports it first), and its deadline leaves the
        # relay's margin for the deepest hop's error to travel up.
        self._span = route.span if route is not None else 1
        self._margin = RELAY_DEADLINE_MARGIN if route is not None else HOP_DEADLINE_MARGIN

    @property
    def hop(self) -> Hop:
        return self.replicas.hop(self.replica)

    def named(self, err: ShardError, hop: Hop | None = None) -> PipelineError:
        return self.gen.blames.error(self.hop if hop is None else hop, err)

    async def timed(self, call: Callable[[], Awaitable[T]], steps: int = 1) -> T:
        """``call()`` within ``steps`` times ``step_timeout``: no answer in time is a
        ``STEP_DEADLINE`` error (a hung worker), which fails the hop over."""
        if self.gen.step_timeout is None:
            return await call()
        steps *= self._span
        with trio.move_on_after(self.gen.step_timeout * steps):
            return await call()
        within = f"{steps} x " if steps > 1 else ""
        raise ShardError(
            ErrorCode.DEADLINE_EXCEEDED,
            f"no answer within {within}step_timeout={self.gen.step_timeout:g} s (the worker "
            "may be hung)",
            reason=STEP_DEADLINE,
        )

    async def attempt(self, action: Callable[[ClientSession], Awaitable[T]]) -> T:
        """Run ``action`` on the session; when the worker fails, move to another replica,
        replay, and run it again there."""
        while True:
            if self._should_hand_over():
                await self._hand_over()
            assert self.session is not None
            try:
                return await action(self.session)
            except PipelineError:
                raise
            except ShardError as err:
                if err.reason == YIELDED and self.session.alive:
                    # A drain ended the worker's Generate between two tokens: move the session
                    # (or, if no replica takes it, go on on the draining worker, unyielding).
                    await self._hand_over()
                    continue
                if err.relay_depth:  # a later hop's (chain relay): its replica may take over
                    if not (should_fail_over(err) and self.route is not None
                            and self.route.can_move(err)):
                        raise self.named(err) from None
                    await self._reroute(err)
                    continue
                if not should_fail_over(err):
                    raise self.named(err) from None
                await self._fail_over(err)

    def yields_on_drain(self) -> bool:
        """A ``Generate`` here should yield the session on a drain: a replica may take it."""
        return (not self._handover_failed and self._may_move()
                and any(takes_state(self.replica.caps, c.caps) for c in self._candidates()))

    async def open(self, *, ahead: bool = False) -> None:
        """Open the hop's session on the current replica (or the next that takes it).

        ``ahead``: where nothing that follows depends on the worker's answer, send the open and
        return without waiting for it, so the first step follows it on the stream at once
        (``ShardClient.open_session(ahead=True)``). That holds for a whole-model hop without a
        route, with one replica, not opened as a fork: its first prefill needs no
        ``cache_limit`` (no probe is asked), and a refused open has no other replica to try,
        so the refusal fails the first step as it would have failed the open."""
        self._ahead = ahead
        try:
            await self._replace(None)
        finally:
            self._ahead = False

    async def close(self) -> None:
        """Close the session (released). A worker that fails now has nothing left to compute:
        its session is retired like a failed one, without failing over."""
        for held in self.sessions:
            if held.session is not self.session or held.session is None:
                self.sessions.retire(held)
                continue
            session = held.session
            try:
                await self.timed(session.close)
            except ShardError as err:
                if err.relay_depth or not should_fail_over(err):
                    raise self.named(err) from None
                log.info("%s: closing failed (%s); releasing instead", self.hop, err)
                self.sessions.retire(held)
                continue
            self.sessions.forget(held)

    def _candidates(self) -> Iterator[Replica]:
        """Untried replicas, the current one first, then the others in the order given."""
        n = len(self.replicas.replicas)
        for i in range(n):
            replica = self.replicas.replicas[(self.replicas.current + i) % n]
            if replica.target not in self._tried_targets:
                yield replica

    async def _fail_over(self, err: ShardError) -> None:
        failed = self.replica
        log.warning("%s failed: %s", self.hop, err)
        self.tried[failed.target] = err
        self._tried_targets.add(failed.target)
        for held in self.sessions.of(self.session):
            self.sessions.retire(held)
        self.session = None
        has_alternative = next(self._candidates(), None) is not None
        if has_alternative and not self.history.replayable():
            raise PipelineError(self.replicas.hop(failed), err, tried=list(self.tried.items()),
                                note=f"no failover: {self.gen.budget.why_dropped()}")
        await self._replace(err)

    def _should_hand_over(self) -> bool:
        client = self.replica.client
        return (
            self.session is not None and client is not None and client.going_away
            and not self._handover_failed and (self.history.replayable() or self._may_move())
            and next(self._candidates(), None) is not None  # (the serving one counts as tried)
        )

    def _may_move(self) -> bool:
        """The session's state can leave its worker (session hand-off): a plain session (a
        routed one holds its chain together) on a worker that exports states."""
        caps, session = self.replica.caps, self.session
        return (self.gen.handoff and self.route is None and caps is not None
                and caps.session_handoff
                and session is not None and session.alive)

    async def _hand_over(self) -> None:
        """The worker is draining: move the session's state to another replica (session
        hand-off; replay there when the state cannot move), then close the old session
        gracefully on its stream (it still works after GOAWAY). If no replica takes over,
        stay on the draining worker (its open streams may finish)."""
        old = self.replica
        cause = ShardError(ErrorCode.DRAINING, f"{old.target} sent GOAWAY (draining)")
        self.tried[old.target] = cause
        self._tried_targets.add(old.target)
        keep = self.sessions.of(self.session)
        try:
            await self._replace(cause, handover=True, source=self.session)
        except PipelineError as err:
            log.warning("%s: no replica took over from the draining worker: %s", self.hop, err)
            self._handover_failed = True
            return
        for held in keep:
            self.sessions.retire(held, graceful=True)

    async def _replace(
        self, cause: ShardError | None, *, handover: bool = False,
        source: ClientSession | None = None,
    ) -> None:
        """Open a session on the first candidate that takes it and bring it to the history
        there: the state of ``source`` (a draining worker's session) moved, else replayed."""
        started = trio.current_time()
        for replica in self._candidates():
            self._tried_targets.add(replica.target)
            try:
                held = await self._open_replayed(replica, source)
            except ShardError as err:
                if isinstance(err, PipelineError) or err.relay_depth or not (
                    should_fail_over(err) or err.code in REPLICA_REFUSALS
                ):
                    raise self.named(err, self.replicas.hop(replica)) from None
                log.warning("%s: %s cannot take over: %s", self.hop, replica.target, err)
                self.tried[replica.target] = err
                continue
            previous = self.replica
            self.session, self.replica = held.session, replica
            self.replicas.current = self.replicas.replicas.index(replica)
            if cause is not None:
                self.gen.record(self.index, cause, previous, replica, handover=handover,
                                started=started, positions=self.history.held, moved=held.moved)
            return
        # named: the replica that failed (at the first open: the first one asked)
        cause = cause if cause is not None else self.tried[self.replica.target]
        tried = list(self.tried.items())
        raise PipelineError(self.hop, cause, tried=tried, note=listing(tried))

    async def _open_replayed(
        self, replica: Replica, source: ClientSession | None = None
    ) -> HeldSession:
        """A new session on ``replica`` (with chain relay: with the route as it is now, under a
        name of its own), holding the whole history: ``source``'s state moved into it when it
        can be, replayed otherwise; on failure it is retired and the error raised."""
        name = self.name
        if self.route is not None and self._opened:
            # A routed session's workers name theirs after it; one a lost worker left behind
            # may still be retained, so a new route never reuses a name.
            name = f"{self.gen.sid}.{self.index}~{self._opened}"
        self._opened += 1
        held = HeldSession(replica, name,
                           downstream=self.route.serving() if self.route is not None else [])
        self.sessions.add(held)
        history = self.history
        try:
            await self.timed(lambda: self.replicas.ensure(replica, self._connect_timeout()))
            held.session = await self.timed(lambda: self._open_on(replica, name))
            moved = SOURCE
            if source is not None and self._may_move():
                moved = await move_state(source, held.session, replica, serving=self.replica,
                                         positions=history.held, timed=self.timed, hop=self.hop)
            held.moved = moved is MOVED
            if not held.moved and history.replayable():
                await history.replay(held.session, chunk_tokens=self.gen.chunk_tokens,
                                     parse_special=self.gen.parse_special,
                                     reference=self.replicas.reference, timed=self.timed)
            elif moved is REPLICA:  # (and the history cannot be replayed) the next replica may
                raise ShardError(ErrorCode.INCOMPATIBLE_MODEL, f"{replica.target} did not take "
                                 "the session's state", reason="STATE_REFUSED")
            elif moved is SOURCE:  # a hand-off the draining worker could not give
                self._tried_targets.discard(replica.target)  # (not the replica's fault)
                raise PipelineError(self.hop, ShardError(
                    ErrorCode.DRAINING, "the draining worker gave no state"),
                    note=f"no failover: {self.gen.budget.why_dropped()}")
        except ShardError as err:
            self.sessions.retire(held, cause=err)
            raise
        self.name = name
        return held

    async def _reroute(self, err: ShardError) -> None:
        """A later hop of the route failed (chain relay): move the route to that hop's next
        replica and open and replay a routed session with it on the first hop's worker; a
        replica that cannot take over (lost too, or refusing) moves the route on again."""
        assert self.route is not None
        started = trio.current_time()
        for held in self.sessions.of(self.session):
            self.sessions.retire(held, cause=err)
        self.session = None
        while True:
            hop, old, new = self.route.move(err)  # a PipelineError when none is left
            self.gen.blames.hops = self.route.hops()
            log.warning("%s failed: %s; the route moves to %s", hop.hop(old), err, new.target)
            try:
                held = await self._open_replayed(self.replica)
            except ShardError as again:
                if isinstance(again, PipelineError):
                    raise
                taken = again.relay_depth and (should_fail_over(again) or again.code in
                                               REPLICA_REFUSALS or again.reason == RELAY_NOT_ALLOWED)
                if taken and self.route.failed_hop(again) is not None:
                    err = again  # the new replica (or another later hop) cannot serve
                    continue
                if not again.relay_depth and should_fail_over(again):
                    await self._fail_over(again)  # the first hop's own worker failed meanwhile
                    return
                raise self.named(again) from None
            self.session = held.session
            self.gen.record(hop.index, err, old, new, handover=False, started=started,
                            positions=self.history.held)
            return

    def _connect_timeout(self) -> float | None:
        left = time_left(self.gen.deadline)
        bound = self.gen.step_timeout
        if left is None:
            return bound
        return left if bound is None else min(left, bound)

    async def _open_on(self, replica: Replica, name: str) -> ClientSession:
        """Open the session with the remaining budget, rounded down, as its grpc-timeout; at
        the first open of a fork (``Generation.fork_of``) as a fork of the source's session on
        that replica, or, where it cannot be forked (gone, busy, a worker without forks), as a
        plain one (the prompt is then computed as usual)."""
        source = self.gen.fork_of
        caps = replica.caps
        if source and self._opened == 1 and caps is not None and caps.session_fork:
            try:
                return await self._open_fresh(replica, name, fork_of=f"{source}.{self.index}")
            except ShardError as err:
                if err.code not in _NO_FORK:
                    raise
                log.info("%s: no fork of %s (%s): a plain session", self.hop, source, err)
        return await self._open_fresh(replica, name)

    async def _open_fresh(self, replica: Replica, name: str, fork_of: str = "") -> ClientSession:
        ref = self.replicas.reference
        assert ref is not None and replica.client is not None and replica.caps is not None
        timeout = hop_timeout(self.gen.deadline, self._margin)
        if timeout is not None and timeout <= 0:
            raise ShardError(ErrorCode.DEADLINE_EXCEEDED, "the pipeline deadline expired")
        want = convert.offered_dtype(replica.caps, self.gen.hidden_dtype)
        tokens_only = replica.caps.is_first and replica.caps.is_last and self.route is None
        ahead = (self._ahead and tokens_only and not fork_of and self._opened == 1
                 and len(self.replicas.replicas) == 1)
        return await replica.client.open_session(
            name,
            # a whole-model hop's results are tokens: a wide window costs fewer grants
            credit=TOKEN_CREDIT if tokens_only else 0,
            expected_model_fingerprint=ref.model_fingerprint,
            expected_layer_range=(ref.layer_range.start, ref.layer_range.end),
            # float32 is not asked for, so a v1.0 exchange stays byte for byte the same
            hidden_wire_dtype="" if want == convert.HIDDEN_DTYPE else want,
            route=self.route.message() if self.route is not None else None,
            batch_group=self.gen.batch_group,
            prefix_probe=self.gen.prefix_probe if self.probes(replica) else (),
            fork_of=fork_of,
            timeout=timeout,
            ahead=ahead,
        )

    def probes(self, replica: Replica) -> bool:
        """Whether the session on ``replica`` is asked what it holds of the prompt
        (``shard.pipeline.prefix``): a later hop's, or a first hop's that asks its route; one
        that answers, when the prompt's ids are known."""
        caps = replica.caps
        return (bool(self.gen.prefix_probe) and caps is not None and caps.prefix_cache_limit
                and (self.index > 0 or self.route is not None))
