"""Session guarantees that must hold under batching, rewinds and hostile peers.

* A failed rewind (a Prefill at an earlier position stopped by Cancel, its step timeout or its
  call deadline) never leaves the worker reporting positions the engine no longer holds, and a
  step whose Cancel arrived first changes nothing.
* Prompts never starve behind decodes that keep resubmitting, whatever ``max_batch_sessions``.
* A decode with a step timeout is not put into a tick that another session's prompt makes too
  long; a stopped step waits for at most the tick it is in.
* One huge request cannot stall the worker: sizes are checked before any work, tokenization
  runs off the event loop.

Batching cases use the fake engine in batched mode with scripted tick costs under
``autojump_clock``: times are virtual, so the bounds below are exact tick arithmetic.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import trio
import trio.testing

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import MODEL, driver, loaded, running_registry
from shard.engine import DecodeRequest, LoadSpec, PrefillRequest, StepTimeout
from shard.engine.fake import FakeEngine, FakeScript, FakeStep
from shard.v1 import shard_pb2 as pb

R = pb.CacheResult
HISTORY = [1, *(3 + (i * 7) % 200 for i in range(99))]  # 100 positions
REWRITE = [3 + (i * 13) % 200 for i in range(150)]  # a different continuation from 60


class HoldAt:
    """``on_step`` hook: once armed, hold the step of ``position`` of ``session`` until
    released (positions before it were computed: the prefill has changed the KV cells)."""

    def __init__(self, session: str, position: int) -> None:
        self.session, self.position = session, position
        self.armed = False
        self.reached = trio.Event()
        self.go = trio.Event()

    async def __call__(self, step: FakeStep) -> None:
        if self.armed and step.session_id == self.session and step.position == self.position and not self.go.is_set():
            self.reached.set()
            await self.go.wait()


async def _reference_logits(history: list[int], token: int) -> list[float]:
    """Top logprobs of ``token`` after ``history`` on a fresh fake engine (the same model)."""
    async with FakeEngine(model=MODEL) as ref:
        await ref.load(LoadSpec(n_ctx=1024, max_sessions=4))
        await ref.open_session("r")
        await ref.prefill(PrefillRequest("r", tokens=tuple(history)))
        step = await ref.decode(DecodeRequest("r", token=token))
        await ref.release("r")
        assert step.logits is not None
        return [t.logprob for t in step.logits.top]


async def _after_failed_rewind(d, engine) -> None:  # noqa: ANN001 - harness types
    """The session holds 60 positions: Usage said so, the next decode continues at 60 with the
    logits of a 60-position history, and a count-only resume of 100 is PARTIAL, not HIT."""
    assert engine.session_info("s1").n_past == 60
    await d.send(decode=pb.Decode(token=42, top_logprobs=5))
    (step,), err, usage = await d.until_usage()
    assert err is None
    assert (step.start_position, step.n_past, usage.n_past) == (60, 61, 61)
    want = await _reference_logits(HISTORY[:60], 42)
    assert np.allclose([t.logprob for t in step.logits.top], want, atol=1e-6)


async def test_a_cancelled_rewind_reports_what_the_session_holds() -> None:
    """Prefill 100, rewrite from 60 with 150 tokens, Cancel once the rewrite computed a few
    positions: the engine holds 60 and so does everything the worker reports (it used to
    report 100 and serve a 60-position session as if it held 100)."""
    hold = HoldAt("s1", 65)
    engine = FakeEngine(model=MODEL, script=FakeScript(on_step=hold))
    async with loaded(engine), running_registry(engine) as reg:
        async with driver(reg) as d:
            await d.open()
            await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=HISTORY)))
            _, err, usage = await d.until_usage()
            assert err is None and usage.n_past == 100
            hold.armed = True
            await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=REWRITE), position=pb.Position(value=60)))
            await hold.reached.wait()
            assert d.call.cancel_step()
            hold.go.set()
            steps, err, usage = await d.until_usage()
            assert steps == [] and err is not None and err.code == pb.ERROR_CODE_CANCELLED
            assert usage.n_past == 60
            await _after_failed_rewind(d, engine)
            await d.send(close=pb.CloseSession(retain=True))
            closed = await d.recv_kind("closed")
            assert closed.kv_retained
        async with driver(reg) as d:
            opened = await d.open(cache=pb.CacheExpectation(n_tokens=100))
            assert opened.cache.outcome == R.OUTCOME_PARTIAL and opened.cache.tokens_held == 61
            await d.send(close=pb.CloseSession())
            await d.recv_kind("closed")


async def test_a_rewind_stopped_by_its_step_timeout_reports_what_the_session_holds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = FakeEngine(model=MODEL, script=FakeScript(step_latency=0.02))
    async with loaded(engine), running_registry(engine) as reg, driver(reg) as d:
        await d.open(step_timeout_ms=2500)
        await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=HISTORY)))  # 2 s: fits
        _, err, usage = await d.until_usage()
        assert err is None and usage.n_past == 100
        await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=REWRITE), position=pb.Position(value=60)))
        steps, err, usage = await d.until_usage()  # 3 s of work, timed out after 2.5 s
        assert steps == [] and err is not None and err.reason == "STEP_TIMEOUT"
        assert usage.n_past == 60
        await _after_failed_rewind(d, engine)


async def test_a_step_whose_cancel_arrived_first_changes_nothing() -> None:
    """A Cancel that lands between the dispatch of a rewinding prefill and its engine call
    stops it before it touches the KV cells: the session still holds all 100 positions."""
    engine = FakeEngine(model=MODEL)
    async with loaded(engine), running_registry(engine) as reg, driver(reg) as d:
        await d.open()
        await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=HISTORY)))
        await d.until_usage()
        steps_before = engine.metrics().steps_total
        await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=REWRITE), position=pb.Position(value=60)))
        with trio.fail_after(10):  # the request was read and dispatched, its task not yet run
            await d.call._cancel.active.wait_value(True)  # noqa: SLF001 - the race under test
        assert d.call.cancel_step()
        steps, err, usage = await d.until_usage()
        assert steps == [] and err.code == pb.ERROR_CODE_CANCELLED and usage.n_past == 100
        assert engine.metrics().steps_total == steps_before
        assert engine.session_info("s1").tokens == tuple(HISTORY)


async def test_a_call_deadline_during_a_rewind_leaves_nothing_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = FakeEngine(model=MODEL, script=FakeScript(step_latency=0.02))
    async with loaded(engine), running_registry(engine) as reg:
        async with driver(reg, deadline=trio.current_time() + 3) as d:  # 2 s + 3 s of work
            await d.open()
            await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=HISTORY)))
            await d.until_usage()
            await d.send(prefill=pb.Prefill(tokens=pb.TokenIds(ids=REWRITE), position=pb.Position(value=60)))
            await d.finished()
            assert d.call.error is not None and d.call.error.code.name == "DEADLINE_EXCEEDED"
        assert engine.sessions() == () and engine.metrics().kv_cells_used == 0


async def test_v1_0_sessions_get_no_usage_n_past() -> None:
    """``Usage.n_past`` is a v1.1 field: a session opened with 1.0 sees the bytes it always saw."""
    engine = FakeEngine(model=MODEL)
    async with loaded(engine), running_registry(engine) as reg, driver(reg) as d:
        v10 = pb.ProtocolVersion(major=1, minor=0)
        await d.send_raw(pb.SessionRequest(version=v10, open=pb.OpenSession(session_id="s1")))
        opened = await d.recv_kind("opened")
        assert (opened.version.major, opened.version.minor) == (1, 0)
        await d.send_raw(pb.SessionRequest(version=v10, prefill=pb.Prefill(tokens=pb.TokenIds(ids=HISTORY[:5]))))
        _, err, usage = await d.until_usage()
        assert err is None
        assert usage.SerializeToString() == pb.Usage(prompt_tokens=5).SerializeToString()


# ---- batching: starvation, step deadlines, cancel bounds (fake engine, scripted ticks) -------

TICK, ROW = 0.01, 0.001  # a tick costs 10 ms plus 1 ms per row


def _batched(*, batch_tokens: int = 512, max_batch_sessions: int | None = None, on_step=None) -> tuple[FakeEngine, LoadSpec]:  # noqa: ANN001
    engine = FakeEngine(
        model=MODEL, script=FakeScript(batched=True, tick_latency=TICK, row_latency=ROW, on_step=on_step)
    )
    spec = LoadSpec(n_ctx=8 * 2048, max_sessions=8, n_batch=512, batch_tokens=batch_tokens,
                    max_batch_sessions=max_batch_sessions)
    return engine, spec


async def _decode_loop(engine: FakeEngine, sid: str, n: int, log: list[tuple[str, float]], **req) -> None:  # noqa: ANN003
    await engine.open_session(sid)
    r = await engine.prefill(PrefillRequest(sid, tokens=(1, 5, 6)))
    for _ in range(n):
        r = await engine.decode(DecodeRequest(sid, token=r.logits.token_id, **req))
        log.append((sid, trio.current_time()))


@pytest.mark.parametrize("max_batch_sessions, n_decoders", [(1, 1), (2, 4)])
async def test_a_prompt_is_not_starved_by_resubmitting_decodes(
    autojump_clock: trio.testing.MockClock, max_batch_sessions: int, n_decoders: int
) -> None:
    """With ``--max-batch-sessions`` below the number of ready sessions, decodes that resubmit
    after every tick used to take every slot: a prompt waited for all 400 tokens of the others
    (4.3 s, and 24.3 s with 2 slots and 4 decoders, on the bench model). Now it waits its turn:
    its first token comes after a few ticks while the others still have most of theirs left."""
    engine, spec = _batched(max_batch_sessions=max_batch_sessions)
    log: list[tuple[str, float]] = []
    async with engine:
        await engine.load(spec)
        async with trio.open_nursery() as nursery:
            for i in range(n_decoders):
                nursery.start_soon(_decode_loop, engine, f"d{i}", 400, log)
            await trio.sleep(0.2)  # the decodes are running
            await engine.open_session("p")
            await engine.prefill(PrefillRequest("p", tokens=tuple(range(3, 23))))
            decoded_meanwhile = len(log)
        # Round robin over n_decoders + 1 sessions in slots of max_batch_sessions: a few ticks.
        assert decoded_meanwhile - sum(1 for _, t in log if t <= 0.2) <= 4 * (n_decoders + 1)
        assert len(log) == 400 * n_decoders
        for sid in ["p", *(f"d{i}" for i in range(n_decoders))]:
            await engine.release(sid)


@pytest.mark.parametrize("groups", [[1, 1, 2, 2, 3, 3], [0] * 6])
async def test_sessions_in_batch_groups_never_share_a_tick(
    autojump_clock: trio.testing.MockClock, groups: list[int]
) -> None:
    """Six sessions decoding at once, in three batch groups of two (a pipeline's micro-batches):
    every tick holds one group's sessions, and groups take turns; the same sessions without
    groups share ticks (the rows of one tick run at one virtual time)."""
    rows: list[tuple[float, str]] = []
    engine, spec = _batched(on_step=lambda step: rows.append((trio.current_time(), step.session_id)))
    async with engine:
        await engine.load(spec)
        for i, group in enumerate(groups):
            await engine.open_session(f"s{i}", batch_group=group)

        async def run(i: int) -> None:
            r = await engine.prefill(PrefillRequest(f"s{i}", tokens=(1, 5, 6)))
            for _ in range(12):
                r = await engine.decode(DecodeRequest(f"s{i}", token=r.logits.token_id))

        async with trio.open_nursery() as nursery:
            for i in range(len(groups)):
                nursery.start_soon(run, i)
        ticks: dict[float, set[int]] = {}
        for at, sid in rows:
            ticks.setdefault(at, set()).add(groups[int(sid[1:])])
        if groups[0]:
            assert all(len(g) == 1 for g in ticks.values()), "a tick mixed batch groups"
            order = [next(iter(g)) for _, g in sorted(ticks.items())]
            assert max(len(list(run)) for _, run in itertools.groupby(order)) <= 2  # turns
        else:
            assert max(len(g) for g in ticks.values()) == 1  # (one group: 0)
            assert len(ticks) < len(rows)  # shared ticks
        for i in range(len(groups)):
            await engine.release(f"s{i}")


@pytest.mark.parametrize("think", [0.0, 0.05])
async def test_a_decode_with_a_step_timeout_is_not_held_by_another_sessions_prompt(
    autojump_clock: trio.testing.MockClock, think: float
) -> None:
    """While one session prefills 1,500 tokens in 512-row chunks (0.5 s ticks), every decode of
    another session with a 300 ms step timeout used to time out: the prompt's ticks held it.
    Now the ticks it shares are cut to fit its timeout, and so are the ticks that start while
    it is between two steps (``think`` seconds: a client's round trip), so each decode ends in
    time."""
    engine, spec = _batched()
    log: list[tuple[str, float]] = []
    starts: list[float] = []
    async with engine:
        await engine.load(spec)
        await engine.open_session("d")
        # Every step of "d" has the timeout (as every step of a stream opened with one).
        r = await engine.prefill(PrefillRequest("d", tokens=(1, 5, 6), step_timeout=0.3))
        token = r.logits.token_id
        await engine.open_session("p")
        timeouts = 0
        async with trio.open_nursery() as nursery:
            done = trio.Event()

            async def long_prompt() -> None:
                await engine.prefill(PrefillRequest("p", tokens=tuple(3 + i % 200 for i in range(1500))))
                done.set()

            nursery.start_soon(long_prompt)
            await trio.sleep(0.001)
            while not done.is_set():
                await trio.sleep(think)
                starts.append(trio.current_time())
                try:
                    r = await engine.decode(DecodeRequest("d", token=token, step_timeout=0.3))
                    token = r.logits.token_id
                    log.append(("d", trio.current_time()))
                except StepTimeout:
                    timeouts += 1
        assert timeouts == 0 and len(log) >= 5
        # Each decode ended within its timeout (exact here: the cost model learns the script).
        assert all(end - start <= 0.3 for start, (_, end) in zip(starts, log, strict=False))
        assert engine.session_info("p").n_past == 1500
        await engine.release("d")
        await engine.release("p")


async def test_a_result_computed_in_time_is_not_thrown_away(autojump_clock: trio.testing.MockClock) -> None:
    """A decode whose timeout passes while its tick computes it gets its result (the tick was
    chosen to fit; throwing the result away would only make the next step redo it)."""
    engine = FakeEngine(model=MODEL, script=FakeScript(batched=True, tick_latency=0.05))
    async with engine:
        await engine.load(LoadSpec(n_ctx=1024, max_sessions=4))
        await engine.open_session("s")
        r = await engine.prefill(PrefillRequest("s", tokens=(1, 5, 6)))
        r = await engine.decode(DecodeRequest("s", token=r.logits.token_id, step_timeout=0.02))
        assert r.n_past == 4
        await engine.release("s")


async def test_a_cancelled_step_waits_for_at_most_the_tick_it_is_in(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Without mixing (a non-last shard) a decode waits while a 0.5 s chunk tick of another
    session runs; a Cancel then stops it at once (it is not in that tick), not after the next
    tick as before. A cancel of a step inside the running tick ends when that tick ends."""
    from shard.engine import LayerRange

    engine, spec = _batched()
    spec = LoadSpec(n_ctx=spec.n_ctx, max_sessions=8, n_batch=512, layer_range=LayerRange(0, 2))
    async with engine:
        await engine.load(spec)
        await engine.open_session("d")
        await engine.prefill(PrefillRequest("d", tokens=(1, 5, 6)))
        await engine.open_session("p")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.prefill, PrefillRequest("p", tokens=tuple(3 + i % 200 for i in range(1500))))
            await trio.sleep(0.6)  # inside the second chunk tick (0.52 s each)
            ended: list[float] = []

            async def decode() -> None:
                with pytest.raises(Exception) as info:  # noqa: PT011 - EngineCancelled below
                    await engine.decode(DecodeRequest("d", token=9))
                assert type(info.value).__name__ == "EngineCancelled"
                ended.append(trio.current_time())

            nursery.start_soon(decode)
            await trio.sleep(0.001)
            engine.cancel("d")
            cancelled_at = trio.current_time()
            await trio.sleep(0.001)
            assert ended and ended[0] - cancelled_at < 0.01  # not in the running tick: at once
        await engine.release("d")
        await engine.release("p")


# ---- one huge request ------------------------------------------------------------------------


async def test_huge_requests_are_refused_before_any_work() -> None:
    """16 MiB of text or 4M token ids: refused with the error the engine would give, before
    tokenizing or copying (16 MiB of text stalled every session for 7.5 s and grew RSS by
    950 MB on the bench model)."""
    engine = FakeEngine(model=MODEL)
    calls: list[int] = []
    tokenize = engine._impl_tokenize  # noqa: SLF001 - counting the work done

    def counting(text: str, add_bos: bool, parse_special: bool) -> list[int]:
        calls.append(len(text))
        return tokenize(text, add_bos, parse_special)

    engine._impl_tokenize = counting  # type: ignore[method-assign]  # noqa: SLF001
    async with loaded(engine), running_registry(engine) as reg, driver(reg) as d:
        await d.open()
        for request in (
            pb.Prefill(text="x" * (16 * 1024 * 1024)),
            pb.Prefill(tokens=pb.TokenIds(ids=[5] * 4_000_000)),
        ):
            await d.send(prefill=request)
            _, err, usage = await d.until_usage()
            assert err is not None and err.code == pb.ERROR_CODE_INVALID_ARGUMENT, err
            assert usage.n_past == 0
        await d.send(generate=pb.Generate(text="y" * (1024 * 1024), max_tokens=2))
        _, err, _ = await d.until_usage()
        assert err is not None and err.code == pb.ERROR_CODE_INVALID_ARGUMENT
        assert calls == []
        # A budget-sized text still works (the bound has slack for normalising tokenizers).
        await d.send(prefill=pb.Prefill(text="z" * 200))
        _, err, usage = await d.until_usage()
        assert err is None and usage.n_past == 201 and calls == [200]


async def test_text_is_tokenized_off_the_event_loop() -> None:
    engine = FakeEngine(model=MODEL)
    threads: list[threading.Thread] = []
    tokenize = engine._impl_tokenize  # noqa: SLF001

    def recording(text: str, add_bos: bool, parse_special: bool) -> list[int]:
        threads.append(threading.current_thread())
        return tokenize(text, add_bos, parse_special)

    engine._impl_tokenize = recording  # type: ignore[method-assign]  # noqa: SLF001
    async with loaded(engine), running_registry(engine) as reg, driver(reg) as d:
        await d.open()
        await d.send(generate=pb.Generate(text="hello", max_tokens=1))
        _, err, _ = await d.until_usage()
        assert err is None
        assert threads and threads[0] is not threading.main_thread()


async def test_closing_the_engine_waits_for_a_running_tokenization() -> None:
    """The vocabulary a worker thread reads is freed only after it finished."""
    engine = FakeEngine(model=MODEL)
    inside, leave = threading.Event(), threading.Event()
    tokenize = engine._impl_tokenize  # noqa: SLF001

    def slow(text: str, add_bos: bool, parse_special: bool) -> list[int]:
        inside.set()
        leave.wait(10)
        return tokenize(text, add_bos, parse_special)

    engine._impl_tokenize = slow  # type: ignore[method-assign]  # noqa: SLF001
    await engine.load(LoadSpec(n_ctx=1024, max_sessions=4))
    closed = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.tokenize_async, "abc")
        await trio.to_thread.run_sync(inside.wait)

        async def close() -> None:
            await engine.aclose()
            closed.set()

        nursery.start_soon(close)
        await trio.sleep(0.05)
        assert not closed.is_set()
        leave.set()
    assert closed.is_set()
