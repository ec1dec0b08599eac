"""Command-line options the worker benches share (bench/hot_path.py, bench/colocated.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_common(p: argparse.ArgumentParser, default_out: Path, *, quick: str) -> None:
    """``--model``, ``--worker-root``, ``--quick`` (described by ``quick``), ``--out``, ``--logs``."""
    p.add_argument("--model", type=Path, help="GGUF file (default: the bench preset, written if missing)")
    p.add_argument("--worker-root", type=Path, help="also run the workers from this checkout, alternating")
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--out", type=Path, default=default_out)
    p.add_argument("--logs", type=Path, default=default_out.parent / "logs",
                   help="the workers' log files (default: bench/results/logs)")


def resolve(args: argparse.Namespace) -> None:
    """The model (tiny with ``--quick``, else the bench preset, written if missing) and the
    output directory."""
    if args.model is None:
        from shard.models import ensure_model

        args.model = ensure_model("tiny" if args.quick else "bench", progress=sys.stderr.isatty())
    args.out.parent.mkdir(parents=True, exist_ok=True)
