"""A result the worker split into chunks (a boundary result over its ``max_message_bytes``),
buffered until its last chunk arrives and joined into one ``StepResult``, within bounds."""

from __future__ import annotations

from shard.rpc import convert
from shard.rpc.errors import ErrorCode, ShardError
from shard.v1 import shard_pb2 as pb

__all__ = ["ResultChunks"]


class ResultChunks(list[pb.StepResult]):
    """The chunks of the split result being read (empty between split results).

    A list, so the session's per-result test ``step.more_chunks or chunks`` is a list's truth
    test. What it holds is bounded: every chunk well-formed (rows of the first chunk's width in
    the session's dtype), at most the session's KV capacity in rows (so at most
    kv_capacity x row bytes) and ``max_result_bytes`` in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0
        self.nbytes = 0

    def add(
        self, chunk: pb.StepResult, dtype: str, capacity: int, max_bytes: int | None,
        session_id: str,
    ) -> None:
        """Keep one chunk (hidden states in ``dtype``, of a session holding ``capacity`` rows);
        past a bound drop everything and raise ``ShardError`` (the session then fails: the
        rest of the result cannot be read)."""
        t = chunk.hidden_states
        first = self[0].hidden_states if self else t
        width = first.shape[1] if len(first.shape) == 2 else 0
        rows = t.shape[0] if len(t.shape) == 2 and t.shape[1] == width else 0
        if rows < 1 or width < 1 or len(t.data) != rows * convert.WIRE_DTYPES[dtype].row_bytes(width):
            self.drop()
            raise ShardError(
                ErrorCode.INVALID_ARGUMENT,
                f"malformed result chunk: shape {list(t.shape)}, {len(t.data)} bytes of "
                f"{dtype} (rows of width {width or '?'} expected)",
                session_id=session_id,
            )
        self.rows += rows
        self.nbytes += len(t.data)
        if max_bytes is not None and self.nbytes > max_bytes:
            what = f"more than max_result_bytes={max_bytes}"
        elif self.rows > capacity:
            what = f"more rows than the session's KV capacity ({capacity})"
        else:
            self.append(chunk)
            return
        err = ShardError(
            ErrorCode.RESOURCE_EXHAUSTED,
            f"a result sent in chunks grew to {self.rows} rows, {self.nbytes} bytes: {what}",
            retryable=False, session_id=session_id, reason="RESULT_TOO_LARGE",
        )
        self.drop()
        raise err

    def drop(self) -> None:
        self.clear()
        self.rows = self.nbytes = 0

    def join(self, last: pb.StepResult) -> pb.StepResult:
        """The whole result (rows in order; ``last`` is buffered already); ``last`` itself when
        nothing was split."""
        if not self:
            return last
        parts = list(self)
        self.drop()
        whole = pb.StepResult()
        whole.CopyFrom(last)
        whole.hidden_states.data = b"".join(p.hidden_states.data for p in parts)
        whole.hidden_states.shape[0] = sum(p.hidden_states.shape[0] for p in parts)
        return whole
