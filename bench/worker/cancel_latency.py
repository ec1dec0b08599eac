"""How fast a cancelled session gives its KV cells back, through a live ``trio-shard serve``.

Four ways to stop a session, each during server-driven decode and during a long prefill:

  in_band       the client cancels the call: RST_STREAM on the session's stream
  out_of_band   the ``Cancel`` RPC on another stream (the session stays open: measured until
                the stream reports CANCELLED, i.e. the step stopped and was rolled back)
  deadline      the session stream's ``grpc-timeout`` expires
  disconnect    the TCP connection drops (the client's socket is shut down without RST_STREAM
                or GOAWAY, as when a client dies); the worker runs with ``--resume-ttl 0`` so a
                lost connection releases instead of retaining

For the three releasing ways, latency is the time from the cancel to the first ``GetMetrics``
(polled back to back on a separate connection) that shows no engine session and no KV cell in
use: an upper bound, with about one metrics round trip of resolution (reported). Latencies are
also given in decode steps (divided by the median decode step time measured in this run).
Trials whose cancel came too late (the prefill had already finished) are discarded and counted.

    python -m bench.worker.cancel_latency [--quick] [--model PATH] [--trials 30] [--prefill 2048]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

from bench.common import options
from bench.common.environment import default_threads, environment, load_average
from bench.common.processes import shard_server, wait_serving
from shard.client import ErrorCode, ShardClient, ShardError

MODES = ("in_band", "out_of_band", "deadline", "disconnect")
PHASES = ("decode", "prefill")


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: with few trials p99 is the maximum)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


class Trials:
    def __init__(self, target: str, prompt: list[int], long_prompt: list[int], seed: int) -> None:
        self.target = target
        self.prompt = prompt
        self.long_prompt = long_prompt
        self.rng = random.Random(seed)
        self.step_s = 0.0
        self.ttft_s = 0.0
        self.prefill_s = 0.0
        self.poll_rtt_s = 0.0

    async def calibrate(self, monitor: ShardClient) -> None:
        """Decode step time, time to first token and the long prefill's duration."""
        async with ShardClient.connect(self.target, timeout=600) as client:
            t0 = time.perf_counter()
            times = []
            async for _ in client.generate(self.prompt, max_tokens=24, ignore_eos=True):
                times.append(time.perf_counter())
            self.ttft_s = times[0] - t0
            self.step_s = statistics.median(b - a for a, b in zip(times[1:], times[2:]))
            t0 = time.perf_counter()
            async for _ in client.generate(self.long_prompt, max_tokens=1, ignore_eos=True):
                self.prefill_s = time.perf_counter() - t0
        rtts = []
        for _ in range(20):
            t0 = time.perf_counter()
            await monitor.metrics()
            rtts.append(time.perf_counter() - t0)
        self.poll_rtt_s = statistics.median(rtts)

    async def wait_released(self, monitor: ShardClient, since: float, limit: float = 60.0) -> float:
        with trio.fail_after(limit):
            while True:
                e = (await monitor.metrics()).engine
                if e["sessions_active"] == 0 and e["kv_cells_used"] == 0:
                    return time.perf_counter() - since
                await trio.sleep(0)

    async def one(self, mode: str, phase: str, monitor: ShardClient) -> float | None:
        """One trial; returns the latency in seconds, or None if the cancel came too late."""
        decode = phase == "decode"
        prompt = self.prompt if decode else self.long_prompt
        max_tokens = 100_000 if decode else 1
        if decode:
            k = self.rng.randint(2, 10)  # cancel after this many tokens
            delay = self.ttft_s + k * self.step_s
        else:
            delay = self.rng.uniform(0.05, 0.35) * self.prefill_s  # early on: bounded run time
        first_token = [float("inf")]
        stopped = [float("nan")]
        cancel_at = [0.0]
        scope = trio.CancelScope()
        sid = f"cancel-{mode}-{phase}-{self.rng.getrandbits(32):08x}"
        async with ShardClient.connect(self.target, timeout=600) as client:

            async def run() -> None:
                timeout = delay if mode == "deadline" else 600.0
                with scope:
                    try:
                        cancel_at[0] = time.perf_counter() + delay
                        async with client.session(sid, timeout=timeout) as s:
                            async for _ in s.generate(prompt, max_tokens=max_tokens, ignore_eos=True):
                                first_token[0] = min(first_token[0], time.perf_counter())
                    except ShardError as err:
                        stopped[0] = time.perf_counter()
                        if mode == "out_of_band" and err.code != ErrorCode.CANCELLED:
                            raise

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                await trio.sleep(delay)  # the session opens within a round trip of now
                if mode == "in_band":
                    t = time.perf_counter()
                    scope.cancel()
                elif mode == "out_of_band":
                    t = time.perf_counter()
                    await client.cancel(sid)
                elif mode == "deadline":
                    t = cancel_at[0]
                else:  # disconnect: drop the socket under the client, no RST_STREAM or GOAWAY
                    t = time.perf_counter()
                    _shutdown_socket(client)
                if mode == "out_of_band":
                    with trio.fail_after(60):
                        while math.isnan(stopped[0]):  # until the stream reports the error
                            await trio.sleep(0)
                    latency = stopped[0] - t
                else:
                    latency = await self.wait_released(monitor, t)
                    scope.cancel()
        await self.wait_released(monitor, time.perf_counter())  # clean slate for the next trial
        if not decode and first_token[0] <= t:
            return None  # the prefill had finished before the cancel
        return latency


def _shutdown_socket(client: ShardClient) -> None:
    """Reach under the client to the TCP socket: a crashed client sends no HTTP/2 goodbye."""
    sock = client._conn.stream.socket  # noqa: SLF001 - deliberate, see the docstring
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


async def run(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    env = environment(model, args.threads)
    per_session = 256 * ((args.prefill + 64 + 255) // 256) + 256
    log = args.out_dir / "logs" / "trio-shard-cancel.log"
    with shard_server(model, threads=args.threads, ctx=per_session, max_sessions=1, log=log,
                      extra=["--resume-ttl", "0", "--grace", "0"]) as server:
        await wait_serving(server.target)
        async with ShardClient.connect(server.target, timeout=600) as monitor:
            caps = await monitor.capabilities()
            n_vocab = caps.n_vocab
            rng = random.Random(args.seed)
            prompt = [1] + [rng.randrange(3, n_vocab) for _ in range(15)]
            long_prompt = [1] + [rng.randrange(3, n_vocab) for _ in range(args.prefill - 1)]
            trials = Trials(server.target, prompt, long_prompt, args.seed)
            await trials.calibrate(monitor)
            print(f"decode step {trials.step_s * 1e3:.2f} ms, ttft {trials.ttft_s * 1e3:.1f} ms, "
                  f"{args.prefill}-token prefill {trials.prefill_s * 1e3:.0f} ms, metrics round trip "
                  f"{trials.poll_rtt_s * 1e3:.2f} ms")
            results: dict[str, dict[str, Any]] = {}
            plan = [(p, m) for p in PHASES for m in MODES]
            samples: dict[tuple[str, str], list[float]] = {k: [] for k in plan}
            late: dict[tuple[str, str], int] = {k: 0 for k in plan}
            for i in range(args.trials):  # interleaved: every cell sees the same drift
                for phase, mode in plan[i % len(plan):] + plan[: i % len(plan)]:
                    lat = await trials.one(mode, phase, monitor)
                    if lat is None:
                        late[(phase, mode)] += 1
                    else:
                        samples[(phase, mode)].append(lat)
                print(f"trial {i + 1}/{args.trials} done")
    print(f"\n{'phase':<8} {'mode':<12} {'n':>3} {'late':>4} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'p50 steps':>9} {'p99 steps':>9}")
    for (phase, mode), xs in samples.items():
        row: dict[str, Any] = {"n": len(xs), "late": late[(phase, mode)]}
        if xs:
            p50, p99 = percentile(xs, 50), percentile(xs, 99)
            row.update(p50_ms=p50 * 1e3, p99_ms=p99 * 1e3, max_ms=max(xs) * 1e3,
                       p50_steps=p50 / trials.step_s, p99_steps=p99 / trials.step_s,
                       samples_ms=[round(x * 1e3, 3) for x in xs])
            print(f"{phase:<8} {mode:<12} {len(xs):>3} {row['late']:>4} {row['p50_ms']:8.1f} "
                  f"{row['p99_ms']:8.1f} {row['max_ms']:8.1f} {row['p50_steps']:9.2f} {row['p99_steps']:9.2f}")
        results.setdefault(phase, {})[mode] = row
    env["load_average_after"] = load_average()
    return {
        "environment": env,
        "settings": {"trials": args.trials, "prefill_tokens": args.prefill, "threads": args.threads,
                     "seed": args.seed},
        "calibration": {"decode_step_ms": trials.step_s * 1e3, "ttft_ms": trials.ttft_s * 1e3,
                        "prefill_ms": trials.prefill_s * 1e3, "metrics_rtt_ms": trials.poll_rtt_s * 1e3},
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.worker.cancel_latency", description=__doc__.splitlines()[0])
    options.add_quick(p, "tiny model, 5 trials")
    options.add_model(p, "GGUF file (default: the bench preset; tiny with --quick)")
    p.add_argument("--trials", type=int, default=None, help="trials per cell (default 30; 5 with --quick)")
    p.add_argument("--prefill", type=int, default=2048, help="prompt tokens of the prefill phase (default 2048)")
    options.add_threads(p, None, "llama.cpp threads (default: serve's default)")
    options.add_seed(p)
    options.add_out_dir(p)
    args = p.parse_args(argv)
    args.trials = args.trials or (5 if args.quick else 30)
    if args.threads is None:
        args.threads = default_threads()
    model = args.model or options.default_model(args.quick, progress=False)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = trio.run(run, args, model)
    report["environment"]["command"] = " ".join(["python", "-m", "bench.worker.cancel_latency", *(sys.argv[1:] if argv is None else argv)])
    path = args.out_dir / "cancel_latency.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
