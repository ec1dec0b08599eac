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

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        raise NotImplementedError

    @staticmethod
    def by_choice(deltas: Sequence[Delta], outcome: Outcome) -> list[tuple[list[Delta], str]]:
        """Each returned choice's deltas and finish reason, by index (``n`` choices)."""
        reasons = outcome.finish_reasons or (outcome.finish_reason,)
        return [([d for d in deltas if d.index == i], reason) for i, reason in enumerate(reasons)]

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

    def _choice(self, deltas: Sequence[Delta], finish: str | None, index: int,
                logprobs: bool = True) -> s.CompletionChoice:
        return s.CompletionChoice(index=index, text="".join(d.text for d in deltas),
                                  logprobs=self._logprobs(deltas) if logprobs else None,
                                  finish_reason=finish)  # type: ignore[arg-type]

    def _completion(self, choices: list[s.CompletionChoice], usage: s.Usage | None) -> dict[str, Any]:
        return s.Completion(id=self.id, created=self.created, model=self.model, choices=choices,
                            usage=usage).model_dump()

    def _streamed(self, body: dict[str, Any]) -> dict[str, Any]:
        if not self.include_usage:
            del body["usage"]  # a stream's chunks carry it (null) only when asked to
        return body

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        return self._streamed(self._completion([self._choice([delta], None, delta.index)], None))

    def final_chunks(self, outcome: Outcome) -> list[dict[str, Any]]:
        chunks = [self._streamed(self._completion([self._choice([], reason, i, logprobs=False)], None))
                  for i, (_, reason) in enumerate(self.by_choice((), outcome))]
        if self.include_usage:
            last = s.Completion(id=self.id, created=self.created, model=self.model, choices=[],
                                usage=_usage(outcome))
            chunks.append(last.model_dump())
        return chunks

    def body(self, deltas: Sequence[Delta], outcome: Outcome) -> dict[str, Any]:
        return self._completion([self._choice(mine, reason, i) for i, (mine, reason)
                                 in enumerate(self.by_choice(deltas, outcome))], _usage(outcome))


class ChatReply(Reply):
    prefix = "chatcmpl"

    def __init__(self, model: str, *, logprobs: bool, include_usage: bool = False) -> None:
        super().__init__(model, include_usage=include_usage)
        self.logprobs = logprobs
        self._opened: set[int] = set()  # the choices whose role was sent

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
                                      choices=[choice])
        body = chunk.model_dump()
        body["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        if not self.include_usage:
            del body["usage"]
        return body

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        role = None if delta.index in self._opened else "assistant"
        self._opened.add(delta.index)
        return self._chunk(s.ChatDelta(role=role, content=delta.text), self._logprobs([delta]), None,
                           delta.index)

    def final_chunks(self, outcome: Outcome) -> list[dict[str, Any]]:
        chunks = []
        for i, (_, reason) in enumerate(self.by_choice((), outcome)):
            if i not in self._opened:  # no text at all: the role still opens the message
                chunks.append(self.chunk(Delta(index=i)))
            chunks.append(self._chunk(s.ChatDelta(), None, reason, i))
        if self.include_usage:
            last = s.ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                         choices=[], usage=_usage(outcome))
            chunks.append(last.model_dump())
        return [c for c in chunks if c is not None]

    def body(self, deltas: Sequence[Delta], outcome: Outcome) -> dict[str, Any]:
        choices = [s.ChatChoice(
            index=i, message=s.AssistantMessage(content="".join(d.text for d in mine)),
            logprobs=self._logprobs(mine), finish_reason=reason,  # type: ignore[arg-type]
        ) for i, (mine, reason) in enumerate(self.by_choice(deltas, outcome))]
        return s.ChatCompletion(id=self.id, created=self.created, model=self.model,
                                choices=choices, usage=_usage(outcome)).model_dump()
