"""``trio-shard health``: probe a worker, exit status 0 only when it is SERVING (a liveness or
readiness probe); ``--watch`` prints every change."""

from __future__ import annotations

import argparse
import json
from typing import Any

from shard.cli.common import client_setup
from shard.cli.env import Options
from shard.cli.options import add_target, non_negative_float

NAME = "health"


def add_parser(sub: Any) -> Options:
    """The ``health`` command's options."""
    parser = sub.add_parser(
        "health", help="probe a worker: exit 0 only when it is SERVING",
        description="Ask a worker for its health (Shard Health RPC). Exit status 0 when it is "
        "SERVING, 1 when it is not (NOT_READY, DRAINING, FAILED) or cannot be reached: usable "
        "as a liveness/readiness probe.",
    )
    opts = Options(parser)
    add_target(opts)
    opts.add("--timeout", type=non_negative_float, default=5.0,
             help="deadline in seconds per check (default: 5)")
    opts.add("--json", action="store_true", help="print JSON")
    opts.add("--watch", action="store_true",
             help="keep checking and print every change until interrupted")
    opts.add("--interval", type=non_negative_float, default=2.0,
             help="seconds between checks with --watch (default: 2)")
    return opts


def run(args: argparse.Namespace) -> int:
    """Probe once (or with ``--watch`` until interrupted); 0 only when SERVING."""
    import trio

    options = client_setup(args)

    from shard.client import ShardClient, ShardError
    from shard.v1 import shard_pb2 as pb

    async def check() -> dict[str, object]:
        try:
            async with ShardClient.connect(args.target, timeout=args.timeout, **options) as client:  # type: ignore[arg-type]
                h = await client.health()
        except ShardError as exc:
            return {"status": "UNREACHABLE" if exc.reason == "CONNECT_FAILED" else "ERROR",
                    "detail": str(exc)}
        return {
            "status": pb.HealthResponse.Status.Name(h.status).removeprefix("STATUS_"),
            "detail": h.detail,
            "sessions_active": h.sessions_active,
            "sessions_retained": h.sessions_retained,
            "max_sessions": h.max_sessions,
        }

    def show(report: dict[str, object]) -> None:
        if args.json:
            print(json.dumps(report), flush=True)
            return
        line = str(report["status"])
        if "sessions_active" in report:
            line += (f"  sessions: {report['sessions_active']} active, "
                     f"{report['sessions_retained']} retained, max {report['max_sessions']}")
        if report["detail"]:
            line += f"  ({report['detail']})"
        print(line, flush=True)

    async def watch() -> int:
        last: dict[str, object] | None = None
        while True:
            report = await check()
            if last is None or report["status"] != last["status"] or not args.watch:
                show(report)
            last = report
            if not args.watch:
                return 0 if report["status"] == "SERVING" else 1
            await trio.sleep(args.interval)

    return trio.run(watch)
