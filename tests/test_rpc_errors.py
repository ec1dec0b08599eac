"""The error taxonomy and version policy as tables: complete, consistent with the proto, and
lossless on the wire."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import shard.engine.errors as engine_errors
from google.rpc import error_details_pb2, status_pb2

from shard.rpc.errors import (
    ENGINE_ERROR_CODES,
    ERROR_DOMAIN,
    ERROR_TABLE,
    ERROR_TRAILER,
    STATUS_DETAILS_TRAILER,
    STATUS_RETRYABLE,
    ErrorCode,
    GrpcStatus,
    ShardError,
    agreeing_retryable,
)
from shard.rpc.versions import SUPPORTED_VERSIONS, check_version, is_supported
from shard.v1 import shard_pb2 as pb

PROTO = Path(__file__).resolve().parents[1] / "proto" / "shard" / "v1" / "shard.proto"


def test_error_codes_mirror_the_proto_enum() -> None:
    proto = {v.name.removeprefix("ERROR_CODE_"): v.number for v in pb.ErrorCode.DESCRIPTOR.values}
    assert {c.name: int(c) for c in ErrorCode} == proto
    assert set(ERROR_TABLE) == set(ErrorCode)


def test_table_status_matches_the_proto_comments() -> None:
    """The proto documents each code's gRPC status in a comment; the table must agree."""
    documented = dict(re.findall(r"ERROR_CODE_(\w+) = \d+;\s*// (\w+)", PROTO.read_text()))
    assert documented, "no documented statuses found in the proto"
    for name, status in documented.items():
        assert ERROR_TABLE[ErrorCode[name]].status.name == status, name


@pytest.mark.parametrize("name", engine_errors.__all__)
def test_every_engine_error_maps_to_a_code(name: str) -> None:
    cls = getattr(engine_errors, name)
    err = ShardError.from_engine(cls("boom", session_id="s9"))
    assert err.code in ErrorCode and err.code is not ErrorCode.UNSPECIFIED
    assert err.reason == cls.code and err.session_id == "s9" and err.message == "boom"
    # The engine knows best whether to retry, where the status leaves it open.
    assert err.retryable == agreeing_retryable(err.grpc_status, cls.retryable)
    assert any(issubclass(cls, k) for k in ENGINE_ERROR_CODES)


@pytest.mark.parametrize(
    "cls, code",
    [
        (engine_errors.SessionExists, ErrorCode.SESSION_EXISTS),
        (engine_errors.SessionBusy, ErrorCode.SESSION_BUSY),
        (engine_errors.KvCacheFull, ErrorCode.RESOURCE_EXHAUSTED),
        (engine_errors.TooManySessions, ErrorCode.RESOURCE_EXHAUSTED),
        (engine_errors.UnknownSession, ErrorCode.SESSION_NOT_FOUND),
        (engine_errors.EngineCancelled, ErrorCode.CANCELLED),
        (engine_errors.EngineFailure, ErrorCode.ENGINE_FAILURE),
    ],
)
def test_specific_engine_mappings(cls: type[engine_errors.EngineError], code: ErrorCode) -> None:
    assert ShardError.from_engine(cls("x")).code is code


def test_retryable_always_agrees_with_the_status() -> None:
    assert set(STATUS_RETRYABLE) == set(GrpcStatus)
    for code, spec in ERROR_TABLE.items():
        fixed = STATUS_RETRYABLE[spec.status]
        assert fixed is None or spec.retryable is fixed, code
        for wish in (True, False):  # an explicit flag cannot contradict the status either
            err = ShardError(code, retryable=wish)
            assert err.retryable is (wish if fixed is None else fixed), code
    # The cases the table alone does not settle:
    assert ERROR_TABLE[ErrorCode.SESSION_BUSY].status is GrpcStatus.ABORTED
    assert ShardError(ErrorCode.ENGINE_FAILURE, retryable=False).retryable  # UNAVAILABLE
    assert not ShardError(ErrorCode.RESOURCE_EXHAUSTED, retryable=False).retryable  # too large


def test_status_details_carry_an_error_info() -> None:
    err = ShardError(ErrorCode.SESSION_BUSY, "busy", session_id="s1", reason="SESSION_BUSY")
    trailers = dict(err.trailers())
    status = status_pb2.Status.FromString(trailers[STATUS_DETAILS_TRAILER])
    assert (status.code, status.message) == (GrpcStatus.ABORTED, "busy")
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert (info.reason, info.domain) == ("SESSION_BUSY", ERROR_DOMAIN)
    assert dict(info.metadata) == {"retryable": "true", "session_id": "s1", "engine_reason": "SESSION_BUSY"}
    # A client that only got the standard details rebuilds the same error.
    back = ShardError.from_status(10, "busy", [(STATUS_DETAILS_TRAILER, trailers[STATUS_DETAILS_TRAILER])])
    assert (back.code, back.retryable, back.session_id, back.reason) == (
        ErrorCode.SESSION_BUSY, True, "s1", "SESSION_BUSY"
    )


def test_error_round_trips_through_the_trailer() -> None:
    err = ShardError(
        ErrorCode.UNSUPPORTED_VERSION, "nope", session_id="s1", reason="R",
        supported_versions=[(1, 0)],
    )
    (key, value), (details_key, _) = err.trailers()
    assert key == ERROR_TRAILER and isinstance(value, bytes) and details_key == STATUS_DETAILS_TRAILER
    back = ShardError.from_status(9, "nope", [("other", "x"), (key, value)])
    assert (back.code, back.message, back.session_id, back.reason) == (err.code, "nope", "s1", "R")
    assert back.supported_versions == ((1, 0),) and back.grpc_status is GrpcStatus.FAILED_PRECONDITION
    assert not back.retryable


def test_status_without_trailer_and_unknown_codes_degrade_gracefully() -> None:
    plain = ShardError.from_status(4, "deadline exceeded")
    assert plain.code is ErrorCode.DEADLINE_EXCEEDED and plain.retryable
    weird = ShardError.from_status(99, "")
    assert weird.grpc_status is GrpcStatus.UNKNOWN and weird.code is ErrorCode.UNSPECIFIED
    corrupt = ShardError.from_status(13, "internal error", [(ERROR_TRAILER, b"\xff\xff")])
    assert corrupt.code is ErrorCode.INTERNAL
    newer = ShardError.from_proto(pb.Error(code=777, message="from the future"), grpc_status=GrpcStatus.ABORTED)  # type: ignore[arg-type]
    assert newer.code is ErrorCode.UNSPECIFIED and newer.grpc_status is GrpcStatus.ABORTED


def test_internal_errors_are_generic() -> None:
    assert ERROR_TABLE[ErrorCode.INTERNAL].message == "internal error"
    assert str(ShardError(ErrorCode.INTERNAL)) == "INTERNAL: internal error"


@pytest.mark.parametrize(
    "version, ok",
    [((1, 0), True), ((1, 1), True), ((1, 2), True), ((1, 3), True), ((1, 4), False), ((2, 0), False), ((0, 9), False), ((0, 0), False)],
)
def test_version_policy(version: tuple[int, int], ok: bool) -> None:
    assert is_supported(*version) is ok
    request = pb.HealthRequest(version=pb.ProtocolVersion(major=version[0], minor=version[1]))
    if ok:
        assert check_version(request) == version
    else:
        with pytest.raises(ShardError) as info:
            check_version(request)
        assert info.value.code is ErrorCode.UNSUPPORTED_VERSION
        assert info.value.supported_versions == SUPPORTED_VERSIONS


def test_missing_version_is_refused() -> None:
    with pytest.raises(ShardError) as info:
        check_version(pb.HealthRequest())
    assert info.value.code is ErrorCode.UNSUPPORTED_VERSION and "no protocol version" in info.value.message


def test_protocol_doc_error_table_matches_the_code() -> None:
    doc = (PROTO.parents[3] / "docs" / "protocol.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (\w+) \| (yes|no) \| (.+?) \|$", doc, flags=re.MULTILINE)
    table = {name: (status, retry == "yes", message) for name, status, retry, message in rows}
    assert table == {
        code.name: (spec.status.name, spec.retryable, spec.message) for code, spec in ERROR_TABLE.items()
    }
