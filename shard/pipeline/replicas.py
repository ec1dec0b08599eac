"""The workers that can serve one hop of a pipeline: its replicas, for the pipeline's lifetime.

A hop is a layer range served by one or more interchangeable workers (replicas: the same model
fingerprint, the same range). ``HopReplicas`` owns that list (which replica serves now, their
connections and capabilities) and checks that every replica serves what the hop serves;
``shard.pipeline.failover.HopFailover`` moves a hop to another replica when its worker fails.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import trio

from shard.client import ShardClient
from shard.deadlines import time_left
from shard.rpc.errors import ErrorCode, ShardError
from shard.v1 import shard_pb2 as pb

from .errors import Hop, PipelineError

log = logging.getLogger(__name__)

__all__ = ["PROBE_GRACE", "Connect", "HopReplicas", "Replica", "listing"]

#: At connect, once one replica of a hop answered, how long the others may still answer.
PROBE_GRACE = 1.0


@dataclass
class Replica:
    """One worker that can serve a hop: its connection and what it reported (None until it
    answered; a replica unreachable at connect is tried again when it is needed), and why it
    was set aside at connect (``refused``: it serves another model or range than the hop)."""

    target: str
    client: ShardClient | None = None
    caps: pb.GetCapabilitiesResponse | None = None
    refused: ShardError | None = None


#: Opens a connection owned by the pipeline: (target, connect timeout) -> client.
Connect = Callable[[str, "float | None"], Awaitable[ShardClient]]


class HopReplicas:
    """The workers that serve one hop (one model, one layer range) and which one serves now."""

    def __init__(self, index: int, targets: Sequence[str], connect: Connect) -> None:
        self.index = index
        self.replicas = [Replica(t) for t in targets]
        self.current = 0
        self.reference: pb.GetCapabilitiesResponse | None = None  # the hop's model and range
        self._connect = connect

    @property
    def replica(self) -> Replica:
        return self.replicas[self.current]

    def starting_at(self, target: str) -> HopReplicas:
        """This hop for one generation that starts on ``target`` (one of its replicas): the
        same replicas and connections, its own serving index, so a failover of that
        generation does not move the others (a pool chooses each generation's route)."""
        view = copy.copy(self)
        view.current = next(i for i, r in enumerate(self.replicas) if r.target == target)
        return view

    def hop(self, replica: Replica | None = None) -> Hop:
        replica = replica if replica is not None else self.replica
        return Hop(self.index, replica.target, replica.caps or self.reference)

    async def attach(self, deadline: float, wait_for_ready: bool) -> None:
        """At connect: ask every replica (concurrently) what it serves and pick the first that
        answers (with ``wait_for_ready``, wait for the first reachable one if none serves yet).
        A replica that cannot be reached now is not an error while another one answers; once
        one did, the others get ``PROBE_GRACE`` seconds more (a silent one is asked again when
        it is needed)."""
        errors: dict[str, ShardError] = {}
        answered = trio.Event()

        async def probe(replica: Replica) -> None:
            try:
                replica.client = await self._connect(replica.target, time_left(deadline))
                replica.caps = await replica.client.capabilities(timeout=time_left(deadline))
                answered.set()
            except ShardError as err:
                errors[replica.target] = err

        async with trio.open_nursery() as nursery:

            async def probe_all() -> None:
                async with trio.open_nursery() as probes:
                    for replica in self.replicas:
                        probes.start_soon(probe, replica)
                nursery.cancel_scope.cancel()  # every replica answered or failed

            nursery.start_soon(probe_all)
            await answered.wait()
            await trio.sleep(PROBE_GRACE)  # a silent replica must not hold up the pipeline
            nursery.cancel_scope.cancel()
        chosen = next((i for i, r in enumerate(self.replicas) if r.caps is not None), None)
        if chosen is None and wait_for_ready:
            for i, replica in enumerate(self.replicas):
                if replica.client is None:
                    continue
                try:
                    await replica.client.wait_for_ready(timeout=time_left(deadline))
                    replica.caps = await replica.client.capabilities(timeout=time_left(deadline))
                except ShardError as err:
                    errors[replica.target] = err
                    continue
                chosen = i
                break
        if chosen is None:
            tried = [(r.target, errors[r.target]) for r in self.replicas]
            raise PipelineError(
                Hop(self.index, tried[0][0]), tried[0][1], tried=tried, note=listing(tried)
            )
        self.current = chosen
        self.reference = self.replicas[chosen].caps

    def check_alternatives(self) -> None:
        """Set aside (``Replica.refused``, a warning) a standby that answered for another model
        or range than the hop's: a misconfigured standby must not stop a healthy hop; it is
        never failed over to."""
        for replica in self.replicas:
            if replica.caps is not None and replica is not self.replica:
                try:
                    self.check(replica.caps)
                except ShardError as err:
                    replica.refused = err
                    log.warning("%s: replica %s set aside: %s", self.hop(), replica.target, err)

    def check(self, caps: pb.GetCapabilitiesResponse) -> None:
        ref = self.reference
        assert ref is not None
        mine = (ref.model_fingerprint, ref.n_layers_total, ref.n_embd,
                ref.layer_range.start, ref.layer_range.end)
        theirs = (caps.model_fingerprint, caps.n_layers_total, caps.n_embd,
                  caps.layer_range.start, caps.layer_range.end)
        if mine != theirs:
            raise ShardError(
                ErrorCode.INCOMPATIBLE_MODEL,
                f"a replica must serve what the hop serves: model {caps.model_fingerprint} "
                f"layers [{theirs[3]}, {theirs[4]}) of {caps.n_layers_total} (n_embd "
                f"{caps.n_embd}), the hop serves {ref.model_fingerprint} layers "
                f"[{mine[3]}, {mine[4]}) of {ref.n_layers_total} (n_embd {ref.n_embd})",
            )

    async def ensure(self, replica: Replica, timeout: float | None) -> None:
        """Make ``replica`` usable for a new session: connected (again, if its connection
        broke or was told to go away) and checked to serve the hop's model and range."""
        client = replica.client
        if client is None or not client.connected or client.going_away:
            replica.client, replica.caps = await self._connect(replica.target, timeout), None
        if replica.caps is None:
            assert replica.client is not None
            caps = await replica.client.capabilities(timeout=timeout)
            self.check(caps)
            replica.caps = caps


def listing(tried: Sequence[tuple[str, ShardError]]) -> str:
    """What a hop with replicas says when none is left (empty for a hop of one worker)."""
    if len({target for target, _ in tried}) < 2:
        return ""
    return "no replica of the hop is left: tried " + ", ".join(f"{t} ({e})" for t, e in tried)
