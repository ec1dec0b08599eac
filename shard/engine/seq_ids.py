"""Which sequence id a new session takes.

Why it matters: with one KV stream per sequence, llama.cpp splits a batch into one ubatch per
run of rows whose sequence ids go up one by one, and every ubatch reads all the weights again
(docs/engine.md, "Sequence ids and ubatches"). A tick holds the steps of one batch group
(``shard.engine.batching``, rule 5), so the ids of a group's sessions should form one run.

Sessions without a group take the lowest free id, which keeps the sessions open at one time
together. A pipeline opens its generations' sessions in its groups in turn (A, B, C, A, B, ...):
lowest-free would give group A the ids 0, 3, 6, so every tick of A ran as three ubatches of one
row. Here a session of a group takes a free id next to its group's members when there is one,
and otherwise starts a run where it has the most room to grow: at the start of a free stretch
that follows nothing, or in the middle of one that follows another session (whose group may
still grow into the first half).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["pick_seq_id", "runs"]


def pick_seq_id(free: Iterable[int], held: Mapping[int, int], group: int) -> int:
    """The id for a new session of batch group ``group`` (0: none) among ``free`` ids, given
    ``held``: the group of every id in use."""
    free_ids = sorted(free)
    if not free_ids:
        raise ValueError("no free sequence id")
    if group == 0:
        return free_ids[0]
    free_set = set(free_ids)
    mine = sorted(s for s, g in held.items() if g == group)
    for s in reversed(mine):  # grow a run upwards first: the ids above are more often free
        if s + 1 in free_set:
            return s + 1
    for s in mine:
        if s - 1 in free_set:
            return s - 1
    best, room = free_ids[0], -1
    i = 0
    while i < len(free_ids):  # each stretch of consecutive free ids [a, b)
        a = b = free_ids[i]
        while i < len(free_ids) and free_ids[i] == b:
            b += 1
            i += 1
        if a - 1 in held:
            start, space = a + (b - a) // 2, (b - a + 1) // 2
        else:
            start, space = a, b - a
        if space > room:
            best, room = start, space
    return best


def runs(ids: Iterable[int]) -> int:
    """How many runs of consecutive ids ``ids`` form (a tick of them: that many ubatches)."""
    s = sorted(set(ids))
    return sum(1 for i, x in enumerate(s) if i == 0 or s[i - 1] != x - 1)
