"""Contract tests of an engine's lifecycle: load, capabilities, health, metrics, close and
failure (CREATED -> READY -> FAILED/CLOSED), and the values that may cross the contract."""

from __future__ import annotations

from typing import Any

import pytest

from shard.engine import (
    DecodeRequest,
    EngineError,
    EngineFailure,
    EngineState,
    IllegalTransition,
    NotReady,
    PrefillRequest,
    ResultKind,
    SamplingParams,
    ShardEngine,
)

from ..factories import EngineFactory
from .harness import (
    assert_project_value,
    decode,
    inject_failure,
    prefill,
    prompt_tokens,
    whole_options,
)


class Lifecycle:
    """Load, capabilities, health and metrics; every state's refusals; what a fault leaves."""

    async def test_load_reports_capabilities_health_and_metrics(
        self, engine_factory: EngineFactory
    ) -> None:
        engine = engine_factory.create()
        assert engine.health().state is EngineState.CREATED
        assert not engine.health().ready
        async with engine:
            spec = engine_factory.load_spec(whole_options(n_ctx=1024, max_sessions=4))
            caps = await engine.load(spec)
            assert engine.capabilities() == caps
            assert caps.engine and caps.architecture
            int(caps.model_fingerprint, 16)  # a hex digest
            assert len(caps.model_fingerprint) >= 16
            assert caps.max_sessions == 4
            assert caps.n_ctx >= 1024
            assert caps.n_ctx_per_session == caps.n_ctx // caps.max_sessions
            assert caps.n_vocab >= 259 and caps.n_embd > 0
            assert caps.layer_range.start == 0 and caps.layer_range.end == caps.n_layers_total
            assert caps.is_first and caps.is_last and caps.result_kind is ResultKind.LOGITS
            assert caps.hidden_dtype == "float32"
            assert caps.bos_token_id is not None and caps.eos_token_id is not None
            health = engine.health()
            assert health.state is EngineState.READY and health.ready
            m = engine.metrics()
            assert (m.sessions_active, m.kv_cells_used, m.operations_running) == (0, 0, 0)
            assert m.steps_total == m.sessions_opened_total == 0

    async def test_only_project_owned_frozen_values_cross_the_contract(
        self, engine_factory: EngineFactory
    ) -> None:
        async with engine_factory.open() as engine:
            values: dict[str, Any] = {"capabilities": engine.capabilities()}
            values["open_session"] = await engine.open_session("s")
            values["tokenize"] = engine.tokenize("hello world")
            values["token_piece"] = engine.token_piece(values["tokenize"][-1])
            r = await prefill(engine, "s", prompt_tokens(engine, 6), top_k_logprobs=3)
            values["prefill"] = r
            assert r.logits is not None
            values["decode"] = await decode(engine, "s", r.logits.token_id,
                                            sampling=SamplingParams(temperature=1.0, top_k=5))
            values["session_info"] = engine.session_info("s")
            values["sessions"] = engine.sessions()
            values["health"] = engine.health()
            values["metrics"] = engine.metrics()
            for name, value in values.items():
                assert_project_value(value, name)
            assert type(values["token_piece"]) is bytes
            assert all(type(t) is int for t in values["tokenize"])

    async def test_reserved_hooks_are_reported_disabled(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            caps = engine.capabilities()
            assert not caps.mtp.enabled and caps.mtp.max_draft_tokens == 0
            assert not caps.aux_state.enabled and caps.aux_state.kinds == ()

    async def test_operations_before_load_raise_not_ready(self, engine_factory: EngineFactory) -> None:
        engine = engine_factory.create()
        async with engine:
            await _assert_every_operation_raises(engine, NotReady)
            assert engine.health().state is EngineState.CREATED
            assert engine.metrics().sessions_active == 0

    async def test_load_twice_is_an_illegal_transition(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            with pytest.raises(IllegalTransition):
                await engine.load(engine_factory.load_spec(whole_options()))
            assert engine.health().ready

    async def test_operations_after_close_raise_not_ready(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            await engine.open_session("s")
            await prefill(engine, "s", prompt_tokens(engine, 4))
            await engine.aclose()
            assert engine.health().state is EngineState.CLOSED
            assert not engine.health().ready
            await engine.aclose()  # idempotent
            await _assert_every_operation_raises(engine, NotReady, session_id="s")
            with pytest.raises(IllegalTransition):
                await engine.load(engine_factory.load_spec(whole_options()))
            assert engine.metrics().kv_cells_used == 0
            assert engine.metrics().sessions_active == 0

    async def test_engine_failure_turns_health_failed_and_fails_every_later_call(
        self, engine_factory: EngineFactory
    ) -> None:
        async with engine_factory.open() as engine:
            await engine.open_session("s")
            await engine.open_session("other")
            await prefill(engine, "other", prompt_tokens(engine, 4))
            inject_failure(engine)
            with pytest.raises(EngineFailure):
                await prefill(engine, "s", prompt_tokens(engine, 4))
            health = engine.health()
            assert health.state is EngineState.FAILED and not health.ready and health.detail
            await _assert_every_operation_raises(engine, EngineFailure, session_id="other")
            with pytest.raises(EngineFailure):
                await engine.load(engine_factory.load_spec(whole_options()))
            # Cleanup calls never raise: they let callers unwind without special cases.
            assert engine.cancel("other") is False
            assert await engine.release("other") is True
            assert await engine.release("other") is False
            assert engine.health().state is EngineState.FAILED
            await engine.aclose()
            assert engine.health().state is EngineState.CLOSED


async def _assert_every_operation_raises(
    engine: ShardEngine, error: type[EngineError], session_id: str = "s"
) -> None:
    """Every work-requesting call raises ``error``; health/metrics/cancel never raise."""
    with pytest.raises(error):
        engine.capabilities()
    with pytest.raises(error):
        await engine.open_session("new")
    with pytest.raises(error):
        await engine.prefill(PrefillRequest(session_id, tokens=(1, 5, 6)))
    with pytest.raises(error):
        await engine.decode(DecodeRequest(session_id, token=5))
    with pytest.raises(error):
        engine.tokenize("hello")
    with pytest.raises(error):
        engine.token_piece(5)
    engine.health()
    engine.metrics()
    assert engine.cancel(session_id) is False
