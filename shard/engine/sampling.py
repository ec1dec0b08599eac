"""Token choice from a logits vector, shared by every engine.

Sampling lives above the engine implementations so the fake and the llama engine choose tokens
identically. The random stream is keyed by ``(seed, position)``: the chosen token is a pure
function of the logits, the parameters, where the token will be placed and (with penalties)
the session's last token ids, so replaying a session with the same seed reproduces it, and no
sampler state needs to survive a resume, a rewind or a hand-off: the engine keeps the ids.

The steps follow llama-server's default chain over the samplers implemented here, each with
llama.cpp's definition in float32 (``src/llama-sampler.cpp``), so the same logits and history
give the token llama.cpp's chain gives: logit_bias, penalties, top_k, top_p, min_p,
temperature, then the draw (greedy: the first maximum of the biased, penalized logits). Only
top_p differs from llama.cpp: it keeps its nucleus of the temperature-scaled probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .errors import InvalidInput
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
    return np.argsort(-x, kind="stable")  # (stable: ties keep ascending ids)


def penalty_window(history: Sequence[int], last_n: int) -> Sequence[int]:
    """The ids the penalties see: the last ``last_n`` of ``history`` (-1: all of it)."""
    return history if last_n < 0 else history[max(0, len(history) - last_n):]


def lookahead_window(ids: Sequence[int], params: SamplingParams) -> tuple[int, ...] | None:
    """What a step computed ahead needs of ``ids`` (the session's ids through the step that
    chooses): their penalty window, or None when ``params`` has no penalties."""
    return tuple(penalty_window(ids, params.penalty_last_n)) if params.penalized else None


def adjusted_logits(logits: np.ndarray, params: SamplingParams,
                    history: Sequence[int] | None) -> np.ndarray:
    """A float32 copy of ``logits`` with ``params.logit_bias`` added, then llama.cpp's
    penalties over the window of ``history`` (``penalty_window``): a token seen ``count``
    times has its logit divided by ``repeat_penalty`` (multiplied, when <= 0), then
    ``count * frequency_penalty + presence_penalty`` subtracted, all in float32 as
    ``llama_sampler_penalties_apply`` does."""
    x = np.array(logits, dtype=np.float32)
    if params.logit_bias:
        ids = np.fromiter((t for t, _ in params.logit_bias), dtype=np.intp)
        x[ids] += np.fromiter((b for _, b in params.logit_bias), dtype=np.float32)
    if params.penalized:
        if history is None:
            raise ValueError("penalties need the session's token ids")
        window = penalty_window(history, params.penalty_last_n)
        if len(window):
            ids, counts = np.unique(np.asarray(window, dtype=np.intp), return_counts=True)
            v = x[ids]
            rp = np.float32(params.repeat_penalty)
            v = np.where(v <= 0, v * rp, v / rp)
            v -= (counts.astype(np.float32) * np.float32(params.frequency_penalty)
                  + np.float32(params.presence_penalty))
            x[ids] = v
    return x


def choose_token(logits: np.ndarray, params: SamplingParams, position: int,
                 history: Sequence[int] | None = None) -> int:
    """Pick the token of ``position``. Greedy takes the first maximum, as llama.cpp's greedy
    sampler does. ``history``: the session's ids before ``position`` (its last
    ``penalty_last_n`` at least; needed with penalties: the engine refuses a penalized step
    whose history it does not hold)."""
    if params.plain_greedy:
        return int(np.argmax(logits))
    if params.logit_bias or params.penalized:
        logits = adjusted_logits(logits, params, history)
        if params.logit_bias and not np.isfinite(np.max(logits)):
            # Only -inf biases can empty a row the model scored (a grammar's mask leaves the
            # tokens it allows finite): refused, and the step rolled back, as a bias that
            # forbids every token is refused before any work.
            raise InvalidInput("logit_bias forbids every token the grammar allows at position "
                               f"{position}")
    if params.greedy:
        return int(np.argmax(logits))
    u = np.random.Generator(np.random.PCG64([params.seed, position])).random()
    token = draw_from_prefix(logits, params, u)
    return draw_from_candidates(logits, params, u) if token is None else token


def draw_from_candidates(logits: np.ndarray, params: SamplingParams, u: float) -> int:
    """The inverse-CDF draw at ``u`` over ``candidates`` (the whole row sorted without
    top_k): the definition ``draw_from_prefix`` keeps to."""
    order, probs = candidates(logits, params)
    idx = int(np.searchsorted(np.cumsum(probs), u, side="right"))
    return int(order[min(idx, order.shape[0] - 1)])


#: How close (a fraction of the row's probability mass) a cut or a draw may come to a
#: boundary before ``draw_from_prefix`` leaves it to the full sort: its sums are added in
#: another order than ``candidates``' (a few ulps apart), so a decision closer than this could
#: fall on the other side. Far above those ulps, far below any probability that matters.
PREFIX_MARGIN = 1e-8


def draw_from_prefix(logits: np.ndarray, params: SamplingParams, u: float) -> int | None:
    """The token ``candidates`` and the inverse-CDF draw at ``u`` give, from the likeliest
    tokens only; None when that cannot be decided so (the caller sorts the whole row).

    Why: without top_k the full sort orders the whole vocabulary, while the draw (and top_p's
    cut) only reads the sorted order up to the mass it reaches, and min_p's cut is a count.
    So: the probabilities unnormalized in one O(n) pass and their sum; the ids whose share is
    at least a threshold (an exact prefix of the full order, ties included: the weight is
    monotone in the logit) sorted as the full sort sorts, the threshold lowered until their
    mass passes what the cut or the draw needs; then the same decisions on that prefix. Each
    is taken only if it clears ``PREFIX_MARGIN``, so the token is the full sort's, always."""
    n = len(logits)
    if 0 < params.top_k < n:  # (already a partial sort)
        return None
    x = np.asarray(logits, dtype=np.float64)
    top = float(x.max())
    if not math.isfinite(top):
        return None
    weight = np.subtract(x, top)  # as ``candidates``, in place
    if params.temperature != 1.0:
        with np.errstate(over="ignore"):  # -big / tiny -> -inf
            np.divide(weight, params.temperature, out=weight)
    np.exp(weight, out=weight)
    total = float(weight.sum())
    tol = PREFIX_MARGIN * total
    kept, mass = n, total  # what min_p keeps (a count: its tokens are a prefix) and their mass
    if params.min_p > 0.0:
        above = _min_p_kept(np.asarray(logits, dtype=np.float32), params.min_p)
        kept = max(1, int(np.count_nonzero(above)))
        mass = float(weight[above].sum()) if kept < n else total
    cut = params.top_p < 1.0
    need = params.top_p * total if cut else u * mass
    prefix = _likeliest(x, weight, total, min(need, mass) + tol)
    if prefix is None:
        return None
    order, cum = prefix
    if cut:  # top_p: the first id whose cumulative share reaches top_p is the last kept
        if not (kept <= cum.shape[0] and cum[kept - 1] < need - tol):  # (else min_p cuts first)
            last = _crossing(cum, need, tol, side="left")
            if last is None:
                return None
            kept = min(last + 1, kept)
        need = u * float(cum[kept - 1])
    idx = _crossing(cum, need, tol, side="right")
    return None if idx is None or idx >= kept else int(order[idx])


def _min_p_kept(x32: np.ndarray, min_p: float) -> np.ndarray:
    """llama.cpp's min_p: the ids with p_i >= min_p * p_max of the untempered logits, i.e.
    logit_i >= max + logf(min_p) in float32 (a min_p below float32's range: -inf, all)."""
    with np.errstate(divide="ignore"):
        return x32 >= x32.max() + np.log(np.float32(min_p))


def _likeliest(x: np.ndarray, weight: np.ndarray, total: float,
               mass: float) -> tuple[np.ndarray, np.ndarray] | None:
    """The likeliest ids in the full sort's order and their cumulative weights, enough of
    them to pass ``mass`` (of ``total``); None when that takes a large part of the row
    (sorting it all is then as cheap) or cannot be had."""
    n = x.shape[0]
    threshold = total / 256  # at most 256 ids, then up to 8 times as many each round
    while threshold > total * 2.0**-60:
        ids = np.flatnonzero(weight >= threshold)
        if ids.shape[0] > n // 4:
            return None
        if float(weight[ids].sum()) > mass:
            order = ids[np.argsort(-x[ids], kind="stable")]  # (ids ascend: ties keep them so)
            return order, np.cumsum(weight[order])
        threshold /= 8
    return None


def _crossing(cum: np.ndarray, value: float, tol: float, *, side: str) -> int | None:
    """``np.searchsorted(cum, value, side)`` when no cumulative weight near it is within
    ``tol`` of ``value`` (None: too close to call, or not reached)."""
    idx = int(np.searchsorted(cum, value, side=side))  # type: ignore[call-overload]
    if idx >= cum.shape[0] or cum[idx] - value <= tol or (idx and value - cum[idx - 1] <= tol):
        return None
    return idx


def candidates(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The ids a sampled choice draws from (likeliest first, ties by lower id) and their
    probabilities: ``logits`` (biased and penalized already) through top_k, temperature,
    top_p and min_p."""
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
    if params.min_p > 0.0:
        # llama.cpp: keep p_i >= min_p * p_max of the untempered logits, i.e.
        # logit_i >= max + logf(min_p) in float32; the order is descending, so a prefix.
        keep = max(1, int(np.count_nonzero(_min_p_kept(
            np.asarray(logits, dtype=np.float32)[order], params.min_p))))
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return order, probs
