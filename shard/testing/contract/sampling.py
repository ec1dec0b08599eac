"""Contract tests of token choice: greedy and seeded sampling give the same tokens on every
run and every engine instance of one model; penalties see the session's ids (prompt and
generated, through a rewind and on a chain's last hop); logit_bias forces and forbids."""

from __future__ import annotations

import math

import pytest
import trio

from shard.engine import (
    DecodeRequest,
    InvalidInput,
    PrefillRequest,
    SamplingParams,
    ShardEngine,
    StepResult,
    StreamRequest,
)

from ..factories import EngineFactory, EngineOptions, ShardPart
from .harness import (
    assert_layer_range_refused,
    decode,
    generate,
    prefill,
    prompt_tokens,
)
from .prefix_cache import cached_engine

#: Sampled with every penalty, over the whole session.
PENALIZED = SamplingParams(temperature=1.0, seed=5, repeat_penalty=1.3, presence_penalty=0.5,
                           frequency_penalty=0.4, penalty_last_n=-1, min_p=0.01)


class Sampling:
    """Greedy and seeded sampling are deterministic; penalties see the session's ids wherever
    they came from (a rewind, a replay, a hand-off, the prefix cache, a later hop's token_ids)."""

    async def test_greedy_is_deterministic(self, engine_factory: EngineFactory) -> None:
        runs: list[list[int]] = []
        fingerprints: set[str] = set()
        for _ in range(2):  # two engine instances of the same model
            async with engine_factory.open() as engine:
                tokens = prompt_tokens(engine, 9, salt=2)
                await engine.open_session("a")
                await engine.open_session("b")
                runs.append(await generate(engine, "a", tokens, 12))
                runs.append(await generate(engine, "b", tokens, 12))
                fingerprints.add(engine.capabilities().model_fingerprint)
        assert all(run == runs[0] for run in runs)
        assert len(fingerprints) == 1

    async def test_seeded_sampling_is_deterministic(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            tokens = prompt_tokens(engine, 9, salt=6)

            async def sample(seed: int) -> list[int]:
                sid = f"seed-{seed}"
                await engine.open_session(sid)
                params = SamplingParams(temperature=1.5, top_k=64, top_p=0.98, seed=seed)
                out = await generate(engine, sid, tokens, 10, sampling=params)
                await engine.release(sid)
                return out

            first = await sample(7)
            assert await sample(7) == first
            assert await sample(7) == first
            assert len({tuple(await sample(seed)) for seed in range(6)}) > 1

    async def test_penalties_see_the_prompt_and_the_generated_tokens(
        self, engine_factory: EngineFactory
    ) -> None:
        # A presence penalty far above the spread of the logits: each step takes the model's
        # likeliest token not yet in the session, read from the step's (unpenalized) top list.
        params = SamplingParams(presence_penalty=1e4, penalty_last_n=-1)
        async with engine_factory.open() as engine:
            tokens = prompt_tokens(engine, 9, salt=3)
            # where plain greedy first repeats a token of the session (prompt or generated)
            await engine.open_session("plain")
            plain = await generate(engine, "plain", tokens, 40)
            repeat = next(j for j, t in enumerate(plain) if t in (*tokens, *plain[:j]))
            await engine.open_session("p")
            history = [*tokens, *plain[:repeat]]
            result = await prefill(engine, "p", history, sampling=params, top_k_logprobs=64)
            for step in range(8):
                assert result.logits is not None
                top = [t.token_id for t in result.logits.top]
                assert step > 0 or top[0] == plain[repeat] in history
                fresh = [t for t in top if t not in history]
                assert result.logits.token_id == fresh[0], (top, history)
                history.append(result.logits.token_id)
                result = await decode(engine, "p", history[-1], sampling=params, top_k_logprobs=64)

    async def test_a_rewind_or_a_replay_gives_the_same_penalized_tokens(
        self, engine_factory: EngineFactory
    ) -> None:
        async with engine_factory.open() as engine:
            tokens = prompt_tokens(engine, 9, salt=4)
            await engine.open_session("a")
            out = await generate(engine, "a", tokens, 10, sampling=PENALIZED)
            # rewind "a" to just after out[3] and decode on
            r = await prefill(engine, "a", out[3:4], position=len(tokens) + 3, sampling=PENALIZED)
            again = await _continue(engine, "a", r, 6)
            assert again == out[4:11]
            # a fresh session given the same ids chooses the same next token
            await engine.open_session("b")
            r = await prefill(engine, "b", (*tokens, *out[:6]), sampling=PENALIZED)
            assert r.logits is not None and r.logits.token_id == out[6]

    async def test_logit_bias_forces_and_forbids_a_token(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            tokens = prompt_tokens(engine, 9, salt=5)
            await engine.open_session("plain")
            plain = await prefill(engine, "plain", tokens, top_k_logprobs=2)
            assert plain.logits is not None
            first, second = (t.token_id for t in plain.logits.top)
            await engine.open_session("forbid")
            r = await prefill(engine, "forbid", tokens,
                              sampling=SamplingParams(logit_bias={first: -math.inf}))
            assert r.logits is not None and r.logits.token_id == second
            # the reported log-probability is the model's, not the biased one
            assert math.isclose(r.logits.logprob, plain.logits.top[1].logprob, abs_tol=1e-4)
            forced = 7
            await engine.open_session("force")
            out = await generate(engine, "force", tokens, 4,
                                 sampling=SamplingParams(temperature=1.0, seed=2,
                                                         logit_bias={forced: 1e3}))
            assert out == [forced] * 5
            n_vocab = engine.capabilities().n_vocab
            with pytest.raises(InvalidInput, match="logit_bias"):
                await prefill(engine, "force", tokens,
                              sampling=SamplingParams(logit_bias={n_vocab: 1.0}))
            with pytest.raises(InvalidInput, match="every token"):
                await prefill(engine, "force", tokens, sampling=SamplingParams(
                    logit_bias={t: -math.inf for t in range(n_vocab)}))

    async def test_a_moved_session_goes_on_with_the_same_penalized_tokens(
        self, engine_factory: EngineFactory
    ) -> None:
        """A hand-off (export, import on another engine) carries the ids the penalties see."""
        async with engine_factory.open() as a, engine_factory.open() as b:
            tokens = prompt_tokens(a, 9, salt=7)
            await a.open_session("s")
            out = await generate(a, "s", tokens, 4, sampling=PENALIZED)
            snap = await a.export_session("s")
            await b.open_session("copy")
            await b.import_session("copy", snap)
            here = await _continue(a, "s", await decode(a, "s", out[-1], sampling=PENALIZED), 5)
            there = await _continue(b, "copy", await decode(b, "copy", out[-1], sampling=PENALIZED), 5)
            assert here == there

    async def test_a_prefix_copied_from_the_cache_is_penalized_as_computed(
        self, engine_factory: EngineFactory
    ) -> None:
        """A prefill whose start the prefix cache serves sees the copied ids in its window."""
        async with cached_engine(engine_factory) as engine:
            tokens = prompt_tokens(engine, 9, salt=8)
            await engine.open_session("a")
            out = await generate(engine, "a", tokens, 6, sampling=PENALIZED)
            await engine.release("a")  # (its history stays cached)
            await engine.open_session("b")
            r = await prefill(engine, "b", (*tokens, *out[:4]), sampling=PENALIZED)
            assert r.cached_tokens > 0
            assert _token(r) == out[4]

    @pytest.mark.parametrize("lookahead", [True, False], ids=["ahead", "plain"])
    async def test_streams_with_penalties_or_bias_give_the_tokens_of_single_steps(
        self, engine_factory: EngineFactory, lookahead: bool
    ) -> None:
        """Sessions streaming at once (a batching engine shares its ticks between them), each
        with another sampling, get the tokens decoding step by step gives."""
        kinds = {
            "penalized": SamplingParams(repeat_penalty=1.5, frequency_penalty=1.0, penalty_last_n=-1),
            "biased": SamplingParams(logit_bias={7: 2.0, 8: -math.inf}),
            "sampled": PENALIZED,
        }
        async with engine_factory.open() as engine:
            prompts = {sid: prompt_tokens(engine, 10, salt=i) for i, sid in enumerate(kinds)}
            streamed: dict[str, list[int]] = {}

            async def run(sid: str) -> None:
                await engine.open_session(sid)
                first = _token(await prefill(engine, sid, prompts[sid], sampling=kinds[sid]))
                got: list[int] = [first]
                await engine.stream(StreamRequest(sid, first, 9, sampling=kinds[sid],
                                                  lookahead=lookahead),
                                    lambda r: got.append(_token(r)) is None)
                streamed[sid] = got

            async with trio.open_nursery() as nursery:
                for sid in kinds:
                    nursery.start_soon(run, sid)
            for sid, params in kinds.items():
                await engine.open_session("ref")
                assert streamed[sid] == await generate(engine, "ref", prompts[sid], 9,
                                                       sampling=params), sid
                await engine.release("ref")

    async def test_a_chains_last_hop_penalizes_the_ids_it_is_given(
        self, engine_factory: EngineFactory
    ) -> None:
        if not engine_factory.layer_ranges:
            await assert_layer_range_refused(engine_factory, ShardPart.FIRST)
            return
        async with (
            engine_factory.open(EngineOptions(part=ShardPart.FIRST)) as first,
            engine_factory.open(EngineOptions(part=ShardPart.LAST)) as last,
            engine_factory.open() as whole,
        ):
            tokens = prompt_tokens(first, 9, salt=9)
            for engine in (first, last, whole):
                await engine.open_session("s")
            expected = await generate(whole, "s", tokens, 8, sampling=PENALIZED)
            b = await prefill(first, "s", tokens)
            assert b.boundary is not None
            r = await last.prefill(PrefillRequest("s", hidden_states=b.boundary.hidden_states,
                                                  token_ids=tokens, sampling=PENALIZED))
            got = [_token(r)]
            for _ in range(8):
                b = await decode(first, "s", got[-1])
                assert b.boundary is not None
                r = await last.decode(DecodeRequest("s", hidden_state=b.boundary.hidden_states,
                                                    token_id=got[-1], sampling=PENALIZED))
                got.append(_token(r))
            assert got == expected
            # without the ids, a penalized step is refused and the session is unchanged
            b = await decode(first, "s", got[-1])
            assert b.boundary is not None
            n_past = last.session_info("s").n_past
            with pytest.raises(InvalidInput, match="token ids"):
                await last.decode(DecodeRequest("s", hidden_state=b.boundary.hidden_states,
                                                sampling=PENALIZED))
            assert last.session_info("s").n_past == n_past


def _token(result: StepResult) -> int:
    assert result.logits is not None
    return result.logits.token_id


async def _continue(engine: ShardEngine, sid: str, result: StepResult, n: int) -> list[int]:
    """The token ``result`` chose, then ``n`` more decoded with ``PENALIZED``."""
    out = [_token(result)]
    for _ in range(n):
        out.append(_token(await decode(engine, sid, out[-1], sampling=PENALIZED)))
    return out
