"""The Shard error taxonomy: one table from ``ErrorCode`` to gRPC status, retryability and message.

Why one table: the router decides whether to retry, fail over or give up from the error code
alone, so every place that produces an error (version checks, the session state machine, engine
failures, the client library) must agree on what a code means. Engine errors are translated
here, at the boundary, with one mapping (``ENGINE_ERROR_CODES``) instead of message parsing.

On the wire an error travels three times: as the gRPC status (code + message, what any gRPC
client understands), as ``grpc-status-details-bin`` (a ``google.rpc.Status`` with an
``ErrorInfo`` detail: gRPC's richer error model, read by standard clients) and as the trailer
``shard-error-bin`` holding a serialized ``shard.v1.Error`` (code, retryable flag, session id,
engine reason, supported versions). ``retryable`` always agrees with the status
(``STATUS_RETRYABLE``), so a standard retry policy and a Shard-aware router decide alike.
Step-level errors inside a healthy session travel in-stream as ``SessionResponse.error``
instead, and the session stays usable. ``ShardError`` is the single exception type both the
server and the client raise.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from google.protobuf.any_pb2 import Any as AnyProto
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from shard.engine import errors as engine_errors
from shard.v1 import shard_pb2 as pb

ERROR_TRAILER = "shard-error-bin"
STATUS_DETAILS_TRAILER = "grpc-status-details-bin"
ERROR_DOMAIN = "shard.v1"  # google.rpc.ErrorInfo.domain of every Shard error


class GrpcStatus(enum.IntEnum):
    """gRPC status codes (numbering from the gRPC spec; identical in grpcio and purerpc)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class ErrorCode(enum.IntEnum):
    """Mirror of ``shard.v1.ErrorCode`` (same numbers) so callers need not import protobuf."""

    UNSPECIFIED = pb.ERROR_CODE_UNSPECIFIED
    INVALID_ARGUMENT = pb.ERROR_CODE_INVALID_ARGUMENT
    UNSUPPORTED_VERSION = pb.ERROR_CODE_UNSUPPORTED_VERSION
    INCOMPATIBLE_MODEL = pb.ERROR_CODE_INCOMPATIBLE_MODEL
    ILLEGAL_TRANSITION = pb.ERROR_CODE_ILLEGAL_TRANSITION
    SESSION_NOT_FOUND = pb.ERROR_CODE_SESSION_NOT_FOUND
    SESSION_EXISTS = pb.ERROR_CODE_SESSION_EXISTS
    RESOURCE_EXHAUSTED = pb.ERROR_CODE_RESOURCE_EXHAUSTED
    DEADLINE_EXCEEDED = pb.ERROR_CODE_DEADLINE_EXCEEDED
    CANCELLED = pb.ERROR_CODE_CANCELLED
    UNAUTHENTICATED = pb.ERROR_CODE_UNAUTHENTICATED
    PERMISSION_DENIED = pb.ERROR_CODE_PERMISSION_DENIED
    ENGINE_FAILURE = pb.ERROR_CODE_ENGINE_FAILURE
    NOT_READY = pb.ERROR_CODE_NOT_READY
    DRAINING = pb.ERROR_CODE_DRAINING
    INTERNAL = pb.ERROR_CODE_INTERNAL
    UNSUPPORTED_FEATURE = pb.ERROR_CODE_UNSUPPORTED_FEATURE
    SESSION_BUSY = pb.ERROR_CODE_SESSION_BUSY


#: Which retry flag each gRPC status allows: True (always retryable: UNAVAILABLE, ABORTED, as
#: standard retry policies assume), False (never), None (depends on the error: a capacity limit
#: may clear, an oversized message never fits). ``ShardError`` enforces it.
STATUS_RETRYABLE: dict[GrpcStatus, bool | None] = {
    GrpcStatus.OK: False,
    GrpcStatus.CANCELLED: None,
    GrpcStatus.UNKNOWN: False,
    GrpcStatus.INVALID_ARGUMENT: False,
    GrpcStatus.DEADLINE_EXCEEDED: None,
    GrpcStatus.NOT_FOUND: False,
    GrpcStatus.ALREADY_EXISTS: False,
    GrpcStatus.PERMISSION_DENIED: False,
    GrpcStatus.RESOURCE_EXHAUSTED: None,
    GrpcStatus.FAILED_PRECONDITION: False,
    GrpcStatus.ABORTED: True,
    GrpcStatus.OUT_OF_RANGE: False,
    GrpcStatus.UNIMPLEMENTED: False,
    GrpcStatus.INTERNAL: False,
    GrpcStatus.UNAVAILABLE: True,
    GrpcStatus.DATA_LOSS: False,
    GrpcStatus.UNAUTHENTICATED: False,
}


def agreeing_retryable(status: GrpcStatus, retryable: bool) -> bool:
    """``retryable`` as the status allows it (the status wins where it is unambiguous)."""
    fixed = STATUS_RETRYABLE.get(status)
    return retryable if fixed is None else fixed


@dataclass(frozen=True)
class ErrorSpec:
    """One row of the taxonomy."""

    status: GrpcStatus
    retryable: bool
    message: str


#: The taxonomy. ``retryable``: the *same* request may succeed later without change (after a
#: back-off, or on another worker for NOT_READY/DRAINING/ENGINE_FAILURE: a failed engine's
#: sessions are gone, but the request may be replayed elsewhere). Each row agrees with
#: ``STATUS_RETRYABLE``.
ERROR_TABLE: dict[ErrorCode, ErrorSpec] = {
    ErrorCode.UNSPECIFIED: ErrorSpec(GrpcStatus.UNKNOWN, False, "unknown error"),
    ErrorCode.INVALID_ARGUMENT: ErrorSpec(GrpcStatus.INVALID_ARGUMENT, False, "invalid argument"),
    ErrorCode.UNSUPPORTED_VERSION: ErrorSpec(
        GrpcStatus.FAILED_PRECONDITION, False, "unsupported protocol version"
    ),
    ErrorCode.INCOMPATIBLE_MODEL: ErrorSpec(
        GrpcStatus.FAILED_PRECONDITION, False, "the worker serves a different model or layer range"
    ),
    ErrorCode.ILLEGAL_TRANSITION: ErrorSpec(
        GrpcStatus.FAILED_PRECONDITION, False, "not allowed in the session's current state"
    ),
    ErrorCode.SESSION_NOT_FOUND: ErrorSpec(GrpcStatus.NOT_FOUND, False, "no such session"),
    ErrorCode.SESSION_EXISTS: ErrorSpec(
        GrpcStatus.ALREADY_EXISTS, False, "a session with this id is already open or retained"
    ),
    ErrorCode.RESOURCE_EXHAUSTED: ErrorSpec(
        GrpcStatus.RESOURCE_EXHAUSTED, True, "a capacity limit was reached"
    ),
    ErrorCode.DEADLINE_EXCEEDED: ErrorSpec(
        GrpcStatus.DEADLINE_EXCEEDED, True, "the deadline expired"
    ),
    ErrorCode.CANCELLED: ErrorSpec(GrpcStatus.CANCELLED, True, "the operation was cancelled"),
    ErrorCode.UNAUTHENTICATED: ErrorSpec(
        GrpcStatus.UNAUTHENTICATED, False, "missing or invalid credentials"
    ),
    ErrorCode.PERMISSION_DENIED: ErrorSpec(
        GrpcStatus.PERMISSION_DENIED, False, "not allowed for this caller"
    ),
    ErrorCode.ENGINE_FAILURE: ErrorSpec(
        GrpcStatus.UNAVAILABLE, True, "the engine failed; the worker needs a restart"
    ),
    ErrorCode.NOT_READY: ErrorSpec(GrpcStatus.UNAVAILABLE, True, "the worker is not ready"),
    ErrorCode.DRAINING: ErrorSpec(
        GrpcStatus.UNAVAILABLE, True, "the worker is draining and refuses new sessions"
    ),
    ErrorCode.INTERNAL: ErrorSpec(GrpcStatus.INTERNAL, False, "internal error"),
    ErrorCode.UNSUPPORTED_FEATURE: ErrorSpec(
        GrpcStatus.UNIMPLEMENTED, False, "not supported by this worker"
    ),
    ErrorCode.SESSION_BUSY: ErrorSpec(
        GrpcStatus.ABORTED, True, "the session is busy with another operation"
    ),
}

#: Engine error class -> ErrorCode. Looked up along the MRO, so subclasses need no entry unless
#: they mean something different on the wire (SessionExists is an IllegalTransition in the
#: engine but ALREADY_EXISTS on the wire).
ENGINE_ERROR_CODES: dict[type[engine_errors.EngineError], ErrorCode] = {
    engine_errors.InvalidInput: ErrorCode.INVALID_ARGUMENT,
    engine_errors.IncompatibleState: ErrorCode.INCOMPATIBLE_MODEL,
    engine_errors.UnknownSession: ErrorCode.SESSION_NOT_FOUND,
    engine_errors.SessionExists: ErrorCode.SESSION_EXISTS,
    engine_errors.SessionBusy: ErrorCode.SESSION_BUSY,
    engine_errors.IllegalTransition: ErrorCode.ILLEGAL_TRANSITION,
    engine_errors.ResourcesExhausted: ErrorCode.RESOURCE_EXHAUSTED,
    engine_errors.StepTimeout: ErrorCode.DEADLINE_EXCEEDED,
    engine_errors.EngineCancelled: ErrorCode.CANCELLED,
    engine_errors.UnsupportedFeature: ErrorCode.UNSUPPORTED_FEATURE,
    engine_errors.EngineFailure: ErrorCode.ENGINE_FAILURE,
    engine_errors.NotReady: ErrorCode.NOT_READY,
    engine_errors.EngineError: ErrorCode.INTERNAL,
}

#: gRPC status -> ErrorCode, for statuses that arrive without a ``shard-error-bin`` trailer
#: (a proxy, the transport itself, or a non-Shard server answered).
STATUS_ERROR_CODES: dict[GrpcStatus, ErrorCode] = {
    GrpcStatus.CANCELLED: ErrorCode.CANCELLED,
    GrpcStatus.INVALID_ARGUMENT: ErrorCode.INVALID_ARGUMENT,
    GrpcStatus.DEADLINE_EXCEEDED: ErrorCode.DEADLINE_EXCEEDED,
    GrpcStatus.NOT_FOUND: ErrorCode.SESSION_NOT_FOUND,
    GrpcStatus.ALREADY_EXISTS: ErrorCode.SESSION_EXISTS,
    GrpcStatus.PERMISSION_DENIED: ErrorCode.PERMISSION_DENIED,
    GrpcStatus.RESOURCE_EXHAUSTED: ErrorCode.RESOURCE_EXHAUSTED,
    GrpcStatus.FAILED_PRECONDITION: ErrorCode.ILLEGAL_TRANSITION,
    GrpcStatus.ABORTED: ErrorCode.SESSION_BUSY,
    GrpcStatus.UNIMPLEMENTED: ErrorCode.UNSUPPORTED_FEATURE,
    GrpcStatus.UNAVAILABLE: ErrorCode.NOT_READY,
    GrpcStatus.UNAUTHENTICATED: ErrorCode.UNAUTHENTICATED,
    GrpcStatus.INTERNAL: ErrorCode.INTERNAL,
    GrpcStatus.DATA_LOSS: ErrorCode.INTERNAL,
}

#: Codes that end a session stream when they happen inside it (everything else is step-level:
#: reported in-stream, the session stays usable).
FATAL_IN_SESSION = frozenset({ErrorCode.ENGINE_FAILURE, ErrorCode.NOT_READY, ErrorCode.INTERNAL})


class ShardError(Exception):
    """An error of the Shard protocol, raised by the server internals and by the client.

    ``code`` decides everything else: ``grpc_status`` and the default ``retryable`` come from
    ``ERROR_TABLE``; an explicit ``retryable`` counts only where the status leaves it open
    (``STATUS_RETRYABLE``). ``reason`` carries the finer engine reason (e.g. ``"KV_CACHE_FULL"``).
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str | None = None,
        *,
        retryable: bool | None = None,
        session_id: str = "",
        reason: str = "",
        supported_versions: Sequence[tuple[int, int]] = (),
        grpc_status: GrpcStatus | None = None,
        relay_depth: int = 0,
        failed_layers: tuple[int, int] | None = None,
    ) -> None:
        spec = ERROR_TABLE[code]
        self.code = code
        self.message = message if message else spec.message
        self.session_id = session_id
        self.reason = reason
        self.supported_versions = tuple(supported_versions)
        #: Chain relay: the hop of the route the error is from, counted from whoever raised or
        #: received it (0: its own), and that hop's layer range (``Error.relay_depth``,
        #: ``failed_layers``): structure, so that nobody parses a message to find the hop.
        self.relay_depth = relay_depth
        self.failed_layers = failed_layers if relay_depth else None
        self.grpc_status = spec.status if grpc_status is None else grpc_status
        self.retryable = agreeing_retryable(
            self.grpc_status, spec.retryable if retryable is None else retryable
        )
        super().__init__(self.message)

    def __repr__(self) -> str:
        hop = f", relay_depth={self.relay_depth}" if self.relay_depth else ""
        return f"ShardError({self.code.name}, {self.message!r}, retryable={self.retryable}{hop})"

    def replace(self, **changes: object) -> ShardError:
        """A copy with ``changes`` (any constructor keyword) applied."""
        fields: dict[str, object] = dict(
            code=self.code, message=self.message, retryable=self.retryable,
            session_id=self.session_id, reason=self.reason,
            supported_versions=self.supported_versions, grpc_status=self.grpc_status,
            relay_depth=self.relay_depth, failed_layers=self.failed_layers,
        )
        fields.update(changes)
        code = fields.pop("code")
        return ShardError(code, **fields)  # type: ignore[arg-type]

    def one_hop_up(self, layers: tuple[int, int] | None) -> ShardError:
        """This error, received from the next hop of a route (whose layer range the route named
        ``layers``), as the relaying worker reports it: one hop deeper, and that hop's range if
        the error was the next hop's own."""
        return self.replace(
            relay_depth=self.relay_depth + 1,
            failed_layers=self.failed_layers if self.relay_depth else layers,
        )

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    # ---- wire conversion -------------------------------------------------------------------

    def to_proto(self) -> pb.Error:
        return pb.Error(
            code=int(self.code),
            message=self.message,
            retryable=self.retryable,
            session_id=self.session_id,
            supported_versions=[
                pb.ProtocolVersion(major=a, minor=b) for a, b in self.supported_versions
            ],
            reason=self.reason,
            relay_depth=self.relay_depth,
            failed_layers=None if self.failed_layers is None else pb.LayerRange(
                start=self.failed_layers[0], end=self.failed_layers[1]),
        )

    def error_info(self) -> error_details_pb2.ErrorInfo:
        """The ``google.rpc.ErrorInfo`` of this error: ``reason`` is the ErrorCode name."""
        metadata = {"retryable": "true" if self.retryable else "false"}
        if self.session_id:
            metadata["session_id"] = self.session_id
        if self.reason:
            metadata["engine_reason"] = self.reason
        if self.relay_depth:
            metadata["relay_depth"] = str(self.relay_depth)
            if self.failed_layers is not None:
                metadata["failed_layers"] = f"{self.failed_layers[0]}:{self.failed_layers[1]}"
        return error_details_pb2.ErrorInfo(
            reason=self.code.name, domain=ERROR_DOMAIN, metadata=metadata
        )

    def status_details(self) -> status_pb2.Status:
        """This error as ``google.rpc.Status`` (what ``grpc-status-details-bin`` carries)."""
        detail = AnyProto()
        detail.Pack(self.error_info())
        return status_pb2.Status(
            code=int(self.grpc_status), message=self.message, details=[detail]
        )

    def trailers(self) -> list[tuple[str, bytes]]:
        """Trailing metadata that carries this error next to the gRPC status."""
        return [
            (ERROR_TRAILER, self.to_proto().SerializeToString()),
            (STATUS_DETAILS_TRAILER, self.status_details().SerializeToString()),
        ]

    @classmethod
    def from_proto(cls, err: pb.Error, *, grpc_status: GrpcStatus | None = None) -> ShardError:
        try:
            code = ErrorCode(err.code)
        except ValueError:  # a newer server's code: keep the status, call it unspecified
            code = ErrorCode.UNSPECIFIED
        return cls(
            code,
            err.message,
            retryable=err.retryable,
            session_id=err.session_id,
            reason=err.reason,
            supported_versions=[(v.major, v.minor) for v in err.supported_versions],
            grpc_status=grpc_status,
            relay_depth=err.relay_depth,
            failed_layers=((err.failed_layers.start, err.failed_layers.end)
                           if err.HasField("failed_layers") else None),
        )

    @classmethod
    def from_status(
        cls, status: int, message: str, trailers: Iterable[tuple[str, str | bytes]] = ()
    ) -> ShardError:
        """Rebuild the error a server sent as status + trailers (client side)."""
        try:
            grpc_status = GrpcStatus(status)
        except ValueError:
            grpc_status = GrpcStatus.UNKNOWN
        pairs = [(k, v) for k, v in trailers if isinstance(v, bytes)]
        for key, value in pairs:
            if key == ERROR_TRAILER:
                err = pb.Error()
                try:
                    err.ParseFromString(value)
                except DecodeError:  # a corrupt trailer: fall back to the status
                    break
                return cls.from_proto(err, grpc_status=grpc_status)
        for key, value in pairs:  # no Shard trailer: maybe gRPC's richer error model
            if key == STATUS_DETAILS_TRAILER:
                info = _error_info(value)
                if info is not None and info.domain == ERROR_DOMAIN and info.reason in ErrorCode.__members__:
                    return cls(
                        ErrorCode[info.reason],
                        message or None,
                        retryable=info.metadata.get("retryable") == "true",
                        session_id=info.metadata.get("session_id", ""),
                        reason=info.metadata.get("engine_reason", ""),
                        grpc_status=grpc_status,
                        relay_depth=_int(info.metadata.get("relay_depth", "0")),
                        failed_layers=_layers(info.metadata.get("failed_layers", "")),
                    )
        code = STATUS_ERROR_CODES.get(grpc_status, ErrorCode.UNSPECIFIED)
        return cls(code, message or None, grpc_status=grpc_status)

    @classmethod
    def from_engine(cls, exc: engine_errors.EngineError) -> ShardError:
        """Translate an engine error; its own ``retryable`` wins over the table default."""
        code = ErrorCode.INTERNAL
        for klass in type(exc).__mro__:
            if klass in ENGINE_ERROR_CODES:
                code = ENGINE_ERROR_CODES[klass]  # type: ignore[index]
                break
        return cls(
            code,
            exc.message,
            retryable=exc.retryable,
            session_id=exc.session_id or "",
            reason=exc.code,
        )


@contextmanager
def unwrap_single_exception() -> Iterator[None]:
    """Re-raise a lone exception out of the exception group a Trio nursery wrapped it in.

    Why: ``serve()`` and ``ShardClient.connect()`` own nurseries, and Trio's strict exception
    groups would hand their callers ``ExceptionGroup([OSError])`` instead of ``OSError`` (or a
    ``ShardError``). Groups of several exceptions are left alone.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        exc: BaseException = group
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        if exc is group:
            raise
        raise exc from exc.__cause__


def _error_info(status_bytes: bytes) -> error_details_pb2.ErrorInfo | None:
    """The first ``ErrorInfo`` in a serialized ``google.rpc.Status``; None if there is none."""
    status = status_pb2.Status()
    try:
        status.ParseFromString(status_bytes)
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                return info
    except DecodeError:
        pass
    return None


def _int(text: str) -> int:
    return int(text) if text.isdigit() else 0


def _layers(text: str) -> tuple[int, int] | None:
    start, sep, end = text.partition(":")
    return (int(start), int(end)) if sep and start.isdigit() and end.isdigit() else None


def internal_error(session_id: str = "") -> ShardError:
    """The error an unexpected exception becomes: generic, so no internals leak to clients."""
    return ShardError(ErrorCode.INTERNAL, session_id=session_id)


__all__ = [
    "ENGINE_ERROR_CODES",
    "ERROR_TABLE",
    "ERROR_DOMAIN",
    "ERROR_TRAILER",
    "FATAL_IN_SESSION",
    "STATUS_DETAILS_TRAILER",
    "STATUS_ERROR_CODES",
    "STATUS_RETRYABLE",
    "agreeing_retryable",
    "ErrorCode",
    "ErrorSpec",
    "GrpcStatus",
    "ShardError",
    "internal_error",
    "unwrap_single_exception",
]
