"""Reading the floor server's streams (bench/common/floor_server.py) and measuring a pass of them.

The Shard client's reader reads on the client's own connection (``ClientConnection``), message
by message, so its CPU per message is comparable with ``ShardClient``'s per token; grpcio reads
in a thread (it blocks). ``floor_pass`` measures one pass of either: the floor server's event
loop CPU and the reader's, per message. Used by bench/worker/stack_floor.py and by
``bench/worker/hot_path.py --floor`` (the floor at the worker's own pace, beside it in one run).
"""

from __future__ import annotations

import time
from typing import Any

import trio

from bench.common.processes import thread_cpu
from shard.client import ShardClient
from shard.v1 import shard_pb2 as pb


def floor_request(n: int, pace_us: float = 0) -> pb.Generate:
    """A floor request: ``n`` messages, ``pace_us`` microseconds apart (0: the server's default
    pace of the paced methods, one millisecond; any other pace is at least 1 us)."""
    return pb.Generate(max_tokens=n, sampling=pb.SamplingParams(
        seed=max(1, round(pace_us)) if pace_us > 0 else 0))


def read_grpcio(channel: Any, n: int, method: str = "Floor", pace_us: float = 0) -> int:
    """Read a server-streaming floor method with grpcio (blocking: run it in a thread)."""
    call = channel.unary_stream(
        f"/shard.v1.Shard/{method}", request_serializer=pb.Generate.SerializeToString,
        response_deserializer=pb.SessionResponse.FromString)
    return sum(1 for _ in call(floor_request(n, pace_us), timeout=600))


async def read_stream(client: ShardClient, n: int, method: str = "Floor", pace_us: float = 0) -> int:
    """Ask ``method`` for ``n`` messages and read them one by one; returns how many came."""
    stream = client._conn.open_stream(method, trio.current_time() + 600, ())  # noqa: SLF001
    try:
        await stream.send(floor_request(n, pace_us))
        await stream.half_close()
        return await _rest(stream)
    finally:
        stream.close()


async def echo(client: ShardClient, n: int, pace_us: float) -> int:
    """``n`` request-answer turns on ``FloorEcho``, each answered ``pace_us`` after its request,
    as a client-driven ``Decode`` per token; returns how many answers came."""
    stream = client._conn.open_stream("FloorEcho", trio.current_time() + 600, ())  # noqa: SLF001
    try:
        got = 0
        for _ in range(n):
            await stream.send(floor_request(1, pace_us))
            if await stream.receive(pb.SessionResponse) is None:
                break
            got += 1
        await stream.half_close()
        return got + await _rest(stream)
    finally:
        stream.close()


async def _rest(stream: Any) -> int:
    """Read a half-closed stream to its end: how many messages came (its error raised)."""
    got = 0
    while await stream.receive(pb.SessionResponse) is not None:
        got += 1
    if (err := stream.error()) is not None:
        raise err
    return got


async def floor_pass(pid: int, method: str, n: int, *, pace_us: float = 0, reader: str = "shard",
                     client: ShardClient | None = None, channel: Any = None) -> dict[str, float]:
    """One pass of ``n`` messages of ``method`` from the floor server ``pid``, read by
    ``reader`` ("shard": on ``client``; "grpcio": on ``channel``; ``FloorEcho``: shard only),
    ``pace_us`` apart: microseconds per message of wall time, of the server's event loop (its
    main thread) and of this process, the reader."""
    before, t0, c0 = thread_cpu(pid), time.perf_counter(), time.process_time()
    if reader == "grpcio":
        got = await trio.to_thread.run_sync(read_grpcio, channel, n, method, pace_us)
    else:
        assert client is not None
        got = await (echo(client, n, pace_us) if method == "FloorEcho"
                     else read_stream(client, n, method, pace_us))
    wall, client_cpu, after = time.perf_counter() - t0, time.process_time() - c0, thread_cpu(pid)
    assert got == n, (got, n)
    per = 1e6 / n
    return {"messages": n, "pace_us": pace_us, "wall_us": wall * per,
            "server_main_us": (after.get(str(pid), 0.0) - before.get(str(pid), 0.0)) * per,
            "client_cpu_us": client_cpu * per}
