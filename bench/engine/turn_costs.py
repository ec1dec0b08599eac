"""What a chat's later turn costs the engine alone, beside the raw llama.cpp loop (issue 53).

A chat's turn 8 decodes at about 1,150 positions and starts from the prefix cache; turn 1
decodes at about 50 and starts from nothing. This bench separates what grows with the context
from what the worker adds, in one process, with no transport and no door:

* ``decode``: greedy decode steps (``--tokens``) at a short and a long context (``--short``,
  ``--long`` positions), timed per token in wall and process CPU time, for

  - ``raw``: the low-level loop (``bench.engine.raw_loops.RawDecoder``, one KV stream per
    sequence as the worker's context);
  - ``engine``: ``LlamaCppEngine`` with a fresh session (its prompt shares nothing cached);
  - ``engine_cached``: ``LlamaCppEngine`` with a session whose prompt starts with a released
    session's history, copied from the prefix cache (as every later turn of a chat is).

  ``engine`` over ``raw`` at both contexts says whether the engine's per-token cost grows with
  the context; ``engine_cached`` over ``engine`` whether a session that came from the cache
  decodes slower (its cells copied from another stream).
* ``copy``: the first step of a session at ``--long`` positions, on the raw context, with and
  without the cross-stream copy the prefix cache does (``llama_memory_seq_cp`` between
  streams: llama.cpp copies the whole stream at the next ``llama_decode`` and reserves its
  worst-case graph again). The difference is what a cached turn pays before its first token.

Rounds alternate the variants, so drift on a shared machine hits all alike; medians over rounds
are reported with the environment. Process CPU time counts every thread, the compute pool's
spinning at its barriers included: use ``--threads 1`` for CPU counts that mean work.

    python -m bench.engine.turn_costs [--model smollm2-135m-instruct|FILE] [--rounds 5]
        [--tokens 60] [--short 47] [--long 1150] [--threads 2] [--out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from bench.common import options
from bench.common.environment import environment, load_average, save_record
from bench.engine.raw_loops import RawDecoder

CTX = 8192  # the chat bench's worker: 4 sessions of 2048 positions
SESSIONS = 4
TEXT = "The history of bread baking is long and varied, and every region has its own loaf. "


def _cpu() -> float:
    return time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID)


def per_token(fn: Callable[[], None], n: int) -> tuple[float, float]:
    """(wall ms, CPU ms) per step of ``n`` calls of ``fn``."""
    t0, c0 = time.perf_counter(), _cpu()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3, (_cpu() - c0) / n * 1e3


class Raw:
    """The raw context: prefill, then decode one sequence; a copy between streams."""

    def __init__(self, model: Path, threads: int) -> None:
        self.d = RawDecoder(model, n_ctx=CTX + CTX // SESSIONS, n_seq_max=SESSIONS + 1,
                            threads=threads, n_batch=512)
        self.lc = self.d._lc
        self.mem = self.lc.llama_get_memory(self.d._ctx)

    def prefill(self, seq: int, tokens: list[int]) -> int:
        """Compute ``tokens`` on ``seq`` in batches of 512; the greedy next token."""
        for s in range(0, len(tokens), 512):
            e = min(len(tokens), s + 512)
            self.d._fill([(tokens[p], p, seq, p == e - 1) for p in range(s, e)])
            self.d._decode()
        return self.d._argmax((len(tokens) - 1) % 512)

    def decode(self, prompt: list[int], n: int) -> tuple[float, float]:
        self.lc.llama_memory_clear(self.mem, True)
        state = {"tok": self.prefill(0, prompt), "pos": len(prompt)}

        def step() -> None:
            self.d._fill([(state["tok"], state["pos"], 0, True)])
            self.d._decode()
            state["tok"], state["pos"] = self.d._argmax(0), state["pos"] + 1

        return per_token(step, n)

    def first_step(self, prompt: list[int], copy: bool) -> tuple[float, float]:
        """One step at ``len(prompt) - 1`` on a sequence holding the rest: sequence 0 itself,
        or (``copy``) sequence 1 after a copy of sequence 0's stream."""
        keep = len(prompt) - 1
        seq = 1 if copy else 0
        self.lc.llama_memory_seq_rm(self.mem, 0, keep, -1)
        self.lc.llama_memory_seq_rm(self.mem, 1, -1, -1)

        def step() -> None:
            if copy:
                self.lc.llama_memory_seq_cp(self.mem, 0, 1, -1, -1)
                self.lc.llama_memory_seq_rm(self.mem, 1, keep, -1)
            self.d._fill([(prompt[keep], keep, seq, True)])
            self.d._decode()
            self.d._argmax(0)

        return per_token(step, 1)

    def close(self) -> None:
        self.d.close()


async def engine_decode(eng: Any, sid: str, prompt: list[int], n: int) -> tuple[float, float, int]:
    """(wall ms, CPU ms) per decode step of a new session after its prompt, and how many of
    the prompt's positions came from the prefix cache. The session is released (into the
    cache) afterwards."""
    from shard.engine import DecodeRequest, PrefillRequest

    await eng.open_session(sid)
    try:
        step = await eng.prefill(PrefillRequest(sid, tokens=tuple(prompt), top_k_logprobs=0))
        cached = step.cached_tokens
        token = step.logits.token_id
        t0, c0 = time.perf_counter(), _cpu()
        for _ in range(n):
            step = await eng.decode(DecodeRequest(sid, token=token, top_k_logprobs=0))
            token = step.logits.token_id
        wall, cpu = (time.perf_counter() - t0) / n * 1e3, (_cpu() - c0) / n * 1e3
    finally:
        await eng.release(sid)
    return wall, cpu, cached


async def run(args: argparse.Namespace, progress: Callable[[str], None] = print) -> dict[str, Any]:
    from shard.engine import LoadSpec
    from shard.engine.llama import LlamaCppEngine

    rows: list[dict[str, Any]] = []
    raw = Raw(args.model, args.threads)
    try:
        async with LlamaCppEngine() as eng:
            await eng.load(LoadSpec(model_path=args.model, n_ctx=CTX, max_sessions=SESSIONS,
                                    n_threads=args.threads, prefix_cache_tokens=CTX // SESSIONS))
            tokenize = eng._llama.tokenize  # the engine's own tokenizer (same vocabulary)
            reversed_text = tokenize(TEXT[::-1] * 400, True, False)
            for rnd in range(args.rounds):
                # Each round's texts differ, so no round finds another's history cached.
                base = tokenize(f"Round {rnd}. " + TEXT * 400, True, False)
                for n_ctx in (args.short, args.long):
                    # The fresh session's prompt differs from every other prompt at its first
                    # token (it has no BOS), so nothing of it is cached.
                    unique = 100 + 2 * rnd + (n_ctx == args.long)
                    unique = 99 if unique == base[0] else unique  # (every round's base[0] is one id)
                    other = [unique, *reversed_text[1:]]
                    order = ["raw", "engine", "engine_cached"]
                    order = order[rnd % 3:] + order[:rnd % 3]
                    for v in order:
                        cached = 0
                        if v == "raw":
                            wall, cpu = raw.decode(base[:n_ctx], args.tokens)
                        elif v == "engine":
                            wall, cpu, cached = await engine_decode(
                                eng, f"f{rnd}-{n_ctx}", other[:n_ctx], args.tokens)
                        else:
                            # A released session holds all but the last 27 positions (a chat's
                            # new user message); this one takes them from the cache.
                            head = max(1, n_ctx - 27)
                            await eng.open_session(f"h{rnd}-{n_ctx}")
                            await eng.prefill(_prefill(f"h{rnd}-{n_ctx}", base[:head]))
                            await eng.release(f"h{rnd}-{n_ctx}")
                            wall, cpu, cached = await engine_decode(
                                eng, f"c{rnd}-{n_ctx}", base[:n_ctx], args.tokens)
                        rows.append({"part": "decode", "variant": v, "context": n_ctx, "round": rnd,
                                     "wall_ms": round(wall, 3), "cpu_ms": round(cpu, 3),
                                     "cached_tokens": cached})
                        progress(f"round {rnd} decode {v} at {n_ctx}: {wall:.2f} ms/token "
                                 f"(CPU {cpu:.2f}, cached {cached})")
                raw.lc.llama_memory_clear(raw.mem, True)
                raw.prefill(0, base[:args.long - 1])
                for copy in ((False, True) if rnd % 2 == 0 else (True, False)):
                    wall, cpu = raw.first_step(base[:args.long], copy)
                    v = "copied" if copy else "own"
                    rows.append({"part": "copy", "variant": v, "context": args.long, "round": rnd,
                                 "wall_ms": round(wall, 3), "cpu_ms": round(cpu, 3)})
                    progress(f"round {rnd} first step at {args.long}, {v} stream: {wall:.2f} ms "
                             f"(CPU {cpu:.2f})")
    finally:
        raw.close()
    return {"measurements": rows, "summary": summarize(rows, args)}


def _prefill(sid: str, tokens: list[int]) -> Any:
    from shard.engine import PrefillRequest

    return PrefillRequest(sid, tokens=tuple(tokens), top_k_logprobs=0)


def summarize(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Medians per part, variant and context; the ratios of each round, then their medians."""
    def med(part: str, v: str, n: int, key: str) -> float:
        return round(statistics.median(r[key] for r in rows
                                       if (r["part"], r["variant"], r["context"]) == (part, v, n)), 3)

    out: dict[str, Any] = {"decode_ms": {}, "ratios": {}}
    for v in ("raw", "engine", "engine_cached"):
        out["decode_ms"][v] = {str(n): {k: med("decode", v, n, k) for k in ("wall_ms", "cpu_ms")}
                               for n in (args.short, args.long)}
    by_round: dict[tuple[int, str, int], dict[str, float]] = {
        (r["round"], r["variant"], r["context"]): r for r in rows}
    rounds = sorted({r["round"] for r in rows})
    for a, b in (("engine", "raw"), ("engine_cached", "engine")):
        for n in (args.short, args.long):
            for key in ("wall_ms", "cpu_ms"):
                out["ratios"][f"{a}_over_{b}_{key[:-3]}_at_{n}"] = round(statistics.median(
                    by_round[(i, a, n)][key] / by_round[(i, b, n)][key] for i in rounds), 3)
    out["first_step_ms"] = {v: {k: med("copy", v, args.long, k) for k in ("wall_ms", "cpu_ms")}
                            for v in ("own", "copied")}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_model(p, "smollm2-135m-instruct (default), a packaged model's name or a GGUF file",
                      type=str, default=None)
    options.add_rounds(p, 5, "rounds, the variants alternating within each (default 5)")
    options.add_tokens(p, 60, "decode steps timed per measurement (default 60)")
    p.add_argument("--short", type=int, default=47, help="the short context's positions (default 47)")
    p.add_argument("--long", type=int, default=1150, help="the long context's positions (default 1150)")
    options.add_threads(p, 2, "llama.cpp threads (default 2; 1 makes CPU time mean work)")
    options.add_quick(p, "1 round of 4 tokens at 40 and 120 positions on the chat preset")
    options.add_out(p, options.RESULTS / "turn_costs.json")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.tokens, args.short, args.long = 1, 4, 40, 120
        args.model = args.model or "chat"
    from bench.api.chat_turns import model_path

    args.model = model_path(args.model or "smollm2-135m-instruct")
    if not 28 < args.short < args.long or args.long + args.tokens >= CTX // SESSIONS:
        p.error(f"need 28 < --short < --long and --long + --tokens < {CTX // SESSIONS}")
    env = environment(args.model, args.threads, argv=[
        Path(sys.executable).name, "-m", "bench.engine.turn_costs", *(sys.argv[1:] if argv is None else argv)])
    result = trio.run(run, args)
    env["load_average_after"] = load_average()
    save_record(args.out, {"bench": "turn_costs", "environment": env, "config": {
        "rounds": args.rounds, "tokens": args.tokens, "short": args.short, "long": args.long,
        "threads": args.threads, "ctx": CTX, "sessions": SESSIONS}, **result, "results": result["summary"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
