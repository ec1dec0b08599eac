"""One generation's reply in each endpoint's shape: the whole body, or server-sent event chunks.

``CompletionReply`` (``/v1/completions``, legacy log-probs: tokens, token_logprobs,
top_logprobs, text_offset) and ``ChatReply`` (``/v1/chat/completions``: an assistant message,
log-probs as ``content`` entries with bytes) take the same ``Delta`` stream and ``Outcome``, so
the generation code does not know which endpoint it serves.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any

from . import schemas as s
from .backend import Outcome
from .text import Delta
from .tool_parsers import CallArgs, CallStart, Event, Text, parse, parser_for

__all__ = ["ChatReply", "CompletionReply", "Reply"]


def _usage(outcome: Outcome) -> s.Usage:
    return s.Usage(prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens,
                   total_tokens=outcome.prompt_tokens + outcome.completion_tokens,
                   prompt_tokens_details=s.PromptTokensDetails(cached_tokens=outcome.cached_tokens))


class Reply:
    """What both endpoints share: the id, the creation time, the model, usage in the stream."""

    prefix = ""

    def __init__(self, model: str, *, include_usage: bool = False) -> None:
        self.id = f"{self.prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self._started = False

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        raise NotImplementedError

    def final_chunks(self, outcome: Outcome) -> list[dict[str, Any]]:
        raise NotImplementedError

    def body(self, deltas: Sequence[Delta], outcome: Outcome) -> dict[str, Any]:
        raise NotImplementedError


class CompletionReply(Reply):
    prefix = "cmpl"

    def __init__(self, model: str, *, logprobs: int | None, include_usage: bool = False) -> None:
        super().__init__(model, include_usage=include_usage)
        self.logprobs = logprobs

    def _logprobs(self, deltas: Sequence[Delta]) -> s.CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        tokens = [t for d in deltas for t in d.tokens]
        offsets = [o for d in deltas for o in d.offsets]
        return s.CompletionLogprobs(
            tokens=[t.text for t in tokens], token_logprobs=[t.logprob for t in tokens],
            top_logprobs=[{a.text: a.logprob for a in t.top} for t in tokens] if self.logprobs else None,
            text_offset=offsets,
        )

    def _completion(self, text: str, logprobs: s.CompletionLogprobs | None, finish: str | None,
                    usage: s.Usage | None) -> dict[str, Any]:
        choice = s.CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish)  # type: ignore[arg-type]
        return s.Completion(id=self.id, created=self.created, model=self.model, choices=[choice],
                            usage=usage).model_dump()

    def _streamed(self, body: dict[str, Any]) -> dict[str, Any]:
        if not self.include_usage:
            del body["usage"]  # a stream's chunks carry it (null) only when asked to
        return body

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        return self._streamed(self._completion(delta.text, self._logprobs([delta]), None, None))

    def final_chunks(self, outcome: Outcome) -> list[dict[str, Any]]:
        chunks = [self._streamed(self._completion("", None, outcome.finish_reason, None))]
        if self.include_usage:
            last = s.Completion(id=self.id, created=self.created, model=self.model, choices=[],
                                usage=_usage(outcome))
            chunks.append(last.model_dump())
        return chunks

    def body(self, deltas: Sequence[Delta], outcome: Outcome) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        return self._completion(text, self._logprobs(deltas), outcome.finish_reason, _usage(outcome))


class ChatReply(Reply):
    """``tool_format``: the call format the answer is parsed in (``shard.api.tool_parsers``);
    None: the answer is text."""

    prefix = "chatcmpl"

    def __init__(self, model: str, *, logprobs: bool, include_usage: bool = False,
                 tool_format: str | None = None) -> None:
        super().__init__(model, include_usage=include_usage)
        self.logprobs = logprobs
        self.tool_format = tool_format
        self._parser = parser_for(tool_format) if tool_format else None

    def _logprobs(self, deltas: Sequence[Delta]) -> s.ChatLogprobs | None:
        if not self.logprobs:
            return None
        return s.ChatLogprobs(content=[
            s.TokenLogprob(token=t.text, logprob=t.logprob, bytes=list(t.piece), top_logprobs=[
                s.TopLogprob(token=a.text, logprob=a.logprob, bytes=list(a.piece)) for a in t.top])
            for d in deltas for t in d.tokens
        ])

    def _chunk(self, delta: s.ChatDelta, logprobs: s.ChatLogprobs | None,
               finish: str | None) -> dict[str, Any]:
        choice = s.ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish)  # type: ignore[arg-type]
        chunk = s.ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                      choices=[choice])
        body = chunk.model_dump()
        body["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        if not self.include_usage:
            del body["usage"]
        return body

    def _events_chunk(self, events: Sequence[Event], delta: Delta) -> dict[str, Any] | None:
        """A chunk of parsed text and call pieces (None: nothing to send yet)."""
        content = "".join(e.text for e in events if isinstance(e, Text))
        calls: dict[int, dict[str, Any]] = {}
        for e in events:
            if isinstance(e, CallStart):
                calls[e.index] = {"index": e.index, "id": e.id, "type": "function",
                                  "function": {"name": e.name, "arguments": ""}}
            elif isinstance(e, CallArgs):
                entry = calls.setdefault(e.index, {"index": e.index, "function": {"arguments": ""}})
                entry["function"]["arguments"] += e.text
        if not (content or calls or delta.tokens or not self._started):
            return None
        role = None if self._started else "assistant"
        self._started = True
        return self._chunk(s.ChatDelta(role=role, content=content or None,
                                       tool_calls=list(calls.values()) or None),
                           self._logprobs([delta]), None)

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        if self._parser is not None:
            return self._events_chunk(self._parser.feed(delta.text), delta)
        role = None if self._started else "assistant"
        self._started = True
        return self._chunk(s.ChatDelta(role=role, content=delta.text), self._logprobs([delta]), None)

    @staticmethod
    def _reason(outcome: Outcome, calls: int) -> str:
        """``tool_calls`` when the answer called (and was not cut short)."""
        return "tool_calls" if calls and outcome.finish_reason != "length" else outcome.finish_reason

    def final_chunks(self, outcome: Outcome) -> list[dict[str, Any]]:
        chunks: list[dict[str, Any] | None] = []
        calls = 0
        if self._parser is not None:
            rest = self._parser.finish()
            calls = self._parser.calls
            if rest or not self._started:
                chunks.append(self._events_chunk(rest, Delta()))
        elif not self._started:  # no text at all: the role still opens the message
            chunks.append(self.chunk(Delta()))
        chunks.append(self._chunk(s.ChatDelta(), None, self._reason(outcome, calls)))
        if self.include_usage:
            last = s.ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                         choices=[], usage=_usage(outcome))
            chunks.append(last.model_dump())
        return [c for c in chunks if c is not None]

    def body(self, deltas: Sequence[Delta], outcome: Outcome) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        content: str | None = text
        tool_calls = None
        if self.tool_format:
            parsed = parse(self.tool_format, text)
            tool_calls = [s.ToolCall(id=c.id, function=s.FunctionCall(
                name=c.name, arguments=c.arguments)) for c in parsed.calls] or None
            content = parsed.content if parsed.content or not tool_calls else None
        choice = s.ChatChoice(
            message=s.AssistantMessage(content=content, tool_calls=tool_calls),
            logprobs=self._logprobs(deltas),
            finish_reason=self._reason(outcome, len(tool_calls or ())),  # type: ignore[arg-type]
        )
        body = s.ChatCompletion(id=self.id, created=self.created, model=self.model,
                                choices=[choice], usage=_usage(outcome)).model_dump()
        if tool_calls is None:
            del body["choices"][0]["message"]["tool_calls"]
        return body
