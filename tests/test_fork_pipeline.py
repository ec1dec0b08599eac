"""``Pipeline.generate_choices``: n choices of one prompt, prefilled once and forked on every
hop, over two halves of the fake model (client relay and chain relay) and one whole-model
worker: greedy choices are equal and equal a plain generation's; seeded ones are reproducible
and each equals a plain generation with its own seed."""

from __future__ import annotations

import pytest

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import worker
from shard.engine import LayerRange, LoadSpec
from shard.engine.llama import LlamaCppEngine
from shard.models import ensure_model
from shard.pipeline import Pipeline
from test_pipeline import PROMPT, TIMEOUT
from test_relay import free_within, relay_shards

N = 4
N_TOKENS = 12
HALVES = [LayerRange(0, 2), LayerRange(2, 4)]
LAYOUTS = {"client": (HALVES, "client"), "chain": (HALVES, "chain"),
           "whole": ([LayerRange(0, 4)], "client")}


def tokens(result: object) -> list[int]:
    return [s.logits.token_id for s in result.steps]  # type: ignore[attr-defined]


@pytest.mark.parametrize("layout", list(LAYOUTS))
async def test_n_choices_prefill_once_and_equal_independent_generations(layout: str) -> None:
    ranges, relay = LAYOUTS[layout]
    async with relay_shards(ranges) as shards:
        targets = [w.target for w in shards]
        async with Pipeline.connect(targets, timeout=TIMEOUT, relay=relay) as pipe:
            seen: dict[int, list[int]] = {i: [] for i in range(N)}
            greedy = await pipe.generate_choices(
                PROMPT, N, max_tokens=N_TOKENS, ignore_eos=True,
                on_token=lambda i, s: seen[i].append(s.logits.token_id))
            n_prompt = greedy[0].prompt_tokens
            assert n_prompt > 1 and all(r.prompt_tokens == n_prompt for r in greedy)
            for shard in shards:  # the prompt once, then one position again per fork
                m = shard.engine.metrics()
                assert m.sessions_forked_total == N - 1
                assert m.prefill_tokens_total == n_prompt + N - 1
            plain = tokens(await pipe.generate(PROMPT, max_tokens=N_TOKENS, ignore_eos=True))
            assert [tokens(r) for r in greedy] == [plain] * N
            assert [seen[i] for i in range(N)] == [plain] * N
            sampled = await pipe.generate_choices(
                PROMPT, N, seed=11, temperature=1.5, max_tokens=N_TOKENS, ignore_eos=True)
            again = await pipe.generate_choices(
                PROMPT, N, seed=11, temperature=1.5, max_tokens=N_TOKENS, ignore_eos=True)
            assert [tokens(r) for r in sampled] == [tokens(r) for r in again]
            assert len({tuple(tokens(r)) for r in sampled}) > 1  # each its own stream
            for i in (0, N - 1):
                alone = await pipe.generate(PROMPT, seed=11 + i, temperature=1.5,
                                            max_tokens=N_TOKENS, ignore_eos=True)
                assert tokens(sampled[i]) == tokens(alone)
        await free_within(shards)


async def test_n_choices_on_llama_cpp_fork_the_prompts_cells() -> None:
    """On the tiny llama.cpp model (a whole-model worker): the forks' cells are copied with
    ``llama_memory_seq_cp``; every greedy choice equals a plain generation, the prompt is
    computed once (each fork: its last position again), and no cell is left behind."""
    spec = LoadSpec(model_path=str(ensure_model("tiny")), n_ctx=1024, max_sessions=4, n_threads=1)
    async with worker(engine=LlamaCppEngine(), load=spec) as w:
        async with Pipeline.connect([w.target], timeout=TIMEOUT) as pipe:
            plain = tokens(await pipe.generate(PROMPT, max_tokens=N_TOKENS, ignore_eos=True))
            before = w.engine.metrics()
            choices = await pipe.generate_choices(PROMPT, 3, max_tokens=N_TOKENS, ignore_eos=True)
            assert [tokens(r) for r in choices] == [plain] * 3
            m = w.engine.metrics()
            n_prompt = choices[0].prompt_tokens
            assert m.sessions_forked_total == 2
            assert m.prefill_tokens_total - before.prefill_tokens_total == n_prompt + 2
        await w.idle()
        assert w.engine.metrics().kv_cells_used == 0
