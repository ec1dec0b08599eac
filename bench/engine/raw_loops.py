"""The ceilings: greedy decode straight on llama-cpp-python, without the worker.

* ``RawDecoder``: llama-cpp-python's low-level (ctypes) API, one context configured like the
  worker's (``n_seq_max`` sequences, one KV stream each, with more than one thread the
  worker's compute thread pool). ``run(n_seq, n_tokens)`` prefills
  ``n_seq`` sequences, then times ``n_tokens`` steps that each advance every sequence by one
  token in **one** ``llama_decode`` (1 sequence: the plain single-stream ceiling; N sequences:
  what batching concurrent sessions could reach).
* ``LlamaBaseline``: llama-cpp-python's high-level ``Llama.generate``, the way most users run
  it. The clock starts at the first token (after the prompt was evaluated), so the timed part
  evaluates exactly ``n_tokens`` single tokens. (The old bench called ``eval(prompt)`` and then
  ``generate(prompt, reset=False)``, which evaluates the prompt a second time inside the timed
  loop.)

Both report how many tokens llama.cpp itself counted as evaluated during the timed part
(``llama_perf_context``: ``n_eval`` single-token evaluations plus ``n_p_eval`` batched tokens),
so a harness test can check that the timed loop does exactly the requested work.

bench/ may use llama_cpp directly; the worker's code (shard/) may not.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class LoopResult:
    """One timed loop: ``tokens`` generated in ``seconds``; llama.cpp counted ``evaluated``."""

    tokens: int
    seconds: float
    evaluated: int
    first_tokens: tuple[int, ...] = ()  # the greedy tokens of sequence 0 (a sanity check)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def _quiet_llama_logs() -> None:
    """llama-cpp-python prints every llama.cpp log line until told otherwise."""
    from llama_cpp import _logger

    _logger.set_verbose(False)


def _evaluated(lc, ctx) -> int:  # noqa: ANN001 - ctypes handles
    lc.llama_synchronize(ctx)  # the counters are updated when the context synchronizes
    perf = lc.llama_perf_context(ctx)
    # llama.cpp reports max(1, count); a count whose accumulated time is zero is really 0.
    single = int(perf.n_eval) if perf.t_eval_ms > 0 else 0
    batched = int(perf.n_p_eval) if perf.t_p_eval_ms > 0 else 0
    return single + batched


class RawDecoder:
    """A low-level llama.cpp context for ``n_seq_max`` sequences (a context manager)."""

    def __init__(self, model: Path, *, n_ctx: int, n_seq_max: int, threads: int, n_batch: int = 512) -> None:
        import llama_cpp.llama_cpp as lc

        _quiet_llama_logs()
        lc.llama_backend_init()
        self._lc = lc
        self.n_seq_max = n_seq_max
        self.n_ctx_seq = 0
        self._model = self._ctx = None
        self._batch = None
        self._threads = None
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self._model = lc.llama_model_load_from_file(os.fsencode(model), mparams)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {model}")
        try:
            cparams = lc.llama_context_default_params()
            cparams.n_ctx = n_ctx
            cparams.n_batch = n_batch
            cparams.n_ubatch = n_batch
            cparams.n_seq_max = n_seq_max
            cparams.n_threads = cparams.n_threads_batch = threads
            cparams.kv_unified = False  # one KV stream per sequence, as the worker does
            cparams.offload_kqv = False
            cparams.no_perf = False  # keep llama.cpp's evaluation counters
            self._ctx = lc.llama_init_from_model(self._model, cparams)
            if not self._ctx:
                raise RuntimeError("llama.cpp could not create a context")
            if threads > 1:  # the worker's compute threads (docs/engine.md, "Compute threads")
                from shard.engine.llama_threads import ComputeThreads

                self._threads = ComputeThreads(threads)
                self._threads.attach(self._ctx)
            self.n_ctx_seq = int(lc.llama_n_ctx_seq(self._ctx))
            self._vocab = lc.llama_model_get_vocab(self._model)
            self.n_vocab = int(lc.llama_vocab_n_tokens(self._vocab))
            self.eos = int(lc.llama_vocab_eos(self._vocab))
            self._batch = lc.llama_batch_init(max(n_batch, n_seq_max), 0, 1)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> RawDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        lc = self._lc
        if self._batch is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            lc.llama_free(self._ctx)
            self._ctx = None
        if self._threads is not None:  # after the context that computed on it
            self._threads.close()
            self._threads = None
        if self._model:
            lc.llama_model_free(self._model)
            self._model = None

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buf = (self._lc.llama_token * (len(data) + 8))()
        n = self._lc.llama_tokenize(self._vocab, data, len(data), buf, len(buf), True, False)
        if n < 0:
            raise RuntimeError("tokenize failed")
        return list(buf[:n])

    def _fill(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """rows: (token, position, sequence, wants logits)."""
        b = self._batch
        b.n_tokens = len(rows)
        for i, (tok, pos, seq, out) in enumerate(rows):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = out

    def _decode(self) -> None:
        rc = self._lc.llama_decode(self._ctx, self._batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, row: int) -> int:
        ptr = self._lc.llama_get_logits_ith(self._ctx, row)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def run(
        self, prompt: list[int], n_seq: int, n_tokens: int, *, after_step: Callable[[], None] | None = None
    ) -> LoopResult:
        """Prefill ``n_seq`` sequences with ``prompt`` (untimed), then time ``n_tokens`` steps
        of one ``llama_decode`` each advancing all of them; greedy (argmax) sampling.
        ``after_step`` runs after every timed step's tokens are chosen (bench/engine/cpu_budget.py)."""
        if not 1 <= n_seq <= self.n_seq_max:
            raise ValueError(f"n_seq must be in [1, {self.n_seq_max}]")
        if len(prompt) + n_tokens > self.n_ctx_seq:
            raise ValueError(f"{len(prompt)} + {n_tokens} tokens do not fit {self.n_ctx_seq} cells")
        lc = self._lc
        mem = lc.llama_get_memory(self._ctx)
        lc.llama_memory_clear(mem, True)
        nxt = []
        for seq in range(n_seq):
            self._fill([(t, p, seq, p == len(prompt) - 1) for p, t in enumerate(prompt)])
            self._decode()
            nxt.append(self._argmax(len(prompt) - 1))
        pos = len(prompt)
        history = [nxt[0]]
        before = _evaluated(lc, self._ctx)
        start = time.perf_counter()
        for _ in range(n_tokens):
            self._fill([(nxt[s], pos, s, True) for s in range(n_seq)])
            self._decode()
            nxt = [self._argmax(s) for s in range(n_seq)]
            history.append(nxt[0])
            pos += 1
            if after_step is not None:
                after_step()
        seconds = time.perf_counter() - start
        evaluated = _evaluated(lc, self._ctx) - before
        lc.llama_memory_clear(mem, True)
        return LoopResult(n_seq * n_tokens, seconds, evaluated, tuple(history))


class LlamaBaseline:
    """``llama_cpp.Llama`` generating greedily (a context manager)."""

    def __init__(self, model: Path, *, n_ctx: int, threads: int) -> None:
        from llama_cpp import Llama

        _quiet_llama_logs()
        self.llm = Llama(
            model_path=str(model), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
            verbose=False, seed=0, n_gpu_layers=0,
        )

    def __enter__(self) -> LlamaBaseline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.llm.close()

    def evaluated(self) -> int:
        """Tokens llama.cpp evaluated in this context so far."""
        import llama_cpp.llama_cpp as lc

        return _evaluated(lc, self.llm.ctx)

    def run(self, prompt: list[int], n_tokens: int) -> LoopResult:
        """Generate ``n_tokens + 1`` tokens; time the last ``n_tokens`` (each is exactly one
        single-token evaluation: the prompt was evaluated before the first token came out)."""
        llm = self.llm
        llm.reset()
        gen = llm.generate(prompt, top_k=1, temp=0.0)
        try:
            history = [next(gen)]  # evaluates the prompt, samples the first token
            before = self.evaluated()
            start = time.perf_counter()
            for _ in range(n_tokens):
                history.append(next(gen))
            seconds = time.perf_counter() - start
            evaluated = self.evaluated() - before
        finally:
            gen.close()
        return LoopResult(n_tokens, seconds, evaluated, tuple(history))


def buggy_llama_baseline(baseline: LlamaBaseline, prompt: list[int], n_tokens: int) -> int:
    """The old bench's loop (``eval(prompt)`` then ``generate(prompt, reset=False)``): returns
    how many tokens its timed part evaluated. Kept so the harness test shows the counter sees
    the difference (it is len(prompt) too many)."""
    llm = baseline.llm
    llm.reset()
    llm.eval(prompt)
    before = baseline.evaluated()
    produced = 0
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=False):
        produced += 1
        if produced >= n_tokens:
            break
    return baseline.evaluated() - before


__all__ = ["LlamaBaseline", "LoopResult", "RawDecoder", "buggy_llama_baseline"]
