"""llama.cpp's own samplers over a logits row, through llama-cpp-python's ctypes bindings: the
reference ``tests/test_sampling_llama.py`` holds ``shard.engine.sampling`` to.

Test-only (ctypes never crosses the engine interface). A chain is built as llama-server's
``common_sampler`` builds it for the samplers the engine implements: logit_bias, penalties
(fed the history with ``llama_sampler_accept``, as llama-server feeds the prompt and each
generated token), min_p, then greedy when asked.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from shard.engine.types import SamplingParams

llama_cpp = __import__("llama_cpp").llama_cpp


def _chain(params: SamplingParams, n_vocab: int, history: Sequence[int], *,
           min_p: bool, greedy: bool) -> object:
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    if params.logit_bias:
        biases = (llama_cpp.llama_logit_bias * len(params.logit_bias))(
            *[llama_cpp.llama_logit_bias(t, b) for t, b in params.logit_bias])
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_logit_bias(
            n_vocab, len(params.logit_bias), biases))
    last_n = len(history) if params.penalty_last_n == -1 else params.penalty_last_n
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_penalties(
        n_vocab, last_n, params.repeat_penalty, params.frequency_penalty,
        params.presence_penalty))
    if min_p:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
    if greedy:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    for token in history:
        llama_cpp.llama_sampler_accept(chain, int(token))
    return chain


def _apply(logits: np.ndarray, params: SamplingParams, history: Sequence[int], *,
           min_p: bool, greedy: bool) -> tuple[list[int], list[float], int]:
    n = int(logits.shape[0])
    data = (llama_cpp.llama_token_data * n)()
    for i, value in enumerate(np.asarray(logits, dtype=np.float32).tolist()):
        data[i].id, data[i].logit, data[i].p = i, value, 0.0
    cur = llama_cpp.llama_token_data_array(
        ctypes.cast(data, llama_cpp.llama_token_data_p), n, -1, False)
    chain = _chain(params, n, history, min_p=min_p, greedy=greedy)
    try:
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(cur))
    finally:
        llama_cpp.llama_sampler_free(chain)
    size = int(cur.size)
    return ([data[i].id for i in range(size)], [data[i].logit for i in range(size)],
            int(cur.selected))


def biased_penalized(logits: np.ndarray, params: SamplingParams,
                     history: Sequence[int]) -> np.ndarray:
    """The row after llama.cpp's logit_bias and penalties samplers (float32, by token id)."""
    ids, values, _ = _apply(logits, params, history, min_p=False, greedy=False)
    out = np.empty(len(ids), dtype=np.float32)
    out[ids] = values
    return out


def kept_by_min_p(logits: np.ndarray, params: SamplingParams, history: Sequence[int]) -> set[int]:
    """The ids llama.cpp's chain keeps after logit_bias, penalties and min_p."""
    ids, _, _ = _apply(logits, params, history, min_p=True, greedy=False)
    return set(ids)


def greedy_token(logits: np.ndarray, params: SamplingParams, history: Sequence[int]) -> int:
    """The token llama.cpp's chain (logit_bias, penalties, min_p, greedy) chooses."""
    ids, _, selected = _apply(logits, params, history, min_p=True, greedy=True)
    return ids[selected]
