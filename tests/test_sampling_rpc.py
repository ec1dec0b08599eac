"""min_p, penalties and logit_bias over the wire: a worker honours them, a pipeline's last hop
penalizes the ids its hops carry (the tokens equal the whole-model worker's, plain, speculative,
relayed and after a failover's replay), and a client never sends them to a worker that would
ignore them."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import numpy as np
import pytest

from rpc_harness import MAX_SESSIONS, MODEL, N_CTX, Worker, worker
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.client import ShardClient, ShardError, check_sampling_support, sampling
from shard.engine import LayerRange, LoadSpec
from shard.engine.fake import FakeEngine
from shard.pipeline import Pipeline, PipelineError
from shard.pipeline.replay import ReplayBudget, RowLog
from shard.relay import ChainRelay
from shard.rpc import convert
from shard.rpc.errors import ErrorCode
from shard.v1 import shard_pb2 as pb
from test_failover import LONG, N_TOKENS, assert_same, fleet, gate_of, run_with
from test_pipeline import after_steps, whole_model_steps

TIMEOUT = 30.0
PROMPT = [1, *(3 + b for b in b"penalties, penalties")]
#: Sampled, every penalty over the whole session, min_p and a bias.
PENALIZED: dict[str, Any] = dict(temperature=0.9, seed=3, repeat_penalty=1.3, presence_penalty=0.4,
                                 frequency_penalty=0.3, penalty_last_n=-1, min_p=0.02,
                                 logit_bias={40: 1.5, 41: -math.inf})


@asynccontextmanager
async def workers(*ranges: LayerRange, relay: bool = False) -> AsyncIterator[list[Worker]]:
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(worker(
            engine=FakeEngine(model=MODEL), relay=ChainRelay() if relay else None,
            load=LoadSpec(n_ctx=N_CTX, max_sessions=MAX_SESSIONS, layer_range=lr)))
            for lr in ranges]


async def client_tokens(target: str, n: int, **kw: Any) -> list[int]:
    async with ShardClient.connect(target, timeout=TIMEOUT) as client:
        return [s.logits.token_id async for s in client.generate(
            PROMPT, max_tokens=n, ignore_eos=True, **kw)]


def test_the_wire_carries_every_field_and_reads_unset_as_off() -> None:
    msg = sampling(top_k=3, **PENALIZED)
    params = convert.sampling_from_proto(pb.SamplingParams.FromString(msg.SerializeToString()))
    assert (params.min_p, params.penalty_last_n) == (pytest.approx(0.02), -1)
    assert params.repeat_penalty == pytest.approx(1.3) and params.presence_penalty == pytest.approx(0.4)
    assert params.logit_bias == ((40, 1.5), (41, -math.inf))
    unset = convert.sampling_from_proto(pb.SamplingParams())
    assert unset.plain_greedy and unset.repeat_penalty == 1.0 and unset.penalty_last_n == 64
    # (an empty message is read once and shared: what the fields read as, set explicitly)
    assert unset == convert.sampling_from_proto(pb.SamplingParams(top_p=1.0, repeat_penalty=1.0))
    assert convert.sampling_from_proto(pb.SamplingParams(), grammar_start=7).grammar is None
    assert not convert.uses_sampling_extensions(sampling(0.7, top_k=5, top_p=0.9))
    # a window of 0 (no penalties) travels as penalties off
    assert not convert.sampling_from_proto(sampling(repeat_penalty=2.0, penalty_last_n=0)).penalized
    with pytest.raises(ShardError, match="repeat_penalty") as info:
        convert.sampling_from_proto(pb.SamplingParams(repeat_penalty=-1.0))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT


async def test_a_worker_honours_penalties_and_bias() -> None:
    async with workers(LayerRange(0, 4)) as (whole,):
        plain = await client_tokens(whole.target, 30)
        assert len(set(plain)) < len(plain)  # (the fake model repeats itself)
        fresh = await client_tokens(whole.target, 30, presence_penalty=1e4, penalty_last_n=-1)
        assert len(set(fresh)) == len(fresh) and not set(fresh) & set(PROMPT)
        assert await client_tokens(whole.target, 5, logit_bias={40: 1e3}) == [40] * 5
        async with ShardClient.connect(whole.target, timeout=TIMEOUT) as client:
            caps = await client.capabilities()
            assert caps.sampling_penalties
            with pytest.raises(ShardError) as info:
                async for _ in client.generate(PROMPT, logit_bias={caps.n_vocab: 1.0}):
                    pass
            assert info.value.code is ErrorCode.INVALID_ARGUMENT and "logit_bias" in info.value.message


@pytest.mark.parametrize("mode", ["stepped", "speculative", "relayed"])
async def test_a_two_part_pipeline_gives_the_whole_models_penalized_tokens(mode: str) -> None:
    relay = mode == "relayed"
    async with workers(LayerRange(0, 4), LayerRange(0, 2), LayerRange(2, 4), relay=relay) as (
            whole, first, last):
        want = await client_tokens(whole.target, 40, **PENALIZED)
        kw: dict[str, Any] = {"relay": "chain"} if relay else {}
        async with Pipeline.connect([first.target, last.target], timeout=TIMEOUT, **kw) as pipe:
            got = await pipe.generate(PROMPT, max_tokens=40, ignore_eos=True, chunk_tokens=4,
                                      speculate=3 if mode == "speculative" else 0, **PENALIZED)
        assert got.tokens == want


async def test_a_last_hop_without_the_ids_refuses_penalties() -> None:
    async with workers(LayerRange(0, 2), LayerRange(2, 4)) as (first, last):
        async with (ShardClient.connect(first.target, timeout=TIMEOUT) as c1,
                    ShardClient.connect(last.target, timeout=TIMEOUT) as c2,
                    c1.session() as s1, c2.session() as s2):
            b = await s1.prefill(tokens=PROMPT)
            rows = convert.tensor_to_array(b.hidden_states, MODEL.n_embd)
            with pytest.raises(ShardError) as info:
                await s2.prefill(hidden_states=rows, sampling=sampling(repeat_penalty=1.2))
            assert info.value.code is ErrorCode.INVALID_ARGUMENT
            assert "token ids" in info.value.message
            r = await s2.prefill(hidden_states=rows, token_ids=PROMPT,
                                 sampling=sampling(repeat_penalty=1.2))
            assert r.n_past == len(PROMPT)


async def test_a_client_sends_them_only_to_a_worker_that_honours_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    old = pb.GetCapabilitiesResponse(n_vocab=300)  # a worker older than the flag
    check_sampling_support(old, sampling(0.7, top_k=4))  # plain sampling goes anywhere
    for extra in ({"min_p": 0.1}, {"repeat_penalty": 1.1}, {"presence_penalty": 0.5},
                  {"frequency_penalty": -0.5}, {"logit_bias": {3: 1.0}}):
        with pytest.raises(ShardError) as info:
            check_sampling_support(old, sampling(**extra))
        assert info.value.code is ErrorCode.UNSUPPORTED_FEATURE
    # the servicer of an old worker: no flag (it would ignore the fields)
    real = convert.capabilities_to_proto

    def without_flag(*args: Any, **kw: Any) -> pb.GetCapabilitiesResponse:
        caps = real(*args, **kw)
        caps.sampling_penalties = False
        return caps

    monkeypatch.setattr(convert, "capabilities_to_proto", without_flag)
    async with workers(LayerRange(0, 4), LayerRange(0, 2), LayerRange(2, 4)) as (whole, first, last):
        with pytest.raises(ShardError) as info:
            await client_tokens(whole.target, 3, presence_penalty=0.5)
        assert info.value.code is ErrorCode.UNSUPPORTED_FEATURE
        assert whole.engine.metrics().sessions_active == 0 and not whole.calls  # nothing opened
        assert await client_tokens(whole.target, 3, temperature=0.5) != []
        async with Pipeline.connect([first.target, last.target], timeout=TIMEOUT) as pipe:
            with pytest.raises(PipelineError) as perr:
                await pipe.generate(PROMPT, max_tokens=3, logit_bias={5: 1.0})
            assert perr.value.hop_index == 1
            assert perr.value.code is ErrorCode.UNSUPPORTED_FEATURE


@pytest.mark.parametrize("relay", ["client", "chain"])
@pytest.mark.parametrize("hop", [0, 2])
async def test_a_failover_replays_the_ids_the_penalties_see(relay: str, hop: int) -> None:
    """A hop's worker stops mid-decode: its replica replays the history (ids with the rows), so
    the last hop's penalties go on over the same window and the tokens are the whole model's."""
    async with fleet(relay) as (whole, hops, gates):
        want = await whole_model_steps(whole.target, LONG, max_tokens=N_TOKENS, ignore_eos=True,
                                       top_logprobs=5, sampling=sampling(**PENALIZED))
        primary = hops[hop][0]
        async with Pipeline.connect([[w.target for w in ws] for ws in hops], timeout=TIMEOUT,
                                    relay=relay) as pipe:
            got, seen = await run_with(
                lambda: after_steps(gate_of(gates, hop, 0), len(LONG) + 1 + 15, primary.stop),
                pipe, **PENALIZED)
        assert_same(got, want, seen)
        assert [f.hop for f in got.failovers] == [hop]


def test_a_row_log_keeps_the_ids_of_its_rows_until_a_step_comes_without() -> None:
    log = RowLog(ReplayBudget(2**20))
    rows = np.zeros((3, 4), dtype=np.float32)
    log.append(rows, "float32", [5, 6, 7])
    log.append(rows[:1], "float32", [1, 2, 8])  # ids beyond the rows: the last ones are its
    assert log.ids == [5, 6, 7, 8]
    log.truncate(2)
    assert log.ids == [5, 6] and log.positions == 2
    log.append(rows[:1], "float32")
    assert log.ids is None and log.positions == 3
