"""Tool-call parsers (``shard.api.tool_parsers``): each format's answers into text and calls,
and a streamed answer, split anywhere, gives the events of the whole one."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shard.api.tool_parsers import Call, Parsed, parse, parser_for
from shard.api.tools import call_format


def counter() -> object:
    ids = itertools.count()
    return lambda: f"call_{next(ids)}"


def calls(*pairs: tuple[str, str]) -> list[Call]:
    return [Call(f"call_{i}", name, args) for i, (name, args) in enumerate(pairs)]


#: (format, answer, content, calls)
CASES = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"at": {"h": 12}}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
     "</tool_call>", "Let me look.\n",
     calls(("get_weather", '{"city": "Paris", "at": {"h": 12}}'), ("get_time", "{}"))),
    ("hermes", '<tool_call>\n{"arguments": {"q": "a}"}, "name": "search"}\n</tool_call>', "",
     calls(("search", '{"q": "a}"}'))),
    ("hermes", "a < b and <tool_ca are text, so is <tool_call>f(x)</tool_call>.",
     "a < b and <tool_ca are text, so is <tool_call>f(x)</tool_call>.", []),
    ("hermes", '<tool_call>\n{"oops": 1}\n</tool_call>', '<tool_call>\n{"oops": 1}\n</tool_call>',
     []),
    ("hermes", 'cut short <tool_call>\n{"name": "f", "arguments": {"x": "ab',
     "cut short ", calls(("f", '{"x": "ab'))),
    ("hermes", "plain answer", "plain answer", []),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', "",
     calls(("get_weather", '{"city": "Oslo"}'))),
    ("llama3", '  {"name": "f", "parameters": {"x": [1, 2]}} ', "", calls(("f", '{"x": [1, 2]}'))),
    ("llama3", '{"parameters": {"x": 1}, "name": "f"}', "", calls(("f", '{"x": 1}'))),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3", "Hello {there}", "Hello {there}", []),
    ("mistral", 'Sure [TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, {"name": "g", '
     '"arguments": {}}]', "Sure ", calls(("f", '{"x": 1}'), ("g", "{}"))),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": 1}', "", calls(("f", '{"x": 1}'))),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    ("mistral", "[TOOL_ a bracket", "[TOOL_ a bracket", []),
]


@pytest.mark.parametrize("fmt,text,content,expected", CASES)
def test_whole_answers(fmt: str, text: str, content: str, expected: list[Call]) -> None:
    assert parse(fmt, text, counter()) == Parsed(content, expected)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_a_stream_split_anywhere_gives_the_whole_answer(case: tuple, cuts: list[int]) -> None:
    fmt, text, _, _ = case
    whole = parse(fmt, text, counter())  # type: ignore[arg-type]
    parser = parser_for(fmt, counter())  # type: ignore[arg-type]
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    events = [e for a, b in itertools.pairwise(bounds) for e in parser.feed(text[a:b])]
    assert Parsed.of(events + parser.finish()) == whole


@settings(max_examples=200, deadline=None)
@given(args=st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                         lambda inner: st.lists(inner, max_size=3)
                         | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8),
       before=st.text(alphabet="ab <>{}\n", max_size=12), cuts=st.lists(st.integers(0, 400), max_size=6))
def test_hermes_arguments_of_any_json_stream_whole(args: object, before: str,
                                                   cuts: list[int]) -> None:
    """Any JSON arguments come back as written; the streamed pieces join to them."""
    written = json.dumps({"a": args}, ensure_ascii=False)
    text = f'{before}<tool_call>\n{{"name": "f", "arguments": {written}}}\n</tool_call>'
    whole = parse("hermes", text, counter())  # type: ignore[arg-type]
    assert [json.loads(c.arguments) for c in whole.calls] == [{"a": args}]
    parser = parser_for("hermes", counter())  # type: ignore[arg-type]
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    events = [e for a, b in itertools.pairwise(bounds) for e in parser.feed(text[a:b])]
    assert Parsed.of(events + parser.finish()) == whole


def test_arguments_stream_before_the_call_ends() -> None:
    parser = parser_for("hermes", counter())  # type: ignore[arg-type]
    events = parser.feed('<tool_call>\n{"name": "f", "arguments": {"city": "Par')
    assert Parsed.of(events) == Parsed("", calls(("f", '{"city": "Par')))


@pytest.mark.parametrize("template,fmt", [
    ("{% for m in messages %}<tool_call>{% endfor %}", "hermes"),
    ("<|start_header_id|>ipython<|end_header_id|>{{ tools }} \"parameters\"", "llama3"),
    ("{{ '<|python_tag|>' }}", "llama3"),
    ("[AVAILABLE_TOOLS] {{ tools }} [TOOL_CALLS]", "mistral"),
    ("{{ messages }}", "hermes"),
])
def test_the_call_format_comes_from_the_template(template: str, fmt: str) -> None:
    assert call_format(template) == fmt


def test_a_chat_reply_of_several_choices_parses_each_choice_on_its_own() -> None:
    """``n`` choices with tools: each choice has its own parser, streamed and whole agree, and
    a choice that calls finishes with ``tool_calls`` while a text one stops."""
    from shard.api.backend import Outcome
    from shard.api.replies import ChatReply
    from shard.api.text import Delta

    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    answers = {0: ["Sure. ", call[:20], call[20:]], 1: ["No call ", "here."]}
    outcome = [Outcome("stop", 5, 5, 0, ("stop", "stop"))]
    streamed = ChatReply("m", logprobs=False, tool_format="hermes", n=2)
    opening = streamed.opening_chunks()
    assert [c["choices"][0]["index"] for c in opening] == [0, 1]
    pieces: dict[int, list[dict]] = {0: [], 1: []}
    for i in (0, 1):
        for text in answers[i]:
            chunk = streamed.chunk(Delta(text, index=i), i)
            if chunk is not None:
                pieces[i].append(chunk["choices"][0])
    for chunk in streamed.final_chunks(outcome):
        pieces[chunk["choices"][0]["index"]].append(chunk["choices"][0])
    assert pieces[0][-1]["finish_reason"] == "tool_calls" and pieces[1][-1]["finish_reason"] == "stop"
    assert "".join(p["delta"].get("content") or "" for p in pieces[1]) == "No call here."
    whole = ChatReply("m", logprobs=False, tool_format="hermes", n=2).body(
        [[Delta(t, index=i) for t in answers[i]] for i in (0, 1)], outcome)
    first, second = whole["choices"]
    assert first["finish_reason"] == "tool_calls"
    assert first["message"]["tool_calls"][0]["function"]["name"] == "f"
    assert second["message"]["content"] == "No call here." and "tool_calls" not in second["message"]
