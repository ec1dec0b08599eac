"""A tick's rows chosen at once (``sampling.greedy_rows``) give what row by row gives; the
sampling cost bench runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shard.engine import sampling
from shard.engine.types import SamplingParams

GREEDY = SamplingParams()


@st.composite
def blocks(draw: st.DrawFn) -> np.ndarray:
    rows = draw(st.integers(1, 40))
    vocab = draw(st.integers(1, 700))
    values = st.floats(-60, 60, width=32) | st.sampled_from([0.0, 3.5, -3.5])
    block = draw(hnp.arrays(np.float32, (rows, vocab), elements=values))
    if draw(st.booleans()):  # a row the engine got wrong: every such row is found out
        bad = draw(st.integers(0, rows - 1))
        block[bad, draw(st.integers(0, vocab - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return block


@settings(max_examples=200, deadline=None)
@given(blocks())
def test_rows_chosen_at_once_equal_rows_chosen_one_by_one(block: np.ndarray) -> None:
    tokens, lses, finite = sampling.greedy_rows(block)
    assert len(tokens) == len(lses) == len(finite) == block.shape[0]
    for i, row in enumerate(block):
        assert finite[i] == bool(np.isfinite(row).all())
        if not finite[i]:
            continue
        token = sampling.choose_token(row, GREEDY, 7)
        assert tokens[i] == token
        assert lses[i] == sampling.logsumexp(row, row[token])  # bit for bit, not approximately


def test_a_tick_of_one_row_and_ties_take_the_first_maximum() -> None:
    block = np.array([[1.0, 5.0, 5.0, -2.0]], dtype=np.float32)
    tokens, lses, finite = sampling.greedy_rows(block)
    assert tokens == [1] and finite == [True]
    assert lses[0] == sampling.logsumexp(block[0], block[0][1])


def test_the_sampling_cost_bench_times_every_kind(tmp_path: Path) -> None:
    """A ``--quick`` run of bench/engine/sampling_cost.py: every kind is timed and recorded with
    the environment (the numbers are the bench's, never asserted here)."""
    from bench.engine.sampling_cost import KINDS, main

    out = tmp_path / "cost.json"
    main(["--quick", "--vocab", "3000", "--history", "100", "--out", str(out)])
    record = json.loads(out.read_text())
    assert set(record["results"]) == set(KINDS) and record["environment"]["command"]
    assert all(r["us_per_token"] > 0 for r in record["results"].values())
