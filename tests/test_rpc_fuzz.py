"""Deadline and cancellation fuzzing at the RPC layer: a hypothesis state machine drives real
``Session`` streams of a live worker over loopback with the Trio client.

The rules submit their coroutines to a Trio loop in a background thread (tests/rpc_fuzz_harness.py
says why); the model and the state machine's base are in tests/rpc_fuzz_model.py, the rules in
tests/rpc_fuzz_steps.py, tests/rpc_fuzz_streams.py and tests/rpc_fuzz_prefix.py. This file
composes them, checks the invariant and holds the tests.

Each example starts a worker (fake engine with random per-step latencies; a smaller run uses
the llama engine and the tiny model) and two session slots, each on its own connection. Rules
interleave open (fresh, resume with the right, a count-only or a wrong expectation), prefill,
decode, generate (awaited, or left running in the background), credit (tiny windows and extra
grants at random points), the out-of-band Cancel RPC, a Cancel that lands right after a step
is dispatched (the race of issue 8 item 3), Release, close (retain or not), half-close,
RST_STREAM (client cancel), an abrupt TCP close, call deadlines and step timeouts firing at
random points, and plain waits. Prefill, decode, generate and resent conversations draw their
sampling (penalties, logit_bias, min_p, a seeded temperature, one of a few grammars:
tests/rpc_fuzz_sampling.py); a rule sends a grammar that does not compile, another rewinds
into a grammar's output and prefills it again (tests/rpc_fuzz_grammar.py). The worker has a small prefix cache: conversations are resent
with a tail on fresh sessions, several live sessions fork one released prefix, rewinds cut into
it, and releases evict entries under pressure.

Checked after every rule: every call ended with a documented status for its cause; the
engine's sessions and KV cells match the model of what is live or retained (and the engine's
own KV bookkeeping matches its sessions); the worker runs exactly one stream task per live
slot; every result equals what the same history gives with the same sampling when computed
alone on a fresh engine without a cache; a grammar's choice is one its matcher allows after the
history (when the history from its start is within it); a broken grammar is refused
INVALID_ARGUMENT / INVALID_GRAMMAR and leaves the session as it was; no prefill takes from the cache more than a released history shares with it,
and a fresh session takes at least what it shares with the last release; the cache stays within
its budget; every sequence id is free, a session's or a cache entry's, exactly once. At the
end of each example: nothing leaks (sessions, KV cells, sequence ids, tasks, threads).

Planted-bug tests show each invariant catches its bug. Run longer with
``--hypothesis-profile=long`` (``SHARD_FUZZ_SECONDS``, default 600, bounds the run).
"""

from __future__ import annotations

import math
import os
import time

import pytest
import trio
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from hypothesis.stateful import initialize, invariant, run_state_machine_as_test

from conftest import LONG_EXAMPLES
from rpc_fuzz_harness import FAILURES, FAKE, FAKE_BATCHED, FAKE_SPEC, LLAMA, MODEL, EngineKind
from rpc_fuzz_model import SLOTS, FuzzWorld, SlotModel
from rpc_fuzz_grammar import SamplingRules
from shard.engine import base as engine_base
from shard.engine.base import Slot as EngineSlot
from shard.engine.fake import FakeEngine, FakeScript
from shard.engine.grammar import SessionGrammar
from shard.engine.prefix_cache import PrefixCache
from shard.rpc.registry import Registry
from shard.rpc.session import SessionCall, StreamEnd
from shard.rpc.session.context import StepContext


class RpcFuzz(SamplingRules):
    """The state machine: every rule, and the invariant checked after each; subclasses pick the
    engine and may plant bugs (see the tests)."""

    @initialize(seed=st.integers(0, 2**32 - 1))
    def seed_latencies(self, seed: int) -> None:
        self.latency.rng.seed(seed)

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def worker_matches_the_model(self) -> None:
        self.loop.run(self._check)

    async def _check(self) -> None:
        # The checks below read the worker with no checkpoint, so it cannot end a stream
        # meanwhile; but ending a stream at its deadline, or settling, may wait, and on a busy
        # machine another slot's deadline may pass then: again until a pass finds none near.
        while True:
            for slot in self._in("open", "stepping"):
                if slot.near_deadline():  # the worker ends the stream at its deadline
                    await self._end_at_deadline(slot)
            if await self._settle() and not self.deadline_near():
                break
        engine = self.engine
        assert engine is not None
        expected = {s.sid for s in self._in("open", "stepping", "retained")}
        assert self._engine_sids() == expected, f"engine sessions {self._engine_sids()}, model {expected}"
        registry = self.server.registry
        retained = {sid for sid in SLOTS if registry.retained(sid) is not None}
        assert retained == {s.sid for s in self._in("retained")}, f"retained {retained}"
        total = 0
        for sid in self._engine_sids():
            info = engine.session_info(sid)
            total += info.n_past
            slot = self.slots[sid]
            if slot.state == "stepping":
                continue
            held, n = list(info.tokens or []), len(slot.tokens)
            assert held[:n] == slot.tokens, f"{sid}: the engine holds other tokens than the client saw"
            if slot.exact and slot.state == "open":
                assert info.n_past == n, f"{sid}: the engine holds {info.n_past} positions, not {n}"
        metrics = engine.metrics()
        assert metrics.prefix_cache_tokens <= self.cache_tokens, (
            f"the cache holds {metrics.prefix_cache_tokens} tokens, over its budget of {self.cache_tokens}"
        )
        assert metrics.prefix_cache_entries <= self.cache_entries, metrics
        problems = self.sequence_id_problems()
        assert not problems, problems
        kv = metrics.kv_cells_used
        if metrics.operations_running == 0:  # a running step may hold cells it has not committed
            if isinstance(engine, FakeEngine):
                assert kv == total, f"{kv} KV cells for {total} held positions"
            elif total == 0:
                assert kv == 0, f"{kv} KV cells with no session"

    async def _end_at_deadline(self, slot: SlotModel) -> None:
        await trio.sleep_until(slot.deadline + 0.005)
        if slot.run is not None:
            await self._finish(slot)
        else:
            await self._end_stream(slot, "none", ambiguous=True)
        if slot.state in ("open", "stepping"):  # the step ended first: end it now
            await self._end_stream(slot, "none", ambiguous=True)
        RpcFuzz.stats["deadline"] += 1


# ---- the tests ---------------------------------------------------------------------------------

LONG = settings.default.max_examples >= LONG_EXAMPLES  # --hypothesis-profile=long


def _run(machine: type[RpcFuzz], max_examples: int, steps: int, *, shrink: bool = True) -> None:
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
    if shrink:
        phases.append(Phase.shrink)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            phases=phases,
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
        ),
    )


def _missing(machine: type[RpcFuzz]) -> list[str]:
    """The paths the run has not reached yet: each names what the fuzzer must have exercised."""
    stats = RpcFuzz.stats
    wanted = {
        "cache:hit": "no prefill took anything from the prefix cache",
        "cache:evicted": "the prefix cache never evicted an entry",
        "penalized": "no result was chosen with penalties, bias or min_p",
        "grammar:constrained": "no grammar constrained a choice",
        "grammar:refused": "no broken grammar was refused",
    }
    if machine.check_reference:  # (the reference tells whether they decided a token)
        wanted["penalized:decisive"] = "penalties or bias never decided a token"
    return [why for key, why in wanted.items() if stats[key] == 0]


# A short run whose random draws missed a path runs again (fresh draws) up to this many times, so
# coverage does not hang on one run's luck; a path no round reaches still fails the test.
COVERAGE_ROUNDS = 4


def _fuzz(machine: type[RpcFuzz], examples: int, steps: int, capsys: pytest.CaptureFixture[str]) -> None:
    RpcFuzz.stats.clear()
    started = time.monotonic()
    if LONG:
        budget = float(os.environ.get("SHARD_FUZZ_SECONDS", "600"))
        while time.monotonic() - started < budget:
            _run(machine, 50, steps)
    else:
        _run(machine, examples, steps)
        for _ in range(COVERAGE_ROUNDS - 1):
            if not _missing(machine):
                break
            _run(machine, examples, steps)
    with capsys.disabled():
        counts = dict(sorted(RpcFuzz.stats.items()))
        print(f"\nrpc fuzz [{machine.engine_kind.name}] {time.monotonic() - started:.1f}s: {counts}")
    assert RpcFuzz.stats["examples"] >= (1 if LONG else examples)
    missing = _missing(machine)
    assert not missing, missing


class FakeFuzz(RpcFuzz):
    engine_kind = FAKE


class BatchedFakeFuzz(RpcFuzz):
    engine_kind = FAKE_BATCHED


class OneEntryFuzz(FakeFuzz):
    """A cache of one short entry: a longer history is not kept, so a cache that ignores its
    budget shows at the first one (with two entries it takes two long histories released one
    after the other, which the short runs may not see)."""

    cache_tokens = 64


class LlamaFuzz(RpcFuzz):
    engine_kind = LLAMA
    # llama.cpp's batched prefill and step-by-step decode may differ in the last float bits,
    # so "the same session run alone" is checked on the fake engine, where it is exact.
    check_reference = False


def test_rpc_state_machine_fake_engine(capsys: pytest.CaptureFixture[str]) -> None:
    _fuzz(FakeFuzz, examples=60, steps=40, capsys=capsys)


def test_rpc_state_machine_batched_fake_engine(capsys: pytest.CaptureFixture[str]) -> None:
    _fuzz(BatchedFakeFuzz, examples=30, steps=40, capsys=capsys)


@pytest.mark.slow
def test_rpc_state_machine_llama_engine(capsys: pytest.CaptureFixture[str]) -> None:
    _fuzz(LlamaFuzz, examples=10, steps=25, capsys=capsys)


# ---- planted bugs: each invariant catches the bug it guards ------------------------------------


class NeverFreesKv(FakeEngine):
    """A fake whose release forgets the session but never frees its KV cells, nor those of a
    cache entry it lets go (with the cache, a release mostly hands its cells to an entry)."""

    async def _impl_truncate(self, slot: EngineSlot, keep: int) -> None:
        if keep == 0 and slot.session_id not in self._slots:
            await trio.lowlevel.checkpoint()
            return
        await super()._impl_truncate(slot, keep)

    async def _impl_forget_cells(self, seq_ids: list[int]) -> None:
        await trio.lowlevel.checkpoint()


class LeakyFuzz(RpcFuzz):
    engine_kind = EngineKind(
        "leaky-fake",
        lambda latency: NeverFreesKv(model=MODEL, script=FakeScript(on_step=latency)),
        lambda: FAKE_SPEC,
    )


def _ignore_cancel(self: SessionCall) -> bool:
    """A session handler that answers Cancel but never stops anything."""
    return self._cancel.active.value and not self._cancel._finishing  # noqa: SLF001


def _racy_cancel(self: SessionCall) -> bool:
    """The item-3 race: a Cancel finds only a step whose task already entered its scope."""
    scope = self._cancel._scope  # noqa: SLF001
    if scope is None or not self._cancel.active.value:  # noqa: SLF001
        return False
    scope.cancel()
    return True


def _finds(machine: type[RpcFuzz], *matches: str, examples: int = 60) -> None:
    """The planted bug makes an invariant fail, one whose message holds one of ``matches``
    (a bug may break more than one invariant; which one fires first depends on timing).
    The fuzzer runs in real time, so Hypothesis's final replay of the failing example may
    diverge and be reported as Flaky: the invariant's own message is also taken from
    ``FAILURES``, recorded when it was raised. A run whose draws (on a loaded machine: fewer
    operations in time) missed the bug runs again with fresh draws, up to ``COVERAGE_ROUNDS``."""
    FAILURES.clear()
    for _ in range(COVERAGE_ROUNDS):
        try:
            _run(machine, examples, 25, shrink=False)
        except (AssertionError, Flaky) as exc:
            text = str(exc) + "".join(str(e) for e in getattr(exc, "exceptions", ()))
            seen = [text, *FAILURES]
            assert any(m in t for m in matches for t in seen), (matches, seen)
            return
    pytest.fail(f"the fuzzer missed the planted bug in {COVERAGE_ROUNDS} runs of {examples} examples")


def test_fuzzer_finds_a_kv_leak() -> None:
    _finds(LeakyFuzz, "KV cells")


def test_fuzzer_finds_a_cache_over_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache that keeps every history whatever its token budget (its entry count still
    bounded by the sequence ids it has)."""
    insert = PrefixCache.insert

    def unbounded(self: PrefixCache, key: int, ids: list[int]) -> tuple[list[int], int]:
        budget, self.budget = self.budget, 10**9
        try:
            return insert(self, key, ids)
        finally:
            self.budget = budget

    monkeypatch.setattr(PrefixCache, "insert", unbounded)
    _finds(OneEntryFuzz, "over its budget", "tokens after stop")


def test_fuzzer_finds_a_handler_that_ignores_cancel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SessionCall, "cancel_step", _ignore_cancel)
    # Either invariant about Cancel stopping the running step catches it: the step goes on
    # after a Cancel, or a Cancel right after dispatch does not end it CANCELLED.
    _finds(FakeFuzz, "after Cancel", "Cancel right after dispatch")


def test_fuzzer_finds_the_cancel_race(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Cancel that only cancels the cancellable region the step is in, without remembering
    the request: it answers "not running" for a step just dispatched, or cancels a region that
    then ends without a checkpoint, answers yes, and the step runs on into its next region
    (seen once in a full run on a loaded machine: "the step went on for 11 positions after
    Cancel"); which fires first depends on timing."""
    monkeypatch.setattr(SessionCall, "cancel_step", _racy_cancel)
    _finds(FakeFuzz, "Cancel after dispatch", "positions after Cancel")


def test_fuzzer_finds_stale_positions_after_a_failed_rewind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The session layer keeps believing the positions it had before a failed rewind (the
    issue-14 desync): the worker reports positions the engine no longer holds."""
    monkeypatch.setattr(StepContext, "resync", lambda self: None)
    # It takes a rewind stopped after it began computing: found within 60 examples in about 9
    # of 10 runs, so it gets more (it stops at the first find).
    _finds(FakeFuzz, "a failed rewind left", "the engine holds", "n_past", examples=200)


def test_fuzzer_finds_a_grammar_that_misses_a_rewind(monkeypatch: pytest.MonkeyPatch) -> None:
    """A session's matcher that only ever moves forward: after a rewind into the grammar's
    output it is ahead of the history, and masks the choice for tokens the session no longer
    holds."""

    def forward_only(self: SessionGrammar, history: list[int], n_past: int) -> bool:
        rest = list(history[self.spec.start:n_past][len(self._consumed):])  # noqa: SLF001
        taken = self._matcher.try_consume_tokens(rest) if rest else 0  # noqa: SLF001
        self._consumed.extend(rest[:taken])  # noqa: SLF001
        return taken == len(rest) and not self._matcher.is_error()  # noqa: SLF001

    monkeypatch.setattr(SessionGrammar, "follow", forward_only)
    _finds(FakeFuzz, "run alone", "grammar", examples=400)


def test_fuzzer_finds_penalties_that_see_only_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A penalty window of the step's own input only: a decode's penalties miss the prompt and
    the tokens generated before it."""
    step_history = engine_base.step_history

    def own_input(slot: EngineSlot, plan: object, last_n: int) -> list[int] | None:
        ids = step_history(slot, plan, last_n)  # type: ignore[arg-type]
        return ids if ids is None else ids[-plan.n_new:]  # type: ignore[attr-defined]

    monkeypatch.setattr(engine_base, "step_history", own_input)
    _finds(FakeFuzz, "run alone", examples=400)


# ---- the model's own timing ---------------------------------------------------------------------


def test_a_cut_the_worker_notices_after_its_deadline_is_read_from_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection cut well before the stream's call deadline, that the worker notices only
    after it (a busy machine: seen in CI as "engine sessions {'b'}, model {'a', 'b'}"): the
    deadline ends the stream first and the session is released, not retained. The model must
    judge the race from when the stream ended, not from when it cut the connection. Planted
    here by a worker that never notices the lost connection, so its deadline always wins."""
    end = SessionCall.end

    def unnoticed(self: SessionCall, reason: StreamEnd) -> None:
        if reason is not StreamEnd.CONNECTION_LOST:
            end(self, reason)

    monkeypatch.setattr(SessionCall, "end", unnoticed)

    async def time_left(machine: RpcFuzz) -> float:
        return machine.slots["a"].deadline - trio.current_time()

    machine = FakeFuzz()
    try:
        machine.open("a", timeout=1.0, step_timeout=None, resume="right", credit=1)
        assert machine.slots["a"].state == "open"
        assert machine.loop.run(time_left, machine) > 0.1, "cut it well before the deadline"
        machine.cut_connection("a")
        machine.worker_matches_the_model()
        assert machine.slots["a"].state == "none", "the deadline released the session"
    finally:
        machine.teardown()


def test_a_deadline_that_passes_while_the_check_settles_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The invariant waits for the worker to settle; on a busy machine that wait may outlast an
    open slot's call deadline, and the worker releases that session meanwhile: the check must
    see the deadline before it compares the engine with the model. Planted by a settle that
    always waits past the slot's deadline."""
    settle = FuzzWorld._settle

    async def slow(self: FuzzWorld) -> bool:
        deadlines = [s.deadline for s in self._in("open", "stepping") if s.deadline != math.inf]
        if deadlines:
            await trio.sleep_until(max(deadlines) + 0.05)
        return await settle(self)

    async def time_left(machine: RpcFuzz) -> float:
        return machine.slots["a"].deadline - trio.current_time()

    machine = FakeFuzz()
    try:
        machine.open("a", timeout=1.0, step_timeout=None, resume="right", credit=1)
        assert machine.slots["a"].state == "open"
        assert machine.loop.run(time_left, machine) > 0.1, "check it well before the deadline"
        monkeypatch.setattr(FuzzWorld, "_settle", slow)
        machine.worker_matches_the_model()
        assert machine.slots["a"].state == "none", "the deadline released the session"
    finally:
        machine.teardown()


def test_a_release_that_reaches_the_worker_after_the_deadline_may_find_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Release sent well before the call deadline that reaches the worker only after the
    deadline ended the stream (a busy machine) finds nothing, and the model must allow it:
    judged when the answer came, not when it was sent. Planted by a worker that handles every
    Release of a live stream only once that stream has ended."""
    release = Registry.release

    async def late(self: Registry, session_id: str) -> bool:
        call = self.live(session_id)
        if call is not None:
            await call.done.wait()
        return await release(self, session_id)

    monkeypatch.setattr(Registry, "release", late)

    async def time_left(machine: RpcFuzz) -> float:
        return machine.slots["a"].deadline - trio.current_time()

    machine = FakeFuzz()
    try:
        machine.open("a", timeout=1.0, step_timeout=None, resume="right", credit=1)
        assert machine.loop.run(time_left, machine) > 0.1, "release it well before the deadline"
        machine.release("a")
        machine.worker_matches_the_model()
        assert machine.slots["a"].state == "none"
    finally:
        machine.teardown()
