"""A prompt's log-probs through a pipeline (``Pipeline.generate(prompt_logprobs=True)``,
``shard.pipeline.scoring``), on live FakeEngine workers, client and chain relay.

The reference is a whole-model worker stepping the prompt one token at a time, each step's
choice forced by a logit bias onto the prompt's next token: its ``logprob`` is the model's (the
bias changes the choice, not the log-probs) and its ``top`` the alternatives there. A prompt
longer than the last shard's ``max_logits_positions`` goes in several overlapping passes and
must give the same values, with nothing left held on any worker.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import trio

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.client import ShardClient, sampling
from shard.engine import LayerRange
from shard.engine.types import MAX_LOGITS_POSITIONS
from shard.pipeline import Pipeline, PipelineResult
from test_pipeline import TIMEOUT, assert_all_free, shards
from test_relay import relay_shards

TWO = [LayerRange(0, 2), LayerRange(2, 4)]
SHORT = [1, *range(40, 60)]
LONG = [1, *(3 + (i * 37) % 200 for i in range(2 * MAX_LOGITS_POSITIONS + 10))]  # three passes


async def forced_steps(target: str, prompt: Sequence[int], top: int) -> list[tuple[float, list]]:
    """(log-prob, top alternatives) of each prompt token after the first, stepped one at a
    time on a whole-model worker with the choice forced onto the next prompt token."""
    out = []
    async with ShardClient.connect(target, timeout=TIMEOUT) as client:
        async with client.session() as s:
            for i in range(len(prompt) - 1):
                forced = sampling(logit_bias={prompt[i + 1]: 1e4})
                if i == 0:
                    step = await s.prefill(prompt[:1], sampling=forced, top_logprobs=top)
                else:
                    step = await s.decode(prompt[i], sampling=forced, top_logprobs=top)
                assert step.logits.token_id == prompt[i + 1]
                out.append((step.logits.logprob, list(step.logits.top)))
    return out


def assert_scored(got: PipelineResult, want: list[tuple[float, list]]) -> None:
    assert len(got.prompt_logprobs) == len(want)
    for i, (scored, (logprob, top)) in enumerate(zip(got.prompt_logprobs, want, strict=True)):
        assert math.isclose(scored.logprob, logprob, abs_tol=1e-5), (i, scored.logprob, logprob)
        assert [t.token_id for t in scored.top] == [t.token_id for t in top], i
        for a, b in zip(scored.top, top, strict=True):
            assert math.isclose(a.logprob, b.logprob, abs_tol=1e-5) and a.piece == b.piece


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["one-pass", "three-passes"])
async def test_prompt_logprobs_over_two_hops_equal_the_whole_model_stepped(
        prompt: list[int]) -> None:
    """Client relay: each prompt token's log-prob and top-3 equal the whole model's; with
    ``max_tokens`` 0 nothing is generated, and the tokens after a scored prompt are a plain
    generation's."""
    async with shards([LayerRange(0, 4), *TWO]) as (whole, *chain):
        want = await forced_steps(whole.target, prompt, 3)
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            got = await pipe.generate(prompt, max_tokens=0, top_logprobs=3, prompt_logprobs=True)
            assert_scored(got, want)
            assert got.steps == [] and got.prompt_tokens == len(prompt)
            more = await pipe.generate(prompt, max_tokens=5, top_logprobs=3, prompt_logprobs=True,
                                       ignore_eos=True)
            plain = await pipe.generate(prompt, max_tokens=5, top_logprobs=3, ignore_eos=True)
            assert_scored(more, want)
            assert more.tokens == plain.tokens
            assert [s.logits.logprob for s in more.steps] == [s.logits.logprob for s in plain.steps]
            assert [s.n_past for s in more.steps] == [s.n_past for s in plain.steps]
        await assert_all_free([whole, *chain])


async def test_prompt_logprobs_over_a_chain_relay_and_one_hop() -> None:
    """Chain relay (the workers forward each pass, the ids with the rows) and a whole-model
    worker alone (the client steps instead of the worker's loop) give the same values."""
    async with relay_shards([LayerRange(0, 4), *TWO]) as (whole, *chain):
        want = await forced_steps(whole.target, LONG, 2)
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT,
                                    relay="chain") as pipe:
            chained = await pipe.generate(LONG, max_tokens=2, top_logprobs=2,
                                          prompt_logprobs=True, ignore_eos=True)
        async with Pipeline.connect([whole.target], timeout=TIMEOUT) as pipe:
            alone = await pipe.generate(LONG, max_tokens=2, top_logprobs=2, prompt_logprobs=True,
                                        ignore_eos=True)
            with pytest.raises(ValueError, match="token ids"):
                await pipe.generate("text", max_tokens=0, prompt_logprobs=True)
            with pytest.raises(ValueError, match="max_tokens"):
                await pipe.generate(LONG, max_tokens=0)
        assert_scored(chained, want)
        assert_scored(alone, want)
        assert chained.tokens == alone.tokens and len(alone.tokens) == 2
        await assert_all_free([whole, *chain])


@pytest.mark.parametrize(("relay", "hop"), [("client", 0), ("client", 2), ("chain", 1)])
async def test_a_hop_fails_over_while_the_prompt_is_scored(relay: str, hop: int) -> None:
    """A worker stopped in the second of three passes: its replica replays the hop's log (the
    passes' overlapping writes as they replaced each other) and the scores and tokens are the
    whole model's, each prompt token scored once."""
    from test_failover import fleet, gate_of
    from test_pipeline import after_steps

    async with fleet(relay) as (whole, hops, gates):
        want = await forced_steps(whole.target, LONG, 2)
        primary, _ = hops[hop]
        async with Pipeline.connect([[w.target for w in ws] for ws in hops], timeout=TIMEOUT,
                                    relay=relay) as pipe:
            plain = await pipe.generate(LONG, max_tokens=3, ignore_eos=True)
            async with trio.open_nursery() as nursery:
                # a few positions into the second pass (the gate counts positions)
                gate = gate_of(gates, hop, 0)
                nursery.start_soon(after_steps, gate, gate.steps + MAX_LOGITS_POSITIONS + 8,
                                   primary.stop)
                got = await pipe.generate(LONG, max_tokens=3, top_logprobs=2,
                                          prompt_logprobs=True, ignore_eos=True)
        assert_scored(got, want)
        assert got.tokens == plain.tokens
        assert [f.hop for f in got.failovers] == [hop]
        await assert_all_free([whole, *(w for ws in hops for w in ws if w is not primary)])
