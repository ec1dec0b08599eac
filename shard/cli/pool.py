"""``trio-shard pool``: what each worker of a pool serves and which models the pool can serve
(exit status 0 only when every model it reports can be)."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from shard.cli.common import client_setup, workers_source
from shard.cli.env import Options
from shard.cli.options import WORKERS_HELP, add_client_credentials, positive_float

NAME = "pool"


def add_parser(sub: Any) -> Options:
    """The ``pool`` command's options."""
    parser = sub.add_parser(
        "pool", help="show a pool of workers: what each serves and which models it can serve",
        description="Ask every worker of a pool (--workers) what it serves and whether it "
        "serves now, and print one line per worker (model, layers, state, and why a worker "
        "takes part in no route) and one per model (its complete routes, or why it has none). "
        "Exit status 0 when every model the workers report can be served, 1 otherwise (a gap, "
        "ranges that overlap without tiling, two models under one name, a worker down or "
        "refusing the credentials).",
    )
    opts = Options(parser)
    opts.add("--workers", metavar="SPEC", required=True, help=WORKERS_HELP)
    add_client_credentials(opts)
    opts.add("--timeout", type=positive_float, default=10.0,
             help="seconds to wait for every worker to answer (default: 10)")
    opts.add("--json", action="store_true", help="print JSON")
    return opts


def run(args: argparse.Namespace) -> int:
    """The pool's table; 0 only when every model it reports can be served."""
    import trio

    from shard.pool import Pool

    options = client_setup(args)
    source = workers_source(args.workers)
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("shard.pool").setLevel(logging.ERROR)  # the table says it all

    async def look() -> tuple[list[dict[str, str]], dict[str, Any], list[str]]:
        async with Pool.open(source, connect_timeout=args.timeout, **options) as pool:  # type: ignore[arg-type]
            await pool.settle(args.timeout)
            models = {name: {"routes": r.routes if name in pool.servable() else 0,
                             "shapes": [" -> ".join(f"{h.range_text}x{len(h.targets)}" for h in s.hops)
                                        for s in r.shapes],
                             "problem": r.problem}
                      for name, r in pool.table.models.items()}
            return pool.rows(), models, pool.not_serving()

    rows, models, failing = trio.run(look)
    if args.json:
        print(json.dumps({"workers": rows, "models": models, "problems": failing}, indent=2))
    else:
        widths = {k: max([len(k)] + [len(r[k]) for r in rows]) for k in ("worker", "model", "layers", "state")}
        print("  ".join(k.upper().ljust(w) for k, w in widths.items()) + "  WHY")
        for r in rows:
            print(("  ".join(r[k].ljust(w) for k, w in widths.items()) + f"  {r['why']}").rstrip())
        print()
        for name, m in sorted(models.items()):
            if m["routes"]:
                print(f"model {name}: {m['routes']} complete route(s): {'; '.join(m['shapes'])}")
        for why in failing:
            print(why)
    return 1 if failing else 0
