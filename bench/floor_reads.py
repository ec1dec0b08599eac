"""Reading the floor server's streams (bench/floor_server.py) the way ``ShardClient`` reads a
worker's: on the client's own connection (``ClientConnection``), message by message, so the
reader's CPU per message is comparable with ``ShardClient``'s per token.

Used by bench/stack_floor.py and by ``bench/hot_path.py --floor`` (the floor at the worker's
own pace, beside it in one run).
"""

from __future__ import annotations

import trio

from shard.client import ShardClient
from shard.v1 import shard_pb2 as pb


def floor_request(n: int, pace_us: int = 0) -> pb.Generate:
    """A floor request: ``n`` messages, ``pace_us`` microseconds apart (0: the server's default
    pace of the paced methods, one millisecond)."""
    return pb.Generate(max_tokens=n, sampling=pb.SamplingParams(seed=max(0, int(pace_us))))


async def read_stream(client: ShardClient, n: int, method: str = "Floor", pace_us: int = 0) -> int:
    """Ask ``method`` for ``n`` messages and read them one by one; returns how many came."""
    stream = client._conn.open_stream(method, trio.current_time() + 600, ())  # noqa: SLF001
    try:
        await stream.send(floor_request(n, pace_us))
        await stream.half_close()
        got = 0
        while await stream.receive(pb.SessionResponse) is not None:
            got += 1
        if (err := stream.error()) is not None:
            raise err
        return got
    finally:
        stream.close()


async def echo(client: ShardClient, n: int, pace_us: int) -> int:
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
        while await stream.receive(pb.SessionResponse) is not None:
            got += 1
        if (err := stream.error()) is not None:
            raise err
        return got
    finally:
        stream.close()
