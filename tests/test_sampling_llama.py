"""logit_bias, penalties and min_p choose what llama.cpp's own sampler chain chooses on the same
logits and history (``tests/llama_samplers.py`` drives llama-cpp-python's samplers)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shard.engine import InvalidInput, sampling
from shard.engine.types import SamplingParams

import llama_samplers


@st.composite
def cases(draw: st.DrawFn) -> tuple[np.ndarray, SamplingParams, list[int]]:
    vocab = draw(st.integers(2, 300))
    # Few distinct values: ties, zeros and equal logits after a penalty are common.
    values = st.floats(-30, 30, width=32) | st.sampled_from([0.0, 1.5, -1.5, 2.0])
    logits = draw(hnp.arrays(np.float32, vocab, elements=values))
    history = draw(st.lists(st.integers(0, min(vocab - 1, draw(st.integers(0, vocab - 1)))),
                            max_size=200))
    penalty = st.floats(-2, 2, width=32) | st.sampled_from([0.0, 0.5, 1.0])
    bias_value = st.floats(-100, 100, width=32) | st.just(-math.inf)
    params = SamplingParams(
        temperature=1.0,
        repeat_penalty=draw(st.floats(0.0625, 4, width=32) | st.sampled_from([1.0, 1.1])),
        presence_penalty=draw(penalty),
        frequency_penalty=draw(penalty),
        penalty_last_n=draw(st.sampled_from([-1, 0, 1, 3, 64])),
        min_p=draw(st.floats(0, 1, width=32) | st.sampled_from([0.0, 0.05, 1.0])),
        logit_bias=draw(st.dictionaries(st.integers(0, vocab - 1), bias_value, max_size=6)),
    )
    if all(b == -math.inf for _, b in params.logit_bias) and len(params.logit_bias) == vocab:
        params = SamplingParams(temperature=1.0)  # (every token forbidden: refused by the engine)
    return logits, params, history


@settings(max_examples=300, deadline=None)
@given(cases())
def test_bias_and_penalties_give_llama_cpps_logits_bit_for_bit(
        case: tuple[np.ndarray, SamplingParams, list[int]]) -> None:
    logits, params, history = case
    ours = sampling.adjusted_logits(logits, params, history)
    theirs = llama_samplers.biased_penalized(logits, params, history)
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, theirs)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_greedy_chooses_llama_cpps_token(case: tuple[np.ndarray, SamplingParams, list[int]]) -> None:
    logits, params, history = case
    greedy = SamplingParams(**{**_fields(params), "temperature": 0.0})
    assert sampling.choose_token(logits, greedy, len(history), history) == \
        llama_samplers.greedy_token(logits, params, history)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_min_p_keeps_llama_cpps_candidates(case: tuple[np.ndarray, SamplingParams, list[int]]) -> None:
    logits, params, history = case
    adjusted = sampling.adjusted_logits(logits, params, history)
    order, probs = sampling.candidates(adjusted, params)
    kept = set(order[probs > 0].tolist())
    theirs = llama_samplers.kept_by_min_p(logits, params, history)
    theirs = {t for t in theirs if adjusted[t] > -np.inf}  # (llama.cpp keeps -inf with min_p 0)
    assert kept == theirs


def _fields(params: SamplingParams) -> dict[str, object]:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_the_window_is_the_last_penalty_last_n_ids_of_the_history() -> None:
    logits = np.array([5.0, 4.0, 3.0], dtype=np.float32)
    history = [0, 0, 1, 2]
    only_last_two = SamplingParams(presence_penalty=10.0, penalty_last_n=2)
    # positions 2 and 3 hold 1 and 2: token 0 is outside the window
    assert sampling.choose_token(logits, only_last_two, 4, history) == 0
    whole = SamplingParams(presence_penalty=10.0, penalty_last_n=-1)
    assert sampling.choose_token(logits, whole, 4, history) == 0  # all penalized alike
    assert sampling.choose_token(logits, whole, 2, history[:2]) == 1  # only [0, 0]
    assert sampling.lookahead_window(history, only_last_two) == (1, 2)
    assert sampling.lookahead_window(history, whole) == (0, 0, 1, 2)
    assert sampling.lookahead_window(history, SamplingParams(min_p=0.5)) is None
    off = SamplingParams(presence_penalty=10.0, penalty_last_n=0)
    assert not off.penalized and sampling.choose_token(logits, off, 4, history) == 0


def test_logit_bias_forces_and_forbids() -> None:
    logits = np.array([5.0, 4.0, 3.0], dtype=np.float32)
    assert sampling.choose_token(logits, SamplingParams(logit_bias={2: 100.0}), 0) == 2
    assert sampling.choose_token(logits, SamplingParams(logit_bias={0: -math.inf}), 0) == 1
    sampled = SamplingParams(temperature=5.0, logit_bias={0: -math.inf, 1: -math.inf}, seed=3)
    assert {sampling.choose_token(logits, sampled, p) for p in range(50)} == {2}


def test_plain_greedy_is_the_first_maximum_of_the_row_as_it_is() -> None:
    assert SamplingParams().plain_greedy
    assert not SamplingParams(logit_bias={1: 1.0}).plain_greedy
    assert not SamplingParams(repeat_penalty=1.1).plain_greedy
    assert SamplingParams(repeat_penalty=1.1, penalty_last_n=0).plain_greedy


@pytest.mark.parametrize("bad, field", [
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"),
    ({"repeat_penalty": 0.0}, "repeat_penalty"), ({"repeat_penalty": math.inf}, "repeat_penalty"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"frequency_penalty": 1e9}, "frequency_penalty"),
    ({"penalty_last_n": -2}, "penalty_last_n"), ({"penalty_last_n": 1.5}, "penalty_last_n"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"logit_bias": {1: math.nan}}, "logit_bias"),
    ({"logit_bias": {1: math.inf}}, "logit_bias"), ({"logit_bias": [(1, 1.0), (1, 2.0)]}, "logit_bias"),
    ({"logit_bias": 3}, "logit_bias"),
])
def test_bad_values_are_refused_naming_the_field(bad: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidInput, match=field):
        SamplingParams(**bad)


def test_logit_bias_is_kept_as_sorted_pairs() -> None:
    params = SamplingParams(logit_bias={5: 1.0, 2: -math.inf})
    assert params.logit_bias == ((2, -math.inf), (5, 1.0))
    assert params == SamplingParams(logit_bias=[(5, 1.0), (2, -math.inf)])
    hash(params)
