"""Contract tests of layer ranges: an engine serves a part of a model (first, middle, last) as its
factory declares, and a chain of parts computes what the whole model computes."""

from __future__ import annotations

import random

import numpy as np
import trio

from shard.engine import (
    DecodeRequest,
    EngineCancelled,
    PrefillRequest,
    ResultKind,
    StepResult,
)

from ..factories import EngineFactory, EngineOptions, ShardPart
from .harness import (
    LONG_PROMPT,
    assert_layer_range_refused,
    assert_same_logits,
    count_tasks,
    decode,
    greedy_steps,
    prefill,
    prompt_tokens,
    start_op,
    through_chain,
    wait_running,
    whole_options,
)


class LayerRanges:
    """Parts of a model are served or refused as declared; chains match the whole model."""

    async def test_layer_ranges_are_served_or_refused_as_declared(
        self, engine_factory: EngineFactory
    ) -> None:
        for part in (ShardPart.FIRST, ShardPart.MIDDLE, ShardPart.LAST):
            if not engine_factory.layer_ranges:
                await assert_layer_range_refused(engine_factory, part)
                continue
            options = EngineOptions(part=part, pieces=3)
            async with engine_factory.open(options) as engine:
                caps = engine.capabilities()
                assert caps.is_first is (part is ShardPart.FIRST)
                assert caps.is_last is (part is ShardPart.LAST)
                assert caps.layer_range == options.layer_range(caps.n_layers_total)
                assert caps.hidden_dtype == "float32"
                assert caps.result_kind is (
                    ResultKind.LOGITS if part is ShardPart.LAST else ResultKind.BOUNDARY
                )

    async def test_two_shard_chain_matches_the_whole_model(self, engine_factory: EngineFactory) -> None:
        if not engine_factory.layer_ranges:
            await assert_layer_range_refused(engine_factory, ShardPart.FIRST)
            return
        async with (
            engine_factory.open(EngineOptions(part=ShardPart.FIRST)) as first,
            engine_factory.open(EngineOptions(part=ShardPart.LAST)) as last,
            engine_factory.open() as whole,
        ):
            c1, c2, cw = first.capabilities(), last.capabilities(), whole.capabilities()
            assert c1.model_fingerprint == c2.model_fingerprint == cw.model_fingerprint
            assert c1.is_first and not c1.is_last and c1.result_kind is ResultKind.BOUNDARY
            assert c2.is_last and not c2.is_first and c2.result_kind is ResultKind.LOGITS
            assert c1.layer_range.end == c2.layer_range.start
            assert c2.layer_range.end == cw.n_layers_total == c1.n_layers_total
            tokens = prompt_tokens(first, 11, salt=8)
            for engine in (first, last, whole):
                await engine.open_session("s")
            b = await prefill(first, "s", tokens)
            assert b.kind is ResultKind.BOUNDARY and b.logits is None and b.boundary is not None
            h = b.boundary.hidden_states
            assert h.dtype == np.float32 and h.shape == (11, c1.n_embd)
            assert np.isfinite(h).all() and b.boundary.start_position == 0
            chained = await last.prefill(PrefillRequest("s", hidden_states=h))
            direct = await prefill(whole, "s", tokens)
            assert_same_logits(chained, direct)
            assert first.session_info("s").tokens == tokens
            assert last.session_info("s").tokens is None
            assert chained.logits is not None
            token = chained.logits.token_id
            for _ in range(3):
                b = await decode(first, "s", token)
                assert b.boundary is not None
                assert b.boundary.hidden_states.shape == (1, c1.n_embd)
                assert b.boundary.start_position == first.session_info("s").n_past - 1
                chained = await last.decode(DecodeRequest("s", hidden_state=b.boundary.hidden_states))
                direct = await decode(whole, "s", token)
                assert_same_logits(chained, direct)
                assert chained.logits is not None
                token = chained.logits.token_id
            assert (
                first.metrics().kv_cells_used
                == last.metrics().kv_cells_used
                == whole.metrics().kv_cells_used
                == 14
            )

    async def test_three_shard_chain_matches_the_whole_model(
        self, engine_factory: EngineFactory
    ) -> None:
        if not engine_factory.layer_ranges:
            await assert_layer_range_refused(engine_factory, ShardPart.MIDDLE)
            return
        parts = (ShardPart.FIRST, ShardPart.MIDDLE, ShardPart.LAST)
        async with (
            engine_factory.open(EngineOptions(part=parts[0], pieces=3)) as first,
            engine_factory.open(EngineOptions(part=parts[1], pieces=3)) as middle,
            engine_factory.open(EngineOptions(part=parts[2], pieces=3)) as last,
            engine_factory.open() as whole,
        ):
            chain = (first, middle, last)
            caps = [e.capabilities() for e in chain]
            cw = whole.capabilities()
            assert len({c.model_fingerprint for c in caps} | {cw.model_fingerprint}) == 1
            assert caps[0].layer_range.start == 0 and caps[2].layer_range.end == cw.n_layers_total
            assert caps[0].layer_range.end == caps[1].layer_range.start
            assert caps[1].layer_range.end == caps[2].layer_range.start
            assert [c.result_kind for c in caps] == [ResultKind.BOUNDARY] * 2 + [ResultKind.LOGITS]
            for engine in (*chain, whole):
                await engine.open_session("s")

            tokens = prompt_tokens(first, 13, salt=5)
            # Prefill in two requests (the second appends at position 9), then decode.
            later = chain[1:]
            await through_chain(later, "s", await prefill(first, "s", tokens[:9]), is_decode=False)
            appended = await prefill(first, "s", tokens[9:], position=9)
            chained = await through_chain(later, "s", appended, is_decode=False)
            direct = await prefill(whole, "s", tokens)
            assert_same_logits(chained, direct)
            for _ in range(4):
                assert chained.logits is not None
                token = chained.logits.token_id
                chained = await through_chain(later, "s", await decode(first, "s", token), is_decode=True)
                direct = await decode(whole, "s", token)
                assert_same_logits(chained, direct)
            assert [e.metrics().kv_cells_used for e in (*chain, whole)] == [17] * 4
            assert middle.session_info("s").tokens is None and middle.session_info("s").n_past == 17

    async def test_many_sessions_through_a_layer_range_chain_match_the_whole_model(
        self, engine_factory: EngineFactory
    ) -> None:
        """Several sessions stepping concurrently through first/middle/last shards (hidden rows
        of many sessions share the later shards) match each session on the whole model alone;
        one session is cancelled on the middle shard mid-prompt and released everywhere."""
        if not engine_factory.layer_ranges:
            await assert_layer_range_refused(engine_factory, ShardPart.MIDDLE)
            return
        parts = (ShardPart.FIRST, ShardPart.MIDDLE, ShardPart.LAST)
        async with (
            engine_factory.open(EngineOptions(part=parts[0], pieces=3, n_ctx=1536, max_sessions=6)) as first,
            engine_factory.open(EngineOptions(part=parts[1], pieces=3, n_ctx=1536, max_sessions=6)) as middle,
            engine_factory.open(EngineOptions(part=parts[2], pieces=3, n_ctx=1536, max_sessions=6)) as last,
            engine_factory.open(whole_options(n_ctx=1536, max_sessions=6)) as whole,
        ):
            chain = (first, middle, last)
            later = chain[1:]
            rng = random.Random(5)
            plans = [(prompt_tokens(first, rng.randint(2, 30), salt=20 + i), rng.randint(1, 6),
                      rng.randint(0, 8)) for i in range(5)]
            alone: list[list[StepResult]] = []
            for tokens, n_decode, _ in plans:
                await whole.open_session("alone")
                alone.append(await greedy_steps(whole, "alone", tokens, n_decode))
                await whole.release("alone")
            tasks_before = count_tasks()

            async def one(i: int) -> None:
                tokens, n_decode, delay = plans[i]
                for _ in range(delay):
                    await trio.lowlevel.checkpoint()
                sid = f"chain-{i}"
                for engine in chain:
                    await engine.open_session(sid)
                b = await prefill(first, sid, tokens)
                steps = [await through_chain(later, sid, b, is_decode=False, top_k_logprobs=3)]
                for _ in range(n_decode):
                    assert steps[-1].logits is not None
                    b = await decode(first, sid, steps[-1].logits.token_id)
                    steps.append(await through_chain(later, sid, b, is_decode=True, top_k_logprobs=3))
                for got, want in zip(steps, alone[i], strict=True):
                    assert_same_logits(got, want)

            async def cancelled_mid_prompt() -> None:
                sid = "chain-cancelled"
                for engine in chain:
                    await engine.open_session(sid)
                b = await prefill(first, sid, prompt_tokens(first, LONG_PROMPT, salt=9))
                assert b.boundary is not None
                async with trio.open_nursery() as nursery:
                    op = start_op(nursery, middle.prefill,
                                  PrefillRequest(sid, hidden_states=b.boundary.hidden_states))
                    await wait_running(middle, sid)
                    middle.cancel(sid)
                assert isinstance(op.error, EngineCancelled), op.error
                assert middle.session_info(sid).n_past == 0
                for engine in chain:
                    assert await engine.release(sid) is True

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancelled_mid_prompt)
                for i in range(len(plans)):
                    nursery.start_soon(one, i)
            expected = sum(len(t) + n for t, n, _ in plans)
            assert [e.metrics().kv_cells_used for e in chain] == [expected] * 3
            assert all(e.metrics().operations_running == 0 for e in chain)
            assert count_tasks() == tasks_before
