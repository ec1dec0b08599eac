"""Continuous batching at run time: the leader that runs ticks for every waiting session.

Why a module of its own: who runs the native steps, when sessions are woken, how a cancelled or
timed-out step leaves the queue and how long a tick may take are the same for every engine that
batches; the engine only says how to run one tick (``TickRunner``). ``shard.engine.llama`` runs
a tick as one ``llama_decode`` in a worker thread; ``shard.engine.fake`` (batched mode) as a
scripted delay. The policy of *which* rows go into a tick is ``shard.engine.batching``.

No background task: a compute is submitted to a pending list; the first caller that finds no
leader becomes one and runs ticks (``run_tick``) for every pending compute until its own is
done, wakes the sessions each tick finished, then wakes the oldest waiter, which takes over.
A leader runs each tick shielded, so it is never abandoned mid-tick; a caller cancelled while it
waits or gathers stops its own job (``compute``).

Cancellation and timeouts: a job whose cancel flag is set (Cancel, release, a caller's
cancellation, its step timeout) leaves the queue at once when it is not inside the running
tick (its task is woken by the flag itself), and otherwise when that tick ends: a stopped step
waits for at most one tick. Only a job that had already started (rows of it were computed in
earlier ticks) then needs its rollback, which waits for the running tick like any native call.

Deadlines: each job may carry a deadline (``ComputePlan.deadline``, Trio clock). The planner
cuts a tick's prompt rows so that the tick is estimated to end in time for the nearest deadline
of a waiting decode, and for the shortest step timeout of a session that recently submitted
timed steps and may submit again while the tick runs; the estimate comes from the ticks
measured so far (``LearnedTickCost``).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from .batching import Piece, Step, TickPlanner
from .plans import ComputePlan
from .slots import Slot
from .tick_stats import TickStats

#: Scheduling rounds a leader yields before a tick so that woken sessions can resubmit ...
MAX_GATHER_ROUNDS = 16
#: ... and the longest it then waits for them in seconds, however long the last tick took: a
#: session resubmits within milliseconds or not soon (its prompt is done and its client is
#: elsewhere), and after a prompt chunk of seconds, a quarter of that tick would hold everyone.
MAX_GATHER_SECONDS = 0.02
#: A session that submitted a step with a timeout this recently (seconds) may submit its next
#: one at any moment: ticks are sized so that it would not wait longer than its timeout allows.
TIMED_SESSION_IDLE = 0.5


@dataclass(eq=False)
class Job:
    """One session's compute waiting for (or inside) ticks.

    Written by the tick (possibly in a worker thread) only while the leader awaits that tick;
    read by the waiting task after the leader woke it, so no lock is needed.
    """

    slot: Slot
    plan: ComputePlan
    step: Step
    submitted: float
    wake: trio.Event = field(default_factory=trio.Event)
    started: bool = False  # rows of it were computed (the KV cache was cut to ``keep``)
    finished: bool = False
    result: Any = None
    error: BaseException | None = None
    #: A stream's (``BatchScheduler.stream``): called once the job finished, gives the job of
    #: the run's next step (None: the run ends); ``run`` says which job the run is at.
    follow: Callable[[Job], Job | None] | None = None
    run: _Run | None = None

    def start(self) -> None:
        """Called by the tick right before the job's first rows change the KV cache."""
        self.started = True
        self.slot.touch()

    def finish(self, *, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error, self.finished = result, error, True


TickRunner = Callable[[list[tuple[Job, Piece]]], Awaitable[None]]


class LearnedTickCost:
    """A tick's expected duration, ``fixed + per_row * rows``, learned from measured ticks.

    ``fixed`` comes from ticks without prompt rows (decodes: the cost of streaming the weights
    once), ``per_row`` from ticks with prompt rows (their time beyond ``fixed``, per row). Both
    are moving averages, so they follow a prompt whose rows grow dearer with its position.
    Until a prompt tick was measured, a prompt row is guessed at a quarter of ``fixed``
    (cautious: a decode tick on a CPU is roughly as long as 4-8 prompt rows).
    """

    ALPHA = 0.3

    def __init__(self) -> None:
        self.fixed: float | None = None
        self.per_row: float | None = None

    def observe(self, rows: int, prompt_rows: int, seconds: float) -> None:
        if prompt_rows == 0:
            self.fixed = _ewma(self.fixed, seconds, self.ALPHA)
        else:
            marginal = max(seconds - (self.fixed or 0.0), 0.0) / prompt_rows
            self.per_row = _ewma(self.per_row, marginal, self.ALPHA)

    def estimate(self, rows: int) -> float | None:
        if self.fixed is None and self.per_row is None:
            return None
        fixed = self.fixed or 0.0
        per_row = self.per_row if self.per_row is not None else fixed / 4
        return fixed + per_row * rows


def _ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


class BatchScheduler:
    """Runs ticks for the jobs of every session (see the module docs).

    ``counters`` is the engine's counter table (``batch_queue_wait_us_total`` is added to it);
    ``stats`` counts every tick (``batch_ticks_total`` ..., the per-tick distributions);
    ``is_open(slot)`` tells whether a session still exists (the leader does not wait for a
    released one to resubmit).
    """

    def __init__(
        self,
        planner: TickPlanner,
        run_tick: TickRunner,
        *,
        counters: dict[str, int],
        stats: TickStats,
        is_open: Callable[[Slot], bool],
    ) -> None:
        self.planner = planner
        self.cost = LearnedTickCost()
        self._run_tick = run_tick
        self._counters = counters
        self.stats = stats
        self._is_open = is_open
        self._pending: list[Job] = []
        self._running: set[Job] = set()  # the jobs of the tick being run
        self._leading = False
        self._arrivals = 0
        self._submitted = trio.Event()  # set (and replaced) whenever a job is submitted
        # Sessions seen in recent ticks, and when; the ends of each batch group's last two
        # ticks (see _let_submitters_in).
        self._recent: dict[int, tuple[Slot, float]] = {}
        self._group_ticks: dict[int, tuple[float, ...]] = {}
        # Sessions that submitted steps with a timeout: (slot, timeout, when), see _expected.
        self._timed: dict[int, tuple[Slot, float, float]] = {}
        self.tick_seconds = 0.0  # duration of the last tick
        # The last tick's sessions and its end: the next tick's gap is idle time (a bubble)
        # when one of them is still open then (shard.engine.tick_stats).
        self._last_slots: list[Slot] = []
        self._last_end = 0.0

    def has_waiting(self) -> bool:
        """Whether a submitted job waits for a tick. Also read from an engine's native thread,
        where it is a hint (a copy of the list is taken under the GIL)."""
        return any(not job.finished for job in list(self._pending))

    def new_step(self, slot: Slot, plan: ComputePlan) -> Step:
        self._arrivals += 1
        return Step(slot.seq_id, plan.n_new, self._arrivals, deadline=plan.deadline,
                    group=slot.batch_group)

    async def compute(self, job: Job) -> None:
        """Queue ``job`` and return once it is finished (result or error set).

        A caller cancelled meanwhile (its deadline, a reset) sets the job's cancel flag and
        waits, shielded, until the job has left the queue or its tick ended; then
        ``trio.Cancelled`` propagates. So a step is never abandoned with a tick computing it,
        and no task of its own is needed to watch the caller (``OperationRunner.step``, shard/engine/operations.py)."""
        now = trio.current_time()
        if job.plan.deadline < math.inf:
            self._timed[id(job.slot)] = (job.slot, job.plan.deadline - now, now)
        self._pending.append(job)
        self._submitted.set()
        self._submitted = trio.Event()
        try:
            await self._wait(job)
            # Cancelled while its last tick ran (shielded): the caller gets no result.
            await trio.lowlevel.checkpoint_if_cancelled()
        except trio.Cancelled:
            # (a stream's last job may be finished and still wait for its follow-up pass)
            if (job.follow is not None or not _last(job).finished) and not job.slot.cancel.is_set():
                job.slot.cancel.set()
            with trio.CancelScope(shield=True):
                await self._wait(job)
            raise

    async def compute_group(self, jobs: Sequence[Job]) -> None:
        """``compute`` for the rows of a group (``ShardEngine.decode_group``): every job is
        queued at once and the caller waits once for all of them (one wake-up per tick that
        finished some, not one per job). Each job keeps its own outcome: its flag (its
        session's Cancel or release) or its deadline takes it out of the queue alone, as
        ``compute`` would. The caller's cancellation sets the flag of every job not finished
        and waits, shielded, as ``compute`` does."""
        now = trio.current_time()
        for job in jobs:
            if job.plan.deadline < math.inf:
                self._timed[id(job.slot)] = (job.slot, job.plan.deadline - now, now)
        self._pending.extend(jobs)
        self._submitted.set()
        self._submitted = trio.Event()
        try:
            await self._wait_group(jobs)
            await trio.lowlevel.checkpoint_if_cancelled()
        except trio.Cancelled:
            for job in jobs:
                if not job.finished and not job.slot.cancel.is_set():
                    job.slot.cancel.set()
            with trio.CancelScope(shield=True):
                await self._wait_group(jobs)
            raise

    async def _wait_group(self, jobs: Sequence[Job]) -> None:
        """``_wait`` for many jobs: one shared wake event, watched by every job's flag; the
        earliest deadline of a job not finished bounds each wait (past it, its flag is set as
        the per-step timer would: ``OperationRunner.run_guarded``)."""
        try:
            while left := [job for job in jobs if not job.finished]:
                if not self._leading:
                    await self._lead(left[0], jobs)
                    continue
                for job in left:
                    if job.slot.cancel.is_set() and job not in self._running:
                        self._drop(job)  # stopped while it waited: no need to wait for a tick
                if not (left := [job for job in left if not job.finished]):
                    break
                wake = trio.Event()
                watched = []
                deadline = math.inf
                for job in left:
                    job.wake = wake
                    flag = job.slot.cancel
                    if not flag.is_set():
                        flag.add_watcher(wake)
                        watched.append(flag)
                        deadline = min(deadline, job.plan.deadline)
                try:
                    with trio.move_on_at(deadline):
                        await wake.wait()
                finally:
                    for flag in watched:
                        flag.remove_watcher(wake)
                now = trio.current_time()
                if deadline <= now:
                    for job in left:
                        if not job.finished and job.plan.deadline <= now and not job.slot.cancel.is_set():
                            job.slot.cancel.set_timeout()
        finally:
            if not self._leading and self._pending:
                self._pending[0].wake.set()  # someone must lead the rest

    async def stream(self, job: Job, follow: Callable[[Job], Job | None]) -> Job:
        """``compute`` for a run of steps (``ShardEngine.stream``): each time a tick finishes a
        step of the run, whoever leads calls ``follow(job)`` right after that tick, on the event
        loop, and queues the job it returns at once; None ends the run. The caller's task is
        not woken between steps: a tick of N streaming sessions costs one pass over their
        results, not N task steps. ``follow`` must not raise or await. Returns the run's last
        job (its ``error``, if any, ended the run); cancellation as for ``compute``."""
        job.follow, job.run = follow, _Run(job)
        await self.compute(job)
        return _last(job)

    async def _wait(self, job: Job) -> None:
        flag = job.slot.cancel
        try:
            while not (job := _last(job)).finished:
                if not self._leading:
                    await self._lead(job)
                    continue
                if flag.is_set() and job not in self._running:
                    self._drop(job)  # stopped while it waited: no need to wait for the tick
                    break
                wake = job.wake
                watched = not flag.is_set()
                if watched:
                    flag.add_watcher(wake)
                try:
                    await wake.wait()
                finally:
                    if watched:
                        flag.remove_watcher(wake)
                job.wake = trio.Event()
        finally:
            if not self._leading and self._pending:
                self._pending[0].wake.set()  # someone must lead the rest

    def _drop(self, job: Job) -> None:
        """Finish a stopped job with its flag's error and take it out of the queue."""
        if not job.finished:
            job.finish(error=job.slot.cancel.error(job.slot.session_id))
        if job in self._pending:
            self._pending.remove(job)
        job.wake.set()

    async def _lead(self, mine: Job, also: Sequence[Job] = ()) -> None:
        """Run ticks until ``mine`` (and every job of ``also``) is finished, then hand the
        lead to the oldest waiter."""
        self._leading = True
        try:
            while not _last(mine).finished or any(not job.finished for job in also):
                await trio.lowlevel.checkpoint_if_cancelled()  # between ticks (see compute)
                await self._let_submitters_in()
                tick = self._form_tick()
                if _last(mine).finished and all(job.finished for job in also):
                    break  # dropped: another task leads the rest
                assert tick, "a pending job that is not finished always gets rows"
                started = trio.current_time()
                waited = any(self._is_open(slot) for slot in self._last_slots)
                self._running = {job for job, _ in tick}
                try:
                    with trio.CancelScope(shield=True):  # a tick is never abandoned
                        await self._run_tick(tick)
                finally:
                    self._running = set()
                ended = trio.current_time()
                self.tick_seconds = ended - started
                rows = sum(p.count for _, p in tick)
                prompt_rows = sum(p.count for _, p in tick if p.count > 1 or not p.completes)
                self.cost.observe(rows, prompt_rows, self.tick_seconds)
                for job, _ in tick:
                    self._recent[id(job.slot)] = (job.slot, ended)
                group = tick[0][0].slot.batch_group  # one group per tick (batching, rule 5)
                self._group_ticks[group] = (*self._group_ticks.get(group, ())[-1:], ended)
                self.stats.tick(self.tick_seconds, rows, len(tick),
                                idle=started - self._last_end if waited else None)
                self._last_slots, self._last_end = [job.slot for job, _ in tick], ended
                for job in [j for j in self._pending if j.finished]:
                    self._pending.remove(job)
                    nxt = _follow(job) if job.follow is not None else None
                    if nxt is None:
                        job.wake.set()
                    else:  # a stream's next step, queued in this pass (see stream)
                        self._pending.append(nxt)
        finally:
            self._leading = False
            if self._pending:
                self._pending[0].wake.set()

    async def _let_submitters_in(self) -> None:
        """Wait until every session seen in the last two ticks has submitted its next step: at
        least ``MAX_GATHER_ROUNDS`` scheduling rounds, then on submissions (an event, not a
        poll) until a quarter of the last tick's time (at most ``MAX_GATHER_SECONDS``) passed.

        A woken session needs a few scheduling rounds (and, served over the network, a trip
        through the transport and sometimes a credit grant) to submit its next step; ticking
        before it does runs it one tick later in a smaller batch, and two halves of a group then
        stay out of phase for good, each half running as a small tick. Waiting for the sessions of the last two
        ticks, not only the last one, merges such halves again. A released session is not
        waited for; a lone session is the one resubmitting, so its tick starts at once.

        Only the sessions of the batch group the tick will hold are waited for, and "the last
        two ticks" are that group's: with G groups taking turns, a group last ran G ticks ago,
        and a horizon of the last two ticks of any group would forget its sessions, so each of its
        ticks would start with the first member back and split the group.
        """
        now = trio.current_time()
        for key, (slot, seen) in list(self._recent.items()):
            if seen < self._horizon(slot.batch_group) or not self._is_open(slot):
                del self._recent[key]
        live = {slot.batch_group for slot, _ in self._recent.values()}
        for g in [g for g in self._group_ticks if g not in live]:
            del self._group_ticks[g]  # (a group id is the client's: keep only those in use)
        # Only the sessions of the batch group the tick will hold: another group is elsewhere
        # in a pipeline (a hop further on), and waiting for it would idle this hop and merge
        # the groups (shard.engine.batching, rule 5).
        group = self.planner.head_group(j.step for j in self._pending if not j.finished)
        awaited = [key for key, (slot, _) in self._recent.items() if slot.batch_group == group]
        deadline = now + min(self.tick_seconds / 4, MAX_GATHER_SECONDS)
        rounds = 0
        while True:
            submitted = {id(j.slot) for j in self._pending if not j.finished}
            if all(key in submitted for key in awaited):
                return
            if rounds < MAX_GATHER_ROUNDS:
                rounds += 1
                await trio.lowlevel.checkpoint()
                continue
            if trio.current_time() >= deadline:
                return
            with trio.move_on_at(deadline):
                await self._submitted.wait()

    def _horizon(self, group: int) -> float:
        """Sessions of ``group`` seen before this are no longer awaited. Sessions in no group
        (0): those not in a tick for two ticks' time (a pipeline without groups then splits its
        sessions into small ticks, an accidental micro-batching that serves more than merging
        them would). A batch group:
        the end of the older of the group's last two ticks (less a millisecond), counted in the
        group's ticks, not in time: a split group's two halves tick close together, and a time
        horizon learnt from them would forget them again before the group came back."""
        now = trio.current_time()
        if group == 0:  # no groups: the last two ticks, in time (a single worker's sessions)
            return now - 2 * self.tick_seconds - 0.001
        ends = self._group_ticks.get(group)
        # No limit in time: a slow pipeline's group may be away for seconds, and forgetting it
        # would split it for good. A member that paused is forgotten after two of its group's
        # ticks, each gather waiting for it at most min(tick / 4, MAX_GATHER_SECONDS).
        return ends[0] - 0.001 if ends else math.inf

    def _expected(self, now: float) -> float | None:
        """The shortest step timeout of a session that is not pending but recently submitted
        timed steps (``TIMED_SESSION_IDLE`` seconds, or two ticks): its next step may arrive
        while the next tick runs, and must not wait for a tick longer than its timeout allows."""
        pending = {id(j.slot) for j in self._pending if not j.finished}
        horizon = now - max(TIMED_SESSION_IDLE, 2 * self.tick_seconds)
        shortest = None
        for key, (slot, timeout, seen) in list(self._timed.items()):
            if seen < horizon or not self._is_open(slot):
                del self._timed[key]
            elif key not in pending and (shortest is None or timeout < shortest):
                shortest = timeout
        return shortest

    def _form_tick(self) -> list[tuple[Job, Piece]]:
        """Drop stopped jobs (woken at once with their error), then plan the next tick."""
        now = trio.current_time()
        by_step: dict[Step, Job] = {}
        for job in list(self._pending):
            if job.finished:
                continue
            if job.plan.deadline <= now and not job.slot.cancel.is_set():
                job.slot.cancel.set_timeout()  # its timer has not run yet
            if job.slot.cancel.is_set():
                self._drop(job)
            else:
                by_step[job.step] = job
        tick = [
            (by_step[p.step], p)
            for p in self.planner.plan(by_step, now=now, cost=self.cost, expected_timeout=self._expected(now))
        ]
        for job, _ in tick:
            if not job.started:
                self._counters["batch_queue_wait_us_total"] += int((now - job.submitted) * 1e6)
        return tick


@dataclass(eq=False)
class _Run:
    """Where a stream's run of jobs is: every job of the run points here, so the owner finds
    the current one at once and the jobs it went through are not kept (a chain of them held
    every step's result for as long as the stream ran)."""

    current: Job


def _last(job: Job) -> Job:
    """The job a run of steps is at (a plain job: itself)."""
    return job if job.run is None else job.run.current


def _follow(job: Job) -> Job | None:
    """A finished stream job's next step, made the run's current one (it shares the owner's
    wake)."""
    assert job.follow is not None and job.run is not None
    try:
        nxt = job.follow(job)
    except Exception as exc:  # noqa: BLE001 - a bug of the engine's follow: end the run with it
        if job.error is None:
            job.error = exc
        return None
    if nxt is not None:
        nxt.follow, nxt.wake, nxt.run = job.follow, job.wake, job.run
        job.run.current = nxt
    return nxt


__all__ = [
    "BatchScheduler",
    "Job",
    "LearnedTickCost",
    "MAX_GATHER_ROUNDS",
    "MAX_GATHER_SECONDS",
    "TIMED_SESSION_IDLE",
    "TickRunner",
]
