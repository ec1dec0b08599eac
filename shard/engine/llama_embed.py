"""Pooled embeddings on llama.cpp: a second, small context of the same model that computes them.

Why a context of its own rather than a sequence of the serving context: llama.cpp pools only in
a context created with ``embeddings = true``, and such a context makes every row of a batch an
output (``llama_context::decode``, "pooled embedding requires that all tokens are output") and
pools per ubatch, so a sequence split over two ubatches would be pooled from its last one only.
Switching the serving context over (``llama_set_embeddings``) would change what every batched
step of every session computes, and a transient sequence there would take a session's id and
its stream. This context holds one sequence of ``n_ctx_per_session`` cells and takes a whole
input as one ubatch (``n_batch = n_ubatch =`` its cells), so the mean, CLS or last row is
pooled from the whole input, as llama-server requires (it refuses an input over its physical
batch). The sequence is emptied after every call: no cell outlives an embedding. It computes on
the serving context's thread pool, in the engine's one native thread (a context is not
thread-safe), so an embedding waits for the running step and a step for a running embedding.

Its price: one more KV stream of a session's size and a compute buffer for a ubatch of that
many rows, paid only by a whole model that declares a pooling type (docs/engine.md,
"Embeddings").

One of the modules allowed to use ``ctypes`` and ``llama_cpp`` (tests/test_import_boundary.py).
"""

from __future__ import annotations

import contextlib

import llama_cpp.llama_cpp as lc
import numpy as np

from .errors import EngineFailure
from .llama_native import native_reason
from .llama_threads import ComputeThreads

#: llama.cpp's pooling types by number (``enum llama_pooling_type``), named as
#: ``Capabilities.pooling_type`` names them; NONE and UNSPECIFIED are "".
POOLING_NAMES = {
    lc.LLAMA_POOLING_TYPE_MEAN: "mean",
    lc.LLAMA_POOLING_TYPE_CLS: "cls",
    lc.LLAMA_POOLING_TYPE_LAST: "last",
    lc.LLAMA_POOLING_TYPE_RANK: "rank",
}
#: The types whose pooled row is an embedding (a RANK head gives a score).
_EMBEDDING_TYPES = (lc.LLAMA_POOLING_TYPE_MEAN, lc.LLAMA_POOLING_TYPE_CLS, lc.LLAMA_POOLING_TYPE_LAST)


def pooling_name(ctx: lc.llama_context_p) -> str:
    """The pooling type a context took from its model (it is created with UNSPECIFIED)."""
    return POOLING_NAMES.get(int(lc.llama_pooling_type(ctx)), "")


class EmbedContext:
    """The embedding context (see the module docs): ``open`` it beside the serving context,
    ``embed_sync`` in the native thread, ``close`` before the model is freed."""

    def __init__(self) -> None:
        self._natives = contextlib.ExitStack()
        self.ctx: lc.llama_context_p | None = None
        self._batch: lc.llama_batch | None = None
        self._mem: lc.llama_memory_t | None = None
        self.n_tokens = self.n_embd = 0

    @staticmethod
    def wanted(pooling: str, *, whole: bool) -> bool:
        """Whether a model with this pooling type, served whole or not, needs one."""
        return whole and pooling in (POOLING_NAMES[t] for t in _EMBEDDING_TYPES)

    def open(self, model: lc.llama_model_p, n_tokens: int, *, threads: int,
             pool: ComputeThreads | None, flash_attn: int | None) -> None:
        """A context of ``model`` that embeds inputs of up to ``n_tokens`` ids."""
        with contextlib.ExitStack() as natives:
            cparams = lc.llama_context_default_params()
            cparams.n_ctx = n_tokens
            cparams.n_batch = cparams.n_ubatch = n_tokens  # a whole input is one ubatch
            cparams.n_seq_max = 1
            cparams.n_threads = cparams.n_threads_batch = threads
            cparams.embeddings = True  # the pooling type stays UNSPECIFIED: the model's
            cparams.offload_kqv = False
            cparams.no_perf = True
            if flash_attn is not None:
                cparams.flash_attn_type = flash_attn
            ctx = lc.llama_init_from_model(model, cparams)
            if not ctx:
                raise EngineFailure(f"llama.cpp could not create the embedding context{native_reason()}")
            natives.callback(lc.llama_free, ctx)
            if int(lc.llama_pooling_type(ctx)) not in _EMBEDDING_TYPES:
                raise EngineFailure("the embedding context pools no embeddings")
            if pool is not None:
                pool.attach(ctx)
            n_batch = int(lc.llama_n_batch(ctx))
            if n_batch < n_tokens or int(lc.llama_n_ubatch(ctx)) < n_tokens:
                raise EngineFailure(f"llama.cpp caps the embedding context's batch at {n_batch} "
                                    f"rows, fewer than the {n_tokens} of one input")
            batch = lc.llama_batch_init(n_tokens, 0, 1)
            natives.callback(lc.llama_batch_free, batch)
            mem = lc.llama_get_memory(ctx)
            if not mem:
                raise EngineFailure("the embedding context has no KV memory")
            self.ctx, self._batch, self._mem = ctx, batch, mem
            self.n_tokens, self.n_embd = n_tokens, int(lc.llama_model_n_embd_out(model))
            self._natives = natives.pop_all()

    def embed_sync(self, tokens: tuple[int, ...]) -> np.ndarray:
        """The pooled, not normalized, embedding of ``tokens`` (checked by the caller: 1 to
        ``n_tokens`` ids of the vocabulary). The sequence is emptied whatever happens."""
        ctx, batch, mem = self.ctx, self._batch, self._mem
        if ctx is None or batch is None or mem is None:
            raise EngineFailure("the embedding context is closed")
        n = len(tokens)
        if not 0 < n <= self.n_tokens:
            raise EngineFailure(f"{n} ids for an embedding context of {self.n_tokens}")
        np.ctypeslib.as_array(batch.token, shape=(n,))[:] = tokens
        np.ctypeslib.as_array(batch.pos, shape=(n,))[:] = np.arange(n)
        np.ctypeslib.as_array(batch.n_seq_id, shape=(n,))[:] = 1
        np.ctypeslib.as_array(batch.logits, shape=(n,))[:] = 1  # every row is an output here
        for i in range(n):
            batch.seq_id[i][0] = 0
        batch.n_tokens = n
        try:
            rc = lc.llama_decode(ctx, batch)
            if rc != 0:
                raise EngineFailure(f"llama_decode failed on an embedding (rc={rc}){native_reason()}")
            row = lc.llama_get_embeddings_seq(ctx, 0)
            if not row:
                raise EngineFailure("llama.cpp pooled no embedding")
            return np.ctypeslib.as_array(row, shape=(self.n_embd,)).copy()
        finally:
            lc.llama_memory_seq_rm(mem, 0, -1, -1)

    def cells_used(self) -> int:
        """Positions its sequence holds (0 between calls: nothing outlives an embedding)."""
        if self._mem is None:
            return 0
        return int(lc.llama_memory_seq_pos_max(self._mem, 0)) + 1

    def close(self) -> None:
        """Free the batch and the context (before the model); idempotent."""
        self.ctx = self._batch = self._mem = None
        self._natives.close()


__all__ = ["POOLING_NAMES", "EmbedContext", "pooling_name"]
