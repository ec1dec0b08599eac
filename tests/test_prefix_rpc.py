"""The engine's prefix cache above the engine: the worker's option and capabilities, the wire
fields (``StepResult``/``Usage.cached_tokens``, ``Prefill.token_ids``, ``Decode.token_id``),
metrics and Prometheus, the pipeline in client and chain relay, and the front door's usage, on
the fake engine and on the tiny llama.cpp model.

Every test runs a chat as a chat UI does: each turn resends the whole conversation (the
previous prompt, the tokens generated for it, something new). With the cache, a later turn
takes the earlier turn's history from the cache; its greedy tokens must equal a cacheless
worker's (the fake engine computes the same whatever the chunks, so the cacheless reference
may prefill in any chunks).
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import numpy as np
import pytest
import trio

from rpc_harness import MAX_SESSIONS, MODEL, N_CTX, V, Requests, Worker, in_thread, req, worker
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.cli.serve import prefix_cache_budget
from shard.client import ShardClient, ShardError
from shard.engine import LayerRange, LoadSpec
from shard.engine.fake import FakeEngine
from shard.engine.llama import LlamaCppEngine
from shard.models import ensure_model, ensure_slice
from shard.pipeline import Pipeline, PipelineError
from shard.relay import ChainRelay
from shard.rpc.errors import ErrorCode
from shard.rpc.metrics import families
from shard.v1 import shard_pb2 as pb

TIMEOUT = 30.0
BUDGET = N_CTX // MAX_SESSIONS  # one session's context: one cached conversation
N_NEW = 8  # tokens generated a turn
#: What each turn adds to the conversation before the model answers.
TURNS = [[1, *b"the quick brown fox"], list(b" jumps over"), list(b" the lazy dog")]
HALVES = [LayerRange(0, 2), LayerRange(2, 4)]


@asynccontextmanager
async def workers(
    ranges: Sequence[LayerRange | None], budgets: Sequence[int], *, relay: bool = False,
) -> AsyncIterator[list[Worker]]:
    """One live FakeEngine worker per range, each with its prefix cache budget."""
    async with AsyncExitStack() as stack:
        out = []
        for lr, budget in zip(ranges, budgets, strict=True):
            spec = LoadSpec(n_ctx=N_CTX, max_sessions=MAX_SESSIONS, layer_range=lr,
                            prefix_cache_tokens=budget)
            out.append(await stack.enter_async_context(worker(
                engine=FakeEngine(model=MODEL), load=spec,
                relay=ChainRelay() if relay else None)))
        yield out


async def chat_on_worker(target: str, chunk: int = 0) -> list[tuple[list[int], int, int]]:
    """The turns on one whole-model worker (``Generate``, or a chunked prefill and decodes
    with ``chunk``): per turn (tokens, ``Usage.cached_tokens``, the first step's)."""
    out = []
    history: list[int] = []
    async with ShardClient.connect(target, timeout=TIMEOUT) as client:
        for turn in TURNS:
            prompt = history + turn
            async with client.session() as s:
                if chunk:
                    steps = [st async for st in s.prefill_chunks(prompt, chunk_tokens=chunk)]
                    cached = sum(st.cached_tokens for st in steps)
                    first = steps[0].cached_tokens
                    assert s.usage.cached_tokens == cached
                    tokens = [steps[-1].logits.token_id]
                    while len(tokens) < N_NEW:
                        tokens.append((await s.decode(tokens[-1])).logits.token_id)
                else:
                    steps = [st async for st in s.generate(prompt, max_tokens=N_NEW, ignore_eos=True)]
                    tokens = [st.logits.token_id for st in steps]
                    cached, first = s.usage.cached_tokens, steps[0].cached_tokens
            out.append((tokens, cached, first))
            history = prompt + tokens
    return out


def held_after(turn: int) -> int:
    """What a session of turn ``turn`` held when it was released: its prompt and every
    generated token but the last (which was never fed back)."""
    return sum(len(t) for t in TURNS[: turn + 1]) + (turn + 1) * N_NEW - 1


async def engine_metrics(target: str) -> dict[str, int]:
    async with ShardClient.connect(target, timeout=TIMEOUT) as client:
        return dict((await client.metrics()).engine)


# ---- the steps of a cached prefill ----------------------------------------------------------


class _Step:
    """What ``PrefillChunks.took`` reads of a step's result."""

    def __init__(self, cached: int, reused: int = 0) -> None:
        self.cached_tokens, self.reused_tokens = cached, reused


def test_a_prefill_the_cache_covers_takes_the_rest_in_one_more_step() -> None:
    """A covered first chunk (all but the one position a step computes) makes the next step take
    the rest, up to ``most``: one more copy of the entry's stream, not one per doubling."""
    from shard.rpc.session.inputs import PrefillChunks

    chunks = PrefillChunks(1000, 32, 0, 1000)
    spans = iter(chunks)
    assert next(spans) == (0, 32)
    chunks.took(_Step(31), 0, 32)  # type: ignore[arg-type]
    assert next(spans) == (32, 1000)

    bounded = PrefillChunks(1000, 32, 0, 300)  # one message carries at most 300 rows on
    spans = iter(bounded)
    assert next(spans) == (0, 32)
    bounded.took(_Step(31), 0, 32)  # type: ignore[arg-type]
    assert next(spans) == (32, 332)
    bounded.took(_Step(100), 32, 332)  # type: ignore[arg-type]  # the cache ran out: chunks again
    assert next(spans) == (332, 364)
    bounded.took(_Step(0), 332, 364)  # type: ignore[arg-type]
    assert next(spans) == (364, 396)


# ---- one worker -----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [0, 5], ids=["generate", "chunked-prefill"])
async def test_a_later_turn_takes_the_conversation_from_the_cache(chunk: int) -> None:
    async with workers([None, None], [BUDGET, 0]) as (cached, plain):
        got = await chat_on_worker(cached.target, chunk)
        want = await chat_on_worker(plain.target, 5)
        assert [t for t, _, _ in got] == [t for t, _, _ in want]
        assert [c for _, c, _ in want] == [0, 0, 0]
        m = await engine_metrics(cached.target)
        assert m["prefix_cache_entries"] == 1 and m["prefix_cache_tokens"] == held_after(2)
        # (chunked: the first step takes the covered prefix and one chunk)
        assert [c for _, c, _ in got] == [0, held_after(0), held_after(1)]
        assert got[1][2] == held_after(0)  # the first step of the turn carries it
        assert m["prefix_cache_hits_total"] == 2
        assert m["prefix_cache_hit_tokens_total"] == held_after(0) + held_after(1)
        assert (await engine_metrics(plain.target))["prefix_cache_hits_total"] == 0


async def test_capabilities_metrics_and_prometheus_report_the_cache() -> None:
    async with workers([None, None], [BUDGET, 0]) as (cached, plain):
        await chat_on_worker(cached.target)
        async with ShardClient.connect(cached.target, timeout=TIMEOUT) as client:
            caps = await client.capabilities()
            shown = await client.capabilities_dict()
            snapshot = await client.metrics()
        assert caps.prefix_cache_tokens == BUDGET and caps.prefix_cache_detail
        assert shown["prefix_cache_tokens"] == BUDGET  # what `trio-shard caps` prints
        samples = {s.name: s.value for f in families(snapshot) for s in f.samples}
        assert samples["trio_shard_engine_prefix_cache_hits_total"] == 2
        assert samples["trio_shard_engine_prefix_cache_stored_total"] == 3
        assert samples["trio_shard_engine_prefix_cache_evictions_total"] == 0
        assert samples["trio_shard_engine_prefix_cache_entries"] == 1
        assert samples["trio_shard_engine_prefix_cache_tokens"] == held_after(2)
        assert samples["trio_shard_engine_prefix_cache_hit_tokens_total"] > 0
        async with ShardClient.connect(plain.target, timeout=TIMEOUT) as client:
            off = await client.capabilities()
        assert off.prefix_cache_tokens == 0


def test_serve_defaults_to_one_session_of_cache_on_a_whole_model_only() -> None:
    args = argparse.Namespace(prefix_cache_tokens=None, ctx=4096, max_sessions=4)
    assert prefix_cache_budget(args, whole_model=True) == 1024
    assert prefix_cache_budget(args, whole_model=False) == 0
    args.max_sessions = 256  # every sequence llama.cpp has is a session's
    assert prefix_cache_budget(args, whole_model=True) == 0
    args.prefix_cache_tokens = 0
    assert prefix_cache_budget(args, whole_model=True) == 0
    args.prefix_cache_tokens = 300
    assert prefix_cache_budget(args, whole_model=False) == 300


def test_print_config_shows_the_budget(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from shard.cli.main import main

    monkeypatch.setenv("TRIO_SHARD_PREFIX_CACHE_TOKENS", "0")
    assert main(["serve", "--print-config"]) == 0
    assert "TRIO_SHARD_PREFIX_CACHE_TOKENS=0  # environment" in capsys.readouterr().out.splitlines()


# ---- hidden-state input on a later shard -----------------------------------------------------


async def test_rows_without_their_cached_prefix_are_refused_and_change_nothing() -> None:
    """More ids than rows: the first positions must come from this worker's own cache; a
    worker that does not hold them fails the step and holds what it held before."""
    rows = np.ones((3, MODEL.n_embd), dtype=np.float32)
    async with workers([LayerRange(2, 4), LayerRange(2, 4)], [BUDGET, 0]) as hops:
        for hop in hops:
            async with ShardClient.connect(hop.target, timeout=TIMEOUT) as client:
                async with client.session() as s:
                    with pytest.raises(ShardError) as info:
                        await s.prefill(hidden_states=rows, token_ids=[1, 2, 3, 4, 5])
                    assert info.value.code == ErrorCode.ILLEGAL_TRANSITION
                    assert info.value.reason == "PREFIX_NOT_CACHED"
                    assert s.usage.n_past == 0
                    step = await s.prefill(hidden_states=rows, token_ids=[1, 2, 3])
                    assert step.n_past == 3 and step.cached_tokens == 0
                    with pytest.raises(ShardError) as info:  # ids beyond the rows: at the end only
                        await s.prefill(hidden_states=rows, token_ids=[1, 2, 3, 4], position=1)
                    assert info.value.code == ErrorCode.INVALID_ARGUMENT


async def test_grpcio_sees_the_new_fields() -> None:
    """A client built from the .proto alone (grpcio): capabilities, the cached count on a step
    and in Usage, the metrics."""
    from test_rpc_grpcio import Responses, live

    spec = LoadSpec(n_ctx=N_CTX, max_sessions=MAX_SESSIONS, prefix_cache_tokens=BUDGET)
    prompt = TURNS[0]
    async with live(load=spec) as w:
        caps = await in_thread(lambda: w.stub.GetCapabilities(
            pb.GetCapabilitiesRequest(version=V), timeout=10))
        assert caps.prefix_cache_tokens == BUDGET and caps.prefix_cache_detail
        usages = []
        for sid, ids in (("g1", prompt), ("g2", [*prompt, *b" again"])):
            reqs = Requests(req(open=pb.OpenSession(session_id=sid)))
            rs = Responses(w.stub.Session(iter(reqs), timeout=10))
            try:
                await rs.kind("opened")
                reqs.put(req(prefill=pb.Prefill(tokens=pb.TokenIds(ids=ids))))
                (step,), err, usage = await rs.until_usage()
                assert err is None and step.cached_tokens == usage.cached_tokens
                usages.append(usage)
                reqs.put(req(close=pb.CloseSession()))
                await rs.kind("closed")
            finally:
                reqs.end()
            await rs.rest()
        assert [u.cached_tokens for u in usages] == [0, len(prompt)]
        assert [u.prompt_tokens for u in usages] == [len(prompt), 6]
        metrics = await in_thread(lambda: w.stub.GetMetrics(
            pb.GetMetricsRequest(version=V), timeout=10))
        assert metrics.engine["prefix_cache_hits_total"] == 1
        await w.idle()


# ---- pipelines ------------------------------------------------------------------------------


async def chat_on_pipeline(targets: Sequence[str], relay: str, chunk: int = 5) -> list[tuple[list[int], int]]:
    """The turns through a pipeline: per turn (tokens, ``PipelineResult.cached_tokens``)."""
    out = []
    history: list[int] = []
    async with Pipeline.connect(list(targets), timeout=TIMEOUT, relay=relay) as pipe:
        for turn in TURNS:
            prompt = history + turn
            result = await pipe.generate(prompt, max_tokens=N_NEW, ignore_eos=True,
                                         chunk_tokens=chunk)
            out.append((result.tokens, result.cached_tokens))
            history = prompt + result.tokens
    return out


THIRDS = [LayerRange(0, 1), LayerRange(1, 3), LayerRange(3, 4)]


@pytest.mark.parametrize("ranges", [HALVES, THIRDS], ids=["2-hops", "3-hops"])
@pytest.mark.parametrize("chunk", [5, 64])
@pytest.mark.parametrize("relay", ["client", "chain"])
async def test_every_hop_of_a_pipeline_takes_the_same_prefix(
    relay: str, chunk: int, ranges: list[LayerRange]
) -> None:
    async with workers([None], [0]) as (plain,):
        want = await chat_on_worker(plain.target, 5)
    async with workers(ranges, [BUDGET] * len(ranges), relay=relay == "chain") as hops:
        got = await chat_on_pipeline([h.target for h in hops], relay, chunk)
        assert [t for t, _ in got] == [t for t, _, _ in want]
        metrics = [await engine_metrics(hop.target) for hop in hops]
        for m in metrics:
            assert m["prefix_cache_entries"] == 1 and m["prefix_cache_tokens"] == held_after(2)
        # each hop took the same positions from its own cache
        assert len({m["prefix_cache_hit_tokens_total"] for m in metrics}) == 1
        # (chunk 5: the first step takes the covered prefix and one chunk)
        assert [c for _, c in got] == [0, held_after(0), held_after(1)]
        assert [m["prefix_cache_hits_total"] for m in metrics] == [2] * len(ranges)
        assert metrics[0]["prefix_cache_hit_tokens_total"] == held_after(0) + held_after(1)


# ---- the front door -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["whole", "pipeline", "chain"])
async def test_the_door_reports_cached_prompt_tokens(shape: str) -> None:
    from test_api import NAME, SHAPES, front_door, get

    ranges, relay = SHAPES[shape]
    async with front_door(ranges, relay=relay, prefix_cache_tokens=512) as door:
        def twice() -> list[object]:
            c = door.client
            return [c.completions.create(model=NAME, prompt="hello world", max_tokens=6,
                                         temperature=0) for _ in range(2)]

        first, second = await in_thread(twice)
        assert first.choices[0].text == second.choices[0].text
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        # the whole prompt but the position a step must compute
        assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
        status, page = await in_thread(lambda: get(door.url + "/metrics"))
        assert status == 200
        assert (f"trio_shard_api_cached_prompt_tokens_total {second.usage.prompt_tokens - 1}.0"
                in page.decode().splitlines())


# ---- llama.cpp ------------------------------------------------------------------------------


async def chat_in_one_session(target: str) -> list[list[int]]:
    """The reference for llama.cpp: the turns on one cacheless session that is never released,
    each turn appending what is new (the last token, then the turn's text) in one step: the
    steps a cached turn computes, so the same cells and the same tokens."""
    out: list[list[int]] = []
    async with ShardClient.connect(target, timeout=TIMEOUT) as client:
        async with client.session() as s:
            for turn in TURNS:
                feed = turn if not out else [out[-1][-1], *turn]
                steps = [st async for st in s.generate(feed, max_tokens=N_NEW, ignore_eos=True)]
                out.append([st.logits.token_id for st in steps])
    return out


async def test_llama_workers_take_the_conversation_from_the_cache() -> None:
    source = ensure_model("tiny")

    @asynccontextmanager
    async def llama(ranges: Sequence[LayerRange | None], budget: int,
                    relay: bool = False) -> AsyncIterator[list[Worker]]:
        async with AsyncExitStack() as stack:
            out = []
            for lr in ranges:
                path = source if lr is None else await trio.to_thread.run_sync(ensure_slice, source, lr)
                spec = LoadSpec(model_path=path, layer_range=lr, n_ctx=512, max_sessions=2,
                                n_threads=1, prefix_cache_tokens=budget)
                out.append(await stack.enter_async_context(worker(
                    engine=LlamaCppEngine(), load=spec, relay=ChainRelay() if relay else None)))
            yield out

    async with llama([None], 0) as (plain,):
        want = await chat_in_one_session(plain.target)
    async with llama([None], 256) as (cached,):
        got = await chat_on_worker(cached.target)
        assert [t for t, _, _ in got] == want
        assert [c for _, c, _ in got] == [0, held_after(0), held_after(1)]
    for relay in ("client", "chain"):
        async with llama(HALVES, 256, relay=relay == "chain") as hops:
            piped = await chat_on_pipeline([h.target for h in hops], relay, chunk=64)
            assert [t for t, _ in piped] == want, relay
            assert [c for _, c in piped] == [0, held_after(0), held_after(1)], relay
            hits = [(await engine_metrics(h.target))["prefix_cache_hit_tokens_total"] for h in hops]
            assert hits == [held_after(0) + held_after(1)] * 2, relay
