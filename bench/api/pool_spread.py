"""A pool's load spread: concurrent generations over two complete routes of the bench model,
against the same generations on one route, in one run.

Two whole-model workers of the bench model (llama.cpp, ``--threads 1`` each, pinned to cores 0
and 1 with ``taskset`` when it exists) make a pool of two complete routes (``shard.pool``). Each
round runs N concurrent greedy generations (default 16) through a pool of both workers, then
through a pool of the first worker alone (one route), in alternating order; reported per
configuration: the aggregate tokens/s (every token over the round's wall time, median over
rounds) and, for the two-route pool, how many generations each worker took (the pool's
least-loaded choice should put N/2 on each).

Ratios are from one run on one machine (the environment is recorded); never compare absolute
numbers across machines. Writes ``pool_spread.json`` to ``--out-dir``.

    python -m bench.api.pool_spread [--sessions 16] [--tokens 48] [--rounds 3] [--model bench]
        [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import trio

from bench.common import options
from bench.common.environment import environment, save_record
from bench.common.processes import shard_server, wait_serving
from shard.models import ensure_model
from shard.pool import Pool, parse_workers

PROMPT = "The history of the city begins"


async def _round(targets: list[str], sessions: int, tokens: int) -> tuple[float, Counter[str]]:
    """N concurrent generations through a pool of ``targets``: (tokens/s, generations per
    worker)."""
    taken: Counter[str] = Counter()
    produced = [0]
    async with Pool.open(parse_workers(",".join(targets)), probe_interval=1.0,
                         connect_timeout=30.0) as pool:
        await pool.settle(60)
        await pool.wait_for()
        (model,) = pool.servable()

        async def one() -> None:
            async with pool.lease(model) as lease:
                taken[lease.route[0]] += 1
                result = await lease.pipeline.generate(
                    PROMPT, max_tokens=tokens, ignore_eos=True, route=lease.route, timeout=600)
            produced[0] += len(result.tokens)

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(sessions):
                nursery.start_soon(one)
        elapsed = time.perf_counter() - started
    return produced[0] / elapsed, taken


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=16, help="concurrent generations (default 16)")
    options.add_tokens(p, 48, "tokens per generation (default 48)")
    options.add_rounds(p, 3, "alternating rounds (default 3)")
    options.add_model(p, "a generated model preset (default bench) or a GGUF file", type=str, default="bench")
    options.add_out_dir(p)
    args = p.parse_args(argv)
    if args.sessions < 1 or args.tokens < 1 or args.rounds < 1:
        p.error("--sessions, --tokens and --rounds must be at least 1")
    model = Path(args.model) if Path(args.model).is_file() else ensure_model(args.model)
    pin = shutil.which("taskset") is not None
    logs = args.out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"two_routes": [], "one_route": [], "spread": []}
    with ExitStack() as stack:
        servers = [stack.enter_context(shard_server(
            model, threads=1, ctx=args.sessions * 256, max_sessions=args.sessions,
            log=logs / f"pool_spread_worker{i}.log",
            wrap=["taskset", "-c", str(i)] if pin else ())) for i in range(2)]
        for s in servers:
            trio.run(wait_serving, s.target)
        targets = [s.target for s in servers]
        for r in range(args.rounds):
            order = ["two_routes", "one_route"] if r % 2 == 0 else ["one_route", "two_routes"]
            for which in order:
                rate, taken = trio.run(_round, targets if which == "two_routes" else targets[:1],
                                       args.sessions, args.tokens)
                results[which].append(round(rate, 1))
                if which == "two_routes":
                    results["spread"].append([taken[t] for t in targets])
                print(f"round {r} {which}: {rate:.1f} tokens/s, generations per worker "
                      f"{[taken[t] for t in targets]}", flush=True)
    summary = {
        "two_routes_tokens_per_s": statistics.median(results["two_routes"]),
        "one_route_tokens_per_s": statistics.median(results["one_route"]),
    }
    summary["ratio"] = round(summary["two_routes_tokens_per_s"] / summary["one_route_tokens_per_s"], 2)
    record = {
        "bench": "pool_spread",
        "environment": environment(model, 1, argv=argv),
        "config": {**vars(args), "out_dir": str(args.out_dir), "pinned": pin},
        "rounds": results,
        "results": summary,
    }
    save_record(args.out_dir / "pool_spread.json", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
