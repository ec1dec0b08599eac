"""Tools (function calling) at the front door: a request's ``tools``, ``tool_choice`` and tool
messages into what the chat template renders, the grammar that forces a call, and the call
format its answer is parsed in (``shard.api.tool_parsers``).

Rendering follows transformers and llama-server: a template that reads ``tools`` gets them
(``[{"type": "function", "function": {...}}]``), assistant messages keep their ``tool_calls``
with ``function.arguments`` decoded to an object (templates write it with ``tojson``), and tool
messages keep ``tool_call_id`` and the called function's ``name``. A template that never
mentions ``tools`` gets them Hermes-style instead: a system prompt listing them in ``<tools>``
and asking for ``<tool_call>`` blocks, earlier calls written as those blocks and tool answers
as ``<tool_response>`` blocks in user turns.

``tool_choice``: ``auto`` (the default with tools) lets the model answer or call, its answer
parsed; ``required`` and a named function force one call by a grammar (the call format's
markers around a JSON object whose ``name`` is the (a) function's and whose arguments keep to
its ``parameters`` schema), so the call always parses and validates; ``none`` renders no tools
and parses nothing (the model is not told of them, so it does not call).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shard.chat import ChatTemplate

from .schemas import ChatCompletionRequest, ChatMessage

__all__ = ["ToolPlan", "call_format", "plan_tools"]

#: JSON as llguidance writes it in a forced call: no free whitespace, OpenAI's separators.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MENTIONS_TOOLS = re.compile(r"\btools\b")

GENERIC_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


#: Each call format's markers: control tokens in some models' vocabularies (Mistral's
#: ``[TOOL_CALLS]`` and ``[ARGS]``, Llama 3.x's ``<|python_tag|>``), whose text the door keeps
#: in the answer for the parser, as llama-server keeps its "preserved tokens".
MARKERS = {"hermes": ("<tool_call>", "</tool_call>"), "llama3": ("<|python_tag|>",),
           "mistral": ("[TOOL_CALLS]", "[ARGS]")}


def call_format(template: str) -> str:
    """The call format (``shard.api.tool_parsers.FORMATS``) a template asks its model for:
    Llama 3.x's JSON, Mistral's ``[TOOL_CALLS]``, else Hermes/Qwen's ``<tool_call>`` (also
    what the generic tool prompt asks for)."""
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template
                                        and '"parameters"' in template):
        return "llama3"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    return "hermes"


def renders_tools(template: str) -> bool:
    return bool(_MENTIONS_TOOLS.search(template))


@dataclass(frozen=True)
class ToolPlan:
    """What the door does for one chat request: the messages and ``tools`` the template gets,
    the grammar forcing a call (or None) and the format its answer is parsed in (None: none)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    constraint: tuple[str, str, str] | None
    parse: str | None
    #: The format's markers: kept in the answer where the model writes one as a control token
    #: (``Request.preserved``), so that its parser sees it.
    preserved: tuple[str, ...] = ()


def _arguments(text: str) -> Any:
    """A call's arguments as templates take them: the decoded object (the text if not JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _tool_dicts(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in body.tools or ()]


def _native(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for a template that renders tools, as transformers passes them."""
    names = {c.id: c.function.name for m in messages for c in m.tool_calls or ()}
    out = []
    for m in messages:
        d: dict[str, Any] = m.for_template()
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in m.tool_calls]
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
            if m.tool_call_id in names and "name" not in d:
                d["name"] = names[m.tool_call_id]
        out.append(d)
    return out


def _generic(messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None,
             ) -> list[dict[str, Any]]:
    """Messages for a template that does not render tools: Hermes-style text (module doc)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = m.for_template()
        if m.tool_calls:
            blocks = [json.dumps({"name": c.function.name,
                                  "arguments": _arguments(c.function.arguments)},
                                 ensure_ascii=False) for c in m.tool_calls]
            d["content"] = "\n".join([d["content"]] * bool(d["content"]) + [
                f"<tool_call>\n{b}\n</tool_call>" for b in blocks])
        if m.role == "tool":
            d = {"role": "user", "content": f"<tool_response>\n{d['content']}\n</tool_response>"}
        out.append(d)
    if tools:
        prompt = GENERIC_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False)
                                                       for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_schema(fmt: str, body: ChatCompletionRequest, only: str | None) -> dict[str, Any]:
    """A JSON schema of one call of the format: any of the tools, or the named one."""
    key = "parameters" if fmt == "llama3" else "arguments"
    choices = []
    for tool in body.tools or ():
        f = tool.function
        if only is not None and f.name != only:
            continue
        params = f.parameters if f.parameters is not None else {
            "type": "object", "properties": {}, "additionalProperties": False}
        choices.append({"type": "object", "properties": {"name": {"const": f.name}, key: params},
                        "required": ["name", key], "additionalProperties": False})
    schema = choices[0] if len(choices) == 1 else {"anyOf": choices}
    return {**schema, "x-guidance": _JSON_STYLE}


def forcing_grammar(fmt: str, body: ChatCompletionRequest, only: str | None) -> str:
    """A lark grammar (llguidance's) of exactly one call in ``fmt``."""
    schema = _call_schema(fmt, body, only)
    if fmt == "mistral":
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1,
                  "x-guidance": _JSON_STYLE}
    before, after = {"hermes": ("<tool_call>\n", "\n</tool_call>"), "llama3": ("", ""),
                     "mistral": ("[TOOL_CALLS]", "")}[fmt]
    parts = [json.dumps(p) for p in (before, after) if p]
    rule = " ".join(([parts[0]] if before else []) + ["call"] + ([parts[-1]] if after else []))
    return f"start: {rule}\ncall: %json {json.dumps(schema)}\n"


def plan_tools(body: ChatCompletionRequest, chat: ChatTemplate | None) -> ToolPlan:
    """The plan of one chat request (see ``ToolPlan``); a request without tools and tool
    messages renders its messages as before."""
    source = chat.source if chat is not None else ""
    native = renders_tools(source)
    fmt = call_format(source) if native else "hermes"
    choice = body.tool_choice
    active = bool(body.tools) and choice != "none"
    tools = _tool_dicts(body) if active else None
    messages = _native(body.messages) if native else _generic(body.messages, tools)
    constraint = None
    if active and choice not in (None, "auto"):
        only = None if choice == "required" else choice.function.name  # type: ignore[union-attr]
        constraint = ("lark", forcing_grammar(fmt, body, only), "tool_choice")
    return ToolPlan(messages, tools if native else None, constraint, fmt if active else None,
                    MARKERS[fmt] if active else ())
