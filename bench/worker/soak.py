"""Soak a live ``trio-shard serve``: RSS and open file descriptors over thousands of sessions.

``--workers`` concurrent clients run ``--cycles`` session cycles in total on loopback, each
cycle picked at random: a generate that runs to its end, one cancelled by the client
(RST_STREAM) after a random number of tokens, one stopped by the ``Cancel`` RPC and then
closed, one cut by its deadline, one whose connection is dropped, and a retained close
followed by a resume and a release. The server's RSS (``/proc/PID/status``) and open fds
(``/proc/PID/fd``) are sampled every ``--sample-every`` cycles. At the end the worker must
hold no session and no KV cell; the report gives RSS and fd growth after the warm-up.

Counts are bounded and everything stays on 127.0.0.1.

    python -m bench.worker.soak [--quick] [--model PATH] [--cycles 3000] [--workers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any

import trio

from bench.common import options
from bench.common.environment import environment, load_average
from bench.common.processes import shard_server, status_kib, wait_serving
from shard.client import ShardClient, ShardError, cache_expectation
from shard.v1 import shard_pb2 as pb

KINDS = ("complete", "client_cancel", "cancel_rpc", "deadline", "disconnect", "retain_resume")


def proc_stats(pid: int) -> tuple[int, int]:
    """(RSS in KiB, open fds) of a Linux process."""
    return status_kib(pid, "VmRSS"), len(os.listdir(f"/proc/{pid}/fd"))


async def cycle(kind: str, client: ShardClient, target: str, rng: random.Random, n: int) -> None:
    prompt = [1] + [rng.randrange(3, 250) for _ in range(rng.randint(4, 40))]
    sid = f"soak-{n}"
    if kind == "complete":
        async for _ in client.generate(prompt, max_tokens=rng.randint(1, 12), ignore_eos=True):
            pass
    elif kind == "client_cancel":
        stop_after = rng.randint(1, 8)
        with trio.CancelScope() as scope:
            async with client.session(sid) as s:
                got = 0
                async for _ in s.generate(prompt, max_tokens=64, ignore_eos=True):
                    got += 1
                    if got >= stop_after:
                        scope.cancel()
    elif kind == "cancel_rpc":
        async with client.session(sid) as s:
            got = 0
            try:
                async for _ in s.generate(prompt, max_tokens=64, ignore_eos=True):
                    got += 1
                    if got == 2:
                        await client.cancel(sid)
            except ShardError:
                pass  # CANCELLED (or the generate ended first); the session stays usable
            await s.decode(prompt[-1])
    elif kind == "deadline":
        try:
            async with client.session(sid, timeout=rng.uniform(0.005, 0.05)) as s:
                async for _ in s.generate(prompt, max_tokens=10_000, ignore_eos=True):
                    pass
        except ShardError:
            pass
    elif kind == "disconnect":
        async with ShardClient.connect(target, timeout=60) as own:
            try:
                async with own.session(sid) as s:
                    got = 0
                    async for _ in s.generate(prompt, max_tokens=64, ignore_eos=True):
                        got += 1
                        if got == 3:  # drop the socket: no RST_STREAM, no GOAWAY
                            own._conn.stream.socket.shutdown(socket.SHUT_RDWR)  # noqa: SLF001
            except ShardError:
                pass
    elif kind == "retain_resume":
        async with client.session(sid) as s:
            step = await s.prefill(prompt)
            await s.close(retain=True)
        async with client.session(sid, cache=cache_expectation(prompt)) as s:
            if s.cache.outcome == pb.CacheResult.OUTCOME_HIT:
                await s.decode(step.logits.token_id)
            else:  # evicted or expired meanwhile (0.5 s TTL on a loaded machine): start over
                await s.prefill(prompt)
        await client.release(sid)
    else:
        raise ValueError(kind)


async def run(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    env = environment(model, args.threads)
    log = args.out_dir / "logs" / "trio-shard-soak.log"
    samples: list[dict[str, Any]] = []
    counts = {k: 0 for k in KINDS}
    errors: dict[str, int] = {}
    with shard_server(model, threads=args.threads, ctx=args.workers * 256 + 256,
                      max_sessions=2 * args.workers, log=log, extra=["--resume-ttl", "0.5"]) as server:
        pid = server.proc.pid
        await wait_serving(server.target)
        done = 0
        t0 = time.perf_counter()

        def sample() -> None:
            rss, fds = proc_stats(pid)
            samples.append({"cycles": done, "seconds": round(time.perf_counter() - t0, 2),
                            "rss_kib": rss, "fds": fds})

        sample()
        async with ShardClient.connect(server.target, timeout=120) as client:

            async def worker(w: int) -> None:
                nonlocal done
                rng = random.Random(args.seed * 1000 + w)
                while done < args.cycles:
                    n = done
                    done += 1
                    kind = rng.choice(KINDS)
                    counts[kind] += 1
                    try:
                        await cycle(kind, client, server.target, rng, n)
                    except ShardError as err:  # counted, never fatal: the soak looks for leaks
                        errors[f"{kind}:{err.code.name}"] = errors.get(f"{kind}:{err.code.name}", 0) + 1
                    if done % args.sample_every == 0:
                        sample()
                        if done % (args.sample_every * 10) == 0:
                            print(f"{done} cycles, rss {samples[-1]['rss_kib'] / 1024:.1f} MiB, "
                                  f"fds {samples[-1]['fds']}")

            async with trio.open_nursery() as nursery:
                for w in range(args.workers):
                    nursery.start_soon(worker, w)
            with trio.fail_after(30):  # retained sessions expire after the 0.5 s TTL
                while True:
                    m = await client.metrics()
                    if m.engine["sessions_active"] == 0 and m.engine["kv_cells_used"] == 0:
                        break
                    await trio.sleep(0.1)
            final_metrics = {"engine": dict(m.engine), "worker": dict(m.worker)}
        await trio.sleep(0.5)  # let the server notice the monitor connection is gone
        sample()
        alive = server.proc.poll() is None
    warm = samples[min(len(samples) - 1, max(1, len(samples) // 10))]
    last = samples[-1]
    span = max(1, last["cycles"] - warm["cycles"])
    summary = {
        "cycles": done,
        "seconds": last["seconds"],
        "rss_kib_start": samples[0]["rss_kib"],
        "rss_kib_after_warmup": warm["rss_kib"],
        "rss_kib_end": last["rss_kib"],
        "rss_growth_kib_per_1000_cycles_after_warmup": round((last["rss_kib"] - warm["rss_kib"]) * 1000 / span, 1),
        "fds_start": samples[0]["fds"],
        "fds_end": last["fds"],
        "server_alive": alive,
        "sessions_active_end": final_metrics["engine"]["sessions_active"],
        "kv_cells_used_end": final_metrics["engine"]["kv_cells_used"],
    }
    print(json.dumps(summary, indent=2))
    env["load_average_after"] = load_average()
    return {"environment": env, "settings": vars(args) | {"out_dir": str(args.out_dir)},
            "kinds": counts, "errors": errors, "summary": summary, "samples": samples,
            "final_metrics": final_metrics}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.worker.soak", description=__doc__.splitlines()[0])
    options.add_quick(p, "300 cycles")
    options.add_model(p, "GGUF file (default: the tiny preset: leaks, not speed)")
    p.add_argument("--cycles", type=int, default=None, help="session cycles in total (default 3000)")
    p.add_argument("--workers", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--sample-every", type=int, default=50, help="cycles between samples (default 50)")
    options.add_threads(p, 1)
    options.add_seed(p)
    options.add_out_dir(p)
    args = p.parse_args(argv)
    args.cycles = args.cycles or (300 if args.quick else 3000)
    model = args.model or options.default_model(False, preset="tiny", progress=False)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = trio.run(run, args, model)
    report["environment"]["command"] = " ".join(["python", "-m", "bench.worker.soak", *(sys.argv[1:] if argv is None else argv)])
    path = args.out_dir / "soak.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    ok = report["summary"]["server_alive"] and report["summary"]["sessions_active_end"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
