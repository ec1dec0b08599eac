"""Pipelined (chunked) prefill against one-shot prefill through a chain of live workers.

A prompt goes through ``--shards`` workers (in this process, real loopback sockets) with
``Pipeline.generate(..., max_tokens=1)``: the time to the first token, for each chunk size,
measured side by side in alternating rounds (median printed). Chunk size = prompt length is the
unpipelined baseline: each shard waits for the whole prompt of the shard before it.

* ``--engine fake``: FakeEngine shards that sleep ``--latency`` seconds per position (a shard on
  its own machine: sleeping does not take this machine's CPU), so the ideal gain is visible.
* ``--engine llama``: the bench model (or ``--preset tiny``) sliced into ranges, one llama.cpp
  thread per shard, all on this machine: shards compete for its cores, so the gain is bounded by
  them.

    python -m bench.pipeline.prefill [--engine fake|llama] [--shards 3] [--prompt 256]
        [--chunks 256,64,32,16,8] [--rounds 3] [--latency 0.002] [--preset bench]
    python -m bench.pipeline.prefill --engine llama --float16-agreement 32 [--shards 2]

``--float16-agreement N`` instead compares N greedy tokens generated with float32 and with
float16 hidden states on the wire (how many agree, the first that differs, the largest
top-8 log-probability difference on the steps before it).

Timing lives here, never in tests.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial

import trio

from bench.common import options
from shard.engine import LayerRange, LoadSpec, ShardEngine
from shard.engine.fake import FakeEngine, FakeModel, FakeScript
from shard.pipeline import Pipeline
from shard.rpc.server import serve


def cuts(n_layers: int, shards: int) -> list[LayerRange]:
    bounds = [round(i * n_layers / shards) for i in range(shards + 1)]
    return [LayerRange(a, b) for a, b in zip(bounds, bounds[1:])]


@asynccontextmanager
async def workers(engines: Sequence[tuple[ShardEngine, LoadSpec]]) -> AsyncIterator[list[str]]:
    """Serve each (engine, spec) on a free loopback port; yield the targets."""
    async with AsyncExitStack() as stack, trio.open_nursery() as nursery:
        targets = []
        for engine, spec in engines:
            await stack.enter_async_context(engine)
            await engine.load(spec)
            server = await nursery.start(partial(serve, engine))
            targets.append(server.target)
        yield targets
        nursery.cancel_scope.cancel()


def fake_engines(args: argparse.Namespace) -> list[tuple[ShardEngine, LoadSpec]]:
    model = FakeModel(n_layers_total=2 * args.shards, n_embd=64)
    script = FakeScript(step_latency=args.latency)
    return [
        (FakeEngine(model, script), LoadSpec(n_ctx=4096, max_sessions=1, layer_range=lr))
        for lr in cuts(model.n_layers_total, args.shards)
    ]


def llama_engines(args: argparse.Namespace) -> list[tuple[ShardEngine, LoadSpec]]:
    from shard.engine.llama import LlamaCppEngine
    from shard.models import ensure_model, ensure_slice
    from shard.models.write import get_preset

    source = ensure_model(args.preset)
    out = []
    for lr in cuts(get_preset(args.preset).n_layer, args.shards):
        path = ensure_slice(source, lr)
        spec = LoadSpec(model_path=path, layer_range=lr, n_ctx=4096, max_sessions=1, n_threads=1)
        out.append((LlamaCppEngine(), spec))
    return out


async def float16_agreement(targets: list[str], n_tokens: int) -> None:
    prompt = "The quick brown fox jumps over the lazy dog."
    runs = {}
    for dtype in ("float32", "float16"):
        async with Pipeline.connect(targets, timeout=600, hidden_dtype=dtype) as pipe:
            runs[dtype] = await pipe.generate(prompt, max_tokens=n_tokens, ignore_eos=True, top_logprobs=8)
    a, b = runs["float32"], runs["float16"]
    first = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
    agreeing = a.steps if first is None else a.steps[:first]
    worst = max(
        (abs(p.logprob - q.logprob)
         for s, t in zip(agreeing, b.steps)
         for p, q in zip(s.logits.top, t.logits.top) if p.token_id == q.token_id),
        default=0.0,
    )
    same = sum(x == y for x, y in zip(a.tokens, b.tokens))
    print(f"float16 vs float32 hidden states, {n_tokens} greedy tokens: {same} equal, first "
          f"difference at token {first}, max |logprob diff| before it {worst:.2e}")


async def run(args: argparse.Namespace) -> None:
    engines = fake_engines(args) if args.engine == "fake" else llama_engines(args)
    if args.float16_agreement:
        async with workers(engines) as targets:
            await float16_agreement(targets, args.float16_agreement)
        return
    chunks = [int(c) for c in args.chunks.split(",")]
    prompt = [1, *[3 + (i * 7) % 200 for i in range(args.prompt - 1)]]
    times: dict[int, list[float]] = {c: [] for c in chunks}
    async with workers(engines) as targets, Pipeline.connect(targets, timeout=600) as pipe:
        await pipe.generate(prompt[:8], max_tokens=1)  # warm-up
        for _ in range(args.rounds):
            for c in chunks:
                start = trio.current_time()
                await pipe.generate(prompt, max_tokens=1, chunk_tokens=c)
                times[c].append(trio.current_time() - start)
    print(f"engine={args.engine} shards={args.shards} prompt={args.prompt} tokens "
          f"rounds={args.rounds} cpus={os.cpu_count()}"
          + (f" latency={args.latency * 1000:g} ms/position/shard" if args.engine == "fake" else
             f" preset={args.preset} threads=1/shard"))
    base = statistics.median(times[max(chunks)])
    print(f"{'chunk_tokens':>12}  {'prefill s (median)':>18}  {'speed-up vs unchunked':>22}")
    for c in chunks:
        t = statistics.median(times[c])
        print(f"{c:>12}  {t:>18.3f}  {base / t:>21.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["fake", "llama"], default="fake")
    p.add_argument("--shards", type=int, default=3)
    p.add_argument("--prompt", type=int, default=256, help="prompt length in tokens")
    p.add_argument("--chunks", default="256,64,32,16,8", help="chunk sizes; the largest is the baseline")
    options.add_rounds(p, 3)
    p.add_argument("--latency", type=float, default=0.002, help="fake: seconds per position per shard")
    options.add_preset(p, help="llama: model preset (bench or tiny)")
    p.add_argument("--float16-agreement", type=int, default=0, metavar="N",
                   help="compare N greedy tokens with float32 and float16 hidden states instead")
    trio.run(run, p.parse_args())


if __name__ == "__main__":
    main()
