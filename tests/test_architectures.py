"""Layer ranges per architecture, through live workers and ``shard.pipeline.Pipeline``.

For every row of the architecture table that serves layer ranges, its test model
(``shard.models.arch_models``: the architecture's quirks, a few MB) is cut at the model's
``chains`` (awkward boundaries: not multiples of any pattern period, a one-block first and last
part wherever the table allows it), every part is served by a live LlamaCppEngine worker, and
the chain must equal one whole-model worker: the same greedy tokens over 36 steps, and the last
shard's logits within the table's tolerance of the whole model's at every step (0: bit-exact;
compared at equal prompt chunking, see below). Each chain prints its measured max |logit
difference| (``-s`` is not needed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import trio

from rpc_harness import Worker, worker
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.engine import LayerRange, LoadSpec
from shard.engine.llama import LlamaCppEngine
from shard.models import RANGE_ARCHITECTURES, ensure_slice, lookup, read_model_info
from shard.models.arch_models import MODELS, ensure_arch_model
from shard.models.architectures import Model
from shard.pipeline import Pipeline
from test_llama_ranges import spy_outputs
from test_pipeline import TIMEOUT, assert_all_free, whole_model_steps

PROMPT = "hello world, the quick brown fox jumps over the lazy dog once upon a time"
N_TOKENS = 36  # a prompt of ~20 tokens + 36: well past every test model's window of 8
CHUNK = 4  # prompt tokens per pipelined prefill request: several boundary transfers per prompt


def test_every_supported_architecture_has_a_test_model_with_awkward_chains() -> None:
    assert set(MODELS) == set(RANGE_ARCHITECTURES)
    for name, model in MODELS.items():
        arch, n = lookup(name), model.dims.n_layer
        assert {len(c) for c in model.chains} >= {3, 4}, name  # 2- and 3-way chains
        assert all(c[0] == 0 and c[-1] == n and list(c) == sorted(set(c)) for c in model.chains), name
        cuts = {c for chain in model.chains for c in chain[1:-1]}
        if arch.cut_multiple is None:  # a one-block first part and a one-block last part
            assert any(c[1] == 1 and c[-2] == n - 1 for c in model.chains), name
        sw = arch.sliding_window
        if sw is not None and arch.cut_multiple is None:
            assert any(c % sw.period for c in cuts), name


@asynccontextmanager
async def arch_workers(arch: str, ranges: Sequence[LayerRange | None]) -> AsyncIterator[dict[LayerRange | None, Worker]]:
    """One live worker per distinct range of ``arch``'s test model (None: the whole model)."""
    source = await trio.to_thread.run_sync(ensure_arch_model, arch)
    async with AsyncExitStack() as stack:
        workers: dict[LayerRange | None, Worker] = {}
        for lr in dict.fromkeys(ranges):
            path = source if lr is None else await trio.to_thread.run_sync(ensure_slice, source, lr)
            spec = LoadSpec(model_path=path, layer_range=lr, n_ctx=1024, max_sessions=2, n_threads=1)
            workers[lr] = await stack.enter_async_context(worker(engine=LlamaCppEngine(), load=spec))
        yield workers


def ranges_of(cuts: Sequence[int]) -> list[LayerRange]:
    return [LayerRange(a, b) for a, b in zip(cuts, cuts[1:])]


@pytest.mark.parametrize("arch", RANGE_ARCHITECTURES)
async def test_chains_of_layer_ranges_equal_the_whole_model(arch: str, capsys: pytest.CaptureFixture[str]) -> None:
    model, entry = MODELS[arch], lookup(arch)
    chains = [ranges_of(c) for c in model.chains]
    async with arch_workers(arch, [None, *(r for chain in chains for r in chain)]) as workers:
        whole = workers[None]
        caps = whole.engine.capabilities()
        assert caps.architecture == arch and caps.layer_ranges.supported
        # The reference tokens: the whole model's own server-driven Generate.
        want = await whole_model_steps(whole.target, PROMPT, max_tokens=N_TOKENS, ignore_eos=True)
        tokens = [s.logits.token_id for s in want]
        assert len(tokens) == N_TOKENS and len(set(tokens)) > 5, tokens  # not one token repeated
        # The reference logits: the whole model fed the prompt in the same chunks as the chains.
        # llama.cpp's rounding depends on how many rows a step holds (its matrix kernels), by
        # up to 1e-3 on these models, so only equal chunking can show a bit-exact chain.
        whole_out = spy_outputs(whole.engine)
        async with Pipeline.connect([whole.target], timeout=TIMEOUT) as pipe:
            ref = await pipe.generate(PROMPT, max_tokens=N_TOKENS, ignore_eos=True, chunk_tokens=CHUNK)
        assert ref.tokens == tokens
        for cuts, chain in zip(model.chains, chains, strict=True):
            last_out = spy_outputs(workers[chain[-1]].engine)
            async with Pipeline.connect([workers[r].target for r in chain], timeout=TIMEOUT) as pipe:
                got = await pipe.generate(PROMPT, max_tokens=N_TOKENS, ignore_eos=True, chunk_tokens=CHUNK)
            assert len(last_out) == len(whole_out) > N_TOKENS  # prompt chunks, then decode steps
            diff = max(float(np.max(np.abs(a - b))) for a, b in zip(last_out, whole_out, strict=True))
            with capsys.disabled():  # the numbers docs/engine.md quotes, shown on every run
                print(f"\n[layer ranges] {arch:<10} cuts {tuple(cuts)!s:<16} "
                      f"max |logit diff| {diff:.3g} over {len(last_out)} steps", end="")
            assert got.tokens == tokens, cuts
            assert diff <= entry.tolerance, (cuts, diff, entry.tolerance_why)
        await assert_all_free(list(workers.values()))


def test_chain_parts_are_what_the_table_says() -> None:
    """Each chain's parts: the table refuses none of them, and each slice loads as the table
    wrote it (per-layer arrays and SWA patterns as long as the slice)."""
    for arch, model in MODELS.items():
        source = ensure_arch_model(arch)
        whole = Model.of(read_model_info(source))
        for cuts in model.chains:
            for lr in ranges_of(cuts):
                assert lookup(arch).refusal(whole, lr) is None, (arch, lr)
                info = read_model_info(ensure_slice(source, lr))
                for key, value in info.metadata.items():
                    if isinstance(value, tuple) and key.startswith(f"{arch}.") and len(value) > 1:
                        assert len(value) == lr.count, (arch, lr, key)


def test_make_model_arch_and_slice_refusals_on_the_command_line(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "shard.cli"]
    out = tmp_path / "l4.gguf"
    made = subprocess.run([*cli, "make-model", "--arch", "llama4", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == str(out) and read_model_info(out).architecture == "llama4"
    assert out.read_bytes() == ensure_arch_model("llama4").read_bytes()  # deterministic
    bad = subprocess.run([*cli, "slice", "--model", str(out), "--layers", "0:3", "--out", str(tmp_path / "x.gguf")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "boundary 3 is not exact for Llama 4: allowed boundaries are multiples of 4 (0, 4, 8, 12)" in bad.stderr
    serve = subprocess.run([*cli, "serve", "--model", str(out), "--layers", "2:12", "--port", "0"],
                           capture_output=True, text=True, timeout=120, env={**os.environ, "TRIO_SHARD_CACHE": str(tmp_path)})
    assert serve.returncode == 2 and "block boundary 2 is not exact for Llama 4" in serve.stderr
    unknown = subprocess.run([*cli, "make-model", "--arch", "nope", "--out", str(tmp_path / "n.gguf")],
                             capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "choose one of llama, qwen2" in unknown.stderr


async def test_caps_report_the_architecture_and_its_boundaries_over_the_wire() -> None:
    """``trio-shard caps`` (GetCapabilities 1.1) on a whole Llama 4 test model and on one of its
    shards: the architecture, whether layer ranges are served, and on which boundaries."""
    cli = [sys.executable, "-m", "shard.cli", "--log-level", "WARNING", "caps", "--json"]
    async with arch_workers("llama4", [None, LayerRange(4, 12)]) as workers:
        shown = {}
        for lr, w in workers.items():
            done = await trio.run_process([*cli, "--target", w.target], capture_stdout=True)
            shown[lr] = json.loads(done.stdout)
    whole, shard = shown[None], shown[LayerRange(4, 12)]
    assert whole["architecture"] == shard["architecture"] == "llama4"
    assert whole["layer_ranges_supported"] is True and shard["layer_ranges_supported"] is True
    assert whole["layer_ranges_detail"] == "allowed boundaries are multiples of 4 (0, 4, 8, 12)"
    assert shard["layer_ranges_detail"].startswith("allowed boundaries: multiples of 4")
    assert shard["layer_range"] == [4, 12] and "1.1" in whole["supported_versions"]
