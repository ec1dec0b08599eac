"""Batch groups: how one pipeline's concurrent generations keep every hop busy.

A worker batches the steps of all its sessions into one native step (a tick). In a pipeline of
H hops that alone makes the hops take turns: every session's next step waits for the token that
the last hop computes, so all of them arrive at the first hop together, are computed there in
one tick, move to the second hop together, and so on; while one hop computes, the others wait.

Pipeline-parallel serving keeps the hops busy with micro-batches: the generations are split into
groups that move through the chain one after another, so that while hop k computes group g, hop
k+1 computes group g-1. ``BatchGroups`` gives each ``generate`` a group (the least occupied:
groups stay even as generations come and go) and every session of that generation, on every hop,
is opened in it (``OpenSession.batch_group``; with chain relay each worker opens its next hop in
the same group). A worker runs one group's steps per tick, the groups taking turns
(``shard.engine.batching``, rule 5), so groups never merge and no hop waits for a group that is
elsewhere.

How many: H groups by default, which keep every hop busy when passing a group on costs nothing.
One more would hide the time a group spends between hops (the client's relay, the network), at
the price of smaller ticks, and a tick is far from proportional to its rows: it reads all the
weights once, so H groups serve more than H + 1 (docs/benchmarks.md, "Pipeline throughput under
concurrency"). A single hop needs no groups (group 0: every session shares every tick).
Group ids are drawn at random per pipeline so that two clients' groups do not merge on shared
workers.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["BatchGroups", "default_groups"]


def default_groups(hops: int) -> int:
    """Groups for a chain of ``hops`` hops: one per hop, none for a single hop."""
    return hops if hops > 1 else 0


class BatchGroups:
    """The batch groups of one pipeline and how many running generations each holds."""

    def __init__(self, n: int) -> None:
        if n < 0:
            raise ValueError("the number of batch groups must be >= 0")
        self._members = [0] * n
        # 1..2**32-1, never 0 (no group); consecutive ids from a random base
        self._base = secrets.randbelow(2**32 - 1 - n) + 1 if n else 0

    @property
    def size(self) -> int:
        return len(self._members)

    def members(self) -> list[int]:
        """Running generations per group, in group order."""
        return list(self._members)

    def running(self, group: int) -> int:
        """Running generations in ``group`` (0 for no group)."""
        return self._members[group - self._base] if group else 0

    def take(self) -> int:
        """The group for a new generation (the least occupied; 0 when there are none)."""
        if not self._members:
            return 0
        i = min(range(len(self._members)), key=lambda k: (self._members[k], k))
        self._members[i] += 1
        return self._base + i

    @contextmanager
    def member(self) -> Iterator[int]:
        """A group for one generation, for the block (``take``, then ``give_back``)."""
        group = self.take()
        try:
            yield group
        finally:
            self.give_back(group)

    def give_back(self, group: int) -> None:
        """A generation in ``group`` ended."""
        if group:
            self._members[group - self._base] -= 1
