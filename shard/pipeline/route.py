"""A chain-relayed generation's route: which replica serves each hop after the first, and how
the route moves when one of them fails.

With chain relay the client talks to the first hop only; the others are named in the route
(``OpenSession.route``) and opened by the worker before each. When a later hop fails (its
worker is lost, unavailable or hung: the error's ``relay_depth`` says which hop, as each worker
counts it up on the way), ``ChainRoute.move`` puts the next untried replica of that hop in the
route, and the first hop's runner opens a fresh routed session with it and replays the token
log through it (``shard.pipeline.failover``).

Why the client re-routes rather than the worker before the failed hop: the first hop's own
failure needs the client anyway, and one party deciding keeps the step timeouts simple. A
worker replaying for its next hop would look hung to every hop above it (they bound each answer
by the route's step timeout), so the failover of one hop could cascade into failovers of its
healthy neighbours. The cost: a failover recomputes the history on every hop, not only on the
replaced one (docs/pipelines.md, "Failover").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from shard.rpc.errors import ShardError
from shard.v1 import shard_pb2 as pb

from .errors import Hop, PipelineError
from .replicas import HopReplicas, Replica, listing

__all__ = ["ChainRoute"]


class ChainRoute:
    """The route a chain's first hop is opened with (see the module docstring)."""

    def __init__(self, replicas: Sequence[HopReplicas], step_timeout: float | None) -> None:
        self.replicas = list(replicas)  # every hop, the first (the client's) included
        self.step_timeout = step_timeout
        #: Per later hop: target -> its last error, in the order tried (set-aside standbys too).
        self.tried: dict[int, dict[str, ShardError]] = {
            r.index: {x.target: x.refused for x in r.replicas if x.refused is not None}
            for r in self.replicas[1:]
        }
        self._first: dict[int, tuple[Replica, ShardError]] = {}  # per hop: its first failure

    def message(self) -> pb.Route:
        """The route as the first hop's worker is given it: every later hop's serving replica,
        as checked, and the step timeout each hop has to answer a step."""
        hops = []
        for r in self.replicas[1:]:
            ref = r.reference
            assert ref is not None
            hops.append(pb.RouteHop(
                target=r.replica.target, expected_model_fingerprint=ref.model_fingerprint,
                expected_layer_range=pb.LayerRange(start=ref.layer_range.start,
                                                   end=ref.layer_range.end),
            ))
        route = pb.Route(hops=hops)
        if self.step_timeout is not None:
            route.step_timeout_ms = max(1, round(self.step_timeout * 1000))
        if len(hops) >= 2:
            # direct return: the last hop hands each token to the first one straight away (at
            # the address the first worker's operator advertises; the workers take part only if
            # every hop reports relay_return; docs/pipelines.md)
            route.return_to.SetInParent()
        return route

    @property
    def span(self) -> int:
        """The hops a routed step passes through (each may take its step timeout)."""
        return len(self.replicas)

    def serving(self) -> list[Replica]:
        """The replicas of the later hops the route names now (first: the next hop)."""
        return [r.replica for r in self.replicas[1:]]

    def hops(self) -> list[Hop]:
        return [r.hop() for r in self.replicas]

    def failed_hop(self, err: ShardError) -> HopReplicas | None:
        """The later hop a chain-relayed error is from (None: not a later hop's, or not one
        of this route's hops)."""
        depth = err.relay_depth
        if not 0 < depth < len(self.replicas):
            return None
        hop = self.replicas[depth]
        ref = hop.reference
        if err.failed_layers is not None and ref is not None and (
                ref.layer_range.start, ref.layer_range.end) != err.failed_layers:
            return None
        return hop

    def can_move(self, err: ShardError) -> bool:
        hop = self.failed_hop(err)
        return hop is not None and next(self._candidates(hop), None) is not None

    def move(self, err: ShardError) -> tuple[HopReplicas, Replica, Replica]:
        """Put the next untried replica of the failed hop in the route: (the hop, the replica
        that failed, the one that serves now). A ``PipelineError`` naming the hop and every
        replica tried when none is left."""
        hop = self.failed_hop(err)
        assert hop is not None
        failed = hop.replica
        tried = self.tried[hop.index]
        tried[failed.target] = err
        self._first.setdefault(hop.index, (failed, err))
        new = next(self._candidates(hop), None)
        if new is None:  # named as client relay names it: the replica that failed first
            first, cause = self._first[hop.index]
            pairs = list(tried.items())
            raise PipelineError(hop.hop(first), cause, tried=pairs, note=listing(pairs))
        hop.current = hop.replicas.index(new)
        return hop, failed, new

    def _candidates(self, hop: HopReplicas) -> Iterator[Replica]:
        """Untried replicas of ``hop`` after the serving one, in the order given."""
        tried = self.tried[hop.index]
        n = len(hop.replicas)
        for i in range(1, n):
            replica = hop.replicas[(hop.current + i) % n]
            if replica.target not in tried:
                yield replica
