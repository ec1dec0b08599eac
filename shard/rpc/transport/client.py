"""The client side, for shard/client.py: purerpc's codec driven by our own reader and writer.

It sends ``grpc-timeout`` and RST_STREAM (purerpc's client does neither), surfaces RST_STREAM
and GOAWAY as statuses, and gets the same bounded settings and flow ledger as the server
(see ``wire``): no 64 MiB / 1 GiB windows, no server-initiated streams, inbound bytes
acknowledged only while the caller keeps up.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import struct
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import h2.exceptions
import trio
from google.protobuf.message import DecodeError, Message
from h2.connection import ConnectionState
from h2.errors import ErrorCodes
from hyperframe.frame import GoAwayFrame
from purerpc.grpclib.events import (
    MessageReceived,
    ResponseEnded,
    ResponseReceived,
    WindowUpdated,
)
from purerpc.grpclib.exceptions import StreamClosedError

from ..errors import ErrorCode, GrpcStatus, ShardError
from .wire import PREFIX, BoundedH2, Outbox, Signal, TransportLimits

M = TypeVar("M", bound=Message)


class _ClientH2(BoundedH2):
    """A graceful GOAWAY lets the streams up to its last stream id finish, but h2 3.2 refuses
    every frame after one, even DATA for those streams in the same read: reopen h2's state
    right after it processed the GOAWAY frame (ClientConnection opens no new streams)."""

    def __init__(self, limits: TransportLimits) -> None:
        super().__init__(limits, client_side=True)
        h2c = self.h2_connection
        receive_goaway = h2c._receive_goaway_frame  # noqa: SLF001

        def receive_graceful_goaway(frame: Any) -> Any:
            pending = h2c.data_to_send()  # h2 drops queued output on GOAWAY (acks, resets)
            result = receive_goaway(frame)
            if frame.error_code == ErrorCodes.NO_ERROR:
                h2c.state_machine.state = ConnectionState.CLIENT_OPEN
                h2c._data_to_send = pending + h2c._data_to_send  # noqa: SLF001
            return result

        h2c._frame_dispatch_table[GoAwayFrame] = receive_graceful_goaway  # noqa: SLF001


def _grpc_timeout(seconds: float) -> datetime.timedelta:
    """A timedelta purerpc formats within gRPC's 8-digit limit (whole seconds past 99 s),
    rounded down: the server must never be told there is more time than the caller has."""
    if seconds >= 99:
        return datetime.timedelta(seconds=math.floor(seconds))
    return datetime.timedelta(microseconds=max(1, math.floor(seconds * 1e6)))


class ClientStream:
    """One call's HTTP/2 stream. Inbound messages are acknowledged (flow control) only when
    read, so the server can never push more than the stream window at a slow caller."""

    def __init__(self, conn: ClientConnection, sid: int, deadline: float) -> None:
        self.conn, self.sid, self.deadline = conn, sid, deadline
        self._in_send, self._in = trio.open_memory_channel[MessageReceived](math.inf)
        self.window = trio.Event()
        self.status: tuple[int, str] | None = None
        self.trailers: tuple[tuple[str, Any], ...] = ()
        # A trailers-only response (an error before any message) arrives as one HEADERS frame;
        # purerpc files its custom metadata under the response headers, so look there too.
        self.headers: tuple[tuple[str, Any], ...] = ()
        self._closed = False

    # ---- called by the reader -----------------------------------------------------------

    def deliver(self, event: Any) -> None:
        if isinstance(event, MessageReceived):
            try:
                self._in_send.send_nowait(event)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                self.conn.consumed(self.sid, event.flow_controlled_length + PREFIX)
        elif isinstance(event, ResponseEnded):
            self.finish(event.status.int_value, event.status.status_message, event.custom_metadata)

    def finish(self, code: int, message: str, trailers: Sequence[tuple[str, Any]] = ()) -> None:
        if self.status is None:
            self.status, self.trailers = (code, message), tuple(trailers)
        self._in_send.close()
        self.window.set()

    # ---- called by the call ---------------------------------------------------------------

    def error(self) -> ShardError | None:
        """The call's error once its status arrived (None for OK)."""
        if self.status is None or self.status[0] == GrpcStatus.OK:
            return None
        return ShardError.from_status(self.status[0], self.status[1], (*self.trailers, *self.headers))

    async def send(self, message: Message) -> None:
        data = message.SerializeToString()
        view = memoryview(struct.pack(">?I", False, len(data)) + data)
        with self._deadline_scope():
            while view:
                if self.status is not None:  # the server ended the call; receive() says why
                    await trio.lowlevel.checkpoint()  # a caller looping on send still yields
                    return
                window = self.conn.h2.flow_control_window(self.sid)
                if window > 0:
                    try:
                        self.conn.h2.send_data(self.sid, bytes(view[:window]))
                    except h2.exceptions.ProtocolError:
                        return  # stream closed under us: receive() reports why
                    view = view[window:]
                    self.conn.send_pending()
                else:
                    await self.window.wait()
                    self.window = trio.Event()
            await self.conn.flush()

    async def half_close(self) -> None:
        if self.status is None:
            try:
                self.conn.h2.end_request(self.sid)
            except (StreamClosedError, h2.exceptions.ProtocolError):
                return  # the stream is already closed: receive() reports why
            self.conn.send_pending()
        await trio.lowlevel.checkpoint()

    async def receive(self, message_type: type[M]) -> M | None:
        """The next message, or None once the response ended (then see ``error()``)."""
        try:
            # One already read from the socket is taken without a cancel scope (a scope per
            # message cost more than parsing it); still a checkpoint, and never past the deadline.
            if trio.current_time() >= self.deadline:
                raise trio.WouldBlock
            await trio.lowlevel.checkpoint_if_cancelled()  # (as a channel's receive does)
            event = self._in.receive_nowait()
            await trio.lowlevel.cancel_shielded_checkpoint()
        except (trio.EndOfChannel, trio.ClosedResourceError):  # (closed: its owner let it go)
            return None
        except trio.WouldBlock:
            with self._deadline_scope():
                try:
                    event = await self._in.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    return None
        self.conn.consumed(self.sid, event.flow_controlled_length + PREFIX)
        message = message_type()
        try:
            message.ParseFromString(event.data)
        except DecodeError:
            self.abort()
            raise ShardError(ErrorCode.INTERNAL, "cannot parse a response message") from None
        return message

    @contextlib.contextmanager
    def _deadline_scope(self) -> Iterator[None]:
        if self.deadline == math.inf:  # no deadline: no cancel scope to open and close
            yield
            return
        with trio.move_on_at(self.deadline) as scope:
            yield
        if scope.cancelled_caught:
            self.abort()
            raise ShardError(ErrorCode.DEADLINE_EXCEEDED, "the call deadline expired (client side)")

    def abort(self) -> None:
        """Leave the call: RST_STREAM(CANCEL) if it is still running, then free it. Sync, so it
        is safe in ``finally`` blocks and generator finalizers."""
        if self.status is None and not self.conn.dead:
            try:
                self.conn.h2.reset_stream(self.sid, ErrorCodes.CANCEL)
            except h2.exceptions.ProtocolError:
                pass  # already closed
            self.conn.send_pending()
        self.finish(GrpcStatus.CANCELLED, "cancelled by the client")
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.conn.streams.pop(self.sid, None)
        self.conn.forget(self.sid)  # unread bytes go back to the connection window
        self._in_send.close()
        self._in.close()


class ClientConnection:
    """One HTTP/2 connection: reader and writer tasks, a stream table, no task groups that
    span the caller's code except the one ``ShardClient.connect`` owns."""

    def __init__(
        self, stream: trio.abc.Stream, authority: str, scheme: str, service: str,
        limits: TransportLimits = TransportLimits(),
    ) -> None:
        self.stream, self.authority, self.scheme = stream, authority, scheme
        self.service = service
        self.h2 = _ClientH2(limits)
        self.h2.on_acks = self.send_pending
        self.streams: dict[int, ClientStream] = {}
        self.dead: str | None = None  # why the connection can no longer be used
        self.going_away = False  # the server sent GOAWAY
        self._outbox = Outbox()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Reader + writer; never raises (a broken connection fails its calls instead)."""
        try:
            async with trio.open_nursery() as nursery:
                self.h2.initiate_connection()
                self.send_pending()
                nursery.start_soon(self._write_loop, nursery.cancel_scope)
                task_status.started()
                await self._read_loop()
                nursery.cancel_scope.cancel()
        finally:
            self._fail_all(self.dead or "connection closed")

    def _fail_all(self, why: str) -> None:
        self.dead = self.dead or why
        for s in list(self.streams.values()):
            s.finish(GrpcStatus.UNAVAILABLE, f"connection to {self.authority} lost: {why}")

    async def _read_loop(self) -> None:
        while True:
            try:
                data = await self.stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self.dead = f"{type(exc).__name__}"
                return
            if not data:
                self.dead = "closed by the server"
                return
            try:
                events = self.h2.receive_data(data)
            except Exception as exc:  # noqa: BLE001 - h2/purerpc parse errors of many types
                # A peer that breaks HTTP/2 or gRPC framing ends the connection; its calls fail
                # with UNAVAILABLE instead of the parser's exception reaching the caller.
                self.dead = f"protocol error: {type(exc).__name__}: {exc}"
                return
            for event in events:
                self._dispatch(event)
            self.send_pending()

    def _dispatch(self, event: Any) -> None:
        if isinstance(event, WindowUpdated):
            targets = self.streams.values() if event.stream_id == 0 else [self.streams.get(event.stream_id)]
            for s in targets:
                if s is not None:
                    s.window.set()
            return
        if isinstance(event, Signal) and event.kind == "settings":
            return
        if isinstance(event, Signal) and event.kind == "goaway":
            self.going_away = True  # no new calls; calls up to last_stream_id may finish
            for sid, s in list(self.streams.items()):
                if sid > event.detail:
                    s.finish(GrpcStatus.UNAVAILABLE, "the server is going away")
            return
        target = self.streams.get(event.stream_id)
        if target is None:
            return
        if isinstance(event, Signal):
            if event.kind == "reset":
                refused = event.detail == ErrorCodes.REFUSED_STREAM
                target.finish(
                    GrpcStatus.CANCELLED if event.detail == ErrorCodes.CANCEL
                    else GrpcStatus.UNAVAILABLE,
                    "the server refused the call (it did no work)" if refused
                    else f"stream reset by the server (HTTP/2 error {event.detail})",
                )
            else:  # "oversized" / "compressed": this response cannot be read
                target.finish(
                    GrpcStatus.RESOURCE_EXHAUSTED if event.kind == "oversized"
                    else GrpcStatus.UNIMPLEMENTED,
                    f"cannot read the response: {event.kind} message",
                )
                target.abort()
        elif isinstance(event, ResponseReceived):
            target.headers = tuple(event.custom_metadata)
        else:
            target.deliver(event)

    async def _write_loop(self, scope: trio.CancelScope) -> None:
        try:
            await self._outbox.write_forever(self.stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.dead = self.dead or type(exc).__name__
            scope.cancel()  # stops the reader too; run() fails every call

    def send_pending(self) -> None:
        self._outbox.push(self.h2.data_to_send())

    async def flush(self) -> None:
        """Queue h2's output; wait while more than 256 KiB are unsent (a slow network)."""
        await self._outbox.flush(self.h2)

    async def drain(self) -> None:
        """Wait until everything queued was written (so resets reach the server before the
        socket closes: a reset releases a session, a dropped connection retains it)."""
        self.send_pending()
        await self._outbox.wait_below(0)

    def consumed(self, sid: int, size: int) -> None:
        """The caller read ``size`` bytes of stream ``sid``: maybe acknowledge (flow control)."""
        if self.dead is None:
            try:
                self.h2.consumed(sid, size)
            except h2.exceptions.ProtocolError:
                return
            self.send_pending()

    def forget(self, sid: int) -> None:
        """Drop a finished stream's state; its unread bytes go back to the window."""
        self.h2.forget(sid)
        if self.dead is None:
            self.send_pending()

    def open_stream(
        self, method: str, deadline: float, metadata: Sequence[tuple[str, str | bytes]]
    ) -> ClientStream:
        if self.dead is not None or self.going_away:
            why = self.dead or "the server sent GOAWAY"
            raise ShardError(
                ErrorCode.NOT_READY, f"connection to {self.authority} is closed: {why}",
                grpc_status=GrpcStatus.UNAVAILABLE,
            )
        timeout = None
        if deadline != math.inf:
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                raise ShardError(ErrorCode.DEADLINE_EXCEEDED, "the deadline expired before the call")
            timeout = _grpc_timeout(remaining)
        try:
            sid = self.h2.get_next_available_stream_id()
            self.h2.start_request(
                sid, self.scheme, self.service, method, None, self.authority, timeout, "+proto",
                metadata,
            )
        except h2.exceptions.ProtocolError as exc:  # e.g. the server's MAX_CONCURRENT_STREAMS
            raise ShardError(
                ErrorCode.RESOURCE_EXHAUSTED, f"cannot start a call on this connection: {exc}"
            ) from None
        self.send_pending()
        s = ClientStream(self, sid, deadline)
        self.streams[sid] = s
        return s

    def goodbye(self) -> None:
        """Reset open calls and say GOAWAY (best effort) before the socket closes."""
        for s in list(self.streams.values()):
            s.abort()
        if self.dead is None:
            try:
                self.h2.h2_connection.close_connection()
            except h2.exceptions.ProtocolError:
                pass
            self.send_pending()
