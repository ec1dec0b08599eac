"""Contract tests of ``all_logits`` prefills, which verify drafted tokens (speculation): every
position's result equals decoding the tokens one by one."""

from __future__ import annotations

import dataclasses

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
