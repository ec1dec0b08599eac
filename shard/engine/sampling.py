"""Token choice from a logits vector, shared by every engine.

Sampling lives above the engine implementations so the fake and the llama engine choose tokens
identically. The random stream is keyed by ``(seed, position)``: the chosen token is a pure
function of the logits, the parameters and where the token will be placed, so replaying a
session with the same seed reproduces it, and no sampler state needs to survive a resume.
"""

from __future__ import annotations

import math

import numpy as np

from .types import SamplingParams, TokenLogprob


def logsumexp(logits: np.ndarray, maximum: float | None = None) -> float:
    """``log(sum(exp(logits)))``, stable; ``logits[i] - logsumexp(logits)`` is a log-probability.

    A scalar instead of a full log-softmax array keeps the per-step cost to one pass over the
    vocabulary; ``maximum`` (the row's largest value, when the caller has it) saves another.
    The exponentials are summed in the row's own dtype, in place, by numpy's pairwise sum: for
    float32 rows the relative error stays near 1e-6 (the wire's log-probabilities are float32),
    and accumulating in float64 instead costs more than the rest of the step's token choice
    (a cast of every element of the row).
    """
    m = float(np.max(logits)) if maximum is None else float(maximum)
    if not math.isfinite(m):  # every value -inf (nothing possible), or a NaN/inf row
        return m
    shifted = np.subtract(logits, logits.dtype.type(m))
    np.exp(shifted, out=shifted)
    return m + math.log(float(shifted.sum()))


def greedy_rows(block: np.ndarray) -> tuple[list[int], list[float], list[bool]]:
    """Greedy token, log-sum-exp and finiteness of each row of ``block`` ([rows, n_vocab]),
    with one numpy call per pass for all rows instead of one per row: the values of
    ``choose_token`` (greedy) and ``logsumexp`` row by row, bit for bit (the same float32
    passes; tests/test_sampling.py). A batching engine uses it for a tick's rows."""
    finite = np.isfinite(block).all(axis=1)
    tokens = block.argmax(axis=1)
    maxima = block[np.arange(block.shape[0]), tokens]
    with np.errstate(invalid="ignore", over="ignore"):  # (rows with inf or NaN: not used)
        shifted = np.subtract(block, maxima[:, None])
        np.exp(shifted, out=shifted)
        sums = shifted.sum(axis=1)
    lses = [m + math.log(s) if math.isfinite(m) else m
            for m, s in zip(maxima.tolist(), sums.tolist())]
    return tokens.tolist(), lses, finite.tolist()


def top_logprobs(logits: np.ndarray, k: int, lse: float) -> tuple[TokenLogprob, ...]:
    """The ``k`` most likely tokens, most likely first, ties broken by lower token id."""
    if k <= 0:
        return ()
    n = logits.shape[0]
    k = min(k, n)
    # Partition first (O(n)), then order only the candidates; every id tied with the k-th value
    # is a candidate, so the tie-break by lower id matches a full sort.
    kth = np.partition(logits, n - k)[n - k]
    cand = np.flatnonzero(logits >= kth)
    order = cand[np.lexsort((cand, -logits[cand]))][:k]
    return tuple(TokenLogprob(int(i), float(logits[i]) - lse) for i in order)


def candidate_order(x: np.ndarray, top_k: int) -> np.ndarray:
    """Token ids by descending ``x``, ties by ascending id; only the first ``top_k`` if > 0.

    With a top-k filter only the candidates are sorted: a partition (O(n)) finds the k-th
    largest value, and every id tied with it is a candidate, so the tie-break by lower id gives
    exactly the first ``top_k`` entries of the full sort.
    """
    n = x.shape[0]
    if 0 < top_k < n:
        kth = np.partition(x, n - top_k)[n - top_k]
        cand = np.flatnonzero(x >= kth)
        return cand[np.lexsort((cand, -x[cand]))][:top_k]
    return np.lexsort((np.arange(n), -x))


def choose_token(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """Pick the next token. Greedy takes the first maximum, as llama.cpp's greedy sampler does."""
    if params.greedy:
        return int(np.argmax(logits))
    x = np.asarray(logits, dtype=np.float64)
    order = candidate_order(x, params.top_k)  # descending logit, then ascending id
    # Shift before scaling: a tiny temperature then sends the others to -inf (probability 0)
    # instead of overflowing the maximum to inf (NaN probabilities).
    with np.errstate(over="ignore"):  # -big / tiny -> -inf is the intended limit
        probs = np.exp((x[order] - x[order[0]]) / params.temperature)
    probs /= probs.sum()
    if params.top_p < 1.0:
        cum = np.cumsum(probs)
        keep = int(np.searchsorted(cum, params.top_p, side="left")) + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    rng = np.random.Generator(np.random.PCG64([params.seed, position]))
    idx = int(np.searchsorted(np.cumsum(probs), rng.random(), side="right"))
    return int(order[min(idx, order.shape[0] - 1)])
