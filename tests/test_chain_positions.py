"""A routed session's positions (issue 31, findings 4, 5, 7 and 8): one owner, one rule.

After every request on a routed session, failed ones included, every hop holds exactly the
positions the client was told (``Usage.n_past``); rows always reach the next hop at the positions
they were computed for, also when the first hop reused a held prefix; the hop a failure is from
is named by structure (``ShardError.relay_depth``), a hung hop too; a step queued behind a
CloseSession is answered, a step whose send failed leaves no return slot behind.

FakeEngine workers on loopback (finding 4 also on two llama.cpp hops of the tiny model, where a
row at the wrong position changes the tokens).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio

from rpc_harness import MODEL, StepGate, Worker, worker
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.client import ClientSession, ShardClient, ShardError
from shard.engine import InvalidInput, LoadSpec
from shard.engine.fake import FakeStep
from shard.pipeline import Pipeline, PipelineError
from shard.rpc.errors import ErrorCode, unwrap_single_exception
from shard.relay import ChainRelay
from shard.relay.downstream import NextHop
from shard.relay.routed import RoutedSession
from shard.v1 import shard_pb2 as pb
from test_direct_return import one_running_one_queued, returning_route
from test_pipeline import TIMEOUT, cuts_to_ranges
from test_relay import THREE, free_within, relay_shards, route_of

TWO = cuts_to_ranges([0, 2, 4])
HISTORY = [1, *(3 + (i * 7) % 200 for i in range(71))]  # 72 token ids, BOS first


def held(w: Worker, sid: str) -> int:
    """Positions the worker's engine holds for ``sid``."""
    return w.engine.session_info(sid).n_past


def chain_held(chain: Sequence[Worker], sid: str) -> list[int]:
    names = [sid + ">" * i for i in range(len(chain))]
    return [held(w, n) for w, n in zip(chain, names)]


async def too_many_logits(s: ClientSession, tokens: Sequence[int], position: int) -> ShardError:
    """A Prefill the last hop refuses after the first computed it (``all_logits`` over more
    positions than it verifies at once): a step error downstream."""
    with pytest.raises(ShardError) as info:
        await s.prefill(tokens=tokens, position=position, all_logits=True)
    return info.value


# ---- finding 4: a reused prefix never moves rows to other positions ------------------------------


async def _retry_after_a_downstream_error(chain: Sequence[Worker]) -> tuple[list[Any], list[Any]]:
    """Hop 0 computes 70 positions the last hop refuses; the client retries the same Prefill
    (the documented recovery). Returns the retried session's results and a clean session's."""
    runs: dict[str, list[Any]] = {}
    async with ShardClient.connect(chain[0].target, timeout=TIMEOUT) as client:
        caps = [w.engine.capabilities() for w in chain]
        route = pb.Route(hops=[
            pb.RouteHop(target=w.target, expected_model_fingerprint=c.model_fingerprint,
                        expected_layer_range=pb.LayerRange(start=c.layer_range.start,
                                                           end=c.layer_range.end))
            for w, c in zip(chain[1:], caps[1:])])
        for sid, fail in (("retry.0", True), ("clean.0", False)):
            async with client.session(sid, route=route) as s:
                await s.prefill(tokens=HISTORY[:2])
                if fail:
                    err = await too_many_logits(s, HISTORY[2:], 2)
                    assert err.code == ErrorCode.INVALID_ARGUMENT
                    assert (err.relay_depth, err.failed_layers) == (len(chain) - 1, (2, 4))
                    # every hop holds exactly what the client was told
                    assert s.usage.n_past == 2
                    assert chain_held(chain, sid) == [2] * len(chain)
                step = await s.prefill(tokens=HISTORY[2:], position=2)
                assert s.usage.n_past == step.n_past == len(HISTORY)
                assert chain_held(chain, sid) == [len(HISTORY)] * len(chain)
                nxt = await s.decode(step.logits.token_id)
                runs[sid] = [step, nxt]
    return runs["retry.0"], runs["clean.0"]


async def test_a_retried_prefill_after_a_downstream_error_lands_at_its_own_positions() -> None:
    """Finding 4: hop 0 held 72 positions and hop 1 held 2 after the refused step; hop 0's
    retry reused 69 of them and forwarded its one row at position 2 (the client read n_past 3
    where 72 was right). Now the failed request leaves every hop at 2 and the retry computes
    what a clean session computes, bit for bit."""
    async with relay_shards(TWO) as chain:
        retried, clean = await _retry_after_a_downstream_error(chain)
        for a, b in zip(retried, clean, strict=True):
            assert (a.n_past, a.logits) == (b.n_past, b.logits)
        await free_within(chain)


@pytest.mark.slow
async def test_a_retried_prefill_on_two_llama_hops_gives_a_clean_sessions_tokens() -> None:
    """Finding 4 on llama.cpp: a row written at another position than it was computed for
    changes the tokens; the retried session's equal a clean session's."""
    from shard.engine.llama import LlamaCppEngine
    from shard.models import ensure_model, ensure_slice

    source = ensure_model("tiny")
    async with AsyncExitStack() as stack:
        chain = []
        for lr in TWO:
            path = await trio.to_thread.run_sync(ensure_slice, source, lr)
            spec = LoadSpec(model_path=path, layer_range=lr, n_ctx=1024, max_sessions=2, n_threads=1)
            chain.append(await stack.enter_async_context(
                worker(engine=LlamaCppEngine(), load=spec, relay=ChainRelay())))
        retried, clean = await _retry_after_a_downstream_error(chain)
        for a, b in zip(retried, clean, strict=True):
            assert a.n_past == b.n_past
            assert a.logits.token_id == b.logits.token_id
            assert abs(a.logits.logprob - b.logits.logprob) < 1e-5
        await free_within(chain, 5)


async def test_a_prefix_reused_by_the_first_hop_is_not_sent_again() -> None:
    """A rewrite whose head the first hop holds already: it computes only the rest, and those
    rows go to the next hop at their own positions (the next hop holds the same head)."""
    async with relay_shards(TWO) as chain:
        async with ShardClient.connect(chain[0].target, timeout=TIMEOUT) as client:
            async with client.session("p.0", route=route_of(chain[1:], TWO[1:])) as s:
                await s.prefill(tokens=HISTORY[:40])
                step = await s.prefill(tokens=[*HISTORY[20:40], 9, 9], position=20)
                assert step.reused_tokens == 20 and step.n_past == 42
                assert chain_held(chain, "p.0") == [42, 42]
            async with client.session("q.0", route=route_of(chain[1:], TWO[1:])) as s:
                want = await s.prefill(tokens=[*HISTORY[:40], 9, 9])
        assert step.logits == want.logits
        await free_within(chain)


# ---- finding 5: a compute result and a downstream error in one pass ------------------------------


@pytest.mark.parametrize("chunk", [1, 3])
async def test_a_chunked_prefill_that_fails_downstream_leaves_every_hop_at_one_end(chunk: int) -> None:
    """Finding 5: the last hop refuses a chunk while the first computes the next one; whichever
    lands first, the request ends with every hop holding what ``Usage.n_past`` says (it said 8
    while the next hop held 0). Many timings: the first hop's steps take a random time."""
    rng = random.Random(5)
    refuse: dict[str, int] = {}

    def refuse_at(i: int, step: FakeStep) -> None:
        if i == 1 and step.position == refuse.get(step.session_id.rstrip(">"), -1):
            refuse.pop(step.session_id.rstrip(">"))
            raise InvalidInput("scripted refusal")

    class Jitter(StepGate):
        """The first hop's steps take a random time (so its compute lands before, with or
        after the refusal coming back)."""

        async def __call__(self, step: FakeStep | None = None) -> None:
            await super().__call__(step)
            await trio.sleep(rng.uniform(0, 0.002))

    async with relay_shards(TWO, on_step=refuse_at, gates=[Jitter(), StepGate()]) as chain:
        async with ShardClient.connect(chain[0].target, timeout=TIMEOUT) as client:
            for run in range(24):
                sid = f"r{run}.0"
                at = rng.randrange(0, 12)
                refuse[sid] = at
                async with client.session(sid, route=route_of(chain[1:], TWO[1:])) as s:
                    steps = s.prefill_chunks(HISTORY[:16], chunk_tokens=chunk)
                    got = []
                    with pytest.raises(ShardError) as info:
                        async for step in steps:
                            got.append(step)
                    assert info.value.code == ErrorCode.INVALID_ARGUMENT
                    n = s.usage.n_past
                    assert chain_held(chain, sid) == [n, n], (run, at, n)
                    assert n == (got[-1].n_past if got else 0)
                    assert n <= at  # the refused position is held nowhere
                    again = await s.prefill(tokens=HISTORY[n:16], position=n)
                    assert again.n_past == 16 and chain_held(chain, sid) == [16, 16]
        await free_within(chain)


# ---- finding 7: the hop a failure is from, also a hung one ---------------------------------------


@asynccontextmanager
async def hung(gate: StepGate) -> AsyncIterator[None]:
    """Hold every later step of ``gate``'s worker; let them go at the end (the teardown)."""
    gate.hold()
    try:
        yield
    finally:
        gate.release()


@pytest.mark.parametrize("which", [1, 2], ids=["middle", "last"])
@pytest.mark.parametrize("bound", ["step-timeout", "deadline"])
async def test_a_hung_hop_of_a_chain_is_the_one_named(which: int, bound: str) -> None:
    """Finding 7: the middle or the last worker stops answering mid-decode. With a step timeout
    the worker before it says so (STEP_DEADLINE) naming it, not the healthy first worker ("may
    be hung"); with only the deadline, the hop that was still working when it passed."""
    gates = [StepGate() for _ in THREE]
    async with relay_shards(THREE, gates=gates, latency=0.001) as chain:
        options: dict[str, Any] = {"step_timeout": 0.4} if bound == "step-timeout" else {}
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT, relay="chain",
                                    **options) as pipe:
            with pytest.raises(PipelineError) as info, unwrap_single_exception():
                async with trio.open_nursery() as nursery:

                    async def stop_it() -> None:
                        with trio.fail_after(10):
                            while gates[which].steps < len(HISTORY[:8]) + 3:
                                await trio.sleep(0.001)
                        gates[which].hold()

                    nursery.start_soon(stop_it)
                    try:
                        await pipe.generate(HISTORY[:8], max_tokens=400, ignore_eos=True,
                                            timeout=None if bound == "step-timeout" else 2.0)
                    finally:
                        gates[which].release()
        err = info.value
        assert err.hop_index == which, err
        assert err.target == chain[which].target
        assert err.code == ErrorCode.DEADLINE_EXCEEDED
        if bound == "step-timeout":
            assert err.reason == "STEP_DEADLINE"
        assert "hop 0 " not in str(err)
        await free_within(chain, 3)


async def test_a_downstream_engine_failure_names_its_hop_by_structure() -> None:
    async with relay_shards(THREE, fail_at_step={1: 12}) as chain:
        async with ShardClient.connect(chain[0].target, timeout=TIMEOUT) as client:
            with pytest.raises(ShardError) as info:
                async with client.session("f.0", route=route_of(chain[1:], THREE[1:])) as s:
                    async for _ in s.generate(HISTORY[:8], max_tokens=20, ignore_eos=True):
                        pass
        err = info.value
        assert err.code == ErrorCode.ENGINE_FAILURE
        assert (err.relay_depth, err.failed_layers) == (1, (1, 3))
        await free_within([chain[0], chain[2]])


# ---- finding 8: a queued step is answered; a failed send leaves no slot ---------------------------


async def test_closesession_answers_the_step_queued_behind_the_running_one() -> None:
    """Finding 8: on a session with a return address (one step may queue behind the running
    one), a CloseSession sent while a step runs and another waits: both are answered (result
    and Usage each), then the session closes; the queued one was dropped without a word."""
    gates = [StepGate() for _ in THREE]
    async with relay_shards(THREE, gates=gates) as chain:
        last = chain[2]
        route = pb.Route(return_to=pb.ReturnAddress(
            target=chain[0].target, session_id="up", secret=b"s" * 16))
        row = np.ones((1, MODEL.n_embd), dtype=np.float32)
        async with ShardClient.connect(last.target, timeout=TIMEOUT) as client:
            s = await client.open_session("q.0>>", route=route)
            try:
                await s.prefill(hidden_states=np.ones((3, MODEL.n_embd), dtype=np.float32))
                await one_running_one_queued(s, gates[2], last, row)
                await s._send(s._request(close=pb.CloseSession()))  # noqa: SLF001 - raw close
                await trio.sleep(0.05)
                gates[2].release()
                a = await s.read_ahead()
                b = await s.read_ahead()
                assert (a.start_position, b.start_position) == (3, 4)
                assert s.usage.n_past == 5
                with trio.fail_after(10):
                    while s.closed is None:
                        await s._next()  # noqa: SLF001
                assert s.closed.reason == pb.SessionClosed.REASON_CLIENT_CLOSE
            finally:
                gates[2].release()
                s.abort()
        await free_within(chain)


async def test_a_decode_whose_send_fails_leaves_no_return_slot_and_the_chain_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finding 8: the first hop runs a step ahead; sending it fails once. The slot it had
    opened for the step's direct copy is forgotten, the request ends with that error, every
    hop holds what the client was told, and the next Generate continues with the right tokens."""
    real = NextHop.send_decode
    calls = {"n": 0}

    async def flaky(self: NextHop, *args: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 4:
            raise ShardError(ErrorCode.CANCELLED, "scripted send failure")
        await real(self, *args, **kwargs)

    monkeypatch.setattr(NextHop, "send_decode", flaky)
    async with relay_shards(THREE) as chain:
        async with ShardClient.connect(chain[0].target, timeout=TIMEOUT) as client:
            async with client.session("l.0", route=returning_route(chain)) as s:
                got: list[pb.StepResult] = []
                with pytest.raises(ShardError) as info, unwrap_single_exception():
                    async for step in s.generate(HISTORY[:8], max_tokens=20, ignore_eos=True):
                        got.append(step)
                assert info.value.message == "scripted send failure"
                call = chain[0].call("l.0")
                assert call is not None and isinstance(call.routed, RoutedSession)
                assert call.routed.returns is not None and call.routed.returns._slots == {}  # noqa: SLF001
                n = s.usage.n_past
                assert n == len(HISTORY[:8]) + len(got) - 1
                assert chain_held(chain, "l.0") == [n, n, n]
                more = [x async for x in s.generate(max_tokens=20 - len(got), ignore_eos=True)]
            async with client.session("m.0", route=returning_route(chain)) as s:
                want = [x async for x in s.generate(HISTORY[:8], max_tokens=20, ignore_eos=True)]
        assert [x.logits for x in got + more] == [x.logits for x in want]
        await free_within(chain)
