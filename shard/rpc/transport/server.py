"""The server side: one task per connection (reader), its writer, one task per call.

purerpc's message codec, header parsing and ``Service`` registry are kept; its connection loop
(``Server`` / ``ConnectionHandler`` / ``GRPCSocket``) is replaced, because that is where
purerpc 0.8.0 falls short: deadlines never enforced, RST_STREAM and dropped connections never
surfaced, bare ``except:`` swallowing ``trio.Cancelled``, SO_REUSEPORT on all interfaces,
sockets never closed, one oversized message killing the connection, 64 MiB / 1 GiB windows,
no GOAWAY.

Resource handling: every connection and call is a task in an owner nursery under ``serve()``;
``serve_listeners`` closes each accepted stream, ``serve`` closes the listener.  Per-call state
(call table, purerpc read buffer, ledger entry) is dropped when the call task ends.  A peer
that stops reading stalls its own connection (see ``Outbox``), and a call that cannot send for
``send_idle_timeout`` ends; a connection that sends no valid HTTP/2 within
``handshake_timeout`` or does not answer a keepalive PING is closed, and one that sends any kind of frame
faster than its budget allows (``TransportLimits.new_streams``, ``resets``, ``pings``, ...;
counted per frame, ``shard.rpc.transport.frames``) gets GOAWAY(ENHANCE_YOUR_CALM); its
host's next connections start from the budgets it left.

Abuse of the inbound buffers: a service registered with ``authorize`` has that hook run from
the call's headers before a byte of its DATA is acknowledged (``BoundedH2`` gates every new
stream), so an unauthenticated peer can never make the worker buffer more than the windows it
was given at connect; a request message not finished within ``message_timeout`` fails its
stream and gives its bytes back (one watchdog task per connection).

Drain: ``Server.drain()`` sends GOAWAY on every connection at once, in two steps (2^31-1 with a
PING, then the last stream id once the PING is acknowledged: a stream the client opened before it
saw the GOAWAY is served, not refused unseen), and refuses streams above that id (REFUSED_STREAM,
which clients retry elsewhere); ``end_calls()`` then ends every
call still open with UNAVAILABLE and a ``shard-error-bin`` DRAINING trailer, and
``wait_flushed()`` waits (on events) until those statuses are written.  Cancelling ``serve`` does
all three, bounded by ``flush_timeout``, before the sockets close.

The hardening keeps stock purerpc's throughput (docs/benchmarks.md, "The stack's floor").
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import socket
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import h2.exceptions
import purerpc
import trio
from h2.errors import ErrorCodes
from purerpc.grpclib.events import (
    MessageReceived,
    RequestEnded,
    RequestReceived,
    WindowUpdated,
)
from purerpc.grpclib.exceptions import ProtocolError
from purerpc.grpclib.headers import b64encode, sanitize_headers
from purerpc.rpc import Cardinality

from ..errors import ERROR_TRAILER, STATUS_DETAILS_TRAILER, ErrorCode, ShardError
from .call import (
    END_STATUS,
    END_TRAILERS,
    Call,
    CallContext,
    EndReason,
    Requests,
    StatusError,
    too_large,
)
from .frames import FrameFlood, PeerMemory
from .wire import (
    OUTBOX_HIGH_WATER,
    READ_SIZE,
    BoundedH2,
    BufferPool,
    Outbox,
    Outcome,
    Signal,
    DRAIN_PING,
    MAX_STREAM_ID,
    TransportLimits,
    goaway_frame,
)

log = logging.getLogger(__name__)

_KEEPALIVE_PING = b"shard-ka"


class _Connection:
    """One HTTP/2 connection: a reader (this task), a writer task, a watchdog (handshake and
    keepalive), a message timer (``message_timeout``) and one task per call."""

    def __init__(self, server: Server, stream: trio.abc.Stream, peer: str, host: str) -> None:
        self.server, self.stream, self.peer, self.host = server, stream, peer, host
        self.budget = server.peers.budget(host)  # frames it may send (reconnects share it)
        self.h2 = BoundedH2(server.limits, client_side=False, pool=server.pool,
                            gate_streams=True, clock=trio.current_time, budget=self.budget)
        self.h2.on_acks = self.send_pending
        self.h2.on_message_start = self._message_started
        self._message_wake = trio.Event()  # an unfinished message began (the timer sleeps)
        self.calls: dict[int, Call] = {}
        self.streaming_calls = 0
        self._outbox = Outbox(on_drained=server.notify)  # bytes h2 produced, not sent yet
        self._nursery: trio.Nursery | None = None
        self._greeted = trio.Event()  # the peer's preface and SETTINGS arrived
        self._heard = True  # bytes arrived since the watchdog last looked
        self._going_away = False  # the first GOAWAY (no new streams) was sent
        self.goaway_last: int | None = None  # final GOAWAY sent: streams above this id are refused

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.h2.initiate_connection()
                self.send_pending()
                if self.server.draining:
                    self.goaway()
                nursery.start_soon(self._write_loop)
                nursery.start_soon(self._watchdog)
                nursery.start_soon(self._time_messages)
                await self._read_loop()
                self.close(EndReason.CONNECTION_LOST)
        finally:
            self.h2.close_ledger()
            self.server.peers.left(self.host, self.budget)
            if log.isEnabledFor(logging.DEBUG):  # its counters, to compare with a cut's
                log.debug("connection from %s closed (%s)", self.peer,
                          _evidence(self.budget.counters()))

    def abort_calls(self, reason: EndReason) -> None:
        for call in list(self.calls.values()):
            call.abort(reason)

    def close(self, reason: EndReason) -> None:
        """End every call with ``reason``, then the connection (its stream is closed by
        ``serve_listeners``)."""
        self.abort_calls(reason)
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def goaway(self) -> None:
        """Graceful GOAWAY in two steps, as gRPC's own servers drain: GOAWAY(2^31-1) and a PING
        now; once the peer acknowledges that PING (it has then seen the GOAWAY and opens no more
        streams here), or after ``keepalive_timeout``, GOAWAY with the last stream it opened.

        A stream the peer opened before it saw the first frame is therefore served (a draining
        worker answers a new session with DRAINING, a status the client reads) instead of being
        refused unseen: grpcio retries a stream refused unseen transparently, and that retry
        (grpcio 1.85) could outlive the call's deadline. Streams above the final id are refused
        with REFUSED_STREAM."""
        if self._going_away:
            return
        self._going_away = True
        self.send_pending()  # frames h2 already produced go first
        self._outbox.push(goaway_frame(MAX_STREAM_ID))
        try:
            self.h2.h2_connection.ping(DRAIN_PING)
        except h2.exceptions.ProtocolError:
            self.final_goaway()
            return
        self.send_pending()
        if self._nursery is None:
            self.final_goaway()
        else:
            self._nursery.start_soon(self._final_goaway_after, self.server.limits.keepalive_timeout)

    def final_goaway(self) -> None:
        """The second GOAWAY: the last stream the peer opened; later ones are refused."""
        if self.goaway_last is None:
            self.goaway_last = self.h2.h2_connection.highest_inbound_stream_id
            self.send_pending()
            self._outbox.push(goaway_frame(self.goaway_last))

    async def _final_goaway_after(self, timeout: float) -> None:
        await trio.sleep(timeout)  # a peer that never answers the PING
        self.final_goaway()

    @property
    def unsent(self) -> int:
        """Bytes queued for the peer and not written yet."""
        return len(self._outbox)

    def send_pending(self) -> None:
        self._outbox.push(self.h2.data_to_send())

    def send_soon(self, write: bool) -> None:
        """Queue h2's output for a response framed by ``send_now``; with ``write``, written at
        once by the caller when the connection carries only that one stream (nothing to
        coalesce with, and the writer's task step is saved), else by the writer with the
        others. Without ``write`` another response follows at once and writes both (through
        ``send_now`` or the handler's ``send``: every push writes or wakes the writer)."""
        self._outbox.push(self.h2.data_to_send(),
                          write_through=write and self.streaming_calls == 1, wake=write)

    async def flush(self, idle: float = math.inf, write: bool = False) -> bool:
        """Queue h2's output; a handler waits here while the peer reads slowly. False if
        nothing was written for ``idle`` seconds. ``write``: written at once by the caller
        if the writer is idle (``CallContext.write_through``).

        No scheduler pass of its own, so responses already queued join the same socket write:
        a handler frames at most what its source holds (a session's bounded channel) before it
        waits, and never more than ``OUTBOX_HIGH_WATER`` unsent bytes or the peer's window."""
        return await self._outbox.flush(self.h2, idle, schedule=False, write_through=write)

    async def _write_loop(self) -> None:
        try:
            await self._outbox.write_forever(self.stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.close(EndReason.CONNECTION_LOST)

    async def _watchdog(self) -> None:
        """Close a connection that never speaks HTTP/2, or stops answering keepalive PINGs."""
        limits = self.server.limits
        with trio.move_on_after(limits.handshake_timeout):
            await self._greeted.wait()
        if not self._greeted.is_set():
            self.server.cut("handshake_timeout")
            log.info("closing connection from %s: no HTTP/2 handshake within %gs",
                     self.peer, limits.handshake_timeout)
            self.close(EndReason.CONNECTION_LOST)
            return
        while True:
            self._heard = False
            await trio.sleep(limits.keepalive_interval)
            if self._heard:
                continue
            try:
                self.h2.h2_connection.ping(_KEEPALIVE_PING)
            except h2.exceptions.ProtocolError:
                self.close(EndReason.CONNECTION_LOST)
                return
            self.send_pending()
            await trio.sleep(limits.keepalive_timeout)
            if not self._heard:
                self.server.cut("keepalive_timeout")
                log.info("closing connection from %s: no answer to a keepalive PING in %gs",
                         self.peer, limits.keepalive_timeout)
                self.close(EndReason.CONNECTION_LOST)
                return

    def _message_started(self) -> None:
        self._message_wake.set()

    async def _time_messages(self) -> None:
        """Fail the streams whose request message is not finished within ``message_timeout``
        (sleeps until the oldest unfinished message is due; no polling)."""
        timeout = self.server.limits.message_timeout
        while True:
            oldest = self.h2.oldest_message_start()
            if oldest is None:
                self._message_wake = trio.Event()
                await self._message_wake.wait()
                continue
            await trio.sleep_until(oldest + timeout)
            for sid in self.h2.messages_started_before(trio.current_time() - timeout):
                self._message_timed_out(sid, timeout)
            self.send_pending()

    def _message_timed_out(self, sid: int, timeout: float) -> None:
        log.info("stream %d from %s: request message not finished within %gs",
                 sid, self.peer, timeout)
        self.h2.drop_input(sid)  # its bytes go back to the pool and to the peer's window
        call = self.calls.get(sid)
        if call is None:
            self.h2.forget(sid)
            return
        error = StatusError.of(ShardError(
            ErrorCode.RESOURCE_EXHAUSTED,
            f"request message not finished within {timeout:g}s (message_timeout)",
            retryable=True, reason="MESSAGE_TIMEOUT"))
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            call.inbox_send.send_nowait(error)
        call.inbox_send.close()

    async def _read_loop(self) -> None:
        while True:
            try:
                data = await self.stream.receive_some(READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            self._heard = True
            try:
                events = self.h2.receive_data(data)
            except FrameFlood as exc:
                # h2 queued GOAWAY(ENHANCE_YOUR_CALM) and dropped the read's events: no call
                # past the limit starts (the budget's levels outlive the connection).
                self.server.cut(f"{exc.kind}_flood")
                log.warning("closing connection from %s: %s (%s)", self.peer, exc,
                            _evidence(self.budget.counters()))
                self.send_pending()
                with trio.move_on_after(1.0):
                    await self._outbox.wait_below(0)
                return
            except (h2.exceptions.ProtocolError, ProtocolError) as exc:
                # h2 queued a GOAWAY with the error code (FRAME_SIZE_ERROR, ...): best effort.
                self.server.cut("protocol_error")
                log.info("closing connection from %s: %r (%s)", self.peer, exc,
                         _evidence(self.budget.counters()))
                self.send_pending()
                with trio.move_on_after(1.0):
                    await self._outbox.wait_below(0)
                return
            for event in events:
                self._dispatch(event)
            self.send_pending()
            # Stop reading while the peer does not read: otherwise frames h2 answers by itself
            # (PING and SETTINGS ACKs) would pile up in the outbox without a bound.
            await self._outbox.wait_below(OUTBOX_HIGH_WATER)

    def _dispatch(self, event: Any) -> None:
        sid = event.stream_id
        if isinstance(event, WindowUpdated):
            for call in self.calls.values() if sid == 0 else filter(None, [self.calls.get(sid)]):
                call.window.set()
        elif isinstance(event, RequestReceived):
            self._start(event)
        elif isinstance(event, Signal):
            self._signal(event)
        elif (call := self.calls.get(sid)) is None:
            self.h2.forget(sid)
        elif isinstance(event, MessageReceived):
            call.deliver(event.data)
        elif isinstance(event, RequestEnded):
            call.inbox_send.close()

    def _signal(self, signal: Signal) -> None:
        sid, kind = signal.stream_id, signal.kind
        if kind == "settings":
            self._greeted.set()
        elif kind == "malformed":
            self._refuse_call(sid, ShardError(ErrorCode.INTERNAL, "malformed request headers"))
        elif kind == "goaway":
            self.close(EndReason.CONNECTION_LOST)
        elif kind == "drain_ack":
            self.final_goaway()
        else:
            if (call := self.calls.get(sid)) is None:
                self.h2.forget(sid)
            elif kind == "oversized":
                call.inbox_send.send_nowait(too_large("request message larger than the limit"))
                call.inbox_send.close()
            elif kind == "compressed":
                call.inbox_send.send_nowait(StatusError.of(ShardError(
                    ErrorCode.UNSUPPORTED_FEATURE, "compressed messages are not supported")))
                call.inbox_send.close()
            elif kind == "reset":
                call.abort(EndReason.CLIENT_CANCELLED)

    def _refuse_call(self, sid: int, err: ShardError) -> None:
        """End a stream before any handler runs: the status with the Shard trailers."""
        self.end_stream(sid, False, int(err.grpc_status), err.message, err.trailers())

    def _refuse(self, sid: int) -> None:
        """REFUSED_STREAM: the call did no work, so any client may retry it elsewhere."""
        self.h2.forget(sid)
        try:
            self.h2.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
        except h2.exceptions.ProtocolError as exc:
            log.debug("cannot refuse stream %d: %r", sid, exc)

    def _start(self, event: RequestReceived) -> None:
        if self.goaway_last is not None and event.stream_id > self.goaway_last:
            self._refuse(event.stream_id)
            return
        service = self.server._services.get(event.service_name)
        bound = None if service is None else service.methods.get(event.method_name)
        if bound is None:
            method = f"/{event.service_name}/{event.method_name}"
            self._refuse_call(event.stream_id, ShardError(
                ErrorCode.UNSUPPORTED_FEATURE, f"method {method} is not implemented"))
            return
        if event.message_encoding not in (None, "identity"):
            # Only identity encoding (see wire._refuse_compressed); the gRPC spec's answer to
            # an unsupported encoding is UNIMPLEMENTED.
            self._refuse_call(event.stream_id, ShardError(
                ErrorCode.UNSUPPORTED_FEATURE,
                f"message encoding {event.message_encoding!r} is not supported"))
            return
        streaming = bound.signature.cardinality != Cardinality.UNARY_UNARY
        if streaming and self.streaming_calls >= self.server.limits.max_concurrent_streams:
            # The advertised stream limit keeps room for unary calls (Cancel, GetMetrics), so
            # a connection full of sessions can still reach the worker; refuse the extra stream.
            self._refuse_call(event.stream_id, ShardError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"at most {self.server.limits.max_concurrent_streams} streaming calls per "
                "connection; open another connection"))
            return
        call = Call(self, event, bound.signature.request_type, streaming)
        call.gate = self.server._gates.get(event.service_name)
        if call.gate is None:
            self.h2.open_gate(call.sid)  # nothing to check: DATA may be acknowledged now
        self.calls[call.sid] = call
        self.streaming_calls += streaming
        assert self._nursery is not None
        self._nursery.start_soon(self._run_call, call, bound, event)

    async def _run_call(self, call: Call, bound: Any, event: RequestReceived) -> None:
        call.make_current()
        try:
            if call.ctx.deadline == math.inf:
                outcome = await self._invoke(call, bound, event)
            else:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._expire, call)
                    outcome = await self._invoke(call, bound, event)
                    nursery.cancel_scope.cancel()
            if outcome is not None:
                self.end_stream(call.sid, call.headers_sent, *outcome)
        finally:
            del self.calls[call.sid]
            self.streaming_calls -= call.streaming
            call.inbox_send.close()
            call.inbox.close()
            self.h2.forget(call.sid)
            self.send_pending()
            self.server.notify()

    @staticmethod
    async def _expire(call: Call) -> None:
        await trio.sleep_until(call.ctx.deadline)
        call.abort(EndReason.DEADLINE)

    async def _invoke(self, call: Call, bound: Any, event: RequestReceived) -> Outcome | None:
        """Run the handler; return (code, message, trailers) to send, None to send nothing."""
        ctx = call.ctx
        try:
            with call.scope:
                if call.gate is not None:
                    await self._authorize(call, call.gate)
                await self._call_handler(call, bound, event)
                if ctx.end_reason is None:
                    return 0, "", ctx.trailers
        except Exception as exc:  # Cancelled is a BaseException: never caught here
            if ctx.end_reason is None:
                error = _find_status_error(exc)
                if error is not None:
                    return error.code, error.message, [*ctx.trailers, *error.trailers]
                log.error("handler %s failed", ctx.method, exc_info=exc)
                trailers = list(ctx.trailers)
                if not any(key == ERROR_TRAILER for key, _ in trailers):
                    trailers += _INTERNAL_TRAILERS
                return 13, "internal error", trailers
            refusal = _find_status_error(exc)
            if refusal is None:
                log.warning("handler %s raised while ending (%s)", ctx.method, ctx.end_reason,
                            exc_info=exc)
            else:  # a structured refusal the peer no longer waits for: nothing went wrong here
                log.debug("handler %s refused (%s: %s) while ending (%s)", ctx.method,
                          refusal.code, refusal.message, ctx.end_reason)
        assert ctx.end_reason is not None  # only abort() cancels call.scope
        status = END_STATUS[ctx.end_reason]
        if status is None:
            return None
        # The transport's own status always carries its Shard error, also when the end raced
        # the handler producing one (a deadline expiring while a session's error status was
        # being made dropped that refusal, and with it every shard-error-bin trailer).
        trailers = list(ctx.trailers)
        if not any(key == ERROR_TRAILER for key, _ in trailers):
            trailers += END_TRAILERS[ctx.end_reason]
        return (*status, trailers)

    async def _authorize(
        self, call: Call, gate: Callable[[CallContext], Awaitable[Any]]
    ) -> None:
        """Run the service's authorize hook from the headers; only then acknowledge DATA."""
        try:
            await gate(call.ctx)
        except ShardError as err:
            raise StatusError.of(err) from None
        self.h2.open_gate(call.sid)
        self.send_pending()

    @staticmethod
    async def _call_handler(call: Call, bound: Any, event: RequestReceived) -> None:
        cardinality = bound.signature.cardinality
        if cardinality in (Cardinality.UNARY_UNARY, Cardinality.UNARY_STREAM):
            argument = await call.receive_one()
        else:
            argument = Requests(call)
        if cardinality in (Cardinality.UNARY_UNARY, Cardinality.STREAM_UNARY):
            await call.send(await bound.method_fn(argument, request=event))
            return
        responses = bound.method_fn(argument, request=event)
        try:
            async for response in responses:
                await call.send(response)
        finally:
            aclose = getattr(responses, "aclose", None)
            if aclose is not None:
                await aclose()

    def end_stream(
        self, sid: int, headers_sent: bool, code: int, message: str, trailers: Sequence[Any]
    ) -> None:
        """Send the status and trailers; reset the stream if the client is still sending.

        ``grpc-status-details-bin`` (a serialized google.rpc.Status) is the one ``grpc-``
        trailer a handler may set; purerpc refuses ``grpc-`` keys, so it is added after them.
        """
        details: list[tuple[str, str]] = []
        try:
            pairs = [(key.lower(), value) for key, value in trailers]
            details = [(k, b64encode(v)) for k, v in pairs if k == STATUS_DETAILS_TRAILER]
            pairs = [(k, v) for k, v in pairs if k != STATUS_DETAILS_TRAILER]
            list(sanitize_headers(pairs))  # validate: -bin keys take bytes, no grpc- keys
        except (ValueError, TypeError, AttributeError):
            log.error("invalid trailing metadata on stream %d: %r", sid, trailers)
            code, message = 13, "internal error"
            pairs = [_INTERNAL_TRAILERS[0]]
            details = [(k, b64encode(v)) for k, v in _INTERNAL_TRAILERS[1:]]
        head = [] if headers_sent else [(":status", "200"), ("content-type", "application/grpc")]
        head.append(("grpc-status", str(code)))
        if message:
            head.append(("grpc-message", urllib.parse.quote(message, safe="")))
        try:
            # As purerpc's end_response/respond_status do, plus the status details.
            self.h2.h2_connection.send_headers(
                sid, [*head, *sanitize_headers(pairs), *details], end_stream=True
            )
            stream = self.h2.h2_connection.streams.get(sid)
            if stream is not None and not stream.closed:
                self.h2.reset_stream(sid, ErrorCodes.NO_ERROR)
        except h2.exceptions.ProtocolError as exc:  # stream or connection already gone
            log.debug("cannot end stream %d: %r", sid, exc)
        self.h2.forget(sid)
        self.send_pending()


_INTERNAL_TRAILERS = ShardError(ErrorCode.INTERNAL).trailers()


def _evidence(counters: dict[str, int]) -> str:
    """A cut connection's counters for the log: budgeted frames by kind, then what it was sent."""
    sent = ("data_frames_sent", "data_bytes_sent", "calls_answered")
    frames = ", ".join(f"{n} {kind}" for kind, n in counters.items() if kind not in sent)
    return (f"it sent {frames or 'no budgeted frames'}; it was sent "
            f"{counters['data_frames_sent']} DATA frames ({counters['data_bytes_sent']} bytes) "
            f"on {counters['calls_answered']} answered calls")


def _find_status_error(exc: BaseException) -> StatusError | None:
    """The StatusError a handler raised, also from inside a nursery's exception group."""
    if isinstance(exc, BaseExceptionGroup):
        match, rest = exc.split(StatusError)
        if match is None or rest is not None:
            return None
        exc = match
        while isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
    return exc if isinstance(exc, StatusError) else None


def _peer_of(stream: trio.abc.Stream) -> tuple[str, str]:
    """The peer's address as gRPC names it (``ipv4:host:port``) and its host alone."""
    raw = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    try:
        sock = raw.socket  # type: ignore[attr-defined]
        host, port = sock.getpeername()[:2]
    except (AttributeError, OSError):
        return "unknown", "unknown"
    if sock.family == socket.AF_INET6:
        return f"ipv6:[{host}]:{port}", str(host)
    return f"ipv4:{host}:{port}", str(host)


class Server:
    """A purerpc server bound to one host:port, with purerpc's connection loop replaced.

    Handlers keep purerpc's shape (unary input: one message; stream input: an async
    iterator; stream output: an async iterator) and read their call through
    ``current_call()``.  ``ssl_context``, if given, gets ALPN ``h2`` set on it.

    Error handling: ``StatusError`` -> its status and trailers; any other exception ->
    INTERNAL "internal error" and a log record with the traceback; a deadline -> the handler
    is cancelled and the call ends DEADLINE_EXCEEDED (also when the handler was producing its
    own error status at that moment); a client cancel or lost connection -> the handler is
    cancelled and nothing is sent; a drain or stop -> UNAVAILABLE (DRAINING); a client that
    reads nothing for ``send_idle_timeout`` -> RESOURCE_EXHAUSTED (SEND_IDLE_TIMEOUT).  Every
    status the transport itself produces carries the ``shard-error-bin`` and
    ``grpc-status-details-bin`` trailers; ``ctx.trailers`` go out with every status.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: TransportLimits = TransportLimits(),
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.host, self.port, self.limits = host, port, limits
        self._ssl_context = ssl_context
        if ssl_context is not None:
            ssl_context.set_alpn_protocols(["h2"])  # gRPC clients require ALPN h2
        self._services: dict[str, purerpc.Service] = {}
        self._gates: dict[str, Callable[[CallContext], Awaitable[Any]]] = {}
        self._connections: set[_Connection] = set()
        # Inbound bytes of all connections: a reserve for each connection slot, the rest lent.
        self.pool = BufferPool(limits.total_buffer_bytes, slots=limits.max_connections,
                               reserve=limits.connection_reserve_bytes)
        self.draining = False
        self.refused_connections = 0  # accepted and closed at once: over max_connections
        #: Connections the server closed on a peer, by reason (``cut``): an operator tells an
        #: attack from a false positive with these and the log line each cut writes.
        self.cuts: collections.Counter[str] = collections.Counter()
        # Per peer host: the levels of the frame budgets its closed connections left.
        self.peers = PeerMemory(limits.frame_rates, trio.current_time)
        self._changed = trio.Event()  # set whenever a call ends or an outbox drains
        self._accepting = trio.CancelScope()  # the accept loop; cancelled by drain()

    def add_service(
        self, service: purerpc.Service, *,
        authorize: Callable[[CallContext], Awaitable[Any]] | None = None,
    ) -> None:
        """Register a ``purerpc.Service`` (e.g. ``servicer.service``).

        ``authorize(ctx)``, if given, runs for every call of the service from its headers,
        before a byte of its request is acknowledged (HTTP/2 flow control) or its handler
        starts; it refuses by raising ``StatusError`` or ``ShardError`` (e.g.
        UNAUTHENTICATED), which ends the call with that status and drops what the peer sent.
        """
        if service.name in self._services:
            raise ValueError(f"service {service.name!r} is already registered")
        self._services[service.name] = service
        if authorize is not None:
            self._gates[service.name] = authorize

    def cut(self, reason: str) -> None:
        """Count a connection closed on its peer: ``<kind>_flood`` (a frame budget, see
        ``shard.rpc.transport.frames``), ``protocol_error``, ``handshake_timeout``,
        ``keepalive_timeout``, ``max_connections``."""
        self.cuts[reason] += 1

    @property
    def open_connections(self) -> int:
        """Live HTTP/2 connections (for metrics, and tests proving nothing lingers)."""
        return len(self._connections)

    @property
    def open_calls(self) -> int:
        """Calls whose task has not finished yet, over all connections."""
        return sum(len(conn.calls) for conn in self._connections)

    @property
    def buffered_bytes(self) -> int:
        """Inbound bytes held now: messages (queued and unfinished) and frames in reassembly."""
        return self.pool.held + sum(c.h2.buffered_frame_bytes for c in self._connections)

    def notify(self) -> None:
        """Wake ``wait_flushed`` (a call ended or an outbox was written out)."""
        self._changed.set()
        self._changed = trio.Event()

    def drain(self) -> None:
        """Stop accepting connections and send GOAWAY on every open one now (two steps, see
        ``_Connection.goaway``): running calls go on, streams opened after the client saw it are
        refused with REFUSED_STREAM (a client retries them elsewhere)."""
        self.draining = True
        self._accepting.cancel()
        for conn in list(self._connections):
            conn.goaway()

    def end_calls(self) -> None:
        """End every open call with UNAVAILABLE and the DRAINING trailer (the handlers are
        cancelled; their ``finally`` blocks run before the status is sent)."""
        self.drain()
        for conn in list(self._connections):
            conn.abort_calls(EndReason.SHUTDOWN)

    async def wait_calls_ended(self, method: str) -> None:
        """Wait until no call of ``method`` (e.g. ``"/shard.v1.Shard/Session"``) is open."""
        while any(call.ctx.method == method
                  for conn in self._connections for call in conn.calls.values()):
            await self._changed.wait()

    async def wait_flushed(self) -> None:
        """Wait until no call runs and every connection has written out what it queued.

        A graceful stop waits here before cancelling ``serve``, so the last responses and
        trailers of finished calls reach their clients instead of dying with the socket.
        """
        while self.open_calls or any(conn.unsent for conn in self._connections):
            await self._changed.wait()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until cancelled; ``task_status.started(port)`` once bound.

        On cancellation every live call gets ``end_reason = SHUTDOWN`` *before* its handler is
        cancelled (the work runs in a shielded scope that only this task cancels), and the
        statuses get up to ``limits.flush_timeout`` seconds to reach the clients.
        """
        sock_listener = await self._bind()
        async with sock_listener:
            port = sock_listener.socket.getsockname()[1]
            listener: trio.abc.Listener[Any] = sock_listener
            if self._ssl_context is not None:
                listener = trio.SSLListener(sock_listener, self._ssl_context,
                                            https_compatible=False)
            work = trio.CancelScope(shield=True)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._accept, listener, work)
                task_status.started(port)
                try:
                    await trio.sleep_forever()
                finally:
                    self.end_calls()
                    with trio.CancelScope(shield=True):
                        with trio.move_on_after(self.limits.flush_timeout):
                            await self.wait_flushed()
                    work.cancel()
    async def _bind(self) -> trio.SocketListener:
        infos = await trio.socket.getaddrinfo(
            self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = trio.socket.socket(family, kind, proto)
        try:
            # SO_REUSEADDR lets a restart take a port in TIME_WAIT; unlike purerpc's
            # SO_REUSEPORT it never lets a second live server share the port.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            await sock.bind(address)
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"cannot listen on {self.host}:{self.port}: "
                                     f"{exc.strerror}") from exc
        return trio.SocketListener(sock)

    async def _accept(self, listener: trio.abc.Listener[Any], work: trio.CancelScope) -> None:
        with work:
            async with trio.open_nursery() as connections:
                with self._accepting:
                    await trio.serve_listeners(
                        self._handle, [listener], handler_nursery=connections)
                # Draining: new connections are refused by the OS, so a client fails over at
                # once instead of connecting to be told GOAWAY; open ones keep running.
                await listener.aclose()

    async def _handle(self, stream: trio.abc.Stream) -> None:
        peer, host = _peer_of(stream)
        if len(self._connections) >= self.limits.max_connections:
            # Closed at once (serve_listeners closes the stream when this returns): a flood
            # of connections costs a socket each for a moment, never a connection's buffers.
            self.refused_connections += 1
            self.cut("max_connections")
            log.warning("refusing a connection from %s: %d connections open",
                        peer, len(self._connections))
            return
        raw = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
        with contextlib.suppress(AttributeError, OSError):  # find peers that vanish silently
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # type: ignore[attr-defined]
        conn = _Connection(self, stream, peer, host)
        self._connections.add(conn)
        try:
            await conn.run()
        except Exception:  # one broken connection must not stop the server
            log.exception("connection from %s failed", conn.peer)
        finally:
            self._connections.discard(conn)
            self.notify()
