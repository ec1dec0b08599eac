"""The rows of a llama.cpp context's one ``llama_batch``, written through numpy views.

Rows are written in increasing sequence order by the callers (the planner's ticks and the
look-ahead's alike): with one KV stream per sequence, llama.cpp splits a batch into one ubatch
per run of rows whose sequence ids go up one by one, and every ubatch reads all the weights
again (``shard.engine.llama``, module docs).

One of the modules allowed to use ``ctypes`` and ``llama_cpp`` (tests/test_import_boundary.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import llama_cpp.llama_cpp as lc
import numpy as np

from .layer_ranges import EmbdInput

if TYPE_CHECKING:
    from .batching import Piece
    from .scheduler import Job


class BatchRows:
    """Views of ``batch``'s arrays (token ids on a first shard, hidden-state rows otherwise),
    and which sequence each row's ``seq_id`` pointer last named, so a row is rewritten only
    when it changes sequence. The batch itself is freed by its owner (``LlamaModel``)."""

    def __init__(self, batch: lc.llama_batch, n_batch: int, *, first: bool, last: bool,
                 n_embd: int, embd_input: EmbdInput) -> None:
        self.batch = batch
        self.n_batch = n_batch
        self.first, self.last = first, last
        self.embd_input = embd_input
        self.tokens: Any = None
        self.embd: Any = None  # [n_batch, n_embd] input rows (non-first)
        if first:
            self.tokens = np.ctypeslib.as_array(batch.token, shape=(n_batch,))
        else:
            embd = np.ctypeslib.as_array(batch.embd, shape=(n_batch * n_embd,))
            self.embd = embd.reshape(n_batch, n_embd)
        self.pos = np.ctypeslib.as_array(batch.pos, shape=(n_batch,))
        self.nseq = np.ctypeslib.as_array(batch.n_seq_id, shape=(n_batch,))
        self.out = np.ctypeslib.as_array(batch.logits, shape=(n_batch,))
        self.rows = [batch.seq_id[i] for i in range(n_batch)]  # per-row seq_id pointers
        self.row_seq = np.full(n_batch, -1, dtype=np.int64)

    def fill(self, live: list[tuple[Job, Piece]]) -> int:
        """Write a tick's rows (pieces in sequence order) into the batch; returns the count."""
        tokens, pos, out, rows, row_seq = self.tokens, self.pos, self.out, self.rows, self.row_seq
        last = self.last
        row = 0
        for work, piece in live:
            plan, m, seq = work.plan, piece.count, work.slot.seq_id
            a, b = piece.start, piece.start + m
            if plan.tokens is not None:
                tokens[row : row + m] = plan.tokens[a:b]
            else:
                self.embd_input.write(self.embd[row : row + m], plan.hidden[a:b])
            pos0 = plan.keep + a
            pos[row : row + m] = np.arange(pos0, pos0 + m, dtype=np.int32)
            if last and plan.all_logits:
                out[row : row + m] = 1  # every position's logits were asked for
            elif last:
                # Logits only for the row whose token the session samples.
                out[row : row + m] = 0
                if piece.completes:
                    out[row + m - 1] = 1
            else:
                # Every row is an output: the last block keeps only output rows (get_rows
                # pruning), and the next shard needs all of them.
                out[row : row + m] = 1
            # seq_id is an array of per-row pointers: only rewrite rows that held another sequence.
            for i in np.flatnonzero(row_seq[row : row + m] != seq):
                rows[row + i][0] = seq
            row_seq[row : row + m] = seq
            row += m
        self.nseq[:row] = 1
        self.batch.n_tokens = row
        return row

    def fill_rows(self, rows: list[tuple[int, int, int]]) -> None:
        """Write one-token rows ``(token, position, seq)``, each an output, into the batch."""
        tokens, pos, out, ptrs, row_seq = self.tokens, self.pos, self.out, self.rows, self.row_seq
        for i, (token, position, seq) in enumerate(rows):
            tokens[i] = token
            pos[i] = position
            out[i] = 1
            if row_seq[i] != seq:
                ptrs[i][0] = seq
                row_seq[i] = seq
        self.nseq[: len(rows)] = 1
        self.batch.n_tokens = len(rows)

    def fill_run(self, start: int, count: int, token: int) -> None:
        """Write positions ``start..start+count`` of sequence 0, ``token`` each (zero rows on a
        non-first shard), with the last row an output (every row on a non-last shard): the
        warm-up's steps."""
        if self.first:
            self.tokens[:count] = token
        else:
            self.embd[:count] = 0.0
        self.pos[:count] = np.arange(start, start + count, dtype=np.int32)
        self.out[:count] = 0 if self.last else 1
        self.out[count - 1] = 1
        for i in range(count):
            self.rows[i][0] = 0
        self.row_seq[:count] = 0
        self.nseq[:count] = 1
        self.batch.n_tokens = count


__all__ = ["BatchRows"]
