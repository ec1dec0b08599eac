"""The prefix cache's index: released histories kept as entries, looked up by their token ids,
within a budget, least recently used first out.

Why a flat list of whole histories and not a radix tree or hashed blocks: on llama.cpp every
sequence has a KV stream of its own (``kv_unified = false``, ``shard.engine.llama``), and a
copy between streams copies a whole stream (``llama_kv_cache::seq_cp`` asserts on a partial
range), so what the engine can keep and hand out is one released sequence at a time, never a
block shared by several. An entry is therefore one history (its storage is a sequence id the
entry owns), the entries are few (each holds a stream; at most ``max_entries``), and a lookup
compares the prompt with each entry's ids in numpy, which costs less than walking a tree of
Python nodes. A radix tree pays off where entries share cells, which needs a unified cache.

Rules (``tests/test_prefix_cache.py`` checks them against a plain model):

- ``insert`` keeps a history unless one already kept starts with it (that one serves every
  lookup this would), drops the kept ones it extends, then evicts the least recently used
  entries until it fits ``budget`` tokens and ``max_entries``; an entry pinned by a copy in
  flight is never evicted (then the new one is not kept).
- ``lookup`` returns the entry sharing the longest prefix with a prompt (the most recently used
  among equals) and marks it used; ``peek`` answers the same length and changes nothing (a
  question about what the cache could serve must not reorder what it evicts).
- Every key the cache lets go (evicted, replaced, or not kept) is returned to the caller, who
  frees its storage; the cache never holds a key twice.

Pure Python: no engine, no Trio; the engine calls it on the event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Hit", "PrefixCache", "reserved_entries"]


def reserved_entries(budget_tokens: int, n_ctx_per_session: int) -> int:
    """How many entries (sequences) a budget of ``budget_tokens`` takes when one entry holds
    at most ``n_ctx_per_session`` tokens: enough for the budget in whole histories, rounded up
    (0: the cache is off)."""
    if budget_tokens <= 0 or n_ctx_per_session <= 0:
        return 0
    return -(-budget_tokens // n_ctx_per_session)


@dataclass(frozen=True)
class Hit:
    """A lookup's answer: the entry's key and how many leading tokens it shares (0: none)."""

    key: int | None = None
    length: int = 0


@dataclass
class _Entry:
    ids: np.ndarray  # int64, the history's token ids
    pins: int = 0


@dataclass
class PrefixCache:
    """Entries keyed by an int the engine chooses (its storage: a sequence id), in LRU order."""

    budget: int = 0
    max_entries: int = 0
    _entries: OrderedDict[int, _Entry] = field(default_factory=OrderedDict)  # oldest first
    _tokens: int = 0

    @property
    def enabled(self) -> bool:
        return self.budget > 0 and self.max_entries > 0

    @property
    def tokens(self) -> int:
        """Tokens held by every entry (each a KV cell of its sequence)."""
        return self._tokens

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[int]:
        """The entries' keys, least recently used first."""
        return list(self._entries)

    def ids(self, key: int) -> tuple[int, ...]:
        return tuple(int(t) for t in self._entries[key].ids)

    def lookup(self, ids: Sequence[int], limit: int | None = None) -> Hit:
        """The entry sharing the longest prefix with ``ids`` (at most ``limit`` tokens), marked
        used; ``Hit()`` when none shares a token."""
        hit = self.peek(ids, limit)
        if hit.key is not None:
            self._entries.move_to_end(hit.key)
        return hit

    def peek(self, ids: Sequence[int], limit: int | None = None) -> Hit:
        """``lookup``'s answer without marking the entry used."""
        n = len(ids) if limit is None else min(limit, len(ids))
        if n <= 0 or not self._entries:
            return Hit()
        query = np.asarray(ids[:n], dtype=np.int64)
        best: int | None = None
        best_len = 0
        for key, entry in reversed(self._entries.items()):  # most recent first: it wins ties
            m = min(n, entry.ids.shape[0])
            if m <= best_len:
                continue
            diff = np.flatnonzero(entry.ids[:m] != query[:m])
            shared = int(diff[0]) if diff.size else m
            if shared > best_len:
                best, best_len = key, shared
        if best is None:
            return Hit()
        return Hit(best, best_len)

    def pin(self, key: int) -> None:
        """``key`` is being copied from: it is not evicted until ``unpin``."""
        self._entries[key].pins += 1

    def unpin(self, key: int) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    def insert(self, key: int, ids: Sequence[int]) -> tuple[list[int], int]:
        """Keep ``ids`` as entry ``key``. Returns the keys let go (``key`` itself when it is not
        kept) and how many of them were evicted for room (the others were replaced)."""
        if key in self._entries:
            raise ValueError(f"key {key} is already an entry")
        n = len(ids)
        if not self.enabled or n == 0 or n > self.budget:
            return [key], 0
        new = np.asarray(ids, dtype=np.int64)
        for other, entry in self._entries.items():
            if entry.ids.shape[0] >= n and np.array_equal(entry.ids[:n], new):
                self._entries.move_to_end(other)  # it holds this history already
                return [key], 0
        pinned = [e.ids.shape[0] for e in self._entries.values() if e.pins]
        if sum(pinned) + n > self.budget or len(pinned) + 1 > self.max_entries:
            return [key], 0  # no room even after every eviction allowed
        freed = [other for other, entry in self._entries.items()  # histories this one extends
                 if entry.pins == 0 and np.array_equal(new[: entry.ids.shape[0]], entry.ids)]
        for other in freed:
            self._drop(other)
        evicted = 0
        while self._tokens + n > self.budget or len(self._entries) + 1 > self.max_entries:
            victim = next(k for k, e in self._entries.items() if e.pins == 0)
            self._drop(victim)
            freed.append(victim)
            evicted += 1
        self._entries[key] = _Entry(new)
        self._tokens += n
        return freed, evicted

    def move(self, key: int, new_key: int) -> bool:
        """The entry ``key`` is stored under ``new_key`` from now on (same place in the LRU
        order); False, and nothing changes, while it is pinned (a step copies from it)."""
        if new_key in self._entries:
            raise ValueError(f"key {new_key} is already an entry")
        if self._entries[key].pins:
            return False
        self._entries = OrderedDict((new_key if k == key else k, e) for k, e in self._entries.items())
        return True

    def clear(self) -> list[int]:
        """Forget every entry (pinned ones too); returns their keys."""
        keys = list(self._entries)
        self._entries.clear()
        self._tokens = 0
        return keys

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._tokens -= entry.ids.shape[0]
