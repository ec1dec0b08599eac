"""``trio-shard slice``: cut a GGUF model into a layer-range shard file (``shard.models.slice``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from shard.cli.common import fail, quiet_gguf
from shard.cli.env import Options
from shard.cli.options import layer_range

NAME = "slice"


def add_parser(sub: Any) -> Options:
    """The ``slice`` command's options."""
    parser = sub.add_parser(
        "slice", help="cut a GGUF model into a layer-range shard file",
        description="Write blocks A..B-1 of a GGUF model to a GGUF that llama.cpp loads as a "
        "shard: blocks renumbered from 0, per-layer metadata and sliding-window patterns cut to "
        "the range, only the other tensors that part needs (the first part keeps the token "
        "embeddings, the last the output norm and LM head, middle parts get tiny stand-ins), the "
        "source fingerprint and range recorded in its metadata. Which architectures and "
        "boundaries are served is the architecture table's (docs/engine.md, \"Layer ranges on "
        "llama.cpp\"); a refused one is an error naming the reason and the allowed boundaries.",
    )
    opts = Options(parser)
    opts.add("--model", type=Path, required=True,
             help="whole GGUF model to slice (a file, or a packaged model's name)")
    opts.add("--layers", type=layer_range, required=True, metavar="A:B",
             help="blocks A..B-1 (0-based, half-open)")
    opts.add("--out", type=Path, required=True, help="output file (written atomically)")
    return opts


def run(args: argparse.Namespace) -> int:
    """Write the slice and print its path; 2 for a range the architecture table refuses."""
    from shard.layers import LayerRange
    from shard.models import SliceError, slice_model
    from shard.models.real import RealModelError, resolve_model

    quiet_gguf()
    try:
        model = resolve_model(args.model)
    except RealModelError as exc:
        return fail(str(exc))
    try:
        path = slice_model(model, LayerRange(*args.layers), args.out, progress=sys.stderr.isatty())
    except SliceError as exc:
        return fail(str(exc), 2)
    print(path)
    return 0
