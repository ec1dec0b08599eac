"""Session hand-off over the Shard protocol (1.2): ``export_state`` on one worker, chunk by
chunk into ``import_state`` on another, and every refusal a replica makes before it resumes a
state it must not (another model, range or KV layout, a state too large, corrupt or out of
order), each leaving the session empty and usable and the worker healthy."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import MODEL, StepGate, worker
from shard.client import ClientSession, ShardClient, move_session
from shard.engine import LayerRange, LoadSpec
from shard.engine.fake import FakeEngine, FakeModel, FakeScript
from shard.pipeline import Pipeline
from shard.rpc.errors import ErrorCode, ShardError
from shard.v1 import shard_pb2 as pb
from test_pipeline import TIMEOUT, after_steps, assert_all_free, cuts_to_ranges, shards, whole_model_steps
from test_relay import relay_shards, route_of

PROMPT = list(b"\x01the state of a session moves")


def _fake(model: FakeModel = MODEL, tag: str = "") -> FakeEngine:
    return FakeEngine(model=model, script=FakeScript(kv_layout_tag=tag))


@contextlib.asynccontextmanager
async def _session(target: str, sid: str, **kw: object) -> AsyncIterator[ClientSession]:
    async with ShardClient.connect(target) as client, client.session(sid, **kw) as session:  # type: ignore[arg-type]
        yield session


async def _exported(session: ClientSession, max_chunk_bytes: int = 0) -> list[pb.StateChunk]:
    return [chunk async for chunk in session.export_state(max_chunk_bytes=max_chunk_bytes)]


async def _tokens(session: ClientSession, n: int) -> list[int]:
    return [step.logits.token_id async for step in session.generate(max_tokens=n, ignore_eos=True)]


async def test_a_session_moves_between_workers_and_goes_on_as_it_would_have() -> None:
    """Prompt and 6 generated tokens on A, moved to B in 4 KiB chunks: B holds the same
    positions and token ids, continues from the last chosen token, and generates what A
    generates; A's session is unchanged."""
    async with worker() as a, worker() as b:
        caps = await _caps(a.target)
        assert caps.session_handoff and caps.kv_layout == a.engine.capabilities().kv_layout
        async with _session(a.target, "s") as src, _session(b.target, "s2") as dst:
            await src.prefill(PROMPT)
            await _tokens(src, 6)
            n_past = len(PROMPT) + 6  # the prefill's token and 5 generated fed; the 6th chosen
            chunks = await _exported(src, max_chunk_bytes=4096)
            assert len(chunks) > 1 and chunks[-1].last and not any(c.last for c in chunks[:-1])
            assert chunks[0].HasField("header") and not any(c.HasField("header") for c in chunks[1:])
            header = chunks[0].header
            assert header.n_past == n_past and tuple(header.tokens) == a.engine.session_info("s").tokens
            assert header.has_next_token
            assert all(c.ByteSize() <= 4096 for c in chunks)
            data = b"".join(c.data for c in chunks)
            assert len(data) == header.data_bytes and hashlib.sha256(data).digest() == header.data_sha256
            assert src.usage.n_past == n_past
            moved = await move_session(src, dst, max_chunk_bytes=8192)
            assert moved == n_past == dst.usage.n_past
            assert b.engine.session_info("s2").tokens == a.engine.session_info("s").tokens
            assert b.engine.metrics().kv_cells_used == n_past
            assert await _tokens(dst, 8) == await _tokens(src, 8)
            assert (a.engine.metrics().sessions_exported_total,
                    b.engine.metrics().sessions_imported_total) == (2, 1)


async def test_a_later_shard_moves_without_token_ids() -> None:
    """A layer range past the first holds hidden states only: its state has no token ids and
    the moved session computes the same rows."""
    import numpy as np

    spec = LoadSpec(n_ctx=1024, max_sessions=4, layer_range=LayerRange(2, 4))
    rows = np.random.default_rng(1).standard_normal((9, MODEL.n_embd)).astype(np.float32)
    async with worker(engine=_fake(), load=spec) as a, worker(engine=_fake(), load=spec) as b:
        async with _session(a.target, "s") as src, _session(b.target, "t") as dst:
            await src.prefill(hidden_states=rows[:8])
            chunks = await _exported(src)
            assert not chunks[0].header.has_tokens and chunks[0].header.n_past == 8
            assert await move_session(src, dst) == 8
            here = await src.decode(hidden_state=rows[8:])
            there = await dst.decode(hidden_state=rows[8:])
            assert here.logits.token_id == there.logits.token_id
            assert list(here.logits.top) == list(there.logits.top)


async def _caps(target: str) -> pb.GetCapabilitiesResponse:
    async with ShardClient.connect(target) as client:
        return await client.capabilities()


async def _refused(dst: ClientSession, chunks: list[pb.StateChunk], code: ErrorCode,
                   reason: str = "", *, n_past: int = 0) -> ShardError:
    with pytest.raises(ShardError) as info:
        for chunk in chunks:
            await dst.import_state(chunk)
    assert info.value.code is code, info.value
    if reason:
        assert info.value.reason == reason
    assert dst.alive and dst.usage.n_past == n_past
    return info.value


def _with(chunks: list[pb.StateChunk], **header: object) -> list[pb.StateChunk]:
    out = [pb.StateChunk() for _ in chunks]
    for new, old in zip(out, chunks):
        new.CopyFrom(old)
    for name, value in header.items():
        if name == "layer_range":
            out[0].header.layer_range.CopyFrom(value)  # type: ignore[arg-type]
        elif name == "tokens":
            del out[0].header.tokens[:]
            out[0].header.tokens.extend(value)  # type: ignore[arg-type]
        else:
            setattr(out[0].header, name, value)
    return out


async def test_a_state_a_replica_must_not_resume_is_refused_and_the_session_stays_usable() -> None:
    """Another model, range, KV layout, a session too small, a corrupt or oversized state,
    chunks out of order, a session that holds positions: refused with a structured error;
    afterwards the same session replays the history and serves (the client's fallback), and
    the worker stays healthy."""
    other = FakeModel(n_layers_total=4, n_embd=8, seed=8)
    async with worker() as a, worker() as b, worker(engine=_fake(tag="/v2")) as c, \
            worker(engine=_fake(other)) as d:
        async with _session(a.target, "s") as src:
            await src.prefill(PROMPT)
            chunks = await _exported(src, max_chunk_bytes=4096)
        whole = chunks[0].header
        async with _session(b.target, "t") as dst:
            await _refused(dst, _with(chunks, layer_range=pb.LayerRange(start=0, end=2)),
                           ErrorCode.INCOMPATIBLE_MODEL)
            await _refused(dst, _with(chunks, model_fingerprint="0" * 64), ErrorCode.INCOMPATIBLE_MODEL)
            await _refused(dst, _with(chunks, data_bytes=whole.data_bytes * 1000),
                           ErrorCode.INVALID_ARGUMENT)
            await _refused(dst, _with(chunks, tokens=list(whole.tokens)[:-1]), ErrorCode.INVALID_ARGUMENT)
            await _refused(dst, _with(chunks, next_token=10**6), ErrorCode.INVALID_ARGUMENT)
            corrupt = _with(chunks)
            corrupt[1].data = bytes([corrupt[1].data[0] ^ 1]) + corrupt[1].data[1:]
            await _refused(dst, corrupt, ErrorCode.INVALID_ARGUMENT, "STATE_CORRUPT")
            short = _with(chunks[:-1])
            short[-1].last = True
            await _refused(dst, short, ErrorCode.INVALID_ARGUMENT, "STATE_CORRUPT")
            await _refused(dst, chunks[1:], ErrorCode.INVALID_ARGUMENT)  # no header first
            await _refused(dst, [chunks[0], chunks[0]], ErrorCode.INVALID_ARGUMENT)  # header twice
            too_much = _with(chunks)
            too_much[1].data += too_much[1].data
            await _refused(dst, too_much, ErrorCode.INVALID_ARGUMENT)
            # a request between two chunks drops the ones received: the next has no header
            await dst.import_state(chunks[0])
            await dst.rewind(0)
            await _refused(dst, chunks[1:], ErrorCode.INVALID_ARGUMENT)
            # the fallback: the same session replays the history and serves
            replayed = await dst.prefill(PROMPT)
            assert replayed.n_past == len(PROMPT)
            await _refused(dst, chunks, ErrorCode.ILLEGAL_TRANSITION, n_past=len(PROMPT))  # not empty
            assert dst.alive and b.engine.session_info("t").n_past == len(PROMPT)
        async with _session(b.target, "small", kv_budget=8) as dst:
            await _refused(dst, chunks, ErrorCode.RESOURCE_EXHAUSTED, "KV_CACHE_FULL")
        async with _session(c.target, "t") as dst:
            assert (await _caps(c.target)).kv_layout != whole.kv_layout
            await _refused(dst, chunks, ErrorCode.INCOMPATIBLE_MODEL, "KV_LAYOUT")
            assert (await dst.prefill(PROMPT)).n_past == len(PROMPT)
        async with _session(d.target, "t") as dst:
            await _refused(dst, chunks, ErrorCode.INCOMPATIBLE_MODEL)
        for w in (b, c, d):
            assert w.engine.health().ready and w.engine.metrics().sessions_imported_total == 0


async def test_an_export_is_checked_and_one_left_early_is_skipped() -> None:
    """An empty session has nothing to export; chunks smaller than 4 KiB are refused; an
    export abandoned after its first chunk is skipped by the next request, whose credit
    accounting stays right (many later steps still run)."""
    async with worker() as a:
        async with _session(a.target, "s") as src:
            with pytest.raises(ShardError) as info:
                await _exported(src)
            assert info.value.code is ErrorCode.ILLEGAL_TRANSITION
            await src.prefill(PROMPT)
            with pytest.raises(ShardError) as info:
                await _exported(src, max_chunk_bytes=100)
            assert info.value.code is ErrorCode.INVALID_ARGUMENT
            for _ in range(3):
                stream = src.export_state(max_chunk_bytes=4096)
                async for _chunk in stream:
                    break
                await stream.aclose()
            assert len(await _tokens(src, 40)) == 40
            assert src.alive


async def test_a_routed_session_is_not_moved() -> None:
    """A session of a chain relay route holds its later hops together: refused, the route
    goes on."""
    ranges = cuts_to_ranges([0, 2, 4])
    async with relay_shards(ranges) as chain:
        async with _session(chain[0].target, "r", route=route_of(chain[1:], ranges[1:])) as src:
            await src.prefill(PROMPT)
            with pytest.raises(ShardError) as info:
                await _exported(src)
            assert info.value.code is ErrorCode.UNSUPPORTED_FEATURE
            assert (await src.decode(5)).n_past == len(PROMPT) + 1


# ---- through the pipeline client: a drain moves the state instead of replaying it ----------

N_TOKENS = 40
LONG = [1, *range(40, 100)]  # 61 positions: several prefill chunks


async def _drained_generation(
    hop_workers: list[list[Any]], gates: list[StepGate], whole: Any, *, drain_hop: int = 1,
    after: int = len(LONG) + 10, sessions: int = 1, **pipeline: Any,
) -> list[Any]:
    """``sessions`` concurrent greedy generations through the hops' first replicas; the
    worker of ``drain_hop`` drains once its gate counted ``after`` steps. Each generation's
    tokens must equal the whole model's; returns their results."""
    want = await whole_model_steps(whole.target, LONG, max_tokens=N_TOKENS, ignore_eos=True,
                                   top_logprobs=3)
    primary = hop_workers[drain_hop][0]
    results: list[Any] = []

    async def drain() -> None:
        await after_steps(gates[drain_hop], after, lambda: None)
        with trio.fail_after(10):  # the grace is 60 s: only the hand-off ends it this soon
            assert await primary.server.drain_for(60)

    async def one(pipe: Pipeline) -> None:
        got = await pipe.generate(LONG, max_tokens=N_TOKENS, ignore_eos=True, top_logprobs=3,
                                  chunk_tokens=8)
        assert got.tokens == [s.logits.token_id for s in want]
        for g, w in zip(got.steps, want, strict=True):
            assert g.logits == w.logits and g.n_past == w.n_past
        results.append(got)

    targets = [[w.target for w in ws] for ws in hop_workers]
    async with Pipeline.connect(targets, timeout=TIMEOUT, **pipeline) as pipe:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            for _ in range(sessions):
                nursery.start_soon(one, pipe)
    return results


@pytest.mark.parametrize("drain_hop", [0, 1])
async def test_a_draining_worker_moves_each_session_to_its_replica_without_replay(
    drain_hop: int,
) -> None:
    """Four generations through two hops with two replicas each; the first replica of one hop
    drains mid-generation: every session's state moves to the other replica (it recomputes
    no position: its engine prefilled nothing), the tokens and log-probabilities are the whole
    model's, and the drain ends at once."""
    ranges = [LayerRange(0, 4), LayerRange(0, 2), LayerRange(0, 2), LayerRange(2, 4), LayerRange(2, 4)]
    gates = [StepGate() for _ in ranges]
    async with shards(ranges, gates=gates) as (whole, *ws):
        hops = [ws[0:2], ws[2:4]]
        results = await _drained_generation(hops, [gates[1], gates[3]], whole, drain_hop=drain_hop,
                                            sessions=4, after=4 * (len(LONG) + 10))
        failovers = [f for r in results for f in r.failovers]
        assert len(failovers) == 4
        replica = hops[drain_hop][1]
        for f in failovers:
            assert (f.hop, f.reason, f.handover, f.moved) == (drain_hop, "DRAINING", True, True)
            assert f.to_target == replica.target and f.positions > len(LONG)
        m = replica.engine.metrics()
        assert m.sessions_imported_total == 4 and m.prefill_tokens_total == 0
        await assert_all_free([whole, *(w for hop in hops for w in hop if w is not hops[drain_hop][0])])
        assert hops[drain_hop][0].engine.sessions() == ()


async def test_a_replica_of_another_kv_layout_refuses_the_state_and_replays() -> None:
    """The replica lays out KV otherwise (as another llama.cpp build may): no state is sent
    to it (its worker would refuse the header, before a byte of state is kept) and the same
    session replays the history; the tokens are the whole model's."""
    ranges = [LayerRange(0, 4), LayerRange(0, 2), LayerRange(2, 4), LayerRange(2, 4)]
    gates = [StepGate() for _ in ranges]
    async with shards(ranges, gates=gates, kv_layout_tags={3: "/v2"}) as (whole, first, a, b):
        (got,) = await _drained_generation([[first], [a, b]], [gates[1], gates[2]], whole)
        (f,) = got.failovers
        assert (f.handover, f.moved, f.to_target) == (True, False, b.target)
        assert b.engine.metrics().sessions_imported_total == 0
        assert b.engine.metrics().prefill_tokens_total == f.positions  # replayed
        await assert_all_free([whole, first, b])


async def test_a_pipeline_told_not_to_move_states_replays() -> None:
    """``Pipeline.connect(handoff=False)``: the drain hands over by replay, as before."""
    ranges = [LayerRange(0, 4), LayerRange(0, 2), LayerRange(2, 4), LayerRange(2, 4)]
    gates = [StepGate() for _ in ranges]
    async with shards(ranges, gates=gates) as (whole, first, a, b):
        (got,) = await _drained_generation([[first], [a, b]], [gates[1], gates[2]], whole,
                                           handoff=False)
        (f,) = got.failovers
        assert (f.handover, f.moved) == (True, False)
        assert a.engine.metrics().sessions_exported_total == 0
        assert b.engine.metrics().prefill_tokens_total == f.positions
        await assert_all_free([whole, first, b])


async def test_a_full_replica_is_passed_over_for_the_next_one() -> None:
    """Hop 1 has three replicas; the second has every session in use, so the state moves to
    the third."""
    ranges = [LayerRange(0, 4), LayerRange(0, 2)] + [LayerRange(2, 4)] * 3
    gates = [StepGate() for _ in ranges]
    async with shards(ranges, gates=gates) as (whole, first, a, full, c):
        async with contextlib.AsyncExitStack() as stack:
            client = await stack.enter_async_context(ShardClient.connect(full.target))
            for i in range(full.engine.capabilities().max_sessions):
                await stack.enter_async_context(client.session(f"occupant-{i}"))
            (got,) = await _drained_generation([[first], [a, full, c]], [gates[1], gates[2]], whole)
        (f,) = got.failovers
        assert (f.moved, f.to_target) == (True, c.target)
        assert c.engine.metrics().sessions_imported_total == 1
        assert c.engine.metrics().prefill_tokens_total == 0
        await assert_all_free([whole, first, full, c])


# ---- llama.cpp: the case, 8 sessions with 1,024-token histories ---------------------

HISTORY = 1024


async def test_llama_sessions_with_long_histories_move_on_drain_and_give_the_same_tokens() -> None:
    """Eight generations with 1,024-token prompts through a whole-model hop with two llama.cpp
    replicas; the serving one drains once every generation has 4 tokens: each session's KV
    state moves to the other (which computes no prompt position), and every generation's
    greedy tokens equal the same prompt's on a worker that never drained."""
    import numpy as np

    from shard.engine.llama import LlamaCppEngine
    from shard.models import ensure_model

    path = ensure_model("tiny")
    n_tokens, sessions = 16, 8
    spec = LoadSpec(model_path=path, n_ctx=sessions * (HISTORY + 64), max_sessions=sessions,
                    n_threads=1)
    rng = np.random.default_rng(11)
    prompts = [[1, *map(int, rng.integers(3, 259, HISTORY - 1))] for _ in range(sessions)]
    async with worker(engine=LlamaCppEngine(), load=spec) as whole, \
            worker(engine=LlamaCppEngine(), load=spec) as primary, \
            worker(engine=LlamaCppEngine(), load=spec) as replica:
        want = [[s.logits.token_id for s in await whole_model_steps(
            whole.target, p, max_tokens=n_tokens, ignore_eos=True)] for p in prompts]
        counts = [0] * sessions
        started = trio.Event()
        results: list[Any] = [None] * sessions

        async def drain() -> None:
            with trio.fail_after(60):
                await started.wait()
                assert await primary.server.drain_for(60)

        def seen(i: int) -> Any:
            def on_token(_step: pb.StepResult) -> None:
                counts[i] += 1
                if min(counts) >= 4:
                    started.set()
            return on_token

        async def one(pipe: Pipeline, i: int) -> None:
            results[i] = await pipe.generate(prompts[i], max_tokens=n_tokens, ignore_eos=True,
                                             chunk_tokens=256, on_token=seen(i))

        async with Pipeline.connect([[primary.target, replica.target]], timeout=120) as pipe:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain)
                for i in range(sessions):
                    nursery.start_soon(one, pipe, i)
        assert [r.tokens for r in results] == want
        moved = [f for r in results for f in r.failovers]
        assert len(moved) == sessions
        assert all(f.moved and f.handover and f.positions >= HISTORY for f in moved)
        m = replica.engine.metrics()
        assert m.sessions_imported_total == sessions and m.prefill_tokens_total == 0
        await assert_all_free([whole, replica])


async def test_a_hop_past_its_replay_budget_still_moves_on_drain() -> None:
    """A later hop whose replay log was dropped (``replay_bytes``) could not fail over; on a
    drain its state moves instead, and the generation goes on with the whole model's tokens."""
    ranges = [LayerRange(0, 4), LayerRange(0, 2), LayerRange(2, 4), LayerRange(2, 4)]
    gates = [StepGate() for _ in ranges]
    async with shards(ranges, gates=gates) as (whole, first, a, b):
        want = await whole_model_steps(whole.target, LONG, max_tokens=N_TOKENS, ignore_eos=True)

        async def drain() -> None:
            await after_steps(gates[2], len(LONG) + 10, lambda: None)
            with trio.fail_after(10):
                assert await a.server.drain_for(60)

        async with Pipeline.connect([[first.target], [a.target, b.target]], timeout=TIMEOUT,
                                    replay_bytes=600) as pipe, trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            got = await pipe.generate(LONG, max_tokens=N_TOKENS, ignore_eos=True, chunk_tokens=8)
        assert got.tokens == [s.logits.token_id for s in want]
        (f,) = got.failovers
        assert (f.moved, f.to_target) == (True, b.target) and f.positions > len(LONG)
        await assert_all_free([whole, first, b])


@pytest.mark.parametrize("second", ["another-layout", "no-handoff", "refuses"])
async def test_a_hop_that_cannot_replay_tries_each_replica_for_its_state(second: str) -> None:
    """A later hop past its replay budget, three replicas: the drained worker's next one
    cannot take the state (another KV layout, or a worker that moves no sessions at all: no
    state is sent; or its worker refuses the state on its header, here a scripted bound of one
    byte, while the rest of the export is read to its end, since a worker that sent GOAWAY
    opens no stream for a Cancel), so the third takes it, and the generation goes on."""
    ranges = [LayerRange(0, 4), LayerRange(0, 2)] + [LayerRange(2, 4)] * 3
    gates = [StepGate() for _ in ranges]
    tag = {"another-layout": "/v2", "no-handoff": None, "refuses": ""}[second]
    async with shards(ranges, gates=gates, kv_layout_tags={3: tag}) as (whole, first, a, b, c):
        if second == "refuses":
            b.engine._impl_state_bound = lambda n_past: 1  # its sessions take 1 byte of state
        want = await whole_model_steps(whole.target, LONG, max_tokens=N_TOKENS, ignore_eos=True)

        async def drain() -> None:
            await after_steps(gates[2], len(LONG) + 10, lambda: None)
            with trio.fail_after(10):
                assert await a.server.drain_for(60)

        async with Pipeline.connect([[first.target], [a.target, b.target, c.target]],
                                    timeout=TIMEOUT, replay_bytes=600) as pipe, \
                trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            got = await pipe.generate(LONG, max_tokens=N_TOKENS, ignore_eos=True, chunk_tokens=8)
        assert got.tokens == [s.logits.token_id for s in want]
        (f,) = got.failovers
        assert (f.moved, f.to_target) == (True, c.target)
        assert b.engine.metrics().sessions_imported_total == 0
        await assert_all_free([whole, first, b, c])


async def test_a_generate_that_yields_on_drain_ends_between_two_tokens_with_its_session_open() -> None:
    """``Generate{yield_on_drain}``: once the worker drains the request ends after its next
    token with DRAINING (reason YIELDED) and the session stays open and exportable; the same
    request without the flag runs to its end (the drain lets it finish)."""
    gate = StepGate()
    async with worker(gate=gate) as w:
        async with _session(w.target, "y") as s, _session(w.target, "n") as plain:
            await s.prefill(PROMPT)
            await plain.prefill(PROMPT)
            draining = trio.Event()

            async def drain() -> None:
                await draining.wait()
                await w.server.drain_for(60)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain)
                got: list[int] = []
                with pytest.raises(ShardError) as info:
                    async for step in s.generate(max_tokens=30, ignore_eos=True,
                                                 yield_on_drain=True):
                        got.append(step.logits.token_id)
                        if len(got) == 3:
                            draining.set()
                            await trio.sleep(0.05)  # the drain has begun
                assert (info.value.code, info.value.reason) == (ErrorCode.DRAINING, "YIELDED")
                assert 4 <= len(got) < 30 and s.alive
                assert s.usage.n_past == len(PROMPT) + len(got)  # the last token chosen, not fed
                chunks = await _exported(s)
                assert chunks[0].header.n_past == s.usage.n_past
                assert chunks[0].header.next_token == got[-1]
                assert len(await _tokens(plain, 12)) == 12  # no flag: it finishes
                counted = w.server.registry.counters
                assert counted["generations_yielded_total"] == 1
                assert counted["errors_total:ERROR_CODE_DRAINING"] == 0
                await s.close()
                await plain.close()



async def _drained_whole(*, tag: str | None = "", held_import: bool = False,
                         step_timeout: float | None = None) -> tuple[Any, list[int], Any]:
    """A whole-model hop [a, b] decoding in the worker's loop (as a pool drives it), a drained
    mid-generation; returns (the result, the whole model's tokens, b). ``held_import``: b's
    import of a moved session does not finish before the generation has."""
    ranges = [LayerRange(0, 4)] * 3
    gates = [StepGate() for _ in ranges]
    async with shards(ranges, gates=gates, latency=0.01, kv_layout_tags={2: tag}) as (whole, a, b):
        want = [s.logits.token_id for s in await whole_model_steps(
            whole.target, LONG, max_tokens=N_TOKENS, ignore_eos=True)]
        generated = trio.Event()
        if held_import:
            real = b.engine._impl_import

            async def held(*args: Any) -> None:
                with trio.move_on_after(60):  # (a move that never gives up fails, not hangs)
                    await generated.wait()
                await real(*args)

            b.engine._impl_import = held  # a replica slower than any wait for it

        async def drain() -> None:
            await after_steps(gates[1], len(LONG) + 10, lambda: None)
            with trio.fail_after(20):
                assert await a.server.drain_for(60)

        async with Pipeline.connect([[a.target, b.target]], timeout=TIMEOUT,
                                    step_timeout=step_timeout) as pipe:
            pipe.step_replicas = False
            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain)
                got = await pipe.generate(LONG, max_tokens=N_TOKENS, ignore_eos=True,
                                          chunk_tokens=8)
                generated.set()
        await b.idle()  # (a held import finishes, shielded, before its session is released)
        await assert_all_free([whole, b])
        return got, want, b


async def test_a_generation_yields_only_toward_a_replica_that_takes_its_state() -> None:
    """The only replica lays out KV otherwise: the generation is not asked to yield, so it
    finishes on the draining worker instead of being replayed on the replica."""
    got, want, b = await _drained_whole(tag="/v2")
    assert got.tokens == want and got.failovers == []
    assert b.engine.metrics().prefill_tokens_total == 0


async def test_a_move_that_times_out_leaves_the_generation_on_the_draining_worker() -> None:
    """The replica's import does not finish while the move waits for it (8 step timeouts): the
    move is given up, the export left half-read on the draining worker is read to its end (no
    Cancel can reach a worker that sent GOAWAY) and the generation finishes there with the whole
    model's tokens. (The import is held, not slow: with a short step timeout, 0.2 s, a loaded
    machine's pause also timed out an ordinary step, and no replica was left.)"""
    got, want, b = await _drained_whole(held_import=True, step_timeout=1.0)
    assert got.tokens == want and got.failovers == []
