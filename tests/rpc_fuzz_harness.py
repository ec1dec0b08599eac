"""The machinery of the RPC fuzzers (tests/test_rpc_fuzz.py, tests/test_chain_fuzz.py): a Trio
loop in a background thread that the hypothesis rules submit their coroutines to, and the engines
a fuzzed worker serves.

Why a plain ``RuleBasedStateMachine`` with a Trio loop in a background thread: hypothesis-trio
does not import with current hypothesis, so each rule submits coroutines to the loop
(``trio.from_thread.run``) and waits for them, bounded, so a hang fails the example instead
of the run.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from shard.engine import LoadSpec, ShardEngine
from shard.engine.fake import FakeEngine, FakeModel, FakeScript, FakeStep

MODEL = FakeModel(n_layers_total=2, n_embd=8, seed=11)
FAKE_SPEC = LoadSpec(n_ctx=1024, max_sessions=4)  # 256 positions per session
#: Messages of the invariant failures raised so far (see ``_finds`` in the fuzz tests).
FAILURES: list[str] = []
RPC_TIMEOUT = 20.0  # bound of every rule's work: a hang fails the example


class LoopThread:
    """A Trio loop in a background thread; ``run`` submits a coroutine function and waits."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self.nursery: trio.Nursery | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="rpc-fuzz-loop", daemon=True)
        self.thread.start()
        if not self._ready.wait(30) or self._token is None:
            raise RuntimeError(f"the fuzz loop did not start: {self.error!r}")

    def _main(self) -> None:
        try:
            trio.run(self._root)
        except BaseException as exc:  # reported by close()
            self.error = exc
        finally:
            self._ready.set()

    async def _root(self) -> None:
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def run(self, fn: Callable[..., Awaitable[Any]], *args: Any, timeout: float = RPC_TIMEOUT) -> Any:
        async def bounded() -> Any:
            with trio.fail_after(timeout):
                return await fn(*args)

        try:
            return trio.from_thread.run(bounded, trio_token=self._token)
        except AssertionError as exc:
            FAILURES.append(str(exc))  # seen even if Hypothesis's replay later reports Flaky
            raise

    def close(self) -> None:
        if self.thread.is_alive() and self._stop is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self.thread.join(30)
        assert not self.thread.is_alive(), "the fuzz loop did not stop: a task is stuck"
        if self.error is not None:
            raise self.error



def trio_cache_thread(thread: threading.Thread) -> bool:
    """Trio keeps idle worker threads for reuse (``trio.to_thread``): not a leak."""
    target = getattr(thread, "_target", None)
    return type(getattr(target, "__self__", None)).__name__ == "WorkerThread"


# ---- engines -----------------------------------------------------------------------------------


@dataclass
class Latency:
    """An ``on_step`` hook: a random latency before each fake step (seeded per example)."""

    rng: random.Random = field(default_factory=random.Random)
    max_s: float = 0.003

    async def __call__(self, step: FakeStep) -> None:
        await trio.sleep(self.rng.uniform(0, self.max_s))


@dataclass(frozen=True)
class EngineKind:
    """An engine a fuzzed worker serves: its name, how to create it (unloaded, with the
    example's latency hook) and its load spec."""

    name: str
    make: Callable[[Latency], ShardEngine]
    spec: Callable[[], LoadSpec]


def _fake(latency: Latency) -> ShardEngine:
    return FakeEngine(model=MODEL, script=FakeScript(on_step=latency))


FAKE = EngineKind("fake", _fake, lambda: FAKE_SPEC)


def _fake_batched(latency: Latency) -> ShardEngine:
    """The fake through the batching scheduler: sessions share ticks (of 8 rows, so a long
    prompt spans many) as on llama.cpp, and the random latency runs inside the ticks."""
    return FakeEngine(model=MODEL, script=FakeScript(on_step=latency, batched=True, tick_latency=0.001))


FAKE_BATCHED = EngineKind("fake-batched", _fake_batched, lambda: replace(FAKE_SPEC, n_batch=8))


def _llama_spec() -> LoadSpec:
    from shard.models import ensure_model

    return LoadSpec(model_path=ensure_model("tiny"), n_ctx=1024, max_sessions=4, n_threads=1)


def _llama(latency: Latency) -> ShardEngine:
    from shard.engine.llama import LlamaCppEngine

    return LlamaCppEngine()


LLAMA = EngineKind("llama", _llama, _llama_spec)
