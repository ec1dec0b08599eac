"""What CPU spent per token by somebody else on the machine costs the native decode loop.

A served token costs the machine more than ``llama_decode``: the worker's event loop (transport,
session, engine bookkeeping) and the client each run Python per token, right after the token is
out, while the next step computes. On a machine whose every core runs a ggml thread that CPU is
taken from the step. This bench measures the price directly, without the worker: the raw decode
loop (``bench.engine.raw_loops.RawDecoder``, the worker's context settings and thread pool) tells a
*burner* process after every token, and the burner spins ``B`` microseconds of its own CPU time
then, in parallel with the next step, the way the event loop and the client do. Budgets and
rounds alternate (the order rotates round by round), so drift hits every budget alike.

Per thread count and budget it reports the loop's tokens/s (median over rounds) and its ratio to
the same loop with a burner that spins nothing (``B = 0``: the notification alone); from those,
``cost_us_per_token`` (how much longer a token took, per budget) and ``cost_per_cpu_us`` (that
extra time per microsecond burned: 1 means the burned CPU came straight out of the step). With
the worker's own CPU per token (``bench/worker/hot_path.py``, plus the client's) this says what a
served stream can reach at best, and how little Python per token a target needs.

    python -m bench.engine.cpu_budget [--quick] [--model PATH] [--threads 1,2] [--budgets 0,250,500,1000,2000]
                               [--tokens 64] [--rounds 5] [--out FILE]

``--quick`` (tiny model, 16 tokens, 1 round, budgets 0,500) only checks the harness: the tiny
model's steps are shorter than the budgets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import options
from bench.common.environment import environment, load_average
from bench.engine.raw_loops import RawDecoder

PROMPT = [1, *range(300, 319)]  # word pieces of the generated vocabularies (tiny: 812 tokens)
DEFAULT_OUT = options.RESULTS / "cpu_budget.json"


#: The burner, as small as a Python process gets (no imports beyond ``sys`` and ``time``, so its
#: start-up is over before the first loop): it writes one byte once ready, then, for every 4-byte
#: budget (microseconds, little-endian) read from stdin, spins that much of its own CPU time; a
#: zero-length read (the loop closed the pipe) ends it.
BURNER = """
import sys, time
out, stdin = sys.stdout.buffer, sys.stdin.buffer
out.write(b"r"); out.flush()
while len(data := stdin.read(4)) == 4:
    end = time.process_time() + int.from_bytes(data, "little") / 1e6
    while time.process_time() < end:
        pass
"""


class Burner:
    """A burner process (a context manager); ``notify(us)`` asks it to spin ``us`` microseconds."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", BURNER], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin = self._proc.stdin
        if self._proc.stdout.read(1) != b"r":  # started: nothing of its start-up overlaps a loop
            self._proc.kill()
            self._proc.communicate()  # reaps it and closes both pipes
            raise RuntimeError("the burner did not start")
        self.asked_us = 0  # every budget notified
        self.burned_s: float | None = None  # the burner's CPU time, known once it ended

    def notify(self, us: int) -> None:
        self._stdin.write(us.to_bytes(4, "little"))
        self._stdin.flush()
        self.asked_us += us

    def __enter__(self) -> Burner:
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the pipe and reap the burner, keeping its CPU time (``burned_s``): the report
        shows the burner really spent what it was asked to."""
        try:
            self._stdin.close()
        except BrokenPipeError:  # it died: its exit status says so below
            pass
        assert self._proc.stdout is not None
        self._proc.stdout.close()
        _, status, usage = os.wait4(self._proc.pid, 0)
        self._proc.returncode = code = os.waitstatus_to_exitcode(status)
        self.burned_s = usage.ru_utime + usage.ru_stime
        if code != 0 and exc[0] is None:
            raise RuntimeError(f"the burner exited with status {code}")


def measure(decoder: RawDecoder, burner: Burner, budget_us: int, n_tokens: int) -> tuple[float, int]:
    """One timed loop with ``budget_us`` burned after every token: (tokens/s, tokens evaluated)."""
    result = decoder.run(PROMPT, 1, n_tokens, after_step=lambda: burner.notify(budget_us))
    return result.tok_s, result.evaluated


def run_threads(model: Path, threads: int, budgets: list[int], n_tokens: int, rounds: int) -> dict[str, Any]:
    rates: dict[int, list[float]] = {b: [] for b in budgets}
    evaluated: dict[int, list[int]] = {b: [] for b in budgets}
    with RawDecoder(model, n_ctx=len(PROMPT) + n_tokens + 16, n_seq_max=1, threads=threads) as dec, Burner() as burner:
        measure(dec, burner, 0, min(n_tokens, 8))  # warm-up
        for rnd in range(rounds):
            shift = rnd % len(budgets)
            for b in budgets[shift:] + budgets[:shift]:
                tok_s, n = measure(dec, burner, b, n_tokens)
                rates[b].append(tok_s)
                evaluated[b].append(n)
                print(f"threads {threads} round {rnd + 1} budget {b:5d} us: {tok_s:6.2f} tok/s", flush=True)
    assert burner.burned_s is not None
    base = statistics.median(rates[0]) if 0 in rates else None
    rows = []
    for b in budgets:
        med = statistics.median(rates[b])
        row: dict[str, Any] = {"budget_us": b, "tok_s_median": round(med, 2),
                               "tok_s": [round(r, 2) for r in rates[b]], "evaluated": evaluated[b]}
        if base:
            row["vs_no_burn"] = round(med / base, 3)
            row["cost_us_per_token"] = round(1e6 / med - 1e6 / base, 1)
            if b:
                row["cost_per_cpu_us"] = round((1e6 / med - 1e6 / base) / b, 2)
        rows.append(row)
    return {"threads": threads, "rows": rows, "burner_asked_s": round(burner.asked_us / 1e6, 3),
            "burner_cpu_s": round(burner.burned_s, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine.cpu_budget", description=__doc__.split("\n\n")[0])
    options.add_model(p)
    options.add_quick(p, "tiny model, 16 tokens, 1 round, budgets 0,500")
    options.add_threads(p, "1,2", "comma-separated thread counts (default 1,2)", type=str)
    p.add_argument("--budgets", default="0,250,500,1000,2000",
                   help="microseconds burned per token, comma-separated; include 0 (default 0,250,500,1000,2000)")
    options.add_tokens(p, 64, "timed tokens per loop (default 64)")
    options.add_rounds(p, 5, "timed rounds (default 5)")
    options.add_out(p, DEFAULT_OUT, "the result JSON (default: bench/results/cpu_budget.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.rounds, args.budgets = 16, 1, "0,500"
    budgets = [int(x) for x in args.budgets.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    if 0 not in budgets or min(budgets) < 0 or min(threads) < 1 or args.tokens < 1 or args.rounds < 1:
        p.error("--budgets must include 0 and be >= 0; --threads, --tokens and --rounds >= 1")
    if args.model is None:
        args.model = options.default_model(args.quick)
    env = environment(args.model, max(threads), argv=sys.argv if argv is None else ["bench/engine/cpu_budget.py", *argv])
    results = [run_threads(args.model, t, budgets, args.tokens, args.rounds) for t in threads]
    env["load_average_after"] = load_average()
    out = {"environment": env, "settings": {"tokens": args.tokens, "rounds": args.rounds, "budgets_us": budgets},
           "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print()
    print("threads  budget_us  tok/s  vs_no_burn  cost_us/token  cost per CPU us")
    for res in results:
        for row in res["rows"]:
            print(f"{res['threads']:7d}  {row['budget_us']:9d}  {row['tok_s_median']:5.1f}  "
                  f"{row.get('vs_no_burn', float('nan')):10.3f}  {row.get('cost_us_per_token', float('nan')):13.1f}  "
                  f"{row.get('cost_per_cpu_us', float('nan')):15.2f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
