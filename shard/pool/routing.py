"""Which complete route one generation of a pool's model takes: the route that holds its
prompt's prefix, else the least-loaded one.

The rule (docs/operations.md, "A pool of workers"):

* **Load.** Per hop the serving replica with the fewest of the pool's open sessions (one per
  choice of a generation) for its ``max_sessions`` (ties taken in turn), and among shapes the
  one whose busiest hop is least busy (then the one with fewer hops): ``least_loaded``. A
  generation of ``n`` choices takes only replicas of at least ``n`` sessions.
* **Prefix first.** A ``PrefixIndex`` remembers the prompts leased to each route. Among the
  routes that remember at least ``min_blocks`` leading blocks of the prompt (4: 256 characters
  of text or 64 tokens; a short system prompt shared by many conversations alone does not pin
  them), or that were sent the whole of a prompt this one goes on from (a short first turn's
  next turn), and whose workers all serve now, the one with the longest match is taken (the
  least loaded among equals), unless it is overloaded next to the least-loaded route: its
  busiest hop runs more than ``slack`` (2) generations more than the least-loaded route's
  busiest hop, or one of its hops has no free session while the least-loaded route has one on
  every hop. A passed-over holder makes way for the next-longest holder, then for the
  least-loaded route.
* Every lease remembers its prompt on the route taken, so the next turn of a conversation
  nobody held finds the route it was sent to.

The pick never changes what a generation computes: every route of a model serves the same
model (``shard.pool.table``), and a worker's prefix cache reuses only exact token ids. Picks are
counted per model by kind (``prefix``; ``load``: no route held the prefix; ``balance``: one
did but was overloaded) for ``/metrics``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from shard.pipeline import Pipeline
from shard.rpc.errors import ErrorCode, ShardError

from .prefix import DEFAULT_ENTRIES, PrefixIndex, Route
from .table import Shape

__all__ = ["MIN_BLOCKS", "PICKS", "SLACK", "Lease", "Router", "least_loaded"]

#: Leading blocks a route must remember for the prompt to be routed by prefix.
MIN_BLOCKS = 4
#: Generations more than the least-loaded route's that a prefix holder may run and still be
#: taken.
SLACK = 2
#: The kinds of picks counted (``Router.picks``).
PICKS = ("prefix", "balance", "load")



class Loaded(Protocol):
    """A worker as the routing sees it (``shard.pool.pool.Member``)."""

    target: str
    #: The sessions of the pool's generations running on it now.
    sessions: int

    @property
    def capacity(self) -> int: ...


#: target -> the worker when it serves now (up and still listed), else None.
Live = Callable[[str], "Loaded | None"]


@dataclass(frozen=True)
class Lease:
    """One generation's route: its pipeline and the target each hop starts on."""

    model: str
    pipeline: Pipeline
    route: tuple[str, ...]


def least_loaded(model: str, shapes: Sequence[tuple[Shape, Pipeline]], live: Live,
                 turn: int) -> Lease | None:
    """The least-loaded complete route (see the module docstring), None when no shape has a
    serving replica of every hop. ``turn`` rotates the ties."""
    best: tuple[tuple[float, int], Lease] | None = None
    for shape, pipe in shapes:
        route, busiest = [], 0.0
        for hop in shape.hops:
            members = [m for m in map(live, hop.targets) if m is not None]
            if not members:
                break
            k = turn % len(members)
            members = members[k:] + members[:k]  # ties in turn
            pick = min(members, key=lambda m: (m.sessions / m.capacity, m.sessions))
            route.append(pick.target)
            busiest = max(busiest, (pick.sessions + 1) / pick.capacity)
        else:
            key = (busiest, len(shape.hops))
            if best is None or key < best[0]:
                best = (key, Lease(model, pipe, tuple(route)))
    return None if best is None else best[1]


def _load(route: Route, live: Live) -> tuple[int, bool, float]:
    """(open generations on the route's busiest hop, whether a hop has no free session, the
    busiest hop's share of its sessions); the route's workers all serve now."""
    members = [m for m in map(live, route) if m is not None]
    assert len(members) == len(route)
    return (max(m.sessions for m in members), any(m.sessions >= m.capacity for m in members),
            max(m.sessions / m.capacity for m in members))


class Router:
    """Prefix first, load second (see the module docstring); one per pool."""

    def __init__(self, *, entries: int = DEFAULT_ENTRIES, min_blocks: int = MIN_BLOCKS,
                 slack: int = SLACK) -> None:
        if entries < 0 or min_blocks < 1 or slack < 0:
            raise ValueError("entries >= 0 (0: load only), min_blocks >= 1, slack >= 0")
        self.index = PrefixIndex(entries) if entries else None
        self.min_blocks = min_blocks
        self.slack = slack
        #: (model, kind) -> picks made (``PICKS``).
        self.picks: Counter[tuple[str, str]] = Counter()

    def choose(self, model: str, shapes: Sequence[tuple[Shape, Pipeline]], live: Live,
               turn: int, prompt: str | Sequence[int] | None = None, *,
               sessions: int = 1) -> Lease:
        """The route for one generation of ``model`` whose prompt is ``prompt`` (None: by
        load only) and which holds ``sessions`` on each hop (its choices all run on the one
        route: a worker of fewer ``max_sessions`` is not a replica for it); ShardError
        NOT_READY when no shape can serve it now."""
        if sessions > 1:
            live = _taking(live, sessions)
        fallback = least_loaded(model, shapes, live, turn)
        if fallback is None:
            taking = f" taking {sessions} sessions" if sessions > 1 else ""
            raise ShardError(ErrorCode.NOT_READY, f"model {model!r}: no route has a serving "
                             f"replica{taking} of every hop now")
        keys = self.index.keys(prompt) if self.index is not None and prompt is not None else []
        chosen, kind = fallback, "load"
        if keys:
            assert self.index is not None
            chosen, kind = self._by_prefix(model, shapes, live, keys, fallback)
            self.index.remember(chosen.route, keys)
        self.picks[(model, kind)] += 1
        return chosen

    def _by_prefix(self, model: str, shapes: Sequence[tuple[Shape, Pipeline]], live: Live,
                   keys: list[int], fallback: Lease) -> tuple[Lease, str]:
        assert self.index is not None
        least_open, least_full, _ = _load(fallback.route, live)
        best: tuple[tuple[int, float], Lease] | None = None
        held = False
        for route, blocks in self.index.matches(keys).items():
            if blocks < self.min_blocks and not self.index.ended(route, keys[blocks - 1]):
                continue
            lease = _lease_of(model, route, shapes, live)
            if lease is None:
                continue  # a worker of it does not serve now (forgotten at the next change)
            held = True
            busiest, full, share = _load(route, live)
            if busiest > least_open + self.slack or (full and not least_full):
                continue
            rank = (-blocks, share)
            if best is None or rank < best[0]:
                best = (rank, lease)
        if best is not None:
            return best[1], "prefix"
        return fallback, "balance" if held else "load"

    def forget(self, target: str) -> None:
        """``target`` left, failed or serves something else: its routes hold nothing now."""
        if self.index is not None:
            self.index.forget(target)


def _taking(live: Live, sessions: int) -> Live:
    """``live`` less the workers of fewer than ``sessions`` sessions."""
    def taking(target: str) -> Loaded | None:
        member = live(target)
        return member if member is not None and member.capacity >= sessions else None
    return taking


def _lease_of(model: str, route: Route, shapes: Sequence[tuple[Shape, Pipeline]],
              live: Live) -> Lease | None:
    """``route`` as a lease of one of ``shapes`` when every worker of it serves now."""
    if any(live(t) is None for t in route):
        return None
    for shape, pipe in shapes:
        if len(shape.hops) == len(route) and all(
                t in hop.targets for t, hop in zip(route, shape.hops)):
            return Lease(model, pipe, route)
    return None
