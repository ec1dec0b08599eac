"""A llama.cpp context's KV cells: truncation, a sequence's state out and in, and the count of
cells every sequence holds. Runs in the engine's native thread only (the context is not
thread-safe; only that thread changes cells).

Moving sessions: one sequence's state is measured at the warm-up (bytes per position and the
rest) and its format learnt (``shard.engine.llama_state``); a context whose state could not be
measured or read reports no ``kv_layout`` and moves no sessions.

One of the modules allowed to use ``ctypes`` and ``llama_cpp`` (tests/test_import_boundary.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable

import llama_cpp.llama_cpp as lc

from .errors import EngineFailure, IncompatibleState, SessionBusy
from .llama_model import LlamaModel
from .llama_native import clear_native_errors, held, native_reason
from .llama_state import StateFormat, check_cells, learn_format
from .lookahead import LookaheadBook

#: Bytes allowed above a state's measured size (``state_bound``): its per-stream header.
_STATE_SLACK = 4096
#: Drops a sequence's steps computed ahead from a position on; returns where its cells must go.
DropAhead = Callable[[int, int], int]


class KvCells:
    """The cells of ``model``'s context; every count goes to ``book`` (which subtracts the
    look-ahead's scratch cells from it)."""

    def __init__(self, model: LlamaModel, book: LookaheadBook) -> None:
        self.model, self.book = model, book
        self.seq_cells: list[int] = []  # KV cells per sequence id (see ``count``)
        self.state_per_position = 0
        self.state_overhead = 0
        self.state_format: StateFormat | None = None
        # A fork's copy between streams that llama.cpp has not performed yet (it does so at the
        # start of the next ``llama_decode``): until then no stream's state is read or written.
        self.copies_pending = False

    def reset(self, n_seq: int) -> None:
        """A fresh context of ``n_seq`` sequences: nothing held."""
        self.seq_cells = [0] * n_seq

    def count(self, seqs: Iterable[int] | None = None) -> int:
        """Cells held by every sequence id of the context (including ones no session owns, so a
        leak shows up), read from llama.cpp for ``seqs`` (default: all) after an operation
        changed them; the others cannot have changed (only this thread changes cells).
        llama.cpp guarantees positions [pos_min, pos_max] are all present."""
        mem = self.model.mem
        if mem is None:
            return 0
        counts = self.seq_cells
        for seq in range(self.model.n_seq) if seqs is None else seqs:
            hi = held.llama_memory_seq_pos_max(mem, seq)
            counts[seq] = hi - held.llama_memory_seq_pos_min(mem, seq) + 1 if hi >= 0 else 0
        return sum(counts)

    def commit(self, seqs: Iterable[int] | None = None) -> None:
        """Count ``seqs``' cells and hand the total to the book."""
        self.book.commit_count(self.count(seqs))

    def truncate_sync(self, seq: int, keep: int, drop_ahead: DropAhead) -> None:
        """Keep positions ``[0, keep)`` of ``seq``; ``drop_ahead(seq, keep)`` first drops its
        steps computed ahead and says from which position cells must go."""
        if self.model.ctx is None:
            return
        try:
            cut = drop_ahead(seq, keep)
            if not held.llama_memory_seq_rm(self.model.mem, seq, cut, -1):
                raise EngineFailure(f"llama.cpp could not truncate sequence {seq} at {keep}")
        finally:
            self.commit([seq])

    def fork_sync(self, source: int, seq: int, n_past: int, sid: str, drop_ahead: DropAhead) -> None:
        """Copy ``source``'s cells ``[0, n_past)`` to the empty ``seq`` (a fork), after dropping
        ``source``'s steps computed ahead.

        Each sequence has a stream of its own (``kv_unified`` is false), and llama.cpp copies
        between streams whole: the cells' positions at once, their K and V rows at the start
        of the next ``llama_decode``, before that call writes a row. Every later step on
        either sequence is therefore computed on the copied rows; only reading or writing a
        stream's state before then (``state_bytes``, ``import_sync``) would miss the copy, so
        those refuse meanwhile (``copies_pending``)."""
        self.truncate_sync(source, n_past, drop_ahead)
        mem = self.model.mem
        try:
            lc.llama_memory_seq_cp(mem, source, seq, -1, -1)
            self.copies_pending = True
            n_held = int(held.llama_memory_seq_pos_max(mem, seq)) + 1
            if n_held != n_past:
                held.llama_memory_seq_rm(mem, seq, -1, -1)
                raise EngineFailure(f"the fork of {sid!r} holds {n_held} of {n_past} positions")
        finally:
            self.commit([seq])

    def move_sync(self, source: int, seq: int) -> None:
        """Move every cell of ``source`` (a prefix cache entry) to the empty ``seq``; ``source``
        is left empty. As a state read and write, done at once: a copy between streams
        (``llama_memory_seq_cp``) is performed only at the next ``llama_decode``, and a session
        that took ``source`` meanwhile could have written its stream first (an import). While a
        fork's copy is pending, state reads are refused until that decode, and then the copy
        joins it instead: performed at the same decode, in order, before any row is written."""
        ctx, mem = self.model.ctx, self.model.mem
        n_held = int(held.llama_memory_seq_pos_max(mem, source)) + 1
        try:
            if self.copies_pending:
                lc.llama_memory_seq_cp(mem, source, seq, -1, -1)
            else:
                data = self.state_bytes(source, f"the prefix cache entry {source}")
                buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
                read = int(lc.llama_state_seq_set_data(ctx, buf, len(data), seq))
                if read != len(data):
                    raise EngineFailure(f"llama.cpp read {read} of {len(data)} bytes moving a "
                                        f"prefix cache entry{native_reason()}")
            moved = int(held.llama_memory_seq_pos_max(mem, seq)) + 1
            if moved != n_held:
                held.llama_memory_seq_rm(mem, seq, -1, -1)
                raise EngineFailure(f"a moved prefix cache entry holds {moved} of {n_held} positions")
        finally:
            held.llama_memory_seq_rm(mem, source, -1, -1)
            self.commit([source, seq])

    def decoded(self, rc: int) -> None:
        """A ``llama_decode`` returned ``rc``: a successful one performed every pending copy."""
        if rc == 0:
            self.copies_pending = False

    def _check_no_copy(self, sid: str) -> None:
        if self.copies_pending:
            raise SessionBusy(f"a fork's copy is pending until the next step: {sid!r}'s state "
                              "cannot be read or written before it", session_id=sid)

    def export_sync(self, seq: int, n_past: int, sid: str, drop_ahead: DropAhead) -> bytes:
        """The sequence's cells as llama.cpp writes one sequence's state (positions, and per
        layer its K and V rows), after dropping any step computed ahead."""
        self.truncate_sync(seq, n_past, drop_ahead)
        return self.state_bytes(seq, sid)

    def state_bytes(self, seq: int, sid: str) -> bytes:
        self._check_no_copy(sid)
        ctx = self.model.ctx
        size = int(lc.llama_state_seq_get_size(ctx, seq))
        buf = (ctypes.c_uint8 * size)()
        written = int(lc.llama_state_seq_get_data(ctx, buf, size, seq))
        if written != size or size == 0:
            raise EngineFailure(f"llama.cpp wrote {written} of {size} bytes of {sid!r}'s state")
        return bytes(buf)

    def state_size(self, seq: int) -> int:
        return int(lc.llama_state_seq_get_size(self.model.ctx, seq))

    def import_sync(self, seq: int, data: bytes, n_past: int, sid: str) -> None:
        """Load a state ``export_sync`` wrote (on a context of the same model and layout).
        Its cells are checked first (``shard.engine.llama_state``: positions a session may
        hold, each once); llama.cpp checks its layer count, types and row sizes and refuses
        with 0. Anything other than exactly ``[.., n_past)`` held afterwards is undone."""
        assert self.state_format is not None  # (no kv_layout, no import)
        self._check_no_copy(sid)
        refused = check_cells(data, n_past, self.state_format)  # before llama.cpp trusts them
        if refused:
            raise IncompatibleState(f"the state of {sid!r} cannot be imported: {refused}",
                                    session_id=sid)
        clear_native_errors()
        ctx, mem = self.model.ctx, self.model.mem
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        try:
            read = int(lc.llama_state_seq_set_data(ctx, buf, len(data), seq))
            n_held = int(held.llama_memory_seq_pos_max(mem, seq)) + 1
            if read != len(data) or n_held != n_past:
                held.llama_memory_seq_rm(mem, seq, -1, -1)
                raise IncompatibleState(
                    f"llama.cpp did not resume {sid!r} from the state: it read {read} of "
                    f"{len(data)} bytes and holds {n_held} of {n_past} positions{native_reason()}",
                    session_id=sid)
        finally:
            self.commit([seq])

    def learn(self, sizes: list[int], chunk: int) -> None:
        """Measure the state from the warm-up: ``sizes`` of sequence 0 after ``chunk``
        positions and after one more (kept only when its format is one this worker reads)."""
        if len(sizes) == 2 and sizes[1] > sizes[0] > 0:
            self.state_format = learn_format(self.state_bytes(0, "the warm-up"))
            if self.state_format is not None:
                self.state_per_position = sizes[1] - sizes[0]
                self.state_overhead = max(0, sizes[0] - chunk * self.state_per_position)

    def state_bound(self, n_past: int) -> int:
        """The most bytes a state of ``n_past`` positions takes: cells of every layer as
        measured on the warm-up's sequence, and a header per stream."""
        return self.state_overhead + n_past * self.state_per_position + _STATE_SLACK

    def layout(self) -> str:
        """The state layout two contexts must share to move a session: the blocks, the width,
        what one position's cells take (their types and head sizes) and the attention kernel
        choice (flash attention keeps V untransposed); llama.cpp checks the rest on import."""
        fmt, m = self.state_format, self.model
        if not self.state_per_position or fmt is None or m.served is None:
            return ""  # the warm-up could not measure or read a state: sessions are not moved
        fa = {None: "auto", True: "on", False: "off"}[m.flash_attn]
        return (f"llama.cpp-seq-state/{m.arch}/blocks={m.served.count}/n_embd={m.n_embd}/"
                f"cell={self.state_per_position}B/streams={fmt.n_stream}/"
                f"ext={int(fmt.ext)}/fa={fa}")


__all__ = ["KvCells"]
