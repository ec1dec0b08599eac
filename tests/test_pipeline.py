"""Pipelines of live workers (FakeEngine shards over real sockets) against one whole-model worker.

Every worker here is a real ``serve()`` on a loopback port; the FakeEngine serves exact layer
ranges (a fake first shard chained into a fake last shard equals the whole fake model), so the
pipeline must reproduce the whole-model worker's tokens and log-probabilities bit for bit.
Every engine is leak-checked when its worker stops (``no_engine_leaks``), and the failure tests
also read every shard's ``GetMetrics`` right after the pipeline call returned: the shielded
Release must already have freed every session and KV cell.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio
from hypothesis import example, given
from hypothesis import strategies as st

from rpc_harness import MAX_SESSIONS, MODEL, N_CTX, StepGate, Worker, tcp_proxy, worker
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.client import ShardClient, ShardError
from shard.engine import LayerRange, LoadSpec
from shard.engine.fake import FakeEngine, FakeModel, FakeScript, FakeStep
from shard.pipeline import CLEANUP_GRACE, RELEASE_TIMEOUT, Pipeline, PipelineError
from shard.relay import ChainRelay
from shard.rpc.errors import ErrorCode
from shard.v1 import shard_pb2 as pb

PROMPT = "the quick brown fox"
N_TOKENS = 40  # >= 32 greedy tokens
TIMEOUT = 30.0


def cuts_to_ranges(cuts: Sequence[int]) -> list[LayerRange]:
    return [LayerRange(a, b) for a, b in zip(cuts, cuts[1:])]


@asynccontextmanager
async def shards(
    ranges: Sequence[LayerRange],
    *,
    model: FakeModel = MODEL,
    latency: float = 0.0,
    gates: Sequence[StepGate] | None = None,
    fail_at_step: dict[int, int] | None = None,
    on_step: Any = None,
    relay: bool = False,
    kv_layout_tags: dict[int, str | None] | None = None,
    engine: type[FakeEngine] = FakeEngine,
    **serve_kwargs: Any,
) -> AsyncIterator[list[Worker]]:
    """One live FakeEngine worker per range (leak-checked when it stops); ``relay``: each one
    relays routes (its own ``ChainRelay``: loopback peers); ``kv_layout_tags[i]``: worker
    ``i`` lays out KV states otherwise (``FakeScript.kv_layout_tag``); ``engine``: a
    FakeEngine subclass to serve (one that records what it is asked)."""
    async with AsyncExitStack() as stack:
        workers = []
        for i, lr in enumerate(ranges):
            gate = gates[i] if gates is not None else StepGate()

            async def hook(step: FakeStep, gate: StepGate = gate, i: int = i) -> None:
                if on_step is not None:
                    on_step(i, step)
                await gate(step)

            served = engine(
                model=model,
                script=FakeScript(
                    step_latency=latency, on_step=hook,
                    fail_at_step=(fail_at_step or {}).get(i),
                    kv_layout_tag=(kv_layout_tags or {}).get(i, ""),
                ),
            )
            spec = LoadSpec(n_ctx=N_CTX, max_sessions=MAX_SESSIONS, layer_range=lr)
            workers.append(
                await stack.enter_async_context(
                    worker(engine=served, gate=gate, load=spec,
                           relay=ChainRelay() if relay else None, **serve_kwargs)
                )
            )
        yield workers


async def whole_model_steps(target: str, prompt: str | list[int], **kw: Any) -> list[pb.StepResult]:
    """The reference: one whole-model worker's Generate."""
    async with ShardClient.connect(target, timeout=TIMEOUT) as client:
        async with client.session() as s:
            return [step async for step in s.generate(
                tokens=prompt if not isinstance(prompt, str) else None,
                text=prompt if isinstance(prompt, str) else None, **kw,
            )]


async def after_steps(gate: StepGate, n: int, action: Callable[[], object]) -> None:
    """Call ``action`` once ``gate`` counted ``n`` engine steps (bounded: a regression fails)."""
    with trio.fail_after(10):
        while gate.steps < n:
            await trio.sleep(0.001)
    action()


async def assert_all_free(workers: Sequence[Worker]) -> None:
    """Every shard, asked over the wire right now: no session, no KV cell, nothing retained."""
    for w in workers:
        async with ShardClient.connect(w.target, timeout=TIMEOUT) as client:
            m = await client.metrics()
        assert m.engine["sessions_active"] == 0, (w.target, dict(m.engine))
        assert m.engine["kv_cells_used"] == 0, (w.target, dict(m.engine))
        assert m.worker["sessions_retained"] == 0, (w.target, dict(m.worker))


# ---- equivalence ---------------------------------------------------------------------------


@pytest.mark.parametrize("cuts", [[0, 2, 4], [0, 1, 3, 4]], ids=["2-workers", "3-workers"])
@pytest.mark.parametrize("chunk", [1, 5, 64])
async def test_pipeline_equals_the_whole_model_worker(cuts: list[int], chunk: int) -> None:
    async with shards([LayerRange(0, 4), *cuts_to_ranges(cuts)]) as (whole, *chain):
        want = await whole_model_steps(
            whole.target, PROMPT, max_tokens=N_TOKENS, ignore_eos=True, top_logprobs=5
        )
        seen: list[int] = []
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            got = await pipe.generate(
                PROMPT, max_tokens=N_TOKENS, ignore_eos=True, top_logprobs=5, chunk_tokens=chunk,
                on_token=lambda step: seen.append(step.logits.token_id),
            )
        assert len(want) == N_TOKENS
        assert got.tokens == [s.logits.token_id for s in want] == seen
        assert got.finish_reason == want[-1].finish_reason == pb.FINISH_REASON_LENGTH
        for g, w in zip(got.steps, want, strict=True):
            assert g.logits == w.logits  # top log-probabilities identical, bit for bit
            assert g.n_past == w.n_past
        assert got.prompt_tokens == len(PROMPT) + 1  # BOS added by the first shard
        await assert_all_free([whole, *chain])


async def test_sampling_and_stop_rules_match_the_worker_generate() -> None:
    """Temperature sampling (a pure function of logits, seed and position), stop tokens and
    EOS end the pipeline exactly where the worker's Generate ends."""
    async with shards([LayerRange(0, 4), *cuts_to_ranges([0, 3, 4])]) as (whole, *chain):
        prompt = [1, *(3 + b for b in b"sampled")]
        params = dict(temperature=0.9, seed=11)
        want = await whole_model_steps(
            whole.target, prompt, max_tokens=N_TOKENS, sampling=pb.SamplingParams(**params)
        )
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            got = await pipe.generate(prompt, max_tokens=N_TOKENS, chunk_tokens=3, **params)
            assert got.tokens == [s.logits.token_id for s in want]
            assert got.finish_reason == want[-1].finish_reason
            stop = got.tokens[len(got.tokens) // 2]
            stopped = await pipe.generate(prompt, max_tokens=N_TOKENS, stop_tokens=[stop], **params)
        assert stopped.tokens == got.tokens[: got.tokens.index(stop) + 1]
        assert stopped.finish_reason == pb.FINISH_REASON_STOP_TOKEN


async def test_float16_hops_are_negotiated_and_halve_the_bytes() -> None:
    async with shards(cuts_to_ranges([0, 2, 4])) as chain:
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            assert all("float16" in h.caps.hidden_wire_dtypes for h in pipe.hops if h.caps)
        async with Pipeline.connect(
            [w.target for w in chain], timeout=TIMEOUT, hidden_dtype="float16"
        ) as pipe:
            got = await pipe.generate(PROMPT, max_tokens=8, ignore_eos=True)
        assert len(got.tokens) == 8
        # the worker really answered in float16: a session asked for it says so, and its
        # hidden states are 2 bytes per value
        async with ShardClient.connect(chain[0].target, timeout=TIMEOUT) as client:
            async with client.session(hidden_wire_dtype="float16") as s:
                assert s.hidden_dtype == "float16"
                step = await s.prefill(tokens=[1, 50, 60])
                assert step.hidden_states.dtype == "float16"
                assert len(step.hidden_states.data) == 3 * MODEL.n_embd * 2
            async with client.session() as s:
                assert s.hidden_dtype == "float32" and s.opened.hidden_wire_dtype == ""


# ---- pipelined prefill ---------------------------------------------------------------------


@pytest.mark.parametrize("chunk, overlaps", [(4, True), (64, False)])
async def test_chunked_prefill_lets_the_next_shard_start_early(chunk: int, overlaps: bool) -> None:
    """Shard 1 computes chunk 1 while shard 0 still computes later chunks (order of engine
    steps, not timing); without chunking it cannot start before shard 0 is done."""
    order: list[tuple[int, int]] = []  # (shard, position) in the order the engines computed
    prompt = [1, *(3 + b for b in b"a prompt of some thirty-two tokens!")]
    async with shards(
        cuts_to_ranges([0, 1, 3, 4]), latency=0.002, on_step=lambda i, s: order.append((i, s.position))
    ) as chain:
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            await pipe.generate(prompt, max_tokens=1, chunk_tokens=chunk)
    last_of_shard0 = order.index((0, len(prompt) - 1))
    first_of_shard1 = order.index((1, 0))
    first_of_shard2 = order.index((2, 0))
    assert (first_of_shard1 < last_of_shard0) is overlaps
    assert (first_of_shard2 < order.index((1, len(prompt) - 1))) is overlaps


# ---- chain checks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ranges, hop, words",
    [
        ([(0, 1), (2, 4)], 1, "gap"),
        ([(0, 2), (1, 4)], 1, "overlap"),
        ([(0, 2)], 0, "ends at layer 2 of 4"),
        ([(2, 4), (0, 2)], 0, "starts at layer 2"),
    ],
    ids=["gap", "overlap", "short", "order"],
)
async def test_chains_that_do_not_tile_the_model_are_refused(
    ranges: list[tuple[int, int]], hop: int, words: str
) -> None:
    async with shards([LayerRange(a, b) for a, b in ranges]) as chain:
        with pytest.raises(PipelineError) as info:
            async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT):
                pass
    err = info.value
    assert err.code == ErrorCode.INCOMPATIBLE_MODEL and err.hop_index == hop
    assert err.target == chain[hop].target and f"hop {hop} ({chain[hop].target}" in err.message
    assert words in err.message


async def test_shards_of_different_models_are_refused() -> None:
    other = FakeModel(n_layers_total=4, n_embd=8, seed=8)
    async with shards([LayerRange(0, 2)]) as (a,), shards([LayerRange(2, 4)], model=other) as (b,):
        with pytest.raises(PipelineError) as info:
            async with Pipeline.connect([a.target, b.target], timeout=TIMEOUT):
                pass
    assert info.value.code == ErrorCode.INCOMPATIBLE_MODEL and info.value.hop_index == 1
    assert other.fingerprint() in info.value.message


async def test_an_unreachable_hop_is_named() -> None:
    async with shards([LayerRange(0, 2)]) as (a,):
        with trio.socket.socket() as sock:
            await sock.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{sock.getsockname()[1]}"  # bound, not listening: refused
            with pytest.raises(PipelineError) as info:
                async with Pipeline.connect([a.target, dead], timeout=TIMEOUT):
                    pass
    assert info.value.hop_index == 1 and info.value.target == dead
    assert info.value.code == ErrorCode.NOT_READY


# ---- cancel, deadline, failure, disconnect ---------------------------------------------------


THREE = cuts_to_ranges([0, 1, 3, 4])


@pytest.mark.parametrize("phase", ["prefill", "decode"])
async def test_cancel_releases_every_shard(phase: str) -> None:
    gates = [StepGate() for _ in THREE]
    async with shards(THREE, gates=gates, latency=0.001) as chain:
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            with trio.CancelScope() as scope:

                async def cancel_midway() -> None:
                    # the middle shard is at its 3rd step (mid-prefill) or 80th (mid-decode)
                    target = 3 if phase == "prefill" else 80
                    with trio.fail_after(10):
                        while gates[1].steps < target:
                            await trio.sleep(0)
                    scope.cancel()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(cancel_midway)
                    await pipe.generate(PROMPT * 3, max_tokens=200, ignore_eos=True, chunk_tokens=4)
            assert scope.cancelled_caught
            n_prompt = len(PROMPT * 3) + 1
            assert (gates[1].steps < n_prompt) is (phase == "prefill")
            await assert_all_free(chain)  # at once: the shielded Release already ran


async def test_cancelling_a_scope_around_connect_also_releases_every_shard() -> None:
    """The connections outlive the cancellation long enough for the cleanup to use them."""
    gates = [StepGate() for _ in THREE]
    async with shards(THREE, gates=gates) as chain:
        with trio.CancelScope() as scope:
            async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(after_steps, gates[2], 20, scope.cancel)
                    await pipe.generate(PROMPT, max_tokens=500, ignore_eos=True)
        assert scope.cancelled_caught
        await assert_all_free(chain)
        assert all(w.server.registry.counters["sessions_retained_total"] == 0 for w in chain)


async def test_deadline_travels_to_every_hop_and_releases_every_shard() -> None:
    async with shards(THREE, latency=0.01) as chain:
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            client = pipe._clients[0]
            open_session = client.open_session

            async def slow_open(*args: Any, **kwargs: Any) -> Any:
                session = await open_session(*args, **kwargs)
                await trio.sleep(0.5)  # half the budget is gone before hops 1 and 2 open
                return session

            client.open_session = slow_open  # type: ignore[method-assign]
            started = trio.current_time()
            with pytest.raises(PipelineError) as info:
                await pipe.generate(PROMPT, max_tokens=500, ignore_eos=True, timeout=1.0)
        err = info.value
        assert err.code == ErrorCode.DEADLINE_EXCEEDED
        assert f"hop {err.hop_index} ({chain[err.hop_index].target}" in err.message
        for w in chain:  # each hop's stream carried the remaining budget as grpc-timeout
            deadline = w.calls[-1].deadline  # the worker's: its receive time + grpc-timeout
            assert started + 0.9 < deadline <= started + 1.0 + 0.25  # + transit, on a loaded machine
        await assert_all_free(chain)


async def test_a_failing_hop_is_named_and_every_shard_is_released() -> None:
    async with shards(THREE, fail_at_step={1: 30}) as chain:
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            with pytest.raises(PipelineError) as info:
                await pipe.generate(PROMPT, max_tokens=100, ignore_eos=True)
        err = info.value
        assert err.code == ErrorCode.ENGINE_FAILURE and err.hop_index == 1
        assert err.target == chain[1].target and "layers [1, 3)" in err.message
        await assert_all_free([chain[0], chain[2]])  # the failed engine refuses new work


async def test_a_worker_that_goes_away_is_named_and_the_others_are_released() -> None:
    gates = [StepGate() for _ in THREE]
    async with shards(THREE, gates=gates) as chain:
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(after_steps, gates[2], 25, chain[2].stop)
                with pytest.raises(PipelineError) as info:
                    await pipe.generate(PROMPT, max_tokens=200, ignore_eos=True)
        assert info.value.hop_index == 2 and info.value.target == chain[2].target
        await assert_all_free(chain[:2])


async def test_a_dropped_connection_to_a_live_worker_is_released_through_a_new_one() -> None:
    """Only the pipeline's connection to hop 1 drops; its worker lives on and retains the session
    for resume. The pipeline names the hop and releases that session over a new connection, so
    no live worker keeps anything."""
    gates = [StepGate() for _ in THREE]
    async with shards(THREE, gates=gates, latency=0.002) as chain, tcp_proxy(chain[1].target) as proxy:
        targets = [chain[0].target, proxy.target, chain[2].target]
        async with Pipeline.connect(targets, timeout=TIMEOUT) as pipe:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(after_steps, gates[2], 25, proxy.cut)
                with pytest.raises(PipelineError) as info:
                    await pipe.generate(PROMPT, max_tokens=200, ignore_eos=True)
        assert info.value.hop_index == 1 and info.value.target == proxy.target
        await assert_all_free(chain)  # hop 1's worker too: nothing retained
        assert proxy.accepted == 2  # the pipeline's connection, then the Release's


async def test_hop_deadlines_are_rounded_down_never_past_the_callers() -> None:
    """grpc-timeout carries whole seconds from 99 s on: a hop gets the time left rounded down,
    so its worker's deadline (its receive time + grpc-timeout) is never after the caller's."""
    async with shards(THREE) as chain:
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            started = trio.current_time()
            await pipe.generate(PROMPT, max_tokens=2, timeout=150.0)
        for w in chain:
            assert started + 148 < w.calls[-1].deadline <= started + 150.0


async def test_the_cleanup_ends_within_the_grace_after_the_callers_deadline() -> None:
    """Workers whose Release hangs: the shielded cleanup gives up CLEANUP_GRACE after the
    caller's deadline (before: RELEASE_TIMEOUT after it). The resets and the workers' own
    deadlines free every session anyway."""
    assert CLEANUP_GRACE + 1.0 < RELEASE_TIMEOUT  # what the bound below tells apart
    gates = [StepGate() for _ in THREE]
    async with shards(THREE, gates=gates) as chain:
        for w in chain:
            release = w.server.registry.release

            async def hanging_release(sid: str, release: Any = release) -> bool:
                await trio.sleep(60)
                return await release(sid)

            w.server.registry.release = hanging_release
        gates[1].hold()  # the middle shard's first step never ends: the deadline passes
        try:
            async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
                deadline = trio.current_time() + 1.0
                with pytest.raises(PipelineError) as info:
                    await pipe.generate(PROMPT, max_tokens=50, timeout=1.0)
                ended = trio.current_time()
        finally:
            gates[1].release()
        assert info.value.code == ErrorCode.DEADLINE_EXCEEDED and info.value.hop_index == 1
        assert ended < deadline + CLEANUP_GRACE + 1.0  # + generous slack for a loaded machine
        for w in chain:
            await w.idle()
        await assert_all_free(chain)


# ---- what a shard refuses (the hop before it misbehaving) ------------------------------------


@pytest.mark.parametrize(
    "tensor, words",
    [
        (pb.Tensor(data=b"\0" * 4 * 3 * 7, shape=[3, 7], dtype="float32"), "shape"),
        (pb.Tensor(data=b"\0" * 2 * 3 * 8, shape=[3, 8], dtype="float16"), "dtype"),
        (pb.Tensor(data=b"\0" * 4 * 3 * 8, shape=[3, 8], dtype="bfloat16"), "dtype"),
        (pb.Tensor(data=b"\0" * 4 * 2 * 8, shape=[3, 8], dtype="float32"), "bytes"),
        (pb.Tensor(data=np.full((3, 8), np.inf, "<f4").tobytes(), shape=[3, 8], dtype="float32"), "NaN or infinite"),
        (pb.Tensor(data=np.full((3, 8), np.nan, "<f4").tobytes(), shape=[3, 8], dtype="float32"), "NaN or infinite"),
    ],
    ids=["shape", "float16-on-float32-session", "unknown-dtype", "size", "inf", "nan"],
)
async def test_bad_hidden_states_are_refused_and_the_session_stays_usable(
    tensor: pb.Tensor, words: str
) -> None:
    async with shards([LayerRange(1, 3)]) as (w,):
        async with ShardClient.connect(w.target, timeout=TIMEOUT) as client:
            async with client.session() as s:
                step = await _raw_prefill(s, tensor)
                assert step.code == ErrorCode.INVALID_ARGUMENT and words in step.message
                good = await s.prefill(hidden_states=np.ones((3, 8), np.float32))
                assert good.n_past == 3
                with pytest.raises(Exception) as info:
                    await s.decode(hidden_state=np.ones((2, 8), np.float32))
                assert info.value.code == ErrorCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
                assert "expected 1 hidden-state row(s), got 2" in str(info.value)
        assert w.engine.metrics().prefill_tokens_total == 3  # nothing bad reached the engine


async def _raw_prefill(session: Any, tensor: pb.Tensor) -> Any:
    """Send a Prefill with a hand-made tensor; return the in-stream error."""
    from shard.client import ShardError

    req = session._request(prefill=pb.Prefill(hidden_states=tensor))
    try:
        await session._one_step(req)
    except ShardError as err:
        return err
    raise AssertionError("the bad tensor was accepted")


async def test_float16_sessions_refuse_non_finite_and_float32_tensors() -> None:
    async with shards([LayerRange(1, 3)]) as (w,):
        async with ShardClient.connect(w.target, timeout=TIMEOUT) as client:
            async with client.session(hidden_wire_dtype="float16") as s:
                f32 = pb.Tensor(data=b"\0" * 4 * 8, shape=[1, 8], dtype="float32")
                assert "dtype" in (await _raw_prefill(s, f32)).message
                inf16 = pb.Tensor(data=np.full((1, 8), np.inf, "<f2").tobytes(), shape=[1, 8], dtype="float16")
                assert "NaN or infinite" in (await _raw_prefill(s, inf16)).message
                ok = await s.prefill(hidden_states=np.full((2, 8), 0.5, np.float32))
                assert ok.n_past == 2 and ok.HasField("hidden_states") and ok.hidden_states.dtype == "float16"


async def test_open_refuses_a_wrong_range_or_dtype() -> None:
    async with shards([LayerRange(1, 3)]) as (w,):
        async with ShardClient.connect(w.target, timeout=TIMEOUT) as client:
            with pytest.raises(Exception) as info:
                await client.open_session(expected_layer_range=(0, 3))
            assert info.value.code == ErrorCode.INCOMPATIBLE_MODEL  # type: ignore[attr-defined]
            assert "serves layers [1, 3), not [0, 3)" in str(info.value)
            with pytest.raises(Exception) as info:
                await client.open_session(hidden_wire_dtype="bfloat16")
            assert info.value.code == ErrorCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
            assert "hidden_wire_dtype" in str(info.value)
            async with client.session(expected_layer_range=(1, 3)) as s:
                assert s.opened.kv_capacity > 0
        await assert_all_free([w])


def test_float16_encoding_refuses_overflow_instead_of_sending_infinities() -> None:
    from shard.client import ShardError
    from shard.rpc.convert import array_to_tensor, tensor_to_array

    rows = np.array([[1.5, -2.25, 1000.0, 0.0]], np.float32)
    t = array_to_tensor(rows, "float16")
    assert t.dtype == "float16" and len(t.data) == 8
    assert np.array_equal(tensor_to_array(t, 4, dtype="float16"), rows)  # exact in float16
    with pytest.raises(ShardError) as info:
        array_to_tensor(np.array([[70000.0, 0, 0, 0]], np.float32), "float16")
    assert info.value.reason == "FLOAT16_OVERFLOW"


async def test_a_chunk_larger_than_a_message_is_refused_before_any_work() -> None:
    from shard.rpc.transport import TransportLimits

    limits = TransportLimits(max_message_bytes=16384)
    async with shards(cuts_to_ranges([0, 2, 4]), transport_limits=limits) as chain:
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            with pytest.raises(PipelineError) as info:
                await pipe.generate(PROMPT, max_tokens=2, chunk_tokens=600)
            assert info.value.code == ErrorCode.INVALID_ARGUMENT and info.value.hop_index == 1
            assert "19200-byte" in info.value.message
            got = await pipe.generate(PROMPT, max_tokens=2, chunk_tokens=16)
            assert len(got.tokens) == 2
        assert all(w.engine.metrics().sessions_opened_total == 1 for w in chain)


# ---- bytes on the wire (the table in docs/pipelines.md) ---------------------------------------

GRPC_PREFIX = 5  # gRPC message framing: 1 flag byte + 4 length bytes
BENCH_N_EMBD = 1024


def wire_sizes(n_tokens: int, n_embd: int, dtype: str) -> tuple[int, int, int]:
    """(tensor data, request to the next shard, result from the previous shard) in bytes, each
    message serialized for real plus its gRPC framing. Step and position numbers are those of
    a decode at position ~600 (varints: a few bytes either way)."""
    from shard.rpc.convert import array_to_tensor

    rows = np.random.default_rng(0).standard_normal((n_tokens, n_embd)).astype(np.float32)
    t = array_to_tensor(rows, dtype)
    V = pb.ProtocolVersion(major=1)
    if n_tokens == 1:
        req = pb.SessionRequest(version=V, decode=pb.Decode(hidden_state=t, sampling=pb.SamplingParams()))
    else:
        req = pb.SessionRequest(version=V, prefill=pb.Prefill(hidden_states=t, position=pb.Position(value=0)))
    res = pb.SessionResponse(step=pb.StepResult(
        step=600, n_past=600, tokens_processed=n_tokens, hidden_states=t, start_position=599
    ))
    return len(t.data), req.ByteSize() + GRPC_PREFIX, res.ByteSize() + GRPC_PREFIX


def test_docs_state_the_bytes_per_step_measured_on_real_messages() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "pipelines.md").read_text()
    for dtype in ("float32", "float16"):
        for n, what in ((1, "decode step"), (512, "512-token prefill")):
            data, request, result = wire_sizes(n, BENCH_N_EMBD, dtype)
            row = f"| {what} | {dtype} | {data:,} | {request:,} | {result:,} | {request + result:,} |"
            assert row in doc, row
    half = wire_sizes(1, BENCH_N_EMBD, "float16")
    full = wire_sizes(1, BENCH_N_EMBD, "float32")
    assert half[0] * 2 == full[0]


# ---- properties ------------------------------------------------------------------------------


@example(n_layers=1, ranges=[(0, 1), (1, 1)])  # an empty range after a full one
@given(
    n_layers=st.integers(1, 8),
    ranges=st.lists(st.tuples(st.integers(0, 8), st.integers(1, 8)), min_size=1, max_size=5),
)
def test_chain_check_accepts_exactly_the_tilings(n_layers: int, ranges: list[tuple[int, int]]) -> None:
    from shard.pipeline import Hop, check_chain

    hops = [
        Hop(i, f"h{i}:1", pb.GetCapabilitiesResponse(
            model_fingerprint="f", n_layers_total=n_layers, n_embd=8,
            layer_range=pb.LayerRange(start=a, end=b),
        ))
        for i, (a, b) in enumerate(ranges)
    ]
    tiles = ranges[0][0] == 0 and ranges[-1][1] == n_layers and all(
        a < b for a, b in ranges
    ) and all(prev[1] == nxt[0] for prev, nxt in zip(ranges, ranges[1:]))
    try:
        check_chain(hops)
    except PipelineError as err:
        assert not tiles, err
        assert err.code == ErrorCode.INCOMPATIBLE_MODEL and 0 <= err.hop_index < len(hops)
    else:
        assert tiles


@given(
    dtype=st.sampled_from(["float32", "float16", "bfloat16", ""]),
    session=st.sampled_from(["float32", "float16"]),
    shape=st.lists(st.integers(0, 5), max_size=3),
    data=st.binary(max_size=80),
    rows=st.none() | st.integers(1, 3),
)
def test_tensor_validation_accepts_only_well_formed_finite_tensors(
    dtype: str, session: str, shape: list[int], data: bytes, rows: int | None
) -> None:
    """Any bytes: a finite float32 array of the declared shape, or INVALID_ARGUMENT."""
    from shard.client import ShardError
    from shard.rpc.convert import tensor_to_array

    msg = pb.Tensor(data=data, shape=shape, dtype=dtype)
    try:
        arr = tensor_to_array(msg, 4, dtype=session, rows=rows)
    except ShardError as err:
        assert err.code == ErrorCode.INVALID_ARGUMENT
        return
    assert dtype == session and arr.dtype == np.float32 and list(arr.shape) == shape
    assert shape[1] == 4 and shape[0] > 0 and (rows is None or shape[0] == rows)
    assert np.isfinite(arr).all()


async def test_a_chunked_text_prompt_past_the_context_is_refused_before_any_chunk() -> None:
    """Issue 33, finding 12: a text prompt sent in chunks that tokenizes to more positions than
    a session holds (the fake: a token per byte, 301 for 256) is refused at once, with the right
    count, computing nothing and leaving the session as it was; through a pipeline no hop
    computes anything (the hops had computed 8 chunks, then refused the ninth)."""
    text = "x" * 300  # + BOS: 301 positions; a session holds 256
    async with shards([LayerRange(0, 4), *THREE]) as (whole, *chain):
        async with ShardClient.connect(whole.target, timeout=TIMEOUT) as client:
            async with client.session() as s:
                await s.prefill(tokens=[1, 5, 6])
                got: list[pb.StepResult] = []
                with pytest.raises(ShardError) as info:
                    async for step in s.prefill_chunks(text=text, chunk_tokens=32):
                        got.append(step)
                assert got == [] and s.usage.n_past == 3
                # (3 held, then 300 tokens: no BOS past position 0)
                assert "303 positions exceed the per-session context of 256" in info.value.message
                assert info.value.code == ErrorCode.INVALID_ARGUMENT
        assert whole.engine.metrics().prefill_tokens_total == 3
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            with pytest.raises(PipelineError) as pinfo:
                await pipe.generate(text, max_tokens=4, chunk_tokens=32)
        assert pinfo.value.hop_index == 0 and "301 positions exceed" in pinfo.value.message
        assert [w.engine.metrics().prefill_tokens_total for w in chain] == [0, 0, 0]
        await assert_all_free([whole, *chain])


async def test_a_whole_model_hop_sends_its_prompt_right_behind_the_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pipeline of one whole-model worker opens its session ahead: the first ``Prefill``
    follows ``OpenSession`` before ``SessionOpened`` is read (one round trip less to the first
    token), with the same tokens as the worker's own Generate; a full worker's refusal
    then fails the first step with the open's error, and nothing is left behind."""
    from shard.client import ClientSession

    events: list[str] = []
    send, nxt = ClientSession._send, ClientSession._next

    async def sending(self: ClientSession, req: pb.SessionRequest) -> None:
        events.append(f"send {req.WhichOneof('kind')}")
        await send(self, req)

    async def reading(self: ClientSession) -> pb.SessionResponse:
        msg = await nxt(self)
        events.append(f"read {msg.WhichOneof('kind')}")
        return msg

    async with shards([LayerRange(0, 4)]) as (whole,):
        want = await whole_model_steps(whole.target, PROMPT, max_tokens=N_TOKENS, ignore_eos=True)
        monkeypatch.setattr(ClientSession, "_send", sending)
        monkeypatch.setattr(ClientSession, "_next", reading)
        async with Pipeline.connect([whole.target], timeout=TIMEOUT) as pipe:
            got = await pipe.generate(PROMPT, max_tokens=N_TOKENS, ignore_eos=True)
            assert got.tokens == [s.logits.token_id for s in want]
            assert events[:3] == ["send open", "send prefill", "read opened"], events
            async with ShardClient.connect(whole.target, timeout=TIMEOUT) as client, \
                    AsyncExitStack() as held:
                for i in range(MAX_SESSIONS):
                    await held.enter_async_context(client.session(f"full-{i}"))
                events.clear()
                with pytest.raises(PipelineError) as info:
                    await pipe.generate(PROMPT, max_tokens=4)
                assert info.value.cause.code is ErrorCode.RESOURCE_EXHAUSTED
                assert events[:2] == ["send open", "send prefill"], events
        await assert_all_free([whole])
