"""A chat turn's step from the prefix cache against the same step in a session that holds its
history: time, and the logits each gives.

A chat's next turn on the door opens a new session; its prefill takes the conversation from a
prefix cache entry (a copy between llama.cpp KV streams, performed by the step's
``llama_decode``) and computes the turn's new rows in that step. llama-server instead keeps the
conversation in its slot. Variants, alternating each round, one engine in process (SmolLM2 by
default, a history of ``--history`` random token ids, ``--new`` new rows):

* ``from_cache``: a new session's one prefill of history + new rows (the door's turn);
* ``held``: the new rows on a session that holds the history (what llama-server computes);
* ``cache_then_rows``: a new session's prefill of history + one new row (the copy), then the
  other new rows as a second prefill.

Besides milliseconds per variant it prints each variant's top token and log-prob against a
cacheless engine computing the history and then the new rows (the same steps): a variant that
takes the cache is meant to give the same floats bit for bit (docs/engine.md, "Prefix cache").

    python -m bench.engine.copy_step [--model NAME|FILE] [--threads 2] [--history 1100]
        [--new 30] [--rounds 4]
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
from shard.engine import LoadSpec, PrefillRequest, StepResult
from shard.engine.llama import LlamaCppEngine

VARIANTS = ("from_cache", "held", "cache_then_rows")


def _top(r: StepResult) -> dict[str, Any]:
    assert r.logits is not None
    return {"token": r.logits.token_id, "logprob": float(r.logits.logprob)}


async def reference(model: Path, threads: int, history: tuple[int, ...],
                    new: tuple[int, ...]) -> dict[str, Any]:
    """The cacheless engine: the history, then the new rows."""
    async with LlamaCppEngine() as e:
        await e.load(LoadSpec(model_path=model, n_ctx=4 * 2048, max_sessions=4, n_threads=threads))
        await e.open_session("r")
        await e.prefill(PrefillRequest("r", tokens=history))
        return _top(await e.prefill(PrefillRequest("r", tokens=new)))


async def run(model: Path, threads: int, history: tuple[int, ...], new_rows: int,
              rounds: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    tops: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    refs: list[dict[str, Any]] = []
    async with LlamaCppEngine() as e:
        await e.load(LoadSpec(model_path=model, n_ctx=4 * 2048, max_sessions=4, n_threads=threads,
                              prefix_cache_tokens=2048))
        for r in range(rounds + 1):  # round 0 warms up
            new = tuple(range(5000 + 64 * r, 5000 + 64 * r + new_rows))
            if r:
                refs.append(await reference(model, threads, history, new))
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for v in order:
                await e.open_session("h")
                await e.prefill(PrefillRequest("h", tokens=history))
                if v == "held":
                    t0 = time.perf_counter()
                    got = await e.prefill(PrefillRequest("h", tokens=new))
                    dt = time.perf_counter() - t0
                    await e.release("h")
                else:
                    await e.release("h")  # its history becomes the entry
                    await e.open_session("n")
                    t0 = time.perf_counter()
                    if v == "from_cache":
                        got = await e.prefill(PrefillRequest("n", tokens=history + new))
                    else:
                        await e.prefill(PrefillRequest("n", tokens=history + new[:1]))
                        got = await e.prefill(PrefillRequest("n", tokens=new[1:]))
                    dt = time.perf_counter() - t0
                    await e.release("n")
                if r:
                    times[v].append(dt * 1e3)
                    tops[v].append(_top(got))
    return {"ms": {v: round(statistics.median(x), 1) for v, x in times.items()},
            "ms_rounds": times, "top": tops, "reference_top": refs,
            "same_as_reference": {v: sum(t == ref for t, ref in zip(tops[v], refs)) for v in VARIANTS}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_model(p, "smollm2-135m-instruct (default), a packaged model's name or a GGUF file",
                      type=str, default="smollm2-135m-instruct")
    options.add_threads(p, 2, "llama.cpp threads (default 2)")
    p.add_argument("--history", type=int, default=1100, help="positions the cache holds (default 1100)")
    p.add_argument("--new", type=int, default=30, help="the turn's new rows (default 30)")
    options.add_rounds(p, 4, "rounds, the variants alternating within each (default 4)")
    options.add_out(p, options.RESULTS / "copy_step.json")
    args = p.parse_args(argv)
    if args.history < 1 or args.new < 2 or args.history + args.new > 2048:
        p.error("--history at least 1, --new at least 2, both within 2048 positions")
    model = model_path(args.model)
    env = environment(model, args.threads,
                      argv=sys.argv if argv is None else ["bench.engine.copy_step", *argv])
    history = tuple(range(100, 100 + args.history))
    results = trio.run(run, model, args.threads, history, args.new, args.rounds)
    save_record(args.out, {"bench": "copy_step", "environment": env,
                           "config": {"model": str(model), "threads": args.threads,
                                      "history": args.history, "new": args.new,
                                      "rounds": args.rounds},
                           "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
