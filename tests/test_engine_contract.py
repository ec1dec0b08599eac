"""The ShardEngine contract suite (shard.testing) run on every engine: fake (alone and batched)
and llama.cpp, plus unit tests of the pieces every engine shares (sampling, value types)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shard.engine import BoundaryResult, DecodeRequest, PrefillRequest, SamplingParams
from shard.engine.fake import FakeScript
from shard.engine.sampling import candidate_order, choose_token, logsumexp
from shard.testing import EngineContractSuite, EngineFactory, fake_factory, llama_factory

# One llama.cpp thread: on a tiny model a second thread buys nothing, and llama.cpp's spinning
# thread pool turns milliseconds into seconds when other processes compete for the 2 cores
# (measured: a 12-token prefill took ~1 s with n_threads=2 under load, ~3 ms with 1).
# The batched fake runs the batching scheduler llama.cpp runs (shard.engine.scheduler), with a
# tick of 1 ms as a native step takes time: a free tick ends a decode within one scheduler pass,
# and the tests that cancel a running step (``wait_running``) could then never see it running.
FACTORIES = [
    fake_factory(),
    fake_factory(script=FakeScript(batched=True, tick_latency=0.001), name="fake-batched"),
    llama_factory("tiny", n_threads=1),
]


@pytest.fixture(params=FACTORIES, ids=str)
def engine_factory(request: pytest.FixtureRequest) -> EngineFactory:
    return request.param


class TestEngineContract(EngineContractSuite):
    """Every contract test, once per engine."""


# ---- shared pieces of the contract: sampling and value types ---------------------------------
# (shard/engine/sampling.py and types.py are used by every engine, so they are tested once here.)

def _reference_choose_token(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """choose_token as it was before the top-k partition: a full lexsort of the vocabulary."""
    if params.greedy:
        return int(np.argmax(logits))
    x = np.asarray(logits, dtype=np.float64) / params.temperature
    order = np.lexsort((np.arange(x.shape[0]), -x))
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


# Logits with many exact ties (few distinct values), the hard case for a partition.
_tied_logits = st.integers(1, 300).flatmap(
    lambda n: st.lists(st.integers(-4, 4), min_size=n, max_size=n).map(
        lambda v: np.array(v, dtype=np.float32) * np.float32(0.75)
    )
)
_random_logits = st.integers(1, 2000).flatmap(
    lambda n: st.integers(0, 2**32 - 1).map(
        lambda seed: (np.random.default_rng(seed).standard_normal(n) * 3).astype(np.float32)
    )
)


@settings(max_examples=300, deadline=None)
@given(logits=st.one_of(_tied_logits, _random_logits), top_k=st.integers(0, 2100))
def test_candidate_order_equals_the_full_sort(logits: np.ndarray, top_k: int) -> None:
    x = logits.astype(np.float64) / 0.7
    full = np.lexsort((np.arange(x.shape[0]), -x))  # descending value, then ascending id
    expected = full[:top_k] if top_k > 0 else full
    assert np.array_equal(candidate_order(x, top_k), expected)


@settings(max_examples=300, deadline=None)
@given(
    logits=st.one_of(_tied_logits, _random_logits),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.5, 7.0]),
    top_k=st.sampled_from([0, 1, 2, 5, 40, 10**6]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 1e-6]),
    seed=st.integers(0, 2**64 - 1),
    position=st.integers(0, 10**6),
)
def test_choose_token_equals_the_reference_implementation(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int, position: int
) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    assert choose_token(logits, params, position) == _reference_choose_token(logits, params, position)


@pytest.mark.parametrize("temperature", [1e-310, 1e-30, 1e-9])
def test_a_tiny_temperature_samples_among_the_maxima_only(temperature: float) -> None:
    # Scaling before shifting overflowed the maximum to inf and gave NaN probabilities.
    logits = np.array([1.0, 5.0, 3.0, 5.0, 4.999], dtype=np.float32)
    picks = {choose_token(logits, SamplingParams(temperature=temperature, seed=s), 3)
             for s in range(64)}
    assert picks == {1, 3}


def test_top_k_sampling_only_picks_candidates() -> None:
    logits = np.array([0.0, 5.0, 5.0, 1.0, 5.0, -2.0], dtype=np.float32)
    picks = {choose_token(logits, SamplingParams(temperature=50.0, top_k=2, seed=s), 3)
             for s in range(200)}
    assert picks == {1, 2}  # the three-way tie at 5.0 keeps the two lowest ids


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.floats(-60.0, 60.0, width=32), min_size=1, max_size=3000),
    banned=st.integers(0, 5),
)
def test_logsumexp_summed_in_float32_matches_float64(values: list[float], banned: int) -> None:
    """The in-place float32 sum (shard/engine/sampling.py) stays within float32 rounding of a
    float64 reference, with or without the row's maximum given, also with -inf entries (tokens
    a sampler ruled out); the row itself is never modified."""
    row = np.array(values, dtype=np.float32)
    row[: min(banned, len(row) - 1)] = -np.inf
    before = row.copy()
    x = row.astype(np.float64)
    m = x.max()
    want = m + np.log(np.exp(x - m).sum())
    for got in (logsumexp(row), logsumexp(row, row[int(np.argmax(row))])):
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want))
    assert np.array_equal(row, before)


def test_arrays_in_requests_and_results_are_immutable_and_unaliased() -> None:
    base = np.zeros((2, 4), dtype=np.float32)
    view = base.view()
    view.flags.writeable = False  # read-only, but still changes with ``base``
    req = PrefillRequest("s", hidden_states=view)
    dec = DecodeRequest("s", hidden_state=base[:1])
    base[:] = np.nan
    assert np.isfinite(req.hidden_states).all() and np.isfinite(dec.hidden_state).all()
    result = BoundaryResult(hidden_states=np.ones((3, 4), dtype=np.float32), start_position=0)
    for arr in (req.hidden_states, dec.hidden_state, result.hidden_states):
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr.flags.writeable = True  # a read-only copy that owns its memory would allow this
        with pytest.raises(ValueError):
            arr[0, 0] = 1.0
    # Already-immutable arrays (a previous result, wire bytes) are not copied again.
    assert BoundaryResult(result.hidden_states, 3).hidden_states is result.hidden_states
    wire = np.frombuffer(np.ones(8, dtype="<f4").tobytes(), dtype="<f4").reshape(2, 4)
    assert PrefillRequest("s", hidden_states=wire).hidden_states is wire
