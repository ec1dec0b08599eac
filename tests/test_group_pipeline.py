"""Group steps in the client relay (issue 55): concurrent generations of one batch group send
each hop one ``GroupSteps`` message per tick, and every generation's tokens equal the
per-session path's (the whole model's in float32), also for one cancelled mid-group; a worker
that does not speak 1.3 is driven per session. Batched FakeEngine workers over the wire."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.client import ShardClient
from shard.engine import LayerRange
from shard.pipeline import Pipeline
from shard.rpc import versions
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
                                batch_groups=batch_groups) as pipe:
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
