"""Pipelines of live llama.cpp workers (the tiny model, 4 blocks, sliced into layer ranges)
against one whole-model worker: same greedy tokens over >= 32 steps, and last-shard top
log-probabilities within 1e-4 of the whole model's.

Needs ``shard.models.ensure_slice`` and ``LlamaCppEngine`` serving ``LoadSpec.layer_range``
(issue 7, parts 1-2); every shard reports the source model's fingerprint, so the pipeline's
chain check accepts them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio

from rpc_harness import Worker, worker
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.engine import LayerRange, LoadSpec
from shard.engine.llama import LlamaCppEngine
from shard.models import ensure_model, ensure_slice
from shard.pipeline import Pipeline
from shard.v1 import shard_pb2 as pb
from test_pipeline import TIMEOUT, assert_all_free, whole_model_steps

PROMPT = "hello world, this is a pipeline"
N_TOKENS = 36
TOP = 8
CHAINS = {"2-workers": [0, 2, 4], "3-workers": [0, 1, 3, 4]}


@asynccontextmanager
async def llama_workers(
    ranges: Sequence[LayerRange | None], *, relay: bool = False, preset: str = "tiny"
) -> AsyncIterator[list[Worker]]:
    """One live LlamaCppEngine worker per range (None: the whole model of ``preset``);
    ``relay``: each one relays routes (``serve --allow-relay``)."""
    from shard.relay import ChainRelay

    source = ensure_model(preset)
    async with AsyncExitStack() as stack:
        workers = []
        for lr in ranges:
            path = source if lr is None else await trio.to_thread.run_sync(ensure_slice, source, lr)
            spec = LoadSpec(model_path=path, layer_range=lr, n_ctx=1024, max_sessions=2, n_threads=1)
            workers.append(await stack.enter_async_context(worker(
                engine=LlamaCppEngine(), load=spec, relay=ChainRelay() if relay else None)))
        yield workers


def ranges_of(cuts: list[int]) -> list[LayerRange]:
    return [LayerRange(a, b) for a, b in zip(cuts, cuts[1:])]


@pytest.mark.parametrize("cuts", list(CHAINS.values()), ids=list(CHAINS))
async def test_llama_pipeline_equals_the_whole_model_worker(cuts: list[int]) -> None:
    async with llama_workers([None, *ranges_of(cuts)]) as (whole, *chain):
        want = await whole_model_steps(
            whole.target, PROMPT, max_tokens=N_TOKENS, ignore_eos=True, top_logprobs=TOP
        )
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            assert len({h.caps.model_fingerprint for h in pipe.hops if h.caps}) == 1
            got = await pipe.generate(
                PROMPT, max_tokens=N_TOKENS, ignore_eos=True, top_logprobs=TOP, chunk_tokens=4
            )
        assert len(want) == N_TOKENS >= 32
        assert got.tokens == [s.logits.token_id for s in want]
        worst = 0.0
        for g, w in zip(got.steps, want, strict=True):
            assert [t.token_id for t in g.logits.top] == [t.token_id for t in w.logits.top]
            for a, b in zip(g.logits.top, w.logits.top, strict=True):
                worst = max(worst, abs(a.logprob - b.logprob))
        assert worst <= 1e-4, f"last-shard log-probabilities differ by {worst}"
        await assert_all_free([whole, *chain])


async def test_llama_pipeline_cancel_frees_every_shard() -> None:
    async with llama_workers(ranges_of([0, 1, 3, 4])) as chain:
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            seen = 0

            def count(_: pb.StepResult) -> None:
                nonlocal seen
                seen += 1
                if seen == 10:
                    scope.cancel()

            with trio.CancelScope() as scope:
                await pipe.generate(PROMPT, max_tokens=200, ignore_eos=True, on_token=count)
        assert scope.cancelled_caught and seen == 10
        for w in chain:  # llama.cpp's own KV cell count, right after the call returned
            m = w.engine.metrics()
            assert m.sessions_active == 0 and m.kv_cells_used == 0
        await assert_all_free(chain)


async def test_llama_generate_pipeline_json_equals_single_worker() -> None:
    cli = [sys.executable, "-m", "shard.cli", "--log-level", "WARNING", "generate", "--json",
           "--max-tokens", "32", PROMPT]
    async with llama_workers([None, *ranges_of([0, 2, 4])]) as (whole, *chain):
        single = await trio.run_process([*cli, "--target", whole.target], capture_stdout=True)
        piped = await trio.run_process(
            [*cli, "--pipeline", ",".join(w.target for w in chain)], capture_stdout=True
        )
    assert isinstance(single, subprocess.CompletedProcess)
    got, want = json.loads(piped.stdout), json.loads(single.stdout)
    assert got["tokens"] == want["tokens"]
    assert got.pop("traversals") == len(want["tokens"])  # the prompt's pass, one per later token
    assert got == want


@pytest.mark.parametrize("cuts", [[0, 4], *CHAINS.values()], ids=["1-worker", *CHAINS])
async def test_llama_speculation_gives_the_tokens_of_plain_decoding(cuts: list[int]) -> None:
    """Speculative verification on llama.cpp shards: drafts accepted and rejected (a scripted
    drafter), and prompt lookup; greedy tokens equal the whole model's, the last shard's
    log-probabilities within 1e-3 (a verifying step's rows are one batch), nothing left."""
    from test_speculation import Scripted, always_draft

    async with llama_workers([None, *ranges_of(cuts)], relay=True) as (whole, *chain):
        want = await whole_model_steps(
            whole.target, PROMPT, max_tokens=N_TOKENS, ignore_eos=True, top_logprobs=TOP
        )
        tokens = [s.logits.token_id for s in want]
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            always_draft(pipe)
            scripted = await pipe.generate(
                PROMPT, max_tokens=N_TOKENS, ignore_eos=True, top_logprobs=TOP, speculate=4,
                drafter=Scripted(tokens, want[0].n_past, wrong_every=3),  # the prompt's ids first
            )
            lookup = await pipe.generate(
                PROMPT, max_tokens=N_TOKENS, ignore_eos=True, top_logprobs=TOP, speculate=4
            )
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT,
                                    relay="chain" if len(chain) > 1 else "client") as pipe:
            always_draft(pipe)
            chained = await pipe.generate(
                PROMPT, max_tokens=N_TOKENS, ignore_eos=True, top_logprobs=TOP, speculate=4,
                drafter=Scripted(tokens, want[0].n_past, wrong_every=3),
            )
        assert scripted.tokens == tokens == lookup.tokens == chained.tokens
        assert chained.traversals == scripted.traversals
        assert 0 < scripted.accepted_tokens < scripted.drafted_tokens
        assert scripted.traversals == N_TOKENS - scripted.accepted_tokens
        for g, w in zip(scripted.steps, want, strict=True):
            assert g.n_past == w.n_past
            for a, b in zip(g.logits.top, w.logits.top, strict=True):
                assert abs(a.logprob - b.logprob) <= 1e-3
        await assert_all_free([whole, *chain])
        for w in [whole, *chain]:
            assert w.engine.metrics().kv_cells_used == 0


@pytest.mark.slow
async def test_bench_model_three_hops_speculation_gives_the_whole_models_tokens() -> None:
    """The bench-size model (12 blocks, 32,000-token vocabulary) cut 0:4, 4:8, 8:12: the
    whole model's greedy tokens through client relay, chain relay, and speculation over both
    (prompt lookup, and a scripted drafter that is wrong every third position)."""
    from shard.relay import ChainRelay
    from test_speculation import Scripted, always_draft

    source = await trio.to_thread.run_sync(ensure_model, "bench")
    async with AsyncExitStack() as stack:
        workers = []
        for lr in (None, *ranges_of([0, 4, 8, 12])):
            path = source if lr is None else await trio.to_thread.run_sync(ensure_slice, source, lr)
            spec = LoadSpec(model_path=path, layer_range=lr, n_ctx=512, max_sessions=1, n_threads=1)
            workers.append(await stack.enter_async_context(
                worker(engine=LlamaCppEngine(), load=spec, relay=ChainRelay())))
        whole, *chain = workers
        prompt = [1, *range(300, 320), *range(300, 320)]
        want = await whole_model_steps(whole.target, prompt, max_tokens=32, ignore_eos=True)
        tokens = [s.logits.token_id for s in want]
        for relay in ("client", "chain"):
            async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT, relay=relay) as pipe:
                always_draft(pipe)
                plain = await pipe.generate(prompt, max_tokens=32, ignore_eos=True)
                lookup = await pipe.generate(prompt, max_tokens=32, ignore_eos=True, speculate=4)
                scripted = await pipe.generate(prompt, max_tokens=32, ignore_eos=True, speculate=4,
                                               drafter=Scripted(tokens, len(prompt), wrong_every=3))
            assert plain.tokens == lookup.tokens == scripted.tokens == tokens, relay
            assert 0 < scripted.accepted_tokens < scripted.drafted_tokens
        await assert_all_free(workers)
