"""Where a decode step's time goes inside ``trio-shard serve`` (py-spy, sampling, no code change).

Starts a worker on the model, attaches ``py-spy record --threads --idle --nonblocking --duration`` to it
in the middle of a server-driven generate (so every sample falls on a decode step), and splits the samples per thread and per
category: the llama.cpp call itself (``llama_decode`` and its ctypes wrapper), the rest of the
worker thread's step (logits copy, KV bookkeeping), the thread hand-off, sampling, protobuf,
socket syscalls, the transport (HTTP/2 and gRPC framing), the session/servicer logic and
the event loop's idle wait. A raw low-level loop on the same model in the same run gives the ceiling step
time, so the overhead per step is ``served step - raw step``.

    python -m bench.worker.profile_server [--model PATH] [--tokens 400] [--threads N] [--rate 250]

Needs py-spy (the ``bench`` extra) and permission to ptrace the worker (root, or
``kernel.yama.ptrace_scope`` 0). The collapsed stacks are kept (``--out-dir``); speedscope.app
opens them.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

from bench.common import options
from bench.common.environment import default_threads, environment, load_average
from bench.common.processes import shard_server, wait_serving
from bench.engine.raw_loops import RawDecoder
from shard.client import ShardClient


# (category, predicate on one frame string "func (file:line)"), first match from the leaf wins.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("llama_decode (native)", ("llama_decode (llama_cpp/llama_cpp.py",)),
    ("socket send/recv (syscalls)", ("trio/_socket.py",)),
    ("thread hand-off (to_thread, wakeup)", ("trio/_threads.py", "trio/_core/_thread_cache.py",
                                             "trio/_core/_entry_queue.py", "trio/_core/_wakeup_socketpair.py",
                                             "threading.py", "shard/engine/native_thread.py")),
    ("sampling", ("shard/engine/sampling.py",)),
    ("protobuf", ("google/protobuf", "shard/rpc/convert.py", "shard_pb2")),
    ("transport (h2/gRPC framing)", ("shard/rpc/transport.py", "/h2/", "/hpack/", "purerpc")),
    ("engine bookkeeping", ("shard/engine/base.py", "shard/engine/types.py", "shard/engine/llama.py",
                            "shard/engine/lookahead.py", "shard/engine/scheduler.py")),
    ("session/servicer", ("shard/rpc/session/", "shard/rpc/servicer.py", "shard/rpc/registry.py")),
    ("trio scheduler", ("trio/_core/",)),
]


def categorize(stack: list[str]) -> str:
    for frame in reversed(stack):  # leaf first
        for name, needles in CATEGORIES:
            if any(n in frame for n in needles):
                return name
    return "other"


def parse_collapsed(path: Path) -> dict[str, collections.Counter[str]]:
    """Per-thread category counts from py-spy's ``--format raw`` (collapsed) output."""
    per_thread: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack_text, _, count = line.rpartition(" ")
        if not stack_text or not count.isdigit():
            continue
        frames = stack_text.split(";")
        thread = frames[0] if frames[0].startswith(("thread", "process")) else "?"
        frames = [f for f in frames if not f.startswith(("thread", "process"))]
        idle = False
        leaf = frames[-1] if frames else ""
        # py-spy --idle keeps samples of threads waiting in the kernel; name the common waits.
        if any(w in leaf for w in ("get_events (trio/_core/_io_epoll.py", "_work (trio/_core/_thread_cache.py",
                                   "wait (threading.py", "acquire")):
            idle = True
        cat = "idle (waiting)" if idle and "llama_decode" not in stack_text else categorize(frames)
        per_thread[thread][cat] += int(count)
    return per_thread


async def drive(target: str, prompt: list[int], n_tokens: int) -> list[float]:
    async with ShardClient.connect(target, timeout=600) as client:
        times = []
        async for _ in client.generate(prompt, max_tokens=n_tokens, ignore_eos=True):
            times.append(time.perf_counter())
    return times


async def drive_profiled(target: str, prompt: list[int], n_tokens: int, spy_cmd: list[str],
                         duration: float) -> tuple[list[float], float, float]:
    """Generate while ``py-spy record --duration`` runs entirely inside the generation, so
    every sample falls on a decode step; returns token times and the recording window."""
    window = [0.0, 0.0]
    times: list[float] = []
    async with ShardClient.connect(target, timeout=600) as client:
        async with trio.open_nursery() as nursery:
            started = trio.Event()

            async def generate() -> None:
                async for _ in client.generate(prompt, max_tokens=n_tokens, ignore_eos=True):
                    times.append(time.perf_counter())
                    if len(times) == 8:
                        started.set()

            nursery.start_soon(generate)
            await started.wait()
            window[0] = time.perf_counter()
            await trio.run_process([*spy_cmd, "--duration", str(max(1, round(duration)))],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            window[1] = time.perf_counter()
            if len(times) >= n_tokens:
                raise RuntimeError("the generation ended before py-spy did: raise --tokens")
            nursery.cancel_scope.cancel()
    return times, window[0], window[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.worker.profile_server", description=__doc__.splitlines()[0])
    options.add_model(p, "GGUF file (default: the bench preset)")
    options.add_tokens(p, 400, "tokens generated while profiling (default 400)")
    options.add_threads(p, None, "llama.cpp threads (default: serve's default)")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second (default 250)")
    options.add_out_dir(p)
    args = p.parse_args(argv)
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(pyspy).exists():
        print("py-spy is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    if args.threads is None:
        args.threads = default_threads()
    model = args.model or options.default_model(False, progress=False)
    out = args.out_dir / "profile"
    out.mkdir(parents=True, exist_ok=True)
    env = environment(model, args.threads)
    per_session = 256 * ((args.tokens + 64 + 255) // 256)  # prompt + tokens fit one session

    with RawDecoder(model, n_ctx=per_session, n_seq_max=1, threads=args.threads) as raw:
        prompt = raw.tokenize("The quick brown fox jumps over the lazy dog while the cat sleeps.")
        raw_before = raw.run(prompt, 1, min(args.tokens, 128))

    with shard_server(model, threads=args.threads, ctx=per_session, max_sessions=1,
                      log=args.out_dir / "logs" / "trio-shard-profile.log") as server:
        trio.run(wait_serving, server.target)
        trio.run(drive, server.target, prompt, 16)  # warm-up
        unprofiled = trio.run(drive, server.target, prompt, args.tokens)
        collapsed = out / "server_generate.collapsed.txt"
        collapsed.unlink(missing_ok=True)
        spy_cmd = [pyspy, "record", "--pid", str(server.proc.pid), "--rate", str(args.rate),
                   "--threads", "--idle", "--nonblocking", "--format", "raw", "-o", str(collapsed)]
        duration = 0.6 * (unprofiled[-1] - unprofiled[0])  # well inside a generation as long
        profiled, t0, t1 = trio.run(drive_profiled, server.target, prompt, args.tokens, spy_cmd, duration)
        if not collapsed.exists():
            print("py-spy wrote nothing (ptrace not allowed?)", file=sys.stderr)
            return 1
    record_s = t1 - t0
    in_window = [t for t in profiled if t0 <= t <= t1]

    with RawDecoder(model, n_ctx=per_session, n_seq_max=1, threads=args.threads) as raw:
        raw_after = raw.run(prompt, 1, min(args.tokens, 128))

    def step_ms(times: list[float]) -> float:
        return statistics.median(b - a for a, b in zip(times[1:], times[2:])) * 1e3

    n_steps = len(in_window)
    mean_ms = record_s / max(1, n_steps) * 1e3
    raw_ms = statistics.median([raw_before.seconds / raw_before.tokens, raw_after.seconds / raw_after.tokens]) * 1e3
    per_thread = parse_collapsed(collapsed)
    threads_out: dict[str, Any] = {}
    print(f"\nraw step {raw_ms:.2f} ms | served step {step_ms(unprofiled):.2f} ms unprofiled, "
          f"{step_ms(in_window):.2f} ms while profiled (median; mean {mean_ms:.2f} ms)")
    print(f"per decode step, by thread and category (ms/step; idle excluded; {n_steps} steps "
          f"in {record_s:.1f} s of recording):")
    for thread, counts in sorted(per_thread.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(counts.values())
        rate = total / record_s  # the rate py-spy really achieved for this thread
        threads_out[thread] = {
            k: {"samples": v, "ms_per_step": round(v / rate / n_steps * 1e3, 4)}
            for k, v in counts.most_common()
        }
        print(f"\n{thread} ({total} samples, {rate:.0f}/s)")
        for k, v in counts.most_common():
            if k != "idle (waiting)":
                print(f"  {k:<36} {v / rate / n_steps * 1e3:7.3f} ms")
    report = {
        "environment": env | {"load_average_after": load_average(),
                              "command": " ".join(["python", "-m", "bench.worker.profile_server", *(sys.argv[1:] if argv is None else argv)])},
        "raw_step_ms": raw_ms,
        "served_step_ms_unprofiled": step_ms(unprofiled),
        "served_step_ms_profiled": step_ms(in_window),
        "served_step_ms_profiled_mean": mean_ms,
        "record_seconds": record_s,
        "profiled_steps": n_steps,
        "threads": threads_out,
        "collapsed_stacks": str(collapsed),
    }
    (out / "profile.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out / 'profile.json'} and {collapsed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
