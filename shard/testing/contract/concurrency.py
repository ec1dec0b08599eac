"""Contract tests of many sessions at once: one step per session at a time, continuous
batching invisible in the results, and nothing (cells, tasks, threads) left behind."""

from __future__ import annotations

import random
import threading

import pytest
import trio

from shard.engine import (
    EngineCancelled,
    SessionBusy,
    SessionExists,
    SessionState,
    StepResult,
)

from ..factories import EngineFactory
from .harness import (
    LONG_PROMPT,
    assert_same_logits,
    count_native_threads,
    count_tasks,
    decode,
    generate,
    greedy_steps,
    next_greedy_step,
    prefill,
    prompt_tokens,
    start_op,
    wait_running,
    whole_options,
)

N_LEAK_CYCLES = 1000


class Concurrency:
    """Concurrent sessions compute what each computes alone and leak nothing."""

    async def test_concurrent_operations_on_one_session_are_rejected(
        self, engine_factory: EngineFactory
    ) -> None:
        async with engine_factory.open() as engine:
            await engine.open_session("s")
            await engine.open_session("t")
            tokens = prompt_tokens(engine, LONG_PROMPT)
            async with trio.open_nursery() as nursery:
                op = start_op(nursery, prefill, engine, "s", tokens)
                await wait_running(engine, "s")
                assert engine.metrics().operations_running == 1
                with pytest.raises(SessionBusy) as info:
                    await prefill(engine, "s", tokens)
                assert info.value.retryable
                with pytest.raises(SessionBusy):
                    await decode(engine, "s", 5)
                with pytest.raises(SessionExists):
                    await engine.open_session("s")
                assert engine.session_info("s").state is SessionState.RUNNING
                assert engine.session_info("t").state is SessionState.IDLE
                await op.done.wait()
            assert op.error is None, op.error
            assert op.value.n_past == LONG_PROMPT
            info2 = engine.session_info("s")
            assert info2.state is SessionState.IDLE and info2.n_past == LONG_PROMPT
            assert engine.metrics().operations_running == 0

    async def test_operations_on_different_sessions_run_concurrently_and_agree(
        self, engine_factory: EngineFactory
    ) -> None:
        async with engine_factory.open() as engine:
            tokens = prompt_tokens(engine, 40)
            for sid in ("a", "b", "c"):
                await engine.open_session(sid)
            outs: dict[str, list[int]] = {}

            async def gen(sid: str) -> None:
                outs[sid] = await generate(engine, sid, tokens, 6)

            async with trio.open_nursery() as nursery:
                for sid in ("a", "b", "c"):
                    nursery.start_soon(gen, sid)
            assert outs["a"] == outs["b"] == outs["c"]
            assert engine.metrics().kv_cells_used == 3 * 46

    @pytest.mark.parametrize("seed", [3, 4, 12])  # each mixes runs, cancels and releases
    async def test_many_sessions_at_once_match_each_session_alone(
        self, engine_factory: EngineFactory, seed: int
    ) -> None:
        """Random arrivals, cancels and releases: every session that survives chooses exactly
        the greedy tokens it chooses alone (logprobs within 1e-3: a batch's shape may change
        floating-point sums), and nothing is left behind."""
        async with engine_factory.open(whole_options(n_ctx=1024, max_sessions=8)) as engine:
            rng = random.Random(seed)
            plans = [
                (prompt_tokens(engine, rng.randint(1, 40), salt=i), rng.randint(0, 10),
                 rng.choice(["run", "run", "cancel", "release"]), rng.randint(0, 12))
                for i in range(8)
            ]
            alone: list[list[StepResult]] = []
            for tokens, n_decode, _, _ in plans:
                await engine.open_session("alone")
                alone.append(await greedy_steps(engine, "alone", tokens, n_decode))
                await engine.release("alone")
            tasks_before = count_tasks()
            threads_before, native_before = threading.active_count(), count_native_threads()
            kept: dict[str, int] = {}

            async def one(i: int) -> None:
                tokens, n_decode, fate, delay = plans[i]
                for _ in range(delay):  # random arrival, in scheduler rounds
                    await trio.lowlevel.checkpoint()
                sid = f"many-{i}"
                # batch groups are a scheduling hint: results never depend on them
                await engine.open_session(sid, batch_group=i % 3)
                stop_at = rng.randint(0, n_decode) if fate != "run" else -1
                steps: list[StepResult] = []
                for j in range(n_decode + 1):
                    if j == stop_at:
                        n_past = engine.session_info(sid).n_past
                        async with trio.open_nursery() as nursery:
                            op = start_op(nursery, next_greedy_step, engine, sid, tokens, steps)
                            await wait_running(engine, sid)
                            if fate == "cancel":
                                assert engine.cancel(sid) is True
                            else:
                                assert await engine.release(sid) is True
                        assert isinstance(op.error, EngineCancelled), op.error
                        if fate == "release":
                            return
                        assert engine.session_info(sid).n_past == n_past  # rolled back
                    steps.append(await next_greedy_step(engine, sid, tokens, steps))
                for got, want in zip(steps, alone[i], strict=True):
                    assert got.n_past == want.n_past
                    assert_same_logits(got, want)
                kept[sid] = steps[-1].n_past

            async with trio.open_nursery() as nursery:
                for i in range(len(plans)):
                    nursery.start_soon(one, i)
            m = engine.metrics()
            assert m.operations_running == 0 and m.sessions_active == len(kept)
            assert m.kv_cells_used == sum(kept.values())
            for sid in kept:
                assert await engine.release(sid) is True
            assert engine.metrics().kv_cells_used == 0
            assert count_tasks() == tasks_before
            # Steps of all sessions share one engine thread at a time: no thread is left behind
            # (Trio may keep an idle worker cached, which the warm-up above already created).
            assert threading.active_count() <= threads_before
            assert count_native_threads() <= native_before

    async def test_tick_distributions_agree_with_the_batching_counters(
        self, engine_factory: EngineFactory
    ) -> None:
        """``tick_distributions`` counts every tick the counters count, once: one observation
        of its duration, rows and sessions per tick, summing to ``batch_rows_total`` and
        ``batch_sessions_total``; the rows are those the steps computed (3 sessions' 5-token
        prompts and 6 decodes each: 33), or there is no tick at all (an engine that does not
        batch). Idle gaps: at most one per tick after the first, their sum the counter's."""
        async with engine_factory.open(whole_options(n_ctx=512, max_sessions=4)) as engine:
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    await engine.open_session(f"t{i}")
                    nursery.start_soon(generate, engine, f"t{i}", prompt_tokens(engine, 5, salt=i), 6)
            m, d = engine.metrics(), engine.tick_distributions()
            assert d.seconds.count == d.rows.count == d.sessions.count == m.batch_ticks_total
            assert (d.rows.total, d.sessions.total) == (m.batch_rows_total, m.batch_sessions_total)
            assert m.batch_rows_total in (0, 3 * (5 + 6))
            assert m.batch_ticks_total <= m.batch_sessions_total <= m.batch_rows_total
            assert d.idle_seconds.count <= max(m.batch_ticks_total - 1, 0)
            # (the counters add whole microseconds per observation)
            for total_us, dist in ((m.batch_tick_us_total, d.seconds),
                                   (m.batch_idle_us_total, d.idle_seconds)):
                assert dist.total * 1e6 - dist.count <= total_us <= dist.total * 1e6 + 1e-3
            for i in range(3):
                await engine.release(f"t{i}")

    async def test_a_thousand_sessions_leave_nothing_behind(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open(whole_options(n_ctx=256, max_sessions=4)) as engine:
            tokens = prompt_tokens(engine, 3)

            async def cycle(i: int) -> None:
                sid = f"leak-{i}"
                await engine.open_session(sid)
                if i % 10 == 9:
                    pass  # opened and released without any work
                elif i % 100 == 42:  # cancelled mid-operation, then released
                    async with trio.open_nursery() as nursery:
                        op = start_op(nursery, prefill, engine, sid, prompt_tokens(engine, 40))
                        await wait_running(engine, sid)
                        engine.cancel(sid)
                    assert isinstance(op.error, EngineCancelled)
                else:
                    r = await prefill(engine, sid, tokens, top_k_logprobs=1)
                    assert r.logits is not None
                    await decode(engine, sid, r.logits.token_id, top_k_logprobs=0)
                assert await engine.release(sid) is True
                # Checked after *every* release: the next session reuses the same sequence id,
                # and its first step truncates that sequence, which would hide a leak here.
                assert engine.metrics().kv_cells_used == 0, f"cycle {i} left KV cells"

            warmup = 50
            for i in range(warmup):
                await cycle(i)
            threads_before = threading.active_count()
            native_before = count_native_threads()
            tasks_before = count_tasks()
            for i in range(warmup, warmup + N_LEAK_CYCLES):
                await cycle(i)
            m = engine.metrics()
            assert (m.kv_cells_used, m.sessions_active, m.operations_running) == (0, 0, 0)
            assert m.sessions_opened_total == m.sessions_released_total == warmup + N_LEAK_CYCLES
            assert engine.sessions() == ()
            assert count_tasks() == tasks_before
            # Trio keeps idle worker threads cached for reuse (a worker is marked idle before it
            # reports back, so a sequential workload never needs a second one): after the
            # warm-up the cache is as large as this workload needs, so the counts may only stay
            # or shrink.
            assert threading.active_count() <= threads_before
            assert count_native_threads() <= native_before
