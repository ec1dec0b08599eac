"""Chain relay's direct return (issue 17): the last hop hands each token to the first hop.

Live FakeEngine workers on loopback ports. A relayed ``Generate`` on three or more hops goes on
with the last hop's result as soon as it arrives through ``Return`` (one step sent ahead, queued
by the next hop): the tokens must stay the client relay's bit for bit, the copies must actually
be used (the first hop's ``direct_returns_used_total``), and everything must fall back to the
chain's answers when the return path is missing, unreachable or forged. A Cancel or a step error
mid-generation must leave every hop consistent (the next Generate continues exactly), and a step
queued behind one that fails must not run.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import numpy as np
import pytest
import trio

from rpc_harness import MODEL, StepGate, Worker, in_thread
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.client import ClientSession, ShardClient, ShardError
from shard.engine import LayerRange
from shard.engine.fake import FakeStep
from shard.pipeline import Pipeline
from shard.rpc.errors import ErrorCode, unwrap_single_exception
from shard.relay import ChainRelay
from shard.relay.returns import DirectReturns
from shard.relay.routed import RoutedSession
from shard.v1 import shard_pb2 as pb
from test_pipeline import PROMPT, TIMEOUT, cuts_to_ranges, whole_model_steps
from test_relay import THREE, free_within, relay_shards, route_of

N_TOKENS = 30
IDS = [1, 17, 18, 19, 20, 21, 22, 23]  # a prompt of token ids (BOS first)


async def used(w: Worker) -> int:
    async with ShardClient.connect(w.target, timeout=TIMEOUT) as client:
        return (await client.metrics()).worker.get("direct_returns_used_total", 0)


def returning_route(chain: Sequence[Worker]) -> pb.Route:
    """A route asking for a direct return (to the first hop's own address)."""
    route = route_of(chain[1:], THREE[1:])
    route.return_to.SetInParent()
    return route


def returns_of(w: Worker, sid: str) -> DirectReturns | None:
    call = w.call(sid)
    assert call is not None and isinstance(call.routed, RoutedSession)
    return call.routed.returns


async def reference(prompt: str | Sequence[int], n: int) -> list[pb.StepResult]:
    async with relay_shards([LayerRange(0, 4)]) as (whole,):
        return await whole_model_steps(
            whole.target, prompt if isinstance(prompt, str) else list(prompt), max_tokens=n,
            ignore_eos=True)


@pytest.mark.parametrize("cuts", [[0, 1, 3, 4], [0, 1, 2, 3, 4]], ids=["3-hops", "4-hops"])
async def test_a_chain_of_three_or_more_hops_goes_on_with_the_last_hops_direct_results(
    cuts: list[int],
) -> None:
    async with relay_shards([LayerRange(0, 4), *cuts_to_ranges(cuts)]) as (whole, *chain):
        want = await whole_model_steps(
            whole.target, PROMPT, max_tokens=N_TOKENS, ignore_eos=True, top_logprobs=5)
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT, relay="chain") as pipe:
            got = await pipe.generate(PROMPT, max_tokens=N_TOKENS, ignore_eos=True, top_logprobs=5)
        assert [s.logits for s in got.steps] == [s.logits for s in want]  # bit for bit
        assert [s.n_past for s in got.steps] == [s.n_past for s in want]
        # every token after the prompt's went on with the copy handed back directly
        assert await used(chain[0]) == N_TOKENS - 1
        await free_within(chain)


async def test_two_hops_need_no_direct_return() -> None:
    """With two hops the answer of the next hop is the last hop's: no return address is sent."""
    async with relay_shards(cuts_to_ranges([0, 2, 4])) as chain:
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT, relay="chain") as pipe:
            await pipe.generate(PROMPT, max_tokens=8, ignore_eos=True)
            routed = chain[0].calls[-1].routed
            assert isinstance(routed, RoutedSession) and routed.returns is None
        assert await used(chain[0]) == 0


async def test_a_last_hop_that_may_not_connect_out_leaves_the_answers_to_the_chain() -> None:
    """The last worker was not started with --allow-relay: it gets no return address (the
    middle hop checks relay_return), and the tokens come up the chain, the same ones."""
    async with relay_shards(THREE, relay=[True, True, False]) as chain:
        want = await reference(PROMPT, N_TOKENS)
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT, relay="chain") as pipe:
            got = await pipe.generate(PROMPT, max_tokens=N_TOKENS, ignore_eos=True)
            assert chain[2].calls[-1].returner is None  # the middle hop sent no return address
        assert got.tokens == [s.logits.token_id for s in want]
        assert await used(chain[0]) == 0
        await free_within(chain)


async def test_an_unreachable_return_address_costs_time_not_tokens() -> None:
    """The first hop's operator advertises an address the last hop cannot reach."""
    async with relay_shards(THREE, relays=[ChainRelay(advertise="127.0.0.1:1"), None, None]) as chain:
        want = await reference(IDS, N_TOKENS)
        async with ShardClient.connect(chain[0].target, timeout=TIMEOUT) as client:
            async with client.session("u.0", route=returning_route(chain)) as s:
                assert returns_of(chain[0], "u.0") is not None
                got = [step async for step in s.generate(IDS, max_tokens=N_TOKENS, ignore_eos=True)]
        assert [g.logits.token_id for g in got] == [w.logits.token_id for w in want]
        assert got[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert await used(chain[0]) == 0
        await free_within(chain)


async def test_a_forged_or_stray_return_is_refused_and_the_session_goes_on() -> None:
    async with relay_shards(THREE) as chain:
        want = await reference(IDS, 4)
        async with ShardClient.connect(chain[0].target, timeout=TIMEOUT) as client:
            async with client.session("f.0", route=returning_route(chain)) as s:
                returns = returns_of(chain[0], "f.0")
                assert returns is not None
                forged = pb.StepResult(logits=pb.Logits(token_id=7))
                for sid, secret in (("f.0", b"x" * 16), ("nobody", returns.secret)):
                    with pytest.raises(ShardError) as info:
                        await client.return_step(
                            pb.ReturnAddress(session_id=sid, secret=secret), 1, forged)
                    assert info.value.code == ErrorCode.PERMISSION_DENIED
                    assert info.value.reason == "RETURN_REFUSED"
                # the right secret, but no step waits for the tag: ignored, not used
                assert not await client.return_step(returns.address(""), 99, forged)

                def grpcio_return() -> grpc.StatusCode:
                    with grpc.insecure_channel(chain[0].target) as channel:
                        call = channel.unary_unary(
                            "/shard.v1.Shard/Return", request_serializer=lambda m: m.SerializeToString(),
                            response_deserializer=pb.ReturnResponse.FromString)
                        try:
                            call(pb.ReturnRequest(version=client.version, session_id="f.0",
                                                  secret=b"y", relay_tag=1, step=forged),
                                 timeout=TIMEOUT)
                        except grpc.RpcError as err:
                            return err.code()
                    return grpc.StatusCode.OK

                assert await in_thread(grpcio_return) == grpc.StatusCode.PERMISSION_DENIED
                got = [step async for step in s.generate(IDS, max_tokens=4, ignore_eos=True)]
            assert [g.logits.token_id for g in got] == [w.logits.token_id for w in want]
            assert (await client.health()).status == pb.HealthResponse.STATUS_SERVING
        await free_within(chain)


async def test_a_cancel_mid_generation_leaves_every_hop_consistent() -> None:
    """A Cancel RPC while the first hop runs one step ahead: a step-level CANCELLED after the
    tokens already computed; every hop holds exactly those, and the next Generate continues
    with the whole model's tokens."""
    gates = [StepGate() for _ in THREE]
    async with relay_shards(THREE, gates=gates, latency=0.002) as chain:
        want = await reference(IDS, 40)
        async with ShardClient.connect(chain[0].target, timeout=TIMEOUT) as client:
            async with client.session("c.0", route=returning_route(chain)) as s:
                got: list[pb.StepResult] = []

                async def cancel_midway() -> None:
                    with trio.fail_after(10):
                        while gates[2].steps < len(IDS) + 12:
                            await trio.sleep(0.001)
                    await client.cancel("c.0")

                with pytest.raises(ShardError) as info, unwrap_single_exception():
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(cancel_midway)
                        async for step in s.generate(IDS, max_tokens=40, ignore_eos=True):
                            got.append(step)
                assert info.value.code == ErrorCode.CANCELLED
                assert 10 <= len(got) < 40
                assert s.usage.n_past == len(IDS) + len(got) - 1  # the prompt, then the tokens fed back
                more = [step async for step in s.generate(max_tokens=40 - len(got), ignore_eos=True)]
                assert more[0].start_position == got[-1].start_position + 1
        tokens = [g.logits.token_id for g in got + more]
        assert tokens == [w.logits.token_id for w in want]
        assert [g.logits for g in got + more] == [w.logits for w in want]
        assert await used(chain[0]) > 0  # it did run ahead
        await free_within(chain)


async def test_a_step_error_at_the_last_hop_mid_generation_is_named_and_the_chain_goes_on() -> None:
    from shard.engine import InvalidInput

    refuse_at = len(IDS) + 6

    def refuse_once(i: int, step: FakeStep) -> None:
        if i == 2 and step.position == refuse_at and not refused:
            refused.append(step)
            raise InvalidInput("scripted refusal")

    refused: list[FakeStep] = []
    async with relay_shards(THREE, on_step=refuse_once) as chain:
        want = await reference(IDS, 20)
        async with ShardClient.connect(chain[0].target, timeout=TIMEOUT) as client:
            async with client.session("e.0", route=returning_route(chain)) as s:
                got: list[pb.StepResult] = []
                with pytest.raises(ShardError) as info:
                    async for step in s.generate(IDS, max_tokens=20, ignore_eos=True):
                        got.append(step)
                assert info.value.code == ErrorCode.INVALID_ARGUMENT and refused
                assert (info.value.relay_depth, info.value.failed_layers) == (2, (3, 4))
                assert s.usage.n_past == refuse_at and got[-1].n_past == refuse_at
                more = [step async for step in s.generate(max_tokens=20 - len(got), ignore_eos=True)]
        assert [g.logits for g in got + more] == [w.logits for w in want]
        assert await used(chain[0]) > 0
        await free_within(chain)


async def one_running_one_queued(s: ClientSession, gate: StepGate, w: Worker, row: np.ndarray) -> None:
    """Send a step the worker's engine holds at its start (``gate``), then one more: the worker
    runs the first and queues the second (a session opened with a return address)."""
    gate.hold()
    await s.send_ahead(hidden_state=row, relay_tag=3)
    with trio.fail_after(10):
        while gate.waiting == 0:
            await trio.sleep(0.001)
    await s.send_ahead(hidden_state=row, relay_tag=4)
    call = w.call(s.session_id)
    assert call is not None
    with trio.fail_after(10):
        while call._queued is None:  # noqa: SLF001
            await trio.sleep(0.001)


async def test_a_step_queued_behind_one_that_fails_is_not_run() -> None:
    """A session opened with a return address queues one step behind the running one; when
    the running one fails (here: a Cancel), the queued one is answered CANCELLED
    (QUEUED_STEP_DROPPED) without running, and the session holds what it held."""
    gates = [StepGate() for _ in THREE]
    async with relay_shards(THREE, gates=gates) as chain:
        last = chain[2]
        route = pb.Route(return_to=pb.ReturnAddress(
            target="127.0.0.1:1", session_id="up", secret=b"s" * 16))
        row = np.ones((1, MODEL.n_embd), dtype=np.float32)
        async with ShardClient.connect(last.target, timeout=TIMEOUT) as client:
            async with client.session("q.0>>", route=route) as s:
                await s.prefill(hidden_states=np.ones((3, MODEL.n_embd), dtype=np.float32))
                # two steps back to back are both served, in order
                await s.send_ahead(hidden_state=row, relay_tag=1)
                await s.send_ahead(hidden_state=row, relay_tag=2)
                a, b = await s.read_ahead(), await s.read_ahead()
                assert (a.start_position, b.start_position) == (3, 4)
                await one_running_one_queued(s, gates[2], last, row)
                assert (await client.cancel("q.0>>")).was_running
                gates[2].release()
                with pytest.raises(ShardError) as first:
                    await s.read_ahead()
                with pytest.raises(ShardError) as second:
                    await s.read_ahead()
                assert first.value.code == second.value.code == ErrorCode.CANCELLED
                assert second.value.reason == "QUEUED_STEP_DROPPED"
                assert s.usage.n_past == 5
                assert (await s.decode(hidden_state=row)).start_position == 5
        await free_within(chain)


async def test_a_return_address_on_a_worker_that_may_not_connect_out_is_refused() -> None:
    async with relay_shards(THREE, relay=[True, True, False]) as chain:
        route = pb.Route(return_to=pb.ReturnAddress(target="127.0.0.1:1", session_id="up", secret=b"s"))
        async with ShardClient.connect(chain[2].target, timeout=TIMEOUT) as client:
            with pytest.raises(ShardError) as info:
                await client.open_session("r.0", route=route)
            assert info.value.code == ErrorCode.PERMISSION_DENIED
            assert "--allow-relay" in info.value.message
        await free_within(chain)


async def test_running_ahead_within_a_credit_of_one() -> None:
    """The first hop takes a credit per step before computing it, one step ahead of what it
    delivered: with a window of one it must deliver the step in flight first (no deadlock)."""
    async with relay_shards(THREE) as chain:
        want = await reference(IDS, 12)
        async with ShardClient.connect(chain[0].target, timeout=TIMEOUT) as client:
            async with client.session("k.0", route=returning_route(chain), credit=1) as s:
                with trio.fail_after(20):
                    got = [step async for step in s.generate(IDS, max_tokens=12, ignore_eos=True)]
        assert [g.logits for g in got] == [w.logits for w in want]
        assert await used(chain[0]) > 0
        await free_within(chain)
