"""Continuous batching: the tick policy on plain data (shard.engine.batching) and the llama.cpp
engine's use of it (sessions really share native steps, metrics, cancellation inside a shared
step). That batching does not change answers is checked by the contract suite
(``test_many_sessions_*``) on every engine."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import replace

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from shard.engine import DecodeRequest, EngineCancelled, LoadSpec, PrefillRequest
from shard.engine.batching import DEADLINE_SHARE, Step, TickPlanner
from shard.engine.tick_stats import TICK_ROWS_BUCKETS
from shard.testing import EngineOptions, llama_factory
from shard.testing.contract import count_tasks, prompt_tokens, start_op, wait_running

# ---- the planner ---------------------------------------------------------------------------

_steps = st.lists(st.tuples(st.integers(0, 63), st.integers(1, 300)), min_size=1, max_size=12,
                  unique_by=lambda t: t[0])


def _run_to_completion(planner: TickPlanner, steps: list[Step]) -> list[list[tuple[Step, int, int]]]:
    """Plan ticks until every step is done (marking rows done as an engine would)."""
    ticks = []
    for _ in range(10_000):
        pieces = planner.plan(steps)
        if not pieces:
            break
        ticks.append([(p.step, p.start, p.count) for p in pieces])
        for p in pieces:
            assert p.start == p.step.done_rows and p.count >= 1
            p.step.done_rows += p.count
    return ticks


@settings(max_examples=200, deadline=None)
@given(spec=_steps, budget=st.integers(1, 64), max_sessions=st.integers(1, 8), mix=st.booleans())
def test_every_tick_respects_the_limits_and_every_step_completes(
    spec: list[tuple[int, int]], budget: int, max_sessions: int, mix: bool
) -> None:
    steps = [Step(seq, n, arrival=i) for i, (seq, n) in enumerate(spec)]
    ticks = _run_to_completion(TickPlanner(budget, max_sessions, mix=mix), steps)
    assert all(s.remaining == 0 for s in steps)
    for tick in ticks:
        seqs = [s.seq for s, _, _ in tick]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)  # ascending, one piece each
        assert len(tick) <= max_sessions
        assert sum(c for _, _, c in tick) <= budget
        if not mix:  # a chunk never shares a tick
            multi = [c for _, _, c in tick if c > 1]
            assert not multi or len(tick) == 1
    # Nothing starves: a step finishes within a bounded number of ticks of its arrival.
    total_rows = sum(n for _, n in spec)
    assert len(ticks) <= 2 * (total_rows + len(spec))


@settings(max_examples=200, deadline=None)
@given(n_decoding=st.integers(1, 8), prompt=st.integers(2, 3000), budget=st.integers(9, 600))
def test_a_long_prompt_delays_running_decodes_by_at_most_one_chunk_per_tick(
    n_decoding: int, prompt: int, budget: int
) -> None:
    planner = TickPlanner(budget, 16)
    decoders = [Step(seq, 1, arrival=seq) for seq in range(n_decoding)]
    long = Step(n_decoding, prompt, arrival=100)
    ticks = 0
    while long.remaining:
        for d in decoders:  # each running decode submits its next row every tick
            d.n_rows, d.done_rows = d.done_rows + 1, d.done_rows
        pieces = planner.plan([*decoders, long])
        ticks += 1
        served = {p.step.seq for p in pieces}
        assert served >= {d.seq for d in decoders}  # no decode waits for the prompt
        chunk = sum(p.count for p in pieces if p.step is long)
        assert chunk <= budget - n_decoding  # at most one chunk's rows share the decodes' tick
        for p in pieces:
            p.step.done_rows += p.count
    assert ticks == math.ceil(prompt / (budget - n_decoding))  # the prompt gets the rest, every tick


def test_without_mixing_row_ticks_and_chunk_ticks_alternate() -> None:
    planner = TickPlanner(8, 8, mix=False)
    rows = [Step(1, 1, 0), Step(2, 1, 1)]
    chunk = Step(0, 20, 2)
    kinds = []
    for _ in range(4):
        pieces = planner.plan([*rows, chunk])
        kinds.append("chunk" if pieces[0].step is chunk else "rows")
        for p in pieces:
            p.step.done_rows += p.count
        for r in rows:
            if r.remaining == 0:  # served: the session submits its next row
                r.n_rows += 1
    assert kinds == ["rows", "chunk", "rows", "chunk"]


def test_a_short_prompt_behind_a_long_one_is_not_kept_waiting() -> None:
    """Chunk steps share the budget: a 40-row prompt arriving behind a 1,000-row one finishes in
    two ticks of 64 rows (half the budget, then what it still needs), not after the long one's
    16 ticks."""
    long, short = Step(0, 1000, arrival=0), Step(1, 40, arrival=1)
    ticks = _run_to_completion(TickPlanner(64, 8), [long, short])
    assert [i for i, tick in enumerate(ticks, 1) if any(s is short for s, _, _ in tick)] == [1, 2]
    # The long prompt got every row the short one left.
    assert sum(c for tick in ticks[:2] for s, _, c in tick if s is long) == 64 + 64 - 40


@settings(max_examples=300, deadline=None)
@given(
    n_decoders=st.integers(0, 6),
    prompts=st.lists(st.tuples(st.integers(0, 20), st.integers(2, 300)), min_size=1, max_size=4),
    budget=st.integers(1, 64),
    max_sessions=st.integers(1, 8),
    mix=st.booleans(),
)
def test_no_step_starves_while_decodes_resubmit(
    n_decoders: int, prompts: list[tuple[int, int]], budget: int, max_sessions: int, mix: bool
) -> None:
    """Decoding sessions submit their next row as soon as the last one is done (as served
    sessions do) and prompts arrive at random ticks. Every waiting step gets rows within
    ``ceil(sessions / min(budget, max_sessions))`` ticks (twice the sessions without mixing,
    where row and chunk ticks alternate), so every prompt finishes; rows-first admission kept a
    prompt out for as long as enough decodes resubmitted (found with --max-batch-sessions 1)."""
    planner = TickPlanner(budget, max_sessions, mix=mix)
    arrivals, seqs = itertools.count(), itertools.count()
    n_sessions = n_decoders + len(prompts)
    bound = math.ceil(n_sessions / min(budget, max_sessions)) if mix else 2 * n_sessions + 1
    decoders = [Step(next(seqs), 1, next(arrivals)) for _ in range(n_decoders)]
    to_arrive = sorted(prompts)
    live: list[Step] = []
    waiting_from: dict[Step, int] = {}  # the tick since which a step waits for rows
    tick = 0
    while to_arrive or live:
        while to_arrive and to_arrive[0][0] <= tick:
            live.append(Step(next(seqs), to_arrive.pop(0)[1], next(arrivals)))
        pending = [*decoders, *live]
        for s in pending:
            waiting_from.setdefault(s, tick)
        pieces = planner.plan(pending)
        served = {p.step for p in pieces}
        for s in pending:
            if s in served:
                waiting_from[s] = tick + 1
            else:
                assert tick - waiting_from[s] < bound - 1, f"a step waited {bound} ticks"
        for p in pieces:
            p.step.done_rows += p.count
        # A decode that got its row submits the next one at once; finished prompts leave.
        decoders = [Step(d.seq, 1, next(arrivals)) if d.remaining == 0 else d for d in decoders]
        live = [s for s in live if s.remaining]
        tick += 1
        assert tick < 100_000, "the prompts never finished"


@settings(max_examples=300, deadline=None)
@given(
    decoder_groups=st.lists(st.integers(0, 3), max_size=8),
    prompts=st.lists(st.tuples(st.integers(0, 20), st.integers(2, 300), st.integers(0, 3)),
                     min_size=1, max_size=4),
    budget=st.integers(1, 64),
    max_sessions=st.integers(1, 8),
    mix=st.booleans(),
)
def test_batch_groups_take_turns_and_no_step_starves(
    decoder_groups: list[int], prompts: list[tuple[int, int, int]], budget: int,
    max_sessions: int, mix: bool,
) -> None:
    """Rule 5: sessions in batch groups (a pipeline's micro-batches), decoders resubmitting at
    once and prompts arriving at random ticks. Every tick holds the steps of one group, and a
    waiting step still gets rows within a bounded number of ticks: every served step goes behind
    it, so at most the sessions ahead of it are served first (twice that and one without mixing,
    where row and chunk ticks alternate)."""
    planner = TickPlanner(budget, max_sessions, mix=mix)
    arrivals, seqs = itertools.count(), itertools.count()
    n_sessions = len(decoder_groups) + len(prompts)
    bound = n_sessions if mix else 2 * n_sessions + 1
    decoders = [Step(next(seqs), 1, next(arrivals), group=g) for g in decoder_groups]
    to_arrive = sorted(prompts)
    live: list[Step] = []
    waiting_from: dict[Step, int] = {}
    tick = 0
    while to_arrive or live:
        while to_arrive and to_arrive[0][0] <= tick:
            _, n, group = to_arrive.pop(0)
            live.append(Step(next(seqs), n, next(arrivals), group=group))
        pending = [*decoders, *live]
        if not pending:
            tick += 1
            continue
        for s in pending:
            waiting_from.setdefault(s, tick)
        head = planner.head_group(pending)
        pieces = planner.plan(pending)
        assert pieces and {p.step.group for p in pieces} == {head}, "one group per tick"
        served = {p.step for p in pieces}
        for s in pending:
            if s in served:
                waiting_from[s] = tick + 1
            else:
                assert tick - waiting_from[s] < bound, f"a step waited {bound} ticks"
        for p in pieces:
            p.step.done_rows += p.count
        decoders = [Step(d.seq, 1, next(arrivals), group=d.group) if d.remaining == 0 else d
                    for d in decoders]
        live = [s for s in live if s.remaining]
        tick += 1
        assert tick < 100_000, "the prompts never finished"


def test_groups_alternate_and_group_zero_alone_is_unchanged() -> None:
    """Two groups of two decoding sessions: ticks alternate between them; the same sessions in
    one group (0, what a client that names none gets) share every tick."""
    planner = TickPlanner(64, 8)
    arrivals = itertools.count()
    steps = [Step(i, 1, next(arrivals), group=1 + i % 2) for i in range(4)]
    seen = []
    for _ in range(4):
        served = {p.step.seq for p in planner.plan(steps)}
        seen.append(sorted(served))
        # a served decode resubmits its next row at once (behind the waiting ones)
        steps = [Step(s.seq, 1, next(arrivals), group=s.group) if s.seq in served else s
                 for s in steps]
    assert seen == [[0, 2], [1, 3], [0, 2], [1, 3]]
    together = TickPlanner(64, 8).plan([Step(i, 1, i) for i in range(4)])
    assert sorted(p.step.seq for p in together) == [0, 1, 2, 3]


@settings(max_examples=200, deadline=None)
@given(spec=_steps, budget=st.integers(1, 64), max_sessions=st.integers(1, 8))
def test_the_first_steps_in_waiting_order_get_rows(
    spec: list[tuple[int, int]], budget: int, max_sessions: int
) -> None:
    """Rows go to the steps that have waited longest (first tick waited, then arrival), as many
    as fit (``min(budget, max_sessions)``), whatever their kind."""
    steps = [Step(seq, n, arrival=i) for i, (seq, n) in enumerate(spec)]
    planner = TickPlanner(budget, max_sessions)
    while any(s.remaining for s in steps):
        for s in steps:  # the planner sets waiting_since of new steps to the current tick
            if s.remaining and s.waiting_since is None:
                s.waiting_since = planner._ticks  # noqa: SLF001 - the order under test
        waiting = sorted((s for s in steps if s.remaining), key=lambda s: (s.waiting_since, s.arrival))
        pieces = planner.plan(steps)
        assert {id(p.step) for p in pieces} == {id(s) for s in waiting[: min(budget, max_sessions)]}
        assert sum(p.count for p in pieces) <= budget
        for p in pieces:
            p.step.done_rows += p.count


class _LinearCost:
    def __init__(self, fixed: float, per_row: float) -> None:
        self.fixed, self.per_row = fixed, per_row

    def estimate(self, rows: int) -> float:
        return self.fixed + self.per_row * rows


def test_a_decode_deadline_cuts_the_prompt_rows_of_its_tick() -> None:
    """A decode due in 100 ms shares a tick with a 2,000-row prompt: with ticks costing 10.5 ms
    plus 1 ms a row, the prompt gets 48 rows (the tick is estimated at 59.5 ms, within
    DEADLINE_SHARE of the time left), not the 511 the budget would allow."""
    assert DEADLINE_SHARE == 0.6
    decode, prompt = Step(0, 1, arrival=1, deadline=10.1), Step(1, 2000, arrival=0)
    pieces = TickPlanner(512, 8).plan([decode, prompt], now=10.0, cost=_LinearCost(0.0105, 0.001))
    assert {p.step.seq: p.count for p in pieces} == {0: 1, 1: 48}
    # Without a deadline, or without an estimate yet, or past its deadline: the whole budget.
    for step, now, cost in (
        (Step(0, 1, arrival=1), 10.0, _LinearCost(0.01, 0.001)),
        (Step(0, 1, arrival=1, deadline=10.1), 10.0, None),
        (Step(0, 1, arrival=1, deadline=9.9), 10.0, _LinearCost(0.01, 0.001)),
    ):
        pieces = TickPlanner(512, 8).plan([step, Step(1, 2000, arrival=0)], now=now, cost=cost)
        assert {p.step.seq: p.count for p in pieces} == {0: 1, 1: 511}


def test_a_timed_session_between_steps_cuts_the_prompt_rows_too() -> None:
    """A session that uses 100 ms step timeouts is not pending now, but its next step may come
    while this tick runs: it would wait for this tick and its own (10.2 + 1 ms)."""
    pieces = TickPlanner(512, 8).plan(
        [Step(1, 2000, arrival=0)], now=10.0, cost=_LinearCost(0.0102, 0.001), expected_timeout=0.1
    )
    assert [p.count for p in pieces] == [38]


def test_a_deadline_that_no_tick_can_meet_still_lets_prompts_progress() -> None:
    decode, a, b = Step(0, 1, 2, deadline=10.001), Step(1, 500, 0), Step(2, 500, 1)
    pieces = TickPlanner(64, 8).plan([decode, a, b], now=10.0, cost=_LinearCost(0.01, 0.001))
    assert {p.step.seq: p.count for p in pieces} == {0: 1, 1: 1, 2: 1}


def test_without_mixing_a_chunk_tick_leaves_time_for_the_waiting_decodes() -> None:
    """A non-last shard runs a chunk tick, then the decodes' row tick: the chunk is cut so that
    both fit the decode's deadline (60 ms minus the 11.2 ms row tick: 38 rows of 1 ms on top of
    10.2 ms)."""
    planner = TickPlanner(512, 8, mix=False)
    planner._last_was_rows = True  # noqa: SLF001 - the chunk's turn
    decode, prompt = Step(0, 1, arrival=1, deadline=10.1), Step(1, 2000, arrival=0)
    (piece,) = planner.plan([decode, prompt], now=10.0, cost=_LinearCost(0.0102, 0.001))
    assert (piece.step, piece.count) == (prompt, 38)


@settings(max_examples=300, deadline=None)
@given(
    fixed=st.floats(0.0005, 0.05),
    per_row=st.floats(1e-5, 0.01),
    slack=st.floats(0.001, 2.0),
    n_decodes=st.integers(1, 6),
    n_prompts=st.integers(1, 3),
    budget=st.integers(8, 1024),
)
def test_a_tick_with_a_due_decode_is_estimated_to_end_in_time(
    fixed: float, per_row: float, slack: float, n_decodes: int, n_prompts: int, budget: int
) -> None:
    cost = _LinearCost(fixed, per_row)
    steps = [Step(i, 1, arrival=i, deadline=5.0 + slack * (i + 1)) for i in range(n_decodes)]
    steps += [Step(100 + i, 5000, arrival=10 + i) for i in range(n_prompts)]
    pieces = TickPlanner(budget, 16).plan(steps, now=5.0, cost=cost)
    rows = sum(p.count for p in pieces)
    prompt_pieces = [p for p in pieces if p.step.seq >= 100]
    assert rows <= budget
    # Within the share of the nearest deadline, unless every admitted prompt is at its minimum.
    assert cost.estimate(rows) <= DEADLINE_SHARE * slack + 1e-12 or all(p.count == 1 for p in prompt_pieces)


def test_without_mixing_chunk_ticks_take_the_waiting_prompts_in_turn() -> None:
    planner = TickPlanner(8, 8, mix=False)
    a, b = Step(0, 40, arrival=0), Step(1, 40, arrival=1)
    order = []
    for _ in range(4):
        (piece,) = planner.plan([a, b])
        order.append(piece.step.seq)
        piece.step.done_rows += piece.count
    assert order == [0, 1, 0, 1]


def test_oldest_rows_go_first_when_the_tick_is_full() -> None:
    planner = TickPlanner(2, 8)
    steps = [Step(seq, 1, arrival=10 - seq) for seq in range(4)]  # seq 3 arrived first
    assert [p.step.seq for p in planner.plan(steps)] == [2, 3]


def test_planner_refuses_empty_limits() -> None:
    with pytest.raises(ValueError):
        TickPlanner(0, 1)


# ---- the llama.cpp engine ------------------------------------------------------------------

FACTORY = llama_factory("tiny", n_threads=1)


async def _generate(engine, sid: str, tokens: tuple[int, ...], n: int) -> list[int]:  # noqa: ANN001
    r = await engine.prefill(PrefillRequest(sid, tokens=tokens))
    out = [r.logits.token_id]
    for _ in range(n):
        r = await engine.decode(DecodeRequest(sid, token=out[-1]))
        out.append(r.logits.token_id)
    return out


async def _generate_together(engine, n: int, prompt_len: int, n_decode: int) -> None:  # noqa: ANN001
    """Sessions s0..s{n-1}, each a different prompt of ``prompt_len`` tokens, generating at once."""
    for i in range(n):
        await engine.open_session(f"s{i}")
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(_generate, engine, f"s{i}", prompt_tokens(engine, prompt_len, salt=i), n_decode)


async def test_concurrent_sessions_share_native_steps() -> None:
    async with FACTORY.open(EngineOptions(n_ctx=1536, max_sessions=6, n_batch=64)) as engine:
        await _generate_together(engine, 6, 9, 30)
        m = engine.metrics()
        assert m.steps_total == 6 * 31
        # Every decode tick holds all six sessions (the prefills may share fewer ticks).
        assert m.batch_ticks_total <= 30 + 6
        assert m.batch_sessions_total == 6 * 31
        assert m.batch_rows_total == 6 * (9 + 30)
        assert m.batch_queue_wait_us_total > 0


async def test_alone_a_session_gets_one_tick_per_step() -> None:
    async with FACTORY.open() as engine:
        await engine.open_session("s")
        started = time.perf_counter()
        await _generate(engine, "s", prompt_tokens(engine, 5), 10)
        elapsed_us = (time.perf_counter() - started) * 1e6
        m = engine.metrics()
        assert (m.batch_ticks_total, m.batch_sessions_total, m.batch_rows_total) == (11, 11, 15)
        # The time inside llama_decode is accounted for every tick, and is part of the steps.
        assert 0 < m.native_step_us_total <= elapsed_us


async def test_tick_distributions_bucket_each_tick_and_count_a_waiting_session_as_idle() -> None:
    """One session alone: its 5-row prompt tick and 10 one-row decode ticks fall in their rows
    buckets, one session each; every gap between its ticks is idle time (it stays open); the
    gap after it was released, before another session's first tick, is not."""
    async with FACTORY.open() as engine:
        await engine.open_session("s")
        await _generate(engine, "s", prompt_tokens(engine, 5), 10)
        d = engine.tick_distributions()
        rows = dict(zip((*TICK_ROWS_BUCKETS, math.inf), d.rows.counts))
        assert (rows[1], rows[8], sum(rows.values())) == (10, 1, 11)  # 1 row x 10; 5 rows <= 8
        assert d.sessions.counts[0] == d.sessions.count == 11
        assert d.idle_seconds.count == 10
        await engine.release("s")
        await engine.open_session("t")
        await _generate(engine, "t", prompt_tokens(engine, 3, salt=1), 2)
        d = engine.tick_distributions()
        assert d.seconds.count == 14
        assert d.idle_seconds.count == 10 + 2  # not the gap before t's first tick
        m = engine.metrics()
        assert m.batch_idle_us_total <= d.idle_seconds.total * 1e6 + 1e-3
        await engine.release("t")


async def test_batch_limits_from_the_load_spec() -> None:
    engine = FACTORY.create()
    async with engine:
        spec = FACTORY.load_spec(EngineOptions(n_ctx=1536, max_sessions=6, n_batch=64))
        await engine.load(replace(spec, batch_tokens=16, max_batch_sessions=2))
        await _generate_together(engine, 4, 40, 3)
        m = engine.metrics()
        assert m.batch_sessions_total <= 2 * m.batch_ticks_total
        assert m.batch_rows_total <= 16 * m.batch_ticks_total
        assert m.batch_rows_total == 4 * 43


async def test_a_cancelled_session_leaves_a_shared_step_and_the_others_go_on() -> None:
    """A long prompt shares ticks with running decodes; cancelling it mid-prompt rolls it back
    and frees its cells while the decodes finish with the tokens they get alone."""
    async with FACTORY.open(EngineOptions(n_ctx=2048, max_sessions=4, n_batch=8)) as whole:
        alone = {}
        for i in range(3):
            await whole.open_session("ref")
            alone[i] = await _generate(whole, "ref", prompt_tokens(whole, 6, salt=i), 25)
            await whole.release("ref")
        tasks_before = count_tasks()
        got = {}

        async def run(i: int) -> None:
            got[i] = await _generate(whole, f"d{i}", prompt_tokens(whole, 6, salt=i), 25)

        for i in range(3):
            await whole.open_session(f"d{i}")
        await whole.open_session("long")
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(run, i)
            op = start_op(nursery, whole.prefill,
                          PrefillRequest("long", tokens=prompt_tokens(whole, 400, salt=7)))
            await wait_running(whole, "long")
            for _ in range(20):
                await trio.lowlevel.checkpoint()
            whole.cancel("long")
        assert isinstance(op.error, EngineCancelled)
        assert got == alone
        assert whole.session_info("long").n_past == 0
        assert whole.metrics().kv_cells_used == 3 * 31
        assert count_tasks() == tasks_before


# ---- knobs ---------------------------------------------------------------------------------


def test_batch_knobs_are_validated_and_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    from shard.cli import build_parser
    from shard.engine import InvalidInput, LoadSpec

    for bad in ({"batch_tokens": 0}, {"max_batch_sessions": -1}):
        with pytest.raises(InvalidInput):
            LoadSpec(**bad)
    monkeypatch.setenv("TRIO_SHARD_MAX_BATCH_SESSIONS", "3")
    args = build_parser().parse_args(["serve", "--batch-tokens", "128"])
    assert (args.batch_tokens, args.max_batch_sessions) == (128, 3)
    args = build_parser().parse_args(["serve"])
    assert args.batch_tokens is None  # default: the engine uses --batch


async def test_new_sessions_take_the_lowest_free_sequence_ids() -> None:
    """llama.cpp (one KV stream per sequence) batches runs of *consecutive* sequence ids in one
    ubatch: a session must take the lowest free id, so sessions open together sit side by side
    even after churn (a LIFO free list scattered them and halved 4-session throughput)."""
    from shard.engine import LoadSpec
    from shard.engine.fake import FakeEngine

    async with FakeEngine() as engine:
        await engine.load(LoadSpec(n_ctx=800, max_sessions=8))
        for i in range(8):
            await engine.open_session(f"s{i}")
        for i in (6, 1, 4, 3):
            await engine.release(f"s{i}")
        for name in ("a", "b", "c"):
            await engine.open_session(name)
        ids = {sid: engine._slots[sid].seq_id for sid in ("a", "b", "c")}  # internal, on purpose
        assert ids == {"a": 1, "b": 3, "c": 4}


async def test_a_batch_groups_sessions_take_neighbouring_sequence_ids() -> None:
    """A pipeline opens its generations' sessions in its batch groups in turn, and a tick holds
    one group: with the lowest free id each group held every third id (0, 3, 6), so each of its
    ticks ran as one ubatch per row (two hops served 0.7x the whole model; 0.9-1.0x once the
    groups held neighbouring ids). Sessions without a group still take the lowest free id."""
    from shard.engine import LoadSpec
    from shard.engine.fake import FakeEngine
    from shard.engine.seq_ids import runs

    async with FakeEngine() as engine:
        await engine.load(LoadSpec(n_ctx=1600, max_sessions=16))
        groups = (7001, 7002, 7003)
        for i in range(8):
            await engine.open_session(f"g{i}", batch_group=groups[i % 3])
        ids = {sid: s.seq_id for sid, s in engine._slots.items()}  # internal, on purpose
        for g in groups:
            assert runs(s.seq_id for s in engine._slots.values() if s.batch_group == g) == 1, ids
        await engine.open_session("plain")
        assert engine._slots["plain"].seq_id == min(set(range(16)) - set(ids.values()))


@given(
    held=st.dictionaries(st.integers(0, 23), st.integers(0, 3), max_size=20),
    group=st.integers(0, 3),
)
def test_a_sequence_id_is_free_and_next_to_the_group_when_it_can_be(
    held: dict[int, int], group: int,
) -> None:
    from shard.engine.seq_ids import pick_seq_id

    free = set(range(24)) - set(held)
    if not free:
        return
    seq = pick_seq_id(free, held, group)
    assert seq in free
    if group == 0:
        assert seq == min(free)
        return
    neighbours = {s + d for s, g in held.items() if g == group for d in (-1, 1)} & free
    if neighbours:
        assert seq in neighbours


@given(n_groups=st.integers(2, 6), per_group=st.integers(1, 5))
def test_groups_opened_in_turn_into_room_each_form_one_run(n_groups: int, per_group: int) -> None:
    """Generations spread over the groups in turn (``shard.pipeline.groups``): with room for
    twice the sessions, every group ends up as one run of ids (one ubatch per tick)."""
    from shard.engine.seq_ids import pick_seq_id, runs

    n = n_groups * per_group
    held: dict[int, int] = {}
    free = set(range(2 * n))
    for i in range(n):
        seq = pick_seq_id(free, held, 1 + i % n_groups)
        free.remove(seq)
        held[seq] = 1 + i % n_groups
    for g in range(1, n_groups + 1):
        assert runs(s for s, h in held.items() if h == g) == 1, held


@pytest.mark.parametrize("ahead", [False, True], ids=["ticks", "lookahead"])
async def test_every_native_call_writes_its_rows_in_increasing_sequence_order(ahead: bool) -> None:
    """llama.cpp splits a batch into one ubatch per run of rows whose sequence ids go up one by
    one (one KV stream per sequence), and every ubatch reads all the weights: four sessions'
    rows in the order 3, 2, 1, 0 took twice as long as sorted (and 4 sessions served 0.52-0.61
    of raw batching). Whatever order the steps arrive in, every call writes them sorted."""
    from shard.engine import Lookahead

    calls: list[list[int]] = []
    async with FACTORY.open(EngineOptions(n_ctx=1536, max_sessions=6, n_batch=64)) as engine:
        fill_batch, fill_rows = engine._fill_batch, engine._fill_rows  # spies on the real engine

        def spy_batch(live):  # noqa: ANN001, ANN202
            calls.append([work.slot.seq_id for work, _ in live])
            return fill_batch(live)

        def spy_rows(rows):  # noqa: ANN001, ANN202
            calls.append([seq for _, _, seq in rows])
            return fill_rows(rows)

        engine._fill_batch, engine._fill_rows = spy_batch, spy_rows

        async def generate(sid: str, salt: int) -> None:
            hint = Lookahead() if ahead else None
            r = await engine.prefill(PrefillRequest(sid, tokens=prompt_tokens(engine, 5, salt=salt),
                                                    lookahead=hint))
            for _ in range(24):
                r = await engine.decode(DecodeRequest(sid, token=r.logits.token_id, lookahead=hint))

        for i in range(6):
            await engine.open_session(f"s{i}")
        for i in (0, 1):
            await engine.release(f"s{i}")
        async with trio.open_nursery() as nursery:
            for i in range(2, 6):
                nursery.start_soon(generate, f"s{i}", i)
            while engine.metrics().steps_total < 3 * 4:  # under way before the late ones
                await trio.sleep(0.001)
            for sid in ("late0", "late1"):  # the lowest ids, arriving last
                await engine.open_session(sid)
                nursery.start_soon(generate, sid, 9)
        if ahead:
            assert engine.metrics().lookahead_used_total > 0
    shared = [c for c in calls if len(c) > 1]
    assert len(shared) >= 10 and any(c[0] < 2 for c in shared)
    assert all(c == sorted(c) for c in shared), [c for c in shared if c != sorted(c)][:3]


@pytest.mark.parametrize(("tick", "transit"), [(0.010, 0.035), (0.2, 1.2), (0.3, 2.0)])
async def test_a_batch_group_back_from_the_other_hops_is_gathered_into_one_tick(
    autojump_clock: trio.abc.Clock, tick: float, transit: float,
) -> None:
    """Issue 32: a pipeline hop sees a batch group come back after the other groups' ticks, its
    members a moment apart. The group's two sessions must share each tick: a gather that only
    remembered the sessions of the last two ticks (of any group) had forgotten them, started
    the tick with the first member back and split the group for good (one session a tick). The
    slow cases (a group away for seconds, as on a pipeline of slow hops) failed with a gather
    that also forgot sessions unseen for a second."""
    from shard.engine.fake import FakeEngine, FakeScript

    steps = 12  # a group is away for 3.5-7 ticks, its members 1 ms apart
    async with FakeEngine(script=FakeScript(batched=True, tick_latency=tick)) as engine:
        await engine.load(LoadSpec(n_ctx=1024, max_sessions=6))
        for g in range(3):
            for m in range(2):
                await engine.open_session(f"g{g}m{m}", batch_group=g + 1)
                await engine.prefill(PrefillRequest(f"g{g}m{m}", tokens=(1, 5, 6)))
        before = engine.metrics()

        async def member(g: int, m: int) -> None:
            token = 7
            for _ in range(steps):
                await trio.sleep(transit + 0.001 * m + 0.003 * g)  # the other hops, then back
                token = (await engine.decode(DecodeRequest(f"g{g}m{m}", token=token))).logits.token_id

        async with trio.open_nursery() as nursery:
            for g in range(3):
                for m in range(2):
                    nursery.start_soon(member, g, m)
        after = engine.metrics()
    ticks = after.batch_ticks_total - before.batch_ticks_total
    sessions = after.batch_sessions_total - before.batch_sessions_total
    assert sessions == 3 * 2 * steps
    assert ticks == 3 * steps, f"{sessions} session-steps in {ticks} ticks: groups were split"
