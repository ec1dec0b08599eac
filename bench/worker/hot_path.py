"""What a served token costs the worker's CPU outside ``llama_decode``, thread by thread.

Decode throughput at 2 threads is bounded by the Python work per token: every ggml thread has a
core, so whatever the worker's event loop and engine thread run per token competes with them
(docs/benchmarks.md, "CPU per token at 2 threads: the budget"). This bench measures that work directly, as CPU
time, which is far steadier than tokens/s on a shared machine: a live ``trio-shard serve``
generates ``--tokens`` tokens per pass (server-driven ``Generate``, then one client-driven
``Decode`` per token), and the worker's CPU time is read from ``/proc`` per thread before and
after each pass, next to the engine's own ``native_step_us_total`` (time inside
``llama_decode``). Per token it reports:

  main_cpu_us     the event loop's thread (transport, session, engine bookkeeping, results)
  engine_cpu_us   the engine's native thread, llama_decode included
  native_us       inside llama_decode (wall time; at 1 thread about its CPU time)
  outside_us      the whole process's CPU minus native_us: the Python work per token
  client_cpu_us   the bench's own process, the client (``ShardClient``) that reads the tokens

With ``--grpcio`` every round also reads one ``Generate`` with the official ``grpcio`` client
(``generate_grpcio``, bench/worker/grpcio_stream.py): HTTP/2 in C, so its ``client_cpu_us`` is what a
gRPC client costs without our Python transport. With ``--llama-server PATH`` every round also streams the same number of tokens from
llama.cpp's ``llama-server`` (one slot, the same threads) with the server-sent-event client of
bench/engine/decode_throughput.py, and reports its ``client_cpu_us`` and ``server_cpu_us`` (the whole
server process, its compute included): what the other stack's client costs next to ours
(bench/engine/cpu_budget.py prices that CPU when every core runs a ggml thread).

With ``--floor`` every round also measures the stack's floor at this worker's own pace
(bench/common/floor_server.py, read by ``ShardClient``'s transport, bench/worker/floor_reads.py): for
``generate``, a plain handler streams as many small step messages, each a native step apart
(the round's ``native_us`` per token, in which the prompt's compute is spread too, a little);
for ``decode``, it answers as many requests, each a native step after it came in.
``over_floor`` divides the worker's (this checkout's) medians by the floor's: what the worker
adds per token to a stack that does nothing but wake up, frame and send one message per step.

With ``--scheduler`` the workers run under ``bench/worker/scheduler_counts.py`` and every pass also
reports ``passes_per_token`` (scheduler passes, one ``epoll_wait`` each) and
``steps_per_token`` (task steps, with the busiest tasks apart): counts, nearly exact from one
pass to the next, where the CPU times above move by 10-20% on a shared machine.

With ``--worker-root DIR`` a second worker runs from another checkout and the two alternate
pass by pass (A, B, B, A, ...), so drift hits both alike; ``ratios`` divides this checkout's
median by the other's (below 1: this checkout spends less). CPU times come in clock ticks
(``SC_CLK_TCK``, usually 10 ms): keep ``--tokens`` x the per-token cost well above that.

    python -m bench.worker.hot_path [--quick] [--model PATH] [--tokens 400] [--rounds 3] [--threads 1]
                             [--worker-root OTHER_CHECKOUT] [--scheduler] [--llama-server PATH] [--grpcio]
                             [--floor]
                             [--out FILE] [--logs DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import trio

from bench.common import options
from bench.common.environment import environment, load_average
from bench.common.processes import (
    V10,
    free_port,
    http_server,
    served,
    shard_server,
    stream_sse,
    thread_cpu,
    wait_serving,
)
from bench.worker import floor_reads, grpcio_stream
from shard.client import ShardClient
from shard.v1 import shard_pb2 as pb

PROMPT = [1, *range(300, 319)]  # word pieces of the generated vocabularies (tiny: 812 tokens)
# (llama-server is given the same token ids: /completion takes a prompt as a list of ids)
MODES = ("generate", "decode")
#: The floor server's answer to each mode (bench/common/floor_server.py).
FLOOR_METHODS = {"generate": "FloorPaced", "decode": "FloorEcho"}
DEFAULT_OUT = options.RESULTS / "hot_path.json"
_COUNTER = Path(__file__).resolve().parent / "scheduler_counts.py"
_BUSIEST = 4  # tasks reported by name in steps_per_token


class SchedulerCounts:
    """Snapshots of a worker's scheduler counts (``bench/worker/scheduler_counts.py``), by SIGUSR1."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def read(self, pid: int) -> dict[str, Any]:
        self.path.unlink(missing_ok=True)
        os.kill(pid, signal.SIGUSR1)
        with trio.fail_after(10):
            while not self.path.exists():
                await trio.sleep(0.005)
        data: dict[str, Any] = json.loads(self.path.read_text())
        return data


async def _native_seconds(client: ShardClient) -> float:
    return (await client.metrics()).engine["native_step_us_total"] / 1e6


async def one_pass(
    client: ShardClient, pid: int, mode: str, tokens: int, counts: SchedulerCounts | None = None,
    channel: Any = None,
) -> dict[str, Any]:
    """One pass of ``tokens`` tokens; CPU and native time per token in microseconds (and the
    scheduler's passes and task steps per token, with ``counts``). ``channel``: a connected
    grpcio channel, for ``generate_grpcio``."""
    sched0 = await counts.read(pid) if counts is not None else None
    before, native0 = thread_cpu(pid), await _native_seconds(client)
    t0, c0 = time.perf_counter(), time.process_time()
    if mode == "generate":
        n = 0
        async for _ in client.generate(PROMPT, max_tokens=tokens + 1, ignore_eos=True):
            n += 1
        assert n == tokens + 1, n
    elif mode == "generate_grpcio":  # the same stream read by grpcio (in a thread: it blocks)
        assert channel is not None
        n = len(await trio.to_thread.run_sync(lambda: grpcio_stream.generate(
            channel, PROMPT, tokens + 1, version=pb.ProtocolVersion(major=V10[0], minor=V10[1]))))
        assert n == tokens + 1, n
    else:
        async with client.session(f"hot-{time.monotonic_ns()}") as s:
            token = (await s.prefill(PROMPT)).logits.token_id
            for _ in range(tokens):
                token = (await s.decode(token=token)).logits.token_id
    wall, client_cpu = time.perf_counter() - t0, time.process_time() - c0
    after, native1 = thread_cpu(pid), await _native_seconds(client)
    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    main = spent.get(str(pid), 0.0)  # the main thread's id is the process id
    busiest_other = max((v for tid, v in spent.items() if tid != str(pid)), default=0.0)
    native = native1 - native0
    per = 1e6 / tokens
    row: dict[str, Any] = {
        "tokens": tokens,
        "wall_us": wall * per,
        "main_cpu_us": main * per,
        "engine_cpu_us": busiest_other * per,
        "native_us": native * per,
        "outside_us": (sum(spent.values()) - native) * per,
        "client_cpu_us": client_cpu * per,
    }
    if counts is not None and sched0 is not None:
        sched1 = await counts.read(pid)
        steps = {name: (n - sched0["steps"].get(name, 0)) / tokens
                 for name, n in sched1["steps"].items()}
        busiest = sorted(steps.items(), key=lambda kv: -kv[1])[:_BUSIEST]
        row["passes_per_token"] = (sched1["passes"] - sched0["passes"]) / tokens
        row["steps_per_token"] = sum(steps.values())
        row["steps_by_task"] = {name: round(n, 2) for name, n in busiest}
    return row


def llama_server_pass(port: int, pid: int, tokens: int) -> dict[str, Any]:
    """``tokens`` greedy tokens from llama-server (EOS ignored) read by the SSE client: CPU per
    token of this process (the client) and of the whole server process."""
    body = {"prompt": PROMPT, "n_predict": tokens + 1, "temperature": 0, "top_k": 1, "stream": True,
            "ignore_eos": True, "cache_prompt": False}
    before, t0, c0 = thread_cpu(pid), time.perf_counter(), time.process_time()
    _, events = stream_sse(port, "/completion", body)
    wall, client_cpu, after = time.perf_counter() - t0, time.process_time() - c0, thread_cpu(pid)
    streamed = int(events[-1][1].get("tokens_predicted", 0)) if events else 0
    if streamed != tokens + 1:
        raise RuntimeError(f"llama-server streamed {streamed} tokens, expected {tokens + 1}")
    per = 1e6 / tokens
    return {"tokens": tokens, "wall_us": wall * per, "client_cpu_us": client_cpu * per,
            "server_cpu_us": sum(after[t] - before.get(t, 0.0) for t in after) * per}


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: round(statistics.median(r[k] for r in rows), 2 if "per_token" in k else 1)
            for k in rows[0] if not isinstance(rows[0][k], dict)}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    roots = options.checkouts(args)
    modes = (*MODES, "generate_grpcio") if args.grpcio else MODES
    passes: dict[str, dict[str, list[dict[str, float]]]] = {
        name: {m: [] for m in modes} for name in roots
    }
    if args.llama_server is not None:
        passes["llama_server"] = {"generate": []}
    servers = {}
    counts: dict[str, SchedulerCounts | None] = {name: None for name in roots}
    with ExitStack() as stack:
        for name, root in roots.items():
            wrap: list[str] = []
            if args.scheduler:
                counts[name] = SchedulerCounts(args.logs / f"hot_path_{name}.counts.json")
                wrap = [sys.executable, str(_COUNTER), str(counts[name].path), "--"]
            servers[name] = stack.enter_context(shard_server(
                args.model, threads=args.threads, ctx=2 * (args.tokens + 128), max_sessions=2,
                log=args.logs / f"hot_path_{name}.log", root=root, wrap=wrap))
        ls = None
        if args.llama_server is not None:
            port = free_port()
            ls = stack.enter_context(http_server(
                [str(args.llama_server), "-m", str(args.model), "--host", "127.0.0.1", "--port", str(port),
                 "-t", str(args.threads), "-tb", str(args.threads), "-c", str(2 * (args.tokens + 128)),
                 "-np", "1", "--no-warmup"],
                port=port, ready_path="/health", log=args.logs / "hot_path_llama_server.log"))
        floor = None
        if args.floor:
            floor = stack.enter_context(served(
                [sys.executable, "-m", "bench.common.floor_server", "--impl", "transport"],
                log=args.logs / "hot_path_floor.log", fake=True))
            passes["floor"] = {m: [] for m in MODES}
        for srv in servers.values():
            await wait_serving(srv.target, version=V10)
        order = list(roots)
        for round_no in range(args.rounds + 1):  # round 0 warms up and is dropped
            names = order if round_no % 2 == 0 else order[::-1]
            for name in names:
                srv = servers[name]
                channel = grpcio_stream.connect(srv.target) if args.grpcio else None
                try:
                    async with ShardClient.connect(srv.target, timeout=600, version=V10) as client:
                        for mode in modes:
                            row = await one_pass(client, srv.proc.pid, mode,
                                                 8 if round_no == 0 else args.tokens, counts[name],
                                                 channel)
                            if round_no:
                                passes[name][mode].append(row)
                                print(f"round {round_no} {name:5} {mode:8} "
                                      + " ".join(f"{k}={v:.0f}" if "per_token" not in k else f"{k}={v:.2f}"
                                                 for k, v in row.items() if not isinstance(v, dict)),
                                      flush=True)
                finally:
                    if channel is not None:
                        channel.close()
            if floor is not None:  # at the pace this round's native steps set
                async with ShardClient.connect(floor.target, timeout=600) as client:
                    for mode in MODES:
                        pace = passes["this"][mode][-1]["native_us"] if round_no else 1000.0
                        row = await floor_reads.floor_pass(
                            floor.proc.pid, FLOOR_METHODS[mode], 8 if round_no == 0 else args.tokens,
                            pace_us=pace, client=client)
                        if round_no:
                            passes["floor"][mode].append(row)
                            print(f"round {round_no} floor {mode:8} "
                                  + " ".join(f"{k}={v:.0f}" for k, v in row.items()), flush=True)
            if ls is not None:  # blocking, between passes: nothing else runs meanwhile
                row = llama_server_pass(ls.port, ls.proc.pid, 8 if round_no == 0 else args.tokens)
                if round_no:
                    passes["llama_server"]["generate"].append(row)
                    print(f"round {round_no} llama-server " + " ".join(f"{k}={v:.0f}" for k, v in row.items()),
                          flush=True)
    medians = {name: {m: _median(rows) for m, rows in per.items()} for name, per in passes.items()}
    result: dict[str, Any] = {"passes": passes, "medians": medians}
    if "other" in medians:
        result["ratios"] = {
            m: {k: round(medians["this"][m][k] / medians["other"][m][k], 3)
                for k in ("main_cpu_us", "engine_cpu_us", "outside_us", "passes_per_token",
                          "steps_per_token") if medians["other"][m].get(k)}
            for m in modes
        }
    if "floor" in medians:
        result["over_floor"] = {
            m: {k: round(medians["this"][m][k] / max(medians["floor"][m][f], 1e-9), 2)
                for k, f in (("main_cpu_us", "server_main_us"), ("client_cpu_us", "client_cpu_us"))}
            for m in MODES
        }
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.worker.hot_path", description=__doc__.split("\n")[0])
    options.add_tokens(p, 400, "tokens per pass (default 400)")
    options.add_rounds(p, 3, "timed rounds (default 3)")
    options.add_threads(p, 1, "llama.cpp threads (default 1)")
    p.add_argument("--llama-server", type=Path, metavar="PATH",
                   help="also stream from llama.cpp's llama-server each round (client and server CPU per token)")
    p.add_argument("--grpcio", action="store_true",
                   help="also read the Generate stream with the official grpcio client (generate_grpcio)")
    p.add_argument("--floor", action="store_true",
                   help="also measure the stack's floor at the worker's pace each round (over_floor)")
    p.add_argument("--scheduler", action="store_true",
                   help="also count scheduler passes and task steps per token (bench/worker/scheduler_counts.py)")
    options.add_common(p, DEFAULT_OUT, quick="tiny model, 64 tokens, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.rounds = 64, 1
    options.resolve(args)
    env = environment(args.model, args.threads, argv=sys.argv if argv is None else argv)  # load before
    result = trio.run(measure, args)
    env["load_average_after"] = load_average()
    report = {
        "environment": env,
        "settings": {"tokens": args.tokens, "rounds": args.rounds, "threads": args.threads,
                     "worker_root": str(args.worker_root) if args.worker_root else None,
                     "scheduler": args.scheduler,
                     "llama_server": str(args.llama_server) if args.llama_server else None,
                     "grpcio": args.grpcio, "floor": args.floor},
        **result,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, per in result["medians"].items():
        for mode, row in per.items():
            print(f"median {name:5} {mode:8} " + " ".join(f"{k}={v}" for k, v in row.items()))
    for mode, row in result.get("ratios", {}).items():
        print(f"ratio this/other {mode:8} " + " ".join(f"{k}={v}" for k, v in row.items()))
    for mode, row in result.get("over_floor", {}).items():
        print(f"this over floor {mode:8} " + " ".join(f"{k}={v}" for k, v in row.items()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
