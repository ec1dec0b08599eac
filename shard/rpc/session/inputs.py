"""Checks of a session's input before any engine work (pure functions: they raise the
``ShardError`` the client gets, or return nothing)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from shard.engine import Capabilities, ContextExceeded, KvCacheFull, PrefillRequest, SamplingParams, StepResult
from shard.v1 import shard_pb2 as pb

from .. import convert
from ..hidden_codec import max_row_bytes
from ..errors import ErrorCode, ShardError
from .limits import MAX_SESSION_ID_BYTES
from .outbox import CHUNK_OVERHEAD

#: A text longer than this many times ``max_token_bytes`` per position of room is refused
#: before tokenization (slack for tokenizers that normalise text away, e.g. runs of spaces).
TEXT_SLACK = 4


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillInput:
    """A Prefill's checked input: ``n`` positions from ``position``, as ``tokens`` or as hidden
    rows (``hidden``) with the ids they stand for (``token_ids``, or None). The first ``lead``
    positions came without rows (the hop before took them from its prefix cache): ``hidden``
    holds zero rows there, which the engine must take from its own cache (``lead_missed``)."""

    position: int
    sampling: SamplingParams
    tokens: tuple[int, ...] | None
    hidden: np.ndarray | None
    token_ids: tuple[int, ...] | None
    n: int
    lead: int = 0
    #: The most positions a step may grow to (the rows one message carries on; None: any).
    max_span: int | None = None
    #: The most of the session's leading positions the prefix cache may serve (None: any).
    cache_limit: int | None = None
    #: Leading positions of this input the prefix cache held when it was checked (a hint for
    #: the first step's size: the engine looks again when it computes it).
    covered: int = 0

    def chunks(self, chunk_tokens: int) -> PrefillChunks:
        """The engine steps of this input, ``chunk_tokens`` positions at a time (0: all)."""
        chunk = chunk_tokens or max(self.n, 1)
        return PrefillChunks(self.n, chunk, max(self.lead, self.covered),
                             max(chunk, self.max_span or self.n))

    def request(self, sid: str, start: int, stop: int, **options: object) -> PrefillRequest:
        """The engine request of the chunk ``[start, stop)`` (``options``: sampling aside)."""
        return PrefillRequest(
            sid,
            None if self.tokens is None else self.tokens[start:stop],
            None if self.hidden is None else self.hidden[start:stop],
            position=self.position + start, sampling=self.sampling,
            token_ids=None if self.token_ids is None else self.token_ids[start:stop],
            cache_limit=self.cache_limit,
            **options,  # type: ignore[arg-type]
        )

    def lead_missed(self, first: StepResult) -> bool:
        """The first step computed some of the positions that came without rows (this engine's
        cache did not hold them): its result is wrong and must be dropped."""
        return first.reused_tokens + first.cached_tokens < self.lead


class PrefillChunks:
    """The ``[start, stop)`` offsets of a prefill's engine steps: ``chunk`` positions at a time,
    the first also holding the positions the prefix cache serves (``covered``: those that came
    without rows, or what the cache held when the input was checked), which cost a copy, not a
    computation: a cached conversation takes one step when its new part fits one chunk, and the
    uncovered rest still goes in pipelined chunks. Should the first step's start be covered as
    far as it may (all but the one position a step computes: the cache held more than it was
    told), the next takes the rest at once (up to ``most``, so that the rows a step computes
    still fit one message to the next hop), where each further step would copy the cache
    entry's whole stream again and compute one more position the cache held (``took``)."""

    __slots__ = ("_n", "_chunk", "_most", "_span")

    def __init__(self, n: int, chunk: int, covered: int, most: int) -> None:
        self._n, self._chunk, self._most, self._span = n, chunk, most, covered + chunk

    def __iter__(self) -> Iterator[tuple[int, int]]:
        start = 0
        while True:
            stop = min(self._n, start + self._span)
            yield start, stop
            if stop >= self._n:
                return
            start = stop

    def took(self, result: StepResult, start: int, stop: int) -> None:
        """The step ``[start, stop)`` returned ``result``."""
        held = result.cached_tokens + result.reused_tokens
        grow = result.cached_tokens and held >= stop - start - 1
        self._span = self._most if grow else self._chunk


def hidden_ids(
    hidden: np.ndarray, ids: Sequence[int], position: int, end: int, sid: str
) -> tuple[np.ndarray, tuple[int, ...], int]:
    """Hidden rows with the ids they stand for (``Prefill.token_ids``): (rows, zero rows first
    for any positions without rows, ids, how many came without rows)."""
    rows = int(hidden.shape[0])
    lead = len(ids) - rows
    if lead < 0:
        raise convert.invalid(f"{len(ids)} token_ids for {rows} hidden-state rows", sid)
    if lead and position != end:
        raise convert.invalid("token_ids beyond the rows need the prefill at the session end "
                              f"({end}), not at {position}", sid)
    if lead:
        pad = np.zeros((lead, hidden.shape[1]), dtype=hidden.dtype)
        hidden = np.concatenate([pad, hidden])
    return hidden, tuple(ids), lead


def cache_limit(msg: pb.Prefill | pb.Generate) -> int | None:
    """``cache_limit`` when the message sets it (``has_cache_limit``), else None: no limit."""
    return msg.cache_limit if msg.has_cache_limit else None


def prefix_not_cached(lead: int, sid: str) -> ShardError:
    return ShardError(
        ErrorCode.ILLEGAL_TRANSITION,
        f"the first {lead} positions came without hidden states and this worker's prefix cache "
        "does not hold them",
        retryable=False, session_id=sid, reason="PREFIX_NOT_CACHED",
    )


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


def rows_per_message(caps: Capabilities, max_message_bytes: int) -> int | None:
    """The most boundary rows one message carries (None on a last shard: it sends logits)."""
    if caps.is_last:
        return None
    return max(1, (max_message_bytes - CHUNK_OVERHEAD) // max_row_bytes(caps.n_embd))


def check_row_fits(caps: Capabilities, max_message_bytes: int, sid: str) -> None:
    """Refuse, before any compute, a boundary result that no chunking could send."""
    if caps.is_last:
        return
    if max_row_bytes(caps.n_embd) + CHUNK_OVERHEAD > max_message_bytes:
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
