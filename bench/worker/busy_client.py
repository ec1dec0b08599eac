"""Soak: the official grpcio client at the highest token rate the batched fake engine allows.

What it checks (issue 43): a busy honest client is never cut by the worker's frame budgets.
grpc-core sends a WINDOW_UPDATE as it consumes DATA, BDP PINGs with bursts of data and
keepalive PINGs, so its control frames grow with the tokens it is sent; a fixed per-second
budget cut exactly the busiest clients. Here ``--streams`` generations on one grpcio channel
(keepalive PINGs every second, BDP probing on) run back to back for ``--seconds`` against
``python -m bench.common.fake_worker`` with zero compute (ticks cost nothing, so the rate is what the
worker's and the client's event loops allow), each granting 16 more messages every 16 tokens as
a tracker reads. Printed per worker tree: tokens and tokens/s, generations finished, the
client's errors by status, and the connections the worker cut (its log's ``closing
connection`` lines, with the reasons and counters they give).

``--worker-root DIR`` runs the same against a worker from another checkout (e.g. the commit
before a change), one after the other in the same run.

    python -m bench.worker.busy_client [--quick] [--seconds 60] [--streams 32] [--worker-root DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import re
import sys
import threading
import time
from typing import Any

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # one log line per GOAWAY otherwise (before)
import grpc  # noqa: E402 - after its log level

from bench.common import options
from bench.common.environment import environment, save_record
from bench.common.processes import FAKE_WORKER, module_in, served
from shard.rpc.versions import current_proto
from shard.v1 import shard_pb2 as pb

DEFAULT_OUT = options.RESULTS / "busy_client.json"
CREDIT = 16
TOKENS = 700  # per generation; a session's context is 1,024 positions
KEEPALIVE = [("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_timeout_ms", 10_000),
             ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
             ("grpc.http2.bdp_probe", 1)]
_CUT = re.compile(r"closing connection from \S+: (.*)")


def session_method(channel: grpc.Channel) -> Any:
    """The ``Session`` method of a grpcio channel."""
    return channel.stream_stream(
        "/shard.v1.Shard/Session", request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=pb.SessionResponse.FromString)


def generation(session: Any, name: str, version: pb.ProtocolVersion,
               tokens_wanted: int = TOKENS) -> tuple[int, str | None]:
    """One generation of ``tokens_wanted`` tokens read as a tracker reads it, granting 16 more
    messages every 16 tokens: (tokens, error status or None). Blocking (grpcio)."""
    requests: queue.Queue[pb.SessionRequest | None] = queue.Queue()
    requests.put(pb.SessionRequest(version=version, open=pb.OpenSession(
        session_id=name, initial_credit=CREDIT)))
    requests.put(pb.SessionRequest(version=version, generate=pb.Generate(
        tokens=pb.TokenIds(ids=[1, 2, 3]), max_tokens=tokens_wanted, ignore_eos=True)))

    def feed() -> Any:
        while (item := requests.get()) is not None:
            yield item

    tokens = 0
    try:
        for response in session(feed(), timeout=120):
            kind = response.WhichOneof("kind")
            if kind == "step":
                tokens += 1
                if tokens % CREDIT == 0:
                    requests.put(pb.SessionRequest(version=version, credit=pb.Credit(messages=CREDIT)))
                if tokens == tokens_wanted:
                    requests.put(pb.SessionRequest(version=version, close=pb.CloseSession()))
                    requests.put(None)
            elif kind == "error":
                return tokens, f"error {response.error.code}"
        return tokens, None
    except grpc.RpcError as exc:
        return tokens, str(exc.code())
    finally:
        requests.put(None)


def soak(target: str, streams: int, seconds: float) -> dict[str, Any]:
    """``streams`` generation loops on one channel for ``seconds``."""
    version = current_proto()
    channel = grpc.insecure_channel(target, options=KEEPALIVE)
    session = session_method(channel)
    grpc.channel_ready_future(channel).result(timeout=30)
    lock = threading.Lock()
    tokens, finished, errors = [0], [0], collections.Counter[str]()
    end = time.monotonic() + seconds

    def loop(i: int) -> None:
        n = 0
        while time.monotonic() < end:
            got, error = generation(session, f"soak-{i}-{n}", version)
            n += 1
            with lock:
                tokens[0] += got
                if error is None:
                    finished[0] += 1
                else:
                    errors[error] += 1

    start = time.monotonic()
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - start
    channel.close()
    return {"seconds": round(elapsed, 1), "tokens": tokens[0],
            "tokens_per_second": round(tokens[0] / elapsed), "generations_finished": finished[0],
            "client_errors": dict(errors)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    roots = options.checkouts(args, "this_checkout", "worker_root")
    results: dict[str, Any] = {}
    for label, root in roots.items():
        log = args.logs / f"busy_client_{label}.log"
        cmd = [sys.executable, "-m", module_in(root, *FAKE_WORKER), "--tick-ms", "0", "--row-ms", "0",
               "--max-sessions", str(args.streams), "--ctx", str(args.streams * 1024)]
        with served(cmd, log=log, root=root, fake=True) as server:
            out = soak(server.target, args.streams, args.seconds)
        cuts = [m.group(1) for m in _CUT.finditer(log.read_text(errors="replace"))]
        out.update(connections_cut=len(cuts), cut_reasons=cuts[:3])
        results[label] = out
        print(label, json.dumps(out), file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_quick(p, "5 s and 8 streams: checks the harness")
    options.add_seconds(p, 60.0, "how long the soak lasts (default: 60)")
    p.add_argument("--streams", type=int, default=32, help="generations on the channel (default: 32)")
    options.add_worker_root(p, "also soak a worker from this checkout")
    options.add_out(p, DEFAULT_OUT)
    options.add_logs(p)
    args = p.parse_args(argv)
    if args.streams < 1 or not args.seconds > 0:
        p.error("--streams must be >= 1 and --seconds > 0")
    if args.quick:
        args.seconds, args.streams = min(args.seconds, 5.0), min(args.streams, 8)
    args.logs.mkdir(parents=True, exist_ok=True)
    results = run(args)
    record = {
        "environment": environment(None, 0),
        "streams": args.streams, "seconds": args.seconds, "tokens_per_generation": TOKENS,
        "worker_root": str(args.worker_root) if args.worker_root else None,
        "results": results,
    }
    save_record(args.out, record)


if __name__ == "__main__":
    main()
