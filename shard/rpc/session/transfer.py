"""A session's state moved between workers (``ExportState``/``StateChunk``): the stream's
side of ``shard.rpc.handoff``, which checks and frames the state."""

from __future__ import annotations

from shard.engine import EngineError
from shard.v1 import shard_pb2 as pb

from .. import convert, handoff
from ..errors import ShardError
from . import inputs
from .context import StepContext
from .outbox import CHUNK_OVERHEAD
from .phase import illegal


async def export_state(ctx: StepContext, e: pb.ExportState) -> None:
    """The session's state as StateChunk responses, one credit each; the session is left
    as it is (a surplus a partial resume left is dropped first: it is not the session's)."""
    sid = ctx.session_id
    inputs.check_export(e, ctx.positions.end, handoff.MIN_CHUNK_BYTES, sid)
    await ctx.truncate_engine(ctx.positions.end)
    try:
        snapshot = await ctx.engine.export_session(sid)
    except EngineError as exc:
        raise ShardError.from_engine(exc) from None
    outbox = ctx.outbox
    limit = outbox.max_message_bytes - CHUNK_OVERHEAD
    size = min(e.max_chunk_bytes or limit, limit)
    next_token = ctx.positions.next_token
    for chunk in handoff.export_chunks(snapshot, ctx.caps, next_token, size):
        with ctx.cancellable():
            await ctx.take_credit()
        ctx.credits.spend()
        await outbox.respond(pb.SessionResponse(state=chunk), more_follows=chunk.last)


async def import_state(
    ctx: StepContext, c: pb.StateChunk, pending: handoff.StateImport | None
) -> handoff.StateImport | None:
    """One chunk of a state (``pending``: the state's earlier chunks); the last resumes the
    (empty) session from the whole state. Returns the chunks so far while more must follow.
    Checked before a byte is kept (``handoff.StateImport``); any refusal drops the chunks
    received and leaves the session empty."""
    sid = ctx.session_id
    if pending is None:
        if not c.HasField("header"):
            raise convert.invalid("a state's first chunk carries its header", sid)
        if ctx.positions.end or ctx.positions.engine:
            raise illegal(f"the session holds {ctx.positions.end} positions: a state is "
                          "imported only into an empty session", sid)
        try:
            pending = handoff.StateImport(c.header, ctx.caps, kv_capacity=ctx.kv_capacity,
                                          bound=ctx.engine.state_bytes_bound, session_id=sid)
        except EngineError as exc:  # (the engine stopped serving meanwhile)
            raise ShardError.from_engine(exc) from None
    elif c.HasField("header"):
        raise convert.invalid("a header in a later chunk of a state", sid)
    pending.add(c.data)
    if not c.last:
        return pending
    snapshot = pending.snapshot()
    try:
        info = await ctx.engine.import_session(sid, snapshot)
    except EngineError as exc:
        raise ShardError.from_engine(exc) from None
    ctx.positions.resumed(info.n_past, info.n_past)
    ctx.positions.next_token = pending.next_token
    return None
