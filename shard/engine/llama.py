"""ShardEngine on llama.cpp through llama-cpp-python's low-level (ctypes) API.

With its boundary capture (``shard.engine.llama_capture``) and its compute threads
(``shard.engine.llama_threads``), this is the only module in the project that imports
``llama_cpp`` or ``ctypes``: everything that crosses the engine contract is
a project type, and every llama.cpp return code is translated into the typed errors of
``shard.engine.errors`` here.

Why the low-level API: the high-level ``llama_cpp.Llama`` owns one sequence and resets it per
call; a shard needs one context serving many sessions (one llama.cpp *sequence id* each),
explicit KV truncation for prefix reuse and rollback, and in-step cancellation through the
abort callback.

Context layout: one ``llama_context`` with ``n_seq_max = max_sessions`` and ``kv_unified =
false``. llama.cpp then gives every sequence its own KV stream of ``n_ctx_seq =
pad256(n_ctx / n_seq_max)`` cells (it pads ``n_ctx`` to a multiple of 256 and rounds the total
to ``n_ctx_seq * n_seq_max``), so each session can always hold ``n_ctx // max_sessions``
positions no matter what the other sessions hold (no fragmentation, no starvation), and a step
attends over its own stream only. ``load`` checks ``llama_n_ctx_seq`` against that promise; the
tests fill every session of a ``n_ctx=1000, max_sessions=3`` engine to 333 positions. (A unified
cache would also fit the sums; decode speed was the same within noise at 4 x 1000 cached tokens
on the bench model, so isolation decided.) The price of one stream per sequence: llama.cpp
splits such a batch (``split_equal``, sequential) into one ubatch per run of rows whose sequence
ids go up one by one, and every ubatch reads all the weights again. Rows are therefore written
in increasing sequence order, the planner's ticks and the look-ahead's alike (on the bench model
at 2 threads, four sessions in the order 3, 2, 1, 0 took 51-61 ms a tick against 26-31 ms
sorted). Ids with a gap (0, 2, 4, 6 in one tick) still cost a ubatch per run: a session takes
the lowest free id, and one of a batch group an id next to its group's
(``shard.engine.seq_ids``). llama.cpp also rejects a batch whose positions do
not continue the sequence (``llama_decode`` -1), and ``_compute_sync`` checks the sequence's
length before every evaluation (an emptied sequence would pass llama.cpp's check), so a KV cache
out of step with the session's ``n_past`` surfaces as ``EngineFailure`` instead of silently wrong
logits.

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

Resource handling: the engine owns the model, context and batch from ``load`` until ``aclose``
(one ``ExitStack``, freed explicitly and exactly once; nothing relies on ``__del__``). The ctypes
abort callbacks and the boundary capture (with its eval callback) are attributes of the engine,
kept until the context is freed, and the log callback is a module global, so
none can be collected while native code may call it.

Threading: a llama context is not thread-safe. Every call that touches the context runs in the
engine's one long-lived native thread (``shard.engine.native_thread``) and is never abandoned
(the base class shields the work and turns a caller's cancellation into the slot's cancel
flag); between calls that thread computes steps ahead for sessions that asked for it
(``shard.engine.lookahead``; docs/engine.md, "Look-ahead and the native thread").
Tokenization and token pieces only read the immutable vocabulary and run inline.

Batching: concurrent sessions share native steps. ``shard.engine.scheduler`` runs the ticks (a
leader among the waiting callers; no background task), ``shard.engine.batching.TickPlanner``
chooses their rows, and a tick here is one ``llama_decode`` (``_tick_sync``); see
docs/engine.md, "Batching".

Cancellation: the cancel flag is checked before every tick (a cancelled session leaves the
batch), and inside a running ``llama_decode`` by llama.cpp's abort callback, which ggml polls
after every graph node (about 210 polls per ubatch on the bench model) and which aborts only when
every session of the tick is cancelled; ``llama_decode`` then returns 2 and drops the unfinished
ubatch, and the base class rolls each session back to its ``keep`` position.

The abort callback is a Python function, so every poll takes the GIL. Measured on the bench
model (1 thread, 2 cores): single-token decode runs at ~60 tokens/s with or without it while
the GIL is free, but falls from ~35 to 3-10 tokens/s while another Python thread is busy (each
poll waits for the GIL). So the callback is *armed only for ticks holding a piece of at least
``abort_min_tokens`` rows of one session* (default 2: every prompt chunk, where a step is long
and in-step abort matters). A tick of one-row decodes is short and stops at the next tick;
pass ``abort_min_tokens=1`` for models where even one token takes long.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.llama_cpp as lc
import numpy as np
import trio

from shard.layers import LayerRange
from shard.llama_build import installed_build
from shard.models.fingerprint import file_fingerprint
from shard.models.header import ModelInfo, SliceError, read_model_info

from . import sampling
from .base import CancelFlag, Claimed, ComputePlan, ShardEngine, Slot, StreamRun
from .batching import Piece, Step, TickPlanner
from .layer_ranges import EmbdInput, check_loadable, range_support, served_range
from .llama_capture import BoundaryCapture
from .llama_state import StateFormat, check_cells, learn_format
from .llama_threads import ComputeThreads
from .lookahead import Ahead, LookaheadBook, LookaheadPlan
from .native_thread import NativeThread
from .scheduler import MAX_GATHER_SECONDS, BatchScheduler, Job
from .errors import (
    EngineCancelled,
    EngineError,
    EngineFailure,
    IllegalTransition,
    IncompatibleState,
    InvalidInput,
    KvCacheFull,
    StepTimeout,
)
from .types import Capabilities, ChatTemplate, EngineState, LoadSpec

log = logging.getLogger(__name__)
native_log = logging.getLogger(__name__ + ".native")

#: llama.cpp's compile-time limit on sequence ids per context (``LLAMA_MAX_SEQ``).
LLAMA_MAX_SEQ = 256
_GGUF_MAGIC = b"GGUF"
_LLAMA_TOKEN_NULL = -1
#: Bytes allowed above a state's measured size (``_impl_state_bound``): its per-stream header.
_STATE_SLACK = 4096
class _AbortedInStep(EngineCancelled):
    """``llama_decode`` returned 2: the abort callback stopped it mid-step (counted by the engine)."""


class _TimedOutInStep(StepTimeout):
    """``llama_decode`` returned 2 because the step's own timeout set the flag mid-step: a step
    timeout (``DEADLINE_EXCEEDED``/``STEP_TIMEOUT`` on the wire), not a cancel (counted too)."""


# ---- native logging ----------------------------------------------------------------------------
# llama.cpp logs to stderr unless a callback is set; llama-cpp-python installs one that prints.
# Ours forwards to Python logging at DEBUG and remembers recent error lines so a failed load can
# say why. The callback is process-global in llama.cpp, so it is installed once and kept
# referenced by this module for the life of the process.

# ggml_log_level as the library really uses it (measured; llama-cpp-python's _logger comment is
# off by one): 1 DEBUG, 2 INFO, 3 WARN, 4 ERROR, 5 CONT.
_GGML_LOG_LEVEL_ERROR = 4
_GGML_LOG_LEVEL_CONT = 5
_recent_native_errors: collections.deque[str] = collections.deque(maxlen=8)
_native_state = {"last_level": 1}
_init_lock = threading.Lock()
_initialized = False


def _on_native_log(level: int, text: bytes | None, _user_data: int | None) -> None:
    try:  # an exception must never escape into C
        if level == _GGML_LOG_LEVEL_CONT:  # continuation of the previous message
            level = _native_state["last_level"]
        else:
            _native_state["last_level"] = level
        msg = (text or b"").decode("utf-8", "replace").rstrip("\n")
        if msg and level == _GGML_LOG_LEVEL_ERROR:
            _recent_native_errors.append(msg.strip())
        if msg and native_log.isEnabledFor(logging.DEBUG):
            native_log.debug("%s", msg)
    except Exception:  # noqa: BLE001 - nothing can be reported from inside a C callback
        pass


_LOG_CALLBACK = lc.llama_log_callback(_on_native_log)


def _ensure_native_init() -> None:
    """Install the log callback and initialise the backend once per process."""
    global _initialized
    with _init_lock:
        if not _initialized:
            lc.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
            lc.llama_backend_init()
            _initialized = True


class _GilHeldCalls:
    """The tiny llama.cpp calls made per step, bound through ``ctypes.PyDLL`` so they keep the
    GIL. ``ctypes.CDLL`` (llama-cpp-python's binding) releases the GIL around every call, and
    taking it back waits while the other thread runs Python (up to the switch interval): with
    a dozen such calls per step, those waits cost more than the calls (bench/profile_server.py).
    Each of these returns in microseconds and never calls back into Python."""

    def __init__(self) -> None:
        lib = ctypes.PyDLL(lc._lib._name, handle=lc._lib._handle)
        for name in (
            "llama_memory_seq_pos_max", "llama_memory_seq_pos_min", "llama_memory_seq_rm",
            "llama_get_logits_ith", "llama_vocab_is_eog", "llama_token_to_piece",
        ):
            fn, declared = getattr(lib, name), getattr(lc, name)
            fn.argtypes, fn.restype = declared.argtypes, declared.restype
            setattr(self, name, fn)


_held: Any = _GilHeldCalls()


def _native_reason() -> str:
    """The first native error logged since the last clear: usually the most specific one."""
    return f" (llama.cpp: {_recent_native_errors[0]})" if _recent_native_errors else ""


class _Chain:
    """A stream's claim on the record of its next step computed ahead (``_impl_stream``)."""

    __slots__ = ("run", "slot", "wake", "rec", "error")

    def __init__(self, run: StreamRun, slot: Slot) -> None:
        self.run, self.slot = run, slot
        self.wake = trio.Event()
        self.rec: Ahead | None = None  # the claimed record it waits for
        self.error: EngineError | None = None


class _Work(Job):
    """A job plus the rows a non-last shard captures for it (or, for an ``all_logits`` step on
    the last shard, every row's logits), filled tick by tick."""

    def __init__(
        self, slot: Slot, plan: ComputePlan, step: Step, submitted: float,
        hidden_out: np.ndarray | None, logits_out: np.ndarray | None = None,
    ) -> None:
        super().__init__(slot, plan, step, submitted)
        self.hidden_out = hidden_out
        self.logits_out = logits_out


def _ahead_seq(rec: Ahead) -> int:
    return rec.seq


def _chat_template(model: Any, vocab: Any) -> ChatTemplate:
    """The model's own chat template (GGUF ``tokenizer.chat_template``) and the texts of its
    BOS, EOS and end-of-turn tokens as the template writes them."""
    raw = lc.llama_model_chat_template(model, None)

    def text(token: int) -> str:
        if token == _LLAMA_TOKEN_NULL:
            return ""
        return (lc.llama_vocab_get_text(vocab, token) or b"").decode("utf-8", "replace")

    # What llama_tokenize's parse_special turns into tokens (user-defined tokens are always
    # parsed, with or without it).
    special = lc.LLAMA_TOKEN_ATTR_CONTROL | lc.LLAMA_TOKEN_ATTR_UNKNOWN
    return ChatTemplate(
        template=raw.decode("utf-8", "replace") if raw else "",
        bos_token=text(int(lc.llama_vocab_bos(vocab))),
        eos_token=text(int(lc.llama_vocab_eos(vocab))),
        eot_token=text(int(lc.llama_vocab_eot(vocab))),
        add_bos=bool(lc.llama_vocab_get_add_bos(vocab)),
        special_texts=tuple(t for i in range(int(lc.llama_vocab_n_tokens(vocab)))
                            if lc.llama_vocab_get_attr(vocab, i) & special and (t := text(i))),
    )


def native_system_info(*, use_extra_bufts: bool = True, threads: int | None = None) -> str:
    """One line naming the native code that runs: the llama-cpp-python version, the build profile
    it was installed with (``shard.llama_build``), whether extra buffer types (repacked / AMX
    weight layouts) are used, how many threads compute (``threads``, when known: more than one
    run on the context's ggml pool, ``shard.engine.llama_threads``), and llama.cpp's system info
    (the CPU features it was compiled for).
    """
    build = installed_build()
    origin = f"build {build['key']}" if build else "build not recorded (not installed by shard.llama_build)"
    info = " ".join(lc.llama_print_system_info().decode("utf-8", "replace").split())
    bufts = "on" if use_extra_bufts else "off"
    if threads is not None:
        where = "one ggml pool" if threads > 1 else "the native thread"
        bufts += f"; threads {threads} ({where})"
    return f"llama-cpp-python {llama_cpp.__version__}; {origin}; extra bufts {bufts}; {info}"


def _default_threads() -> int:
    """Half the usable CPUs (physical cores on SMT machines; llama-cpp-python's default too),
    at most 8. Headroom matters: ggml's threads spin at barriers inside a step. Measured on 2
    cores (bench model, OpenMP build): idle machine, 2 threads ~105 tokens/s vs 1 thread ~60;
    with one other busy process, 2 threads fell to 4-24 tokens/s while 1 thread kept 31-54."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        n = os.cpu_count() or 1
    return max(1, min(n // 2, 8))


def _check_model_file(model_path: Path | None) -> Path:
    """Refuse a missing, unreadable or non-GGUF file before llama.cpp sees it."""
    if model_path is None:
        raise InvalidInput("the llama.cpp engine needs a model_path")
    path = Path(model_path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise InvalidInput(f"model file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise InvalidInput(f"model path {str(path)!r} is a directory") from None
    except OSError as exc:
        raise InvalidInput(f"model file {str(path)!r} cannot be read: {exc.strerror}") from None
    if magic != _GGUF_MAGIC:
        raise InvalidInput(f"model file {str(path)!r} is not a GGUF file")
    return path


class LlamaCppEngine(ShardEngine):
    """A whole model, or a layer range of a sliced model (``shard.engine.layer_ranges``), served by
    llama.cpp.

    Options (all keyword-only, defaults suit the contract suite):

    - ``n_ubatch``: physical batch size, capped at ``n_batch``. Larger values need a compute
      buffer proportional to ``n_ubatch * n_ctx_seq`` and buy little prefill speed on CPU.
    - ``flash_attn``: ``None`` lets llama.cpp decide, ``True``/``False`` force it.
    - ``abort_min_tokens``: arm the in-step abort callback for ticks in which one session
      evaluates at least this many rows (see the module docs for why decode ticks skip it).
    """

    def __init__(
        self, *, n_ubatch: int = 512, flash_attn: bool | None = None, abort_min_tokens: int = 2
    ) -> None:
        super().__init__()
        if n_ubatch <= 0:
            raise InvalidInput("n_ubatch must be positive")
        if abort_min_tokens <= 0:
            raise InvalidInput("abort_min_tokens must be positive")
        self._n_ubatch_opt = n_ubatch
        self._flash_attn = flash_attn
        self._abort_min_tokens = abort_min_tokens
        # The one thread that touches the context (shard.engine.native_thread); between calls
        # it computes steps ahead (shard.engine.lookahead).
        self._native = NativeThread("llama-engine", background=self._lookahead_sync,
                                    on_failure=self._fail)
        self._book = LookaheadBook()
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._last_ahead: list[Ahead] = []  # the records of the last look-ahead tick
        self._ahead_tick_seconds = 0.0
        self._natives = contextlib.ExitStack()
        self._model: lc.llama_model_p | None = None
        self._ctx: lc.llama_context_p | None = None
        self._mem: lc.llama_memory_t | None = None
        self._vocab: lc.llama_vocab_p | None = None
        self._batch: lc.llama_batch | None = None
        self._batch_tokens: np.ndarray | None = None
        self._batch_pos: np.ndarray | None = None
        self._batch_nseq: np.ndarray | None = None
        self._batch_out: np.ndarray | None = None
        self._batch_embd: np.ndarray | None = None  # [n_batch, n_embd] input rows (non-first)
        self._batch_rows: list[Any] = []  # per-row seq_id pointers of the batch
        self._batch_row_seq: np.ndarray | None = None
        self._n_batch = 0
        self._seq_cells: list[int] = []  # KV cells per sequence id (see _count_kv_cells)
        self._n_vocab = 0
        self._pieces: dict[int, bytes] = {}  # token id -> piece, filled as tokens are seen
        self._n_seq = 0
        # The abort callback: ggml polls it after every graph node of a running llama_decode;
        # it aborts only when every session of the running tick is cancelled.
        self._decoding: tuple[CancelFlag, ...] = ()
        # Continuous batching (see "Batching" in docs/engine.md); the planner is set at load.
        self._compute_stops_itself = True  # a scheduler job (BatchScheduler.compute)
        self._scheduler = BatchScheduler(
            TickPlanner(1, 1), self._run_tick, counters=self._counters, is_open=self._is_open
        )
        self._tick_hidden: np.ndarray | None = None  # non-last: captured rows of one tick
        #: Number of abort-callback polls so far; it grows only while a native decode runs.
        self.abort_polls = 0
        self._abort_callback = lc.ggml_abort_callback(self._poll_abort)
        self._no_abort_callback = lc.ggml_abort_callback()  # NULL function pointer
        self._abort_armed = False
        # Layer range: which end of the model this shard is, how hidden-state input is written
        # (non-first) and the boundary capture (non-last; referenced until the context is freed).
        self._first = self._last = True
        self._n_embd = 0
        self._embd_input = EmbdInput(None)
        self._boundary: BoundaryCapture | None = None
        # The context's ggml thread pool (shard.engine.llama_threads), with more than one thread.
        self._threads: ComputeThreads | None = None
        # One sequence's state, measured at the warm-up: bytes per position and the rest, and
        # its format (``shard.engine.llama_state``); 0 / None: sessions cannot be moved.
        self._state_per_position = 0
        self._state_overhead = 0
        self._state_format: StateFormat | None = None

    # ---- hooks -------------------------------------------------------------------------------

    async def _impl_load(self, spec: LoadSpec) -> Capabilities:
        self._trio_token = trio.lowlevel.current_trio_token()
        self._native.start()
        return await self._native.run(self._load_sync, spec)

    async def _impl_compute(self, slot: Slot, plan: ComputePlan) -> np.ndarray:
        """The plan goes to the batching scheduler (``shard.engine.scheduler``), whose ticks run
        ``_tick_sync`` in the native thread (a step computed ahead was claimed before this, by
        ``_impl_claim``)."""
        if (plan.tokens is not None) != self._first:  # the base class checks this per request
            wanted = "token ids, not hidden states" if self._first else "hidden states, not token ids"
            raise EngineFailure(f"this shard takes {wanted}")
        hidden_out = None if self._last else np.empty((plan.n_new, self._n_embd), dtype=np.float32)
        logits_out = (np.empty((plan.n_new, self._n_vocab), dtype=np.float32)
                      if self._last and plan.all_logits else None)
        scheduler = self._scheduler
        work = _Work(slot, plan, scheduler.new_step(slot, plan), trio.current_time(), hidden_out, logits_out)
        await scheduler.compute(work)
        if work.error is not None:
            if isinstance(work.error, (_AbortedInStep, _TimedOutInStep)):
                self._counters["aborted_in_step_total"] += 1
            raise work.error
        assert work.result is not None
        return work.result

    async def _impl_claim(self, slot: Slot, plan: ComputePlan) -> Claimed | None:
        """The logits of this exact step if it was computed ahead (waiting for it while it
        runs); None when there is no such step (the caller computes it the usual way).

        The native thread owns the step computed ahead, not the claim: a claim cancelled while
        it waits (its caller's scope, or its deadline) gives the record back unclaimed."""
        if not (self._first and plan.tokens is not None and len(plan.tokens) == 1
                and self._book.has(slot.seq_id)):
            return None
        rec = self._book.claim(slot.seq_id, plan.keep, plan.tokens[0], plan.lookahead)
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
                self._book.unclaim(rec)
                raise
            finally:
                flag.remove_watcher(wake)
                if wake in rec.watchers:
                    rec.watchers.remove(wake)
        if not rec.ready:  # stopped while the step ran ahead: it stays for a later claim
            self._book.unclaim(rec)
            raise flag.error(slot.session_id)
        if not self._book.consume(rec):
            return None  # dropped (the engine had other work): compute it the usual way
        slot.touch()  # the step's cell is the session's now; a failure rolls it back
        self._counters["lookahead_used_total"] += 1
        if plan.lookahead is not None and not rec.chained:  # (keeps the choice on ``rec``)
            token = self._next_step(rec.logits, plan.lookahead, plan.keep + 1, rec)
            if token is not None:
                self._book.propose(slot.seq_id, plan.keep + 1, token)
                self._native.wake()
        assert rec.logits is not None
        return Claimed(rec.logits, rec.chosen)

    async def _impl_stream(self, slot: Slot, run: StreamRun) -> None:
        """Steps computed ahead are delivered where the event loop learns of them
        (``_on_posted``: one pass per native tick for every streaming session), not by waking
        this task per token. The task sleeps until the run ends, or until a step must be
        computed the usual way (no record for it, or one dropped because other work came
        first), which it does, then hands the run back to the records."""
        while (plan := run.plan) is not None:
            if self._first and self._book.has(slot.seq_id):
                rec = self._book.claim(slot.seq_id, plan.keep, plan.tokens[0], plan.lookahead)
                if rec is not None:
                    chain = _Chain(run, slot)
                    self._chain_take(chain, rec)
                    await self._chain_wait(chain)
                    if chain.error is not None:
                        raise chain.error
                    if slot.cancel.is_set():
                        return
                    continue  # ended (run.plan None), or its next step is computed below
            raw = await self._guard_impl(self._impl_compute(slot, plan))
            if slot.cancel.is_set():
                return
            run.step(raw)

    def _chain_take(self, chain: _Chain, rec: Ahead) -> None:
        """Deliver the claimed record ``rec`` of ``chain``'s next step, and each following one
        already computed; leave the chain on the first one still being computed (``_on_posted``
        calls this again when it is), or wake the chain's task: the run ended or its next
        step has no record. On the event loop, from the task or from ``_on_posted``."""
        chain.rec = None
        run, slot, book = chain.run, chain.slot, self._book
        try:
            while True:
                plan = run.plan
                if plan is None or slot.cancel.is_set():
                    book.unclaim(rec)  # (stopped: the step stays for a later claim)
                    break
                if not rec.ready:
                    chain.rec, rec.chain = rec, chain
                    return
                if not book.consume(rec):
                    break  # dropped (the engine had other work): computed the usual way
                slot.touch()  # the step's cell is the session's now; a failure rolls it back
                self._counters["lookahead_used_total"] += 1
                if plan.lookahead is not None and not rec.chained:
                    # (keeps the token and log-sum-exp on the record: one pass, not two)
                    token = self._next_step(rec.logits, plan.lookahead, plan.keep + 1, rec)
                    if token is not None:
                        book.propose(slot.seq_id, plan.keep + 1, token)
                        self._native.wake()
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
                    self._book.unclaim(rec)

    async def _run_tick(self, tick: list[tuple[Job, Piece]]) -> None:
        seconds = await self._native.run(self._tick_sync, tick)
        self._counters["native_step_us_total"] += int(seconds * 1e6)

    def _is_open(self, slot: Slot) -> bool:
        return not slot.releasing and self._slots.get(slot.session_id) is slot

    async def _impl_truncate(self, slot: Slot, keep: int) -> None:
        await self._native.run(self._truncate_sync, slot.seq_id, keep)

    async def _impl_export(self, slot: Slot) -> bytes:
        return await self._native.run(self._export_sync, slot.seq_id, slot.n_past, slot.session_id)

    async def _impl_import(self, slot: Slot, data: bytes, n_past: int) -> None:
        await self._native.run(self._import_sync, slot.seq_id, data, n_past, slot.session_id)

    def _impl_state_bound(self, n_past: int) -> int:
        # measured on the warm-up's sequence: cells of every layer, a header per stream
        return self._state_overhead + n_past * self._state_per_position + _STATE_SLACK

    def _impl_tokenize(self, text: str, add_bos: bool, parse_special: bool) -> list[int]:
        vocab = self._require_vocab()
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInput("text is not valid Unicode (lone surrogate)") from None
        n_max = len(data) + 8
        for _ in range(2):
            buf = (lc.llama_token * n_max)()
            n = lc.llama_tokenize(vocab, data, len(data), buf, n_max, add_bos, parse_special)
            if n >= 0:
                return list(buf[:n])
            n_max = -n
        raise EngineFailure("llama_tokenize disagreed with itself about the token count")

    def _impl_token_piece(self, token_id: int) -> bytes:
        if not (self._first or self._last):
            raise IllegalTransition("a middle shard holds no vocabulary (its slice has a stub)")
        piece = self._pieces.get(token_id)  # a token's piece never changes: one call per token
        if piece is not None:
            return piece
        vocab = self._require_vocab()
        size = 64
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = _held.llama_token_to_piece(vocab, token_id, buf, size, 0, False)
            if n >= 0:
                self._pieces[token_id] = piece = buf.raw[:n]
                return piece
            size = -n
        raise EngineFailure("llama_token_to_piece disagreed with itself about the piece size")

    def _impl_is_eog(self, token_id: int) -> bool:
        return bool(_held.llama_vocab_is_eog(self._require_vocab(), token_id))

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
        path = _check_model_file(spec.model_path)
        if spec.max_sessions > LLAMA_MAX_SEQ:
            raise InvalidInput(f"max_sessions must be <= {LLAMA_MAX_SEQ} for llama.cpp")
        n_ctx_per_session = spec.n_ctx // spec.max_sessions
        if n_ctx_per_session == 0:
            raise InvalidInput(f"n_ctx {spec.n_ctx} is smaller than max_sessions {spec.max_sessions}")
        try:
            info: ModelInfo | None = read_model_info(path)
        except SliceError as exc:
            if spec.layer_range is not None:
                raise InvalidInput(str(exc)) from None
            info = None  # not a slice; llama.cpp's loader says what it thinks of the file
        served = None if info is None else served_range(info, spec.layer_range)
        n_layers_total = 0 if info is None else info.n_layers_total
        first = served is None or served.start == 0
        last = served is None or served.end == n_layers_total
        if info is not None:
            check_loadable(info)  # never hand llama.cpp a file it would abort the process on
        # Every shard of one model reports the source file's fingerprint.
        fingerprint = info.source_sha256 if info is not None and info.source_sha256 else file_fingerprint(path)
        _ensure_native_init()
        _recent_native_errors.clear()

        with contextlib.ExitStack() as natives:
            mparams = lc.llama_model_default_params()
            mparams.n_gpu_layers = 0
            mparams.use_extra_bufts = spec.use_extra_bufts
            model = lc.llama_model_load_from_file(os.fsencode(path), mparams)
            if not model:
                raise InvalidInput(f"llama.cpp could not load {str(path)!r}{_native_reason()}")
            natives.callback(lc.llama_model_free, model)

            n_layer = int(lc.llama_model_n_layer(model))
            if served is None:
                served, n_layers_total = LayerRange(0, n_layer), n_layer
            elif n_layer != served.count:
                raise InvalidInput(
                    f"llama.cpp sees {n_layer} blocks in {str(path)!r}, its metadata {served.count}"
                )
            vocab = lc.llama_model_get_vocab(model)
            if not vocab:
                raise InvalidInput(f"model {str(path)!r} has no vocabulary")
            n_vocab = int(lc.llama_vocab_n_tokens(vocab))
            n_embd = int(lc.llama_model_n_embd(model))
            arch = self._meta_str(model, b"general.architecture") or "unknown"
            boundary = None if last else BoundaryCapture(n_layer, n_embd)

            cparams = lc.llama_context_default_params()
            cparams.n_ctx = spec.n_ctx
            cparams.n_batch = spec.n_batch
            cparams.n_ubatch = min(spec.n_batch, self._n_ubatch_opt)
            cparams.n_seq_max = spec.max_sessions
            threads = spec.n_threads or _default_threads()
            cparams.n_threads = threads
            cparams.n_threads_batch = threads
            cparams.kv_unified = False
            cparams.embeddings = False
            cparams.offload_kqv = False
            cparams.no_perf = True
            if boundary is not None:
                # The callback object stays referenced (self._boundary) until the context is freed.
                cparams.cb_eval = boundary.callback
                cparams.cb_eval_user_data = None
            if self._flash_attn is not None:
                cparams.flash_attn_type = (
                    lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if self._flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
                )
            # The pool outlives the context that computes on it: registered before it, freed after it.
            pool = ComputeThreads(threads) if threads > 1 else None
            if pool is not None:
                natives.callback(pool.close)
            ctx = lc.llama_init_from_model(model, cparams)
            if not ctx:
                raise EngineFailure(f"llama.cpp could not create a context{_native_reason()}")
            natives.callback(lc.llama_free, ctx)
            if pool is not None:
                pool.attach(ctx)

            n_ctx_seq = int(lc.llama_n_ctx_seq(ctx))
            if n_ctx_seq < n_ctx_per_session:
                raise EngineFailure(
                    f"llama.cpp gives each sequence {n_ctx_seq} cells, fewer than the "
                    f"{n_ctx_per_session} promised per session"
                )
            n_batch = int(lc.llama_n_batch(ctx))  # llama.cpp caps n_batch at n_ctx
            # First shards feed token ids; later shards feed hidden-state rows (batch.embd).
            batch = lc.llama_batch_init(n_batch, 0 if first else n_embd, 1)
            natives.callback(lc.llama_batch_free, batch)
            mem = lc.llama_get_memory(ctx)
            if not mem:
                raise EngineFailure("llama.cpp context has no KV memory")

            # Commit: from here on the engine owns the handles (freed by _close_sync).
            self._model, self._ctx, self._mem, self._vocab, self._batch = model, ctx, mem, vocab, batch
            self._n_batch, self._n_vocab, self._n_seq = n_batch, n_vocab, spec.max_sessions
            self._first, self._last, self._n_embd = first, last, n_embd
            self._boundary = boundary
            self._threads = pool
            self._embd_input = EmbdInput.for_model(info, first=first)
            if first:
                self._batch_tokens = np.ctypeslib.as_array(batch.token, shape=(n_batch,))
            else:
                embd = np.ctypeslib.as_array(batch.embd, shape=(n_batch * n_embd,))
                self._batch_embd = embd.reshape(n_batch, n_embd)
            self._batch_pos = np.ctypeslib.as_array(batch.pos, shape=(n_batch,))
            self._batch_nseq = np.ctypeslib.as_array(batch.n_seq_id, shape=(n_batch,))
            self._batch_out = np.ctypeslib.as_array(batch.logits, shape=(n_batch,))
            self._batch_rows = [batch.seq_id[i] for i in range(n_batch)]
            self._batch_row_seq = np.full(n_batch, -1, dtype=np.int64)
            self._seq_cells = [0] * spec.max_sessions
            if not last:
                self._tick_hidden = np.empty((n_batch, n_embd), dtype=np.float32)
            # Non-last shards never mix a prompt chunk with other sessions' rows: llama.cpp
            # would reorder them into ubatches, and captured rows must come back in batch order.
            self._scheduler.planner = TickPlanner(
                min(spec.batch_tokens or n_batch, n_batch),
                min(spec.max_batch_sessions or spec.max_sessions, spec.max_sessions),
                mix=last,
            )
            self._natives = natives.pop_all()
        self._warm_up_sync(bos=int(lc.llama_vocab_bos(vocab)))
        log.debug(
            "loaded %s: arch=%s layers=[%d, %d) of %d n_ctx=%d n_ctx_seq=%d n_batch=%d threads=%d",
            path, arch, served.start, served.end, n_layers_total, spec.n_ctx, n_ctx_seq, n_batch, threads,
        )
        bos, eos = int(lc.llama_vocab_bos(vocab)), int(lc.llama_vocab_eos(vocab))
        # A token's text as stored (SPM's "\u2581" for a space, byte tokens as "<0x41>") is never
        # shorter than the text it stands for: an upper bound, 0.1 s for a 150,000-token vocab.
        # Only first shards tokenize (a later slice's stub vocabulary has no type to ask).
        max_token_bytes = max(
            (len(lc.llama_vocab_get_text(vocab, i) or b"") for i in range(n_vocab)), default=0
        ) if first else 0
        return Capabilities(
            engine="llama.cpp",
            model_fingerprint=fingerprint,
            architecture=arch,
            n_layers_total=n_layers_total,
            layer_range=served,
            n_embd=n_embd,
            # A middle slice holds a stub vocabulary: report the model's.
            n_vocab=(info.source_n_vocab if info is not None else None) or n_vocab,
            n_ctx=spec.n_ctx,
            n_ctx_per_session=n_ctx_per_session,
            max_sessions=spec.max_sessions,
            bos_token_id=None if bos == _LLAMA_TOKEN_NULL else bos,
            eos_token_id=None if eos == _LLAMA_TOKEN_NULL else eos,
            system_info=native_system_info(use_extra_bufts=spec.use_extra_bufts, threads=threads),
            max_token_bytes=max_token_bytes,
            layer_ranges=range_support(info, arch),
            chat=_chat_template(model, vocab) if first else ChatTemplate(),
            kv_layout=self._kv_layout(arch, served, n_embd),
        )

    def _kv_layout(self, arch: str, served: LayerRange, n_embd: int) -> str:
        """The state layout two contexts must share to move a session: the blocks, the width,
        what one position's cells take (their types and head sizes) and the attention kernel
        choice (flash attention keeps V untransposed); llama.cpp checks the rest on import."""
        fmt = self._state_format
        if not self._state_per_position or fmt is None:
            return ""  # the warm-up could not measure or read a state: sessions are not moved
        fa = {None: "auto", True: "on", False: "off"}[self._flash_attn]
        return (f"llama.cpp-seq-state/{arch}/blocks={served.count}/n_embd={n_embd}/"
                f"cell={self._state_per_position}B/streams={fmt.n_stream}/"
                f"ext={int(fmt.ext)}/fa={fa}")

    def _warm_up_sync(self, *, bos: int) -> None:
        """Run a short prompt chunk and a one-row step on sequence 0 before the engine reports
        READY, then free their cells. Why: llama.cpp's first steps on a fresh context are slow
        (the compute graph of each batch shape built and allocated, weights touched for the
        first time): on a slice of Gemma 3 270M an 8-token prompt took 296 ms against 58 ms
        for the same prompt next, on the bench model's first half 75 ms against 28, so a short
        step timeout failed a worker's first real step. A failed warm-up is logged, never fatal
        (the first real step then pays, as before)."""
        assert self._batch is not None and self._batch_row_seq is not None
        token = bos if bos != _LLAMA_TOKEN_NULL else 0
        chunk = min(8, self._n_batch)
        counters = self._counters
        sizes: list[int] = []  # one sequence's state size after each step (moving sessions)
        try:
            for start, count in ((0, chunk), (chunk, 1)):
                if self._first:
                    self._batch_tokens[:count] = token
                else:
                    self._batch_embd[:count] = 0.0
                self._batch_pos[:count] = np.arange(start, start + count, dtype=np.int32)
                self._batch_out[:count] = 0 if self._last else 1
                self._batch_out[count - 1] = 1
                for i in range(count):
                    self._batch_rows[i][0] = 0
                self._batch_row_seq[:count] = 0
                self._batch_nseq[:count] = 1
                self._batch.n_tokens = count
                started = time.perf_counter()
                rc = lc.llama_decode(self._ctx, self._batch)
                counters["warmup_us_total"] += int((time.perf_counter() - started) * 1e6)
                counters["warmup_steps_total"] += 1
                if rc != 0:
                    log.warning("warm-up step failed (llama_decode returned %d)%s: the first "
                                "real step builds its graph instead", rc, _native_reason())
                    break
                sizes.append(int(lc.llama_state_seq_get_size(self._ctx, 0)))
            if len(sizes) == 2 and sizes[1] > sizes[0] > 0:
                # positions 0..7, then 0..8: what one more position adds, and the rest
                self._state_format = learn_format(self._state_bytes_sync(0, "the warm-up"))
                if self._state_format is not None:
                    self._state_per_position = sizes[1] - sizes[0]
                    self._state_overhead = max(0, sizes[0] - chunk * self._state_per_position)
        finally:
            _held.llama_memory_seq_rm(self._mem, 0, -1, -1)

    def _tick_sync(self, tick: list[tuple[_Work, Piece]]) -> float:
        """One ``llama_decode`` holding every piece of ``tick``; results and errors go to the
        works (never raised: one session's failure must not hide the others' outcome). Returns
        the seconds spent inside ``llama_decode``. A finished step whose caller asked for a
        look-ahead gets its next step queued (run by ``_lookahead_sync`` once this returns)."""
        assert self._ctx is not None
        self._last_ahead = []
        native = 0.0
        try:
            live: list[tuple[_Work, Piece]] = []
            for work, piece in tick:
                if not work.started:
                    try:
                        self._start_sync(work)
                    except EngineError as exc:
                        work.finish(error=exc)
                        continue
                live.append((work, piece))
            if not live:
                return native
            n = self._fill_batch(live)
            # Armed for prompt chunks only: a tick of one-row decodes is short, and every poll
            # takes the GIL (see the module docs).
            self._arm_abort(max(p.count for _, p in live) >= self._abort_min_tokens)
            boundary = self._boundary
            target = None if boundary is None else boundary.begin(self._tick_hidden[:n])
            self._decoding = tuple(w.slot.cancel for w, _ in live)
            started = time.perf_counter()
            try:
                rc = lc.llama_decode(self._ctx, self._batch)
            finally:
                native = time.perf_counter() - started
                self._decoding = ()
                if boundary is not None:
                    boundary.end()
            if rc != 0:
                for work, _ in live:
                    work.finish(error=self._decode_error(rc, work.slot, len(live)))
                return native
            if target is not None:
                try:
                    target.check(n)
                except EngineFailure as error:
                    for work, _ in live:
                        work.finish(error=error)
                    return native
            row = 0
            for work, piece in live:
                step = work.step
                step.done_rows += piece.count
                if work.hidden_out is not None:
                    assert self._tick_hidden is not None
                    work.hidden_out[piece.start : piece.start + piece.count] = self._tick_hidden[row : row + piece.count]
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
                self._finish_logits(work, row - 1)
        except Exception as exc:  # noqa: BLE001 - handed to every waiting work; the base class fails the engine
            for work, _ in tick:
                if not work.finished:
                    work.finish(error=exc)
        finally:
            self._count_kv_cells_sync([work.slot.seq_id for work, _ in tick])
        return native

    def _copy_logits(self, work: _Work, piece: Piece, row: int) -> bool:
        """Copy the logits of batch rows ``row..`` into an ``all_logits`` work's result (False,
        and the work failed, when llama.cpp has none)."""
        assert work.logits_out is not None
        for i in range(piece.count):
            ptr = _held.llama_get_logits_ith(self._ctx, row + i)
            if not ptr:
                work.finish(error=EngineFailure("llama.cpp returned no logits for a position"))
                return False
            work.logits_out[piece.start + i] = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
        return True

    def _finish_logits(self, work: _Work, row: int) -> None:
        """Finish a completed last-shard step with the logits of batch row ``row``, and queue
        the step after it when its caller asked for a look-ahead."""
        ptr = _held.llama_get_logits_ith(self._ctx, row)
        if not ptr:
            work.finish(error=EngineFailure("llama.cpp returned no logits for the last position"))
            return
        logits = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)).copy()
        work.finish(result=logits)
        plan = work.plan
        if plan.lookahead is not None and plan.tokens is not None:
            end = plan.keep + plan.n_new
            token = self._next_step(logits, plan.lookahead, end)
            if token is not None:
                self._book.propose(work.slot.seq_id, end, token)

    # ---- look-ahead (shard.engine.lookahead; docs/engine.md, "Look-ahead") -------------------

    def _next_step(self, logits: np.ndarray, plan: LookaheadPlan, n_past: int,
                   rec: Ahead | None = None) -> int | None:
        """The token a session holding ``n_past`` positions will most likely decode next (the
        one its step chose from ``logits``), or None when no next step will come.

        ``rec``: the record of that step, claimed by a caller sampling as ``plan`` does: its
        token and the row's log-sum-exp are kept on it (``Ahead.chosen``), computed here while
        the row is in this thread's cache, so the event loop does not pass over the vocabulary
        again (``ShardEngine._make_result``)."""
        if not np.isfinite(logits).all():
            return None
        token = sampling.choose_token(logits, plan.sampling, n_past)
        if rec is not None:
            greedy_max = logits[token] if plan.sampling.greedy else None
            rec.chosen = (plan.sampling, token, sampling.logsumexp(logits, greedy_max))
        if n_past + 1 > plan.limit or token in plan.stop_tokens:
            return None
        if plan.stop_at_eog and _held.llama_vocab_is_eog(self._vocab, token):
            return None
        return token

    def _lookahead_sync(self) -> bool:
        """Background work of the native thread: one tick of the queued look-ahead steps.
        Returns False when there was nothing to do."""
        book = self._book
        if self._ctx is None or not book.queued():
            return False
        if self._state is not EngineState.READY:  # failed or closing: compute nothing more
            self._post(book.drop_queued())
            return False
        if self._scheduler.has_waiting():
            # Other work waits for a tick: step aside; the claims fall back to it and are
            # batched with it by the planner.
            self._post(book.drop_queued())
            return False
        # Gather: sessions of the last look-ahead tick that have not claimed their step yet are
        # about to (each claim queues that session's next step); one tick keeps them together.
        waited = self._last_ahead
        deadline = time.perf_counter() + min(self._ahead_tick_seconds / 4, MAX_GATHER_SECONDS)
        while waited and book.unclaimed(waited):
            left = deadline - time.perf_counter()
            if left <= 0 or self._native.wait_for_wake(left):
                break
        if self._native.calls_waiting():
            return True  # a call first; this work is offered again after it
        recs = book.take_queued(min(self._scheduler.planner.max_sessions, self._n_batch))
        if not recs:
            return False
        results: list[tuple[Ahead, np.ndarray | None]] = []
        rows: list[Ahead] = []
        for rec in recs:
            held = int(_held.llama_memory_seq_pos_max(self._mem, rec.seq)) + 1
            if held == rec.keep:
                rows.append(rec)
            else:  # the session moved on meanwhile (cannot happen: drops run in this thread)
                results.append((rec, None))
        rows.sort(key=_ahead_seq)  # one ubatch per run of consecutive ids (module docs)
        native = 0.0
        try:
            self._arm_abort(False)
            if rows:  # one call for every row
                self._fill_rows([(r.token, r.keep, r.seq) for r in rows])
                started = time.perf_counter()
                rc = lc.llama_decode(self._ctx, self._batch)
                native += time.perf_counter() - started
                for i, rec in enumerate(rows):
                    ptr = _held.llama_get_logits_ith(self._ctx, i) if rc == 0 else None
                    if ptr:
                        results.append((rec, np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)).copy()))
                    else:
                        _held.llama_memory_seq_rm(self._mem, rec.seq, rec.keep, -1)
                        results.append((rec, None))
        finally:
            for rec in recs:
                if not any(r is rec for r, _ in results):
                    results.append((rec, None))  # an exception stopped this tick
            for rec, chain in book.finish(results, self._count_kv_cells([r.seq for r in recs])):
                # Already claimed: queue the step after it.
                assert rec.logits is not None
                token = self._next_step(rec.logits, chain, rec.keep + 1, rec)
                if token is not None:
                    book.propose(rec.seq, rec.keep + 1, token)
            self._ahead_tick_seconds = native
            self._last_ahead = rows
            self._post(recs, computed=len(rows) if native else 0, native=native)
        return True

    def _fill_rows(self, rows: list[tuple[int, int, int]]) -> None:
        """Write one-token rows ``(token, position, seq)``, each an output, into the batch."""
        assert self._batch is not None and self._batch_row_seq is not None
        for i, (token, pos, seq) in enumerate(rows):
            self._batch_tokens[i] = token
            self._batch_pos[i] = pos
            self._batch_out[i] = 1
            if self._batch_row_seq[i] != seq:
                self._batch_rows[i][0] = seq
                self._batch_row_seq[i] = seq
        self._batch_nseq[: len(rows)] = 1
        self._batch.n_tokens = len(rows)

    def _post(self, recs: list[Ahead], *, computed: int = 0, native: float = 0.0) -> None:
        """Tell the event loop the outcome of ``recs`` (from the native thread): ``computed``
        rows in ``native`` seconds, or (by default) ``recs`` dropped."""
        if not recs or self._trio_token is None:
            return
        wasted = 0 if computed else sum(1 for r in recs if r.logits is not None)
        try:
            self._trio_token.run_sync_soon(self._on_posted, recs, computed, native, wasted)
        except trio.RunFinishedError:  # pragma: no cover - the engine outlived its Trio run
            pass

    def _on_posted(self, recs: list[Ahead], computed: int, native: float, wasted: int) -> None:
        """On the event loop: wake the claims waiting for ``recs`` and count the work."""
        counters = self._counters
        if computed:
            counters["lookahead_steps_total"] += computed
            counters["native_step_us_total"] += int(native * 1e6)
            counters["batch_ticks_total"] += 1
            counters["batch_rows_total"] += computed
            counters["batch_sessions_total"] += computed
        counters["lookahead_dropped_total"] += wasted
        for rec in recs:
            rec.ready = True
            for wake in rec.watchers:
                wake.set()
            chain = rec.chain
            if chain is not None:  # a stream waits for it: delivered in this pass
                rec.chain = None
                self._chain_take(chain, rec)

    def _drop_ahead_sync(self, seq: int, keep: int) -> int:
        """Drop ``seq``'s look-ahead records (before its cells from ``keep`` on change); returns
        the lowest position whose cells must go."""
        gone = self._book.drop_from(seq, 0)
        self._post(gone)
        return min([keep, *(r.keep for r in gone)])

    def _start_sync(self, work: _Work) -> None:
        """Before a compute's first rows: drop its sequence's cells from ``keep`` on and check."""
        slot, keep = work.slot, work.plan.keep
        work.start()
        cut = self._drop_ahead_sync(slot.seq_id, keep)
        if not _held.llama_memory_seq_rm(self._mem, slot.seq_id, cut, -1):
            raise EngineFailure(f"llama.cpp could not truncate the KV cache of {slot.session_id!r}")
        # llama_decode itself rejects a gap only when the sequence still holds cells; an emptied
        # sequence would silently compute from position ``keep`` without history.
        held = int(_held.llama_memory_seq_pos_max(self._mem, slot.seq_id)) + 1
        if held != keep:
            raise EngineFailure(f"the KV cache of {slot.session_id!r} holds {held} positions, the session {keep}")

    def _fill_batch(self, live: list[tuple[_Work, Piece]]) -> int:
        """Write the tick's rows (pieces in sequence order) into the batch; returns the count."""
        assert self._batch is not None and self._batch_row_seq is not None
        row = 0
        for work, piece in live:
            plan, m, seq = work.plan, piece.count, work.slot.seq_id
            a, b = piece.start, piece.start + m
            if plan.tokens is not None:
                self._batch_tokens[row : row + m] = plan.tokens[a:b]
            else:
                self._embd_input.write(self._batch_embd[row : row + m], plan.hidden[a:b])
            pos0 = plan.keep + a
            self._batch_pos[row : row + m] = np.arange(pos0, pos0 + m, dtype=np.int32)
            if self._last and plan.all_logits:
                self._batch_out[row : row + m] = 1  # every position's logits were asked for
            elif self._last:
                # Logits only for the row whose token the session samples.
                self._batch_out[row : row + m] = 0
                if piece.completes:
                    self._batch_out[row + m - 1] = 1
            else:
                # Every row is an output: the last block keeps only output rows (get_rows
                # pruning), and the next shard needs all of them.
                self._batch_out[row : row + m] = 1
            # seq_id is an array of per-row pointers: only rewrite rows that held another sequence.
            for i in np.flatnonzero(self._batch_row_seq[row : row + m] != seq):
                self._batch_rows[row + i][0] = seq
            self._batch_row_seq[row : row + m] = seq
            row += m
        self._batch_nseq[:row] = 1
        self._batch.n_tokens = row
        return row

    def _arm_abort(self, armed: bool) -> None:
        if armed != self._abort_armed:
            callback = self._abort_callback if armed else self._no_abort_callback
            lc.llama_set_abort_callback(self._ctx, callback, None)
            self._abort_armed = armed

    def _raise_decode_error(self, rc: int, slot: Slot) -> None:
        raise self._decode_error(rc, slot, 1)

    def _decode_error(self, rc: int, slot: Slot, n_sessions: int) -> EngineError:
        """The error a session of a failed tick gets for ``llama_decode``'s status ``rc``."""
        sid = slot.session_id
        if rc == 2:
            if slot.cancel.timed_out:  # why the flag is set decides what the step failed with
                return _TimedOutInStep("the step timeout passed inside a llama.cpp step",
                                       session_id=sid)
            if slot.cancel.is_set():
                return _AbortedInStep("operation cancelled inside a llama.cpp step", session_id=sid)
            return EngineFailure("llama_decode aborted without a cancel request")
        if rc == 1:
            shared = f" (in a step shared by {n_sessions} sessions)" if n_sessions > 1 else ""
            return KvCacheFull(f"llama.cpp found no KV slot for session {sid!r}{shared}", session_id=sid)
        return EngineFailure(f"llama_decode failed with status {rc}{_native_reason()}")

    def _truncate_sync(self, seq: int, keep: int) -> None:
        if self._ctx is None:
            return
        try:
            cut = self._drop_ahead_sync(seq, keep)
            if not _held.llama_memory_seq_rm(self._mem, seq, cut, -1):
                raise EngineFailure(f"llama.cpp could not truncate sequence {seq} at {keep}")
        finally:
            self._count_kv_cells_sync([seq])

    def _export_sync(self, seq: int, n_past: int, sid: str) -> bytes:
        """The sequence's cells as llama.cpp writes one sequence's state (positions, and per
        layer its K and V rows), after dropping any step computed ahead."""
        self._truncate_sync(seq, n_past)
        return self._state_bytes_sync(seq, sid)

    def _state_bytes_sync(self, seq: int, sid: str) -> bytes:
        size = int(lc.llama_state_seq_get_size(self._ctx, seq))
        buf = (ctypes.c_uint8 * size)()
        written = int(lc.llama_state_seq_get_data(self._ctx, buf, size, seq))
        if written != size or size == 0:
            raise EngineFailure(f"llama.cpp wrote {written} of {size} bytes of {sid!r}'s state")
        return bytes(buf)

    def _import_sync(self, seq: int, data: bytes, n_past: int, sid: str) -> None:
        """Load a state ``_export_sync`` wrote (on a context of the same model and layout).
        Its cells are checked first (``shard.engine.llama_state``: positions a session may
        hold, each once); llama.cpp checks its layer count, types and row sizes and refuses
        with 0. Anything other than exactly ``[.., n_past)`` held afterwards is undone."""
        assert self._state_format is not None  # (no kv_layout, no import)
        refused = check_cells(data, n_past, self._state_format)  # before llama.cpp trusts them
        if refused:
            raise IncompatibleState(f"the state of {sid!r} cannot be imported: {refused}",
                                    session_id=sid)
        _recent_native_errors.clear()
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        try:
            read = int(lc.llama_state_seq_set_data(self._ctx, buf, len(data), seq))
            held = int(_held.llama_memory_seq_pos_max(self._mem, seq)) + 1
            if read != len(data) or held != n_past:
                _held.llama_memory_seq_rm(self._mem, seq, -1, -1)
                raise IncompatibleState(
                    f"llama.cpp did not resume {sid!r} from the state: it read {read} of "
                    f"{len(data)} bytes and holds {held} of {n_past} positions{_native_reason()}",
                    session_id=sid)
        finally:
            self._count_kv_cells_sync([seq])

    def _count_kv_cells_sync(self, seqs: Any = None) -> None:
        self._book.commit_count(self._count_kv_cells(seqs))

    def _count_kv_cells(self, seqs: Any = None) -> int:
        """Cells held by every sequence id of the context (including ones no session owns, so a
        leak shows up), read from llama.cpp for ``seqs`` (default: all) after an operation
        changed them; the others cannot have changed (only this thread changes cells).
        llama.cpp guarantees positions [pos_min, pos_max] are all present."""
        if self._mem is None:
            return 0
        counts = self._seq_cells
        for seq in range(self._n_seq) if seqs is None else seqs:
            hi = _held.llama_memory_seq_pos_max(self._mem, seq)
            counts[seq] = hi - _held.llama_memory_seq_pos_min(self._mem, seq) + 1 if hi >= 0 else 0
        return sum(counts)

    def _close_sync(self) -> None:
        self._batch_tokens = self._batch_pos = self._batch_nseq = self._batch_out = None
        self._batch_embd = self._tick_hidden = None
        self._batch_rows = []
        self._batch_row_seq = None
        self._model = self._ctx = self._mem = self._vocab = self._batch = None
        self._pieces = {}
        self._post(self._book.drop_all())
        self._book.commit_count(0)
        self._abort_armed = False
        self._natives.close()  # batch, context, thread pool, model: reverse order of creation
        self._boundary = None  # its eval callback is referenced by no context any more
        self._threads = None

    # ---- helpers -----------------------------------------------------------------------------

    def _poll_abort(self, _data: int | None) -> bool:
        # Runs on ggml's compute thread inside llama_decode; must be cheap and must not raise.
        self.abort_polls += 1
        flags = self._decoding
        return bool(flags) and all(flag.is_set() for flag in flags)

    def _require_vocab(self) -> lc.llama_vocab_p:
        if self._vocab is None:
            raise EngineFailure("llama.cpp vocabulary is not loaded")
        return self._vocab

    @staticmethod
    def _meta_str(model: lc.llama_model_p, key: bytes) -> str | None:
        size = 256
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = lc.llama_model_meta_val_str(model, key, buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", "replace")
            size = n + 1
        return None


__all__ = ["LlamaCppEngine", "file_fingerprint", "native_system_info"]
