"""Constrained decoding in the engine (``shard.engine.grammar``), on the fake engine and on
llama.cpp with a real tokenizer (the generated ``chat`` model): every output keeps to its
schema; greedy tokens are the unconstrained ones wherever the grammar allows those; the
grammar follows rewinds, replays (a new session given the prompt and the tokens so far) and
verified drafts; a grammar that does not compile is the request's error, not the engine's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import numpy as np
import pydantic
import pytest
import trio

from shard.engine import (
    DecodeRequest,
    EngineState,
    GrammarSpec,
    InvalidGrammar,
    InvalidInput,
    LoadSpec,
    PrefillRequest,
    SamplingParams,
    ShardEngine,
    StreamRequest,
)
from shard.engine.fake import FakeEngine, FakeScript
from shard.engine.grammar import SessionGrammar, mask_together
from shard.engine.llama import LlamaCppEngine
from shard.models import ensure_model


class Address(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=12)
    zip: int = pydantic.Field(ge=0, lt=100000)


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=12)
    role: Literal["admin", "user", "guest"]
    tags: list[Literal["a", "b", "c"]] = pydantic.Field(max_length=3)
    address: Address


SCHEMA = json.dumps(Person.model_json_schema())
PROMPT = "Answer in JSON:"


@pytest.fixture(params=["fake", "llama"])
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[ShardEngine]:
    if request.param == "fake":
        eng: ShardEngine = FakeEngine()
        spec = LoadSpec(n_ctx=2048, max_sessions=4)
    else:
        path: Path = await trio.to_thread.run_sync(ensure_model, "chat")
        eng = LlamaCppEngine()
        spec = LoadSpec(model_path=path, n_ctx=2048, max_sessions=4, n_threads=1)
    async with eng:
        await eng.load(spec)
        yield eng


async def generate(engine: ShardEngine, sid: str, prompt: tuple[int, ...], params: SamplingParams,
                   n: int, *, top: int = 0) -> list[int]:
    """Greedy or sampled decoding of up to ``n`` tokens (stops at end of generation)."""
    await engine.open_session(sid)
    r = await engine.prefill(PrefillRequest(sid, tokens=prompt, sampling=params, top_k_logprobs=top))
    out: list[int] = []
    while len(out) < n and not r.logits.is_eog:
        out.append(r.logits.token_id)
        r = await engine.decode(DecodeRequest(sid, token=out[-1], sampling=params, top_k_logprobs=top))
    await engine.release(sid)
    return out


def text_of(engine: ShardEngine, tokens: list[int]) -> str:
    return b"".join(engine.token_piece(t) for t in tokens).decode("utf-8", errors="replace")


def schema_params(prompt: tuple[int, ...], **kw: object) -> SamplingParams:
    return SamplingParams(grammar=GrammarSpec("json_schema", SCHEMA, start=len(prompt)), **kw)


async def test_outputs_keep_to_the_schema_greedy_and_sampled(engine: ShardEngine) -> None:
    assert "json_schema" in engine.capabilities().grammar_kinds
    prompt = engine.tokenize(PROMPT)
    for seed in range(4):
        params = schema_params(prompt, temperature=1.0 if seed else 0.0, seed=seed)
        out = await generate(engine, f"s{seed}", prompt, params, 400)
        Person.model_validate_json(text_of(engine, out))  # parses, and keeps to the schema


@pytest.mark.parametrize("kind,grammar,answers", [
    ("gbnf", 'root ::= "yes" | "no" | "maybe"', {"yes", "no", "maybe"}),
    ("lark", 'start: "red" | "green"', {"red", "green"}),
])
async def test_gbnf_and_lark_grammars(engine: ShardEngine, kind: str, grammar: str,
                                      answers: set[str]) -> None:
    prompt = engine.tokenize(PROMPT)
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed,
                                grammar=GrammarSpec(kind, grammar, start=len(prompt)))
        assert text_of(engine, await generate(engine, "s", prompt, params, 20)) in answers


async def test_json_object_gives_an_object(engine: ShardEngine) -> None:
    prompt = engine.tokenize(PROMPT)
    params = SamplingParams(grammar=GrammarSpec("json_object", start=len(prompt)))
    out = await generate(engine, "s", prompt, params, 300)
    assert isinstance(json.loads(text_of(engine, out)), dict)


async def test_greedy_tokens_are_the_unconstrained_ones_where_the_grammar_allows_them(
        engine: ShardEngine) -> None:
    """Session A decodes under the grammar; B, unconstrained, is fed A's tokens: B's choice
    is then the unconstrained greedy token for A's history, and A must choose it whenever the
    grammar allows it (a matcher fed A's tokens says)."""
    prompt = engine.tokenize(PROMPT)
    spec = GrammarSpec("json_schema", SCHEMA, start=len(prompt))
    constrained, free = SamplingParams(grammar=spec), SamplingParams()
    matcher = engine._grammars.compile(spec)  # the same compiled grammar, to ask what it allows
    await engine.open_session("a")
    await engine.open_session("b")
    a = await engine.prefill(PrefillRequest("a", tokens=prompt, sampling=constrained))
    b = await engine.prefill(PrefillRequest("b", tokens=prompt, sampling=free))
    agreed = differed = 0
    for _ in range(200):
        ta, tb = a.logits.token_id, b.logits.token_id
        if matcher.validate_tokens([tb]) == 1:
            assert ta == tb
            agreed += 1
        else:
            differed += 1
        if a.logits.is_eog:
            break
        assert matcher.consume_token(ta)
        a = await engine.decode(DecodeRequest("a", token=ta, sampling=constrained))
        b = await engine.decode(DecodeRequest("b", token=ta, sampling=free))
    assert agreed and differed  # both cases were seen
    assert matcher.is_accepting()
    await engine.release("a")
    await engine.release("b")


async def test_rewind_replay_and_verified_drafts_give_the_same_tokens(engine: ShardEngine) -> None:
    prompt = engine.tokenize(PROMPT)
    params = schema_params(prompt, temperature=0.8, seed=3)
    out = await generate(engine, "ref", prompt, params, 60)
    assert len(out) > 20
    # Rewind: a session decodes 30 tokens, goes back to 10 and decodes again.
    await engine.open_session("r")
    r = await engine.prefill(PrefillRequest("r", tokens=prompt, sampling=params))
    for t in out[:30]:
        r = await engine.decode(DecodeRequest("r", token=t, sampling=params))
    k = len(prompt) + 10
    r = await engine.prefill(PrefillRequest("r", tokens=tuple(out[9:10]), position=k - 1,
                                            sampling=params))
    again = [r.logits.token_id]
    while len(again) < len(out) - 10:
        r = await engine.decode(DecodeRequest("r", token=again[-1], sampling=params))
        again.append(r.logits.token_id)
    assert again == out[10:]
    await engine.release("r")
    # Replay: a new session given the prompt and the first 25 tokens in one prefill continues.
    await engine.open_session("p")
    r = await engine.prefill(PrefillRequest("p", tokens=(*prompt, *out[:25]), sampling=params))
    assert r.logits.token_id == out[25]
    # Verified drafts: every position's choice of a step holding the next 20 tokens.
    r = await engine.prefill(PrefillRequest("p", tokens=tuple(out[25:45]), position=len(prompt) + 25,
                                            sampling=params, all_logits=True))
    assert [lg.token_id for lg in r.position_logits] == out[26:46]
    await engine.release("p")


async def test_a_stream_chooses_as_decodes_do(engine: ShardEngine) -> None:
    prompt = engine.tokenize(PROMPT)
    params = schema_params(prompt)
    out = await generate(engine, "ref", prompt, params, 40)
    await engine.open_session("s")
    r = await engine.prefill(PrefillRequest("s", tokens=prompt, sampling=params))
    got = [r.logits.token_id]
    await engine.stream(StreamRequest("s", token=got[0], max_steps=len(out) - 1, sampling=params),
                        lambda step: got.append(step.logits.token_id) or True)
    assert got == out
    await engine.release("s")


@pytest.mark.parametrize("kind,text", [
    ("json_schema", '{"type": 5}'),
    ("json_schema", "not json"),
    ("json_schema", "[1, 2]"),
    ("gbnf", "root ::= undefined-rule"),
    ("lark", "start: ("),
])
async def test_a_grammar_that_does_not_compile_is_the_requests_error(
        engine: ShardEngine, kind: str, text: str) -> None:
    prompt = engine.tokenize(PROMPT)
    await engine.open_session("s")
    bad = SamplingParams(grammar=GrammarSpec(kind, text, start=len(prompt)))
    with pytest.raises(InvalidGrammar, match="grammar"):
        await engine.prefill(PrefillRequest("s", tokens=prompt, sampling=bad))
    assert engine.health().state is EngineState.READY
    r = await engine.prefill(PrefillRequest("s", tokens=prompt))  # the session is untouched
    assert r.n_past == len(prompt)
    await engine.release("s")


def test_a_spec_is_checked_where_it_is_made() -> None:
    with pytest.raises(InvalidGrammar):
        GrammarSpec("regex", "a+")
    with pytest.raises(InvalidGrammar):
        GrammarSpec("gbnf", "")
    with pytest.raises(InvalidGrammar):
        GrammarSpec("json_object", start=0)
    with pytest.raises(InvalidInput):
        SamplingParams(grammar="json")  # type: ignore[arg-type]


async def test_a_later_shard_without_the_ids_cannot_follow_a_grammar() -> None:
    async with FakeEngine() as eng:
        caps = await eng.load(LoadSpec())
        await eng.open_session("s")
        rows = np.zeros((3, caps.n_embd), dtype=np.float32)
        params = SamplingParams(grammar=GrammarSpec("json_object", start=3))
        with pytest.raises(InvalidInput, match="token ids"):
            await eng.prefill(PrefillRequest("s", hidden_states=rows, sampling=params))


async def test_a_moved_session_continues_its_grammar(engine: ShardEngine) -> None:
    """Hand-off: a session exported mid-answer and imported into another session goes on with
    the tokens the first would have chosen (its matcher is rebuilt from the history)."""
    assert engine.capabilities().kv_layout  # both engines move sessions
    prompt = engine.tokenize(PROMPT)
    params = schema_params(prompt)
    out = await generate(engine, "ref", prompt, params, 40)
    await engine.open_session("a")
    r = await engine.prefill(PrefillRequest("a", tokens=prompt, sampling=params))
    for t in out[:15]:
        r = await engine.decode(DecodeRequest("a", token=t, sampling=params))
    snapshot = await engine.export_session("a")
    await engine.release("a")
    await engine.open_session("b")
    await engine.import_session("b", snapshot)
    got = [out[15]]
    while len(got) < len(out) - 15:
        r = await engine.decode(DecodeRequest("b", token=got[-1], sampling=params))
        got.append(r.logits.token_id)
    assert got == out[15:]
    await engine.release("b")


@pytest.fixture(params=["fake", "llama"])
async def batched(request: pytest.FixtureRequest) -> AsyncIterator[ShardEngine]:
    """An engine whose concurrent sessions share ticks (the fake in its batched mode)."""
    if request.param == "fake":
        eng: ShardEngine = FakeEngine(script=FakeScript(batched=True))
        spec = LoadSpec(n_ctx=8 * 256, max_sessions=8)
    else:
        path: Path = await trio.to_thread.run_sync(ensure_model, "chat")
        eng = LlamaCppEngine()
        spec = LoadSpec(model_path=path, n_ctx=8 * 256, max_sessions=8, n_threads=1)
    async with eng:
        await eng.load(spec)
        yield eng


PROMPTS = ("Answer in JSON:", "A user, as JSON:", "JSON please:", "Describe a person in JSON:",
           "Output JSON:", "The admin as JSON:", "A guest, JSON:", "Person record (JSON):")


async def test_a_ticks_rows_masked_together_choose_as_each_alone(batched: ShardEngine) -> None:
    """8 constrained sessions decoding at once share ticks, whose masks are filled together:
    every mask filled with a tick is the one its matcher computes alone, and on the fake
    (whose logits do not depend on the batch) each session chooses, greedy or sampled, the
    tokens it chooses stepped alone. (llama.cpp's logits may differ in the last bits with the
    batch's layout, which a sampled choice can tell: docs/engine.md, "Determinism".)"""
    engine = batched
    fake = isinstance(engine, FakeEngine)
    prompts = [engine.tokenize(p) for p in PROMPTS]
    params = [schema_params(p, temperature=0.9 if i % 2 and fake else 0.0, seed=i)
              for i, p in enumerate(prompts)]
    alone = [await generate(engine, f"a{i}", prompts[i], params[i], 30) for i in range(8)]
    book = engine._grammars
    filled: list[int] = []
    differed: list[int] = []  # (the spy runs where the tick ends: llama's native thread)
    mask_tick = book.mask_tick

    def spy(steps: list, n_vocab: int) -> int:
        filled.append(mask_tick(steps, n_vocab))
        for slot, _ in steps:
            state = slot.grammar
            if state is not None and state._ready is not None:
                bits = np.frombuffer(state._matcher.compute_bitmask(), dtype=np.uint8)
                own = np.unpackbits(bits, bitorder="little", count=n_vocab).view(bool)
                differed.append(int((own != state._ready).sum()))
        return filled[-1]

    book.mask_tick = spy  # type: ignore[method-assign]
    together: list[list[int]] = [[] for _ in range(8)]

    async def one(i: int) -> None:
        together[i] = await generate(engine, f"t{i}", prompts[i], params[i], 30)

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(one, i)
    assert max(filled) > 1  # several sessions' masks in one fill
    assert len(differed) == sum(filled) > 8 and not any(differed)
    assert len(set(map(tuple, alone))) > 1  # (the sessions differ)
    if fake:
        assert together == alone


async def test_a_mask_filled_with_its_tick_is_used_until_the_matcher_moves() -> None:
    """``mask_together`` fills the very masks ``mask`` computes alone, including the end of
    the grammar (end of generation only); ``mask`` uses the filled one while the matcher stays
    where it was filled, and computes its own once the matcher moved."""
    async with FakeEngine() as eng:
        caps = await eng.load(LoadSpec())
        spec = GrammarSpec("json_object", start=1)
        template = await trio.to_thread.run_sync(eng._grammars.compile, spec)
        history = [1, *(3 + b for b in b'{"a": [1, {"b": "xy"}], "c": true}')]
        rows = np.random.default_rng(0).standard_normal((len(history) + 1, caps.n_vocab))
        rows = rows.astype(np.float32)
        alone, tick, moved = (SessionGrammar(spec, template) for _ in range(3))
        for n in range(1, len(history) + 1):
            expected = _masked(alone, history, n, rows[n])[0]
            assert mask_together([(tick, history, n), (moved, history, n)], caps.n_vocab,
                                 caps.n_vocab) == 2
            got, computed = _masked(tick, history, n, rows[n])  # (it does not move)
            assert np.array_equal(got, expected) and computed == 0
            if n < len(history):  # moved on past where it was filled: its own mask
                got, computed = _masked(moved, history, n + 1, rows[n + 1])
                assert computed == 1
                assert np.array_equal(got, _masked(alone, history, n + 1, rows[n + 1])[0])
        assert np.isfinite(expected).sum() == 1  # a complete object: end of generation only


class _CountingMatcher:
    """A matcher that counts the masks it computes (``compute_bitmask``)."""

    def __init__(self, matcher: object) -> None:
        self.matcher, self.computed = matcher, 0

    def compute_bitmask(self) -> bytes:
        self.computed += 1
        return self.matcher.compute_bitmask()

    def __getattr__(self, name: str) -> object:
        return getattr(self.matcher, name)


def _masked(state: SessionGrammar, history: list[int], n: int, row: object) -> tuple[object, int]:
    """``state`` brought to ``history[:n]`` and ``row`` masked: the row, and how many masks
    the matcher computed for it."""
    counting = state._matcher = _CountingMatcher(state._matcher)
    try:
        assert state.follow(history, n)
        return state.mask(row), counting.computed
    finally:
        state._matcher = counting.matcher


async def test_a_bias_that_forbids_every_token_the_grammar_allows_is_refused(
        engine: ShardEngine) -> None:
    """``-inf`` biases on each token a ``json_object`` grammar allows first, added one chosen
    token at a time, end in ``InvalidInput`` (never a forbidden token, nor a -inf log-prob); the
    refused step is rolled back, the engine stays READY and the session goes on."""
    prompt = engine.tokenize(PROMPT)
    banned: dict[int, float] = {}
    for attempt in range(engine.capabilities().n_vocab):
        params = SamplingParams(grammar=GrammarSpec("json_object", start=len(prompt)),
                                logit_bias=dict(banned))
        sid = f"b{attempt}"
        await engine.open_session(sid)
        try:
            r = await engine.prefill(PrefillRequest(sid, tokens=prompt, sampling=params))
        except InvalidInput as exc:
            assert "logit_bias" in str(exc)
            assert engine.health().state is EngineState.READY
            r = await engine.prefill(PrefillRequest(sid, tokens=prompt))  # rolled back
            assert r.n_past == len(prompt)
            await engine.release(sid)
            break
        await engine.release(sid)
        assert r.logits.token_id not in banned and r.logits.logprob > float("-inf")
        banned[r.logits.token_id] = float("-inf")
    else:
        pytest.fail("every token was allowed")
    assert banned  # the grammar allowed some tokens, each then forbidden
