"""Helpers the contract tests share, public so that other suites reuse them: valid prompts,
typed one-liners for prefill and decode, running an operation in the background and stopping it,
and the comparisons (same logits, project-owned values, nothing left behind)."""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import trio

from shard.engine import (
    DecodeRequest,
    EngineError,
    EngineFailure,
    EngineState,
    PrefillRequest,
    SamplingParams,
    SessionState,
    ShardEngine,
    StepResult,
    UnsupportedFeature,
)

from ..factories import EngineFactory, EngineOptions, ShardPart

LONG_PROMPT = 200  # positions; with n_batch 8 that is 25 llama.cpp chunks
FIRST_BYTE_ID = 3  # ids [3, 259) are valid in every engine's vocabulary (asserted below)


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
    """Prefill ``tokens`` at ``position``; ``kw`` are the other ``PrefillRequest`` fields."""
    return await engine.prefill(PrefillRequest(sid, tokens=tuple(tokens), position=position, **kw))


async def decode(engine: ShardEngine, sid: str, token: int, **kw: Any) -> StepResult:
    """Decode ``token``; ``kw`` are the other ``DecodeRequest`` fields."""
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


def whole_options(n_ctx: int = 1024, max_sessions: int = 4) -> EngineOptions:
    """Options for an engine serving every layer of the model."""
    return EngineOptions(n_ctx=n_ctx, max_sessions=max_sessions)


async def greedy_steps(engine: ShardEngine, sid: str, tokens: Sequence[int],
                       n_decode: int) -> list[StepResult]:
    """Prefill ``tokens`` then ``n_decode`` greedy decodes; every step's result (top-3 logprobs)."""
    steps: list[StepResult] = []
    for _ in range(n_decode + 1):
        steps.append(await next_greedy_step(engine, sid, tokens, steps))
    return steps


async def next_greedy_step(engine: ShardEngine, sid: str, tokens: Sequence[int],
                           steps: list[StepResult]) -> StepResult:
    """The next step of a greedy generation: the prefill first, then decodes of the last choice."""
    if not steps:
        return await prefill(engine, sid, tokens, top_k_logprobs=3)
    assert steps[-1].logits is not None
    return await decode(engine, sid, steps[-1].logits.token_id, top_k_logprobs=3)


async def open_with_history(engine: ShardEngine) -> tuple[tuple[int, ...], int]:
    """Open "s" holding a short history; returns (history, next greedy token).

    The common start of the tests that stop, stream or look ahead from a session with a past."""
    await engine.open_session("s")
    history = prompt_tokens(engine, 12, salt=3)
    r = await prefill(engine, "s", history)
    assert r.logits is not None
    return history, r.logits.token_id


async def decode_fresh(engine: ShardEngine, sid: str, history: Sequence[int],
                       token: int) -> StepResult:
    """Open ``sid``, prefill ``history`` and decode ``token`` there: what a fresh session computes,
    the reference for a session that was stopped, truncated or refused a request over that
    history. The caller releases ``sid``."""
    await engine.open_session(sid)
    await prefill(engine, sid, history)
    return await decode(engine, sid, token)


async def through_chain(later: Sequence[ShardEngine], sid: str, step: StepResult, *,
                        is_decode: bool, top_k_logprobs: int = 5) -> StepResult:
    """Carry a first shard's ``step`` through the ``later`` shards of a chain, as a pipeline does:
    each hop's boundary must be finite float32 rows of the model's width, and its rows are the
    next shard's decode or prefill (at the boundary's start position)."""
    for engine in later:
        assert step.boundary is not None and step.logits is None
        h = step.boundary.hidden_states
        assert h.dtype == np.float32 and h.shape[1] == engine.capabilities().n_embd
        assert np.isfinite(h).all()
        step = await (
            engine.decode(DecodeRequest(sid, hidden_state=h, top_k_logprobs=top_k_logprobs))
            if is_decode
            else engine.prefill(PrefillRequest(sid, hidden_states=h, top_k_logprobs=top_k_logprobs,
                                               position=step.boundary.start_position))
        )
    return step
