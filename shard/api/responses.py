"""OpenAI's Responses API (``POST /v1/responses``), text in and text out, through the chat path.

Why a minimal one: newer SDK examples and agents call ``client.responses.create`` first. The
request's ``instructions`` and ``input`` (a text, or messages of text parts) become a chat
conversation rendered with the model's template, generated as a chat completion is; the reply
is a ``response`` object with one assistant ``message`` of ``output_text``, or, streamed, the
typed events (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``) each named in its ``event:`` line. Tools, reasoning, stored responses
(``previous_response_id``, ``store: true``) and structured output are refused (400 naming the
parameter), never ignored.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .backend import Outcome
from .replies import Reply
from .text import Delta

__all__ = ["ResponsesReply", "ResponsesRequest"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputText(_Strict):
    # ``output_text``: an earlier response's text a client sends back in the history
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None


class InputMessage(_Strict):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]
    # what an earlier response's output item carries when a client sends it back
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class TextFormat(_Strict):
    type: Literal["text"]


class TextOptions(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(_Strict):
    """``POST /v1/responses``: what a text-in, text-out response takes."""

    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    text: TextOptions | None = None
    parallel_tool_calls: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.store:
            return "store", "responses are not stored (store: true is not supported)"
        if self.tools:
            return "tools", "tools (function calling) are not supported"
        if self.tool_choice not in (None, "none"):
            return "tool_choice", "tool_choice is not supported"
        return None

    def messages(self) -> list[dict[str, str]]:
        """The conversation as a chat template reads it (``developer`` is ``system``)."""
        out = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        return [*out, *({"role": "system" if m.role == "developer" else m.role, "content": m.text}
                         for m in self.input)]


class ResponsesReply(Reply):
    """A ``response`` object, or its stream of typed events (``sse_event_names``)."""

    prefix = "resp"
    sse_event_names = True

    def __init__(self, model: str, body: ResponsesRequest) -> None:
        super().__init__(model)
        self.request = body
        self.item_id = f"msg_{secrets.token_hex(12)}"
        self._text: list[str] = []
        self._sequence = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": []}

    def _item(self, text: str, status: str) -> dict[str, Any]:
        content = [self._part(text)] if status != "in_progress" else []
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": content}

    def _response(self, status: str, output: list[dict[str, Any]],
                  outcomes: Sequence[Outcome] = ()) -> dict[str, Any]:
        r = self.request
        usage = None
        if outcomes:
            total = Outcome.total(outcomes)
            usage = {"input_tokens": total.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": total.cached_tokens},
                     "output_tokens": total.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": total.prompt_tokens + total.completion_tokens}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "model": self.model, "output": output, "parallel_tool_calls": False,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "top_p": 1.0 if r.top_p is None else r.top_p, "tool_choice": "none", "tools": [],
            "text": {"format": {"type": "text"}}, "metadata": r.metadata or {}, "store": False,
            "usage": usage, "user": r.user,
        }

    @staticmethod
    def _status(outcomes: Sequence[Outcome]) -> str:
        return "incomplete" if outcomes[0].finish_reason == "length" else "completed"

    def opening_chunks(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self._response("in_progress", [])),
            self._event("response.in_progress", response=self._response("in_progress", [])),
            self._event("response.output_item.added", output_index=0,
                        item=self._item("", "in_progress")),
            self._event("response.content_part.added", item_id=self.item_id, output_index=0,
                        content_index=0, part=self._part("")),
        ]

    def chunk(self, delta: Delta, index: int = 0) -> dict[str, Any] | None:
        self._text.append(delta.text)
        return self._event("response.output_text.delta", item_id=self.item_id, output_index=0,
                           content_index=0, delta=delta.text, logprobs=[])

    def final_chunks(self, outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
        text, status = "".join(self._text), self._status(outcomes)
        item = self._item(text, status)
        return [
            self._event("response.output_text.done", item_id=self.item_id, output_index=0,
                        content_index=0, text=text, logprobs=[]),
            self._event("response.content_part.done", item_id=self.item_id, output_index=0,
                        content_index=0, part=self._part(text)),
            self._event("response.output_item.done", output_index=0, item=item),
            self._event(f"response.{status}",
                        response=self._response(status, [item], outcomes)),
        ]

    def body(self, deltas: Sequence[Sequence[Delta]], outcomes: Sequence[Outcome]) -> dict[str, Any]:
        (ds,) = deltas
        status = self._status(outcomes)
        text = "".join(d.text for d in ds)
        return self._response(status, [self._item(text, status)], outcomes)
