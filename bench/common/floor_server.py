"""The stack's floor: a minimal server-streaming RPC on Trio, nothing of the worker around it.

``python -m bench.common.floor_server --impl transport|purerpc`` serves three methods:

- ``/shard.v1.Shard/Floor``: a ``Generate`` request asks for ``max_tokens`` messages, and the
  handler yields that many ``SessionResponse`` steps as fast as the reader takes them;
- ``FloorPaced``: the same, one message per pace (``sampling.seed`` microseconds, default one
  millisecond), so each is its own wake-up and socket write, as a worker's token is;
- ``FloorEcho`` (a bidirectional stream): one step message per request, sent a pace after the
  request came in: a client-driven ``Decode`` with nothing of the worker around it.

Each message is built field by field the way the worker builds a token's step (``StepResult``
with ``Logits``: step, position, token id, log-prob, a one-byte piece). No engine, no session, no credit: what is
left is what the required stack (Trio, h2, purerpc's codec, protobuf's C implementation) costs
to frame and send one small message. ``transport`` runs it on the worker's hardened transport
(``shard.rpc.transport.Server``: bounds, deadlines, budgets), ``purerpc`` on stock purerpc 0.8's
own server, to see what the hardening costs.

It logs ``serving shard.v1.Shard on HOST:PORT`` as ``trio-shard serve`` does (bench.common.processes
reads the port from it). Bench-only (bench/worker/stack_floor.py runs it).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator

import purerpc
import trio

from shard.engine.native_thread import GIL_SWITCH_INTERVAL, NativeThread
from shard.v1 import shard_pb2 as pb

SERVICE = "shard.v1.Shard"
METHOD = "Floor"


def step_message(i: int) -> pb.SessionResponse:
    """Token step ``i``, built field by field as the worker builds one."""
    step = pb.StepResult(step=i + 1, n_past=i + 4, tokens_processed=1, start_position=i + 3)
    step.logits.CopyFrom(pb.Logits(token_id=100 + i % 50, logprob=-0.5, piece=b"x"))
    return pb.SessionResponse(step=step)


def pace_of(request: pb.Generate) -> float:
    """Seconds between messages a request asks for: ``sampling.seed`` microseconds (bench-only
    use of the field), or ``PACE``."""
    return request.sampling.seed / 1e6 or PACE


async def floor(request: pb.Generate) -> AsyncIterator[pb.SessionResponse]:
    """``request.max_tokens`` token steps, as fast as the reader takes them."""
    for i in range(request.max_tokens):
        yield step_message(i)


class Ticker:
    """A thread that wakes the event loop once per pace the way the worker's native thread
    hands over a step it computed (``TrioToken.run_sync_soon``), so a paced message costs the
    wake-up a token costs, not a Trio timer's (a ``trio.sleep`` raises and catches a
    ``Cancelled`` per wake-up: dearer, bench/worker/wakeups.py). Ticks are due at fixed times (the
    hand-off does not stretch the pace), and a tick not yet taken absorbs the next one, as a
    native thread computes at most one step ahead."""

    def __init__(self, pace: float) -> None:
        self._pace = pace
        self._ready = False
        self._started = False
        self._lot = trio.lowlevel.ParkingLot()
        self._stop = threading.Event()
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._run, name="floor-ticker", daemon=True)

    def _arrived(self) -> None:
        self._ready = True
        self._lot.unpark()

    def _run(self) -> None:
        due = time.monotonic()
        while True:
            due += self._pace
            if self._stop.wait(max(0.0, due - time.monotonic())):
                return
            try:
                self._token.run_sync_soon(self._arrived)
            except trio.RunFinishedError:
                return

    async def tick(self) -> None:
        """Wait for the next tick (the thread starts at the first call)."""
        if not self._started:
            self._started = True
            self._thread.start()
        while not self._ready:
            await self._lot.park()
        self._ready = False

    def close(self) -> None:
        self._stop.set()


async def floor_paced(request: pb.Generate) -> AsyncIterator[pb.SessionResponse]:
    """The same, one message per pace: each message its own wake-up and socket write, as a
    worker's token is when the engine produces one per tick (unpaced, the writer task
    coalesces many messages into one write)."""
    ticker = Ticker(pace_of(request))
    try:
        async for message in floor(request):
            await ticker.tick()
            yield message
    finally:
        ticker.close()


async def floor_echo(requests: AsyncIterator[pb.Generate]) -> AsyncIterator[pb.SessionResponse]:
    """One step message per request, a pace after it came in, computed by a long-lived
    thread as the worker's native steps are (``shard.engine.native_thread``: a condition
    variable there, the result back by ``run_sync_soon``): each request a read, a hand-off
    and an answer's write, as a client-driven ``Decode`` is."""
    thread = NativeThread("floor-step")
    thread.start()
    try:
        i = 0
        async for request in requests:
            await thread.run(time.sleep, pace_of(request))
            yield step_message(i)
            i += 1
    finally:
        await thread.aclose()


PACE = 0.001


def service() -> purerpc.Service:
    svc = purerpc.Service(SERVICE)
    for name, fn, kind in ((METHOD, floor, purerpc.Cardinality.UNARY_STREAM),
                           (METHOD + "Paced", floor_paced, purerpc.Cardinality.UNARY_STREAM),
                           (METHOD + "Echo", floor_echo, purerpc.Cardinality.STREAM_STREAM)):
        svc.add_method(name, fn, purerpc.RPCSignature(kind, pb.Generate, pb.SessionResponse))
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
    p = argparse.ArgumentParser(prog="python -m bench.common.floor_server",
                                description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=("transport", "purerpc"), default="transport")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="(purerpc needs a fixed one)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.impl == "purerpc" and not args.port:
        p.error("--impl purerpc needs --port")
    # The worker's native thread lowers the GIL switch interval for the whole process
    # (shard.engine.native_thread): the floor's pacing threads run under the same setting.
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL))
    try:
        trio.run(serve, args.impl, args.host, args.port)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
