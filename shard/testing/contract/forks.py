"""Contract tests of ``fork_session``: a new session holding a copy of a live one's history
(how ``n`` choices of one prompt prefill it once)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from shard.engine import (
    InvalidInput,
    Lookahead,
    PrefillRequest,
    SessionExists,
    SessionState,
    TooManySessions,
    UnknownSession,
)

from ..factories import EngineFactory, EngineOptions, ShardPart
from .harness import assert_same_logits, decode, generate, prefill, prompt_tokens, whole_options


class Forks:
    """``fork_session`` on every engine."""

    async def test_a_fork_goes_on_as_an_independent_session_would(
        self, engine_factory: EngineFactory
    ) -> None:
        """A fork holds the source's positions and ids; greedy decodes on the fork, on the
        source and on a session that prefilled the same prompt itself give the same tokens;
        releasing the source leaves the fork intact, and the cells add up throughout."""
        async with engine_factory.open(whole_options()) as engine:
            prompt = prompt_tokens(engine, 24, salt=5)
            await engine.open_session("ref")
            reference = await generate(engine, "ref", prompt, 6)
            await engine.release("ref")
            await engine.open_session("src")
            first = await prefill(engine, "src", prompt)
            assert first.logits is not None
            info = await engine.fork_session("src", "fork")
            assert (info.session_id, info.n_past, info.tokens, info.state) == (
                "fork", len(prompt), prompt, SessionState.IDLE)
            m = engine.metrics()
            assert (m.sessions_forked_total, m.sessions_active, m.kv_cells_used) == (
                1, 2, 2 * len(prompt))
            assert engine.session_info("src").n_past == len(prompt)
            outs: dict[str, list[int]] = {"src": [first.logits.token_id],
                                          "fork": [first.logits.token_id]}
            for _ in range(6):  # interleaved: each step of one must not disturb the other
                for sid, out in outs.items():
                    r = await decode(engine, sid, out[-1])
                    assert r.logits is not None
                    out.append(r.logits.token_id)
            assert outs["src"] == outs["fork"] == reference
            assert await engine.release("src")
            await decode(engine, "fork", outs["fork"][-1])
            assert engine.session_info("fork").n_past == len(prompt) + 7
            assert engine.metrics().kv_cells_used == len(prompt) + 7
            assert await engine.release("fork")
            assert engine.metrics().kv_cells_used == 0

    async def test_a_fork_of_a_fork_and_the_source_goes_on_after_the_fork_is_released(
        self, engine_factory: EngineFactory
    ) -> None:
        """Forks of forks hold the same history; releasing every fork leaves the source's
        next step as it was, and a step the source computed ahead is not copied."""
        async with engine_factory.open(whole_options()) as engine:
            await engine.open_session("src")
            prompt = prompt_tokens(engine, 16, salt=2)
            first = await prefill(engine, "src", prompt, lookahead=Lookahead())
            assert first.logits is not None
            await engine.fork_session("src", "a")
            await engine.fork_session("a", "b")
            assert engine.session_info("b").tokens == prompt
            there = await decode(engine, "b", first.logits.token_id)
            assert await engine.release("a") and await engine.release("b")
            here = await decode(engine, "src", first.logits.token_id)
            assert_same_logits(here, there)
            assert engine.metrics().kv_cells_used == len(prompt) + 1
            assert engine.metrics().sessions_forked_total == 2

    async def test_a_fork_of_a_later_part_copies_hidden_state_history(
        self, engine_factory: EngineFactory
    ) -> None:
        """On a shard fed hidden states (no token ids) a fork holds the positions only and its
        next step equals the source's."""
        if not engine_factory.layer_ranges:
            return
        async with engine_factory.open(EngineOptions(part=ShardPart.LAST)) as engine:
            caps = engine.capabilities()
            await engine.open_session("src")
            rows = np.random.default_rng(5).standard_normal((20, caps.n_embd)).astype(np.float32)
            await engine.prefill(PrefillRequest("src", hidden_states=rows))
            info = await engine.fork_session("src", "fork")
            assert (info.n_past, info.tokens) == (20, None)
            row = np.random.default_rng(6).standard_normal((1, caps.n_embd)).astype(np.float32)
            a = await engine.prefill(PrefillRequest("src", hidden_states=row, position=20))
            b = await engine.prefill(PrefillRequest("fork", hidden_states=row, position=20))
            assert_same_logits(a, b)

    async def test_forks_of_one_source_made_at_once_all_succeed(
        self, engine_factory: EngineFactory
    ) -> None:
        """Three forks of one source asked for at the same time each get their copy (the
        copies run one after another); a decode on the source meanwhile is not refused for a
        running step of its own, only while a copy runs."""
        async with engine_factory.open(whole_options()) as engine:
            await engine.open_session("src")
            prompt = prompt_tokens(engine, 12, salt=7)
            await prefill(engine, "src", prompt)
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(engine.fork_session, "src", f"f{i}")
            assert {s.session_id: s.n_past for s in engine.sessions()} == {
                "src": 12, "f0": 12, "f1": 12, "f2": 12}
            m = engine.metrics()
            assert (m.sessions_forked_total, m.kv_cells_used) == (3, 4 * len(prompt))

    @pytest.mark.parametrize("case", ["unknown", "exists", "bad-id", "full"])
    async def test_a_refused_fork_leaves_nothing_behind(
        self, engine_factory: EngineFactory, case: str
    ) -> None:
        """A fork of an unknown session, to an id in use or not a valid id, or past
        ``max_sessions`` is refused as opening would be; no session, cell or sequence id is
        left held (every session can still open)."""
        async with engine_factory.open(whole_options(max_sessions=3)) as engine:
            await engine.open_session("src")
            prompt = prompt_tokens(engine, 10, salt=1)
            await prefill(engine, "src", prompt)
            await engine.open_session("other")
            source, target, error = {
                "unknown": ("nope", "new", UnknownSession),
                "exists": ("src", "other", SessionExists),
                "bad-id": ("src", "", InvalidInput),
                "full": ("src", "new", TooManySessions),
            }[case]
            if case == "full":
                await engine.open_session("third")
            with pytest.raises(error):
                await engine.fork_session(source, target)
            m = engine.metrics()
            assert (m.kv_cells_used, m.sessions_forked_total) == (len(prompt), 0)
            assert {s.session_id for s in engine.sessions()} == (
                {"src", "other", "third"} if case == "full" else {"src", "other"})
            assert engine.health().ready
            if case != "full":
                await engine.fork_session("src", "new")  # the id it tried is free
                assert engine.metrics().kv_cells_used == 2 * len(prompt)
