"""A simulated network link: a Trio TCP proxy adding one-way delay, jitter and a bandwidth cap.

The kernel here has no netem, so benches and tests put one ``Link`` in front of a worker to
see what a pipeline costs over a real network. Each accepted connection gets two pumps (one per
direction). A chunk read from one side is serialised at the bandwidth cap (its transmission
finishes no earlier than the previous chunk's), then propagated for the one-way delay plus a
uniform jitter; delivery times never decrease within a direction, so jitter never reorders
bytes. Each direction buffers at most ``queue_chunks`` chunks of at most ``chunk_bytes``
(back-pressure: a full queue stops reading that side). End of stream or an error on either side
closes both sides of that connection; leaving the ``open_link`` block ends every task.

    async with open_link("127.0.0.1:5000", one_way_delay_s=0.01) as link:
        ...connect to link.target...
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import trio


@dataclass
class Link:
    """A listening proxy to ``upstream``; ``target`` is its own ``host:port``."""

    upstream: str
    one_way_delay_s: float = 0.0
    jitter_s: float = 0.0
    bandwidth_bytes_per_s: float | None = None
    chunk_bytes: int = 16384
    queue_chunks: int = 64
    seed: int | None = None
    target: str = ""
    connections: int = 0  # accepted so far
    open_connections: int = 0
    _rng: random.Random = field(default_factory=random.Random, repr=False)

    async def _pump(self, src: trio.SocketStream, dst: trio.SocketStream, done: trio.CancelScope) -> None:
        send, recv = trio.open_memory_channel[tuple[float, bytes]](self.queue_chunks)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read, src, send)
            await self._write(recv, dst)
        done.cancel()  # this direction ended: close the connection

    async def _read(self, src: trio.SocketStream, send: trio.MemorySendChannel[tuple[float, bytes]]) -> None:
        tx_free = deliver_last = 0.0
        async with send:
            while True:
                try:
                    data = await src.receive_some(self.chunk_bytes)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                if not data:
                    return
                now = trio.current_time()
                tx_done = max(now, tx_free)
                if self.bandwidth_bytes_per_s:
                    tx_done += len(data) / self.bandwidth_bytes_per_s
                tx_free = tx_done
                jitter = self._rng.uniform(0.0, self.jitter_s) if self.jitter_s > 0 else 0.0
                deliver_last = max(deliver_last, tx_done + self.one_way_delay_s + jitter)
                await send.send((deliver_last, data))

    async def _write(self, recv: trio.MemoryReceiveChannel[tuple[float, bytes]], dst: trio.SocketStream) -> None:
        async with recv:
            async for due, data in recv:
                await trio.sleep_until(due)
                try:
                    await dst.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return

    async def _handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        self.open_connections += 1
        try:
            host, port = self.upstream.rsplit(":", 1)
            try:
                upstream = await trio.open_tcp_stream(host, int(port))
            except OSError:
                await client.aclose()
                return
            async with client, upstream:
                with trio.CancelScope() as done:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._pump, client, upstream, done)
                        nursery.start_soon(self._pump, upstream, client, done)
        finally:
            self.open_connections -= 1


@asynccontextmanager
async def open_link(
    upstream: str, *, one_way_delay_s: float = 0.0, jitter_s: float = 0.0,
    bandwidth_bytes_per_s: float | None = None, chunk_bytes: int = 16384, queue_chunks: int = 64,
    seed: int | None = None, port: int = 0,
) -> AsyncIterator[Link]:
    """Listen on 127.0.0.1 ``port`` (0: a free one) and proxy every connection to ``upstream``
    (``host:port``) through a simulated link until the block ends."""
    if one_way_delay_s < 0 or jitter_s < 0 or (bandwidth_bytes_per_s is not None and bandwidth_bytes_per_s <= 0):
        raise ValueError("delay and jitter must be >= 0, bandwidth > 0")
    link = Link(upstream, one_way_delay_s, jitter_s, bandwidth_bytes_per_s, chunk_bytes,
                queue_chunks, seed, _rng=random.Random(seed))
    async with trio.open_nursery() as nursery:
        (listener,) = await trio.open_tcp_listeners(port, host="127.0.0.1")
        try:
            async with listener:
                host, port = listener.socket.getsockname()[:2]
                link.target = f"{host}:{port}"
                nursery.start_soon(partial(trio.serve_listeners, link._handle, [listener]))
                yield link
        finally:
            # Only after the listener closed: cancelling first made its close raise Cancelled,
            # which the nursery then caught, and an error of the block vanished with it.
            nursery.cancel_scope.cancel()
