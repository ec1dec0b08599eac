"""Steps computed one ahead: the bookkeeping shared by the native thread and the event loop.

Why: a session that generates (server-driven ``Generate``, or a client that always decodes the
token the worker sampled) will next decode the token its last step chose. The engine's native
thread can start that step the moment the last one ends, while the event loop is still
delivering the last result, so the native code never waits for a round trip through Python
(docs/engine.md, "Look-ahead"). A caller asks for it with ``Lookahead`` on a prefill or decode;
its next decode of exactly the chosen token *claims* the step computed ahead. Anything else (a
different token, a rewind, release, close) drops it: the cells it wrote are removed before the
session's next step touches the cache, so a look-ahead is never visible in a session's history.

A record goes ``queued -> running -> done`` (or ``dropped`` from any state). The native thread
moves it; the event loop claims and consumes it; both under ``LookaheadBook.lock``. Cells held by
``done`` records (computed, not claimed) are the engine's scratch, reported apart from the
sessions' cells (``EngineMetrics.lookahead_cells``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .types import SamplingParams

QUEUED, RUNNING, DONE, DROPPED = "queued", "running", "done", "dropped"


@dataclass(frozen=True)
class LookaheadPlan:
    """How the engine may continue after a step: the step's own sampling (which token comes
    next), how many more steps the caller may take, when it would stop, and the session's room."""

    sampling: SamplingParams
    steps: int
    stop_tokens: frozenset[int]
    stop_at_eog: bool
    limit: int  # most positions the session may hold
    #: With penalties: the penalty window of the session's ids through the step's last token
    #: (``sampling.lookahead_window``), taken on the event loop, which the thread's choice
    #: sees; None without penalties.
    history: tuple[int, ...] | None = None


@dataclass(eq=False)
class Ahead:
    """One step computed (or to be computed) ahead: ``token`` at position ``keep`` of ``seq``."""

    seq: int
    keep: int
    token: int
    state: str = QUEUED
    logits: np.ndarray | None = None
    #: Set by a claim: the claiming step's own plan, so the thread can chain the step after it.
    claim: LookaheadPlan | None = None
    claimed: bool = False
    chained: bool = False  # the thread already queued the step after this one
    ready: bool = False  # the event loop learnt the outcome (set on the event loop only)
    watchers: list[Any] = field(default_factory=list)  # trio.Events woken by ``ready``
    #: A stream that claimed it (set and read on the event loop only): called with the record
    #: once it is ``ready``, in the same pass that learnt it (``LlamaCppEngine._impl_stream``).
    chain: Any = None
    #: (sampling, token, log-sum-exp): the token its claimer's sampling chose from ``logits``
    #: and the row's log-sum-exp, when the thread knew that sampling as it finished the step
    #: (a claimed record), else None. A later claimer uses it only if it samples alike.
    chosen: tuple[SamplingParams, int, float] | None = None


class LookaheadBook:
    """Every look-ahead record, by sequence id (see the module docs)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._by_seq: dict[int, list[Ahead]] = {}
        # Cells llama.cpp holds, as the native thread last counted them, and the computed
        # records dropped since (their cells are in that count until the next one).
        self._kv_native = 0
        self._dropped_since_count = 0
        # When each sequence last had a step taken (``take_queued``): steps computed ahead take
        # turns, least recently served first, so a tick smaller than the sessions that want
        # one never serves the same session for ever.
        self._turns: dict[int, int] = {}
        self._turn = 0

    # ---- either side ---------------------------------------------------------------------

    def propose(self, seq: int, keep: int, token: int) -> Ahead:
        """Queue ``token`` at ``keep`` (caller holds no lock)."""
        rec = Ahead(seq, keep, token)
        with self.lock:
            self._by_seq.setdefault(seq, []).append(rec)
        return rec

    def committed_cells(self) -> int:
        """Cells holding sessions' positions: llama.cpp's count minus the look-ahead scratch."""
        with self.lock:
            return self._kv_native - self._scratch()

    def scratch_cells(self) -> int:
        with self.lock:
            return self._scratch()

    def _scratch(self) -> int:
        done = sum(1 for recs in self._by_seq.values() for r in recs if r.state == DONE)
        return done + self._dropped_since_count

    def commit_count(self, kv_native: int) -> None:
        """The native thread counted the cells llama.cpp holds now."""
        with self.lock:
            self._kv_native, self._dropped_since_count = kv_native, 0

    def has(self, seq: int) -> bool:
        return bool(self._by_seq.get(seq))

    # ---- the event loop ------------------------------------------------------------------

    def claim(self, seq: int, keep: int, token: int, plan: LookaheadPlan | None) -> Ahead | None:
        """The live record for exactly this step, now claimed; None when there is none."""
        with self.lock:
            for rec in self._by_seq.get(seq, ()):
                if rec.keep == keep and rec.token == token and rec.state != DROPPED:
                    rec.claimed, rec.claim = True, plan
                    return rec
        return None

    def unclaim(self, rec: Ahead) -> None:
        with self.lock:
            rec.claimed, rec.claim = False, None

    def consume(self, rec: Ahead) -> bool:
        """Take a claimed ``done`` record out of the book (its cell is the session's now)."""
        with self.lock:
            recs = self._by_seq.get(rec.seq, [])
            if rec.state != DONE or rec not in recs:
                return False
            recs.remove(rec)
            if not recs:
                del self._by_seq[rec.seq]
            return True

    # ---- the native thread ---------------------------------------------------------------

    def take_queued(self, max_sessions: int) -> list[Ahead]:
        """Up to ``max_sessions`` queued records (one per sequence, the sequences served least
        recently first), now running.

        Why turns: a session that claims its step while it is computed has its next one queued
        at once; taken in the book's order, it would win every tick smaller than the sessions
        waiting (``--max-batch-sessions 1``) and its neighbours would wait for its whole
        generation."""
        with self.lock:
            queued = [
                next(r for r in recs if r.state == QUEUED)
                for recs in self._by_seq.values() if any(r.state == QUEUED for r in recs)
            ]
            queued.sort(key=lambda r: self._turns.get(r.seq, -1))
            out = queued[:max_sessions]
            for rec in out:
                rec.state = RUNNING
                self._turn += 1
                self._turns[rec.seq] = self._turn
        return out

    def unclaimed(self, recs: list[Ahead]) -> bool:
        """Some of ``recs`` is computed and not claimed yet."""
        with self.lock:
            return any(r.state == DONE and not r.claimed for r in recs)

    def busy(self) -> bool:
        """Some record is queued or being computed."""
        with self.lock:
            return any(r.state in (QUEUED, RUNNING) for recs in self._by_seq.values() for r in recs)

    def queued(self) -> bool:
        with self.lock:
            return any(r.state == QUEUED for recs in self._by_seq.values() for r in recs)

    def drop_from(self, seq: int, keep: int) -> list[Ahead]:
        """Drop ``seq``'s records at positions ``>= keep`` (the caller removes their cells)."""
        with self.lock:
            recs = self._by_seq.get(seq, [])
            gone = [r for r in recs if r.keep >= keep]
            for rec in gone:
                self._dropped_since_count += rec.state == DONE
                rec.state = DROPPED
                recs.remove(rec)
            if not recs:
                self._by_seq.pop(seq, None)
        return gone

    def drop_queued(self) -> list[Ahead]:
        """Drop every record not yet computed (no cells to remove)."""
        gone: list[Ahead] = []
        with self.lock:
            for seq, recs in list(self._by_seq.items()):
                for rec in [r for r in recs if r.state == QUEUED]:
                    rec.state = DROPPED
                    recs.remove(rec)
                    gone.append(rec)
                if not recs:
                    del self._by_seq[seq]
        return gone

    def drop_all(self) -> list[Ahead]:
        with self.lock:
            gone = [r for recs in self._by_seq.values() for r in recs]
            for rec in gone:
                self._dropped_since_count += rec.state == DONE
                rec.state = DROPPED
            self._by_seq.clear()
        return gone

    def finish(self, results: list[tuple[Ahead, np.ndarray | None]], kv_native: int) -> list[tuple[Ahead, LookaheadPlan]]:
        """Record the outcome of running records (logits, or None: failed and its cells
        removed) together with the cell count taken after them, so no reader sees one without
        the other. Returns the records a session already claimed, with the claim's plan: the
        thread chains the step after each."""
        chains: list[tuple[Ahead, LookaheadPlan]] = []
        with self.lock:
            self._kv_native, self._dropped_since_count = kv_native, 0
            for rec, logits in results:
                if rec.state != RUNNING:
                    continue
                if logits is None:
                    rec.state = DROPPED
                    recs = self._by_seq.get(rec.seq, [])
                    if rec in recs:
                        recs.remove(rec)
                    if not recs:
                        self._by_seq.pop(rec.seq, None)
                    continue
                rec.state, rec.logits = DONE, logits
                if rec.claimed and rec.claim is not None:
                    rec.chained = True
                    chains.append((rec, rec.claim))
        return chains


__all__ = ["Ahead", "LookaheadBook", "LookaheadPlan", "DONE", "DROPPED", "QUEUED", "RUNNING"]
