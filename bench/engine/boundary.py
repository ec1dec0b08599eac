"""Per-step cost of boundary capture: a first-shard decode step next to a whole-model step.

A non-last llama shard captures its output through ggml's eval callback, a Python function
that ggml asks about every graph node until the last block's output (``l_out-{n-1}``), then
stops the graph, so the output norm and LM head never run. This bench measures, in one process
on the same machine and thread count, the time of one decode step of

* the whole model (every block + output norm + LM head),
* the first shard ``[0, cut)`` (its blocks + capture, no head),
* the last shard ``[cut, n)`` (hidden state in, its blocks + head, no capture),

in alternating rounds so drift affects all alike (median step of each measurement, median over
rounds), and prints the ratios to the whole-model step. The capture's own cost is estimated against a compute model: weights read per step are
proportional to the tensors' bytes (decode on CPU is memory-bound), so the first shard "should"
take ``bytes(blocks < cut) / bytes(all blocks + head)`` of a whole step; the measured excess
over that share is what capture costs (callbacks, copying one row, the skipped graph tail).
The callback count per step is counted in a separate, untimed step. ``--busy`` repeats the
measurement while another Python thread spins: every callback needs the GIL, so this shows what
a busy event loop in the same process costs a non-last shard. Timing lives here, never in tests.

    python -m bench.engine.boundary [--preset bench|tiny] [--cut 6] [--steps 64] [--rounds 3]
        [--threads 1] [--busy]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import trio

from bench.common import options
from bench.common.environment import environment
from shard.engine import DecodeRequest, LayerRange, LoadSpec, PrefillRequest
from shard.engine.llama import LlamaCppEngine
from shard.models import ensure_model, ensure_slice, get_preset

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def weight_share(model: Path, cut: int) -> float:
    """Bytes of blocks ``[0, cut)`` over the bytes a whole-model step reads (blocks + head)."""
    tensors = gguf.GGUFReader(model).tensors
    head = next((t for t in tensors if t.name == "output.weight"), None)
    if head is None:  # tied embeddings: the head is token_embd
        head = next(t for t in tensors if t.name == "token_embd.weight")
    blocks = [t for t in tensors if t.name.startswith("blk.")]
    first = sum(t.n_bytes for t in blocks if int(t.name.split(".")[1]) < cut)
    return first / (sum(t.n_bytes for t in blocks) + head.n_bytes)


async def _time_steps(engine: LlamaCppEngine, steps: int, *, hidden: np.ndarray | None) -> float:
    """Median seconds of one decode step after a short prefill (token 42 or one hidden row).

    The median, not the mean: on a shared machine single steps are delayed by other processes,
    and those outliers would swamp a difference of a few percent."""
    await engine.open_session("b")
    try:
        if hidden is None:
            await engine.prefill(PrefillRequest("b", tokens=engine.tokenize(PROMPT)))
            request = DecodeRequest("b", token=42, top_k_logprobs=0)
        else:
            await engine.prefill(PrefillRequest("b", hidden_states=hidden[:40]))
            request = DecodeRequest("b", hidden_state=hidden[40:41], top_k_logprobs=0)
        await engine.decode(request)  # warm-up
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            await engine.decode(request)
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        await engine.release("b")


async def count_callbacks(engine: LlamaCppEngine) -> int:
    """How many nodes the eval callback is asked about in one decode step (untimed)."""
    boundary = engine._boundary  # shard.engine.llama_capture.BoundaryCapture
    assert boundary is not None
    api = boundary.api
    asked = 0

    def counting(tensor: int) -> bytes:
        nonlocal asked
        asked += 1
        return api.get_name(tensor)

    boundary.api = dataclasses.replace(api, get_name=counting)
    try:
        await engine.open_session("c")
        await engine.prefill(PrefillRequest("c", tokens=engine.tokenize(PROMPT)))
        asked = 0
        await engine.decode(DecodeRequest("c", token=42, top_k_logprobs=0))
        await engine.release("c")
        return asked
    finally:
        boundary.api = api


@contextlib.contextmanager
def busy_python_thread(enabled: bool) -> Iterator[None]:
    """A thread that keeps the GIL busy with pure-Python work while the block runs."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x = (x + 1) % 1_000_003

    thread = threading.Thread(target=spin, daemon=True) if enabled else None
    if thread is not None:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread is not None:
            thread.join()


async def run(model: Path, n_layer: int, cut: int, steps: int, rounds: int, threads: int,
              busy: bool) -> None:
    first_path = await trio.to_thread.run_sync(ensure_slice, model, LayerRange(0, cut))
    last_path = await trio.to_thread.run_sync(ensure_slice, model, LayerRange(cut, n_layer))

    def spec(path: Path) -> LoadSpec:
        return LoadSpec(model_path=path, n_ctx=512, max_sessions=1, n_batch=512, n_threads=threads)

    async with LlamaCppEngine() as whole, LlamaCppEngine() as first, LlamaCppEngine() as last:
        caps = await whole.load(spec(model))
        await first.load(spec(first_path))
        await last.load(spec(last_path))
        rng = np.random.default_rng(0)
        hidden = rng.standard_normal((41, caps.n_embd)).astype(np.float32)
        asked = await count_callbacks(first)
        print(f"first shard [0, {cut}): the eval callback is asked about {asked} nodes per decode step")
        if busy:
            print("another Python thread spins during every measurement (--busy)")
        t_whole, t_first, t_last = [], [], []
        for round_no in range(1, rounds + 1):
            with busy_python_thread(busy):
                t_whole.append(await _time_steps(whole, steps, hidden=None))
                t_first.append(await _time_steps(first, steps, hidden=None))
                t_last.append(await _time_steps(last, steps, hidden=hidden))
            print(f"round {round_no}: whole {t_whole[-1] * 1e3:7.2f} ms | first [0, {cut}) "
                  f"{t_first[-1] * 1e3:7.2f} ms | last [{cut}, {n_layer}) {t_last[-1] * 1e3:7.2f} ms per step")
    w, f, la = statistics.median(t_whole), statistics.median(t_first), statistics.median(t_last)
    share = weight_share(model, cut)
    print(f"median per decode step: whole {w * 1e3:.2f} ms, first {f * 1e3:.2f} ms, last {la * 1e3:.2f} ms")
    print(f"ratio first/whole {f / w:.3f} (its share of the weights read per step: {share:.3f}); "
          f"ratio last/whole {la / w:.3f}; (first+last)/whole {(f + la) / w:.3f}")
    excess = f - share * w
    print(f"capture cost estimate: {excess * 1e3:+.3f} ms per step "
          f"({excess / w * 100:+.1f}% of a whole-model step, {excess / max(asked, 1) * 1e6:+.2f} us per node asked)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_preset(parser, help="model preset (default: bench)")
    parser.add_argument("--cut", type=int, default=None, help="first shard is [0, cut) (default: half)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps per measurement (default: 64)")
    options.add_rounds(parser, 3, "alternating rounds (default: 3)")
    options.add_threads(parser, 1, "llama.cpp threads (default: 1, steadiest on a shared machine)")
    parser.add_argument("--busy", action="store_true",
                        help="measure while another Python thread spins (GIL contention)")
    args = parser.parse_args()

    model = ensure_model(args.preset, progress=True)
    n_layer = get_preset(args.preset).n_layer
    cut = args.cut if args.cut is not None else n_layer // 2
    print("environment:")
    for key, value in environment(model, args.threads).items():
        print(f"  {key}: {value}")
    print(f"model: {model.name} ({model.stat().st_size / 1e6:.0f} MB), steps/measurement: {args.steps}")
    trio.run(run, model, n_layer, cut, args.steps, args.rounds, args.threads, args.busy)


if __name__ == "__main__":
    main()
