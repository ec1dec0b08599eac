"""Retention and the prefix cache are one mechanism: a retained session (``CloseSession{retain}``,
a dropped stream) is a session the engine holds until it ends, and however it ends (its TTL
expires, a Release, eviction for room, a resume whose expectation does not match) it ends in
the engine's ``release``, which keeps its history as a cache entry like any other release. So a
resume that misses and replays the conversation takes it from the cache; a retained session
never takes the cache's room (it holds a session's sequence id, not an entry's), and when it is
evicted for a new session its history becomes the newest entry, so cache entries go before it;
a live session's cells are never touched. docs/protocol.md ("Resume and TTL") and
docs/engine.md ("Prefix cache") state the rule.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from rpc_harness import MAX_SESSIONS, MODEL, N_CTX, Worker, tcp_proxy, worker
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.client import ShardClient, cache_expectation
from shard.engine import LoadSpec, PrefillRequest
from shard.engine.fake import FakeEngine
from shard.rpc.session import SessionLimits
from shard.v1 import shard_pb2 as pb

TIMEOUT = 30.0
PER_SESSION = N_CTX // MAX_SESSIONS
#: Far beyond any stall of a loaded machine: a retained session expires only when a test moves
#: the clock past it (``expire``), never between a test's steps on its own.
TTL = 30.0
HISTORY = [1, *range(10, 41)]  # the retained conversation
TAIL = [7, 8]  # what the next turn adds
R = pb.CacheResult


@asynccontextmanager
async def cached_worker(budget: int = 2 * PER_SESSION) -> AsyncIterator[Worker]:
    """A FakeEngine worker with a prefix cache of ``budget`` tokens and a resume TTL."""
    spec = LoadSpec(n_ctx=N_CTX, max_sessions=MAX_SESSIONS, prefix_cache_tokens=budget)
    async with worker(engine=FakeEngine(model=MODEL), load=spec,
                      limits=SessionLimits(resume_ttl=TTL)) as w:
        yield w


async def cacheless(prompt: list[int]) -> int:
    """The token a cacheless engine chooses after ``prompt``."""
    async with FakeEngine(model=MODEL) as engine:
        await engine.load(LoadSpec(n_ctx=N_CTX, max_sessions=MAX_SESSIONS))
        await engine.open_session("ref")
        result = await engine.prefill(PrefillRequest("ref", tuple(prompt)))
        await engine.release("ref")
    assert result.logits is not None
    return result.logits.token_id


async def retain(client: ShardClient, sid: str, history: list[int]) -> None:
    session = await client.open_session(sid)
    await session.prefill(history)
    assert (await session.close(retain=True)).kv_retained


@pytest.fixture
def clock() -> trio.testing.MockClock:
    """Real time (rate 1) that ``expire`` moves past the TTL at once (pytest-trio runs a test
    that takes this fixture on it)."""
    return trio.testing.MockClock(rate=1.0)


async def expire(w: Worker, clock: trio.testing.MockClock, sid: str) -> None:
    """Move the clock past ``sid``'s TTL and wait until the engine's release of it has finished
    (with its history kept as a cache entry): the registry forgets the session first, so that
    no stream resumes it, and the engine's release runs after that."""
    released = w.engine.metrics().sessions_released_total
    clock.jump(TTL)
    with trio.fail_after(10):
        while (w.server.registry.retained(sid) is not None
               or w.engine.metrics().sessions_released_total == released):
            await trio.sleep(0.01)


async def next_turn(client: ShardClient, sid: str, prompt: list[int],
                    cache: pb.CacheExpectation | None = None) -> tuple[pb.CacheResult, pb.StepResult]:
    """Open ``sid`` (resuming with ``cache``), send ``prompt``, release: the open's outcome and
    the step (its token checked against a cacheless engine)."""
    session = await client.open_session(sid, cache=cache)
    outcome = session.cache
    step = await session.prefill(prompt)
    await session.close()
    assert step.logits.token_id == await cacheless(prompt)
    return outcome, step


@pytest.mark.parametrize("end", ["expired", "released", "dropped"])
async def test_a_retained_session_that_ends_leaves_its_history_to_the_cache(
    end: str, clock: trio.testing.MockClock,
) -> None:
    """A retained session that expires, is released, or whose stream dropped and then expired
    becomes a cache entry: the resume misses, and the replay of its conversation plus the next
    turn computes only the new part."""
    async with cached_worker() as w, tcp_proxy(w.server.target) as proxy:
        async with ShardClient.connect(w.server.target, timeout=TIMEOUT) as client:
            if end == "dropped":
                async with ShardClient.connect(proxy.target, timeout=TIMEOUT) as lost:
                    session = await lost.open_session("conv")
                    await session.prefill(HISTORY)
                    proxy.cut()
                    with trio.fail_after(10):
                        while w.server.registry.retained("conv") is None:
                            await trio.sleep(0.01)
                    session.abort()
            else:
                await retain(client, "conv", HISTORY)
            m = w.engine.metrics()
            assert (m.prefix_cache_entries, m.sessions_active) == (0, 1)  # retained: a session
            if end == "released":
                assert await client.release("conv")
            else:
                await expire(w, clock, "conv")
                assert w.server.registry.counters["sessions_expired_total"] == 1
            m = w.engine.metrics()
            assert (m.prefix_cache_entries, m.prefix_cache_tokens) == (1, len(HISTORY))
            assert (m.sessions_active, m.kv_cells_used) == (0, 0)
            outcome, step = await next_turn(client, "conv", HISTORY + TAIL, cache_expectation(HISTORY))
            assert outcome.outcome == R.OUTCOME_MISS
            assert (step.cached_tokens, step.tokens_processed) == (len(HISTORY), len(TAIL))


async def test_a_mismatched_resume_leaves_the_held_history_to_the_cache() -> None:
    """A resume whose expectation differs clears the retained session through a release: the
    history it held is an entry, and a replay of what it shares is taken from it."""
    other = [*HISTORY[:-1], 200]
    async with cached_worker() as w:
        async with ShardClient.connect(w.server.target, timeout=TIMEOUT) as client:
            await retain(client, "conv", HISTORY)
            outcome, step = await next_turn(client, "conv", other + TAIL, cache_expectation(other))
            assert (outcome.outcome, outcome.tokens_held) == (R.OUTCOME_MISMATCH, 0)
            assert step.cached_tokens == len(HISTORY) - 1


async def test_a_retained_session_evicted_for_room_becomes_an_entry_and_live_ones_keep_theirs() -> None:
    """Sessions fill ``max_sessions``: the retained one is evicted for the last open, and its
    history becomes a cache entry; the live sessions hold every cell they had."""
    async with cached_worker() as w:
        async with ShardClient.connect(w.server.target, timeout=TIMEOUT) as client:
            await retain(client, "conv", HISTORY)
            live = []
            for i in range(MAX_SESSIONS):
                session = await client.open_session(f"live-{i}")
                await session.prefill([1, 100 + i, 101 + i])
                live.append(session)
            assert w.server.registry.counters["sessions_evicted_total"] == 1
            assert w.server.registry.retained("conv") is None
            m = w.engine.metrics()
            assert (m.prefix_cache_entries, m.prefix_cache_tokens) == (1, len(HISTORY))
            for i, session in enumerate(live):
                assert w.engine.session_info(f"live-{i}").tokens == (1, 100 + i, 101 + i)
            await live.pop().close()  # room for the next turn (its history is an entry too)
            outcome, step = await next_turn(client, "conv", HISTORY + TAIL, cache_expectation(HISTORY))
            assert outcome.outcome == R.OUTCOME_MISS and step.cached_tokens == len(HISTORY)
            for session in live:
                await session.close()


async def test_cache_entries_go_before_a_retained_session(clock: trio.testing.MockClock) -> None:
    """A cache of one entry holds a released conversation while a session is retained beside
    it (the retained one takes no room of the cache); when the retained session expires, its
    history replaces the older entry (an eviction), so the replay of it is served, and the
    older conversation is computed again."""
    older = [1, *range(60, 80)]
    async with cached_worker(budget=PER_SESSION) as w:
        async with ShardClient.connect(w.server.target, timeout=TIMEOUT) as client:
            session = await client.open_session("old")
            await session.prefill(older)
            await session.close()
            await retain(client, "conv", HISTORY)
            m = w.engine.metrics()
            assert (m.prefix_cache_entries, m.prefix_cache_tokens) == (1, len(older))
            await expire(w, clock, "conv")
            m = w.engine.metrics()
            assert (m.prefix_cache_tokens, m.prefix_cache_evictions_total) == (len(HISTORY), 1)
            _, step = await next_turn(client, "conv", HISTORY + TAIL)
            assert step.cached_tokens == len(HISTORY)
            _, step = await next_turn(client, "old", older + TAIL)
            assert step.cached_tokens == 1  # only the BOS it shares with the kept one
