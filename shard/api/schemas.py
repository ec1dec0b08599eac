"""The OpenAI-compatible request and response bodies, as Pydantic models.

Requests are strict (``extra="forbid"``): a parameter the front door does not know is refused
with a 400 naming it, never silently ignored, and so is a known one the engine cannot honour
(``unsupported``: penalties, ``logit_bias``, tools, ``echo``, ...). Responses
are built from the same models so that their shape is written down once.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "MAX_CHOICES",
    "MAX_STOPS",
    "MAX_STOP_CHARS",
    "MAX_TOP_LOGPROBS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "GenerationRequest",
]

#: OpenAI's limits: at most 4 stop sequences, at most 20 alternatives per token.
MAX_STOPS = 4
MAX_TOP_LOGPROBS = 20
#: The most choices of one request (``n``, ``best_of``): each takes a session on every hop.
MAX_CHOICES = 8
#: Characters in one stop sequence. Text that may start a stop sequence is held back and looked
#: at again with every token (``shard.api.text``): a stop as long as the whole output (the
#: output itself and one more character) held all of it back, the others being checked against
#: ever more text. Bounded, a token's look costs at most about a millisecond.
MAX_STOP_CHARS = 1024
_U64 = 2**64


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class GenerationRequest(_Strict):
    """What both endpoints take."""

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    #: Choices of the prompt, prefilled once and forked (``shard.pipeline.choices``).
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    #: Any 64-bit value; a negative one is taken modulo 2**64 (some clients send -1).
    seed: int | None = Field(None, ge=-(2**63), lt=_U64)
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    #: llama-server's parameter: a GBNF grammar every generated token keeps to.
    grammar: str | None = None

    def constraint(self) -> tuple[str, str, str] | None:
        """(grammar kind, text, the parameter it came from) of a constrained generation."""
        return ("gbnf", self.grammar, "grammar") if self.grammar else None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("a stop sequence must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence may hold at most {MAX_STOP_CHARS} characters")
        return value

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, why) for a parameter given that the engine cannot honour, None if none."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                return name, f"{name} is not supported (the engine applies no penalties)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options needs stream: true"
        return None


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # null: 16 too
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    #: Choices generated, of which the ``n`` with the highest summed log-probability return.
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.best_of is not None and self.best_of < (self.n or 1):
            return "best_of", "best_of must be at least n"
        if self.stream and self.best_of is not None and self.best_of > (self.n or 1):
            return "best_of", "best_of above n cannot be streamed (the best are known at the end)"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        p = self.prompt
        if isinstance(p, list) and len(p) > 1 and not isinstance(p[0], int):
            return "prompt", "one prompt per request (a list of prompts is not supported)"
        return super().unsupported()

    @property
    def single_prompt(self) -> str | list[int]:
        """The one prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return p[0]  # type: ignore[return-value]
        return p  # type: ignore[return-value]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # What the openai SDK puts in an assistant message it returned, when a client sends it back
    # in the history: taken when empty (tool calls are refused, ``unsupported``).
    refusal: str | None = None
    tool_calls: list[Any] | None = None
    annotations: list[Any] | None = None

    def for_template(self) -> dict[str, str]:
        """The message as a chat template reads it (``developer`` is OpenAI's newer name for
        the system role, which templates know)."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text}
        if self.name is not None:
            out["name"] = self.name
        return out

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(_Strict):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    #: Accepted; the schema is kept to either way (every token is masked to it).
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> tuple[str, str] | None:
        for i, m in enumerate(self.messages):
            if m.tool_calls:
                return f"messages.{i}.tool_calls", "tool calls are not supported"
        if self.tools:
            return "tools", "tools (function calling) are not supported"
        if self.tool_choice not in (None, "none"):
            return "tool_choice", "tool_choice is not supported"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema" and (
                fmt.json_schema is None or fmt.json_schema.schema_ is None):
            return "response_format", "response_format json_schema needs json_schema.schema"
        if self.grammar and fmt is not None and fmt.type != "text":
            return "grammar", "give either grammar or a JSON response_format, not both"
        return super().unsupported()

    def constraint(self) -> tuple[str, str, str] | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return super().constraint()
        if fmt.type == "json_object":
            return "json_object", "", "response_format"
        assert fmt.json_schema is not None and fmt.json_schema.schema_ is not None
        return "json_schema", json.dumps(fmt.json_schema.schema_), "response_format"

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses ---------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    #: Prompt tokens taken from the workers' prefix cache rather than computed.
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "trio-shard"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
