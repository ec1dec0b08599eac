"""The native handles of a loaded llama.cpp model: model, context, KV memory, vocabulary and
batch, loaded together and freed together, plus what is read from them (metadata, vocabulary,
chat template, capabilities).

One owner for the handles' lifetime: ``open`` creates everything in one ``ExitStack`` and
commits only when all of it exists; ``close`` frees it explicitly and exactly once (nothing
relies on ``__del__``). The boundary capture (with its eval callback) and the abort callback
are kept here until the context is freed, so neither can be collected while native code may
call it. The other parts of
the engine read these attributes; only ``open`` and ``close`` write them.

One of the modules allowed to use ``ctypes`` and ``llama_cpp`` (tests/test_import_boundary.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os

import llama_cpp.llama_cpp as lc

from shard.layers import LayerRange
from shard.models.fingerprint import file_fingerprint
from shard.models.header import ModelInfo, SliceError, read_model_info

from .base import CancelFlag
from .batching import TickPlanner
from .errors import EngineFailure, IllegalTransition, InvalidInput
from .layer_ranges import EmbdInput, check_loadable, range_support, served_range
from .llama_batch import BatchRows
from .llama_capture import BoundaryCapture
from .llama_embed import EmbedContext, pooling_name
from .llama_native import (
    LLAMA_MAX_SEQ,
    LLAMA_TOKEN_NULL,
    check_model_file,
    clear_native_errors,
    default_threads,
    ensure_native_init,
    held,
    native_reason,
    native_system_info,
)
from .llama_threads import ComputeThreads
from .prefix_cache import reserved_entries
from .types import Capabilities, ChatTemplate, LoadSpec

log = logging.getLogger("shard.engine.llama")


class AbortSwitch:
    """The context's abort callback (ggml polls it after every graph node of a running
    ``llama_decode``), set on the context only while armed (``shard.engine.llama_tick`` says
    when). Its ctypes callback objects live as long as the model, so none can be collected
    while native code may call it."""

    def __init__(self) -> None:
        #: Number of abort-callback polls so far; it grows only while a native decode runs.
        self.polls = 0
        #: The cancel flags of the running tick: the callback aborts when all of them are set.
        self.decoding: tuple[CancelFlag, ...] = ()
        self.armed = False
        self._callback = lc.ggml_abort_callback(self._poll)
        self._no_callback = lc.ggml_abort_callback()  # NULL function pointer

    def arm(self, ctx: lc.llama_context_p, armed: bool) -> None:
        if armed != self.armed:
            lc.llama_set_abort_callback(ctx, self._callback if armed else self._no_callback, None)
            self.armed = armed

    def _poll(self, _data: int | None) -> bool:
        # Runs on ggml's compute thread inside llama_decode; must be cheap and must not raise.
        self.polls += 1
        flags = self.decoding
        return bool(flags) and all(flag.is_set() for flag in flags)


class LlamaModel:
    """One loaded model and its context (``None`` handles before ``open`` and after ``close``)."""

    def __init__(self, *, n_ubatch: int, flash_attn: bool | None) -> None:
        self.n_ubatch_opt, self.flash_attn = n_ubatch, flash_attn
        self._natives = contextlib.ExitStack()
        self.model: lc.llama_model_p | None = None
        self.ctx: lc.llama_context_p | None = None
        self.mem: lc.llama_memory_t | None = None
        self.vocab: lc.llama_vocab_p | None = None
        self.batch: lc.llama_batch | None = None
        self.rows: BatchRows | None = None
        self.abort = AbortSwitch()
        # Layer range: which end of the model this shard is; the boundary capture (non-last).
        self.first = self.last = True
        self.boundary: BoundaryCapture | None = None
        # The context's ggml thread pool (shard.engine.llama_threads), with more than one thread.
        self.threads: ComputeThreads | None = None
        #: The pooling type the model declares ("" none) and, for a whole model with one, the
        #: context that computes its embeddings (``shard.engine.llama_embed``).
        self.pooling = ""
        self.embedder: EmbedContext | None = None
        self.n_batch = self.n_vocab = self.n_embd = self.n_seq = self.n_threads = 0
        self.n_ctx_seq = self.n_layers_total = 0
        #: Sequences beyond the sessions' kept for the prefix cache's entries, and what the
        #: cache does here (or why it is off).
        self.cache_entries = 0
        self.cache_detail = ""
        #: Sliding-window attention layers (``llama_model_n_swa`` > 0): a sequence's state then
        #: holds only the window's cells in its SWA cache, so an entry is not moved through it.
        self.swa = False
        self.info: ModelInfo | None = None
        self.served: LayerRange | None = None
        self.arch = "unknown"
        self.fingerprint = ""
        #: token id -> piece, filled as tokens are seen (a token's piece never changes)
        self.pieces: dict[int, bytes] = {}

    def open(self, spec: LoadSpec) -> None:
        """Load ``spec``'s model and create its context (in the native thread)."""
        path = check_model_file(spec.model_path)
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
        ensure_native_init()
        clear_native_errors()

        with contextlib.ExitStack() as natives:
            mparams = lc.llama_model_default_params()
            mparams.n_gpu_layers = 0
            mparams.use_extra_bufts = spec.use_extra_bufts
            model = lc.llama_model_load_from_file(os.fsencode(path), mparams)
            if not model:
                raise InvalidInput(f"llama.cpp could not load {str(path)!r}{native_reason()}")
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
            swa = int(lc.llama_model_n_swa(model)) > 0
            arch = _meta_str(model, b"general.architecture") or "unknown"
            boundary = None if last else BoundaryCapture(n_layer, n_embd)
            entries, cache_detail = _cache_layout(model, spec, n_ctx_per_session)

            n_seq_max = spec.max_sessions + entries
            if spec.n_batch < n_seq_max:
                # llama.cpp reserves an output row per sequence within n_batch and aborts the
                # whole process (GGML_ASSERT on n_outputs_max) when n_batch is smaller.
                raise InvalidInput(
                    f"n_batch {spec.n_batch} is smaller than the {n_seq_max} sequences the worker "
                    f"keeps ({spec.max_sessions} sessions + {entries} prefix cache entries): raise "
                    "--batch, or lower --max-sessions or --prefix-cache-tokens")
            cparams = lc.llama_context_default_params()
            # Every sequence, a session's or a cache entry's, gets a stream of the same size.
            cparams.n_ctx = spec.n_ctx + entries * n_ctx_per_session
            cparams.n_batch = spec.n_batch
            cparams.n_ubatch = min(spec.n_batch, self.n_ubatch_opt)
            cparams.n_seq_max = n_seq_max
            threads = spec.n_threads or default_threads()
            cparams.n_threads = threads
            cparams.n_threads_batch = threads
            cparams.kv_unified = False
            cparams.embeddings = False
            cparams.offload_kqv = False
            cparams.no_perf = True
            if boundary is not None:
                # The callback object stays referenced (self.boundary) until the context is freed.
                cparams.cb_eval = boundary.callback
                cparams.cb_eval_user_data = None
            flash_attn = None if self.flash_attn is None else (
                lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED)
            if flash_attn is not None:
                cparams.flash_attn_type = flash_attn
            # The pool outlives the context that computes on it: registered before it, freed after it.
            pool = ComputeThreads(threads) if threads > 1 else None
            if pool is not None:
                natives.callback(pool.close)
            ctx = lc.llama_init_from_model(model, cparams)
            if not ctx:
                raise EngineFailure(f"llama.cpp could not create a context{native_reason()}")
            natives.callback(lc.llama_free, ctx)
            if pool is not None:
                pool.attach(ctx)

            # (A context made without a pooling type takes the model's; with embeddings off
            # it pools nothing, so this one generates as any other model's.)
            pooling = pooling_name(ctx)
            embedder = None
            if EmbedContext.wanted(pooling, whole=first and last):
                embedder = EmbedContext()
                embedder.open(model, n_ctx_per_session, threads=threads, pool=pool, flash_attn=flash_attn)
                natives.callback(embedder.close)  # freed before the pool and the model

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

            # Commit: from here on this object owns the handles (freed by close).
            self.model, self.ctx, self.mem, self.vocab, self.batch = model, ctx, mem, vocab, batch
            self.n_batch, self.n_vocab, self.n_embd = n_batch, n_vocab, n_embd
            self.n_seq, self.cache_entries, self.cache_detail = spec.max_sessions + entries, entries, cache_detail
            self.swa = swa
            self.n_threads, self.n_ctx_seq, self.n_layers_total = threads, n_ctx_seq, n_layers_total
            self.first, self.last = first, last
            self.boundary, self.threads = boundary, pool
            self.pooling, self.embedder = pooling, embedder
            self.info, self.served, self.arch, self.fingerprint = info, served, arch, fingerprint
            self.rows = BatchRows(batch, n_batch, first=first, last=last, n_embd=n_embd,
                                  embd_input=EmbdInput.for_model(info, first=first))
            self._natives = natives.pop_all()
        log.debug(
            "loaded %s: arch=%s layers=[%d, %d) of %d n_ctx=%d n_ctx_seq=%d n_batch=%d threads=%d",
            path, arch, served.start, served.end, n_layers_total, spec.n_ctx, n_ctx_seq, n_batch, threads,
        )

    def planner(self, spec: LoadSpec) -> TickPlanner:
        """The tick planner for this context. Non-last shards never mix a prompt chunk with
        other sessions' rows: llama.cpp would reorder them into ubatches, and captured rows must
        come back in batch order."""
        return TickPlanner(
            min(spec.batch_tokens or self.n_batch, self.n_batch),
            min(spec.max_batch_sessions or spec.max_sessions, spec.max_sessions),
            mix=self.last,
        )

    def capabilities(self, spec: LoadSpec, kv_layout: str) -> Capabilities:
        vocab, info = self.vocab, self.info
        bos, eos = int(lc.llama_vocab_bos(vocab)), int(lc.llama_vocab_eos(vocab))
        return Capabilities(
            engine="llama.cpp",
            model_fingerprint=self.fingerprint,
            architecture=self.arch,
            n_layers_total=self.n_layers_total,
            layer_range=self.served,
            n_embd=self.n_embd,
            # A middle slice holds a stub vocabulary: report the model's.
            n_vocab=(info.source_n_vocab if info is not None else None) or self.n_vocab,
            n_ctx=spec.n_ctx,
            n_ctx_per_session=spec.n_ctx // spec.max_sessions,
            max_sessions=spec.max_sessions,
            bos_token_id=None if bos == LLAMA_TOKEN_NULL else bos,
            eos_token_id=None if eos == LLAMA_TOKEN_NULL else eos,
            system_info=native_system_info(use_extra_bufts=spec.use_extra_bufts, threads=self.n_threads),
            max_token_bytes=self._max_token_bytes(),
            layer_ranges=range_support(info, self.arch),
            chat=self._chat_template() if self.first else ChatTemplate(),
            kv_layout=kv_layout,
            prefix_cache_tokens=spec.prefix_cache_tokens if self.cache_entries else 0,
            prefix_cache_detail=self.cache_detail,
            pooling_type=self.pooling,
        )

    def close(self) -> None:
        """Free batch, context, thread pool and model (reverse order of creation); idempotent."""
        self.rows = None
        self.abort.armed = False
        self.model = self.ctx = self.mem = self.vocab = self.batch = None
        self.pieces = {}
        self._natives.close()
        self.boundary = None  # its eval callback is referenced by no context any more
        self.threads = self.embedder = None

    # ---- the vocabulary (reads only immutable data: called inline, on the event loop) -------

    def tokenize(self, text: str, add_bos: bool, parse_special: bool) -> list[int]:
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

    def token_piece(self, token_id: int) -> bytes:
        if not (self.first or self.last):
            raise IllegalTransition("a middle shard holds no vocabulary (its slice has a stub)")
        piece = self.pieces.get(token_id)  # a token's piece never changes: one call per token
        if piece is not None:
            return piece
        vocab = self._require_vocab()
        size = 64
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = held.llama_token_to_piece(vocab, token_id, buf, size, 0, False)
            if n >= 0:
                self.pieces[token_id] = piece = buf.raw[:n]
                return piece
            size = -n
        raise EngineFailure("llama_token_to_piece disagreed with itself about the piece size")

    def is_eog(self, token_id: int) -> bool:
        return bool(held.llama_vocab_is_eog(self._require_vocab(), token_id))

    def _require_vocab(self) -> lc.llama_vocab_p:
        if self.vocab is None:
            raise EngineFailure("llama.cpp vocabulary is not loaded")
        return self.vocab

    def _max_token_bytes(self) -> int:
        """An upper bound of a token's bytes: a token's text as stored (SPM's "\u2581" for a
        space, byte tokens as "<0x41>") is never shorter than the text it stands for. Only first
        shards tokenize (a later slice's stub vocabulary has no type to ask)."""
        if not self.first:
            return 0
        vocab = self.vocab
        return max((len(lc.llama_vocab_get_text(vocab, i) or b"") for i in range(self.n_vocab)), default=0)

    def _chat_template(self) -> ChatTemplate:
        """The model's own chat template (GGUF ``tokenizer.chat_template``) and the texts of its
        BOS, EOS and end-of-turn tokens as the template writes them."""
        vocab = self.vocab
        raw = lc.llama_model_chat_template(self.model, None)

        def text(token: int) -> str:
            if token == LLAMA_TOKEN_NULL:
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


def _cache_layout(model: lc.llama_model_p, spec: LoadSpec, n_ctx_per_session: int) -> tuple[int, str]:
    """The sequences to reserve for the prefix cache's entries, and what it does or why not.

    An entry is a released session's stream kept whole (``kv_unified`` is false: a copy
    between streams copies a whole stream, ``llama_kv_cache::seq_cp``), so the budget buys
    ``ceil(budget / n_ctx_per_session)`` more streams of a session's size, in memory as many
    more sessions' KV would take. A recurrent or hybrid model's state is one row per sequence,
    not cells by position: a copy could not be cut back to a shared prefix, so the cache is
    off there."""
    if spec.prefix_cache_tokens == 0:
        return 0, "off (budget 0)"
    if lc.llama_model_is_recurrent(model) or lc.llama_model_is_hybrid(model):
        return 0, "off: a recurrent or hybrid model's state cannot be cut back to a prefix"
    entries = reserved_entries(spec.prefix_cache_tokens, n_ctx_per_session)
    if spec.max_sessions + entries > LLAMA_MAX_SEQ:
        raise InvalidInput(
            f"a prefix cache of {spec.prefix_cache_tokens} tokens takes {entries} sequences of "
            f"{n_ctx_per_session} beside {spec.max_sessions} sessions; llama.cpp allows "
            f"{LLAMA_MAX_SEQ} in all")
    return entries, (f"released histories kept whole in {entries} more sequences of "
                     f"{n_ctx_per_session} cells, copied to a new session's stream")


def _meta_str(model: lc.llama_model_p, key: bytes) -> str | None:
    """A string value of the model's GGUF metadata (None when it has no such key)."""
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


__all__ = ["AbortSwitch", "LlamaModel"]
