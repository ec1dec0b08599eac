"""``trio-shard metrics``: a worker's GetMetrics counters and gauges."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from shard.cli.common import ask_worker
from shard.cli.env import Options
from shard.cli.options import add_target, non_negative_float

if TYPE_CHECKING:
    from shard.client import ShardClient

NAME = "metrics"


def add_parser(sub: Any) -> Options:
    """The ``metrics`` command's options."""
    parser = sub.add_parser(
        "metrics", help="show a worker's counters and gauges (GetMetrics)",
        description="Print a worker's GetMetrics counters and gauges, the same values its "
        "Prometheus /metrics page shows.",
    )
    opts = Options(parser)
    add_target(opts)
    opts.add("--timeout", type=non_negative_float, default=10.0,
             help="deadline in seconds (default: 10)")
    opts.add("--json", action="store_true", help="print JSON")
    return opts


def run(args: argparse.Namespace) -> int:
    """Print the worker's counters and gauges (``--json``: by section)."""
    from shard.rpc.metrics import snapshot_values

    async def ask(client: ShardClient) -> dict[str, int]:
        return snapshot_values(await client.metrics())

    values = ask_worker(args, ask)
    if args.json:
        nested: dict[str, dict[str, int]] = {"engine": {}, "worker": {}}
        for key, value in values.items():
            section, _, name = key.partition(".")
            nested[section][name] = value
        print(json.dumps(nested, indent=2, sort_keys=True))
    else:
        width = max(map(len, values), default=0)
        for key, value in values.items():
            print(f"{key:<{width}}  {value}")
    return 0
