"""Tick formation for continuous batching: which rows of which sessions go into the next step.

Why a separate module: the policy (who goes first, how a long prompt is cut, which sessions may
share a step, how long a step may take) decides latency and fairness, and is easiest to reason
about and test on plain data. It knows nothing about llama.cpp, numpy or Trio;
``shard.engine.scheduler`` runs the ticks and ``shard.engine.llama`` owns the native step.

Policy (one call of ``TickPlanner.plan`` per native step):

1. **Waiting order.** Every step waits in one queue, ordered by the tick since which it has been
   waiting (its first tick, or the tick after it last got rows), then by arrival. A step that
   was just served goes to the back, so when not every waiting step fits in a tick the sessions
   take turns: a waiting step is served within ``ceil(waiting / max_sessions)`` ticks, whatever
   the other sessions resubmit meanwhile (a decode that resubmits after every tick cannot keep a
   prompt out, and a prompt of many chunks cannot keep a decode out).
2. **Admission.** The first ``min(max_sessions, budget)`` steps of that order get rows in the
   tick. *Row steps* (one row left: a decode, or the last row of a prompt) take their row;
   *chunk steps* (more rows left) share the rest of the ``budget``: equal shares, a step that
   needs less leaves the rest to the others. When everything waiting fits (the usual case), a
   tick therefore holds every ready decode plus as much prompt as the budget allows, and a
   prompt of ``P`` rows delays running decodes by at most one chunk per tick.
3. **Deadlines.** A row step may carry a deadline (a step timeout). Given the current time and
   a cost model of a tick (``TickCost``), the prompt rows of a tick are cut so that the tick is
   estimated to end within ``DEADLINE_SHARE`` of the time the nearest such deadline leaves (a
   decode is never put into a tick that cannot meet it because of another session's prompt).
   The same holds for a session that uses step timeouts and may submit its next step while
   the tick runs (``expected_timeout``): it would wait for the whole tick. Every admitted chunk
   step still gets at least one row, so prompts always progress.
4. **No mixing** (``mix=False``, used by non-last layer-range shards, whose captured hidden rows
   must come back in batch order, see ``shard.engine.llama``): a tick holds either row steps of
   many sessions (in waiting order) or one chunk of a single step, never both; ticks alternate
   between the two kinds while both wait, and chunk ticks take the waiting chunk steps in turn
   (least recently served first, then oldest). The deadlines of waiting row steps cut a chunk
   tick as in rule 3.

5. **Batch groups.** A step may belong to a batch group (``Step.group``, the session's
   ``OpenSession.batch_group``; 0 for none). A tick holds the steps of one group only: the group
   of the first step in waiting order (rule 1), so groups take turns as steps do. Why: a
   pipeline's hops keep busy only while its sessions move through them as separate groups,
   one group computing on hop k while another computes on hop k+1; a tick that merged two
   groups would put them in phase for good, and every hop would then wait for the others
   (docs/pipelines.md, "Throughput under concurrency"). With every step in group 0, as for
   clients that name none, the policy is rules 1-4 unchanged.

The pieces of a tick are returned sorted by sequence id: llama.cpp splits a multi-sequence batch
of a per-sequence KV cache into ubatches of consecutive, ascending sequence ids.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

#: A tick is sized to end within this share of the time left to the nearest deadline: the cost
#: model is an estimate (attention grows with the position, the machine may be busy).
DEADLINE_SHARE = 0.6


@dataclass(eq=False)
class Step:
    """One submitted compute: ``n_rows`` rows to evaluate for sequence ``seq``, in order.

    ``deadline`` (same clock as ``plan``'s ``now``; ``inf``: none) is when the step's result is
    due. ``waiting_since`` is kept by the planner (the tick number since which it waits).
    """

    seq: int
    n_rows: int
    arrival: int
    deadline: float = math.inf
    group: int = 0  # the session's batch group (rule 5)
    done_rows: int = 0  # rows already evaluated by earlier ticks
    waiting_since: int | None = None
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


class TickCost(Protocol):
    """How long a tick of ``rows`` rows is expected to take, in seconds (None: not known yet)."""

    def estimate(self, rows: int) -> float | None: ...


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
        self._expected: float | None = None

    def plan(
        self,
        pending: Iterable[Step],
        *,
        now: float | None = None,
        cost: TickCost | None = None,
        expected_timeout: float | None = None,
    ) -> list[Piece]:
        """The pieces of the next tick (empty only when nothing is pending).

        ``now`` and ``cost`` enable rule 3 (deadlines); without them deadlines are ignored.
        ``expected_timeout``: the shortest step timeout of a session that is not pending now
        but may submit a step during this tick (it then waits for this tick and its own): the
        tick's prompt rows are cut as for a waiting row step with that much time left.
        """
        self._expected = expected_timeout
        steps = self._in_order(pending)
        if steps:  # rule 5: the first step's batch group only
            steps = [s for s in steps if s.group == steps[0].group]
        rows = [s for s in steps if s.remaining == 1]
        chunks = [s for s in steps if s.remaining > 1]
        take_rows = bool(rows) and (self.mix or not chunks or not self._last_was_rows)
        pieces: list[Piece] = []
        if self.mix:
            admitted = steps[: min(self.max_sessions, self.budget)]
            row_steps = [s for s in admitted if s.remaining == 1]
            chunk_steps = [s for s in admitted if s.remaining > 1]
            pieces = [Piece(s, s.done_rows, 1) for s in row_steps]
            if chunk_steps:
                share = self._chunk_rows(self.budget - len(pieces), len(pieces), rows, now, cost)
                pieces += _fair_shares(chunk_steps, max(share, len(chunk_steps)))
        elif take_rows:
            pieces = [Piece(s, s.done_rows, 1) for s in rows[: min(self.budget, self.max_sessions)]]
        elif chunks:
            # One chunk per tick: its captured rows are the whole batch, in order.
            s = min(chunks, key=lambda c: (c.last_chunk_tick, c.arrival))
            # Waiting row steps run in the next tick: this one must leave them time for it.
            share = self._chunk_rows(min(s.remaining, self.budget), 0, rows, now, cost, after=len(rows))
            pieces = [Piece(s, s.done_rows, max(1, min(s.remaining, share)))]
        for p in pieces:
            if p.count < p.step.remaining:  # served, not finished: back of the queue
                p.step.waiting_since = self._ticks + 1
            if p.step.remaining > 1:
                p.step.last_chunk_tick = self._ticks
        self._ticks += 1
        self._last_was_rows = take_rows
        pieces.sort(key=lambda p: p.step.seq)
        return pieces

    def head_group(self, pending: Iterable[Step]) -> int | None:
        """The batch group the next tick will hold (None: nothing pending): the scheduler
        gathers that group's sessions before the tick."""
        steps = self._in_order(pending)
        return steps[0].group if steps else None

    def _in_order(self, pending: Iterable[Step]) -> list[Step]:
        """The steps with rows left, in waiting order (rule 1)."""
        steps = [s for s in pending if s.remaining > 0]
        for s in steps:
            if s.waiting_since is None:
                s.waiting_since = self._ticks
        steps.sort(key=lambda s: (s.waiting_since, s.arrival))
        return steps

    def _chunk_rows(
        self,
        limit: int,
        rows_in_tick: int,
        row_steps: list[Step],
        now: float | None,
        cost: TickCost | None,
        *,
        after: int = 0,
    ) -> int:
        """Prompt rows this tick may hold: ``limit``, cut so that the tick (``rows_in_tick`` rows
        besides the prompt rows; then a tick of ``after`` rows) ends within ``DEADLINE_SHARE`` of
        the time left to the nearest deadline of a waiting row step (rule 3)."""
        if now is None or cost is None:
            return limit
        slack = min((s.deadline - now for s in row_steps if s.deadline > now), default=math.inf)
        allowed = slack * DEADLINE_SHARE
        if after:
            allowed -= cost.estimate(after) or 0.0
        if self._expected is not None:  # a step that arrives now waits for this tick, then its own
            allowed = min(allowed, self._expected * DEADLINE_SHARE - (cost.estimate(max(after, 1)) or 0.0))
        if not math.isfinite(allowed):
            return limit
        # The largest prompt share whose tick fits (estimates grow with the rows).
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            estimate = cost.estimate(rows_in_tick + mid)
            if estimate is None:  # nothing measured yet: no basis to cut
                return limit
            if estimate <= allowed:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _fair_shares(chunks: list[Step], rows: int) -> list[Piece]:
    """Split ``rows`` (at least one per step) among ``chunks``: equal shares, a step that needs
    less leaving the rest to the others."""
    pieces = []
    left = rows
    for i, s in enumerate(sorted(chunks, key=lambda c: (c.remaining, c.arrival))):
        count = min(s.remaining, left // (len(chunks) - i))  # >= 1: left >= steps still to serve
        pieces.append(Piece(s, s.done_rows, count))
        left -= count
    return pieces


__all__ = ["DEADLINE_SHARE", "Piece", "Step", "TickCost", "TickPlanner"]
