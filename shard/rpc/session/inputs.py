"""Checks of a session's input before any engine work (pure functions: they raise the
``ShardError`` the client gets, or return nothing)."""

from __future__ import annotations

from shard.engine import Capabilities, ContextExceeded, KvCacheFull
from shard.v1 import shard_pb2 as pb

from .. import convert
from ..errors import ErrorCode, ShardError
from .limits import MAX_SESSION_ID_BYTES
from .outbox import CHUNK_OVERHEAD

FLOAT32_BYTES = 4  # the widest wire dtype: a row never takes more than 4 * n_embd bytes
#: A text longer than this many times ``max_token_bytes`` per position of room is refused
#: before tokenization (slack for tokenizers that normalise text away, e.g. runs of spaces).
TEXT_SLACK = 4


def check_session_id(sid: str) -> None:
    if not sid or len(sid.encode("utf-8")) > MAX_SESSION_ID_BYTES:
        raise convert.invalid(f"session_id must be 1..{MAX_SESSION_ID_BYTES} bytes")


def check_model(req: pb.OpenSession, caps: Capabilities, sid: str) -> None:
    """The model and layers the client expects are the ones this worker serves."""
    if req.expected_model_fingerprint and req.expected_model_fingerprint != caps.model_fingerprint:
        raise ShardError(
            ErrorCode.INCOMPATIBLE_MODEL,
            f"this worker serves model {caps.model_fingerprint}, "
            f"not {req.expected_model_fingerprint}",
            session_id=sid,
        )
    if req.HasField("expected_layer_range"):
        want, have = req.expected_layer_range, caps.layer_range
        if (want.start, want.end) != (have.start, have.end):
            raise ShardError(
                ErrorCode.INCOMPATIBLE_MODEL,
                f"this worker serves layers [{have.start}, {have.end}), "
                f"not [{want.start}, {want.end})",
                session_id=sid,
            )


def check_room(caps: Capabilities, kv_capacity: int, position: int, n_tokens: int, sid: str) -> None:
    """Refuse, before any work, input that cannot fit: the errors the engine would give."""
    new_len = position + n_tokens
    if new_len > caps.n_ctx_per_session:
        raise ShardError.from_engine(ContextExceeded(
            f"{new_len} positions exceed the per-session context of {caps.n_ctx_per_session}",
            session_id=sid,
        ))
    if new_len > kv_capacity:
        raise ShardError.from_engine(KvCacheFull(
            f"{new_len} positions exceed this session's KV budget of {kv_capacity}",
            session_id=sid,
        ))


def text_floor(caps: Capabilities, text: str) -> int:
    """The fewest positions ``text`` can take: a token stands for at most ``max_token_bytes``
    bytes and a character is at least one (``TEXT_SLACK`` for tokenizers that normalise text
    away); 0 when the engine does not say."""
    if not caps.max_token_bytes:
        return 0
    return len(text) // (TEXT_SLACK * caps.max_token_bytes)


def check_row_fits(caps: Capabilities, max_message_bytes: int, sid: str) -> None:
    """Refuse, before any compute, a boundary result that no chunking could send."""
    if caps.is_last:
        return
    if FLOAT32_BYTES * caps.n_embd + CHUNK_OVERHEAD > max_message_bytes:
        raise ShardError(
            ErrorCode.RESOURCE_EXHAUSTED,
            f"one hidden-state row ({caps.n_embd} values) does not fit in max_message_bytes="
            f"{max_message_bytes}",
            retryable=False,
            session_id=sid,
            reason="MESSAGE_TOO_LARGE",
        )


def check_rewind(r: pb.Rewind, end: int, sid: str) -> int:
    """A Rewind's checked position."""
    if r.position > end:
        raise convert.invalid(f"Rewind position {r.position} is beyond the session end {end}", sid)
    return r.position


def check_export(e: pb.ExportState, end: int, min_chunk_bytes: int, sid: str) -> None:
    if e.max_chunk_bytes and e.max_chunk_bytes < min_chunk_bytes:
        raise convert.invalid(f"max_chunk_bytes must be 0 or >= {min_chunk_bytes}", sid)
    if end == 0:
        raise ShardError(ErrorCode.ILLEGAL_TRANSITION, "the session holds no positions to export",
                         session_id=sid)
