"""HTTP errors in OpenAI's shape, and what each Shard protocol error becomes.

Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with a status an OpenAI
client acts on: 400 for the request itself, 401 without a valid key, 404 for an unknown model,
413 for a body over the limit, 429 (with ``Retry-After``) when the workers are full past the
door's wait queue (``shard.api.queue``), 503 when no replica of a hop serves, 504 when the
deadline passed. A worker's error keeps its message (which names the hop), so an operator reads
the cause from the client's side too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.responses import JSONResponse

from shard.pipeline import PipelineError
from shard.rpc.errors import ErrorCode, GrpcStatus, ShardError

from .schemas import ErrorDetail, ErrorResponse

__all__ = ["ApiError", "from_shard_error"]

#: Seconds a client is asked to wait after a 429 (the sessions were all taken, past the queue).
RETRY_AFTER_SECONDS = 1
#: ``ShardError.reason`` of input longer than a session's context (``shard.errors.ContextExceeded``),
#: and of input beyond a session's KV budget (with chain relay: a later hop's smaller context).
CONTEXT_REASON = "CONTEXT_LENGTH_EXCEEDED"
KV_FULL_REASON = "KV_CACHE_FULL"
GRAMMAR_REASON = "INVALID_GRAMMAR"  # (shard.errors.InvalidGrammar)


@dataclass
class ApiError(Exception):
    """An HTTP error response in OpenAI's shape."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    #: What the operator's log gets beyond ``message`` (a worker's full error, with its address;
    #: clients are told which hop, never where it runs).
    detail: str = ""

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, object]:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=detail).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_shard_error(err: ShardError, *, prompt_param: str = "prompt",
                     grammar_param: str = "grammar") -> ApiError:
    """The HTTP error for a worker's (or the pipeline's) error; ``grammar_param``: the request
    field a grammar the last worker could not compile is blamed on."""
    if err.reason == GRAMMAR_REASON:
        cause = err.cause if isinstance(err, PipelineError) else err
        return ApiError(400, cause.message, param=grammar_param, code="invalid_grammar")
    error = _shaped(err, prompt_param)
    if isinstance(err, PipelineError):  # the hop by its place only: its address is for the log
        error.detail, error.message = error.message, f"hop {err.hop_index}: {err.cause.message}"
    return error


def _shaped(err: ShardError, prompt_param: str) -> ApiError:
    retry = {"Retry-After": str(RETRY_AFTER_SECONDS)}
    if err.reason in (CONTEXT_REASON, KV_FULL_REASON):  # KV full: a later hop's smaller context
        return ApiError(400, err.message, param=prompt_param, code="context_length_exceeded")
    if err.code == ErrorCode.INVALID_ARGUMENT:
        return ApiError(400, err.message, code="invalid_argument")
    if err.code == ErrorCode.RESOURCE_EXHAUSTED:
        if not err.retryable:  # it would fail again: not a reason to come back later
            return ApiError(400, err.message, param=prompt_param, code="request_too_large")
        return ApiError(429, err.message, type="rate_limit_error", code="rate_limit_exceeded",
                        headers=retry)
    if err.code == ErrorCode.DEADLINE_EXCEEDED:
        return ApiError(504, err.message, type="timeout_error", code="timeout")
    if err.code in (ErrorCode.UNAUTHENTICATED, ErrorCode.PERMISSION_DENIED):
        # The front door's own credentials were refused: the operator's problem, not the caller's.
        return ApiError(502, err.message, type="server_error", code="upstream_refused")
    if err.grpc_status == GrpcStatus.UNAVAILABLE or err.code in (ErrorCode.SESSION_BUSY, ErrorCode.CANCELLED):
        return ApiError(503, err.message, type="server_error", code="service_unavailable",
                        headers=retry)
    return ApiError(500, err.message, type="server_error", code=err.code.name.lower())
