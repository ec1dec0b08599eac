"""One ``Pipeline``, many concurrent generations (issue 32): each gets its own whole-model
tokens, one's failure or cancellation leaves the others' tokens and sessions as they were, and
the generations are spread over batch groups that every hop keeps apart.

The workers are live FakeEngine workers in batched mode (ticks of scripted cost, as llama.cpp
batches) on loopback ports, in both relay modes; every worker is asked over the wire afterwards
(no session, no KV cell, nothing retained).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import trio

from rpc_harness import MODEL, Worker, worker
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.engine import InvalidInput, LayerRange, LoadSpec
from shard.engine.fake import FakeEngine, FakeScript, FakeStep
from shard.pipeline import Pipeline, PipelineError
from shard.pipeline.groups import BatchGroups, default_groups
from shard.relay import ChainRelay
from shard.rpc.errors import ErrorCode
from shard.v1 import shard_pb2 as pb
from test_pipeline import TIMEOUT, assert_all_free, whole_model_steps

N_GEN = 8
N_TOKENS = 24
RELAYS = ["client", "chain"]


@asynccontextmanager
async def batched_shards(
    ranges: Sequence[LayerRange | None], *, relay: bool, on_step: Any = None
) -> AsyncIterator[list[Worker]]:
    """One batched FakeEngine worker per range (None: the whole model), room for 12 sessions;
    ``on_step(worker_index, step)`` sees every computed position."""
    async with AsyncExitStack() as stack:
        workers = []
        for i, lr in enumerate(ranges):
            hook = None if on_step is None else (lambda step, i=i: on_step(i, step))
            engine = FakeEngine(model=MODEL, script=FakeScript(
                batched=True, tick_latency=0.002, row_latency=0.0002, on_step=hook))
            spec = LoadSpec(n_ctx=12 * 256, max_sessions=12, layer_range=lr)
            workers.append(await stack.enter_async_context(worker(
                engine=engine, load=spec, relay=ChainRelay() if relay else None)))
        yield workers


def prompt(i: int) -> list[int]:
    return [1, *(3 + (i * 7 + k * 5) % 200 for k in range(5 + i))]


@pytest.mark.parametrize("relay", RELAYS)
async def test_concurrent_generations_each_get_the_whole_models_tokens(relay: str) -> None:
    layers = [None, LayerRange(0, 1), LayerRange(1, 3), LayerRange(3, 4)]
    async with batched_shards(layers, relay=relay == "chain") as (whole, *chain):
        want = [await whole_model_steps(whole.target, prompt(i), max_tokens=N_TOKENS,
                                        ignore_eos=True, top_logprobs=3) for i in range(N_GEN)]
        got: dict[int, Any] = {}
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT, relay=relay) as pipe:
            assert pipe.batch_groups.size == default_groups(3) == 3
            occupied: list[list[int]] = []

            async def one(i: int) -> None:
                def seen(_: pb.StepResult) -> None:
                    occupied.append(pipe.batch_groups.members())

                got[i] = await pipe.generate(prompt(i), max_tokens=N_TOKENS, ignore_eos=True,
                                             top_logprobs=3, on_token=seen)

            async with trio.open_nursery() as nursery:
                for i in range(N_GEN):
                    nursery.start_soon(one, i)
            assert pipe.batch_groups.members() == [0, 0, 0]
        for i in range(N_GEN):
            assert got[i].tokens == [s.logits.token_id for s in want[i]], i
            assert [s.logits for s in got[i].steps] == [s.logits for s in want[i]], i
        # while all eight ran, as even as three groups allow
        assert [3, 3, 2] in occupied and all(sum(m) <= N_GEN for m in occupied)
        await assert_all_free([whole, *chain])


@pytest.mark.parametrize("relay", RELAYS)
async def test_a_failed_and_a_cancelled_generation_leave_the_others_intact(relay: str) -> None:
    """Of six concurrent generations one asks for too long a prompt (INVALID_ARGUMENT at the
    first hop), one is cancelled by its caller after 5 tokens, one has a step refused on the
    middle hop mid-generation (scripted for its session only): the other three get their
    whole-model tokens, and nothing is left on any worker."""
    failing: set[str] = set()

    def on_step(index: int, step: FakeStep) -> None:
        if index == 2 and step.session_id in failing and step.position >= 20:
            raise InvalidInput("scripted refusal of one session's step")

    layers = [None, LayerRange(0, 1), LayerRange(1, 3), LayerRange(3, 4)]
    async with batched_shards(layers, relay=relay == "chain", on_step=on_step) as (whole, *chain):
        want = {i: await whole_model_steps(whole.target, prompt(i), max_tokens=N_TOKENS,
                                           ignore_eos=True) for i in (0, 1, 2)}
        outcome: dict[str, Any] = {}
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT, relay=relay) as pipe:

            async def good(i: int) -> None:
                outcome[f"good{i}"] = await pipe.generate(prompt(i), max_tokens=N_TOKENS,
                                                          ignore_eos=True)

            async def too_long() -> None:
                with pytest.raises(PipelineError) as info:
                    await pipe.generate([1] * 5000, max_tokens=4)
                outcome["too_long"] = info.value

            async def cancelled() -> None:
                with trio.CancelScope() as scope:
                    def stop(step: pb.StepResult) -> None:
                        outcome["cancelled_tokens"] = outcome.get("cancelled_tokens", 0) + 1
                        if outcome["cancelled_tokens"] == 5:
                            scope.cancel()

                    await pipe.generate(prompt(3), max_tokens=N_TOKENS, ignore_eos=True,
                                        on_token=stop)
                outcome["cancelled"] = scope.cancelled_caught

            async def broken() -> None:
                sid = "broken"
                # the middle hop's session of this generation (client relay: <id>.1; chain
                # relay: the name the first worker gives its next hop's session)
                failing.update({f"{sid}.1", f"{sid}.0>"})
                with pytest.raises(PipelineError) as info:
                    await pipe.generate(prompt(4), max_tokens=N_TOKENS, ignore_eos=True,
                                        session_id=sid)
                outcome["broken"] = info.value

            async with trio.open_nursery() as nursery:
                for i in (0, 1, 2):
                    nursery.start_soon(good, i)
                nursery.start_soon(too_long)
                nursery.start_soon(cancelled)
                nursery.start_soon(broken)
        for i in (0, 1, 2):
            assert outcome[f"good{i}"].tokens == [s.logits.token_id for s in want[i]], i
        assert outcome["too_long"].code == ErrorCode.INVALID_ARGUMENT
        assert outcome["cancelled"] and outcome["cancelled_tokens"] == 5
        assert outcome["broken"].code == ErrorCode.INVALID_ARGUMENT and outcome["broken"].hop_index == 1
        await assert_all_free([whole, *chain])


def test_batch_groups_stay_even_and_give_back() -> None:
    groups = BatchGroups(3)
    taken = [groups.take() for _ in range(7)]
    assert groups.members() == [3, 2, 2] and len(set(taken)) == 3 and 0 not in taken
    for g in taken[:3]:
        groups.give_back(g)
    assert groups.members() == [2, 1, 1]
    assert groups.take() in taken[1:3] and sorted(groups.members()) == [1, 2, 2]
    with pytest.raises(RuntimeError), groups.member() as g:  # given back however the block ends
        assert groups.members()[g - min(taken)] == 2
        raise RuntimeError
    assert sorted(groups.members()) == [1, 2, 2]
    none = BatchGroups(0)
    assert none.take() == 0 and none.members() == []
    none.give_back(0)
    assert default_groups(1) == 0 and default_groups(2) == 2
    with pytest.raises(ValueError):
        BatchGroups(-1)
