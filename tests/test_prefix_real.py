"""The prefix cache never changes a greedy token: on the real models (SmolLM2 135M Instruct and
Gemma 3 270M, engine in process) and on every architecture family's test model (live workers,
the whole model and 2- and 3-part pipelines in client and chain relay).

The reference is always a cacheless engine that computed the same positions in the same steps
(llama.cpp's float sums depend on a step's shape, so only the same steps promise the same
logits): a session that holds the earlier history the cache copied, cut where the new prompt
departs from it, then the rest in one step. Against it the cached run's top-k log-probabilities
must be bit-identical at every position, so a near-tie cannot flip and no prompt needs choosing
for its margin. How often a cacheless run in *other* steps differs (near-ties flipping) is what
``bench/engine/prefix_flips.py`` measures: a property of llama.cpp's kernels on the machine, not
of the cache, so no test asserts it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest
import trio

from bench.engine.prefix_flips import Engines, common_prefix, conversations, converse, engines, top_of
from rpc_harness import Worker, worker
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.engine import LayerRange, LoadSpec, StepResult
from shard.engine.llama import LlamaCppEngine
from shard.models import RANGE_ARCHITECTURES, ensure_slice
from shard.models.arch_models import MODELS, ensure_arch_model
from shard.relay import ChainRelay
from shard.testing.contract.harness import decode, prefill
from shard.testing.contract.prefix_cache import history_of
from test_prefix_rpc import chat_in_one_session, chat_on_pipeline, chat_on_worker, held_after

REAL = ["smollm2-135m-instruct", "gemma3-270m"]
N_TOKENS = 12


# ---- the real models, engine in process -----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model", REAL)
async def test_every_turn_of_a_conversation_equals_a_cacheless_engine_in_the_same_steps(
    model: str,
) -> None:
    """Chats as a chat UI sends them (each turn the whole conversation, rendered with the
    model's template): each later turn takes the previous one from the cache and then computes
    bit for bit what the cacheless session computes."""
    async with engines(model, threads=1) as e:
        turns = []
        for i, (system, users) in enumerate(conversations(seed=1, n=2, turns=3)):
            turns += await converse(e, i, system, users, N_TOKENS)
    assert len(turns) == 6
    later = [t for t in turns if t.turn > 0]
    assert all(t.cached_tokens > t.prompt_tokens // 2 for t in later)  # the cache served them
    for t in turns:
        assert t.same_chunks.identical and t.same_chunks.first_diff is None, t


async def greedy(engine: LlamaCppEngine, sid: str, step: StepResult, n: int
                 ) -> list[tuple[tuple[int, float], ...]]:
    """The top-k log-probabilities of ``step`` and of the ``n - 1`` greedy decodes after it."""
    out = [step]
    while len(out) < n:
        assert out[-1].logits is not None
        out.append(await decode(engine, sid, out[-1].logits.token_id))
    return [top_of(s) for s in out]


async def opening(e: Engines, users: Sequence[str]) -> tuple[list[int], list[list[int]]]:
    """A first turn on the cached engine (its history released into the cache) and the prompts
    of the follow-ups ``users[1:]``, each the whole conversation rendered again."""
    first = [{"role": "user", "content": users[0]}]
    prompt = list(e.cached.tokenize(e.chat.render(first), add_bos=e.chat.add_bos,
                                    parse_special=True))
    history, last = await history_of(e.cached, "first", prompt, N_TOKENS - 1)
    await e.cached.release("first")
    said = b"".join(e.cached.token_piece(t) for t in [*history[len(prompt):], last])
    answer = {"role": "assistant", "content": said.decode("utf-8", "replace").strip()}
    follow_ups = [list(e.cached.tokenize(e.chat.render([*first, answer, {"role": "user", "content": u}]),
                                         add_bos=e.chat.add_bos, parse_special=True))
                  for u in users[1:]]
    return prompt, follow_ups


async def reference(e: Engines, prompt: Sequence[int], keep: int, rest: Sequence[int]) -> list:
    """A cacheless session in the cached run's steps: the first turn (prompt in one step, then
    its decodes), cut to ``keep``, ``rest`` in one step, then greedy decodes."""
    await history_of(e.plain, "ref", prompt, N_TOKENS - 1)
    await e.plain.truncate("ref", keep)
    try:
        return await greedy(e.plain, "ref", await prefill(e.plain, "ref", rest, keep), N_TOKENS)
    finally:
        await e.plain.release("ref")


USERS = ["Can you explain black holes in simple terms?", "Why is that?",
         "Can you give a concrete example?", "What would a beginner get wrong here?"]
#: What a rewound session says instead, after the cut.
EDIT = " and what about honeybees?"


@pytest.mark.slow
@pytest.mark.parametrize("model", REAL)
async def test_live_sessions_share_a_prefix_and_a_rewind_into_it_changes_no_other(model: str) -> None:
    """Three live sessions start from one cached turn; one of them rewinds into the shared part
    (inside the first user message) and goes on with other words; the steps interleave. Every
    session computes bit for bit what a cacheless session computes in the same steps."""
    async with engines(model, threads=1, sessions=3) as e:
        prompt, follow_ups = await opening(e, USERS)
        history, _ = await history_of(e.plain, "h", prompt, N_TOKENS - 1)
        await e.plain.release("h")
        firsts, keeps = [], []
        for i, q in enumerate(follow_ups):
            await e.cached.open_session(f"s{i}")
            step = await prefill(e.cached, f"s{i}", q)
            keeps.append(min(common_prefix(history, q), len(q) - 1))
            assert step.cached_tokens == keeps[-1] > len(prompt)
            firsts.append(step)
        assert e.cached.metrics().prefix_cache_hits_total == 3
        cut = len(prompt) // 2  # inside the first user message
        edit = list(e.cached.tokenize(EDIT, add_bos=False))
        await e.cached.truncate("s0", cut)
        firsts[0] = await prefill(e.cached, "s0", edit, cut)
        assert firsts[0].cached_tokens == 0
        got: list[list] = [[top_of(f)] for f in firsts]
        for _ in range(N_TOKENS - 1):  # round robin: each session's decode between the others'
            for i, tops in enumerate(got):
                tops.append(top_of(await decode(e.cached, f"s{i}", tops[-1][0][0])))
        for i in range(3):
            await e.cached.release(f"s{i}")
        want = [await reference(e, prompt, cut, edit)]
        want += [await reference(e, prompt, keep, q[keep:]) for keep, q in zip(keeps[1:], follow_ups[1:])]
        for i in range(3):
            assert got[i] == want[i], i


@pytest.mark.slow
@pytest.mark.parametrize("model", REAL)
async def test_a_rewind_into_a_cached_prefix_equals_a_cacheless_session(model: str) -> None:
    """One session takes a conversation from the cache, decodes, then is cut inside the cached
    part and continues with other words: it computes what a cacheless session computes after
    the same first turn, cut and continuation; the cache entry it came from serves again."""
    async with engines(model, threads=1) as e:
        prompt, (follow_up,) = await opening(e, USERS[:2])
        await e.cached.open_session("s")
        step = await prefill(e.cached, "s", follow_up)
        assert step.cached_tokens > len(prompt)
        await greedy(e.cached, "s", step, N_TOKENS)
        cut = len(prompt) - 2  # the last user message's end markers go
        edit = list(e.cached.tokenize(EDIT, add_bos=False))
        await e.cached.truncate("s", cut)
        got = await greedy(e.cached, "s", await prefill(e.cached, "s", edit, cut), N_TOKENS)
        await e.cached.release("s")
        assert got == await reference(e, prompt, cut, edit)
        assert e.cached.metrics().prefix_cache_hits_total == 1


# ---- every architecture family's test model, live workers -----------------------------------


@asynccontextmanager
async def arch_workers(arch: str, ranges: Sequence[LayerRange | None], budget: int,
                       relay: bool = False) -> AsyncIterator[list[Worker]]:
    """One live worker per range of ``arch``'s test model (None: the whole model), each with a
    prefix cache of ``budget`` tokens (``relay``: each relays a chain)."""
    source = await trio.to_thread.run_sync(ensure_arch_model, arch)
    async with AsyncExitStack() as stack:
        out = []
        for lr in ranges:
            path = source if lr is None else await trio.to_thread.run_sync(ensure_slice, source, lr)
            spec = LoadSpec(model_path=path, layer_range=lr, n_ctx=512, max_sessions=2,
                            n_threads=1, prefix_cache_tokens=budget)
            out.append(await stack.enter_async_context(worker(
                engine=LlamaCppEngine(), load=spec, relay=ChainRelay() if relay else None)))
        yield out


def parts(cuts: Sequence[int]) -> list[LayerRange | None]:
    return [LayerRange(a, b) for a, b in zip(cuts, cuts[1:])]


@pytest.mark.parametrize("arch", RANGE_ARCHITECTURES)
async def test_each_architecture_takes_the_conversation_from_the_cache(arch: str) -> None:
    """A three-turn chat on the architecture's test model: the whole model (server-driven
    Generate) and its 2- and 3-part chains in client and chain relay, every worker with a
    cache, give the greedy tokens of one cacheless session fed each turn's new part in one step
    (the steps a cached turn computes), and every hop took the same positions from its cache."""
    two, three = (next(c for c in MODELS[arch].chains if len(c) == n) for n in (3, 4))
    async with arch_workers(arch, [None], 0) as (plain,):
        want = await chat_in_one_session(plain.target)
    assert len({t for turn in want for t in turn}) > 1, want  # not one token repeated
    cached = [0, held_after(0), held_after(1)]
    async with arch_workers(arch, [None], 256) as (whole,):
        caps = whole.engine.capabilities()
        assert caps.architecture == arch and caps.prefix_cache_tokens == 256, caps.prefix_cache_detail
        got = await chat_on_worker(whole.target)
        assert [t for t, _, _ in got] == want
        assert [c for _, c, _ in got] == cached
    for cuts in (two, three):
        for relay in ("client", "chain"):
            async with arch_workers(arch, parts(cuts), 256, relay=relay == "chain") as hops:
                piped = await chat_on_pipeline([h.target for h in hops], relay, chunk=64)
                assert [t for t, _ in piped] == want, (cuts, relay)
                assert [c for _, c in piped] == cached, (cuts, relay)
                for h in hops:
                    hits = h.engine.metrics().prefix_cache_hit_tokens_total
                    assert hits == held_after(0) + held_after(1), (cuts, relay)


# ---- the bench that measures the flips ------------------------------------------------------


def test_the_conversations_are_varied_and_the_same_for_one_seed() -> None:
    chats = conversations(seed=3, n=40, turns=3)
    assert chats == conversations(seed=3, n=40, turns=3) != conversations(seed=4, n=40, turns=3)
    assert all(len(users) == 3 for _, users in chats)
    assert len({users[0] for _, users in chats}) > 30  # openers differ in topic and template
    assert len({system for system, _ in chats}) > 2


@pytest.mark.slow
def test_the_flips_bench_reports_both_references(tmp_path: Path) -> None:
    from bench.engine.prefix_flips import main

    out = tmp_path / "flips.json"
    main(["--quick", "--models", "smollm2-135m-instruct", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["environment"]["threads"] == 1
    (r,) = record["results"].values()
    assert (r["conversations"], r["turns"], r["later_turns"]) == (3, 6, 3)
    below = list(r["positions_with_margin_below"].values())
    assert below == sorted(below) and below[-1] <= r["positions"]
    assert r["mean_cached_tokens_later_turns"] > 0
    same, other = r["same_chunks"], r["other_chunks"]
    assert (same["turns_differing"], same["turns_bit_identical"], same["max_logprob_drift"]) == (0, 6, 0)
    assert other["turns_bit_identical"] >= 3  # the first turns: the same steps in both
    for flip in other["flips"]:
        assert flip["turn"] > 0 and 0 <= flip["position"] < 16
