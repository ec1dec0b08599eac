"""One ``GroupStepRequest``: a batch group's decode rows, each a step of its own session, run as
one tick and answered by one ``GroupStepResponse`` (protocol 1.3, ``GroupSteps``).

Why: a pipeline hop that serves a batch group of N sessions otherwise reads N Decode messages
and writes N results per tick, one wake-up and one message each; here it reads one and writes
one (docs/protocol.md, "Group steps"). And the engine takes the rows as one submission
(``ShardEngine.decode_group``): this task waits once for the group's tick, not one task and
one wake-up per row. Sessions keep their identity: each row is checked by its session's own
step code (``StepContext.decode_input``: input checks; its step timeout goes with its request),
marked RUNNING on its session while it runs (its stream's Cancel stops it: ``_RowStop``; its
stream's close waits for it; its stream's deadline or reset releases it, which fails the row),
its positions kept and resynced as its stream's steps' are, and a row's failure is that row's
outcome only. Its sessions share a batch group, so the engine's scheduler runs the rows in one
tick (``shard.engine.batching``, rule 5). A row whose session must first drop positions past
its logical end (after a resume), or with a grammar to compile, runs as its own step (``_row``).

A row's result does not take the session's credit: it leaves on the group's stream, whose one
answer per request paces it.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from shard.engine import DecodeRequest, EngineCancelled, EngineError, ShardEngine, StepResult, StepTimeout
from shard.v1 import shard_pb2 as pb

from .. import convert
from ..errors import FATAL_IN_SESSION, ErrorCode, ShardError, internal_error
from ..hidden_codec import max_row_bytes
from . import steps
from .cancellation import cancelled
from .call import SessionCall
from .context import StepContext
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
    """Run ``req``'s rows as one engine submission and answer each (see the module docs). Rows
    are claimed in order before any of them runs (a session named twice: the second is
    SESSION_BUSY)."""
    out = pb.GroupStepResponse()
    claimed: list[tuple[SessionCall, pb.Decode, pb.GroupRowResult]] = []
    limit: int | None = None
    limit_caps = None  # the capabilities ``limit`` is for (every row's are the engine's)
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
                if caps is not limit_caps:
                    limit_caps = caps
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
    # Rows that run as their own steps, each in its session's Cancel region: a row whose
    # session holds more positions in the engine than it counts (after a resume: a
    # one-position prefill, ``StepContext.decode_one``), and a row with a grammar (compiled
    # before its session is RUNNING in the engine, which a Cancel must stop too).
    alone, together = [], []
    for c in claimed:
        positions = c[0].ctx.positions
        own = positions.end != positions.engine or bool(c[1].sampling.grammar_kind)
        (alone if own else together).append(c)
    if alone:
        async with trio.open_nursery() as nursery:
            for call, d, res in alone:
                nursery.start_soon(_row, host, call, d, res)
            await _submit(host, together)
    elif together:
        await _submit(host, together)
    else:
        await trio.lowlevel.checkpoint()
    return out


class _RowStop:
    """A grouped row's Cancel: the engine stops its session's step (``StepCancel.watch``)."""

    __slots__ = ("_engine", "_session_id")

    def __init__(self, engine: ShardEngine, session_id: str) -> None:
        self._engine, self._session_id = engine, session_id

    def cancel(self) -> None:
        self._engine.cancel(self._session_id)


async def _submit(host: GroupHost, rows: list[tuple[SessionCall, pb.Decode, pb.GroupRowResult]]) -> None:
    """The rows as one engine submission (``ShardEngine.decode_group``): each checked by its
    session's step code (``StepContext.decode_input``), stopped alone by its stream's Cancel
    (the engine's ``cancel`` of its session) and by its step timeout, its outcome its own.
    Every row is ended (``end_row``) whatever happens; only the group's own cancellation
    escapes (each row is then rolled back, as a cancelled step is)."""
    if not rows:
        return
    engine = rows[0][0].ctx.engine
    running: list[tuple[SessionCall, pb.GroupRowResult, int]] = []
    requests: list[DecodeRequest] = []
    left = rows[::-1]  # not yet ended or submitted, the next one last
    try:
        while left:
            call, d, res = left.pop()
            ctx = call.ctx
            try:
                sampling, token, hidden, token_id = ctx.decode_input(d)
                if call.stop_row(_RowStop(engine, ctx.session_id)):
                    raise cancelled(ctx.session_id)  # a Cancel before the engine call
            except ShardError as err:
                _end(host, call, res, err)
                continue
            except Exception:
                log.exception("session %r: a group row failed", call.session_id)
                _end(host, call, res, internal_error(call.session_id))
                continue
            if token is not None:
                ctx.follows = (ctx.positions.next_token is not None
                               and token == ctx.positions.next_token)
            hint = ctx.client_hint() if token is not None else None
            requests.append(DecodeRequest(
                session_id=ctx.session_id, token=token, hidden_state=hidden, sampling=sampling,
                top_k_logprobs=d.top_logprobs, lookahead=hint, token_id=token_id,
                step_timeout=ctx.step_timeout))
            running.append((call, res, ctx.positions.end))
        if not running:
            await trio.lowlevel.checkpoint()
            return
        try:
            outcomes = await engine.decode_group(requests)
        except BaseException:  # the group's stream ended: every row was rolled back
            for call, _, _ in running:
                call.ctx.resync()
            raise
    except BaseException:
        for call, res, _ in running:
            call.end_row(0)
            res.n_past = call.ctx.positions.end
        for call, _, res in reversed(left):
            call.end_row(0)
            res.n_past = call.ctx.positions.end
        raise
    for (call, res, start), outcome in zip(running, outcomes, strict=True):
        ctx = call.ctx
        if isinstance(outcome, EngineError):
            ctx.resync()
            if isinstance(outcome, StepTimeout):
                assert ctx.step_timeout is not None
                err = ShardError(ErrorCode.DEADLINE_EXCEEDED, "the step exceeded step_timeout_ms="
                                 f"{round(ctx.step_timeout * 1000)}", session_id=ctx.session_id,
                                 reason=outcome.code)
            elif isinstance(outcome, EngineCancelled) and call.row_cancel_requested:
                err = cancelled(ctx.session_id)
            else:
                err = ShardError.from_engine(outcome)
            _end(host, call, res, err)
            continue
        try:
            ctx.positions.computed(start, outcome)
            _answer(host, ctx, res, outcome, start)
        except Exception:
            log.exception("session %r: a group row failed", call.session_id)
            _end(host, call, res, internal_error(call.session_id))
            continue
        call.end_row(1)
        res.n_past = ctx.positions.end


def _end(host: GroupHost, call: SessionCall, res: pb.GroupRowResult, err: ShardError) -> None:
    """A row that failed with ``err``: its outcome, and its session's stream ends when the
    error is fatal in a session (as ``_row``'s)."""
    _failed(host, res, err)
    call.end_row(0, err if err.code in FATAL_IN_SESSION else None)
    res.n_past = call.ctx.positions.end


async def _row(host: GroupHost, call: SessionCall, d: pb.Decode, res: pb.GroupRowResult) -> None:
    """One row as its session's own decode step (a row ``_submit`` cannot take), its outcome
    written into ``res``. Only the group's own cancellation escapes (the row is then rolled back like any step: ``engine_call``)."""
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
        _answer(host, ctx, res, result, start)
    finally:
        call.end_row(generated, fatal)
        res.n_past = ctx.positions.end


def _answer(host: GroupHost, ctx: StepContext, res: pb.GroupRowResult, result: StepResult,
            start: int) -> None:
    """A row's result, written into its answer as its session's next step (its stream's results
    number on from it; its grammar start becomes the session's, as a sent step's)."""
    outbox = ctx.outbox
    outbox.step_no += 1
    convert.step_into(res.result, result, outbox.step_no, start, ctx.wire_dtype)
    ctx.step_accepted()
    ctx.positions.sent(result.n_past)
    host.count("steps_sent_total")


def _failed(host: GroupHost, res: pb.GroupRowResult, err: ShardError) -> None:
    if not err.session_id:
        err.session_id = res.session_id
    res.error.CopyFrom(err.to_proto())
    host.count_error(err.code)


__all__ = ["GroupHost", "ROW_OVERHEAD", "rows_per_group", "run_group"]
