"""What the OpenAI-compatible front door costs: tokens/s and time to first token through
``trio-shard api`` against the Shard client that ``trio-shard generate`` uses, on one worker.

One ``trio-shard serve`` process and one ``trio-shard api`` process in front of it. Each trial
runs the same greedy generation twice, alternating which goes first: directly
(``ShardClient.generate`` with the prompt's special tokens parsed, what ``generate
--parse-special`` sends) and as a streamed ``POST /v1/completions`` read event by event. Time to
first token: from the request to the first token (or the first event with text); tokens/s:
tokens after the first over the time after the first. Reported: the medians, the ratio of the
front door's tokens/s to the direct one and the time to first token it adds (median of the
per-trial differences). Targets (issue 34): >= 0.95 of the tokens/s, < 2 ms added at the median.

Ratios from one run on one machine (the environment is recorded). Writes ``api_overhead.json``
to ``--out-dir``.

    python -m bench.api.overhead [--model bench|tiny|gemma3-270m|FILE] [--trials 21]
        [--tokens 32] [--threads N] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

from bench.common import options
from bench.common.environment import default_threads, environment
from bench.common.processes import free_port, http_server, shard_server, stream_sse, wait_serving
from shard.client import ShardClient
from shard.models import ensure_model
from shard.models.real import resolve_model

PROMPT = "Once upon a time, in a city by the sea, there lived a"


def model_path(name: str) -> Path:
    if name in ("tiny", "bench", "chat"):
        return ensure_model(name, progress=sys.stderr.isatty())
    return resolve_model(Path(name))


async def direct(target: str, tokens: int) -> dict[str, float]:
    """The Shard client's own streamed generation (``trio-shard generate``'s path)."""
    async with ShardClient.connect(target, timeout=300) as client:
        sent = time.perf_counter()
        stamps = [time.perf_counter() async for _ in client.generate(
            PROMPT, max_tokens=tokens, temperature=0.0, parse_special=True)]
    return _timing(sent, stamps)


def through_api(port: int, model: str, tokens: int) -> dict[str, float]:
    sent, events = stream_sse(port, "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}})
    stamps = [t for t, e in events if e.get("choices") and e["choices"][0].get("text")]
    usage = next(e["usage"] for _, e in events if e.get("usage"))
    timing = _timing(sent, stamps)
    # tokens/s over tokens, not events: a token whose text is held back shares an event
    if len(stamps) > 1:
        timing["tokens_per_s"] = (usage["completion_tokens"] - 1) / (stamps[-1] - stamps[0])
    timing["tokens"] = usage["completion_tokens"]
    return timing


def _timing(sent: float, stamps: list[float]) -> dict[str, float]:
    out = {"ttft_ms": (stamps[0] - sent) * 1e3, "tokens": float(len(stamps))}
    out["tokens_per_s"] = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_model(parser, None, type=str, default="bench")
    parser.add_argument("--trials", type=int, default=21)
    options.add_tokens(parser, 32)
    options.add_threads(parser, default_threads())
    options.add_out_dir(parser)
    args = parser.parse_args(argv)
    model = model_path(args.model)
    env = environment(model, args.threads, argv=sys.argv if argv is None else ["bench.api.overhead", *argv])
    logs = args.out_dir / "logs"
    port = free_port()
    rows: list[dict[str, Any]] = []
    with shard_server(model, threads=args.threads, ctx=4096, max_sessions=4,
                      log=logs / "api_overhead_worker.log") as worker:
        trio.run(wait_serving, worker.target)
        cmd = [sys.executable, "-m", "shard.cli", "api", "--target", worker.target,
               "--port", str(port), "--model-name", "m"]
        with http_server(cmd, port=port, ready_path="/health", log=logs / "api_overhead_api.log"):
            through_api(port, "m", 8)  # warm-up: both paths' first native steps
            trio.run(direct, worker.target, 8)
            for trial in range(args.trials):
                order = ["direct", "api"] if trial % 2 == 0 else ["api", "direct"]
                row: dict[str, Any] = {}
                for which in order:
                    if which == "direct":
                        row["direct"] = trio.run(direct, worker.target, args.tokens)
                    else:
                        row["api"] = through_api(port, "m", args.tokens)
                rows.append(row)
                print(f"trial {trial}: direct {row['direct']['tokens_per_s']:.1f} tok/s ttft "
                      f"{row['direct']['ttft_ms']:.1f} ms | api {row['api']['tokens_per_s']:.1f} "
                      f"tok/s ttft {row['api']['ttft_ms']:.1f} ms", flush=True)

    def median(which: str, key: str) -> float:
        return statistics.median(r[which][key] for r in rows)

    summary = {
        "direct_tokens_per_s": median("direct", "tokens_per_s"),
        "api_tokens_per_s": median("api", "tokens_per_s"),
        "direct_ttft_ms": median("direct", "ttft_ms"),
        "api_ttft_ms": median("api", "ttft_ms"),
        "ttft_added_ms_median": statistics.median(r["api"]["ttft_ms"] - r["direct"]["ttft_ms"] for r in rows),
    }
    summary["tokens_per_s_ratio"] = summary["api_tokens_per_s"] / summary["direct_tokens_per_s"]
    summary["targets"] = {"tokens_per_s_ratio >= 0.95": summary["tokens_per_s_ratio"] >= 0.95,
                          "ttft_added_ms_median < 2": summary["ttft_added_ms_median"] < 2.0}
    result = {"environment": env, "prompt": PROMPT, "tokens": args.tokens, "trials": rows,
              "summary": summary}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "api_overhead.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
