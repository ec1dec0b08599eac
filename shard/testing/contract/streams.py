"""Contract tests of ``ShardEngine.stream`` (a generation's steady state): it delivers what
decoding step by step gives, and keeps exactly what it delivered however it ends."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from shard.engine import (
    GREEDY,
    DecodeRequest,
    EngineCancelled,
    EngineState,
    IllegalTransition,
    InvalidInput,
    SamplingParams,
    SessionState,
    ShardEngine,
    StepResult,
    StreamRequest,
    UnknownSession,
)

from ..factories import EngineFactory
from .harness import (
    assert_same_logits,
    decode,
    decode_fresh,
    open_with_history,
    prefill,
    prompt_tokens,
    start_op,
)


async def _stream(engine: ShardEngine, sid: str, token: int, max_steps: int,
                  stop_after: int | None = None, **kw: Any) -> tuple[int, list[StepResult]]:
    """Stream ``max_steps`` from ``token`` (``kw``: the other ``StreamRequest`` fields), telling
    the engine to stop after ``stop_after`` results; returns its step count and every result."""
    got: list[StepResult] = []

    def deliver(result: StepResult) -> bool:
        got.append(result)
        return stop_after is None or len(got) < stop_after

    n = await engine.stream(StreamRequest(sid, token, max_steps, **kw), deliver)
    return n, got


class Streams:
    """A stream equals step-by-step decoding and keeps exactly the steps it delivered."""

    @pytest.mark.parametrize("lookahead", [True, False], ids=["ahead", "plain"])
    async def test_a_stream_delivers_what_decoding_step_by_step_gives(
        self, engine_factory: EngineFactory, lookahead: bool
    ) -> None:
        """Three sessions stream at once (a batching engine runs them in shared ticks), greedy
        and seeded: each gets exactly the results of decoding step by step, committed as
        delivered, and leaves no scratch once released."""
        seeded = SamplingParams(temperature=0.8, top_k=20, seed=7)
        async with engine_factory.open() as engine:
            sessions = {"g0": GREEDY, "g1": GREEDY, "seeded": seeded}
            prompts = {sid: prompt_tokens(engine, 10, salt=i) for i, sid in enumerate(sessions)}
            before = engine.metrics()
            streamed: dict[str, list[StepResult]] = {}

            async def run(sid: str) -> None:
                await engine.open_session(sid)
                r = await prefill(engine, sid, prompts[sid], sampling=sessions[sid])
                assert r.logits is not None
                n, got = await _stream(engine, sid, r.logits.token_id, 9, lookahead=lookahead,
                                            sampling=sessions[sid], top_k_logprobs=2)
                assert n == len(got) == 9
                streamed[sid] = [r, *got]

            async with trio.open_nursery() as nursery:
                for sid in sessions:
                    nursery.start_soon(run, sid)
            assert engine.metrics().decode_tokens_total == before.decode_tokens_total + 27
            for sid, sampling in sessions.items():
                info = engine.session_info(sid)
                assert info.state is SessionState.IDLE and info.n_past == 10 + 9
                got = streamed[sid]
                assert [r.n_past for r in got] == list(range(10, 20))
                assert info.tokens == (*prompts[sid], *(r.logits.token_id for r in got[:-1]))  # type: ignore[union-attr]
                await engine.open_session("ref")
                ref = [await prefill(engine, "ref", prompts[sid], sampling=sampling)]
                for _ in range(9):
                    token = ref[-1].logits.token_id  # type: ignore[union-attr]
                    ref.append(await decode(engine, "ref", token, sampling=sampling, top_k_logprobs=2))
                for a, b in zip(got, ref, strict=True):
                    assert_same_logits(a, b)
                await engine.release("ref")
            for sid in sessions:
                await engine.release(sid)
            m = engine.metrics()
            assert (m.kv_cells_used, m.lookahead_cells, m.operations_running) == (0, 0, 0)

    async def test_a_stream_ends_when_deliver_says_so_at_max_steps_and_at_the_budget(
        self, engine_factory: EngineFactory
    ) -> None:
        async with engine_factory.open() as engine:
            history, token = await open_with_history(engine)
            n, got = await _stream(engine, "s", token, 50, stop_after=3)
            assert n == len(got) == 3 and engine.session_info("s").n_past == len(history) + 3
            assert got[-1].logits is not None
            n, got = await _stream(engine, "s", got[-1].logits.token_id, 2)
            assert n == len(got) == 2 and engine.session_info("s").n_past == len(history) + 5
            await engine.open_session("small", kv_budget=len(history) + 4)
            r = await prefill(engine, "small", history)
            assert r.logits is not None
            n, got = await _stream(engine, "small", r.logits.token_id, 50)
            assert n == 4 and engine.session_info("small").n_past == len(history) + 4
            for sid in ("s", "small"):
                await engine.release(sid)
            assert engine.metrics().kv_cells_used == 0

    @pytest.mark.parametrize("how", ["engine.cancel", "cancel_scope", "release"])
    async def test_a_stopped_stream_keeps_what_it_delivered(
        self, engine_factory: EngineFactory, how: str
    ) -> None:
        """Cancelled, its caller cancelled or its session released while it runs, a stream ends
        holding exactly the steps it delivered: the step in flight is rolled back."""
        async with engine_factory.open() as engine:
            history, token = await open_with_history(engine)
            got: list[StepResult] = []

            def deliver(result: StepResult) -> bool:
                got.append(result)
                return True

            async with trio.open_nursery() as nursery:
                op = start_op(nursery, engine.stream, StreamRequest("s", token, 100_000), deliver)
                with trio.fail_after(120):
                    while len(got) < 3:
                        await trio.lowlevel.checkpoint()
                if how == "engine.cancel":
                    assert engine.cancel("s") is True
                elif how == "cancel_scope":
                    op.scope.cancel()
                else:
                    assert await engine.release("s") is True
                await op.done.wait()
            if how == "cancel_scope":
                assert op.caller_cancelled and op.error is None
            else:
                assert isinstance(op.error, EngineCancelled), op.error
            m = engine.metrics()
            assert m.operations_running == 0
            if how == "release":
                assert (m.sessions_active, m.kv_cells_used, m.lookahead_cells) == (0, 0, 0)
                return
            kept = len(history) + len(got)
            info = engine.session_info("s")
            assert info.state is SessionState.IDLE and info.n_past == kept == got[-1].n_past
            assert info.tokens == (*history, token, *(r.logits.token_id for r in got[:-1]))  # type: ignore[union-attr]
            assert m.kv_cells_used == kept
            last = got[-1].logits
            assert last is not None
            after = await decode(engine, "s", last.token_id)
            assert_same_logits(after, await decode_fresh(engine, "ref", info.tokens, last.token_id))
            for sid in ("s", "ref"):
                await engine.release(sid)
            assert (engine.metrics().kv_cells_used, engine.metrics().lookahead_cells) == (0, 0)

    async def test_an_exception_of_deliver_ends_the_stream_and_the_engine_stays_ready(
        self, engine_factory: EngineFactory
    ) -> None:
        async with engine_factory.open() as engine:
            history, token = await open_with_history(engine)
            seen: list[StepResult] = []

            def deliver(result: StepResult) -> bool:
                seen.append(result)
                if len(seen) == 2:
                    raise ValueError("the caller's own bug")
                return True

            with pytest.raises(ValueError, match="the caller's own bug"):
                await engine.stream(StreamRequest("s", token, 10), deliver)
            assert engine.health().state is EngineState.READY
            info = engine.session_info("s")
            assert info.state is SessionState.IDLE and info.n_past == len(history) + 2
            assert engine.metrics().kv_cells_used == len(history) + 2
            n, _ = await _stream(engine, "s", seen[-1].logits.token_id, 2)  # type: ignore[union-attr]
            assert n == 2
            await engine.release("s")

    async def test_bad_streams_are_refused_before_anything_runs(
        self, engine_factory: EngineFactory
    ) -> None:
        async with engine_factory.open() as engine:
            ok = lambda r: True  # noqa: E731
            with pytest.raises(InvalidInput):
                StreamRequest("s", 5, 0)
            with pytest.raises(UnknownSession):
                await engine.stream(StreamRequest("nope", 5, 3), ok)
            await engine.open_session("s")
            with pytest.raises(IllegalTransition):
                await engine.stream(StreamRequest("s", 5, 3), ok)
            history, token = prompt_tokens(engine, 6), 0
            r = await prefill(engine, "s", history)
            assert r.logits is not None
            token = r.logits.token_id
            for bad in (StreamRequest("s", engine.capabilities().n_vocab, 3),
                        StreamRequest("s", token, 3, top_k_logprobs=-1)):
                with pytest.raises(InvalidInput):
                    await engine.stream(bad, ok)
            with pytest.raises(InvalidInput):
                await engine.stream(StreamRequest("s", token, 3), None)  # type: ignore[arg-type]
            with pytest.raises(InvalidInput):
                await engine.stream(DecodeRequest("s", token=token), ok)  # type: ignore[arg-type]
            assert engine.session_info("s").n_past == 6
            await engine.release("s")
