"""The reference trace: one fixed sequence of operations whose outcomes (states, reuse counts,
error codes) every engine must produce verbatim."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from shard.engine import (
    EngineError,
    MtpRequest,
    PrefillRequest,
    ShardEngine,
    StepResult,
)

from ..factories import EngineFactory
from .harness import (
    decode,
    prefill,
    prompt_tokens,
    whole_options,
)


class ReferenceTrace:
    """Every engine produces ``REFERENCE_TRACE`` exactly."""

    async def test_reference_trace(self, engine_factory: EngineFactory) -> None:
        """One scripted sequence; every engine must produce exactly this trace."""
        async with engine_factory.open(whole_options(n_ctx=768, max_sessions=3)) as engine:
            trace = await run_reference_trace(engine)
        assert trace == REFERENCE_TRACE


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
