"""Pipelines over delayed links: tokens/s, time to first token and a long prefill per round trip.

2-, 3- and 4-hop pipelines of the bench model (its blocks split evenly, one ``trio-shard serve
--layers`` worker per hop, 1 llama.cpp thread each, all on this machine) are driven through
one simulated link per worker (bench/common/links.py; round trip r = one-way delay r/2 each way).
Workers start once per hop count; links are re-created per round trip. Per (hops, RTT):

* ``tok_s``: a greedy generation (``ignore_eos``), tokens after the first over the time
  between the first and the last token;
* ``ttft_ms``: from the request to the first token of that generation (short prompt);
* ``prefill_ms``: ``max_tokens=1`` after a ``--prefill``-token prompt.

Results are keyed by mode: ``client`` (the client relays every hop's hidden states,
``shard/pipeline``) and ``chain`` (the workers relay to each other, ``relay="chain"``:
the client talks to the first hop only, each worker reaches the next one through the link in
front of it, since the route names the link addresses; workers run ``serve --allow-relay``, and
the first one ``--advertise``s the address of the link in front of it, which is re-created on
that port for every round trip, so the last worker's direct return crosses that link too).
``speculate`` and ``chain-speculate`` are those two relays with ``--speculate K`` (up to K
drafted tokens verified per pass, shard/pipeline/drafting.py): each such row generates from a
text prompt (``--spec-prompts``: a numbered list, ``REPETITIVE``, or code, ``CODE``) through the
same links, plain and then speculating, ``--spec-rounds`` times, and records both rates (medians),
the median of the pairs' ratios, the passes through the chain and whether the tokens were
identical. Modes alternate per round trip on the same workers. With several workers on few
cores the machine is oversubscribed; the environment records it. Timing lives here, never in
tests.

    python -m bench.pipeline.network [--quick] [--model PRESET|gemma3-270m] [--hops 2,3,4]
        [--rtts 0,2,20,50] [--modes client,chain,speculate,chain-speculate] [--speculate K]
        [--spec-prompts list,code] [--spec-rounds N] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from contextlib import AsyncExitStack, ExitStack
from pathlib import Path
from typing import Any

import trio

from bench.common import options
from bench.common.environment import environment, load_average, save_chart
from bench.common.links import open_link
from bench.common.processes import free_port, shard_server, wait_serving
from shard.pipeline import Pipeline
from shard.v1 import shard_pb2 as pb

#: A prompt that repeats itself, as lists and code do (what prompt lookup drafts from).
REPETITIVE = ("Shopping list:\n1. apples\n2. bananas\n3. carrots\n4. dates\n5. eggs\n"
              "6. figs\n7. grapes\n8. ")
#: Code, where drafts from prompt lookup are right less often (issue 33, finding 4: a loss).
CODE = ("def parse_config(path):\n    with open(path) as f:\n        lines = f.read().splitlines()\n"
        "    config = {}\n    for line in lines:\n        line = line.strip()\n"
        "        if not line or line.startswith('#'):\n            continue\n")
SPEC_PROMPTS = {"list": REPETITIVE, "code": CODE}


def even_ranges(n_layers: int, hops: int) -> list[str]:
    bounds = [round(i * n_layers / hops) for i in range(hops + 1)]
    return [f"{a}:{b}" for a, b in zip(bounds, bounds[1:])]


MODES = ("client", "chain", "speculate", "chain-speculate")
SPECULATING = {"speculate": "client", "chain-speculate": "chain"}  # mode -> its relay


async def open_links(
    stack: AsyncExitStack, targets: list[str], rtt_ms: float, first_port: int,
) -> list[Any]:
    """One fresh link in front of each worker (the first one's on ``first_port``, the address
    that worker advertises for the direct return)."""
    return [await stack.enter_async_context(open_link(
        t, one_way_delay_s=rtt_ms / 2000, port=first_port if i == 0 else 0))
        for i, t in enumerate(targets)]


async def measure_rtt(
    targets: list[str], rtt_ms: float, tokens: int, prefill: int, mode: str = "client",
    first_port: int = 0,
) -> dict[str, Any]:
    """One (mode, hop count, RTT) point, through fresh links."""
    async with AsyncExitStack() as stack:
        links = await open_links(stack, targets, rtt_ms, first_port)
        pipe = await stack.enter_async_context(
            Pipeline.connect([lk.target for lk in links], timeout=600, relay=mode))
        caps = pipe.hops[0].caps
        assert caps is not None
        rng = random.Random(prefill)
        long_prompt = [1, *(rng.randrange(3, caps.n_vocab) for _ in range(prefill - 1))]
        await pipe.generate(long_prompt[:8], max_tokens=1)  # warm-up: sessions, code paths
        arrivals: list[float] = []

        def on_token(_: pb.StepResult) -> None:
            arrivals.append(time.perf_counter())

        start = time.perf_counter()
        await pipe.generate(long_prompt[:8], max_tokens=tokens, ignore_eos=True, on_token=on_token)
        ttft = arrivals[0] - start
        decode = arrivals[-1] - arrivals[0]
        start = time.perf_counter()
        await pipe.generate(long_prompt, max_tokens=1)
        prefill_s = time.perf_counter() - start
    return {
        "mode": mode, "hops": len(targets), "rtt_ms": rtt_ms, "tokens": len(arrivals),
        "tok_s": round((len(arrivals) - 1) / decode, 2) if decode > 0 else None,
        "ms_per_token": round(decode / (len(arrivals) - 1) * 1e3, 2),
        "ttft_ms": round(ttft * 1e3, 1), "prefill_tokens": prefill,
        "prefill_ms": round(prefill_s * 1e3, 1),
    }


async def measure_speculation(
    targets: list[str], rtt_ms: float, tokens: int, k: int, mode: str, first_port: int = 0,
    prompt: str = "list", rounds: int = 1,
) -> dict[str, Any]:
    """One (mode, hop count, RTT, prompt) point of a speculating mode against the same relay
    without speculation, through the same fresh links: ``rounds`` pairs of generations (plain,
    then speculating); the speedup is the median of the pairs' ratios."""
    text = SPEC_PROMPTS[prompt]
    async with AsyncExitStack() as stack:
        links = await open_links(stack, targets, rtt_ms, first_port)
        pipe = await stack.enter_async_context(Pipeline.connect(
            [lk.target for lk in links], timeout=600, relay=SPECULATING[mode]))
        await pipe.generate(text, max_tokens=2, speculate=k)  # warm-up
        rates: dict[str, list[float]] = {"plain": [], "speculate": []}
        results = {}
        for _ in range(rounds):
            for name, spec in (("plain", 0), ("speculate", k)):
                arrivals: list[float] = []

                def on_token(_: pb.StepResult, arrivals: list[float] = arrivals) -> None:
                    arrivals.append(time.perf_counter())

                results[name] = await pipe.generate(text, max_tokens=tokens, ignore_eos=True,
                                                    speculate=spec, on_token=on_token)
                span = arrivals[-1] - arrivals[0]
                rates[name].append((len(arrivals) - 1) / span if span > 0 else 0.0)
    spec = results["speculate"]
    ratios = sorted(s / p for s, p in zip(rates["speculate"], rates["plain"]) if p > 0)
    return {
        "mode": mode, "hops": len(targets), "rtt_ms": rtt_ms, "prompt": prompt,
        "tokens": len(spec.tokens), "k": k, "rounds": rounds,
        "tok_s": round(statistics.median(rates["speculate"]), 2),
        "plain_tok_s": round(statistics.median(rates["plain"]), 2),
        "speedup": round(statistics.median(ratios), 3) if ratios else None,
        "speedups": [round(r, 3) for r in ratios],
        "traversals": spec.traversals, "plain_traversals": results["plain"].traversals,
        "drafted": spec.drafted_tokens, "accepted": spec.accepted_tokens,
        "identical_tokens": spec.tokens == results["plain"].tokens,
    }


async def measure_hops(
    targets: list[str], rtts: list[float], tokens: int, prefill: int, modes: list[str], k: int,
    first_port: int = 0, prompts: tuple[str, ...] = ("list",), rounds: int = 1,
) -> list[dict[str, Any]]:
    for target in targets:
        await wait_serving(target)
    rows = []
    for rtt in rtts:
        for mode in modes:
            if mode in SPECULATING:
                for prompt in prompts:
                    row = await measure_speculation(targets, rtt, tokens, k, mode, first_port,
                                                    prompt, rounds)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                continue
            row = await measure_rtt(targets, rtt, tokens, prefill, mode, first_port)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """chain / client tokens/s (and prefill time client / chain) per (hops, RTT)."""
    out = []
    for r in rows:
        if r["mode"] != "chain":
            continue
        base = next((c for c in rows if c["mode"] == "client" and c["hops"] == r["hops"]
                     and c["rtt_ms"] == r["rtt_ms"]), None)
        if base is None or not base["tok_s"] or not r["tok_s"]:
            continue
        out.append({"hops": r["hops"], "rtt_ms": r["rtt_ms"],
                    "tok_s_chain_over_client": round(r["tok_s"] / base["tok_s"], 2),
                    "ttft_client_over_chain": round(base["ttft_ms"] / r["ttft_ms"], 2),
                    "prefill_client_over_chain": round(base["prefill_ms"] / r["prefill_ms"], 2)})
    return out


def write_chart(rows: list[dict[str, Any]], path: Path, title: str) -> str | None:
    """PNG of tokens/s against RTT, one line per hop count; returns why not if it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    styles = {"client": ("o", "-"), "chain": ("s", "--"), "speculate": ("^", "-."),
              "chain-speculate": ("D", ":")}
    for mode in MODES:
        for hops in sorted({r["hops"] for r in rows}):
            mine = [r for r in rows if r["hops"] == hops and r["mode"] == mode]
            if mine:
                marker, line = styles[mode]
                label = (f"{SPECULATING[mode]} relay + speculate (list prompt)" if mode in SPECULATING
                         else f"{mode} relay")
                ax.plot([r["rtt_ms"] for r in mine], [r["tok_s"] for r in mine],
                        marker=marker, linestyle=line, label=f"{label}, {hops} hops")
    ax.set_xlabel("round trip per link (ms)")
    ax.set_ylabel("decode tokens/s")
    save_chart(fig, ax, path, title)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pipeline.network", description=__doc__.splitlines()[0])
    options.add_quick(p, "tiny model, 2 hops, RTT 0 and 20 ms, 8 tokens, 64-token prefill")
    options.add_preset(p, None, "model preset, or a packaged model's name: gemma3-270m (the real Gemma 3 "
                       "270M, installed by make models) (default: bench; tiny with --quick)", "--model")
    p.add_argument("--hops", default=None, help="hop counts (default 2,3,4)")
    p.add_argument("--rtts", default=None, help="round trips per link in ms (default 0,2,20,50)")
    options.add_tokens(p, None, "generated tokens (default 32)")
    p.add_argument("--prefill", type=int, default=None, help="prefill prompt length (default 1000)")
    options.add_threads(p, 1, "llama.cpp threads per worker")
    p.add_argument("--modes", default=",".join(MODES), help=f"modes (default {','.join(MODES)})")
    p.add_argument("--speculate", type=int, default=4, metavar="K",
                   help="drafted tokens per pass of the speculating modes (default 4)")
    p.add_argument("--spec-prompts", default="list",
                   help=f"prompts of the speculating modes, of {','.join(SPEC_PROMPTS)} (default list)")
    p.add_argument("--spec-rounds", type=int, default=1,
                   help="plain/speculating pairs per speculating point; the median ratio is kept")
    options.add_out_dir(p)
    args = p.parse_args(argv)
    spec_prompts = tuple(args.spec_prompts.split(","))
    if not set(spec_prompts) <= set(SPEC_PROMPTS) or args.spec_rounds < 1:
        p.error(f"--spec-prompts: choose from {', '.join(SPEC_PROMPTS)}; --spec-rounds >= 1")
    q = args.quick
    preset = args.preset or ("tiny" if q else "bench")
    hop_counts = [int(h) for h in (args.hops or ("2" if q else "2,3,4")).split(",")]
    rtts = [float(r) for r in (args.rtts or ("0,20" if q else "0,2,20,50")).split(",")]
    tokens = args.tokens or (8 if q else 32)
    prefill = args.prefill or (64 if q else 1000)
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        p.error(f"--modes: choose from {', '.join(MODES)}")
    from shard.models import ensure_model
    from shard.models.header import read_model_info
    from shard.models.real import REAL_MODELS, ensure_real_model

    model = ensure_real_model(preset) if preset in REAL_MODELS else ensure_model(preset)
    n_layer = read_model_info(model).block_count
    logs = args.out_dir / "logs"
    env = environment(model, args.threads,
                      argv=["-m", "bench.pipeline.network", *(sys.argv[1:] if argv is None else argv)])
    rows: list[dict[str, Any]] = []
    for hops in hop_counts:
        ranges = even_ranges(n_layer, hops)
        first_port = free_port()  # the first worker's link, re-created there for every round trip
        with ExitStack() as stack:
            servers = [stack.enter_context(shard_server(
                model, threads=args.threads, ctx=2 * (prefill + tokens + 64), max_sessions=2,
                log=logs / f"pipeline_network-{hops}-{i}.log",
                extra=["--layers", r, "--allow-relay",
                       *(["--advertise", f"127.0.0.1:{first_port}"] if i == 0 else [])]))
                for i, r in enumerate(ranges)]
            rows += trio.run(measure_hops, [s.target for s in servers], rtts, tokens, prefill, modes,
                             args.speculate, first_port, spec_prompts, args.spec_rounds)
    env["load_average_after"] = load_average()
    print(f"\n{'mode':<7} {'hops':>4} {'rtt ms':>7} {'tok/s':>7} {'ms/tok':>7} {'ttft ms':>8} {'prefill ms':>11}")
    for r in rows:
        if r["mode"] not in SPECULATING:
            print(f"{r['mode']:<7} {r['hops']:>4} {r['rtt_ms']:>7g} {r['tok_s']:>7} {r['ms_per_token']:>7} "
                  f"{r['ttft_ms']:>8} {r['prefill_ms']:>11}")
    print(f"\n{'speculating':<15} {'prompt':>6} {'hops':>4} {'rtt ms':>7} {'tok/s':>7} {'plain':>7} "
          f"{'x':>6} {'passes':>7} {'plain':>6} {'same':>5}")
    for r in rows:
        if r["mode"] in SPECULATING:
            print(f"{r['mode']:<15} {r['prompt']:>6} {r['hops']:>4} {r['rtt_ms']:>7g} {r['tok_s']:>7} "
                  f"{r['plain_tok_s']:>7} {r['speedup']:>6} {r['traversals']:>7} "
                  f"{r['plain_traversals']:>6} {str(r['identical_tokens']):>5}")
    report: dict[str, Any] = {
        "environment": env,
        "settings": {"preset": preset, "hops": hop_counts, "ranges": {h: even_ranges(n_layer, h) for h in hop_counts},
                     "rtts_ms": rtts, "tokens": tokens, "prefill_tokens": prefill, "threads": args.threads,
                     "speculate": args.speculate,
                     "speculate_prompts": {name: SPEC_PROMPTS[name] for name in spec_prompts},
                     "speculate_rounds": args.spec_rounds,
                     "links": "one bench/common/links.py Link in front of each worker, one-way delay = rtt/2"},
        "modes": {mode: [{k: v for k, v in r.items() if k != "mode"} for r in rows if r["mode"] == mode]
                  for mode in modes},
        "ratios": speedups(rows),
    }
    for ratio in report["ratios"]:
        print(f"chain/client tok/s {ratio['tok_s_chain_over_client']:>5}x  ttft {ratio['ttft_client_over_chain']:>5}x  "
              f"prefill {ratio['prefill_client_over_chain']:>5}x  ({ratio['hops']} hops, {ratio['rtt_ms']:g} ms)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    why = write_chart(rows, args.out_dir / "pipeline_network.png",
                      f"{preset} model, {args.threads} thread/worker, {env['usable_cores']} cores")
    report["chart"] = why or "pipeline_network.png"
    path = args.out_dir / "pipeline_network.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {path}" + (f" ({why})" if why else " and pipeline_network.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
