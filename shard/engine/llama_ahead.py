"""Steps computed ahead on a llama.cpp context (``shard.engine.lookahead``; docs/engine.md,
"Look-ahead and the native thread"): the native thread's background tick that computes them,
how their outcome reaches the event loop, and how a step or a stream claims them.

Between calls the engine's native thread computes, in one ``llama_decode``, the queued next
step of every session that asked for it; it steps aside whenever a call or a tick waits. The
event loop learns the outcome once per native tick (``_on_posted``) and delivers it to the
claims and streams waiting for it, so a stream's task is not woken per token.

One of the modules allowed to use ``ctypes`` and ``llama_cpp`` (tests/test_import_boundary.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import llama_cpp.llama_cpp as lc
import numpy as np
import trio

from . import sampling
from .base import Claimed, ComputePlan, Slot, StreamRun
from .errors import EngineError, EngineFailure
from .llama_kv import KvCells
from .llama_model import LlamaModel
from .llama_native import held
from .lookahead import Ahead, LookaheadBook, LookaheadPlan
from .native_thread import NativeThread
from .scheduler import MAX_GATHER_SECONDS, BatchScheduler

log = logging.getLogger("shard.engine.llama")


class _Chain:
    """A stream's claim on the record of its next step computed ahead (``AheadSteps.follow``)."""

    __slots__ = ("run", "slot", "wake", "rec", "error")

    def __init__(self, run: StreamRun, slot: Slot) -> None:
        self.run, self.slot = run, slot
        self.wake = trio.Event()
        self.rec: Ahead | None = None  # the claimed record it waits for
        self.error: EngineError | None = None


def _ahead_seq(rec: Ahead) -> int:
    return rec.seq


class AheadSteps:
    """The steps computed ahead of ``model``'s sessions, recorded in ``book``.

    ``ready()`` says whether the engine still serves (a failed or closing engine computes
    nothing more); ``trio_token`` (set at load) is how the native thread reaches the event
    loop.
    """

    def __init__(self, model: LlamaModel, book: LookaheadBook, kv: KvCells,
                 scheduler: BatchScheduler, counters: dict[str, int], *,
                 ready: Callable[[], bool]) -> None:
        self.model, self.book, self.kv = model, book, kv
        self.scheduler, self.counters, self.ready = scheduler, counters, ready
        #: The thread that runs ``background_sync``, set by the owner once it exists (the two
        #: refer to each other).
        self.native: NativeThread = None  # type: ignore[assignment]
        self.trio_token: trio.lowlevel.TrioToken | None = None
        self.last_rows: list[Ahead] = []  # the records of the last look-ahead tick
        self.tick_seconds = 0.0

    # ---- the event loop: claims and streams ----------------------------------------------

    async def claim(self, slot: Slot, plan: ComputePlan) -> Claimed | None:
        """The logits of this exact one-token step if it was computed ahead (waiting for it
        while it runs); None when there is no such step (the caller computes it the usual way).

        The native thread owns the step computed ahead, not the claim: a claim cancelled while
        it waits (its caller's scope, or its deadline) gives the record back unclaimed."""
        book = self.book
        rec = book.claim(slot.seq_id, plan.keep, plan.tokens[0], plan.lookahead)
        if rec is None:
            return None
        flag = slot.cancel
        if not rec.ready and not flag.is_set():
            wake = trio.Event()
            rec.watchers.append(wake)
            flag.add_watcher(wake)
            try:
                await wake.wait()
            except BaseException:  # the caller's cancellation: the step stays for a later claim
                book.unclaim(rec)
                raise
            finally:
                flag.remove_watcher(wake)
                if wake in rec.watchers:
                    rec.watchers.remove(wake)
        if not rec.ready:  # stopped while the step ran ahead: it stays for a later claim
            book.unclaim(rec)
            raise flag.error(slot.session_id)
        if not self._take(rec, slot, plan):
            return None  # dropped (the engine had other work): compute it the usual way
        assert rec.logits is not None
        return Claimed(rec.logits, rec.chosen)

    async def follow(self, slot: Slot, run: StreamRun, plan: ComputePlan) -> bool:
        """Deliver ``run``'s steps from their records, starting with ``plan``'s, until the run
        ends or a step has no record (then the caller computes it). False when ``plan``'s step
        has no record at all."""
        rec = self.book.claim(slot.seq_id, plan.keep, plan.tokens[0], plan.lookahead)
        if rec is None:
            return False
        chain = _Chain(run, slot)
        self._chain_take(chain, rec)
        await self._chain_wait(chain)
        if chain.error is not None:
            raise chain.error
        return True

    def _take(self, rec: Ahead, slot: Slot, plan: ComputePlan) -> bool:
        """Take the claimed, ready record ``rec`` of ``plan``'s step as ``slot``'s: its cell is
        the session's now (a failure rolls it back), counted, and the step after it queued when
        the caller asked for a look-ahead. False when it was dropped (the engine had other work:
        the step is computed the usual way). One path for claims and streams alike."""
        book = self.book
        if not book.consume(rec):
            return False
        slot.touch()
        self.counters["lookahead_used_total"] += 1
        if plan.lookahead is not None and not rec.chained:
            # (keeps the token and log-sum-exp on the record: one pass, not two)
            token = self.next_step(rec.logits, plan.lookahead, plan.keep + 1, rec)
            if token is not None:
                book.propose(slot.seq_id, plan.keep + 1, token)
                self.native.wake()
        return True

    def _chain_take(self, chain: _Chain, rec: Ahead) -> None:
        """Deliver the claimed record ``rec`` of ``chain``'s next step, and each following one
        already computed; leave the chain on the first one still being computed (``_on_posted``
        calls this again when it is), or wake the chain's task: the run ended or its next
        step has no record. On the event loop, from the task or from ``_on_posted``."""
        chain.rec = None
        run, slot, book = chain.run, chain.slot, self.book
        try:
            while True:
                plan = run.plan
                if plan is None or slot.cancel.is_set():
                    book.unclaim(rec)  # (stopped: the step stays for a later claim)
                    break
                if not rec.ready:
                    chain.rec, rec.chain = rec, chain
                    return
                if not self._take(rec, slot, plan):
                    break  # dropped (the engine had other work): computed the usual way
                assert rec.logits is not None
                nxt = run.step(rec.logits, rec.chosen)
                if nxt is None:
                    break
                claimed = book.claim(slot.seq_id, nxt.keep, nxt.tokens[0], nxt.lookahead)
                if claimed is None:
                    break  # no record of it: computed the usual way
                rec = claimed
        except Exception as exc:  # noqa: BLE001 - raised by the chain's task (never here: a callback)
            log.exception("look-ahead delivery failed")
            chain.error = EngineFailure(f"engine fault: {type(exc).__name__}")
        chain.wake.set()

    async def _chain_wait(self, chain: _Chain) -> None:
        """Wait until ``chain`` needs its task (see ``_chain_take``), or its session is stopped
        (``slot.cancel``) or the caller cancelled: then the record it waits for is given back
        unclaimed, ready for a later claim."""
        flag = chain.slot.cancel
        if not chain.wake.is_set():
            flag.add_watcher(chain.wake)
            try:
                await chain.wake.wait()
            finally:
                flag.remove_watcher(chain.wake)
                rec, chain.rec = chain.rec, None
                if rec is not None:
                    rec.chain = None
                    self.book.unclaim(rec)

    def _on_posted(self, recs: list[Ahead], computed: int, native: float, wasted: int) -> None:
        """On the event loop: wake the claims waiting for ``recs`` and count the work."""
        counters = self.counters
        if computed:
            counters["lookahead_steps_total"] += computed
            counters["native_step_us_total"] += int(native * 1e6)
            self.scheduler.stats.ahead(native, computed)
        counters["lookahead_dropped_total"] += wasted
        for rec in recs:
            rec.ready = True
            for wake in rec.watchers:
                wake.set()
            chain = rec.chain
            if chain is not None:  # a stream waits for it: delivered in this pass
                rec.chain = None
                self._chain_take(chain, rec)

    # ---- the native thread -----------------------------------------------------------------

    def next_step(self, logits: np.ndarray, plan: LookaheadPlan, n_past: int,
                  rec: Ahead | None = None) -> int | None:
        """The token a session holding ``n_past`` positions will most likely decode next (the
        one its step chose from ``logits``), or None when no next step will come.

        ``rec``: the record of that step, claimed by a caller sampling as ``plan`` does: its
        token and the row's log-sum-exp are kept on it (``Ahead.chosen``), computed here while
        the row is in this thread's cache, so the event loop does not pass over the vocabulary
        again (``ShardEngine._make_result``)."""
        if not np.isfinite(logits).all():
            return None
        token = sampling.choose_token(logits, plan.sampling, n_past, plan.history)
        if rec is not None:
            greedy_max = logits[token] if plan.sampling.plain_greedy else None
            rec.chosen = (plan.sampling, token, sampling.logsumexp(logits, greedy_max))
        if n_past + 1 > plan.limit or token in plan.stop_tokens:
            return None
        if plan.stop_at_eog and held.llama_vocab_is_eog(self.model.vocab, token):
            return None
        return token

    def background_sync(self) -> bool:
        """Background work of the native thread: one tick of the queued look-ahead steps.
        Returns False when there was nothing to do."""
        book, m = self.book, self.model
        if m.ctx is None or not book.queued():
            return False
        if not self.ready():  # failed or closing: compute nothing more
            self.post(book.drop_queued())
            return False
        if self.scheduler.has_waiting():
            # Other work waits for a tick: step aside; the claims fall back to it and are
            # batched with it by the planner.
            self.post(book.drop_queued())
            return False
        # Gather: sessions of the last look-ahead tick that have not claimed their step yet are
        # about to (each claim queues that session's next step); one tick keeps them together.
        waited = self.last_rows
        deadline = time.perf_counter() + min(self.tick_seconds / 4, MAX_GATHER_SECONDS)
        while waited and book.unclaimed(waited):
            left = deadline - time.perf_counter()
            if left <= 0 or self.native.wait_for_wake(left):
                break
        if self.native.calls_waiting():
            return True  # a call first; this work is offered again after it
        recs = book.take_queued(min(self.scheduler.planner.max_sessions, m.n_batch))
        if not recs:
            return False
        ctx, mem = m.ctx, m.mem
        results: list[tuple[Ahead, np.ndarray | None]] = []
        rows: list[Ahead] = []
        for rec in recs:
            n_held = int(held.llama_memory_seq_pos_max(mem, rec.seq)) + 1
            if n_held == rec.keep:
                rows.append(rec)
            else:  # the session moved on meanwhile (cannot happen: drops run in this thread)
                results.append((rec, None))
        rows.sort(key=_ahead_seq)  # one ubatch per run of consecutive ids (shard.engine.llama)
        native = 0.0
        try:
            m.abort.arm(ctx, False)
            if rows:  # one call for every row
                assert m.rows is not None
                m.rows.fill_rows([(r.token, r.keep, r.seq) for r in rows])
                started = time.perf_counter()
                rc = lc.llama_decode(ctx, m.batch)
                self.kv.decoded(rc)
                native += time.perf_counter() - started
                n_vocab = m.n_vocab
                for i, rec in enumerate(rows):
                    ptr = held.llama_get_logits_ith(ctx, i) if rc == 0 else None
                    if ptr:
                        results.append((rec, np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()))
                    else:
                        held.llama_memory_seq_rm(mem, rec.seq, rec.keep, -1)
                        results.append((rec, None))
        finally:
            for rec in recs:
                if not any(r is rec for r, _ in results):
                    results.append((rec, None))  # an exception stopped this tick
            for rec, chain in book.finish(results, self.kv.count([r.seq for r in recs])):
                # Already claimed: queue the step after it.
                assert rec.logits is not None
                token = self.next_step(rec.logits, chain, rec.keep + 1, rec)
                if token is not None:
                    book.propose(rec.seq, rec.keep + 1, token)
            self.tick_seconds = native
            self.last_rows = rows
            self.post(recs, computed=len(rows) if native else 0, native=native)
        return True

    def post(self, recs: list[Ahead], *, computed: int = 0, native: float = 0.0) -> None:
        """Tell the event loop the outcome of ``recs`` (from the native thread): ``computed``
        rows in ``native`` seconds, or (by default) ``recs`` dropped."""
        if not recs or self.trio_token is None:
            return
        wasted = 0 if computed else sum(1 for r in recs if r.logits is not None)
        try:
            self.trio_token.run_sync_soon(self._on_posted, recs, computed, native, wasted)
        except trio.RunFinishedError:  # pragma: no cover - the engine outlived its Trio run
            pass

    def drop_sync(self, seq: int, keep: int) -> int:
        """Drop ``seq``'s look-ahead records (before its cells from ``keep`` on change); returns
        the lowest position whose cells must go."""
        gone = self.book.drop_from(seq, 0)
        self.post(gone)
        return min([keep, *(r.keep for r in gone)])

    def drop_all_sync(self) -> None:
        """Drop every record (the context is closing): none holds cells any more."""
        self.post(self.book.drop_all())
        self.book.commit_count(0)


__all__ = ["AheadSteps"]
