"""Running one operation on a session: RUNNING while it runs, the cancel flag, the step's
deadline, counted outcomes, and the rollback of a step that did not commit.

Why one owner: these rules are what makes a cancelled, timed-out or failed step leave its
session exactly as it was, on every engine and for every kind of operation (a step, a stream,
a truncate or a hand-off). ``ShardEngine`` owns one runner, which reaches the implementation
only through its hooks (``StepHooks``).

This is the path of every generated token: a step adds no task, nursery or cancel scope unless
it needs one (a step timeout, an implementation that does not stop by itself).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
import outcome
import trio

from . import sampling
from .errors import EngineCancelled, EngineError, EngineFailure
from .plans import ComputePlan, StreamRun
from .sessions import SessionTable
from .slots import Claimed, Slot, known_choice
from .status import EngineStatus
from .types import Capabilities, EngineState, SamplingParams, SessionState, StepResult

if TYPE_CHECKING:
    from .scheduler import BatchScheduler, Job

log = logging.getLogger(__name__)
T = TypeVar("T")


class StepHooks(Protocol):
    """The hooks a runner calls (``ShardEngine``'s, looked up on each call so that an
    implementation's or a test's override counts; ``EngineHooks`` documents them)."""

    _compute_stops_itself: bool

    async def _impl_claim(self, slot: Slot, plan: ComputePlan) -> Claimed | None: ...

    async def _impl_compute(self, slot: Slot, plan: ComputePlan) -> np.ndarray: ...

    async def _impl_truncate(self, slot: Slot, keep: int) -> None: ...

    def _impl_group_raw(self, job: Job) -> np.ndarray: ...

    def _make_result(self, slot: Slot, caps: Capabilities, plan: ComputePlan, raw: np.ndarray,
                     params: SamplingParams, top_k: int, reused: int, counter: str,
                     chosen: tuple[int, float] | None = None) -> StepResult: ...


class OperationRunner:
    """Runs the engine's operations on its sessions (one at a time per session)."""

    __slots__ = ("_hooks", "_status", "_sessions")

    def __init__(self, hooks: StepHooks, status: EngineStatus, sessions: SessionTable) -> None:
        self._hooks, self._status, self._sessions = hooks, status, sessions

    def fail(self, detail: str) -> None:
        """Turn the engine FAILED (first failure wins) and stop every running operation."""
        if self._status.fail(detail):
            self._sessions.stop_all()

    async def guard(self, awaitable: Awaitable[T]) -> T:
        """Turn unexpected implementation exceptions into EngineFailure + FAILED health."""
        try:
            return await awaitable
        except EngineFailure as exc:
            self.fail(exc.message)
            raise
        except (EngineError, trio.Cancelled):
            raise
        except Exception as exc:
            log.exception("engine implementation fault")
            self.fail(f"{type(exc).__name__} in engine")
            raise EngineFailure(f"engine fault: {type(exc).__name__}") from exc

    async def exclusive(self, slot: Slot, hook: Awaitable[T]) -> T:
        """A short, shielded hook (truncate, export, import) with the session marked RUNNING,
        so no other operation starts on it meanwhile."""
        slot.state = SessionState.RUNNING
        slot.idle = trio.Event()
        try:
            with trio.CancelScope(shield=True):
                return await self.guard(hook)
        finally:
            slot.state = SessionState.IDLE
            slot.idle.set()

    async def step(self, slot: Slot, caps: Capabilities, plan: ComputePlan,
                   params: SamplingParams, top_k: int, reused: int, counter: str, *,
                   begun: bool = False) -> StepResult:
        """Run one step (a prefill or decode) with the session marked RUNNING; roll back on
        any failure.

        A step that its timeout stopped after the result was computed still commits: the
        timeout bounds the wait for a result, and throwing a finished one away would only make
        the next step redo it.
        """
        hooks = self._hooks

        async def work() -> StepResult:
            claimed = await self.claim(slot, plan)
            raw, chosen = (None, None) if claimed is None else (claimed.raw, known_choice(claimed.chosen, params))
            if raw is None:
                if hooks._compute_stops_itself and plan.deadline == math.inf and plan.n_new == 1:
                    # (one row: a prompt's chunks keep the watching task, whose flag stops
                    # a running chunk at once through the abort callback)
                    raw = await self.guard(hooks._impl_compute(slot, plan))
                else:
                    raw = await self.run_guarded(
                        slot, lambda: hooks._impl_compute(slot, plan), plan.deadline)
            if slot.cancel.is_set() and not slot.cancel.timed_out:
                raise slot.cancel.error(slot.session_id)
            return hooks._make_result(slot, caps, plan, raw, params, top_k, reused, counter, chosen)

        return await self.running(slot, plan.keep, work, begun=begun)

    async def group(self, rows: Sequence[GroupRow], scheduler: BatchScheduler) -> None:
        """Run one-row steps of many sessions as one submission (``ShardEngine.decode_group``):
        each row as ``step`` runs it (RUNNING while it runs, its flag, its deadline, counted,
        rolled back alone when it fails), but every row's job is queued at once and this task
        waits once for all of them (``BatchScheduler.compute_group``). Each row's outcome
        (result or ``EngineError``) is set on it; a caller's cancellation stops every row not
        computed (rolled back) and is raised once all of them stopped. The caller marked each
        row's session RUNNING (``begin_operation``) with no checkpoint since."""
        hooks = self._hooks
        try:
            await scheduler.compute_group([row.job for row in rows])
        except BaseException as exc:
            cancelled = _is_cancellation(exc)
            for row in rows:
                if cancelled:
                    self._status.counters["cancelled_total"] += 1
                await self._end(row.slot, row.plan.keep, False)
            raise
        choices = _greedy_choices(rows)
        for i, row in enumerate(rows):
            slot, plan, job = row.slot, row.plan, row.job
            committed = False
            try:
                try:
                    raw = hooks._impl_group_raw(job)
                    if slot.cancel.is_set() and not slot.cancel.timed_out:
                        raise slot.cancel.error(slot.session_id)
                    chosen = choices[i] if raw is job.result else None
                    row.result = hooks._make_result(slot, row.caps, plan, raw, row.params, row.top_k,
                                                    0, "decode_tokens_total", chosen)
                except (EngineError, trio.Cancelled, BaseExceptionGroup):
                    raise
                except Exception as exc:  # a hook (piece, is_eog) or the result check misbehaved
                    log.exception("engine implementation fault while building a result")
                    raise EngineFailure(f"engine fault: {type(exc).__name__}") from exc
                committed = True
            except EngineError as exc:
                row.error = self._counted(exc)
            finally:
                if committed or not slot.touched:  # nothing to roll back: no coroutine per row
                    _idle(slot)
                else:
                    await self._end(slot, plan.keep, committed)

    def _counted(self, exc: EngineError) -> EngineError:
        """A failed operation's error, counted (``running``'s rules): a cancellation that the
        engine's failure caused is that failure."""
        status = self._status
        counters = status.counters
        if isinstance(exc, EngineCancelled):
            if status.state is EngineState.FAILED:
                counters["errors_total"] += 1
                return EngineFailure(f"engine failed: {status.detail}")
            counters["cancelled_total"] += 1
        elif isinstance(exc, EngineFailure):
            self.fail(exc.message)
            counters["errors_total"] += 1
        else:
            counters["errors_total"] += 1
        return exc

    async def _end(self, slot: Slot, keep: int | None, committed: bool) -> None:
        """An operation on ``slot`` ended: rolled back to ``keep`` unless ``committed`` (see
        ``running``), and IDLE again."""
        try:
            if not committed and slot.touched:
                with trio.CancelScope(shield=True):
                    slot.cut(slot.n_past if keep is None else min(slot.n_past, keep))
                    if self._status.state is EngineState.READY:
                        try:
                            await self.guard(self._hooks._impl_truncate(slot, slot.n_past))
                        except EngineError:
                            log.warning("rollback of session %s failed", slot.session_id)
        finally:  # never leave a session RUNNING, whatever the rollback raised (``_idle``)
            slot.touched = False
            slot.state = SessionState.IDLE
            slot.idle.set()

    async def running(self, slot: Slot, keep: int | None, work: Callable[[], Awaitable[T]], *,
                      begun: bool = False) -> T:
        """``work()`` with the session marked RUNNING, counted, and rolled back on failure to
        ``keep`` (None: to what the session holds committed, ``slot.n_past``; a stream commits
        step by step). Shared by single steps (``step``) and streams.

        A caller whose scope is already cancelled gets ``trio.Cancelled`` before anything is
        touched (a step whose cancel arrived first never starts). ``begun``: the caller marked
        the session RUNNING already (``begin_operation``, a group's row), so a ``cancel`` since
        then is kept and stops the step.
        """
        if not begun:
            await trio.lowlevel.checkpoint_if_cancelled()
            begin_operation(slot)
        committed = False
        status = self._status
        counters = status.counters
        try:
            try:
                out = await work()
            except (EngineError, trio.Cancelled, BaseExceptionGroup):
                raise
            except Exception as exc:  # a hook (piece, is_eog) or the result check misbehaved
                log.exception("engine implementation fault while building a result")
                raise EngineFailure(f"engine fault: {type(exc).__name__}") from exc
            committed = keep is not None
            return out
        except EngineCancelled:
            if status.state is EngineState.FAILED:
                # Stopped because the engine failed under it (see fail), not by a caller.
                counters["errors_total"] += 1
                raise EngineFailure(f"engine failed: {status.detail}") from None
            counters["cancelled_total"] += 1
            raise
        except EngineFailure as exc:
            self.fail(exc.message)
            counters["errors_total"] += 1
            raise
        except EngineError:
            counters["errors_total"] += 1
            raise
        except BaseException as exc:
            # The caller's scope stopped the operation (an RPC Cancel, a client reset, a
            # deadline): a cancellation too, though it reaches us as trio.Cancelled (possibly
            # inside the exception group of run_guarded's nursery).
            if _is_cancellation(exc):
                counters["cancelled_total"] += 1
            raise
        finally:
            # Leave the session exactly as it was up to ``keep``. (Untouched: as it was.)
            await self._end(slot, keep, committed)

    async def claim(self, slot: Slot, plan: ComputePlan) -> Claimed | None:
        """``_impl_claim`` within the step's deadline (past it: ``StepTimeout``)."""
        if plan.deadline == math.inf:  # no step timeout: no cancel scope per token
            return await self.guard(self._hooks._impl_claim(slot, plan))
        with trio.move_on_at(plan.deadline):
            return await self.guard(self._hooks._impl_claim(slot, plan))
        slot.cancel.set_timeout()
        raise slot.cancel.error(slot.session_id)

    async def run_guarded(
        self, slot: Slot, fn: Callable[[], Awaitable[T]], deadline: float = math.inf
    ) -> T:
        """Run ``fn`` shielded; a cancellation of the caller sets the slot's cancel flag, and so
        does ``deadline`` (reason TIMEOUT).

        The engine work is never abandoned: if the caller's scope is cancelled, the work is told
        to stop (flag) and waited for, then ``trio.Cancelled`` propagates to the caller.
        """
        box: list[outcome.Outcome] = []
        done = trio.Event()
        async with trio.open_nursery() as nursery:

            async def worker() -> None:
                with trio.CancelScope(shield=True):
                    box.append(await outcome.acapture(self.guard, fn()))
                done.set()

            nursery.start_soon(worker)
            # An event, not the nursery's cancellation, ends the wait: no Cancelled is raised
            # and caught per step, and the deadline needs no task of its own.
            try:
                if math.isfinite(deadline):
                    with trio.move_on_at(deadline):
                        await done.wait()
                    if not done.is_set():
                        slot.cancel.set_timeout()
                await done.wait()
            except trio.Cancelled:
                if not box:
                    slot.cancel.set()
                raise  # once the shielded work is done: the nursery waits for it
        return box[0].unwrap()

    async def stream_steps(self, slot: Slot, run: StreamRun) -> None:
        """The default ``_impl_stream``: each step of ``run`` in the caller's task, as a
        decode runs it (claimed if computed ahead, else computed), until the run ends."""
        hooks = self._hooks
        plan = run.plan
        while plan is not None:
            claimed = await self.claim(slot, plan)
            if claimed is not None:
                if slot.cancel.is_set():
                    return
                plan = run.step(claimed.raw, claimed.chosen)
                continue
            if hooks._compute_stops_itself:
                raw = await self.guard(hooks._impl_compute(slot, plan))
            else:
                step_plan = plan
                raw = await self.run_guarded(slot, lambda: hooks._impl_compute(slot, step_plan))
            if slot.cancel.is_set():
                return
            plan = run.step(raw)


class GroupRow:
    """One row of ``OperationRunner.group``: a one-row step of its session, its scheduler job,
    and (once the group ran) its outcome."""

    __slots__ = ("slot", "caps", "plan", "params", "top_k", "job", "result", "error")

    def __init__(self, slot: Slot, caps: Capabilities, plan: ComputePlan, params: SamplingParams,
                 top_k: int, job: Job) -> None:
        self.slot, self.caps, self.plan, self.params, self.top_k, self.job = (
            slot, caps, plan, params, top_k, job)
        self.result: StepResult | None = None
        self.error: EngineError | None = None


def _greedy_choices(rows: Sequence[GroupRow]) -> list[tuple[int, float] | None]:
    """The token and log-sum-exp of every finished plain greedy row of a group's logits, for
    all of them at once (``sampling.greedy_rows``: bit for bit what each row's own
    ``choose_token`` and ``logsumexp`` give), so that each result is built without its own
    passes over the vocabulary (``ShardEngine._make_result``'s ``chosen``). None for a row
    that gets no such choice (hidden states, another sampler, a grammar, not finite): its
    result is built as a decode's is."""
    choices: list[tuple[int, float] | None] = [None] * len(rows)
    picked, block = [], []
    plain: dict[int, bool] = {}  # by the id of a row's sampling (rows mostly share one)
    f32 = np.dtype(np.float32)
    for i, row in enumerate(rows):
        job, params, caps = row.job, row.params, row.caps
        raw = job.result
        if (ok := plain.get(id(params))) is None:
            ok = plain[id(params)] = params.plain_greedy and params.grammar is None
        if (ok and job.error is None and not row.plan.all_logits and isinstance(raw, np.ndarray)
                and raw.dtype == f32 and raw.size == caps.n_vocab and caps.is_last):
            picked.append(i)
            block.append(raw.reshape(-1))
    if len(picked) < 2:  # (one row: nothing shared)
        return choices
    tokens, lses, finite = sampling.greedy_rows(np.stack(block))
    for i, token, lse, ok in zip(picked, tokens, lses, finite):
        if ok:
            choices[i] = (token, lse)
    return choices


def _idle(slot: Slot) -> None:
    """An operation on ``slot`` ended (committed, or rolled back): IDLE again (``_end``'s
    last part, for a group's committed rows)."""
    slot.touched = False
    slot.state = SessionState.IDLE
    slot.idle.set()


def begin_operation(slot: Slot) -> None:
    """An operation starts on ``slot``: RUNNING, its flag cleared."""
    slot.state = SessionState.RUNNING
    slot.cancel.clear()
    slot.touched = False
    slot.idle = trio.Event()


def _is_cancellation(exc: BaseException) -> bool:
    """``trio.Cancelled``, alone or as the only kind of exception in a group."""
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(trio.Cancelled)
        return rest is None
    return isinstance(exc, trio.Cancelled)
