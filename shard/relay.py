"""Chain relay, the worker's outbound side: open the next hop of a routed session.

``serve(relay=ChainRelay(...))`` (``trio-shard serve --allow-relay``) lets a worker take a
session opened with a ``route`` (``OpenSession.route``: the hops after it). For each such session
it connects to ``route.hops[0]`` with its own outbound credentials (``--relay-tls-ca``,
``--relay-tls-cert/--relay-tls-key``, ``--relay-token-file``), checks the hop's capabilities
against what the route expects, and opens a session there with the rest of the route; the session
steps themselves are ``shard.rpc.relaying``'s. Why a module of its own, above ``shard.rpc``: it
is a client of the next worker (``shard.client``), and the RPC layer must not import the client.

Ownership: the connection and the downstream session are held by one task started in the
upstream session stream's nursery (``RelayOpener.open``): the downstream lives exactly as long as
the upstream stream. A graceful close closes it; anything else (a reset, the deadline, a Release,
a failure, a drain's end) cancels the task, which resets the downstream stream, so the next
worker releases its session at once (and in turn resets its own downstream).

Deadlines: the downstream session's ``grpc-timeout`` is the upstream's remaining time less
``shard.hops.HOP_DEADLINE_MARGIN``, rounded down (``hop_timeout``), so deadlines shrink along the
route and every hop's ends before the one above it.

Direct return: a last hop given a return address (``Route.return_to``) hands each tagged result
to the first hop through a ``ReturnPusher`` (its own connection, the same outbound credentials);
a middle hop passes the address on only to a next hop that reports ``relay_return``.

Errors: everything a hop reports is prefixed ``relay hop HOST:PORT (layers [A, B))`` by the worker
before it (``name_of``); a client reads the deepest such prefix to name the failing hop
(``blamed_hop``).
"""

from __future__ import annotations

import logging
import re
import ssl
from collections.abc import Sequence

import numpy as np
import trio

from shard.client import ClientSession, ShardClient
from shard.hops import hop_timeout, time_left, wire_dtype
from shard.rpc import convert
from shard.rpc.errors import ErrorCode, ShardError, unwrap_single_exception
from shard.rpc.relaying import relay_session_id
from shard.v1 import shard_pb2 as pb

__all__ = ["RELAY_CALL_TIMEOUT", "ChainRelay", "DownstreamHop", "ReturnPusher", "blamed_hop", "name_of"]

log = logging.getLogger(__name__)

#: Seconds a relay's own unary calls (GetCapabilities, a forwarded Cancel) and its TCP/TLS
#: connect may take at most (and never past the session's deadline).
RELAY_CALL_TIMEOUT = 10.0
#: How long a graceful downstream close may take before the stream is reset instead.
CLOSE_TIMEOUT = 2.0
_PREFIX = re.compile(r"relay hop (\S+) \(layers \[(\d+), (\d+)\)\): ")


def name_of(hop: pb.RouteHop) -> str:
    """How a worker names its downstream hop in errors."""
    if hop.HasField("expected_layer_range"):
        r = hop.expected_layer_range
        return f"relay hop {hop.target} (layers [{r.start}, {r.end}))"
    return f"relay hop {hop.target} (layers [?, ?))"


def blamed_hop(message: str) -> tuple[str, str] | None:
    """The deepest hop an error message names (its target) and what it said, or None when no
    relay hop is named (the error is the first hop's own)."""
    target, rest = None, message
    while (m := _PREFIX.match(rest)) is not None:
        target, rest = m.group(1), rest[m.end():]
    return None if target is None else (target, rest)


def _bounded(deadline: float) -> float:
    left = time_left(deadline)
    return RELAY_CALL_TIMEOUT if left is None else max(0.0, min(RELAY_CALL_TIMEOUT, left))


class DownstreamHop:
    """A routed session's open session on the next hop (``shard.rpc.relaying.Downstream``)."""

    def __init__(
        self, hop: pb.RouteHop, client: ShardClient, session: ClientSession, nursery: trio.Nursery,
        *, pipelined: bool = False,
    ) -> None:
        self.name = name_of(hop)
        self.target = hop.target
        self.kv_capacity = session.opened.kv_capacity
        self.pipelined = pipelined  # it took the route's return address (queues one step)
        self._client = client
        self._session = session
        self._nursery = nursery
        self._busy = 0  # steps in flight downstream
        self.done = trio.Event()  # the holder task may end (closed or reset)

    async def prefill(
        self, rows: np.ndarray | None, position: int, sampling: pb.SamplingParams, top_logprobs: int,
        all_logits: bool = False,
    ) -> pb.StepResult:
        if rows is None:
            raise ShardError(ErrorCode.INTERNAL, "no boundary rows to relay")
        with self._in_flight():
            return await self._session.prefill(
                hidden_states=rows, position=position, sampling=sampling, top_logprobs=top_logprobs,
                all_logits=all_logits,
            )

    async def decode(
        self, row: np.ndarray | None, sampling: pb.SamplingParams, top_logprobs: int,
        relay_tag: int = 0,
    ) -> pb.StepResult:
        if row is None:
            raise ShardError(ErrorCode.INTERNAL, "no boundary row to relay")
        with self._in_flight():
            return await self._session.decode(
                hidden_state=row, sampling=sampling, top_logprobs=top_logprobs, relay_tag=relay_tag
            )

    async def send_decode(
        self, row: np.ndarray, sampling: pb.SamplingParams, top_logprobs: int, relay_tag: int,
    ) -> None:
        await self._session.send_ahead(hidden_state=row, sampling=sampling,
                                       top_logprobs=top_logprobs, relay_tag=relay_tag)
        self._busy += 1

    async def read_answer(self) -> pb.StepResult:
        try:
            return await self._session.read_ahead()
        finally:
            self._busy -= 1

    def _in_flight(self) -> _Busy:
        return _Busy(self)

    def alive(self) -> bool:
        return self._session.alive

    def held(self) -> int | None:
        if not self._session.alive or self._session.opened.version.minor < 1:
            return None  # Usage.n_past is 1.1's: a 1.0 hop cannot say what it holds
        return int(self._session.usage.n_past)

    def cancel(self) -> None:
        if self._busy and self._session.alive:
            self._nursery.start_soon(self._forward_cancel)

    async def _forward_cancel(self) -> None:
        try:
            await self._client.cancel(self._session.session_id, timeout=RELAY_CALL_TIMEOUT)
        except ShardError as err:  # the step goes on or fails by itself; log why
            log.info("%s: forwarding Cancel failed: %s", self.name, err)

    async def close(self) -> None:
        try:
            if self._session.alive:
                with trio.move_on_after(CLOSE_TIMEOUT):
                    await self._session.close()
        except ShardError as err:
            log.info("%s: closing the downstream session failed: %s", self.name, err)
        finally:
            self.abort()

    def abort(self) -> None:
        self._session.abort()  # a no-op on the wire once the stream ended
        self.done.set()


class _Busy:
    """Marks a step in flight downstream (a Cancel is then forwarded)."""

    def __init__(self, hop: DownstreamHop) -> None:
        self._hop = hop

    def __enter__(self) -> None:
        self._hop._busy += 1

    def __exit__(self, *exc: object) -> None:
        self._hop._busy -= 1


class ChainRelay:
    """The ``RelayOpener`` of ``serve(relay=...)``: connects to each routed session's next hop
    with these outbound credentials (TLS context, bearer metadata)."""

    def __init__(
        self, *, ssl_context: ssl.SSLContext | None = None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> None:
        self.ssl_context = ssl_context
        self.metadata = tuple(metadata)

    async def open(
        self, route: pb.Route, *, session_id: str, deadline: float, hidden_dtype: str,
        nursery: trio.Nursery, return_to: pb.ReturnAddress | None = None,
    ) -> DownstreamHop:
        with unwrap_single_exception():
            down: DownstreamHop = await nursery.start(
                self._hold, route, session_id, deadline, hidden_dtype, nursery, return_to
            )
        return down

    async def open_return(
        self, address: pb.ReturnAddress, *, deadline: float, nursery: trio.Nursery
    ) -> ReturnPusher:
        pusher = ReturnPusher(address, self, deadline)
        nursery.start_soon(pusher.run)
        await trio.lowlevel.checkpoint()
        return pusher

    async def _hold(
        self, route: pb.Route, session_id: str, deadline: float, hidden_dtype: str,
        nursery: trio.Nursery, return_to: pb.ReturnAddress | None,
        task_status: trio.TaskStatus[DownstreamHop],
    ) -> None:
        """Own the connection and the session until the upstream stream ends."""
        hop, rest = route.hops[0], list(route.hops[1:])
        name = name_of(hop)
        started = False
        try:
            async with ShardClient.connect(
                hop.target, timeout=_bounded(deadline), ssl_context=self.ssl_context,
                metadata=self.metadata,
            ) as client:
                caps = await client.capabilities(timeout=_bounded(deadline))
                _check(caps, hop, rest)
                timeout = hop_timeout(deadline)
                if timeout is not None and timeout <= 0:
                    raise ShardError(ErrorCode.DEADLINE_EXCEEDED, "the deadline expired")
                want = wire_dtype(caps, hidden_dtype)
                r = hop.expected_layer_range
                # a return address goes only to a hop that takes part (an older one would refuse
                # the queued steps); without it the answers come back up the chain as before
                returning = return_to is not None and caps.relay_return
                down_route = pb.Route(hops=rest)
                if returning:
                    down_route.return_to.CopyFrom(return_to)
                session = await client.open_session(
                    relay_session_id(session_id),
                    expected_model_fingerprint=hop.expected_model_fingerprint,
                    expected_layer_range=(r.start, r.end) if hop.HasField("expected_layer_range") else None,
                    hidden_wire_dtype="" if want == convert.HIDDEN_DTYPE else want,
                    route=down_route if rest or returning else None,
                    timeout=timeout,
                )
                down = DownstreamHop(hop, client, session, nursery, pipelined=returning)
                try:
                    task_status.started(down)
                    started = True
                    await down.done.wait()
                finally:
                    down.abort()  # RST_STREAM unless it closed: the next worker releases
        except ShardError as err:
            if started:  # the connection's end after the session's: nothing left to report
                log.info("%s: %s", name, err)
                return
            raise ShardError(
                err.code, f"{name}: {err.message}", retryable=err.retryable, reason=err.reason,
                supported_versions=err.supported_versions, grpc_status=err.grpc_status,
            ) from None
        except Exception:
            if not started:
                raise
            log.exception("%s: the relay task failed after the session ended", name)


class ReturnPusher:
    """A last hop's direct return (``Returner``): hands each tagged result to the route's first
    hop with the ``Return`` RPC, over a connection of its own (the relay's outbound
    credentials). Never in the step's way: results wait in a small queue, a full queue drops
    one, and a return address that cannot be reached is logged once and then ignored (the
    chain's answers carry every result anyway)."""

    #: Results waiting to be handed over (each Return waits for its answer, one at a time).
    QUEUE = 4

    def __init__(self, address: pb.ReturnAddress, relay: ChainRelay, deadline: float) -> None:
        self.address = address
        self._relay = relay
        self._deadline = deadline
        self._send, self._recv = trio.open_memory_channel[tuple[int, pb.StepResult]](self.QUEUE)
        self.pushed = self.dropped = 0
        self._scope = trio.CancelScope()

    def push(self, tag: int, step: pb.StepResult) -> None:
        try:
            self._send.send_nowait((tag, step))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self.dropped += 1

    def close(self) -> None:
        self._send.close()
        self._scope.cancel()  # a connect or a Return in flight is of no use any more

    async def run(self) -> None:
        """Own the connection until the session closes (``close``) or its stream ends."""
        with self._scope:
            await self._push_all()

    async def _push_all(self) -> None:
        target = self.address.target
        try:
            async with ShardClient.connect(
                target, timeout=_bounded(self._deadline), ssl_context=self._relay.ssl_context,
                metadata=self._relay.metadata,
            ) as client, self._recv:
                async for tag, step in self._recv:
                    await client.return_step(self.address, tag, step,
                                             timeout=_bounded(self._deadline))
                    self.pushed += 1
        except ShardError as err:
            log.info("direct return to %s stopped (results go up the chain): %s", target, err)
        finally:
            self._send.close()  # later pushes are dropped


def _check(caps: pb.GetCapabilitiesResponse, hop: pb.RouteHop, rest: Sequence[pb.RouteHop]) -> None:
    """The hop serves what the route expects, and can relay further if the route goes on."""
    have = (caps.layer_range.start, caps.layer_range.end)
    if hop.expected_model_fingerprint and hop.expected_model_fingerprint != caps.model_fingerprint:
        raise ShardError(ErrorCode.INCOMPATIBLE_MODEL,
                         f"serves model {caps.model_fingerprint}, the route expects "
                         f"{hop.expected_model_fingerprint}")
    if hop.HasField("expected_layer_range"):
        want = (hop.expected_layer_range.start, hop.expected_layer_range.end)
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
