"""A hop's CPU per session-step, a worker of this checkout against one of another, one client.

``bench.worker.session_steps --group`` steps one worker two ways; run from two checkouts in
turn, its client changes with its worker, and a faster client changes how the worker's reads
batch (a worker's CPU per step depends on how many frames one wake-up finds). This runs the
same stepped rounds (``session_steps.stepped_round``: every session of one batch group stepped
``--tokens`` times by the client, on its own stream and as one ``GroupSteps`` message a tick)
against a fake worker from this checkout and one from ``--worker-root``, with this checkout's
client for both, alternating round by round (A, B, B, A, ...); each worker pinned to the first
core as in ``session_steps``. Reported: the worker's CPU per session-step (``/proc``), medians
per checkout, way and session count, this checkout's over the other's (ratio of medians and the
median of the rounds' paired ratios).

    python -m bench.worker.steps_checkouts --worker-root OTHER_CHECKOUT [--sessions 8,32]
        [--tokens 300] [--rounds 10] [--out FILE] [--logs DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import ExitStack
from typing import Any

import trio

from bench.common import options
from bench.common.environment import environment, save_record
from bench.common.processes import FAKE_WORKER, module_in, served
from bench.worker.session_steps import FAKE, pin_worker, stepped_round

WAYS = ("per_session", "group")


def _ratio(a: float, b: float) -> float | None:
    """``a / b``; None when ``b`` is 0 (a round too short for the CPU clock's 10 ms ticks)."""
    return a / b if b else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", default="8,32", help="sessions of the group (default 8,32)")
    options.add_tokens(p, 300, "steps of every session a round (default 300)")
    options.add_rounds(p, 10, "rounds, the checkouts alternating (default 10)")
    options.add_worker_root(p, "the other checkout (required)")
    options.add_out(p, options.RESULTS / "steps_checkouts.json")
    options.add_logs(p)
    args = p.parse_args(argv)
    sessions = [int(x) for x in args.sessions.split(",")]
    if args.worker_root is None or not (args.worker_root / "shard").is_dir():
        p.error("--worker-root: a checkout with a shard/ package is required")
    if min(sessions) < 1 or args.rounds < 1 or args.tokens < 1:
        p.error("--sessions, --rounds and --tokens must be positive")
    roots = options.checkouts(args)
    rows: dict[str, dict[str, dict[int, list[float]]]] = {
        name: {way: {n: [] for n in sessions} for way in WAYS} for name in roots}
    ctx = max(sessions) * (args.tokens + 64)
    with ExitStack() as stack:
        servers = {name: stack.enter_context(served(
            [*pin_worker(), sys.executable, "-m", module_in(root, *FAKE_WORKER), *FAKE,
             "--port", "0", "--max-sessions", str(max(sessions)), "--ctx", str(ctx)],
            log=args.logs / f"steps_checkouts_{name}.log", root=root, fake=True))
            for name, root in roots.items()}
        order = list(roots)
        for round_no in range(args.rounds + 1):  # round 0 warms both up and is dropped
            for name in order if round_no % 2 == 0 else order[::-1]:
                srv = servers[name]
                for way in WAYS:
                    for n in sessions:
                        row = trio.run(stepped_round, srv.target, srv.proc.pid, n,
                                       16 if round_no == 0 else args.tokens, way == "group")
                        if round_no:
                            rows[name][way][n].append(row["worker_cpu_us"])
                            print(f"round {round_no} {name} {way} sessions={n} "
                                  f"worker_cpu_us={row['worker_cpu_us']}", flush=True)
    medians = {name: {way: {n: statistics.median(v) for n, v in per.items()}
                      for way, per in ways.items()} for name, ways in rows.items()}
    results: dict[str, Any] = {"worker_cpu_us": rows, "medians": medians, "ratios": {
        way: {n: {"of_medians": _ratio(medians["this"][way][n], medians["other"][way][n]),
                  "paired_median": statistics.median(
                      a / b for a, b in zip(rows["this"][way][n], rows["other"][way][n]) if b)
                  if all(rows["other"][way][n]) else None}
              for n in sessions} for way in WAYS}}
    save_record(args.out, {"environment": environment(
        None, 1, argv=sys.argv if argv is None else ["bench.worker.steps_checkouts", *argv]),
        "worker_root": str(args.worker_root), "tokens": args.tokens, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
