"""Chain relay (issue 17, part 2): workers that relay hidden states to each other.

Live workers on loopback ports, FakeEngine shards (exact layer ranges) and the tiny llama model:
a chain-relayed pipeline must give the client-relayed pipeline's (and the whole-model worker's)
tokens and log-probabilities; a cancel, a reset, a Cancel RPC or the deadline on the first hop
must free every hop (``GetMetrics`` on every worker: no session, no KV cell, nothing retained)
within a second and without the client's help; a worker not started with relay refuses a route;
a downstream failure names the hop; older clients and older workers keep working.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import grpc
import pytest
import trio

from rpc_harness import MAX_SESSIONS, MODEL, N_CTX, Requests, StepGate, Worker, in_thread, req, worker
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.client import ShardClient, ShardError
from shard.deadlines import RELAY_DEADLINE_MARGIN
from shard.engine import LayerRange, LoadSpec
from shard.engine.fake import FakeEngine, FakeScript, FakeStep
from shard.pipeline import Pipeline, PipelineError
from shard.relay import ChainRelay
from shard.rpc.errors import ErrorCode, unwrap_single_exception
from shard.v1 import shard_pb2 as pb
from test_pipeline import PROMPT, TIMEOUT, assert_all_free, cuts_to_ranges, whole_model_steps

N_TOKENS = 40
CHAINS = {"2-hops": [0, 2, 4], "3-hops": [0, 1, 3, 4]}
THREE = cuts_to_ranges([0, 1, 3, 4])


@asynccontextmanager
async def relay_shards(
    ranges: Sequence[LayerRange], *, relay: Sequence[bool] | None = None, latency: float = 0.0,
    gates: Sequence[StepGate] | None = None, fail_at_step: dict[int, int] | None = None,
    on_step: Any = None, relays: Sequence[ChainRelay | None] | None = None,
) -> AsyncIterator[list[Worker]]:
    """One live FakeEngine worker per range; ``relay[i]``: started with relay allowed
    (default: every one), with ``relays[i]`` if given (default: ``ChainRelay()``)."""
    async with AsyncExitStack() as stack:
        workers = []
        for i, lr in enumerate(ranges):
            gate = gates[i] if gates is not None else StepGate()

            async def hook(step: FakeStep, gate: StepGate = gate, i: int = i) -> None:
                if on_step is not None:
                    on_step(i, step)  # may raise (a scripted step error)
                await gate(step)

            engine = FakeEngine(model=MODEL, script=FakeScript(
                step_latency=latency, on_step=hook, fail_at_step=(fail_at_step or {}).get(i)))
            spec = LoadSpec(n_ctx=N_CTX, max_sessions=MAX_SESSIONS, layer_range=lr)
            allowed = relay[i] if relay is not None else True
            given = relays[i] if relays is not None else None
            workers.append(await stack.enter_async_context(worker(
                engine=engine, gate=gate, load=spec,
                relay=(given or ChainRelay()) if allowed else None)))
        yield workers


def route_of(workers: Sequence[Worker], ranges: Sequence[LayerRange]) -> pb.Route:
    return pb.Route(hops=[
        pb.RouteHop(target=w.target, expected_model_fingerprint=MODEL.fingerprint(),
                    expected_layer_range=pb.LayerRange(start=r.start, end=r.end))
        for w, r in zip(workers, ranges)
    ])


async def free_within(workers: Sequence[Worker], seconds: float = 1.0) -> None:
    """Every worker reports no session, no KV cell and nothing retained within ``seconds``,
    asked over the wire (GetMetrics), without anyone calling Release."""
    with trio.fail_after(seconds):
        while True:
            try:
                await assert_all_free(workers)
                return
            except AssertionError:
                await trio.sleep(0.01)


async def after_steps(gate: StepGate, n: int) -> None:
    with trio.fail_after(10):
        while gate.steps < n:
            await trio.sleep(0.001)


# ---- equivalence -----------------------------------------------------------------------------


@pytest.mark.parametrize("cuts", list(CHAINS.values()), ids=list(CHAINS))
@pytest.mark.parametrize("chunk", [1, 5, 64])
async def test_chain_relay_gives_the_client_relays_and_the_whole_models_results(
    cuts: list[int], chunk: int
) -> None:
    async with relay_shards([LayerRange(0, 4), *cuts_to_ranges(cuts)]) as (whole, *chain):
        want = await whole_model_steps(
            whole.target, PROMPT, max_tokens=N_TOKENS, ignore_eos=True, top_logprobs=5)
        results = {}
        for relay in ("client", "chain"):
            seen: list[int] = []
            async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT, relay=relay) as pipe:
                results[relay] = got = await pipe.generate(
                    PROMPT, max_tokens=N_TOKENS, ignore_eos=True, top_logprobs=5,
                    chunk_tokens=chunk, on_token=lambda s: seen.append(s.logits.token_id))
            assert got.tokens == seen
        client, chained = results["client"], results["chain"]
        assert chained.tokens == client.tokens == [s.logits.token_id for s in want]
        assert chained.prompt_tokens == client.prompt_tokens == len(PROMPT) + 1
        assert chained.finish_reason == client.finish_reason == pb.FINISH_REASON_LENGTH
        for c, r, w in zip(chained.steps, client.steps, want, strict=True):
            assert c.logits == r.logits == w.logits  # bit for bit
            assert c.n_past == r.n_past == w.n_past
            assert c.finish_reason == r.finish_reason
        # the client opened one session (hop 0's); the workers opened the others
        assert [w.engine.metrics().sessions_opened_total for w in chain] == [2] * len(chain)
        assert all(len(w.calls) == 2 for w in chain)
        await assert_all_free([whole, *chain])


async def test_chain_relay_carries_float16_between_the_workers() -> None:
    """hidden_dtype="float16": every worker-to-worker session is float16 (as each client-relay
    hop is), and the results are the client relay's (float16 -> float32 -> float16 is exact)."""
    async with relay_shards(THREE) as chain:
        targets = [w.target for w in chain]
        got = {}
        for relay in ("client", "chain"):
            async with Pipeline.connect(targets, timeout=TIMEOUT, relay=relay,
                                        hidden_dtype="float16") as pipe:
                got[relay] = await pipe.generate(PROMPT, max_tokens=12, ignore_eos=True, top_logprobs=3)
        assert [s.logits for s in got["chain"].steps] == [s.logits for s in got["client"].steps]
        assert [w.calls[-1].ctx.wire_dtype for w in chain] == ["float16"] * 3
        await assert_all_free(chain)


async def test_chain_relay_keeps_sampling_and_the_stop_rules() -> None:
    async with relay_shards(THREE) as chain:
        targets = [w.target for w in chain]
        prompt = [1, *(3 + b for b in b"sampled")]
        params: dict[str, Any] = dict(temperature=0.9, seed=11)
        got = {}
        for relay in ("client", "chain"):
            async with Pipeline.connect(targets, timeout=TIMEOUT, relay=relay) as pipe:
                full = await pipe.generate(prompt, max_tokens=N_TOKENS, chunk_tokens=3, **params)
                stop = full.tokens[len(full.tokens) // 2]
                stopped = await pipe.generate(prompt, max_tokens=N_TOKENS, stop_tokens=[stop], **params)
                one = await pipe.generate(prompt, max_tokens=1, **params)
                got[relay] = (full.tokens, full.finish_reason, stopped.tokens,
                              stopped.finish_reason, one.tokens, one.finish_reason)
        assert got["chain"] == got["client"]
        assert got["chain"][3] == pb.FINISH_REASON_STOP_TOKEN
        assert got["chain"][5] == pb.FINISH_REASON_LENGTH and len(got["chain"][4]) == 1
        await assert_all_free(chain)


async def test_chain_relay_stops_at_the_chains_smallest_kv_budget() -> None:
    """The first hop reports the least capacity of the chain: CONTEXT_FULL where the client
    relay stops too."""
    async with relay_shards(cuts_to_ranges([0, 2, 4])) as chain:
        targets = [w.target for w in chain]
        prompt = list(range(1, 251))  # 256 positions per session: room for 6 tokens
        out = {}
        for relay in ("client", "chain"):
            async with Pipeline.connect(targets, timeout=TIMEOUT, relay=relay) as pipe:
                r = await pipe.generate(prompt, max_tokens=50, ignore_eos=True)
                out[relay] = (r.tokens, r.finish_reason)
        assert out["chain"] == out["client"]
        assert out["chain"][1] == pb.FINISH_REASON_CONTEXT_FULL
        await assert_all_free(chain)


# ---- cancel, reset, deadline: every hop released by the workers themselves -------------------


@pytest.mark.parametrize("phase", ["prefill", "decode"])
async def test_cancelling_a_chained_pipeline_releases_every_hop(phase: str) -> None:
    gates = [StepGate() for _ in THREE]
    async with relay_shards(THREE, gates=gates, latency=0.001) as chain:
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT, relay="chain") as pipe:
            with trio.CancelScope() as scope:

                async def cancel_midway() -> None:
                    await after_steps(gates[2], 3 if phase == "prefill" else 80)
                    scope.cancel()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(cancel_midway)
                    await pipe.generate(PROMPT * 3, max_tokens=200, ignore_eos=True, chunk_tokens=4)
            assert scope.cancelled_caught
            assert (gates[2].steps < len(PROMPT * 3) + 1) is (phase == "prefill")
            await free_within(chain)


@pytest.mark.parametrize("how", ["reset", "release", "deadline"])
async def test_the_first_hops_stream_ending_frees_every_hop_without_the_client(how: str) -> None:
    """A raw routed session on hop 0 (no Pipeline, so nobody Releases the later hops): a reset
    (RST_STREAM), a Release of hop 0's session or the stream deadline tears the chain down."""
    gates = [StepGate() for _ in THREE]
    async with relay_shards(THREE, gates=gates, latency=0.002) as chain:
        async with ShardClient.connect(chain[0].target, timeout=TIMEOUT) as client:
            session = await client.open_session(
                "raw.0", route=route_of(chain[1:], THREE[1:]),
                timeout=1.0 if how == "deadline" else TIMEOUT)
            assert [len(w.calls) for w in chain] == [1, 1, 1]
            assert chain[2].call("raw.0>>") is not None

            async def end_it() -> None:
                await after_steps(gates[2], 20)
                if how == "reset":
                    session.abort()
                elif how == "release":
                    await client.release("raw.0")

            with pytest.raises(ShardError) as info, unwrap_single_exception():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(end_it)
                    await session.prefill(text=PROMPT)
                    async for _ in session.generate(max_tokens=5000, ignore_eos=True):
                        pass
            expected = {"reset": ErrorCode.CANCELLED, "release": ErrorCode.SESSION_NOT_FOUND,
                        "deadline": ErrorCode.DEADLINE_EXCEEDED}[how]
            assert info.value.code == expected, info.value
            ended = trio.current_time()
            await free_within(chain)
            assert trio.current_time() - ended < 1.0
        assert all(w.server.registry.counters["sessions_retained_total"] == 0 for w in chain)


async def test_a_routed_session_whose_connection_drops_is_released_not_retained() -> None:
    """A lost connection normally leaves a session retained for resume; a routed one cannot be
    resumed (the chain behind it is gone), so hop 0 releases it and resets the rest."""
    from rpc_harness import tcp_proxy

    gates = [StepGate() for _ in THREE]
    async with relay_shards(THREE, gates=gates, latency=0.002) as chain, \
            tcp_proxy(chain[0].target) as proxy:
        async with ShardClient.connect(proxy.target, timeout=TIMEOUT) as client:
            session = await client.open_session("drop.0", route=route_of(chain[1:], THREE[1:]))
            with pytest.raises(ShardError), unwrap_single_exception():
                async with trio.open_nursery() as nursery:

                    async def cut() -> None:
                        await after_steps(gates[2], 20)
                        proxy.cut()

                    nursery.start_soon(cut)
                    await session.prefill(text=PROMPT)
                    async for _ in session.generate(max_tokens=5000, ignore_eos=True):
                        pass
        await free_within(chain)
        assert all(w.server.registry.counters["sessions_retained_total"] == 0 for w in chain)


async def test_a_cancel_rpc_stops_the_step_on_every_hop_and_the_session_goes_on() -> None:
    """Cancel on hop 0 while the step runs downstream: forwarded hop by hop, a step-level
    CANCELLED, and the chained session still serves, holding what it reports."""
    gates = [StepGate() for _ in THREE]
    async with relay_shards(THREE, gates=gates) as chain:
        async with ShardClient.connect(chain[0].target, timeout=TIMEOUT) as client:
            async with client.session("c.0", route=route_of(chain[1:], THREE[1:])) as s:
                first = await s.prefill(tokens=[1, 5, 6, 7])
                gates[2].hold()  # the last shard's next step waits: the step is downstream

                async def cancel_when_held() -> None:
                    with trio.fail_after(10):
                        while gates[2].waiting == 0:
                            await trio.sleep(0.001)
                    reply = await client.cancel("c.0")
                    assert reply.found and reply.was_running
                    last = chain[2].call("c.0>>")
                    assert last is not None
                    with trio.fail_after(10):  # the Cancel reached the last hop's step
                        while not last._cancel.requested:  # noqa: SLF001
                            await trio.sleep(0.001)
                    gates[2].release()  # the engine notices at its next position

                try:
                    with pytest.raises(ShardError) as info, unwrap_single_exception():
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(cancel_when_held)
                            await s.decode(first.logits.token_id)
                finally:
                    gates[2].release()  # (also when the test fails: the teardown needs it)
                assert info.value.code == ErrorCode.CANCELLED
                # the last hop's (two after hop 0), said by structure
                assert (info.value.relay_depth, info.value.failed_layers) == (2, (3, 4))
                assert s.usage.n_past == 4  # the step was taken back on every hop
                assert chain[2].engine.metrics().cancelled_total == 1
                again = await s.decode(first.logits.token_id)
                assert again.n_past == 5 and again.HasField("logits")
        await free_within(chain)
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            reference = await pipe.generate([1, 5, 6, 7], max_tokens=2)
        assert reference.steps[1].logits == again.logits


async def test_the_deadline_of_a_chained_pipeline_releases_every_hop() -> None:
    gates = [StepGate() for _ in THREE]
    async with relay_shards(THREE, gates=gates, latency=0.01) as chain:
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT, relay="chain") as pipe:
            started = trio.current_time()
            with pytest.raises(PipelineError) as info:
                await pipe.generate(PROMPT, max_tokens=500, ignore_eos=True, timeout=1.0)
            assert info.value.code == ErrorCode.DEADLINE_EXCEEDED
            ended = trio.current_time()
            assert ended < started + 1.5
        # every hop's stream carried the time left as grpc-timeout, less the relay's margin
        # per hop (each worker's deadline is its receive time + that: the transit between two
        # workers may add a little); so deadlines shrink along the route
        deadlines = [w.calls[-1].deadline for w in chain]
        for k, d in enumerate(deadlines):
            assert started + 0.9 - k * RELAY_DEADLINE_MARGIN < d <= started + 1.0 + 0.25
        assert deadlines == sorted(deadlines, reverse=True)
        await free_within(chain)


# ---- refusals and errors ---------------------------------------------------------------------


async def test_a_worker_without_relay_refuses_a_route_with_a_clear_error() -> None:
    async with relay_shards(cuts_to_ranges([0, 2, 4]), relay=[False, True]) as (a, b):
        async with ShardClient.connect(a.target, timeout=TIMEOUT) as client:
            assert not (await client.capabilities()).relay_allowed
            with pytest.raises(ShardError) as info:
                await client.open_session(route=route_of([b], [LayerRange(2, 4)]))
        err = info.value
        assert err.code == ErrorCode.PERMISSION_DENIED and err.reason == "RELAY_NOT_ALLOWED"
        assert "operator did not allow relay" in err.message and "--allow-relay" in err.message
        assert len(b.calls) == 0  # nothing was opened downstream
        with pytest.raises(PipelineError) as pinfo:
            async with Pipeline.connect([a.target, b.target], timeout=TIMEOUT, relay="chain"):
                pass
        assert pinfo.value.hop_index == 0 and "relay_allowed" in pinfo.value.message
        assert pinfo.value.code == ErrorCode.UNSUPPORTED_FEATURE
        await assert_all_free([a, b])


async def test_a_route_through_a_worker_that_does_not_relay_is_refused_naming_it() -> None:
    """Hop 1 does not relay: hop 0 refuses to open it (its capabilities say so), naming it."""
    async with relay_shards(THREE, relay=[True, False, True]) as chain:
        async with ShardClient.connect(chain[0].target, timeout=TIMEOUT) as client:
            with pytest.raises(ShardError) as info:
                await client.open_session(route=route_of(chain[1:], THREE[1:]))
        err = info.value
        assert err.code == ErrorCode.PERMISSION_DENIED and err.reason == "RELAY_NOT_ALLOWED"
        assert (err.relay_depth, err.failed_layers) == (1, (1, 3))
        assert chain[1].target not in err.message  # named by its place and range, not address
        assert len(chain[2].calls) == 0
        await assert_all_free(chain)


async def test_a_route_expecting_another_model_or_range_is_refused_naming_the_hop() -> None:
    """A route naming another model, or ranges that do not continue the first hop's, is refused
    by the first hop before any connection; a hop that serves other layers than the route says
    is refused by the hop before it, naming it."""
    async with relay_shards(THREE) as chain:
        route = route_of(chain[1:], THREE[1:])
        route.hops[1].expected_model_fingerprint = "another-model"
        async with ShardClient.connect(chain[0].target, timeout=TIMEOUT) as client:
            with pytest.raises(ShardError) as info:
                await client.open_session(route=route)
            err = info.value
            assert err.code == ErrorCode.INVALID_ARGUMENT and err.relay_depth == 0
            assert "route.hops[1] expects model another-model" in err.message
            gap = route_of(chain[1:], [LayerRange(1, 3), LayerRange(2, 4)])  # an overlap
            with pytest.raises(ShardError) as info:
                await client.open_session(route=gap)
            assert info.value.code == ErrorCode.INVALID_ARGUMENT and info.value.relay_depth == 0
            assert "route.hops[1] starts at layer 2, but the route so far ends at layer 3" in info.value.message
            assert len(chain[1].calls) == len(chain[2].calls) == 0  # nothing opened anywhere
            wrong = route_of(chain[1:], [LayerRange(1, 2), LayerRange(2, 4)])  # hop 1 serves [1, 3)
            with pytest.raises(ShardError) as info:
                await client.open_session(route=wrong)
            err = info.value
            assert err.code == ErrorCode.INCOMPATIBLE_MODEL
            assert (err.relay_depth, err.failed_layers) == (1, (1, 2))
            assert "serves layers [1, 3), the route expects [1, 2)" in err.message
        assert len(chain[1].calls) == len(chain[2].calls) == 0
        await assert_all_free(chain)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
async def test_a_downstream_failure_names_the_hop_and_frees_the_others(phase: str) -> None:
    step = 3 if phase == "prefill" else 30
    async with relay_shards(THREE, fail_at_step={2: step}) as chain:
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT, relay="chain") as pipe:
            with pytest.raises(PipelineError) as info:
                await pipe.generate(PROMPT, max_tokens=100, ignore_eos=True, chunk_tokens=4)
        err = info.value
        assert err.code == ErrorCode.ENGINE_FAILURE
        assert err.hop_index == 2 and err.target == chain[2].target
        assert err.message.startswith(f"hop 2 ({chain[2].target}, layers [3, 4)): ")
        await free_within(chain[:2])


async def test_a_step_error_downstream_is_named_and_the_chained_session_goes_on() -> None:
    """A step the last shard's engine refuses: a step-level error naming it; the session
    (every hop's) holds what it held and serves the next step."""
    from shard.engine import InvalidInput

    def refuse_once(i: int, step: FakeStep) -> None:
        if i == 2 and step.position == 3 and not refused:
            refused.append(step)
            raise InvalidInput("scripted refusal")

    refused: list[FakeStep] = []
    async with relay_shards(THREE, on_step=refuse_once) as chain:
        async with ShardClient.connect(chain[0].target, timeout=TIMEOUT) as client:
            async with client.session("e.0", route=route_of(chain[1:], THREE[1:])) as s:
                first = await s.prefill(tokens=[1, 9, 10])
                with pytest.raises(ShardError) as info:
                    await s.decode(first.logits.token_id)
                assert info.value.code == ErrorCode.INVALID_ARGUMENT and refused
                assert (info.value.relay_depth, info.value.failed_layers) == (2, (3, 4))
                assert s.usage.n_past == 3
                nxt = await s.decode(first.logits.token_id)
                assert nxt.n_past == 4
        await free_within(chain)


async def test_a_standby_that_does_not_relay_is_set_aside_in_a_chain() -> None:
    """Hop 0's standby was not started with relay: it could never take over a chain's first
    hop, so it is set aside at connect (a warning), and the chain serves."""
    async with relay_shards([*cuts_to_ranges([0, 2, 4]), LayerRange(0, 2)],
                            relay=[True, True, False]) as (a, b, standby):
        async with Pipeline.connect([[a.target, standby.target], b.target], timeout=TIMEOUT,
                                    relay="chain") as pipe:
            (_, set_aside), _ = pipe.replicas
            assert set_aside.refused is not None and "relay_allowed" in set_aside.refused.message
            got = await pipe.generate(PROMPT, max_tokens=4, ignore_eos=True)
        assert len(got.tokens) == 4 and len(standby.calls) == 0
        await assert_all_free([a, b, standby])


# ---- compatibility ---------------------------------------------------------------------------


async def test_a_v1_0_client_is_served_as_before_by_a_relaying_worker() -> None:
    async with relay_shards([LayerRange(0, 4)]) as (w,):
        async with ShardClient.connect(w.target, timeout=TIMEOUT, version=(1, 0)) as client:
            caps = await client.capabilities()
            assert caps.relay_allowed
            async with client.session() as s:
                assert s.opened.version.minor == 0
                steps = [x async for x in s.generate(text=PROMPT, max_tokens=5, ignore_eos=True)]
                assert s.usage.n_past == 0  # a 1.0 session gets 1.0's fields only
        want = await whole_model_steps(w.target, PROMPT, max_tokens=5, ignore_eos=True)
        assert [x.logits for x in steps] == [x.logits for x in want]


async def test_client_relay_works_with_workers_that_lack_the_capability() -> None:
    """Workers that do not report relay_allowed (older, or not allowed): the default client
    relay is unchanged, and chain relay is refused before any session."""
    async with relay_shards(THREE, relay=[False, False, False]) as chain:
        targets = [w.target for w in chain]
        async with Pipeline.connect(targets, timeout=TIMEOUT) as pipe:
            got = await pipe.generate(PROMPT, max_tokens=6, ignore_eos=True)
        assert len(got.tokens) == 6
        with pytest.raises(PipelineError):
            async with Pipeline.connect(targets, timeout=TIMEOUT, relay="chain"):
                pass
        assert [w.engine.metrics().sessions_opened_total for w in chain] == [1, 1, 1]
        await assert_all_free(chain)


async def test_the_grpcio_client_opens_a_routed_session() -> None:
    async with relay_shards(THREE) as chain:
        route = route_of(chain[1:], THREE[1:])

        def run() -> list[pb.SessionResponse]:
            requests = Requests(
                req(open=pb.OpenSession(session_id="g.0", route=route)),
                req(prefill=pb.Prefill(tokens=pb.TokenIds(ids=[1, 20, 21]))),
            )
            out = []
            with grpc.insecure_channel(chain[0].target) as channel:
                call = channel.stream_stream(
                    "/shard.v1.Shard/Session", request_serializer=lambda m: m.SerializeToString(),
                    response_deserializer=pb.SessionResponse.FromString)
                for msg in call(iter(requests), timeout=TIMEOUT):
                    out.append(msg)
                    if msg.WhichOneof("kind") == "usage":
                        requests.put(req(close=pb.CloseSession()))
                        requests.end()
            return out

        got = await in_thread(run)
        kinds = [m.WhichOneof("kind") for m in got]
        assert kinds == ["opened", "step", "usage", "closed"]
        assert got[1].step.HasField("logits") and got[1].step.n_past == 3
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            want = await pipe.generate([1, 20, 21], max_tokens=1)
        assert got[1].step.logits == want.steps[0].logits
        await free_within(chain)


# ---- the tiny llama model --------------------------------------------------------------------


@pytest.mark.parametrize("cuts", list(CHAINS.values()), ids=list(CHAINS))
async def test_llama_chain_relay_gives_the_client_relays_tokens(cuts: list[int]) -> None:
    from shard.engine.llama import LlamaCppEngine
    from shard.models import ensure_model, ensure_slice

    source = ensure_model("tiny")
    async with AsyncExitStack() as stack:
        chain = []
        for lr in cuts_to_ranges(cuts):
            path = await trio.to_thread.run_sync(ensure_slice, source, lr)
            spec = LoadSpec(model_path=path, layer_range=lr, n_ctx=1024, max_sessions=2, n_threads=1)
            chain.append(await stack.enter_async_context(
                worker(engine=LlamaCppEngine(), load=spec, relay=ChainRelay())))
        got = {}
        for relay in ("client", "chain"):
            async with Pipeline.connect([w.target for w in chain], timeout=120, relay=relay) as pipe:
                got[relay] = await pipe.generate(
                    "hello world, this is a pipeline", max_tokens=36, ignore_eos=True, top_logprobs=4)
        assert got["chain"].tokens == got["client"].tokens and len(got["chain"].tokens) == 36
        for c, r in zip(got["chain"].steps, got["client"].steps, strict=True):
            assert c.logits.token_id == r.logits.token_id
            assert abs(c.logits.logprob - r.logits.logprob) < 1e-4
        await assert_all_free(chain)


# ---- the command line ------------------------------------------------------------------------


async def test_generate_relay_chain_prints_what_client_relay_prints() -> None:
    import json
    import subprocess
    import sys

    async with relay_shards(THREE) as chain:
        pipeline = ",".join(w.target for w in chain)
        out = {}
        for relay in ("client", "chain"):
            proc = await trio.run_process(
                [sys.executable, "-m", "shard.cli", "--log-level", "WARNING", "generate",
                 "--pipeline", pipeline, "--relay", relay, "--json", "--max-tokens", "24", PROMPT],
                capture_stdout=True, capture_stderr=True, check=False)
            assert proc.returncode == 0, proc.stderr
            out[relay] = json.loads(proc.stdout)
        assert out["chain"] == out["client"] and len(out["chain"]["tokens"]) == 24
        assert [len(w.calls) for w in chain] == [2, 2, 2]  # the chain run opened hop 0 only
        proc = await trio.run_process(  # hop 1|standby (unreachable): the chain still serves
            [sys.executable, "-m", "shard.cli", "--log-level", "WARNING", "generate", "--relay",
             "chain", "--json", "--max-tokens", "24", "--pipeline",
             f"{chain[0].target},{chain[1].target}|127.0.0.1:9,{chain[2].target}", PROMPT],
            capture_stdout=True, capture_stderr=True, check=False)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["tokens"] == out["client"]["tokens"]
        await assert_all_free(chain)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--relay-token-file", "t"], "--relay-token-file needs --allow-relay"),
        (["--relay-tls-ca", "ca.pem"], "--relay-tls-ca needs --allow-relay"),
        (["--allow-relay", "--relay-tls-cert", "c.pem"], "--relay-tls-cert and --relay-tls-key go together"),
        (["--allow-relay", "--relay-token-file", "/nonexistent/tokens"], "relay set-up failed"),
    ],
    ids=["token-alone", "ca-alone", "cert-without-key", "missing-token-file"],
)
def test_serve_relay_options_are_checked(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from shard.cli import main

    assert main(["serve", *args]) == 2
    assert words in capsys.readouterr().err


def test_serve_relay_options_build_the_outbound_credentials(tmp_path: Any) -> None:
    from shard.cli import build_parser
    from shard.cli.serve import relay_options as _relay_options

    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret relay\n")
    args = build_parser().parse_args(["serve", "--allow-relay", "--relay-token-file", str(tokens),
                                      "--relay-plaintext-loopback", "--relay-peers", "127.0.0.1"])
    options = _relay_options(args)
    assert options == {"ssl_context": None, "metadata": (("authorization", "Bearer s3cret"),),
                       "peers": "127.0.0.1", "advertise": None, "plaintext_loopback": True}
    assert _relay_options(build_parser().parse_args(["serve"])) is None


async def test_the_relays_outbound_token_reaches_a_worker_that_requires_one(tmp_path: Any) -> None:
    """The next hop requires a bearer token: a relay without one is refused (UNAUTHENTICATED,
    naming the hop); one given the token (``--relay-token-file``) gets through."""
    from shard.rpc.auth import TokenAuthenticator, bearer_metadata

    tokens = tmp_path / "tokens"
    tokens.write_text("hop-secret relay\n")
    ranges = cuts_to_ranges([0, 2, 4])
    async with AsyncExitStack() as stack:
        def spec(lr: LayerRange) -> LoadSpec:
            return LoadSpec(n_ctx=N_CTX, max_sessions=MAX_SESSIONS, layer_range=lr)

        last = await stack.enter_async_context(worker(
            engine=FakeEngine(model=MODEL, script=FakeScript()), load=spec(ranges[1]),
            authorize=TokenAuthenticator(tokens)))
        bare = await stack.enter_async_context(worker(
            engine=FakeEngine(model=MODEL, script=FakeScript()), load=spec(ranges[0]),
            relay=ChainRelay()))
        keyed = await stack.enter_async_context(worker(
            engine=FakeEngine(model=MODEL, script=FakeScript()), load=spec(ranges[0]),
            relay=ChainRelay(metadata=bearer_metadata("hop-secret"), plaintext_loopback=True)))
        route = route_of([last], ranges[1:])
        async with ShardClient.connect(bare.target, timeout=TIMEOUT) as client:
            with pytest.raises(ShardError) as info:
                await client.open_session(route=route)
        assert info.value.code == ErrorCode.UNAUTHENTICATED
        assert (info.value.relay_depth, info.value.failed_layers) == (1, (2, 4))
        async with ShardClient.connect(keyed.target, timeout=TIMEOUT) as client:
            async with client.session(route=route) as s:
                step = await s.prefill(tokens=[1, 2, 3])
                assert step.HasField("logits") and step.n_past == 3
        await free_within([bare, keyed])
        with trio.fail_after(1):  # (its GetMetrics needs the token too: ask the engine)
            while last.engine.metrics().sessions_active or last.engine.metrics().kv_cells_used:
                await trio.sleep(0.01)
