"""Tools through the front door with the official openai client: ``tool_choice`` required and
named force a call by a grammar (its arguments parse and keep to the function's schema),
``auto`` parses the model's answer; streamed (the SDK accumulating the deltas) and not; whole
and as a 2-hop pipeline; the tool's answer goes back and the model's reply comes. Fake workers
with the Hermes/Qwen template of the ``tools`` preset (and minimal Llama 3.x and Mistral
ones); then that preset on llama.cpp workers (whole, 2-hop pipeline, 2-part pool), and
SmolLM2 (slow; its template does not render tools); and llama.cpp workers of a model whose
vocabulary makes the Llama 3.x and Mistral markers control tokens, as those models' GGUFs do.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, Literal

import openai
import pydantic
import pytest
import trio

from rpc_harness import in_thread
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.api import Backend, Catalog, build_app, serve_http
from shard.api.schemas import ChatCompletionRequest
from shard.api.tools import plan_tools
from shard.chat import ChatTemplate
from shard.engine.fake import FakeModel
from shard.models import ensure_model, read_model_info
from shard.models.plan import plan_parts
from shard.models.real import ensure_real_model, packaged_name
from shard.models.write import CHATML_TEMPLATE, HERMES_TOOLS_TEMPLATE, write_model
from shard.pool import Pool
from test_api import HALVES, NAME, SHAPES, front_door, post
from test_pipeline import TIMEOUT
from test_pool import Listed
from test_pool_llama import CHAT, llama_fleet

#: Positions of a fake worker's session: the tools prompt is some 1,300 bytes (a fake token
#: is a byte).
CONTEXT = 4096
TOOLS_MODEL = FakeModel(n_layers_total=4, n_embd=8, seed=11, chat_template=HERMES_TOOLS_TEMPLATE)


class WeatherArgs(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: Literal["Paris", "Oslo", "Lima"]
    unit: Literal["celsius", "fahrenheit"]
    days: int = pydantic.Field(ge=1, le=7)


class TimeArgs(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    zone: str = pydantic.Field(max_length=12)


ARGS = {"get_weather": WeatherArgs, "get_time": TimeArgs}
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name} of a place", "parameters": model.model_json_schema()}}
    for name, model in ARGS.items()]
CHOICES: dict[str, Any] = {
    "required": "required",
    "named": {"type": "function", "function": {"name": "get_time"}},
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def ask(client: openai.OpenAI, model: str, choice: Any, stream: bool, seed: int,
        ) -> tuple[Any, str | None]:
    """One answer (the message and its finish reason), streamed through the SDK's
    accumulator or whole."""
    kw = dict(model=model, messages=QUESTION, tools=TOOLS, tool_choice=choice,
              temperature=1.0, seed=seed, max_tokens=120)
    if stream:
        with client.chat.completions.stream(**kw) as events:  # type: ignore[arg-type]
            done = events.get_final_completion()
    else:
        done = client.chat.completions.create(**kw)  # type: ignore[arg-type]
    return done.choices[0].message, done.choices[0].finish_reason


def round_trip(client: openai.OpenAI, model: str, choice: Any, stream: bool, seed: int,
               ) -> tuple[Any, str | None, Any]:
    """A forced call, the tool's answer sent back, and the model's reply."""
    message, finish = ask(client, model, choice, stream, seed)
    call = message.tool_calls[0] if message.tool_calls else None
    history: list[Any] = [*QUESTION, message]
    if call is not None:
        history.append({"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'})
    reply = client.chat.completions.create(model=model, messages=history, tools=TOOLS,
                                           tool_choice="none", max_tokens=8, seed=seed)
    return message, finish, reply.choices[0]


def check_call(message: Any, finish: str | None, named: str | None) -> None:
    assert finish == "tool_calls", (finish, message)
    assert message.content is None and len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    # (Mistral's format: 9 letters and digits, test_forced_calls_in_each_format)
    assert re.fullmatch(r"call_[0-9a-f]{24}|[A-Za-z0-9]{9}", call.id) and call.type == "function"
    assert call.function.name in ARGS and (named is None or call.function.name == named)
    ARGS[call.function.name].model_validate_json(call.function.arguments)  # parses, validates


@pytest.mark.parametrize("shape", ["whole", "pipeline"])
@pytest.mark.parametrize("choice", list(CHOICES))
async def test_forced_calls_round_trip(shape: str, choice: str) -> None:
    ranges, relay = SHAPES[shape]
    named = None if choice == "required" else CHOICES[choice]["function"]["name"]
    async with front_door(ranges, relay=relay, model=TOOLS_MODEL, session_ctx=CONTEXT) as door:
        client = door.client
        for seed, stream in enumerate([False, True, False, True]):
            message, finish, reply = await in_thread(partial(
                round_trip, client, NAME, CHOICES[choice], stream, seed))
            check_call(message, finish, named)
            assert reply.finish_reason in ("stop", "length") and not reply.message.tool_calls
            assert isinstance(reply.message.content, str)


AUTO_GRAMMAR = ('root ::= "Checking.\\n<tool_call>\\n{\\"name\\": \\"get_weather\\", '
                '\\"arguments\\": {\\"city\\": \\"Oslo\\", \\"unit\\": \\"celsius\\", '
                '\\"days\\": 2}}\\n</tool_call>"')


@pytest.mark.parametrize("shape", ["whole", "pipeline"])
@pytest.mark.parametrize("stream", [False, True])
async def test_auto_parses_the_models_answer(shape: str, stream: bool) -> None:
    """``auto``: the answer is parsed (a grammar makes the random model write a call), the call
    and the tool's answer go back and the model replies; ``none``: the same answer is text."""
    ranges, relay = SHAPES[shape]
    async with front_door(ranges, relay=relay, model=TOOLS_MODEL, session_ctx=CONTEXT) as door:
        def go(choice: str, messages: list[Any] = QUESTION, grammar: bool = True) -> Any:
            kw = dict(model=NAME, messages=messages, tools=TOOLS, tool_choice=choice,
                      max_tokens=200 if grammar else 8, seed=5)
            if grammar:
                kw["extra_body"] = {"grammar": AUTO_GRAMMAR}
            if stream and grammar:  # (the SDK's helper raises on a reply cut at max_tokens)
                kw["stream_options"] = {"include_usage": True}
                with door.client.chat.completions.stream(**kw) as events:  # type: ignore[arg-type]
                    return events.get_final_completion()
            return door.client.chat.completions.create(**kw)  # type: ignore[arg-type]

        def round_trip() -> tuple[Any, Any, list[Any], Any]:
            auto = go("auto")
            message = auto.choices[0].message
            history = [*QUESTION, message.model_dump(exclude_none=True), *(
                {"role": "tool", "tool_call_id": c.id, "content": '{"sky": "sunny"}'}
                for c in message.tool_calls or ())]
            return auto, go("none"), history, go("auto", history, grammar=False)

        auto, none, history, reply = await in_thread(round_trip)
    message = auto.choices[0].message
    assert auto.choices[0].finish_reason == "tool_calls" and message.content == "Checking.\n"
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    assert WeatherArgs.model_validate_json(call.function.arguments) == WeatherArgs(
        city="Oslo", unit="celsius", days=2)
    assert none.choices[0].finish_reason == "stop" and not none.choices[0].message.tool_calls
    assert "<tool_call>" in (none.choices[0].message.content or "")
    # the reply's prompt is the conversation with the call and the tool's answer, rendered
    # (a fake token is a byte)
    grown = reply.usage.prompt_tokens - auto.usage.prompt_tokens
    assert grown == len(rendered(history).encode()) - len(rendered(QUESTION).encode()), grown
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert isinstance(reply.choices[0].message.content, str)


def rendered(messages: list[Any]) -> str:
    """The prompt the door renders for ``messages`` with ``TOOLS`` (the tools preset's template)."""
    body = ChatCompletionRequest.model_validate({"model": NAME, "messages": messages,
                                                 "tools": TOOLS})
    template = ChatTemplate(HERMES_TOOLS_TEMPLATE)
    plan = plan_tools(body, template)
    return template.render(plan.messages, tools=plan.tools)


async def test_stream_chunks_carry_call_pieces_as_the_sdk_expects() -> None:
    async with front_door(model=TOOLS_MODEL, session_ctx=CONTEXT) as door:
        def go() -> list[Any]:
            return list(door.client.chat.completions.create(
                model=NAME, messages=QUESTION, tools=TOOLS, tool_choice=CHOICES["named"],
                max_tokens=120, seed=3, stream=True))

        chunks = await in_thread(go)
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert pieces[0].index == 0 and pieces[0].id.startswith("call_")
    assert pieces[0].function.name == "get_time"
    assert all(p.index == 0 and p.id is None for p in pieces[1:])
    TimeArgs.model_validate_json("".join(p.function.arguments or "" for p in pieces))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nowhere"}}, "tools": TOOLS},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
      "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
])
async def test_bad_tool_requests_are_a_400_naming_the_parameter(body: dict, param: str) -> None:
    async with front_door(model=TOOLS_MODEL, session_ctx=CONTEXT) as door:
        request = {"model": NAME, "messages": QUESTION, "max_tokens": 4, **body}
        status, _, answer = await in_thread(lambda: post(door.url + "/v1/chat/completions", request))
        assert status == 400, answer
        assert answer["error"]["param"] == param, answer
        ok = await in_thread(lambda: door.client.chat.completions.create(
            model=NAME, messages=QUESTION, max_tokens=4))
        assert ok.choices[0].finish_reason in ("stop", "length")


HISTORY = [
    {"role": "system", "content": "be brief"},
    *QUESTION,
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def test_a_template_with_tools_gets_them_and_the_history() -> None:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY,
                                                 "tools": TOOLS})
    plan = plan_tools(body, ChatTemplate(HERMES_TOOLS_TEMPLATE))
    text = ChatTemplate(HERMES_TOOLS_TEMPLATE).render(plan.messages, tools=plan.tools)
    assert plan.parse == "hermes" and plan.constraint is None
    assert '"name": "get_time"' in text and "be brief" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


def test_a_template_without_tools_gets_them_hermes_style() -> None:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY,
                                                 "tools": TOOLS, "tool_choice": "required"})
    plan = plan_tools(body, ChatTemplate(CHATML_TEMPLATE))
    assert plan.tools is None and plan.parse == "hermes" and plan.constraint is not None
    text = ChatTemplate(CHATML_TEMPLATE).render(plan.messages)
    assert text.count("<|im_start|>system\n") == 1 and "be brief\n\n# Tools" in text
    assert '{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>" in text
    none = plan_tools(body.model_copy(update={"tool_choice": "none"}), ChatTemplate(CHATML_TEMPLATE))
    assert none.parse is None and none.constraint is None
    assert "# Tools" not in ChatTemplate(CHATML_TEMPLATE).render(none.messages)


@asynccontextmanager
async def llama_door(path: Path, name: str, where: str, controls: tuple[str, ...] = (),
                     ) -> AsyncIterator[openai.OpenAI]:
    """The openai client of a front door over llama.cpp workers serving ``path`` whole, as a
    2-hop pipeline, or as a 2-part pool; ``controls``: texts the first worker must report as
    control tokens."""
    ranges = [None] if where == "whole" else [p.layers for p in plan_parts(path, 2)]
    async with AsyncExitStack() as stack:
        workers = await stack.enter_async_context(llama_fleet(
            [(path, r, name) for r in ranges], max_sessions=1, session_ctx=CONTEXT))
        served: Backend | Catalog
        if where == "pool":
            pool = await stack.enter_async_context(
                Pool.open(Listed([w.target for w in workers]), probe_interval=0.2))
            await pool.settle(TIMEOUT)
            served = Catalog(pool=pool, timeout=TIMEOUT)
        else:
            served = await stack.enter_async_context(
                Backend.connect([[w.target] for w in workers], model_id=name, timeout=TIMEOUT))
            assert served.chat is not None and set(controls) <= set(served.chat.special_texts)
        nursery = await stack.enter_async_context(trio.open_nursery())
        shutdown = trio.Event()
        url = (await nursery.start(partial(serve_http, build_app(served), host="127.0.0.1",
                                           port=0, shutdown=shutdown, grace=1.0)))[0]
        yield stack.enter_context(openai.OpenAI(base_url=url + "/v1", api_key="unused",
                                                max_retries=0, timeout=4 * TIMEOUT))
        shutdown.set()


async def llama_round_trips(path: Path, name: str, where: str, controls: tuple[str, ...] = (),
                            ) -> list[tuple[Any, Any, Any]]:
    """A required and a named round trip (the second streamed) through ``llama_door``."""
    async with llama_door(path, name, where, controls) as client:
        got = [await in_thread(partial(round_trip, client, name, CHOICES[c], s, i))
               for i, (c, s) in enumerate([("required", False), ("named", True)])]
    for (message, finish, reply), c in zip(got, ["required", "named"], strict=True):
        check_call(message, finish, None if c == "required" else "get_time")
        assert reply.finish_reason in ("stop", "length") and not reply.message.tool_calls
    return got


@pytest.mark.parametrize("where", ["whole", "pipeline", "pool"])
async def test_the_tools_preset_on_llama_workers(where: str) -> None:
    """The generated ``tools`` preset (the Hermes template in its GGUF, rendering tools)."""
    path = await trio.to_thread.run_sync(ensure_model, "tools")
    assert "<tool_call>" in read_model_info(path).metadata["tokenizer.chat_template"]
    await llama_round_trips(path, "tools-test", where)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["whole", "pool"])
async def test_smollm2_round_trips(where: str) -> None:
    """SmolLM2's template does not render tools: they reach it in the generic system prompt."""
    path = await trio.to_thread.run_sync(ensure_real_model, CHAT)
    await llama_round_trips(path, packaged_name(CHAT), where)


def mistral_id(var: str) -> str:
    """Mistral's templates' check of a call id in the history."""
    return (f"{{% if not {var} is defined or {var} | length != 9 %}}{{{{ raise_exception("
            "'Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}")


#: Minimal templates that render tools and ask for each call format. The Mistral one takes
#: calls and their results back as Mistral 7B Instruct v0.3's and Nemo's templates do, ids
#: checked as they check them.
FORMAT_TEMPLATES = {
    "llama3": ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
               "{{ m.content }}<|eot_id|>{% endfor %}{% if tools %}{{ tools | tojson }} Answer "
               '{"name": ..., "parameters": ...} or <|python_tag|>{% endif %}'
               "<|start_header_id|>assistant<|end_header_id|>"),
    "mistral": ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
                "{% for m in messages %}"
                "{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
                "{% elif m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
                + mistral_id("c.id") + "{{ (c.function | tojson)[:-1] }}, \"id\": \"{{ c.id }}\"}"
                "{% if not loop.last %}, {% endif %}{% endfor %}]</s>"
                "{% elif m.role == 'tool' %}"
                + mistral_id("m.tool_call_id")
                + '[TOOL_RESULTS]{"content": {{ m.content | tojson }}, '
                '"call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]'
                "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"),
}


@pytest.mark.parametrize("fmt", list(FORMAT_TEMPLATES))
async def test_forced_calls_in_each_format(fmt: str) -> None:
    """The grammar writes the format's call; its parser reads it back, streamed and not; the
    call and the tool's answer go back through the template and the model replies (Mistral's
    template takes only ids of 9 letters and digits)."""
    model = FakeModel(n_layers_total=4, n_embd=8, seed=13, chat_template=FORMAT_TEMPLATES[fmt])
    async with front_door(HALVES, model=model, session_ctx=CONTEXT) as door:
        assert plan_tools(ChatCompletionRequest.model_validate(
            {"model": NAME, "messages": QUESTION, "tools": TOOLS}), door.backend.chat).parse == fmt
        for seed, (choice, stream) in enumerate([("required", False), ("named", True)]):
            message, finish, reply = await in_thread(partial(
                round_trip, door.client, NAME, CHOICES[choice], stream, seed))
            check_call(message, finish, None if choice == "required" else "get_time")
            if fmt == "mistral":
                assert re.fullmatch(r"[A-Za-z0-9]{9}", message.tool_calls[0].id)
            assert reply.finish_reason in ("stop", "length") and not reply.message.tool_calls


#: The markers each format's template writes, control tokens in those models' GGUFs (Mistral's
#: v3 tokenizer: ``[TOOL_CALLS]`` ...; Llama 3.x: ``<|python_tag|>`` ...).
FORMAT_CONTROLS = {
    "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"),
    "mistral": ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
}


@pytest.mark.parametrize("fmt", list(FORMAT_TEMPLATES))
async def test_forced_calls_where_the_markers_are_control_tokens(fmt: str, tmp_path: Path) -> None:
    """On llama.cpp workers of a model whose vocabulary makes the format's markers control
    tokens: a control token has no text at the door, so a forced call spells its marker in
    text tokens (the grammar's literal) and parses; the call and the tool's answer go back
    through the template (its markers the control tokens again) and the model replies."""
    path = await trio.to_thread.run_sync(partial(
        write_model, "tools", tmp_path / f"{fmt}.gguf", chat_template=FORMAT_TEMPLATES[fmt],
        controls=FORMAT_CONTROLS[fmt]))
    for message, _, _ in await llama_round_trips(path, f"{fmt}-test", "whole",
                                                 FORMAT_CONTROLS[fmt]):
        if fmt == "mistral":
            assert re.fullmatch(r"[A-Za-z0-9]{9}", message.tool_calls[0].id)


async def test_an_auto_answer_keeps_its_control_token_markers_text(tmp_path: Path) -> None:
    """A Mistral model writes ``[TOOL_CALLS]`` as its control token (here a grammar makes the
    random model do so): with tools (``auto``) the door keeps that token's text for the parser,
    so the call is parsed, streamed and not; with ``tool_choice`` none the token has no text,
    as every control token in an answer."""
    path = await trio.to_thread.run_sync(partial(
        write_model, "tools", tmp_path / "mistral.gguf", chat_template=FORMAT_TEMPLATES["mistral"],
        controls=FORMAT_CONTROLS["mistral"]))
    async with llama_door(path, "mistral-test", "whole", FORMAT_CONTROLS["mistral"]) as client:
        root = str(client.base_url).removesuffix("/").removesuffix("/v1")
        status, _, got = await in_thread(lambda: post(root + "/tokenize", {
            "content": "[TOOL_CALLS]", "with_pieces": True}))
        assert status == 200 and [t["piece"] for t in got["tokens"]] == [""], got
        marker = got["tokens"][0]["id"]
        call = ('[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius", '
                '"days": 2}}]')
        grammar = f"start: <[{marker}]> {json.dumps(call)}"

        def go(choice: str, stream: bool) -> Any:
            kw = dict(model="mistral-test", messages=QUESTION, tools=TOOLS, tool_choice=choice,
                      max_tokens=100, extra_body={"grammar": grammar})
            if stream:
                with client.chat.completions.stream(**kw) as events:  # type: ignore[arg-type]
                    return events.get_final_completion().choices[0]
            return client.chat.completions.create(**kw).choices[0]  # type: ignore[arg-type]

        answers = await in_thread(lambda: [go("auto", False), go("auto", True), go("none", False)])
    for auto in answers[:2]:
        assert auto.finish_reason == "tool_calls" and auto.message.content is None, auto
        (parsed,) = auto.message.tool_calls
        assert parsed.function.name == "get_weather"
        assert WeatherArgs.model_validate_json(parsed.function.arguments) == WeatherArgs(
            city="Oslo", unit="celsius", days=2)
    none = answers[2]
    assert none.finish_reason == "stop" and none.message.content == call
