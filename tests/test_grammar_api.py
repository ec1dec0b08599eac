"""Constrained decoding at the front door with the official openai client: ``response_format``
(json_object, json_schema, through ``beta.chat.completions.parse`` with pydantic models) and
llama-server's ``grammar``; a bad schema or grammar is a 400 naming its parameter. Fake
workers, whole and as a 2-hop pipeline (the client stepping, or a chain relay); then SmolLM2
(slow), whole and through a 2-part pool.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from functools import partial
from typing import Annotated, Literal

import openai
import pydantic
import pytest
import trio

from rpc_harness import in_thread
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.api import Backend, Catalog, build_app, serve_http
from shard.models.plan import plan_parts
from shard.models.real import ensure_real_model, packaged_name
from shard.pool import Pool
from test_api import HALVES, NAME, SHAPES, FrontDoor, front_door, post
from test_pipeline import TIMEOUT
from test_pool import Listed
from test_pool_llama import CHAT, llama_fleet


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "fish"]
    name: str = pydantic.Field(max_length=16)


class Owner(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=120)
    pets: list[Pet] = pydantic.Field(max_length=3)


class City(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    capital: bool


class Weather(pydantic.BaseModel):
    place: City
    sky: Literal["sunny", "cloudy", "rainy", "snowy"]
    temperatures: list[int] = pydantic.Field(max_length=5)


class Verdict(pydantic.BaseModel):
    answer: Literal["yes", "no"]
    reasons: list[Annotated[str, pydantic.Field(max_length=40)]] = pydantic.Field(max_length=3)


#: (pydantic model, question): nested objects, arrays, enums, required fields.
CASES = [
    (Owner, "Describe a pet owner and their pets."),
    (Weather, "What is the weather like in Paris today?"),
    (Verdict, "Is the sea salty? Give reasons."),
    (City, "Name a large city."),
    (Pet, "Invent a pet."),
]


def ask_parsed(door: FrontDoor) -> list[object]:
    """One answer per case (sampled, seeded) and a json_object answer (greedy)."""
    client = door.client
    got: list[object] = []
    for seed, (model, question) in enumerate(CASES):
        done = client.beta.chat.completions.parse(
            model=NAME, messages=[{"role": "user", "content": question}],
            response_format=model, temperature=1.0, seed=seed, max_tokens=400)
        got.append(done.choices[0].message.parsed)
    obj = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=400)
    got.append(json.loads(obj.choices[0].message.content or ""))
    return got


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_parse_with_pydantic_models_and_json_object(shape: str) -> None:
    """Whole, and two hops (the client stepping, or a chain relay)."""
    ranges, relay = SHAPES[shape]
    async with front_door(ranges, relay=relay) as door:
        got = await in_thread(partial(ask_parsed, door))
    assert [type(g) for g in got] == [m for m, _ in CASES] + [dict]


async def test_verified_drafts_give_the_answers_of_plain_decoding() -> None:
    """Two hops verifying drafted tokens: every drafted position is masked as plain decoding
    would mask it, so the answers are plain decoding's."""
    async with front_door(HALVES) as door:
        plain = await in_thread(partial(ask_parsed, door))
        plain_steps = door.workers[-1].engine.metrics().steps_total
    async with front_door(HALVES, speculate=3) as door:
        drafted = await in_thread(partial(ask_parsed, door))
        drafted_steps = door.workers[-1].engine.metrics().steps_total
    assert drafted == plain
    assert drafted_steps < plain_steps  # drafts were verified, and some kept


async def test_grammar_on_completions_and_chat() -> None:
    gbnf = 'root ::= ("yes" | "no") "!"'
    async with front_door() as door:
        def ask() -> list[str]:
            client = door.client
            texts = [client.completions.create(
                model=NAME, prompt="Well?", max_tokens=10, temperature=1.0, seed=s,
                extra_body={"grammar": gbnf}).choices[0].text for s in range(3)]
            texts.append(client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": "Well?"}], max_tokens=10,
                extra_body={"grammar": gbnf}).choices[0].message.content or "")
            return texts

        assert set(await in_thread(ask)) <= {"yes!", "no!"}


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": 5}}}}, "response_format"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"grammar": "root ::= missing"}, "grammar"),
    ({"grammar": "root ::= \"a\"", "response_format": {"type": "json_object"}}, "grammar"),
])
@pytest.mark.parametrize("shape", ["whole", "pipeline"])
async def test_a_bad_schema_or_grammar_is_a_400_naming_it(body: dict, param: str,
                                                          shape: str) -> None:
    async with front_door(HALVES if shape == "pipeline" else [None]) as door:
        request = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], **body}
        status, _, answer = await in_thread(lambda: post(door.url + "/v1/chat/completions", request))
        assert status == 400, answer
        assert answer["error"]["param"] == param, answer
        # ... and the workers still serve
        ok = await in_thread(lambda: door.client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4))
        assert ok.choices[0].finish_reason in ("stop", "length")


#: json_schema answers SmolLM2 gives per shape (whole, 2-part pool), every one checked.
ANSWERS_PER_SHAPE = 50


@pytest.mark.slow
@pytest.mark.parametrize("where", ["whole", "pool"])
async def test_smollm2_answers_parse_and_validate(where: str) -> None:
    smollm2 = ensure_real_model(CHAT)
    name = packaged_name(CHAT)
    async with AsyncExitStack() as stack:
        if where == "whole":
            (w,) = await stack.enter_async_context(llama_fleet([(smollm2, None, name)]))
            served: Backend | Catalog = await stack.enter_async_context(
                Backend.connect([[w.target]], timeout=TIMEOUT))
        else:
            parts = [p.layers for p in plan_parts(smollm2, 2)]
            workers = await stack.enter_async_context(
                llama_fleet([(smollm2, lr, name) for lr in parts]))
            pool = await stack.enter_async_context(
                Pool.open(Listed([w.target for w in workers]), probe_interval=0.2))
            await pool.settle(TIMEOUT)
            served = Catalog(pool=pool, timeout=TIMEOUT)
        nursery = await stack.enter_async_context(trio.open_nursery())
        shutdown = trio.Event()
        url = (await nursery.start(partial(serve_http, build_app(served), host="127.0.0.1",
                                           port=0, shutdown=shutdown, grace=1.0)))[0]
        client = stack.enter_context(openai.OpenAI(  # (a shared machine: an answer's time)
            base_url=url + "/v1", api_key="unused", max_retries=0, timeout=4 * TIMEOUT))

        def ask() -> list[tuple[type, object, str | None]]:
            got = []
            for i in range(ANSWERS_PER_SHAPE):
                model, question = CASES[i % len(CASES)]
                done = client.beta.chat.completions.parse(
                    model=CHAT, messages=[{"role": "user", "content": question}],
                    response_format=model, temperature=0.0 if i < len(CASES) else 0.8, seed=i,
                    max_tokens=200)
                got.append((model, done.choices[0].message.parsed, done.choices[0].finish_reason))
            return got

        got = await in_thread(ask)
        shutdown.set()
    assert len(got) == ANSWERS_PER_SHAPE
    for model, parsed, finish in got:
        assert isinstance(parsed, model) and finish == "stop"


async def test_a_last_worker_without_grammars_is_refused_not_ignored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that reports no grammar kinds (an older one, or one without the grammar
    library) would answer unconstrained: the pipeline refuses before any step."""
    from shard.engine import grammar

    monkeypatch.setattr(grammar, "available", lambda: False)
    async with front_door(HALVES) as door:
        request = {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                   "response_format": {"type": "json_object"}}
        status, _, answer = await in_thread(lambda: post(door.url + "/v1/chat/completions", request))
        assert status == 400 and answer["error"]["param"] == "response_format", answer
        assert "constrains decoding to none" in answer["error"]["message"]


async def test_the_wire_names_where_a_grammar_starts() -> None:
    """``grammar_start`` 0 reads as the end of a Prefill's prompt, and on a Decode as the start
    the session's last step used; with none to continue, and for a grammar that does not
    compile, the step is INVALID_ARGUMENT (reason INVALID_GRAMMAR) and the session goes on."""
    from rpc_harness import worker
    from shard.client import ShardClient, sampling
    from shard.engine.fake import BYTE_OFFSET, EOS_ID
    from shard.rpc.errors import ErrorCode, ShardError

    yes = sampling(grammar_kind="gbnf", grammar='root ::= "ok"')
    async with worker() as w, ShardClient.connect(w.target, timeout=10) as c:
        async with c.session() as s:
            first = await s.prefill([1, 50, 60, 70])
            with pytest.raises(ShardError) as caught:
                await s.decode(first.logits.token_id, sampling=yes)  # no grammar to continue
            assert (caught.value.code, caught.value.reason) == (ErrorCode.INVALID_ARGUMENT,
                                                                "INVALID_GRAMMAR")
            bad = sampling(grammar_kind="gbnf", grammar="root ::= nowhere")
            with pytest.raises(ShardError) as caught:
                await s.prefill([80], position=4, sampling=bad)
            assert caught.value.reason == "INVALID_GRAMMAR" and "nowhere" in caught.value.message
            step = await s.prefill([80], position=4, sampling=yes)  # the grammar starts at 5
            tokens = [step.logits.token_id]
            while not step.logits.is_eog:
                step = await s.decode(tokens[-1], sampling=yes)  # start 0: the session's
                tokens.append(step.logits.token_id)
            assert tokens == [BYTE_OFFSET + ord("o"), BYTE_OFFSET + ord("k"), EOS_ID]


@pytest.mark.parametrize("refusal", ["grammar", "token"])
async def test_a_refused_step_leaves_the_sessions_grammar_start(refusal: str) -> None:
    """A step refused (its grammar does not compile; its token is out of the vocabulary)
    leaves where the session's grammar starts as the last accepted step set it: a Decode with
    ``grammar_start`` 0 after it continues that grammar, not the refused step's."""
    from rpc_harness import worker
    from shard.client import ShardClient, sampling
    from shard.engine.fake import BYTE_OFFSET, EOS_ID
    from shard.rpc.errors import ShardError

    yes = sampling(grammar_kind="gbnf", grammar='root ::= "ok"')
    async with worker() as w, ShardClient.connect(w.target, timeout=10) as c:
        async with c.session() as s:
            step = await s.prefill([1, 50, 60, 70], sampling=yes)  # the grammar starts at 4
            o = step.logits.token_id
            assert o == BYTE_OFFSET + ord("o")
            with pytest.raises(ShardError) as caught:
                if refusal == "grammar":  # it would start at 5, after its prompt
                    await s.prefill([o], position=4, sampling=sampling(
                        grammar_kind="gbnf", grammar="root ::= nowhere"))
                else:
                    elsewhere = sampling(grammar_kind="gbnf", grammar='root ::= "ok"')
                    elsewhere.grammar_start = 2
                    await s.decode(10**6, sampling=elsewhere)
            want = "INVALID_GRAMMAR" if refusal == "grammar" else "INVALID_INPUT"
            assert caught.value.reason == want
            tokens = [o]
            while not step.logits.is_eog:
                step = await s.decode(tokens[-1], sampling=yes)  # start 0: the accepted one's
                tokens.append(step.logits.token_id)
            assert tokens == [BYTE_OFFSET + ord("o"), BYTE_OFFSET + ord("k"), EOS_ID]
