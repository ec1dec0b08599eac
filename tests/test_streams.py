"""A generation's steady state as one engine stream (``ShardEngine.stream``): the engine hands
each step's result to the session where the step finished (the task that ran a batched tick,
or the native thread's callback for steps computed ahead), and the session frames it there.

The contract suite checks what a stream computes and keeps (shard/testing/contract/streams.py,
"streams"); this module checks what makes it lean (the caller's task sleeps through the run;
streaming sessions share ticks; a token's response is the long path's message) and that a
served ``Generate`` keeps every guarantee on the llama.cpp engine's callback path."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import trio

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import TaskSteps, loaded, worker
from shard.client import ShardClient, ShardError
from shard.engine import (
    DecodeRequest,
    EngineCancelled,
    LoadSpec,
    LogitsResult,
    PrefillRequest,
    SamplingParams,
    ShardEngine,
    StepResult,
    StreamRequest,
    TokenLogprob,
)
from shard.engine import sampling
from shard.engine.fake import FakeEngine, FakeModel, FakeScript
from shard.engine.llama import LlamaCppEngine
from shard.engine.types import GREEDY
from shard.models import ensure_model
from shard.rpc import convert
from shard.rpc.errors import ErrorCode
from shard.v1 import shard_pb2 as pb

PROMPT = (1, 72, 101, 108, 108, 111, 44, 32)
STEPS = 40


def _batched_fake() -> FakeEngine:
    return FakeEngine(model=FakeModel(n_layers_total=2, n_embd=8, seed=3),
                      script=FakeScript(batched=True, tick_latency=0.0005))


def _llama_spec(max_sessions: int = 4, per_session: int = 256) -> LoadSpec:
    return LoadSpec(model_path=ensure_model("tiny"), n_ctx=per_session * max_sessions,
                    max_sessions=max_sessions, n_threads=1)


async def _steps_of(engine: ShardEngine, sessions: int, *, stream: bool) -> tuple[int, list[list[int]]]:
    """``sessions`` generations of ``STEPS`` tokens after a prompt, at once, each as one
    stream or decode by decode; returns the task steps they took in all, and their tokens."""
    counter = TaskSteps()
    out: list[list[int]] = [[] for _ in range(sessions)]

    async def run(i: int) -> None:
        sid = f"{'s' if stream else 'd'}{i}"
        await engine.open_session(sid)
        r = await engine.prefill(PrefillRequest(sid, PROMPT[: 5 + i], top_k_logprobs=0))
        assert r.logits is not None
        tokens = out[i]
        tokens.append(r.logits.token_id)
        counter.tasks.add(trio.lowlevel.current_task())
        if stream:
            def deliver(result: StepResult) -> bool:
                assert result.logits is not None
                tokens.append(result.logits.token_id)
                return True

            assert await engine.stream(StreamRequest(sid, tokens[0], STEPS), deliver) == STEPS
        else:
            for _ in range(STEPS):
                d = await engine.decode(DecodeRequest(sid, token=tokens[-1], top_k_logprobs=0))
                assert d.logits is not None
                tokens.append(d.logits.token_id)
        counter.tasks.discard(trio.lowlevel.current_task())

    trio.lowlevel.add_instrument(counter)
    try:
        async with trio.open_nursery() as nursery:
            for i in range(sessions):
                nursery.start_soon(run, i)
    finally:
        trio.lowlevel.remove_instrument(counter)
    for i in range(sessions):
        await engine.release(f"{'s' if stream else 'd'}{i}")
    return counter.steps, out


@pytest.mark.parametrize("kind", ["fake-batched", "llama"])
async def test_a_streams_task_sleeps_between_its_tokens(kind: str) -> None:
    """Decode by decode, every session's task runs at least once per token. As streams, the
    steps are delivered where they finished: on the batched fake by the one task that runs the
    ticks (a couple of steps a tick for all 4 sessions), on llama.cpp by the native thread's
    callback (the session's task is woken a few times in all)."""
    engine: ShardEngine = _batched_fake() if kind == "fake-batched" else LlamaCppEngine()
    spec = None if kind == "fake-batched" else _llama_spec()
    sessions = 4 if kind == "fake-batched" else 1
    async with loaded(engine, spec=spec):
        stepwise, expected = await _steps_of(engine, sessions, stream=False)
        streamed, tokens = await _steps_of(engine, sessions, stream=True)
        assert tokens == expected
        assert stepwise >= sessions * STEPS
        if kind == "fake-batched":
            assert streamed <= 3 * STEPS, (streamed, stepwise)
        else:
            assert streamed <= STEPS // 4, (streamed, stepwise)
            # every step after the first was computed ahead and delivered by the callback
            assert engine.metrics().lookahead_used_total >= STEPS - 2


async def test_streaming_sessions_share_ticks_and_each_tick_is_one_pass() -> None:
    engine = _batched_fake()
    async with loaded(engine, spec=LoadSpec(n_ctx=8 * 128, max_sessions=8)):
        async def run(i: int) -> None:
            sid = f"s{i}"
            await engine.open_session(sid)
            r = await engine.prefill(PrefillRequest(sid, PROMPT[: 4 + i % 4], top_k_logprobs=0))
            assert r.logits is not None
            n = await engine.stream(StreamRequest(sid, r.logits.token_id, STEPS), lambda _: True)
            assert n == STEPS

        before = engine.metrics()
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(run, i)
        m = engine.metrics()
        ticks = m.batch_ticks_total - before.batch_ticks_total
        sessions = m.batch_sessions_total - before.batch_sessions_total
        assert sessions == 8 * (STEPS + 1)
        assert sessions / ticks >= 6, (sessions, ticks)  # (the prompts arrive apart)
        for i in range(8):
            await engine.release(f"s{i}")


async def test_a_batched_tick_chooses_for_all_its_greedy_stream_steps_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched fake chooses the token and log-sum-exp of a tick's greedy stream steps for
    all its rows together, beside them, as the llama engine's native thread does: no stream
    step makes a pass over the vocabulary of its own on the event loop (a sampled stream still
    does), and tokens and log-probabilities are those of decode by decode, bit for bit."""
    engine = _batched_fake()
    passes = []
    lse = sampling.logsumexp
    monkeypatch.setattr(sampling, "logsumexp", lambda *a: passes.append(1) or lse(*a))

    async def run(i: int, how: str, params: SamplingParams = GREEDY) -> list[tuple[int, float]]:
        sid = f"{how}{i}"
        await engine.open_session(sid)
        r = await engine.prefill(PrefillRequest(sid, PROMPT[: 4 + i], sampling=params,
                                                top_k_logprobs=0))
        assert r.logits is not None
        out = [(r.logits.token_id, r.logits.logprob)]
        if how == "stream":
            def deliver(result: StepResult) -> bool:
                assert result.logits is not None
                out.append((result.logits.token_id, result.logits.logprob))
                return True

            await engine.stream(StreamRequest(sid, out[0][0], STEPS, params), deliver)
        else:
            for _ in range(STEPS):
                d = await engine.decode(DecodeRequest(sid, token=out[-1][0], sampling=params,
                                                      top_k_logprobs=0))
                assert d.logits is not None
                out.append((d.logits.token_id, d.logits.logprob))
        await engine.release(sid)
        return out

    async def four(how: str, params: SamplingParams = GREEDY) -> list[list[tuple[int, float]]]:
        got: list[list[tuple[int, float]]] = [[] for _ in range(4)]

        async def one(i: int) -> None:
            got[i] = await run(i, how, params)

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
        return got

    async with loaded(engine, spec=LoadSpec(n_ctx=4 * 128, max_sessions=4)):
        stepwise = await four("decode")
        assert len(passes) == 4 * (STEPS + 1)  # one per step, prompts included
        passes.clear()
        before = engine.metrics()
        streamed = await four("stream")
        after = engine.metrics()
        assert streamed == stepwise
        assert len(passes) == 4  # the prompts' steps only
        # ... and the ticks held several sessions' rows, chosen together
        assert (after.batch_sessions_total - before.batch_sessions_total
                > 2 * (after.batch_ticks_total - before.batch_ticks_total))
        passes.clear()
        sampled = SamplingParams(temperature=0.8, seed=5)
        assert await four("stream", sampled) == await four("decode", sampled)
        assert len(passes) == 2 * 4 * (STEPS + 1)  # sampled: chosen row by row, as before


async def test_a_long_batched_stream_keeps_no_step_it_went_through() -> None:
    """The jobs of a stream's finished steps (each holding its result) are dropped as the run
    goes on: a long run holds one step, not all of them. (They were linked one to the next,
    so a stream kept every step's result until it ended, and found its current step by
    walking them all.)"""
    engine = _batched_fake()
    async with loaded(engine):
        await engine.open_session("s")
        r = await engine.prefill(PrefillRequest("s", PROMPT, top_k_logprobs=0))
        assert r.logits is not None
        scheduler = engine._scheduler  # noqa: SLF001
        assert scheduler is not None
        seen: list[weakref.ref[Any]] = []
        alive_at: list[int] = []
        stream = scheduler.stream

        async def watched(job: Any, follow: Any) -> Any:
            def recording(j: Any) -> Any:
                seen.append(weakref.ref(j))
                return follow(j)

            return await stream(job, recording)

        scheduler.stream = watched  # type: ignore[method-assign]

        def deliver(result: StepResult) -> bool:
            if result.n_past == len(PROMPT) + 150:
                gc.collect()
                alive_at.append(sum(ref() is not None for ref in seen[1:-2]))
            return True

        assert await engine.stream(StreamRequest("s", r.logits.token_id, 200), deliver) == 200
        assert len(seen) == 200 and alive_at == [0], alive_at
        await engine.release("s")


@pytest.mark.parametrize("how", ["cancel_scope", "engine.cancel"])
async def test_a_stream_stopped_while_its_finished_step_awaits_the_ticks_pass_commits_nothing_more(
    how: str,
) -> None:
    """Stream A is stopped (its caller's scope, or ``engine.cancel`` followed at once by the
    session's next decode) while a tick that another stream's task runs has finished A's step
    but not yet made its pass over the results. A's ``stream`` returns, so nothing of A may be
    committed or delivered after it: the pass finds the run closed. (Found in review: the pass
    committed the step and queued the next ones for a session already IDLE.)"""
    state: dict[str, Any] = {"armed": False, "scope": None, "delivered": 0, "returned": False,
                             "late": 0, "stop_b": False, "stopped": False}

    async def hook(step: Any) -> None:  # B's rows await, as a slow tick would: A's finish first
        if not (state["armed"] and step.session_id == "B"):
            return
        if state["delivered"] >= 3 and not state["stopped"] and not state["returned"]:
            state["stopped"] = True
            if how == "cancel_scope":
                state["scope"].cancel()
            else:
                engine.cancel("A")
            await trio.sleep(0.05)  # the rest of the tick: A's caller goes on meanwhile
            return
        await trio.sleep(0.002)

    engine = FakeEngine(model=FakeModel(n_layers_total=2, n_embd=8, seed=3),
                        script=FakeScript(batched=True, tick_latency=0.0005, on_step=hook))
    async with loaded(engine, spec=LoadSpec(n_ctx=4 * 512, max_sessions=4)):
        first = {}
        for sid in ("A", "B"):
            await engine.open_session(sid)
            r = await engine.prefill(PrefillRequest(sid, PROMPT, top_k_logprobs=0))
            assert r.logits is not None
            first[sid] = r.logits.token_id
        state["armed"] = True
        got: list[StepResult] = []

        def deliver_a(result: StepResult) -> bool:
            state["late"] += state["returned"]
            state["delivered"] += 1
            got.append(result)
            return True

        async def run_b() -> None:
            await engine.stream(StreamRequest("B", first["B"], 400), lambda _: not state["stop_b"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_b)
            await trio.sleep(0.02)  # B's task leads the ticks
            with trio.CancelScope() as scope:
                state["scope"] = scope
                try:
                    await engine.stream(StreamRequest("A", first["A"], 400), deliver_a)
                except EngineCancelled:
                    assert how == "engine.cancel"
            state["returned"] = True
            held = engine.session_info("A").n_past
            assert held == len(PROMPT) + len(got)
            if how == "engine.cancel":  # the session's next step, at once
                last = got[-1].logits
                assert last is not None
                d = await engine.decode(DecodeRequest("A", token=last.token_id, top_k_logprobs=0))
                held += 1
                assert d.n_past == held
            await trio.sleep(0.1)
            state["stop_b"] = True
        assert state["late"] == 0
        info = engine.session_info("A")
        assert info.state.value == "idle" and info.n_past == held
        assert engine.metrics().kv_cells_used == held + engine.session_info("B").n_past
        for sid in ("A", "B"):
            await engine.release(sid)


@pytest.mark.parametrize("finish", [pb.FINISH_REASON_UNSPECIFIED, pb.FINISH_REASON_LENGTH])
def test_a_tokens_response_is_the_long_paths_message(finish: int) -> None:
    top = (TokenLogprob(5, -0.5, b"a"), TokenLogprob(9, -1.25, b"\xff"))
    logits = LogitsResult(top=top, token_id=5, logprob=-0.5, piece=b"a", is_eog=False)
    for result in (
        StepResult("s", n_past=12, tokens_processed=1, reused_tokens=0, logits=logits),
        StepResult("s", n_past=30, tokens_processed=7, reused_tokens=3, logits=logits,
                   position_logits=(logits, logits)),
        StepResult("s", n_past=2, tokens_processed=1, reused_tokens=0,
                   logits=LogitsResult((), 2, 0.0, b"", True)),
    ):
        step = convert.step_to_proto(result, 7, result.n_past - 1)
        step.finish_reason = finish  # type: ignore[assignment]
        long_path = pb.SessionResponse(step=step)
        short_path = convert.token_response(result, 7, result.n_past - 1, finish)
        assert short_path == long_path
        assert short_path.SerializeToString(deterministic=True) == long_path.SerializeToString(deterministic=True)


# ---- served Generate on llama.cpp: the callback path keeps every guarantee ------------------


async def _reference(engine: ShardEngine, n: int) -> list[int]:
    """The greedy tokens of ``PROMPT`` decode by decode, without any look-ahead."""
    await engine.open_session("ref")
    r = await engine.prefill(PrefillRequest("ref", PROMPT, top_k_logprobs=0))
    assert r.logits is not None
    out = [r.logits.token_id]
    for _ in range(n - 1):
        d = await engine.decode(DecodeRequest("ref", token=out[-1], top_k_logprobs=0))
        assert d.logits is not None
        out.append(d.logits.token_id)
    await engine.release("ref")
    return out


@pytest.mark.parametrize("credit", [1, 3, 64])
async def test_served_llama_generate_streams_the_plain_tokens_under_any_credit(credit: int) -> None:
    """Credit that runs out ends a stream; the next one claims the step already computed
    ahead. Every step is numbered in order, counted once, and the tokens are the plain ones."""
    async with worker(engine=LlamaCppEngine(), load=_llama_spec()) as w:
        expected = await _reference(w.engine, 60)
        async with ShardClient.connect(w.target, timeout=60) as c, c.session("g", credit=credit) as s:
            steps = [st async for st in s.generate(list(PROMPT), max_tokens=60, ignore_eos=True)]
            assert [st.logits.token_id for st in steps] == expected
            assert [st.step for st in steps] == list(range(1, 61))
            assert [st.n_past for st in steps] == list(range(len(PROMPT), len(PROMPT) + 60))
            assert steps[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert s.usage.generated_tokens == 60 and s.usage.prompt_tokens == len(PROMPT)
            assert w.engine.session_info("g").n_past == len(PROMPT) + 59
            more = [st async for st in s.generate(max_tokens=5, ignore_eos=True)]
            assert [st.n_past for st in more] == list(range(len(PROMPT) + 60, len(PROMPT) + 65))
        assert w.engine.metrics().lookahead_used_total >= 50
        await w.idle()


@pytest.mark.parametrize("how", ["cancel", "release", "deadline"])
async def test_served_llama_generate_stopped_mid_stream_keeps_exactly_what_was_sent(how: str) -> None:
    # (a long context: the tiny model decodes a token in about a millisecond)
    async with worker(engine=LlamaCppEngine(), load=_llama_spec(2, 8192)) as w:
        expected = await _reference(w.engine, 12)
        got: list[pb.StepResult] = []
        async with ShardClient.connect(w.target, timeout=60) as c:
            if how == "deadline":
                with pytest.raises(ShardError) as info:
                    async with c.session("d", timeout=0.3) as s:
                        async for st in s.generate(list(PROMPT), max_tokens=100_000, ignore_eos=True):
                            got.append(st)
                assert info.value.code is ErrorCode.DEADLINE_EXCEEDED
                assert len(got) > 3
                await w.idle()
                assert w.engine.sessions() == ()
                return
            async with c.session(how) as s:
                async def consume() -> None:
                    with pytest.raises(ShardError) as info:
                        async for st in s.generate(list(PROMPT), max_tokens=100_000, ignore_eos=True):
                            got.append(st)
                    code = ErrorCode.CANCELLED if how == "cancel" else ErrorCode.SESSION_NOT_FOUND
                    assert info.value.code is code, info.value

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(consume)
                    with trio.fail_after(30):
                        while len(got) < 5:
                            await trio.sleep(0.001)
                    if how == "cancel":
                        reply = await c.cancel(how)
                        assert reply.found and reply.was_running
                    else:
                        assert await c.release(how)
                if how == "release":
                    assert w.engine.sessions() == ()
                    return
                # Usage counts exactly the tokens sent; the session holds exactly them.
                assert s.usage.generated_tokens == len(got)
                assert [st.logits.token_id for st in got[:12]] == expected[: len(got[:12])]
                held = w.engine.session_info(how)
                assert held.n_past == got[-1].n_past == len(PROMPT) + len(got) - 1
                assert w.engine.metrics().kv_cells_used == held.n_past
                nxt = await s.decode(got[-1].logits.token_id)
                assert nxt.n_past == held.n_past + 1
        await w.idle()


async def test_a_failing_engine_ends_a_served_llama_stream_with_engine_failure() -> None:
    """A fault in the callback's delivery (here: the result check) fails the engine, as a
    fault in a step does; the stream ends with ENGINE_FAILURE and nothing leaks."""

    class Faulty(LlamaCppEngine):
        delivered = 0

        def _make_result(self, *args: Any, **kwargs: Any) -> StepResult:
            Faulty.delivered += 1
            if Faulty.delivered == 6:
                raise RuntimeError("a broken hook")
            return super()._make_result(*args, **kwargs)

    async with worker(engine=Faulty(), load=_llama_spec()) as w:
        async with ShardClient.connect(w.target, timeout=60) as c:
            with pytest.raises(ShardError) as info:
                async for _ in c.generate(list(PROMPT), max_tokens=100, ignore_eos=True):
                    pass
            assert info.value.code is ErrorCode.ENGINE_FAILURE
        assert w.engine.health().state.value == "failed"
        await w.idle()
