"""OpenAI's Responses API (``POST /v1/responses``), text and function calls, through the chat path.

Why a minimal one: newer SDK examples and agents call ``client.responses.create`` first. The
request's ``instructions`` and ``input`` (a text, or messages of text parts, earlier
``function_call`` items and their ``function_call_output``) become a chat request
(``ResponsesRequest.chat_request``) whose tools, tool choice and history go through
``shard.api.tools`` as a chat completion's do; the answer is parsed by the same call parsers
(``shard.api.tool_parsers``). The reply is a ``response`` object whose ``output`` is the
assistant's ``message`` of ``output_text`` and/or its ``function_call`` items, or, streamed,
the typed events (``response.created`` ... ``response.output_text.delta`` /
``response.function_call_arguments.delta`` ... ``response.completed``) each named in its
``event:`` line. Built-in tools (web search, files, ...), reasoning, stored responses
(``previous_response_id``, ``store: true``) and structured output are refused (400 naming the
parameter), never ignored.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from .backend import Outcome
from .replies import Reply
from .schemas import (ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDefinition,
                      NamedFunction, NamedToolChoice, Tool, ToolCall)
from .text import Delta
from .tool_parsers import CallArgs, CallStart, Event, Text, parser_for

__all__ = ["ResponsesReply", "ResponsesRequest"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputText(_Strict):
    # ``output_text``: an earlier response's text a client sends back in the history
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _joined(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class InputMessage(_Strict):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]
    # what an earlier response's output item carries when a client sends it back
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(_Strict):
    """An earlier answer's call (its output item sent back): the assistant's tool call."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    """The client's answer to a call: the tool message."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None


def _item_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind or "message"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind)]


class FunctionTool(FunctionDefinition):
    """A Responses-API function tool: the chat one's definition, flat (not under ``function``)."""

    type: Literal["function"]


class HostedTool(BaseModel):
    """A built-in tool (``web_search``, ``file_search``, ...): taken only to be refused by name."""

    model_config = ConfigDict(extra="allow")
    type: str


ResponseTool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[HostedTool, Tag("hosted")],
    Discriminator(lambda v: "function" if _item_kind(v) == "function" else "hosted")]


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text"]


class TextOptions(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(_Strict):
    """``POST /v1/responses``: what a response of text and function calls takes."""

    model: str | None = None
    #: A text is one user message (so a bad item is named ``input.<i>...``, not by a union).
    input: Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    text: TextOptions | None = None
    #: Accepted as on chat completions: a forced call is one call, ``auto`` parses every call.
    parallel_tool_calls: bool | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: str | FunctionChoice | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> Any:
        return [{"role": "user", "content": value}] if isinstance(value, str) else value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        named = isinstance(value, dict) and value.get("type") == "function"
        if not (named or value is None or value in ("none", "auto", "required")):
            raise ValueError("tool_choice must be none, auto, required or a named function "
                             "(built-in tools are not supported)")
        return FunctionChoice.model_validate(value) if named else value

    def unsupported(self) -> tuple[str, str] | None:
        if self.store:
            return "store", "responses are not stored (store: true is not supported)"
        hosted = sorted({t.type for t in self.tools or () if isinstance(t, HostedTool)})
        if hosted:
            return "tools", (f"built-in tools ({', '.join(hosted)}) are not supported; "
                             "function tools are")
        return self.chat_request()._tools_unsupported()

    def chat_request(self) -> ChatCompletionRequest:
        """The request as a chat completion's messages, tools and tool choice: consecutive
        calls join the assistant message before them (one turn), each output is a tool
        message answering its ``call_id``; ``developer`` is ``system`` (``for_template``)."""
        messages = [] if self.instructions is None else [
            ChatMessage(role="system", content=self.instructions)]
        for item in self.input:
            if isinstance(item, InputMessage):
                messages.append(ChatMessage(role=item.role, content=item.text))
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                            content=_joined(item.output)))
            else:
                call = ToolCall(id=item.call_id, function=FunctionCall(
                    name=item.name, arguments=item.arguments))
                last = messages[-1] if messages else None
                if last is not None and last.role == "assistant":
                    last.tool_calls = [*(last.tool_calls or ()), call]
                else:
                    messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        choice = self.tool_choice
        return ChatCompletionRequest(
            messages=messages, tool_choice=NamedToolChoice(
                type="function", function=NamedFunction(name=choice.name))
            if isinstance(choice, FunctionChoice) else choice,
            tools=[Tool(type="function", function=FunctionDefinition.model_validate(
                t.model_dump(exclude={"type"}))) for t in self.tools or ()
                if isinstance(t, FunctionTool)] or None)

    def texts(self) -> list[tuple[str, str]]:
        """(parameter, text) of every text the request renders, for the Unicode check."""
        out = [] if self.instructions is None else [("instructions", self.instructions)]
        for i, item in enumerate(self.input):
            if isinstance(item, InputMessage):
                out.append((f"input.{i}.content", item.text))
            elif isinstance(item, FunctionCallItem):
                out.append((f"input.{i}.arguments", item.arguments))
            else:
                out.append((f"input.{i}.output", _joined(item.output)))
        return out


@dataclass
class _Open:
    """The output item being written: a message's text, or a call's arguments."""

    kind: Literal["message", "function_call"]
    id: str
    text: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""


class ResponsesReply(Reply):
    """A ``response`` object, or its stream of typed events (``sse_event_names``).

    The answer's events (text, call starts, arguments; ``tool_format``: parsed as a chat
    answer is) open and fill output items one after another: text opens a ``message`` (or
    goes on in the open one), a call opens a ``function_call``, each closing the item before
    it. A whole body is the same events folded, so a stream and a body agree."""

    prefix = "resp"
    sse_event_names = True

    def __init__(self, model: str, body: ResponsesRequest, tool_format: str | None = None) -> None:
        super().__init__(model)
        self.request = body
        self._parser = parser_for(tool_format) if tool_format else None
        self._items: list[dict[str, Any]] = []  # the closed output items
        self._open: _Open | None = None
        self._sequence = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": []}

    def _item(self, o: _Open, status: str) -> dict[str, Any]:
        text = "".join(o.text)
        if o.kind == "message":
            return {"type": "message", "id": o.id, "status": status, "role": "assistant",
                    "content": [] if status == "in_progress" else [self._part(text)]}
        return {"type": "function_call", "id": o.id, "call_id": o.call_id, "name": o.name,
                "arguments": text, "status": status}

    def _begin(self, o: _Open) -> list[dict[str, Any]]:
        self._open, at = o, len(self._items)
        out = [self._event("response.output_item.added", output_index=at,
                           item=self._item(o, "in_progress"))]
        if o.kind == "message":
            out.append(self._event("response.content_part.added", item_id=o.id, output_index=at,
                                   content_index=0, part=self._part("")))
        return out

    def _end(self, status: str) -> list[dict[str, Any]]:
        o, self._open = self._open, None
        if o is None:
            return []
        at, text, item = len(self._items), "".join(o.text), self._item(o, status)
        self._items.append(item)
        if o.kind == "message":
            out = [self._event("response.output_text.done", item_id=o.id, output_index=at,
                               content_index=0, text=text, logprobs=[]),
                   self._event("response.content_part.done", item_id=o.id, output_index=at,
                               content_index=0, part=self._part(text))]
        else:
            out = [self._event("response.function_call_arguments.done", item_id=o.id,
                               output_index=at, arguments=text)]
        return [*out, self._event("response.output_item.done", output_index=at, item=item)]

    def _events(self, events: Sequence[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, CallStart):
                out += self._end("completed")
                out += self._begin(_Open("function_call", f"fc_{secrets.token_hex(12)}",
                                         call_id=e.id, name=e.name))
                continue
            if not e.text:
                continue
            if isinstance(e, Text) and (self._open is None or self._open.kind != "message"):
                out += self._end("completed")
                out += self._begin(_Open("message", f"msg_{secrets.token_hex(12)}"))
            o = self._open
            assert o is not None and (o.kind == "message") == isinstance(e, Text)
            o.text.append(e.text)
            at = len(self._items)
            if isinstance(e, CallArgs):
                out.append(self._event("response.function_call_arguments.delta", item_id=o.id,
                                       output_index=at, delta=e.text))
            else:
                out.append(self._event("response.output_text.delta", item_id=o.id,
                                       output_index=at, content_index=0, delta=e.text,
                                       logprobs=[]))
        return out

    def _response(self, status: str, outcomes: Sequence[Outcome] = ()) -> dict[str, Any]:
        r = self.request
        usage = None
        if outcomes:
            total = Outcome.total(outcomes)
            usage = {"input_tokens": total.prompt_tokens,
                     # (what the workers' prefix caches took in is not counted)
                     "input_tokens_details": {"cached_tokens": total.cached_tokens,
                                              "cache_write_tokens": 0},
                     "output_tokens": total.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": total.prompt_tokens + total.completion_tokens}
        tools = [t.model_dump() for t in r.tools or ()]
        choice = r.tool_choice or ("auto" if tools else "none")
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "model": self.model, "output": list(self._items),
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": tools, "text": {"format": {"type": "text"}}, "metadata": r.metadata or {},
            "store": False, "usage": usage, "user": r.user,
        }

    def opening_chunks(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress"))]

    def chunks(self, delta: Delta, index: int = 0) -> list[dict[str, Any]]:
        return self._events(self._parser.feed(delta.text) if self._parser else [Text(delta.text)])

    def final_chunks(self, outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
        status = "incomplete" if outcomes[0].finish_reason == "length" else "completed"
        out = self._events(self._parser.finish() if self._parser else [])
        if not self._items and self._open is None:  # an empty answer: an empty message
            out += self._begin(_Open("message", f"msg_{secrets.token_hex(12)}"))
        out += self._end(status)  # the last item is the one a limit cut short
        return [*out, self._event(f"response.{status}", response=self._response(status, outcomes))]

    def body(self, deltas: Sequence[Sequence[Delta]], outcomes: Sequence[Outcome]) -> dict[str, Any]:
        (ds,) = deltas
        for d in ds:
            self.chunks(d)
        return self.final_chunks(outcomes)[-1]["response"]  # type: ignore[no-any-return]
