"""What one wake-up costs, before any work: CPU per wake-up of a process that sleeps between them.

The worker's CPU per token at one session is dominated by waking up once per token (docs/
benchmarks.md, "The floor at the worker's own pace"). This bench isolates that cost: a loop
that only sleeps for each of ``--paces`` and wakes up, ``--wakeups`` times, measured as CPU time
of the waking thread (``time.thread_time``: the thread's own, precise, not sampled; for Trio,
from inside ``trio.run``), one way each:

  time_sleep      ``time.sleep``: the cheapest wake-up Python has
  epoll           ``select.epoll().poll(pace)``: what Trio's I/O wait is made of
  trio_sleep      ``trio.sleep(pace)`` in ``trio.run``: a Trio timer (a cancel scope per sleep)
  trio_woken      a Trio task woken by another thread with ``TrioToken.run_sync_soon``, as the
                  worker's native thread wakes its event loop after a step (the floor
                  server's ``Ticker``, bench/common/floor_server.py; only the event loop's CPU counts)
  trio_warm       ``trio.sleep(0)`` repeated: a Trio scheduling round that never waits (no pace)

Paces: ``--paces`` (default 1 and 25 ms: the paced floor of earlier runs and about one native
step of the bench model at one thread). On an idle core a wake-up finds cold caches; the
gap between ``trio_warm`` and the paced rows is what that costs Trio's run loop here.

    python -m bench.worker.wakeups [--quick] [--paces 1,25] [--wakeups 400] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import select
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from bench.common import options
from bench.common.environment import environment, save_record
from bench.common.floor_server import Ticker
from shard.engine.native_thread import GIL_SWITCH_INTERVAL

DEFAULT_OUT = options.RESULTS / "wakeups.json"


def _thread_cpu_per(n: int, fn: Callable[[], None]) -> float:
    """Microseconds of this thread's CPU per wake-up of ``fn()``, which wakes up ``n`` times."""
    start = time.thread_time()
    fn()
    return (time.thread_time() - start) * 1e6 / n


def time_sleep(pace: float, n: int) -> float:
    def run() -> None:
        for _ in range(n):
            time.sleep(pace)
    return _thread_cpu_per(n, run)


def epoll(pace: float, n: int) -> float:
    poller = select.epoll()
    try:
        def run() -> None:
            for _ in range(n):
                poller.poll(pace)
        return _thread_cpu_per(n, run)
    finally:
        poller.close()


def _in_trio(n: int, body: Callable[[], Awaitable[None]]) -> float:
    """Microseconds of this thread's CPU per wake-up of ``body()`` run inside ``trio.run``
    (its start-up and shutdown not counted)."""
    async def main() -> float:
        start = time.thread_time()
        await body()
        return (time.thread_time() - start) * 1e6 / n
    return trio.run(main)


def trio_sleep(pace: float, n: int) -> float:
    async def body() -> None:
        for _ in range(n):
            await trio.sleep(pace)
    return _in_trio(n, body)


def trio_woken(pace: float, n: int) -> float:
    """A task woken by another thread every ``pace`` (``run_sync_soon``), as the worker is."""
    async def body() -> None:
        ticker = Ticker(pace)
        try:
            for _ in range(n):
                await ticker.tick()
        finally:
            ticker.close()
    return _in_trio(n, body)


def trio_warm(_pace: float, n: int) -> float:
    async def body() -> None:
        for _ in range(n):
            await trio.sleep(0)
    return _in_trio(n, body)


WAYS: dict[str, Callable[[float, int], float]] = {
    "time_sleep": time_sleep, "epoll": epoll, "trio_sleep": trio_sleep, "trio_woken": trio_woken,
}


def measure(paces_ms: list[float], wakeups: int, rounds: int) -> dict[str, Any]:
    rows: dict[str, list[float]] = {}
    for round_no in range(rounds):
        for pace_ms in paces_ms:
            for name, way in WAYS.items():
                value = way(pace_ms / 1000, wakeups)
                rows.setdefault(f"{name}_{pace_ms:g}ms", []).append(round(value, 1))
        rows.setdefault("trio_warm", []).append(round(trio_warm(0.0, 20 * wakeups), 2))
        print(f"round {round_no + 1}: " + ", ".join(f"{k} {v[-1]}" for k, v in rows.items()),
              file=sys.stderr, flush=True)
    return {"us_per_wakeup": rows,
            "medians": {k: round(statistics.median(v), 1) for k, v in rows.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.worker.wakeups", description=__doc__.split("\n")[0])
    p.add_argument("--paces", default="1,25", help="milliseconds between wake-ups (default 1,25)")
    p.add_argument("--wakeups", type=int, default=400, help="wake-ups per measurement (default 400)")
    options.add_rounds(p, 3, "rounds, all ways alternating (default 3)")
    options.add_quick(p, "1 and 5 ms, 100 wake-ups, 1 round")
    options.add_out(p, DEFAULT_OUT, f"result file (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    try:
        paces = [float(x) for x in args.paces.split(",") if x.strip()]
    except ValueError:
        p.error("--paces takes comma-separated milliseconds")
    if args.quick:
        paces, args.wakeups, args.rounds = [1.0, 5.0], 100, 1
    if not paces or min(paces) <= 0 or args.wakeups < 1 or args.rounds < 1:
        p.error("--paces, --wakeups and --rounds must be positive")
    # as in a worker, whose native thread lowers the GIL switch interval (and the floor server)
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL))
    results = measure(paces, args.wakeups, args.rounds)
    save_record(args.out, {"environment": environment(None, 0, argv=sys.argv if argv is None else argv),
                           "settings": {"paces_ms": paces, "wakeups": args.wakeups, "rounds": args.rounds},
                           "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
