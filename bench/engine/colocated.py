"""Workers sharing one machine: a whole-model worker and a two-worker pipeline, side by side,
optionally next to busy processes, and optionally against another checkout.

What a worker's idle threads cost its neighbours shows only when several processes share the
cores: a one-box pipeline (one worker computes while the other waits for its hidden states), a
router or a second worker on the box. Per round, for each checkout, this measures, in ms per
generated token:

  generate    one server-driven ``Generate`` on the whole-model worker
  decode      one client-driven ``Decode`` per token on it
  sessions4   four concurrent ``Generate`` streams on it (aggregate over the streams)
  pipeline    one token stream through two ``--layers`` workers (``shard.pipeline``, client relay)

Each stream's first ``WARM`` tokens are not timed; the clock runs while every stream of a mode
decodes (from the last stream's ``WARM``-th token to the first stream's last) and counts every
token that arrives meanwhile (``tokens_timed``). ``tokens_agree`` says whether ``Generate``,
``Decode`` and the pipeline chose the same greedy tokens in every round. ``native_ms_per_step``
is the time inside ``llama_decode`` per tick (the workers' ``native_step_us_total``), over the
same steady stretch as the ms per token (from the stream's ``WARM``-th token on): the whole
worker's during ``generate`` and each hop's during ``pipeline`` (one tick per token there), so
the pipeline's cost beyond its two halves' compute shows (``null`` for a worker that does not
report it).

All of a checkout's workers are started once and stay up; checkouts alternate round by round
(A, B, B, A, ...) so drift hits both alike, and the first round warms up and is dropped.
``--busy N`` keeps N busy-looping processes running during the timed rounds (the neighbour).
``--worker-root DIR`` runs the second set of workers from another checkout; a checkout whose
directory holds its own ``llama_cpp`` package (a copy of the installed one, with its own
``lib/``) runs on those native libraries, e.g. another llama.cpp build. ``ratios`` divides the
other checkout's median by this one's (above 1: this checkout is faster).

    python -m bench.engine.colocated [--quick] [--model PATH] [--threads 2] [--tokens 64] [--rounds 6]
                              [--busy N] [--worker-root OTHER_CHECKOUT] [--out FILE] [--logs DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import trio

from bench.common import options
from bench.common.environment import environment, load_average
from bench.common.processes import shard_server, wait_serving
from shard.client import ShardClient
from shard.pipeline import Pipeline

PROMPT = [1, *range(300, 319)]
MODES = ("generate", "decode", "sessions4", "pipeline")
WARM = 4  # tokens of each stream not timed (the prompt's and the first steps')
DEFAULT_OUT = options.RESULTS / "colocated.json"
T = TypeVar("T")


def _window(streams: list[list[float]]) -> tuple[float, int]:
    """ms per token while every stream decodes: from the last stream's ``WARM``-th token to the
    first stream's last one, counting every stream's tokens in between."""
    start = max(t[WARM - 1] for t in streams)
    end = min(t[-1] for t in streams)
    n = sum(1 for t in streams for x in t if start < x <= end)
    return (end - start) * 1e3 / n, n


async def _generate(
    target: str, tokens: int, streams: int, warm: Callable[[], None] = lambda: None
) -> tuple[float, int, list[int]]:
    async with ShardClient.connect(target, timeout=600) as client:
        arrivals: list[list[float]] = [[] for _ in range(streams)]
        chosen: list[int] = []

        async def one(i: int) -> None:
            async for step in client.generate(PROMPT, max_tokens=tokens + WARM, ignore_eos=True):
                arrivals[i].append(time.perf_counter())
                if i == 0:
                    chosen.append(step.logits.token_id)
                    if len(chosen) == WARM:
                        warm()

        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(one, i)
        return (*_window(arrivals), chosen)


async def _decode(target: str, tokens: int) -> tuple[float, int, list[int]]:
    async with ShardClient.connect(target, timeout=600) as client:
        async with client.session(f"colocated-{time.monotonic_ns()}") as s:
            token = (await s.prefill(PROMPT)).logits.token_id
            arrivals, chosen = [time.perf_counter()], [token]
            for _ in range(tokens + WARM - 1):
                token = (await s.decode(token=token)).logits.token_id
                arrivals.append(time.perf_counter())
                chosen.append(token)
            return (*_window([arrivals]), chosen)


async def _pipeline(
    targets: list[str], tokens: int, warm: Callable[[], None] = lambda: None
) -> tuple[float, int, list[int]]:
    arrivals: list[float] = []
    chosen: list[int] = []

    def on_token(step: Any) -> None:
        arrivals.append(time.perf_counter())
        chosen.append(step.logits.token_id)
        if len(chosen) == WARM:
            warm()

    async with Pipeline.connect(targets, timeout=600) as pipe:
        await pipe.generate(PROMPT, max_tokens=tokens + WARM, ignore_eos=True, on_token=on_token)
    return (*_window([arrivals]), chosen)


async def _native(target: str) -> tuple[int, int]:
    """The worker's ``native_step_us_total`` and ``batch_ticks_total`` (0 when not reported)."""
    async with ShardClient.connect(target, timeout=60) as client:
        engine = (await client.metrics()).engine
        return engine.get("native_step_us_total", 0), engine.get("batch_ticks_total", 0)


async def _with_native(
    targets: list[str], run: Callable[[Callable[[], None]], Awaitable[T]]
) -> tuple[T, list[float | None]]:
    """``run(warm)``, and the ms inside ``llama_decode`` per tick of each worker from the moment
    ``run`` calls ``warm`` (its stream's ``WARM``-th token: the prompt's tick and the untimed
    steps are left out, as in the ms per token) to its end."""
    mark = trio.Event()
    before: list[tuple[int, int]] = []

    async def snapshot() -> None:
        await mark.wait()
        before.extend([await _native(t) for t in targets])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(snapshot)
        try:
            result = await run(mark.set)
        finally:
            mark.set()  # a stream shorter than WARM: the snapshot is taken now (no ticks: None)
    out: list[float | None] = []
    for target, (us0, ticks0) in zip(targets, before):
        us1, ticks1 = await _native(target)
        out.append(round((us1 - us0) / (ticks1 - ticks0) / 1e3, 3) if ticks1 > ticks0 and us1 > us0 else None)
    return result, out


@contextmanager
def busy(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` processes spinning on a core each until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def _ranges(model: Path) -> tuple[tuple[int, int], tuple[int, int]]:
    """The pipeline's two halves of the model's blocks."""
    from shard.models import read_model_info

    n = read_model_info(model).block_count
    return (0, n // 2), (n // 2, n)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    roots = options.checkouts(args)
    halves = _ranges(args.model)
    rows: dict[str, dict[str, list[float]]] = {name: {m: [] for m in MODES} for name in roots}
    counted: dict[str, dict[str, list[int]]] = {name: {m: [] for m in MODES} for name in roots}
    system_info: dict[str, str] = {}
    agree: dict[str, list[bool]] = {name: [] for name in roots}  # greedy tokens, three ways
    # ms inside llama_decode per tick: the whole worker during Generate, each hop during the pipeline
    native: dict[str, dict[str, list[Any]]] = {name: {"generate": [], "pipeline_hops": []} for name in roots}
    with ExitStack() as stack:
        sets: dict[str, tuple[str, list[str]]] = {}
        for name, root in roots.items():
            ctx = 4 * 2 * (args.tokens + 64)
            whole = stack.enter_context(shard_server(
                args.model, threads=args.threads, ctx=ctx, max_sessions=4,
                log=args.logs / f"colocated_{name}_whole.log", root=root))
            hops = [stack.enter_context(shard_server(
                args.model, threads=args.threads, ctx=2 * (args.tokens + 64), max_sessions=1,
                log=args.logs / f"colocated_{name}_{a}_{b}.log", root=root, extra=["--layers", f"{a}:{b}"]))
                for a, b in halves]
            for srv in (whole, *hops):
                await wait_serving(srv.target)
            async with ShardClient.connect(whole.target, timeout=60) as client:
                system_info[name] = (await client.capabilities()).system_info
            sets[name] = (whole.target, [h.target for h in hops])
        order = list(roots)
        neighbours: list[subprocess.Popen[bytes]] = []
        for round_no in range(args.rounds + 1):  # round 0 warms up and is dropped
            if round_no == 1:
                neighbours = stack.enter_context(busy(args.busy))
            tokens = 8 if round_no == 0 else args.tokens
            for name in (order if round_no % 2 == 0 else order[::-1]):
                whole_target, hop_targets = sets[name]
                results = {}
                results["generate"], whole_native = await _with_native(
                    [whole_target], lambda warm: _generate(whole_target, tokens, 1, warm))
                results["decode"] = await _decode(whole_target, tokens)
                results["sessions4"] = await _generate(whole_target, tokens, 4)
                results["pipeline"], hops_native = await _with_native(
                    hop_targets, lambda warm: _pipeline(hop_targets, tokens, warm))
                if round_no:
                    for mode, (ms, n, _) in results.items():
                        rows[name][mode].append(round(ms, 3))
                        counted[name][mode].append(n)
                    same = [results[m][2] for m in ("generate", "decode", "pipeline")]
                    agree[name].append(same[0] == same[1] == same[2])
                    native[name]["generate"].append(whole_native[0])
                    native[name]["pipeline_hops"].append(hops_native)
                    print(f"round {round_no} {name:5} " + " ".join(
                        f"{m}={ms:.1f}" for m, (ms, _, _) in results.items()), flush=True)
        assert all(p.poll() is None for p in neighbours), "a busy neighbour died during the run"
    medians = {name: {m: round(statistics.median(v), 2) for m, v in per.items()} for name, per in rows.items()}
    result: dict[str, Any] = {
        "ms_per_token": rows, "tokens_timed": counted, "medians": medians, "system_info": system_info,
        "tokens_agree": {name: all(v) for name, v in agree.items()},
        "native_ms_per_step": native,
        "pipeline_vs_whole": {name: round(m["generate"] / m["pipeline"], 3) for name, m in medians.items()},
    }
    if "other" in medians:
        result["ratios"] = {m: round(medians["other"][m] / medians["this"][m], 3) for m in MODES}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine.colocated", description=__doc__.split("\n")[0])
    options.add_threads(p, 2, "llama.cpp threads per worker (default 2)")
    options.add_tokens(p, 64, "timed tokens per stream (default 64)")
    options.add_rounds(p, 6, "timed rounds (default 6)")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="busy-looping processes running during the timed rounds (default 0)")
    options.add_common(p, DEFAULT_OUT, quick="tiny model, 16 tokens, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.rounds = 16, 1
    options.resolve(args)
    env = environment(args.model, args.threads, argv=sys.argv if argv is None else argv)
    result = trio.run(measure, args)
    env["load_average_after"] = load_average()
    report = {
        "environment": env,
        "settings": {"tokens": args.tokens, "rounds": args.rounds, "threads": args.threads,
                     "busy": args.busy, "worker_root": str(args.worker_root) if args.worker_root else None},
        **result,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, row in result["medians"].items():
        print(f"median {name:5} " + " ".join(f"{m}={v}" for m, v in row.items())
              + f"  pipeline/whole tok/s {result['pipeline_vs_whole'][name]}")
    if "ratios" in result:
        print("ratio other/this (time; above 1: this checkout faster) "
              + " ".join(f"{m}={v}" for m, v in result["ratios"].items()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
