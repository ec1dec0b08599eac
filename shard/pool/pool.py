"""A pool of workers: who is in it, what each serves, and a route for each generation.

``Pool.open(source)`` owns one connection per listed worker (``shard.pool.spec`` says who is
listed) and a task per worker that asks its capabilities and health every ``probe_interval``
seconds. The workers that answer SERVING make the pool's ``Table`` (``shard.pool.table``); each
complete route shape of a model gets a ``Pipeline`` over the pool's own connections
(``Pipeline.of_known``), so every guarantee of the pipeline client (failover to the hop's
other replicas, chain relay, speculation, deadlines, releases) holds for a pool's generations.

``lease(model, prompt)`` picks a complete route (``shard.pool.routing``): the one that holds the
prompt's prefix (the pool remembers what it sent where, ``shard.pool.prefix``) unless it is
overloaded, else the least-loaded one: per hop the replica with the fewest of the door's open
generations for its ``max_sessions`` (ties taken in turn), and among shapes the one whose
busiest hop is least busy. The generation runs on the returned pipeline with ``route=``; its
count is held until the lease ends.

Membership is live: a worker added to the file (on ``reload``) or to the DNS name is probed and
used from the next generation; one that stops answering or serving is out of new routes at the
next probe (running generations fail over within their pipeline, as always); one that reports
another model, range or name at the same address is read again and its old shape rebuilt, never
mixed into it (sessions are also opened with the expected fingerprint and range, so a worker
swapped under a running generation refuses it); the routes through a worker that leaves, fails
or changes forget the prompts sent there. Every change is logged.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from shard.client import ShardClient
from shard.pipeline import Pipeline, PipelineError
from shard.rpc.errors import ErrorCode, ShardError
from shard.v1 import shard_pb2 as pb

from .prefix import DEFAULT_ENTRIES
from .routing import MIN_BLOCKS, SLACK, Lease, Router
from .spec import PoolSpecError, WorkerSource
from .table import Shape, ShapeHop, Table, build_table, model_id

__all__ = ["Lease", "Member", "Pool"]

log = logging.getLogger(__name__)

#: States of a member, as ``trio-shard pool`` and ``/metrics`` show them.
STATES = ("connecting", "up", "down", "refused")
_REFUSALS = (ErrorCode.UNAUTHENTICATED, ErrorCode.PERMISSION_DENIED)


@dataclass
class Member:
    """One listed worker: its connection, what it last reported, and the door's load on it."""

    target: str
    state: str = "connecting"
    why: str = ""
    caps: pb.GetCapabilitiesResponse | None = None
    client: ShardClient | None = None
    #: Sessions of this pool's generations running on it now (one per choice).
    sessions: int = 0
    removed: bool = False
    answered: trio.Event = field(default_factory=trio.Event)  # probed once (either way)
    poke: trio.Event = field(default_factory=trio.Event)  # probe again now
    #: Every connection held for it, and the event that closes each: the current one, and
    #: replaced ones still carrying a draining worker's calls.
    _held: list[tuple[ShardClient, trio.Event]] = field(default_factory=list)
    _lock: trio.Lock = field(default_factory=trio.Lock)

    @property
    def usable(self) -> bool:
        return self.client is not None and self.client.connected and not self.client.going_away

    @property
    def capacity(self) -> int:
        return max(self.caps.max_sessions, 1) if self.caps is not None else 1

    def describe(self) -> str:
        if self.caps is None:
            return "?"
        r = self.caps.layer_range
        return f"model {model_id(self.caps)} layers {r.start}:{r.end} of {self.caps.n_layers_total}"


def _close_dead(member: Member) -> None:
    """Close the member's connections that broke (a replaced one is closed once it has)."""
    for pair in [p for p in member._held if not p[0].connected]:
        pair[1].set()
        member._held.remove(pair)


def _identity(caps: pb.GetCapabilitiesResponse | None) -> tuple[Any, ...] | None:
    """What makes a worker another worker for the routes (a change is re-read, not mixed)."""
    if caps is None:
        return None
    return (model_id(caps), caps.model_fingerprint, caps.n_layers_total, caps.n_embd,
            caps.layer_range.start, caps.layer_range.end, caps.max_sessions, caps.relay_allowed)


class Pool:
    """See the module docstring. Create with ``Pool.open``."""

    def __init__(
        self, source: WorkerSource, nursery: trio.Nursery, *, probe_interval: float,
        connect_timeout: float, ssl_context: ssl.SSLContext | None,
        metadata: Sequence[tuple[str, str | bytes]], pipeline_options: dict[str, Any],
        router: Router | None = None,
    ) -> None:
        self.source = source
        #: Picks each generation's route, and counts its picks (``shard.pool.routing``).
        self.router = router if router is not None else Router()
        self.members: dict[str, Member] = {}
        self.table = Table()
        #: Per model id: per shape's ranges, the pipeline over the shape's current replicas.
        self._pipelines: dict[str, dict[tuple[tuple[int, int], ...], tuple[Shape, Pipeline]]] = {}
        self._unusable: dict[str, str] = {}  # model -> why a shape's pipeline was refused
        self._nursery = nursery
        self._probe_interval = probe_interval
        self._connect_timeout = connect_timeout
        self._ssl_context = ssl_context
        self._metadata = tuple(metadata)
        self._options = pipeline_options
        self._reload = trio.Event()
        self._listed = trio.Event()  # the source was read once (or failed)
        self._turn = 0
        self._changed = trio.Event()  # set (and replaced) at every rebuild of the routes
        self._logged = Table()  # the routes as the log last described them
        self._closing = False
        self.source_error = ""

    # ---- life --------------------------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def open(
        cls, source: WorkerSource, *, probe_interval: float = 2.0, connect_timeout: float = 5.0,
        ssl_context: ssl.SSLContext | None = None,
        metadata: Sequence[tuple[str, str | bytes]] = (), prefix_entries: int = DEFAULT_ENTRIES,
        prefix_min_blocks: int = MIN_BLOCKS, prefix_slack: int = SLACK, **pipeline_options: Any,
    ) -> AsyncIterator[Pool]:
        """Probe ``source``'s workers until the block ends (every connection closed then).
        ``prefix_entries`` (0: route by load only), ``prefix_min_blocks``, ``prefix_slack``:
        the prefix routing's bound and rule (``shard.pool.routing``). ``pipeline_options``:
        ``Pipeline.connect``'s keywords for every route (``relay``, ``step_timeout``,
        ``timeout``, ``hidden_dtype``, ...)."""
        if not probe_interval > 0:
            raise ValueError("probe_interval must be > 0")
        router = Router(entries=prefix_entries, min_blocks=prefix_min_blocks, slack=prefix_slack)
        async with trio.open_nursery() as nursery:
            pool = cls(source, nursery, probe_interval=probe_interval,
                       connect_timeout=connect_timeout, ssl_context=ssl_context,
                       metadata=metadata, pipeline_options=pipeline_options, router=router)
            nursery.start_soon(pool._watch_source)
            try:
                yield pool
            finally:
                pool._closing = True  # (its members leaving now is no news for the log)
                nursery.cancel_scope.cancel()

    def reload(self) -> None:
        """Read the worker list again now (SIGHUP), and probe every worker again."""
        self._reload.set()
        for member in self.members.values():
            member.poke.set()

    async def settle(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until the list was read and every listed worker
        answered or failed once."""
        with trio.move_on_after(timeout):
            await self._listed.wait()
            for member in list(self.members.values()):
                await member.answered.wait()

    async def wait_for(self, model: str | None = None) -> None:
        """Wait until ``model`` (None: any model) has a complete route."""
        while not (model in self.servable() if model is not None else self.servable()):
            await self._changed.wait()

    # ---- the list ----------------------------------------------------------------------------

    async def _watch_source(self) -> None:
        while True:
            self._reload = trio.Event()  # (before reading: a reload asked meanwhile reads again)
            try:
                targets = await self.source.targets()
            except Exception as exc:  # noqa: BLE001 - a bad list keeps the workers listed before
                if not isinstance(exc, PoolSpecError):
                    log.exception("pool: reading %s failed", self.source.describe)
                if str(exc) != self.source_error:
                    log.error("pool: %s (keeping the %d workers listed before)", exc,
                              len(self.members))
                self.source_error = str(exc)
            else:
                self.source_error = ""
                self._apply(targets)
            self._listed.set()
            with trio.move_on_after(self.source.interval if self.source.interval else float("inf")):
                await self._reload.wait()

    def _apply(self, targets: list[str]) -> None:
        for target in targets:
            member = self.members.get(target)
            if member is None or member.removed:
                if member is not None:  # listed again while leaving: a fresh member
                    self.members.pop(target)
                member = self.members[target] = Member(target)
                log.info("pool: %s listed", target)
                self._nursery.start_soon(self._run_member, member)
        for target, member in list(self.members.items()):
            if target not in targets and not member.removed:
                member.removed = True
                self.router.forget(target)
                member.poke.set()
                log.info("pool: %s no longer listed: out of new routes%s", target,
                         f" ({member.sessions} session(s) finish first)" if member.sessions else "")
        self._rebuild()

    # ---- one worker --------------------------------------------------------------------------

    async def _run_member(self, member: Member) -> None:
        try:
            while not member.removed:
                _close_dead(member)
                try:
                    await self._probe(member)
                except Exception as exc:  # noqa: BLE001 - one worker must not take the pool down
                    log.exception("pool: probing %s failed", member.target)
                    self._set(member, "down", f"probe failed: {type(exc).__name__}: {exc}",
                              member.caps)
                member.answered.set()
                with trio.move_on_after(self._probe_interval):
                    await member.poke.wait()
                member.poke = trio.Event()
            while member.sessions or any(c.open_calls for c, _ in member._held):
                # running generations keep their connection (also one that failed over to it)
                with trio.move_on_after(self._probe_interval):
                    await member.poke.wait()
                member.poke = trio.Event()
        finally:
            member.answered.set()
            for _, closer in member._held:
                closer.set()
            if self.members.get(member.target) is member:
                del self.members[member.target]
                self.router.forget(member.target)
            self._rebuild()

    async def _probe(self, member: Member) -> None:
        """Connect if needed, read capabilities and health, and update the member's state."""
        try:
            client = await self._client(member)
            caps = await client.capabilities(timeout=self._connect_timeout)
            health = await client.health(timeout=self._connect_timeout)
        except ShardError as err:
            state = "refused" if err.code in _REFUSALS else "down"
            self._set(member, state, f"{err.code.name}: {err.message}", member.caps)
            return
        if health.status == pb.HealthResponse.STATUS_SERVING:
            self._set(member, "up", "", caps)
        else:
            status = pb.HealthResponse.Status.Name(health.status).removeprefix("STATUS_")
            self._set(member, "down", f"health {status}" + (f": {health.detail}" if health.detail else ""), caps)

    def _set(self, member: Member, state: str, why: str,
             caps: pb.GetCapabilitiesResponse | None) -> None:
        before, known = member.state, member.caps
        member.state, member.why = state, why
        changed = _identity(caps) != _identity(known)
        member.caps = caps
        if changed or (before == "up" and state != "up"):
            self.router.forget(member.target)  # what it cached is gone, or another model's
        if changed and known is not None and caps is not None:
            log.warning("pool: %s now serves %s (was %s): read again, out of its old routes",
                        member.target, member.describe(),
                        f"model {model_id(known)} layers {known.layer_range.start}:{known.layer_range.end}")
        if state != before or changed:
            if state == "up":
                log.info("pool: %s %s: %s", member.target,
                         "joined" if before == "connecting" else "is up", member.describe())
            elif before != state:
                log.warning("pool: %s is %s: %s", member.target, state, why)
            self._rebuild()

    async def _client(self, member: Member) -> ShardClient:
        """The member's usable connection, made anew when it broke or was told to go away (the
        old one stays open while it still carries calls: a draining worker's streams finish)."""
        async with member._lock:
            if member.usable:
                assert member.client is not None
                return member.client
            if member.removed:
                raise ShardError(ErrorCode.NOT_READY, f"{member.target} left the pool")
            _close_dead(member)
            client, closer = await self._nursery.start(self._hold, member.target)
            member.client = client
            member._held.append((client, closer))
            return client

    async def _hold(self, target: str,
                    task_status: trio.TaskStatus[tuple[ShardClient, trio.Event]]) -> None:
        """Own one connection until its closer is set (or the pool closes)."""
        closer = trio.Event()
        async with ShardClient.connect(
            target, timeout=self._connect_timeout, ssl_context=self._ssl_context,
            metadata=self._metadata,
        ) as client:
            task_status.started((client, closer))
            await closer.wait()

    async def connect(self, target: str, timeout: float | None) -> ShardClient:
        """A pipeline's way to a worker (``Pipeline.of_known``): the member's connection."""
        member = self.members.get(target)
        if member is None or member.removed:
            raise ShardError(ErrorCode.NOT_READY, f"{target} is no longer in the pool")
        return await self._client(member)

    # ---- routes ------------------------------------------------------------------------------

    def _rebuild(self) -> None:
        if self._closing:
            return
        up = {t: m.caps for t, m in self.members.items()
              if m.state == "up" and not m.removed and m.caps is not None}
        self.table = table = build_table(up)
        pipelines: dict[str, dict[tuple[tuple[int, int], ...], tuple[Shape, Pipeline]]] = {}
        self._unusable = {}
        for name, routes in table.models.items():
            kept = self._pipelines.get(name, {})
            mine = pipelines[name] = {}
            for shape in routes.shapes:
                usable = self._usable(shape)
                if isinstance(usable, str):
                    self._unusable[name] = usable
                    log.warning("pool: model %s: route %s refused: %s", name,
                                "|".join(h.range_text for h in shape.hops), usable)
                    continue
                shape = usable
                prior = kept.get(shape.ranges)
                if prior is not None and prior[0] == shape and all(
                        _identity(self.members[t].caps) == _identity(prior[1].replicas[i][j].caps)
                        for i, hop in enumerate(shape.hops) for j, t in enumerate(hop.targets)):
                    mine[shape.ranges] = prior
                    continue
                try:
                    mine[shape.ranges] = (shape, self._pipeline(shape))
                except PipelineError as err:
                    self._unusable[name] = str(err)
                    log.warning("pool: model %s: route %s refused: %s", name,
                                "|".join(h.range_text for h in shape.hops), err)
        self._pipelines = pipelines
        self._changed.set()
        self._changed = trio.Event()
        if any(m.state == "connecting" for m in self.members.values()):
            return  # workers still answering for the first time: no half-read pool in the log
        old, self._logged = self._logged, table
        for name, routes in table.models.items():
            before = old.models.get(name)
            if before is None or before.routes != routes.routes or before.problem != routes.problem:
                if routes.servable:
                    log.info("pool: model %s: %d complete route(s) over %s", name, routes.routes,
                             "; ".join(" -> ".join(f"{h.range_text}x{len(h.targets)}" for h in s.hops)
                                       for s in routes.shapes))
                else:
                    log.warning("pool: model %s cannot be served: %s", name, routes.problem)
        for name in old.models.keys() - table.models.keys():
            log.warning("pool: model %s: no worker serves it now", name)
        for target, why in table.unused.items():
            if old.unused.get(target) != why:
                log.warning("pool: %s is in no route: %s", target, why)

    def _usable(self, shape: Shape) -> Shape | str:
        """The shape with only the replicas that can serve it in this pool's relay mode (chain
        relay: every hop but the last relays, ``serve --allow-relay``), or why none can."""
        if self._options.get("relay") != "chain":
            return shape
        hops = []
        for i, hop in enumerate(shape.hops):
            targets = hop.targets
            if i < len(shape.hops) - 1:
                targets = tuple(t for t in targets if self.members[t].caps is not None
                                and self.members[t].caps.relay_allowed)  # type: ignore[union-attr]
                if not targets:
                    return (f"no worker of layers {hop.range_text} relays (serve --allow-relay), "
                            "and the door relays by chain")
            hops.append(ShapeHop(hop.start, hop.end, targets))
        return Shape(tuple(hops))

    def _pipeline(self, shape: Shape) -> Pipeline:
        hops = [[(t, self.members[t].client, self.members[t].caps) for t in hop.targets]
                for hop in shape.hops]
        # A whole-model route decodes in its worker's loop even with replicas: the pool
        # balances over them, and a failure fails over by replay.
        return Pipeline.of_known(hops, self.connect, ssl_context=self._ssl_context,  # type: ignore[arg-type]
                                 metadata=self._metadata, step_replicas=False, **self._options)

    def known_models(self) -> dict[str, list[str]]:
        """Every model a listed worker reported (serving now or not) -> its workers."""
        known: dict[str, list[str]] = {}
        for target, member in list(self.members.items()):  # (a snapshot: a thread may ask)
            if member.caps is not None and not member.removed:
                known.setdefault(model_id(member.caps), []).append(target)
        return known

    def servable(self) -> list[str]:
        """The model ids with at least one complete route now."""
        return [name for name, pipes in self._pipelines.items() if pipes]

    def not_serving(self) -> list[str]:
        """Why the pool cannot serve every model it knows (empty: it can)."""
        why = []
        if self.source_error and not self.members:
            why.append(self.source_error)
        known = self.known_models()
        if not known:
            counts = ", ".join(f"{n} {state}" for state, n in self.counts().items() if n)
            why.append(f"no listed worker reports a model ({counts})" if self.members
                       else "no worker is listed")
        for name in known:
            if not self._pipelines.get(name):
                routes = self.table.models.get(name)
                why.append(f"model {name}: " + (
                    routes.problem if routes is not None and routes.problem else
                    self._unusable.get(name, "none of its workers serves now")))
        return why

    def first_caps(self, model: str) -> pb.GetCapabilitiesResponse | None:
        """A first shard's capabilities for ``model`` (chat template, vocabulary), or None."""
        for shape, pipe in self._pipelines.get(model, {}).values():
            return pipe.hops[0].caps
        return None

    def context(self, model: str) -> int:
        """The most positions one generation of ``model`` may hold on any of its routes."""
        sizes = [m.caps.n_ctx_per_session for t, m in list(self.members.items())
                 if m.caps is not None and m.state == "up" and model_id(m.caps) == model]
        return min(sizes, default=0)

    def capacity(self, model: str) -> int | None:
        """The generations ``model``'s routes take at once (per shape, its smallest hop's
        sessions over its serving replicas; an upper bound where shapes share a hop), None when
        it has no route now. The door's wait queue counts against it."""
        up = {t: m.capacity for t, m in self.members.items() if m.state == "up" and not m.removed}
        return sum(min(sum(up.get(t, 0) for t in hop.targets) for hop in shape.hops)
                   for shape, _ in self._pipelines.get(model, {}).values()) or None

    def route_capacity(self, model: str) -> int | None:
        """The most generations (or one generation's choices) one route of ``model`` takes at
        once: per shape, the least over its hops of the hop's largest serving replica; the
        most over shapes. None when it has no route now. A request's ``n`` choices all run on
        one route (``lease(sessions=n)``), so this, not ``capacity``, bounds them."""
        best = 0
        for shape, _ in self._pipelines.get(model, {}).values():
            hops = [max((m.capacity for m in map(self._live, hop.targets) if m is not None),
                        default=0) for hop in shape.hops]
            best = max(best, min(hops, default=0))
        return best or None

    def _live(self, target: str) -> Member | None:
        member = self.members.get(target)
        return member if member is not None and member.state == "up" and not member.removed \
            else None

    def _choose(self, model: str, prompt: str | Sequence[int] | None, whole: bool,
                sessions: int) -> Lease:
        pipes = self._pipelines.get(model)
        if not pipes:
            known = self.table.models.get(model)
            why = known.problem if known is not None and known.problem else \
                self._unusable.get(model, "no worker of it serves now")
            raise ShardError(ErrorCode.NOT_READY, f"model {model!r} has no complete route: {why}")
        shapes = [sp for sp in pipes.values() if not whole or len(sp[0].hops) == 1]
        if not shapes:
            raise ShardError(ErrorCode.UNSUPPORTED_FEATURE, f"model {model!r} is served as a "
                             "pipeline only: no worker serves the whole model")
        self._turn += 1
        return self.router.choose(model, shapes, self._live, self._turn, prompt,
                                  sessions=sessions)

    @asynccontextmanager
    async def lease(self, model: str, prompt: str | Sequence[int] | None = None, *,
                    whole: bool = False, sessions: int = 1) -> AsyncIterator[Lease]:
        """A complete route of ``model`` for one generation of ``prompt`` (None: the
        least-loaded route; see the module docstring) holding ``sessions`` on each hop (its
        choices); ShardError NOT_READY when it has none. ``whole``: a route of one worker
        serving the whole model (what an embedding needs; UNSUPPORTED_FEATURE when the model
        has none)."""
        chosen = self._choose(model, prompt, whole, sessions)
        members = [self.members[t] for t in chosen.route]
        for m in members:
            m.sessions += sessions
        try:
            yield chosen
        finally:
            for m in members:
                m.sessions -= sessions
                if m.removed and not m.sessions:
                    m.poke.set()

    def counts(self) -> dict[str, int]:
        """Listed workers by state (``STATES``)."""
        out = dict.fromkeys(STATES, 0)
        for member in self.members.values():
            if not member.removed:
                out[member.state] += 1
        return out

    def rows(self) -> list[dict[str, str]]:
        """One row per listed worker: target, model, range, state and why (``trio-shard pool``)."""
        rows = []
        for target, m in self.members.items():
            if m.removed:
                continue
            caps = m.caps
            why = self.table.unused.get(target, "") if m.state == "up" else m.why
            rows.append({
                "worker": target,
                "model": model_id(caps) if caps is not None else "",
                "layers": (f"{caps.layer_range.start}:{caps.layer_range.end}/{caps.n_layers_total}"
                           if caps is not None else ""),
                "state": "unused" if m.state == "up" and target in self.table.unused else m.state,
                "why": why,
            })
        return rows
