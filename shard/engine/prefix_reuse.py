"""Prefix reuse across sessions: when a released session's history is kept in the prefix cache,
and how a new prefill starts from a kept one. The same mechanism on every engine; an
implementation only copies, frees and moves cells (``ComputePlan.copy_from``,
``_impl_forget_cells``, ``_impl_move_cells``).

Why released histories only (not a truncated tail): a released session's sequence id passes to
its entry as it is (or its cells move to a higher free id at once, ``_move_up``), so keeping it
copies nothing that is written later; a copy of a live session's cells would be a
second stream written later (llama.cpp performs a copy between streams at the next
``llama_decode``; no public call performs it sooner), which an import into that session could
overwrite first (a fork, ``fork_session``, makes such a copy and refuses state reads and writes
until it is performed). See docs/engine.md, "Prefix cache".

Rules: a prefill uses the cache only when the session's whole history starts its prompt (an
empty session always does), takes the entry with the longest shared prefix when it is longer
than what the session holds, never more than the prompt less one position (a step computes at
least one) nor than the request's ``cache_limit`` (a pipeline's first hop held to what every
later hop holds), and never for an ``all_logits`` step. ``held`` answers how much of a prompt the
cache could serve now without using it (a worker reports it to the hop before, and plans its
chunks with it). The entry is pinned until the step ends, so
no eviction can free it under the copy; a step that fails or is cancelled rolls the session
back to what it held (``OperationRunner.running``), and entries are only ever written by a
release, so no failure leaves half an entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from .operations import OperationRunner
from .plans import ComputePlan
from .prefix_cache import PrefixCache, reserved_entries
from .sessions import SessionTable
from .slots import Slot
from .types import Capabilities


class CellHooks(Protocol):
    """The implementation's hooks this uses (``EngineHooks`` documents them)."""

    async def _impl_truncate(self, slot: Slot, keep: int) -> None: ...

    async def _impl_forget_cells(self, seq_ids: list[int]) -> None: ...

    async def _impl_move_cells(self, source: int, seq: int) -> None: ...

    def _impl_moves_cells(self) -> bool: ...


class PrefixReuse:
    """The engine's prefix cache (``cache``) and the rules of using it."""

    __slots__ = ("cache", "_hooks", "_runner", "_sessions", "_counters")

    def __init__(self, hooks: CellHooks, runner: OperationRunner, sessions: SessionTable,
                 counters: dict[str, int]) -> None:
        self._hooks, self._runner, self._sessions, self._counters = hooks, runner, sessions, counters
        self.cache = PrefixCache()

    def reset(self, caps: Capabilities) -> int:
        """A fresh cache for a loaded engine; returns the sequence ids its entries may take."""
        entries = reserved_entries(caps.prefix_cache_tokens, caps.n_ctx_per_session)
        self.cache = PrefixCache(caps.prefix_cache_tokens if entries else 0, entries)
        return entries

    def held(self, ids: Sequence[int]) -> int:
        """How many leading ids of ``ids`` an entry holds now (no entry is marked used)."""
        if not self.cache.enabled:
            return 0
        return self.cache.peek(ids).length

    def plan(self, slot: Slot, plan: ComputePlan, limit: int | None = None) -> ComputePlan:
        """``plan`` started from the cached entry that shares more of its prompt than the
        session holds, at most ``limit`` positions of the session (that entry pinned: ``done``
        unpins it), or ``plan`` itself."""
        cache = self.cache
        held = slot.tokens
        if not cache.enabled or held is None or plan.all_logits or plan.keep != slot.n_past:
            return plan
        ids = plan.tokens if plan.tokens is not None else plan.token_ids
        if ids is None:
            return plan
        prompt = [*held, *ids]
        most = len(prompt) - 1 if limit is None else min(limit, len(prompt) - 1)
        hit = cache.lookup(prompt, most)
        if hit.key is None or hit.length <= plan.keep:
            return plan
        skip = hit.length - plan.keep
        cache.pin(hit.key)
        return dataclasses.replace(
            plan, keep=hit.length,
            tokens=None if plan.tokens is None else plan.tokens[skip:],
            hidden=None if plan.hidden is None else plan.hidden[skip:],
            token_ids=None if plan.token_ids is None else plan.token_ids[skip:],
            copy_from=hit.key, cached_ids=tuple(ids[:skip]))

    def done(self, plan: ComputePlan) -> None:
        """The step of ``plan`` ended (committed or not): its entry may be evicted again."""
        if plan.copy_from is not None:
            self.cache.unpin(plan.copy_from)

    async def keep(self, slot: Slot) -> bool:
        """Keep the released ``slot``'s history as an entry (its sequence id with it, or its
        cells moved to a higher free id: ``_move_up``); returns whether it was kept. Entries it
        replaces or evicts are freed here."""
        cache = self.cache
        if not cache.enabled or slot.tokens is None or slot.n_past == 0:
            return False
        # Only the committed history: a step computed ahead is not part of it.
        await self._runner.guard(self._hooks._impl_truncate(slot, slot.n_past))
        freed, evicted = cache.insert(slot.seq_id, slot.tokens)
        kept = slot.seq_id not in freed
        counters = self._counters
        counters["prefix_cache_stored_total"] += kept
        counters["prefix_cache_evictions_total"] += evicted
        await self.forget([key for key in freed if key != slot.seq_id])
        if slot.seq_id in cache:  # (not evicted meanwhile by another release)
            await self._move_up(slot.seq_id)
        return kept

    async def _move_up(self, key: int) -> None:
        """Store the new entry ``key`` (the released session's sequence id, which the caller
        leaves held) at the highest free id instead, when one is above it, and free ``key``.

        Why: sessions take the lowest free ids, and llama.cpp splits a tick into one ubatch per
        run of consecutive ids (docs/engine.md, "Sequence ids and ubatches"): an entry left
        where a session was splits every later tick of the sessions around it in two, each
        pass reading all the weights (the door's chats release one session per conversation,
        so under load one entry always sat inside the sessions' run). The entry is re-keyed
        before its cells move: a step that finds it from then on copies from the new id, and
        its tick runs in the native thread after the move. A pinned entry (a step is copying
        from it) stays where it is, and so does every entry of an engine that cannot move one
        whole (``_impl_moves_cells``)."""
        if not self._hooks._impl_moves_cells():
            return
        sessions, cache = self._sessions, self.cache
        target = sessions.take_free_above(key)
        if target is None:
            return
        if not cache.move(key, target):
            sessions.free_id(target)
            return
        await self._runner.guard(self._hooks._impl_move_cells(key, target))
        sessions.free_id(key)

    async def forget(self, seq_ids: list[int]) -> None:
        """Free the cells of entries the cache let go, and their sequence ids."""
        if not seq_ids:
            return
        try:
            await self._runner.guard(self._hooks._impl_forget_cells(seq_ids))
        finally:
            for seq_id in seq_ids:
                self._sessions.free_id(seq_id)


def commit_history(slot: Slot, plan: ComputePlan, counters: dict[str, int]) -> None:
    """Commit the ids of a computed step that is not the plain token case: a hidden-state
    step's ids (``plan.token_ids``; without them the session stops keeping its history), and a
    prefill's start copied from the cache (``plan.cached_ids``, counted as a hit)."""
    ids = plan.tokens if plan.tokens is not None else plan.token_ids
    if ids is None:
        slot.tokens = None
        return
    if slot.tokens is None:
        return
    cached = plan.cached_ids
    del slot.tokens[plan.keep - len(cached) :]
    if cached:
        slot.tokens.extend(cached)
        counters["prefix_cache_hits_total"] += 1
        counters["prefix_cache_hit_tokens_total"] += len(cached)
    slot.tokens.extend(ids)


__all__ = ["PrefixReuse", "commit_history"]
