"""ShardEngine on llama.cpp through llama-cpp-python's low-level (ctypes) API.

The engine composes the parts that own each concern, all in ``shard.engine.llama_*`` (the only
modules in the project, with this one, that import ``llama_cpp`` or ``ctypes``; every llama.cpp
return code is translated into the typed errors of ``shard.engine.errors`` there):

- ``llama_native``: process-wide setup (log callback, backend init), the calls made per step
  with the GIL held, native error reasons, system info;
- ``llama_model``: the native handles (model, context, memory, vocabulary, batch) from load to
  close, the vocabulary, chat template and capabilities; ``llama_batch`` writes the batch rows;
- ``llama_tick``: one tick (one ``llama_decode``) of the scheduler, its abort callback and
  decode errors, and the warm-up;
- ``llama_ahead``: steps computed ahead by the native thread, their claims and streams;
- ``llama_kv``: KV cells (truncation, state export/import, cell counts);
- ``llama_embed``: a pooling model's embedding context (``ShardEngine.embed``);
- ``llama_capture`` (a non-last shard's boundary rows) and ``llama_threads`` (the ggml pool).

Why the low-level API: the high-level ``llama_cpp.Llama`` owns one sequence and resets it per
call; a shard needs one context serving many sessions (one llama.cpp *sequence id* each),
explicit KV truncation for prefix reuse and rollback, and in-step cancellation through the
abort callback.

Context layout: one ``llama_context`` with ``n_seq_max = max_sessions`` (plus one sequence
per prefix cache entry, ``shard.engine.prefix_reuse``) and ``kv_unified = false``. llama.cpp then gives every sequence its own KV stream of ``n_ctx_seq =
pad256(n_ctx / n_seq_max)`` cells (it pads ``n_ctx`` to a multiple of 256 and rounds the total
to ``n_ctx_seq * n_seq_max``), so each session can always hold ``n_ctx // max_sessions``
positions no matter what the other sessions hold (no fragmentation, no starvation), and a step
attends over its own stream only. ``load`` checks ``llama_n_ctx_seq`` against that promise; the
tests fill every session of a ``n_ctx=1000, max_sessions=3`` engine to 333 positions. (A unified
cache would also fit the sums and decoded no faster, so isolation decided.) The price of one
stream per sequence: llama.cpp splits such a batch (``split_equal``, sequential) into one
ubatch per run of rows whose sequence ids go up one by one, and every ubatch reads all the
weights again. Rows are therefore written in increasing sequence order, the planner's ticks and
the look-ahead's alike (unsorted rows made a tick much longer). Ids
with a gap (0, 2, 4, 6 in one tick) still cost a ubatch per run: a session takes the lowest
free id, and one of a batch group an id next to its group's (``shard.engine.seq_ids``).
llama.cpp also rejects a batch whose positions do not continue the sequence (``llama_decode``
-1), and a tick checks the sequence's length before every evaluation (an emptied sequence would
pass llama.cpp's check), so a KV cache out of step with the session's ``n_past`` surfaces as
``EngineFailure`` instead of silently wrong logits.

Layer ranges: a range is served from a file cut by ``shard.models.slice`` (blocks renumbered,
LM head dropped on non-last parts; see docs/engine.md, "Layer ranges on llama.cpp").
``shard.engine.layer_ranges`` decides, from the architecture table, which range a file serves
and refuses what llama.cpp would abort on; it also writes non-first shards' hidden-state rows
into ``batch.embd`` (``EmbdInput``: pre-divided where llama.cpp scales that input). Non-last
shards mark every position as an output and capture the last block's output with
``shard.engine.llama_capture.BoundaryCapture``, which then stops the graph so the output norm
and LM head never run. Capabilities report the source model (fingerprint, block count,
vocabulary size) read from the slice's metadata. A strict range of a whole file is refused:
loading never writes files.

Threading: a llama context is not thread-safe. Every call that touches the context runs in the
engine's one long-lived native thread (``shard.engine.native_thread``) and is never abandoned
(the base class shields the work and turns a caller's cancellation into the slot's cancel
flag); between calls that thread computes steps ahead for sessions that asked for it
(``shard.engine.llama_ahead``). Tokenization and token pieces only read the immutable
vocabulary and run inline.

Batching: concurrent sessions share native steps. ``shard.engine.scheduler`` runs the ticks (a
leader among the waiting callers; no background task), ``shard.engine.batching.TickPlanner``
chooses their rows, and a tick here is one ``llama_decode`` (``shard.engine.llama_tick``); see
docs/engine.md, "Batching".

Cancellation: the cancel flag is checked before every tick (a cancelled session leaves the
batch), and inside a running ``llama_decode`` by llama.cpp's abort callback, armed for ticks
holding a prompt chunk only (``abort_min_tokens``; ``shard.engine.llama_tick`` says why); the
base class then rolls each session back to its ``keep`` position.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import trio

from shard.models.fingerprint import file_fingerprint

from .base import Claimed, ComputePlan, ShardEngine, Slot, StreamRun
from .batching import Piece, TickPlanner
from .errors import EngineFailure, InvalidInput, NotReady
from .llama_ahead import AheadSteps
from .llama_kv import KvCells
from .llama_model import LlamaModel
from .llama_native import ensure_native_init, held, native_system_info
from .llama_tick import AbortedInStep, Ticks, TimedOutInStep, Work, decode_error
from .lookahead import LookaheadBook
from .native_thread import NativeThread
from .scheduler import BatchScheduler, Job
from .types import Capabilities, EngineState, LoadSpec

# Kept under their old names for the callers that reach them here (tests, benches).
_held = held
_ensure_native_init = ensure_native_init


class LlamaCppEngine(ShardEngine):
    """A whole model, or a layer range of a sliced model (``shard.engine.layer_ranges``), served by
    llama.cpp.

    Options (all keyword-only, defaults suit the contract suite):

    - ``n_ubatch``: physical batch size, capped at ``n_batch``. Larger values need a compute
      buffer proportional to ``n_ubatch * n_ctx_seq`` and buy little prefill speed on CPU.
    - ``flash_attn``: ``None`` lets llama.cpp decide, ``True``/``False`` force it.
    - ``abort_min_tokens``: arm the in-step abort callback for ticks in which one session
      evaluates at least this many rows (``shard.engine.llama_tick`` says why decode ticks skip
      it).
    """

    def __init__(
        self, *, n_ubatch: int = 512, flash_attn: bool | None = None, abort_min_tokens: int = 2
    ) -> None:
        super().__init__()
        if n_ubatch <= 0:
            raise InvalidInput("n_ubatch must be positive")
        if abort_min_tokens <= 0:
            raise InvalidInput("abort_min_tokens must be positive")
        self._llama = LlamaModel(n_ubatch=n_ubatch, flash_attn=flash_attn)
        self._book = LookaheadBook()
        self._kv = KvCells(self._llama, self._book)
        # Continuous batching (see "Batching" in docs/engine.md); the planner is set at load.
        self._compute_stops_itself = True  # a scheduler job (BatchScheduler.compute)
        self._scheduler = BatchScheduler(
            TickPlanner(1, 1), self._run_tick, counters=self._counters, stats=self._tick_stats,
            is_open=self._is_open,
        )
        self._ahead = AheadSteps(self._llama, self._book, self._kv, self._scheduler, self._counters,
                                 ready=self._serving)
        # The one thread that touches the context (shard.engine.native_thread); between calls
        # it computes steps ahead. It and the look-ahead refer to each other: wired here.
        self._native = NativeThread("llama-engine", background=self._ahead.background_sync,
                                    on_failure=self._fail)
        self._ahead.native = self._native
        self._ticks = Ticks(self._llama, self._kv, self._ahead, self._counters,
                            abort_min_tokens=abort_min_tokens, mask_tick=self._mask_tick)
        # An attribute, not a method, so that an instrument can wrap it (bench/engine/batching.py).
        self._tick_sync = self._ticks.run_sync

    # ---- hooks -------------------------------------------------------------------------------

    async def _impl_load(self, spec: LoadSpec) -> Capabilities:
        self._ahead.trio_token = trio.lowlevel.current_trio_token()
        self._native.start()
        return await self._native.run(self._load_sync, spec)

    async def _impl_compute(self, slot: Slot, plan: ComputePlan) -> np.ndarray:
        """The plan goes to the batching scheduler (``shard.engine.scheduler``), whose ticks run
        ``Ticks.run_sync`` in the native thread (a step computed ahead was claimed before this,
        by ``_impl_claim``)."""
        m = self._llama
        if (plan.tokens is not None) != m.first:  # the base class checks this per request
            wanted = "token ids, not hidden states" if m.first else "hidden states, not token ids"
            raise EngineFailure(f"this shard takes {wanted}")
        hidden_out = None if m.last else np.empty((plan.n_new, m.n_embd), dtype=np.float32)
        logits_out = (np.empty((plan.n_new, m.n_vocab), dtype=np.float32)
                      if m.last and plan.all_logits else None)
        scheduler = self._scheduler
        work = Work(slot, plan, scheduler.new_step(slot, plan), trio.current_time(), hidden_out, logits_out)
        await scheduler.compute(work)
        if work.error is not None:
            if isinstance(work.error, (AbortedInStep, TimedOutInStep)):
                self._counters["aborted_in_step_total"] += 1
            raise work.error
        assert work.result is not None
        return work.result

    def _impl_group_scheduler(self) -> BatchScheduler | None:
        return self._scheduler

    def _impl_group_job(self, slot: Slot, plan: ComputePlan) -> Job | None:
        """``_impl_compute``'s job, unless a step computed ahead may be claimed (``_impl_claim``:
        the row then runs alone) or the input is the wrong kind (its ``EngineFailure``)."""
        m = self._llama
        if (plan.tokens is not None) != m.first or (
                m.first and plan.tokens is not None and len(plan.tokens) == 1 and self._book.has(slot.seq_id)):
            return None
        hidden_out = None if m.last else np.empty((plan.n_new, m.n_embd), dtype=np.float32)
        logits_out = (np.empty((plan.n_new, m.n_vocab), dtype=np.float32)
                      if m.last and plan.all_logits else None)
        return Work(slot, plan, self._scheduler.new_step(slot, plan), trio.current_time(),
                    hidden_out, logits_out)

    def _impl_group_raw(self, job: Job) -> np.ndarray:
        if job.error is not None:
            if isinstance(job.error, (AbortedInStep, TimedOutInStep)):
                self._counters["aborted_in_step_total"] += 1
            raise job.error
        assert job.result is not None
        return job.result  # type: ignore[no-any-return]

    async def _impl_claim(self, slot: Slot, plan: ComputePlan) -> Claimed | None:
        """A one-token step computed ahead (``AheadSteps.claim``), or None."""
        if not (self._llama.first and plan.tokens is not None and len(plan.tokens) == 1
                and self._book.has(slot.seq_id)):
            return None
        return await self._ahead.claim(slot, plan)

    async def _impl_stream(self, slot: Slot, run: StreamRun) -> None:
        """Steps computed ahead are delivered where the event loop learns of them
        (``AheadSteps.follow``: one pass per native tick for every streaming session), not by
        waking this task per token. The task sleeps until the run ends, or until a step must be
        computed the usual way (no record for it, or one dropped because other work came
        first), which it does, then hands the run back to the records."""
        first, book, ahead = self._llama.first, self._book, self._ahead
        while (plan := run.plan) is not None:
            if first and book.has(slot.seq_id) and await ahead.follow(slot, run, plan):
                if slot.cancel.is_set():
                    return
                continue  # ended (run.plan None), or its next step is computed below
            raw = await self._guard_impl(self._impl_compute(slot, plan))
            if slot.cancel.is_set():
                return
            run.step(raw)

    async def _run_tick(self, tick: list[tuple[Job, Piece]]) -> None:
        seconds = await self._native.run(self._tick_sync, tick)
        self._counters["native_step_us_total"] += int(seconds * 1e6)

    def _is_open(self, slot: Slot) -> bool:
        return not slot.releasing and self._slots.get(slot.session_id) is slot

    def _serving(self) -> bool:
        return self._state is EngineState.READY

    async def _impl_embed(self, tokens: tuple[int, ...]) -> np.ndarray:
        """In the native thread, on the model's embedding context (``shard.engine.llama_embed``:
        why a context of its own), between the serving context's steps."""
        return await self._native.run(self._embed_sync, tokens)

    async def _impl_truncate(self, slot: Slot, keep: int) -> None:
        await self._native.run(self._truncate_sync, slot.seq_id, keep)

    async def _impl_forget_cells(self, seq_ids: list[int]) -> None:
        await self._native.run(self._forget_sync, seq_ids)

    async def _impl_move_cells(self, source: int, seq: int) -> None:
        await self._native.run(self._kv.move_sync, source, seq)

    def _impl_moves_cells(self) -> bool:
        # A sliding-window model's sequence state holds only the window in its SWA cache:
        # moved through it, an entry would come back with fewer cells than it stands for.
        return not self._llama.swa

    async def _impl_fork(self, source: Slot, slot: Slot) -> None:
        await self._native.run(self._kv.fork_sync, source.seq_id, slot.seq_id, source.n_past,
                               source.session_id, self._ahead.drop_sync)

    async def _impl_export(self, slot: Slot) -> bytes:
        return await self._native.run(self._kv.export_sync, slot.seq_id, slot.n_past, slot.session_id,
                                      self._ahead.drop_sync)

    async def _impl_import(self, slot: Slot, data: bytes, n_past: int) -> None:
        await self._native.run(self._kv.import_sync, slot.seq_id, data, n_past, slot.session_id)

    def _impl_state_bound(self, n_past: int) -> int:
        return self._kv.state_bound(n_past)

    def _impl_tokenize(self, text: str, add_bos: bool, parse_special: bool) -> list[int]:
        return self._llama.tokenize(text, add_bos, parse_special)

    def _impl_token_piece(self, token_id: int) -> bytes:
        piece = self._llama.pieces.get(token_id)  # (the cache first: this runs per token)
        return piece if piece is not None else self._llama.token_piece(token_id)

    def _impl_is_eog(self, token_id: int) -> bool:
        vocab = self._llama.vocab
        if vocab is None:
            raise EngineFailure("llama.cpp vocabulary is not loaded")
        return bool(held.llama_vocab_is_eog(vocab, token_id))

    def _impl_grammar_tokenizer(self) -> object:
        # llguidance's bridge reads every piece through llama.cpp (a second or so on a large
        # vocabulary: the base class runs it once, in a worker thread) and tokenizes with it.
        from llguidance.llamacpp import lltokenizer_from_vocab

        vocab, n_vocab = self._llama.vocab, self._llama.n_vocab
        if vocab is None:
            raise EngineFailure("llama.cpp vocabulary is not loaded")
        eog = [t for t in range(n_vocab) if held.llama_vocab_is_eog(vocab, t)]
        # (The bridge calls a name llama-cpp-python deprecated; a DeprecationWarning is not
        # shown outside __main__, and the test suite ignores that one: pyproject.toml.
        # warnings.catch_warnings() here would race with other threads' warning filters.)
        return lltokenizer_from_vocab(vocab, n_vocab, eos_token=eog or None)

    def _impl_kv_cells_used(self) -> int:
        # Counted by the native thread at the end of every native operation (the context is
        # not thread-safe), less the cells of steps computed ahead and not claimed.
        return self._book.committed_cells()

    def _impl_lookahead_cells(self) -> int:
        return self._book.scratch_cells()

    async def _impl_close(self) -> None:
        if self._native.running:
            try:
                await self._native.run(self._close_sync)
                return
            except EngineFailure:
                # Ours unless the thread failed. (A real EngineFailure from _close_sync and a
                # background failure right after it cannot coincide: _close_sync drops the
                # context first, and background work then finds nothing to do.)
                if self._native.failure is None:
                    raise
                # The thread failed and may still be ending: free the context here once it has.
            finally:
                await self._native.aclose()
        self._close_sync()

    # ---- native-thread bodies (shard.engine.native_thread: one thread, one call at a time) ----

    def _load_sync(self, spec: LoadSpec) -> Capabilities:
        m = self._llama
        m.open(spec)
        self._kv.reset(m.n_seq)
        self._ticks.opened()
        self._scheduler.planner = m.planner(spec)
        self._ticks.warm_up_sync()
        return m.capabilities(spec, self._kv.layout())

    def _embed_sync(self, tokens: tuple[int, ...]) -> np.ndarray:
        embedder = self._llama.embedder
        if embedder is None:  # (the base class checked the capabilities: closed meanwhile)
            raise NotReady("the engine is closed")
        return embedder.embed_sync(tokens)

    def _truncate_sync(self, seq: int, keep: int) -> None:
        self._kv.truncate_sync(seq, keep, self._ahead.drop_sync)

    def _forget_sync(self, seq_ids: list[int]) -> None:
        for seq in seq_ids:
            self._kv.truncate_sync(seq, 0, self._ahead.drop_sync)

    def _close_sync(self) -> None:
        self._ticks.closed()
        self._ahead.drop_all_sync()
        self._llama.close()  # batch, context, thread pool, model: reverse order of creation

    # ---- for tests and benches: the parts' state under the engine's old names -----------------

    @property
    def abort_polls(self) -> int:
        """Number of abort-callback polls so far; it grows only while a native decode runs."""
        return self._llama.abort.polls

    @property
    def _model(self) -> Any:
        return self._llama.model

    @property
    def _ctx(self) -> Any:
        return self._llama.ctx

    @property
    def _batch(self) -> Any:
        return self._llama.batch

    @property
    def _threads(self) -> Any:
        return self._llama.threads

    @property
    def _boundary(self) -> Any:
        return self._llama.boundary

    @property
    def _fill_batch(self) -> Any:
        assert self._llama.rows is not None
        return self._llama.rows.fill

    @_fill_batch.setter
    def _fill_batch(self, fn: Any) -> None:  # a spy on the rows a tick writes
        assert self._llama.rows is not None
        self._llama.rows.fill = fn  # type: ignore[method-assign]

    @property
    def _fill_rows(self) -> Any:
        assert self._llama.rows is not None
        return self._llama.rows.fill_rows

    @_fill_rows.setter
    def _fill_rows(self, fn: Any) -> None:  # a spy on the rows a look-ahead tick writes
        assert self._llama.rows is not None
        self._llama.rows.fill_rows = fn  # type: ignore[method-assign]

    def _raise_decode_error(self, rc: int, slot: Slot) -> None:
        raise decode_error(rc, slot, 1)


__all__ = ["LlamaCppEngine", "file_fingerprint", "native_system_info"]
