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
3. The rest of the budget goes to chunk steps, oldest first, each taking as many rows as it has
   left or as fit. A prompt of ``P`` rows therefore delays the running decodes by at most one
   chunk per tick, and its own first token comes after ``ceil(P / budget)`` ticks.
4. With ``mix=False`` (used by non-last layer-range shards, whose captured hidden rows must
   come back in batch order, see ``shard.engine.llama``) a tick holds either row steps of many
   sessions or one chunk of a single step, never both; ticks then alternate between the two
   kinds while both wait, so neither starves.

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
        if self.mix or not take_rows:
            left = self.budget - len(pieces)
            for s in chunks:
                if left <= 0 or len(pieces) >= self.max_sessions:
                    break
                count = min(s.remaining, left)
                pieces.append(Piece(s, s.done_rows, count))
                left -= count
                if not self.mix:
                    break  # one chunk per tick: its captured rows are the whole batch, in order
        self._last_was_rows = take_rows
        pieces.sort(key=lambda p: p.step.seq)
        return pieces


__all__ = ["Piece", "Step", "TickPlanner"]
