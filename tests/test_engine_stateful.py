"""Hypothesis stateful test of the session lifecycle, on the fake and the llama.cpp engine.

hypothesis-trio is broken with current hypothesis, so a plain ``RuleBasedStateMachine`` drives
the engine through a Trio loop running in a background thread: every rule submits one coroutine
with ``trio.from_thread.run(..., trio_token=...)``. A small reference model predicts, for every
operation, either the exact resulting session state or the exact error type, following the
precedence documented in docs/engine.md. Greedy results are also remembered per token history:
the same history must always choose the same token, whatever reuse, rollback or cancellation
led to it. Each engine also runs with a prefix cache: then a prefill may copy the start of its
prompt from a released history (``cached_tokens``, never more than a released history shares
with it), the same histories must still choose the same tokens, rewinds into a prefix several
sessions took from one entry leave the others' cells alone, and the cache stays within its
budget of two entries (releases evict under pressure).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from shard.engine import (
    ContextExceeded,
    DecodeRequest,
    EngineCancelled,
    EngineError,
    IllegalTransition,
    InvalidInput,
    KvCacheFull,
    MtpRequest,
    PrefillRequest,
    SessionBusy,
    SessionExists,
    SessionState,
    ShardEngine,
    StepResult,
    TooManySessions,
    UnknownSession,
    UnsupportedFeature,
)
from shard.testing import EngineFactory, EngineOptions, fake_factory, llama_factory, start_op, wait_running

MAX_SESSIONS = 3
PER_SESSION = 48
OPTIONS = EngineOptions(n_ctx=MAX_SESSIONS * PER_SESSION, max_sessions=MAX_SESSIONS, n_batch=8)
CACHE_BUDGET = 2 * PER_SESSION  # two entries
NAMES = ("a", "b", "c", "d")
BAD_IDS = (-1, 10**6)

SETTINGS = settings(
    max_examples=50,
    stateful_step_count=20,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class EngineLoop:
    """One loaded engine living in a Trio loop on a background thread."""

    def __init__(self, factory: EngineFactory, options: EngineOptions) -> None:
        self.factory, self.options = factory, options
        self.engine: ShardEngine | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.error: BaseException | None = None
        self.greedy_seen: dict[tuple[int, ...], tuple[int, float]] = {}
        self.cached = factory.name.endswith("-cached")
        self.released: list[tuple[int, ...]] = []  # histories of released sessions, latest last
        #: Every history a release may have left in the cache (the engine lives across examples).
        self.ever_released: set[tuple[int, ...]] = set()
        self._ready = threading.Event()
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)

    async def _main(self) -> None:
        try:
            async with self.factory.open(self.options) as engine:
                self.engine = engine
                self._stop = trio.Event()
                self.token = trio.lowlevel.current_trio_token()
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:  # reported to the test thread, never lost
            self.error = exc
        finally:
            self._ready.set()

    def __enter__(self) -> EngineLoop:
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self._stop is not None
        trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
        self._thread.join()
        if self.error is not None:
            raise self.error

    def run(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return trio.from_thread.run(fn, *args, trio_token=self.token)

    def run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)


@dataclass
class Ref:
    """Reference model of one open session."""

    n_past: int
    tokens: tuple[int, ...]
    kv_budget: int


class Outcome:
    """What the engine did: a value or an engine error (plus 'cancelled by the caller')."""

    def __init__(self, value: Any = None, error: EngineError | None = None,
                 caller_cancelled: bool = False) -> None:
        self.value, self.error, self.caller_cancelled = value, error, caller_cancelled


async def capture(fn: Callable[..., Awaitable[Any]], *args: Any) -> Outcome:
    try:
        return Outcome(await fn(*args))
    except EngineError as exc:
        return Outcome(error=exc)


valid_tokens = st.lists(st.integers(3, 258), min_size=1, max_size=10).map(tuple)
bad_tokens = st.one_of(
    st.just(()),
    st.tuples(st.integers(3, 258), st.sampled_from(BAD_IDS)),
)
any_tokens = st.one_of(valid_tokens, valid_tokens, valid_tokens, bad_tokens)
# Names that were opened at some point (maybe released since): drawing mostly from them makes
# most operations hit a real session; the plain names keep never-opened sessions in play.
OPENED = Bundle("opened")
session_names = st.one_of(OPENED, OPENED, OPENED, st.sampled_from(NAMES))
positions = st.sampled_from(["append", "zero", "inner", "beyond"])
budgets = st.sampled_from([None, None, 6, 20, PER_SESSION, 0, PER_SESSION + 1])


def _shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    m = min(len(a), len(b))
    return next((i for i in range(m) if a[i] != b[i]), m)


class SessionLifecycle(RuleBasedStateMachine):
    loop: EngineLoop  # set on the per-engine subclass
    opened = OPENED

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[str, Ref] = {}
        self.engine = self.loop.engine
        assert self.engine is not None
        m = self.loop.run_sync(self.engine.metrics)
        assert (m.sessions_active, m.kv_cells_used) == (0, 0)

    # -- the reference model -----------------------------------------------------------------

    def _position(self, name: str, choice: str) -> int:
        ref = self.refs.get(name)
        n = ref.n_past if ref else 0
        return {"append": n, "zero": 0, "inner": n // 2, "beyond": n + 1}[choice]

    def expect_prefill(self, name: str, tokens: tuple[int, ...], position: int,
                       mtp: bool = False) -> type[EngineError] | None:
        ref = self.refs.get(name)
        if ref is None:
            return UnknownSession
        if mtp:
            return UnsupportedFeature
        if not 0 <= position <= ref.n_past:
            return InvalidInput
        if not tokens or any(t in BAD_IDS for t in tokens):
            return InvalidInput
        if position + len(tokens) > PER_SESSION:
            return ContextExceeded
        if position + len(tokens) > ref.kv_budget:
            return KvCacheFull
        return None

    def expect_decode(self, name: str, token: int) -> type[EngineError] | None:
        ref = self.refs.get(name)
        if ref is None:
            return UnknownSession
        if ref.n_past == 0:
            return IllegalTransition
        if token in BAD_IDS:
            return InvalidInput
        if ref.n_past + 1 > PER_SESSION:
            return ContextExceeded
        if ref.n_past + 1 > ref.kv_budget:
            return KvCacheFull
        return None

    def apply_prefill(self, name: str, tokens: tuple[int, ...], position: int,
                      result: StepResult) -> None:
        ref = self.refs[name]
        held = ref.tokens[position:]
        reused = 0
        while reused < min(len(held), len(tokens) - 1) and held[reused] == tokens[reused]:
            reused += 1
        ref.tokens = ref.tokens[:position] + tokens
        ref.n_past = len(ref.tokens)
        assert (result.n_past, result.reused_tokens) == (ref.n_past, reused)
        assert result.tokens_processed + result.cached_tokens == len(tokens) - reused
        assert self.loop.cached or result.cached_tokens == 0
        if result.cached_tokens:  # copied from a released history that shares that much
            history, start = ref.tokens, position + reused
            shared = max((_shared(h, history) for h in self.loop.ever_released), default=0)
            assert start + result.cached_tokens <= min(shared, len(history) - 1), (
                f"{result.cached_tokens} cached tokens from {start}: released histories share {shared}"
            )
        self.check_greedy(ref.tokens, result)

    def check_greedy(self, history: tuple[int, ...], result: StepResult) -> None:
        assert result.logits is not None
        token, logprob = result.logits.token_id, result.logits.logprob
        top = result.logits.top
        seen = self.loop.greedy_seen.get(history)
        if seen is None:
            # Only remember clear winners: a near-tie may legitimately flip with batch layout.
            if len(top) < 2 or top[0].logprob - top[1].logprob > 1e-2:
                self.loop.greedy_seen[history] = (token, logprob)
        else:
            assert token == seen[0], f"history {history} chose {token}, before {seen[0]}"
            assert math.isclose(logprob, seen[1], abs_tol=1e-3)

    def check(self, outcome: Outcome, expected: type[EngineError] | None) -> None:
        if expected is None:
            assert outcome.error is None, f"unexpected {outcome.error!r}"
        else:
            assert type(outcome.error) is expected, f"expected {expected.__name__}, got {outcome.error!r}"

    # -- rules -------------------------------------------------------------------------------

    @initialize(target=opened, prefilled=st.lists(valid_tokens, min_size=1, max_size=2))
    def start_with_open_sessions(self, prefilled: list[tuple[int, ...]]) -> Any:
        """Every run starts with one or two open (prefilled) sessions: swarm testing may
        disable the ``open`` rule, and a run without sessions only tests UnknownSession."""
        names = NAMES[: len(prefilled)]
        for name, tokens in zip(names, prefilled, strict=True):
            self.open(name, None)
            self.prefill(name, tokens, "zero", False)
        return multiple(*names)

    @rule(target=opened, name=st.sampled_from(NAMES), budget=budgets)
    def open(self, name: str, budget: int | None) -> Any:
        out = self.loop.run(capture, lambda: self.engine.open_session(name, kv_budget=budget))
        if name in self.refs:
            expected: type[EngineError] | None = SessionExists
        elif budget is not None and not 0 < budget <= PER_SESSION:
            expected = InvalidInput
        elif len(self.refs) >= MAX_SESSIONS:
            expected = TooManySessions
        else:
            expected = None
        self.check(out, expected)
        if expected is None:
            self.refs[name] = Ref(0, (), PER_SESSION if budget is None else budget)
            assert out.value.state is SessionState.IDLE and out.value.n_past == 0
            return name
        return multiple()

    @rule(target=opened, source=session_names, name=st.sampled_from(NAMES))
    def fork(self, source: str, name: str) -> Any:
        """A fork holds its source's history (the invariant checks both, and the cells; later
        steps check the fork's greedy choices against every other session's)."""
        out = self.loop.run(capture, lambda: self.engine.fork_session(source, name))
        ref = self.refs.get(source)
        if ref is None:
            expected: type[EngineError] | None = UnknownSession
        elif name in self.refs:
            expected = SessionExists
        elif len(self.refs) >= MAX_SESSIONS:
            expected = TooManySessions
        else:
            expected = None
        self.check(out, expected)
        if expected is None:
            assert ref is not None
            self.refs[name] = Ref(ref.n_past, ref.tokens, ref.kv_budget)
            return name
        return multiple()

    @rule(name=session_names, tokens=any_tokens, where=positions, mtp=st.booleans())
    def prefill(self, name: str, tokens: tuple[int, ...], where: str, mtp: bool) -> None:
        position = self._position(name, where)
        tokens = ((1,) + tokens[1:]) if position == 0 and tokens and tokens[0] not in BAD_IDS else tokens
        request = PrefillRequest(name, tokens=tokens, position=position,
                                 mtp=MtpRequest(1) if mtp and where == "inner" else None)
        out = self.loop.run(capture, self.engine.prefill, request)
        expected = self.expect_prefill(name, tokens, position, request.mtp is not None)
        self.check(out, expected)
        if expected is None:
            self.apply_prefill(name, tokens, position, out.value)

    @rule(name=session_names, where=positions, share=st.integers(1, PER_SESSION),
          extra=st.lists(st.integers(3, 258), max_size=4).map(tuple))
    def prefill_reusing_held_tokens(self, name: str, where: str, share: int,
                                    extra: tuple[int, ...]) -> None:
        """A prefill that starts with tokens the session already holds from ``position`` on:
        random prompts almost never do, so prefix reuse needs its own rule."""
        ref = self.refs.get(name)
        position = self._position(name, where)
        held = ref.tokens[position:] if ref is not None and position <= ref.n_past else ()
        self.prefill(name, held[:share] + extra, where, False)

    @rule(name=session_names, back=st.integers(1, 4), share=st.integers(1, PER_SESSION),
          extra=st.lists(st.integers(3, 258), max_size=4).map(tuple))
    def prefill_from_a_released_history(self, name: str, back: int, share: int,
                                        extra: tuple[int, ...]) -> None:
        """A prompt that starts with a released session's history (the prefix cache's case;
        without a cache, an ordinary prefill)."""
        released = self.loop.released
        if released:
            self.prefill(name, released[-min(back, len(released))][:share] + extra, "zero", False)

    @rule(name=session_names, token=st.one_of(st.integers(3, 258), st.sampled_from(BAD_IDS)))
    def decode(self, name: str, token: int) -> None:
        out = self.loop.run(capture, self.engine.decode, DecodeRequest(name, token=token))
        expected = self.expect_decode(name, token)
        self.check(out, expected)
        if expected is None:
            ref = self.refs[name]
            ref.tokens += (token,)
            ref.n_past += 1
            assert out.value.n_past == ref.n_past and out.value.tokens_processed == 1
            self.check_greedy(ref.tokens, out.value)

    @rule(name=session_names, n=st.integers(16, 40), where=st.sampled_from(["append", "inner"]),
          share=st.integers(0, 4), via=st.sampled_from(["engine.cancel", "cancel_scope", "release"]))
    def cancel_in_flight(self, name: str, n: int, where: str, share: int, via: str) -> None:
        """Start a prefill, cancel it while RUNNING: the session keeps exactly what it held
        before ``position + reused`` (nothing of the new input, nothing after it), or, if the
        cancel came before the engine changed any KV cell, exactly what it held."""
        ref = self.refs.get(name)
        position = self._position(name, where)
        held = ref.tokens[position:] if ref else ()
        tokens = held[:share] + tuple(3 + (i * 11 + n) % 256 for i in range(n))
        expected = self.expect_prefill(name, tokens, position)
        if expected is not None:  # cannot start: the synchronous error is checked instead
            out = self.loop.run(capture, self.engine.prefill,
                                PrefillRequest(name, tokens=tokens, position=position))
            self.check(out, expected)
            return

        async def scenario() -> tuple[Any, Any]:
            engine = self.engine
            async with trio.open_nursery() as nursery:
                op = start_op(nursery, engine.prefill,
                              PrefillRequest(name, tokens=tokens, position=position))
                await wait_running(engine, name)
                released = None
                if via == "engine.cancel":
                    assert engine.cancel(name) is True
                elif via == "cancel_scope":
                    op.scope.cancel()
                else:
                    released = await engine.release(name)
            return op, released

        op, released = self.loop.run(scenario)
        if via == "cancel_scope":
            assert op.caller_cancelled and op.error is None
        else:
            assert isinstance(op.error, EngineCancelled), op.error
        assert ref is not None
        if via == "release":
            assert released is True
            self.loop.ever_released.add(ref.tokens)  # (or the start it rolled back to)
            del self.refs[name]
            return
        reused = 0
        while reused < min(len(held), len(tokens) - 1) and held[reused] == tokens[reused]:
            reused += 1
        # Stopped before it changed the KV cells: as it was; after: truncated at ``keep``.
        info = self.loop.run_sync(self.engine.session_info, name)
        untouched, rolled_back = ref.tokens, ref.tokens[: position + reused]
        assert info.tokens in (untouched, rolled_back), (info.tokens, untouched, rolled_back)
        ref.tokens = info.tokens
        ref.n_past = len(ref.tokens)

    @rule(name=session_names, n=st.integers(12, 24))
    def second_operation_is_rejected(self, name: str, n: int) -> None:
        ref = self.refs.get(name)
        position = ref.n_past if ref else 0
        tokens = tuple(3 + (i * 5 + n) % 256 for i in range(n))
        if self.expect_prefill(name, tokens, position) is not None:
            return

        async def scenario() -> tuple[Any, list[Outcome]]:
            engine = self.engine
            async with trio.open_nursery() as nursery:
                op = start_op(nursery, engine.prefill,
                              PrefillRequest(name, tokens=tokens, position=position))
                await wait_running(engine, name)
                rejected = [
                    await capture(engine.decode, DecodeRequest(name, token=5)),
                    await capture(engine.prefill, PrefillRequest(name, tokens=(1, 5))),
                    await capture(engine.open_session, name),
                ]
                assert engine.cancel(name) is True
            return op, rejected

        op, rejected = self.loop.run(scenario)
        assert [type(o.error) for o in rejected] == [SessionBusy, SessionBusy, SessionExists]
        assert isinstance(op.error, EngineCancelled)

    @rule(name=session_names)
    def release(self, name: str) -> None:
        out = self.loop.run(capture, self.engine.release, name)
        assert out.error is None and out.value is (name in self.refs)
        ref = self.refs.pop(name, None)
        if ref is not None and ref.tokens:
            self.loop.released = [*self.loop.released[-3:], ref.tokens]
            self.loop.ever_released.add(ref.tokens)

    @rule(name=session_names)
    def cancel_idle(self, name: str) -> None:
        assert self.loop.run_sync(self.engine.cancel, name) is False

    @rule(name=session_names, rows=st.integers(0, 2))
    def hidden_states_on_a_first_shard(self, name: str, rows: int) -> None:
        hidden = np.full((rows, 4), np.nan, dtype=np.float32)
        out = self.loop.run(capture, self.engine.prefill, PrefillRequest(name, hidden_states=hidden))
        self.check(out, UnknownSession if name not in self.refs else InvalidInput)

    @rule(name=session_names)
    def session_info(self, name: str) -> None:
        def get() -> Any:
            try:
                return self.engine.session_info(name)
            except UnknownSession:
                return None

        info = self.loop.run_sync(get)
        ref = self.refs.get(name)
        assert (info is None) == (ref is None)
        if info is not None and ref is not None:
            assert (info.n_past, info.tokens, info.kv_budget) == (ref.n_past, ref.tokens, ref.kv_budget)

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def engine_matches_the_model(self) -> None:
        def snapshot() -> Any:
            return self.engine.sessions(), self.engine.metrics(), self.engine.health()

        sessions, metrics, health = self.loop.run_sync(snapshot)
        assert health.ready
        got = {s.session_id: (s.state, s.n_past, s.tokens, s.kv_budget) for s in sessions}
        want = {k: (SessionState.IDLE, r.n_past, r.tokens, r.kv_budget) for k, r in self.refs.items()}
        assert got == want
        assert metrics.sessions_active == len(self.refs)
        assert metrics.kv_cells_used == sum(r.n_past for r in self.refs.values())
        assert metrics.operations_running == 0
        assert metrics.prefix_cache_tokens <= (CACHE_BUDGET if self.loop.cached else 0)
        assert metrics.prefix_cache_entries <= 2

    def teardown(self) -> None:
        for name in list(self.refs):
            assert self.loop.run(self.engine.release, name) is True
            self.loop.ever_released.add(self.refs[name].tokens)
        m = self.loop.run_sync(self.engine.metrics)
        assert (m.sessions_active, m.kv_cells_used) == (0, 0)


def with_cache(factory: EngineFactory) -> EngineFactory:
    """``factory``'s engine with a prefix cache of ``CACHE_BUDGET`` tokens."""
    def load_spec(options: EngineOptions) -> Any:
        return dataclasses.replace(factory.load_spec(options), prefix_cache_tokens=CACHE_BUDGET)

    return dataclasses.replace(factory, name=f"{factory.name}-cached", load_spec=load_spec)


_FAKE, _LLAMA = fake_factory(), llama_factory("tiny", n_threads=1)


@pytest.fixture(scope="module", params=[_FAKE, with_cache(_FAKE), _LLAMA, with_cache(_LLAMA)],
                ids=str)
def engine_loop(request: pytest.FixtureRequest) -> Iterator[EngineLoop]:
    with EngineLoop(request.param, OPTIONS) as loop:
        yield loop


def test_session_lifecycle_state_machine(engine_loop: EngineLoop) -> None:
    machine = type("SessionLifecycleOn" + engine_loop.factory.name.title(), (SessionLifecycle,),
                   {"loop": engine_loop})
    run_state_machine_as_test(machine, settings=SETTINGS)
    assert len(engine_loop.greedy_seen) > 0
    m = engine_loop.run_sync(engine_loop.engine.metrics)  # type: ignore[union-attr]
    assert m.sessions_forked_total > 0
    if engine_loop.cached:
        assert m.prefix_cache_hits_total > 0 and m.prefix_cache_stored_total > 0
        assert m.prefix_cache_evictions_total > 0  # two entries: releases evict under pressure
