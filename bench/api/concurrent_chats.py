"""Concurrent streamed chats through the door over one worker, beside llama-server.

At each concurrency N (default 1, 4, 8, 16) N clients send one streamed greedy ``POST
/v1/chat/completions`` each at once, every one a short distinct question asking for a long
answer of ``--tokens`` tokens. Variants, started once and measured in turns (the order rotates
each round, so drift of a shared machine hits both alike):

* ``door``: ``trio-shard api`` over one ``trio-shard serve`` (``--threads``, ``--ctx`` =
  ``--max-sessions`` x ``--session-ctx``);
* ``llama_server``: llama.cpp's server (``--llama-server PATH``: ``-t T -np N -c`` the same
  total, so each slot holds the same context as a worker session), same GGUF.

Equal lengths: llama-server takes ``ignore_eos``, the door does not. Both are sent the same
``logit_bias`` forbidding the model's end-of-generation tokens (``--eog``, default: the
worker's ``eos_token_id``) when the door accepts ``logit_bias``, and neither gets anything
otherwise: greedy decoding of one model and one prompt then ends alike on both. Each stream's
``completion_tokens`` is recorded, and rates count the tokens generated.

Per level and variant (medians over rounds): aggregate tokens/s (every stream's completion
tokens over the time from the first request to the last stream's end), time to first token
p50/p90 (to the first event with text), each stream's decode rate, and the CPU seconds per
token of the door process and the worker process (their sum is what the door's stack costs:
on 2 cores every millisecond the door spends is taken from llama.cpp's threads) beside
llama-server's. Ratios door/llama_server are the medians of each round's own ratio.

``--trace``: run the door under ``bench.api.door_trace`` and report its path to each
generation's first token by stage (milliseconds from the request's arrival at the handler), as
medians per level.

    python -m bench.api.concurrent_chats [--model smollm2-135m-instruct|chat|FILE]
        [--levels 1,4,8,16] [--rounds 3] [--tokens 96] [--threads 2] [--session-ctx 512]
        [--llama-server PATH] [--trace] [--out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from bench.api.chat_turns import model_path
from bench.common import options
from bench.common.environment import environment, save_record
from bench.common.processes import (
    cpu_seconds,
    free_port,
    http_server,
    shard_server,
    stream_sse,
    wait_serving,
)
from shard.client import ShardClient

#: Subjects of the questions; a question is made distinct by its round, level and stream.
SUBJECTS = (
    "a lighthouse keeper", "a river in spring", "an old clockmaker", "a city at night",
    "a mountain village", "a ship in a storm", "a desert caravan", "a library after closing",
    "a winter garden", "a train across the plains", "a forgotten island", "a market at dawn",
    "a young astronomer", "a bakery on a corner", "a wolf in the forest", "a painter's studio",
)
VARIANTS = ("door", "llama_server")


@dataclass
class Servers:
    """The running variants: their HTTP ports and the processes whose CPU is counted."""

    ports: dict[str, int]
    pids: dict[str, dict[str, int]]  # variant -> {"door": pid, "worker": pid} / {"server": pid}
    door_log: Path | None


def question(rnd: int, level: int, i: int) -> str:
    subject = SUBJECTS[(i + rnd * 5 + level) % len(SUBJECTS)]
    return (f"Write a long, detailed story about {subject} (story {rnd}-{level}-{i}). "
            "Describe every scene.")


def stream(port: int, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat: request time, first text, end, and the usage it reports."""
    sent, events = stream_sse(port, "/v1/chat/completions", body)
    ended = time.perf_counter()
    texts = [t for t, e in events if e.get("choices")
             and (e["choices"][0].get("delta") or {}).get("content")]
    if not texts:
        raise RuntimeError(f"port {port}: a chat streamed no text")
    usage = next((e["usage"] for _, e in reversed(events) if e.get("usage")), None)
    if usage is None:
        raise RuntimeError(f"port {port}: no usage in the stream")
    n = int(usage["completion_tokens"])
    return {"sent": sent, "first": texts[0], "last": texts[-1], "ended": ended,
            "tokens": n, "prompt_tokens": int(usage["prompt_tokens"]),
            "decode_tok_s": (n - 1) / (texts[-1] - texts[0]) if n > 1 and texts[-1] > texts[0]
            else 0.0}


def cpu_of(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def measure(servers: Servers, variant: str, level: int, rnd: int, body: dict[str, Any],
            pool: ThreadPoolExecutor) -> dict[str, Any]:
    """``level`` concurrent chats on one variant: the level's aggregate numbers."""
    port, pids = servers.ports[variant], servers.pids[variant]
    bodies = [{**body, "messages": [{"role": "user", "content": question(rnd, level, i)}]}
              for i in range(level)]
    cpu0 = cpu_of(pids)
    streams = list(pool.map(lambda b: stream(port, b), bodies))
    cpu1 = cpu_of(pids)
    tokens = sum(s["tokens"] for s in streams)
    span = max(s["ended"] for s in streams) - min(s["sent"] for s in streams)
    ttft = sorted((s["first"] - s["sent"]) * 1e3 for s in streams)
    row: dict[str, Any] = {
        "tok_s": tokens / span,
        "ttft_ms_p50": statistics.median(ttft),
        "ttft_ms_p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "decode_tok_s_p50": statistics.median(s["decode_tok_s"] for s in streams),
        "tokens": tokens,
        "prompt_tokens": statistics.median(s["prompt_tokens"] for s in streams),
        "seconds": span,
    }
    for name in pids:
        row[f"cpu_ms_per_tok_{name}"] = (cpu1[name] - cpu0[name]) * 1e3 / tokens
    row["cpu_ms_per_tok"] = sum(row[f"cpu_ms_per_tok_{n}"] for n in pids)
    return row


def eog_ids(target: str, given: Sequence[int] | None) -> list[int]:
    """The tokens to forbid: ``given``, else the worker's EOS (SmolLM2's ``<|im_end|>``; the
    capabilities name the chat template's other special tokens by text only)."""
    if given:
        return list(given)

    async def ask() -> list[int]:
        async with ShardClient.connect(target, timeout=10) as client:
            caps = await client.capabilities()
            return [caps.eos_token_id] if caps.eos_token_id >= 0 else []
    return trio.run(ask)


def accepts(port: int, body: dict[str, Any]) -> bool:
    """Whether the door takes ``body`` (a 400 for an unknown parameter says it does not)."""
    try:
        stream_sse(port, "/v1/chat/completions", {**body, "max_tokens": 2, "messages": [
            {"role": "user", "content": "Hi"}]})
    except RuntimeError as err:
        if "HTTP 400" in str(err):
            return False
        raise
    return True


@contextmanager
def started(args: argparse.Namespace, variants: Sequence[str], logs: Path) -> Iterator[Servers]:
    """Every variant's servers, for the whole run."""
    ports: dict[str, int] = {}
    pids: dict[str, dict[str, int]] = {}
    door_log = None
    total_ctx = args.session_ctx * args.max_sessions
    with ExitStack() as stack:
        if "door" in variants:
            worker = stack.enter_context(shard_server(
                args.model, threads=args.threads, ctx=total_ctx, max_sessions=args.max_sessions,
                log=logs / "concurrent_chats_worker.log"))
            trio.run(wait_serving, worker.target)
            port = free_port()
            door_log = logs / "concurrent_chats_api.log"
            entry = "bench.api.door_trace" if args.trace else "shard.cli"
            door = stack.enter_context(http_server(
                [sys.executable, "-m", entry, "api", "--target", worker.target,
                 "--port", str(port), "--model-name", "m"],
                port=port, ready_path="/health", log=door_log))
            ports["door"] = port
            pids["door"] = {"door": door.proc.pid, "worker": worker.proc.pid}
            args.worker_target = worker.target
        if "llama_server" in variants:
            port = free_port()
            server = stack.enter_context(http_server(
                [str(args.llama_server), "-m", str(args.model), "-t", str(args.threads),
                 "-c", str(total_ctx), "-np", str(args.max_sessions), "--host", "127.0.0.1",
                 "--port", str(port)],
                port=port, ready_path="/health", log=logs / "concurrent_chats_llama_server.log"))
            ports["llama_server"] = port
            pids["llama_server"] = {"server": server.proc.pid}
        yield Servers(ports, pids, door_log)


_STAGES = re.compile(r"door trace stages_ms=(\{[^}]*\})")


def trace_stages(log: Path | None, since: int) -> tuple[list[dict[str, float]], int]:
    """The door's per-generation stage times logged after byte ``since`` of its log."""
    if log is None:
        return [], since
    data = log.read_bytes()
    rows = []
    for m in _STAGES.finditer(data[since:].decode(errors="replace")):
        try:
            rows.append(json.loads(m.group(1)))
        except ValueError:
            continue
    return rows, len(data)


def summarize(rounds: list[dict[str, dict[int, dict[str, Any]]]], variants: Sequence[str],
              levels: Sequence[int]) -> dict[str, Any]:
    """Medians over rounds per variant and level; the door's over llama-server's as the
    median of each round's own ratio."""
    out: dict[str, Any] = {"per_level": {}, "door_over_llama_server": {}}
    for v in variants:
        out["per_level"][v] = {}
        for c in levels:
            rows = [r[v][c] for r in rounds]
            out["per_level"][v][c] = {k: round(statistics.median(x[k] for x in rows), 3)
                                      for k in rows[0] if isinstance(rows[0][k], (int, float))}
    if set(VARIANTS) <= set(variants):
        for c in levels:
            def ratio(key: str) -> float:
                return round(statistics.median(r["door"][c][key] / r["llama_server"][c][key]
                                               for r in rounds), 3)
            out["door_over_llama_server"][c] = {
                "tok_s": ratio("tok_s"), "ttft_ms_p50": ratio("ttft_ms_p50"),
                "ttft_ms_p90": ratio("ttft_ms_p90"), "cpu_ms_per_tok": ratio("cpu_ms_per_tok")}
    return out


def print_table(summary: dict[str, Any], variants: Sequence[str], levels: Sequence[int]) -> None:
    print("N | " + " | ".join(f"{v} tok/s, ttft p50/p90 ms, cpu ms/tok" for v in variants)
          + (" | door/llama_server tok/s, ttft p50, cpu/tok" if summary["door_over_llama_server"]
             else ""))
    for c in levels:
        cells = []
        for v in variants:
            row = summary["per_level"][v][c]
            parts = "+".join(f"{row[k]:.2f}" for k in row if k.startswith("cpu_ms_per_tok_"))
            cells.append(f"{row['tok_s']:.1f}, {row['ttft_ms_p50']:.0f}/{row['ttft_ms_p90']:.0f}, "
                         f"{row['cpu_ms_per_tok']:.2f} ({parts})")
        r = summary["door_over_llama_server"].get(c)
        if r:
            cells.append(f"{r['tok_s']:.3f}x, {r['ttft_ms_p50']:.3f}x, {r['cpu_ms_per_tok']:.3f}x")
        print(f"{c} | " + " | ".join(cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_model(p, "smollm2-135m-instruct (default), a packaged model's name, a "
                      "generated preset (chat: the tiny model with a chat template) or a GGUF file",
                      type=str, default=None)
    options.add_rounds(p, 3, "rounds, the variants alternating within each (default 3)")
    p.add_argument("--levels", default="1,4,8,16", help="concurrencies (default 1,4,8,16)")
    options.add_tokens(p, 96, "max_tokens a chat (default 96)")
    options.add_threads(p, 2, "llama.cpp threads of the worker and of llama-server (default 2)")
    p.add_argument("--max-sessions", type=int, default=16,
                   help="worker sessions and llama-server slots (default 16)")
    p.add_argument("--session-ctx", type=int, default=512,
                   help="context of each session/slot (default 512)")
    p.add_argument("--eog", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="token ids forbidden by logit_bias (default: the worker's EOS)")
    p.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary: also run it")
    p.add_argument("--trace", action="store_true",
                   help="run the door under bench.api.door_trace: its stages to the first token")
    options.add_quick(p, "levels 1,4, 16 tokens, 1 round, the chat preset (checks the harness)")
    options.add_out(p, options.RESULTS / "concurrent_chats.json")
    options.add_logs(p)
    args = p.parse_args(argv)
    if args.quick:
        args.model = args.model or "chat"
        args.levels = "1,4"
        args.tokens = 16
        args.rounds = 1
    levels = sorted({int(x) for x in args.levels.split(",")})
    args.model = model_path(args.model or "smollm2-135m-instruct")
    if min(args.rounds, args.tokens, *levels) < 1 or max(levels) > args.max_sessions:
        p.error("--rounds, --tokens and --levels must be at least 1, levels at most --max-sessions")
    if args.llama_server is not None and not args.llama_server.is_file():
        p.error(f"--llama-server {args.llama_server}: no such file")
    variants = [v for v in VARIANTS if v != "llama_server" or args.llama_server is not None]
    env = environment(args.model, args.threads,
                      argv=sys.argv if argv is None else ["bench.api.concurrent_chats", *argv])
    body: dict[str, Any] = {"model": "m", "max_tokens": args.tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}
    rounds: list[dict[str, dict[int, dict[str, Any]]]] = []
    traces: dict[int, list[dict[str, float]]] = {c: [] for c in levels}
    with started(args, variants, args.logs) as servers, \
            ThreadPoolExecutor(max(levels)) as pool:
        eog = eog_ids(args.worker_target, args.eog)
        bias = {"logit_bias": {str(t): -100 for t in eog}}
        eos_banned = bool(eog) and accepts(servers.ports["door"], {**body, **bias})
        if eos_banned:
            body.update(bias)
        for v in variants:  # the first native steps are paid before timing
            stream(servers.ports[v], {**body, "max_tokens": 4,
                                      "messages": [{"role": "user", "content": "Hello"}]})
        mark = servers.door_log.stat().st_size if servers.door_log else 0
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            got: dict[str, dict[int, dict[str, Any]]] = {v: {} for v in variants}
            for c in levels:
                for v in order:
                    got[v][c] = measure(servers, v, c, r, body, pool)
                    if v == "door" and args.trace:
                        time.sleep(0.2)  # the log line is written as the response ends
                        rows, mark = trace_stages(servers.door_log, mark)
                        traces[c].extend(rows)
                print(f"round {r} N={c}: " + ", ".join(
                    f"{v} {got[v][c]['tok_s']:.1f} tok/s ttft p50 {got[v][c]['ttft_ms_p50']:.0f} ms"
                    for v in variants), flush=True)
            rounds.append(got)
    summary = summarize(rounds, variants, levels)
    if args.trace:
        summary["door_stages_ms_p50"] = {
            c: {k: round(statistics.median(t[k] for t in rows if k in t), 3)
                for k in sorted({k for t in rows for k in t})}
            for c, rows in traces.items() if rows}
    print_table(summary, variants, levels)
    for c, stages in summary.get("door_stages_ms_p50", {}).items():
        print(f"door stages N={c} (ms p50): "
              + ", ".join(f"{k} {x:.2f}" for k, x in stages.items()))
    record = {
        "bench": "concurrent_chats",
        "environment": env,
        "config": {"model": str(args.model), "rounds": args.rounds, "levels": levels,
                   "max_tokens": args.tokens, "threads": args.threads,
                   "max_sessions": args.max_sessions, "session_ctx": args.session_ctx,
                   "eog_banned": eog if eos_banned else [],
                   "llama_server": str(args.llama_server) if args.llama_server else None,
                   "variants": variants},
        "rounds": rounds,
        "results": summary,
    }
    save_record(args.out, record)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
