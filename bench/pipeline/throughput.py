"""More machines, more tokens: a pipeline's aggregate decode throughput under concurrency.

N concurrent greedy generations through one ``Pipeline`` (its shared connections), against
the whole model on one worker at the same N. Reported per configuration and N: the
steady-state aggregate tokens/s (the tokens that arrived while every generation was decoding,
over that window) and each worker's busy fraction (``native_step_us_total`` over the same
window: time in the engine's compute over wall time). Two parts:

* ``real``: the bench model (llama.cpp, 12 blocks), every worker ``--threads 1`` pinned to its
  own core with ``taskset`` (the client is not pinned): the whole model on core 0; the whole
  model with 2 threads on cores 0-1; two hops (``0:6`` on core 0, ``6:12`` on core 1) with
  client relay and with chain relay, each without batch groups ("before": every session shares
  every tick, ``batch_groups=0``) and with them ("after": the default, one group per hop,
  ``shard.pipeline.groups``), side by side in one run; with client relay "after" sends each hop
  one ``GroupSteps`` message per group per tick (protocol 1.3), and "after-per-session" the same
  groups with one message per session per step.
* ``sim``: ``bench.common.fake_worker`` processes (the batched fake engine: a tick sleeps its scripted
  cost, per layer, so H hops cost what one whole-model worker costs): H = 2, 4, 8 hops at 2H
  and 4H sessions, before and after, against one whole-model fake worker: the scheduling alone,
  for more hops than this machine has cores.

Ratios are from one run on one machine (the environment is recorded); never compare absolute
numbers across machines. Writes ``pipeline_throughput.json`` and ``.png`` to ``--out-dir``.

    python -m bench.pipeline.throughput [--quick] [--parts real,sim] [--sessions 1,8,16]
        [--tokens 48] [--relays client,chain] [--cuts half,7] [--sim-hops 2,4,8]
        [--sim-scale 1] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from bench.common import options
from bench.common.environment import environment, load_average
from bench.common.processes import (
    FAKE_WORKER,
    ShardServer,
    cpu_seconds,
    served,
    shard_server,
    wait_serving,
)
from shard.client import ShardClient
from shard.pipeline import Pipeline

#: Seconds between two reads of every worker's metrics (interpolated to the window's ends; a
#: read is a GetMetrics call the worker answers on its event loop, so not too often).
SAMPLE_EVERY = 0.1
PROMPT_TOKENS = 16


@dataclass(frozen=True)
class Run:
    """What one configuration at one session count measured."""

    tokens_per_s: float
    busy: list[float]  # per worker, over the steady-state window
    window_s: float
    tokens_in_window: int
    sessions: int
    #: Per worker, in the window: CPU time outside the engine's compute per session-step and
    #: per tick (the worker's own cost: protocol, scheduling, Python), in microseconds.
    cpu_us_per_step: list[float]
    cpu_us_per_tick: list[float]
    sessions_per_tick: list[float]
    #: This process's CPU (the pipeline client, and the sampling) per token, in microseconds.
    client_cpu_us_per_token: float
    #: Per worker, by thread (``/proc/PID/task``): the event loop's thread (the process's main
    #: thread: protocol, scheduling, sampling) per session-step, in microseconds, and the
    #: engine's threads (llama.cpp's compute) as a fraction of the window. ``busy`` is time
    #: inside the engine's native calls, which also counts the time the compute thread waited
    #: for its core while the event loop ran on it; ``compute_cpu`` is the CPU it got.
    loop_cpu_us_per_step: list[float]
    compute_cpu: list[float]
    #: Every process of the run (workers and client) together: CPU seconds per wall second (of
    #: the machine's ``os.cpu_count()`` cores; near it, the machine and not the scheduling is
    #: the limit).
    cores_used: float


_COUNTERS = ("native_step_us_total", "batch_sessions_total", "batch_ticks_total")


def _cpu_pair(pid: int) -> list[float]:
    """[all threads, the main thread] CPU seconds of ``pid`` (its main thread runs Trio)."""
    return [cpu_seconds(pid), cpu_seconds(pid, pid)]


def _prompt(i: int, vocab: int) -> list[int]:
    """Generation ``i``'s prompt: distinct token ids (past the first 300, the generated
    vocabularies' special and byte tokens, where there are that many)."""
    low = 300 if vocab > 600 else 3
    return [1, *(low + (i * 131 + k * 37) % (vocab - low) for k in range(PROMPT_TOKENS - 1))]


Sample = tuple[float, list[list[float]]]  # (time, per worker: the counters, CPU seconds, main thread)


def _at(samples: list[Sample], t: float, k: int, j: int) -> float:
    """Worker ``k``'s value ``j`` at time ``t``, interpolated between samples."""
    before = [s for s in samples if s[0] <= t]
    after = [s for s in samples if s[0] >= t]
    if not before:
        return after[0][1][k][j]
    if not after:
        return before[-1][1][k][j]
    (t0, v0), (t1, v1) = before[-1], after[0]
    if t1 == t0:
        return v0[k][j]
    return v0[k][j] + (v1[k][j] - v0[k][j]) * (t - t0) / (t1 - t0)


async def measure(
    targets: Sequence[str], workers: Sequence[ShardServer], *, sessions: int, tokens: int,
    relay: str, groups: int | None, group_steps: bool = True,
) -> Run:
    """``sessions`` concurrent generations of ``tokens`` tokens through ``targets``; the
    ``workers``' counters and CPU time are sampled meanwhile."""
    arrivals: list[list[float]] = [[] for _ in range(sessions)]
    samples: list[Sample] = []
    async with Pipeline.connect(list(targets), timeout=600, relay=relay, batch_groups=groups,
                                group_steps=group_steps) as pipe:
        caps = pipe.hops[0].caps
        assert caps is not None
        vocab = caps.n_vocab
        async with trio.open_nursery() as outer:
            clients = [await outer.start(_hold_client, w.target) for w in workers]

            async def read() -> None:
                values = []
                for c, w in zip(clients, workers):
                    engine = (await c.metrics()).engine
                    values.append([float(engine[k]) for k in _COUNTERS] + _cpu_pair(w.proc.pid))
                values.append([0.0, 0.0, 0.0, *_cpu_pair(os.getpid())])  # the client
                samples.append((time.perf_counter(), values))

            async def sample() -> None:
                while True:
                    await read()
                    await trio.sleep(SAMPLE_EVERY)

            outer.start_soon(sample)

            async def one(i: int) -> None:
                await pipe.generate(_prompt(i, vocab), max_tokens=tokens, ignore_eos=True,
                                    on_token=lambda _: arrivals[i].append(time.perf_counter()))

            async with trio.open_nursery() as gens:
                for i in range(sessions):
                    gens.start_soon(one, i)
            await read()
            outer.cancel_scope.cancel()
    # steady state: from the moment every generation has its first token (all prompts are in)
    # to the moment the first one ends
    start = max(a[0] for a in arrivals)
    end = min(a[-1] for a in arrivals)
    if end - start < 1e-3:  # one session: its decode steps
        start, end = arrivals[0][0], arrivals[0][-1]
    inside = sum(1 for a in arrivals for t in a if start < t <= end)
    window = end - start

    # The counters over the samples inside the window: a tick's native time is counted when it
    # ends, so interpolating across the window's start would credit part of the prompts' tick
    # (seconds long, ended just before the start) to the window (busy fractions above 1).
    inner = [s for s in samples if start <= s[0] <= end]
    if len(inner) >= 2:
        (t0, first), (t1, last) = inner[0], inner[-1]

        def delta(k: int, j: int) -> float:
            return last[k][j] - first[k][j]
    else:  # a window shorter than two reads: interpolate
        t0, t1 = start, end

        def delta(k: int, j: int) -> float:
            return _at(samples, end, k, j) - _at(samples, start, k, j)
    span = t1 - t0
    tokens_in_span = sum(1 for a in arrivals for t in a if t0 < t <= t1) or inside

    busy, per_step, per_tick, per_tick_sessions, loop, compute = [], [], [], [], [], []
    for k in range(len(workers)):
        native_s, steps, ticks, cpu_s, main_s = (delta(k, j) for j in range(5))
        native_s /= 1e6
        busy.append(round(native_s / span, 3))
        # the fake engine's "native" step is a sleep (no CPU): all its CPU is the worker's own
        own = cpu_s - (0.0 if workers[k].fake else native_s)
        per_step.append(round(own * 1e6 / steps, 1) if steps else 0.0)
        per_tick.append(round(own * 1e6 / ticks, 1) if ticks else 0.0)
        per_tick_sessions.append(round(steps / ticks, 2) if ticks else 0.0)
        loop.append(round(main_s * 1e6 / steps, 1) if steps else 0.0)
        compute.append(round((cpu_s - main_s) / span, 3))
    client = round(delta(len(workers), 3) * 1e6 / tokens_in_span, 1)
    cores = sum(delta(k, 3) for k in range(len(workers) + 1)) / span
    return Run(inside / window, busy, round(window, 3), inside, sessions, per_step, per_tick,
               per_tick_sessions, client, loop, compute, round(cores, 2))


async def _hold_client(target: str, task_status: trio.TaskStatus[ShardClient]) -> None:
    async with ShardClient.connect(target, timeout=600) as client:
        task_status.started(client)
        await trio.sleep_forever()


async def _ready(targets: Sequence[str]) -> None:
    for t in targets:
        await wait_serving(t)


def _row(name: str, run: Run, **extra: Any) -> dict[str, Any]:
    return {"config": name, "sessions": run.sessions, "tokens_per_s": round(run.tokens_per_s, 2),
            "busy": run.busy, "window_s": run.window_s, "tokens_in_window": run.tokens_in_window,
            "cpu_us_per_step": run.cpu_us_per_step, "cpu_us_per_tick": run.cpu_us_per_tick,
            "sessions_per_tick": run.sessions_per_tick,
            "client_cpu_us_per_token": run.client_cpu_us_per_token,
            "loop_cpu_us_per_step": run.loop_cpu_us_per_step, "compute_cpu": run.compute_cpu,
            "cores_used": run.cores_used, **extra}


# ---- real compute --------------------------------------------------------------------------


def _pinned(cores: str) -> list[str]:
    return ["taskset", "-c", cores] if shutil.which("taskset") and (os.cpu_count() or 1) >= 2 else []


def real_part(args: argparse.Namespace, logs: Path) -> list[dict[str, Any]]:
    from shard.models import ensure_model
    from shard.models.write import get_preset

    preset = "tiny" if args.quick else "bench"
    model = ensure_model(preset)
    n_layer = get_preset(preset).n_layer
    half = n_layer // 2  # the last hop also holds the output head: see --cuts
    ctx = max(args.sessions) * 256
    common: dict[str, Any] = dict(ctx=ctx, max_sessions=max(args.sessions), extra=["--allow-relay"])
    rows: list[dict[str, Any]] = []

    @contextmanager
    def workers(specs: Sequence[tuple[str, int, str]]) -> Iterator[list[ShardServer]]:
        with ExitStack() as stack:
            yield [stack.enter_context(shard_server(
                model, threads=threads, log=logs / f"throughput-{i}.log", wrap=_pinned(cores),
                **{**common, "extra": [*common["extra"], *(["--layers", layers] if layers else [])]}))
                for i, (layers, threads, cores) in enumerate(specs)]

    cuts = [half if c == "half" else int(c) for c in args.cuts]
    configs: list[tuple[str, list[tuple[str, int, str]]]] = [
        ("whole_1core", [("", 1, "0")]),
        ("whole_2threads", [("", 2, "0,1")]),
        *((f"hops2_cut{cut}", [(f"0:{cut}", 1, "0"), (f"{cut}:{n_layer}", 1, "1")]) for cut in cuts),
    ]
    for name, specs in configs:
        with workers(specs) as ws:
            targets = [w.target for w in ws]
            trio.run(_ready, targets)
            for n in args.sessions:
                if name.startswith("whole"):
                    run = trio.run(lambda: measure(targets, ws, sessions=n, tokens=args.tokens,
                                                   relay="client", groups=None))
                    rows.append(_row(name, run))
                    print(json.dumps(rows[-1]), flush=True)
                    continue
                for relay in args.relays:
                    for label, groups, steps in _variants(args.groups, relay):
                        run = trio.run(lambda: measure(targets, ws, sessions=n,
                                                       tokens=args.tokens, relay=relay,
                                                       groups=groups, group_steps=steps))
                        rows.append(_row(name, run, relay=relay, groups=label))
                        print(json.dumps(rows[-1]), flush=True)
    return rows


def _variants(groups: list[int] | None, relay: str) -> list[tuple[str, int | None, bool]]:
    """("before", 0: no batch groups), then "after" with the pipeline's default groups, or one
    "after-N" per count asked for; with client relay each "after" also without group steps
    ("-per-session": one message per session per step, as before protocol 1.3), side by side
    with them (label, groups, group steps)."""
    after = [("after", None)] if groups is None else [(f"after-{g}", g) for g in groups]
    out: list[tuple[str, int | None, bool]] = [("before", 0, False)]
    for label, g in after:
        if relay == "client":
            out.append((f"{label}-per-session", g, False))
        out.append((label, g, True))
    return out


# ---- simulation ----------------------------------------------------------------------------


def sim_part(args: argparse.Namespace, logs: Path) -> list[dict[str, Any]]:
    n_layers = 16
    costs = ["--tick-ms", str(args.sim_tick_ms * args.sim_scale),
             "--row-ms", str(args.sim_row_ms * args.sim_scale), "--per-layer", "--n-layers", str(n_layers)]
    rows: list[dict[str, Any]] = []

    @contextmanager
    def fakes(ranges: Sequence[str]) -> Iterator[list[ShardServer]]:
        with ExitStack() as stack:
            yield [stack.enter_context(served(
                [sys.executable, "-m", FAKE_WORKER[0], "--allow-relay", *costs,
                 *(["--layers", r] if r else [])], log=logs / f"fake-{i}.log", fake=True))
                for i, r in enumerate(ranges)]

    counts = sorted({k * h for h in args.sim_hops for k in (2, 4)})
    with fakes([""]) as (whole,):
        trio.run(_ready, [whole.target])
        for n in counts:
            run = trio.run(lambda: measure([whole.target], [whole], sessions=n,
                                           tokens=args.tokens, relay="client", groups=None))
            rows.append(_row("sim_whole", run, hops=1))
            print(json.dumps(rows[-1]), flush=True)
    for h in args.sim_hops:
        step = n_layers // h
        ranges = [f"{i * step}:{(i + 1) * step}" for i in range(h)]
        with fakes(ranges) as ws:
            targets = [w.target for w in ws]
            trio.run(_ready, targets)
            for n in (2 * h, 4 * h):
                for relay in args.relays:
                    for label, groups, steps in _variants(args.groups, relay):
                        run = trio.run(lambda: measure(targets, ws, sessions=n,
                                                       tokens=args.tokens, relay=relay,
                                                       groups=groups, group_steps=steps))
                        rows.append(_row(f"sim_hops{h}", run, hops=h, relay=relay, groups=label))
                        print(json.dumps(rows[-1]), flush=True)
    return rows


# ---- report --------------------------------------------------------------------------------


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each pipeline row against the whole model at the same session count (same run)."""
    whole = {(r["config"], r["sessions"]): r["tokens_per_s"] for r in rows
             if r["config"] in ("whole_1core", "whole_2threads", "sim_whole")}
    out = []
    for r in rows:
        if r["config"].startswith("hops"):
            n = r["sessions"]
            out.append({**{k: r[k] for k in ("config", "relay", "groups", "sessions")},
                        "vs_whole_1core": round(r["tokens_per_s"] / whole[("whole_1core", n)], 3),
                        "vs_whole_2threads": round(r["tokens_per_s"] / whole[("whole_2threads", n)], 3),
                        "busy": r["busy"], "compute_cpu": r["compute_cpu"]})
        elif r["config"].startswith("sim_hops"):
            n, h = r["sessions"], r["hops"]
            out.append({**{k: r[k] for k in ("config", "relay", "groups", "sessions", "hops")},
                        "vs_h_x_whole": round(r["tokens_per_s"] / (h * whole[("sim_whole", n)]), 3),
                        "min_busy": min(r["busy"]), "cores_used": r["cores_used"]})
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> str | None:
    """PNG of tokens/s against sessions per configuration; returns why not if it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"

    parts = [p for p in ("real", "sim") if any(r["config"].startswith("sim") == (p == "sim") for r in rows)]
    fig, axes = plt.subplots(1, len(parts), figsize=(6.5 * len(parts), 4.5), squeeze=False)
    for ax, part in zip(axes[0], parts):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # more series than tab10's 10 colours
        mine = [r for r in rows if r["config"].startswith("sim") == (part == "sim")]
        series: dict[str, list[tuple[int, float]]] = {}
        for r in mine:
            label = r["config"] + (f" {r['relay']} {r['groups']}" if "relay" in r else "")
            series.setdefault(label, []).append((r["sessions"], r["tokens_per_s"]))
        for label, points in sorted(series.items()):
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, marker="o", label=label,
                    linestyle="--" if "before" in label else "-")
        ax.set_xlabel("concurrent generations")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_title("bench model, 2 cores" if part == "real" else "batched fake engine (scripted ticks)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pipeline.throughput",
                                description=__doc__.splitlines()[0])
    options.add_quick(p, "tiny model, few sessions and tokens, 2 simulated hops: checks the harness")
    p.add_argument("--parts", default="real,sim", help="real, sim or both (default)")
    p.add_argument("--sessions", default="1,8,16", help="real part: session counts (default 1,8,16)")
    options.add_tokens(p, 48, "tokens per generation (default 48)")
    p.add_argument("--relays", default="client,chain", help="client, chain or both (default)")
    p.add_argument("--sim-hops", default="2,4,8", help="sim part: hop counts (default 2,4,8)")
    p.add_argument("--sim-tick-ms", type=float, default=0.3,
                   help="sim part: a tick's fixed cost per layer of 16, ms (default 0.3: a third of "
                   "a row, as the bench model's ticks on a CPU)")
    p.add_argument("--sim-row-ms", type=float, default=1.0,
                   help="sim part: a tick's cost per row and layer, ms (default 1)")
    p.add_argument("--sim-scale", type=float, default=1.0,
                   help="sim part: multiply both costs (a slower simulated machine): the fake "
                   "workers' own CPU per step stays what it is, so a larger scale leaves more of "
                   "this machine's cores idle and measures the scheduling alone (see cores_used)")
    p.add_argument("--groups", default=None,
                   help="batch groups of the 'after' runs, comma-separated counts, one run each "
                   "(default: the pipeline's own choice)")
    p.add_argument("--cuts", default="half",
                   help="real part: where the two hops are cut (blocks on the first hop), "
                   "comma-separated; 'half' (default) is 6 of the bench model's 12; the last hop "
                   "also holds the output head, so 7 balances it better")
    options.add_out_dir(p)
    args = p.parse_args(argv)
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    args.relays = [x.strip() for x in args.relays.split(",") if x.strip()]
    if not parts <= {"real", "sim"} or not parts:
        p.error("--parts: choose from real, sim")
    if not args.relays or not set(args.relays) <= {"client", "chain"}:
        p.error("--relays: choose from client, chain")
    args.sessions = [int(x) for x in args.sessions.split(",")]
    args.sim_hops = [int(x) for x in args.sim_hops.split(",")]
    args.groups = None if args.groups is None else [int(x) for x in args.groups.split(",")]
    args.cuts = [x.strip() for x in args.cuts.split(",") if x.strip()]
    if args.quick:
        args.sessions, args.tokens, args.sim_hops = [1, 4], min(args.tokens, 12), [2]
    logs = args.out_dir / "logs"
    rows: list[dict[str, Any]] = []
    if "real" in parts:
        rows += real_part(args, logs)
    if "sim" in parts:
        rows += sim_part(args, logs)
    env = environment(options.default_model(args.quick, progress=False), 1, argv=[
        "-m", "bench.pipeline.throughput", *(sys.argv[1:] if argv is None else argv)])
    env["load_average_after"] = load_average()
    report = {"environment": env, "settings": {
        "parts": sorted(parts), "sessions": args.sessions, "tokens": args.tokens,
        "relays": args.relays, "sim_hops": args.sim_hops, "cuts": args.cuts, "groups": args.groups, "sim_tick_ms_per_layer": args.sim_tick_ms,
        "sim_row_ms_per_layer": args.sim_row_ms, "sim_scale": args.sim_scale,
        "prompt_tokens": PROMPT_TOKENS},
        "rows": rows, "ratios": ratios(rows)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    why = plot(rows, args.out_dir / "pipeline_throughput.png")
    report["chart"] = why or "pipeline_throughput.png"
    path = args.out_dir / "pipeline_throughput.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["ratios"], indent=1))
    print(f"wrote {path}" + (f" ({why})" if why else " and pipeline_throughput.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
