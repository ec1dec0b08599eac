"""Pipelines whose hops have replicas: a hop that fails moves to another worker and replays.

The workers are live FakeEngine workers on loopback (as in test_pipeline.py); the fake
computes every position exactly, whatever the batching, so after a failover the pipeline
must still reproduce the whole-model worker's tokens *and* log-probabilities bit for bit, and
the caller must see every token once. After each case every live worker is asked over the
wire: no session, no KV cell, nothing retained. The same with real ``trio-shard serve``
processes and signals (SIGKILL, SIGSTOP, SIGTERM) is tests/test_failover_chaos.py.

``relay``: the cases that apply to both run with client relay and with chain relay (the workers
relay to each other; a later hop's failure moves the client's route to its replica and the token
log is replayed through the first hop).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from rpc_harness import StepGate, Worker, tcp_proxy
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.client import ShardClient
from shard.engine import LayerRange
from shard.pipeline import Pipeline, PipelineError, hop_targets
from shard.pipeline.replay import ReplayBudget, RowLog
from shard.rpc.errors import ErrorCode, unwrap_single_exception
from shard.v1 import shard_pb2 as pb
from test_pipeline import PROMPT, TIMEOUT, after_steps, assert_all_free, shards, whole_model_steps

N_TOKENS = 40
LONG = PROMPT * 3  # 57 positions with BOS: a prefill of several chunks
#: whole model, then hop 0 (two replicas), hop 1 (two), hop 2 (two)
RANGES = [LayerRange(0, 4), LayerRange(0, 1), LayerRange(0, 1), LayerRange(1, 3),
          LayerRange(1, 3), LayerRange(3, 4), LayerRange(3, 4)]


RELAYS = ["client", "chain"]


@asynccontextmanager
async def fleet(
    relay: str = "client", **kwargs: Any
) -> AsyncIterator[tuple[Worker, list[list[Worker]], list[StepGate]]]:
    """A whole-model worker and two replicas of each of three hops (with their step gates);
    ``relay="chain"``: every worker relays routes."""
    gates = [StepGate() for _ in RANGES]
    async with shards(RANGES, gates=gates, relay=relay == "chain", **kwargs) as (whole, *ws):
        yield whole, [ws[0:2], ws[2:4], ws[4:6]], gates[1:]


def gate_of(gates: list[StepGate], hop: int, replica: int) -> StepGate:
    return gates[2 * hop + replica]


async def reference(whole: Worker, prompt: str | list[int] = LONG) -> list[pb.StepResult]:
    return await whole_model_steps(
        whole.target, prompt, max_tokens=N_TOKENS, ignore_eos=True, top_logprobs=5
    )


def assert_same(got: Any, want: list[pb.StepResult], seen: list[int]) -> None:
    """Tokens, log-probabilities and positions of the whole model, each token seen once."""
    assert got.tokens == [s.logits.token_id for s in want] == seen
    for g, w in zip(got.steps, want, strict=True):
        assert g.logits == w.logits and g.n_past == w.n_past
    assert got.finish_reason == want[-1].finish_reason


async def generate(pipe: Pipeline, prompt: str | list[int] = LONG, **kw: Any) -> tuple[Any, list[int]]:
    seen: list[int] = []
    got = await pipe.generate(
        prompt, max_tokens=N_TOKENS, ignore_eos=True, top_logprobs=5, chunk_tokens=4,
        on_token=lambda step: seen.append(step.logits.token_id), **kw,
    )
    return got, seen


async def run_with(action: Callable[[], Any], pipe: Pipeline, **kw: Any) -> tuple[Any, list[int]]:
    """``generate`` with ``action`` (an async callable) running beside it."""
    out: list[tuple[Any, list[int]]] = []
    with unwrap_single_exception():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(action)
            out.append(await generate(pipe, **kw))
    return out[0]


# ---- failover ------------------------------------------------------------------------------


@pytest.mark.parametrize("relay", RELAYS)
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("hop", [0, 1, 2])
async def test_a_stopped_worker_fails_over_and_the_tokens_are_the_whole_models(
    hop: int, phase: str, relay: str
) -> None:
    """The worker serving ``hop`` stops mid-prefill or mid-decode (GOAWAY, then its streams end
    with UNAVAILABLE/DRAINING): the replica replays the hop's history and the generation goes
    on."""
    async with fleet(relay) as (whole, hops, gates):
        want = await reference(whole)
        primary, replica = hops[hop]
        targets = [[w.target for w in ws] for ws in hops]
        async with Pipeline.connect(targets, timeout=TIMEOUT, relay=relay) as pipe:
            at = 12 if phase == "prefill" else len(LONG) + 1 + 15
            got, seen = await run_with(
                lambda: after_steps(gate_of(gates, hop, 0), at, primary.stop), pipe
            )
            assert_same(got, want, seen)
            (f,) = got.failovers
            assert (f.hop, f.from_target, f.to_target) == (hop, primary.target, replica.target)
            # a stopping worker says GOAWAY first: the hop may hand over before its streams end
            assert f.reason in ("DRAINING", "NOT_READY") and f.recovery_ms >= 0
            # (chain relay: the first hop's runner holds nothing before the prompt's end)
            assert (f.positions == 0) is (phase == "prefill" and (hop == 0 or relay == "chain"))
            assert pipe.hops[hop].target == replica.target  # the next generate starts there
            again, _ = await generate(pipe)
            assert again.tokens == got.tokens and again.failovers == []
        await assert_all_free([whole, *(w for ws in hops for w in ws if w is not primary)])


@pytest.mark.parametrize("relay", RELAYS)
@pytest.mark.parametrize("hop", [0, 1, 2])
async def test_a_lost_connection_to_a_live_worker_fails_over_and_releases_it(
    hop: int, relay: str
) -> None:
    """Only the connection drops (through a proxy): the worker lives on and would retain the
    session for resume; the pipeline fails over and releases it through a new connection (with
    chain relay the proxy also carries the relaying worker's connection, and the later hops'
    retained sessions are released too)."""
    async with fleet(relay) as (whole, hops, gates), tcp_proxy(hops[hop][0].target) as proxy:
        want = await reference(whole, "the prompt")
        targets = [[w.target for w in ws] for ws in hops]
        targets[hop][0] = proxy.target
        async with Pipeline.connect(targets, timeout=TIMEOUT, relay=relay) as pipe:
            got, seen = await run_with(
                lambda: after_steps(gate_of(gates, hop, 0), 30, proxy.cut), pipe, prompt="the prompt"
            )
        assert_same(got, want, seen)
        assert [(f.hop, f.from_target, f.reason) for f in got.failovers] == [(hop, proxy.target, "NOT_READY")]
        await assert_all_free([whole, *(w for ws in hops for w in ws)])  # the cut one too
        if relay == "client":
            assert proxy.accepted == 2  # the pipeline's connection, then the Release's


async def test_a_draining_whole_model_worker_hands_over_to_its_replica() -> None:
    """A pipeline of one hop with replicas (what the HTTP front door drives for `--target`
    replicas) steps each token itself, so a draining worker hands over between two tokens."""
    gates = [StepGate() for _ in range(3)]
    whole_ranges = [LayerRange(0, 4)] * 3
    async with shards(whole_ranges, gates=gates) as (whole, primary, standby):
        want = await reference(whole)
        drained: list[bool] = []

        async def drain() -> None:
            await after_steps(gates[1], len(LONG) + 1 + 5, lambda: None)
            with trio.fail_after(10):  # the grace is 60 s: only the handover ends it this soon
                drained.append(await primary.server.drain_for(60))

        async with Pipeline.connect([[primary.target, standby.target]], timeout=TIMEOUT) as pipe:
            got, seen = await run_with(drain, pipe)
        assert_same(got, want, seen)
        assert drained == [True]
        (f,) = got.failovers
        assert (f.reason, f.handover, f.to_target) == ("DRAINING", True, standby.target)
        await assert_all_free([whole, standby])


@pytest.mark.parametrize("relay", RELAYS)
async def test_a_hung_worker_is_detected_within_step_timeout_and_failed_over(relay: str) -> None:
    """The middle worker's steps stop (a held gate: it answers nothing more on the stream):
    after ``step_timeout`` the hop fails over (chain relay: the first worker's bound on its
    next hop's answer names it); once the worker resumes it finds the stream reset and
    releases."""
    async with fleet(relay) as (whole, hops, gates):
        want = await reference(whole)
        held = gate_of(gates, 1, 0)
        async with Pipeline.connect(
            [[w.target for w in ws] for ws in hops], timeout=TIMEOUT, step_timeout=0.5,
            relay=relay,
        ) as pipe:
            got, seen = await run_with(lambda: after_steps(held, len(LONG) + 1 + 5, held.hold), pipe)
        held.release()
        assert_same(got, want, seen)
        (f,) = got.failovers
        assert (f.hop, f.reason, f.from_target) == (1, "DEADLINE_EXCEEDED", hops[1][0].target)
        assert ("step_timeout=0.5 s" if relay == "client" else "no answer within 1 s") in f.message
        await hops[1][0].idle()
        await assert_all_free([whole, *(w for ws in hops for w in ws)])


async def test_a_draining_worker_hands_over_without_an_error() -> None:
    """SIGTERM's drain (GOAWAY; open streams may finish): the hop moves to its replica at the
    next step, then closes the old session, so the drain ends long before its grace."""
    async with fleet() as (whole, hops, gates):
        want = await reference(whole)
        primary = hops[1][0]
        drained: list[bool] = []

        async def drain() -> None:
            await after_steps(gate_of(gates, 1, 0), len(LONG) + 1 + 5, lambda: None)
            with trio.fail_after(10):  # the grace is 60 s: only the handover ends it this soon
                drained.append(await primary.server.drain_for(60))

        async with Pipeline.connect([[w.target for w in ws] for ws in hops], timeout=TIMEOUT) as pipe:
            got, seen = await run_with(drain, pipe)
        assert_same(got, want, seen)
        assert drained == [True]
        (f,) = got.failovers
        assert (f.hop, f.reason, f.handover, f.to_target) == (1, "DRAINING", True, hops[1][1].target)
        assert f.positions > len(LONG)
        await assert_all_free([whole, *(w for ws in hops for w in ws if w is not primary)])
        assert primary.engine.sessions() == ()


@pytest.mark.parametrize("relay", RELAYS)
async def test_an_engine_failure_fails_over(relay: str) -> None:
    async with fleet(relay, fail_at_step={3: len(LONG) + 10}) as (whole, hops, _):
        want = await reference(whole)
        async with Pipeline.connect([[w.target for w in ws] for ws in hops], timeout=TIMEOUT,
                                    relay=relay) as pipe:
            got, seen = await generate(pipe)
        assert_same(got, want, seen)
        assert [(f.hop, f.reason) for f in got.failovers] == [(1, "ENGINE_FAILURE")]
        await assert_all_free([whole, *(w for ws in hops for w in ws if w is not hops[1][0])])


@pytest.mark.parametrize("relay", RELAYS)
async def test_a_hop_fails_over_twice_and_token_id_prompts_replay_too(relay: str) -> None:
    """Three replicas of the middle hop: the first and then the second stop."""
    ranges = [LayerRange(0, 4), LayerRange(0, 1), *[LayerRange(1, 3)] * 3, LayerRange(3, 4)]
    gates = [StepGate() for _ in ranges]
    prompt = [1, *(3 + b for b in b"token ids, not text")]
    async with shards(ranges, gates=gates, relay=relay == "chain") as (whole, a, b1, b2, b3, c):
        want = await reference(whole, prompt)
        n = len(prompt)

        async def stop_two() -> None:
            await after_steps(gates[2], n + 5, b1.stop)
            await after_steps(gates[3], n + 10 + 5, b2.stop)  # b2 replays n + 5, then 5 steps

        async with Pipeline.connect([a.target, [b1.target, b2.target, b3.target], c.target],
                                    timeout=TIMEOUT, relay=relay) as pipe:
            got, seen = await run_with(stop_two, pipe, prompt=prompt)
        assert_same(got, want, seen)
        assert [(f.from_target, f.to_target) for f in got.failovers] == [
            (b1.target, b2.target), (b2.target, b3.target)]
        await assert_all_free([whole, a, b3, c])


async def test_a_replica_that_hangs_while_replaying_is_skipped() -> None:
    """The first replica's engine is held, so its replay never answers: after REPLAY_CHUNKS
    step timeouts it is given up (and its stream reset) and the next replica takes over."""
    ranges = [LayerRange(0, 4), LayerRange(0, 1), *[LayerRange(1, 3)] * 3, LayerRange(3, 4)]
    gates = [StepGate() for _ in ranges]
    async with shards(ranges, gates=gates) as (whole, a, b1, b2, b3, c):
        want = await reference(whole)
        gates[3].hold()
        try:
            async with Pipeline.connect([a.target, [b1.target, b2.target, b3.target], c.target],
                                        timeout=TIMEOUT, step_timeout=0.5) as pipe:
                got, seen = await run_with(lambda: after_steps(gates[2], len(LONG) + 5, b1.stop), pipe)
        finally:
            gates[3].release()
        assert_same(got, want, seen)
        (f,) = got.failovers
        assert (f.from_target, f.to_target) == (b1.target, b3.target)
        await b2.idle()
        await assert_all_free([whole, a, b2, b3, c])


async def test_float16_hops_replay_exactly_what_was_sent() -> None:
    """float16 on the wire is lossy, but the log keeps the rows as sent: a run with a failover
    gives the same log-probabilities as one without."""
    async with fleet() as (_, hops, gates):
        targets = [[w.target for w in ws] for ws in hops]
        async with Pipeline.connect(targets, timeout=TIMEOUT, hidden_dtype="float16") as pipe:
            calm, _ = await generate(pipe)
            gate = gate_of(gates, 2, 0)
            at = gate.steps + len(LONG) + 1 + 10  # mid-decode of the second run
            got, seen = await run_with(lambda: after_steps(gate, at, hops[2][0].stop), pipe)
        assert [f.hop for f in got.failovers] == [2]
        assert_same(got, calm.steps, seen)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
async def test_whole_model_replicas_fail_over_with_sampling_too(temperature: float) -> None:
    """One hop, two whole-model workers: the first hop is also the last. Sampling is a pure
    function of the logits, the seed and the position, so it replays as well."""
    gates = [StepGate() for _ in range(3)]
    async with shards([LayerRange(0, 4)] * 3, gates=gates) as (whole, w1, w2):
        params = pb.SamplingParams(temperature=temperature, seed=5)
        want = await whole_model_steps(whole.target, LONG, max_tokens=N_TOKENS, ignore_eos=True,
                                       top_logprobs=5, sampling=params)
        async with Pipeline.connect([[w1.target, w2.target]], timeout=TIMEOUT) as pipe:
            got, seen = await run_with(
                lambda: after_steps(gates[1], len(LONG) + 20, w1.stop), pipe,
                temperature=temperature, seed=5,
            )
        assert_same(got, want, seen)
        assert [(f.hop, f.to_target) for f in got.failovers] == [(0, w2.target)]
        await assert_all_free([whole, w2])


# ---- when it does not fail over --------------------------------------------------------------


@pytest.mark.parametrize("relay", RELAYS)
async def test_no_replica_left_names_the_hop_and_every_replica_tried(relay: str) -> None:
    async with fleet(relay) as (whole, hops, gates):
        b1, b2 = hops[1]
        b2.stop()  # unreachable from the start: not an error while b1 serves
        await trio.sleep(0.05)
        async with Pipeline.connect([[w.target for w in ws] for ws in hops], timeout=TIMEOUT,
                                    relay=relay) as pipe:
            with pytest.raises(PipelineError) as info:
                await run_with(lambda: after_steps(gate_of(gates, 1, 0), len(LONG) + 10, b1.stop), pipe)
        err = info.value
        assert err.hop_index == 1 and err.target == b1.target and "layers [1, 3)" in err.message
        assert [t for t, _ in err.tried] == [b1.target, b2.target]
        assert f"no replica of the hop is left: tried {b1.target} (" in err.message
        # (chain relay: the first worker tried to reach it, and says so without details)
        down = "cannot connect" if relay == "client" else "it could not be reached"
        assert f"{b2.target} (NOT_READY: {down}" in err.message
        await assert_all_free([w for w in (whole, *hops[0], *hops[2])])


@pytest.mark.parametrize("relay", RELAYS)
async def test_a_request_error_does_not_fail_over(relay: str) -> None:
    """INVALID_ARGUMENT (a prompt longer than the session's context) is the request's fault:
    the replica is never asked."""
    async with fleet(relay) as (whole, hops, _):
        async with Pipeline.connect([[w.target for w in ws] for ws in hops], timeout=TIMEOUT,
                                    relay=relay) as pipe:
            with pytest.raises(PipelineError) as info:
                await pipe.generate([1] * 300, max_tokens=2)
        assert info.value.code == ErrorCode.INVALID_ARGUMENT and info.value.hop_index == 0
        assert all(ws[1].engine.metrics().sessions_opened_total == 0 for ws in hops)
        await assert_all_free([whole, *(w for ws in hops for w in ws)])


async def test_past_replay_bytes_a_later_hop_cannot_fail_over_but_the_first_can() -> None:
    """8 floats a row: 20 positions of the middle hop's rows are over 600 bytes, so its log is
    dropped during the prefill; the first hop keeps token ids and still fails over."""
    async with fleet() as (whole, hops, gates):
        targets = [[w.target for w in ws] for ws in hops]
        async with Pipeline.connect(targets, timeout=TIMEOUT, replay_bytes=600) as pipe:
            with pytest.raises(PipelineError) as info:
                await run_with(lambda: after_steps(gate_of(gates, 1, 0), len(LONG) + 5, hops[1][0].stop), pipe)
            err = info.value
            assert err.hop_index == 1 and "no failover: its replay log was dropped" in err.message
            assert "replay_bytes=600" in err.message
            # (a hand-off may have been tried between GOAWAY and the streams' end: it left
            # nothing on the replica, checked below)
            assert hops[1][1].engine.metrics().sessions_imported_total == 0
            want = await reference(whole)
            got, seen = await run_with(
                lambda: after_steps(gate_of(gates, 0, 0), 5 + len(LONG) + 1 + 5, hops[0][0].stop),
                pipe,
            )
            assert_same(got, want, seen)
            assert [f.hop for f in got.failovers] == [0]
        await assert_all_free([whole, hops[0][1], hops[1][1], *hops[2]])


async def test_cancelling_mid_failover_leaves_nothing_on_any_worker() -> None:
    """The replica's replay is held; the caller cancels: every live worker is free after."""
    async with fleet() as (whole, hops, gates):
        b1, b2 = hops[1]
        replay = gate_of(gates, 1, 1)
        replay.hold()
        try:
            async with Pipeline.connect([[w.target for w in ws] for ws in hops], timeout=TIMEOUT) as pipe:
                with trio.CancelScope() as scope:

                    async def kill_then_cancel() -> None:
                        await after_steps(gate_of(gates, 1, 0), len(LONG) + 5, b1.stop)
                        with trio.fail_after(10):
                            while replay.waiting == 0:
                                await trio.sleep(0.001)
                        scope.cancel()

                    await run_with(kill_then_cancel, pipe)
                assert scope.cancelled_caught
        finally:
            replay.release()
        await b2.idle()
        await assert_all_free([whole, *hops[0], b2, *hops[2]])


# ---- connect -------------------------------------------------------------------------------


async def test_a_standby_of_another_range_is_set_aside_and_the_pipeline_serves() -> None:
    """Issue 33, finding 13: one misconfigured standby (another range) no longer stops a
    pipeline whose primary is fine: it is reported (``Replica.refused``, a warning) and never
    failed over to; the hop without another replica then fails naming it among those tried."""
    async with shards([LayerRange(0, 4), LayerRange(0, 2), LayerRange(2, 4), LayerRange(1, 4)]) as (
            whole, a, b, wrong):
        async with Pipeline.connect([a.target, [b.target, wrong.target]], timeout=TIMEOUT) as pipe:
            refused = pipe.replicas[1][1].refused
            assert refused is not None and refused.code == ErrorCode.INCOMPATIBLE_MODEL
            assert "a replica must serve what the hop serves" in refused.message and "[1, 4)" in refused.message
            got = await pipe.generate(PROMPT, max_tokens=8, ignore_eos=True)
            want = await whole_model_steps(whole.target, PROMPT, max_tokens=8, ignore_eos=True)
            assert got.tokens == [s.logits.token_id for s in want]
            b.stop()  # its primary gone, the hop has no replica to move to
            with pytest.raises(PipelineError) as info:
                await pipe.generate(PROMPT, max_tokens=8, ignore_eos=True)
        err = info.value
        assert err.hop_index == 1 and [t for t, _ in err.tried] == [wrong.target, b.target]
        assert wrong.engine.metrics().sessions_opened_total == 0
        await assert_all_free([whole, a, wrong])


async def test_an_unreachable_first_replica_is_skipped_at_connect() -> None:
    async with shards([LayerRange(0, 4), LayerRange(0, 2), LayerRange(2, 4)]) as (whole, a, b):
        with trio.socket.socket() as sock:
            await sock.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{sock.getsockname()[1]}"  # bound, not listening: refused
            async with Pipeline.connect([[dead, a.target], b.target], timeout=TIMEOUT) as pipe:
                assert pipe.hops[0].target == a.target
                assert [r.target for r in pipe.replicas[0]] == [dead, a.target]
                got = await pipe.generate(PROMPT, max_tokens=8, ignore_eos=True)
            want = await whole_model_steps(whole.target, PROMPT, max_tokens=8, ignore_eos=True)
            assert got.tokens == [s.logits.token_id for s in want]
            with pytest.raises(PipelineError) as info:
                async with Pipeline.connect([[dead], b.target], timeout=TIMEOUT):
                    pass
            assert info.value.hop_index == 0 and info.value.message.startswith(f"hop 0 ({dead}): ")
            assert "no replica" not in info.value.message  # one worker: nothing to list


async def test_a_silent_replica_does_not_hold_up_connect() -> None:
    """A replica that accepts TCP but never answers (a hung machine): connect does not wait the
    whole timeout for it once another replica answered; it is asked again when needed."""

    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async with shards([LayerRange(0, 4)]) as (w,), trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, silent, 0)
        mute = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        with trio.fail_after(15):  # the timeout is 30 s: only the probe grace ends it this soon
            async with Pipeline.connect([[w.target, mute]], timeout=30) as pipe:
                assert pipe.hops[0].target == w.target and pipe.replicas[0][1].caps is None
                got = await pipe.generate(PROMPT, max_tokens=4, ignore_eos=True)
        assert len(got.tokens) == 4
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    "targets, words",
    [([], "at least one worker"), (["a:1", []], "hop 1 names no worker"),
     (["a:1", ["b:1", "a:1"]], "a:1 is listed twice")],
)
def test_malformed_hop_lists_are_refused(targets: Sequence[Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        hop_targets(targets)


# ---- the replay log --------------------------------------------------------------------------


@given(
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=12),
    max_rows=st.integers(1, 20),
    dtype=st.sampled_from(["float32", "float16"]),
)
def test_a_row_log_gives_back_every_row_in_slices(chunks: list[int], max_rows: int, dtype: str) -> None:
    rng = np.random.default_rng(len(chunks))
    parts = [rng.standard_normal((n, 4)).astype(np.float32) for n in chunks]
    rows = RowLog(ReplayBudget(None))
    for part in parts:
        rows.append(part, dtype)
    slices = list(rows.slices(max_rows))
    assert all(1 <= s.shape[0] <= max_rows and s.dtype == np.float32 for s in slices)
    assert all(s.shape[0] == max_rows for s in slices[:-1])
    sent = np.concatenate(parts).astype(dtype).astype(np.float32)  # what the hop was sent
    assert np.array_equal(np.concatenate(slices), sent)
    assert rows.positions == sum(chunks) and rows.nbytes == sent.size * np.dtype(dtype).itemsize


@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=20), limit=st.integers(0, 400))
def test_the_budget_drops_every_row_log_once_it_is_exceeded(sizes: list[int], limit: int) -> None:
    budget = ReplayBudget(limit)
    logs = [RowLog(budget), RowLog(budget)]
    for i, n in enumerate(sizes):
        logs[i % 2].append(np.zeros((n, 1), np.float32), "float32")
    total = 4 * sum(sizes)
    assert all(log.dropped for log in logs) is (total > limit)
    assert budget.used == (0 if total > limit else total) == sum(log.nbytes for log in logs)
    assert [log.positions for log in logs] == [sum(sizes[0::2]), sum(sizes[1::2])]


async def test_metrics_after_a_failover_count_one_session_per_worker() -> None:
    """Bookkeeping: the replica opened exactly one session; the primary none after the stop."""
    async with fleet() as (whole, hops, gates):
        async with Pipeline.connect([[w.target for w in ws] for ws in hops], timeout=TIMEOUT) as pipe:
            await run_with(lambda: after_steps(gate_of(gates, 2, 0), len(LONG) + 3, hops[2][0].stop), pipe)
        async with ShardClient.connect(hops[2][1].target, timeout=TIMEOUT) as client:
            m = await client.metrics()
        assert m.engine["sessions_opened_total"] == 1
