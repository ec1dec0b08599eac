"""Steps computed one ahead (shard.engine.lookahead) and the native thread that runs them.

The contract suite checks that look-ahead hints never change a result on any engine; here the
llama engine shows it really computes steps ahead, hands each to the claiming decode, drops
what nobody claims, steps aside for other work, and that a claim waiting for its step can be
cancelled. Timing is never asserted: the native thread is held by a call of the test's own
where an order must be forced.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import trio

from shard.engine import (
    DecodeRequest,
    EngineCancelled,
    EngineFailure,
    EngineState,
    LoadSpec,
    Lookahead,
    PrefillRequest,
    SamplingParams,
)
from shard.engine import llama as llama_module
from shard.engine.base import ComputePlan
from shard.engine.llama import LlamaCppEngine
from shard.engine.scheduler import Job
from shard.engine.native_thread import GIL_SWITCH_INTERVAL, NativeThread
from test_llama_engine import engine, tiny_path  # noqa: F401 - fixtures

PROMPT = (1, 415, 23, 301, 77, 590, 412)


async def settle(engine: LlamaCppEngine) -> None:
    """Wait until the native thread computed every step queued ahead. (One call is not enough:
    the thread runs queued calls before its own work.)"""
    with trio.fail_after(60):
        while True:
            await engine._native.run(lambda: None)
            if not engine._book.busy():
                return


async def greedy(engine: LlamaCppEngine, sid: str, n: int, *, hinted: bool) -> list[int]:
    res = await engine.prefill(PrefillRequest(sid, tokens=PROMPT, lookahead=Lookahead(n) if hinted else None))
    assert res.logits is not None
    out = [res.logits.token_id]
    for i in range(n):
        hint = Lookahead(n - i - 1) if hinted and n - i - 1 > 0 else None
        res = await engine.decode(DecodeRequest(sid, token=out[-1], lookahead=hint))
        assert res.logits is not None
        out.append(res.logits.token_id)
    return out


async def test_a_claimed_step_keeps_the_choice_made_beside_its_row(engine: LlamaCppEngine) -> None:
    """A claimed step's token and log-sum-exp were computed where the row was computed (the
    native thread, or the claim itself): the result is built from them, not from a second pass
    over the vocabulary on the event loop, and equals the one computed without look-ahead
    (log-probabilities included)."""
    made = []
    make = engine._make_result  # a spy on the real engine

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        made.append(args[8] if len(args) > 8 else kwargs.get("chosen"))
        return make(*args, **kwargs)

    await engine.open_session("plain")
    plain = await greedy(engine, "plain", 12, hinted=False)
    plain_lp = []
    await engine.release("plain")
    engine._make_result = spy
    await engine.open_session("a")
    res = await engine.prefill(PrefillRequest("a", tokens=PROMPT, lookahead=Lookahead(12)))
    out, lps = [res.logits.token_id], []
    for i in range(12):
        hint = Lookahead(12 - i - 1) if 12 - i - 1 > 0 else None
        res = await engine.decode(DecodeRequest("a", token=out[-1], lookahead=hint))
        out.append(res.logits.token_id)
        lps.append(res.logits.logprob)
    await settle(engine)
    assert out == plain
    assert engine.metrics().lookahead_used_total == 12
    # The prompt is no claim; the last step, with no hint, chose nothing ahead of its result.
    assert made[0] is None and made[-1] is None and all(c is not None for c in made[1:-1]), made
    engine._make_result = make
    await engine.open_session("b")
    res = await engine.prefill(PrefillRequest("b", tokens=PROMPT))
    for token in plain[:12]:
        res = await engine.decode(DecodeRequest("b", token=token))
        plain_lp.append(res.logits.logprob)
    assert lps == plain_lp


async def test_every_step_of_a_hinted_loop_was_computed_ahead(engine: LlamaCppEngine) -> None:
    await engine.open_session("plain")
    plain = await greedy(engine, "plain", 16, hinted=False)
    await engine.release("plain")
    assert engine.metrics().lookahead_steps_total == 0  # no hint, no look-ahead
    await engine.open_session("a")
    hinted = await greedy(engine, "a", 16, hinted=True)
    await settle(engine)
    m = engine.metrics()
    assert hinted == plain
    # Every decode claimed the step computed ahead for it; the last hint allowed none more.
    assert m.lookahead_used_total == 16 and m.lookahead_steps_total == 16
    assert (m.lookahead_dropped_total, m.lookahead_cells, m.kv_cells_used) == (0, 0, len(PROMPT) + 16)


async def test_an_unclaimed_step_is_scratch_until_dropped(engine: LlamaCppEngine) -> None:
    await engine.open_session("a")
    res = await engine.prefill(PrefillRequest("a", tokens=PROMPT, lookahead=Lookahead()))
    await settle(engine)
    m = engine.metrics()
    assert (m.lookahead_steps_total, m.lookahead_cells, m.kv_cells_used) == (1, 1, len(PROMPT))
    assert res.logits is not None
    await engine.decode(DecodeRequest("a", token=res.logits.token_id + 1))  # not the chosen one
    m = engine.metrics()
    assert (m.lookahead_dropped_total, m.lookahead_cells, m.kv_cells_used) == (1, 0, len(PROMPT) + 1)


@pytest.mark.parametrize("hint", ["stop token", "eog", "no steps", "context full"])
async def test_nothing_is_computed_ahead_when_no_step_can_follow(tiny_path: Path, hint: str) -> None:
    async with LlamaCppEngine() as engine:
        await engine.load(LoadSpec(model_path=tiny_path, n_ctx=1024, max_sessions=4, n_threads=1))
        budget = len(PROMPT) + 1 if hint == "context full" else None
        await engine.open_session("a", kv_budget=budget)
        first = await engine.prefill(PrefillRequest("a", tokens=PROMPT))
        assert first.logits is not None
        # The token the next step will choose: the same session decoding the same token.
        await engine.open_session("probe")
        await engine.prefill(PrefillRequest("probe", tokens=PROMPT))
        probe = await engine.decode(DecodeRequest("probe", token=first.logits.token_id))
        assert probe.logits is not None
        await engine.release("probe")
        lookahead = {
            "stop token": Lookahead(5, stop_tokens={probe.logits.token_id}),
            "eog": Lookahead(5, stop_at_eog=True),
            "no steps": Lookahead(0),
            "context full": Lookahead(5),
        }[hint]
        held = llama_module._held
        real = held.llama_vocab_is_eog
        if hint == "eog":  # the engine asks llama.cpp: make every token end generation
            held.llama_vocab_is_eog = lambda vocab, token: True
        try:
            await engine.decode(DecodeRequest("a", token=first.logits.token_id, lookahead=lookahead))
            await settle(engine)
        finally:
            held.llama_vocab_is_eog = real
        m = engine.metrics()
        assert (m.lookahead_steps_total, m.lookahead_cells) == (0, 0)


async def test_a_claim_waiting_for_its_step_can_be_cancelled(engine: LlamaCppEngine) -> None:
    """The step computed ahead cannot run while the native thread is held: the decode that
    claims it waits, is cancelled, leaves the session as it was, and the step (computed once the
    thread is free) still serves the next decode of that token. The cancelled claim gave the
    step back: the thread chains no step after it for the hint the cancelled decode carried."""
    await engine.open_session("a")
    await engine.open_session("ref")
    res = await engine.prefill(PrefillRequest("a", tokens=PROMPT))
    assert res.logits is not None
    token = res.logits.token_id
    release = threading.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine._native.run, release.wait)  # holds the thread
        await trio.sleep(0)
        # Queue a step ahead by hand, as a finished hinted step would.
        engine._book.propose(engine._slots["a"].seq_id, len(PROMPT), token)
        with trio.CancelScope() as scope:
            async def cancel_when_running() -> None:
                while engine.session_info("a").state.value != "running":
                    await trio.lowlevel.checkpoint()
                for _ in range(10):
                    await trio.lowlevel.checkpoint()
                scope.cancel()

            nursery.start_soon(cancel_when_running)
            await engine.decode(DecodeRequest("a", token=token, lookahead=Lookahead(5)))
        assert scope.cancelled_caught
        info = engine.session_info("a")
        assert info.n_past == len(PROMPT) and info.state.value == "idle"
        release.set()
    await settle(engine)
    m = engine.metrics()
    assert (m.lookahead_steps_total, m.lookahead_cells) == (1, 1)  # computed, not claimed
    got = await engine.decode(DecodeRequest("a", token=token))
    await engine.prefill(PrefillRequest("ref", tokens=PROMPT))
    ref = await engine.decode(DecodeRequest("ref", token=token))
    assert got.logits is not None and ref.logits is not None
    assert got.logits.token_id == ref.logits.token_id and got.n_past == ref.n_past
    m = engine.metrics()
    assert (m.lookahead_used_total, m.lookahead_cells) == (1, 0)
    assert engine.metrics().kv_cells_used == 2 * (len(PROMPT) + 1)


async def test_lookahead_steps_aside_for_other_work(engine: LlamaCppEngine) -> None:
    """A step queued ahead is dropped when another session's step waits for a tick: its claim
    then computes it with the others (the planner's batching and deadlines apply to it). The
    waiting step is put in the scheduler's queue by hand, so the thread's decision does not
    depend on timing."""
    await engine.open_session("a")
    await engine.open_session("b")
    res = await engine.prefill(PrefillRequest("a", tokens=PROMPT))
    assert res.logits is not None
    release = threading.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine._native.run, release.wait)  # nothing runs until the job waits
        await trio.sleep(0)
        engine._book.propose(engine._slots["a"].seq_id, len(PROMPT), res.logits.token_id)
        slot_b = engine._slots["b"]
        plan = ComputePlan(0, PROMPT, None)
        waiting = Job(slot_b, plan, engine._scheduler.new_step(slot_b, plan), trio.current_time())
        engine._scheduler._pending.append(waiting)
        release.set()
    try:
        with trio.fail_after(60):
            while engine._book.busy():  # the thread looks for work of its own after each call
                await engine._native.run(lambda: None)
    finally:
        engine._scheduler._pending.remove(waiting)
    m = engine.metrics()
    assert m.lookahead_steps_total == 0 and m.lookahead_cells == 0 and not engine._book.busy()
    step = await engine.decode(DecodeRequest("a", token=res.logits.token_id))  # computed as usual
    assert step.n_past == len(PROMPT) + 1 and engine.metrics().kv_cells_used == len(PROMPT) + 1


async def test_steps_computed_ahead_take_turns_under_a_one_session_tick(tiny_path: Path) -> None:
    """Issue 33, finding 10: with ``max_batch_sessions`` 1, two generating sessions alternate.
    A session that claims its step while it runs has its next one queued at once; taken in the
    book's order, it won every look-ahead tick and its neighbour waited for its whole generation
    (measured before: 274 of the first session's tokens in a row). Counted in steps, not time."""
    async with LlamaCppEngine() as eng:
        await eng.load(LoadSpec(model_path=tiny_path, n_ctx=1024, max_sessions=2, n_threads=1,
                                max_batch_sessions=1))
        order: list[str] = []
        second = trio.Event()

        async def generate(sid: str) -> None:
            if sid == "b":
                await second.wait()
            await eng.open_session(sid)
            res = await eng.prefill(PrefillRequest(sid, tokens=PROMPT, lookahead=Lookahead(200)))
            for i in range(120):
                assert res.logits is not None
                res = await eng.decode(DecodeRequest(sid, token=res.logits.token_id, lookahead=Lookahead(200)))
                order.append(sid)
                if len(order) == 10:
                    second.set()

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(generate, "a")
                nursery.start_soon(generate, "b")
        both = "".join(order)
        both = both[both.index("b"):both.rindex("a")]  # while both generate (a ends first)
        longest = max(len(run) for part in (both.split("a"), both.split("b")) for run in part)
        assert longest <= 4, both  # generous: they alternate step by step
        assert eng.metrics().lookahead_used_total > 100  # the steps were still computed ahead


async def test_sampled_generation_is_computed_ahead_with_its_own_sampler(engine: LlamaCppEngine) -> None:
    params = SamplingParams(temperature=0.9, top_k=40, seed=7)
    outs = []
    for sid, hinted in (("plain", False), ("hinted", True)):
        await engine.open_session(sid)
        res = await engine.prefill(PrefillRequest(sid, tokens=PROMPT, sampling=params))
        assert res.logits is not None
        toks = [res.logits.token_id]
        for _ in range(12):
            res = await engine.decode(DecodeRequest(
                sid, token=toks[-1], sampling=params, lookahead=Lookahead(4) if hinted else None))
            assert res.logits is not None
            toks.append(res.logits.token_id)
        outs.append(toks)
        await engine.release(sid)
    assert outs[0] == outs[1]
    assert engine.metrics().lookahead_used_total >= 11  # the first hinted decode had no step ahead


# ---- the native thread ---------------------------------------------------------------------


async def test_native_thread_runs_calls_in_order_in_one_thread() -> None:
    idents: list[int] = []
    worker = NativeThread("test-native")
    worker.start()
    try:
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(worker.run, lambda i=i: idents.append((i, threading.get_ident())))
                await trio.sleep(0)
        assert [i for i, _ in idents] == list(range(20))
        assert len({t for _, t in idents}) == 1 and idents[0][1] != threading.get_ident()
        with pytest.raises(ZeroDivisionError):
            await worker.run(lambda: 1 / 0)
        assert await worker.run(lambda: 42) == 42  # an exception does not stop the thread
        assert sys.getswitchinterval() <= GIL_SWITCH_INTERVAL
    finally:
        await worker.aclose()
    assert not worker.running
    with pytest.raises(RuntimeError):
        await worker.run(lambda: None)


async def test_a_cancelled_caller_still_waits_for_its_native_call() -> None:
    worker = NativeThread("test-native")
    worker.start()
    started, release, finished = threading.Event(), threading.Event(), []

    def slow() -> None:
        started.set()
        release.wait()
        finished.append(True)

    try:
        with trio.move_on_after(0.05) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(worker.run, slow)
                await trio.to_thread.run_sync(started.wait)
                nursery.start_soon(trio.to_thread.run_sync, release.set)  # after the deadline
        assert finished == [True]  # run() returned only once the call had finished
        assert scope.cancelled_caught or scope.deadline != float("inf")
    finally:
        release.set()
        await worker.aclose()


async def test_background_work_runs_between_calls_and_on_wake() -> None:
    pending: list[int] = []
    done: list[int] = []

    def background() -> bool:
        if not pending:
            return False
        done.append(pending.pop())
        return True

    worker = NativeThread("test-native", background=background)
    worker.start()
    try:
        pending.append(1)
        await worker.run(lambda: None)  # background is offered after every call
        await worker.run(lambda: None)
        assert done == [1]
        pending.append(2)
        worker.wake()
        with trio.fail_after(10):
            while done != [1, 2]:
                await trio.sleep(0.001)
    finally:
        await worker.aclose()


async def test_a_failure_of_the_background_work_fails_the_waiting_calls_instead_of_hanging_them() -> None:
    """Issue 33, finding 3: the background work raises while a call waits behind it. The call
    (shielded: no deadline could end it) fails with EngineFailure, and so does every later one;
    the owner is told; aclose returns."""
    gate, running = threading.Event(), threading.Event()

    def background() -> bool:
        running.set()
        gate.wait(10)
        raise ValueError("a bug in the background work")

    told: list[str] = []
    worker = NativeThread("test-native", background=background, on_failure=told.append)
    worker.start()
    try:
        worker.wake()
        with trio.fail_after(10):  # a hang is a failure, not a slow test
            while not running.is_set():  # the background work runs: a call now waits for it
                await trio.sleep(0.001)
            async with trio.open_nursery() as nursery:
                errors: list[BaseException] = []

                async def call() -> None:
                    try:
                        await worker.run(lambda: "never")
                    except EngineFailure as exc:
                        errors.append(exc)

                nursery.start_soon(call)
                await trio.sleep(0.05)  # the call is queued behind the background work
                gate.set()
            assert len(errors) == 1 and "ValueError in its background work" in str(errors[0])
            with pytest.raises(EngineFailure):
                await worker.run(lambda: None)
            while not told:
                await trio.sleep(0.001)
        assert "ValueError" in told[0]
    finally:
        gate.set()
        with trio.fail_after(10):
            await worker.aclose()


async def test_a_failed_native_thread_fails_the_llama_engine(tiny_path: Path) -> None:
    """Issue 33, finding 3, on the engine: health turns FAILED with the reason, a step waiting
    behind the failed work and every later one fail with EngineFailure, close completes."""
    async with LlamaCppEngine() as eng:
        await eng.load(LoadSpec(model_path=tiny_path, n_ctx=512, max_sessions=2, n_threads=1))
        await eng.open_session("s")
        gate, running = threading.Event(), threading.Event()

        def broken() -> bool:
            running.set()
            gate.wait(10)
            raise RuntimeError("planted fault")

        eng._native._background = broken  # noqa: SLF001 - the planted fault
        eng._native.wake()  # noqa: SLF001
        with trio.fail_after(20):
            while not running.is_set():
                await trio.sleep(0.001)
            async with trio.open_nursery() as nursery:
                failed: list[BaseException] = []

                async def step() -> None:
                    try:
                        await eng.prefill(PrefillRequest("s", tokens=(1, 5, 6)))
                    except EngineFailure as exc:
                        failed.append(exc)

                nursery.start_soon(step)
                await trio.sleep(0.05)
                gate.set()
            assert len(failed) == 1
            while eng.health().state is not EngineState.FAILED:
                await trio.sleep(0.001)
        assert "background work" in eng.health().detail
        with pytest.raises(EngineFailure):
            await eng.prefill(PrefillRequest("s", tokens=(1, 5, 6)))
        gate.set()


async def test_the_llama_engine_closes_while_its_failed_thread_is_still_ending(tiny_path: Path) -> None:
    """CI found a race: the engine turned FAILED while the failed thread had not yet ended, and
    close then queued its call to that thread and raised EngineFailure instead of closing. Here
    the thread lingers after its failure until close has begun, so close always meets it
    alive."""
    async with LlamaCppEngine() as eng:
        await eng.load(LoadSpec(model_path=tiny_path, n_ctx=512, max_sessions=2, n_threads=1))
        await eng.open_session("s")
        native = eng._native  # noqa: SLF001 - the planted fault
        fail, closing = native._fail, threading.Event()  # noqa: SLF001

        def broken() -> bool:
            raise RuntimeError("planted fault")

        def fail_and_linger(exc: BaseException) -> None:
            fail(exc)
            closing.wait(30)  # still ending when close comes (set as the engine closes)

        native._fail = fail_and_linger  # noqa: SLF001
        native._background = broken  # noqa: SLF001
        native.wake()
        with trio.fail_after(20):
            while eng.health().state is not EngineState.FAILED:
                await trio.sleep(0.001)
        assert native.running and native.failure is not None  # the window the race needs
        close = eng._impl_close  # noqa: SLF001

        async def close_then_release() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(close)
                await trio.sleep(0.05)  # close has met the thread alive and waits for it
                closing.set()

        eng._impl_close = close_then_release  # noqa: SLF001
    assert not native.running


async def test_a_tick_of_one_row_steps_gives_each_session_its_tokens_alone(tiny_path: Path) -> None:
    """Two sessions decoding together, in the scheduler's ticks and in look-ahead ticks: every
    token equals the session's alone."""
    async with LlamaCppEngine() as engine:
        await engine.load(LoadSpec(model_path=tiny_path, n_ctx=1024, max_sessions=4, n_threads=1))
        alone = {}
        for sid in ("x", "y"):
            await engine.open_session(sid)
            alone[sid] = await greedy(engine, sid, 10, hinted=False)
            await engine.release(sid)
        together: dict[str, list[int]] = {}

        async def run(sid: str, hinted: bool) -> None:
            await engine.open_session(sid)
            together[sid] = await greedy(engine, sid, 10, hinted=hinted)

        for hinted in (False, True):  # ticks of the scheduler, then look-ahead ticks
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "x", hinted)
                nursery.start_soon(run, "y", hinted)
            assert together == {"x": alone["x"], "y": alone["y"]}
            for sid in ("x", "y"):
                await engine.release(sid)
