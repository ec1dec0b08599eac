"""What llama.cpp's samplers cost the engine per token: ``choose_token`` on one logits row with
each kind of sampling, side by side, as ratios to plain greedy (the argmax fast path).

The row is a vocabulary-sized float32 vector (SmolLM2's 49,152 by default) of random logits,
and the session history a list of token ids of ``--history`` positions, so the penalties see
their whole window: ``penalty_last_n`` 64 (the default) or -1 (the whole history). The kinds
run in alternating rounds, so drift affects all alike; each round times ``--calls`` calls of
one kind (the median per call over rounds is reported); the kinds without top_k also with
every draw sorting the whole row (`` [full sort]``, the cost before the prefix draw), in the
same rounds. The engine adds the same per-step work
to every engine (sampling is above the implementations); the step itself is not part of this.

    python -m bench.engine.sampling_cost [--vocab 49152] [--history 2048] [--calls 200]
        [--rounds 5] [--quick] [--out bench/results/sampling_cost.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from bench.common import options
from bench.common.environment import environment, save_record
from shard.engine import SamplingParams
from shard.engine import sampling
from shard.engine.sampling import choose_token

PENALTIES: dict[str, Any] = dict(repeat_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)
KINDS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(),
    "greedy+logit_bias": SamplingParams(logit_bias={5: 2.0, 7: -float("inf")}),
    "greedy+penalties(64)": SamplingParams(**PENALTIES),
    "greedy+penalties(all)": SamplingParams(**PENALTIES, penalty_last_n=-1),
    "sampled(top_k 40)": SamplingParams(temperature=0.8, top_k=40, seed=1),
    "sampled(top_k 40)+min_p+penalties(64)+bias": SamplingParams(
        temperature=0.8, top_k=40, seed=1, min_p=0.05, logit_bias={5: 2.0}, **PENALTIES),
    # the door's default (OpenAI's temperature 1, top_p 1, no top_k)
    "sampled(t 1, no top_k)": SamplingParams(temperature=1.0, seed=1),
    "sampled(t 1, top_p 0.9)": SamplingParams(temperature=1.0, top_p=0.9, seed=1),
    "sampled(no top_k)+min_p+penalties(64)": SamplingParams(
        temperature=0.8, seed=1, min_p=0.05, **PENALTIES),
}


#: Kinds also timed with every draw over the whole sorted row (``FULL_SORT``: what a draw
#: cost before ``sampling.draw_from_prefix``), side by side.
FULL_SORT = " [full sort]"
SORTED_TOO = ("sampled(t 1, no top_k)", "sampled(t 1, top_p 0.9)",
              "sampled(no top_k)+min_p+penalties(64)")


@contextmanager
def full_sort() -> Iterator[None]:
    """``choose_token`` with the prefix draw off: every draw sorts the whole row."""
    saved = sampling.draw_from_prefix
    sampling.draw_from_prefix = lambda *_: None  # type: ignore[assignment]
    try:
        yield
    finally:
        sampling.draw_from_prefix = saved


def per_call(logits: np.ndarray, params: SamplingParams, history: list[int], calls: int) -> float:
    """Seconds a call; each call a position further (another draw of the random stream)."""
    position = len(history)
    start = time.perf_counter()
    for i in range(calls):
        choose_token(logits, params, position + i, history)
    return (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--history", type=int, default=2048, help="positions the session holds")
    p.add_argument("--calls", type=int, default=200, help="calls per kind and round")
    options.add_rounds(p, 5)
    options.add_quick(p, "10 calls, 2 rounds: checks the harness")
    options.add_out(p, options.RESULTS / "sampling_cost.json")
    args = p.parse_args(argv)
    calls, rounds = (10, 2) if args.quick else (args.calls, args.rounds)
    env = environment(None, 1, argv=argv)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(args.vocab).astype(np.float32) * 3
    history = rng.integers(0, args.vocab, args.history).tolist()
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    times.update({k + FULL_SORT: [] for k in SORTED_TOO})
    for _ in range(rounds):
        for kind, params in KINDS.items():
            times[kind].append(per_call(logits, params, history, calls))
            if kind in SORTED_TOO:
                with full_sort():
                    times[kind + FULL_SORT].append(per_call(logits, params, history, calls))
    base = statistics.median(times["greedy"])
    results = {kind: {"us_per_token": round(statistics.median(t) * 1e6, 2),
                      "vs_greedy": round(statistics.median(t) / base, 2)}
               for kind, t in times.items()}
    save_record(args.out, {"environment": env, "vocab": args.vocab, "history": args.history,
                           "calls": calls, "rounds": rounds, "results": results})


if __name__ == "__main__":
    main()
