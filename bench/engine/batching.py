"""Continuous batching: the engine with N concurrent sessions against a raw N-sequence loop.

Everything runs in one process, on one GGUF file and thread count, raw and engine alternated
``--rounds`` times; each round's ratio engine/raw is taken back to back and the median ratio is
reported (this machine's load changes between rounds by tens of percent, which a best-of-each
ratio would mix in). Timing lives here, never in tests.

1. ``raw N``: llama-cpp-python's low-level API, one ``llama_decode`` per step holding one row
   for each of N sequences (same context layout as the engine: per-sequence KV streams), greedy
   argmax per row. This is the ceiling the engine's scheduler is measured against.
2. ``engine N``: ``LlamaCppEngine`` with N sessions decoding concurrently (greedy, each session a
   Trio task calling ``decode`` in a loop, as the server's generate does).
3. ``arrival``: 4 sessions decode while a 2,048-token prompt arrives on a fifth; reports the
   largest gap between two tokens of a running decode during the prompt, against the median
   step before it and the time of one prompt chunk (``--batch-tokens`` rows).
4. ``sharing``: the ``--prompt``-token prompt alone, then again with a ``--short-prompt``-token
   prompt arriving 0.2 s after it (during its first chunk); reports the short prompt's time to
   first token and the long one's time, both against the long one alone in the same run.

    python -m bench.engine.batching [--preset bench|tiny] [--tokens 64] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import llama_cpp.llama_cpp as lc
import numpy as np
import trio

from bench.common import options
from bench.common.environment import environment
from shard.engine import DecodeRequest, LoadSpec, PrefillRequest
from shard.engine.llama import LlamaCppEngine, _ensure_native_init
from shard.models import ensure_model

PROMPT_LEN = 16
PER_SESSION_CTX = 256


def bench_raw(model: Path, n_seq: int, n_tokens: int, threads: int) -> float:
    """Aggregate tokens/s of a raw N-sequence batched decode loop."""
    _ensure_native_init()  # the engine's quiet log callback, so both sides log alike
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = 0
    mdl = lc.llama_model_load_from_file(os.fsencode(model), mparams)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = PER_SESSION_CTX * n_seq
    cparams.n_batch = cparams.n_ubatch = 512
    cparams.n_seq_max = n_seq
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.kv_unified = False
    cparams.no_perf = True
    ctx = lc.llama_init_from_model(mdl, cparams)
    batch = lc.llama_batch_init(512, 0, 1)
    try:
        n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(mdl))

        def step(rows: list[tuple[int, int, int, bool]]) -> None:
            batch.n_tokens = len(rows)
            for i, (tok, pos, seq, out) in enumerate(rows):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, out
            assert lc.llama_decode(ctx, batch) == 0

        def argmax(i: int) -> int:
            return int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())

        last = []
        for s in range(n_seq):
            step([(3 + (s * 7 + i) % 250, i, s, i == PROMPT_LEN - 1) for i in range(PROMPT_LEN)])
            last.append(argmax(PROMPT_LEN - 1))
        t0 = time.perf_counter()
        for k in range(n_tokens):
            step([(last[s], PROMPT_LEN + k, s, True) for s in range(n_seq)])
            last = [argmax(s) for s in range(n_seq)]
        return n_seq * n_tokens / (time.perf_counter() - t0)
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(mdl)


async def bench_engine(model: Path, n_seq: int, n_tokens: int, threads: int) -> float:
    """Aggregate tokens/s of N sessions decoding concurrently through the engine."""
    async with LlamaCppEngine() as engine:
        await engine.load(LoadSpec(model_path=model, n_ctx=PER_SESSION_CTX * n_seq,
                                   max_sessions=n_seq, n_threads=threads))
        firsts = []
        for s in range(n_seq):
            await engine.open_session(f"s{s}")
            tokens = tuple(3 + (s * 7 + i) % 250 for i in range(PROMPT_LEN))
            r = await engine.prefill(PrefillRequest(f"s{s}", tokens=tokens))
            firsts.append(r.logits.token_id)

        async def run(s: int) -> None:
            token = firsts[s]
            for _ in range(n_tokens):
                r = await engine.decode(DecodeRequest(f"s{s}", token=token))
                token = r.logits.token_id

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for s in range(n_seq):
                nursery.start_soon(run, s)
        return n_seq * n_tokens / (time.perf_counter() - t0)


async def bench_arrival(model: Path, threads: int, prompt: int, batch_tokens: int) -> dict[str, float]:
    """4 running decodes and a ``prompt``-token prefill arriving: the decodes' worst gap."""
    n_dec = 4
    async with LlamaCppEngine() as engine:
        await engine.load(LoadSpec(model_path=model, n_ctx=(prompt + 128) * (n_dec + 1),
                                   max_sessions=n_dec + 1, n_threads=threads,
                                   batch_tokens=batch_tokens))
        # One chunk alone: the time a tick with a full prompt chunk takes.
        await engine.open_session("chunk")
        t0 = time.perf_counter()
        await engine.prefill(PrefillRequest("chunk", tokens=tuple(3 + i % 250 for i in range(batch_tokens))))
        chunk_alone = time.perf_counter() - t0
        await engine.release("chunk")
        # Instrument the native step (bench only): when each tick ran and how many rows it had.
        ticks: list[tuple[float, float, int]] = []
        tick_sync = engine._tick_sync

        def timed_tick(tick: list) -> float:  # type: ignore[type-arg]
            t = time.perf_counter()
            native = tick_sync(tick)
            ticks.append((t, time.perf_counter(), sum(p.count for _, p in tick)))
            return native

        engine._tick_sync = timed_tick  # type: ignore[method-assign]
        stamps: dict[int, list[float]] = {s: [] for s in range(n_dec)}
        window: list[float] = []
        stop = trio.Event()

        async def run(s: int) -> None:
            sid = f"d{s}"
            await engine.open_session(sid)
            r = await engine.prefill(PrefillRequest(sid, tokens=tuple(3 + (s + i) % 250 for i in range(8))))
            room = engine.capabilities().n_ctx_per_session
            while not stop.is_set() and r.n_past < room:  # (a slow machine fills the context)
                r = await engine.decode(DecodeRequest(sid, token=r.logits.token_id))
                stamps[s].append(time.perf_counter())

        async def arrive() -> None:
            while min(len(v) for v in stamps.values()) < 20:
                await trio.sleep(0.01)
            await engine.open_session("long")
            window.append(time.perf_counter())
            await engine.prefill(PrefillRequest("long", tokens=tuple(3 + (i * 5) % 250 for i in range(prompt))))
            window.append(time.perf_counter())
            await trio.sleep(0.3)
            stop.set()

        async with trio.open_nursery() as nursery:
            for s in range(n_dec):
                nursery.start_soon(run, s)
            nursery.start_soon(arrive)
    start, end = window
    before, during, ticks_in_gap = [], [], []
    chunk_ticks = [t1 - t0 for t0, t1, rows in ticks if start <= t0 <= end and rows > n_dec]
    for ts in stamps.values():
        gaps = [(a, b) for a, b in zip(ts, ts[1:])]
        before += [b - a for a, b in gaps if b < start]
        for a, b in gaps:
            if start <= b <= end + 1e-9:
                during.append(b - a)
                # Native steps that *ended* inside this gap: 1 means the decode was in the very
                # next tick (it waited for at most the one chunk sharing that tick).
                ticks_in_gap.append(sum(1 for _, t1, _ in ticks if a < t1 <= b))
    step = statistics.median(before)
    return {
        "prompt_s": end - start,
        "chunks": len(chunk_ticks),
        "chunk_alone_s": chunk_alone,
        "max_chunk_tick_s": max(chunk_ticks),
        "median_step_before_s": step,
        "max_gap_during_s": max(during),
        "max_ticks_in_gap": max(ticks_in_gap),
        "bound_s": step + max(chunk_ticks),
    }


async def bench_sharing(model: Path, threads: int, prompt: int, short: int,
                        batch_tokens: int) -> dict[str, float]:
    """Prefill times of a long prompt alone, then of it and a short one arriving 0.2 s later."""
    async with LlamaCppEngine() as engine:
        await engine.load(LoadSpec(model_path=model, n_ctx=2 * (prompt + short + 64),
                                   max_sessions=2, n_threads=threads, batch_tokens=batch_tokens))
        span = engine.capabilities().n_vocab - 10  # ids 10.. skip the special tokens
        long_tokens = tuple((i * 7919) % span + 10 for i in range(prompt))
        short_tokens = tuple((i * 104729) % span + 10 for i in range(short))
        took: dict[str, float] = {}

        async def prefill(sid: str, tokens: tuple[int, ...], delay: float, key: str) -> None:
            await trio.sleep(delay)
            await engine.open_session(sid)
            started = time.perf_counter()
            await engine.prefill(PrefillRequest(sid, tokens=tokens))
            took[key] = time.perf_counter() - started
            await engine.release(sid)

        await prefill("long", long_tokens, 0, "long_alone_s")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(prefill, "long", long_tokens, 0, "long_shared_s")
            nursery.start_soon(prefill, "short", short_tokens, 0.2, "short_ttft_s")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_preset(ap)
    options.add_tokens(ap, 64)
    options.add_rounds(ap, 3)
    options.add_threads(ap, 2)
    ap.add_argument("--sessions", type=int, nargs="*", default=[1, 4, 8])
    ap.add_argument("--prompt", type=int, default=2048, help="0 skips the arrival run")
    ap.add_argument("--batch-tokens", type=int, default=512)
    ap.add_argument("--short-prompt", type=int, default=20,
                    help="short prompt arriving behind the long one (0 skips the sharing run)")
    args = ap.parse_args()
    model = ensure_model(args.preset)
    for k, v in environment(model, args.threads).items():
        print(f"{k}: {v}")
    print(f"model: {model.name}  tokens per session: {args.tokens}  rounds: {args.rounds}")
    bench_raw(model, 1, 4, args.threads)  # warm-up (page cache, thread pool): not reported
    for n in args.sessions:
        raw, eng = [], []
        for _ in range(args.rounds):
            raw.append(bench_raw(model, n, args.tokens, args.threads))
            eng.append(trio.run(bench_engine, model, n, args.tokens, args.threads))
        # Per-round ratios (raw and engine back to back) are robust to the machine's load
        # changing between rounds; the best of each alone is not.
        ratios = [e / r for r, e in zip(raw, eng, strict=True)]
        print(f"N={n}: median ratio engine/raw {statistics.median(ratios):.3f} "
              f"(per round {[round(x, 3) for x in ratios]}); raw {[round(x, 1) for x in raw]} tok/s, "
              f"engine {[round(x, 1) for x in eng]} tok/s")
    if args.prompt <= 0:
        return
    a = trio.run(bench_arrival, model, args.threads, args.prompt, args.batch_tokens)
    print(
        f"arrival: {args.prompt}-token prompt during 4 decodes took {a['prompt_s']:.2f} s "
        f"({a['chunks']} chunk ticks, slowest {a['max_chunk_tick_s'] * 1e3:.0f} ms; a "
        f"{args.batch_tokens}-token chunk alone at position 0: {a['chunk_alone_s'] * 1e3:.0f} ms); "
        f"median decode step before {a['median_step_before_s'] * 1e3:.1f} ms; worst decode gap "
        f"during the prompt {a['max_gap_during_s'] * 1e3:.0f} ms (bound: step + slowest chunk tick "
        f"{a['bound_s'] * 1e3:.0f} ms: {'within' if a['max_gap_during_s'] <= a['bound_s'] else 'MISSED'}); "
        f"most native steps ending inside one decode gap: {a['max_ticks_in_gap']}"
    )
    if args.short_prompt <= 0:
        return
    t = trio.run(bench_sharing, model, args.threads, args.prompt, args.short_prompt, args.batch_tokens)
    print(
        f"sharing: {args.prompt}-token prompt alone {t['long_alone_s']:.2f} s; with a "
        f"{args.short_prompt}-token prompt arriving 0.2 s later: that one's first token after "
        f"{t['short_ttft_s']:.2f} s ({t['short_ttft_s'] / t['long_alone_s']:.2f} of the long prompt "
        f"alone), the long one {t['long_shared_s']:.2f} s "
        f"({t['long_shared_s'] / t['long_alone_s']:.2f} of alone)"
    )


if __name__ == "__main__":
    main()
