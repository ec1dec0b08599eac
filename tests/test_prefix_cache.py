"""The prefix cache's index (shard.engine.prefix_cache) against a plain model: a state machine
inserts, looks up, pins and unpins, and after every step the cache must agree with the model
(same entries in the same LRU order, same answers) and keep its invariants (within the budget,
no key lost or held twice, a pinned entry never evicted)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shard.engine.prefix_cache import Hit, PrefixCache, reserved_entries

# Few distinct tokens and short histories: prefixes shared, extended and repeated are common.
histories = st.lists(st.integers(0, 3), min_size=0, max_size=9)


@dataclass
class _ModelEntry:
    key: int
    ids: tuple[int, ...]
    pins: int = 0


def _shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class PrefixCacheMachine(RuleBasedStateMachine):
    """The cache beside a list of entries, least recently used first, updated by the rules the
    module doc states, written the slow and obvious way."""

    @initialize(budget=st.integers(0, 24), max_entries=st.integers(0, 4))
    def start(self, budget: int, max_entries: int) -> None:
        self.cache = PrefixCache(budget, max_entries)
        self.model: list[_ModelEntry] = []
        self.next_key = 0
        self.outside: set[int] = set()  # keys handed back to the caller
        self.inserted: set[int] = set()

    def _find(self, key: int) -> _ModelEntry:
        return next(e for e in self.model if e.key == key)

    @rule(ids=histories)
    def insert(self, ids: list[int]) -> None:
        key = self.next_key
        self.next_key += 1
        self.inserted.add(key)
        freed, evicted = self.cache.insert(key, ids)
        # The model.
        new = tuple(ids)
        expect_freed: list[int] = []
        expect_evicted = 0
        budget, most = self.cache.budget, self.cache.max_entries
        holder = next((e for e in self.model if e.ids[: len(new)] == new and len(e.ids) >= len(new)), None)
        pinned = [e for e in self.model if e.pins]
        if budget <= 0 or most <= 0 or not new or len(new) > budget:
            expect_freed = [key]
        elif holder is not None:
            self.model.remove(holder)
            self.model.append(holder)
            expect_freed = [key]
        elif sum(len(e.ids) for e in pinned) + len(new) > budget or len(pinned) + 1 > most:
            expect_freed = [key]
        else:
            for e in list(self.model):
                if not e.pins and new[: len(e.ids)] == e.ids:
                    self.model.remove(e)
                    expect_freed.append(e.key)
            while (sum(len(e.ids) for e in self.model) + len(new) > budget
                   or len(self.model) + 1 > most):
                victim = next(e for e in self.model if not e.pins)
                self.model.remove(victim)
                expect_freed.append(victim.key)
                expect_evicted += 1
            self.model.append(_ModelEntry(key, new))
        assert freed == expect_freed
        assert evicted == expect_evicted
        for k in freed:
            assert k not in self.outside, "a key handed back twice"
            self.outside.add(k)

    def _best(self, ids: list[int], limit: int | None) -> tuple[_ModelEntry | None, int]:
        query = tuple(ids if limit is None else ids[:limit])
        best, best_len = None, 0
        for e in reversed(self.model):
            n = _shared(e.ids, query)
            if n > best_len:
                best, best_len = e, n
        return best, best_len

    @rule(ids=histories, limit=st.none() | st.integers(0, 10))
    def lookup(self, ids: list[int], limit: int | None) -> None:
        hit = self.cache.lookup(ids, limit)
        best, best_len = self._best(ids, limit)
        if best is None:
            assert hit == Hit()
            return
        assert hit == Hit(best.key, best_len)
        self.model.remove(best)
        self.model.append(best)

    @rule(ids=histories, limit=st.none() | st.integers(0, 10))
    def peek(self, ids: list[int], limit: int | None) -> None:
        """The same answer as ``lookup``, and the order of use stays as it was."""
        best, best_len = self._best(ids, limit)
        assert self.cache.peek(ids, limit) == (Hit() if best is None else Hit(best.key, best_len))

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        entry = data.draw(st.sampled_from(self.model))
        self.cache.pin(entry.key)
        entry.pins += 1

    @precondition(lambda self: any(e.pins for e in self.model))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        entry = data.draw(st.sampled_from([e for e in self.model if e.pins]))
        self.cache.unpin(entry.key)
        entry.pins -= 1

    @invariant()
    def agrees_with_the_model(self) -> None:
        assert self.cache.keys() == [e.key for e in self.model]
        for e in self.model:
            assert self.cache.ids(e.key) == e.ids
        assert self.cache.tokens == sum(len(e.ids) for e in self.model)
        assert len(self.cache) == len(self.model)

    @invariant()
    def holds_its_bounds(self) -> None:
        # Pinned entries may keep the cache over nothing: pins only stop evictions, and an
        # insert that cannot make room keeps nothing.
        assert self.cache.tokens <= max(self.cache.budget, 0)
        assert len(self.cache) <= max(self.cache.max_entries, 0)

    @invariant()
    def loses_no_key(self) -> None:
        kept = set(self.cache.keys())
        assert not kept & self.outside
        assert kept | self.outside == self.inserted


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_the_longest_shared_prefix_wins_and_the_most_recent_breaks_ties() -> None:
    cache = PrefixCache(100, 4)
    assert cache.insert(1, [1, 2, 3, 4]) == ([], 0)
    assert cache.insert(2, [1, 2, 9]) == ([], 0)
    assert cache.lookup([1, 2, 3, 7]) == Hit(1, 3)
    assert cache.lookup([1, 2, 5]) == Hit(1, 2)  # 1 was used last: it wins the tie
    assert cache.lookup([1, 2, 5], limit=1) == Hit(1, 1)
    assert cache.lookup([7]) == Hit()
    assert cache.lookup([]) == Hit()


def test_a_history_that_extends_an_entry_replaces_it_and_one_it_starts_is_not_kept() -> None:
    cache = PrefixCache(100, 4)
    cache.insert(1, [1, 2])
    assert cache.insert(2, [1, 2, 3]) == ([1], 0)  # replaced, not evicted
    assert cache.insert(3, [1, 2]) == ([3], 0)  # entry 2 holds it already
    assert cache.keys() == [2]


def test_eviction_is_least_recently_used_and_spares_pinned_entries() -> None:
    cache = PrefixCache(6, 3)
    cache.insert(1, [1, 1])
    cache.insert(2, [2, 2])
    cache.insert(3, [3, 3])
    cache.lookup([1])  # 2 is now the oldest
    cache.pin(2)
    assert cache.insert(4, [4, 4]) == ([3], 1)
    assert cache.keys() == [2, 1, 4]
    cache.pin(1)
    cache.pin(4)
    assert cache.insert(5, [5]) == ([5], 0)  # every entry pinned: the new one is not kept
    cache.unpin(1)
    assert cache.insert(5, [5, 5]) == ([1], 1)


def test_a_moved_entry_keeps_its_place_and_a_pinned_one_stays() -> None:
    cache = PrefixCache(6, 3)
    cache.insert(1, [1, 1])
    cache.insert(2, [2, 2])
    cache.insert(3, [3, 3])
    assert cache.move(2, 9)
    assert cache.keys() == [1, 9, 3] and cache.ids(9) == (2, 2) and 2 not in cache
    cache.pin(3)
    assert not cache.move(3, 8) and cache.keys() == [1, 9, 3]
    with pytest.raises(ValueError):
        cache.move(1, 9)
    assert cache.lookup([2, 2]) == Hit(9, 2)  # found under its new key, and marked used
    assert cache.keys() == [1, 3, 9]
    assert cache.insert(4, [4, 4]) == ([1], 1)


def test_an_off_cache_keeps_nothing() -> None:
    for cache in (PrefixCache(0, 3), PrefixCache(10, 0)):
        assert not cache.enabled
        assert cache.insert(1, [1, 2]) == ([1], 0)
        assert cache.lookup([1, 2]) == Hit()
    assert PrefixCache(3, 1).insert(1, [1, 2, 3, 4]) == ([1], 0)  # over the whole budget


@pytest.mark.parametrize(("budget", "per_session", "entries"),
                         [(0, 256, 0), (1, 256, 1), (256, 256, 1), (257, 256, 2), (100, 0, 0)])
def test_reserved_entries_round_the_budget_up_to_whole_histories(
        budget: int, per_session: int, entries: int) -> None:
    assert reserved_entries(budget, per_session) == entries


async def test_a_thousand_conversations_leave_the_cache_within_its_budget() -> None:
    """1,000 distinct conversations through a fake engine with a small cache: after every
    release the cache is within its budget and holds no more entries than it may, no session
    cell is left, and every history was either kept, replaced or evicted (counted)."""
    from shard.engine import LoadSpec, PrefillRequest
    from shard.engine.fake import FakeEngine

    budget = 300
    async with FakeEngine() as engine:
        caps = await engine.load(LoadSpec(n_ctx=1024, max_sessions=4, prefix_cache_tokens=budget))
        assert reserved_entries(budget, caps.n_ctx_per_session) == 2
        for i in range(1000):
            await engine.open_session("c")
            prompt = (1, 3 + i % 200, 3 + (i // 200) % 200, *range(10, 10 + i % 17))
            await engine.prefill(PrefillRequest("c", tokens=prompt, top_k_logprobs=0))
            await engine.release("c")
            m = engine.metrics()
            assert m.prefix_cache_tokens <= budget and m.prefix_cache_entries <= 2
            assert m.kv_cells_used == 0
        m = engine.metrics()
        assert m.prefix_cache_stored_total == 1000
        assert m.prefix_cache_evictions_total + m.prefix_cache_entries == 1000
        assert engine._impl_kv_cells_used() == m.prefix_cache_tokens  # nothing else held


def _rss_bytes() -> int:
    """This process's resident set (Linux ``/proc/self/statm``: pages)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
async def test_a_thousand_conversations_on_llama_keep_the_budget_memory_and_live_cells() -> None:
    """The same on llama.cpp (the tiny model), with conversations that extend earlier ones (so
    entries are hit, replaced and evicted) while one live session stays open: the cache stays
    within its budget, no session cell is left, the process's memory stays flat after a
    warm-up, and the live session never loses a cell under the pressure (it holds its tokens,
    and a step from it gives what it gave before the conversations)."""
    from shard.engine import DecodeRequest, LoadSpec, PrefillRequest
    from shard.engine.llama import LlamaCppEngine
    from shard.models import ensure_model

    budget, n = 300, 1000
    live = (1, *range(40, 70))
    async with LlamaCppEngine() as engine:
        caps = await engine.load(LoadSpec(model_path=ensure_model("tiny"), n_ctx=1024, max_sessions=4,
                                          n_threads=1, prefix_cache_tokens=budget))
        assert reserved_entries(budget, caps.n_ctx_per_session) == 2
        await engine.open_session("live")
        await engine.prefill(PrefillRequest("live", tokens=live, top_k_logprobs=0))

        async def live_step() -> tuple[int, float]:
            """A step from the live session's history, then its cells back as they were."""
            result = await engine.decode(DecodeRequest("live", token=5))
            await engine.truncate("live", len(live))
            assert engine.session_info("live").tokens == live
            assert result.logits is not None
            return result.logits.token_id, result.logits.logprob

        before = await live_step()
        rss: dict[int, int] = {}
        previous: tuple[int, ...] = ()
        for i in range(n):
            await engine.open_session("c")
            extends = bool(i % 3 and previous)
            if extends:  # the next turn of the previous conversation, released just before
                prompt = (*previous, 3 + i % 250, 3 + (i * 7) % 250)
            else:  # a new conversation
                prompt = (1, 3 + i % 250, 3 + (i // 250) % 250, *range(10, 10 + i % 17))
            result = await engine.prefill(PrefillRequest("c", tokens=prompt, top_k_logprobs=0))
            assert result.cached_tokens < len(prompt)
            if extends:
                assert result.cached_tokens >= len(previous), (i, result.cached_tokens)
            await engine.release("c")
            previous = prompt if len(prompt) < 120 else ()
            m = engine.metrics()
            assert m.prefix_cache_tokens <= budget and m.prefix_cache_entries <= 2
            assert m.kv_cells_used == len(live)  # the live session's cells only
            if i in (n // 2, n - 1):
                rss[i] = _rss_bytes()
                after = await live_step()
                assert after[0] == before[0] and math.isclose(after[1], before[1], abs_tol=1e-4)
        m = engine.metrics()
        assert m.prefix_cache_hits_total > n // 2 and m.prefix_cache_evictions_total > 0
        assert m.prefix_cache_evictions_total + m.prefix_cache_entries <= m.prefix_cache_stored_total
        growth = rss[n - 1] - rss[n // 2]
        assert growth < 20 * 2**20, f"the process grew {growth / 2**20:.1f} MiB over the second half"
