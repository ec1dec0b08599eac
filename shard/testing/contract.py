"""The ShardEngine contract suite: one set of tests every engine must pass unchanged.

Use it from any package by subclassing ``EngineContractSuite`` (the class name does not start
with ``Test``, so pytest only collects your subclass) and providing an ``engine_factory``
fixture, parametrized over as many factories as you like::

    import pytest
    from shard.testing import EngineContractSuite, fake_factory

    @pytest.fixture(params=[fake_factory()], ids=str)
    def engine_factory(request):
        return request.param

    class TestMyEngineContract(EngineContractSuite):
        pass

Requirements: pytest-trio with ``trio_mode = true`` (the tests are ``async def``). The suite
never skips, never assumes an engine's speed (it waits for ``SessionState.RUNNING`` rather than
sleeping), and only uses the public contract plus one documented hook name
(``_impl_compute``, overridden on the instance by ``inject_failure``).

Every test states the *same* expectation for every engine: the contract is identical lifecycle
semantics, so nothing here branches on the engine's name.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import random
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import trio

from shard.engine import (
    GREEDY,
    AuxState,
    AuxStateKind,
    DecodeRequest,
    EngineCancelled,
    EngineError,
    EngineFailure,
    EngineState,
    IllegalTransition,
    IncompatibleState,
    InvalidInput,
    KvCacheFull,
    Lookahead,
    MtpRequest,
    NotReady,
    PrefillRequest,
    ResultKind,
    SamplingParams,
    SessionBusy,
    SessionExists,
    SessionSnapshot,
    SessionState,
    ShardEngine,
    StepResult,
    StreamRequest,
    TooManySessions,
    UnknownSession,
    UnsupportedFeature,
)

from .factories import EngineFactory, EngineOptions, ShardPart

LONG_PROMPT = 200  # positions; with n_batch 8 that is 25 llama.cpp chunks
FIRST_BYTE_ID = 3  # ids [3, 259) are valid in every engine's vocabulary (asserted below)
N_LEAK_CYCLES = 1000


# ---- helpers (public: other suites reuse them) ---------------------------------------------


def prompt_tokens(engine: ShardEngine, n: int, salt: int = 0) -> tuple[int, ...]:
    """``n`` valid token ids (BOS first, then a salt-dependent byte pattern)."""
    caps = engine.capabilities()
    span = min(caps.n_vocab, 259) - FIRST_BYTE_ID
    body = [FIRST_BYTE_ID + (salt * 31 + i * 7 + (i * i) % 5) % span for i in range(n)]
    if caps.bos_token_id is not None and n > 0:
        body[0] = caps.bos_token_id
    return tuple(body)


async def wait_running(engine: ShardEngine, session_id: str) -> None:
    """Return once ``session_id`` is RUNNING.

    Polls once per scheduler checkpoint, never by time: an operation sets RUNNING before its
    first checkpoint and needs several scheduling rounds to finish, so the poller cannot miss
    it, whatever the engine's speed. The 120 s bound only turns a hang into a failure.
    """
    with trio.fail_after(120):
        while engine.session_info(session_id).state is not SessionState.RUNNING:
            await trio.lowlevel.checkpoint()


@dataclass
class Pending:
    """An engine operation running in a background task (see ``start_op``)."""

    scope: trio.CancelScope
    done: trio.Event
    value: Any = None
    error: EngineError | None = None

    @property
    def caller_cancelled(self) -> bool:
        """The op ended with ``trio.Cancelled`` from its caller's cancel scope."""
        return self.scope.cancelled_caught


def start_op(nursery: trio.Nursery, fn: Callable[..., Awaitable[Any]], *args: Any) -> Pending:
    """Start ``fn(*args)`` in its own cancel scope; engine errors are captured, not raised."""
    pending = Pending(trio.CancelScope(), trio.Event())

    async def run() -> None:
        try:
            with pending.scope:
                try:
                    pending.value = await fn(*args)
                except EngineError as exc:
                    pending.error = exc
        finally:
            pending.done.set()

    nursery.start_soon(run)
    return pending


def count_tasks() -> int:
    """Every Trio task reachable from the root task (to prove no task is left behind)."""
    stack = [trio.lowlevel.current_root_task()]
    n = 0
    while stack:
        task = stack.pop()
        if task is None:
            continue
        n += 1
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return n


def count_native_threads() -> int:
    """OS threads of this process (Linux ``/proc``), which also sees native threads that
    ``threading`` does not (llama.cpp / OpenMP workers); elsewhere the Python thread count."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # pragma: no cover - not Linux
        return threading.active_count()


def inject_failure(engine: ShardEngine, exc: BaseException | None = None) -> None:
    """Make the engine's next compute fail with an unexpected exception (not an EngineError).

    Overrides the ``_impl_compute`` hook on this instance only, which works for every
    ShardEngine subclass. The base class must turn it into EngineFailure + FAILED health.
    """
    error = exc if exc is not None else RuntimeError("injected fault")

    async def broken(slot: Any, plan: Any) -> np.ndarray:
        await trio.lowlevel.checkpoint()
        raise error

    engine._impl_compute = broken  # type: ignore[method-assign]


async def assert_layer_range_refused(factory: EngineFactory, part: ShardPart) -> None:
    """An engine without layer-range support refuses one at load, cleanly (fail closed)."""
    engine = factory.create()
    async with engine:
        with pytest.raises(UnsupportedFeature):
            await engine.load(factory.load_spec(EngineOptions(part=part)))
        assert engine.health().state is EngineState.FAILED
        with pytest.raises(EngineFailure):
            await engine.open_session("s")
    assert engine.health().state is EngineState.CLOSED


def assert_same_logits(a: StepResult, b: StepResult, *, atol: float = 1e-3) -> None:
    """Two last-shard results agree: same chosen token, same top-k within ``atol``.

    The i-th best log-probabilities agree within ``atol``, and so does every token both lists
    hold; the ids at a rank may differ only between tokens that tie within ``atol`` (random
    weights give near-ties, and a batch's shape changes floating-point sums in the last bits).
    """
    assert a.logits is not None and b.logits is not None
    assert a.logits.token_id == b.logits.token_id
    top_a, top_b = a.logits.top, b.logits.top
    assert len(top_a) == len(top_b), (top_a, top_b)
    for x, y in zip(top_a, top_b, strict=True):
        assert math.isclose(x.logprob, y.logprob, abs_tol=atol), (top_a, top_b)
    by_id = {t.token_id: t.logprob for t in top_b}
    for t in top_a:
        if t.token_id in by_id:
            assert math.isclose(t.logprob, by_id[t.token_id], abs_tol=atol), (top_a, top_b)


async def prefill(engine: ShardEngine, sid: str, tokens: Sequence[int], position: int = 0,
                  **kw: Any) -> StepResult:
    return await engine.prefill(PrefillRequest(sid, tokens=tuple(tokens), position=position, **kw))


async def decode(engine: ShardEngine, sid: str, token: int, **kw: Any) -> StepResult:
    return await engine.decode(DecodeRequest(sid, token=token, **kw))


async def generate(engine: ShardEngine, sid: str, tokens: Sequence[int], n: int,
                   sampling: SamplingParams | None = None) -> list[int]:
    """Prefill ``tokens`` then decode ``n`` tokens, feeding back each chosen token."""
    kw = {} if sampling is None else {"sampling": sampling}
    result = await prefill(engine, sid, tokens, **kw)
    assert result.logits is not None
    out = [result.logits.token_id]
    for _ in range(n):
        result = await decode(engine, sid, out[-1], **kw)
        assert result.logits is not None
        out.append(result.logits.token_id)
    return out


#: Modules whose dataclasses may cross the contract: the engine's and the shared leaf types.
_VALUE_MODULES = ("shard.engine", "shard.layers")


def assert_project_value(value: Any, where: str = "value") -> None:
    """``value`` holds only project-owned frozen dataclasses (``shard.engine`` or the shared leaf
    ``shard.layers``), enums of ``shard.engine``, plain Python scalars, tuples and immutable
    numeric numpy arrays: nothing from ctypes, llama.cpp or ggml (and no numpy scalar standing in
    for an int or float)."""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return
    if isinstance(value, tuple):
        for i, item in enumerate(value):
            assert_project_value(item, f"{where}[{i}]")
        return
    if isinstance(value, enum.Enum):
        assert type(value).__module__.startswith("shard.engine"), f"{where}: {type(value)}"
        return
    if isinstance(value, np.ndarray):
        assert type(value) is np.ndarray and value.dtype.kind in "biuf", f"{where}: {value.dtype}"
        assert not value.flags.writeable, f"{where}: writeable array"
        return
    cls = type(value)
    assert dataclasses.is_dataclass(value) and cls.__module__.startswith(_VALUE_MODULES), (
        f"{where}: {cls.__module__}.{cls.__qualname__} is not a project-owned type"
    )
    assert cls.__dataclass_params__.frozen, f"{where}: {cls.__qualname__} is not frozen"  # type: ignore[attr-defined]
    for f in dataclasses.fields(value):
        assert_project_value(getattr(value, f.name), f"{where}.{f.name}")


def _whole(n_ctx: int = 1024, max_sessions: int = 4) -> EngineOptions:
    return EngineOptions(n_ctx=n_ctx, max_sessions=max_sessions)


# ---- the suite -----------------------------------------------------------------------------


class EngineContractSuite:
    """The contract tests. Subclass it as ``Test...`` and provide ``engine_factory``."""

    # -- engine lifecycle --------------------------------------------------------------------

    async def test_load_reports_capabilities_health_and_metrics(
        self, engine_factory: EngineFactory
    ) -> None:
        engine = engine_factory.create()
        assert engine.health().state is EngineState.CREATED
        assert not engine.health().ready
        async with engine:
            caps = await engine.load(engine_factory.load_spec(_whole(n_ctx=1024, max_sessions=4)))
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
            await self._assert_every_operation_raises(engine, NotReady)
            assert engine.health().state is EngineState.CREATED
            assert engine.metrics().sessions_active == 0

    async def test_load_twice_is_an_illegal_transition(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            with pytest.raises(IllegalTransition):
                await engine.load(engine_factory.load_spec(_whole()))
            assert engine.health().ready

    async def test_operations_after_close_raise_not_ready(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            await engine.open_session("s")
            await prefill(engine, "s", prompt_tokens(engine, 4))
            await engine.aclose()
            assert engine.health().state is EngineState.CLOSED
            assert not engine.health().ready
            await engine.aclose()  # idempotent
            await self._assert_every_operation_raises(engine, NotReady, session_id="s")
            with pytest.raises(IllegalTransition):
                await engine.load(engine_factory.load_spec(_whole()))
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
            await self._assert_every_operation_raises(engine, EngineFailure, session_id="other")
            with pytest.raises(EngineFailure):
                await engine.load(engine_factory.load_spec(_whole()))
            # Cleanup calls never raise: they let callers unwind without special cases.
            assert engine.cancel("other") is False
            assert await engine.release("other") is True
            assert await engine.release("other") is False
            assert engine.health().state is EngineState.FAILED
            await engine.aclose()
            assert engine.health().state is EngineState.CLOSED

    async def _assert_every_operation_raises(
        self, engine: ShardEngine, error: type[EngineError], session_id: str = "s"
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

    # -- sessions: the basic path -------------------------------------------------------------

    async def test_session_open_prefill_decode_release(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            caps = engine.capabilities()
            info = await engine.open_session("s")
            assert info.state is SessionState.IDLE
            assert (info.n_past, info.tokens, info.kv_budget) == (0, (), caps.n_ctx_per_session)
            assert [i.session_id for i in engine.sessions()] == ["s"]

            tokens = prompt_tokens(engine, 10)
            r = await prefill(engine, "s", tokens, top_k_logprobs=5)
            assert r.kind is ResultKind.LOGITS and r.boundary is None and r.logits is not None
            assert (r.session_id, r.n_past, r.tokens_processed, r.reused_tokens) == ("s", 10, 10, 0)
            lg = r.logits
            assert len(lg.top) == 5
            assert [t.logprob for t in lg.top] == sorted((t.logprob for t in lg.top), reverse=True)
            assert all(t.logprob <= 0.0 and math.isfinite(t.logprob) for t in lg.top)
            assert 0 <= lg.token_id < caps.n_vocab
            assert lg.token_id == lg.top[0].token_id  # greedy by default
            assert lg.logprob == lg.top[0].logprob
            assert lg.piece == engine.token_piece(lg.token_id)
            assert lg.is_eog == (lg.token_id == caps.eos_token_id)
            assert engine.session_info("s").tokens == tokens
            assert engine.metrics().kv_cells_used == 10

            r2 = await decode(engine, "s", lg.token_id, top_k_logprobs=0)
            assert (r2.n_past, r2.tokens_processed, r2.reused_tokens) == (11, 1, 0)
            assert r2.logits is not None and r2.logits.top == ()
            info = engine.session_info("s")
            assert info.state is SessionState.IDLE and info.n_past == 11
            assert info.tokens == (*tokens, lg.token_id)

            m = engine.metrics()
            assert (m.sessions_active, m.kv_cells_used, m.operations_running) == (1, 11, 0)
            assert (m.prefill_tokens_total, m.decode_tokens_total, m.steps_total) == (10, 1, 2)
            assert m.sessions_opened_total == 1

            assert await engine.release("s") is True
            m = engine.metrics()
            assert (m.sessions_active, m.kv_cells_used, m.sessions_released_total) == (0, 0, 1)

    async def test_released_session_is_unknown_and_release_cancel_are_idempotent(
        self, engine_factory: EngineFactory
    ) -> None:
        async with engine_factory.open() as engine:
            await engine.open_session("s")
            await prefill(engine, "s", prompt_tokens(engine, 4))
            assert engine.cancel("s") is False  # nothing running
            assert engine.cancel("s") is False
            assert await engine.release("s") is True
            assert await engine.release("s") is False
            assert engine.cancel("s") is False
            with pytest.raises(UnknownSession) as info:
                engine.session_info("s")
            assert info.value.session_id == "s"
            with pytest.raises(UnknownSession):
                await prefill(engine, "s", prompt_tokens(engine, 4))
            with pytest.raises(UnknownSession):
                await decode(engine, "s", 5)
            assert engine.sessions() == ()
            # The id can be reused after release: a fresh, empty session.
            info2 = await engine.open_session("s")
            assert info2.n_past == 0 and info2.tokens == ()
            assert engine.metrics().kv_cells_used == 0

    async def test_unknown_session_and_duplicate_open(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            with pytest.raises(UnknownSession):
                engine.session_info("nope")
            with pytest.raises(UnknownSession):
                await prefill(engine, "nope", prompt_tokens(engine, 3))
            assert await engine.release("nope") is False
            await engine.open_session("s")
            await prefill(engine, "s", prompt_tokens(engine, 3))
            with pytest.raises(SessionExists):
                await engine.open_session("s")
            assert engine.session_info("s").n_past == 3  # untouched
            for bad in ("", "x" * 129):
                with pytest.raises(InvalidInput):
                    await engine.open_session(bad)

    async def test_too_many_sessions(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open(_whole(n_ctx=256, max_sessions=2)) as engine:
            await engine.open_session("a")
            await engine.open_session("b")
            with pytest.raises(TooManySessions) as info:
                await engine.open_session("c")
            assert info.value.retryable
            await engine.release("a")
            await engine.open_session("c")
            assert sorted(i.session_id for i in engine.sessions()) == ["b", "c"]

    async def test_decode_needs_a_prefilled_session(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            await engine.open_session("s")
            with pytest.raises(IllegalTransition):
                await decode(engine, "s", 5)
            assert engine.session_info("s").state is SessionState.IDLE

    async def test_kv_budget_is_enforced(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            caps = engine.capabilities()
            for bad in (0, -1, caps.n_ctx_per_session + 1):
                with pytest.raises(InvalidInput):
                    await engine.open_session("s", kv_budget=bad)
            await engine.open_session("s", kv_budget=6)
            assert engine.session_info("s").kv_budget == 6
            with pytest.raises(KvCacheFull) as info:
                await prefill(engine, "s", prompt_tokens(engine, 7))
            assert not info.value.retryable and info.value.session_id == "s"
            assert engine.session_info("s").n_past == 0
            r = await prefill(engine, "s", prompt_tokens(engine, 6))
            assert r.n_past == 6
            assert r.logits is not None
            with pytest.raises(KvCacheFull):
                await decode(engine, "s", r.logits.token_id)
            assert engine.session_info("s").n_past == 6
            assert engine.metrics().kv_cells_used == 6
            # Rewriting inside the budget still works.
            r = await prefill(engine, "s", prompt_tokens(engine, 3, salt=1), position=3)
            assert r.n_past == 6

    async def test_batch_group_is_validated(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            for bad in (-1, 2**32, True, 1.5):
                with pytest.raises(InvalidInput):
                    await engine.open_session("s", batch_group=bad)  # type: ignore[arg-type]
            await engine.open_session("s", batch_group=2**32 - 1)
            r = await prefill(engine, "s", prompt_tokens(engine, 3))
            assert r.n_past == 3 and engine.metrics().sessions_active == 1

    # -- concurrency and cancellation ---------------------------------------------------------

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

    async def _prepare_cancel(self, engine: ShardEngine) -> tuple[tuple[int, ...], int]:
        """Open "s" holding a short history; returns (history, next greedy token)."""
        await engine.open_session("s")
        history = prompt_tokens(engine, 12, salt=3)
        r = await prefill(engine, "s", history)
        assert r.logits is not None
        return history, r.logits.token_id

    async def _assert_rolled_back(
        self, engine: ShardEngine, history: tuple[int, ...], next_token: int
    ) -> None:
        """"s" is IDLE, holds exactly ``history`` and computes as a fresh session would."""
        info = engine.session_info("s")
        assert info.state is SessionState.IDLE
        assert info.n_past == len(history) and info.tokens == history
        assert engine.metrics().kv_cells_used == len(history)
        assert engine.metrics().operations_running == 0
        assert engine.cancel("s") is False  # idempotent: nothing left to stop
        after = await decode(engine, "s", next_token)
        await engine.open_session("ref")
        await prefill(engine, "ref", history)
        ref = await decode(engine, "ref", next_token)
        assert after.n_past == ref.n_past == len(history) + 1
        assert_same_logits(after, ref)
        await engine.release("ref")

    @pytest.mark.parametrize("how", ["engine.cancel", "cancel_scope"])
    async def test_cancel_mid_prefill_rolls_back_and_leaves_session_usable(
        self, engine_factory: EngineFactory, how: str
    ) -> None:
        async with engine_factory.open() as engine:
            history, next_token = await self._prepare_cancel(engine)
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
            await self._assert_rolled_back(engine, history, next_token)

    @pytest.mark.parametrize("how", ["engine.cancel", "cancel_scope"])
    async def test_cancel_mid_decode_rolls_back_and_leaves_session_usable(
        self, engine_factory: EngineFactory, how: str
    ) -> None:
        async with engine_factory.open() as engine:
            history, next_token = await self._prepare_cancel(engine)
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
            await self._assert_rolled_back(engine, history, next_token)

    async def test_cancel_of_a_rewriting_prefill_keeps_the_reused_prefix(
        self, engine_factory: EngineFactory
    ) -> None:
        """A prefill at an earlier position that was cancelled once it began changing the KV
        cells keeps ``position + reused`` (the old positions after it were being replaced)."""
        async with engine_factory.open() as engine:
            history, _ = await self._prepare_cancel(engine)
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

    async def test_truncate_keeps_a_prefix_and_the_session_goes_on_from_it(
        self, engine_factory: EngineFactory
    ) -> None:
        """``truncate(keep)`` leaves ``[0, keep)`` exactly as it was (a decode after it equals a
        fresh session's over that prefix), frees the cells, drops a step computed ahead with
        them, and changes nothing for ``keep`` at or past the end."""
        async with engine_factory.open() as engine:
            await engine.open_session("s")
            history = prompt_tokens(engine, 16, salt=6)
            first = await prefill(engine, "s", history, lookahead=Lookahead())
            assert first.logits is not None
            await decode(engine, "s", first.logits.token_id, lookahead=Lookahead())  # one ahead
            info = await engine.truncate("s", 10)
            assert (info.n_past, info.tokens, info.state) == (10, history[:10], SessionState.IDLE)
            assert engine.metrics().kv_cells_used == 10
            assert engine.metrics().lookahead_cells == 0
            for keep in (10, 99):
                assert (await engine.truncate("s", keep)).n_past == 10
            after = await decode(engine, "s", history[10])
            await engine.open_session("ref")
            await prefill(engine, "ref", history[:10])
            ref = await decode(engine, "ref", history[10])
            assert after.n_past == ref.n_past == 11
            assert_same_logits(after, ref)
            with pytest.raises(InvalidInput):
                await engine.truncate("s", -1)
            with pytest.raises(UnknownSession):
                await engine.truncate("nope", 0)
            assert (await engine.truncate("s", 0)).n_past == 0
            assert engine.metrics().kv_cells_used == 11  # "ref"'s only
            await engine.release("ref")
            await engine.release("s")

    @pytest.mark.parametrize("part", [ShardPart.WHOLE, ShardPart.LAST], ids=lambda p: p.value)
    async def test_a_session_moves_to_another_engine_and_goes_on_there(
        self, engine_factory: EngineFactory, part: ShardPart
    ) -> None:
        """``export_session`` on one engine and ``import_session`` on another of the same model
        and range: the copy holds the same positions (and token ids, on a first shard) and its
        next step equals the original's; a step computed ahead is not part of the state; the
        original goes on as before. (Session hand-off on drain.)"""
        if part is not ShardPart.WHOLE and not engine_factory.layer_ranges:
            return
        options = EngineOptions(part=part)
        async with engine_factory.open(options) as a, engine_factory.open(options) as b:
            caps = a.capabilities()
            assert caps.kv_layout and caps.kv_layout == b.capabilities().kv_layout
            await a.open_session("s")
            if caps.is_first:
                history = prompt_tokens(a, 40, salt=9)
                first = await prefill(a, "s", history, lookahead=Lookahead())
                assert first.logits is not None
                nxt = first.logits.token_id
                await decode(a, "s", nxt, lookahead=Lookahead())  # a step computed ahead
                n_past = 41
            else:
                rows = np.random.default_rng(3).standard_normal((41, caps.n_embd)).astype(np.float32)
                await a.prefill(PrefillRequest("s", hidden_states=rows))
                n_past = 41
            snap = await a.export_session("s")
            assert isinstance(snap, SessionSnapshot) and snap.n_past == n_past
            assert snap.kv_layout == caps.kv_layout
            assert 0 < len(snap.data) <= a.state_bytes_bound(n_past)
            if caps.is_first:
                assert snap.tokens == (*history, nxt)
            else:
                assert snap.tokens is None
            assert a.metrics().lookahead_cells == 0 and a.metrics().kv_cells_used == n_past
            await b.open_session("copy")
            info = await b.import_session("copy", snap)
            assert (info.n_past, info.tokens, info.state) == (n_past, snap.tokens, SessionState.IDLE)
            assert b.metrics().kv_cells_used == n_past
            assert (a.metrics().sessions_exported_total, b.metrics().sessions_imported_total) == (1, 1)
            if caps.is_first:
                here, there = await decode(a, "s", 7), await decode(b, "copy", 7)
            else:
                row = np.random.default_rng(4).standard_normal((1, caps.n_embd)).astype(np.float32)
                here = await a.decode(DecodeRequest("s", hidden_state=row))
                there = await b.decode(DecodeRequest("copy", hidden_state=row))
            assert here.n_past == there.n_past == n_past + 1
            assert_same_logits(here, there)
            for engine, sid in ((a, "s"), (b, "copy")):
                await engine.release(sid)
                assert engine.metrics().kv_cells_used == 0

    async def test_an_import_that_does_not_fit_is_refused_and_leaves_the_session_empty(
        self, engine_factory: EngineFactory
    ) -> None:
        """Another layout, more positions than the budget, token ids that do not match the
        positions, more bytes than the positions take, bytes the engine cannot read, a session
        that holds positions already: each refused with its typed error, the session left
        empty and usable, the engine healthy."""
        async with engine_factory.open() as a, engine_factory.open() as b:
            await a.open_session("s")
            history = prompt_tokens(a, 12, salt=4)
            await prefill(a, "s", history)
            snap = await a.export_session("s")
            await b.open_session("t", kv_budget=8)
            await b.open_session("u")
            await prefill(b, "u", history[:3])
            r = dataclasses.replace
            refused: list[tuple[str, SessionSnapshot, type[EngineError]]] = [
                ("t", r(snap, kv_layout=snap.kv_layout + "/other"), IncompatibleState),
                ("t", snap, KvCacheFull),  # 12 positions, a budget of 8
                ("u", snap, IllegalTransition),  # holds 3 positions already
                ("nope", snap, UnknownSession),
            ]
            await b.open_session("v")
            refused += [
                ("v", r(snap, tokens=snap.tokens[:-1]), InvalidInput),  # type: ignore[index]
                ("v", r(snap, tokens=None), InvalidInput),  # a first shard's state has its ids
                ("v", r(snap, n_past=0), InvalidInput),
                ("v", r(snap, data=b""), InvalidInput),
                ("v", r(snap, data=snap.data + bytes(b.state_bytes_bound(12))), InvalidInput),
                ("v", r(snap, data=snap.data[: len(snap.data) // 2]), IncompatibleState),
                ("v", r(snap, data=snap.data[:-1]), IncompatibleState),
            ]
            for sid, bad, error in refused:
                with pytest.raises(error):
                    await b.import_session(sid, bad)
                assert b.health().ready
            for sid in ("t", "v"):
                assert b.session_info(sid).n_past == 0
            assert b.metrics().kv_cells_used == 3  # "u"'s
            assert b.metrics().sessions_imported_total == 0
            # the refused sessions stay usable: the state fits "v" and is imported after all
            assert (await b.import_session("v", snap)).n_past == 12
            assert_same_logits(await decode(b, "v", 9), await decode(a, "s", 9))
            assert (await prefill(b, "t", history[:5])).n_past == 5

    async def test_a_step_whose_caller_was_already_cancelled_never_starts(
        self, engine_factory: EngineFactory
    ) -> None:
        """A rewriting prefill whose caller's scope is cancelled before it was called (a Cancel
        that arrived first) raises ``trio.Cancelled`` and leaves the session as it was."""
        async with engine_factory.open() as engine:
            history, next_token = await self._prepare_cancel(engine)
            before = engine.metrics()
            new = history[4:8] + prompt_tokens(engine, LONG_PROMPT, salt=5)[1:]
            with trio.CancelScope() as scope:
                scope.cancel()
                await prefill(engine, "s", new, 4)
            assert scope.cancelled_caught
            assert engine.metrics().steps_total == before.steps_total
            await self._assert_rolled_back(engine, history, next_token)

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

    # -- streams (ShardEngine.stream: a generation's steady state) ----------------------------

    async def _stream(self, engine: ShardEngine, sid: str, token: int, max_steps: int,
                      stop_after: int | None = None, **kw: Any) -> tuple[int, list[StepResult]]:
        got: list[StepResult] = []

        def deliver(result: StepResult) -> bool:
            got.append(result)
            return stop_after is None or len(got) < stop_after

        n = await engine.stream(StreamRequest(sid, token, max_steps, **kw), deliver)
        return n, got

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
                n, got = await self._stream(engine, sid, r.logits.token_id, 9, lookahead=lookahead,
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
            history, token = await self._prepare_cancel(engine)
            n, got = await self._stream(engine, "s", token, 50, stop_after=3)
            assert n == len(got) == 3 and engine.session_info("s").n_past == len(history) + 3
            assert got[-1].logits is not None
            n, got = await self._stream(engine, "s", got[-1].logits.token_id, 2)
            assert n == len(got) == 2 and engine.session_info("s").n_past == len(history) + 5
            await engine.open_session("small", kv_budget=len(history) + 4)
            r = await prefill(engine, "small", history)
            assert r.logits is not None
            n, got = await self._stream(engine, "small", r.logits.token_id, 50)
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
            history, token = await self._prepare_cancel(engine)
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
            await engine.open_session("ref")
            await prefill(engine, "ref", info.tokens)
            assert_same_logits(after, await decode(engine, "ref", last.token_id))
            for sid in ("s", "ref"):
                await engine.release(sid)
            assert (engine.metrics().kv_cells_used, engine.metrics().lookahead_cells) == (0, 0)

    async def test_an_exception_of_deliver_ends_the_stream_and_the_engine_stays_ready(
        self, engine_factory: EngineFactory
    ) -> None:
        async with engine_factory.open() as engine:
            history, token = await self._prepare_cancel(engine)
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
            n, _ = await self._stream(engine, "s", seen[-1].logits.token_id, 2)  # type: ignore[union-attr]
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

    # -- prefix reuse and determinism ---------------------------------------------------------

    # -- look-ahead hints (docs/engine.md, "Look-ahead") ---------------------------------------

    async def test_lookahead_hints_never_change_results(self, engine_factory: EngineFactory) -> None:
        """A session that asks for look-ahead on every step gets exactly the results of one that
        never does, and its cells are its history after every step: a step computed ahead is the
        engine's scratch (``lookahead_cells``) until the next decode claims it."""
        async with engine_factory.open() as engine:
            tokens = prompt_tokens(engine, 12, salt=6)

            async def run(sid: str, hinted: bool) -> list[StepResult]:
                await engine.open_session(sid)
                hint = Lookahead(steps=8) if hinted else None
                out = [await prefill(engine, sid, tokens, lookahead=hint)]
                for i in range(8):
                    assert engine.metrics().kv_cells_used == out[-1].n_past
                    hint = Lookahead(steps=8 - i) if hinted else None
                    token = out[-1].logits.token_id  # type: ignore[union-attr]
                    out.append(await decode(engine, sid, token, lookahead=hint))
                assert engine.metrics().kv_cells_used == out[-1].n_past
                return out

            plain = await run("plain", False)
            await engine.release("plain")
            hinted = await run("hinted", True)
            assert [r.n_past for r in hinted] == [r.n_past for r in plain]
            for a, b in zip(plain, hinted, strict=True):
                assert_same_logits(a, b)
            m = engine.metrics()
            assert m.lookahead_cells <= 1  # the last hint allowed one more step
            assert m.lookahead_used_total + m.lookahead_dropped_total <= m.lookahead_steps_total
            await engine.release("hinted")
            m = engine.metrics()
            assert (m.kv_cells_used, m.lookahead_cells) == (0, 0)

    @pytest.mark.parametrize("then", ["other token", "rewind", "hidden step", "release"])
    async def test_a_step_computed_ahead_is_dropped_by_any_other_call(
        self, engine_factory: EngineFactory, then: str
    ) -> None:
        """After a hinted step, whatever the caller does instead of decoding the chosen token
        computes exactly what a session without the hint computes, and leaves no scratch cell."""
        async with engine_factory.open() as engine:
            history, chosen = await self._prepare_cancel(engine)
            r = await decode(engine, "s", chosen, lookahead=Lookahead(steps=4))
            assert r.logits is not None
            ahead = r.logits.token_id
            other = FIRST_BYTE_ID + (ahead + 1 - FIRST_BYTE_ID) % 200
            await engine.open_session("ref")
            await prefill(engine, "ref", (*history, chosen))
            if then == "other token":
                got = await decode(engine, "s", other)
                ref = await decode(engine, "ref", other)
                assert_same_logits(got, ref)
            elif then == "rewind":
                got = await prefill(engine, "s", (other, ahead), position=len(history))
                ref = await prefill(engine, "ref", (other, ahead), position=len(history))
                assert_same_logits(got, ref)
                assert got.n_past == ref.n_past == len(history) + 2
            elif then == "hidden step":
                with pytest.raises(InvalidInput):  # refused before it runs: the scratch may stay
                    await engine.decode(DecodeRequest("s", hidden_state=np.zeros((1, 4), np.float32)))
                got = await decode(engine, "s", ahead)  # ... and is still the right step
                ref = await decode(engine, "ref", ahead)
                assert_same_logits(got, ref)
            else:
                assert await engine.release("s") is True
            await engine.release("ref")
            m = engine.metrics()
            held = 0 if then == "release" else engine.session_info("s").n_past
            assert (m.kv_cells_used, m.lookahead_cells) == (held, 0)
            if then != "release":
                await engine.release("s")
            assert (engine.metrics().kv_cells_used, engine.metrics().lookahead_cells) == (0, 0)

    async def test_lookahead_hints_are_checked(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            history, chosen = await self._prepare_cancel(engine)
            with pytest.raises(InvalidInput):
                await engine.decode(DecodeRequest("s", token=chosen, lookahead=1))  # type: ignore[arg-type]
            with pytest.raises(ValueError):
                Lookahead(steps=-1)
            assert engine.session_info("s").n_past == len(history)
            # No step can follow: nothing is computed ahead (stop token, eog rule, no steps left).
            r = await decode(engine, "s", chosen, lookahead=Lookahead(steps=0))
            assert r.logits is not None
            r = await decode(engine, "s", r.logits.token_id, lookahead=Lookahead(stop_tokens=range(1 << 17)))
            assert engine.metrics().lookahead_cells == 0

    async def test_prefix_reuse(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            base = prompt_tokens(engine, 16)
            tail = prompt_tokens(engine, 6, salt=9)[1:]
            await engine.open_session("s")
            await prefill(engine, "s", base)
            # Extending from position 0 reuses everything held.
            r = await prefill(engine, "s", base + tail)
            assert (r.n_past, r.reused_tokens, r.tokens_processed) == (21, 16, 5)
            # The same prompt again recomputes exactly one position (the logits need it).
            r = await prefill(engine, "s", base + tail)
            assert (r.n_past, r.reused_tokens, r.tokens_processed) == (21, 20, 1)
            # Diverging after 10 positions keeps 10, replaces the rest.
            other = base[:10] + prompt_tokens(engine, 4, salt=11)[1:]
            r = await prefill(engine, "s", other)
            assert (r.n_past, r.reused_tokens, r.tokens_processed) == (13, 10, 3)
            assert engine.session_info("s").tokens == other
            assert engine.metrics().kv_cells_used == 13
            # Appending at the current length (position = n_past) reuses nothing.
            r = await prefill(engine, "s", tail, position=13)
            assert (r.n_past, r.reused_tokens, r.tokens_processed) == (18, 0, 5)
            # A prefill at an inner position matches held tokens from that position on.
            r = await prefill(engine, "s", other[5:], position=5)
            assert (r.n_past, r.reused_tokens, r.tokens_processed) == (13, 7, 1)
            assert engine.metrics().reused_tokens_total == 16 + 20 + 10 + 7
            # Reused state computes exactly what a fresh session computes.
            await engine.open_session("fresh")
            fresh = await prefill(engine, "fresh", other)
            assert_same_logits(r, fresh)
            with pytest.raises(InvalidInput):
                await prefill(engine, "s", tail, position=14)  # beyond the session's length
            assert engine.session_info("s").n_past == 13

    @pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
    async def test_all_logits_verify_drafted_tokens_like_decodes(
        self, engine_factory: EngineFactory, sampled: bool
    ) -> None:
        """One ``all_logits`` prefill of a token and five drafted tokens gives, at every
        position, the result (same token, sampled or greedy) that decoding them one by one
        gives; rewinding to keep only the accepted part then equals a session that never saw
        the rest, and no KV cell stays behind."""
        params = SamplingParams(temperature=1.2, top_k=40, seed=11) if sampled else SamplingParams()
        async with engine_factory.open() as engine:
            tokens = prompt_tokens(engine, 10, salt=12)
            drafts = prompt_tokens(engine, 6, salt=13)[1:]
            await engine.open_session("steps")
            plain = [await prefill(engine, "steps", tokens, sampling=params)]
            for token in drafts:
                plain.append(await decode(engine, "steps", token, sampling=params))
            await engine.open_session("verify")
            await prefill(engine, "verify", tokens[:-1], sampling=params)
            got = await engine.prefill(PrefillRequest(
                "verify", tokens=(tokens[-1], *drafts), position=len(tokens) - 1,
                sampling=params, all_logits=True,
            ))
            assert got.n_past == plain[-1].n_past == len(tokens) + len(drafts)
            assert got.tokens_processed == 1 + len(drafts) and got.reused_tokens == 0
            assert len(got.position_logits) == len(plain)
            assert got.logits == got.position_logits[-1]
            for logits, ref in zip(got.position_logits, plain, strict=True):
                assert_same_logits(dataclasses.replace(got, logits=logits), ref)
            assert not plain[-1].position_logits  # asked for only
            assert_project_value(got, "result")
            # Keep two drafts, then a correction: as if the others had never been sent.
            kept = len(tokens) + 2
            fix = FIRST_BYTE_ID + (drafts[2] + 1 - FIRST_BYTE_ID) % 200
            after = await prefill(engine, "verify", (fix,), position=kept, sampling=params)
            await engine.open_session("fresh")
            ref = await prefill(engine, "fresh", (*tokens, *drafts[:2], fix), sampling=params)
            assert_same_logits(after, ref)
            assert after.n_past == ref.n_past == kept + 1
            assert engine.metrics().kv_cells_used == plain[-1].n_past + 2 * (kept + 1)
            # all_logits reuses no held prefix: every position's logits are computed.
            again = await engine.prefill(PrefillRequest(
                "fresh", tokens=tokens, position=0, sampling=params, all_logits=True))
            assert again.reused_tokens == 0 and len(again.position_logits) == len(tokens)
            assert_same_logits(dataclasses.replace(again, logits=again.position_logits[-1]), plain[0])
            for sid in ("steps", "verify", "fresh"):
                await engine.release(sid)
            assert engine.metrics().kv_cells_used == 0

    async def test_all_logits_is_bounded_and_ignored_before_the_last_shard(
        self, engine_factory: EngineFactory
    ) -> None:
        """More positions than ``max_logits_positions`` are refused before any work; a
        non-last shard ignores the flag (its boundary holds every position already), and the
        last shard of a chain then verifies exactly as the whole model does."""
        async with engine_factory.open() as engine:
            caps = engine.capabilities()
            assert caps.max_logits_positions >= 16
            await engine.open_session("s")
            await prefill(engine, "s", prompt_tokens(engine, 4))
            too_many = prompt_tokens(engine, caps.max_logits_positions + 1, salt=3)
            with pytest.raises(InvalidInput, match="all_logits"):
                await engine.prefill(PrefillRequest("s", tokens=too_many, position=4, all_logits=True))
            info = engine.session_info("s")
            assert (info.n_past, info.state) == (4, SessionState.IDLE)
            assert engine.metrics().kv_cells_used == 4
        if not engine_factory.layer_ranges:
            return
        async with (
            engine_factory.open(EngineOptions(part=ShardPart.FIRST)) as first,
            engine_factory.open(EngineOptions(part=ShardPart.LAST)) as last,
            engine_factory.open() as whole,
        ):
            assert first.capabilities().max_logits_positions == 0
            tokens = prompt_tokens(first, 9, salt=14)
            for engine in (first, last, whole):
                await engine.open_session("s")
            b = await first.prefill(PrefillRequest("s", tokens=tokens, all_logits=True))
            assert b.boundary is not None and not b.position_logits
            chained = await last.prefill(PrefillRequest(
                "s", hidden_states=b.boundary.hidden_states, all_logits=True))
            direct = await whole.prefill(PrefillRequest("s", tokens=tokens, all_logits=True))
            assert len(chained.position_logits) == len(direct.position_logits) == 9
            for x, y in zip(chained.position_logits, direct.position_logits, strict=True):
                assert_same_logits(dataclasses.replace(chained, logits=x),
                                   dataclasses.replace(direct, logits=y))

    async def test_greedy_is_deterministic(self, engine_factory: EngineFactory) -> None:
        runs: list[list[int]] = []
        fingerprints: set[str] = set()
        for _ in range(2):  # two engine instances of the same model
            async with engine_factory.open() as engine:
                tokens = prompt_tokens(engine, 9, salt=2)
                await engine.open_session("a")
                await engine.open_session("b")
                runs.append(await generate(engine, "a", tokens, 12))
                runs.append(await generate(engine, "b", tokens, 12))
                fingerprints.add(engine.capabilities().model_fingerprint)
        assert all(run == runs[0] for run in runs)
        assert len(fingerprints) == 1

    async def test_seeded_sampling_is_deterministic(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            tokens = prompt_tokens(engine, 9, salt=6)

            async def sample(seed: int) -> list[int]:
                sid = f"seed-{seed}"
                await engine.open_session(sid)
                params = SamplingParams(temperature=1.5, top_k=64, top_p=0.98, seed=seed)
                out = await generate(engine, sid, tokens, 10, sampling=params)
                await engine.release(sid)
                return out

            first = await sample(7)
            assert await sample(7) == first
            assert await sample(7) == first
            assert len({tuple(await sample(seed)) for seed in range(6)}) > 1

    # -- bad input ----------------------------------------------------------------------------

    async def test_bad_input_gets_typed_errors_and_leaves_sessions_untouched(
        self, engine_factory: EngineFactory
    ) -> None:
        async with engine_factory.open() as engine:
            caps = engine.capabilities()
            good = prompt_tokens(engine, 6)
            await engine.open_session("s")
            await engine.open_session("bystander")
            r = await prefill(engine, "s", good)
            assert r.logits is not None
            await prefill(engine, "bystander", prompt_tokens(engine, 8, salt=1))
            snapshot = engine.sessions()
            hidden = np.zeros((2, caps.n_embd), dtype=np.float32)
            too_long = prompt_tokens(engine, caps.n_ctx_per_session + 1)

            bad_requests: list[tuple[type[EngineError], Callable[[], Awaitable[Any]]]] = [
                (InvalidInput, lambda: prefill(engine, "s", ())),
                (InvalidInput, lambda: prefill(engine, "s", (-1,))),
                (InvalidInput, lambda: prefill(engine, "s", (caps.n_vocab,))),
                (InvalidInput, lambda: prefill(engine, "s", (1, 2**40))),
                (InvalidInput, lambda: prefill(engine, "s", (1, True))),
                (InvalidInput, lambda: prefill(engine, "s", (1, 5.0))),  # type: ignore[arg-type]
                (InvalidInput, lambda: prefill(engine, "s", too_long)),
                (InvalidInput, lambda: prefill(engine, "s", good, position=7)),
                (InvalidInput, lambda: prefill(engine, "s", good, position=-1)),
                (InvalidInput, lambda: prefill(engine, "s", good, top_k_logprobs=-1)),
                (InvalidInput, lambda: prefill(engine, "s", good, top_k_logprobs=65)),
                (InvalidInput, lambda: prefill(engine, "s", good, position=True)),
                (InvalidInput, lambda: prefill(engine, "s", good, top_k_logprobs=True)),
                (InvalidInput, lambda: engine.prefill(PrefillRequest("s"))),
                (InvalidInput, lambda: engine.prefill(
                    PrefillRequest("s", tokens=good, hidden_states=hidden))),
                (InvalidInput, lambda: engine.prefill(PrefillRequest("s", hidden_states=hidden))),
                (InvalidInput, lambda: decode(engine, "s", -3)),
                (InvalidInput, lambda: decode(engine, "s", caps.n_vocab)),
                (InvalidInput, lambda: engine.decode(DecodeRequest("s"))),
                (InvalidInput, lambda: engine.decode(
                    DecodeRequest("s", hidden_state=hidden[:1]))),
                (UnknownSession, lambda: prefill(engine, "ghost", good)),
                (UnknownSession, lambda: decode(engine, "ghost", 5)),
                (UnknownSession, lambda: prefill(engine, ["s"], good)),  # type: ignore[arg-type]
                # Malformed fields must be this request's error, never an engine fault.
                (InvalidInput, lambda: prefill(engine, "s", good, sampling=None)),
                (InvalidInput, lambda: decode(engine, "s", 5, sampling="greedy")),
                (UnsupportedFeature, lambda: prefill(engine, "s", good, aux_state="state")),
                (UnsupportedFeature, lambda: decode(engine, "s", 5, aux_state=b"")),
            ]
            for expected, call in bad_requests:
                with pytest.raises(expected):
                    await call()
                assert engine.sessions() == snapshot
                assert engine.health().ready
            with pytest.raises(InvalidInput):
                engine.tokenize(123)  # type: ignore[arg-type]
            with pytest.raises(InvalidInput):
                engine.token_piece(caps.n_vocab)
            with pytest.raises(InvalidInput):
                SamplingParams(temperature=float("nan"))
            with pytest.raises(InvalidInput):
                SamplingParams(top_p=0.0)
            for bad_params in ({"top_k": 2.5}, {"seed": 1.5}, {"top_k": True}, {"temperature": "1"},
                               {"top_p": None}):
                with pytest.raises(InvalidInput):
                    SamplingParams(**{"temperature": 1.0, **bad_params})
            assert engine.cancel(["s"]) is False  # type: ignore[arg-type]
            assert await engine.release(["s"]) is False  # type: ignore[arg-type]
            assert engine.metrics().kv_cells_used == 6 + 8
            # Both sessions still compute exactly as before.
            again = await decode(engine, "s", r.logits.token_id)
            await engine.open_session("ref")
            await prefill(engine, "ref", good)
            assert_same_logits(again, await decode(engine, "ref", r.logits.token_id))

    @pytest.mark.parametrize("part", [ShardPart.LAST, ShardPart.MIDDLE], ids=lambda p: p.value)
    async def test_bad_hidden_states_on_a_later_shard(
        self, engine_factory: EngineFactory, part: ShardPart
    ) -> None:
        if not engine_factory.layer_ranges:
            await assert_layer_range_refused(engine_factory, part)
            return
        async with engine_factory.open(EngineOptions(part=part, pieces=3)) as engine:
            caps = engine.capabilities()
            assert not caps.is_first and caps.is_last is (part is ShardPart.LAST)
            d = caps.n_embd
            await engine.open_session("s")
            await engine.open_session("bystander")
            rng = np.random.default_rng(0)
            ok = rng.standard_normal((5, d)).astype(np.float32)
            await engine.prefill(PrefillRequest("s", hidden_states=ok))
            await engine.prefill(PrefillRequest("bystander", hidden_states=ok[:3]))
            snapshot = engine.sessions()
            nan = ok.copy()
            nan[1, 2] = np.nan
            inf = ok.copy()
            inf[0, 0] = np.inf
            too_long = np.zeros((caps.n_ctx_per_session + 1, d), dtype=np.float32)
            bad_hidden = [
                ok[:, : d - 1],  # wrong width
                np.zeros((3, d + 1), dtype=np.float32),
                ok[0],  # 1-D
                ok.reshape(1, 5, d),  # 3-D
                np.zeros((0, d), dtype=np.float32),  # no rows
                ok.astype(np.float64),  # wrong dtype
                nan,
                inf,
                too_long,
            ]
            for value in bad_hidden:
                with pytest.raises(InvalidInput):
                    await engine.prefill(PrefillRequest("s", hidden_states=value, position=5))
                assert engine.sessions() == snapshot
            for row in (ok[:2], nan[1:2], ok[0], ok[:1, :-1]):
                with pytest.raises(InvalidInput):
                    await engine.decode(DecodeRequest("s", hidden_state=row))
            with pytest.raises(InvalidInput):
                await prefill(engine, "s", (1, 5, 6))  # token ids need a first shard
            with pytest.raises(InvalidInput):
                await decode(engine, "s", 5)
            with pytest.raises(IllegalTransition):
                engine.tokenize("hello")
            assert engine.sessions() == snapshot
            assert engine.metrics().kv_cells_used == 8
            r = await engine.decode(DecodeRequest("s", hidden_state=ok[:1]))
            assert r.n_past == 6
            if caps.is_last:
                assert r.logits is not None and r.boundary is None
            else:
                assert r.logits is None and r.boundary is not None
                assert r.boundary.hidden_states.shape == (1, d) and r.boundary.start_position == 5
            assert engine.session_info("s").tokens is None  # ids are unknown past layer 0

    async def test_reserved_hooks_fail_closed(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            await engine.open_session("s")
            tokens = prompt_tokens(engine, 5)
            aux = AuxState(AuxStateKind.RECURRENT, b"\0" * 16, (4,))
            with pytest.raises(UnsupportedFeature):
                await prefill(engine, "s", tokens, mtp=MtpRequest(n_draft=2))
            with pytest.raises(UnsupportedFeature):
                await prefill(engine, "s", tokens, aux_state=aux)
            assert engine.session_info("s").n_past == 0
            r = await prefill(engine, "s", tokens)
            assert r.mtp is None and r.aux_state is None
            assert r.logits is not None
            with pytest.raises(UnsupportedFeature):
                await decode(engine, "s", r.logits.token_id, mtp=MtpRequest(n_draft=1))
            with pytest.raises(UnsupportedFeature):
                await decode(engine, "s", r.logits.token_id,
                             aux_state=AuxState(AuxStateKind.CROSS_ATTENTION, b"", (0,)))
            assert engine.session_info("s").n_past == 5
            assert engine.health().ready

    # -- tokens -------------------------------------------------------------------------------

    async def test_tokenize_and_pieces(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            caps = engine.capabilities()
            with_bos = engine.tokenize("hello world")
            without = engine.tokenize("hello world", add_bos=False)
            assert with_bos[0] == caps.bos_token_id and with_bos[1:] == without
            assert all(0 <= t < caps.n_vocab for t in with_bos)
            text = b"".join(engine.token_piece(t) for t in without)
            assert b"hello" in text and b"world" in text

    async def test_special_token_texts_are_parsed_only_when_asked(
        self, engine_factory: EngineFactory
    ) -> None:
        """A chat template's markers must become special tokens; a user's text must not."""
        async with engine_factory.open() as engine:
            caps = engine.capabilities()
            assert caps.chat.bos_token and caps.chat.eos_token and caps.bos_token_id is not None
            assert caps.chat.add_bos is (engine.tokenize("x")[0] == caps.bos_token_id)
            text = f"hello{caps.chat.eos_token}world"
            parsed = engine.tokenize(text, add_bos=False, parse_special=True)
            plain = engine.tokenize(text, add_bos=False)
            assert caps.eos_token_id in parsed and caps.eos_token_id not in plain
            assert parsed == (*engine.tokenize("hello", add_bos=False), caps.eos_token_id,
                              *engine.tokenize("world", add_bos=False))
            # A step's top alternatives carry their pieces, as the chosen token does.
            await engine.open_session("s")
            r = await prefill(engine, "s", list(engine.tokenize("hello world")), top_k_logprobs=4)
            assert r.logits is not None and len(r.logits.top) == 4
            assert all(t.piece == engine.token_piece(t.token_id) for t in r.logits.top)

    # -- layer ranges -------------------------------------------------------------------------

    async def test_layer_ranges_are_served_or_refused_as_declared(
        self, engine_factory: EngineFactory
    ) -> None:
        for part in (ShardPart.FIRST, ShardPart.MIDDLE, ShardPart.LAST):
            if not engine_factory.layer_ranges:
                await assert_layer_range_refused(engine_factory, part)
                continue
            options = EngineOptions(part=part, pieces=3)
            async with engine_factory.open(options) as engine:
                caps = engine.capabilities()
                assert caps.is_first is (part is ShardPart.FIRST)
                assert caps.is_last is (part is ShardPart.LAST)
                assert caps.layer_range == options.layer_range(caps.n_layers_total)
                assert caps.hidden_dtype == "float32"
                assert caps.result_kind is (
                    ResultKind.LOGITS if part is ShardPart.LAST else ResultKind.BOUNDARY
                )

    async def test_two_shard_chain_matches_the_whole_model(self, engine_factory: EngineFactory) -> None:
        if not engine_factory.layer_ranges:
            await assert_layer_range_refused(engine_factory, ShardPart.FIRST)
            return
        async with (
            engine_factory.open(EngineOptions(part=ShardPart.FIRST)) as first,
            engine_factory.open(EngineOptions(part=ShardPart.LAST)) as last,
            engine_factory.open() as whole,
        ):
            c1, c2, cw = first.capabilities(), last.capabilities(), whole.capabilities()
            assert c1.model_fingerprint == c2.model_fingerprint == cw.model_fingerprint
            assert c1.is_first and not c1.is_last and c1.result_kind is ResultKind.BOUNDARY
            assert c2.is_last and not c2.is_first and c2.result_kind is ResultKind.LOGITS
            assert c1.layer_range.end == c2.layer_range.start
            assert c2.layer_range.end == cw.n_layers_total == c1.n_layers_total
            tokens = prompt_tokens(first, 11, salt=8)
            for engine in (first, last, whole):
                await engine.open_session("s")
            b = await prefill(first, "s", tokens)
            assert b.kind is ResultKind.BOUNDARY and b.logits is None and b.boundary is not None
            h = b.boundary.hidden_states
            assert h.dtype == np.float32 and h.shape == (11, c1.n_embd)
            assert np.isfinite(h).all() and b.boundary.start_position == 0
            chained = await last.prefill(PrefillRequest("s", hidden_states=h))
            direct = await prefill(whole, "s", tokens)
            assert_same_logits(chained, direct)
            assert first.session_info("s").tokens == tokens
            assert last.session_info("s").tokens is None
            assert chained.logits is not None
            token = chained.logits.token_id
            for _ in range(3):
                b = await decode(first, "s", token)
                assert b.boundary is not None
                assert b.boundary.hidden_states.shape == (1, c1.n_embd)
                assert b.boundary.start_position == first.session_info("s").n_past - 1
                chained = await last.decode(DecodeRequest("s", hidden_state=b.boundary.hidden_states))
                direct = await decode(whole, "s", token)
                assert_same_logits(chained, direct)
                assert chained.logits is not None
                token = chained.logits.token_id
            assert (
                first.metrics().kv_cells_used
                == last.metrics().kv_cells_used
                == whole.metrics().kv_cells_used
                == 14
            )

    async def test_three_shard_chain_matches_the_whole_model(
        self, engine_factory: EngineFactory
    ) -> None:
        if not engine_factory.layer_ranges:
            await assert_layer_range_refused(engine_factory, ShardPart.MIDDLE)
            return
        parts = (ShardPart.FIRST, ShardPart.MIDDLE, ShardPart.LAST)
        async with (
            engine_factory.open(EngineOptions(part=parts[0], pieces=3)) as first,
            engine_factory.open(EngineOptions(part=parts[1], pieces=3)) as middle,
            engine_factory.open(EngineOptions(part=parts[2], pieces=3)) as last,
            engine_factory.open() as whole,
        ):
            chain = (first, middle, last)
            caps = [e.capabilities() for e in chain]
            cw = whole.capabilities()
            assert len({c.model_fingerprint for c in caps} | {cw.model_fingerprint}) == 1
            assert caps[0].layer_range.start == 0 and caps[2].layer_range.end == cw.n_layers_total
            assert caps[0].layer_range.end == caps[1].layer_range.start
            assert caps[1].layer_range.end == caps[2].layer_range.start
            assert [c.result_kind for c in caps] == [ResultKind.BOUNDARY] * 2 + [ResultKind.LOGITS]
            for engine in (*chain, whole):
                await engine.open_session("s")

            async def through(step: StepResult, sid: str = "s", *, is_decode: bool) -> StepResult:
                for engine in chain[1:]:
                    assert step.boundary is not None and step.logits is None
                    h = step.boundary.hidden_states
                    assert h.dtype == np.float32 and h.shape[1] == cw.n_embd and np.isfinite(h).all()
                    step = await (
                        engine.decode(DecodeRequest(sid, hidden_state=h)) if is_decode
                        else engine.prefill(PrefillRequest(sid, hidden_states=h,
                                                           position=step.boundary.start_position))
                    )
                return step

            tokens = prompt_tokens(first, 13, salt=5)
            # Prefill in two requests (the second appends at position 9), then decode.
            await through(await prefill(first, "s", tokens[:9]), is_decode=False)
            chained = await through(await prefill(first, "s", tokens[9:], position=9), is_decode=False)
            direct = await prefill(whole, "s", tokens)
            assert_same_logits(chained, direct)
            for _ in range(4):
                assert chained.logits is not None
                token = chained.logits.token_id
                chained = await through(await decode(first, "s", token), is_decode=True)
                direct = await decode(whole, "s", token)
                assert_same_logits(chained, direct)
            assert [e.metrics().kv_cells_used for e in (*chain, whole)] == [17] * 4
            assert middle.session_info("s").tokens is None and middle.session_info("s").n_past == 17

    # -- many sessions at once (continuous batching must be invisible) ------------------------

    @pytest.mark.parametrize("seed", [3, 4, 12])  # each mixes runs, cancels and releases
    async def test_many_sessions_at_once_match_each_session_alone(
        self, engine_factory: EngineFactory, seed: int
    ) -> None:
        """Random arrivals, cancels and releases: every session that survives chooses exactly
        the greedy tokens it chooses alone (logprobs within 1e-3: a batch's shape may change
        floating-point sums), and nothing is left behind."""
        async with engine_factory.open(_whole(n_ctx=1024, max_sessions=8)) as engine:
            rng = random.Random(seed)
            plans = [
                (prompt_tokens(engine, rng.randint(1, 40), salt=i), rng.randint(0, 10),
                 rng.choice(["run", "run", "cancel", "release"]), rng.randint(0, 12))
                for i in range(8)
            ]
            alone: list[list[StepResult]] = []
            for tokens, n_decode, _, _ in plans:
                await engine.open_session("alone")
                alone.append(await _greedy_steps(engine, "alone", tokens, n_decode))
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
                            op = start_op(nursery, _step, engine, sid, tokens, steps)
                            await wait_running(engine, sid)
                            if fate == "cancel":
                                assert engine.cancel(sid) is True
                            else:
                                assert await engine.release(sid) is True
                        assert isinstance(op.error, EngineCancelled), op.error
                        if fate == "release":
                            return
                        assert engine.session_info(sid).n_past == n_past  # rolled back
                    steps.append(await _step(engine, sid, tokens, steps))
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

    async def test_many_sessions_through_a_layer_range_chain_match_the_whole_model(
        self, engine_factory: EngineFactory
    ) -> None:
        """Several sessions stepping concurrently through first/middle/last shards (hidden rows
        of many sessions share the later shards) match each session on the whole model alone;
        one session is cancelled on the middle shard mid-prompt and released everywhere."""
        if not engine_factory.layer_ranges:
            await assert_layer_range_refused(engine_factory, ShardPart.MIDDLE)
            return
        parts = (ShardPart.FIRST, ShardPart.MIDDLE, ShardPart.LAST)
        async with (
            engine_factory.open(EngineOptions(part=parts[0], pieces=3, n_ctx=1536, max_sessions=6)) as first,
            engine_factory.open(EngineOptions(part=parts[1], pieces=3, n_ctx=1536, max_sessions=6)) as middle,
            engine_factory.open(EngineOptions(part=parts[2], pieces=3, n_ctx=1536, max_sessions=6)) as last,
            engine_factory.open(_whole(n_ctx=1536, max_sessions=6)) as whole,
        ):
            chain = (first, middle, last)
            rng = random.Random(5)
            plans = [(prompt_tokens(first, rng.randint(2, 30), salt=20 + i), rng.randint(1, 6),
                      rng.randint(0, 8)) for i in range(5)]
            alone: list[list[StepResult]] = []
            for tokens, n_decode, _ in plans:
                await whole.open_session("alone")
                alone.append(await _greedy_steps(whole, "alone", tokens, n_decode))
                await whole.release("alone")
            tasks_before = count_tasks()

            async def through(sid: str, step: StepResult, *, is_decode: bool) -> StepResult:
                for engine in chain[1:]:
                    assert step.boundary is not None
                    h = step.boundary.hidden_states
                    k = 3 if engine is last else 0
                    step = await (
                        engine.decode(DecodeRequest(sid, hidden_state=h, top_k_logprobs=k)) if is_decode
                        else engine.prefill(PrefillRequest(sid, hidden_states=h, top_k_logprobs=k,
                                                           position=step.boundary.start_position))
                    )
                return step

            async def one(i: int) -> None:
                tokens, n_decode, delay = plans[i]
                for _ in range(delay):
                    await trio.lowlevel.checkpoint()
                sid = f"chain-{i}"
                for engine in chain:
                    await engine.open_session(sid)
                steps = [await through(sid, await prefill(first, sid, tokens), is_decode=False)]
                for _ in range(n_decode):
                    assert steps[-1].logits is not None
                    b = await decode(first, sid, steps[-1].logits.token_id)
                    steps.append(await through(sid, b, is_decode=True))
                for got, want in zip(steps, alone[i], strict=True):
                    assert_same_logits(got, want)

            async def cancelled_mid_prompt() -> None:
                sid = "chain-cancelled"
                for engine in chain:
                    await engine.open_session(sid)
                b = await prefill(first, sid, prompt_tokens(first, LONG_PROMPT, salt=9))
                assert b.boundary is not None
                async with trio.open_nursery() as nursery:
                    op = start_op(nursery, middle.prefill,
                                  PrefillRequest(sid, hidden_states=b.boundary.hidden_states))
                    await wait_running(middle, sid)
                    middle.cancel(sid)
                assert isinstance(op.error, EngineCancelled), op.error
                assert middle.session_info(sid).n_past == 0
                for engine in chain:
                    assert await engine.release(sid) is True

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancelled_mid_prompt)
                for i in range(len(plans)):
                    nursery.start_soon(one, i)
            expected = sum(len(t) + n for t, n, _ in plans)
            assert [e.metrics().kv_cells_used for e in chain] == [expected] * 3
            assert all(e.metrics().operations_running == 0 for e in chain)
            assert count_tasks() == tasks_before

    # -- one reference trace ------------------------------------------------------------------

    async def test_reference_trace(self, engine_factory: EngineFactory) -> None:
        """One scripted sequence; every engine must produce exactly this trace."""
        async with engine_factory.open(_whole(n_ctx=768, max_sessions=3)) as engine:
            trace = await run_reference_trace(engine)
        assert trace == REFERENCE_TRACE

    # -- leaks --------------------------------------------------------------------------------

    async def test_a_thousand_sessions_leave_nothing_behind(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open(_whole(n_ctx=256, max_sessions=4)) as engine:
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


async def _greedy_steps(engine: ShardEngine, sid: str, tokens: Sequence[int], n_decode: int) -> list[StepResult]:
    """Prefill ``tokens`` then ``n_decode`` greedy decodes; every step's result (top-3 logprobs)."""
    steps: list[StepResult] = []
    for _ in range(n_decode + 1):
        steps.append(await _step(engine, sid, tokens, steps))
    return steps


async def _step(engine: ShardEngine, sid: str, tokens: Sequence[int], steps: list[StepResult]) -> StepResult:
    """The next step of a greedy generation: the prefill first, then decodes of the last choice."""
    if not steps:
        return await prefill(engine, sid, tokens, top_k_logprobs=3)
    assert steps[-1].logits is not None
    return await decode(engine, sid, steps[-1].logits.token_id, top_k_logprobs=3)


# ---- the reference trace -------------------------------------------------------------------


async def run_reference_trace(engine: ShardEngine) -> list[tuple[str, object]]:
    """Run a fixed sequence of operations and record each outcome engine-independently."""
    trace: list[tuple[str, object]] = []
    t8 = prompt_tokens(engine, 8)
    t4 = prompt_tokens(engine, 5, salt=1)[1:]
    diverge = t8[:5] + prompt_tokens(engine, 3, salt=2)[1:]

    async def step(name: str, call: Callable[[], Awaitable[Any]]) -> Any:
        try:
            value = await call()
        except EngineError as exc:
            trace.append((name, exc.code))
            return None
        if isinstance(value, StepResult):
            trace.append((name, (value.kind.value, value.n_past, value.tokens_processed,
                                 value.reused_tokens)))
        elif hasattr(value, "state"):
            trace.append((name, (value.state.value, value.n_past)))
        else:
            trace.append((name, value))
        return value

    await step("open a", lambda: engine.open_session("a"))
    await step("decode a before prefill", lambda: decode(engine, "a", 5))
    await step("prefill a 8", lambda: prefill(engine, "a", t8))
    await step("append a 4", lambda: prefill(engine, "a", t4, position=8))
    await step("repeat a 12", lambda: prefill(engine, "a", t8 + t4))
    await step("diverge a at 5", lambda: prefill(engine, "a", diverge))
    await step("decode a", lambda: decode(engine, "a", 7))
    await step("prefill a beyond length", lambda: prefill(engine, "a", t4, position=20))
    await step("open a again", lambda: engine.open_session("a"))
    await step("open b budget 4", lambda: engine.open_session("b", kv_budget=4))
    await step("prefill b 5", lambda: prefill(engine, "b", t8[:5]))
    await step("prefill b 4", lambda: prefill(engine, "b", t8[:4]))
    await step("decode b", lambda: decode(engine, "b", 9))
    await step("open c", lambda: engine.open_session("c"))
    await step("open d", lambda: engine.open_session("d"))
    await step("open e", lambda: engine.open_session("e"))
    await step("mtp on a", lambda: prefill(engine, "a", t4, position=9, mtp=MtpRequest(1)))
    await step("hidden on a", lambda: engine.prefill(
        PrefillRequest("a", hidden_states=np.zeros((1, engine.capabilities().n_embd), np.float32))))
    await step("release b", lambda: engine.release("b"))
    await step("release b again", lambda: engine.release("b"))
    await step("decode b released", lambda: decode(engine, "b", 9))
    await step("open e after release", lambda: engine.open_session("e"))
    trace.append(("cancel a idle", engine.cancel("a")))
    trace.append(("kv cells", engine.metrics().kv_cells_used))
    for sid in ("a", "c", "d", "e"):
        await step(f"release {sid}", lambda sid=sid: engine.release(sid))
    trace.append(("kv cells at end", engine.metrics().kv_cells_used))
    return trace


REFERENCE_TRACE: list[tuple[str, object]] = [
    ("open a", ("idle", 0)),
    ("decode a before prefill", "ILLEGAL_TRANSITION"),
    ("prefill a 8", ("logits", 8, 8, 0)),
    ("append a 4", ("logits", 12, 4, 0)),
    ("repeat a 12", ("logits", 12, 1, 11)),
    ("diverge a at 5", ("logits", 7, 2, 5)),
    ("decode a", ("logits", 8, 1, 0)),
    ("prefill a beyond length", "INVALID_INPUT"),
    ("open a again", "SESSION_EXISTS"),
    ("open b budget 4", ("idle", 0)),
    ("prefill b 5", "KV_CACHE_FULL"),
    ("prefill b 4", ("logits", 4, 4, 0)),
    ("decode b", "KV_CACHE_FULL"),
    ("open c", ("idle", 0)),
    ("open d", "TOO_MANY_SESSIONS"),
    ("open e", "TOO_MANY_SESSIONS"),
    ("mtp on a", "UNSUPPORTED_FEATURE"),
    ("hidden on a", "INVALID_INPUT"),
    ("release b", True),
    ("release b again", False),
    ("decode b released", "UNKNOWN_SESSION"),
    ("open e after release", ("idle", 0)),
    ("cancel a idle", False),
    ("kv cells", 8),
    ("release a", True),
    ("release c", True),
    ("release d", False),
    ("release e", True),
    ("kv cells at end", 0),
]

__all__ = [
    "REFERENCE_TRACE",
    "EngineContractSuite",
    "Pending",
    "assert_layer_range_refused",
    "assert_project_value",
    "assert_same_logits",
    "count_native_threads",
    "count_tasks",
    "decode",
    "generate",
    "inject_failure",
    "prefill",
    "prompt_tokens",
    "run_reference_trace",
    "start_op",
    "wait_running",
]
