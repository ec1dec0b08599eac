"""One test per purerpc 0.8.0 gap closed by shard.rpc.transport.

Clients are the official grpcio client (blocking calls in worker threads) and, where the exact
frames matter (deadline trailers, dropped connections, SETTINGS), a raw h2 client on Trio.
Cancellation is asserted through server-side state (the handler's ``finally`` and
``end_reason``), never through wall-clock time.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import queue
import struct
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import purerpc
import pytest
import trio
import trio.testing
from google.protobuf.wrappers_pb2 import StringValue
from h2.settings import SettingCodes

from shard.rpc.transport import wire
from shard.rpc.transport.frames import FrameRate
from shard.rpc.transport import (
    CallContext,
    EndReason,
    Server,
    StatusError,
    TransportLimits,
    current_call,
)

SERVICE = "test.Echo"
LIMITS = TransportLimits(
    max_message_bytes=256 * 1024, stream_window_bytes=65535,
    connection_window_bytes=1024 * 1024, max_concurrent_streams=8,
)
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]  # one TCP connection per channel


class Echo:
    """A proto-free test service. ``value`` drives the behaviour: "hang:<key>" blocks until
    cancelled, "fail", "boom", "group" raise, anything else is echoed."""

    def __init__(self) -> None:
        self.started: defaultdict[str, trio.Event] = defaultdict(trio.Event)
        self.finished: defaultdict[str, trio.Event] = defaultdict(trio.Event)
        self.reasons: dict[str, EndReason | None] = {}
        self.contexts: list[CallContext] = []

    async def _hang(self, key: str) -> None:
        ctx = current_call()
        ctx.trailers.append(("x-progress", "hung"))
        try:
            self.started[key].set()
            await trio.sleep_forever()
        finally:
            self.reasons[key] = ctx.end_reason
            self.finished[key].set()

    async def unary(self, message: StringValue) -> StringValue:
        value = message.value
        ctx = current_call()
        self.contexts.append(ctx)
        if value.startswith("hang:"):
            await self._hang(value[5:])
        if value == "fail":
            raise StatusError(9, "not now", [("x-detail-bin", b"\x00\xffdetail"), ("x-why", "busy")])
        if value == "boom":
            raise RuntimeError("secret internals")
        if value == "group":
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._raise_status)
        if value == "trailers":
            ctx.trailers.append(("x-usage", "42"))
        if value == "bad-trailers":  # reserved key: must not reach the wire or kill the connection
            ctx.trailers.append(("grpc-status", "0"))
        if value == "child":  # current_call() is inherited by the handler's own tasks
            seen: list[str] = []

            async def child() -> None:
                seen.append(current_call().method)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(child)
            value = seen[0]
        return StringValue(value=value)

    @staticmethod
    async def _raise_status() -> None:
        raise StatusError(5, "no such session")

    async def bidi(self, messages: AsyncIterator[StringValue]) -> AsyncIterator[StringValue]:
        async for message in messages:
            if message.value.startswith("hang:"):
                await self._hang(message.value[5:])
            yield message

    @property
    def service(self) -> purerpc.Service:
        service = purerpc.Service(SERVICE)
        service.add_method("Unary", self.unary, purerpc.RPCSignature(
            purerpc.Cardinality.UNARY_UNARY, StringValue, StringValue))
        service.add_method("Bidi", self.bidi, purerpc.RPCSignature(
            purerpc.Cardinality.STREAM_STREAM, StringValue, StringValue))
        return service


async def start(nursery: trio.Nursery, limits: TransportLimits = LIMITS) -> tuple[Server, Echo, int]:
    echo = Echo()
    server = Server(port=0, limits=limits)
    server.add_service(echo.service)
    port = await nursery.start(server.serve)
    return server, echo, port


def channel(port: int) -> grpc.Channel:
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)


def unary(ch: grpc.Channel, method: str = "Unary") -> grpc.UnaryUnaryMultiCallable:
    return ch.unary_unary(f"/{SERVICE}/{method}", request_serializer=StringValue.SerializeToString,
                          response_deserializer=StringValue.FromString)


def bidi(ch: grpc.Channel) -> grpc.StreamStreamMultiCallable:
    return ch.stream_stream(f"/{SERVICE}/Bidi", request_serializer=StringValue.SerializeToString,
                            response_deserializer=StringValue.FromString)


async def call(port: int, value: str, **kwargs: Any) -> tuple[StringValue | None, Any]:
    """One unary call in a worker thread: (response, call) or (None, RpcError)."""

    def run() -> tuple[StringValue | None, Any]:
        with channel(port) as ch:
            try:
                return unary(ch).with_call(StringValue(value=value), timeout=10, **kwargs)
            except grpc.RpcError as exc:
                return None, exc

    return await trio.to_thread.run_sync(run)


async def settle(event: trio.Event) -> None:
    """Wait for server-side state; the bound only turns a regression into a failure, not a hang."""
    with trio.fail_after(10):
        await event.wait()


def frame(value: str | bytes) -> bytes:
    data = StringValue(value=value).SerializeToString() if isinstance(value, str) else value
    return struct.pack(">?I", False, len(data)) + data


class RawClient:
    """A minimal h2 client for tests that need exact frames or an abrupt disconnect."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.initiate_connection()
        self.events: list[Any] = []

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        client = cls(await trio.open_tcp_stream("127.0.0.1", port))
        await client.flush()
        return client

    async def flush(self) -> None:
        await self.stream.send_all(self.h2.data_to_send())

    async def request(self, method: str, body: bytes, *, end: bool = True,
                      headers: tuple[tuple[str, str], ...] = (), service: str = SERVICE) -> int:
        sid = self.h2.get_next_available_stream_id()
        self.h2.send_headers(sid, [
            (":method", "POST"), (":scheme", "http"), (":path", f"/{service}/{method}"),
            (":authority", "test"), ("te", "trailers"), ("content-type", "application/grpc"),
            *headers])
        self.h2.send_data(sid, body, end_stream=end)
        await self.flush()
        return sid

    async def until(self, predicate: Callable[[Any], bool]) -> Any:
        """The first event matching ``predicate`` (events before it are dropped)."""
        with trio.fail_after(10):
            return await self._until(predicate)

    async def _until(self, predicate: Callable[[Any], bool]) -> Any:
        while True:
            while self.events:
                event = self.events.pop(0)
                if predicate(event):
                    return event
            data = await self.stream.receive_some(65536)
            assert data, "server closed the connection"
            self.events.extend(self.h2.receive_data(data))
            await self.flush()


# -- binding and listener lifecycle ----------------------------------------------------------

async def test_port_zero_reports_bound_port_and_port_is_exclusive(nursery: trio.Nursery) -> None:
    _, _, port = await start(nursery)
    assert port > 0
    response, _ = await call(port, "hello")
    assert response is not None and response.value == "hello"
    with pytest.raises(OSError, match="cannot listen on 127.0.0.1") as info:
        await nursery.start(Server(port=port).serve)  # purerpc: SO_REUSEPORT shared the port
    assert info.value.errno == errno.EADDRINUSE


async def test_listener_and_accepted_sockets_closed_when_serve_is_cancelled() -> None:
    async with trio.open_nursery() as nursery:
        server, _, port = await start(nursery)
        client = await RawClient.connect(port)
        await client.until(lambda e: isinstance(e, h2.events.RemoteSettingsChanged))
        nursery.cancel_scope.cancel()
    with trio.fail_after(5):  # the server closed its end: we read EOF, nothing in CLOSE-WAIT
        while await client.stream.receive_some(65536):
            pass
    await client.stream.aclose()
    assert server.open_connections == 0
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)


# -- status, trailers, metadata --------------------------------------------------------------

async def test_status_error_sends_code_message_and_binary_trailers(nursery: trio.Nursery) -> None:
    _, _, port = await start(nursery)
    _, error = await call(port, "fail")
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details() == "not now"
    trailers = dict(error.trailing_metadata())
    assert trailers["x-detail-bin"] == b"\x00\xffdetail"
    assert trailers["x-why"] == "busy"


async def test_status_error_raised_inside_a_nursery_is_unwrapped(nursery: trio.Nursery) -> None:
    _, _, port = await start(nursery)
    _, error = await call(port, "group")
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == "no such session"


async def test_context_trailers_sent_on_success(nursery: trio.Nursery) -> None:
    _, _, port = await start(nursery)
    response, rpc = await call(port, "trailers")
    assert response is not None and response.value == "trailers"
    assert dict(rpc.trailing_metadata())["x-usage"] == "42"


async def test_invalid_trailers_become_internal_not_a_dead_connection(
    nursery: trio.Nursery,
) -> None:
    _, _, port = await start(nursery)

    def run() -> tuple[grpc.StatusCode, str]:
        with channel(port) as ch:
            with pytest.raises(grpc.RpcError) as info:
                unary(ch)(StringValue(value="bad-trailers"), timeout=10)
            return info.value.code(), unary(ch)(StringValue(value="still up"), timeout=10).value

    assert await trio.to_thread.run_sync(run) == (grpc.StatusCode.INTERNAL, "still up")


async def test_unknown_exception_is_internal_and_logged_not_leaked(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    _, _, port = await start(nursery)
    with caplog.at_level(logging.ERROR, logger="shard.rpc.transport"):
        _, error = await call(port, "boom")
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == "internal error"
    assert "secret" not in error.debug_error_string()
    logged = [r for r in caplog.records if r.exc_info and "secret internals" in str(r.exc_info[1])]
    assert logged


async def test_metadata_peer_method_and_current_call(nursery: trio.Nursery) -> None:
    _, echo, port = await start(nursery)
    await call(port, "meta", metadata=[("x-user", "bob"), ("x-blob-bin", b"\x00\x01")])
    ctx = echo.contexts[-1]
    assert ctx.method == f"/{SERVICE}/Unary"
    assert ("x-user", "bob") in ctx.metadata
    assert ("x-blob-bin", b"\x00\x01") in ctx.metadata
    assert not any(key.startswith((":", "grpc-")) for key, _ in ctx.metadata)
    assert ctx.peer.startswith("ipv4:127.0.0.1:")
    response, _ = await call(port, "child")
    assert response is not None and response.value == f"/{SERVICE}/Unary"


async def test_unknown_method_and_service_are_unimplemented(nursery: trio.Nursery) -> None:
    _, _, port = await start(nursery)

    def run() -> list[grpc.StatusCode]:
        codes = []
        with channel(port) as ch:
            for path in (f"/{SERVICE}/Nope", "/no.Such/Method"):
                rpc = ch.unary_unary(path, request_serializer=StringValue.SerializeToString,
                                     response_deserializer=StringValue.FromString)
                with pytest.raises(grpc.RpcError) as info:
                    rpc(StringValue(value="x"), timeout=10)
                codes.append(info.value.code())
        return codes

    assert await trio.to_thread.run_sync(run) == [grpc.StatusCode.UNIMPLEMENTED] * 2


async def test_compressed_requests_are_refused_not_inflated(nursery: trio.Nursery) -> None:
    _, echo, port = await start(nursery)
    _, err = await call(port, "x" * 1000, compression=grpc.Compression.Gzip)
    assert isinstance(err, grpc.RpcError)
    assert err.code() is grpc.StatusCode.UNIMPLEMENTED
    assert "gzip" in err.details()
    # The connection and the server stay usable for identity-encoded calls.
    reply, _ = await call(port, "plain")
    assert reply is not None


async def test_a_compressed_flag_fails_that_stream_only(nursery: trio.Nursery) -> None:
    """A message with the compressed flag set (no grpc-encoding header) used to raise out of
    purerpc's parser and take the connection down; now only that stream fails."""
    _, _, port = await start(nursery)
    client = await RawClient.connect(port)
    data = StringValue(value="zip?").SerializeToString()
    sid = await client.request("Unary", struct.pack(">?I", True, len(data)) + data)

    def status_of(stream_id: int) -> Callable[[Any], bool]:  # trailers, or trailers-only
        return lambda e: getattr(e, "stream_id", None) == stream_id and "grpc-status" in dict(
            getattr(e, "headers", None) or ())

    ended = await client.until(status_of(sid))
    assert dict(ended.headers)["grpc-status"] == "12"
    ok = await client.request("Unary", frame("still here"))
    assert dict((await client.until(status_of(ok))).headers)["grpc-status"] == "0"
    await client.stream.aclose()


# -- deadlines, cancellation, dropped connections ----------------------------------------------

async def test_deadline_cancels_handler_and_sends_deadline_exceeded(nursery: trio.Nursery) -> None:
    _, echo, port = await start(nursery)
    client = await RawClient.connect(port)
    await client.request("Unary", frame("hang:d"), headers=(("grpc-timeout", "50m"),))
    trailers = await client.until(lambda e: isinstance(e, h2.events.ResponseReceived))
    headers = dict(trailers.headers)  # trailers-only response: the status is in the headers
    assert headers["grpc-status"] == "4"
    assert headers["x-progress"] == "hung"  # ctx.trailers ride along with the deadline status
    assert echo.reasons["d"] is EndReason.DEADLINE
    await client.stream.aclose()


async def test_client_cancel_reaches_handler_and_leaves_no_state(nursery: trio.Nursery) -> None:
    server, echo, port = await start(nursery)
    ch = channel(port)
    try:
        for i in range(10):  # one connection, many cancelled calls (unary and bidi)
            key = f"c{i}"
            if i % 2:
                rpc = await trio.to_thread.run_sync(
                    lambda: unary(ch).future(StringValue(value=f"hang:{key}"), timeout=10))
            else:
                rpc = bidi(ch)(iter([StringValue(value=f"hang:{key}")]), timeout=10)
            await settle(echo.started[key])
            await trio.to_thread.run_sync(rpc.cancel)
            await settle(echo.finished[key])
            assert echo.reasons[key] is EndReason.CLIENT_CANCELLED
        await trio.testing.wait_all_tasks_blocked()
        assert server.open_connections == 1
        assert server.open_calls == 0
        (conn,) = server._connections
        assert not conn.h2.flow and not conn.h2.message_read_buffers and conn.h2.held == 0  # no per-call leftovers
    finally:
        ch.close()


async def test_dropped_connection_reaches_handler_and_socket_is_closed(
    nursery: trio.Nursery,
) -> None:
    server, echo, port = await start(nursery)
    client = await RawClient.connect(port)
    await client.request("Bidi", frame("hang:x"), end=False)
    await settle(echo.started["x"])
    await client.stream.send_eof()  # the client goes away
    await settle(echo.finished["x"])
    assert echo.reasons["x"] is EndReason.CONNECTION_LOST
    with trio.fail_after(5):  # the server closed its side too: EOF, no CLOSE-WAIT
        while await client.stream.receive_some(65536):
            pass
    await client.stream.aclose()
    await trio.testing.wait_all_tasks_blocked()
    assert server.open_connections == 0


async def test_server_shutdown_sets_end_reason_before_cancelling() -> None:
    async with trio.open_nursery() as outer:
        results: list[Any] = []

        async def client(port: int) -> None:
            results.append(await call(port, "hang:s"))

        async with trio.open_nursery() as nursery:
            _, echo, port = await start(nursery)
            outer.start_soon(client, port)
            await settle(echo.started["s"])
            nursery.cancel_scope.cancel()
    assert echo.reasons["s"] is EndReason.SHUTDOWN
    assert results[0][1].code() == grpc.StatusCode.UNAVAILABLE


# -- limits ------------------------------------------------------------------------------------

async def test_oversized_message_fails_only_that_stream(nursery: trio.Nursery) -> None:
    _, _, port = await start(nursery)

    def run() -> tuple[grpc.StatusCode, list[str]]:
        with channel(port) as ch:
            q: queue.Queue[StringValue | None] = queue.Queue()
            stream = bidi(ch)(iter(q.get, None), timeout=10)
            q.put(StringValue(value="before"))
            seen = [next(stream).value]
            with pytest.raises(grpc.RpcError) as info:
                unary(ch)(StringValue(value="x" * (300 * 1024)), timeout=10)
            q.put(StringValue(value="after"))
            seen.append(next(stream).value)
            q.put(None)
            seen.extend(m.value for m in stream)
            return info.value.code(), seen

    code, seen = await trio.to_thread.run_sync(run)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert seen == ["before", "after"]


async def test_settings_advertise_bounded_windows_and_stream_limit(nursery: trio.Nursery) -> None:
    _, _, port = await start(nursery)
    client = await RawClient.connect(port)
    settings = await client.until(lambda e: isinstance(e, h2.events.RemoteSettingsChanged))
    changed = {code: s.new_value for code, s in settings.changed_settings.items()}
    assert changed[SettingCodes.MAX_CONCURRENT_STREAMS] == (
        LIMITS.max_concurrent_streams + LIMITS.unary_reserve)
    assert changed[SettingCodes.INITIAL_WINDOW_SIZE] == LIMITS.stream_window_bytes
    update = await client.until(lambda e: isinstance(e, h2.events.WindowUpdated))
    assert update.stream_id == 0
    assert update.delta + 65535 == LIMITS.connection_window_bytes
    await client.stream.aclose()


async def test_messages_larger_than_the_window_still_flow(nursery: trio.Nursery) -> None:
    _, _, port = await start(nursery)  # window 64 KiB, message limit 256 KiB
    big = "y" * (200 * 1024)
    response, _ = await call(port, big)
    assert response is not None and response.value == big


async def test_a_response_larger_than_the_clients_window_is_not_held_back(
    nursery: trio.Nursery,
) -> None:
    """The server framed the first window of such a response but waited for the client's
    WINDOW_UPDATE before handing those bytes to the socket: the client, which acknowledges what
    it received, never got them, and the response waited for some other frame (a keepalive
    PING, 60 s) to flush it. Found with the Trio client echoing 1 MiB messages."""
    from shard.rpc.transport import ClientConnection

    _, _, port = await start(nursery)
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        conn = ClientConnection(stream, "test", "http", SERVICE, LIMITS)
        async with trio.open_nursery() as inner:
            await inner.start(conn.run)
            s = conn.open_stream("Bidi", trio.current_time() + 30, ())
            big = StringValue(value="r" * (LIMITS.stream_window_bytes + 1000))
            with trio.fail_after(10):
                for _ in range(3):
                    await s.send(big)
                    reply = await s.receive(StringValue)
                    assert reply is not None and reply.value == big.value, s.status
            s.abort()
            conn.goodbye()
            inner.cancel_scope.cancel()


async def test_empty_messages_to_a_handler_that_does_not_read_stay_bounded(
    nursery: trio.Nursery,
) -> None:
    """Each queued message counts its 5-byte gRPC prefix against the stream window, so a peer
    cannot queue an unbounded number of empty messages at a handler that stopped reading."""
    server, echo, port = await start(nursery)
    client = await RawClient.connect(port)
    sid = await client.request("Bidi", frame("hang:e"), end=False)
    await settle(echo.started["e"])  # the handler now waits forever without reading
    empty, window = frame(b""), LIMITS.stream_window_bytes
    (conn,) = server._connections
    call = conn.calls[sid]
    for _ in range(4):  # fill every window the server grants; unbounded, it grants forever
        room = client.h2.local_flow_control_window(sid)
        per_frame = client.h2.max_outbound_frame_size // len(empty)
        n = room // len(empty)
        while n > 0:
            client.h2.send_data(sid, empty * min(n, per_frame))
            n -= per_frame
        client.h2.ping(b"barrier!")  # answered after the data before it was processed
        await client.flush()
        await client.until(lambda e: isinstance(e, h2.events.PingAckReceived))
    queued = call.inbox.statistics().current_buffer_used
    assert queued <= 2 * window // len(empty) + 1, queued
    assert conn.h2.flow[sid].deferred > 0  # acknowledgements are being withheld
    await client.stream.aclose()


async def test_a_peer_that_never_reads_cannot_grow_the_outbox(nursery: trio.Nursery) -> None:
    """Frames h2 answers by itself (PING ACKs here) also wait for the peer to read: the
    connection stops reading while its outbox is over the high-water mark. (The PING budget is
    lifted here: with it, the flood ends at GOAWAY long before; tests/test_transport_floods.py.)"""
    server, _, port = await start(nursery, dataclasses.replace(LIMITS, pings=FrameRate(10**9, 1e9)))
    client = await RawClient.connect(port)
    flooded = 0

    async def flood() -> None:  # 2.5 MB of PINGs, never reading a single ACK
        nonlocal flooded
        for _ in range(150):
            for _ in range(1000):
                client.h2.ping(b"flooding")
            await client.flush()
            flooded += 1000

    async with trio.open_nursery() as inner:
        inner.start_soon(flood)
        await trio.testing.wait_all_tasks_blocked()  # flood, reader and writer all stuck
        (conn,) = server._connections
        assert len(conn._outbox) <= wire.OUTBOX_HIGH_WATER + wire.READ_SIZE + 17
        assert flooded < 150_000  # the server stopped reading, so the flood could not finish
        inner.cancel_scope.cancel()
    await client.stream.aclose()


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError):
        TransportLimits(stream_window_bytes=2**31)
    with pytest.raises(ValueError):
        TransportLimits(max_concurrent_streams=0)
