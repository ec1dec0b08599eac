"""Contract tests of ``all_logits`` prefills, which verify drafted tokens (speculation): every
position's result equals decoding the tokens one by one."""

from __future__ import annotations

import dataclasses
import math

import pytest

from shard.engine import (
    InvalidInput,
    PrefillRequest,
    SamplingParams,
    SessionState,
)

from ..factories import EngineFactory, EngineOptions, ShardPart
from .harness import (
    FIRST_BYTE_ID,
    assert_project_value,
    assert_same_logits,
    decode,
    generate,
    prefill,
    prompt_tokens,
)


class Verification:
    """An ``all_logits`` prefill verifies drafted tokens exactly as decodes would."""

    @pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
    async def test_all_logits_verify_drafted_tokens_like_decodes(
        self, engine_factory: EngineFactory, sampled: bool
    ) -> None:
        """One ``all_logits`` prefill of a token and five drafted tokens gives, at every
        position, the result (same token, sampled or greedy) that decoding them one by one
        gives; rewinding to keep only the accepted part then equals a session that never saw
        the rest, and no KV cell stays behind."""
        params = SamplingParams(temperature=1.2, top_k=40, seed=11) if sampled else SamplingParams()
        async with engine_factory.open() as engine:
            tokens = prompt_tokens(engine, 10, salt=12)
            drafts = prompt_tokens(engine, 6, salt=13)[1:]
            await engine.open_session("steps")
            plain = [await prefill(engine, "steps", tokens, sampling=params)]
            for token in drafts:
                plain.append(await decode(engine, "steps", token, sampling=params))
            await engine.open_session("verify")
            await prefill(engine, "verify", tokens[:-1], sampling=params)
            got = await engine.prefill(PrefillRequest(
                "verify", tokens=(tokens[-1], *drafts), position=len(tokens) - 1,
                sampling=params, all_logits=True,
            ))
            assert got.n_past == plain[-1].n_past == len(tokens) + len(drafts)
            assert got.tokens_processed == 1 + len(drafts) and got.reused_tokens == 0
            assert len(got.position_logits) == len(plain)
            assert got.logits == got.position_logits[-1]
            for logits, ref in zip(got.position_logits, plain, strict=True):
                assert_same_logits(dataclasses.replace(got, logits=logits), ref)
            assert not plain[-1].position_logits  # asked for only
            assert_project_value(got, "result")
            # Keep two drafts, then a correction: as if the others had never been sent.
            kept = len(tokens) + 2
            fix = FIRST_BYTE_ID + (drafts[2] + 1 - FIRST_BYTE_ID) % 200
            after = await prefill(engine, "verify", (fix,), position=kept, sampling=params)
            await engine.open_session("fresh")
            ref = await prefill(engine, "fresh", (*tokens, *drafts[:2], fix), sampling=params)
            assert_same_logits(after, ref)
            assert after.n_past == ref.n_past == kept + 1
            assert engine.metrics().kv_cells_used == plain[-1].n_past + 2 * (kept + 1)
            # all_logits reuses no held prefix: every position's logits are computed.
            again = await engine.prefill(PrefillRequest(
                "fresh", tokens=tokens, position=0, sampling=params, all_logits=True))
            assert again.reused_tokens == 0 and len(again.position_logits) == len(tokens)
            assert_same_logits(dataclasses.replace(again, logits=again.position_logits[-1]), plain[0])
            for sid in ("steps", "verify", "fresh"):
                await engine.release(sid)
            assert engine.metrics().kv_cells_used == 0

    async def test_all_logits_is_bounded_and_ignored_before_the_last_shard(
        self, engine_factory: EngineFactory
    ) -> None:
        """More positions than ``max_logits_positions`` are refused before any work; a
        non-last shard ignores the flag (its boundary holds every position already), and the
        last shard of a chain then verifies exactly as the whole model does."""
        async with engine_factory.open() as engine:
            caps = engine.capabilities()
            assert caps.max_logits_positions >= 16
            await engine.open_session("s")
            await prefill(engine, "s", prompt_tokens(engine, 4))
            too_many = prompt_tokens(engine, caps.max_logits_positions + 1, salt=3)
            with pytest.raises(InvalidInput, match="all_logits"):
                await engine.prefill(PrefillRequest("s", tokens=too_many, position=4, all_logits=True))
            info = engine.session_info("s")
            assert (info.n_past, info.state) == (4, SessionState.IDLE)
            assert engine.metrics().kv_cells_used == 4
        if not engine_factory.layer_ranges:
            return
        async with (
            engine_factory.open(EngineOptions(part=ShardPart.FIRST)) as first,
            engine_factory.open(EngineOptions(part=ShardPart.LAST)) as last,
            engine_factory.open() as whole,
        ):
            assert first.capabilities().max_logits_positions == 0
            tokens = prompt_tokens(first, 9, salt=14)
            for engine in (first, last, whole):
                await engine.open_session("s")
            b = await first.prefill(PrefillRequest("s", tokens=tokens, all_logits=True))
            assert b.boundary is not None and not b.position_logits
            chained = await last.prefill(PrefillRequest(
                "s", hidden_states=b.boundary.hidden_states, all_logits=True))
            direct = await whole.prefill(PrefillRequest("s", tokens=tokens, all_logits=True))
            assert len(chained.position_logits) == len(direct.position_logits) == 9
            for x, y in zip(chained.position_logits, direct.position_logits, strict=True):
                assert_same_logits(dataclasses.replace(chained, logits=x),
                                   dataclasses.replace(direct, logits=y))

    async def test_all_logits_report_each_input_tokens_logprob(
        self, engine_factory: EngineFactory
    ) -> None:
        """``input_logprobs[i]`` of an ``all_logits`` prefill is the log-prob of input token
        ``i + 1`` at position ``i``: what a decode step ending there reports for that token,
        as its chosen token when a logit bias forces it (log-probs are the model's, before any
        bias) and among its top-k when it is there. The same again gives the same values; a
        grammar's or penalty's step is not asked for here (they change the choice, not these)."""
        async with engine_factory.open() as engine:
            tokens = prompt_tokens(engine, 12, salt=21)
            await engine.open_session("all")
            got = await engine.prefill(PrefillRequest("all", tokens=tokens, all_logits=True,
                                                      top_k_logprobs=64))
            assert len(got.input_logprobs) == len(tokens) - 1
            assert all(lp <= 0.0 for lp in got.input_logprobs)
            assert_project_value(got, "result")
            for i, value in enumerate(got.input_logprobs):
                nxt = tokens[i + 1]
                forced = SamplingParams(logit_bias=((nxt, 1e4),))
                await engine.open_session("ref")
                ref = await prefill(engine, "ref", tokens[: i + 1], sampling=forced,
                                    top_k_logprobs=64)
                await engine.release("ref")
                assert ref.logits is not None and ref.logits.token_id == nxt
                assert math.isclose(value, ref.logits.logprob, abs_tol=1e-3), (i, value, ref.logits)
                top = {t.token_id: t.logprob for t in got.position_logits[i].top}
                if nxt in top:  # the very row and log-sum-exp of the top-k
                    assert value == top[nxt], (i, value, top[nxt])
            # A greedy continuation: each next input token is its row's own choice.
            seq = (*tokens[:4], *(await generate(engine, "all", tokens[:4], 5)))
            greedy = await engine.prefill(PrefillRequest("all", tokens=seq, all_logits=True))
            for i in range(3, len(seq) - 1):
                chosen = greedy.position_logits[i]
                assert chosen.token_id == seq[i + 1]
                assert greedy.input_logprobs[i] == chosen.logprob
            # Token input only; a one-position step has no next input token to score.
            one = await prefill(engine, "all", tokens[:1], all_logits=True)
            assert one.input_logprobs == () and len(one.position_logits) == 1
            plain = await prefill(engine, "all", tokens)
            assert plain.input_logprobs == ()  # asked for only
            again = await engine.prefill(PrefillRequest("all", tokens=tokens, all_logits=True,
                                                        top_k_logprobs=64))
            if engine_factory.name.startswith("fake"):
                assert again.input_logprobs == got.input_logprobs  # deterministic
            else:
                for x, y in zip(again.input_logprobs, got.input_logprobs, strict=True):
                    assert math.isclose(x, y, abs_tol=1e-3)
            await engine.release("all")
            assert engine.metrics().kv_cells_used == 0

    async def test_input_logprobs_through_a_chain_and_every_position_computed(
        self, engine_factory: EngineFactory
    ) -> None:
        """A last shard fed hidden states with ``token_ids`` reports the input's log-probs as
        the whole model does; without the ids it reports none. An ``all_logits`` prefill
        written over positions a first shard holds recomputes them all (reuses none), so a
        pipeline can score a long prompt in overlapping passes."""
        if not engine_factory.layer_ranges:
            return
        async with (
            engine_factory.open(EngineOptions(part=ShardPart.FIRST)) as first,
            engine_factory.open(EngineOptions(part=ShardPart.LAST)) as last,
            engine_factory.open() as whole,
        ):
            tokens = prompt_tokens(first, 9, salt=22)
            for engine in (first, last, whole):
                await engine.open_session("s")
            b = await first.prefill(PrefillRequest("s", tokens=tokens, all_logits=True))
            assert b.boundary is not None and not b.input_logprobs
            direct = await whole.prefill(PrefillRequest("s", tokens=tokens, all_logits=True))
            chained = await last.prefill(PrefillRequest(
                "s", hidden_states=b.boundary.hidden_states, all_logits=True, token_ids=tokens))
            assert len(chained.input_logprobs) == len(direct.input_logprobs) == 8
            for x, y in zip(chained.input_logprobs, direct.input_logprobs, strict=True):
                assert math.isclose(x, y, abs_tol=1e-3)
            bare = await last.prefill(PrefillRequest(
                "s", hidden_states=b.boundary.hidden_states, all_logits=True))
            assert bare.input_logprobs == () and len(bare.position_logits) == 9
            # The first shard holds all 9: from position 6 a plain prefill reuses 2 of the 3
            # (it recomputes the last only), an all_logits one none.
            plain = await first.prefill(PrefillRequest("s", tokens=tokens[6:], position=6))
            assert plain.reused_tokens == 2
            over = await first.prefill(PrefillRequest("s", tokens=tokens[6:], position=6,
                                                      all_logits=True))
            assert over.reused_tokens == 0 and over.tokens_processed == 3
            assert over.boundary is not None and over.boundary.start_position == 6
            for engine in (first, last, whole):
                await engine.release("s")
