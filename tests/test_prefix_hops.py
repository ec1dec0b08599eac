"""The prefix every hop of a route holds (issue 53): ``OpenSession.prefix_probe`` answered in
``SessionOpened.prefix_cached_tokens``, ``Prefill.cache_limit``, the pipeline holding its first
hop to the least any hop holds (client and chain relay) and retrying a turn once when a later
hop still lacks it, and one step for a chunked prefill the cache covers.

As in ``test_prefix_rpc``, every pipeline test runs a chat (each turn resends the whole
conversation) and its greedy tokens must equal a cacheless worker's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.client import ShardClient, ShardError
from shard.engine import LayerRange
from shard.pipeline import Pipeline, PipelineError, PipelineResult
from shard.pipeline.errors import Blames, Hop
from shard.pipeline.prefix import PrefixTurn, route_limit
from shard.rpc.errors import ErrorCode
from shard.rpc.session.inputs import PrefillChunks
from shard.v1 import shard_pb2 as pb
from test_prefix_rpc import (
    BUDGET, HALVES, N_NEW, THIRDS, TIMEOUT, TURNS, _Step, chat_on_pipeline, chat_on_worker,
    engine_metrics, held_after, workers,
)


async def first_turn(target: str) -> list[int]:
    """The first turn on a whole-model worker (released: its history, ``held_after(0)``
    positions, stays in the cache); returns its tokens."""
    async with ShardClient.connect(target, timeout=TIMEOUT) as client:
        async with client.session() as s:
            steps = [st async for st in s.generate(TURNS[0], max_tokens=N_NEW, ignore_eos=True)]
    return [st.logits.token_id for st in steps]


# ---- the steps of a chunked prefill ----------------------------------------------------------


def test_the_first_step_takes_the_covered_prefix_and_one_chunk() -> None:
    """Positions the cache covers cost a copy: the first step takes them and one chunk; the
    uncovered rest goes in chunks, pipelined to the next hop."""
    chunks = PrefillChunks(100, 8, 60, 100)
    spans = iter(chunks)
    assert next(spans) == (0, 68)
    chunks.took(_Step(60), 0, 68)  # type: ignore[arg-type]
    assert next(spans) == (68, 76)
    chunks.took(_Step(0), 68, 76)  # type: ignore[arg-type]
    assert next(spans) == (76, 84)
    whole = PrefillChunks(100, 8, 95, 100)  # the new part fits the chunk: one step
    assert list(whole) == [(0, 100)]


async def test_a_chunked_prefill_of_a_cached_conversation_takes_one_step_and_chunks() -> None:
    """On a worker: the turn's first step copies the whole cached conversation and computes one
    chunk; the rest follows in chunks; a limit caps the copy."""
    async with workers([None], [BUDGET]) as (w,):
        history = [*TURNS[0], *await first_turn(w.target), *TURNS[1]]
        async with ShardClient.connect(w.target, timeout=TIMEOUT) as client:
            for limit, cached in ((None, held_after(0)), (10, 10)):
                async with client.session() as s:
                    steps = [st async for st in s.prefill_chunks(history, chunk_tokens=4,
                                                                  cache_limit=limit)]
                    assert steps[0].cached_tokens == cached
                    assert steps[0].tokens_processed == 4
                    assert [st.tokens_processed for st in steps[1:]] == \
                        [4] * (len(steps) - 2) + [steps[-1].tokens_processed]
                    assert sum(st.tokens_processed for st in steps) == len(history) - cached
                    assert s.usage.cached_tokens == cached


# ---- the probe and the limit on the wire -----------------------------------------------------


async def test_a_generate_takes_no_more_than_its_cache_limit() -> None:
    async with workers([None, None], [BUDGET, 0]) as (w, plain):
        prompt = [*TURNS[0], *await first_turn(w.target), *TURNS[1]]
        got = []
        for target, limit in ((w.target, 5), (plain.target, None)):
            async with ShardClient.connect(target, timeout=TIMEOUT) as client:
                async with client.session() as s:
                    steps = [st async for st in s.generate(prompt, max_tokens=N_NEW,
                                                           ignore_eos=True, cache_limit=limit)]
                    assert s.usage.cached_tokens == steps[0].cached_tokens == (limit or 0)
            got.append([st.logits.token_id for st in steps])
        assert got[0] == got[1]


async def test_the_probe_says_what_the_cache_holds_and_changes_nothing() -> None:
    async with workers([None, None], [BUDGET, 0]) as (cached, plain):
        tokens = await first_turn(cached.target)
        await first_turn(plain.target)
        history = [*TURNS[0], *tokens[:-1]]  # what the first turn left in the cache
        assert len(history) == held_after(0)
        for target, want in ((cached.target, held_after(0)), (plain.target, 0)):
            async with ShardClient.connect(target, timeout=TIMEOUT) as client:
                assert (await client.capabilities()).prefix_cache_limit
                before = (await client.metrics()).engine
                other = (tokens[-1] + 1) % 256
                for probe, held in ((history + [other, 6], want), (history[:7], min(7, want)),
                                    ([], 0)):
                    s = await client.open_session(prefix_probe=probe)
                    try:
                        assert s.opened.prefix_cached_tokens == held
                    finally:
                        await s.close()
                after = (await client.metrics()).engine
                assert after["prefix_cache_hits_total"] == before["prefix_cache_hits_total"]


# ---- pipelines -------------------------------------------------------------------------------


#: held_after(1) does not fit it: it keeps the first turn's history only.
SMALL = held_after(0) + 4


@pytest.mark.parametrize("budgets", ["later-none", "later-small", "first-small"])
@pytest.mark.parametrize("ranges", [HALVES, THIRDS], ids=["2-hops", "3-hops"])
@pytest.mark.parametrize("chunk", [5, 64])
@pytest.mark.parametrize("relay", ["client", "chain"])
async def test_the_first_hop_takes_only_what_every_hop_holds(
    relay: str, chunk: int, ranges: list[LayerRange], budgets: str,
) -> None:
    """Hops whose caches differ (a later one without a cache, or too small for the second
    turn's history, or the first one smaller): each turn takes from the cache what every hop
    holds, and the tokens are the cacheless ones."""
    async with workers([None], [0]) as (plain,):
        want = await chat_on_worker(plain.target, 5)
    n = len(ranges)
    per_hop = {"later-none": [BUDGET] * (n - 1) + [0],
               "later-small": [BUDGET] * (n - 1) + [SMALL],
               "first-small": [SMALL] + [BUDGET] * (n - 1)}[budgets]
    expect = {"later-none": [0, 0, 0],
              "later-small": [0, held_after(0), held_after(0)],
              "first-small": [0, held_after(0), held_after(0)]}[budgets]
    async with workers(ranges, per_hop, relay=relay == "chain") as hops:
        got = await chat_on_pipeline([h.target for h in hops], relay, chunk)
        assert [t for t, _ in got] == [t for t, _, _ in want]
        assert [c for _, c in got] == expect
        hits = [(await engine_metrics(h.target))["prefix_cache_hit_tokens_total"] for h in hops]
        # the first hop took what every hop holds, and so did the later ones where that is all
        # they hold (the limit holds a middle hop too: taking more, it would send the next hop
        # fewer rows than it can use); first-small: the later hops hold more and may take it
        assert hits[0] == sum(expect) and all(h >= hits[0] for h in hits)
        if budgets != "first-small":
            assert hits == [sum(expect)] * n


@pytest.mark.parametrize("relay", ["client", "chain"])
async def test_a_text_prompt_a_later_hop_lacks_runs_again_within_what_it_holds(
    relay: str,
) -> None:
    """A text prompt's ids are known only once the first hop tokenized it, so its open probes
    nothing: the first hop takes the cached prefix, the next hop (no cache) refuses it, and
    the turn runs once more within what every hop holds (client relay: probed with the ids
    the first hop echoed; chain relay: from no cache), with the cacheless tokens."""
    text = "the quick brown fox"
    async with workers([None], [0]) as (plain,):
        async with Pipeline.connect([plain.target], timeout=TIMEOUT) as pipe:
            want = (await pipe.generate(text, max_tokens=N_NEW, ignore_eos=True)).tokens
    async with workers(HALVES, [BUDGET, 0], relay=relay == "chain") as hops:
        async with Pipeline.connect([h.target for h in hops], timeout=TIMEOUT, relay=relay) as pipe:
            first = await pipe.generate(text, max_tokens=N_NEW, ignore_eos=True)
            again = await pipe.generate(text, max_tokens=N_NEW, ignore_eos=True)
        assert first.tokens == again.tokens == want
        assert (first.cached_tokens, again.cached_tokens) == (0, 0)
        m = await engine_metrics(hops[0].target)
        # the refused try took the prompt from the first hop's cache; the retry did not
        assert m["prefix_cache_hits_total"] == 1


# ---- the retry's rules -----------------------------------------------------------------------


@dataclass
class _Gen:
    """What ``PrefixTurn`` reads and writes of a ``Generation``."""

    sid: str = "p-1"
    prefix_probe: tuple[int, ...] = ()
    prefix_retry: bool = False
    blames: Blames = field(default_factory=Blames)


@dataclass
class _Runner:
    gen: _Gen
    prompt_ids: list[int] | None = None
    honours: bool = True

    def honours_cache_limit(self) -> bool:
        return self.honours

    def prefix_held(self) -> int | None:
        return None


def _refused(reason: str = "PREFIX_NOT_CACHED") -> PipelineError:
    return PipelineError(Hop(1, "t"), ShardError(ErrorCode.ILLEGAL_TRANSITION, "x", reason=reason))


def test_a_turn_runs_again_once_and_only_for_a_prefix_a_later_hop_lacks() -> None:
    gen = _Gen()
    turn = PrefixTurn("a text", gen)  # type: ignore[arg-type]
    assert gen.prefix_probe == ()  # a text's ids are not known yet
    runner = _Runner(gen, prompt_ids=[1, 2, 3])
    assert not turn.retry(_refused("KV_CACHE_FULL"), [runner], PipelineResult())  # type: ignore[list-item]
    assert not turn.retry(_refused(), [_Runner(gen, honours=False)], PipelineResult())  # type: ignore[list-item]
    emitted = PipelineResult()
    emitted.steps.append(pb.StepResult())
    assert not turn.retry(_refused(), [runner], emitted)  # type: ignore[list-item]
    assert not gen.prefix_retry
    gen.blames.failures.append(_refused())
    assert turn.retry(BaseExceptionGroup("one", [_refused()]), [runner], PipelineResult())  # type: ignore[list-item]
    # new sessions, probed with the ids the first hop echoed, the last try's blame forgotten
    assert (gen.sid, gen.prefix_probe, gen.prefix_retry) == ("p-1~p", (1, 2, 3), True)
    assert gen.blames.failures == []
    assert route_limit([runner]) is None  # probed hops answer (none here): no limit  # type: ignore[list-item]
    assert not turn.retry(_refused(), [runner], PipelineResult())  # type: ignore[list-item]  # once
    ids_gen = _Gen()
    PrefixTurn([4, 5], ids_gen)  # type: ignore[arg-type]
    assert ids_gen.prefix_probe == (4, 5)
    unknown = _Gen(prefix_retry=True)  # a retry without the prompt's ids uses no cache
    assert route_limit([_Runner(unknown)]) == 0  # type: ignore[list-item]
