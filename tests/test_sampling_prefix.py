"""A sampled token drawn from the likeliest tokens only (``sampling.draw_from_prefix``) is the
token the full sort of the vocabulary gives: ``choose_token`` and ``candidates`` against the
full-sort implementation they replaced (kept here as the oracle), over random logits with
ties, -inf entries, tiny temperatures and top_k / top_p / min_p together; draws exactly on a
cumulative boundary are left to the full sort, never decided otherwise; and on a
vocabulary-sized row the prefix decides nearly every draw (the point of it).
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shard.engine import sampling
from shard.engine.types import SamplingParams


# ---- the oracle: the full-sort implementation, as it was --------------------------------------


def old_candidates(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(logits, dtype=np.float64)
    n = x.shape[0]
    if 0 < params.top_k < n:
        kth = np.partition(x, n - params.top_k)[n - params.top_k]
        cand = np.flatnonzero(x >= kth)
        order = cand[np.lexsort((cand, -x[cand]))][:params.top_k]
    else:
        order = np.lexsort((np.arange(n), -x))
    with np.errstate(over="ignore"):
        probs = np.exp((x[order] - x[order[0]]) / params.temperature)
    probs /= probs.sum()
    if params.top_p < 1.0:
        cum = np.cumsum(probs)
        keep = int(np.searchsorted(cum, params.top_p, side="left")) + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    if params.min_p > 0.0:
        x32 = np.asarray(logits, dtype=np.float32)[order]
        with np.errstate(divide="ignore"):  # (a min_p float32 rounds to 0)
            floor = x32[0] + np.log(np.float32(params.min_p))
        keep = max(1, int(np.count_nonzero(x32 >= floor)))
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return order, probs


def old_draw(logits: np.ndarray, params: SamplingParams, u: float) -> int:
    order, probs = old_candidates(logits, params)
    idx = int(np.searchsorted(np.cumsum(probs), u, side="right"))
    return int(order[min(idx, order.shape[0] - 1)])


def old_choose(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    u = np.random.Generator(np.random.PCG64([params.seed, position])).random()
    return old_draw(logits, params, u)


# ---- rows and parameters ------------------------------------------------------------------


@st.composite
def rows(draw: st.DrawFn) -> np.ndarray:
    """Rows from a few ids to thousands: spread or peaked, with ties and -inf entries."""
    n = draw(st.integers(1, 3000))
    scale = draw(st.sampled_from([0.5, 3.0, 12.0]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    row = (rng.standard_normal(n) * scale).astype(np.float32)
    if draw(st.booleans()):  # ties: values from a few levels
        levels = draw(hnp.arrays(np.float32, draw(st.integers(1, 6)),
                                 elements=st.floats(-20, 20, width=32)))
        row = levels[rng.integers(0, levels.shape[0], n)]
    if n > 1 and draw(st.booleans()):  # forbidden ids (a grammar's mask, a -inf bias)
        row[rng.random(n) < draw(st.sampled_from([0.1, 0.5, 0.99]))] = -np.inf
        row[rng.integers(0, n)] = draw(st.floats(-20, 20, width=32))  # (one stays possible)
    return row


@st.composite
def params(draw: st.DrawFn) -> SamplingParams:
    temperature = draw(st.sampled_from([1e-30, 1e-6, 0.05, 0.7, 1.0, 2.0])
                       | st.floats(0.01, 2.0))
    top_k = draw(st.sampled_from([0, 0, 0, 1, 5, 40, 5000]))
    top_p = draw(st.sampled_from([1.0, 1.0, 0.9, 0.5, 0.999999]) | st.floats(0.01, 1.0))
    min_p = draw(st.sampled_from([0.0, 0.0, 0.05, 0.5, 1.0]) | st.floats(0.0, 1.0))
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          seed=draw(st.integers(0, 2**31)))


@settings(max_examples=400, deadline=None)
@given(rows(), params(), st.integers(0, 10**6))
def test_choose_token_and_candidates_equal_the_full_sort(row: np.ndarray, p: SamplingParams,
                                                         position: int) -> None:
    assert sampling.choose_token(row, p, position) == old_choose(row, p, position)
    order, probs = sampling.candidates(row, p)
    old_order, old_probs = old_candidates(row, p)
    np.testing.assert_array_equal(order, old_order)
    np.testing.assert_array_equal(probs, old_probs)


@settings(max_examples=300, deadline=None)
@given(rows(), params(), st.data())
def test_a_draw_on_a_boundary_is_the_full_sorts_or_left_to_it(
        row: np.ndarray, p: SamplingParams, data: st.DataObject) -> None:
    """``u`` exactly on (or an ulp beside) a cumulative probability of the full sort, or
    anywhere: the prefix gives the full sort's token or none."""
    _, probs = old_candidates(row, p)
    cum = np.cumsum(probs)
    at = float(cum[data.draw(st.integers(0, cum.shape[0] - 1))])
    u = data.draw(st.sampled_from([at, math.nextafter(at, 0.0), math.nextafter(at, 1.0)])
                  | st.floats(0.0, 1.0, exclude_max=True))
    u = min(max(u, 0.0), math.nextafter(1.0, 0.0))  # (the generator's range)
    token = sampling.draw_from_prefix(row, p, u)
    assert token is None or token == old_draw(row, p, u)


def test_the_prefix_decides_nearly_every_draw_of_a_vocabulary_row() -> None:
    """The door's default (temperature 1, no top_k, top_p 1) and the cuts, on a
    vocabulary-sized row: the full sort is almost never needed, and the tokens are its."""
    rng = np.random.default_rng(0)
    row = (rng.standard_normal(49152) * 3).astype(np.float32)
    for p in (SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.8, top_p=0.9, seed=2),
              SamplingParams(temperature=1.0, min_p=0.05, seed=3),
              SamplingParams(temperature=1.5, top_p=0.95, min_p=0.01, seed=4)):
        decided = 0
        for position in range(60):
            u = np.random.Generator(np.random.PCG64([p.seed, position])).random()
            token = sampling.draw_from_prefix(row, p, u)
            decided += token is not None
            assert sampling.choose_token(row, p, position) == old_draw(row, p, u)
            assert token is None or token == old_draw(row, p, u)
        assert decided >= 55, (p, decided)
