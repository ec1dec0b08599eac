"""A ``GroupSteps`` stream (protocol 1.3): the decode steps of several of this client's sessions
on one worker sent as one message per tick, answered by one message of per-session outcomes.

Why: a pipeline hop serving a batch group otherwise pays one message and one wake-up per
session per step, on both sides; a group pays one (docs/protocol.md, "Group steps"). Each
session stays what it was: opened, cancelled, timed out and closed on its own ``Session``
stream; a row's error is that session's step error only.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from typing import Protocol

from shard.rpc.errors import ErrorCode, ShardError
from shard.rpc.transport import ClientStream
from shard.v1 import shard_pb2 as pb

from .session import ClientSession

__all__ = ["GroupStream", "RowOutcome"]

#: A row's outcome: its session's step result, or its step error.
RowOutcome = pb.StepResult | ShardError


class _Versioned(Protocol):
    @property
    def version(self) -> pb.ProtocolVersion: ...


class GroupStream:
    """One ``GroupSteps`` call (``ShardClient.group_steps``): ``step`` one tick at a time."""

    def __init__(self, client: _Versioned, stream: ClientStream) -> None:
        self._client = client
        self._stream = stream
        self._dead: ShardError | None = None

    @property
    def alive(self) -> bool:
        return self._dead is None

    async def step(self, rows: Sequence[tuple[ClientSession, pb.Decode]]) -> list[RowOutcome]:
        """Send one tick's rows (each a session and its Decode; every session opened on this
        stream's worker) and return each row's outcome, in order. A row's error is returned,
        not raised (the session stays usable unless the error ended its stream); a failure of
        the group's stream itself raises ``ShardError`` and ends this stream (the sessions are
        untouched: their steps go on their own streams)."""
        if self._dead is not None:
            raise self._dead
        if not rows:
            return []
        req = pb.GroupStepRequest(version=self._client.version)
        for session, decode in rows:
            req.rows.add(session_id=session.session_id, decode=decode)
        with ExitStack() as held:  # (one step of each session at a time, as on its stream)
            for session, _ in rows:
                held.enter_context(session._guard.exclusive())
            try:
                await self._stream.send(req)
                reply = await self._stream.receive(pb.GroupStepResponse)
            except ShardError as err:
                self._dead = err
                raise
        if reply is None or len(reply.rows) != len(rows):
            self._dead = self._stream.error() or ShardError(
                ErrorCode.INTERNAL, "the worker answered a group step with "
                + ("nothing" if reply is None else f"{len(reply.rows)} of {len(rows)} rows"))
            self._stream.abort()
            raise self._dead
        out: list[RowOutcome] = []
        for (session, _), row in zip(rows, reply.rows, strict=True):
            if row.WhichOneof("outcome") == "result":
                out.append(row.result)
            else:
                err = ShardError.from_proto(row.error)
                err.session_id = err.session_id or session.session_id
                out.append(err)
        return out

    async def aclose(self) -> None:
        """End the call (half-close, then its status); a failed one is reset."""
        if self._dead is None:
            try:
                await self._stream.half_close()
                extra = await self._stream.receive(pb.GroupStepResponse)
                err = self._stream.error()
                if extra is None and err is None:
                    self._stream.close()
                    return
                self._dead = err or ShardError(ErrorCode.INTERNAL, "an unexpected group answer")
            except ShardError as err:
                self._dead = err
        self.abort()

    def abort(self) -> None:
        """Reset the call now (sync); the sessions are untouched."""
        self._dead = self._dead or ShardError(ErrorCode.CANCELLED, "aborted by the client")
        self._stream.abort()
