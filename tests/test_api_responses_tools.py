"""Function tools on ``/v1/responses`` with the official openai client (fake workers with the
``tools`` preset's template, then the preset itself on a llama.cpp worker): forced calls
(``required``, a named function) come back as ``function_call`` output items (whole:
``ResponseFunctionToolCall``; streamed: the function-call events the SDK parses and
accumulates), the call and its ``function_call_output`` go back to the template as the chat
path's assistant call and tool message, and the model answers in text; ``auto`` parses the
answer as the chat path does (text then a call: a message item then a function-call item,
stream and body alike); built-in tools and bad tool requests are a 400 naming the parameter.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from functools import partial
from typing import Any, get_args

import openai
import pytest
import trio
from openai.types.responses import Response, ResponseFunctionToolCall, ResponseStreamEvent

from rpc_harness import in_thread
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.api import Backend, build_app, serve_http
from shard.api.backend import Outcome
from shard.api.responses import ResponsesReply, ResponsesRequest
from shard.api.schemas import ChatCompletionRequest
from shard.api.text import Delta
from shard.api.tools import plan_tools
from shard.chat import ChatTemplate
from shard.models import ensure_model
from shard.models.write import CHATML_TEMPLATE, HERMES_TOOLS_TEMPLATE
from test_api import NAME, front_door, post
from test_api_tools import ARGS, CONTEXT, HISTORY, TOOLS, TOOLS_MODEL, TimeArgs
from test_pipeline import TIMEOUT
from test_pool_llama import llama_fleet

#: The chat tools in the Responses API's flat shape.
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
CHOICES: dict[str, Any] = {"required": "required",
                           "named": {"type": "function", "name": "get_time"}}
QUESTION = "What is the weather in Paris?"
#: Each stream event's model in the SDK, by its ``type`` (validated strictly, not just read).
EVENTS = {get_args(m.model_fields["type"].annotation)[0]: m
          for m in get_args(get_args(ResponseStreamEvent)[0])}


def check_call(item: Any, named: str | None) -> None:
    assert isinstance(item, ResponseFunctionToolCall), item
    assert item.type == "function_call" and item.status == "completed"
    assert item.call_id.startswith("call_") and item.id and item.id.startswith("fc_")
    assert item.name in ARGS and (named is None or item.name == named)
    ARGS[item.name].model_validate_json(item.arguments)  # parses, keeps to the schema


def called(client: openai.OpenAI, choice: Any, stream: bool,
           model: str = NAME) -> tuple[Any, list[Any]]:
    """A forced call: the final response and (streamed) the events the SDK parsed."""
    kw = dict(model=model, input=QUESTION, tools=FLAT_TOOLS, tool_choice=choice,
              max_output_tokens=120, temperature=1.0)
    if not stream:
        return client.responses.create(**kw), []  # type: ignore[call-overload]
    events = list(client.responses.create(stream=True, **kw))  # type: ignore[call-overload]
    return events[-1].response, events


def check_stream(events: list[Any], final: Any) -> None:
    """The function-call events in OpenAI's order, their deltas joining to the call."""
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.status == "in_progress" and added.arguments == ""
    (call,) = final.output
    assert added.id == done.id == call.id and done.model_dump() == call.model_dump()
    joined = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert joined == events[-3].arguments == call.arguments
    assert all(e.item_id == call.id and e.output_index == 0 for e in events[3:-2])
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def round_trips(client: openai.OpenAI, choice: str, model: str = NAME) -> None:
    """Each forced call, whole and streamed; then the call and its output sent back (as the
    SDK gives the items), and the model's text."""
    named = None if choice == "required" else "get_time"
    for stream in (False, True):
        final, events = await in_thread(partial(called, client, CHOICES[choice], stream, model))
        assert final.status == "completed" and final.output_text == ""
        (call,) = final.output
        check_call(call, named)
        if stream:
            check_stream(events, final)
        history = [{"role": "user", "content": QUESTION}, call,
                   {"type": "function_call_output", "call_id": call.call_id,
                    "output": '{"sky": "sunny"}'}]
        reply = await in_thread(lambda h=history, s=stream: (  # type: ignore[misc]
            list(client.responses.create(model=model, input=h, tools=FLAT_TOOLS,
                                         tool_choice="none", max_output_tokens=8,
                                         stream=True))[-1].response if s else
            client.responses.create(model=model, input=h, tools=FLAT_TOOLS,
                                    tool_choice="none", max_output_tokens=8)))
        assert reply.status in ("completed", "incomplete")
        assert [item.type for item in reply.output] == ["message"]
        assert reply.output_text == reply.output[0].content[0].text
        base = await in_thread(lambda: client.responses.create(
            model=model, input=QUESTION, tools=FLAT_TOOLS, tool_choice="none",
            max_output_tokens=1))
        # the call's arguments and the tool's output are in the prompt
        grown = reply.usage.input_tokens - base.usage.input_tokens
        assert grown > await tokens(client, call.arguments + '{"sky": "sunny"}') - 2, grown


async def tokens(client: openai.OpenAI, text: str) -> int:
    """How many tokens the door's model makes of ``text`` (``/tokenize``)."""
    root = str(client.base_url).removesuffix("/").removesuffix("/v1")
    status, _, got = await in_thread(lambda: post(root + "/tokenize", {"content": text}))
    assert status == 200, got
    return len(got["tokens"])


@pytest.mark.parametrize("choice", list(CHOICES))
async def test_forced_calls_round_trip(choice: str) -> None:
    async with front_door(model=TOOLS_MODEL, session_ctx=CONTEXT) as door:
        await round_trips(door.client, choice)


async def test_the_tools_preset_on_a_llama_worker() -> None:
    """The generated ``tools`` preset (the Hermes template in its GGUF) on a llama.cpp worker:
    a forced call each way, whole and streamed, and the round trip."""
    path = await trio.to_thread.run_sync(ensure_model, "tools")
    async with AsyncExitStack() as stack:
        (w,) = await stack.enter_async_context(llama_fleet(
            [(path, None, "tools-test")], max_sessions=1, session_ctx=CONTEXT))
        backend = await stack.enter_async_context(
            Backend.connect([[w.target]], model_id="tools-test", timeout=TIMEOUT))
        nursery = await stack.enter_async_context(trio.open_nursery())
        shutdown = trio.Event()
        url = (await nursery.start(partial(serve_http, build_app(backend), host="127.0.0.1",
                                           port=0, shutdown=shutdown, grace=1.0)))[0]
        client = stack.enter_context(openai.OpenAI(base_url=url + "/v1", api_key="unused",
                                                   max_retries=0, timeout=4 * TIMEOUT))
        for choice in CHOICES:
            await round_trips(client, choice, "tools-test")
        shutdown.set()


async def test_the_sdk_stream_helper_accumulates_a_named_call() -> None:
    async with front_door(model=TOOLS_MODEL, session_ctx=CONTEXT) as door:
        def go() -> Any:
            with door.client.responses.stream(
                    model=NAME, input=QUESTION, tools=FLAT_TOOLS,  # type: ignore[arg-type]
                    tool_choice=CHOICES["named"], max_output_tokens=120) as stream:
                return stream.get_final_response()

        final = await in_thread(go)
    (call,) = final.output
    check_call(call, "get_time")
    TimeArgs.model_validate_json(call.arguments)


def test_function_items_render_as_the_chat_history() -> None:
    """``function_call`` and ``function_call_output`` input items are the chat path's
    assistant tool call and tool message, in both kinds of template."""
    responses = ResponsesRequest.model_validate({
        "instructions": "be brief", "tools": FLAT_TOOLS, "input": [
            {"role": "user", "content": HISTORY[1]["content"]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]})
    assert responses.unsupported() is None
    chat = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": TOOLS})
    for source in (HERMES_TOOLS_TEMPLATE, CHATML_TEMPLATE):
        template = ChatTemplate(source)
        texts = [template.render(p.messages, tools=p.tools) for p in (
            plan_tools(responses.chat_request(), template), plan_tools(chat, template))]
        assert texts[0] == texts[1]
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in texts[0]
        assert "<tool_response>\nsunny, 21 C\n</tool_response>" in texts[0]


ANSWER = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
          '"unit": "celsius", "days": 2}}\n</tool_call>')


@pytest.mark.parametrize("step", [1, 3, 7, len(ANSWER)])
def test_auto_answers_stream_as_a_message_then_a_call(step: int) -> None:
    """``auto``: the answer parsed as chat's; however split, the events are OpenAI's types,
    the streamed items are the whole body's, and the SDK reads a message then a call."""
    body = ResponsesRequest.model_validate({"input": QUESTION, "tools": FLAT_TOOLS})
    outcome = Outcome(finish_reason="stop", prompt_tokens=5, completion_tokens=9)
    streamed = ResponsesReply(NAME, body, "hermes")
    events = [*streamed.opening_chunks()]
    for i in range(0, len(ANSWER), step):
        events += streamed.chunks(Delta(ANSWER[i:i + step]))
    events += streamed.final_chunks([outcome])
    parsed = [EVENTS[e["type"]].model_validate(e) for e in events]
    whole = Response.model_validate(ResponsesReply(NAME, body, "hermes").body(
        [[Delta(ANSWER)]], [outcome]))
    final = parsed[-1].response  # type: ignore[union-attr]
    message, call = whole.output
    assert message.type == "message" and message.content[0].text == "Checking.\n"
    assert isinstance(call, ResponseFunctionToolCall) and call.name == "get_weather"
    assert ARGS["get_weather"].model_validate_json(call.arguments).city == "Oslo"
    strip = {"id", "call_id"}  # fresh in each reply
    assert [i.model_dump(exclude=strip) for i in final.output] == [
        i.model_dump(exclude=strip) for i in whole.output]
    kinds = [e.type for e in parsed]
    assert kinds.index("response.output_item.done") < kinds.index(
        "response.function_call_arguments.delta")  # the message closed before the call
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "web_search_preview"}]}, "tools"),
    ({"tools": [*FLAT_TOOLS, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
    ({"tools": FLAT_TOOLS + FLAT_TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "name": "a b", "parameters": {}}]}, "tools.0.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nowhere"}},
     "tool_choice"),
    ({"tools": FLAT_TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.name"),
    ({"input": [{"type": "function_call_output", "output": "x"}]},
     "input.0.function_call_output.call_id"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
    ({"input": []}, "input"),
])
async def test_bad_tool_requests_are_a_400_naming_the_parameter(body: dict, param: str) -> None:
    async with front_door(model=TOOLS_MODEL, session_ctx=CONTEXT) as door:
        request = {"model": NAME, "input": QUESTION, "max_output_tokens": 4, **body}
        status, _, answer = await in_thread(lambda: post(door.url + "/v1/responses", request))
        assert status == 400, answer
        assert answer["error"]["param"] == param, answer
        ok = await in_thread(lambda: door.client.responses.create(
            model=NAME, input=QUESTION, max_output_tokens=4))
        assert ok.status in ("completed", "incomplete")
