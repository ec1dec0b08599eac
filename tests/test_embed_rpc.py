"""The ``Embed`` RPC against a live worker: a whole model that declares a pooling type embeds
texts and ids in order; a partial shard, a model without pooling and bad input are refused with
the project's structured errors, and the worker stays healthy and holds nothing afterwards."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import MODEL, worker
from shard.client import ErrorCode, ShardClient, ShardError
from shard.engine import LayerRange, LoadSpec
from shard.engine.fake import FakeEngine
from shard.rpc.convert import MAX_EMBED_INPUTS, embeds_per_call
from shard.rpc.errors import GrpcStatus
from shard.rpc.transport import TransportLimits
from shard.v1 import shard_pb2 as pb

POOLED = dataclasses.replace(MODEL, pooling_type="mean")


async def test_embed_answers_each_input_in_order() -> None:
    engine = FakeEngine(POOLED)
    async with worker(engine=engine) as w, ShardClient.connect(w.target, timeout=10) as c:
        caps = await c.capabilities()
        assert caps.pooling_type == "mean" and caps.embeddings
        inputs: list[str | list[int]] = ["hello world", [1, 72, 101, 108], "<s>x</s>"]
        got = await c.embed(inputs)
        assert [e.n_tokens for e in got.embeddings] == [12, 4, 4]  # BOS + bytes; <s>, x, </s> parsed
        for item, e in zip(inputs, got.embeddings):
            ids = (engine.tokenize(item, parse_special=True) if isinstance(item, str) else item)
            expected = await engine.embed(ids)
            assert np.array_equal(np.array(e.values, dtype=np.float32), expected)
        raw = await c.embed(["hello world"], normalize=False)
        values = np.array(raw.embeddings[0].values, dtype=np.float32)
        assert np.array_equal(values, await engine.embed(engine.tokenize("hello world"), normalize=False))
        assert (await c.health()).status == pb.HealthResponse.STATUS_SERVING


@pytest.mark.parametrize("layers", [LayerRange(0, 2), LayerRange(2, 4)], ids=["first", "last"])
async def test_a_partial_shard_answers_failed_precondition(layers: LayerRange) -> None:
    async with worker(engine=FakeEngine(POOLED), load=LoadSpec(n_ctx=1024, layer_range=layers)) as w, \
            ShardClient.connect(w.target, timeout=10) as c:
        caps = await c.capabilities()
        assert caps.pooling_type == "mean" and not caps.embeddings
        with pytest.raises(ShardError) as err:
            await c.embed(["hello"])
        assert err.value.code == ErrorCode.ILLEGAL_TRANSITION
        assert err.value.grpc_status == GrpcStatus.FAILED_PRECONDITION
        assert "whole model" in err.value.message


async def test_a_model_without_pooling_answers_unimplemented() -> None:
    async with worker() as w, ShardClient.connect(w.target, timeout=10) as c:
        caps = await c.capabilities()
        assert caps.pooling_type == "" and not caps.embeddings
        with pytest.raises(ShardError) as err:
            await c.embed([[1, 72]])
        assert err.value.code == ErrorCode.UNSUPPORTED_FEATURE
        assert err.value.grpc_status == GrpcStatus.UNIMPLEMENTED
        assert "no pooling type" in err.value.message


async def test_bad_input_is_refused_naming_it_and_the_worker_stays_healthy() -> None:
    engine = FakeEngine(POOLED)
    async with worker(engine=engine) as w, ShardClient.connect(w.target, timeout=10) as c:
        n = engine.capabilities().n_ctx_per_session
        cases: list[tuple[list[str | list[int]], str, str]] = [
            ([], "inputs is empty", ""),
            (["ok", ""], "input 1: the text is empty", ""),
            (["ok", []], "input 1:", ""),
            ([[1, 72], [1, 10_000]], "input 1: token id 10000", ""),
            (["ok", [1] * (n + 1)], "input 1:", "CONTEXT_LENGTH_EXCEEDED"),
            (["ok", "x" * (n + 5)], "input 1:", ""),
        ]
        for inputs, message, reason in cases:
            with pytest.raises(ShardError) as err:
                await c.embed(inputs)
            assert err.value.code == ErrorCode.INVALID_ARGUMENT, inputs
            assert message in err.value.message
            if reason:
                assert err.value.reason == reason
        assert (await c.health()).status == pb.HealthResponse.STATUS_SERVING
        assert len((await c.embed(["ok", [1] * n])).embeddings) == 2


async def test_a_batch_whose_answer_cannot_fit_a_message_is_refused_whole() -> None:
    limits = TransportLimits(max_message_bytes=64 * 1024)
    engine = FakeEngine(dataclasses.replace(POOLED, n_embd=1024))
    async with worker(engine=engine, transport_limits=limits) as w, \
            ShardClient.connect(w.target, timeout=10) as c:
        per_call = embeds_per_call(1024, limits.max_message_bytes)
        assert 1 < per_call < MAX_EMBED_INPUTS
        got = await c.embed([[1, 72]] * per_call)  # the most that fits: the answer arrives
        assert len(got.embeddings) == per_call
        with pytest.raises(ShardError) as err:
            await c.embed([[1, 72]] * (per_call + 1))
        assert err.value.code == ErrorCode.INVALID_ARGUMENT
        assert f"at most {per_call} per call" in err.value.message
