"""Command-line options the benches share, each defined once, and where their results go.

A bench builds its parser from these (``add_model(p)``, ``add_threads(p, 1)``, ...), so an
option is spelt, typed and parsed the same way in every bench that takes it; what differs from
bench to bench (a default, the help line that says what the option means there) is passed in.
``add_common`` is the set the worker benches that compare two checkouts take together.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

#: The bench package, the checkout it belongs to, and where results and workers' logs go by
#: default (bench/results is not kept in git; docs/benchmarks holds the results that are).
BENCH = Path(__file__).resolve().parents[1]
CHECKOUT = BENCH.parent
RESULTS = BENCH / "results"
LOGS = RESULTS / "logs"

MODEL_HELP = "GGUF file (default: the bench preset, written if missing)"


def add_model(p: argparse.ArgumentParser, help: str = MODEL_HELP, **kwargs: Any) -> None:
    """``--model``: a GGUF file (a ``Path``; ``type=str`` and a default for benches that also
    take a preset's or a packaged model's name)."""
    kwargs.setdefault("type", Path)
    p.add_argument("--model", help=help, **kwargs)


def add_preset(p: argparse.ArgumentParser, default: str | None = "bench", help: str | None = None,
               *aliases: str) -> None:
    """``--preset``: which generated model (``shard.models``) the bench writes and runs
    (``aliases``: more spellings, e.g. ``--model`` where a packaged model's name is taken too)."""
    p.add_argument("--preset", *aliases, dest="preset", default=default, help=help)


def add_worker_root(p: argparse.ArgumentParser,
                    help: str = "also run the workers from this checkout, alternating") -> None:
    """``--worker-root DIR``: workers (also) started from another checkout, e.g. the commit
    before a change (``bench.common.processes.served(root=...)``; a bench helper that runs
    there is found by ``processes.module_in``)."""
    p.add_argument("--worker-root", type=Path, help=help)


def add_quick(p: argparse.ArgumentParser, help: str) -> None:
    """``--quick``: a short run that checks the harness (``help`` says what it shrinks)."""
    p.add_argument("--quick", action="store_true", help=help)


def add_out(p: argparse.ArgumentParser, default: Path, help: str | None = None) -> None:
    """``--out FILE``: the result file."""
    p.add_argument("--out", type=Path, default=default, help=help)


def add_out_dir(p: argparse.ArgumentParser, default: Path = RESULTS, help: str | None = None) -> None:
    """``--out-dir DIR``: where the result files (and, for some benches, the logs) go."""
    p.add_argument("--out-dir", type=Path, default=default, help=help)


def add_logs(p: argparse.ArgumentParser, default: Path = LOGS,
             help: str | None = "where the workers' logs go") -> None:
    """``--logs DIR``: the log files of the processes a bench starts."""
    p.add_argument("--logs", type=Path, default=default, help=help)


def add_threads(p: argparse.ArgumentParser, default: Any, help: str | None = None, **kwargs: Any) -> None:
    """``--threads``: llama.cpp threads per worker (``type=str`` for a comma-separated list)."""
    kwargs.setdefault("type", int)
    p.add_argument("--threads", default=default, help=help, **kwargs)


def add_tokens(p: argparse.ArgumentParser, default: int | None, help: str | None = None) -> None:
    """``--tokens``: tokens generated (or timed) per stream, pass or generation."""
    p.add_argument("--tokens", type=int, default=default, help=help)


def add_rounds(p: argparse.ArgumentParser, default: int | None, help: str | None = None) -> None:
    """``--rounds``: timed rounds (the configurations alternate within each)."""
    p.add_argument("--rounds", type=int, default=default, help=help)


def add_seconds(p: argparse.ArgumentParser, default: float, help: str | None = None) -> None:
    """``--seconds``: how long each timed phase lasts."""
    p.add_argument("--seconds", type=float, default=default, help=help)


def add_seed(p: argparse.ArgumentParser) -> None:
    """``--seed``: the bench's random choices (prompts, cancel points)."""
    p.add_argument("--seed", type=int, default=0)


def add_common(p: argparse.ArgumentParser, default_out: Path, *, quick: str) -> None:
    """``--model``, ``--worker-root``, ``--quick`` (described by ``quick``), ``--out``, ``--logs``."""
    add_model(p)
    add_worker_root(p)
    add_quick(p, quick)
    add_out(p, default_out)
    add_logs(p, default_out.parent / "logs", help="the workers' log files (default: bench/results/logs)")


def checkouts(args: argparse.Namespace, this: str = "this", other: str = "other") -> dict[str, Path | None]:
    """The checkouts whose workers a bench runs, by the label its results use: this one
    (``None``: no ``PYTHONPATH`` change), then ``--worker-root``'s when given."""
    roots: dict[str, Path | None] = {this: None}
    if args.worker_root is not None:
        roots[other] = args.worker_root
    return roots


def default_model(quick: bool, *, preset: str = "bench", progress: bool | None = None) -> Path:
    """The model a bench runs without ``--model``: the tiny preset with ``--quick``, else
    ``preset``; written if missing."""
    from shard.models import ensure_model

    return ensure_model("tiny" if quick else preset,
                        progress=sys.stderr.isatty() if progress is None else progress)


def resolve(args: argparse.Namespace) -> None:
    """The model (tiny with ``--quick``, else the bench preset, written if missing) and the
    output directory."""
    if args.model is None:
        args.model = default_model(args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
