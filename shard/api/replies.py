"""One generation's reply in each endpoint's shape: the whole body, or server-sent event chunks.

``CompletionReply`` (``/v1/completions``, legacy log-probs: tokens, token_logprobs,
top_logprobs, text_offset) and ``ChatReply`` (``/v1/chat/completions``: an assistant message,
log-probs as ``content`` entries with bytes) take the same ``Delta`` stream and ``Outcome``, so
the generation code does not know which endpoint it serves. A chat stream opens with the role
alone (as OpenAI's); a completion with several prompts has one choice per prompt (``index``).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Sequence
from typing import Any

from shard import __version__

from . import schemas as s
from .backend import Outcome
from .text import Delta
from .tool_parsers import CallArgs, CallStart, Event, Text, parse, parser_for

__all__ = ["ChatReply", "CompletionReply", "Reply", "choice_reasons", "system_fingerprint"]


def system_fingerprint(model_fingerprint: str) -> str:
    """OpenAI's ``system_fingerprint``: what served a reply, so a client sees when the same
    seed may give other tokens. ``fp_`` and 12 hex digits of SHA-256 over this package's version
    and the model's fingerprint (its GGUF's): a new model or a new door changes it."""
    digest = hashlib.sha256(f"trio-shard {__version__} {model_fingerprint}".encode()).hexdigest()
    return f"fp_{digest[:12]}"


def _usage(outcomes: Sequence[Outcome]) -> s.Usage:
    """Every choice's tokens added up (several prompts: one generation each)."""
    total = Outcome.total(outcomes)
    return s.Usage(prompt_tokens=total.prompt_tokens, completion_tokens=total.completion_tokens,
                   total_tokens=total.prompt_tokens + total.completion_tokens,
                   prompt_tokens_details=s.PromptTokensDetails(cached_tokens=total.cached_tokens))


def choice_reasons(outcomes: Sequence[Outcome]) -> list[str]:
    """Every returned choice's finish reason, in index order: each generation's (a prompt's)
    choices one after the other (several prompts, each with ``n`` choices)."""
    return [r for o in outcomes for r in (o.finish_reasons or (o.finish_reason,))]


class Reply:
    """What both endpoints share: the id, the creation time, the model, the fingerprint, usage
    in the stream. Deltas come with their choice's index (several prompts: several choices)."""

    prefix = ""
    #: Each stream event also named in an ``event:`` line (its ``type``), as the Responses API.
    sse_event_names = False

    def __init__(self, model: str, *, fingerprint: str | None = None,
                 include_usage: bool = False) -> None:
        self.id = f"{self.prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self.include_usage = include_usage

    def opening_chunks(self) -> list[dict[str, Any]]:
        """What a stream sends before any generated text."""
        return []

    def chunk(self, delta: Delta, index: int = 0) -> dict[str, Any] | None:
        raise NotImplementedError

    def chunks(self, delta: Delta, index: int = 0) -> list[dict[str, Any]]:
        """What a stream sends for one delta (none, one chunk, or several events)."""
        chunk = self.chunk(delta, index)
        return [] if chunk is None else [chunk]

    def final_chunks(self, outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def body(self, deltas: Sequence[Sequence[Delta]], outcomes: Sequence[Outcome]) -> dict[str, Any]:
        """The whole reply: ``deltas[i]`` are choice ``i``'s, ``outcomes`` each generation's
        (``choice_reasons``)."""
        raise NotImplementedError


class CompletionReply(Reply):
    prefix = "cmpl"

    def __init__(self, model: str, *, logprobs: int | None, fingerprint: str | None = None,
                 include_usage: bool = False, echo: Sequence[str] = ()) -> None:
        super().__init__(model, fingerprint=fingerprint, include_usage=include_usage)
        self.logprobs = logprobs
        self.echo = echo  # each choice's prompt text, sent before its completion (``echo``)

    def _logprobs(self, deltas: Sequence[Delta]) -> s.CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        tokens = [t for d in deltas for t in d.tokens]
        offsets = [o for d in deltas for o in d.offsets]
        return s.CompletionLogprobs(
            tokens=[t.text for t in tokens], token_logprobs=[t.logprob for t in tokens],
            top_logprobs=[None if t.logprob is None else {a.text: a.logprob for a in t.top}
                          for t in tokens] if self.logprobs else None,
            text_offset=offsets,
        )

    def _completion(self, choices: list[s.CompletionChoice], usage: s.Usage | None) -> dict[str, Any]:
        return s.Completion(id=self.id, created=self.created, model=self.model, choices=choices,
                            usage=usage, system_fingerprint=self.fingerprint).model_dump()

    def _streamed(self, index: int, text: str, logprobs: s.CompletionLogprobs | None,
                  finish: str | None) -> dict[str, Any]:
        body = self._completion([s.CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                    finish_reason=finish)], None)  # type: ignore[arg-type]
        if not self.include_usage:
            del body["usage"]  # a stream's chunks carry it (null) only when asked to
        return body

    def opening_chunks(self) -> list[dict[str, Any]]:
        return [self._streamed(i, text, None, None) for i, text in enumerate(self.echo)]

    def chunk(self, delta: Delta, index: int = 0) -> dict[str, Any] | None:
        return self._streamed(index, delta.text, self._logprobs([delta]), None)

    def final_chunks(self, outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
        chunks = [self._streamed(i, "", None, r) for i, r in enumerate(choice_reasons(outcomes))]
        if self.include_usage:
            chunks.append(self._completion([], _usage(outcomes)))
        return chunks

    def body(self, deltas: Sequence[Sequence[Delta]], outcomes: Sequence[Outcome]) -> dict[str, Any]:
        choices = [s.CompletionChoice(
            index=i, text=(self.echo[i] if self.echo else "") + "".join(d.text for d in ds),
            logprobs=self._logprobs(ds), finish_reason=r,  # type: ignore[arg-type]
        ) for i, (ds, r) in enumerate(zip(deltas, choice_reasons(outcomes), strict=True))]
        return self._completion(choices, _usage(outcomes))


class ChatReply(Reply):
    """``tool_format``: the call format each answer is parsed in (``shard.api.tool_parsers``;
    one parser per choice); None: the answers are text. ``n``: the choices (``index`` 0..n-1)."""

    prefix = "chatcmpl"

    def __init__(self, model: str, *, logprobs: bool, fingerprint: str | None = None,
                 include_usage: bool = False, tool_format: str | None = None, n: int = 1) -> None:
        super().__init__(model, fingerprint=fingerprint, include_usage=include_usage)
        self.logprobs = logprobs
        self.tool_format = tool_format
        self.n = n
        self._parsers = [parser_for(tool_format) for _ in range(n)] if tool_format else None

    def _logprobs(self, deltas: Sequence[Delta]) -> s.ChatLogprobs | None:
        if not self.logprobs:
            return None
        return s.ChatLogprobs(content=[
            s.TokenLogprob(token=t.text, logprob=t.logprob, bytes=list(t.piece), top_logprobs=[
                s.TopLogprob(token=a.text, logprob=a.logprob, bytes=list(a.piece)) for a in t.top])
            for d in deltas for t in d.tokens
        ])

    def _chunk(self, delta: s.ChatDelta, logprobs: s.ChatLogprobs | None,
               finish: str | None, index: int = 0) -> dict[str, Any]:
        choice = s.ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                   finish_reason=finish)  # type: ignore[arg-type]
        chunk = s.ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                      choices=[choice], system_fingerprint=self.fingerprint)
        body = chunk.model_dump()
        body["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        if not self.include_usage:
            del body["usage"]
        return body

    def _events_chunk(self, events: Sequence[Event], delta: Delta,
                      index: int) -> dict[str, Any] | None:
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
        if not (content or calls or delta.tokens):
            return None
        return self._chunk(s.ChatDelta(content=content or None,
                                       tool_calls=list(calls.values()) or None),
                           self._logprobs([delta]), None, index)

    def opening_chunks(self) -> list[dict[str, Any]]:
        """Each choice's role alone, as OpenAI's first chunks: with empty content, or with none
        where the answer may be a tool call (a message that only calls has ``content: null``)."""
        content = None if self._parsers is not None else ""
        return [self._chunk(s.ChatDelta(role="assistant", content=content), None, None, i)
                for i in range(self.n)]

    def chunk(self, delta: Delta, index: int = 0) -> dict[str, Any] | None:
        if self._parsers is not None:
            return self._events_chunk(self._parsers[index].feed(delta.text), delta, index)
        return self._chunk(s.ChatDelta(content=delta.text), self._logprobs([delta]), None, index)

    @staticmethod
    def _reason(reason: str, calls: int) -> str:
        """``tool_calls`` when the answer called (and was not cut short)."""
        return "tool_calls" if calls and reason != "length" else reason

    def final_chunks(self, outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
        chunks: list[dict[str, Any] | None] = []
        for i, reason in enumerate(choice_reasons(outcomes)):
            calls = 0
            if self._parsers is not None:
                parser = self._parsers[i]
                rest = parser.finish()
                calls = parser.calls
                if rest:
                    chunks.append(self._events_chunk(rest, Delta(), i))
            chunks.append(self._chunk(s.ChatDelta(), None, self._reason(reason, calls), i))
        if self.include_usage:
            last = s.ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                         choices=[], usage=_usage(outcomes),
                                         system_fingerprint=self.fingerprint)
            chunks.append(last.model_dump())
        return [c for c in chunks if c is not None]

    def _choice(self, index: int, ds: Sequence[Delta], reason: str) -> s.ChatChoice:
        text = "".join(d.text for d in ds)
        content: str | None = text
        tool_calls = None
        if self.tool_format:
            parsed = parse(self.tool_format, text)
            tool_calls = [s.ToolCall(id=c.id, function=s.FunctionCall(
                name=c.name, arguments=c.arguments)) for c in parsed.calls] or None
            content = parsed.content if parsed.content or not tool_calls else None
        return s.ChatChoice(
            index=index, message=s.AssistantMessage(content=content, tool_calls=tool_calls),
            logprobs=self._logprobs(ds),
            finish_reason=self._reason(reason, len(tool_calls or ())),  # type: ignore[arg-type]
        )

    def body(self, deltas: Sequence[Sequence[Delta]], outcomes: Sequence[Outcome]) -> dict[str, Any]:
        choices = [self._choice(i, ds, r)
                   for i, (ds, r) in enumerate(zip(deltas, choice_reasons(outcomes), strict=True))]
        body = s.ChatCompletion(id=self.id, created=self.created, model=self.model,
                                choices=choices, usage=_usage(outcomes),
                                system_fingerprint=self.fingerprint).model_dump()
        for choice, dumped in zip(choices, body["choices"], strict=True):
            if choice.message.tool_calls is None:
                del dumped["message"]["tool_calls"]
        return body
