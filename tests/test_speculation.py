"""Speculative verification over a pipeline: drafted tokens verified by the last shard in the
same pass through the chain (``Pipeline.generate(speculate=K)``), on live FakeEngine workers.

The reference is always a whole-model worker's ``Generate``: speculation must give its tokens,
log-probabilities and positions exactly (the fake engine computes each position alone, so the
batch of a verifying step changes no bit), greedy or sampled, whatever the drafts were, and
leave no session or KV cell behind. A scripted drafter (``Scripted``) makes acceptance and
rejection happen where a test wants them; prompt lookup (``shard.drafting``) is tested on its
own and end to end. How many tokens a pass drafts depends on measured costs
(``shard.pipeline.speculation``); tests about what a pass does fix those costs
(``always_draft``: rows cost nothing, so every pass drafts all it may), and the planner's
decisions are tested on given costs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.pipeline.drafting import PromptLookup
from shard.engine import Capabilities, LayerRange
from shard.pipeline import Pipeline, PipelineError
from shard.pipeline.replay import ReplayBudget, RowLog, TokenLog
from shard.pipeline.speculation import EXPLORE_EVERY, MEASURE_LOOP, DraftPlanner, PassCost
from shard.rpc.errors import ErrorCode
from shard.v1 import shard_pb2 as pb
from test_failover import fleet, gate_of
from test_pipeline import THREE, TIMEOUT, after_steps, assert_all_free, shards, whole_model_steps

PROMPT_IDS = [1, *range(40, 52), *range(40, 52), 77, 78]  # BOS, a repeated run, a tail
N_TOKENS = 40
TWO = [LayerRange(0, 2), LayerRange(2, 4)]


class FixedPassCost(PassCost):
    """Pass costs that measurements never change (a fake of the learned model); the workers'
    loop (chain relay) as fast as a pass the client steps."""

    def __init__(self, traversal: float, per_row: float) -> None:
        super().__init__()
        self.traversal, self.per_row, self.loop = traversal, per_row, traversal

    def observe(self, drafts: int, seconds: float) -> None:
        pass

    def observe_loop(self, tokens: int, seconds: float) -> None:
        pass


def always_draft(pipe: Pipeline) -> None:
    """Rows that cost nothing: every pass drafts as many tokens as it may."""
    pipe.pass_cost = FixedPassCost(1.0, 0.0)


class Scripted:
    """Drafts the reference's own next tokens, except every ``wrong_every``-th generated
    position, where it drafts a wrong token (so the step after it is rejected there)."""

    def __init__(self, want: Sequence[int], prompt_len: int, wrong_every: int = 0) -> None:
        self.want, self.prompt_len, self.wrong_every = list(want), prompt_len, wrong_every
        self.calls = 0
        self.asked: list[tuple[int, int]] = []  # (tokens generated, k) per call

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        self.calls += 1
        self.asked.append((len(history) - self.prompt_len, k))
        done = len(history) - self.prompt_len  # tokens generated so far
        out = []
        for j, token in enumerate(self.want[done:done + k]):
            if self.wrong_every and (done + j) % self.wrong_every == 0:
                token = 3 + (token - 3 + 1) % 200  # a valid id that is not the model's
            out.append(token)
        return out


def assert_same(got: Any, want: list[pb.StepResult]) -> None:
    assert got.tokens == [s.logits.token_id for s in want]
    for g, w in zip(got.steps, want, strict=True):
        assert g.logits == w.logits and g.n_past == w.n_past
    assert got.finish_reason == want[-1].finish_reason


async def reference(target: str, prompt: str | list[int] = PROMPT_IDS, **kw: Any) -> list[pb.StepResult]:
    kw.setdefault("max_tokens", N_TOKENS)
    return await whole_model_steps(target, prompt, ignore_eos=True, top_logprobs=5, **kw)


@pytest.mark.parametrize("ranges", [[LayerRange(0, 4)], TWO, THREE], ids=["1", "2", "3"])
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("wrong_every", [0, 3])
async def test_speculation_gives_the_tokens_of_plain_decoding(
    ranges: list[LayerRange], k: int, wrong_every: int
) -> None:
    async with shards([LayerRange(0, 4), *ranges]) as (whole, *chain):
        want = await reference(whole.target)
        drafter = Scripted([s.logits.token_id for s in want], len(PROMPT_IDS), wrong_every)
        seen: list[int] = []
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            always_draft(pipe)
            got = await pipe.generate(
                PROMPT_IDS, max_tokens=N_TOKENS, ignore_eos=True, top_logprobs=5,
                speculate=k, drafter=drafter, on_token=lambda s: seen.append(s.logits.token_id),
            )
        assert_same(got, want)
        assert seen == got.tokens  # each token seen once, in order
        assert got.drafted_tokens > 0 and 0 < drafter.calls <= got.traversals - 1
        assert 0 < got.accepted_tokens <= got.drafted_tokens
        if wrong_every:
            assert got.accepted_tokens < got.drafted_tokens  # rejections happened and were undone
        else:
            assert got.accepted_tokens == got.drafted_tokens
        # every pass emits its accepted drafts and one token of the model's own
        assert got.traversals == 1 + (N_TOKENS - 1 - got.accepted_tokens)
        assert got.traversals < N_TOKENS
        await assert_all_free([whole, *chain])


async def test_a_pipeline_drafts_only_when_the_rows_pay() -> None:
    """Issue 33, finding 4: with rows as dear as a pass (each verified row costs the last shard
    a whole step, as Gemma's head does) and a drafter that is right half the time, drafting
    loses, so the pipeline decodes plainly, trying one draft every ``EXPLORE_EVERY`` passes;
    with cheap rows the same drafter drafts on every pass. The tokens are the same either way
    (before, every pass drafted up to K whatever a row cost)."""
    async with shards(TWO) as chain:
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            plain = await pipe.generate(PROMPT_IDS, max_tokens=N_TOKENS, ignore_eos=True)
            pipe.pass_cost = FixedPassCost(traversal=1.0, per_row=1.0)
            dear = await pipe.generate(PROMPT_IDS, max_tokens=N_TOKENS, ignore_eos=True, speculate=4,
                                       drafter=Scripted(plain.tokens, len(PROMPT_IDS), wrong_every=2))
            pipe.pass_cost = FixedPassCost(traversal=1.0, per_row=0.05)
            cheap = await pipe.generate(PROMPT_IDS, max_tokens=N_TOKENS, ignore_eos=True, speculate=4,
                                        drafter=Scripted(plain.tokens, len(PROMPT_IDS), wrong_every=2))
        assert dear.tokens == cheap.tokens == plain.tokens
        assert dear.drafted_tokens <= -(-N_TOKENS // EXPLORE_EVERY)  # exploration only
        assert cheap.drafted_tokens > N_TOKENS // 2 and cheap.traversals < dear.traversals
        await assert_all_free(chain)


def test_the_planner_drafts_the_count_with_the_most_tokens_per_second() -> None:
    cost = PassCost()
    planner = DraftPlanner(4, cost)
    assert planner.drafts() == 0  # a plain pass first: the traversal's cost
    planner.passed(0, 0, 0.100)
    assert planner.drafts() == 4  # then a pass with drafts: a row's cost
    planner.passed(4, 4, 0.100 + 4 * 0.010)
    assert cost.traversal == pytest.approx(0.100) and cost.per_row == pytest.approx(0.010)
    assert planner.drafts() == 4  # cheap rows, everything accepted so far
    for _ in range(30):  # now nothing is accepted: no draft pays
        planner.passed(1, 0, 0.110)
    assert planner.acceptance < 0.1
    assert planner.drafts() == 0
    # Rows as dear as a traversal never pay below a = 1 ...
    assert DraftPlanner(4, cost).best(0.1, 0.1) == 0
    # ... and at a = 1/2 a row that costs a quarter of a traversal does (1.5 / 1.25 > 1).
    assert DraftPlanner(4, cost).best(0.1, 0.025) >= 1


def test_with_chain_relay_drafting_must_beat_the_workers_loop() -> None:
    """Chain relay's plain decoding is the workers' loop: drafts that beat a pass the client
    steps may still lose to it. Unknown, it is measured first (``MEASURE_LOOP`` tokens)."""
    cost = PassCost()
    cost.traversal, cost.per_row = 0.100, 0.020
    planner = DraftPlanner(4, cost, loop=True)
    assert planner.drafts() == 0 and planner.stretch() == MEASURE_LOOP
    planner.looped(MEASURE_LOOP, MEASURE_LOOP * 0.060)  # the loop: 60 ms a token
    assert planner.drafts() == 0 and planner.stretch() == EXPLORE_EVERY  # 1.5 / 0.12 < 1 / 0.06
    assert DraftPlanner(4, cost).drafts() >= 1  # client relay: 1.5 / 0.12 > 1 / 0.1


def test_the_planner_explores_while_drafting_does_not_pay() -> None:
    planner = DraftPlanner(4, FixedPassCost(1.0, 1.0))
    asked = []
    for _ in range(3 * EXPLORE_EVERY):
        k = planner.drafts()
        asked.append(k)
        planner.passed(k, 0, 1.0 + k)
    assert asked.count(1) == 3 and set(asked) == {0, 1}


async def test_sampled_speculation_gives_the_tokens_of_plain_sampling() -> None:
    """Each position is sampled as a decode ending there would be (the sampler's stream is
    keyed by position), so accepting while the sampled token equals the draft (the standard
    acceptance rule for a deterministic draft) reproduces plain sampling token for token."""
    kw: dict[str, Any] = dict(temperature=0.9, top_k=20, seed=5)
    async with shards([LayerRange(0, 4), *THREE]) as (whole, *chain):
        want = await reference(whole.target, sampling=pb.SamplingParams(**kw))
        drafter = Scripted([s.logits.token_id for s in want], len(PROMPT_IDS), wrong_every=4)
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            always_draft(pipe)
            got = await pipe.generate(PROMPT_IDS, max_tokens=N_TOKENS, ignore_eos=True,
                                      top_logprobs=5, speculate=3, drafter=drafter, **kw)
            plain = await pipe.generate(PROMPT_IDS, max_tokens=N_TOKENS, ignore_eos=True,
                                        top_logprobs=5, **kw)
        assert_same(got, want)
        assert plain.tokens == got.tokens and plain.traversals == N_TOKENS
        assert got.accepted_tokens > 0
        await assert_all_free([whole, *chain])


@pytest.mark.parametrize("stop_at", [5, 6, 7])
async def test_stop_rules_end_inside_a_verified_run(stop_at: int) -> None:
    """A stop token, or max_tokens, reached among accepted drafts ends the generation there:
    what the pass verified after it is dropped, as plain decoding would never compute it."""
    async with shards([LayerRange(0, 4), *TWO]) as (whole, *chain):
        free = await reference(whole.target)
        tokens = [s.logits.token_id for s in free]
        stop = tokens[stop_at]
        first = tokens.index(stop)  # it may occur earlier
        want_stop = await reference(whole.target, stop_tokens=[stop])
        assert len(want_stop) == first + 1
        want_len = await reference(whole.target, max_tokens=stop_at)
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            always_draft(pipe)
            got = await pipe.generate(
                PROMPT_IDS, max_tokens=N_TOKENS, ignore_eos=True, top_logprobs=5,
                stop_tokens=[stop], speculate=4, drafter=Scripted(tokens, len(PROMPT_IDS)),
            )
            assert_same(got, want_stop)
            assert got.finish_reason == pb.FINISH_REASON_STOP_TOKEN
            got = await pipe.generate(
                PROMPT_IDS, max_tokens=stop_at, ignore_eos=True, top_logprobs=5,
                speculate=4, drafter=Scripted(tokens, len(PROMPT_IDS)),
            )
            assert_same(got, want_len)
            assert got.finish_reason == pb.FINISH_REASON_LENGTH
        await assert_all_free([whole, *chain])


class Recording(PromptLookup):
    """Prompt lookup that keeps the first history it was shown."""

    first: list[int] | None = None

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        if self.first is None:
            self.first = list(history)
        return super().propose(history, k)


async def test_prompt_lookup_on_a_repetitive_prompt_and_a_text_prompt() -> None:
    """The default drafter, end to end: the same tokens as the whole model, for a token-id
    prompt and a text prompt, whose ids the first shard echoes (``Prefill.echo_tokens``), so
    drafts come from the prompt as well as the output."""
    text = "one two three one two three one two"
    async with shards([LayerRange(0, 4), *THREE]) as (whole, *chain):
        ids = list(whole.engine.tokenize(text))
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            always_draft(pipe)
            for prompt, prompt_ids in ((PROMPT_IDS, PROMPT_IDS), (text, ids)):
                want = await reference(whole.target, prompt)
                drafter = Recording()
                got = await pipe.generate(prompt, max_tokens=N_TOKENS, ignore_eos=True,
                                          top_logprobs=5, speculate=4, drafter=drafter)
                assert_same(got, want)
                assert got.traversals == N_TOKENS - got.accepted_tokens
                assert drafter.first == [*prompt_ids, want[0].logits.token_id]
        await assert_all_free([whole, *chain])


@pytest.mark.parametrize("hop", [0, 1, 2])
async def test_a_hop_fails_over_during_speculation(hop: int) -> None:
    """A worker stopped mid-generation while drafts are being verified and rejected: the
    replica replays the hop's log, in which every rewind replaced what it overwrote, and the
    tokens are still the whole model's."""
    from test_failover import LONG, N_TOKENS as FAILOVER_TOKENS
    async with fleet() as (whole, hops, gates):
        want = await whole_model_steps(whole.target, LONG, max_tokens=FAILOVER_TOKENS,
                                       ignore_eos=True, top_logprobs=5)
        prompt_len = want[0].n_past
        # a text prompt: the history starts with its ids, as the first shard echoed them
        drafter = Scripted([s.logits.token_id for s in want], prompt_len, wrong_every=3)
        primary, _ = hops[hop]
        async with Pipeline.connect([[w.target for w in ws] for ws in hops], timeout=TIMEOUT) as pipe:
            always_draft(pipe)
            async with trio.open_nursery() as nursery:
                # a few passes into decoding (the gate counts positions)
                nursery.start_soon(after_steps, gate_of(gates, hop, 0), prompt_len + 12,
                                   primary.stop)
                got = await pipe.generate(LONG, max_tokens=FAILOVER_TOKENS, ignore_eos=True,
                                          top_logprobs=5, chunk_tokens=4, speculate=3,
                                          drafter=drafter)
        assert_same(got, want)
        assert [f.hop for f in got.failovers] == [hop]
        assert got.accepted_tokens < got.drafted_tokens
        await assert_all_free([whole, *(w for ws in hops for w in ws if w is not primary)])


async def test_a_last_shard_that_cannot_verify_is_refused_before_any_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with shards(TWO) as chain:
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            always_draft(pipe)
            caps = pipe.hops[-1].caps
            assert caps is not None and caps.max_logits_positions == 64
            with pytest.raises(PipelineError, match="at most 63 drafted tokens") as info:
                await pipe.generate(PROMPT_IDS, max_tokens=4, speculate=64)
            assert info.value.code is ErrorCode.UNSUPPORTED_FEATURE and info.value.hop_index == 1
            with pytest.raises(ValueError, match="speculate"):
                await pipe.generate(PROMPT_IDS, max_tokens=4, speculate=-1)
        # a worker older than the field reports 0
        monkeypatch.setattr(Capabilities, "max_logits_positions", property(lambda self: 0))
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT) as pipe:
            always_draft(pipe)
            with pytest.raises(PipelineError, match="an older worker") as info:
                await pipe.generate(PROMPT_IDS, max_tokens=4, speculate=2)
            assert info.value.hop_index == 1
            plain = await pipe.generate(PROMPT_IDS, max_tokens=4)  # still works without
            assert len(plain.tokens) == 4
        await assert_all_free(chain)


async def test_the_worker_refuses_too_many_positions_and_ignores_the_flag_before_the_end() -> None:
    """Over the wire: more than max_logits_positions is INVALID_ARGUMENT and leaves the session
    as it was; a first (non-last) shard answers all_logits with its boundary only."""
    from shard.client import ShardClient

    async with shards([LayerRange(0, 4), *TWO]) as (whole, first, _):
        async with ShardClient.connect(whole.target, timeout=TIMEOUT) as client:
            async with client.session() as s:
                await s.prefill(PROMPT_IDS[:4])
                with pytest.raises(Exception) as info:
                    await s.prefill(list(range(3, 3 + 65)), position=4, all_logits=True)
                assert getattr(info.value, "code", None) is ErrorCode.INVALID_ARGUMENT
                assert s.usage.n_past == 4
                step = await s.prefill(PROMPT_IDS[4:8], position=4, all_logits=True)
                assert len(step.position_logits) == 4 and step.position_logits[-1] == step.logits
                assert step.start_position == 4 and step.n_past == 8
                assert not step.HasField("input_tokens")  # ids in, nothing to echo
            async with client.session() as s:  # a text's ids, on its first result only
                steps = [r async for r in s.prefill_chunks(text="abcdefgh", chunk_tokens=3,
                                                           echo_tokens=True)]
                assert list(steps[0].input_tokens.ids) == list(whole.engine.tokenize("abcdefgh"))
                assert len(steps) == 3 and not any(r.HasField("input_tokens") for r in steps[1:])
        async with ShardClient.connect(first.target, timeout=TIMEOUT) as client:
            async with client.session() as s:
                step = await s.prefill(PROMPT_IDS, all_logits=True)
                assert step.WhichOneof("output") == "hidden_states" and not step.position_logits


async def test_generate_cli_speculate_reports_traversals() -> None:
    async with shards([LayerRange(0, 4), *TWO]) as (whole, *chain):
        pipeline = ",".join(w.target for w in chain)
        base = [sys.executable, "-m", "shard.cli", "--log-level", "WARNING", "generate", "--json",
                "--max-tokens", "24"]
        runs = {}
        for name, extra in (("single", ["--target", whole.target]),
                            ("spec", ["--pipeline", pipeline, "--speculate", "4"])):
            runs[name] = await trio.run_process([*base, *extra, "a b a b a b a b"],
                                                capture_stdout=True, capture_stderr=True, check=False)
        assert all(p.returncode == 0 for p in runs.values()), {k: p.stderr for k, p in runs.items()}
        want, got = (json.loads(runs[n].stdout) for n in ("single", "spec"))
        assert got["tokens"] == want["tokens"] and got["text"] == want["text"]
        assert got["traversals"] == len(got["tokens"]) - got["accepted_tokens"]
        assert got["drafted_tokens"] >= got["accepted_tokens"] >= 0
        bad = subprocess.run([*base, "--target", whole.target, "--speculate", "2", "x"],
                             capture_output=True, check=False)
        assert bad.returncode == 2 and b"--speculate needs --pipeline" in bad.stderr
        await assert_all_free([whole, *chain])


# ---- the drafter and the logs, on their own ------------------------------------------------


def test_prompt_lookup_drafts_what_followed_the_latest_match() -> None:
    d = PromptLookup()
    assert d.propose([1, 2, 3, 4, 9, 2, 3], 2) == [4, 9]  # the 2-gram (2, 3) matched
    assert d.propose([1, 2, 3, 9, 5, 2, 3, 7, 6, 2, 3], 1) == [7]  # the latest match wins
    assert d.propose([5, 6, 5, 6], 5) == [5, 6, 5, 6, 5]  # a loop goes on
    assert d.propose([1, 2, 3], 4) == [] and d.propose([], 3) == [] and d.propose([1, 1], 0) == []
    assert d.propose([1, 5, 9, 5], 2) == []  # one repeated token is not context enough...
    assert PromptLookup(min_ngram=1).propose([1, 5, 9, 5], 2) == [9, 5]  # ...unless asked
    with pytest.raises(ValueError):
        PromptLookup(max_ngram=1, min_ngram=2)


@given(st.lists(st.integers(0, 4), max_size=40), st.integers(1, 6))
def test_a_draft_continues_an_earlier_occurrence_of_the_tail(history: list[int], k: int) -> None:
    draft = PromptLookup(max_ngram=3, min_ngram=1).propose(history, k)
    assert len(draft) in (0, k)
    if not draft:  # no earlier occurrence of even the last token
        assert not history or history[-1] not in history[:-1]
        return
    # some n-gram tail occurred earlier, and the draft is what followed it, looped
    extended = history + draft
    assert any(
        extended[i:i + n] == history[-n:] and extended[i + n:i + n + k] == draft
        for n in (3, 2, 1) if n < len(history)
        for i in range(len(history) - n)
    )


def test_logs_forget_what_a_rewind_overwrote() -> None:
    tokens = TokenLog()
    tokens.hold_prompt([1, 2, 3], 3)
    tokens.write(3, [7, 8, 9])
    tokens.write(5, [4])
    assert tokens.tokens == [7, 8, 4]
    with pytest.raises(ValueError):
        tokens.write(2, [1])  # inside the prompt
    budget = ReplayBudget(10_000)
    rows = RowLog(budget)
    import numpy as np
    a = np.arange(12, dtype=np.float32).reshape(6, 2)
    rows.append(a[:4], "float32")
    rows.append(a[4:], "float32")
    assert budget.used == a.nbytes
    rows.truncate(3)
    assert rows.positions == 3 and budget.used == a[:3].nbytes
    rows.append(a[:1] + 100, "float32")
    (got,) = rows.slices(10)
    assert got.tolist() == [*a[:3].tolist(), (a[0] + 100).tolist()]
    with pytest.raises(ValueError):
        rows.truncate(5)


def held_bytes(rows: RowLog) -> int:
    """Bytes the log keeps alive: a view keeps its whole base array."""
    return sum((c.base if c.base is not None else c).nbytes for c in rows._chunks)  # noqa: SLF001


def test_a_log_rewound_again_and_again_keeps_only_what_it_accounts() -> None:
    """Issue 33, finding 1: speculation rewinds a hop's row log by K+1 rows and appends K+1
    every pass. A partly kept chunk was kept as a view, so the bytes "given back" stayed
    allocated (4.9x the bound at K = 4). Now what the log holds is what the budget counts."""
    import numpy as np

    k = 4
    budget = ReplayBudget(64 * 2**10)
    rows = RowLog(budget)
    rows.append(np.zeros((100, 16), dtype=np.float32), "float32")
    for _ in range(500):  # a pass that accepts nothing: rewind K rows, write K+1 again
        rows.truncate(rows.positions - k)
        rows.append(np.ones((k + 1, 16), dtype=np.float32), "float32")
    assert not rows.dropped
    assert held_bytes(rows) == budget.used == rows.nbytes


# ---- over a chain relay (the workers carry the hidden states) --------------------------------


@pytest.mark.parametrize("ranges", [TWO, THREE], ids=["2", "3"])
@pytest.mark.parametrize("drafting", ["scripted", "lookup"])
async def test_speculation_over_a_chain_relay_gives_the_same_results(
    ranges: list[LayerRange], drafting: str
) -> None:
    """Client relay, chain relay, and speculation over each: the whole model's tokens,
    log-probabilities and positions, bit for bit; each verification pass is one trip along the
    chain (the relays forward ``all_logits`` to the last shard), and nothing stays behind."""
    from test_relay import relay_shards

    async with relay_shards([LayerRange(0, 4), *ranges]) as (whole, *chain):
        want = await reference(whole.target)
        tokens = [s.logits.token_id for s in want]
        got = {}
        for relay in ("client", "chain"):
            async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT, relay=relay) as pipe:
                always_draft(pipe)
                for k in (0, 4):
                    drafter = Scripted(tokens, len(PROMPT_IDS), wrong_every=3) if drafting == "scripted" else None
                    got[relay, k] = await pipe.generate(
                        PROMPT_IDS, max_tokens=N_TOKENS, ignore_eos=True, top_logprobs=5,
                        speculate=k, drafter=drafter)
        for result in got.values():
            assert_same(result, want)
        spec = got["chain", 4]
        assert spec.traversals == N_TOKENS - spec.accepted_tokens < N_TOKENS == got["chain", 0].traversals
        if drafting == "scripted":
            assert 0 < spec.accepted_tokens < spec.drafted_tokens
        await assert_all_free([whole, *chain])


async def test_a_chain_that_does_not_draft_decodes_in_the_workers_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With chain relay, plain decoding is the workers' loop (no trip to the client per
    token), not passes the client steps: when drafting does not pay, the pipeline hands the
    generation to that loop in stretches (``EXPLORE_EVERY`` tokens, a draft tried between
    them), and the tokens are the whole model's. Before, chain relay with ``--speculate``
    stepped every token through the client (0.92x of plain chain relay on Gemma 3 270M)."""
    from shard.pipeline.runner import HopRunner
    from test_relay import relay_shards

    loops = []
    original = HopRunner.generate

    async def counted(self: HopRunner, *args: Any, **kwargs: Any) -> None:
        loops.append(kwargs["max_tokens"])
        await original(self, *args, **kwargs)

    monkeypatch.setattr(HopRunner, "generate", counted)
    async with relay_shards([LayerRange(0, 4), *THREE]) as (whole, *chain):
        want = await reference(whole.target, max_tokens=3 * EXPLORE_EVERY)
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT, relay="chain") as pipe:
            pipe.pass_cost = FixedPassCost(traversal=1.0, per_row=1.0)  # a row costs a pass
            got = await pipe.generate(PROMPT_IDS, max_tokens=3 * EXPLORE_EVERY, ignore_eos=True,
                                      top_logprobs=5, speculate=4)
        assert_same(got, want)
        assert len(loops) >= 2 and all(n <= EXPLORE_EVERY for n in loops)
        assert got.drafted_tokens <= len(loops)  # one exploring draft between two stretches
        assert got.traversals == 3 * EXPLORE_EVERY - got.accepted_tokens
        await assert_all_free([whole, *chain])


async def test_cancelling_a_speculating_chain_frees_every_hop_within_a_second() -> None:
    from test_relay import free_within, relay_shards

    async with relay_shards(THREE, latency=0.002) as chain:
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT, relay="chain") as pipe:
            always_draft(pipe)
            seen = 0

            def count(_: pb.StepResult) -> None:
                nonlocal seen
                seen += 1
                if seen == 12:
                    scope.cancel()

            with trio.CancelScope() as scope:
                await pipe.generate(PROMPT_IDS, max_tokens=200, ignore_eos=True, speculate=4,
                                    on_token=count)
        assert scope.cancelled_caught and seen == 12
        await free_within(chain)
