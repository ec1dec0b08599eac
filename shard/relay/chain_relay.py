"""``ChainRelay``: a worker's chain relay as its operator configured it (``serve --allow-relay``).

It is the ``Relay`` a worker's sessions are given (``serve(relay=...)``): it checks a session's
route (``policy.check_route``) and where the worker would connect (``PeerList``), opens the next
hop's session on a pooled connection (``PeerPool``), and hands the session a ``RoutedSession``
that runs its steps. It also gives a last hop its return pusher. Its outbound credentials
(``--relay-tls-ca``, ``--relay-tls-cert/--relay-tls-key``, ``--relay-token-file``) only ever go
to peers the operator allowed, and a bearer token never travels in plaintext except to loopback
peers the operator opted into (``plaintext_loopback``).

Deadlines: the next hop's ``grpc-timeout`` is this worker's remaining time less
``RELAY_DEADLINE_MARGIN``, rounded down, so deadlines shrink along the route and the deepest hop
still working reports first. A route's step timeout (``Route.step_timeout_ms``) bounds each
answer of the next hop by that many milliseconds per hop still ahead.

What a caller learns from errors: a route refused by policy (PERMISSION_DENIED), an incompatible
hop (INCOMPATIBLE_MODEL), a refusal of this worker's credentials (UNAUTHENTICATED /
PERMISSION_DENIED), or one generic NOT_READY "could not be reached" for every connection failure
(refused, reset, timed out, not a Shard worker), each naming the hop by its place in the route
and its layer range; the details go to this worker's log.
"""

from __future__ import annotations

import ipaddress
import logging
import ssl
from collections.abc import Sequence

import trio

from shard.deadlines import RELAY_DEADLINE_MARGIN, bounded, hop_timeout
from shard.engine import Capabilities
from shard.v1 import shard_pb2 as pb

from shard.rpc import convert
from shard.rpc.errors import ErrorCode, ShardError, unwrap_single_exception
from shard.rpc.routes import relay_session_id
from shard.rpc.session import StepHost
from .downstream import NextHop, ReturnPusher
from .peers import PeerPool, PoolLimits
from .policy import Peer, PeerList, check_route, parse_target
from .returns import DirectReturns
from .routed import RoutedSession

__all__ = ["ChainRelay"]

log = logging.getLogger(__name__)

_CREDENTIAL_REFUSALS = frozenset({ErrorCode.UNAUTHENTICATED, ErrorCode.PERMISSION_DENIED})


def _has_token(metadata: Sequence[tuple[str, str | bytes]]) -> bool:
    return any(key.lower() == "authorization" for key, _ in metadata)


class ChainRelay:
    """The relay of ``serve(relay=...)`` (see the module docstring).

    ``peers``: where this worker may connect (a ``PeerList``, or its spec: entries or
    ``@FILE``); None allows loopback peers only. ``ssl_context``/``metadata``: the outbound
    credentials. A bearer token in ``metadata`` needs ``ssl_context``, unless
    ``plaintext_loopback`` (then only loopback peers are allowed). ``advertise``: the
    ``HOST:PORT`` later hops reach this worker at, the address it gives for a direct return
    (default: the address it serves on, unless that is a wildcard; then no direct return).
    """

    def __init__(
        self, *, peers: PeerList | str | None = None, ssl_context: ssl.SSLContext | None = None,
        metadata: Sequence[tuple[str, str | bytes]] = (), advertise: str | None = None,
        plaintext_loopback: bool = False, limits: PoolLimits = PoolLimits(),
    ) -> None:
        if _has_token(metadata) and ssl_context is None and not plaintext_loopback:
            raise ValueError(
                "a relay bearer token needs TLS to the next hops (--relay-tls-ca), or "
                "--relay-plaintext-loopback to send it in plaintext to loopback peers only")
        if advertise is not None:
            parse_target(advertise)  # ValueError for a malformed address
        if isinstance(peers, PeerList):
            if plaintext_loopback and not peers.loopback_only:
                raise ValueError("plaintext_loopback needs a PeerList made with loopback_only")
            self.peers = peers
        else:
            self.peers = PeerList(peers, loopback_only=plaintext_loopback)
        self.pool = PeerPool(ssl_context=ssl_context, metadata=metadata, limits=limits)
        self.advertise = advertise
        self._local: str | None = None

    @property
    def return_address(self) -> str | None:
        """Where later hops send a direct return: ``advertise``, else the bound address when it
        names one host (not a wildcard)."""
        if self.advertise is not None or self._local is None:
            return self.advertise
        host, _ = parse_target(self._local)
        try:
            if ipaddress.ip_address(host).is_unspecified:
                return None
        except ValueError:
            if not host:
                return None
        return self._local

    async def run(self, local: str, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._local = local
        log.info("chain relay: peers %s; direct return to %s", self.peers.describe(),
                 self.return_address or "(none: no --advertise address)")
        await self.pool.run(task_status=task_status)

    # ---- the Relay protocol ----------------------------------------------------------------

    def check(self, req: pb.OpenSession, caps: Capabilities, sid: str) -> None:
        if req.route.hops:
            check_route(req, caps, sid)
        elif not caps.is_last:
            raise convert.invalid("route: a return address without hops needs the last shard "
                                  "(this worker's hops would have to be named)", sid)
        elif not req.route.return_to.target:
            raise convert.invalid("route: return_to needs a target", sid)

    async def open(self, host: StepHost, req: pb.OpenSession, *, nursery: trio.Nursery) -> RoutedSession:
        route = req.route
        hop = route.hops[0]
        layers = (hop.expected_layer_range.start, hop.expected_layer_range.end)
        try:
            peer = await self.peers.check(hop.target)
        except ShardError as err:
            raise err.one_hop_up(layers) from None
        returns = None
        return_to: pb.ReturnAddress | None = None
        if route.return_to.session_id:  # a middle hop: pass the first hop's address on
            return_to = route.return_to
        elif route.HasField("return_to") and len(route.hops) >= 2:
            address = self.return_address  # this worker's own, never the caller's
            if address is not None:
                returns = DirectReturns(host.session_id)
                return_to = returns.address(address)
        with unwrap_single_exception():
            down: NextHop = await nursery.start(
                self._hold, host, route, layers, peer, return_to, nursery, req.prefix_probe,
                req.fork_of)
        if not down.pipelined:
            returns = None  # the next hop takes no part: answers come up the chain
        return RoutedSession(host, down, returns)

    async def open_return(
        self, address: pb.ReturnAddress, *, deadline: float, nursery: trio.Nursery
    ) -> ReturnPusher:
        try:
            peer = await self.peers.check(address.target)
        except ShardError as err:
            raise err.replace(message="the route's return address is not a relay peer this "
                              "worker's operator allows (`serve --relay-peers`)") from None
        pusher = ReturnPusher(address, peer, self.pool, deadline)
        nursery.start_soon(pusher.run)
        await trio.lowlevel.checkpoint()
        return pusher

    # ---- the next hop ------------------------------------------------------------------------

    async def _hold(
        self, host: StepHost, route: pb.Route, layers: tuple[int, int], peer: Peer,
        return_to: pb.ReturnAddress | None, nursery: trio.Nursery, probe: Sequence[int],
        fork_of: str, task_status: trio.TaskStatus[NextHop],
    ) -> None:
        """Own the next hop's session (on a pooled connection) until the upstream stream ends:
        a graceful close closes it, anything else resets it (its worker releases at once).
        ``fork_of``: the upstream session is a fork of that one: the next hop forks the
        session this worker opened there for it (the same principal: this worker's)."""
        hop, rest = route.hops[0], list(route.hops[1:])
        deadline = host.deadline
        stage = "connect"
        started = False
        try:
            async with self.pool.lease(peer, deadline=deadline) as conn:
                client = conn.client
                assert client is not None
                if conn.caps is None:
                    try:
                        conn.caps = await client.capabilities(
                            timeout=bounded(deadline, self.pool.limits.connect_timeout))
                    except ShardError:
                        self.pool.discard(conn)  # no Shard worker answers there (as expected)
                        raise
                caps = conn.caps
                stage = "check"
                _check(caps, hop, rest)
                stage = "open"
                timeout = hop_timeout(deadline, RELAY_DEADLINE_MARGIN)
                if timeout is not None and timeout <= 0:
                    raise ShardError(ErrorCode.DEADLINE_EXCEEDED, "the deadline expired")
                if fork_of and not caps.session_fork:
                    raise ShardError(ErrorCode.UNSUPPORTED_FEATURE, "it cannot fork a session")
                want = convert.offered_dtype(caps, host.wire_dtype)
                # a return address goes only to a hop that takes part (an older one would refuse
                # the queued steps); without it the answers come back up the chain as before
                returning = return_to is not None and caps.relay_return
                down_route = pb.Route(hops=rest, step_timeout_ms=route.step_timeout_ms)
                if returning:
                    assert return_to is not None
                    down_route.return_to.CopyFrom(return_to)
                session = await client.open_session(
                    relay_session_id(host.session_id),
                    expected_model_fingerprint=hop.expected_model_fingerprint,
                    expected_layer_range=layers,
                    hidden_wire_dtype="" if want == convert.HIDDEN_DTYPE else want,
                    route=down_route if rest or returning else None,
                    batch_group=host.batch_group,  # the pipeline's group, on every hop
                    # what the route holds of the prompt, asked of a hop that answers
                    prefix_probe=probe if caps.prefix_cache_limit else (),
                    fork_of=relay_session_id(fork_of) if fork_of else "",
                    timeout=timeout,
                )
                step = route.step_timeout_ms / 1000 * (len(rest) + 1) if route.step_timeout_ms else None
                down = NextHop(layers=layers, caps=caps, client=client, session=session,
                               nursery=nursery, pipelined=returning, answer_timeout=step)
                try:
                    task_status.started(down)
                    started = True
                    await down.done.wait()
                finally:
                    down.abort()  # RST_STREAM unless it closed: the next worker releases
                    if not client.connected:
                        self.pool.discard(conn)
        except ShardError as err:
            if started:  # the connection's end after the session's: nothing left to report
                log.info("relay to %s (layers [%d, %d)): %s", peer.target, *layers, err)
                return
            if stage == "connect" and err.reason != "RELAY_CONNECTIONS_EXHAUSTED":
                raise _unreachable(err, peer, layers) from None
            raise err.one_hop_up(layers) from None
        except Exception:
            if not started:
                raise
            log.exception("relay to %s: the holder task failed after the session ended", peer.target)


def _unreachable(err: ShardError, peer: Peer, layers: tuple[int, int]) -> ShardError:
    """A failure to reach the next hop, as the caller learns it: one message whatever went
    wrong (refused, reset, timed out, not a Shard worker), so a caller cannot probe what
    listens where; the details go to the log."""
    log.warning("relay: cannot reach %s (%s) for layers [%d, %d): %s", peer.target, peer.address,
                *layers, err)
    if err.code in _CREDENTIAL_REFUSALS:
        return ShardError(err.code, "it refused this worker's relay credentials",
                          reason="RELAY_CREDENTIALS_REFUSED").one_hop_up(layers)
    return ShardError(ErrorCode.NOT_READY, "it could not be reached",
                      reason="RELAY_HOP_UNREACHABLE").one_hop_up(layers)


def _check(caps: pb.GetCapabilitiesResponse, hop: pb.RouteHop, rest: Sequence[pb.RouteHop]) -> None:
    """The hop serves what the route expects, and can relay further if the route goes on."""
    have = (caps.layer_range.start, caps.layer_range.end)
    want = (hop.expected_layer_range.start, hop.expected_layer_range.end)
    if hop.expected_model_fingerprint != caps.model_fingerprint:
        raise ShardError(ErrorCode.INCOMPATIBLE_MODEL,
                         f"serves model {caps.model_fingerprint}, the route expects "
                         f"{hop.expected_model_fingerprint}")
    if want != have:
        raise ShardError(ErrorCode.INCOMPATIBLE_MODEL,
                         f"serves layers [{have[0]}, {have[1]}), the route expects "
                         f"[{want[0]}, {want[1]})")
    if rest and not caps.relay_allowed:
        raise ShardError(ErrorCode.PERMISSION_DENIED,
                         "the route goes on after this hop, but it does not report relay_allowed "
                         "(its operator did not start it with --allow-relay)",
                         reason="RELAY_NOT_ALLOWED")
    if not rest and not caps.is_last:
        raise ShardError(ErrorCode.INCOMPATIBLE_MODEL,
                         f"the route ends here, at layer {have[1]} of {caps.n_layers_total}: its "
                         "last hop must serve the last layers")
