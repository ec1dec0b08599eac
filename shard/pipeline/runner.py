"""One hop of one generation: its session, its replay log, failover to a replica.

``HopRunner`` drives a hop for one ``generate``: it opens the session, sends each step, logs what
it sent (``shard.pipeline.replay``) and, when the worker fails, moves the hop to the next replica
(``shard.pipeline.replicas``) and replays the log there, so its caller sees each step's result
once, as if nothing had happened. Why a class per hop rather than code in the pipeline: the
client-relayed pipeline drives one runner per hop, and a chain-relayed one drives the runner of
the hop it talks to.

When a hop fails over (``should_fail_over``): the worker is gone or going (the connection
was lost, a status ``UNAVAILABLE``: ``NOT_READY``, ``DRAINING``, ``ENGINE_FAILURE``) or it
did not answer one step within ``step_timeout`` (a hung worker). A worker that sends GOAWAY
(a drain) is handed over at the next step without any error: the replacement replays the
history first, then the draining worker's session is closed on its still-open stream. Any
other error (``INVALID_ARGUMENT``, ``INCOMPATIBLE_MODEL``, a full KV budget, the caller's
deadline) is the request's, not the worker's, and ends the generation at once.

With chain relay (``route``: the first hop's runner, the only one) a later hop's failure comes
as an error with ``relay_depth``: the route moves to that hop's next replica
(``shard.pipeline.route.ChainRoute``) and a routed session is opened again, under a new name, and
replayed through the new route (the token log: every hop recomputes the history).

Sessions are never left behind: a failed worker's session is reset (``RST_STREAM``) and, when
its connection was lost (the worker may be alive and would retain it), released through a new
connection, in a task of the nursery the generation owns, bounded like every cleanup.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import trio

from shard.client import TOKEN_CREDIT, ClientSession, ShardClient, StepStream
from shard.deadlines import HOP_DEADLINE_MARGIN, RELAY_DEADLINE_MARGIN, hop_timeout, time_left
from shard.rpc import convert
from shard.rpc.errors import ErrorCode, ShardError
from shard.rpc.handoff import MIN_CHUNK_BYTES, YIELDED
from shard.rpc.routes import relay_session_id
from shard.v1 import shard_pb2 as pb

from .errors import STEP_DEADLINE, Blames, Hop, PipelineError, should_fail_over
from .replay import ReplayBudget, RowLog, TokenLog
from .replicas import HopReplicas, Replica, listing
from .route import ChainRoute

__all__ = [
    "CLEANUP_GRACE",
    "RELEASE_TIMEOUT",
    "Failover",
    "Generation",
    "HopOutput",
    "HopRunner",
    "release_session",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

RELEASE_TIMEOUT = 2.0  # seconds a cleanup (Release, shielded) may take at most...
CLEANUP_GRACE = 0.5  # ...and how long it may go on after the caller's deadline
#: A replay result covers this many prefill chunks (``chunk_tokens`` each) and may take as many
#: ``step_timeout``s: small chunks cost a worker more per position (1,024 positions of the tiny
#: model replayed in 407 ms in chunks of 32, in 38 ms in chunks of 256; docs/pipelines.md).
REPLAY_CHUNKS = 8
#: ``ShardError.reason`` of a route hop whose worker does not relay (a standby started without
#: ``serve --allow-relay``): with chain relay, not a replica that can take over.
RELAY_NOT_ALLOWED = "RELAY_NOT_ALLOWED"
#: What became of a session's state on a drain (``HopRunner._move``): it moved; the replica
#: did not take it; the draining worker did not give it.
MOVED, REPLICA, SOURCE = "moved", "replica", "source"
#: Errors on opening or replaying on a replacement that say "not this replica": try the next.
REPLICA_REFUSALS = frozenset({
    ErrorCode.INCOMPATIBLE_MODEL, ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.SESSION_EXISTS,
    ErrorCode.UNSUPPORTED_VERSION,
})


@dataclass(frozen=True)
class Failover:
    """A hop that moved to another replica during a generation (``PipelineResult.failovers``).

    ``recovery_ms``: from the failure reaching the client (or the GOAWAY being noticed) to the
    replacement holding the whole history again; ``positions``: how many it replayed."""

    hop: int
    from_target: str
    to_target: str
    reason: str  # the failure's ErrorCode name (DRAINING for a handover)
    message: str
    handover: bool  # a draining worker handed over: no step failed
    positions: int
    recovery_ms: float
    #: The session's state moved from the draining worker (session hand-off): the replacement
    #: recomputed nothing; False: it replayed ``positions``.
    moved: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"hop": self.hop, "from": self.from_target, "to": self.to_target,
                "reason": self.reason, "handover": self.handover, "moved": self.moved,
                "positions": self.positions, "recovery_ms": round(self.recovery_ms, 1)}


#: Releases a session by name on a replica; never raises (the pipeline's, it has the TLS
#: context and metadata to connect again).
Release = Callable[[Replica, str], Awaitable[None]]


@dataclass
class Generation:
    """What every hop of one ``generate`` shares."""

    sid: str
    deadline: float
    sampling: pb.SamplingParams
    top_logprobs: int
    chunk_tokens: int
    hidden_dtype: str
    step_timeout: float | None
    budget: ReplayBudget
    release: Release
    #: ``start_soon`` of the nursery that owns the releases of failed sessions (the
    #: generation's): they run while it goes on and it waits for them, bounded.
    spawn: Callable[..., None]
    failovers: list[Failover] = field(default_factory=list)
    #: Names the hop of every error (a later hop's, for an error a chain relay passed up).
    blames: Blames = field(default_factory=Blames)
    #: Every session of the generation is opened in this batch group (``shard.pipeline.groups``).
    batch_group: int = 0
    #: A text prompt's special-token texts become special tokens (``Prefill.parse_special``).
    parse_special: bool = False
    #: A draining worker's sessions move to the replica as state (``HopRunner._move``).
    handoff: bool = True

    def cleanup_deadline(self) -> float:
        return min(trio.current_time() + RELEASE_TIMEOUT, self.deadline + CLEANUP_GRACE)


@dataclass
class HopOutput:
    """One step's result at a hop: the StepResult and, for a non-last hop, its validated
    float32 boundary rows starting at position ``start``."""

    step: pb.StepResult
    start: int
    rows: np.ndarray | None


@dataclass
class _Held:
    """A session this runner answers for (None: its open was started, outcome unknown), by its
    name; with chain relay, the replicas its route named (each may hold the session its worker
    opened, named after this one: ``relay_session_id``)."""

    replica: Replica
    name: str
    session: ClientSession | None = None
    downstream: list[Replica] = field(default_factory=list)
    moved: bool = False  # it took the history as a state moved from a draining worker


class HopRunner:
    """One hop of one ``generate``: ``open``, then ``prefill_prompt`` (first hop) or
    ``prefill_rows``, ``decode``, and ``close``; on failure ``abort`` and ``release``. Every
    step call fails over by itself (see the module docstring) and returns its result once."""

    def __init__(
        self, replicas: HopReplicas, gen: Generation, *, last: bool, route: ChainRoute | None = None
    ) -> None:
        self.replicas = replicas
        #: Chain relay: the hops after this one, opened by its worker (``last`` is then True:
        #: the worker answers with the last shard's results); a later hop that fails moves the
        #: route to its next replica and this runner opens and replays a routed session again.
        self.route = route
        self.gen = gen
        self.index = replicas.index
        self.first = self.index == 0
        self.last = last
        self.name = f"{gen.sid}.{self.index}"
        self._opened = 0  # sessions opened: a routed one is named afresh each time
        self.session: ClientSession | None = None
        self.replica = replicas.replica
        self.held = 0  # positions the session holds
        self.tokens = TokenLog()  # the first hop's input (a few bytes a position)
        #: The prompt's token ids: the caller's, or a text's as the first shard tokenized it
        #: (``Prefill.echo_tokens``; None from a worker that does not echo them).
        self.prompt_ids: list[int] | None = None
        alternatives = len(replicas.replicas) > 1
        self.rows = RowLog(gen.budget) if alternatives and not self.first else None
        self.tried: dict[str, ShardError] = {}  # target -> its last error, in order tried
        self._tried_targets: set[str] = set()
        for replica in replicas.replicas:  # set aside at connect: never a candidate
            if replica.refused is not None:
                self.tried[replica.target] = replica.refused
                self._tried_targets.add(replica.target)
        self._live: list[_Held] = []
        self._handover_failed = False
        # A routed session answers for every hop of its route: a step may take each of them
        # its step timeout (the workers on the route wait as long for the hops after them,
        # so the one nearest a hung hop reports it first), and its deadline leaves the
        # relay's margin for the deepest hop's error to travel up.
        self._span = route.span if route is not None else 1
        self._margin = RELAY_DEADLINE_MARGIN if route is not None else HOP_DEADLINE_MARGIN

    @property
    def hop(self) -> Hop:
        return self.replicas.hop(self.replica)

    def _named(self, err: ShardError, hop: Hop | None = None) -> PipelineError:
        return self.gen.blames.error(self.hop if hop is None else hop, err)

    # ---- steps ----------------------------------------------------------------------------

    async def open(self) -> None:
        """Open the hop's session on the current replica (or the next that takes it)."""
        await self._replace(None)

    async def prefill_prompt(
        self, prompt: str | Sequence[int], emit: Callable[[HopOutput], Awaitable[None]]
    ) -> None:
        """First hop: prefill the prompt in chunks, ``emit`` each chunk's output once (after a
        failover the replacement computes the prompt again; what was emitted is not repeated)."""
        text = prompt if isinstance(prompt, str) else None
        tokens = None if isinstance(prompt, str) else list(prompt)
        emitted = 0

        async def action(session: ClientSession) -> None:
            nonlocal emitted
            steps = session.prefill_chunks(
                tokens, text=text, chunk_tokens=self.gen.chunk_tokens,
                sampling=self.gen.sampling, top_logprobs=self.gen.top_logprobs,
                echo_tokens=text is not None, parse_special=self.gen.parse_special,
            )
            while (step := await self._timed(lambda: _next(steps))) is not None:
                if step.HasField("input_tokens"):
                    self.prompt_ids = list(step.input_tokens.ids)
                out = self._output(step, session)
                if step.n_past <= emitted:
                    continue  # already emitted before a failover
                if out.rows is not None and out.start < emitted:
                    out = HopOutput(step, emitted, out.rows[emitted - out.start:])
                emitted = step.n_past
                await emit(out)

        await self._attempt(action)  # a replacement replays nothing: held stays 0 until here
        self.tokens.hold_prompt(prompt, emitted)
        self.held = emitted

    async def prefill_rows(self, position: int, rows: np.ndarray) -> HopOutput:
        """Later hop: prefill boundary ``rows`` at ``position``."""
        out = await self._attempt(lambda s: self._step(s, lambda: s.prefill(
            hidden_states=rows, position=position, sampling=self.gen.sampling,
            top_logprobs=self.gen.top_logprobs,
        )))
        self._log_rows(rows)
        return out

    async def verify(
        self, position: int, *, tokens: Sequence[int] | None = None, rows: np.ndarray | None = None
    ) -> HopOutput:
        """A speculative step at ``position``: token ids (first hop) or boundary rows (later
        hops) written over whatever the session holds from there (the rejected drafts of the
        step before, on every hop alike). The last hop returns one ``Logits`` per position
        (``step.position_logits``, checked)."""
        n = len(tokens) if tokens is not None else int(rows.shape[0])  # type: ignore[union-attr]
        out = await self._attempt(lambda s: self._step(s, lambda: s.prefill(
            tokens, hidden_states=rows, position=position, sampling=self.gen.sampling,
            top_logprobs=self.gen.top_logprobs, all_logits=self.last,
        )))
        if self.last and len(out.step.position_logits) != n:
            raise PipelineError(self.hop, ShardError(
                ErrorCode.INTERNAL,
                f"asked for the logits of {n} positions, got {len(out.step.position_logits)}",
            ))
        if tokens is not None:
            self.tokens.write(position, tokens)
        elif self.rows is not None and self.session is not None:
            self.rows.truncate(position)
            self.rows.append(rows, self.session.hidden_dtype)  # type: ignore[arg-type]
        return out

    async def decode(self, *, token: int | None = None, row: np.ndarray | None = None) -> HopOutput:
        """One position: a token id (first hop) or one boundary row (later hops)."""
        out = await self._attempt(lambda s: self._step(s, lambda: s.decode(
            token, hidden_state=row, sampling=self.gen.sampling,
            top_logprobs=self.gen.top_logprobs,
        )))
        if token is not None:
            self.tokens.append(token)
        elif row is not None:
            self._log_rows(row)
        return out

    async def generate(
        self, emit: Callable[[pb.StepResult], Awaitable[None]], *, max_tokens: int,
        stop_tokens: Sequence[int], ignore_eos: bool, fed: int | None = None,
    ) -> None:
        """Server-driven decoding from the last result on (a routed first hop: the workers
        loop, the client only reads); ``emit`` sees each step once, the last with its
        ``finish_reason``. ``fed``: the token of that last result, which the loop feeds first
        (each step's token is fed by the next; the log records what the session holds)."""
        feeding, emitted, runs = fed, 0, 0

        async def action(session: ClientSession) -> None:
            nonlocal feeding, emitted, runs
            # After a failover the replay holds every position before the token to feed: feed
            # it explicitly (a sampled replay's own last choice may differ from it).
            prompt = [feeding] if runs and feeding is not None else None
            runs += 1
            steps = session.generate(
                prompt,
                max_tokens=max_tokens - emitted, sampling=self.gen.sampling,
                stop_tokens=stop_tokens, ignore_eos=ignore_eos,
                top_logprobs=self.gen.top_logprobs,
                # a drain yields the session between two tokens, to be moved to a replica
                yield_on_drain=not self._handover_failed and self._may_move()
                and any(self._takes_state(c) for c in self._candidates()),
            )
            while (step := await self._timed(lambda: _next(steps))) is not None:
                self._output(step, session)
                self.held = step.n_past
                if feeding is not None:
                    self.tokens.append(feeding)
                feeding = step.logits.token_id
                emitted += 1
                await emit(step)

        await self._attempt(action)

    async def close(self) -> None:
        """Close the session (released). A worker that fails now has nothing left to compute:
        its session is retired like a failed one, without failing over."""
        for held in list(self._live):
            if held.session is not self.session or held.session is None:
                self._retire(held)
                continue
            session = held.session
            try:
                await self._timed(session.close)
            except ShardError as err:
                if err.relay_depth or not should_fail_over(err):
                    raise self._named(err) from None
                log.info("%s: closing failed (%s); releasing instead", self.hop, err)
                self._retire(held)
                continue
            self._live.remove(held)

    def abort(self) -> None:
        """Reset every stream this runner holds now (sync: the workers stop and release)."""
        for held in self._live:
            if held.session is not None:
                held.session.abort()

    async def release(self) -> None:
        """``Release`` on every replica where this runner may hold a session (never raises;
        the caller bounds and shields it)."""
        async with trio.open_nursery() as nursery:
            for held in self._live:
                nursery.start_soon(self.gen.release, held.replica, held.name)
                # a worker lost mid-chain leaves the next one retaining its session
                for replica, name in _downstream_names(held):
                    nursery.start_soon(self.gen.release, replica, name)

    # ---- plumbing -------------------------------------------------------------------------

    async def _step(
        self, session: ClientSession, call: Callable[[], Awaitable[pb.StepResult]]
    ) -> HopOutput:
        step = await self._timed(call)
        out = self._output(step, session)
        self.held = step.n_past
        return out

    def _output(self, step: pb.StepResult, session: ClientSession) -> HopOutput:
        """Validate a result: logits from the last hop, well-formed rows from the others."""
        if self.last:
            if step.WhichOneof("output") != "logits":
                raise ShardError(ErrorCode.INTERNAL, "expected logits from the last shard")
            return HopOutput(step, step.n_past, None)
        if step.WhichOneof("output") != "hidden_states":
            raise ShardError(ErrorCode.INTERNAL, "expected hidden states from a non-last shard")
        assert self.replicas.reference is not None
        rows = convert.tensor_to_array(
            step.hidden_states, self.replicas.reference.n_embd, session.session_id,
            dtype=session.hidden_dtype, rows=step.tokens_processed or None,
        )
        return HopOutput(step, step.n_past - rows.shape[0], rows)

    def _log_rows(self, rows: np.ndarray) -> None:
        if self.rows is not None and self.session is not None:
            self.rows.append(rows, self.session.hidden_dtype)

    async def _timed(self, call: Callable[[], Awaitable[T]], steps: int = 1) -> T:
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

    async def _attempt(self, action: Callable[[ClientSession], Awaitable[T]]) -> T:
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
                        raise self._named(err) from None
                    await self._reroute(err)
                    continue
                if not should_fail_over(err):
                    raise self._named(err) from None
                await self._fail_over(err)

    def _replayable(self) -> bool:
        return self.first or self.held == 0 or (self.rows is not None and not self.rows.dropped)

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
        for held in [h for h in self._live if h.session is self.session]:
            self._retire(held)
        self.session = None
        has_alternative = next(self._candidates(), None) is not None
        if has_alternative and not self._replayable():
            raise PipelineError(self.replicas.hop(failed), err, tried=list(self.tried.items()),
                                note=f"no failover: {self.gen.budget.why_dropped()}")
        await self._replace(err)

    def _should_hand_over(self) -> bool:
        client = self.replica.client
        return (
            self.session is not None and client is not None and client.going_away
            and not self._handover_failed and (self._replayable() or self._may_move())
            and next(self._candidates(), None) is not None  # (the serving one counts as tried)
        )

    def _takes_state(self, replica: Replica) -> bool:
        """``replica`` reports that it takes states of this hop's layout (it may still refuse
        one: the worker decides)."""
        mine, theirs = self.replica.caps, replica.caps
        return (mine is not None and theirs is not None and theirs.session_handoff
                and theirs.kv_layout == mine.kv_layout)

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
        keep = [h for h in self._live if h.session is self.session]
        try:
            await self._replace(cause, handover=True, source=self.session)
        except PipelineError as err:
            log.warning("%s: no replica took over from the draining worker: %s", self.hop, err)
            self._handover_failed = True
            return
        for held in keep:
            self._retire(held, graceful=True)

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
                    raise self._named(err, self.replicas.hop(replica)) from None
                log.warning("%s: %s cannot take over: %s", self.hop, replica.target, err)
                self.tried[replica.target] = err
                continue
            previous = self.replica
            self.session, self.replica = held.session, replica
            self.replicas.current = self.replicas.replicas.index(replica)
            if cause is not None:
                self._record(cause, previous, replica, handover, started, moved=held.moved)
            return
        # named: the replica that failed (at the first open: the first one asked)
        cause = cause if cause is not None else self.tried[self.replica.target]
        tried = list(self.tried.items())
        raise PipelineError(self.hop, cause, tried=tried, note=listing(tried))

    async def _open_replayed(self, replica: Replica, source: ClientSession | None = None) -> _Held:
        """A new session on ``replica`` (with chain relay: with the route as it is now, under a
        name of its own), holding the whole history: ``source``'s state moved into it when it
        can be, replayed otherwise; on failure it is retired and the error raised."""
        name = self.name
        if self.route is not None and self._opened:
            # A routed session's workers name theirs after it; one a lost worker left behind
            # may still be retained, so a new route never reuses a name.
            name = f"{self.gen.sid}.{self.index}~{self._opened}"
        self._opened += 1
        held = _Held(replica, name,
                     downstream=self.route.serving() if self.route is not None else [])
        self._live.append(held)
        try:
            await self._timed(lambda: self.replicas.ensure(replica, self._connect_timeout()))
            held.session = await self._timed(lambda: self._open_on(replica, name))
            moved = SOURCE
            if source is not None and self._may_move():
                moved = await self._move(source, held.session, replica)
            held.moved = moved is MOVED
            if not held.moved and self._replayable():
                await self._replay(held.session)
            elif moved is REPLICA:  # (and the history cannot be replayed) the next replica may
                raise ShardError(ErrorCode.INCOMPATIBLE_MODEL, f"{replica.target} did not take "
                                 "the session's state", reason="STATE_REFUSED")
            elif moved is SOURCE:  # a hand-off the draining worker could not give
                self._tried_targets.discard(replica.target)  # (not the replica's fault)
                raise PipelineError(self.hop, ShardError(
                    ErrorCode.DRAINING, "the draining worker gave no state"),
                    note=f"no failover: {self.gen.budget.why_dropped()}")
        except ShardError as err:
            self._retire(held, cause=err)
            raise
        self.name = name
        return held

    async def _move(self, source: ClientSession, target: ClientSession, replica: Replica) -> str:
        """Session hand-off: copy ``source``'s state (the draining worker's session) into
        ``target`` chunk by chunk, within ``REPLAY_CHUNKS`` step timeouts. Returns ``MOVED``;
        ``REPLICA`` when the replica cannot take it (its worker takes no states, or refused
        this one: another model, range or KV layout, too large, corrupt), which leaves
        ``target`` empty; ``SOURCE`` when the draining worker gave none (its stream ended, it
        refused). A ``target`` that failed raises, as a failed replay would.

        A refused export is read to its end rather than abandoned: skipping it would take a
        ``Cancel`` on a new stream, which a connection that got GOAWAY no longer opens."""
        old, new = self.replica.caps, replica.caps
        if self.held == 0 or not source.alive:
            return SOURCE
        if new is None or not self._takes_state(replica):
            return REPLICA  # (no transfer that its worker would refuse at the header)
        assert old is not None
        limit = min(x for x in (old.max_message_bytes, new.max_message_bytes, 16 * 2**20) if x)
        chunks = source.export_state(max_chunk_bytes=max(MIN_CHUNK_BYTES, limit - 4096))
        held, outcome = 0, MOVED

        async def copy() -> None:
            nonlocal held, outcome
            while True:
                try:
                    chunk = await _next(chunks)
                except ShardError as err:  # the draining worker's side: the replica is fine
                    log.warning("%s: the draining worker gave no state (%s)", self.hop, err)
                    outcome = SOURCE
                    return
                if chunk is None:
                    return
                if outcome is not MOVED:
                    continue  # refused: the rest of the export is only read
                try:
                    held = await target.import_state(chunk)
                except ShardError as err:
                    if not target.alive or err.reason == STEP_DEADLINE:
                        raise
                    log.warning("%s: %s refused the session's state: %s", self.hop,
                                replica.target, err)
                    outcome = REPLICA

        try:
            await self._timed(copy, REPLAY_CHUNKS)
        finally:  # a failed move leaves the export to be skipped by the source's next request
            await chunks.aclose()
        if outcome is MOVED and held != self.held:  # never expected: the counts are one
            log.warning("%s: the moved state holds %d positions, not %d", self.hop, held,
                        self.held)
            if held:
                await self._timed(lambda: target.rewind(0))
            outcome = REPLICA
        return outcome

    async def _reroute(self, err: ShardError) -> None:
        """A later hop of the route failed (chain relay): move the route to that hop's next
        replica and open and replay a routed session with it on the first hop's worker; a
        replica that cannot take over (lost too, or refusing) moves the route on again."""
        assert self.route is not None
        started = trio.current_time()
        for held in [h for h in self._live if h.session is self.session]:
            self._retire(held, cause=err)
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
                raise self._named(again) from None
            self.session = held.session
            self._record(err, old, new, False, started, hop=hop.index)
            return

    def _record(
        self, cause: ShardError, old: Replica, new: Replica, handover: bool, started: float,
        *, hop: int | None = None, moved: bool = False,
    ) -> None:
        ms = (trio.current_time() - started) * 1000
        index = self.index if hop is None else hop
        record = Failover(index, old.target, new.target, cause.code.name, cause.message,
                          handover, self.held, ms, moved)
        self.gen.failovers.append(record)
        log.warning(
            "hop %d: %s from %s to %s (%s); %s %d positions in %.1f ms", index,
            "handed over" if handover else "failed over", old.target, new.target,
            cause.code.name, "moved the state of" if moved else "replayed", self.held, ms,
        )

    def _connect_timeout(self) -> float | None:
        left = time_left(self.gen.deadline)
        bound = self.gen.step_timeout
        if left is None:
            return bound
        return left if bound is None else min(left, bound)

    async def _open_on(self, replica: Replica, name: str) -> ClientSession:
        """Open the session with the remaining budget, rounded down, as its grpc-timeout."""
        ref = self.replicas.reference
        assert ref is not None and replica.client is not None and replica.caps is not None
        timeout = hop_timeout(self.gen.deadline, self._margin)
        if timeout is not None and timeout <= 0:
            raise ShardError(ErrorCode.DEADLINE_EXCEEDED, "the pipeline deadline expired")
        want = convert.offered_dtype(replica.caps, self.gen.hidden_dtype)
        tokens_only = replica.caps.is_first and replica.caps.is_last and self.route is None
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
            timeout=timeout,
        )

    async def _replay(self, session: ClientSession) -> None:
        """Bring a new session to what the failed one held: the first hop's prompt and tokens,
        or a later hop's logged rows (in requests that fit one message, results per chunk)."""
        if self.held == 0:
            return
        chunk, steps = self.gen.chunk_tokens * REPLAY_CHUNKS, REPLAY_CHUNKS
        last: pb.StepResult | None = None
        if self.first:
            prompt = self.tokens.prompt
            assert prompt is not None
            if isinstance(prompt, str):
                last = await self._drain(session.prefill_chunks(
                    text=prompt, chunk_tokens=chunk, parse_special=self.gen.parse_special), steps)
                if self.tokens.tokens:
                    last = await self._drain(
                        session.prefill_chunks(self.tokens.tokens, chunk_tokens=chunk), steps)
            else:
                last = await self._drain(session.prefill_chunks(
                    [*prompt, *self.tokens.tokens], chunk_tokens=chunk), steps)
        else:
            assert self.rows is not None and self.replicas.reference is not None
            caps = self.replicas.reference
            itemsize = convert.WIRE_DTYPES[session.hidden_dtype].itemsize
            limit = min(x for x in (caps.max_message_bytes, 16 * 2**20) if x)
            per_message = max(1, (limit - 1024) // (caps.n_embd * itemsize))
            position = 0
            for part in self.rows.slices(per_message):
                last = await self._drain(session.prefill_chunks(
                    hidden_states=part, position=position, chunk_tokens=chunk), steps)
                position += part.shape[0]
        if last is None or last.n_past != self.held:
            got = "nothing" if last is None else f"{last.n_past} positions"
            raise ShardError(ErrorCode.INTERNAL, f"the replay left {got}, not {self.held}")

    async def _drain(self, results: StepStream, steps: int) -> pb.StepResult | None:
        last = None
        while (step := await self._timed(lambda: _next(results), steps)) is not None:
            last = step
        return last

    def _retire(
        self, held: _Held, *, graceful: bool = False, cause: ShardError | None = None
    ) -> None:
        """Give up a session: reset its stream now (the worker stops and releases) or, for a
        draining worker, close it on its stream; release it through a new connection if the
        old one was lost (a live worker would retain it), in a task the generation owns.

        With chain relay, also ``Release`` what the route's later hops may hold: a hop whose
        upstream worker was lost retains its session. From the failed hop on (``cause``'s
        ``relay_depth``; every later hop for the first hop's own failure), the failed one
        itself only if it was not hung: a stopped worker finds its stream reset when it runs
        again, and a Release would only wait for it."""
        if held in self._live:
            self._live.remove(held)
        if held.session is not None and not graceful:
            held.session.abort()
        self.gen.spawn(self._retire_task, held, graceful)
        if graceful:
            return
        failed = cause.relay_depth if cause is not None else 0
        hung = cause is not None and cause.reason == STEP_DEADLINE
        for depth, (replica, name) in enumerate(_downstream_names(held), start=1):
            if depth > failed or (depth == failed and not hung):
                self.gen.spawn(self._release_task, replica, name)

    async def _release_task(self, replica: Replica, name: str) -> None:
        with trio.CancelScope(shield=True, deadline=self.gen.cleanup_deadline()):
            await self.gen.release(replica, name)

    async def _retire_task(self, held: _Held, graceful: bool) -> None:
        with trio.CancelScope(shield=True, deadline=self.gen.cleanup_deadline()):
            if graceful and held.session is not None:
                try:
                    await held.session.close()
                    return
                except ShardError as err:
                    log.info("%s: closing the session on %s failed: %s", self.hop,
                             held.replica.target, err)
                    held.session.abort()
            client = held.replica.client
            if client is None or not client.connected:
                await self.gen.release(held.replica, held.name)


def _downstream_names(held: _Held) -> list[tuple[Replica, str]]:
    """Chain relay: each later hop's replica on ``held``'s route and the name its session has
    there (every worker names the session it opens after its own)."""
    out, name = [], held.name
    for replica in held.downstream:
        name = relay_session_id(name)
        out.append((replica, name))
    return out


async def _next(steps: AsyncIterator[T]) -> T | None:
    try:
        return await steps.__anext__()
    except StopAsyncIteration:
        return None


async def release_session(
    replica: Replica, name: str, *, ssl_context: ssl.SSLContext | None,
    metadata: Sequence[tuple[str, str | bytes]],
) -> None:
    """``Release`` session ``name`` on ``replica`` within the enclosing scope's deadline; never
    raises. Through a new connection where the old one was lost: a live worker retains a
    session whose connection dropped (for resume), and nobody would resume it. Not on a
    connection the worker sent GOAWAY on (it refuses new calls there and its listener is
    closed): the stream reset already released the session."""
    client = replica.client
    try:
        if client is not None and client.connected:
            if client.going_away:
                return
            try:
                await client.release(name, timeout=time_left(trio.current_effective_deadline()))
                return
            except ShardError:
                if client.connected:
                    raise
        async with ShardClient.connect(
            replica.target, timeout=time_left(trio.current_effective_deadline()),
            ssl_context=ssl_context, metadata=metadata,
        ) as fresh:
            await fresh.release(name)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the cleanup goes on
        gone = isinstance(exc, ShardError) and exc.reason == "CONNECT_FAILED"
        # a worker that refuses connections is gone: it freed the session with its process
        log.log(logging.INFO if gone else logging.WARNING, "%s: release of %s failed: %s",
                replica.target, name, exc)
