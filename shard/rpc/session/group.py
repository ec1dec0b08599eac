"""One ``GroupStepRequest``: a batch group's decode rows, each a step of its own session, run as
one tick and answered by one ``GroupStepResponse`` (protocol 1.3, ``GroupSteps``).

Why: a pipeline hop that serves a batch group of N sessions otherwise reads N Decode messages
and writes N results per tick, one wake-up and one message each; here it reads one and writes
one (docs/protocol.md, "Group steps"). Sessions keep their identity: each row is checked and
computed by its session's own step code (``steps.compute_decode`` with the session's
``StepContext``: input checks, step timeout, resync, positions), marked RUNNING on its session
while it runs (its stream's Cancel stops it; its stream's close waits for it; its stream's
deadline or reset releases it, which fails the row), and a row's failure is that row's outcome
only. The rows are submitted together, so the engine's scheduler runs them in one tick (their
sessions share a batch group: ``shard.engine.batching``, rule 5).

A row's result does not take the session's credit: it leaves on the group's stream, whose one
answer per request paces it.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from shard.v1 import shard_pb2 as pb

from .. import convert
from ..errors import FATAL_IN_SESSION, ErrorCode, ShardError, internal_error
from ..hidden_codec import max_row_bytes
from . import steps
from .call import SessionCall
from .outbox import CHUNK_OVERHEAD

log = logging.getLogger(__name__)

#: Bytes a row's result may take besides its hidden-state row (ids, positions, framing).
ROW_OVERHEAD = 256


class GroupHost(Protocol):
    """What a group needs of the worker's session table (``Registry``)."""

    def live(self, session_id: str) -> SessionCall | None: ...

    def count(self, name: str, n: int = 1) -> None: ...

    def count_error(self, code: ErrorCode) -> None: ...


def rows_per_group(n_embd: int, is_last: bool, max_message_bytes: int) -> int | None:
    """The most rows one answer holds on a shard that sends hidden rows (None on a last shard:
    its rows are a token's logits each)."""
    if is_last:
        return None
    return max(1, (max_message_bytes - CHUNK_OVERHEAD) // (max_row_bytes(n_embd) + ROW_OVERHEAD))


async def run_group(host: GroupHost, req: pb.GroupStepRequest, caller: tuple[str, str],
                    max_message_bytes: int) -> pb.GroupStepResponse:
    """Run ``req``'s rows as one tick and answer each (see the module docs). Rows are claimed
    in order before any of them runs (a session named twice: the second is SESSION_BUSY)."""
    out = pb.GroupStepResponse()
    claimed: list[tuple[SessionCall, pb.Decode, pb.GroupRowResult]] = []
    limit: int | None = None
    for row in req.rows:
        res = out.rows.add(session_id=row.session_id)
        call = host.live(row.session_id)
        refusal = (ShardError(ErrorCode.SESSION_NOT_FOUND, "no live session of this caller "
                              "with this id", session_id=row.session_id)
                   if call is None else call.row_refusal(caller))
        if refusal is None and call is not None:
            res.n_past = call.positions.end
            if not row.HasField("decode"):
                refusal = convert.invalid("a group row needs a Decode", row.session_id)
            else:
                caps = call.ctx.caps
                limit = rows_per_group(caps.n_embd, caps.is_last, max_message_bytes)
                if limit is not None and len(claimed) >= limit:
                    refusal = ShardError(
                        ErrorCode.RESOURCE_EXHAUSTED, f"more rows than one answer holds ({limit} "
                        f"of {caps.n_embd} values in max_message_bytes={max_message_bytes})",
                        retryable=False, session_id=row.session_id, reason="MESSAGE_TOO_LARGE")
        if refusal is not None:
            res.error.CopyFrom(refusal.to_proto())
            host.count_error(refusal.code)
            continue
        assert call is not None
        call.begin_row()  # (no checkpoint from here to the rows' tasks: each ends its row)
        claimed.append((call, row.decode, res))
    host.count("group_steps_total")
    host.count("group_rows_total", len(req.rows))
    if claimed:
        async with trio.open_nursery() as nursery:
            for call, d, res in claimed:
                nursery.start_soon(_row, host, call, d, res)
    else:
        await trio.lowlevel.checkpoint()
    return out


async def _row(host: GroupHost, call: SessionCall, d: pb.Decode, res: pb.GroupRowResult) -> None:
    """One row: its session's decode step, its outcome written into ``res``. Only the group's
    own cancellation escapes (the row is then rolled back like any step: ``engine_call``)."""
    ctx = call.ctx
    generated, fatal = 0, None
    try:
        try:
            result, start = await steps.compute_decode(ctx, d, credit=False)
        except ShardError as err:
            fatal = err if err.code in FATAL_IN_SESSION else None
            _failed(host, res, err)
            return
        except Exception:
            log.exception("session %r: a group row failed", call.session_id)
            fatal = internal_error(call.session_id)
            _failed(host, res, fatal)
            return
        generated = 1
        outbox = ctx.outbox
        outbox.step_no += 1  # the session's next step (its stream's results number on from it)
        res.result.CopyFrom(convert.step_to_proto(result, outbox.step_no, start, ctx.wire_dtype))
        ctx.positions.sent(result.n_past)
        host.count("steps_sent_total")
    finally:
        call.end_row(generated, fatal)
        res.n_past = ctx.positions.end


def _failed(host: GroupHost, res: pb.GroupRowResult, err: ShardError) -> None:
    if not err.session_id:
        err.session_id = res.session_id
    res.error.CopyFrom(err.to_proto())
    host.count_error(err.code)


__all__ = ["GroupHost", "ROW_OVERHEAD", "rows_per_group", "run_group"]
