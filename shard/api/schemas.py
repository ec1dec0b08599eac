"""The OpenAI-compatible request and response bodies, as Pydantic models.

Requests are strict (``extra="forbid"``): a parameter the front door does not know is refused
with a 400 naming it, never silently ignored, and so is a known one the engine cannot honour
(``unsupported``: ``suffix``, ...). Responses
are built from the same models so that their shape is written down once.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "MAX_PROMPTS",
    "MAX_CHOICES",
    "MAX_STOPS",
    "MAX_STOP_CHARS",
    "MAX_TOP_LOGPROBS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "EmbeddingRequest",
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
#: Prompts in one completions request: each is a generation of its own, run at once, so a
#: request of many would take every session and fill the queue by itself.
MAX_PROMPTS = 16
_U64 = 2**64


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class GenerationRequest(_Strict):
    """What both endpoints take."""

    model: str | None = None  # None: the one model served (as llama-server and Ollama)
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
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    #: Token id (a decimal string, as OpenAI's) -> bias in [-100, 100]; ids are checked
    #: against the vocabulary by the door (``shard.api.app``).
    logit_bias: dict[str, float] | None = None
    #: llama-server's parameter: a GBNF grammar every generated token keeps to.
    grammar: str | None = None

    def constraint(self) -> tuple[str, str, str] | None:
        """(grammar kind, text, the parameter it came from) of a constrained generation."""
        return ("gbnf", self.grammar, "grammar") if self.grammar else None
    # llama-server's extensions (llama.cpp's samplers, as the workers apply them).
    top_k: int | None = Field(None, ge=0, lt=2**31)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, ge=1e-6, le=1e6)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdecimal() or not key.isascii():
                raise ValueError(f"{key!r} is not a token id")
            if not -100 <= bias <= 100:
                raise ValueError(f"the bias of token {key} must be in [-100, 100]")
        return value

    @property
    def token_biases(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

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
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options needs stream: true"
        return None


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    #: null: 16 too; 0 (with echo and logprobs): the prompt's log-probs alone.
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    #: Choices generated, of which the ``n`` with the highest summed log-probability return.
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo_logprobs:
            return "max_tokens", ("max_tokens 0 is served with echo and logprobs only (the "
                                  "prompt's log-probs, nothing generated)")
        if self.echo and not self.echo_logprobs and any(not isinstance(p, str) for p in self.prompts):
            return "echo", ("echo without logprobs needs text prompts (with logprobs the "
                            "prompt's tokens are echoed)")
        if self.best_of is not None and self.best_of < (self.n or 1):
            return "best_of", "best_of must be at least n"
        if self.stream and self.best_of is not None and self.best_of > (self.n or 1):
            return "best_of", "best_of above n cannot be streamed (the best are known at the end)"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        if len(self.prompts) > MAX_PROMPTS:
            return "prompt", f"at most {MAX_PROMPTS} prompts per request"
        return super().unsupported()

    @property
    def echo_logprobs(self) -> bool:
        """``echo`` with ``logprobs``: every prompt token comes back first, with its log-prob
        (none for the first) and top alternatives, then the completion's."""
        return bool(self.echo) and self.logprobs is not None

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt (text, or token ids): one choice each."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    #: The arguments as JSON text (as the model wrote them).
    arguments: str
    #: What the openai SDK's stream helper adds to a call it returned, when a client sends
    #: the message back: ignored (``arguments`` is what the template renders).
    parsed_arguments: Any = Field(None, exclude=True)


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    #: What the SDK's stream helper keeps of the deltas, sent back with the message: ignored.
    index: int | None = Field(None, exclude=True)


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # What the openai SDK puts in an assistant message it returned, when a client sends it back
    # in the history (rendered by ``shard.api.tools``).
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    annotations: list[Any] | None = None
    #: A ``tool`` message: the call it answers.
    tool_call_id: str | None = None
    # What the SDK's stream helper puts in the message it accumulated, sent back as is:
    # taken when null (``parsed``: its parse of the content, ignored).
    audio: None = None
    function_call: None = None
    parsed: Any = Field(None, exclude=True)

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


class FunctionDefinition(_Strict):
    #: As OpenAI's: letters, digits, ``_``, ``-`` (and ``.``), at most 64.
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    #: A JSON schema of the arguments (none: the function takes none).
    parameters: dict[str, Any] | None = None
    #: Accepted; a forced call keeps to the schema either way.
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


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
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    #: Accepted: a forced call (``required``, a named function) is one call; ``auto`` parses
    #: every call the model writes.
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> tuple[str, str] | None:
        refused = self._tools_unsupported()
        if refused is not None:
            return refused
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema" and (
                fmt.json_schema is None or fmt.json_schema.schema_ is None):
            return "response_format", "response_format json_schema needs json_schema.schema"
        if self.grammar and fmt is not None and fmt.type != "text":
            return "grammar", "give either grammar or a JSON response_format, not both"
        return super().unsupported()

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in ("none", "auto", "required"):
            raise ValueError("tool_choice must be none, auto, required or a named function")
        return NamedToolChoice.model_validate(value) if isinstance(value, dict) else value

    def _tools_unsupported(self) -> tuple[str, str] | None:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            return "tools", "two tools have the same function name"
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            return "tool_choice", "tool_choice needs tools"
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            return "tool_choice", f"tool_choice names {choice.function.name!r}, not in tools"
        for i, m in enumerate(self.messages):
            if m.role == "tool" and m.tool_call_id is None:
                return f"messages.{i}.tool_call_id", "a tool message needs tool_call_id"
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        fmt = self.response_format
        if forced and (self.grammar or (fmt is not None and fmt.type != "text")):
            return "tool_choice", "a forced tool call and grammar/response_format exclude each other"
        return None

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


class EmbeddingRequest(_Strict):
    """``POST /v1/embeddings`` (``shard.api.embeddings``; docs/api.md). ``user`` is taken and
    ignored, as OpenAI's."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _one_shape(cls, value: Any) -> Any:
        """One of OpenAI's four shapes, checked before the union is tried, so a refusal names
        ``input`` rather than the union member that failed last."""
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(value, str) or ids(value) or (isinstance(value, list) and (
                all(isinstance(x, str) for x in value) or all(ids(x) for x in value))):
            return value
        raise ValueError("must be a string, a list of strings, a list of token ids or a list "
                         "of lists of token ids")

    def unsupported(self) -> tuple[str, str] | None:
        return None


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
    #: (echo) null for the prompt's first token, which nothing precedes.
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
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
    #: The model and the door that served it (``shard.api.replies.system_fingerprint``).
    system_fingerprint: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    #: The model and the door that served it (``shard.api.replies.system_fingerprint``).
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    #: Pieces of calls as the openai SDK accumulates them: ``index``, then ``id``, ``type`` and
    #: ``function.name`` once, ``function.arguments`` in pieces.
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    #: The model and the door that served it (``shard.api.replies.system_fingerprint``).
    system_fingerprint: str | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "trio-shard"
    #: Positions one request may use (a session's context); OpenRouter's and LM Studio's name.
    context_length: int | None = None


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
