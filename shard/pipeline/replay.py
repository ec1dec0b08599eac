"""What a pipeline keeps so that another worker can take over a hop: the replay logs.

A worker that takes over hop ``k`` mid-generation must hold what the failed one held: the KV
cache of every position so far. The protocol cannot make a live shard re-send the boundary
states of positions it already holds (a prefill reuses held token ids without computing them,
and returns rows only for the positions it computed), so recomputing hop ``k``'s input from the
first hop would mean re-running every earlier hop over the whole history in a second session.
Instead the client keeps each hop's input as it sent it, and replays one hop only:

* the first hop's input is the prompt (text or token ids) and the token ids fed after it
  (``TokenLog``: 4 bytes a position);
* a later hop's input is the boundary hidden states it received (``RowLog``: a row's bytes in
  the hop's wire dtype a position, kept encoded, so a replay sends exactly what the failed
  worker was sent: re-encoding a decoded row gives the same bytes, see
  ``shard.rpc.hidden_codec``), kept only for hops that have an alternative.

``ReplayBudget`` bounds the rows of one generation (all hops together). Past it every row log
is dropped at once (and a warning logged): the memory is freed, the first hop can still fail
over, a later hop cannot (its failure is then a ``PipelineError`` that says why).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import numpy as np

from shard.rpc.hidden_codec import CODECS

__all__ = ["DEFAULT_REPLAY_BYTES", "ReplayBudget", "RowLog", "TokenLog"]

log = logging.getLogger(__name__)

#: Default bound on the boundary rows one generation keeps: 65,536 positions of the bench model
#: (n_embd 1024, float32) on one hop with an alternative, 4,096 positions of a 4096-wide model
#: on four such hops.
DEFAULT_REPLAY_BYTES = 256 * 2**20


class ReplayBudget:
    """The bytes of boundary rows one generation may keep, shared by its row logs."""

    def __init__(self, limit: int | None) -> None:
        if limit is not None and limit < 0:
            raise ValueError("replay_bytes must be >= 0 (or None for no bound)")
        self.limit = limit
        self.used = 0
        self.exceeded_at: int | None = None  # positions of the log that crossed the bound
        self._logs: list[RowLog] = []

    def register(self, rows: RowLog) -> None:
        self._logs.append(rows)

    def take(self, nbytes: int, positions: int) -> bool:
        """Account ``nbytes`` more; False (and every row log dropped) past the bound."""
        if self.exceeded_at is not None:
            return False
        if self.limit is not None and self.used + nbytes > self.limit:
            self.exceeded_at = positions
            log.warning(
                "replay logs dropped: %d more bytes would pass replay_bytes=%d at %d positions; "
                "later hops can no longer fail over in this generation",
                nbytes, self.limit, positions,
            )
            for row_log in self._logs:
                row_log.drop()
            self.used = 0
            return False
        self.used += nbytes
        return True

    def give_back(self, nbytes: int) -> None:
        """Rows a log forgot (``RowLog.truncate``) no longer count."""
        if self.exceeded_at is None:
            self.used = max(0, self.used - nbytes)

    def why_dropped(self) -> str:
        if self.exceeded_at is None:  # (``RowLog.gap``)
            return ("part of its input came as token ids without rows (the hop before took them "
                    "from its prefix cache), which cannot be replayed")
        return (f"its replay log was dropped when the history reached {self.exceeded_at} "
                f"positions (replay_bytes={self.limit})")


class TokenLog:
    """The first hop's input: the prompt and every token id fed after it."""

    def __init__(self) -> None:
        self.prompt: str | list[int] | None = None  # set once the prompt is held
        self.prompt_positions = 0  # what the prompt occupies (a text's token count)
        self.tokens: list[int] = []

    def hold_prompt(self, prompt: str | Sequence[int], positions: int) -> None:
        self.prompt = prompt if isinstance(prompt, str) else list(prompt)
        self.prompt_positions = positions

    def append(self, token: int) -> None:
        self.tokens.append(token)

    def write(self, position: int, tokens: Sequence[int]) -> None:
        """``tokens`` written at ``position`` (a speculative step, or the step after one that
        drops its rejected drafts): everything logged from ``position`` on is replaced."""
        offset = position - self.prompt_positions
        if not 0 <= offset <= len(self.tokens):
            raise ValueError(f"position {position} is outside the logged "
                             f"[{self.prompt_positions}, {self.prompt_positions + len(self.tokens)}]")
        del self.tokens[offset:]
        self.tokens.extend(tokens)

    @property
    def empty(self) -> bool:
        return self.prompt is None


class RowLog:
    """A later hop's input: the boundary rows it was sent, position 0 first, and the token ids
    they stand for (``ids``; None once a step came without them), which a replay sends again so
    that the replica's session knows its ids as the failed one did (penalties, prefix cache)."""

    def __init__(self, budget: ReplayBudget) -> None:
        self._budget = budget
        self._chunks: list[np.ndarray] = []  # uint8 [rows, row bytes]: the rows as encoded
        self._dtype = ""  # the wire dtype and width of the rows kept
        self._n_embd = 0
        self.positions = 0
        self.dropped = False
        self.ids: list[int] | None = []
        budget.register(self)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._chunks)

    def append(self, rows: np.ndarray, dtype: str, ids: Sequence[int] | None = None) -> None:
        """Keep a copy of ``rows`` ([n, n_embd] float32) as the hop received them: in its
        session's wire ``dtype``; ``ids``: the token ids of those rows (its last ``n``)."""
        if ids is None or self.ids is None:
            self.ids = None
        else:
            self.ids.extend(ids[len(ids) - rows.shape[0]:])
        self.positions += rows.shape[0]
        if self.dropped:
            return
        codec = CODECS[dtype]
        self._dtype, self._n_embd = dtype, rows.shape[1]
        kept = np.frombuffer(codec.encode(rows), dtype=np.uint8).reshape(rows.shape[0], -1)
        if self._budget.take(kept.nbytes, self.positions):
            self._chunks.append(kept)

    def truncate(self, positions: int) -> None:
        """Forget every row from position ``positions`` on (a rewind: rejected drafts) and give
        their bytes back to the budget."""
        if positions > self.positions:
            raise ValueError(f"cannot keep {positions} of {self.positions} logged rows")
        self.positions = positions
        if self.ids is not None:
            del self.ids[positions:]
        if self.dropped:
            return
        kept, total = [], 0
        for chunk in self._chunks:
            if total >= positions:
                break
            part = chunk[:positions - total]
            if part.shape[0] < chunk.shape[0]:  # a view would keep the whole chunk alive
                part = part.copy()
            kept.append(part)
            total += part.shape[0]
        freed = self.nbytes - sum(c.nbytes for c in kept)
        self._chunks = kept
        self._budget.give_back(freed)

    def drop(self) -> None:
        self.dropped = True
        self._chunks = []

    def gap(self, positions: int) -> None:
        """``positions`` arrived without rows (the hop before took them from its prefix
        cache): the log cannot replay the hop any more, but still counts positions."""
        self.positions += positions
        self.ids = None
        self.drop()

    def slices(self, max_rows: int) -> Iterator[np.ndarray]:
        """Every row so far, in order, as float32 arrays of at most ``max_rows`` rows (exact:
        the wire dtype's decoding); one slice is copied at a time."""
        if self.dropped:
            raise RuntimeError("the replay log was dropped")
        pending: list[np.ndarray] = []
        size = 0
        for chunk in self._chunks:
            start = 0
            while start < chunk.shape[0]:
                part = chunk[start:start + max_rows - size]
                pending.append(part)
                size += part.shape[0]
                start += part.shape[0]
                if size == max_rows:
                    yield self._decode(pending)
                    pending, size = [], 0
        if pending:
            yield self._decode(pending)

    def _decode(self, parts: list[np.ndarray]) -> np.ndarray:
        data = np.concatenate(parts)
        return CODECS[self._dtype].decode(data.tobytes(), data.shape[0], self._n_embd)
