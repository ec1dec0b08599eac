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
from shard.engine.plans import ComputePlan
from shard.engine.results import step_history
from shard.engine.slots import Slot
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
    from bench.engine.sampling_cost import FULL_SORT, KINDS, SORTED_TOO, main

    prefix_draw = sampling.draw_from_prefix
    out = tmp_path / "cost.json"
    main(["--quick", "--vocab", "3000", "--history", "100", "--out", str(out)])
    record = json.loads(out.read_text())
    assert set(record["results"]) == set(KINDS) | {k + FULL_SORT for k in SORTED_TOO}
    assert record["environment"]["command"]
    assert sampling.draw_from_prefix is prefix_draw  # (the full-sort rounds put it back)
    assert all(r["us_per_token"] > 0 for r in record["results"].values())


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_steps_history_is_the_tail_its_rows_penalty_windows_reach(data: st.DataObject) -> None:
    """``results.step_history``: the committed ids (held, copied from the prefix cache, new)
    from as far back as the first chosen row's window reaches; each row's slice of it ends
    where that row's ids end."""
    held = data.draw(st.lists(st.integers(0, 50), max_size=30))
    keep = data.draw(st.integers(0, len(held)))
    n_cached = data.draw(st.integers(0, keep))
    cached = tuple(data.draw(st.lists(st.integers(0, 50), min_size=n_cached, max_size=n_cached)))
    new = tuple(data.draw(st.lists(st.integers(0, 50), min_size=1, max_size=8)))
    all_logits = data.draw(st.booleans())
    last_n = data.draw(st.sampled_from([-1, 1, 2, 5, 64]))
    slot = Slot("s", 0, 100, tokens=list(held))
    plan = ComputePlan(keep, new, None, all_logits=all_logits, cached_ids=cached)
    full = [*held[: keep - len(cached)], *cached, *new]
    got = step_history(slot, plan, last_n)
    assert got is not None and full[len(full) - len(got):] == got
    rows = len(new) if all_logits else 1
    for i in range(rows):  # as results.step_outputs slices it for row i
        n_past = keep + len(new) - rows + 1 + i
        mine = got[: len(got) - (rows - 1 - i)]
        want = full[:n_past]
        assert sampling.penalty_window(mine, last_n) == sampling.penalty_window(want, last_n)
    assert step_history(Slot("s", 0, 100, tokens=None), plan, last_n) is None
