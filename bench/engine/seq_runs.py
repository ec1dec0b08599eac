"""Sixteen sessions decoding together after prefix cache entries came and went: how many
llama.cpp ubatches each tick runs, and the CPU a decoded row costs.

With one KV stream per sequence llama.cpp runs one ubatch per run of consecutive sequence ids,
each a pass over all the weights (docs/engine.md, "Sequence ids and ubatches"). Before the
prefix cache moved its entries above the sessions' ids, the door's chats (one session per
conversation, stored as an entry when released) left an entry inside the sessions' run, and
every tick of 16 chats ran as two ubatches. Variants, alternating each round, one process:

* ``cache-off``: no prefix cache; the sessions take ids 0-15;
* ``cache-on``: a prefix cache of one entry, and three sessions released first, the middle one
  last, as a door's chats leave it; then the same 16 sessions.

Ubatches are counted with the abort callback, which ggml polls once per graph node (armed for
every tick here: ``abort_min_tokens=1``): a tick's polls over a one-row tick's. CPU is the
process's (every llama.cpp thread) over the decode ticks, per row.

    python -m bench.engine.seq_runs [--model FILE|NAME] [--threads 1] [--steps 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

from bench.api.chat_turns import model_path
from bench.common import options
from bench.common.environment import environment, save_record
from shard.engine import DecodeRequest, LoadSpec, PrefillRequest
from shard.engine.llama import LlamaCppEngine

SESSIONS = 16
VARIANTS = ("cache-off", "cache-on")


async def run_variant(model: Path, variant: str, threads: int, steps: int) -> dict[str, float]:
    """One variant: mean ubatches per 16-row decode tick and CPU ms per decoded row."""
    budget = 512 if variant == "cache-on" else 0
    async with LlamaCppEngine(abort_min_tokens=1) as engine:
        await engine.load(LoadSpec(model_path=model, n_ctx=512 * SESSIONS, max_sessions=SESSIONS,
                                   n_threads=threads, prefix_cache_tokens=budget))
        ticks: list[tuple[int, int, float]] = []  # rows, abort polls, process CPU seconds
        tick_sync = engine._tick_sync

        def counted(tick: list) -> float:  # type: ignore[type-arg]
            polls, cpu = engine.abort_polls, time.process_time()
            native = tick_sync(tick)
            ticks.append((sum(p.count for _, p in tick), engine.abort_polls - polls,
                          time.process_time() - cpu))
            return native

        engine._tick_sync = counted  # type: ignore[method-assign]
        await engine.open_session("one")  # a one-row tick: the polls of one graph
        r = await engine.prefill(PrefillRequest("one", tokens=(1, 2, 3)))
        await engine.decode(DecodeRequest("one", token=r.logits.token_id))
        one_graph = ticks[-1][1]
        for sid in ("x", "y"):
            await engine.open_session(sid)
            await engine.prefill(PrefillRequest(sid, tokens=tuple(range(3, 40))))
        for sid in ("one", "y", "x"):  # with a cache: the entry is x's, which held id 1
            await engine.release(sid)
        ticks.clear()

        async def chat(s: int) -> None:
            sid = f"s{s}"
            await engine.open_session(sid)
            r = await engine.prefill(PrefillRequest(sid, tokens=tuple(range(100 + s, 130 + s))))
            for _ in range(steps):
                r = await engine.decode(DecodeRequest(sid, token=r.logits.token_id))

        async with trio.open_nursery() as nursery:
            for s in range(SESSIONS):
                nursery.start_soon(chat, s)
    full = [t for t in ticks if t[0] == SESSIONS]
    return {"ticks": len(full),
            "ubatches_per_tick": statistics.mean(t[1] / one_graph for t in full),
            "cpu_ms_per_row": sum(t[2] for t in full) / sum(t[0] for t in full) * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_model(p, "smollm2-135m-instruct (default), a packaged model's name or a GGUF file",
                      type=str, default="smollm2-135m-instruct")
    options.add_threads(p, 1, "llama.cpp threads (default 1: no spinning thread pool)")
    p.add_argument("--steps", type=int, default=30, help="decode steps of every session (default 30)")
    options.add_rounds(p, 3, "rounds, the variants alternating within each (default 3)")
    options.add_out(p, options.RESULTS / "seq_runs.json")
    args = p.parse_args(argv)
    model = model_path(args.model)
    env = environment(model, args.threads,
                      argv=sys.argv if argv is None else ["bench.engine.seq_runs", *argv])
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        got = {v: trio.run(run_variant, model, v, args.threads, args.steps) for v in order}
        print(f"round {r}: " + ", ".join(
            f"{v} {got[v]['ubatches_per_tick']:.2f} ubatches/tick {got[v]['cpu_ms_per_row']:.2f} ms/row"
            for v in VARIANTS), flush=True)
        rounds.append(got)
    results: dict[str, Any] = {v: {k: round(statistics.median(x[v][k] for x in rounds), 3)
                                   for k in rounds[0][v]} for v in VARIANTS}
    results["cpu_on_over_off"] = round(statistics.median(
        x["cache-on"]["cpu_ms_per_row"] / x["cache-off"]["cpu_ms_per_row"] for x in rounds), 3)
    save_record(args.out, {"bench": "seq_runs", "environment": env,
                           "config": {"model": str(model), "threads": args.threads,
                                      "steps": args.steps, "rounds": args.rounds},
                           "rounds": rounds, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
