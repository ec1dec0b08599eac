"""What one hop's session holds, and bringing a new session there to it by replay.

``HopHistory`` is shared by a hop's runner, which logs every step it sends (``held`` positions,
the first hop's token ids, a later hop's boundary rows: ``shard.pipeline.replay``), and its
failover, which replays the log into a replica's new session.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from shard.client import ClientSession, StepStream
from shard.rpc import convert
from shard.rpc.errors import ErrorCode, ShardError
from shard.v1 import shard_pb2 as pb

from .generation import next_or_none
from .replay import RowLog, TokenLog

__all__ = ["REPLAY_CHUNKS", "HopHistory"]

#: A replay result covers this many prefill chunks (``chunk_tokens`` each; ``chunk_tokens`` 0,
#: a one-hop prefill in one step: the whole replay in one) and may take as many
#: ``step_timeout``s: small chunks cost a worker more per position (docs/pipelines.md).
REPLAY_CHUNKS = 8
#: ``timed(call, steps)``: ``call()`` within ``steps`` step timeouts (the runner's).
Timed = Callable[..., Awaitable[Any]]


@dataclass
class HopHistory:
    """The positions one hop's session holds and what to replay them from: the first hop's
    prompt and token ids, a later hop's boundary rows (None: the hop has no alternative)."""

    first: bool
    tokens: TokenLog
    rows: RowLog | None
    held: int = 0

    def replayable(self) -> bool:
        return self.first or self.held == 0 or (self.rows is not None and not self.rows.dropped)

    async def replay(
        self, session: ClientSession, *, chunk_tokens: int, parse_special: bool,
        reference: pb.GetCapabilitiesResponse | None, timed: Timed,
    ) -> None:
        """Bring a new session to what the failed one held: the first hop's prompt and tokens,
        or a later hop's logged rows with their ids when known (in requests that fit one
        message, results per chunk; ``reference``: the hop's capabilities)."""
        if self.held == 0:
            return
        chunk, steps = chunk_tokens * REPLAY_CHUNKS, REPLAY_CHUNKS

        async def drain(results: StepStream) -> pb.StepResult | None:
            last = None
            while (step := await timed(lambda: next_or_none(results), steps)) is not None:
                last = step
            return last

        last: pb.StepResult | None = None
        if self.first:
            prompt = self.tokens.prompt
            assert prompt is not None
            if isinstance(prompt, str):
                last = await drain(session.prefill_chunks(
                    text=prompt, chunk_tokens=chunk, parse_special=parse_special))
                if self.tokens.tokens:
                    last = await drain(
                        session.prefill_chunks(self.tokens.tokens, chunk_tokens=chunk))
            else:
                last = await drain(session.prefill_chunks(
                    [*prompt, *self.tokens.tokens], chunk_tokens=chunk))
        else:
            assert self.rows is not None and reference is not None
            row = convert.WIRE_DTYPES[session.hidden_dtype].row_bytes(reference.n_embd)
            limit = min(x for x in (reference.max_message_bytes, 16 * 2**20) if x)
            per_message = max(1, (limit - 1024) // row)
            position, ids = 0, self.rows.ids
            for part in self.rows.slices(per_message):
                end = position + part.shape[0]
                last = await drain(session.prefill_chunks(
                    hidden_states=part, position=position, chunk_tokens=chunk,
                    token_ids=None if ids is None else ids[position:end]))
                position = end
        if last is None or last.n_past != self.held:
            got = "nothing" if last is None else f"{last.n_past} positions"
            raise ShardError(ErrorCode.INTERNAL, f"the replay left {got}, not {self.held}")
