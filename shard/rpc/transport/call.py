"""The server's call API: a call's context and ending (``CallContext``, ``current_call``,
``StatusError``, ``EndReason``), the handler's fast paths (``StreamHandler``, ``ResponseSink``)
and ``Call``, one RPC's request inbox and response writer over its connection's h2 machine.

Why a module of its own: it is what handlers see of the transport, and a call's framing and
flow control are its own concern; the connection (``server``) owns the socket, the tasks and
the h2 machine it shares with its calls (through ``CallOwner``).
"""

from __future__ import annotations

import enum
import logging
import math
import struct
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

import h2.exceptions
import trio
from google.protobuf.message import DecodeError
from purerpc.grpclib.events import RequestReceived

from ..errors import ErrorCode, GrpcStatus, ShardError
from .wire import OUTBOX_HIGH_WATER, PREFIX, BoundedH2

log = logging.getLogger(__name__)


class CallOwner(Protocol):
    """What a ``Call`` uses of its connection (``server._Connection``)."""

    peer: str
    h2: BoundedH2

    @property
    def unsent(self) -> int: ...

    def send_pending(self) -> None: ...

    def send_soon(self, write: bool) -> None: ...

    async def flush(self, idle: float = math.inf, write: bool = False) -> bool: ...

    def close(self, reason: EndReason) -> None: ...


class EndReason(enum.Enum):
    """Why a call ended early; the servicer uses it to choose release vs. retain."""

    DEADLINE = "deadline"  # grpc-timeout expired
    CLIENT_CANCELLED = "client_cancelled"  # RST_STREAM from the client
    CONNECTION_LOST = "connection_lost"  # the connection closed / broke
    SHUTDOWN = "shutdown"  # the server is stopping
    SEND_STALLED = "send_stalled"  # the client read no response for send_idle_timeout


# Status sent when the transport itself ends a call; None: the stream is gone, send nothing.
END_STATUS: dict[EndReason, tuple[int, str] | None] = {
    EndReason.DEADLINE: (int(GrpcStatus.DEADLINE_EXCEEDED), "deadline exceeded"),
    EndReason.CLIENT_CANCELLED: None,
    EndReason.CONNECTION_LOST: None,
    EndReason.SHUTDOWN: (int(GrpcStatus.UNAVAILABLE), "the worker is draining"),
    EndReason.SEND_STALLED: (int(GrpcStatus.RESOURCE_EXHAUSTED), "the client read no response"),
}

#: The Shard error that rides along with each of those statuses unless the handler attached
#: its own: a router can tell a drain (retry elsewhere) from a crash, and every status the
#: transport sends carries ``shard-error-bin`` and ``grpc-status-details-bin``.
END_TRAILERS: dict[EndReason, list[tuple[str, bytes]]] = {
    EndReason.DEADLINE: ShardError(
        ErrorCode.DEADLINE_EXCEEDED, "the call deadline expired").trailers(),
    EndReason.SHUTDOWN: ShardError(
        ErrorCode.DRAINING, "the worker is draining: the call was ended before it finished"
    ).trailers(),
    EndReason.SEND_STALLED: ShardError(
        ErrorCode.RESOURCE_EXHAUSTED,
        "the client read no response for send_idle_timeout: the call was ended",
        retryable=True, reason="SEND_IDLE_TIMEOUT",
    ).trailers(),
}
class StatusError(Exception):
    """Raise from a handler to end the call with a gRPC status and trailing metadata.

    ``code`` is a numeric gRPC status code (e.g. 9 FAILED_PRECONDITION); ``trailers`` are extra
    trailing metadata pairs (binary keys end in ``-bin`` and take bytes).
    """

    def __init__(
        self, code: int, message: str, trailers: Sequence[tuple[str, str | bytes]] = ()
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailers = tuple(trailers)

    @classmethod
    def of(cls, err: ShardError) -> StatusError:
        """``err`` as a status with its ``shard-error-bin`` and ``grpc-status-details-bin``
        trailers (every status the transport itself produces carries them)."""
        return cls(int(err.grpc_status), err.message, err.trailers())


class StreamHandler(Protocol):
    """A stream-input handler's fast path for requests, registered with its call
    (``CallContext.register``)."""

    def take_now(self, message: Any) -> bool:
        """Offered each request message, parsed, by the connection's reader while the handler
        waits for the next one with none queued; True: taken (the request iterator never
        yields it), False: queued as usual. Why: a client-driven step's request otherwise
        wakes the handler's task only to be handed on, a task step and a scheduler pass per
        request. It must not wait; order is kept (offered only when every earlier message
        was read)."""
        ...


class ResponseSink(Protocol):
    """The transport's fast path for responses (what ``CallContext.register`` returns)."""

    def send_now(self, message: Any, flush: bool = True) -> bool:
        """Frame one response now, from the caller's own task, if the peer's windows and the
        connection's unsent bytes allow it without waiting; False otherwise (nothing was sent:
        hand it to the handler's stream as usual). Only while the handler itself sends nothing
        (see ``Call.send_now``); a streaming handler's producer uses it to skip a task hop.
        ``flush``: False when another response follows at once."""
        ...


class _NoSink:
    """The sink of a context without a transport call behind it (tests): never sends."""

    def send_now(self, message: Any, flush: bool = True) -> bool:
        return False


@dataclass
class CallContext:
    """Per-call facts the transport gives the handler (through ``current_call()``)."""

    method: str  # "/shard.v1.Shard/Session"
    metadata: tuple[tuple[str, str | bytes], ...]  # request headers (custom metadata only)
    peer: str
    deadline: float = math.inf  # trio.current_time() based; inf when no grpc-timeout
    end_reason: EndReason | None = None  # set before the handler is cancelled early
    trailers: list[tuple[str, str | bytes]] = field(default_factory=list)  # sent with the status
    _sink: ResponseSink = field(default_factory=_NoSink, repr=False)
    _handler: StreamHandler | None = field(default=None, init=False, repr=False)
    #: Each response is a batch of its own (a group's answer: ``GroupSteps``), so it is written
    #: from the handler's task when the connection's writer is idle, as a lone stream's
    #: response is (``_Connection.send_soon``), instead of waking the writer for it: nothing
    #: would coalesce with it there that is not already in it.
    write_through: bool = field(default=False, init=False, repr=False)

    def register(self, handler: StreamHandler) -> ResponseSink:
        """A stream-input handler's fast paths: ``handler.take_now`` is offered requests (see
        ``StreamHandler``) until ``unregister``; the returned sink frames responses at once."""
        self._handler = handler
        return self._sink

    def unregister(self) -> None:
        self._handler = None

    @property
    def handler(self) -> StreamHandler | None:
        """The registered ``StreamHandler``, if any."""
        return self._handler


_current: ContextVar[CallContext] = ContextVar("shard_rpc_call")


def current_call() -> CallContext:
    """The context of the call the current task is handling."""
    return _current.get()


class Requests:
    """The request stream given to stream-input handlers; a plain class, not an async
    generator, so an abandoned iterator needs no finalizer."""

    def __init__(self, call: Call) -> None:
        self._call = call

    def __aiter__(self) -> Requests:
        return self

    async def __anext__(self) -> Any:
        if (message := await self._call.receive()) is None:
            raise StopAsyncIteration
        return message


class Call:
    """One RPC: its context, request inbox, response writer and the handler's cancel scope."""

    def __init__(
        self, conn: CallOwner, event: RequestReceived, request_type: type, streaming: bool
    ) -> None:
        self.conn, self.sid, self.request_type = conn, event.stream_id, request_type
        self.streaming = streaming  # counts against max_concurrent_streams
        timeout = event.timeout
        self.ctx = CallContext(
            method=f"/{event.service_name}/{event.method_name}",
            metadata=tuple(event.custom_metadata),
            peer=conn.peer,
            deadline=math.inf if timeout is None else trio.current_time() + timeout.total_seconds(),
            _sink=self,
        )
        self.scope = trio.CancelScope()
        # Unbounded in items, bounded in bytes: the ledger stops acknowledging (flow control)
        # once a window of messages waits here.
        self.inbox_send, self.inbox = trio.open_memory_channel[bytes | StatusError | tuple[Any, int]](
            math.inf)  # (a tuple: a message parsed already, and its size)
        self.window = trio.Event()
        self.headers_sent = False
        self.error: StatusError | None = None
        #: The service's authorize hook, run from the headers before the DATA is acknowledged.
        self.gate: Callable[[CallContext], Awaitable[Any]] | None = None

    def make_current(self) -> None:
        """This call is ``current_call()`` in the calling task (its handler's)."""
        _current.set(self.ctx)

    def abort(self, reason: EndReason) -> None:
        """Record why the call ends early, then cancel the handler (its ``finally`` runs)."""
        if self.ctx.end_reason is None:
            self.ctx.end_reason = reason
        self.scope.cancel()

    async def receive(self) -> Any:
        """Next request message; None at the end of the stream; StatusError if it failed."""
        if self.error is None:
            try:
                item = await self.inbox.receive()
            except trio.EndOfChannel:
                return None
            if isinstance(item, StatusError):
                self.error = item
            elif isinstance(item, tuple):  # parsed by ``deliver`` and not taken
                message, size = item
                self.conn.h2.consumed(self.sid, size + PREFIX)
                self.conn.send_pending()
                return message
            else:
                self.conn.h2.consumed(self.sid, len(item) + PREFIX)
                self.conn.send_pending()
                message = self.request_type()
                try:
                    message.ParseFromString(item)
                    return message
                except DecodeError:
                    self.error = invalid_status("cannot parse request message")
        raise StatusError(self.error.code, self.error.message, self.error.trailers)

    def deliver(self, data: bytes) -> None:
        """A request message from the connection: offered to the handler's ``take_now`` (see
        ``StreamHandler``) while the handler's task waits on the inbox and nothing is queued or
        handed to it, so no earlier message is overtaken; else queued (parsed, if it was).

        A fault in ``take_now`` is logged and the message queued: the handler's own task then
        meets whatever is wrong, and one stream fails, not the connection."""
        handler = self.ctx._handler  # (the registered StreamHandler)
        stats = self.inbox.statistics()
        if (handler is None or self.error is not None or stats.current_buffer_used
                or not stats.tasks_waiting_receive):
            self.inbox_send.send_nowait(data)
            return
        message = self.request_type()
        try:
            message.ParseFromString(data)
        except DecodeError:
            self.inbox_send.send_nowait(data)  # ``receive`` reports it
            return
        try:
            taken = handler.take_now(message)
        except Exception:
            log.exception("%s on stream %d from %s: take_now failed", self.ctx.method, self.sid,
                          self.conn.peer)
            taken = False
        if taken:
            self.conn.h2.consumed(self.sid, len(data) + PREFIX)  # (sent by the reader's send_pending)
        else:
            self.inbox_send.send_nowait((message, len(data)))

    async def receive_one(self) -> Any:
        message = await self.receive()
        if message is None or await self.receive() is not None:
            raise invalid_status("expected exactly one request message")
        return message

    async def send(self, message: Any) -> None:
        """Frame ``message`` and send it within the peer's flow-control windows."""
        data = message.SerializeToString()
        limits = self.conn.h2.limits
        if len(data) > limits.max_message_bytes:
            raise StatusError.of(ShardError(
                ErrorCode.RESOURCE_EXHAUSTED, "response message larger than the limit",
                retryable=False, reason="MESSAGE_TOO_LARGE"))
        h2c, framed = self.conn.h2, struct.pack(">?I", False, len(data)) + data
        view = memoryview(framed)
        blocked_since: float | None = None  # the peer has given no window since then
        while view:
            await trio.lowlevel.checkpoint_if_cancelled()  # the stream may be gone
            try:
                if not self.headers_sent:
                    h2c.start_response(self.sid)
                    self.headers_sent = True
                if len(view) == len(framed) and h2c.send_message(self.sid, framed):
                    break  # the whole message as one DATA frame (``send_now``'s framing)
                window = h2c.flow_control_window(self.sid)
                if window > 0:
                    h2c.send_data(self.sid, bytes(view[:window]))
                    view = view[window:]
                    blocked_since = None
            except h2.exceptions.ProtocolError:  # h2 refuses to send: connection is closing
                self.conn.close(EndReason.CONNECTION_LOST)
                await trio.lowlevel.checkpoint()
                raise trio.BrokenResourceError("connection closed") from None
            if window <= 0:
                # What h2 framed so far must reach the peer before we wait for its window: the
                # peer acknowledges only what it received (a response larger than the window
                # used to wait here until some other frame flushed it, e.g. a keepalive PING).
                self.conn.send_pending()
                # Woken by any WINDOW_UPDATE of the connection: only a window for this stream
                # counts as progress, so the idle clock runs from the first wait.
                if blocked_since is None:
                    blocked_since = trio.current_time()
                with trio.move_on_at(blocked_since + limits.send_idle_timeout) as idle:
                    await self.window.wait()
                self.window = trio.Event()
                if idle.cancelled_caught:
                    await self._stalled("no flow-control window")
        if not await self.conn.flush(limits.send_idle_timeout, self.ctx.write_through):
            await self._stalled("nothing written to the socket")

    def send_now(self, message: Any, flush: bool = True) -> bool:
        """Frame ``message`` at once, without waiting, or do nothing and return False.

        Why: a served token used to pass from the session's task through a channel to the
        handler's task, then to the connection's writer: three task steps (and scheduler
        passes) per token where one does. The producer calls this instead while the handler
        is idle (so responses stay in order); it refuses whatever would need a wait: no
        window for the whole message, more than ``OUTBOX_HIGH_WATER`` bytes unsent, a call
        that is ending, an oversized message (``send`` then waits, or raises, as before).
        ``flush``: False when the caller frames another response right after this one (a
        result and its ``Usage``): then both leave in one socket write."""
        conn = self.conn
        if self.scope.cancel_called or conn.unsent > OUTBOX_HIGH_WATER:
            return False
        data = message.SerializeToString()
        h2c = conn.h2
        if len(data) > h2c.limits.max_message_bytes:
            return False
        try:
            if h2c.flow_control_window(self.sid) < len(data) + PREFIX:
                return False
            if not self.headers_sent:
                h2c.start_response(self.sid)
                self.headers_sent = True
            framed = struct.pack(">?I", False, len(data)) + data
            if not h2c.send_message(self.sid, framed):
                h2c.send_data(self.sid, framed)
        except h2.exceptions.ProtocolError:  # the connection is closing: ``send`` reports it
            return False
        conn.send_soon(self.streaming and flush)
        return True

    async def _stalled(self, what: str) -> None:
        """The peer read nothing for ``send_idle_timeout``: end the call (RESOURCE_EXHAUSTED,
        reason SEND_IDLE_TIMEOUT; a session is released, not retained)."""
        log.info("ending %s on stream %d from %s: %s for %gs (the client stopped reading)",
                 self.ctx.method, self.sid, self.conn.peer, what,
                 self.conn.h2.limits.send_idle_timeout)
        self.abort(EndReason.SEND_STALLED)
        await trio.lowlevel.checkpoint()  # raises Cancelled: this task runs in self.scope
        raise trio.BrokenResourceError("the client stopped reading")  # outside self.scope


def too_large(message: str) -> StatusError:
    """RESOURCE_EXHAUSTED with the Shard trailers: the same message never fits (not retryable)."""
    return StatusError.of(ShardError(
        ErrorCode.RESOURCE_EXHAUSTED, message, retryable=False, reason="MESSAGE_TOO_LARGE"))


def invalid_status(message: str) -> StatusError:
    """INVALID_ARGUMENT with the Shard trailers, on unary calls and streams alike (a request
    message that does not parse, or a unary call without exactly one)."""
    return StatusError.of(ShardError(ErrorCode.INVALID_ARGUMENT, message, retryable=False))
