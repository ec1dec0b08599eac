"""What one session-step costs the worker's CPU when many sessions generate at once.

Each ``--sessions`` count N (default 1, 8 and 32) generates ``--tokens`` tokens per session, all
N at once over one ``ShardClient`` connection (and max/N such generations in a row, so that
every count makes about as many tokens), against ``python -m bench.common.fake_worker`` with the
batched fake engine and next to no compute (ticks cost nothing, a one-layer model 8 wide): what
the worker spends is its event loop's work, the serving stack (transport, session, scheduler,
engine bookkeeping) and not a model's. The worker is pinned to one core and the client to the
other (when there are two), so ``tokens_per_s`` is what one worker process sustains on one
core; ``worker_cpu_us`` is its CPU time (``/proc``, user + system) per session-step, i.e. per
token generated, and ``client_cpu_us`` the client's. ``fake_row_us`` is the part of a
session-step that stands for a model's compute: the fake model's own numerics per row,
measured in this process without a server.

``--group`` measures a pipeline hop's side instead (issue 55): the client steps every session
(one Decode per session per step, as the client relay drives a hop), all N sessions in one batch
group, once on their own streams (``per_session``) and once as one ``GroupSteps`` message per
tick (``group``), the two alternating round by round on two workers of this checkout; ``ratios``
divides ``group``'s medians by ``per_session``'s (the issue asks ``worker_cpu_us`` <= 0.3 at 8
and 32 sessions).

``--worker-root DIR`` runs a second worker from another checkout (e.g. the commit before a
change); the two alternate round by round (A, B, B, A, ...) so that drift hits both alike, and
``ratios`` divides this checkout's medians by the other's (below 1: this checkout spends less).

    python -m bench.worker.session_steps [--quick] [--sessions 1,8,32] [--tokens 300] [--rounds 3]
                                  [--group | --worker-root OTHER_CHECKOUT] [--out FILE] [--logs DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import AsyncExitStack, ExitStack
from typing import Any

import trio

from bench.common import options
from bench.common.environment import environment, save_record
from bench.common.fake_worker import SEED
from bench.common.processes import FAKE_WORKER, V10, cpu_seconds, module_in, served
from shard.client import ShardClient
from shard.engine import LoadSpec
from shard.engine.base import ComputePlan
from shard.engine.fake import FakeEngine, FakeModel, FakeScript

DEFAULT_OUT = options.RESULTS / "session_steps.json"
#: The fake worker: batched engine, ticks free, the smallest model (compute next to nothing).
FAKE_LAYERS, FAKE_EMBD = 1, 8
FAKE = ["--tick-ms", "0", "--row-ms", "0", "--n-layers", str(FAKE_LAYERS), "--n-embd", str(FAKE_EMBD)]


async def fake_row_us(rows: int = 20000) -> float:
    """Microseconds of CPU the fake model's own numerics take per decode row (one position
    through the fake worker's model and its logits), measured here without a server: the part
    of ``worker_cpu_us`` that stands for a model's compute, not the serving stack's."""
    engine = FakeEngine(model=FakeModel(n_layers_total=FAKE_LAYERS, n_embd=FAKE_EMBD, seed=SEED),
                        script=FakeScript(batched=True))
    await engine.load(LoadSpec(n_ctx=4096, max_sessions=1))
    try:
        plan, cells = ComputePlan(0, (5,), None), []
        start = time.process_time()
        for _ in range(rows):
            engine._output([engine._compute_position(plan, 0, cells)], plan)  # noqa: SLF001
            if len(cells) > 64:
                cells.clear()
        return round((time.process_time() - start) * 1e6 / rows, 1)
    finally:
        await engine.aclose()


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def pin_worker() -> list[str]:
    """A command prefix pinning a worker to the first core (none on a one-core machine)."""
    return ["taskset", "-c", str(cores()[0])] if len(cores()) > 1 else []


async def one_round(
    target: str, pid: int, sessions: int, tokens: int, repeat: int = 1
) -> dict[str, float]:
    """``sessions`` generations of ``tokens`` tokens at once, each ``repeat`` times in a row
    (so that few sessions still make enough tokens for the CPU clock's 10 ms ticks); per-token
    CPU and the rate."""
    got = 0

    async def generate(client: ShardClient, i: int) -> None:
        nonlocal got
        for _ in range(repeat):
            async for _ in client.generate([1, 2, 3, 4 + i % 200], max_tokens=tokens, ignore_eos=True):
                got += 1

    async with ShardClient.connect(target, timeout=600, version=V10) as client:
        cpu0, t0, c0 = cpu_seconds(pid), time.perf_counter(), time.process_time()
        async with trio.open_nursery() as nursery:
            for i in range(sessions):
                nursery.start_soon(generate, client, i)
        cpu1, t1, c1 = cpu_seconds(pid), time.perf_counter(), time.process_time()
    assert got == sessions * tokens * repeat, (got, sessions, tokens, repeat)
    return {
        "tokens_per_s": round(got / (t1 - t0), 1),
        "worker_cpu_us": round(1e6 * (cpu1 - cpu0) / got, 1),
        "client_cpu_us": round(1e6 * (c1 - c0) / got, 1),
    }


async def stepped_round(
    target: str, pid: int, sessions: int, tokens: int, group: bool
) -> dict[str, float]:
    """``sessions`` sessions of one batch group, each stepped ``tokens`` times by the client:
    on their own streams, or as one GroupSteps message per tick (``group``)."""
    async with ShardClient.connect(target, timeout=600) as client, AsyncExitStack() as stack:
        opened = [await stack.enter_async_context(client.session(batch_group=1))
                  for _ in range(sessions)]
        last = [(await s.prefill([1, 2, 3, 4 + i % 200])).logits.token_id
                for i, s in enumerate(opened)]
        stream = await stack.enter_async_context(client.group_steps()) if group else None

        async def alone(i: int) -> None:
            for _ in range(tokens):
                last[i] = (await opened[i].decode(last[i])).logits.token_id

        cpu0, t0, c0 = cpu_seconds(pid), time.perf_counter(), time.process_time()
        if stream is not None:
            for _ in range(tokens):
                outcomes = await stream.step([(s, s.decode_message(t)) for s, t in zip(opened, last)])
                for o in outcomes:
                    if isinstance(o, Exception):
                        raise o
                last = [o.logits.token_id for o in outcomes]  # type: ignore[union-attr]
        else:
            async with trio.open_nursery() as nursery:
                for i in range(sessions):
                    nursery.start_soon(alone, i)
        cpu1, t1, c1 = cpu_seconds(pid), time.perf_counter(), time.process_time()
    got = sessions * tokens
    return {
        "tokens_per_s": round(got / (t1 - t0), 1),
        "worker_cpu_us": round(1e6 * (cpu1 - cpu0) / got, 1),
        "client_cpu_us": round(1e6 * (c1 - c0) / got, 1),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    roots = options.checkouts(args)
    if args.group:  # one worker, two ways of stepping it
        roots = {"per_session": roots["this"], "group": roots["this"]}
    rows: dict[str, dict[int, list[dict[str, float]]]] = {n: {s: [] for s in args.sessions} for n in roots}
    ctx = max(args.sessions) * (args.tokens + 64)
    with ExitStack() as stack:
        servers = {
            name: stack.enter_context(served(
                [*pin_worker(), sys.executable, "-m", module_in(root, *FAKE_WORKER), *FAKE, "--port", "0",
                 "--max-sessions", str(max(args.sessions)), "--ctx", str(ctx)],
                log=args.logs / f"session_steps_{name}.log", root=root, fake=True))
            for name, root in roots.items()
        }
        order = list(roots)
        for round_no in range(args.rounds + 1):  # round 0 warms both up and is dropped
            for name in (order if round_no % 2 == 0 else order[::-1]):
                srv = servers[name]
                for n in args.sessions:
                    repeat = max(1, max(args.sessions) // n)  # about as many tokens for every n
                    tokens = 16 if round_no == 0 else args.tokens
                    if args.group:  # (every session steps ``tokens`` times: its KV budget)
                        row = await stepped_round(srv.target, srv.proc.pid, n, tokens,
                                                  name == "group")
                    else:
                        row = await one_round(srv.target, srv.proc.pid, n, tokens, repeat)
                    if round_no:
                        rows[name][n].append(row)
                        print(f"round {round_no} {name:5} sessions={n:3} "
                              + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    medians = {name: {n: {k: statistics.median(r[k] for r in per[n]) for k in per[n][0]}
                      for n in args.sessions} for name, per in rows.items()}
    result: dict[str, Any] = {"rounds": rows, "medians": medians, "fake_row_us": await fake_row_us()}
    if args.group:
        result["ratios"] = {n: {k: round(medians["group"][n][k] / medians["per_session"][n][k], 3)
                                for k in ("worker_cpu_us", "tokens_per_s", "client_cpu_us")}
                            for n in args.sessions}
    if "other" in medians:
        result["ratios"] = {n: {k: round(medians["this"][n][k] / medians["other"][n][k], 3)
                                for k in ("worker_cpu_us", "tokens_per_s", "client_cpu_us")}
                            for n in args.sessions}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.worker.session_steps", description=__doc__.split("\n")[0])
    p.add_argument("--sessions", default="1,8,32",
                   help="comma-separated counts of concurrent sessions (default 1,8,32)")
    options.add_tokens(p, 300, "tokens per session per round (default 300)")
    options.add_rounds(p, 3, "measured rounds per worker (default 3)")
    options.add_worker_root(p, "also measure a worker from this checkout")
    p.add_argument("--group", action="store_true",
                   help="client-stepped sessions: per session vs one GroupSteps message per tick")
    options.add_quick(p, "a smoke run: 2 and 4 sessions, 40 tokens, 1 round")
    options.add_out(p, DEFAULT_OUT, f"result file (default {DEFAULT_OUT})")
    options.add_logs(p, help="the workers' logs")
    args = p.parse_args(argv)
    try:
        args.sessions = sorted({int(x) for x in args.sessions.split(",") if x.strip()})
    except ValueError:
        p.error("--sessions takes comma-separated integers")
    if not args.sessions or min(args.sessions) < 1 or args.tokens < 1 or args.rounds < 1:
        p.error("--sessions, --tokens and --rounds must be positive")
    if args.quick:
        args.sessions, args.tokens, args.rounds = [2, 4], 40, 1
    if args.group and args.worker_root is not None:
        p.error("--group compares two ways of stepping one worker: no --worker-root")
    if args.worker_root is not None and not (args.worker_root / "shard").is_dir():
        p.error(f"--worker-root {args.worker_root}: no shard/ package there")
    if len(cores()) > 1:
        os.sched_setaffinity(0, {cores()[1]})  # the client on a core the workers do not use
    results = trio.run(measure, args)
    save_record(args.out, {"environment": environment(None, 0, argv=sys.argv), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
