"""Typed engine errors (also importable as ``shard.engine.errors`` and from ``shard.engine``).

Every failure that crosses the ShardEngine contract is one of these classes, so the transport can
map them to wire status codes with one table and never has to parse messages. Engines never raise
library-specific exceptions (llama.cpp return codes, ctypes errors) past the contract.

A leaf module: it imports nothing from the project, so value types every layer shares
(``shard.layers.LayerRange``) can raise these errors without importing the engine package.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error raised through the engine contract.

    ``code`` is a stable machine-readable name; ``retryable`` says whether repeating the same
    request later can succeed without the caller changing it.
    """

    code: str = "ENGINE_ERROR"
    retryable: bool = False

    def __init__(self, message: str, *, session_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.session_id = session_id


class InvalidInput(EngineError):
    """The request itself is malformed (bad token ids, empty prompt, wrong shape, NaN, ...)."""

    code = "INVALID_INPUT"


class InvalidGrammar(InvalidInput):
    """A constrained decoding's grammar or schema is not one (``GrammarSpec``): the caller's
    door names its grammar parameter."""

    code = "INVALID_GRAMMAR"


class ContextExceeded(InvalidInput):
    """The input would take a session past the per-session context (n_ctx_per_session): no
    budget or retry makes it fit (an HTTP front door answers ``context_length_exceeded``)."""

    code = "CONTEXT_LENGTH_EXCEEDED"


class UnknownSession(EngineError):
    """The session id is not open (never opened, or already released)."""

    code = "UNKNOWN_SESSION"


class IllegalTransition(EngineError):
    """The operation is not allowed in the session's or engine's current state."""

    code = "ILLEGAL_TRANSITION"


class SessionBusy(IllegalTransition):
    """Another operation is already running on this session; operations never interleave."""

    code = "SESSION_BUSY"
    retryable = True


class SessionExists(IllegalTransition):
    """``open_session`` was called with an id that is already open."""

    code = "SESSION_EXISTS"


class ResourcesExhausted(EngineError):
    """A capacity limit was hit; the request may succeed once resources are freed."""

    code = "RESOURCES_EXHAUSTED"
    retryable = True


class KvCacheFull(ResourcesExhausted):
    """No KV cells are left for this session (its budget or the context is full).

    Not retryable: a session's budget is fixed, so the same request can never fit; the caller
    must release positions (prefill at an earlier position) or open a larger session.
    """

    code = "KV_CACHE_FULL"
    retryable = False


class TooManySessions(ResourcesExhausted):
    """``max_sessions`` sessions are already open."""

    code = "TOO_MANY_SESSIONS"


class EngineCancelled(EngineError):
    """The operation was stopped by ``cancel(session_id)`` (or ``release``) before it finished."""

    code = "CANCELLED"
    retryable = True


class StepTimeout(EngineCancelled):
    """The step's own timeout (``step_timeout`` of the request) passed before its result was
    computed. Rolled back like any cancelled step; a result computed in time is never dropped."""

    code = "STEP_TIMEOUT"
    retryable = True


class UnsupportedFeature(EngineError):
    """The request asks for a feature this engine or shard does not provide (fail closed)."""

    code = "UNSUPPORTED_FEATURE"


class EngineFailure(EngineError):
    """The engine hit an unrecoverable fault; it is FAILED and refuses all later work."""

    code = "ENGINE_FAILURE"


class IncompatibleState(EngineError):
    """A session state exported by another engine does not fit this one (another KV layout, a
    state llama.cpp would not read): the session stays empty, and the caller recomputes the
    history instead (session hand-off falls back to replay)."""

    code = "INCOMPATIBLE_STATE"


class NotReady(EngineError):
    """The engine is not loaded yet, or already closed."""

    code = "NOT_READY"
    retryable = True


__all__ = [
    "ContextExceeded",
    "EngineCancelled",
    "EngineError",
    "EngineFailure",
    "IllegalTransition",
    "IncompatibleState",
    "InvalidGrammar",
    "InvalidInput",
    "KvCacheFull",
    "NotReady",
    "ResourcesExhausted",
    "SessionBusy",
    "SessionExists",
    "StepTimeout",
    "TooManySessions",
    "UnknownSession",
    "UnsupportedFeature",
]
