"""A session's state moved between workers (``ExportState``/``StateChunk``): the stream's
side of ``shard.rpc.handoff``, which checks and frames the state."""

from __future__ import annotations

from shard.engine import EngineError
from shard.v1 import shard_pb2 as pb

from .. import convert, handoff
from ..errors import ShardError
from . import inputs
from .outbox import CHUNK_OVERHEAD
from .phase import illegal


class StateTransfer:
    """``SessionCall``'s export and import steps (a mixin)."""

    async def _export_state(self, e: pb.ExportState) -> None:
        """The session's state as StateChunk responses, one credit each; the session is left
        as it is (a surplus a partial resume left is dropped first: it is not the session's)."""
        sid = self.session_id
        inputs.check_export(e, self.positions.end, handoff.MIN_CHUNK_BYTES, sid)
        await self.truncate_engine(self.positions.end)
        try:
            snapshot = await self._engine.export_session(sid)
        except EngineError as exc:
            raise ShardError.from_engine(exc) from None
        outbox = self._outbox
        limit = outbox.max_message_bytes - CHUNK_OVERHEAD
        size = min(e.max_chunk_bytes or limit, limit)
        next_token = self.positions.next_token
        for chunk in handoff.export_chunks(snapshot, self.caps, next_token, size):
            with self.cancellable():
                await self.take_credit()
            self._credits.spend()
            await outbox.respond(pb.SessionResponse(state=chunk), more_follows=chunk.last)

    async def _import_state(self, c: pb.StateChunk) -> None:
        """One chunk of a state; the last resumes the (empty) session from the whole state.
        Checked before a byte is kept (``handoff.StateImport``); any refusal drops the chunks
        received and leaves the session empty."""
        sid, pending = self.session_id, self._importing
        self._importing = None
        if pending is None:
            if not c.HasField("header"):
                raise convert.invalid("a state's first chunk carries its header", sid)
            if self.positions.end or self.positions.engine:
                raise illegal(f"the session holds {self.positions.end} positions: a state is "
                              "imported only into an empty session", sid)
            try:
                pending = handoff.StateImport(c.header, self.caps, kv_capacity=self._kv_capacity,
                                              bound=self._engine.state_bytes_bound, session_id=sid)
            except EngineError as exc:  # (the engine stopped serving meanwhile)
                raise ShardError.from_engine(exc) from None
        elif c.HasField("header"):
            raise convert.invalid("a header in a later chunk of a state", sid)
        pending.add(c.data)
        if not c.last:
            self._importing = pending
            return
        snapshot = pending.snapshot()
        try:
            info = await self._engine.import_session(sid, snapshot)
        except EngineError as exc:
            raise ShardError.from_engine(exc) from None
        self.positions.resumed(info.n_past, info.n_past)
        self.positions.next_token = pending.next_token
