"""Peers that abuse the worker's inbound buffers, streams or patience (issue 14, item 5).

Each test reproduces one way a peer could stall or exhaust the worker over a real socket, with
small ``TransportLimits`` so that it stays light: connections that fill the shared receive pool
with unfinished messages, a message that never completes, an unauthenticated peer sending
message bytes, streams opened and reset in a loop, and a client that stops reading its
responses. Every test asserts behaviour and bounds, never speed.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import h2.events
import trio
import trio.testing
from google.protobuf.wrappers_pb2 import StringValue
from h2.settings import SettingCodes
from hyperframe.frame import DataFrame, GoAwayFrame, HeadersFrame, RstStreamFrame, WindowUpdateFrame

from raw_h2 import RawConnection, grpc_message
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import req, worker
from shard.rpc.auth import TokenAuthenticator
from shard.rpc.errors import ERROR_TRAILER, ErrorCode, ShardError
from shard.rpc.transport import ClientConnection, EndReason, Server, TransportLimits
from shard.rpc.transport.frames import FrameRate
from shard.rpc.transport.wire import BufferPool
from shard.v1 import shard_pb2 as pb
from test_transport import SERVICE, Echo, RawClient, call, frame, settle
from test_transport_bounds import (
    BOUNDED,
    ENHANCE_YOUR_CALM,
    KiB,
    fill_partial_messages,
    start,
    still_serving,
)

#: The attackers below answer no PINGs (they never read), so keepalive must not cut them: an
#: attacker that does answer would stay connected anyway.
LIMITS = dataclasses.replace(BOUNDED, keepalive_interval=60)
#: Bigger than a stream window (so it needs WINDOW_UPDATEs to arrive whole), smaller than the
#: share every connection keeps for itself (one stream window) plus one window in flight.
WINDOW_AND_A_HALF = "w" * (BOUNDED.stream_window_bytes * 3 // 2)


@contextlib.asynccontextmanager
async def raw_clients(port: int, n: int) -> AsyncIterator[list[RawClient]]:
    """``n`` raw h2 connections, closed at the end whatever happens."""
    clients: list[RawClient] = []
    try:
        for _ in range(n):
            clients.append(await RawClient.connect(port))
        yield clients
    finally:
        for client in clients:
            await client.stream.aclose()


async def well_behaved_call(port: int, value: str) -> None:
    """A grpcio call on a new connection gets its answer (grpcio gives up after 10 s)."""
    response, outcome = await call(port, value)
    assert response is not None and response.value == value, outcome


async def test_connections_full_of_unfinished_messages_do_not_starve_another(
    nursery: trio.Nursery,
) -> None:
    """The issue's stall, scaled down: three connections each start unfinished messages on
    four streams and send as much as flow control lets them, which filled the global pool;
    afterwards no connection got a WINDOW_UPDATE, so the fourth connection's message (1.5
    stream windows) never arrived."""
    server, echo, port = await start(nursery, LIMITS)
    async with raw_clients(port, LIMITS.max_connections - 1) as attackers:
        for attacker in attackers:
            await fill_partial_messages(attacker, echo, streams=4)
        assert server.buffered_bytes > LIMITS.total_buffer_bytes // 2
        await well_behaved_call(port, WINDOW_AND_A_HALF)


async def test_one_connection_never_takes_the_whole_pool(nursery: trio.Nursery) -> None:
    """With ``total_buffer_bytes == connection_buffer_bytes`` (allowed), one connection could
    be acknowledged the whole pool and starve every other connection."""
    limits = dataclasses.replace(LIMITS, total_buffer_bytes=LIMITS.connection_buffer_bytes)
    server, echo, port = await start(nursery, limits)
    async with raw_clients(port, 1) as (attacker,):
        await fill_partial_messages(attacker, echo, streams=8)
        (conn,) = server._connections  # noqa: SLF001 - the ledger under test
        # The bound: every other connection slot keeps its reserve.
        bound = min(limits.connection_buffer_bytes, limits.total_buffer_bytes
                    - (limits.max_connections - 1) * limits.connection_reserve_bytes)
        assert 0 < conn.h2.charge <= bound < limits.total_buffer_bytes
        await well_behaved_call(port, WINDOW_AND_A_HALF)


async def test_lent_bytes_come_back_when_unfinished_messages_time_out(nursery: trio.Nursery) -> None:
    """A message that needs more than a connection's own reserve waits for lent bytes; the
    attackers' unfinished messages time out (``message_timeout``), which gives them back."""
    limits = dataclasses.replace(LIMITS, message_timeout=1.0)
    server, echo, port = await start(nursery, limits)
    async with raw_clients(port, limits.max_connections - 1) as attackers:
        for attacker in attackers:
            await fill_partial_messages(attacker, echo, streams=4)
        big = "b" * (limits.connection_reserve_bytes + limits.stream_window_bytes + 64 * KiB)
        await well_behaved_call(port, big)
        with trio.fail_after(10):  # the last attacker's messages time out too
            while server.pool.held:
                await trio.sleep(0.05)
        assert server.pool.lent == 0


def test_the_pool_keeps_a_reserve_per_slot_and_lends_the_rest_in_equal_shares() -> None:
    pool = BufferPool(1000, slots=4, reserve=50)  # 4 x 50 reserved, 800 lent out at most
    a, b, c = object(), object(), object()
    assert pool.room(a, 0) == 850  # alone: its reserve and all of the shared part
    pool.recharge(a, 0, 850)
    assert pool.lent == 800 and pool.room(a, 850) == 0
    assert pool.room(b, 0) == 50  # whatever a holds, b still has its reserve
    retried: list[str] = []
    pool.wait_for_room(c, lambda: retried.append("c"))
    pool.wait_for_room(b, lambda: retried.append("b"))
    pool.recharge(a, 850, 450)  # a gives back 400: the waiting members are told
    assert sorted(retried) == ["b", "c"]
    # a, b and c contend now: a, which borrowed 400, gets nothing more, the others 800 / 3.
    pool.wait_for_room(b, lambda: None)
    pool.wait_for_room(c, lambda: None)
    assert pool.room(a, 450) == 0
    assert pool.room(b, 50) == 800 // 3
    pool.recharge(b, 50, 50 + 800 // 3)
    assert pool.room(c, 0) == 50 + 800 - 400 - 800 // 3
    pool.forget(a)  # a left after giving everything back
    pool.recharge(a, 450, 0)
    assert pool.lent == 800 // 3


def shard_error_of(headers: dict[str, str]) -> ShardError:
    """The Shard error of a status received as (utf-8 decoded) HTTP/2 trailers."""
    text = headers[ERROR_TRAILER]
    value = base64.b64decode(text + "=" * (-len(text) % 4))
    return ShardError.from_proto(pb.Error.FromString(value))


def status_of(stream_id: int) -> Callable[[Any], bool]:
    """Trailers (or a trailers-only response) of ``stream_id``."""
    return lambda e: getattr(e, "stream_id", None) == stream_id and "grpc-status" in dict(
        getattr(e, "headers", None) or ())


async def test_a_message_not_finished_in_time_fails_its_stream_only(nursery: trio.Nursery) -> None:
    limits = dataclasses.replace(LIMITS, message_timeout=0.5)
    server, _, port = await start(nursery, limits)
    client = await RawClient.connect(port)
    try:
        sid = await client.request("Bidi", frame("first"), end=False)
        await client.until(lambda e: isinstance(e, h2.events.DataReceived) and e.stream_id == sid)
        client.h2.send_data(sid, frame("x" * 1000)[:100])  # a message that never completes
        await client.flush()
        headers = dict((await client.until(status_of(sid))).headers)
        assert headers["grpc-status"] == "8", headers
        err = shard_error_of(headers)
        assert err.code is ErrorCode.RESOURCE_EXHAUSTED and err.reason == "MESSAGE_TIMEOUT"
        assert err.retryable
        assert server.pool.held == 0  # its bytes were given back
        ok = await client.request("Unary", frame("still here"))  # the connection lives on
        assert dict((await client.until(status_of(ok))).headers)["grpc-status"] == "0"
    finally:
        await client.stream.aclose()


async def test_a_slow_but_steady_sender_is_not_cut(nursery: trio.Nursery) -> None:
    """The timeout runs per message, from its first byte to its last: a stream that sends
    each message within ``message_timeout`` lives as long as it likes."""
    limits = dataclasses.replace(LIMITS, message_timeout=2.0)
    _, _, port = await start(nursery, limits)
    client = await RawClient.connect(port)
    try:
        sid = await client.request("Bidi", frame("start"), end=False)
        for i in range(6):  # 6 x 0.5 s: longer than the timeout, each message well within it
            data = frame(f"message {i}")
            client.h2.send_data(sid, data[:4])
            await client.flush()
            await trio.sleep(0.5)
            client.h2.send_data(sid, data[4:])
            await client.flush()
        client.h2.end_stream(sid)
        await client.flush()
        headers = dict((await client.until(status_of(sid))).headers)
        assert headers["grpc-status"] == "0", headers
    finally:
        await client.stream.aclose()


def _headers_with(peer: RawConnection, path: str, extra: list[tuple[str, str]]) -> tuple[int, bytes]:
    sid, peer.next_stream_id = peer.next_stream_id, peer.next_stream_id + 2
    block = peer.encoder.encode([
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "test"),
        ("te", "trailers"), ("content-type", "application/grpc"), *extra,
    ])
    return sid, HeadersFrame(sid, data=block, flags={"END_HEADERS"}).serialize()


async def refused_before_any_acknowledgement(peer: RawConnection, path: str, window: int) -> ShardError:
    """Open a call on ``path`` without credentials and send one stream window of a message
    much larger than that: the call must be refused and none of its DATA acknowledged."""
    sid, head = _headers_with(peer, path, [])
    body = grpc_message(b"\0" * (8 * window))[:window]
    await peer.send(head + DataFrame(sid, data=body).serialize())
    with trio.fail_after(10):
        while True:
            frame_ = await peer.next_frame()
            assert frame_ is not None, "the server closed the connection"
            assert not (isinstance(frame_, WindowUpdateFrame) and frame_.stream_id == sid), (
                "DATA of an unauthorized call was acknowledged")
            if isinstance(frame_, HeadersFrame) and frame_.stream_id == sid and (
                    "grpc-status" in frame_.decoded):
                break
    assert frame_.decoded["grpc-status"] == "16", frame_.decoded
    return shard_error_of(frame_.decoded)


async def test_an_unauthorized_call_is_refused_before_its_data_is_acknowledged(
    nursery: trio.Nursery,
) -> None:
    echo = Echo()

    async def authorize(ctx: Any) -> None:
        if ("authorization", "Bearer ok") not in ctx.metadata:
            raise ShardError(ErrorCode.UNAUTHENTICATED, "a bearer token is required")

    server = Server(port=0, limits=LIMITS)
    server.add_service(echo.service, authorize=authorize)
    port = await nursery.start(server.serve)
    peer = await RawConnection.open("127.0.0.1", port)
    try:
        await peer.handshake()
        for method in ("Unary", "Bidi"):
            err = await refused_before_any_acknowledgement(
                peer, f"/{SERVICE}/{method}", LIMITS.stream_window_bytes)
            assert err.code is ErrorCode.UNAUTHENTICATED
        assert echo.contexts == []  # no handler ran
        await trio.testing.wait_all_tasks_blocked()
        assert server.buffered_bytes == 0
        # With the token the same call is served (its DATA acknowledged as usual).
        big = "t" * (2 * LIMITS.stream_window_bytes)
        response, _ = await call(port, big, metadata=[("authorization", "Bearer ok")])
        assert response is not None and response.value == big
    finally:
        await peer.aclose()


async def test_the_worker_authenticates_from_headers_before_acknowledging_request_bytes(
    tmp_path: Path,
) -> None:
    """``serve(authorize=...)`` runs the hook at HEADERS: an unauthenticated peer cannot make
    the worker acknowledge (and so buffer beyond the initial windows) request bytes, on unary
    calls (whose message the transport used to read whole before the handler authenticated)
    nor on Session streams."""
    tokens = tmp_path / "tokens"
    tokens.write_text("tok-abuse router\n")
    limits = TransportLimits(stream_window_bytes=65535)
    async with worker(authorize=TokenAuthenticator(tokens), transport_limits=limits) as w:
        host, port = w.target.rsplit(":", 1)
        peer = await RawConnection.open(host, int(port))
        try:
            await peer.handshake()
            for method in ("GetCapabilities", "Session"):
                err = await refused_before_any_acknowledgement(
                    peer, f"/shard.v1.Shard/{method}", limits.stream_window_bytes)
                assert err.code is ErrorCode.UNAUTHENTICATED, method
            await trio.testing.wait_all_tasks_blocked()
            assert w.server.transport.buffered_bytes == 0
            assert w.server.registry.counters["rpc_GetCapabilities_total"] == 1
        finally:
            await peer.aclose()
        await w.idle()


async def test_a_peer_that_resets_streams_in_a_loop_gets_enhance_your_calm(
    nursery: trio.Nursery,
) -> None:
    """Rapid reset (CVE-2023-44487): streams opened and reset at once never count against
    MAX_CONCURRENT_STREAMS, so only a rate bound stops a peer from making the worker start and
    cancel calls for ever."""
    limits = dataclasses.replace(LIMITS, resets=FrameRate(20, 5.0))
    server, _, port = await start(nursery, limits)
    peer = await RawConnection.open("127.0.0.1", port)
    try:
        await peer.handshake()
        burst = b""
        for _ in range(100):
            sid, head = peer.headers(f"/{SERVICE}/Bidi")
            burst += head + RstStreamFrame(sid, error_code=0x8).serialize()  # CANCEL
        with contextlib.suppress(trio.BrokenResourceError):  # the server may close first
            await peer.send(burst)
        frames = await peer.closed_within(10)
        goaway = [f for f in frames if isinstance(f, GoAwayFrame)]
        assert goaway and goaway[-1].error_code == ENHANCE_YOUR_CALM, frames
    finally:
        await peer.aclose()
    await still_serving(port)
    await trio.testing.wait_all_tasks_blocked()
    assert server.open_calls == 0


async def test_the_clients_own_cancels_stay_within_the_default_reset_bound(
    nursery: trio.Nursery,
) -> None:
    """300 calls started and cancelled back to back on one connection (the Trio client's
    cancel: RST_STREAM(CANCEL)), then the same call completes: the defaults never cut a
    client that cancels what it started."""
    limits = dataclasses.replace(LIMITS, resets=TransportLimits().resets)
    server, echo, port = await start(nursery, limits)
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        conn = ClientConnection(stream, "test", "http", SERVICE, limits)
        async with trio.open_nursery() as inner:
            await inner.start(conn.run)
            for i in range(300):
                # Unary: cancelled calls the server has not cleaned up yet never count against
                # the streaming-call limit, so every one of them really starts.
                s = conn.open_stream("Unary", trio.current_time() + 30, ())
                await s.send(StringValue(value=f"hang:k{i}"))
                await s.half_close()
                if i % 50 == 0:  # now and then, let the call really start before cancelling
                    await settle(echo.started[f"k{i}"])
                s.abort()
            s = conn.open_stream("Unary", trio.current_time() + 30, ())
            await s.send(StringValue(value="after 300 cancels"))
            await s.half_close()
            with trio.fail_after(10):
                reply = await s.receive(StringValue)
            assert reply is not None and reply.value == "after 300 cancels", s.status
            assert conn.dead is None and not conn.going_away
            for i in range(0, 300, 50):  # the resets did reach the calls
                await settle(echo.finished[f"k{i}"])
                assert echo.reasons[f"k{i}"] is EndReason.CLIENT_CANCELLED
            s.close()
            conn.goodbye()
            inner.cancel_scope.cancel()
    assert server.refused_connections == 0


async def until_status(client: RawClient, sid: int, *, poke: Callable[[], None]) -> dict[str, str]:
    """Read until ``sid``'s status arrives; ``poke()`` runs every 0.1 s meanwhile."""
    with trio.fail_after(10):
        while True:
            for event in client.events:
                if status_of(sid)(event):
                    return dict(event.headers)
            client.events.clear()
            poke()
            await client.flush()
            with trio.move_on_after(0.1):
                data = await client.stream.receive_some(65536)
                assert data, "the server closed the connection"
                client.events.extend(client.h2.receive_data(data))


async def test_a_call_whose_client_stops_reading_ends_after_send_idle_timeout(
    nursery: trio.Nursery,
) -> None:
    """A client that reads nothing leaves a response waiting for flow-control window for ever
    (the handler, and a session behind it, with it). Window updates for the *connection* (the
    client reads another stream) do not count as progress for the stalled one."""
    limits = dataclasses.replace(LIMITS, send_idle_timeout=0.5)
    server, _, port = await start(nursery, limits)
    client = await RawClient.connect(port)
    try:
        client.h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 16})  # 16 bytes per stream
        stalled = await client.request("Bidi", frame("s" * 100), end=False)  # echo > 16 bytes
        lively = await client.request("Bidi", frame("l"), end=False)  # echo: 8 bytes

        def keep_reading() -> None:  # the connection as a whole is read
            client.h2.increment_flow_control_window(1024)

        headers = await until_status(client, stalled, poke=keep_reading)
        assert headers["grpc-status"] == "8", headers
        err = shard_error_of(headers)
        assert err.code is ErrorCode.RESOURCE_EXHAUSTED and err.reason == "SEND_IDLE_TIMEOUT"
        await trio.testing.wait_all_tasks_blocked()
        assert server.open_calls == 1  # the lively call goes on
    finally:
        await client.stream.aclose()


async def test_a_session_whose_client_stops_reading_is_released() -> None:
    limits = TransportLimits(send_idle_timeout=0.5)
    async with worker(transport_limits=limits) as w:
        host, port = w.target.rsplit(":", 1)
        client = RawClient(await trio.open_tcp_stream(host, int(port)))
        try:
            client.h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 16})
            opened = req(open=pb.OpenSession(session_id="stalled")).SerializeToString()
            sid = await client.request("Session", grpc_message(opened), end=False, service="shard.v1.Shard")
            headers = await until_status(client, sid, poke=lambda: None)
            assert headers["grpc-status"] == "8", headers
            err = shard_error_of(headers)
            assert err.code is ErrorCode.RESOURCE_EXHAUSTED and err.reason == "SEND_IDLE_TIMEOUT"
        finally:
            await client.stream.aclose()
        await w.idle()
        assert w.engine.sessions() == () and w.server.registry.n_retained == 0  # released
