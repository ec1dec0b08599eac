"""``GroupSteps`` (protocol 1.3): a batch group's decodes as one message per tick. Tokens and
hidden rows equal the per-session path's; a row's failure (bad input, an unknown, busy,
cancelled or closed session) is that row's outcome only; negotiation both ways; nothing leaks.
On the fake engine over the wire."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse leak check
from rpc_harness import MODEL, StepGate, make_engine, worker
from shard.client import ShardClient, ShardError
from shard.engine import LayerRange, LoadSpec
from shard.engine.fake import FakeEngine, FakeScript
from shard.rpc import convert
from shard.rpc.auth import TokenAuthenticator, bearer_metadata
from shard.rpc.errors import ErrorCode
from shard.v1 import shard_pb2 as pb
from test_relay import relay_shards, route_of

TIMEOUT = 30.0
PROMPTS = [[1, *b"alpha"], [1, *b"bravo!"], [1, *b"charlie"]]
STEPS = 6
TOKEN_A, TOKEN_B = "tok-A-group-1234", "tok-B-group-5678"


async def per_session(client: ShardClient, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens of each prompt, each session stepped on its own stream."""
    out = []
    for i, prompt in enumerate(prompts):
        async with client.session(f"ref-{i}") as s:
            tokens = [(await s.prefill(prompt)).logits.token_id]
            for _ in range(n):
                tokens.append((await s.decode(tokens[-1])).logits.token_id)
            out.append(tokens)
    return out


async def test_group_tokens_equal_the_per_session_path() -> None:
    """Three sessions stepped as one group message per tick choose the tokens each chooses
    alone; their streams number on after the group's steps and their totals count them."""
    async with worker() as w, ShardClient.connect(w.target, timeout=TIMEOUT) as client:
        assert (await client.capabilities()).group_steps
        expected = await per_session(client, PROMPTS, STEPS)
        async with client.session("g0") as a, client.session("g1") as b, \
                client.session("g2") as c, client.group_steps() as group:
            sessions = [a, b, c]
            tokens = [[(await s.prefill(p)).logits.token_id] for s, p in zip(sessions, PROMPTS)]
            for step in range(STEPS):
                outcomes = await group.step(
                    [(s, s.decode_message(t[-1])) for s, t in zip(sessions, tokens)])
                for i, (t, r) in enumerate(zip(tokens, outcomes)):
                    assert isinstance(r, pb.StepResult), r
                    assert r.step == step + 2 and r.n_past == len(PROMPTS[i]) + step + 1
                    t.append(r.logits.token_id)
            assert tokens == expected
            after = await a.decode(tokens[0][-1])  # the stream numbers on
            assert after.step == STEPS + 2 and after.n_past == len(PROMPTS[0]) + STEPS + 1
            closed = await b.close()
            assert closed.totals.generated_tokens == STEPS
        metrics = await client.metrics()
        assert metrics.worker["rpc_GroupSteps_total"] == 1
        assert metrics.worker["group_rows_total"] == 3 * STEPS


async def test_a_groups_rows_run_as_one_tick() -> None:
    """On a batching engine, each group message's rows (one batch group) share one tick."""
    engine = FakeEngine(model=MODEL, script=FakeScript(batched=True))
    async with worker(engine=engine) as w, ShardClient.connect(w.target, timeout=TIMEOUT) as client:
        async with client.session("a", batch_group=1) as a, client.session("b", batch_group=1) as b, \
                client.session("c", batch_group=1) as c, client.group_steps() as group:
            sessions = [a, b, c]
            tokens = [(await s.prefill(p)).logits.token_id for s, p in zip(sessions, PROMPTS)]
            before = engine.metrics()
            for _ in range(STEPS):
                outcomes = await group.step(
                    [(s, s.decode_message(t)) for s, t in zip(sessions, tokens)])
                tokens = [r.logits.token_id for r in outcomes]  # type: ignore[union-attr]
            after = engine.metrics()
        assert after.batch_ticks_total - before.batch_ticks_total == STEPS
        assert after.batch_sessions_total - before.batch_sessions_total == 3 * STEPS


def _rows(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, MODEL.n_embd)).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
async def test_hidden_rows_equal_the_per_session_path(dtype: str) -> None:
    """A middle shard fed hidden rows (with their token ids) answers each group row with the
    very bytes the session's own stream would have sent, in the session's wire dtype."""
    load = LoadSpec(n_ctx=1024, max_sessions=4, layer_range=LayerRange(1, 3))
    async with worker(engine=make_engine(), load=load) as w, \
            ShardClient.connect(w.target, timeout=TIMEOUT) as client:
        prompts = [_rows(i, 4) for i in range(2)]
        steps = [[_rows(10 * i + k, 1) for k in range(4)] for i in range(2)]
        expected = []
        for i in range(2):
            async with client.session(f"ref-{i}", hidden_wire_dtype=dtype) as s:
                await s.prefill(hidden_states=prompts[i])
                expected.append([(await s.decode(hidden_state=row, token_id=7 + k)).hidden_states
                                 for k, row in enumerate(steps[i])])
        async with client.session("h0", hidden_wire_dtype=dtype) as a, \
                client.session("h1", hidden_wire_dtype=dtype) as b, client.group_steps() as group:
            sessions = [a, b]
            for s, p in zip(sessions, prompts):
                await s.prefill(hidden_states=p)
            got: list[list[pb.Tensor]] = [[], []]
            for k in range(4):
                outcomes = await group.step([
                    (s, s.decode_message(hidden_state=steps[i][k], token_id=7 + k))
                    for i, s in enumerate(sessions)])
                for i, r in enumerate(outcomes):
                    assert isinstance(r, pb.StepResult), r
                    assert r.hidden_states.dtype == dtype
                    got[i].append(r.hidden_states)
        assert got == expected
        assert convert.tensor_to_array(got[0][0], MODEL.n_embd, "", dtype=dtype).shape == (1, MODEL.n_embd)


async def test_a_rows_error_fails_that_row_only() -> None:
    """A token outside the vocabulary, an unknown session, a session named twice and a row
    without a Decode are each their row's error; the other rows run, every session stays usable
    and holds what its rows say."""
    async with worker() as w, ShardClient.connect(w.target, timeout=TIMEOUT) as client:
        expected = await per_session(client, PROMPTS[:2], 2)
        async with client.session("a") as a, client.session("b") as b, \
                client.group_steps() as group:
            ta = (await a.prefill(PROMPTS[0])).logits.token_id
            tb = (await b.prefill(PROMPTS[1])).logits.token_id
            ghost = await client.open_session("ghost")
            ghost.abort()
            with trio.fail_after(10):
                while w.call("ghost") is not None:  # (gone once the worker read the reset)
                    await trio.sleep(0.01)
            outcomes = await group.step([
                (a, a.decode_message(ta)), (b, b.decode_message(10**6)), (ghost, a.decode_message(ta)),
                (a, a.decode_message(ta)),
            ])
            assert isinstance(outcomes[0], pb.StepResult)
            codes = [o.code for o in outcomes[1:]]  # type: ignore[union-attr]
            assert codes == [ErrorCode.INVALID_ARGUMENT, ErrorCode.SESSION_NOT_FOUND,
                             ErrorCode.SESSION_BUSY]
            second = await group.step([(b, b.decode_message(tb)), (a, pb.Decode())])
            assert isinstance(second[0], pb.StepResult)
            assert second[1].code == ErrorCode.INVALID_ARGUMENT  # type: ignore[union-attr]
            assert [ta, outcomes[0].logits.token_id] == expected[0][:2]  # type: ignore[union-attr]
            assert [tb, second[0].logits.token_id] == expected[1][:2]
            # both sessions go on, on their streams, from what the rows left
            assert (await b.decode(second[0].logits.token_id)).logits.token_id == expected[1][2]
            assert (await a.decode(expected[0][1])).logits.token_id == expected[0][2]
            assert await group.step([]) == []


async def test_cancel_and_close_mid_group_leave_the_others() -> None:
    """While a group's rows wait in the engine, a Cancel stops one row (CANCELLED, its session
    usable, holding what it held) and a reset of another session's stream fails that row (the
    session released once its row ended); the third row's token is the one it chooses alone."""
    gate = StepGate()
    async with worker(gate=gate) as w, ShardClient.connect(w.target, timeout=TIMEOUT) as client:
        expected = await per_session(client, PROMPTS, 2)
        async with client.session("a") as a, client.session("c") as c, \
                client.group_steps() as group:
            b = await client.open_session("b")
            sessions = [a, b, c]
            tokens = [(await s.prefill(p)).logits.token_id for s, p in zip(sessions, PROMPTS)]
            outcomes: list[object] = []

            async def run() -> None:
                outcomes.extend(await group.step(
                    [(s, s.decode_message(t)) for s, t in zip(sessions, tokens)]))

            gate.hold()
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(run)
                    with trio.fail_after(5):
                        while gate.waiting < 1 or not w.call("a").running:  # type: ignore[union-attr]
                            await trio.sleep(0.01)
                    assert (await client.cancel("a")).was_running
                    b.abort()
                    with trio.fail_after(5):  # the worker read the reset: b is being released
                        while w.call("b")._end_reason is None:  # type: ignore[union-attr]
                            await trio.sleep(0.01)
                    gate.release()  # (a step inside the engine ends before its release)
            finally:
                gate.release()
            assert outcomes[0].code == ErrorCode.CANCELLED  # type: ignore[union-attr]
            # b's row ran to its end (computed or stopped); either way b is gone now
            assert isinstance(outcomes[1], ShardError | pb.StepResult)
            with trio.fail_after(5):
                while w.call("b") is not None:
                    await trio.sleep(0.01)
            assert "b" not in [info.session_id for info in w.engine.sessions()]
            assert isinstance(outcomes[2], pb.StepResult)
            assert outcomes[2].logits.token_id == expected[2][1]
            # the cancelled session holds what it held and goes on
            assert (await a.decode(tokens[0])).logits.token_id == expected[0][1]
    assert w.server.registry.n_live == 0


async def test_negotiated_only() -> None:
    """A client speaking 1.2 (or a worker that does not report group_steps) never opens the
    stream: UNSUPPORTED_FEATURE before any call, and its sessions step as before."""
    async with worker() as w, ShardClient.connect(w.target, timeout=TIMEOUT, version=(1, 2)) as client:
        with pytest.raises(ShardError) as info:
            async with client.group_steps():
                pass
        assert info.value.code == ErrorCode.UNSUPPORTED_FEATURE
        async with client.session("old") as s:
            token = (await s.prefill(PROMPTS[0])).logits.token_id
            await s.decode(token)
        assert "rpc_GroupSteps_total" not in (await client.metrics()).worker


async def test_only_the_sessions_own_caller_may_step_it(tmp_path: Path) -> None:
    """With an authenticator, another principal's row for a live session is answered as an
    unknown id (and the session is untouched); the same principal on another connection
    steps it."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN_A} router-a\n{TOKEN_B} router-b\n")
    async with worker(authorize=TokenAuthenticator(tokens)) as w:
        async with ShardClient.connect(w.target, timeout=TIMEOUT,
                                       metadata=bearer_metadata(TOKEN_A)) as a, \
                ShardClient.connect(w.target, timeout=TIMEOUT,
                                    metadata=bearer_metadata(TOKEN_B)) as b, \
                ShardClient.connect(w.target, timeout=TIMEOUT,
                                    metadata=bearer_metadata(TOKEN_A)) as a2:
            async with a.session("mine") as s:
                token = (await s.prefill(PROMPTS[0])).logits.token_id
                async with b.group_steps() as theirs:
                    [refused] = await theirs.step([(s, s.decode_message(token))])
                assert refused.code == ErrorCode.SESSION_NOT_FOUND  # type: ignore[union-attr]
                assert w.engine.session_info("mine").n_past == len(PROMPTS[0])
                async with a2.group_steps() as ours:
                    [stepped] = await ours.step([(s, s.decode_message(token))])
                assert stepped.n_past == len(PROMPTS[0]) + 1  # type: ignore[union-attr]


async def test_a_routed_session_is_refused_its_row() -> None:
    """A session of a chain relay route takes its steps on its own stream (its hops hold it
    together): its row is UNSUPPORTED_FEATURE, and it goes on."""
    ranges = [LayerRange(0, 2), LayerRange(2, 4)]
    async with relay_shards(ranges) as shards:
        route = route_of(shards[1:], ranges[1:])
        async with ShardClient.connect(shards[0].target, timeout=TIMEOUT) as client:
            async with client.session("routed", route=route) as s, client.group_steps() as group:
                token = (await s.prefill(PROMPTS[0])).logits.token_id
                [refused] = await group.step([(s, s.decode_message(token))])
                assert refused.code == ErrorCode.UNSUPPORTED_FEATURE  # type: ignore[union-attr]
                assert (await s.decode(token)).n_past == len(PROMPTS[0]) + 1


async def test_a_rows_step_timeout_is_that_rows_error() -> None:
    """Steps held past one session's step timeout: its row fails DEADLINE_EXCEEDED
    (STEP_TIMEOUT) and the session holds what it held; the other row (no timeout) is computed
    once the steps go on."""
    gate = StepGate()
    async with worker(gate=gate) as w, ShardClient.connect(w.target, timeout=TIMEOUT) as client:
        async with client.session("slow", step_timeout=0.2) as timed, \
                client.session("fine") as fine, client.group_steps() as group:
            t0 = (await timed.prefill(PROMPTS[0])).logits.token_id
            t1 = (await fine.prefill(PROMPTS[1])).logits.token_id
            gate.hold()
            try:
                async with trio.open_nursery() as nursery:
                    outcomes: list[object] = []

                    async def run() -> None:
                        outcomes.extend(await group.step([(timed, timed.decode_message(t0)),
                                                          (fine, fine.decode_message(t1))]))

                    nursery.start_soon(run)
                    with trio.fail_after(10):  # the steps are held (their timeouts run)
                        while gate.waiting == 0:
                            await trio.sleep(0.001)
                    await trio.sleep(0.5)  # past the timed session's timeout (the same Trio clock)
                    gate.release()
            finally:
                gate.release()
            assert outcomes[0].code == ErrorCode.DEADLINE_EXCEEDED  # type: ignore[union-attr]
            assert outcomes[0].reason == "STEP_TIMEOUT"  # type: ignore[union-attr]
            assert outcomes[1].n_past == len(PROMPTS[1]) + 1  # type: ignore[union-attr]
            assert w.engine.session_info("slow").n_past == len(PROMPTS[0])


async def test_a_group_rows_grammar_start_is_the_sessions_from_then_on() -> None:
    """A row's grammar start, as a step's sent on the session's own stream, becomes the
    session's: its next step may name the grammar without repeating where it starts."""
    async with worker() as w, ShardClient.connect(w.target, timeout=TIMEOUT) as client:
        assert "json_object" in (await client.capabilities()).grammar_kinds
        async with client.session("g") as s, client.group_steps() as group:
            first = (await s.prefill([1, *b"say"])).logits.token_id
            grammar = pb.SamplingParams(grammar_kind="json_object", grammar_start=4)
            (row,) = await group.step([(s, s.decode_message(first, sampling=grammar))])
            assert isinstance(row, pb.StepResult), row
            later = await s.decode(row.logits.token_id,
                                   sampling=pb.SamplingParams(grammar_kind="json_object"))
            assert later.n_past == 6
