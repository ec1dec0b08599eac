"""What constrained decoding costs (``shard.engine.grammar``): the grammar mask's CPU per
token and per tick of 8 sessions, against the step's own time, on llama.cpp.

For each model (SmolLM2 135M Instruct, and the generated bench model), side by side in one
run:

* ``mask``: a session's matcher brought to the next token and its mask applied to a logits
  row (``SessionGrammar.follow`` + ``mask``, what ``ShardEngine._make_result`` adds to a
  constrained step), over the tokens of a real constrained answer; CPU seconds
  (``time.thread_time``) per token, and that times 8 (a tick of 8 sessions masked row by row).
* ``tick``: the masks of a tick of 8 sessions (following the 8 answers of the constrained run),
  computed alone, one row after another (``follow`` + ``mask`` per row), against together
  (``grammar.mask_together``: the 8 matchers brought to their histories and filled by one
  parallel call, as a tick's end does, then each row's ``follow`` + ``mask`` as building its
  result does); CPU seconds of the whole process (``time.process_time``: the library's
  threads fill the masks) and wall seconds per tick, and, together, the event loop's part
  (what building the 8 results still does, ``time.thread_time``).
* ``step``: 8 sessions decoding greedily at once (the engine batches them into one tick per
  token), unconstrained and constrained by the same JSON schema; wall seconds per tick.

Run: ``python -m bench.engine.grammar_cost [--quick]``; the result file goes to
``bench/results/grammar_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

from bench.common.environment import environment, save_record
from bench.common.options import RESULTS, add_out, add_quick, add_threads, add_tokens
from shard.engine import DecodeRequest, GrammarSpec, LoadSpec, PrefillRequest, SamplingParams
from shard.engine.grammar import SessionGrammar, mask_together
from shard.engine.llama import LlamaCppEngine
from shard.models import ensure_model
from shard.models.real import ensure_real_model

SESSIONS = 8
SCHEMA = json.dumps({
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "pets": {"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog", "fish"]},
                           "name": {"type": "string", "maxLength": 16}},
            "required": ["kind", "name"], "additionalProperties": False}},
    },
    "required": ["name", "age", "role", "pets"],
    "additionalProperties": False,
})
PROMPT = "Describe a user of a web site and their pets as JSON:"


async def ticks(engine: LlamaCppEngine, prompt: tuple[int, ...], params: SamplingParams,
                n_tokens: int) -> tuple[float, list[list[int]]]:
    """8 sessions decode ``n_tokens`` each at once (ignoring end of generation): wall seconds
    per tick, and each session's tokens."""
    out: list[list[int]] = [[] for _ in range(SESSIONS)]

    async def one(i: int) -> None:
        sid = f"s{i}"
        r = await engine.prefill(PrefillRequest(sid, tokens=prompt, sampling=params, top_k_logprobs=0))
        for _ in range(n_tokens):
            out[i].append(r.logits.token_id)
            r = await engine.decode(DecodeRequest(sid, token=out[i][-1], sampling=params,
                                                  top_k_logprobs=0))

    for i in range(SESSIONS):
        await engine.open_session(f"s{i}")
    try:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(SESSIONS):
                nursery.start_soon(one, i)
        seconds = time.perf_counter() - start
    finally:
        for i in range(SESSIONS):
            await engine.release(f"s{i}")
    return seconds / n_tokens, out


def mask_cpu(engine: LlamaCppEngine, spec: GrammarSpec, history: list[int], n_vocab: int,
             rounds: int) -> float:
    """CPU seconds per token of following ``history`` (from ``spec.start``) and masking a row."""
    row = np.random.default_rng(0).standard_normal(n_vocab).astype(np.float32)
    steps = len(history) - spec.start
    spent = 0.0
    for _ in range(rounds):
        state = SessionGrammar(spec, engine._grammars.compile(spec))
        start = time.thread_time()
        for n in range(spec.start, len(history) + 1):
            if state.follow(history, n):
                state.mask(row)
        spent += time.thread_time() - start
    return spent / (rounds * (steps + 1))


def tick_mask_cost(engine: LlamaCppEngine, spec: GrammarSpec, histories: list[list[int]],
                   n_vocab: int, rounds: int, together: bool) -> dict[str, float]:
    """Per tick of ``len(histories)`` sessions, over their answers: process CPU and wall
    seconds of masking every session's next row (``together``: filled in one call first), and
    the calling thread's CPU in the per-row part (what the event loop pays)."""
    rows = np.random.default_rng(0).standard_normal((len(histories), n_vocab)).astype(np.float32)
    end = min(len(h) for h in histories)
    ticks = end - spec.start + 1
    cpu = wall = loop = 0.0
    for _ in range(rounds):
        states = [SessionGrammar(spec, engine._grammars.compile(spec)) for _ in histories]
        for n in range(spec.start, end + 1):
            cpu0, wall0 = time.process_time(), time.perf_counter()
            if together:
                mask_together([(s, h, n) for s, h in zip(states, histories)], n_vocab, n_vocab)
            loop0 = time.thread_time()
            for state, history, row in zip(states, histories, rows):
                if state.follow(history, n):
                    state.mask(row)
            loop += time.thread_time() - loop0
            cpu += time.process_time() - cpu0
            wall += time.perf_counter() - wall0
    per = rounds * ticks
    return {"cpu_us": cpu / per * 1e6, "wall_us": wall / per * 1e6, "loop_cpu_us": loop / per * 1e6}


async def measure(model: Path, threads: int, n_tokens: int, rounds: int) -> dict[str, Any]:
    async with LlamaCppEngine() as engine:
        caps = await engine.load(LoadSpec(model_path=model, n_ctx=SESSIONS * 512,
                                          max_sessions=SESSIONS, n_threads=threads))
        prompt = engine.tokenize(PROMPT)
        spec = GrammarSpec("json_schema", SCHEMA, start=len(prompt))
        free, constrained = SamplingParams(), SamplingParams(grammar=spec)
        compile_start = time.perf_counter()
        await trio.to_thread.run_sync(engine._grammars.compile, spec)  # tokenizer + schema
        compile_s = time.perf_counter() - compile_start
        await ticks(engine, prompt, free, 4)  # warm
        free_tick, _ = await ticks(engine, prompt, free, n_tokens)
        grammar_tick, outs = await ticks(engine, prompt, constrained, n_tokens)
        history = [*prompt, *outs[0]]
        per_token = mask_cpu(engine, spec, history, caps.n_vocab, rounds)
        histories = [[*prompt, *out] for out in outs]
        alone = tick_mask_cost(engine, spec, histories, caps.n_vocab, rounds, together=False)
        together = tick_mask_cost(engine, spec, histories, caps.n_vocab, rounds, together=True)
    return {
        "model": model.name, "n_vocab": caps.n_vocab, "tokens_per_session": n_tokens,
        "first_compile_s": compile_s,
        "mask_cpu_us_per_token": per_token * 1e6,
        "mask_cpu_us_per_tick_of_8": per_token * SESSIONS * 1e6,
        "tick_of_8_masks_alone": alone,
        "tick_of_8_masks_together": together,
        "masks_together_over_alone_cpu": together["cpu_us"] / alone["cpu_us"],
        "masks_together_over_alone_wall": together["wall_us"] / alone["wall_us"],
        "tick_ms_unconstrained": free_tick * 1e3,
        "tick_ms_constrained": grammar_tick * 1e3,
        "mask_share_of_unconstrained_tick": per_token * SESSIONS / free_tick,
        "constrained_over_unconstrained_tick": grammar_tick / free_tick,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_quick(p, "fewer tokens and rounds (checks the harness)")
    add_threads(p, 2)
    add_tokens(p, 64, "tokens each of the 8 sessions decodes")
    add_out(p, RESULTS / "grammar_cost.json")
    args = p.parse_args()
    n_tokens, rounds = (12, 1) if args.quick else (args.tokens, 5)
    models = [ensure_real_model("smollm2-135m-instruct"), ensure_model("bench")]
    results = [trio.run(measure, m, args.threads, n_tokens, rounds) for m in models]
    save_record(args.out, {"environment": environment(models[0], args.threads),
                           "results": results})


if __name__ == "__main__":
    main()
