"""Session hand-off on the wire: a session's state out as ``StateChunk`` messages, and in again.

Why a module of its own: a state is the one thing a session sends that can be tens of megabytes
(every layer's K and V rows of every position), so it is cut into messages that each fit the
transport, and an import is checked against this worker (model, range, KV layout, the bytes
its positions can take here) *before* a byte of it is buffered, then checked whole (size and
SHA-256) before the engine reads it. The session stream (``shard.rpc.session``) only sends the
chunks this module cuts and feeds it the chunks it receives.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

from shard.engine import Capabilities, SessionSnapshot
from shard.v1 import shard_pb2 as pb

from .convert import invalid
from .errors import ErrorCode, ShardError

__all__ = ["MIN_CHUNK_BYTES", "YIELDED", "StateImport", "export_chunks"]

#: The smallest ``ExportState.max_chunk_bytes`` a worker accepts: smaller chunks would only
#: multiply messages (a 1,024-position state of a small model is tens of megabytes).
MIN_CHUNK_BYTES = 4096
_FIELD_OVERHEAD = 64  # a chunk's own tags and lengths around its data
#: ``Error.reason`` of a ``Generate{yield_on_drain}`` that a drain ended early between two
#: tokens, its session left open to be moved.
YIELDED = "YIELDED"


def export_chunks(
    snapshot: SessionSnapshot, caps: Capabilities, next_token: int | None, max_bytes: int
) -> Iterator[pb.StateChunk]:
    """The state as chunks of at most ``max_bytes`` serialized bytes each, the header on the
    first (which must fit in one chunk with at least one byte of data)."""
    data = snapshot.data
    header = pb.StateHeader(
        model_fingerprint=caps.model_fingerprint,
        layer_range=pb.LayerRange(start=caps.layer_range.start, end=caps.layer_range.end),
        kv_layout=snapshot.kv_layout,
        n_past=snapshot.n_past,
        has_tokens=snapshot.tokens is not None,
        tokens=snapshot.tokens or (),
        data_bytes=len(data),
        data_sha256=hashlib.sha256(data).digest(),
        has_next_token=next_token is not None,
        next_token=next_token or 0,
    )
    room = max_bytes - _FIELD_OVERHEAD
    first = room - header.ByteSize()
    if first < 1:
        raise ShardError(
            ErrorCode.RESOURCE_EXHAUSTED,
            f"the state's header ({header.ByteSize()} bytes) does not fit a chunk of {max_bytes}",
            reason="MESSAGE_TOO_LARGE",
        )
    offset = 0
    while True:
        start = offset
        piece = data[start : start + (first if start == 0 else room)]
        offset += len(piece)
        last = offset >= len(data)
        yield pb.StateChunk(header=header if start == 0 else None, data=piece, last=last)
        if last:
            return


class StateImport:
    """One import in progress: the header checked against this worker, then the chunks'
    bytes, bounded by what the header declared (itself bounded by what its positions take
    here: ``bound``)."""

    def __init__(
        self, header: pb.StateHeader, caps: Capabilities, *, kv_capacity: int,
        bound: Callable[[int], int], session_id: str,
    ) -> None:
        sid = session_id
        have = caps.layer_range
        if header.model_fingerprint != caps.model_fingerprint:
            raise self._refused(f"the state is of model {header.model_fingerprint}, this worker "
                                f"serves {caps.model_fingerprint}", sid)
        if (header.layer_range.start, header.layer_range.end) != (have.start, have.end):
            raise self._refused(
                f"the state is of layers [{header.layer_range.start}, {header.layer_range.end}), "
                f"this worker serves [{have.start}, {have.end})", sid)
        if not caps.kv_layout or header.kv_layout != caps.kv_layout:
            raise self._refused(f"the state's KV layout {header.kv_layout!r} is not this "
                                f"worker's {caps.kv_layout!r}", sid, reason="KV_LAYOUT")
        n = header.n_past
        if n < 1:
            raise invalid("a state holds at least one position", sid)
        if n > kv_capacity:
            raise ShardError(ErrorCode.RESOURCE_EXHAUSTED, f"the state holds {n} positions, this "
                             f"session {kv_capacity}", retryable=False, session_id=sid,
                             reason="KV_CACHE_FULL")
        # a first shard's state always has its ids; a later shard's when every hidden-state
        # step carried them (Prefill.token_ids), so that it stays in the prefix cache
        if (caps.is_first and not header.has_tokens) or (header.has_tokens and len(header.tokens) != n):
            raise invalid(f"the state carries {len(header.tokens)} token ids for {n} positions "
                          f"of a {'first' if caps.is_first else 'later'} shard", sid)
        limit = bound(n)
        if not 0 < header.data_bytes <= limit:
            raise invalid(f"a state of {header.data_bytes} bytes for {n} positions (they take at "
                          f"most {limit} here)", sid)
        if len(header.data_sha256) != 32:
            raise invalid("data_sha256 must be 32 bytes", sid)
        if header.has_next_token and not header.next_token < caps.n_vocab:
            raise invalid(f"next_token {header.next_token} is outside the vocabulary "
                          f"[0, {caps.n_vocab})", sid)
        self.header = header
        self._sid = sid
        self._data = bytearray()
        self._hash = hashlib.sha256()

    @staticmethod
    def _refused(message: str, sid: str, reason: str = "") -> ShardError:
        return ShardError(ErrorCode.INCOMPATIBLE_MODEL, message, session_id=sid, reason=reason)

    def add(self, data: bytes) -> None:
        """One more chunk's bytes; more than the header declared is refused."""
        if len(self._data) + len(data) > self.header.data_bytes:
            raise invalid(f"the chunks carry more than the {self.header.data_bytes} bytes the "
                          "state declared", self._sid)
        self._data += data
        self._hash.update(data)

    def snapshot(self) -> SessionSnapshot:
        """The whole state, once its size and SHA-256 are what the header said."""
        h = self.header
        if len(self._data) != h.data_bytes or self._hash.digest() != h.data_sha256:
            raise ShardError(ErrorCode.INVALID_ARGUMENT, f"the state's {len(self._data)} bytes "
                             f"are not the {h.data_bytes} its header describes (size or SHA-256)",
                             session_id=self._sid, reason="STATE_CORRUPT")
        tokens = tuple(h.tokens) if h.has_tokens else None
        return SessionSnapshot(h.n_past, tokens, h.kv_layout, bytes(self._data))

    @property
    def next_token(self) -> int | None:
        return self.header.next_token if self.header.has_next_token else None
