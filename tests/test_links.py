"""bench/common/links.py: bytes arrive intact and in order, delay and bandwidth bound times from below,
closing one side closes the other, no task outlives the link, and gRPC works through it.
Lower bounds only: never a speed."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import trio

from bench.common.links import open_link
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import worker
from shard.client import ShardClient
from shard.v1 import shard_pb2 as pb


@asynccontextmanager
async def echo_server(closed: trio.Event | None = None) -> AsyncIterator[str]:
    """A TCP echo server on loopback; ``closed`` is set when a connection ends."""

    async def echo(stream: trio.SocketStream) -> None:
        async with stream:
            async for data in stream:
                await stream.send_all(data)
        if closed is not None:
            closed.set()

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, echo, 0, host="127.0.0.1"))
        yield f"127.0.0.1:{listener.socket.getsockname()[1]}"
        nursery.cancel_scope.cancel()


async def connect(target: str) -> trio.SocketStream:
    host, port = target.rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


async def receive_exactly(stream: trio.SocketStream, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        data = await stream.receive_some(n - len(out))
        assert data, "stream ended early"
        out += data
    return bytes(out)


async def test_bytes_arrive_intact_and_in_order_under_jitter() -> None:
    payload = os.urandom(300_000)
    async with echo_server() as up, open_link(up, one_way_delay_s=0.002, jitter_s=0.01,
                                              chunk_bytes=1000, queue_chunks=4, seed=1) as link:
        stream = await connect(link.target)
        async with stream, trio.open_nursery() as nursery:
            nursery.start_soon(stream.send_all, payload)
            assert await receive_exactly(stream, len(payload)) == payload


async def test_round_trip_takes_at_least_two_one_way_delays() -> None:
    delay = 0.05
    async with echo_server() as up, open_link(up, one_way_delay_s=delay) as link:
        stream = await connect(link.target)
        async with stream:
            for _ in range(3):
                start = trio.current_time()
                await stream.send_all(b"ping")
                assert await receive_exactly(stream, 4) == b"ping"
                assert trio.current_time() - start >= 2 * delay


async def test_bandwidth_cap_bounds_transfer_time_from_below() -> None:
    n, rate = 200_000, 1_000_000.0  # 0.2 s each way at least
    async with echo_server() as up, open_link(up, bandwidth_bytes_per_s=rate) as link:
        stream = await connect(link.target)
        async with stream, trio.open_nursery() as nursery:
            start = trio.current_time()
            nursery.start_soon(stream.send_all, b"x" * n)
            await receive_exactly(stream, n)
            assert trio.current_time() - start >= n / rate


async def test_closing_the_client_closes_upstream_and_leaves_no_tasks() -> None:
    closed = trio.Event()
    async with echo_server(closed) as up:
        async with open_link(up, one_way_delay_s=0.01) as link:
            stream = await connect(link.target)
            await stream.send_all(b"hello")
            assert await receive_exactly(stream, 5) == b"hello"
            assert link.open_connections == 1
            await stream.aclose()
            with trio.fail_after(10):
                await closed.wait()  # upstream saw the end of its connection
                while link.open_connections:
                    await trio.sleep(0.01)
            # another connection left open when the link closes is ended with it
            left_open = await connect(link.target)
            while link.connections < 2:
                await trio.sleep(0.01)
        assert link.open_connections == 0
        assert await left_open.receive_some(10) == b""  # the link closed its side
        await left_open.aclose()
        assert link.connections == 2


async def test_grpc_through_a_delayed_link() -> None:
    async with worker() as w, open_link(w.target, one_way_delay_s=0.005, jitter_s=0.005, seed=2) as link:
        async with ShardClient.connect(link.target, timeout=10) as client:
            assert (await client.health()).status == pb.HealthResponse.STATUS_SERVING
            assert (await client.capabilities()).engine == "fake"


async def test_an_error_in_the_block_propagates() -> None:
    """An error of the code inside the link's block reaches the caller: closing the listener
    after the link's nursery was cancelled used to raise Cancelled over it, which the nursery
    caught, and the block's error vanished (a bench then failed later, elsewhere)."""
    async with echo_server() as target:
        try:
            async with open_link(target):
                raise LookupError("from the block")
        except BaseException as exc:  # the error, maybe inside an exception group
            caught = exc
        else:
            caught = None
    assert caught is not None
    if isinstance(caught, BaseExceptionGroup):
        match, _ = caught.split(LookupError)
        assert match is not None
    else:
        assert isinstance(caught, LookupError)
