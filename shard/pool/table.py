"""Which complete routes a pool of workers offers, found from what each worker reports.

Pure: a mapping of target -> capabilities in, a ``Table`` out (no I/O), so the rules are tested
on their own and every front door, ``generate --workers`` and ``trio-shard pool`` read a pool
the same way.

The rules:

* A worker serves the model named by its ``model_name`` (``serve --model-name``; a packaged
  model's name by default), or, without one, ``<architecture>-<first 12 hex digits of the
  fingerprint>``: the id clients ask for (``model_id``).
* One name, one model: two fingerprints claiming one name make that name unservable (every such
  worker is refused with the reason), since no door can tell which one clients mean.
* Workers of one model holding the same layer range are replicas of one hop. The ways the
  ranges tile ``[0, n_layers_total)`` in order are the model's route *shapes* (a whole-model
  worker is a shape of one hop; ``[0:9) + [9:18)`` another); each shape is complete with one
  replica per hop chosen at generation time (``shard.pool.pool``).
* A range that takes part in no shape is reported per worker: it overlaps another range without
  tiling with it, or it sits beyond a gap; a model without any shape names its first gap or
  overlap.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from shard.v1 import shard_pb2 as pb

__all__ = ["MAX_SHAPES", "ModelRoutes", "Shape", "ShapeHop", "Table", "build_table", "model_id"]

#: Shapes kept per model (fewest hops first): more only adds choices of the same workers.
MAX_SHAPES = 8
_MAX_FRONTIER = 256  # partial routes explored per hop count (a pool of many small ranges)


def model_id(caps: pb.GetCapabilitiesResponse) -> str:
    """The id clients ask for a worker's model by (see the module docstring)."""
    if caps.model_name:
        return caps.model_name
    return f"{caps.architecture or 'model'}-{caps.model_fingerprint[:12]}"


@dataclass(frozen=True)
class ShapeHop:
    """One hop of a shape: a layer range and its replicas (targets, in pool order)."""

    start: int
    end: int
    targets: tuple[str, ...]

    @property
    def range_text(self) -> str:
        return f"{self.start}:{self.end}"


@dataclass(frozen=True)
class Shape:
    """One way the model's ranges tile it, first hop first."""

    hops: tuple[ShapeHop, ...]

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple((h.start, h.end) for h in self.hops)

    @property
    def routes(self) -> int:
        """How many complete routes it offers (one replica per hop)."""
        n = 1
        for hop in self.hops:
            n *= len(hop.targets)
        return n


@dataclass
class ModelRoutes:
    """One model in a pool: its routes, or why it has none."""

    model_id: str
    fingerprint: str
    n_layers_total: int
    shapes: list[Shape] = field(default_factory=list)
    #: Why the model cannot be served ("" when it can).
    problem: str = ""

    @property
    def servable(self) -> bool:
        return bool(self.shapes)

    @property
    def routes(self) -> int:
        return sum(s.routes for s in self.shapes)


@dataclass
class Table:
    """Every model of a pool, and every worker that takes part in no route, with why."""

    models: dict[str, ModelRoutes] = field(default_factory=dict)
    #: target -> why it is in no route (a name conflict, an overlap, a gap)
    unused: dict[str, str] = field(default_factory=dict)

    def model_of(self, target: str) -> str | None:
        for routes in self.models.values():
            if any(target in hop.targets for s in routes.shapes for hop in s.hops):
                return routes.model_id
        return None


def build_table(workers: Mapping[str, pb.GetCapabilitiesResponse]) -> Table:
    """The pool's routes from the capabilities of its workers that serve now (``workers``:
    target -> capabilities, in pool order)."""
    table = Table()
    by_name: dict[str, dict[str, list[str]]] = {}  # id -> fingerprint -> targets
    for target, caps in workers.items():
        by_name.setdefault(model_id(caps), {}).setdefault(caps.model_fingerprint, []).append(target)
    for name, prints in by_name.items():
        if len(prints) > 1:
            claims = "; ".join(f"{fp[:12]} by {', '.join(ts)}" for fp, ts in prints.items())
            why = f"model name {name!r} is claimed by {len(prints)} different models ({claims})"
            table.models[name] = ModelRoutes(name, "", 0, problem=why)
            for targets in prints.values():
                for target in targets:
                    table.unused[target] = why
            continue
        (fingerprint, targets), = prints.items()
        table.models[name] = _routes(name, fingerprint, {t: workers[t] for t in targets}, table.unused)
    return table


def _routes(
    name: str, fingerprint: str, workers: Mapping[str, pb.GetCapabilitiesResponse],
    unused: dict[str, str],
) -> ModelRoutes:
    total = max(c.n_layers_total for c in workers.values())
    replicas: dict[tuple[int, int], list[str]] = {}
    for target, caps in workers.items():
        start, end = caps.layer_range.start, caps.layer_range.end
        if caps.n_layers_total != total or not 0 <= start < end <= total:
            unused[target] = (f"reports layers [{start}, {end}) of {caps.n_layers_total}, other "
                              f"workers of {name!r} {total} layers")
            continue
        replicas.setdefault((start, end), []).append(target)
    # Positions reachable from layer 0, and positions from which the last layer is reachable.
    ranges = sorted(replicas)
    forward = {0}
    for start, end in ranges:  # sorted by start: one pass suffices
        if start in forward:
            forward.add(end)
    backward = {total}
    for start, end in sorted(ranges, key=lambda r: -r[1]):
        if end in backward:
            backward.add(start)
    result = ModelRoutes(name, fingerprint, total)
    for (start, end), targets in replicas.items():
        if start in forward and end in backward:
            continue
        why = _why_unused(start, end, total, ranges, forward, backward)
        for target in targets:
            unused[target] = why
    if total in forward:  # (only ranges on some complete route: every path searched completes)
        result.shapes = _shapes({r: t for r, t in replicas.items()
                                 if r[0] in forward and r[1] in backward}, total)
    else:
        result.problem = _why_incomplete(total, ranges, forward)
    return result


def _why_unused(start: int, end: int, total: int, ranges: list[tuple[int, int]],
                forward: set[int], backward: set[int]) -> str:
    here = f"layers [{start}, {end})"
    if start not in forward:
        over = [r for r in ranges if r[0] < start < r[1]]
        if over:
            return (f"{here} overlap [{over[0][0]}, {over[0][1]}) without tiling with it (no "
                    f"route from layer 0 ends at layer {start})")
        return f"{here} follow a gap: no route from layer 0 reaches layer {start}"
    over = [r for r in ranges if r[0] < end < r[1]]
    if over:
        return (f"{here} overlap [{over[0][0]}, {over[0][1]}) without tiling with it (no route "
                f"to layer {total} starts at layer {end})")
    return f"{here} end before a gap: no route from layer {end} reaches layer {total}"


def _why_incomplete(total: int, ranges: list[tuple[int, int]], forward: set[int]) -> str:
    covered = [False] * total
    for start, end in ranges:
        for i in range(start, end):
            covered[i] = True
    if not all(covered):
        gap = covered.index(False)
        stop = next((i for i in range(gap, total) if covered[i]), total)
        return f"no complete route: no worker serves layers [{gap}, {stop}) (a gap)"
    reach = max(forward)
    return (f"no complete route: the ranges overlap without tiling (routes from layer 0 reach "
            f"layer {reach} at most, of {total})")


def _shapes(replicas: Mapping[tuple[int, int], list[str]], total: int) -> list[Shape]:
    """Every tiling of [0, total) by the ranges, fewest hops first, at most ``MAX_SHAPES``."""
    starts: dict[int, list[tuple[int, int]]] = {}
    for r in replicas:
        starts.setdefault(r[0], []).append(r)
    found: list[tuple[tuple[int, int], ...]] = []
    frontier: list[tuple[tuple[int, int], ...]] = [()]
    while frontier and len(found) < MAX_SHAPES:  # breadth first: fewest hops first
        nxt = []
        for path in frontier:
            at = path[-1][1] if path else 0
            for r in sorted(starts.get(at, ()), key=lambda r: -r[1]):
                if r[1] == total:
                    found.append(path + (r,))
                else:
                    nxt.append(path + (r,))
        frontier = nxt[:_MAX_FRONTIER]
    return [Shape(tuple(ShapeHop(a, b, tuple(replicas[(a, b)])) for a, b in path))
            for path in found[:MAX_SHAPES]]
