"""Contract tests of cancellation: ``cancel``, a caller's cancel scope, ``release`` and ``aclose``
while a step runs. A stopped step is rolled back; the session stays usable."""

from __future__ import annotations

import pytest
import trio

from shard.engine import (
    EngineCancelled,
    EngineState,
    NotReady,
    SessionState,
    ShardEngine,
    UnknownSession,
)

from ..factories import EngineFactory
from .harness import (
    LONG_PROMPT,
    assert_same_logits,
    decode,
    decode_fresh,
    open_with_history,
    prefill,
    prompt_tokens,
    start_op,
    wait_running,
)


class Cancellation:
    """Stopping a running step, by every route, rolls it back and frees what it held."""

    @pytest.mark.parametrize("how", ["engine.cancel", "cancel_scope"])
    async def test_cancel_mid_prefill_rolls_back_and_leaves_session_usable(
        self, engine_factory: EngineFactory, how: str
    ) -> None:
        async with engine_factory.open() as engine:
            history, next_token = await open_with_history(engine)
            before = engine.metrics()
            long_tail = prompt_tokens(engine, LONG_PROMPT, salt=4)[1:]
            async with trio.open_nursery() as nursery:
                op = start_op(nursery, prefill, engine, "s", long_tail, len(history))
                await wait_running(engine, "s")
                if how == "engine.cancel":
                    assert engine.cancel("s") is True
                    assert engine.cancel("s") is True  # idempotent while still running
                else:
                    op.scope.cancel()
                await op.done.wait()
            if how == "engine.cancel":
                assert isinstance(op.error, EngineCancelled), op.error
                assert op.error.retryable and op.error.session_id == "s"
                assert engine.metrics().cancelled_total == before.cancelled_total + 1
            else:
                assert op.caller_cancelled and op.error is None and op.value is None
            m = engine.metrics()
            assert m.prefill_tokens_total == before.prefill_tokens_total  # nothing committed
            assert m.steps_total == before.steps_total
            await _assert_rolled_back(engine, history, next_token)

    @pytest.mark.parametrize("how", ["engine.cancel", "cancel_scope"])
    async def test_cancel_mid_decode_rolls_back_and_leaves_session_usable(
        self, engine_factory: EngineFactory, how: str
    ) -> None:
        async with engine_factory.open() as engine:
            history, next_token = await open_with_history(engine)
            async with trio.open_nursery() as nursery:
                op = start_op(nursery, decode, engine, "s", next_token)
                await wait_running(engine, "s")
                if how == "engine.cancel":
                    assert engine.cancel("s") is True
                else:
                    op.scope.cancel()
                await op.done.wait()
            if how == "engine.cancel":
                assert isinstance(op.error, EngineCancelled), op.error
            else:
                assert op.caller_cancelled and op.error is None
            await _assert_rolled_back(engine, history, next_token)

    async def test_cancel_of_a_rewriting_prefill_keeps_the_reused_prefix(
        self, engine_factory: EngineFactory
    ) -> None:
        """A prefill at an earlier position that was cancelled once it began changing the KV
        cells keeps ``position + reused`` (the old positions after it were being replaced)."""
        async with engine_factory.open() as engine:
            history, _ = await open_with_history(engine)
            new = history[4:8] + prompt_tokens(engine, LONG_PROMPT, salt=5)[1:]
            async with trio.open_nursery() as nursery:
                op = start_op(nursery, prefill, engine, "s", new, 4)
                await wait_running(engine, "s")
                # Wait until the prefill changed the cells: 8 kept plus its first rows (never
                # 12 again: the fake computes one row, llama.cpp a chunk of n_batch 8).
                with trio.fail_after(120):
                    while engine.metrics().kv_cells_used == len(history):
                        await trio.lowlevel.checkpoint()
                engine.cancel("s")
            assert isinstance(op.error, EngineCancelled)
            info = engine.session_info("s")
            assert info.state is SessionState.IDLE
            assert info.n_past == 8 and info.tokens == history[:8]
            assert engine.metrics().kv_cells_used == 8

    async def test_a_step_whose_caller_was_already_cancelled_never_starts(
        self, engine_factory: EngineFactory
    ) -> None:
        """A rewriting prefill whose caller's scope is cancelled before it was called (a Cancel
        that arrived first) raises ``trio.Cancelled`` and leaves the session as it was."""
        async with engine_factory.open() as engine:
            history, next_token = await open_with_history(engine)
            before = engine.metrics()
            new = history[4:8] + prompt_tokens(engine, LONG_PROMPT, salt=5)[1:]
            with trio.CancelScope() as scope:
                scope.cancel()
                await prefill(engine, "s", new, 4)
            assert scope.cancelled_caught
            assert engine.metrics().steps_total == before.steps_total
            await _assert_rolled_back(engine, history, next_token)

    async def test_release_while_running_cancels_and_frees(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            await engine.open_session("s")
            async with trio.open_nursery() as nursery:
                op = start_op(nursery, prefill, engine, "s", prompt_tokens(engine, LONG_PROMPT))
                await wait_running(engine, "s")
                first = start_op(nursery, engine.release, "s")
                second = start_op(nursery, engine.release, "s")
                await first.done.wait()
                await second.done.wait()
                # From the moment release starts the session is unknown to everyone else.
                with pytest.raises(UnknownSession):
                    engine.session_info("s")
            assert isinstance(op.error, EngineCancelled), op.error
            assert sorted([first.value, second.value]) == [False, True]
            assert await engine.release("s") is False
            with pytest.raises(UnknownSession):
                await decode(engine, "s", 5)
            m = engine.metrics()
            assert (m.sessions_active, m.kv_cells_used, m.operations_running) == (0, 0, 0)
            await engine.open_session("s")  # the id is free again
            assert engine.session_info("s").n_past == 0

    async def test_release_is_completed_even_if_the_caller_is_cancelled(
        self, engine_factory: EngineFactory
    ) -> None:
        async with engine_factory.open() as engine:
            await engine.open_session("s")
            async with trio.open_nursery() as nursery:
                op = start_op(nursery, prefill, engine, "s", prompt_tokens(engine, LONG_PROMPT))
                await wait_running(engine, "s")
                rel = start_op(nursery, engine.release, "s")
                rel.scope.cancel()
            assert isinstance(op.error, EngineCancelled)
            assert engine.metrics().sessions_active == 0
            assert engine.metrics().kv_cells_used == 0

    async def test_close_while_running_stops_the_operation(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            await engine.open_session("s")
            async with trio.open_nursery() as nursery:
                op = start_op(nursery, prefill, engine, "s", prompt_tokens(engine, LONG_PROMPT))
                await wait_running(engine, "s")
                await engine.aclose()
            assert isinstance(op.error, EngineCancelled), op.error
            assert engine.health().state is EngineState.CLOSED
            with pytest.raises(NotReady):
                await engine.open_session("t")


async def _assert_rolled_back(
    engine: ShardEngine, history: tuple[int, ...], next_token: int
) -> None:
    """"s" is IDLE, holds exactly ``history`` and computes as a fresh session would."""
    info = engine.session_info("s")
    assert info.state is SessionState.IDLE
    assert info.n_past == len(history) and info.tokens == history
    assert engine.metrics().kv_cells_used == len(history)
    assert engine.metrics().operations_running == 0
    assert engine.cancel("s") is False  # idempotent: nothing left to stop
    after = await decode(engine, "s", next_token)
    ref = await decode_fresh(engine, "ref", history, next_token)
    assert after.n_past == ref.n_past == len(history) + 1
    assert_same_logits(after, ref)
    await engine.release("ref")
