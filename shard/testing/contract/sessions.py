"""Contract tests of sessions: open, prefill, decode, release, budgets, truncation and prefix
reuse (the positions and KV cells a session holds after each call)."""

from __future__ import annotations

import math

import pytest

from shard.engine import (
    IllegalTransition,
    InvalidInput,
    KvCacheFull,
    Lookahead,
    ResultKind,
    SessionExists,
    SessionState,
    TooManySessions,
    UnknownSession,
)

from ..factories import EngineFactory
from .harness import (
    assert_same_logits,
    decode,
    decode_fresh,
    prefill,
    prompt_tokens,
    whole_options,
)


class Sessions:
    """A session's life and the positions and KV cells it holds after every call."""

    async def test_session_open_prefill_decode_release(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            caps = engine.capabilities()
            info = await engine.open_session("s")
            assert info.state is SessionState.IDLE
            assert (info.n_past, info.tokens, info.kv_budget) == (0, (), caps.n_ctx_per_session)
            assert [i.session_id for i in engine.sessions()] == ["s"]

            tokens = prompt_tokens(engine, 10)
            r = await prefill(engine, "s", tokens, top_k_logprobs=5)
            assert r.kind is ResultKind.LOGITS and r.boundary is None and r.logits is not None
            assert (r.session_id, r.n_past, r.tokens_processed, r.reused_tokens) == ("s", 10, 10, 0)
            lg = r.logits
            assert len(lg.top) == 5
            assert [t.logprob for t in lg.top] == sorted((t.logprob for t in lg.top), reverse=True)
            assert all(t.logprob <= 0.0 and math.isfinite(t.logprob) for t in lg.top)
            assert 0 <= lg.token_id < caps.n_vocab
            assert lg.token_id == lg.top[0].token_id  # greedy by default
            assert lg.logprob == lg.top[0].logprob
            assert lg.piece == engine.token_piece(lg.token_id)
            assert lg.is_eog == (lg.token_id == caps.eos_token_id)
            assert engine.session_info("s").tokens == tokens
            assert engine.metrics().kv_cells_used == 10

            r2 = await decode(engine, "s", lg.token_id, top_k_logprobs=0)
            assert (r2.n_past, r2.tokens_processed, r2.reused_tokens) == (11, 1, 0)
            assert r2.logits is not None and r2.logits.top == ()
            info = engine.session_info("s")
            assert info.state is SessionState.IDLE and info.n_past == 11
            assert info.tokens == (*tokens, lg.token_id)

            m = engine.metrics()
            assert (m.sessions_active, m.kv_cells_used, m.operations_running) == (1, 11, 0)
            assert (m.prefill_tokens_total, m.decode_tokens_total, m.steps_total) == (10, 1, 2)
            assert m.sessions_opened_total == 1

            assert await engine.release("s") is True
            m = engine.metrics()
            assert (m.sessions_active, m.kv_cells_used, m.sessions_released_total) == (0, 0, 1)

    async def test_released_session_is_unknown_and_release_cancel_are_idempotent(
        self, engine_factory: EngineFactory
    ) -> None:
        async with engine_factory.open() as engine:
            await engine.open_session("s")
            await prefill(engine, "s", prompt_tokens(engine, 4))
            assert engine.cancel("s") is False  # nothing running
            assert engine.cancel("s") is False
            assert await engine.release("s") is True
            assert await engine.release("s") is False
            assert engine.cancel("s") is False
            with pytest.raises(UnknownSession) as info:
                engine.session_info("s")
            assert info.value.session_id == "s"
            with pytest.raises(UnknownSession):
                await prefill(engine, "s", prompt_tokens(engine, 4))
            with pytest.raises(UnknownSession):
                await decode(engine, "s", 5)
            assert engine.sessions() == ()
            # The id can be reused after release: a fresh, empty session.
            info2 = await engine.open_session("s")
            assert info2.n_past == 0 and info2.tokens == ()
            assert engine.metrics().kv_cells_used == 0

    async def test_unknown_session_and_duplicate_open(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            with pytest.raises(UnknownSession):
                engine.session_info("nope")
            with pytest.raises(UnknownSession):
                await prefill(engine, "nope", prompt_tokens(engine, 3))
            assert await engine.release("nope") is False
            await engine.open_session("s")
            await prefill(engine, "s", prompt_tokens(engine, 3))
            with pytest.raises(SessionExists):
                await engine.open_session("s")
            assert engine.session_info("s").n_past == 3  # untouched
            for bad in ("", "x" * 129):
                with pytest.raises(InvalidInput):
                    await engine.open_session(bad)

    async def test_too_many_sessions(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open(whole_options(n_ctx=256, max_sessions=2)) as engine:
            await engine.open_session("a")
            await engine.open_session("b")
            with pytest.raises(TooManySessions) as info:
                await engine.open_session("c")
            assert info.value.retryable
            await engine.release("a")
            await engine.open_session("c")
            assert sorted(i.session_id for i in engine.sessions()) == ["b", "c"]

    async def test_decode_needs_a_prefilled_session(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            await engine.open_session("s")
            with pytest.raises(IllegalTransition):
                await decode(engine, "s", 5)
            assert engine.session_info("s").state is SessionState.IDLE

    async def test_kv_budget_is_enforced(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            caps = engine.capabilities()
            for bad in (0, -1, caps.n_ctx_per_session + 1):
                with pytest.raises(InvalidInput):
                    await engine.open_session("s", kv_budget=bad)
            await engine.open_session("s", kv_budget=6)
            assert engine.session_info("s").kv_budget == 6
            with pytest.raises(KvCacheFull) as info:
                await prefill(engine, "s", prompt_tokens(engine, 7))
            assert not info.value.retryable and info.value.session_id == "s"
            assert engine.session_info("s").n_past == 0
            r = await prefill(engine, "s", prompt_tokens(engine, 6))
            assert r.n_past == 6
            assert r.logits is not None
            with pytest.raises(KvCacheFull):
                await decode(engine, "s", r.logits.token_id)
            assert engine.session_info("s").n_past == 6
            assert engine.metrics().kv_cells_used == 6
            # Rewriting inside the budget still works.
            r = await prefill(engine, "s", prompt_tokens(engine, 3, salt=1), position=3)
            assert r.n_past == 6

    async def test_batch_group_is_validated(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            for bad in (-1, 2**32, True, 1.5):
                with pytest.raises(InvalidInput):
                    await engine.open_session("s", batch_group=bad)  # type: ignore[arg-type]
            await engine.open_session("s", batch_group=2**32 - 1)
            r = await prefill(engine, "s", prompt_tokens(engine, 3))
            assert r.n_past == 3 and engine.metrics().sessions_active == 1

    async def test_truncate_keeps_a_prefix_and_the_session_goes_on_from_it(
        self, engine_factory: EngineFactory
    ) -> None:
        """``truncate(keep)`` leaves ``[0, keep)`` exactly as it was (a decode after it equals a
        fresh session's over that prefix), frees the cells, drops a step computed ahead with
        them, and changes nothing for ``keep`` at or past the end."""
        async with engine_factory.open() as engine:
            await engine.open_session("s")
            history = prompt_tokens(engine, 16, salt=6)
            first = await prefill(engine, "s", history, lookahead=Lookahead())
            assert first.logits is not None
            await decode(engine, "s", first.logits.token_id, lookahead=Lookahead())  # one ahead
            info = await engine.truncate("s", 10)
            assert (info.n_past, info.tokens, info.state) == (10, history[:10], SessionState.IDLE)
            assert engine.metrics().kv_cells_used == 10
            assert engine.metrics().lookahead_cells == 0
            for keep in (10, 99):
                assert (await engine.truncate("s", keep)).n_past == 10
            after = await decode(engine, "s", history[10])
            ref = await decode_fresh(engine, "ref", history[:10], history[10])
            assert after.n_past == ref.n_past == 11
            assert_same_logits(after, ref)
            with pytest.raises(InvalidInput):
                await engine.truncate("s", -1)
            with pytest.raises(UnknownSession):
                await engine.truncate("nope", 0)
            assert (await engine.truncate("s", 0)).n_past == 0
            assert engine.metrics().kv_cells_used == 11  # "ref"'s only
            await engine.release("ref")
            await engine.release("s")

    async def test_prefix_reuse(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            base = prompt_tokens(engine, 16)
            tail = prompt_tokens(engine, 6, salt=9)[1:]
            await engine.open_session("s")
            await prefill(engine, "s", base)
            # Extending from position 0 reuses everything held.
            r = await prefill(engine, "s", base + tail)
            assert (r.n_past, r.reused_tokens, r.tokens_processed) == (21, 16, 5)
            # The same prompt again recomputes exactly one position (the logits need it).
            r = await prefill(engine, "s", base + tail)
            assert (r.n_past, r.reused_tokens, r.tokens_processed) == (21, 20, 1)
            # Diverging after 10 positions keeps 10, replaces the rest.
            other = base[:10] + prompt_tokens(engine, 4, salt=11)[1:]
            r = await prefill(engine, "s", other)
            assert (r.n_past, r.reused_tokens, r.tokens_processed) == (13, 10, 3)
            assert engine.session_info("s").tokens == other
            assert engine.metrics().kv_cells_used == 13
            # Appending at the current length (position = n_past) reuses nothing.
            r = await prefill(engine, "s", tail, position=13)
            assert (r.n_past, r.reused_tokens, r.tokens_processed) == (18, 0, 5)
            # A prefill at an inner position matches held tokens from that position on.
            r = await prefill(engine, "s", other[5:], position=5)
            assert (r.n_past, r.reused_tokens, r.tokens_processed) == (13, 7, 1)
            assert engine.metrics().reused_tokens_total == 16 + 20 + 10 + 7
            # Reused state computes exactly what a fresh session computes.
            await engine.open_session("fresh")
            fresh = await prefill(engine, "fresh", other)
            assert_same_logits(r, fresh)
            with pytest.raises(InvalidInput):
                await prefill(engine, "s", tail, position=14)  # beyond the session's length
            assert engine.session_info("s").n_past == 13
