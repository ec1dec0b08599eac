"""What happened to each session, told to the operator: one log line per lifecycle event, and
the session counters and latencies that ``GetMetrics`` and ``/metrics`` report.

Why by watching messages: the session state machine (``session/``) already answers every
event with a response (``SessionOpened`` with its cache outcome, an in-stream ``Error``,
``SessionClosed``) or with the stream's final error, so the servicer hands each request and
response to a ``StreamWatch`` and the state machine stays free of logging and metrics. The
watch sees what the client sees, in the order it sees it.

Events (logger ``shard.sessions``; fields ``session_id``, ``peer``, ``principal`` on each):
``open`` (with the cache outcome: ``new``, or the resume outcome ``hit``/``partial``/``miss``/
``mismatch``), ``cancel`` (a step stopped by the Cancel RPC, and the Cancel RPC itself),
``deadline`` (a step over ``step_timeout_ms``, or the call deadline), ``release`` (the Release
RPC), ``error`` (a refused open, a step-level or fatal error, with its code), ``close`` (how the
stream ended and whether the KV cache is retained). Nothing secret is logged: the principal is
the authenticator's name for the caller, never its credential (and hpack's DEBUG header dump
is switched off for the whole package, see ``shard/rpc/__init__.py``).
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Protocol

import trio

from shard.logs import kv
from shard.v1 import shard_pb2 as pb

from .errors import ErrorCode, ShardError
from .transport import CallContext, EndReason, current_call

log = logging.getLogger("shard.sessions")

#: The authenticated caller of the current RPC ("" without an authenticator).
principal: ContextVar[str] = ContextVar("shard_principal", default="")

_DEADLINE = int(ErrorCode.DEADLINE_EXCEEDED)


def event(name: str, session_id: str, ctx: CallContext | None = None, **fields: object) -> None:
    """Log one lifecycle event of ``session_id`` with the caller's peer and principal."""
    if ctx is None:
        try:
            ctx = current_call()
        except LookupError:  # no transport (tests driving the registry directly)
            ctx = None
    data: dict[str, object] = {
        "event": name,
        "session_id": session_id,
        "peer": ctx.peer if ctx is not None else "",
        "principal": principal.get(),
        **fields,
    }
    log.info("session %s %s", name, kv({k: v for k, v in data.items() if k != "event"}),
             extra={"fields": data})


def _outcome_name(outcome: int) -> str:
    return pb.CacheResult.Outcome.Name(outcome).removeprefix("OUTCOME_").lower()


def _code_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return str(code)


class Counts(Protocol):
    """Where a watch reports (``metrics.WorkerMetrics``): counters and a latency histogram."""

    def count(self, name: str, n: int = 1) -> None: ...

    def time_to_first_token(self, seconds: float) -> None: ...


class StreamWatch:
    """Follows one ``Session`` stream through its requests and responses.

    Call ``request`` for every request read, ``response`` for every response sent, and ``end``
    once the stream is over (the session is released or retained by then).
    """

    def __init__(self, counts: Counts, ctx: CallContext) -> None:
        self._counts = counts
        self._ctx = ctx
        self.session_id = ""
        self._opened = False
        self._closed: pb.SessionClosed | None = None
        self._step_started: float | None = None  # a Prefill/Generate waits for its first result

    def _event(self, name: str, **fields: object) -> None:
        event(name, self.session_id, self._ctx, **fields)

    def request(self, req: pb.SessionRequest) -> None:
        kind = req.WhichOneof("kind")
        if kind == "open" and not self.session_id:
            self.session_id = req.open.session_id
        elif kind in ("prefill", "generate"):
            self._step_started = trio.current_time()
            if kind == "prefill" and req.prefill.WhichOneof("input") == "hidden_states":
                self._counts.count("hidden_state_bytes_in_total", len(req.prefill.hidden_states.data))
        elif kind == "decode" and req.decode.WhichOneof("input") == "hidden_state":
            self._counts.count("hidden_state_bytes_in_total", len(req.decode.hidden_state.data))

    def response(self, msg: pb.SessionResponse) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "step":
            if self._step_started is not None:
                self._counts.time_to_first_token(trio.current_time() - self._step_started)
                self._step_started = None
            if msg.step.WhichOneof("output") == "hidden_states":
                self._counts.count("hidden_state_bytes_out_total", len(msg.step.hidden_states.data))
        elif kind == "usage":
            self._step_started = None
        elif kind == "opened":
            self._opened = True
            self.session_id = msg.opened.session_id
            self._counts.count("sessions_opened_total")
            self._event("open", cache=_outcome_name(msg.opened.cache.outcome),
                        tokens_held=msg.opened.cache.tokens_held)
        elif kind == "error":
            self._step_error(msg.error)
        elif kind == "closed":
            self._closed = msg.closed

    def _step_error(self, err: pb.Error) -> None:
        code = int(err.code)
        if code == int(ErrorCode.CANCELLED):
            self._counts.count("steps_cancelled_total")
            self._event("cancel", scope="step")
        elif code == _DEADLINE:
            self._counts.count("steps_deadline_exceeded_total")
            self._event("deadline", scope="step", reason=err.reason)
        else:
            self._event("error", scope="step", code=_code_name(code), reason=err.reason,
                        message=err.message)

    def end(self, error: ShardError | None, retained: bool) -> None:
        """The stream is over: log how, and count refused, failed and cancelled sessions."""
        reason = self._ctx.end_reason
        if error is None and reason is EndReason.DEADLINE:
            # The transport's timer for the call deadline fired before the session's own scope
            # (same deadline) noticed: the session was released with no error of its own. It
            # ended by its deadline all the same: count and log it as the session would.
            error = ShardError(ErrorCode.DEADLINE_EXCEEDED, "the call deadline expired")
        if error is not None:
            code = error.code.name
            if not self._opened:
                self._counts.count("sessions_rejected_total")
                self._event("error", scope="open", code=code, message=error.message)
                return
            self._counts.count("sessions_failed_total")
            if error.code is ErrorCode.DEADLINE_EXCEEDED:
                self._counts.count("sessions_deadline_exceeded_total")
                self._event("deadline", scope="call")
            else:
                self._event("error", scope="session", code=code, message=error.message)
        elif not self._opened:
            return  # the client went away before opening: there was no session
        if reason is EndReason.CLIENT_CANCELLED:
            self._counts.count("sessions_cancelled_total")
        if self._closed is not None:
            how = pb.SessionClosed.Reason.Name(self._closed.reason).removeprefix("REASON_").lower()
        elif error is not None:
            how = "error"
        else:
            how = reason.value if reason is not None else "ended"
        self._counts.count("sessions_closed_total")
        self._event("close", reason=how, retained=retained)


__all__ = ["Counts", "StreamWatch", "event", "principal"]
