"""The stack's floor: a minimal server-streaming RPC on Trio, nothing of the worker around it.

``python -m bench.floor_server --impl transport|purerpc`` serves two methods,
``/shard.v1.Shard/Floor`` and ``FloorPaced``: a ``Generate`` request asks for ``max_tokens``
messages, and the handler yields that many ``SessionResponse`` steps (``FloorPaced``: one per
millisecond, so each is its own wake-up and socket write, as a worker's token is), each built field by field the way the worker
builds a token's step (``StepResult`` with ``Logits``: step, position, token id, log-prob, a
one-byte piece), as fast as the reader takes them. No engine, no session, no credit: what is
left is what the required stack (Trio, h2, purerpc's codec, protobuf's C implementation) costs
to frame and send one small message. ``transport`` runs it on the worker's hardened transport
(``shard.rpc.transport.Server``: bounds, deadlines, budgets), ``purerpc`` on stock purerpc 0.8's
own server, to see what the hardening costs.

It logs ``serving shard.v1.Shard on HOST:PORT`` as ``trio-shard serve`` does (bench.processes
reads the port from it). Bench-only (bench/stack_floor.py runs it).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import AsyncIterator

import purerpc
import trio

from shard.v1 import shard_pb2 as pb

SERVICE = "shard.v1.Shard"
METHOD = "Floor"


async def floor(request: pb.Generate) -> AsyncIterator[pb.SessionResponse]:
    """``request.max_tokens`` token steps, built per message as the worker builds them."""
    for i in range(request.max_tokens):
        step = pb.StepResult(step=i + 1, n_past=i + 4, tokens_processed=1, start_position=i + 3)
        step.logits.CopyFrom(pb.Logits(token_id=100 + i % 50, logprob=-0.5, piece=b"x"))
        yield pb.SessionResponse(step=step)


async def floor_paced(request: pb.Generate) -> AsyncIterator[pb.SessionResponse]:
    """The same, one message per ``PACE`` seconds: each message its own wake-up and socket
    write, as a worker's token is when the engine produces one per tick (unpaced, the writer
    task coalesces many messages into one write)."""
    async for message in floor(request):
        await trio.sleep(PACE)
        yield message


PACE = 0.001


def service() -> purerpc.Service:
    svc = purerpc.Service(SERVICE)
    for name, fn in ((METHOD, floor), (METHOD + "Paced", floor_paced)):
        svc.add_method(name, fn, purerpc.RPCSignature(
            purerpc.Cardinality.UNARY_STREAM, pb.Generate, pb.SessionResponse))
    return svc


async def serve(impl: str, host: str, port: int) -> None:
    if impl == "purerpc":
        server = purerpc.Server(port=port)
        server.add_service(service())
        print(f"serving {SERVICE} on {host}:{port}", file=sys.stderr, flush=True)
        await server.serve_async()
        return
    from shard.rpc.transport import Server

    transport = Server(host=host, port=port)
    transport.add_service(service())
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(transport.serve)
        print(f"serving {SERVICE} on {host}:{bound}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.floor_server",
                                description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=("transport", "purerpc"), default="transport")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="(purerpc needs a fixed one)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.impl == "purerpc" and not args.port:
        p.error("--impl purerpc needs --port")
    try:
        trio.run(serve, args.impl, args.host, args.port)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
