"""``n`` choices of one prompt through the door: one request of ``n`` (the prompt prefilled
once, forked for the others) beside ``n`` concurrent requests of one choice each (every one
prefills the prompt), on one worker without a prefix cache (``--prefix-cache-tokens 0``, so the
separate requests cannot share the prompt either way).

Each round runs both variants on the same fresh worker and door, in alternating order, with a
long prompt (``--prompt-words`` words) and a short answer (``--tokens``), sampled with a seed
(choice ``i``: ``seed + i`` in both variants, so they generate the same tokens). Per variant:
wall time from the first request sent to the last answer, prompt tokens. Reported: medians per
variant, and separate over forked as the median of each round's own ratio (one run, one
machine; the environment is recorded).

    python -m bench.api.choices [--model smollm2-135m-instruct|chat|FILE] [--n 4]
        [--rounds 5] [--prompt-words 600] [--tokens 16] [--threads 2] [--out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import trio

from bench.api.chat_turns import model_path
from bench.common import options
from bench.common.environment import environment, save_record
from bench.common.processes import free_port, http_server, shard_server, wait_serving

VARIANTS = ("forked", "separate")
WORDS = ("the river keeps its own counsel while the town sleeps and the lamps burn low "
         "along the quay where boats wait for morning").split()


def post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as reply:
        return json.loads(reply.read())


def run(variant: str, port: int, prompt: str, n: int, tokens: int, seed: int) -> dict[str, Any]:
    """One variant's requests; its wall time, prompt tokens and the choices' texts."""
    body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0.8}
    started = time.perf_counter()
    if variant == "forked":
        answers = [post(port, {**body, "n": n, "seed": seed})]
    else:
        with ThreadPoolExecutor(n) as pool:
            answers = list(pool.map(lambda i: post(port, {**body, "seed": seed + i}), range(n)))
    wall = time.perf_counter() - started
    texts = [c["text"] for a in answers for c in sorted(a["choices"], key=lambda c: c["index"])]
    return {"wall_ms": round(wall * 1e3, 2), "texts": texts,
            "prompt_tokens": sum(a["usage"]["prompt_tokens"] for a in answers)}


@contextmanager
def door(args: argparse.Namespace, logs: Path) -> Any:
    """A fresh worker (no prefix cache, ``n`` sessions) behind a fresh door; yields its port."""
    port = free_port()
    with ExitStack() as stack:
        worker = stack.enter_context(shard_server(
            args.model, threads=args.threads, ctx=args.n * 2048, max_sessions=args.n,
            extra=["--prefix-cache-tokens", "0"], log=logs / "choices_worker.log"))
        trio.run(wait_serving, worker.target)
        cmd = [sys.executable, "-m", "shard.cli", "api", "--target", worker.target,
               "--port", str(port), "--model-name", "m"]
        stack.enter_context(http_server(cmd, port=port, ready_path="/health",
                                        log=logs / "choices_api.log"))
        for n in (1, 2):  # warm-up: the first native steps, and the first forks
            post(port, {"model": "m", "prompt": "0 1 2 3", "max_tokens": 2, "n": n})
        yield port


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_model(p, "smollm2-135m-instruct (default), a packaged model's name, a "
                      "generated preset or a GGUF file", type=str, default=None)
    p.add_argument("--n", type=int, default=4, help="choices (default 4)")
    options.add_rounds(p, 5, "rounds, the variants alternating within each (default 5)")
    p.add_argument("--prompt-words", type=int, default=600, help="prompt length in words (default 600)")
    options.add_tokens(p, 16, "max_tokens of each choice (default 16)")
    options.add_threads(p, 2, "llama.cpp threads of the worker (default 2)")
    options.add_quick(p, "the chat preset, a 60-word prompt, 4 tokens, 1 round (checks the harness)")
    options.add_out(p, options.RESULTS / "choices.json")
    options.add_logs(p)
    args = p.parse_args(argv)
    if args.quick:
        args.model = args.model or "chat"
        args.prompt_words, args.tokens, args.rounds = 60, 4, 1
    args.model = model_path(args.model or "smollm2-135m-instruct")
    if min(args.n, args.rounds, args.prompt_words, args.tokens) < 1 or args.n > 8:
        p.error("--n must be in 1..8; --rounds, --prompt-words and --tokens at least 1")
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(args.prompt_words))
    env = environment(args.model, args.threads,
                      argv=sys.argv if argv is None else ["bench.api.choices", *argv])
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        got: dict[str, dict[str, Any]] = {}
        with door(args, Path(args.logs)) as port:
            for v in order:
                got[v] = run(v, port, prompt, args.n, args.tokens, seed=1000 + r)
        same = got["forked"]["texts"] == got["separate"]["texts"]
        print(f"round {r}: forked {got['forked']['wall_ms']:.0f} ms, separate "
              f"{got['separate']['wall_ms']:.0f} ms, same choices: {same}", flush=True)
        rounds.append(got)
    summary = {
        "wall_ms": {v: round(statistics.median(r[v]["wall_ms"] for r in rounds), 2) for v in VARIANTS},
        "prompt_tokens": {v: rounds[0][v]["prompt_tokens"] for v in VARIANTS},
        "separate_over_forked": round(statistics.median(
            r["separate"]["wall_ms"] / r["forked"]["wall_ms"] for r in rounds), 3),
        "same_choices": all(r["forked"]["texts"] == r["separate"]["texts"] for r in rounds),
    }
    print(f"n={args.n}: forked {summary['wall_ms']['forked']:.0f} ms, separate "
          f"{summary['wall_ms']['separate']:.0f} ms, separate/forked "
          f"{summary['separate_over_forked']:.2f}x")
    save_record(args.out, {
        "bench": "choices", "environment": env,
        "config": {"model": str(args.model), "n": args.n, "rounds": args.rounds,
                   "prompt_words": args.prompt_words, "max_tokens": args.tokens,
                   "threads": args.threads},
        "rounds": rounds, "results": summary})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
