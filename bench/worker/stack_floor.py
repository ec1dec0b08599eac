"""The stack's floor beside the worker: CPU per streamed message, server and client, one run.

The worker's Python CPU per token (bench/worker/hot_path.py) is not all the worker's own: before
calling it a ceiling, measure what the required stack itself costs. ``bench/common/floor_server.py``
streams one small ``SessionResponse`` per message from a plain handler, with nothing of the
worker around it, on the worker's hardened transport (``transport``) and on stock purerpc
(``purerpc``). Each is read by the official grpcio client and by the project's own client
transport (``shard``: the ``ClientConnection`` under ``ShardClient``, reading the stream message
by message as ``ShardClient`` does). In the same run, alternating pass by pass, a real
``trio-shard serve`` on the tiny model streams ``Generate`` tokens read by ``ShardClient`` and
by grpcio (``bench.worker.hot_path.one_pass``), so the worker's event loop is judged against the floor
on one machine at one moment.

Per message (microseconds of CPU, medians over ``--rounds``):

  server_main_us   the serving process's main thread (its event loop): the floor's, and for the
                   worker its event loop per token (``main_cpu_us`` of bench/worker/hot_path.py)
  client_cpu_us    the reading process (this one: grpcio's C threads included)

and ``worker_over_floor``: the worker's event loop per ``Generate`` token over the floor's per
message, for each reader. The hardened transport's floor is also measured *paced*
(``FloorPaced``: one message per the worker's own time per token in that round, read by
``ShardClient``, so each is its own wake-up and socket write, as a worker's token is at one
session; unpaced, the writer coalesces many messages per write). ``bench/worker/hot_path.py --floor``
does the same on the bench model, and for ``Decode`` too.

    python -m bench.worker.stack_floor [--quick] [--messages 4000] [--rounds 5] [--model PATH] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from contextlib import ExitStack
from typing import Any

import trio

from bench.common import options
from bench.common.environment import environment
from bench.common.processes import V10, free_port, served, shard_server, wait_serving
from bench.worker import grpcio_stream
from bench.worker.floor_reads import floor_pass
from bench.worker.hot_path import one_pass
from shard.client import ShardClient

DEFAULT_OUT = options.RESULTS / "stack_floor.json"
IMPLS = ("transport", "purerpc")
READERS = ("grpcio", "shard")


def _median(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0]} if rows else {}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    passes: dict[str, list[dict[str, float]]] = {}
    with ExitStack() as stack:
        floors = {}
        for impl in IMPLS:
            port = free_port() if impl == "purerpc" else 0
            floors[impl] = stack.enter_context(served(
                [sys.executable, "-m", "bench.common.floor_server", "--impl", impl, "--port", str(port)],
                log=args.logs / f"stack_floor_{impl}.log", fake=True))
        worker = stack.enter_context(shard_server(
            args.model, threads=1, ctx=2 * (args.messages + 128), max_sessions=2,
            log=args.logs / "stack_floor_worker.log"))
        await wait_serving(worker.target, version=V10)
        for round_no in range(args.rounds + 1):  # round 0 warms up and is dropped
            n = 64 if round_no == 0 else args.messages
            pace = 1000  # microseconds: the worker's own time per token, from its first pass below
            channel = grpcio_stream.connect(worker.target)
            try:
                async with ShardClient.connect(worker.target, timeout=600, version=V10) as client:
                    for reader, mode in (("shard", "generate"), ("grpcio", "generate_grpcio")):
                        row = await one_pass(client, worker.proc.pid, mode, n, channel=channel)
                        if reader == "shard":
                            pace = int(row["wall_us"])
                        if round_no:
                            passes.setdefault(f"worker_generate_{reader}", []).append({
                                "messages": n, "wall_us": row["wall_us"],
                                "server_main_us": row["main_cpu_us"],
                                "client_cpu_us": row["client_cpu_us"]})
            finally:
                channel.close()
            for impl, srv in floors.items():
                channel = grpcio_stream.connect(srv.target)
                try:
                    async with ShardClient.connect(srv.target, timeout=600) as client:
                        for reader in READERS:
                            row = await floor_pass(srv.proc.pid, "Floor", n, reader=reader,
                                                   client=client, channel=channel)
                            if round_no:
                                passes.setdefault(f"floor_{impl}_{reader}", []).append(row)
                        if impl == "transport":  # at the worker's pace: a write each
                            for reader in READERS:
                                row = await floor_pass(srv.proc.pid, "FloorPaced", n, pace_us=pace,
                                                       reader=reader, client=client, channel=channel)
                                if round_no:
                                    passes.setdefault(f"paced_{impl}_{reader}", []).append(row)
                finally:
                    channel.close()
            if round_no:
                print(f"round {round_no}: " + ", ".join(
                    f"{name} {rows[-1]['server_main_us']:.0f}/{rows[-1]['client_cpu_us']:.0f}"
                    for name, rows in passes.items()), file=sys.stderr, flush=True)
    medians = {name: _median(rows) for name, rows in passes.items()}
    over = {f"{floor}_{reader}": round(
        medians[f"worker_generate_{reader}"]["server_main_us"]
        / max(medians[f"{floor}_transport_{reader}"]["server_main_us"], 1e-9), 2)
        for floor in ("floor", "paced") for reader in READERS}
    return {"passes": passes, "medians": medians, "worker_over_floor": over}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.worker.stack_floor", description=__doc__.split("\n")[0])
    p.add_argument("--messages", type=int, default=4000, help="messages (tokens) per pass")
    options.add_rounds(p, 5)
    options.add_model(p, "the worker's GGUF (default: the tiny preset)")
    options.add_quick(p, "500 messages, 1 round: checks the harness")
    options.add_out(p, DEFAULT_OUT)
    options.add_logs(p, help=None)
    args = p.parse_args(argv)
    if args.messages < 64 or args.rounds < 1:
        p.error("--messages must be >= 64 and --rounds >= 1")
    if args.quick:
        args.messages, args.rounds = 500, 1
    if args.model is None:
        args.model = options.default_model(False, preset="tiny")
    args.logs.mkdir(parents=True, exist_ok=True)
    result = trio.run(measure, args)
    record = {"environment": environment(args.model, 1), "messages": args.messages,
              "rounds": args.rounds, **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({"medians": result["medians"], "worker_over_floor": result["worker_over_floor"]},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
