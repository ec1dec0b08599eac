"""Tick formation for continuous batching: which rows of which sessions go into the next step.

Why a separate module: the policy (who goes first, how a long prompt is cut, which sessions may
share a step) decides latency and fairness, and is easiest to reason about and test on plain
data. It knows nothing about llama.cpp, numpy or Trio; ``shard.engine.llama`` owns the native
step and the waiting.

Policy (one call of ``TickPlanner.plan`` per native step):

1. Steps are served in arrival order within each class. *Row steps* are steps with one row
   left (a decode, or the last row of a prompt); *chunk steps* have more.
2. Every ready row step gets its row, oldest first, up to ``budget`` rows and ``max_sessions``
   sessions per tick (the rest wait for the next tick, still oldest first, so none starves).
3. The rest of the budget is shared by the chunk steps: the oldest ones that fit (one row each
   at least, ``max_sessions`` in all) split it equally, and a step needing less than its share
   gives the rest to the others. A prompt of ``P`` rows therefore delays the running decodes by
   at most one chunk per tick; alone, its first token comes after ``ceil(P / budget)`` ticks,
   and a short prompt arriving behind a long one is not kept waiting for all of it (first come,
   first served would hold it for the long prompt's every chunk).
4. With ``mix=False`` (used by non-last layer-range shards, whose captured hidden rows must
   come back in batch order, see ``shard.engine.llama``) a tick holds either row steps of many
   sessions or one chunk of a single step, never both; ticks then alternate between the two
   kinds while both wait, so neither starves, and chunk ticks take the waiting chunk steps in
   turn (least recently served first, then oldest).

The pieces of a tick are returned sorted by sequence id: llama.cpp splits a multi-sequence batch
of a per-sequence KV cache into ubatches of consecutive, ascending sequence ids.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(eq=False)
class Step:
    """One submitted compute: ``n_rows`` rows to evaluate for sequence ``seq``, in order."""

    seq: int
    n_rows: int
    arrival: int
    done_rows: int = 0  # rows already evaluated by earlier ticks
    last_chunk_tick: int = -1  # the planner's tick number when it last gave this step a chunk

    @property
    def remaining(self) -> int:
        return self.n_rows - self.done_rows


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, start + count)`` of ``step`` in one tick."""

    step: Step
    start: int
    count: int

    @property
    def completes(self) -> bool:
        """This piece evaluates the step's last row."""
        return self.start + self.count == self.step.n_rows


class TickPlanner:
    """Forms ticks from the pending steps (see the module docs for the policy)."""

    def __init__(self, budget: int, max_sessions: int, *, mix: bool = True) -> None:
        if budget <= 0 or max_sessions <= 0:
            raise ValueError("budget and max_sessions must be positive")
        self.budget = budget
        self.max_sessions = max_sessions
        self.mix = mix
        self._last_was_rows = False  # mix=False: alternate between row ticks and chunk ticks
        self._ticks = 0

    def plan(self, pending: Iterable[Step]) -> list[Piece]:
        """The pieces of the next tick (empty only when nothing is pending)."""
        steps = sorted((s for s in pending if s.remaining > 0), key=lambda s: s.arrival)
        rows = [s for s in steps if s.remaining == 1]
        chunks = [s for s in steps if s.remaining > 1]
        pieces: list[Piece] = []
        take_rows = bool(rows) and (self.mix or not chunks or not self._last_was_rows)
        if take_rows:
            for s in rows[: min(self.budget, self.max_sessions)]:
                pieces.append(Piece(s, s.done_rows, 1))
        if chunks and self.mix:
            pieces += _fair_shares(chunks, self.budget - len(pieces), self.max_sessions - len(pieces))
        elif chunks and not take_rows:
            # One chunk per tick: its captured rows are the whole batch, in order.
            s = min(chunks, key=lambda c: (c.last_chunk_tick, c.arrival))
            pieces.append(Piece(s, s.done_rows, min(s.remaining, self.budget)))
        for p in pieces:
            if p.step.remaining > 1:  # a chunk step (row steps have one row left)
                p.step.last_chunk_tick = self._ticks
        self._ticks += 1
        self._last_was_rows = take_rows
        pieces.sort(key=lambda p: p.step.seq)
        return pieces


def _fair_shares(chunks: list[Step], rows: int, sessions: int) -> list[Piece]:
    """Split ``rows`` among the oldest chunk steps that fit (at least one row each, at most
    ``sessions`` of them): equal shares, a step that needs less leaving the rest to the others."""
    takers = chunks[: max(0, min(rows, sessions))]  # chunks are oldest first
    pieces = []
    left = rows
    for i, s in enumerate(sorted(takers, key=lambda c: (c.remaining, c.arrival))):
        count = min(s.remaining, left // (len(takers) - i))  # >= 1: left >= takers still to serve
        pieces.append(Piece(s, s.done_rows, count))
        left -= count
    return pieces


__all__ = ["Piece", "Step", "TickPlanner"]
