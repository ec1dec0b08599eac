"""Token choice from a logits vector, shared by every engine.

Sampling lives above the engine implementations so the fake and the llama engine choose tokens
identically. The random stream is keyed by ``(seed, position)``: the chosen token is a pure
function of the logits, the parameters and where the token will be placed, so replaying a
session with the same seed reproduces it, and no sampler state needs to survive a resume.
"""

from __future__ import annotations

import numpy as np

from .types import SamplingParams, TokenLogprob


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax in float64."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x)
    shifted = x - m
    return shifted - np.log(np.sum(np.exp(shifted)))


def top_logprobs(logprobs: np.ndarray, k: int) -> tuple[TokenLogprob, ...]:
    """The ``k`` most likely tokens, most likely first, ties broken by lower token id."""
    if k <= 0:
        return ()
    k = min(k, logprobs.shape[0])
    # lexsort: last key is primary -> sort by -logprob, then by id.
    order = np.lexsort((np.arange(logprobs.shape[0]), -logprobs))[:k]
    return tuple(TokenLogprob(int(i), float(logprobs[i])) for i in order)


def choose_token(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """Pick the next token. Greedy takes the first maximum, as llama.cpp's greedy sampler does."""
    if params.greedy:
        return int(np.argmax(logits))
    x = np.asarray(logits, dtype=np.float64) / params.temperature
    order = np.lexsort((np.arange(x.shape[0]), -x))  # descending logit, then ascending id
    if params.top_k > 0:
        order = order[: params.top_k]
    sel = x[order]
    probs = np.exp(sel - sel[0])
    probs /= probs.sum()
    if params.top_p < 1.0:
        cum = np.cumsum(probs)
        keep = int(np.searchsorted(cum, params.top_p, side="left")) + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    rng = np.random.Generator(np.random.PCG64([params.seed, position]))
    idx = int(np.searchsorted(np.cumsum(probs), rng.random(), side="right"))
    return int(order[min(idx, order.shape[0] - 1)])
