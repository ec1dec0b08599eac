"""The session state machine without a network: lifecycle, fail-closed transitions, credit,
deadlines, cancellation, resume/TTL and release. Uses FakeEngine and, where time matters, the
autojump clock (no real sleeping); assertions go through engine and registry state."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import (
    V,
    Driver,
    StepGate,
    assert_no_leaks,
    driver,
    loaded,
    make_engine,
    running_registry,
)
from shard.engine import EngineFailure, LayerRange, LoadSpec, PrefillRequest
from shard.engine.fake import FakeEngine, FakeModel
from shard.rpc.convert import array_to_tensor, cache_expectation, tensor_to_array
from shard.rpc.errors import ErrorCode
from shard.rpc.registry import Registry
from shard.rpc.session import Phase, SessionLimits, StreamEnd
from shard.v1 import shard_pb2 as pb

R = pb.CacheResult
TOKENS = [1, 72, 101, 108, 108, 111]


async def test_open_prefill_decode_generate_close_releases() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg, driver(reg) as d:
        opened = await d.open("s1")
        assert opened.cache.outcome == R.OUTCOME_NEW
        assert opened.kv_capacity == 256 and opened.credit == SessionLimits().default_credit
        assert opened.version == V

        await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=TOKENS), top_logprobs=3))
        steps, err, usage = await d.until_usage()
        assert err is None and len(steps) == 1
        assert steps[0].step == 1 and steps[0].n_past == 6 and len(steps[0].logits.top) == 3
        assert usage.prompt_tokens == 6

        await d.send(decode=pb.Decode(token=steps[0].logits.token_id))
        (step,), err, usage = await d.until_usage()
        assert err is None and step.n_past == 7 and step.start_position == 6
        assert usage.generated_tokens == 1

        await d.send(generate=pb.Generate(max_tokens=5))  # continues from the last token
        steps, err, usage = await d.until_usage()
        assert err is None and [s.step for s in steps] == [3, 4, 5, 6, 7]
        assert steps[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert all(s.finish_reason == pb.FINISH_REASON_UNSPECIFIED for s in steps[:-1])
        assert usage.generated_tokens == 5
        assert engine.session_info("s1").n_past == 12  # 5 decodes; the last choice is not fed back

        await d.send(close=pb.CloseSession(retain=False))
        closed = await d.recv_kind("closed")
        assert closed.reason == pb.SessionClosed.REASON_CLIENT_CLOSE and not closed.kv_retained
        assert closed.totals.prompt_tokens == 6 and closed.totals.generated_tokens == 6
        assert engine.sessions() == ()  # released at once
        await d.half_close()
        assert await d.drain() == []
        await d.finished()
        assert d.call.error is None and d.call.phase.value is Phase.CLOSED


async def test_generate_text_prompt_and_stop_tokens() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg:
        async with driver(reg) as a:
            await a.open("a")
            await a.send(generate=pb.Generate(text="hi", max_tokens=8))
            steps, _, usage = await a.until_usage()
            assert usage.prompt_tokens == 3  # BOS + 2 bytes, tokenized by the worker
            tokens = [s.logits.token_id for s in steps]
        async with driver(reg) as b:
            await b.open("b")
            await b.send(generate=pb.Generate(text="hi", max_tokens=8, stop_tokens=[tokens[3]]))
            steps, _, _ = await b.until_usage()
            stop_at = tokens.index(tokens[3])
            assert [s.logits.token_id for s in steps] == tokens[: stop_at + 1]
            assert steps[-1].finish_reason == pb.FINISH_REASON_STOP_TOKEN


# ---- fail-closed lifecycle ------------------------------------------------------------------


@pytest.mark.parametrize(
    "first",
    [
        {"decode": pb.Decode(token=5)},
        {"prefill": pb.Prefill(tokens=pb.TokenIds(ids=[1]))},
        {"generate": pb.Generate(max_tokens=1)},
        {"credit": pb.Credit(messages=1)},
        {"close": pb.CloseSession()},
    ],
    ids=lambda k: next(iter(k)),
)
async def test_anything_before_open_is_refused(first: dict[str, object]) -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg, driver(reg) as d:
        await d.send(**first)
        assert await d.drain() == []
        assert d.call.error is not None and d.call.error.code is ErrorCode.ILLEGAL_TRANSITION
        assert "before OpenSession" in d.call.error.message
        assert engine.metrics().sessions_opened_total == 0


async def test_stream_ending_before_open_is_refused() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg, driver(reg) as d:
        await d.half_close()
        await d.finished()
        assert d.call.error is not None and d.call.error.code is ErrorCode.ILLEGAL_TRANSITION


async def test_empty_request_is_invalid() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg, driver(reg) as d:
        await d.open()
        await d.send()
        await d.finished()
        assert d.call.error is not None and d.call.error.code is ErrorCode.INVALID_ARGUMENT
        assert engine.sessions() == ()


async def test_second_open_is_refused_and_only_this_session_ends() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg:
        async with driver(reg) as other:
            await other.open("other")
            async with driver(reg) as d:
                await d.open("s1")
                await d.send(open=pb.OpenSession(session_id="s2"))
                await d.finished()
                assert d.call.error is not None
                assert d.call.error.code is ErrorCode.ILLEGAL_TRANSITION and d.call.error.session_id == "s1"
            # The other session is untouched and still works.
            assert [s.session_id for s in engine.sessions()] == ["other"]
            await other.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=TOKENS)))
            steps, err, _ = await other.until_usage()
            assert err is None and steps[0].n_past == 6


async def test_step_while_a_step_runs_is_refused() -> None:
    gate = StepGate()
    async with loaded(make_engine(gate=gate)) as engine, running_registry(engine) as reg, driver(reg) as d:
        await d.open()
        gate.hold()
        await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=TOKENS)))
        await d.call.phase.wait_value(Phase.RUNNING)
        await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=[1])))
        await trio.testing.wait_all_tasks_blocked()
        gate.release()  # the engine finishes (never abandons) the step it is in, then stops
        await d.finished()
        assert d.call.error is not None and d.call.error.code is ErrorCode.ILLEGAL_TRANSITION
        assert "while a step is running" in d.call.error.message
        assert engine.sessions() == ()  # the running step was stopped and the session freed


async def test_anything_after_close_is_refused() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg, driver(reg) as d:
        await d.open()
        await d.send(close=pb.CloseSession(retain=True))
        closed = await d.recv_kind("closed")
        assert closed.kv_retained
        await d.send(decode=pb.Decode(token=3))
        await d.finished()
        assert d.call.error is not None and d.call.error.code is ErrorCode.ILLEGAL_TRANSITION
        assert "after CloseSession" in d.call.error.message
        assert reg.retained("s1") is not None  # the closed session is not touched by the error
        assert await reg.release("s1")


async def test_duplicate_session_id_across_streams_is_refused() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg:
        async with driver(reg) as a, driver(reg) as b:
            await a.open("dup")
            await b.send(open=pb.OpenSession(session_id="dup"))
            await b.finished()
            assert b.call.error is not None and b.call.error.code is ErrorCode.SESSION_EXISTS
            assert [s.session_id for s in engine.sessions()] == ["dup"]


@pytest.mark.parametrize(
    "open_fields, code",
    [
        ({"expected_model_fingerprint": "deadbeef"}, ErrorCode.INCOMPATIBLE_MODEL),
        ({"expected_layer_range": pb.LayerRange(start=0, end=2)}, ErrorCode.INCOMPATIBLE_MODEL),
        ({"kv_budget": 10_000}, ErrorCode.INVALID_ARGUMENT),
        ({"session_id": ""}, ErrorCode.INVALID_ARGUMENT),
        ({"session_id": "x" * 129}, ErrorCode.INVALID_ARGUMENT),
    ],
    ids=["fingerprint", "layer-range", "kv-budget", "empty-id", "long-id"],
)
async def test_open_refusals(open_fields: dict[str, object], code: ErrorCode) -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg, driver(reg) as d:
        fields = {"session_id": "s1", **open_fields}
        await d.send(open=pb.OpenSession(**fields))
        await d.finished()
        assert d.call.error is not None and d.call.error.code is code
        assert engine.metrics().sessions_opened_total == 0  # refused before any engine work


async def test_matching_fingerprint_and_layer_range_are_accepted() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg, driver(reg) as d:
        caps = engine.capabilities()
        opened = await d.open(
            expected_model_fingerprint=caps.model_fingerprint,
            expected_layer_range=pb.LayerRange(start=0, end=4),
        )
        assert opened.session_id == "s1"


@pytest.mark.parametrize(
    "version",
    [None, pb.ProtocolVersion(major=2, minor=0), pb.ProtocolVersion(major=1, minor=4),
     pb.ProtocolVersion(major=0, minor=9)],
    ids=["missing", "v2.0", "v1.4", "v0.9"],
)
async def test_unsupported_versions_fail_before_engine_work(version: pb.ProtocolVersion | None) -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg, driver(reg) as d:
        req = pb.SessionRequest(open=pb.OpenSession(session_id="s1"))
        if version is not None:
            req.version.CopyFrom(version)
        await d.send_raw(req)
        await d.finished()
        err = d.call.error
        assert err is not None and err.code is ErrorCode.UNSUPPORTED_VERSION
        assert err.supported_versions == ((1, 0), (1, 1), (1, 2), (1, 3)) and "1.0, 1.1, 1.2, 1.3" in err.message
        assert engine.metrics().sessions_opened_total == 0


async def test_version_is_checked_on_every_message() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg, driver(reg) as d:
        await d.open()
        await d.send_raw(pb.SessionRequest(version=pb.ProtocolVersion(major=1, minor=7), credit=pb.Credit(messages=1)))
        await d.finished()
        assert d.call.error is not None and d.call.error.code is ErrorCode.UNSUPPORTED_VERSION
        assert engine.sessions() == ()


# ---- step-level errors keep the session usable -------------------------------------------------


async def test_token_outside_vocabulary_is_a_step_error() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg, driver(reg) as d:
        await d.open()
        await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=[1, 5000])))
        steps, err, usage = await d.until_usage()
        assert steps == [] and err is not None and err.code == pb.ERROR_CODE_INVALID_ARGUMENT
        assert err.session_id == "s1" and usage.prompt_tokens == 0
        await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=TOKENS)))
        steps, err, _ = await d.until_usage()
        assert err is None and steps[0].n_past == 6
        assert d.call.error is None


@pytest.mark.parametrize(
    "tensor, message",
    [
        (pb.Tensor(data=b"\0" * 32, shape=[1, 8], dtype="float16"), "dtype"),
        (pb.Tensor(data=b"\0" * 28, shape=[1, 7], dtype="float32"), "shape"),
        (pb.Tensor(data=b"\0" * 16, shape=[1, 8], dtype="float32"), "bytes"),
        (array_to_tensor(np.full((1, 8), np.nan, dtype=np.float32)), "NaN"),
    ],
    ids=["dtype", "shape", "size", "nan"],
)
async def test_bad_hidden_states_are_step_errors(tensor: pb.Tensor, message: str) -> None:
    async with (
        loaded(make_engine(), layer_range=LayerRange(2, 4)) as engine,
        running_registry(engine) as reg,
        driver(reg) as d,
    ):
        await d.open()
        await d.send(prefill=pb.Prefill(hidden_states=tensor))
        _, err, _ = await d.until_usage()
        assert err is not None and err.code == pb.ERROR_CODE_INVALID_ARGUMENT and message in err.message
        good = array_to_tensor(np.ones((3, 8), dtype=np.float32))
        await d.send(prefill=pb.Prefill(hidden_states=good))
        (step,), err, _ = await d.until_usage()
        assert err is None and step.n_past == 3 and step.HasField("logits")
        row = array_to_tensor(np.ones((1, 8), dtype=np.float32))
        await d.send(decode=pb.Decode(hidden_state=row))
        (step,), err, _ = await d.until_usage()
        assert err is None and step.n_past == 4


async def test_tokens_on_a_non_first_shard_and_generate_on_a_partial_shard_fail_closed() -> None:
    async with (
        loaded(make_engine(), layer_range=LayerRange(2, 4)) as engine,
        running_registry(engine) as reg,
        driver(reg) as d,
    ):
        await d.open()
        await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=[1, 2])))
        _, err, _ = await d.until_usage()
        assert err is not None and err.code == pb.ERROR_CODE_INVALID_ARGUMENT
        await d.send(generate=pb.Generate(max_tokens=2))
        _, err, _ = await d.until_usage()
        assert err is not None and err.code == pb.ERROR_CODE_UNSUPPORTED_FEATURE


async def test_first_shard_returns_boundary_hidden_states() -> None:
    async with (
        loaded(make_engine(), layer_range=LayerRange(0, 2)) as engine,
        running_registry(engine) as reg,
        driver(reg) as d,
    ):
        await d.open()
        await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=TOKENS)))
        (step,), err, _ = await d.until_usage()
        assert err is None and list(step.hidden_states.shape) == [6, 8]
        assert step.hidden_states.dtype == "float32" and len(step.hidden_states.data) == 6 * 8 * 4


async def test_kv_budget_full_is_a_step_error() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg, driver(reg) as d:
        opened = await d.open(kv_budget=4)
        assert opened.kv_capacity == 4
        await d.send(generate=pb.Generate(tokens=pb.TokenIds(ids=[1, 2, 3]), max_tokens=10))
        steps, err, _ = await d.until_usage()
        assert err is None and steps[-1].finish_reason == pb.FINISH_REASON_CONTEXT_FULL
        await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=[1, 2, 3, 4, 5])))
        _, err, _ = await d.until_usage()
        assert err is not None and err.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED and err.reason == "KV_CACHE_FULL"


async def test_step_timeout_is_a_step_error_and_rolls_back(autojump_clock: trio.testing.MockClock) -> None:
    async with loaded(make_engine(latency=1.0)) as engine, running_registry(engine) as reg, driver(reg) as d:
        await d.open(step_timeout_ms=2500)
        await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=[1, 2])))  # 2 s: fits
        _, err, _ = await d.until_usage()
        assert err is None
        await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=[3, 4, 5])))  # 3 s: too slow
        steps, err, _ = await d.until_usage()
        assert steps == [] and err is not None and err.code == pb.ERROR_CODE_DEADLINE_EXCEEDED
        assert err.reason == "STEP_TIMEOUT"
        assert engine.session_info("s1").n_past == 2  # rolled back
        await d.send(decode=pb.Decode(token=7))
        (step,), err, _ = await d.until_usage()
        assert err is None and step.n_past == 3


# ---- credit (flow control) -------------------------------------------------------------------


async def test_no_credit_parks_generation_and_buffers_stay_bounded() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg, driver(reg) as d:
        opened = await d.open(initial_credit=3)
        assert opened.credit == 3
        await d.send(generate=pb.Generate(tokens=pb.TokenIds(ids=TOKENS), max_tokens=100))
        await d.call.parked.wait_value(True)
        steps = engine.metrics().steps_total
        assert steps == 3 and d.call.buffered() <= 3 and d.call.credit.value == 0
        for _ in range(20):  # nothing moves while no credit comes
            await trio.lowlevel.checkpoint()
        assert engine.metrics().steps_total == 3 and d.call.parked.value
        for _ in range(3):
            await d.recv_kind("step")
        await d.send(credit=pb.Credit(messages=2))
        await d.call.parked.wait_value(False)
        await d.call.parked.wait_value(True)
        assert engine.metrics().steps_total == 5 and d.call.buffered() <= 2
        await d.send(credit=pb.Credit(messages=10_000))  # capped at max_credit
        await d.call.credit.wait_value(lambda c: c > 0)
        assert d.call.credit.value <= SessionLimits().max_credit


async def test_half_close_lifts_credit_and_retains() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg, driver(reg) as d:
        await d.open(initial_credit=1)
        await d.send(generate=pb.Generate(tokens=pb.TokenIds(ids=TOKENS), max_tokens=6))
        await d.half_close()
        msgs = await d.drain()
        kinds = [m.WhichOneof("kind") for m in msgs]
        assert kinds == ["step"] * 6 + ["usage", "closed"]
        closed = msgs[-1].closed
        assert closed.reason == pb.SessionClosed.REASON_CLIENT_HALF_CLOSE and closed.kv_retained
        assert closed.resume_ttl_ms == SessionLimits().resume_ttl_ms
        assert reg.retained("s1") is not None and reg.n_live == 0
        assert await reg.release("s1") and engine.sessions() == ()


# ---- deadlines, cancellation, release ----------------------------------------------------------


async def test_call_deadline_releases_within_one_step(autojump_clock: trio.testing.MockClock) -> None:
    gate = StepGate()
    async with loaded(make_engine(latency=1.0, gate=gate)) as engine, running_registry(engine) as reg:
        deadline = trio.current_time() + 10.5
        async with driver(reg, deadline=deadline) as d:
            await d.open()
            await d.send(generate=pb.Generate(tokens=pb.TokenIds(ids=[1]), max_tokens=1000))
            await d.half_close()  # unlimited credit from here on
            await d.drain()
            assert d.call.error is not None and d.call.error.code is ErrorCode.DEADLINE_EXCEEDED
        assert gate.after(deadline) <= 1
        assert engine.sessions() == () and reg.n_retained == 0


async def test_cancel_stops_a_running_generate_within_one_step(autojump_clock: trio.testing.MockClock) -> None:
    gate = StepGate()
    async with (
        loaded(make_engine(latency=1.0, gate=gate)) as engine,
        running_registry(engine) as reg,
        driver(reg) as d,
    ):
        await d.open(initial_credit=64)
        await d.send(generate=pb.Generate(tokens=pb.TokenIds(ids=[1]), max_tokens=1000))
        await d.recv_kind("step")
        await d.recv_kind("step")
        cancelled_at = trio.current_time()
        assert reg.cancel("s1") == (True, True)
        steps, err, usage = await d.until_usage()
        assert err is not None and err.code == pb.ERROR_CODE_CANCELLED
        assert gate.after(cancelled_at) <= 1
        assert usage.generated_tokens == 2 + len(steps)
        assert reg.cancel("s1") == (True, False)  # nothing running any more
        # The session is still usable and holds what was generated.
        await d.send(decode=pb.Decode(token=5))
        (step,), err, _ = await d.until_usage()
        assert err is None and step.n_past == 1 + usage.generated_tokens


async def test_cancel_while_parked_on_credit() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg, driver(reg) as d:
        await d.open(initial_credit=1)
        await d.send(generate=pb.Generate(tokens=pb.TokenIds(ids=[1]), max_tokens=10))
        await d.call.parked.wait_value(True)
        assert reg.cancel("s1") == (True, True)
        steps, err, _ = await d.until_usage()
        assert len(steps) == 1 and err is not None and err.code == pb.ERROR_CODE_CANCELLED


async def test_release_ends_a_live_stream() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg, driver(reg) as d:
        await d.open()
        assert await reg.release("s1")
        msgs = await d.drain()
        assert [m.WhichOneof("kind") for m in msgs] == ["closed"]
        assert msgs[0].closed.reason == pb.SessionClosed.REASON_RELEASED
        assert d.call.error is None and engine.sessions() == ()
        assert not await reg.release("s1")  # idempotent
        assert reg.cancel("s1") == (False, False)


@pytest.mark.parametrize(
    "reason, retained",
    [
        (StreamEnd.CONNECTION_LOST, True),
        (StreamEnd.CLIENT_CANCELLED, False),
        (StreamEnd.DEADLINE, False),
        (StreamEnd.SHUTDOWN, False),
    ],
)
async def test_stream_end_reason_decides_release_or_retain(reason: StreamEnd, retained: bool) -> None:
    gate = StepGate()
    async with loaded(make_engine(gate=gate)) as engine, running_registry(engine) as reg, driver(reg) as d:
        await d.open()
        await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=TOKENS)))
        await d.until_usage()
        gate.hold()
        await d.send(decode=pb.Decode(token=4))
        await d.call.phase.wait_value(Phase.RUNNING)
        d.call.end(reason)
        await trio.testing.wait_all_tasks_blocked()
        gate.release()
        await d.finished()
        assert (reg.retained("s1") is not None) is retained
        if retained:
            assert engine.session_info("s1").n_past == 6  # the interrupted step rolled back
            assert await reg.release("s1")
        assert engine.sessions() == ()


# ---- resume and TTL ---------------------------------------------------------------------------


async def _retain(reg, tokens=TOKENS, sid="s1"):  # type: ignore[no-untyped-def]
    async with driver(reg) as d:
        await d.open(sid)
        await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=tokens)))
        await d.until_usage()
        await d.send(close=pb.CloseSession(retain=True))
        closed = await d.recv_kind("closed")
        await d.half_close()
        await d.finished()
    assert closed.kv_retained
    return closed


async def test_resume_hit_then_continue() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg:
        await _retain(reg)
        async with driver(reg) as d:
            opened = await d.open(cache=cache_expectation(TOKENS))
            assert opened.cache.outcome == R.OUTCOME_HIT and opened.cache.tokens_held == 6
            assert opened.n_past == 6
            await d.send(decode=pb.Decode(token=33))
            (step,), err, _ = await d.until_usage()
            assert err is None and step.n_past == 7 and step.start_position == 6
            assert engine.metrics().prefill_tokens_total == 6  # nothing recomputed


async def test_resume_shorter_prefix_truncates_logically() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg:
        await _retain(reg)
        async with driver(reg) as d:
            opened = await d.open(cache=cache_expectation(TOKENS[:4]))
            assert opened.cache.outcome == R.OUTCOME_HIT and opened.n_past == 4
            await d.send(decode=pb.Decode(token=33))
            (step,), err, _ = await d.until_usage()
            assert err is None and step.n_past == 5
            assert engine.session_info("s1").tokens == (*TOKENS[:4], 33)


async def test_resume_mismatch_clears_the_cache() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg:
        await _retain(reg)
        kv_before = engine.metrics().kv_cells_used
        assert kv_before == 6
        async with driver(reg) as d:
            opened = await d.open(cache=cache_expectation([1, 2, 3]))
            assert opened.cache.outcome == R.OUTCOME_MISMATCH and opened.cache.tokens_held == 0
            assert opened.n_past == 0 and engine.metrics().kv_cells_used == 0
            assert engine.session_info("s1").n_past == 0


async def test_resume_count_only_expectation() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg:
        await _retain(reg)
        async with driver(reg) as d:
            opened = await d.open(cache=pb.CacheExpectation(n_tokens=9))
            assert opened.cache.outcome == R.OUTCOME_PARTIAL and opened.cache.tokens_held == 6


async def test_resume_without_expectation_on_a_retained_session_is_refused() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg:
        await _retain(reg)
        async with driver(reg) as d:
            await d.send(open=pb.OpenSession(session_id="s1"))
            await d.finished()
            assert d.call.error is not None and d.call.error.code is ErrorCode.SESSION_EXISTS
        assert reg.retained("s1") is not None  # refused without touching it
        assert await reg.release("s1")


async def test_ttl_expiry_frees_kv_and_resume_misses(autojump_clock: trio.testing.MockClock) -> None:
    limits = SessionLimits(resume_ttl=5.0)
    async with loaded(make_engine()) as engine, running_registry(engine, limits) as reg:
        await _retain(reg)
        assert engine.metrics().kv_cells_used == 6
        await trio.sleep(4.0)
        assert reg.retained("s1") is not None
        await trio.sleep(1.5)
        assert reg.retained("s1") is None and engine.sessions() == ()
        assert engine.metrics().kv_cells_used == 0 and reg.counters["sessions_expired_total"] == 1
        async with driver(reg) as d:
            opened = await d.open(cache=cache_expectation(TOKENS))
            assert opened.cache.outcome == R.OUTCOME_MISS and opened.cache.tokens_held == 0


async def test_failing_engine_releases_never_stop_the_reaper_or_skip_sessions(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine release that raises (e.g. a failed KV truncate) must not kill the reaper (and
    with it the registry and the server) nor leave the other retained sessions behind."""
    limits = SessionLimits(resume_ttl=5.0)
    async with loaded(make_engine()) as engine:
        real_release = engine.release

        async def failing_release(session_id: str) -> bool:
            freed = await real_release(session_id)  # the engine frees the slot, then reports
            raise EngineFailure(f"truncate of {session_id} failed")
            return freed  # pragma: no cover

        async with running_registry(engine, limits) as reg:
            await _retain(reg, sid="a")
            await _retain(reg, sid="b")
            monkeypatch.setattr(engine, "release", failing_release)
            await trio.sleep(6.0)  # both expire; the first failure must not stop the reaper
            assert reg.n_retained == 0 and engine.sessions() == ()
            monkeypatch.setattr(engine, "release", real_release)
            async with driver(reg) as d:  # the registry still serves
                assert (await d.open("c")).cache.outcome == R.OUTCOME_NEW
            await _retain(reg, sid="d")
            await _retain(reg, sid="e")
            monkeypatch.setattr(engine, "release", failing_release)
        # Shutdown freed every retained session despite the failures (checked by `loaded`).
        assert engine.sessions() == ()


async def test_failing_release_on_close_ends_with_engine_failure_and_frees_the_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg, driver(reg) as d:
        await d.open()
        real_release = engine.release

        async def failing_release(session_id: str) -> bool:
            await real_release(session_id)
            raise EngineFailure("truncate failed")

        monkeypatch.setattr(engine, "release", failing_release)
        await d.send(close=pb.CloseSession(retain=False))
        await d.finished()
        assert d.call.error is not None and d.call.error.code is ErrorCode.ENGINE_FAILURE
        assert reg.n_live == 0 and reg.n_retained == 0 and engine.sessions() == ()


async def test_release_frees_a_retained_session_at_once() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg:
        await _retain(reg)
        assert reg.cancel("s1") == (True, False)
        assert await reg.release("s1")
        assert engine.sessions() == () and engine.metrics().kv_cells_used == 0


async def test_full_engine_evicts_the_oldest_retained_session(autojump_clock: trio.testing.MockClock) -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg:
        for i in range(4):
            await _retain(reg, sid=f"r{i}")
            await trio.sleep(1)
        async with driver(reg) as d:
            opened = await d.open("new")
            assert opened.cache.outcome == R.OUTCOME_NEW
        assert reg.retained("r0") is None and reg.retained("r1") is not None
        assert reg.counters["sessions_evicted_total"] == 1


def _slow_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """A release's history takes 1 s to become a cache entry, as behind a long tick of
    llama.cpp's native thread."""
    from shard.engine import prefix_reuse

    keep = prefix_reuse.PrefixReuse.keep

    async def slow_keep(self, slot):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        await trio.sleep(1.0)
        return await keep(self, slot)

    monkeypatch.setattr(prefix_reuse.PrefixReuse, "keep", slow_keep)


async def _open_waits_for_the_release(reg: Registry, engine: FakeEngine) -> None:
    """Open "s2" on the full engine: it must wait for the release under way, not be refused."""
    async with driver(reg) as d:
        try:
            opened = await d.open("s2")
        except trio.EndOfChannel:
            await d.finished()
            pytest.fail(f"the open was refused: {d.call.error}")
        assert opened.cache.outcome == R.OUTCOME_NEW
        assert engine.metrics().sessions_released_total == 1


async def test_an_open_on_a_full_engine_waits_for_an_expired_session_being_freed(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The only session of a full engine was retained and expired: the registry lists it no
    more while the engine still releases it (its history takes 1 s to become a cache entry, as
    behind a long tick of llama.cpp's native thread). An open then waits for that release; it
    was refused RESOURCE_EXHAUSTED ("all 1 sessions are in use")."""
    _slow_release(monkeypatch)
    spec = LoadSpec(n_ctx=512, max_sessions=1, prefix_cache_tokens=64)
    async with loaded(make_engine(), spec=spec) as engine, \
            running_registry(engine, SessionLimits(resume_ttl=5.0)) as reg:
        await _retain(reg)
        await trio.sleep(5.5)  # expired half a second ago: its release is under way
        assert reg.retained("s1") is None and reg.counters["sessions_expired_total"] == 1
        assert engine.sessions() == () and engine.metrics().sessions_released_total == 0
        await _open_waits_for_the_release(reg, engine)
        assert reg.counters["sessions_evicted_total"] == 0


async def test_an_open_on_a_full_engine_waits_for_a_released_session_being_freed(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, for a retained session freed by a Release RPC: while the engine still
    releases it, an open on the full engine waits for it instead of being refused."""
    _slow_release(monkeypatch)
    spec = LoadSpec(n_ctx=512, max_sessions=1, prefix_cache_tokens=64)
    async with loaded(make_engine(), spec=spec) as engine, \
            running_registry(engine, SessionLimits(resume_ttl=60.0)) as reg:
        await _retain(reg)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reg.release, "s1")
            await trio.sleep(0.5)  # the Release is under way: the registry lists s1 no more
            assert reg.retained("s1") is None and engine.metrics().sessions_released_total == 0
            await _open_waits_for_the_release(reg, engine)
        assert reg.counters["sessions_evicted_total"] == 0


async def test_no_retention_while_draining() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg:
        async with driver(reg) as d:
            await d.open()
            reg.draining = True
            await d.send(close=pb.CloseSession(retain=True))
            closed = await d.recv_kind("closed")
            assert not closed.kv_retained
        async with driver(reg) as d:
            await d.send(open=pb.OpenSession(session_id="late"))
            await d.finished()
            assert d.call.error is not None and d.call.error.code is ErrorCode.DRAINING


async def test_engine_failure_ends_the_stream() -> None:
    async with (
        loaded(make_engine(fail_at_step=2), check_leaks=False) as engine,
        running_registry(engine) as reg,
        driver(reg) as d,
    ):
        await d.open()
        await d.send(generate=pb.Generate(tokens=pb.TokenIds(ids=[1]), max_tokens=5))
        await d.drain()
        assert d.call.error is not None and d.call.error.code is ErrorCode.ENGINE_FAILURE
        assert d.call.error.retryable  # UNAVAILABLE: on another worker (this one needs a restart)
    assert_no_leaks(engine)


# ---- no lost cancel, no lost step (issue 8 item 3) -------------------------------------------


class _CancelRightAfterDispatch:
    """Stands in for a call's nursery: right after a step task is scheduled (before it runs),
    an out-of-band Cancel lands, as a Cancel RPC racing the step's start would."""

    def __init__(self, nursery: trio.Nursery, reg: object, session_id: str) -> None:
        self._nursery, self._reg, self._sid = nursery, reg, session_id
        self.answers: list[tuple[bool, bool]] = []

    def start_soon(self, fn: object, *args: object) -> None:
        self._nursery.start_soon(fn, *args)  # type: ignore[arg-type]
        self.answers.append(self._reg.cancel(self._sid))  # type: ignore[attr-defined]


async def test_cancel_between_dispatch_and_task_start_is_not_lost() -> None:
    async with loaded(make_engine()) as engine, running_registry(engine) as reg, driver(reg) as d:
        await d.open(initial_credit=64)
        race = _CancelRightAfterDispatch(d.call._nursery, reg, "s1")  # noqa: SLF001
        d.call._nursery = race  # type: ignore[assignment]  # noqa: SLF001
        await d.send(generate=pb.Generate(tokens=pb.TokenIds(ids=[1]), max_tokens=50))
        steps, err, usage = await d.until_usage()
        assert race.answers == [(True, True)]  # found, and was_running: the step was dispatched
        assert err is not None and err.code == pb.ERROR_CODE_CANCELLED
        assert steps == [] and usage == pb.Usage()  # stopped before any compute
        assert engine.session_info("s1").n_past == 0 and engine.metrics().steps_total == 0


async def test_cancel_while_a_result_waits_for_room_never_drops_it() -> None:
    """After half-close, results pile up in the bounded channel; a Cancel landing while the
    step waits for room must stop the step, not the send of a token already computed."""
    async with loaded(make_engine()) as engine, running_registry(engine) as reg, driver(reg) as d:
        await d.open(initial_credit=64)
        await d.send(generate=pb.Generate(tokens=pb.TokenIds(ids=[1]), max_tokens=200))
        await d.half_close()  # credit no longer applies: only the channel's bound paces us
        await trio.testing.wait_all_tasks_blocked()
        assert d.call.buffered() == SessionLimits().max_credit + 4  # full, a result is waiting
        assert reg.cancel("s1") == (True, True)
        rest = await d.drain()
        kinds = [m.WhichOneof("kind") for m in rest]
        n_steps = kinds.count("step")
        assert kinds == [*["step"] * n_steps, "error", "usage", "closed"], kinds
        steps = [m.step for m in rest[:n_steps]]
        error, usage, closed = rest[n_steps].error, rest[n_steps + 1].usage, rest[n_steps + 2].closed
        assert error.code == pb.ERROR_CODE_CANCELLED
        assert n_steps > SessionLimits().max_credit + 4 - 3  # the waiting result was delivered
        assert usage.generated_tokens == n_steps  # Usage counts exactly what was sent
        assert usage.prompt_tokens == 1 and closed.kv_retained
        # The session holds exactly what the last delivered result says, nothing more.
        retained = reg.retained("s1")
        assert retained is not None and retained.end == steps[-1].n_past
        assert engine.session_info("s1").n_past == steps[-1].n_past
        await reg.release("s1")


async def _engine_busy(engine: FakeEngine) -> None:
    while engine.metrics().operations_running == 0:
        await trio.sleep(0.01)


async def test_cancel_counts_in_the_engine_metrics(autojump_clock: trio.testing.MockClock) -> None:
    async with loaded(make_engine(latency=1.0)) as engine, running_registry(engine) as reg:
        async with driver(reg) as d:
            await d.open(initial_credit=64)
            await d.send(generate=pb.Generate(tokens=pb.TokenIds(ids=[1]), max_tokens=100))
            await d.recv_kind("step")
            await _engine_busy(engine)
            assert reg.cancel("s1") == (True, True)
            await d.until_usage()
            assert engine.metrics().cancelled_total == 1
            await d.send(generate=pb.Generate(max_tokens=100))
            await d.recv_kind("step")
            await _engine_busy(engine)
            d.call.end(StreamEnd.CLIENT_CANCELLED)  # RST_STREAM mid-step
            await d.finished()
        assert engine.metrics().cancelled_total == 2


# ---- results larger than one message (issue 8 item 4) ---------------------------------------

WIDE = FakeModel(n_layers_total=4, n_embd=256, seed=7)


async def test_large_boundary_results_are_chunked_in_order() -> None:
    limit = 16 * 1024  # 12 rows of 1 KiB per message (4 KiB are kept for the other fields)
    first = LayerRange(0, 2)
    async with (
        loaded(FakeEngine(model=WIDE), layer_range=first) as engine,
        loaded(FakeEngine(model=WIDE), layer_range=first) as reference,
        running_registry(engine) as reg,
    ):
        send, recv = trio.open_memory_channel[pb.SessionRequest](4)
        call = await reg.start_call(recv, max_message_bytes=limit)
        d = Driver(call, send)
        try:
            await d.open("w")
            tokens = list(range(3, 43))  # 40 rows: 40 KiB of float32
            await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=tokens)))
            chunks, err, usage = await d.until_usage()
            assert err is None and usage.prompt_tokens == 40
            assert len(chunks) == 4 and all(c.ByteSize() <= limit for c in chunks)
            assert [c.more_chunks for c in chunks] == [True] * (len(chunks) - 1) + [False]
            assert {(c.step, c.n_past, c.start_position) for c in chunks} == {(1, 40, 0)}
            rows = np.concatenate([tensor_to_array(c.hidden_states, 256, "w") for c in chunks])
            await reference.open_session("r")
            want = await reference.prefill(PrefillRequest("r", tuple(tokens)))
            assert want.boundary is not None
            np.testing.assert_array_equal(rows, want.boundary.hidden_states)
            await reference.release("r")
            # A second small step is one message again.
            await d.send(decode=pb.Decode(token=5))
            (step,), err, _ = await d.until_usage()
            assert err is None and not step.more_chunks and step.n_past == 41
        finally:
            send.close()
            call.end(StreamEnd.CLIENT_CANCELLED)
            await call.done.wait()


async def test_a_row_that_can_never_fit_is_refused_before_compute() -> None:
    async with (
        loaded(FakeEngine(model=WIDE), layer_range=LayerRange(0, 2)) as engine,
        running_registry(engine) as reg,
    ):
        send, recv = trio.open_memory_channel[pb.SessionRequest](4)
        call = await reg.start_call(recv, max_message_bytes=4096 + 1023)  # < one row + overhead
        d = Driver(call, send)
        try:
            await d.open("w")
            await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=[3, 4])))
            steps, err, _ = await d.until_usage()
            assert steps == [] and err is not None
            assert err.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED and not err.retryable
            assert err.reason == "MESSAGE_TOO_LARGE"
            assert engine.metrics().steps_total == 0 and engine.session_info("w").n_past == 0
        finally:
            send.close()
            call.end(StreamEnd.CLIENT_CANCELLED)
            await call.done.wait()


async def test_a_step_without_a_result_gives_its_credit_back(autojump_clock: trio.testing.MockClock) -> None:
    """Found by the RPC fuzzer: a timed-out, cancelled or refused step took its credit and
    never sent a result, so a client with a window of 1 waited forever on its next step."""
    async with loaded(make_engine(latency=1.0)) as engine, running_registry(engine) as reg, driver(reg) as d:
        await d.open(initial_credit=1, step_timeout_ms=500)
        await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=[3, 4])))  # times out
        steps, err, _ = await d.until_usage()
        assert steps == [] and err is not None and err.reason == "STEP_TIMEOUT"
        assert d.call.credit.value == 1
        await d.send(generate=pb.Generate(tokens=pb.TokenIds(ids=[1]), max_tokens=3))
        await d.call.parked.wait_value(False)
        assert reg.cancel("s1") == (True, True)  # cancelled in the engine: no result either
        steps, err, _ = await d.until_usage()
        assert steps == [] and err is not None and err.code == pb.ERROR_CODE_CANCELLED
        assert d.call.credit.value == 1
        await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=[999])))  # refused: bad token id
        steps, err, _ = await d.until_usage()
        assert steps == [] and err is not None and d.call.credit.value == 1
