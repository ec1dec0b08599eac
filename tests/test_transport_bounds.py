"""Bounds that hold for any peer, each pushed past with raw frames over a real socket.

Every test checks three things: the offending connection is cut (with GOAWAY where HTTP/2 has
one) within its limit, the server's inbound buffers stay within the documented cap
(``TransportLimits``: ``per_connection_memory_bytes`` per connection), and calls on other
connections keep working meanwhile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

import h2.events
import pytest
import trio
import trio.testing
from google.protobuf.wrappers_pb2 import StringValue
from hyperframe.frame import ContinuationFrame, GoAwayFrame, HeadersFrame, PingFrame, SettingsFrame

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from raw_h2 import PREFACE, RawConnection, frame_header, grpc_message
from shard.rpc.errors import GrpcStatus
from shard.rpc.transport import ClientConnection, Server, TransportLimits
from shard.rpc.transport.wire import READ_SIZE
from test_transport import LIMITS, SERVICE, Echo, RawClient, call, frame, settle

KiB = 1024
BOUNDED = dataclasses.replace(
    LIMITS,  # 256 KiB messages, 64 KiB stream window, 1 MiB connection window, 8 streams
    connection_buffer_bytes=512 * KiB,
    total_buffer_bytes=1024 * KiB,
    max_connections=4,
    handshake_timeout=0.5,
    keepalive_interval=0.3,
    keepalive_timeout=0.5,
)
FRAME_SIZE_ERROR, ENHANCE_YOUR_CALM = 0x6, 0xB


async def start(nursery: trio.Nursery, limits: TransportLimits = BOUNDED) -> tuple[Server, Echo, int]:
    echo = Echo()
    server = Server(port=0, limits=limits)
    server.add_service(echo.service)
    port = await nursery.start(server.serve)
    return server, echo, port


async def raw(port: int) -> RawConnection:
    return await RawConnection.open("127.0.0.1", port)


async def still_serving(port: int) -> None:
    """A call on a fresh connection works (other clients are unaffected)."""
    response, outcome = await call(port, "still here")  # outcome: the call, or the RpcError
    assert response is not None and response.value == "still here", outcome


async def test_a_frame_above_the_advertised_max_frame_size_is_a_connection_error(
    nursery: trio.Nursery,
) -> None:
    server, _, port = await start(nursery)
    peer = await raw(port)
    await peer.handshake()
    # A DATA frame header declaring 16 MiB (h2 alone buffered all of it before checking the
    # length), then the start of its payload: the header alone is refused.
    await peer.send(frame_header(2**24 - 1, 0x0, 0, 1) + b"\0" * (64 * KiB))
    frames = await peer.closed_within(5)
    goaway = [f for f in frames if isinstance(f, GoAwayFrame)]
    assert goaway and goaway[0].error_code == FRAME_SIZE_ERROR
    assert server.buffered_bytes <= BOUNDED.per_connection_memory_bytes
    await peer.aclose()
    await still_serving(port)


async def test_a_header_block_above_the_header_list_limit_is_a_connection_error(
    nursery: trio.Nursery,
) -> None:
    server, _, port = await start(nursery)
    peer = await raw(port)
    await peer.handshake()
    # HEADERS without END_HEADERS, then CONTINUATION frames: h2 alone would buffer 64 of them.
    await peer.send(HeadersFrame(1, data=b"\x00" * 2048).serialize() + b"".join(
        ContinuationFrame(1, data=b"\x00" * 2048).serialize() for _ in range(5)))
    frames = await peer.closed_within(5)
    goaway = [f for f in frames if isinstance(f, GoAwayFrame)]
    assert goaway and goaway[0].error_code == ENHANCE_YOUR_CALM
    assert server.buffered_bytes <= BOUNDED.per_connection_memory_bytes
    await peer.aclose()
    await still_serving(port)


async def test_one_oversized_header_list_is_refused_too(nursery: trio.Nursery) -> None:
    _, _, port = await start(nursery)
    peer = await raw(port)
    await peer.handshake()
    sid, _ = peer.headers("/x/y")
    block = peer.encoder.encode([(":method", "POST"), ("x-big", "v" * (BOUNDED.max_header_list_bytes + 1))])
    await peer.send(HeadersFrame(sid, data=block, flags={"END_HEADERS"}).serialize())
    frames = await peer.closed_within(5)
    assert any(isinstance(f, GoAwayFrame) and f.error_code == ENHANCE_YOUR_CALM for f in frames)
    await peer.aclose()


@pytest.mark.parametrize("junk", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # no preface at all
    PREFACE + b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # junk after the preface
    PREFACE + b"\xff" * 64,
])
async def test_junk_is_cut_at_once(nursery: trio.Nursery, junk: bytes) -> None:
    server, _, port = await start(nursery, dataclasses.replace(BOUNDED, handshake_timeout=60))
    peer = await raw(port)
    await peer.send(junk)
    await peer.closed_within(5)  # far below the 60 s handshake timeout
    await peer.aclose()
    await trio.testing.wait_all_tasks_blocked()
    assert server.open_connections == 0
    await still_serving(port)


@pytest.mark.parametrize("opening", [b"", PREFACE, PREFACE + frame_header(0, 0x0, 0, 0)[:5]])
async def test_a_connection_that_never_completes_the_handshake_is_closed(
    nursery: trio.Nursery, opening: bytes,
) -> None:
    server, _, port = await start(nursery)
    peer = await raw(port)
    await peer.send(opening)
    frames = await peer.closed_within(BOUNDED.handshake_timeout + 10)
    assert not any(isinstance(f, HeadersFrame) for f in frames)
    await peer.aclose()
    await trio.testing.wait_all_tasks_blocked()
    assert server.open_connections == 0


async def test_a_peer_that_stops_answering_pings_is_closed(nursery: trio.Nursery) -> None:
    server, _, port = await start(nursery)
    quiet, lively = await raw(port), await raw(port)
    await quiet.handshake()
    await lively.handshake()

    async def answer_pings() -> None:  # reads and ACKs every PING: a healthy idle client
        while await lively.next_frame() is not None:
            pass

    async with trio.open_nursery() as inner:
        inner.start_soon(answer_pings)
        # The quiet peer reads but never answers: no SETTINGS ACK, no PING ACK.
        quiet.answer = False
        frames = await quiet.closed_within(10)
        assert any(isinstance(f, PingFrame) and "ACK" not in f.flags for f in frames), frames
        assert server.open_connections == 1 and not lively.eof  # the lively one stays
        inner.cancel_scope.cancel()
    await quiet.aclose()
    await lively.aclose()


async def test_connections_beyond_the_limit_are_closed_at_once(nursery: trio.Nursery) -> None:
    server, _, port = await start(nursery, dataclasses.replace(BOUNDED, handshake_timeout=60))
    peers = [await raw(port) for _ in range(BOUNDED.max_connections)]
    for peer in peers:
        await peer.handshake()
        await peer.until(lambda f: f.type == 0x4)  # the server's SETTINGS: it is served
    extra = await raw(port)
    assert await extra.closed_within(5) == []  # closed without a byte of HTTP/2
    assert server.refused_connections == 1
    for peer in peers:  # the ones inside the limit still work
        sid = await peer.start(f"/{SERVICE}/Unary", StringValue(value="hi"), end=True)
        assert (await peer.headers_of(sid))["grpc-status"] == "0"
    await peers.pop().aclose()
    await extra.aclose()
    with trio.fail_after(10):
        while server.open_connections >= BOUNDED.max_connections:
            await trio.sleep(0.01)
    await still_serving(port)  # room again
    for peer in peers:
        await peer.aclose()


async def fill_partial_messages(client: RawClient, echo: Echo, streams: int) -> list[int]:
    """Open ``streams`` calls whose handler never reads again, then send each an unfinished
    message as fast as flow control allows, until the server grants nothing more."""
    sids = []
    for i in range(streams):
        sid = await client.request("Bidi", frame(f"hang:p{id(client)}-{i}"), end=False)
        await settle(echo.started[f"p{id(client)}-{i}"])
        header = grpc_message(b"")[:1] + (BOUNDED.max_message_bytes - 16).to_bytes(4, "big")
        client.h2.send_data(sid, header)
        sids.append(sid)
    await client.flush()
    stalled = 0
    while stalled < 3:
        sent = 0
        for sid in sids:
            room = min(client.h2.local_flow_control_window(sid), client.h2.max_outbound_frame_size)
            if room > 0:
                client.h2.send_data(sid, b"\0" * room)
                sent += room
        client.h2.ping(b"barrier!")  # answered after the server processed what came before
        await client.flush()
        await client.until(lambda e: isinstance(e, h2.events.PingAckReceived))
        stalled = stalled + 1 if sent == 0 else 0
    return sids


async def test_unfinished_messages_count_against_the_window(nursery: trio.Nursery) -> None:
    """8 streams x an unfinished 256 KiB message would be 2 MiB on one connection; the ledger
    stops acknowledging at connection_buffer_bytes, so the peer runs out of window instead."""
    server, echo, port = await start(nursery)
    client = await RawClient.connect(port)
    sids = await fill_partial_messages(client, echo, streams=8)
    (conn,) = server._connections  # noqa: SLF001
    held = sum(conn.h2.flow[sid].partial for sid in sids)
    assert held > 0
    assert conn.h2.held <= BOUNDED.connection_buffer_bytes + BOUNDED.connection_window_bytes
    assert server.buffered_bytes <= BOUNDED.per_connection_memory_bytes
    assert held < 8 * (BOUNDED.max_message_bytes - 16)  # not every message got through
    await still_serving(port)  # small calls on other connections go on
    await client.stream.aclose()
    await trio.testing.wait_all_tasks_blocked()
    assert server.pool.held == 0  # everything given back when the connection closed


async def test_all_connections_together_stay_within_the_total_cap(nursery: trio.Nursery) -> None:
    limits = dataclasses.replace(BOUNDED, total_buffer_bytes=600 * KiB)
    server, echo, port = await start(nursery, limits)
    clients = [await RawClient.connect(port) for _ in range(3)]
    for client in clients:
        await fill_partial_messages(client, echo, streams=4)
    bound = limits.total_buffer_bytes + len(clients) * (
        limits.connection_window_bytes + 2 * limits.max_frame_bytes + READ_SIZE)
    assert server.buffered_bytes <= bound
    assert server.pool.held <= limits.total_buffer_bytes + len(clients) * limits.connection_window_bytes
    await still_serving(port)
    for client in clients:
        await client.stream.aclose()


async def test_unary_calls_are_not_starved_by_a_connection_full_of_streams(
    nursery: trio.Nursery,
) -> None:
    """With every streaming slot of a connection in use, unary calls on the same connection
    (a router's Cancel / GetMetrics) still get a stream; one more streaming call is refused
    with RESOURCE_EXHAUSTED instead of waiting for its deadline."""
    _, echo, port = await start(nursery)
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        conn = ClientConnection(stream, "test", "http", SERVICE, BOUNDED)
        async with trio.open_nursery() as inner:
            await inner.start(conn.run)
            deadline = trio.current_time() + 30
            held = []
            for i in range(BOUNDED.max_concurrent_streams):
                s = conn.open_stream("Bidi", deadline, ())
                await s.send(StringValue(value=f"hang:busy{i}"))
                held.append(s)
            for i in range(BOUNDED.max_concurrent_streams):
                await settle(echo.started[f"busy{i}"])
            for _ in range(BOUNDED.unary_reserve + 2):  # more than the reserve, one at a time
                s = conn.open_stream("Unary", deadline, ())
                await s.send(StringValue(value="ping"))
                await s.half_close()
                with trio.fail_after(10):
                    reply = await s.receive(StringValue)
                assert reply is not None and reply.value == "ping"
                assert await s.receive(StringValue) is None and s.status == (0, "")
                s.close()
            extra = conn.open_stream("Bidi", deadline, ())
            await extra.send(StringValue(value="one too many"))
            with trio.fail_after(10):
                assert await extra.receive(StringValue) is None
            assert extra.status is not None and extra.status[0] == GrpcStatus.RESOURCE_EXHAUSTED
            for s in held:
                s.abort()
            conn.goodbye()
            inner.cancel_scope.cancel()


async def test_the_client_advertises_the_same_bounded_settings() -> None:
    left, right = trio.testing.memory_stream_pair()
    conn = ClientConnection(left, "test", "http", SERVICE, BOUNDED)
    async with trio.open_nursery() as nursery:
        await nursery.start(conn.run)
        import h2.config
        import h2.connection

        server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        events: list[Any] = []
        with trio.fail_after(5):
            while not any(isinstance(e, h2.events.WindowUpdated) for e in events):
                events += server.receive_data(await right.receive_some(65536))
        (settings,) = [e for e in events if isinstance(e, h2.events.RemoteSettingsChanged)]
        values = {int(k): v.new_value for k, v in settings.changed_settings.items()}
        assert values[0x3] == 1  # MAX_CONCURRENT_STREAMS: see the late-trailers test below
        assert values[0x4] == BOUNDED.stream_window_bytes  # not purerpc's 2 x 4 MiB
        assert values[0x5] == BOUNDED.max_frame_bytes
        assert values[0x6] == BOUNDED.max_header_list_bytes
        (update,) = [e for e in events if isinstance(e, h2.events.WindowUpdated)]
        assert update.delta + 65535 == BOUNDED.connection_window_bytes  # not 1 GiB
        conn.goodbye()
        nursery.cancel_scope.cancel()


async def test_a_router_can_cancel_over_its_own_connection_with_64_session_streams() -> None:
    """The issue's case on the real worker: 64 Session streams on one connection, then Cancel
    and GetMetrics on the same connection answer instead of waiting for their deadline."""
    from rpc_harness import V, worker
    from shard.v1 import shard_pb2 as pb

    async with worker() as w:
        host, port = w.target.rsplit(":", 1)
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            conn = ClientConnection(stream, w.target, "http", "shard.v1.Shard")
            async with trio.open_nursery() as inner:
                await inner.start(conn.run)
                deadline = trio.current_time() + 30
                limit = TransportLimits().max_concurrent_streams
                sessions = [conn.open_stream("Session", deadline, ()) for _ in range(limit)]
                await conn.flush()
                with trio.fail_after(10):
                    await w.server.registry.streams.wait_value(limit)
                for method, request, reply_type in (
                    ("Cancel", pb.CancelRequest(version=V, session_id="nope"), pb.CancelResponse),
                    ("GetMetrics", pb.GetMetricsRequest(version=V), pb.GetMetricsResponse),
                ):
                    s = conn.open_stream(method, trio.current_time() + 10, ())
                    await s.send(request)
                    await s.half_close()
                    reply = await s.receive(reply_type)
                    assert reply is not None and s.error() is None, (method, s.status)
                    s.close()
                extra = conn.open_stream("Session", deadline, ())
                with trio.fail_after(10):
                    assert await extra.receive(pb.SessionResponse) is None
                assert extra.status is not None
                assert extra.status[0] == GrpcStatus.RESOURCE_EXHAUSTED
                for s in sessions:
                    s.abort()
                conn.goodbye()
                with trio.fail_after(10):
                    await conn.drain()
                inner.cancel_scope.cancel()
        await w.idle()


# ---- the issue's attacks against a real `trio-shard serve`, measured in RSS -----------------


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="RSS is read from /proc")
def test_worker_rss_stays_within_the_documented_cap_under_the_issues_attacks() -> None:
    """8 connections declaring a 16 MiB DATA frame (once ~18 MB each, kept after close), then
    one well-behaved connection with 16 unfinished 16 MiB messages (once acknowledged in full):
    the worker's RSS grows by less than the documented per-connection cap, and it still
    answers other clients."""
    import grpc
    from grpc_health.v1 import health_pb2

    cap_mib = TransportLimits().per_connection_memory_bytes / 2**20
    proc = subprocess.Popen(
        [sys.executable, "-m", "shard.cli", "serve", "--port", "0", "--threads", "1",
         "--max-sessions", "2", "--ctx", "1024"], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    reader = threading.Thread(target=proc.stderr.read, daemon=True)
    try:
        host = port = None
        for line in proc.stderr:
            if m := re.search(r"serving shard\.v1\.Shard on (\S+):(\d+)", line):
                host, port = m.group(1), int(m.group(2))
                break
        assert host and port
        reader.start()  # keeps the pipe from filling up
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            check = channel.unary_unary(
                "/grpc.health.v1.Health/Check",
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString)
            check(health_pb2.HealthCheckRequest(), timeout=60, wait_for_ready=True)  # loaded
            before = _rss_mib(proc.pid)

            socks = []
            for _ in range(8):
                sock = socket.create_connection((host, port), timeout=10)
                sock.sendall(PREFACE + SettingsFrame(0).serialize() + frame_header(2**24 - 1, 0, 0, 1))
                with contextlib.suppress(OSError):
                    sock.sendall(b"\0" * (1024 * KiB))
                socks.append(sock)
            for sock in socks:  # every one is cut (EOF or reset) well within the timeout
                with contextlib.suppress(ConnectionResetError):
                    while sock.recv(65536):
                        pass
                sock.close()
            grown = _rss_mib(proc.pid) - before
            assert grown < 16, f"frame-size attack grew RSS by {grown:.0f} MiB"

            sent = _fill_unfinished_messages(host, port, streams=16)
            grown = _rss_mib(proc.pid) - before
            # The peer got well past one message, but not past the cap (16 x 16 MiB once).
            assert 16 * 2**20 < sent <= TransportLimits().per_connection_memory_bytes, sent
            assert grown < cap_mib + 16, (
                f"RSS grew {grown:.0f} MiB, documented cap {cap_mib:.0f} MiB per connection")
            reply = check(health_pb2.HealthCheckRequest(), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        if reader.is_alive():
            reader.join(timeout=10)
        proc.stderr.close()


def _fill_unfinished_messages(host: str, port: int, *, streams: int) -> int:
    """One HTTP/2 connection that obeys flow control: each stream starts a message just under
    16 MiB and sends as much of it as the windows allow, until the worker grants nothing more.
    Returns the bytes sent; the connection is still open when it returns (and then closed)."""
    import h2.config
    import h2.connection

    sock = socket.create_connection((host, port), timeout=10)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    sids = []
    for _ in range(streams):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", "x"),
                                (":path", "/shard.v1.Shard/Session"), ("te", "trailers"),
                                ("content-type", "application/grpc")])
        conn.send_data(sid, b"\0" + (16 * 2**20 - 16).to_bytes(4, "big"))
        sids.append(sid)
    sock.sendall(conn.data_to_send())
    sent, idle = 0, 0
    try:
        while idle < 5:
            batch = 0
            for sid in sids:
                room = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
                if room > 0:
                    conn.send_data(sid, b"\0" * room)
                    batch += room
            conn.ping(b"barrier!")
            sock.sendall(conn.data_to_send())
            while not any(isinstance(e, h2.events.PingAckReceived)
                          for e in conn.receive_data(sock.recv(1 << 20))):
                pass
            sent += batch
            idle = idle + 1 if batch == 0 else 0
        return sent
    finally:
        sock.close()


async def test_a_client_that_stops_reading_holds_at_most_a_window(nursery: trio.Nursery) -> None:
    """The client's ledger acknowledges only what its caller reads (plus one window), so a
    server streaming at a caller that stopped reading cannot grow the client's memory."""
    _, _, port = await start(nursery)
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        conn = ClientConnection(stream, "test", "http", SERVICE, BOUNDED)
        async with trio.open_nursery() as inner:
            await inner.start(conn.run)
            s = conn.open_stream("Bidi", trio.current_time() + 30, ())
            sent = 0

            async def send_forever() -> None:  # echoed back; the test never reads a reply
                nonlocal sent
                while s.status is None:
                    await s.send(StringValue(value="z" * (16 * KiB)))
                    sent += 1

            inner.start_soon(send_forever)
            with trio.fail_after(10):  # until flow control stops the sender
                while True:
                    before = sent
                    await trio.sleep(0.2)
                    if sent == before and sent > 0:
                        break
            assert s.status is None, s.status
            assert sent < 200  # 200 x 16 KiB would have fitted an unbounded client
            # Acknowledged: at most a window of unread messages; in flight: one more window.
            held = conn.h2.held
            assert 0 < held <= 2 * BOUNDED.stream_window_bytes + 16 * KiB + 64, held
            s.abort()
            conn.goodbye()
            inner.cancel_scope.cancel()


async def test_trailers_racing_a_client_reset_leave_the_connection_usable() -> None:
    """The server's trailers for a call can cross the client's RST_STREAM on the wire. The
    client must drop them and keep the connection: with MAX_CONCURRENT_STREAMS 0, h2 took them
    for a new server-initiated stream over the limit and killed every call on the connection
    (found by the RPC fuzzer)."""
    import h2.config
    import h2.connection

    left, right = trio.testing.memory_stream_pair()
    conn = ClientConnection(left, "test", "http", SERVICE, BOUNDED)
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    server.initiate_connection()
    await right.send_all(server.data_to_send())

    async def server_reads() -> list[Any]:
        events: list[Any] = []
        with trio.move_on_after(0.2):
            while True:
                events += server.receive_data(await right.receive_some(65536))
                await right.send_all(server.data_to_send())
        return events

    async with trio.open_nursery() as nursery:
        await nursery.start(conn.run)
        first = conn.open_stream("Unary", trio.current_time() + 30, ())
        await first.send(StringValue(value="x"))
        events = await server_reads()
        assert any(isinstance(e, h2.events.RequestReceived) for e in events)
        first.abort()  # RST_STREAM(CANCEL) is on its way; the server has not read it yet
        # A new call makes h2 prune the closed stream from its table: the late frames below
        # then look like a stream the server opened.
        second = conn.open_stream("Unary", trio.current_time() + 30, ())
        server.send_headers(first.sid, [(":status", "200"), ("content-type", "application/grpc")])
        server.send_headers(first.sid, [("grpc-status", "0")], end_stream=True)
        await right.send_all(server.data_to_send())
        await second.send(StringValue(value="y"))
        events = await server_reads()  # the server reads the reset and the second call
        assert conn.dead is None
        assert [e.stream_id for e in events if isinstance(e, h2.events.RequestReceived)] == [second.sid]
        third = conn.open_stream("Unary", trio.current_time() + 30, ())  # still usable
        await third.send(StringValue(value="z"))
        events = await server_reads()
        assert [e.stream_id for e in events if isinstance(e, h2.events.RequestReceived)] == [third.sid]
        third.abort()
        second.abort()
        conn.goodbye()
        nursery.cancel_scope.cancel()


async def test_a_long_lived_connection_remembers_a_bounded_number_of_closed_streams(
    nursery: trio.Nursery,
) -> None:
    """h2 remembers closed streams (to answer late frames of a reset one); by default 65,536 per
    connection, about 6 MiB on a router's long-lived connection. Both ends keep the limit."""
    limits = dataclasses.replace(BOUNDED, closed_streams_remembered=16)
    server, _, port = await start(nursery, limits)
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        conn = ClientConnection(stream, "test", "http", SERVICE, limits)
        async with trio.open_nursery() as inner:
            await inner.start(conn.run)
            for i in range(100):
                s = conn.open_stream("Unary", trio.current_time() + 30, ())
                await s.send(StringValue(value=f"call {i}"))
                await s.half_close()
                with trio.fail_after(10):
                    reply = await s.receive(StringValue)
                assert reply is not None and reply.value == f"call {i}"
                assert await s.receive(StringValue) is None and s.status == (0, "")
                s.close()
            (served,) = server._connections  # noqa: SLF001 - the bookkeeping under test
            for h2c in (served.h2.h2_connection, conn.h2.h2_connection):
                assert 0 < len(h2c._closed_streams) <= 16  # noqa: SLF001
            conn.goodbye()
            inner.cancel_scope.cancel()
