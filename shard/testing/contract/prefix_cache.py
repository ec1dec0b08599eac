"""Contract tests of the prefix cache (``LoadSpec.prefix_cache_tokens``): a released session's
history serves the start of later prompts, within the budget, least recently used out, and
never changes what a session computes.

The reference for every cached result is an engine with the cache off that computed the same
positions in the same chunks (the history's steps in its own session, then the rest): on
llama.cpp float sums depend on a batch's shape, so only the same chunks promise the same
logits; the fake computes every position alone and matches whatever the chunks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import numpy as np
import trio

from shard.engine import (
    DecodeRequest,
    EngineCancelled,
    EngineFailure,
    InvalidInput,
    PrefillRequest,
    ShardEngine,
    StepResult,
)

from ..factories import EngineFactory, EngineOptions, ShardPart
from .harness import (
    LONG_PROMPT,
    assert_same_logits,
    decode,
    inject_failure,
    prefill,
    prompt_tokens,
    start_op,
    wait_running,
)

#: Two entries of a session's size with the suite's default options (4 sessions of 256).
BUDGET = 512


@asynccontextmanager
async def cached_engine(factory: EngineFactory, budget: int = BUDGET,
                        options: EngineOptions | None = None) -> AsyncIterator[ShardEngine]:
    """A loaded engine whose prefix cache holds up to ``budget`` tokens."""
    engine = factory.create()
    async with engine:
        spec = factory.load_spec(options or EngineOptions())
        await engine.load(dataclasses.replace(spec, prefix_cache_tokens=budget))
        yield engine


async def history_of(engine: ShardEngine, sid: str, prompt: Sequence[int], n_decode: int
                     ) -> tuple[tuple[int, ...], int]:
    """Open ``sid``, prefill ``prompt`` and decode ``n_decode`` greedy tokens: returns the
    history the session holds and the token its last step chose."""
    await engine.open_session(sid)
    r = await prefill(engine, sid, prompt)
    assert r.logits is not None
    history = list(prompt)
    for _ in range(n_decode):
        history.append(r.logits.token_id)
        r = await decode(engine, sid, r.logits.token_id)
        assert r.logits is not None
    return tuple(history), r.logits.token_id


async def continue_greedy(engine: ShardEngine, sid: str, first: StepResult, n: int) -> list[int]:
    """The greedy tokens after ``first``: its choice, then ``n`` decodes of each choice."""
    assert first.logits is not None
    out = [first.logits.token_id]
    for _ in range(n):
        r = await decode(engine, sid, out[-1])
        assert r.logits is not None
        out.append(r.logits.token_id)
    return out


class PrefixCache:
    """Released histories serve later prompts' starts; results stay what they were."""

    async def test_a_released_history_serves_the_start_of_a_new_session(
        self, engine_factory: EngineFactory
    ) -> None:
        """A new session whose prompt starts with a released history copies its positions
        (``cached_tokens``), computes the rest, and then computes what a cacheless engine
        computes from the same steps; the cache is reported in capabilities and metrics."""
        prompt = None
        async with cached_engine(engine_factory) as engine, engine_factory.open() as plain:
            caps = engine.capabilities()
            assert caps.prefix_cache_tokens == BUDGET and caps.prefix_cache_detail
            assert plain.capabilities().prefix_cache_tokens == 0
            prompt = prompt_tokens(engine, 30, salt=5)
            history, _ = await history_of(engine, "a", prompt, 3)
            await engine.release("a")
            m = engine.metrics()
            assert (m.prefix_cache_stored_total, m.prefix_cache_entries) == (1, 1)
            assert m.prefix_cache_tokens == len(history) and m.kv_cells_used == 0
            tail = prompt_tokens(engine, 7, salt=6)[1:]
            await engine.open_session("b")
            got = await prefill(engine, "b", history + tail)
            assert (got.cached_tokens, got.reused_tokens, got.tokens_processed) == (
                len(history), 0, len(tail))
            assert got.n_past == len(history) + len(tail)
            assert engine.session_info("b").tokens == history + tail
            # The reference: the same steps in one session of a cacheless engine.
            ref_history, _ = await history_of(plain, "a", prompt, 3)
            assert ref_history == history
            want = await prefill(plain, "a", tail, position=len(history))
            assert want.cached_tokens == 0
            assert_same_logits(got, want)
            assert await continue_greedy(engine, "b", got, 4) == await continue_greedy(plain, "a", want, 4)
            m = engine.metrics()
            assert (m.prefix_cache_hits_total, m.prefix_cache_hit_tokens_total) == (1, len(history))
            assert m.kv_cells_used == len(history) + len(tail) + 4

    async def test_an_entry_stored_between_live_sessions_moves_above_them(
        self, engine_factory: EngineFactory
    ) -> None:
        """A history released between live sessions is stored above them (its cells moved to
        the highest free sequence id), so the next session takes the freed id beside them
        (sessions take the lowest: on llama.cpp one run of ids is one pass per tick); a prompt
        served from the moved entry computes what a cacheless engine computes."""
        async with cached_engine(engine_factory) as engine, engine_factory.open() as plain:
            prompt = prompt_tokens(engine, 20, salt=31)
            await engine.open_session("x")
            history, _ = await history_of(engine, "a", prompt, 2)
            await engine.open_session("y")
            freed = engine._slots["a"].seq_id
            assert engine._slots["x"].seq_id < freed < engine._slots["y"].seq_id
            await engine.release("a")
            (entry,) = engine._prefix.cache.keys()
            assert entry > engine._slots["y"].seq_id
            tail = prompt_tokens(engine, 6, salt=32)[1:]
            await engine.open_session("b")
            assert engine._slots["b"].seq_id == freed
            got = await prefill(engine, "b", history + tail)
            assert got.cached_tokens == len(history)
            ref_history, _ = await history_of(plain, "a", prompt, 2)
            assert ref_history == history
            want = await prefill(plain, "a", tail, position=len(history))
            assert_same_logits(got, want)
            assert await continue_greedy(engine, "b", got, 3) == await continue_greedy(plain, "a", want, 3)
            m = engine.metrics()
            assert m.kv_cells_used == len(history) + len(tail) + 3

    async def test_sessions_released_together_leave_a_consistent_cache(
        self, engine_factory: EngineFactory
    ) -> None:
        """Sessions released at once into a cache of one entry (each release keeps its
        history, evicting the one before, which another release may be moving up): the cache
        holds what it says, every id comes back, and a prompt it serves computes what a
        cacheless engine computes."""
        async with cached_engine(engine_factory, BUDGET // 2) as engine, \
                engine_factory.open() as plain:
            n = engine.capabilities().max_sessions
            histories = [(await history_of(engine, f"r{i}", prompt_tokens(engine, 12 + i, salt=40 + i), 1))[0]
                         for i in range(n)]
            await engine.release("r0")  # the cache is full: every later release evicts
            async with trio.open_nursery() as nursery:
                for i in range(1, n):
                    nursery.start_soon(engine.release, f"r{i}")
            cache = engine._prefix.cache
            kept = [i for i, h in enumerate(histories) if h in {cache.ids(k) for k in cache.keys()}]
            m = engine.metrics()
            assert kept and m.kv_cells_used == 0
            assert m.prefix_cache_tokens == sum(len(histories[i]) for i in kept)
            for i in range(n):  # every session id is free again
                await engine.open_session(f"n{i}")
            i = kept[0]
            tail = prompt_tokens(engine, 5, salt=60)[1:]
            got = await prefill(engine, "n0", histories[i] + tail)
            ref, _ = await history_of(plain, "a", prompt_tokens(plain, 12 + i, salt=40 + i), 1)
            assert ref == histories[i] and got.cached_tokens == len(ref)
            assert_same_logits(got, await prefill(plain, "a", tail, position=len(ref)))

    async def test_live_sessions_share_a_prefix_and_a_rewind_affects_only_its_own(
        self, engine_factory: EngineFactory
    ) -> None:
        """Three live sessions start from one cached history; one of them rewinds into the
        shared part and goes elsewhere; the others still compute what they would alone."""
        async with cached_engine(engine_factory) as engine, engine_factory.open() as plain:
            prompt = prompt_tokens(engine, 24, salt=7)
            history, _ = await history_of(engine, "a", prompt, 2)
            await engine.release("a")
            tails = [prompt_tokens(engine, 4 + i, salt=10 + i)[1:] for i in range(3)]
            firsts = []
            for i, tail in enumerate(tails):
                await engine.open_session(f"s{i}")
                r = await prefill(engine, f"s{i}", history + tail)
                assert r.cached_tokens == len(history)
                firsts.append(r)
            assert engine.metrics().prefix_cache_hits_total == 3
            # s0 rewinds into the shared prefix and continues with other tokens.
            await engine.truncate("s0", 10)
            other = prompt_tokens(engine, 6, salt=20)[1:]
            r0 = await prefill(engine, "s0", other, position=10)
            assert r0.cached_tokens == 0 and r0.n_past == 10 + len(other)
            await plain.open_session("r0")
            await prefill(plain, "r0", history[:10])
            assert_same_logits(r0, await prefill(plain, "r0", other, position=10))
            await plain.release("r0")
            for i in (1, 2):
                ref_history, _ = await history_of(plain, "r", prompt, 2)
                want = await prefill(plain, "r", tails[i], position=len(ref_history))
                assert_same_logits(firsts[i], want)
                assert (await continue_greedy(engine, f"s{i}", firsts[i], 3)
                        == await continue_greedy(plain, "r", want, 3))
                await plain.release("r")

    async def test_the_budget_holds_and_the_least_recently_used_goes_first(
        self, engine_factory: EngineFactory
    ) -> None:
        """Histories beyond the budget evict the least recently used entry (counted), never a
        live session's cells; a longer history replaces the one it extends; an evicted
        history is computed again."""
        async with cached_engine(engine_factory) as engine:
            prompts = [prompt_tokens(engine, 20, salt=30 + i) for i in range(3)]
            histories = []
            for i in range(2):
                h, _ = await history_of(engine, f"h{i}", prompts[i], 1)
                histories.append(h)
                await engine.release(f"h{i}")
            assert engine.metrics().prefix_cache_entries == 2
            # A live session uses entry 0 (now the most recently used) and stays open.
            await engine.open_session("live")
            live = await prefill(engine, "live", histories[0] + (5,))
            assert live.cached_tokens == len(histories[0])
            h, _ = await history_of(engine, "h2", prompts[2], 1)
            histories.append(h)
            await engine.release("h2")
            m = engine.metrics()
            assert m.prefix_cache_evictions_total == 1 and m.prefix_cache_entries == 2
            assert m.prefix_cache_tokens <= BUDGET
            assert m.kv_cells_used == engine.session_info("live").n_past
            for i in range(3):  # (entry 1 was evicted: at most a start shared by chance)
                await engine.open_session(f"q{i}")
                r = await prefill(engine, f"q{i}", histories[i] + (6,))
                if i == 1:
                    assert r.cached_tokens < len(histories[i])
                else:
                    assert r.cached_tokens == len(histories[i]), i
            r = await decode(engine, "live", 7)  # the live session still holds every cell
            assert r.n_past == len(histories[0]) + 2
            m = engine.metrics()
            assert m.kv_cells_used == sum(info.n_past for info in engine.sessions())
            await engine.release("q0")  # extends the entry it came from: replaces it
            m = engine.metrics()
            assert m.prefix_cache_evictions_total == 1 and m.prefix_cache_entries == 2
            assert m.prefix_cache_tokens == len(histories[0]) + 1 + len(histories[2])
            for sid in ("q1", "q2", "live"):
                await engine.release(sid)
            m = engine.metrics()
            assert m.kv_cells_used == 0 and m.prefix_cache_tokens <= BUDGET

    async def test_many_conversations_stay_within_the_budget(
        self, engine_factory: EngineFactory
    ) -> None:
        """Distinct conversations one after another: the cache never holds more than its
        budget, evictions are counted, and no cell is left behind once all are released."""
        budget = 300  # two entries (256 each), 300 tokens at most
        async with cached_engine(engine_factory, budget) as engine:
            for i in range(12):
                await engine.open_session("c")
                await prefill(engine, "c", prompt_tokens(engine, 40 + 9 * (i % 5), salt=100 + i))
                await engine.release("c")
                m = engine.metrics()
                assert m.prefix_cache_tokens <= budget and m.prefix_cache_entries <= 2
                assert m.kv_cells_used == 0
            m = engine.metrics()
            assert m.prefix_cache_stored_total == 12
            assert m.prefix_cache_evictions_total == 12 - m.prefix_cache_entries

    async def test_a_failed_or_cancelled_cached_prefill_leaves_session_and_cache_as_they_were(
        self, engine_factory: EngineFactory
    ) -> None:
        """A prefill that copied a cached prefix and was cancelled rolls the session back to
        what it held; the entry is untouched and serves the next prefill. A failing one fails
        the engine as any failure does, leaving no half entry."""
        async with cached_engine(engine_factory) as engine:
            prompt = prompt_tokens(engine, 20, salt=40)
            history, _ = await history_of(engine, "a", prompt, 1)
            await engine.release("a")
            before = engine.metrics()
            long_tail = prompt_tokens(engine, LONG_PROMPT, salt=41)[1:]
            await engine.open_session("b")
            async with trio.open_nursery() as nursery:
                op = start_op(nursery, prefill, engine, "b", history + long_tail)
                await wait_running(engine, "b")
                engine.cancel("b")
                await op.done.wait()
            assert isinstance(op.error, EngineCancelled) or op.value is not None
            if op.value is None:
                info = engine.session_info("b")
                assert info.n_past == 0 and info.tokens == ()
                m = engine.metrics()
                assert m.kv_cells_used == 0 and m.prefix_cache_hits_total == before.prefix_cache_hits_total
            else:  # finished before the cancel arrived: a hit like any other
                await engine.truncate("b", 0)
            assert engine.metrics().prefix_cache_entries == 1
            r = await prefill(engine, "b", history + (9,))
            assert r.cached_tokens == len(history)
            await engine.release("b")
            inject_failure(engine)
            await engine.open_session("c")
            try:
                await prefill(engine, "c", history + (9, 10))
            except EngineFailure:
                pass
            else:  # pragma: no cover - the contract says otherwise
                raise AssertionError("an injected fault must fail the step")
            assert not engine.health().ready

    async def test_hidden_state_prefills_are_cached_by_their_token_ids(
        self, engine_factory: EngineFactory
    ) -> None:
        """A later shard caches a history only when its hidden-state input carried the token
        ids it stands for; a new session with the same ids then copies those positions and
        computes what a cacheless engine computes from the same rows."""
        if not engine_factory.layer_ranges:
            return
        options = EngineOptions(part=ShardPart.LAST)
        async with (cached_engine(engine_factory, options=options) as engine,
                    engine_factory.open(options) as plain):
            caps = engine.capabilities()
            rows = np.random.default_rng(11).standard_normal((30, caps.n_embd)).astype(np.float32)
            ids = tuple(range(3, 33))
            await engine.open_session("blind")
            await engine.prefill(PrefillRequest("blind", hidden_states=rows[:20]))
            await engine.release("blind")
            assert engine.metrics().prefix_cache_stored_total == 0  # no ids: nothing kept
            await engine.open_session("a")
            await engine.prefill(PrefillRequest("a", hidden_states=rows[:20], token_ids=ids[:20]))
            await engine.decode(DecodeRequest("a", hidden_state=rows[20:21], token_id=ids[20]))
            assert engine.session_info("a").tokens == ids[:21]
            await engine.release("a")
            assert engine.metrics().prefix_cache_tokens == 21
            await engine.open_session("b")
            got = await engine.prefill(PrefillRequest("b", hidden_states=rows, token_ids=ids))
            assert (got.cached_tokens, got.tokens_processed) == (21, 9)
            await plain.open_session("r")
            await plain.prefill(PrefillRequest("r", hidden_states=rows[:20]))
            await plain.decode(DecodeRequest("r", hidden_state=rows[20:21]))
            want = await plain.prefill(PrefillRequest("r", hidden_states=rows[21:], position=21))
            assert_same_logits(got, want)

    async def test_a_first_shards_boundary_starts_after_the_cached_positions(
        self, engine_factory: EngineFactory
    ) -> None:
        """On a first shard that is not last, a prefill from the cache returns the hidden
        states of the positions it computed only, from where the copy ends (the next hop must
        hold the cached positions itself), equal to a cacheless engine's for the same steps."""
        if not engine_factory.layer_ranges:
            return
        options = EngineOptions(part=ShardPart.FIRST)
        async with (cached_engine(engine_factory, options=options) as engine,
                    engine_factory.open(options) as plain):
            prompt = prompt_tokens(engine, 25, salt=60)
            tail = prompt_tokens(engine, 6, salt=61)[1:]
            await engine.open_session("a")
            await prefill(engine, "a", prompt)
            await engine.release("a")
            await engine.open_session("b")
            got = await prefill(engine, "b", prompt + tail)
            assert got.cached_tokens == len(prompt) and got.boundary is not None
            assert got.boundary.start_position == len(prompt)
            await plain.open_session("r")
            await prefill(plain, "r", prompt)
            want = await prefill(plain, "r", tail, position=len(prompt))
            assert want.boundary is not None
            np.testing.assert_allclose(got.boundary.hidden_states, want.boundary.hidden_states,
                                       atol=1e-4)

    async def test_a_session_started_from_the_cache_moves_to_another_engine(
        self, engine_factory: EngineFactory
    ) -> None:
        """Hand-off: a session whose start was copied from the cache exports a state that
        another engine of the same layout resumes, and both go on alike. (On llama.cpp the
        layout counts every stream, the cache's too: replicas that move sessions between them
        share their cache budget as they share ``max_sessions``.)"""
        async with cached_engine(engine_factory) as engine, cached_engine(engine_factory) as plain:
            if not engine.capabilities().kv_layout:
                return
            assert engine.capabilities().kv_layout == plain.capabilities().kv_layout
            history, _ = await history_of(engine, "a", prompt_tokens(engine, 18, salt=50), 1)
            await engine.release("a")
            await engine.open_session("b")
            first = await prefill(engine, "b", history + (8, 9))
            assert first.cached_tokens == len(history) and first.logits is not None
            snapshot = await engine.export_session("b")
            await plain.open_session("b")
            await plain.import_session("b", snapshot)
            nxt = first.logits.token_id
            assert_same_logits(await decode(engine, "b", nxt), await decode(plain, "b", nxt))

    async def test_cached_prefix_answers_without_touching_the_cache(
        self, engine_factory: EngineFactory
    ) -> None:
        """``cached_prefix`` says how many leading ids an entry holds (whole, past, partly, not
        at all; 0 without a cache) and marks nothing used: after asking about the older entry,
        a new history still evicts that one, as if nobody had asked."""
        budget = 300  # two entries, at most 300 tokens
        async with cached_engine(engine_factory, budget) as engine, engine_factory.open() as plain:
            histories = []
            for i in range(2):
                h, _ = await history_of(engine, f"h{i}", prompt_tokens(engine, 60, salt=70 + i), 1)
                histories.append(h)
                await engine.release(f"h{i}")
            old = histories[0]
            assert engine.cached_prefix(old) == len(old)
            assert engine.cached_prefix(old + (5, 6)) == len(old)
            assert engine.cached_prefix(old[:10]) == 10
            assert engine.cached_prefix(old[:10] + (old[10] + 1,)) == 10
            assert engine.cached_prefix(()) == 0
            assert plain.cached_prefix(old) == 0
            before = engine.metrics()
            h, _ = await history_of(engine, "h2", prompt_tokens(engine, 200, salt=72), 0)
            await engine.release("h2")  # evicts the least recently used: still entry 0
            assert engine.metrics().prefix_cache_evictions_total == before.prefix_cache_evictions_total + 1
            assert engine.cached_prefix(old) < len(old)
            assert engine.cached_prefix(histories[1]) == len(histories[1])

    async def test_a_cache_limit_holds_a_prefill_to_that_many_cached_positions(
        self, engine_factory: EngineFactory
    ) -> None:
        """``PrefillRequest.cache_limit`` caps the positions copied from the cache (0: none);
        the rest is computed, and the result is what a cacheless engine computes from the
        same steps. A negative limit is refused before any work."""
        async with cached_engine(engine_factory) as engine, engine_factory.open() as plain:
            prompt = prompt_tokens(engine, 30, salt=80)
            history, _ = await history_of(engine, "a", prompt, 2)
            await engine.release("a")
            tail = prompt_tokens(engine, 5, salt=81)[1:]
            await engine.open_session("b")
            try:
                await engine.prefill(PrefillRequest("b", tokens=history + tail, cache_limit=-1))
            except InvalidInput:
                pass
            else:  # pragma: no cover - the contract says otherwise
                raise AssertionError("a negative cache_limit must be refused")
            assert engine.session_info("b").n_past == 0
            got = await engine.prefill(PrefillRequest("b", tokens=history + tail, cache_limit=12))
            assert (got.cached_tokens, got.tokens_processed) == (12, len(history) + len(tail) - 12)
            await engine.open_session("c")
            none = await engine.prefill(PrefillRequest("c", tokens=history + tail, cache_limit=0))
            assert none.cached_tokens == 0
            await plain.open_session("r")
            await prefill(plain, "r", history[:12])
            want = await prefill(plain, "r", history[12:] + tail, position=12)
            assert_same_logits(got, want)
            assert (await continue_greedy(engine, "b", got, 3)
                    == await continue_greedy(plain, "r", want, 3))
