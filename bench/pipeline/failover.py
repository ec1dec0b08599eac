"""Failover recovery time against history length: a 3-hop pipeline whose middle worker dies.

Three ``trio-shard serve --layers`` workers (the model cut in thirds) and a replica of the
middle range, all on this machine. For each history length L the pipeline prefills an L-token
prompt, the middle worker is killed (SIGKILL) when the first token arrives, and the next step
fails over: the replica replays the L positions the middle hop held (docs/pipelines.md,
"Failover"). Per trial:

* ``recovery_ms``: from the failure reaching the client to the replica holding the history
  again (``Failover.recovery_ms``: open the session, replay the logged boundary rows);
* ``stall_ms``: what the caller waited in addition: the gap between tokens 1 and 2 less the
  median gap between the later tokens;
* ``prefill_ms``: the time to the first token (the whole chain prefilling L positions), for
  scale; ``log_bytes``: the middle hop's replay log (L x n_embd x 4 bytes, float32).

With ``--relays client,chain`` each length runs once per relay mode: with chain relay the
workers relay to each other (``serve --allow-relay``), the client moves the route to the replica
and the first hop replays the token log through the whole new route (every hop recomputes the
history, not only the replaced one), so its recovery is about the prefill time.

With ``--events kill,drain,drain-replay`` (client relay) each length also runs as a planned
drain: the middle worker gets SIGTERM at the first token (it sends GOAWAY and lets its streams
finish), and the hop hands over at its next step: ``drain`` moves the session's KV state to the
replica (session hand-off, docs/pipelines.md), ``drain-replay`` replays it there
(``Pipeline.connect(handoff=False)``), so the two are compared in one run. A drain's stall is
the largest gap between tokens less the median one (the hand-over comes at the first step
after GOAWAY arrived, not always the second token).

Each trial starts a fresh primary (the killed one is gone) and reconnects; the other workers
stay up. Timing lives here, never in tests.

    python -m bench.pipeline.failover [--preset bench|tiny] [--histories 16,64,256,1024] [--rounds 1]
                             [--relays client,chain] [--events kill,drain,drain-replay]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import time
from contextlib import ExitStack
from typing import Any

import trio

from bench.common import options
from bench.common.environment import environment, load_average
from bench.common.processes import ShardServer, shard_server, wait_serving
from shard.pipeline import DEFAULT_CHUNK_TOKENS, Pipeline
from shard.v1 import shard_pb2 as pb



def thirds(n_layers: int) -> list[str]:
    bounds = [round(i * n_layers / 3) for i in range(4)]
    return [f"{a}:{b}" for a, b in zip(bounds, bounds[1:])]


EVENTS = ("kill", "drain", "drain-replay")


async def trial(
    a: str, b1: ShardServer, b2: str, c: str, history: int, tokens: int, chunk: int, seed: int,
    relay: str = "client", event: str = "kill",
) -> dict[str, Any]:
    for target in (a, b1.target, b2, c):
        await wait_serving(target)
    async with Pipeline.connect([a, [b1.target, b2], c], timeout=600, relay=relay,
                                handoff=event != "drain-replay") as pipe:
        caps = pipe.hops[0].caps
        assert caps is not None
        rng = random.Random(seed)
        prompt = [1, *(rng.randrange(3, caps.n_vocab) for _ in range(history - 1))]
        arrivals: list[float] = []

        def on_token(_: pb.StepResult) -> None:
            arrivals.append(time.perf_counter())
            if len(arrivals) == 1 and event == "kill":
                b1.proc.send_signal(signal.SIGKILL)
                b1.proc.wait()  # dead before the next step is sent
            elif len(arrivals) == 1:
                b1.proc.send_signal(signal.SIGTERM)  # GOAWAY; it exits once handed over

        started = time.perf_counter()
        result = await pipe.generate(
            prompt, max_tokens=tokens, ignore_eos=True, chunk_tokens=chunk, on_token=on_token
        )
    (failover,) = result.failovers
    gaps = [y - x for x, y in zip(arrivals, arrivals[1:])]
    step = statistics.median(gaps[1:])
    stalled = gaps[0] if event == "kill" else max(gaps)
    if event != "kill":
        step = statistics.median(gaps)
    if failover.moved is not (event == "drain"):
        raise SystemExit(f"{event}: the hand-over {'moved' if failover.moved else 'replayed'} "
                         "the session (expected the other)")
    return {
        "relay": relay,
        "event": event,
        "history": history,
        "moved": failover.moved,
        "positions_replayed": 0 if failover.moved else failover.positions,
        "recovery_ms": round(failover.recovery_ms, 2),
        "stall_ms": round((stalled - step) * 1e3, 2),
        "step_ms": round(step * 1e3, 2),
        "prefill_ms": round((arrivals[0] - started) * 1e3, 1),
        # the middle hop's row log (client relay); chain relay keeps token ids only
        "log_bytes": failover.positions * caps.n_embd * 4 if relay == "client" else 0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pipeline.failover", description=__doc__.splitlines()[0])
    options.add_preset(p, help="model preset: bench (default) or tiny")
    p.add_argument("--histories", default="16,64,256,1024", help="prompt lengths (positions)")
    options.add_rounds(p, 1, "trials per length (medians reported)")
    options.add_tokens(p, 8, "tokens per trial (>= 4)")
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help=f"prefill (and replay) chunk_tokens (default {DEFAULT_CHUNK_TOKENS}, "
                   "the pipeline's over several hops)")
    options.add_threads(p, 1, "llama.cpp threads per worker")
    p.add_argument("--relays", default="client",
                   help="relay modes to measure, comma-separated: client (default), chain")
    p.add_argument("--events", default="kill",
                   help="what happens to the middle worker, comma-separated: kill (default: "
                        "SIGKILL, replay), drain (SIGTERM, its sessions' state moves), "
                        "drain-replay (SIGTERM, replayed); drains run with client relay")
    options.add_out_dir(p)
    args = p.parse_args(argv)
    histories = [int(h) for h in args.histories.split(",")]
    relays = [r.strip() for r in args.relays.split(",") if r.strip()]
    if not relays or any(r not in ("client", "chain") for r in relays):
        p.error(f"--relays: choose from client, chain (got {args.relays!r})")
    events = [e.strip() for e in args.events.split(",") if e.strip()]
    if not events or any(e not in EVENTS for e in events):
        p.error(f"--events: choose from {', '.join(EVENTS)} (got {args.events!r})")
    modes = [(relay, "kill") for relay in relays if "kill" in events]
    modes += [("client", e) for e in events if e != "kill"]
    from shard.models import ensure_model
    from shard.models.write import get_preset

    model = ensure_model(args.preset)
    ranges = thirds(get_preset(args.preset).n_layer)
    per_session = max(histories) + args.tokens + 64
    common = dict(threads=args.threads, ctx=2 * per_session, max_sessions=2)
    relaying = ["--allow-relay"] if "chain" in relays else []  # loopback peers only
    logs = args.out_dir / "logs"
    env = environment(model, args.threads, argv=["-m", "bench.pipeline.failover", *(sys.argv[1:] if argv is None else argv)])
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        a, b2, c = (
            stack.enter_context(shard_server(model, log=logs / f"failover-{name}.log",
                                             extra=["--layers", layers, *relaying], **common))  # type: ignore[arg-type]
            for name, layers in (("a", ranges[0]), ("b2", ranges[1]), ("c", ranges[2]))
        )
        for r in range(args.rounds):
            for history in histories:
                for relay, event in modes:
                    with shard_server(model, log=logs / "failover-b1.log",
                                      extra=["--layers", ranges[1], *relaying],
                                      **common) as b1:  # type: ignore[arg-type]
                        row = trio.run(trial, a.target, b1, b2.target, c.target, history,
                                       args.tokens, args.chunk, r * 1000 + history, relay, event)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    env["load_average_after"] = load_average()
    table = []
    print(f"\n{'relay':>6} {'event':>12} {'history':>8} {'recovery ms':>12} {'stall ms':>9} "
          f"{'step ms':>8} {'prefill ms':>11} {'log KiB':>8}")
    for relay, event in modes:
        for history in histories:
            mine = [row for row in rows if row["history"] == history and row["relay"] == relay
                    and row["event"] == event]

            def med(key: str, mine: list[dict[str, Any]] = mine) -> float:
                return round(statistics.median(row[key] for row in mine), 2)

            line = {"relay": relay, "event": event, "history": history, **{k: med(k) for k in
                    ("recovery_ms", "stall_ms", "step_ms", "prefill_ms", "log_bytes")}}
            table.append(line)
            print(f"{relay:>6} {event:>12} {history:>8} {line['recovery_ms']:>12.1f} "
                  f"{line['stall_ms']:>9.1f} {line['step_ms']:>8.1f} {line['prefill_ms']:>11.1f} "
                  f"{line['log_bytes'] / 1024:>8.0f}")
    moved = {row["history"]: row["recovery_ms"] for row in table if row["event"] == "drain"}
    replayed = {row["history"]: row["recovery_ms"] for row in table
                if row["event"] == "drain-replay"}
    ratios = {h: round(moved[h] / replayed[h], 3) for h in moved if h in replayed and replayed[h]}
    if ratios:
        print("\nhand-off recovery / replay recovery (drains, medians): " +
              ", ".join(f"{h}: {r}x" for h, r in ratios.items()))
    report = {
        "environment": env,
        "settings": {"preset": args.preset, "ranges": [ranges[0], f"{ranges[1]} x2", ranges[2]],
                     "histories": histories, "rounds": args.rounds, "tokens": args.tokens,
                     "chunk_tokens": args.chunk, "threads": args.threads, "relays": relays,
                     "events": events},
        "trials": rows,
        "medians": table,
        "handoff_over_replay": ratios,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "failover.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
