"""``trio-shard plan``: N balanced layer ranges of a model (``shard.models.plan``), the parts
``serve --part I/N`` serves."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from shard.cli.common import fail
from shard.cli.env import Options
from shard.cli.options import memory, positive_int

NAME = "plan"


def add_parser(sub: Any) -> Options:
    """The ``plan`` command's options."""
    parser = sub.add_parser(
        "plan", help="split a model into N balanced layer ranges (for serve --part)",
        description="Print N contiguous layer ranges of a GGUF model balanced by the bytes each "
        "part holds (its blocks, plus the token embeddings on the first part and the output head "
        "on the last, as `trio-shard slice` writes them), and those bytes. `serve --part I/N` "
        "serves the I-th of the same parts. Only ranges the architecture table allows are "
        "proposed.",
    )
    opts = Options(parser)
    opts.add("--model", type=Path, required=True,
             help="whole GGUF model (a file, or a packaged model's name)")
    opts.add("--parts", type=positive_int, required=True, metavar="N", help="number of parts")
    opts.add("--memory", type=memory, metavar="SIZE,...",
             help="memory of each worker, one per part (e.g. 8G,4G,4G): parts are sized "
             "in proportion (default: all equal)")
    opts.add("--json", action="store_true", help="print JSON")
    return opts


def run(args: argparse.Namespace) -> int:
    """Print the parts (``--json``: as objects); 2 when no such split exists."""
    from shard.models.plan import PlanError, plan_parts
    from shard.models.real import RealModelError, resolve_model

    try:
        model = resolve_model(args.model)
        parts = plan_parts(model, args.parts, args.memory)
    except RealModelError as exc:
        return fail(str(exc))
    except PlanError as exc:
        return fail(str(exc), 2)
    if args.json:
        print(json.dumps({"model": str(model), "parts": [p.as_dict() for p in parts]}, indent=2))
        return 0
    biggest = max(p.nbytes for p in parts)
    print(f"{'part':>6}  {'layers':>9}  {'blocks':>6}  {'bytes':>13}  {'MiB':>9}  of largest")
    for p in parts:
        print(f"{p.index:>4}/{p.count}  {p.layers.start:>4}:{p.layers.end:<4}  {p.layers.count:>6}  "
              f"{p.nbytes:>13,}  {p.nbytes / 2**20:>9.1f}  {p.nbytes / biggest:>9.2f}")
    return 0
