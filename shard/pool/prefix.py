"""Which route holds which conversation: a bounded, approximate memory of the prompts a pool
sent to each route, so that the next turn of a conversation goes back to where it is cached.

Why: every worker keeps a prefix cache keyed by exact token ids (``shard.engine.prefix_cache``),
and a chat client resends the whole conversation every turn. A turn that lands on the route
that served the turn before computes only its new tail; one that lands elsewhere computes the
whole conversation again. The pool cannot ask the workers what they hold at every lease, so it
remembers what it sent where, as SGLang's cache-aware router keeps an approximate tree per
worker.

How: a prompt is cut into blocks (``BLOCK_CHARS`` characters of a text prompt, what the door
sends after rendering the chat template, or ``BLOCK_TOKENS`` ids of a token prompt); block i's
key is a hash of its content and block i-1's key, so one key stands for the whole prefix up to
the block's end (the block hashing of vLLM's prefix cache). A route remembers the keys of every
prompt leased to it, and which keys ended one (``ended``: the prompt goes on from a whole
prompt sent there, as a chat's next turn does, not from a prefix several prompts share); a
route's match for a new prompt is how many of its leading keys the route remembers, in
blocks. The bound is ``max_entries`` (route, key) pairs over all routes, least recently used
first out; a prompt's keys are touched last block first, so a prefix outlives the tails that
extend it, and a prompt longer than the bound keeps its first ``max_entries`` blocks.

Approximate by design, never a matter of correctness (the worker's cache compares exact ids; a
wrong guess costs a prefill, nothing else): a text prefix is a token prefix of the same
conversation except near the cut, where one token may span it (the worker then reuses the
common part); matches count whole blocks; the worker may have evicted what the pool remembers,
or a generation may have failed over to another replica; two different prefixes may share a
64-bit key. Routes through a worker that left, failed or changed are ``forget``-ed by the pool.

Pure: no Trio, no I/O (``tests/test_pool_prefix.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["BLOCK_CHARS", "BLOCK_TOKENS", "DEFAULT_ENTRIES", "PrefixIndex", "Route"]

#: Characters of a text prompt per block (about 16 tokens of English text).
BLOCK_CHARS = 64
#: Token ids of a token prompt per block.
BLOCK_TOKENS = 16
#: (route, block) pairs remembered by default: 1 Mi characters of prompts in all, far more than
#: the workers' caches hold by default (one conversation each).
DEFAULT_ENTRIES = 16384

#: One complete route: the worker serving each hop, first hop first.
Route = tuple[str, ...]


def block_keys(prompt: str | Sequence[int], limit: int) -> list[int]:
    """The chained keys of ``prompt``'s whole blocks (a partial last block has none), at most
    ``limit``. Text and token prompts never share a key (their chains start apart)."""
    if isinstance(prompt, str):
        size, key, seq = BLOCK_CHARS, hash("text"), prompt
    else:
        size, key, seq = BLOCK_TOKENS, hash("tokens"), tuple(prompt)  # type: ignore[assignment]
    keys = []
    for start in range(0, min(len(seq) // size, limit) * size, size):
        key = hash((key, seq[start:start + size]))
        keys.append(key)
    return keys


class PrefixIndex:
    """Per route, the block keys of the prompts sent there (see the module docstring)."""

    def __init__(self, max_entries: int = DEFAULT_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        #: (route, key) -> whether a prompt sent there ended with that block; oldest first
        self._lru: OrderedDict[tuple[Route, int], bool] = OrderedDict()
        self._pairs: dict[Route, int] = {}  # route -> its pairs in ``_lru``

    def __len__(self) -> int:
        return len(self._lru)

    def keys(self, prompt: str | Sequence[int]) -> list[int]:
        """``prompt``'s block keys, as ``matches`` and ``remember`` take them (one more than
        the bound at most: ``remember`` then knows the prompt went past it)."""
        return block_keys(prompt, self.max_entries + 1)

    def matches(self, keys: Sequence[int]) -> dict[Route, int]:
        """Every route that remembers at least the first block: how many leading blocks.
        (Per route, not per key: the routes are few, and a set of holders per key would cost
        more memory than the pairs themselves.)"""
        found: dict[Route, int] = {}
        for route in self._pairs:
            depth = 0
            for key in keys:
                if (route, key) not in self._lru:
                    break
                depth += 1
            if depth:
                found[route] = depth
        return found

    def remember(self, route: Route, keys: Sequence[int]) -> None:
        """``route`` was given a prompt of these keys: remember them (most recently used),
        evicting the least recently used pairs past the bound."""
        route = next((r for r in self._pairs if r == route), route)  # one tuple per route
        for key in reversed(keys[:self.max_entries]):
            entry = (route, key)
            if entry in self._lru:
                self._lru.move_to_end(entry)
            else:
                self._lru[entry] = False
                self._pairs[route] = self._pairs.get(route, 0) + 1
        if keys and len(keys) <= self.max_entries:  # (past the bound: its end is not kept)
            self._lru[(route, keys[-1])] = True
        while len(self._lru) > self.max_entries:
            self._drop(self._lru.popitem(last=False)[0])

    def ended(self, route: Route, key: int) -> bool:
        """Whether a prompt sent to ``route`` ended with the block of ``key``."""
        return self._lru.get((route, key), False)

    def forget(self, target: str) -> int:
        """Drop every route through ``target`` (it left, failed or serves something else now);
        returns how many pairs went."""
        gone = [entry for entry in self._lru if target in entry[0]]
        for entry in gone:
            del self._lru[entry]
            self._drop(entry)
        return len(gone)

    def routes(self) -> set[Route]:
        """The routes that remember something."""
        return set(self._pairs)

    def _drop(self, entry: tuple[Route, int]) -> None:
        route = entry[0]
        self._pairs[route] -= 1
        if not self._pairs[route]:
            del self._pairs[route]
