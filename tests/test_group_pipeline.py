"""Group steps in the client relay (issue 55): concurrent generations of one batch group send
each hop one ``GroupSteps`` message per tick, and every generation's tokens equal the
per-session path's (the whole model's in float32), also for one cancelled mid-group; a worker
that does not speak 1.3 is driven per session. Batched FakeEngine workers over the wire."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import worker
from shard.client import ShardClient
from shard.engine import LayerRange, LoadSpec
from shard.engine.llama import LlamaCppEngine
from shard.models import ensure_model, ensure_slice
from shard.pipeline import Pipeline
from shard.pipeline.gathering import Gatherer, _Group, _Row
from shard.rpc import versions
from shard.v1 import shard_pb2 as pb
from test_pipeline import TIMEOUT, assert_all_free, whole_model_steps
from test_pipeline_concurrency import batched_shards, prompt

N_GEN = 6
N_TOKENS = 12
HOPS = [LayerRange(0, 2), LayerRange(2, 4)]


async def run_all(targets: list[str], dtype: str, batch_groups: int | None,
                  cancel: int | None = None) -> dict[int, list[int]]:
    """Every generation's tokens (``cancel``: that one is cancelled after 3 tokens)."""
    got: dict[int, list[int]] = {}
    async with Pipeline.connect(targets, timeout=TIMEOUT, hidden_dtype=dtype,
                                batch_groups=batch_groups, group_steps=True) as pipe:
        async def one(i: int) -> None:
            with trio.CancelScope() as scope:
                seen: list[int] = []

                def token(step: Any) -> None:
                    seen.append(step.logits.token_id)
                    if i == cancel and len(seen) == 3:
                        scope.cancel()

                result = await pipe.generate(prompt(i), max_tokens=N_TOKENS, ignore_eos=True,
                                             on_token=token)
                got[i] = result.tokens

        async with trio.open_nursery() as nursery:
            for i in range(N_GEN):
                nursery.start_soon(one, i)
    return got


async def group_counts(target: str) -> tuple[int, int]:
    async with ShardClient.connect(target, timeout=TIMEOUT) as client:
        w = (await client.metrics()).worker
    return w.get("group_steps_total", 0), w.get("group_rows_total", 0)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
async def test_group_messages_give_the_per_session_tokens(dtype: str) -> None:
    async with batched_shards([None, *HOPS], relay=False) as (whole, *chain):
        targets = [w.target for w in chain]
        reference = await run_all(targets, dtype, batch_groups=0)  # no groups: per session
        assert [await group_counts(t) for t in targets] == [(0, 0), (0, 0)]
        got = await run_all(targets, dtype, batch_groups=None)  # 2 groups of 3
        assert got == reference
        if dtype == "float32":
            for i in range(N_GEN):
                want = await whole_model_steps(whole.target, prompt(i), max_tokens=N_TOKENS,
                                               ignore_eos=True)
                assert got[i] == [s.logits.token_id for s in want], i
        for t in targets:
            messages, rows = await group_counts(t)
            assert messages > 0 and rows > messages  # several generations' rows per message
        await assert_all_free(chain)


async def test_a_generation_cancelled_mid_group_leaves_the_others() -> None:
    async with batched_shards(HOPS, relay=False) as chain:
        targets = [w.target for w in chain]
        reference = await run_all(targets, "float32", batch_groups=0)
        got = await run_all(targets, "float32", batch_groups=None, cancel=2)
        assert 2 not in got
        assert got == {i: reference[i] for i in range(N_GEN) if i != 2}
        assert all(c[0] > 0 for c in [await group_counts(t) for t in targets])
        await assert_all_free(chain)


async def test_workers_older_than_1_3_are_driven_per_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers that serve 1.0-1.2 only: the client steps down, sends no group message, and
    the tokens are the same."""
    async with batched_shards(HOPS, relay=False) as chain:
        targets = [w.target for w in chain]
        reference = await run_all(targets, "float32", batch_groups=0)
        monkeypatch.setattr(versions, "SUPPORTED_VERSIONS", ((1, 0), (1, 1), (1, 2)))
        got = await run_all(targets, "float32", batch_groups=None)
        monkeypatch.undo()
        assert got == reference
        assert [await group_counts(t) for t in targets] == [(0, 0), (0, 0)]
        await assert_all_free(chain)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
async def test_llama_group_messages_give_the_per_session_tokens(dtype: str) -> None:
    """The tiny llama model on 2 hops, 4 generations in one batch group: one group message per
    hop per tick chooses the tokens the per-session path chooses (same groups, same ticks)."""
    source = ensure_model("tiny")
    async with AsyncExitStack() as stack:
        chain = []
        for lr in [LayerRange(0, 2), LayerRange(2, 4)]:
            path = await trio.to_thread.run_sync(ensure_slice, source, lr)
            spec = LoadSpec(model_path=path, layer_range=lr, n_ctx=1024, max_sessions=4, n_threads=1)
            chain.append(await stack.enter_async_context(worker(engine=LlamaCppEngine(), load=spec)))
        targets = [w.target for w in chain]
        runs = []
        for group_steps in (False, True):
            got: dict[int, list[int]] = {}
            async with Pipeline.connect(targets, timeout=TIMEOUT, hidden_dtype=dtype,
                                        batch_groups=1, group_steps=group_steps) as pipe:
                async def one(i: int) -> None:
                    got[i] = (await pipe.generate(prompt(i), max_tokens=N_TOKENS,
                                                  ignore_eos=True)).tokens

                async with trio.open_nursery() as nursery:
                    for i in range(4):
                        nursery.start_soon(one, i)
            runs.append(got)
        assert runs[0] == runs[1]
        messages, rows = await group_counts(targets[1])
        assert messages > 0 and rows > messages
        await assert_all_free(chain)


async def test_a_hop_failing_mid_group_fails_over_each_session() -> None:
    """The second hop's worker stops mid-group: every row of its group message fails as its
    own session's step would, each generation moves to the replica (replay) and ends with the
    tokens it would have had."""
    async with batched_shards([*HOPS, HOPS[1]], relay=False) as (first, second, spare):
        reference = await run_all([first.target, second.target], "float32", batch_groups=0)
        got: dict[int, list[int]] = {}
        async with Pipeline.connect([first.target, [second.target, spare.target]],
                                    timeout=TIMEOUT, batch_groups=1, group_steps=True) as pipe:
            async def one(i: int) -> None:
                def token(step: Any) -> None:
                    if i == 0 and step.n_past == len(prompt(0)) + 4:
                        second.stop()

                result = await pipe.generate(prompt(i), max_tokens=N_TOKENS, ignore_eos=True,
                                             on_token=token)
                got[i] = result.tokens
                assert result.failovers, i

            async with trio.open_nursery() as nursery:
                for i in range(N_GEN):
                    nursery.start_soon(one, i)
        assert got == reference
        messages, rows = await group_counts(spare.target)
        assert messages > 0 and rows > messages  # the replica took group messages too
        await assert_all_free([first, spare])


async def test_a_gatherer_awaits_recent_members_not_ones_queued_at_another_hop() -> None:
    """The flush rule: a message waits for the members of the gatherer's last two messages,
    except one whose row is queued at another hop's gatherer of the group (the two halves of a
    split group would each wait for the other), and a member that left."""
    shared = _Group()
    here = Gatherer(None, lambda: None, shared)  # type: ignore[arg-type]
    there = Gatherer(None, lambda: None, shared)  # type: ignore[arg-type]
    here._sent, here._recent = 3, {"a": 3, "b": 2, "old": 1}
    here._rows = [_Row("a", None, pb.Decode())]  # type: ignore[arg-type]
    assert not here._all_in()  # b rode in one of the last two messages: awaited
    shared.queued["b"] = there
    assert here._all_in()  # b waits at the other hop
    del shared.queued["b"]
    here.leave("b")
    assert here._all_in()  # b left; "old" is in neither of the last two messages
