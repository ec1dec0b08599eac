"""Decode throughput of LlamaCppEngine, side by side with llama-cpp-python's own ``Llama``.

Both run in one process, on the same GGUF file, prompt, thread count and token count, one after
the other, repeated ``--rounds`` times in alternation so drift affects both alike. Prints the
environment, tokens/s of each, and the ratio engine/raw. Timing lives here, never in tests.

    python -m bench.bench_engine [--preset bench|tiny] [--tokens 128] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import trio

from shard.engine import DecodeRequest, LoadSpec, PrefillRequest
from shard.engine.llama import LlamaCppEngine, native_system_info
from shard.llama_build import installed_build
from shard.models import ensure_model

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def environment(threads: int) -> dict[str, str]:
    """What the numbers depend on, printed with them."""
    import llama_cpp

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "threads": str(threads),
        "llama_cpp_python": llama_cpp.__version__,
        # Which llama.cpp build ran: numbers from different builds must not be compared blindly.
        "llama_build": str((installed_build() or {}).get("key", "not recorded")),
        "system_info": native_system_info(),
    }


def bench_raw(model: Path, n_tokens: int, threads: int) -> float:
    """Greedy generation with llama-cpp-python's high-level API; returns tokens/s."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(model), n_ctx=1024, n_threads=threads, verbose=False, seed=0)
    try:
        prompt = llm.tokenize(PROMPT.encode(), add_bos=True)
        llm.eval(prompt)  # prefill outside the timed part, as below
        start = time.perf_counter()
        produced = 0
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=False):
            produced += 1
            if produced >= n_tokens:
                break
        return produced / (time.perf_counter() - start)
    finally:
        llm.close()


async def bench_engine(model: Path, n_tokens: int, threads: int) -> float:
    """Greedy prefill + decode loop through the ShardEngine contract; returns tokens/s."""
    async with LlamaCppEngine() as engine:
        await engine.load(LoadSpec(model_path=model, n_ctx=1024, max_sessions=1, n_threads=threads))
        await engine.open_session("bench")
        step = await engine.prefill(PrefillRequest("bench", tokens=engine.tokenize(PROMPT)))
        assert step.logits is not None
        token = step.logits.token_id
        start = time.perf_counter()
        for _ in range(n_tokens - 1):
            step = await engine.decode(DecodeRequest("bench", token=token, top_k_logprobs=0))
            assert step.logits is not None
            token = step.logits.token_id
        elapsed = time.perf_counter() - start
        await engine.release("bench")
        return (n_tokens - 1) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench", help="model preset (default: bench)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per run (default: 128)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    parser.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 4))
    args = parser.parse_args()

    model = ensure_model(args.preset)
    print("environment:")
    for key, value in environment(args.threads).items():
        print(f"  {key}: {value}")
    print(f"model: {model.name} ({model.stat().st_size / 1e6:.0f} MB), tokens/run: {args.tokens}")
    raw, eng = [], []
    for round_no in range(1, args.rounds + 1):
        raw.append(bench_raw(model, args.tokens, args.threads))
        eng.append(trio.run(bench_engine, model, args.tokens, args.threads))
        print(f"round {round_no}: llama_cpp.Llama {raw[-1]:7.1f} tok/s | "
              f"LlamaCppEngine {eng[-1]:7.1f} tok/s")
    r, e = statistics.median(raw), statistics.median(eng)
    print(f"median: llama_cpp.Llama {r:.1f} tok/s, LlamaCppEngine {e:.1f} tok/s, "
          f"ratio engine/raw {e / r:.2f}")


if __name__ == "__main__":
    main()
