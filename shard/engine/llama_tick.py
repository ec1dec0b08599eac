"""One tick of the llama.cpp engine: the rows of every session the planner put in it, written
into the batch and evaluated by one ``llama_decode`` in the native thread; then the outputs
(logits, or a non-last shard's captured rows) copied to each session's work, and each
``llama_decode`` status turned into the typed error its sessions get. The grammar masks of the
tick's finished last-shard steps are computed together here, before their works finish
(``ShardEngine._mask_tick``): this thread pays for them, not the event loop per row.

Cancellation inside a running ``llama_decode`` goes through llama.cpp's abort callback, which
ggml polls after every graph node and which aborts only when every session of the tick is
cancelled; ``llama_decode`` then returns 2 and drops the unfinished ubatch. The callback is a
Python function, so every poll takes the GIL and waits for it while another Python thread is
busy, which slows a short step many times over. So it is *armed only for
ticks holding a piece of at least ``abort_min_tokens`` rows of one session* (every prompt chunk
by default, where a step is long and in-step abort matters); a tick of one-row decodes is short
and stops at the next tick.

One of the modules allowed to use ``ctypes`` and ``llama_cpp`` (tests/test_import_boundary.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import llama_cpp.llama_cpp as lc
import numpy as np

from .base import ComputePlan, Slot
from .batching import Piece, Step
from .errors import EngineCancelled, EngineError, EngineFailure, KvCacheFull, StepTimeout
from .llama_ahead import AheadSteps
from .llama_kv import KvCells
from .llama_model import LlamaModel
from .llama_native import LLAMA_TOKEN_NULL, held, native_reason
from .scheduler import Job

log = logging.getLogger("shard.engine.llama")


class AbortedInStep(EngineCancelled):
    """``llama_decode`` returned 2: the abort callback stopped it mid-step (counted by the engine)."""


class TimedOutInStep(StepTimeout):
    """``llama_decode`` returned 2 because the step's own timeout set the flag mid-step: a step
    timeout (``DEADLINE_EXCEEDED``/``STEP_TIMEOUT`` on the wire), not a cancel (counted too)."""


class Work(Job):
    """A job plus the rows a non-last shard captures for it (or, for an ``all_logits`` step on
    the last shard, every row's logits), filled tick by tick."""

    def __init__(
        self, slot: Slot, plan: ComputePlan, step: Step, submitted: float,
        hidden_out: np.ndarray | None, logits_out: np.ndarray | None = None,
    ) -> None:
        super().__init__(slot, plan, step, submitted)
        self.hidden_out = hidden_out
        self.logits_out = logits_out


def decode_error(rc: int, slot: Slot, n_sessions: int) -> EngineError:
    """The error a session of a failed tick gets for ``llama_decode``'s status ``rc``."""
    sid = slot.session_id
    if rc == 2:
        if slot.cancel.timed_out:  # why the flag is set decides what the step failed with
            return TimedOutInStep("the step timeout passed inside a llama.cpp step", session_id=sid)
        if slot.cancel.is_set():
            return AbortedInStep("operation cancelled inside a llama.cpp step", session_id=sid)
        return EngineFailure("llama_decode aborted without a cancel request")
    if rc == 1:
        shared = f" (in a step shared by {n_sessions} sessions)" if n_sessions > 1 else ""
        return KvCacheFull(f"llama.cpp found no KV slot for session {sid!r}{shared}", session_id=sid)
    return EngineFailure(f"llama_decode failed with status {rc}{native_reason()}")


class Ticks:
    """Runs the planner's ticks on ``model``'s context (native thread only)."""

    def __init__(self, model: LlamaModel, kv: KvCells, ahead: AheadSteps,
                 counters: dict[str, int], *, abort_min_tokens: int,
                 mask_tick: Callable[[Sequence[tuple[Slot, ComputePlan]]], None] | None = None
                 ) -> None:
        self.model, self.kv, self.ahead = model, kv, ahead
        self.counters = counters
        self.abort_min_tokens = abort_min_tokens
        #: The grammar masks of a tick's finished steps, computed together here, before
        #: their callers are woken (``ShardEngine._mask_tick``).
        self.mask_tick = mask_tick
        self.hidden: np.ndarray | None = None  # non-last: captured rows of one tick

    def opened(self) -> None:
        """The model was loaded: size the capture buffer of a non-last shard."""
        m = self.model
        self.hidden = None if m.last else np.empty((m.n_batch, m.n_embd), dtype=np.float32)

    def closed(self) -> None:
        self.hidden = None

    def run_sync(self, tick: list[tuple[Work, Piece]]) -> float:
        """One ``llama_decode`` holding every piece of ``tick``; results and errors go to the
        works (never raised: one session's failure must not hide the others' outcome). Returns
        the seconds spent inside ``llama_decode``. A finished step whose caller asked for a
        look-ahead gets its next step queued (run by the look-ahead once this returns)."""
        m = self.model
        ctx = m.ctx
        assert ctx is not None and m.rows is not None
        self.ahead.last_rows = []
        native = 0.0
        try:
            live: list[tuple[Work, Piece]] = []
            for work, piece in tick:
                if not work.started:
                    try:
                        self._start(work)
                    except EngineError as exc:
                        work.finish(error=exc)
                        continue
                live.append((work, piece))
            if not live:
                return native
            n = m.rows.fill(live)
            # Armed for prompt chunks only: a tick of one-row decodes is short, and every poll
            # takes the GIL (see the module docs).
            abort = m.abort
            abort.arm(ctx, max(p.count for _, p in live) >= self.abort_min_tokens)
            boundary = m.boundary
            hidden = self.hidden
            target = None if boundary is None else boundary.begin(hidden[:n])
            abort.decoding = tuple(w.slot.cancel for w, _ in live)
            started = time.perf_counter()
            try:
                rc = lc.llama_decode(ctx, m.batch)
                self.kv.decoded(rc)
            finally:
                native = time.perf_counter() - started
                abort.decoding = ()
                if boundary is not None:
                    boundary.end()
            if rc != 0:
                for work, _ in live:
                    work.finish(error=decode_error(rc, work.slot, len(live)))
                return native
            if target is not None:
                try:
                    target.check(n)
                except EngineFailure as error:
                    for work, _ in live:
                        work.finish(error=error)
                    return native
            row = 0
            done: list[tuple[Work, np.ndarray]] = []  # last-shard steps this tick finished
            for work, piece in live:
                step = work.step
                step.done_rows += piece.count
                if work.hidden_out is not None:
                    assert hidden is not None
                    work.hidden_out[piece.start : piece.start + piece.count] = hidden[row : row + piece.count]
                row += piece.count
                if work.logits_out is not None and not self._copy_logits(work, piece, row - piece.count):
                    continue
                if not piece.completes:
                    continue
                if work.hidden_out is not None:
                    work.finish(result=work.hidden_out)
                    continue
                if work.logits_out is not None:
                    work.finish(result=work.logits_out)
                    continue
                logits = self._logits(work, row - 1)
                if logits is not None:
                    done.append((work, logits))
            if done and self.mask_tick is not None:
                self.mask_tick([(work.slot, work.plan) for work, _ in done])
            for work, logits in done:
                self._finish_logits(work, logits)
        except Exception as exc:  # noqa: BLE001 - handed to every waiting work; the base class fails the engine
            for work, _ in tick:
                if not work.finished:
                    work.finish(error=exc)
        finally:
            self.kv.commit([work.slot.seq_id for work, _ in tick])
        return native

    def _start(self, work: Work) -> None:
        """Before a compute's first rows: drop its sequence's cells from ``keep`` on and check.

        A plan that starts from the prefix cache (``copy_from``) first takes the entry's whole
        stream: llama.cpp copies between streams only whole (a partial range asserts) and
        performs the copy at the next ``llama_decode``, this tick's, before it writes a row,
        so nothing can read or overwrite the stream in between. Then the tail past ``keep``."""
        slot, keep, mem = work.slot, work.plan.keep, self.model.mem
        work.start()
        cut = self.ahead.drop_sync(slot.seq_id, keep)
        source = work.plan.copy_from
        if source is not None:
            lc.llama_memory_seq_cp(mem, source, slot.seq_id, -1, -1)
            cut = keep
        if not held.llama_memory_seq_rm(mem, slot.seq_id, cut, -1):
            raise EngineFailure(f"llama.cpp could not truncate the KV cache of {slot.session_id!r}")
        # llama_decode itself rejects a gap only when the sequence still holds cells; an emptied
        # sequence would silently compute from position ``keep`` without history.
        n_held = int(held.llama_memory_seq_pos_max(mem, slot.seq_id)) + 1
        if n_held != keep:
            raise EngineFailure(f"the KV cache of {slot.session_id!r} holds {n_held} positions, the session {keep}")

    def _copy_logits(self, work: Work, piece: Piece, row: int) -> bool:
        """Copy the logits of batch rows ``row..`` into an ``all_logits`` work's result (False,
        and the work failed, when llama.cpp has none)."""
        assert work.logits_out is not None
        ctx, n_vocab = self.model.ctx, self.model.n_vocab
        for i in range(piece.count):
            ptr = held.llama_get_logits_ith(ctx, row + i)
            if not ptr:
                work.finish(error=EngineFailure("llama.cpp returned no logits for a position"))
                return False
            work.logits_out[piece.start + i] = np.ctypeslib.as_array(ptr, shape=(n_vocab,))
        return True

    def _logits(self, work: Work, row: int) -> np.ndarray | None:
        """A copy of the logits of batch row ``row`` (None, and the work failed, when
        llama.cpp has none)."""
        ptr = held.llama_get_logits_ith(self.model.ctx, row)
        if not ptr:
            work.finish(error=EngineFailure("llama.cpp returned no logits for the last position"))
            return None
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).copy()

    def _finish_logits(self, work: Work, logits: np.ndarray) -> None:
        """Finish a completed last-shard step with its ``logits``, and queue the step after it
        when its caller asked for a look-ahead."""
        work.finish(result=logits)
        plan = work.plan
        if plan.lookahead is not None and plan.tokens is not None:
            end = plan.keep + plan.n_new
            ahead = self.ahead
            token = ahead.next_step(logits, plan.lookahead, end)
            if token is not None:
                ahead.book.propose(work.slot.seq_id, end, token)

    def warm_up_sync(self) -> None:
        """Run a short prompt chunk and a one-row step on sequence 0 before the engine reports
        READY, then free their cells; the state sizes after each teach ``KvCells`` what one
        position's state takes. Why: llama.cpp's first steps on a fresh context are several
        times slower (the compute graph of each batch shape built and allocated, weights
        touched for the first time), so a short step timeout failed a worker's first real step.
        A failed warm-up is logged, never fatal (the first real step then pays, as before)."""
        m, counters = self.model, self.counters
        assert m.rows is not None
        bos = int(lc.llama_vocab_bos(m.vocab))
        token = bos if bos != LLAMA_TOKEN_NULL else 0
        chunk = min(8, m.n_batch)
        sizes: list[int] = []  # one sequence's state size after each step (moving sessions)
        try:
            for start, count in ((0, chunk), (chunk, 1)):
                m.rows.fill_run(start, count, token)
                started = time.perf_counter()
                rc = lc.llama_decode(m.ctx, m.batch)
                counters["warmup_us_total"] += int((time.perf_counter() - started) * 1e6)
                counters["warmup_steps_total"] += 1
                if rc != 0:
                    log.warning("warm-up step failed (llama_decode returned %d)%s: the first "
                                "real step builds its graph instead", rc, native_reason())
                    break
                sizes.append(self.kv.state_size(0))
            self.kv.learn(sizes, chunk)  # positions 0..7, then 0..8: one more position, and the rest
        finally:
            held.llama_memory_seq_rm(m.mem, 0, -1, -1)


__all__ = ["AbortedInStep", "Ticks", "TimedOutInStep", "Work", "decode_error"]
