"""How a pipeline cuts a prompt into prefill steps (issue 53).

Over a route of one hop (a whole-model worker) the prompt goes as one ``Prefill``: nothing
overlaps there, and the worker's scheduler already cuts a long prompt into ticks among other
sessions' steps, so a Cancel still lands at the end of the running tick. Over several hops the
first shard computes ``DEFAULT_CHUNK_TOKENS`` positions a step so that the hops overlap. The
workers are live FakeEngine workers that record every prefill they are asked for
(``PrefillLog``: one entry per Prefill step, its positions); the tokens must stay the whole
model's, bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from rpc_harness import MAX_SESSIONS, N_CTX, PrefillLog
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.client import ShardClient
from shard.engine import LayerRange, LoadSpec
from shard.engine.fake import FakeScript, FakeStep
from shard.pipeline import pipeline as pipeline_module
from shard.pipeline import DEFAULT_CHUNK_TOKENS, TIMED_ONE_HOP_CHUNK_TOKENS, Pipeline
from test_pipeline import TIMEOUT, assert_all_free, cuts_to_ranges, shards, whole_model_steps

WHOLE = LayerRange(0, 4)
#: Token ids of a prompt of two and a half default chunks (within a session's context).
N_PROMPT = min(DEFAULT_CHUNK_TOKENS * 5 // 2, N_CTX // MAX_SESSIONS - 16)
PROMPT_IDS = [1, *(3 + (i * 7) % 200 for i in range(N_PROMPT - 1))]
N_TOKENS = 8


def chunks_of(n: int, chunk: int) -> list[int]:
    """The positions of each step of an ``n``-position prefill in steps of ``chunk``."""
    return [min(chunk, n - i) for i in range(0, n, chunk)]


def tokens_of(steps: Any) -> list[int]:
    return [s.logits.token_id for s in steps]


@pytest.mark.parametrize("replicas, speculate", [(1, 0), (2, 0), (1, 2)],
                         ids=["alone", "replicas", "speculating"])
@pytest.mark.parametrize("prompt", ["ids", "text"])
async def test_a_one_hop_route_prefills_the_prompt_in_one_step(
    replicas: int, speculate: int, prompt: str,
) -> None:
    """The worker's own loop (alone), the client stepping (replicas, speculation): one Prefill
    of the whole prompt on the serving worker, and the whole model's tokens."""
    given: list[int] | str = PROMPT_IDS if prompt == "ids" else "the quick brown fox " * 6
    async with shards([WHOLE] * (1 + replicas), engine=PrefillLog) as (ref, *ws):
        want = await whole_model_steps(ref.target, given, max_tokens=N_TOKENS, ignore_eos=True)
        async with Pipeline.connect([[w.target for w in ws]], timeout=TIMEOUT) as pipe:
            got = await pipe.generate(given, max_tokens=N_TOKENS, ignore_eos=True,
                                      speculate=speculate)
        assert got.tokens == tokens_of(want)
        n = got.prompt_tokens
        assert n == (len(PROMPT_IDS) if prompt == "ids" else want[0].n_past)
        serving, *standby = ws
        assert serving.engine.prefills[0] == n  # the prompt: one step
        assert all(p < n for p in serving.engine.prefills[1:])  # then decodes or verifications
        assert all(w.engine.prefills == [] for w in standby)
        await assert_all_free(ws)


async def test_an_explicit_chunk_is_honoured_on_one_hop_too() -> None:
    async with shards([WHOLE], engine=PrefillLog) as (w,):
        async with Pipeline.connect([w.target], timeout=TIMEOUT) as pipe:
            await pipe.generate(PROMPT_IDS, max_tokens=1, chunk_tokens=5)
        assert w.engine.prefills == chunks_of(len(PROMPT_IDS), 5)


async def test_with_a_step_timeout_one_hop_takes_bounded_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step timeout bounds every step, whatever the prompt's length: one hop then prefills
    ``TIMED_ONE_HOP_CHUNK_TOKENS`` positions a step (made small here to fit a test context)."""
    monkeypatch.setattr(pipeline_module, "TIMED_ONE_HOP_CHUNK_TOKENS", 16)
    async with shards([WHOLE], engine=PrefillLog) as (w,):
        async with Pipeline.connect([w.target], timeout=TIMEOUT, step_timeout=TIMEOUT) as pipe:
            assert pipe.prefill_chunk() == 16
            await pipe.generate(PROMPT_IDS, max_tokens=1)
        assert w.engine.prefills == chunks_of(len(PROMPT_IDS), 16)


@pytest.mark.parametrize("relay", ["client", "chain"])
@pytest.mark.parametrize("cuts", [[0, 2, 4], [0, 1, 3, 4]], ids=["2-hops", "3-hops"])
async def test_several_hops_prefill_in_default_chunks(cuts: list[int], relay: str) -> None:
    """Every hop computes the prompt ``DEFAULT_CHUNK_TOKENS`` positions a step (the first from
    the ids, the others from the boundary of each chunk as it comes), and the tokens are the
    whole model's."""
    async with shards([WHOLE], engine=PrefillLog) as (ref,), shards(
            cuts_to_ranges(cuts), engine=PrefillLog, relay=relay == "chain") as chain:
        want = await whole_model_steps(ref.target, PROMPT_IDS, max_tokens=N_TOKENS,
                                       ignore_eos=True)
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT,
                                    relay=relay) as pipe:
            assert pipe.prefill_chunk() == DEFAULT_CHUNK_TOKENS
            got = await pipe.generate(PROMPT_IDS, max_tokens=N_TOKENS, ignore_eos=True)
        assert got.tokens == tokens_of(want)
        steps = chunks_of(len(PROMPT_IDS), DEFAULT_CHUNK_TOKENS)
        assert len(steps) > 1
        for w in chain:
            assert w.engine.prefills[:len(steps)] == steps
            assert all(p == 1 for p in w.engine.prefills[len(steps):])  # then decodes
        await assert_all_free(chain)


async def test_chunk_choices_are_checked() -> None:
    async with shards([WHOLE, *cuts_to_ranges([0, 2, 4])]) as (whole, *chain):
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            for bad in (0, -1):  # the whole prompt in one step: a hidden-state message too large
                with pytest.raises(ValueError, match="chunk_tokens"):
                    await pipe.generate(PROMPT_IDS, max_tokens=1, chunk_tokens=bad)
        async with Pipeline.connect([whole.target], timeout=TIMEOUT) as pipe:
            assert pipe.prefill_chunk() == 0  # one hop, no step timeout: the whole prompt
            assert pipe.prefill_chunk(0) == 0
            assert TIMED_ONE_HOP_CHUNK_TOKENS > DEFAULT_CHUNK_TOKENS
            with pytest.raises(ValueError, match="chunk_tokens"):
                await pipe.generate(PROMPT_IDS, max_tokens=1, chunk_tokens=-1)
        await assert_all_free([whole, *chain])


async def test_a_one_hop_failover_replays_in_one_step() -> None:
    """The serving replica fails mid-generation: its standby replays the prompt and the tokens
    so far in one Prefill, and the caller gets the whole model's tokens, each once."""
    n = len(PROMPT_IDS)
    async with shards([WHOLE] * 3, engine=PrefillLog, fail_at_step={1: n + 4}) as (ref, a, b):
        want = await whole_model_steps(ref.target, PROMPT_IDS, max_tokens=N_TOKENS,
                                       ignore_eos=True)
        seen: list[int] = []
        async with Pipeline.connect([[a.target, b.target]], timeout=TIMEOUT) as pipe:
            got = await pipe.generate(PROMPT_IDS, max_tokens=N_TOKENS, ignore_eos=True,
                                      on_token=lambda s: seen.append(s.logits.token_id))
        assert got.tokens == seen == tokens_of(want)
        (f,) = got.failovers
        assert f.to_target == b.target
        assert a.engine.prefills[0] == n
        assert b.engine.prefills[0] == f.positions > n  # the replay: one step
        await assert_all_free([a, b])


async def test_a_cancel_lands_within_a_tick_of_a_one_step_prompt() -> None:
    """A one-hop prompt sent as one Prefill still runs as ticks of ``batch_tokens`` rows on a
    batching worker: cancelling the generation mid-prompt (as the door does when a client
    goes away) stops it at the end of the running tick, and the worker releases everything."""
    batch, n = 8, N_CTX // 2 - 8
    prompt = [1, *(3 + i % 200 for i in range(n - 1))]
    cancel_at = 3 * batch + 2
    computed: list[int] = []
    scope = trio.CancelScope()

    async def on_step(step: FakeStep) -> None:
        computed.append(step.position)
        if step.position == cancel_at:
            scope.cancel()  # the client resets the stream ...
            await trio.sleep(0.2)  # ... and the worker hears it while this tick runs

    from rpc_harness import worker

    engine = PrefillLog(script=FakeScript(batched=True, on_step=on_step))
    spec = LoadSpec(n_ctx=N_CTX, max_sessions=2, batch_tokens=batch)
    async with worker(engine=engine, load=spec) as w:
        async with Pipeline.connect([w.target], timeout=TIMEOUT) as pipe:
            with scope:
                await pipe.generate(prompt, max_tokens=1)
        assert scope.cancelled_caught
        assert engine.prefills == [n]  # one Prefill ...
        tick_end = (cancel_at // batch + 1) * batch
        assert max(computed) == tick_end - 1  # ... stopped at the end of the running tick
        await w.idle()
        async with ShardClient.connect(w.target, timeout=TIMEOUT) as client:
            m = await client.metrics()
        assert (m.engine["sessions_active"], m.engine["kv_cells_used"]) == (0, 0)


def test_the_cli_leaves_the_chunk_to_the_pipeline_and_says_its_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from shard.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["generate", "--pipeline", "a:1,b:2", "x"]).chunk_tokens is None
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"default: {DEFAULT_CHUNK_TOKENS} over several hops" in text
    assert f"or {TIMED_ONE_HOP_CHUNK_TOKENS} a step with" in text
