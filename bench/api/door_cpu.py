"""What one streamed chat costs the door's and the worker's CPU per token, this checkout
against another (issue 53: on 2 cores every ms of Python a token costs is taken from llama.cpp's
two threads).

Each checkout (this one, and ``--worker-root``'s when given) runs its own ``trio-shard serve`` on
the model (SmolLM2 135M Instruct by default, ``--threads 2``) and its own ``trio-shard api``
in front of it. The chats run one at a time, the checkouts alternating (A, B, B, A, ...) so that
drift hits both alike: each a greedy streamed chat of ``--tokens`` tokens with the EOS forbidden
(``logit_bias``) so it runs to the limit. Per chat, the CPU seconds (user + system, ``/proc``) of
the door's and of the worker's process over the chat, divided by the tokens streamed; reported
are the medians per checkout and, with two, this checkout's over the other's. ``/proc/PID/stat``
counts in 10 ms ticks (0.04 ms a token over 256 tokens), so the door's figure comes from its
threads' ``schedstat`` (nanoseconds on a CPU) instead; a thread that ends during a chat would
take its time with it (the door's CPU is its event loop's thread).

    python -m bench.api.door_cpu [--model smollm2-135m-instruct|chat|FILE] [--tokens 256]
        [--chats 3] [--worker-root OTHER_CHECKOUT] [--out FILE] [--logs DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import trio

from bench.api.chat_turns import model_path
from bench.api.concurrent_chats import eog_ids
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

def cpu_ns(pid: int) -> int:
    """Nanoseconds the threads of ``pid`` have run (``/proc/PID/task/*/schedstat``)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return total


PROMPT = "Tell me a long story about a lighthouse keeper and the ships she guided home."


def chat(port: int, tokens: int, bias: dict[str, int]) -> int:
    """One greedy streamed chat; the tokens it streamed (from its usage, else its chunks)."""
    _, events = stream_sse(port, "/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
        "logit_bias": bias})
    for _, e in events:
        if e.get("usage"):
            return int(e["usage"]["completion_tokens"])
    return sum(1 for _, e in events if e.get("choices"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_model(p, "smollm2-135m-instruct (default), a packaged model's name, a "
                      "generated preset or a GGUF file", type=str, default=None)
    options.add_tokens(p, 256, "max_tokens a chat (default 256)")
    p.add_argument("--chats", type=int, default=3, help="chats per checkout (default 3)")
    options.add_threads(p, 2, "llama.cpp threads of each worker (default 2)")
    options.add_worker_root(p, "also run a worker and a door from this checkout, alternating")
    options.add_out(p, options.RESULTS / "door_cpu.json")
    options.add_logs(p)
    args = p.parse_args(argv)
    args.model = model_path(args.model or "smollm2-135m-instruct")
    roots = options.checkouts(args)
    env = environment(args.model, args.threads,
                      argv=sys.argv if argv is None else ["bench.api.door_cpu", *argv])
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in roots}
    with ExitStack() as stack:
        pids: dict[str, tuple[int, int]] = {}
        ports: dict[str, int] = {}
        bias: dict[str, int] = {}
        for name, root in roots.items():
            worker = stack.enter_context(shard_server(
                args.model, threads=args.threads, ctx=2048, max_sessions=2, root=root,
                log=args.logs / f"door_cpu_worker_{name}.log"))
            trio.run(wait_serving, worker.target)
            bias = {str(t): -100 for t in eog_ids(worker.target, None)}
            port = free_port()
            where = [] if root is None else ["env", f"--chdir={root}", f"PYTHONPATH={root}"]
            door = stack.enter_context(http_server(
                [*where, sys.executable, "-m", "shard.cli", "api", "--target", worker.target,
                 "--port", str(port), "--model-name", "m"],
                port=port, ready_path="/health", log=args.logs / f"door_cpu_api_{name}.log"))
            chat(port, 4, bias)  # warm both up (first request, first session)
            pids[name], ports[name] = (door.proc.pid, worker.proc.pid), port
        order = list(roots)
        for i in range(args.chats):
            for name in order if i % 2 == 0 else order[::-1]:
                door_pid, worker_pid = pids[name]
                before = cpu_ns(door_pid), cpu_seconds(worker_pid)
                n = chat(ports[name], args.tokens, bias)
                door_s, worker_s = ((cpu_ns(door_pid) - before[0]) / 1e9,
                                    cpu_seconds(worker_pid) - before[1])
                runs[name].append({"tokens": n, "door_cpu_ms_per_token": 1e3 * door_s / n,
                                   "worker_cpu_ms_per_token": 1e3 * worker_s / n})
                print(name, runs[name][-1], flush=True)
    keys = ("door_cpu_ms_per_token", "worker_cpu_ms_per_token")
    medians = {name: {k: statistics.median(r[k] for r in rows) for k in keys}
               for name, rows in runs.items()}
    results: dict[str, Any] = {"medians": medians, "runs": runs}
    if len(roots) == 2:
        results["ratios"] = {k: medians["this"][k] / medians["other"][k] for k in keys}
    save_record(args.out, {"environment": env, "worker_root": str(args.worker_root or ""),
                           "tokens": args.tokens, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
