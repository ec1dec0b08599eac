"""Connections from a relaying worker to its peers: one shared, bounded pool.

Why a pool: every routed session needs a stream to its next hop, and a last hop with a direct
return a stream of ``Return`` calls to its first hop. A connection per session would make one
busy chain open hundreds of connections, each counted against the next worker's
``max_connections`` and each paying a TCP (and TLS) handshake at session open. A gRPC
connection multiplexes streams, so the pool keeps one connection per peer and puts every routed
session's stream on it, opening a second one only when a connection carries
``streams_per_connection`` streams (a worker refuses more than 64 streaming calls per
connection), up to ``connections_per_peer``; past that, and past ``max_connections`` in all, a
new lease is refused with RESOURCE_EXHAUSTED.

Health: a connection that broke or was told to go away (GOAWAY: the peer drains) is never
leased again; it closes once its last lease ends. A connection unused for ``check_idle_after``
seconds is asked for its worker's ``Health`` before it is leased again (a peer that vanished
without closing the connection, a partition or a stopped process, would otherwise hold the next
session until its deadline); no answer within ``connect_timeout`` and it is dropped for a new
one. An idle connection (no lease for ``idle_timeout`` seconds) is closed. A caller whose call
finds the connection broken reports it with ``discard``. The peer's capabilities are asked once
per connection (``PooledConnection.caps``).

Ownership: ``run`` (started by ``serve``) owns a nursery; each connection is held by one task in
it, so every connection closes when the server stops. Credentials: every connection carries the
relay's outbound TLS context and metadata (``--relay-tls-*``, ``--relay-token-file``), and only
ever goes to a ``Peer`` the relay policy checked.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from shard.client import ShardClient
from shard.deadlines import bounded
from shard.v1 import shard_pb2 as pb

from shard.rpc.errors import ErrorCode, ShardError
from .policy import Peer

__all__ = ["PeerPool", "PoolLimits", "PooledConnection"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolLimits:
    """Bounds of the pool; the defaults are the production defaults."""

    #: Streams (routed sessions, return pushers) one connection carries before another opens.
    streams_per_connection: int = 48
    connections_per_peer: int = 4
    max_connections: int = 64
    #: Seconds an unused connection stays open.
    idle_timeout: float = 30.0
    #: A connection unused this many seconds is checked (the peer's Health) before reuse.
    check_idle_after: float = 5.0
    #: Seconds reaching a peer may take at most: the TCP/TLS connect, and its first answer
    #: (its capabilities, asked once per connection).
    connect_timeout: float = 10.0

    def __post_init__(self) -> None:
        for name in ("streams_per_connection", "connections_per_peer", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("idle_timeout", "connect_timeout", "check_idle_after"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")


@dataclass(eq=False)
class PooledConnection:
    """One pooled connection: its client, and what the peer reported (kept for the
    connection's lifetime: one worker process answers on it)."""

    peer: Peer
    client: ShardClient | None = None
    caps: pb.GetCapabilitiesResponse | None = None
    error: ShardError | None = None
    leases: int = 0
    idle_since: float = 0.0  # trio time its last lease ended
    opened: trio.Event = field(default_factory=trio.Event)  # connected, or failed (``error``)
    changed: trio.Event = field(default_factory=trio.Event)  # a lease ended, or it was discarded
    discarded: bool = False

    def usable(self) -> bool:
        client = self.client
        return (not self.discarded and client is not None and client.connected
                and not client.going_away)

    def nudge(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class PeerPool:
    """Shared outbound connections of one relaying worker (see the module docstring)."""

    def __init__(
        self, *, ssl_context: ssl.SSLContext | None = None,
        metadata: Sequence[tuple[str, str | bytes]] = (), limits: PoolLimits = PoolLimits(),
    ) -> None:
        self.ssl_context = ssl_context
        self.metadata = tuple(metadata)
        self.limits = limits
        self._conns: dict[tuple[str, int, str], list[PooledConnection]] = {}
        self._nursery: trio.Nursery | None = None
        self.opened_total = 0  # connections ever opened (observers, tests)

    @property
    def connections(self) -> int:
        """Connections open or opening now."""
        return sum(len(c) for c in self._conns.values())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own every connection until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    @asynccontextmanager
    async def lease(self, peer: Peer, *, deadline: float) -> AsyncIterator[PooledConnection]:
        """A connection to ``peer`` for the block (opened within ``deadline`` if none is
        free). Raises the connect failure as is (the caller words it for its own caller)."""
        conn = await self._acquire(peer, deadline)
        try:
            yield conn
        finally:
            conn.leases -= 1
            conn.idle_since = trio.current_time()
            conn.nudge()

    @staticmethod
    def discard(conn: PooledConnection) -> None:
        """Stop leasing ``conn`` (a call found it broken); it closes once idle."""
        conn.discarded = True
        conn.nudge()

    async def _acquire(self, peer: Peer, deadline: float) -> PooledConnection:
        while True:
            conns = self._conns.setdefault(peer.key, [])
            free = [c for c in conns if (c.usable() or not c.opened.is_set())
                    and c.leases < self.limits.streams_per_connection]
            fresh = not free
            if free:
                conn = min(free, key=lambda c: c.leases)
                if not await self._healthy(conn, deadline):
                    continue
            elif (len(conns) >= self.limits.connections_per_peer
                  or self.connections >= self.limits.max_connections):
                raise ShardError(
                    ErrorCode.RESOURCE_EXHAUSTED,
                    "this worker's relay connections are all in use; try again later",
                    retryable=True, reason="RELAY_CONNECTIONS_EXHAUSTED")
            else:
                conn = self._open(peer)
            conn.leases += 1
            try:
                with trio.fail_after(bounded(deadline, self.limits.connect_timeout)):
                    await conn.opened.wait()
            except trio.TooSlowError:
                conn.leases -= 1
                conn.nudge()
                raise ShardError(ErrorCode.NOT_READY, "timed out connecting",
                                 reason="CONNECT_FAILED") from None
            except BaseException:
                conn.leases -= 1
                conn.nudge()
                raise
            if conn.error is not None:
                conn.leases -= 1
                raise conn.error
            if conn.usable():
                return conn
            conn.leases -= 1
            conn.nudge()
            if fresh:  # dead on arrival (the peer spoke no HTTP/2, or hung up): no retry
                raise ShardError(ErrorCode.NOT_READY, "the connection closed as soon as it opened",
                                 reason="CONNECT_FAILED")
            # a pooled connection broke between our look and now: try another

    async def _healthy(self, conn: PooledConnection, deadline: float) -> bool:
        """A connection unused for ``check_idle_after`` answers its worker's Health in time,
        or is dropped (False). Others are taken as they are."""
        idle = trio.current_time() - conn.idle_since
        if conn.leases or not conn.opened.is_set() or idle < self.limits.check_idle_after:
            return True
        assert conn.client is not None
        conn.leases += 1  # (not closed as idle while it is asked)
        try:
            with trio.move_on_after(bounded(deadline, self.limits.connect_timeout)):
                await conn.client.health(timeout=self.limits.connect_timeout)
                conn.idle_since = trio.current_time()
                return True
        except ShardError:
            pass
        finally:
            conn.leases -= 1
            conn.nudge()
        log.info("relay connection to %s (%s) did not answer Health: dropped", conn.peer.target,
                 conn.peer.address)
        self.discard(conn)
        return False

    def _open(self, peer: Peer) -> PooledConnection:
        if self._nursery is None:
            raise ShardError(ErrorCode.NOT_READY, "the relay is not running")
        conn = PooledConnection(peer, idle_since=trio.current_time())
        self._conns.setdefault(peer.key, []).append(conn)
        self.opened_total += 1
        self._nursery.start_soon(self._hold, conn)
        return conn

    async def _hold(self, conn: PooledConnection) -> None:
        """Own one connection: open it, keep it while it is leased or recently used, close it
        when idle, broken (and unleased) or the pool stops."""
        peer = conn.peer
        try:
            async with ShardClient.connect(
                peer.target, address=peer.address, timeout=self.limits.connect_timeout,
                ssl_context=self.ssl_context, metadata=self.metadata,
            ) as client:
                conn.client = client
                conn.opened.set()
                while True:
                    changed = conn.changed
                    if conn.leases == 0 and not conn.usable():
                        return
                    if conn.leases == 0:
                        with trio.move_on_after(self.limits.idle_timeout) as idle:
                            await changed.wait()
                        if idle.cancelled_caught and conn.leases == 0:
                            return
                        continue
                    await changed.wait()
        except ShardError as err:
            conn.error = err
            log.info("relay connection to %s (%s) failed: %s", peer.target, peer.address, err)
        finally:
            conn.discarded = True
            conn.opened.set()
            conns = self._conns.get(peer.key, [])
            if conn in conns:
                conns.remove(conn)
            if not conns:
                self._conns.pop(peer.key, None)
