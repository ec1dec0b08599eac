"""A drain a router can trust: GOAWAY at once, only Session streams hold it, every stream ends
with a status and the ``shard-error-bin`` trailer (never a bare socket close).

The worker is the real ``serve()`` with the fake engine; clients are the transport's own
``ClientConnection`` (which keeps serving its open streams after a graceful GOAWAY) and, where
the exact frames matter, a raw socket that parses frames with hyperframe.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing
from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import V, req, worker
from shard.rpc.errors import ErrorCode, GrpcStatus
from shard.rpc.transport import ClientConnection, ClientStream, TransportLimits
from shard.v1 import shard_pb2 as pb

SHARD, HEALTH = "shard.v1.Shard", "grpc.health.v1.Health"


@asynccontextmanager
async def connect(target: str, service: str) -> AsyncIterator[ClientConnection]:
    host, port = target.rsplit(":", 1)
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        conn = ClientConnection(stream, target, "http", service)
        async with trio.open_nursery() as nursery:
            await nursery.start(conn.run)
            try:
                yield conn
            finally:
                conn.goodbye()
                nursery.cancel_scope.cancel()


async def open_session(conn: ClientConnection, session_id: str) -> ClientStream:
    s = conn.open_stream("Session", trio.current_time() + 30, ())
    await s.send(req(open=pb.OpenSession(session_id=session_id)))
    with trio.fail_after(10):
        opened = await s.receive(pb.SessionResponse)
    assert opened is not None and opened.WhichOneof("kind") == "opened"
    return s


async def open_watch(conn: ClientConnection) -> ClientStream:
    s = conn.open_stream("Watch", trio.current_time() + 30, ())
    await s.send(HealthCheckRequest(service=""))
    await s.half_close()
    with trio.fail_after(10):
        first = await s.receive(HealthCheckResponse)
    assert first is not None and first.status == HealthCheckResponse.SERVING
    return s


async def close_session(s: ClientStream) -> None:
    await s.send(req(close=pb.CloseSession()))
    await s.half_close()
    with trio.fail_after(10):
        while (msg := await s.receive(pb.SessionResponse)) is not None:
            assert msg.WhichOneof("kind") == "closed"
    assert s.status is not None and s.status[0] == GrpcStatus.OK


async def until_ended(s: ClientStream, message_type: Any) -> list[Any]:
    """Every remaining message; then the stream must have a status (not a lost connection)."""
    seen = []
    with trio.fail_after(10):
        while (msg := await s.receive(message_type)) is not None:
            seen.append(msg)
    return seen


def assert_drained_status(s: ClientStream) -> None:
    """UNAVAILABLE with a DRAINING ``shard-error-bin``: retry elsewhere, not a crash."""
    assert s.status is not None and s.status[0] == GrpcStatus.UNAVAILABLE, s.status
    assert "lost" not in s.status[1], s.status  # a real status, not "connection ... lost"
    err = s.error()
    assert err is not None and err.code is ErrorCode.DRAINING and err.retryable, err


async def test_a_watch_does_not_hold_the_drain_and_ends_with_a_status() -> None:
    async with worker() as w, connect(w.target, SHARD) as shard, connect(w.target, HEALTH) as health:
        session = await open_session(shard, "a")
        watch = await open_watch(health)
        result: list[bool] = []
        drained = trio.Event()

        async def drain() -> None:
            result.append(await w.server.drain_for(60))  # a grace far beyond the test bound
            drained.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            with trio.fail_after(10):
                while not (shard.going_away and health.going_away):  # GOAWAY at once
                    await trio.sleep(0.01)
            update = await watch.receive(HealthCheckResponse)  # the watcher hears it first
            assert update is not None and update.status == HealthCheckResponse.NOT_SERVING
            await trio.testing.wait_all_tasks_blocked()
            assert not drained.is_set()  # the session still runs; the Watch does not count
            assert watch.status is None
            await close_session(session)  # the open stream keeps working after GOAWAY
            with trio.fail_after(5):  # right after the last session, not after the grace
                await drained.wait()
        assert result == [True]
        assert await until_ended(watch, HealthCheckResponse) == []
        assert_drained_status(watch)
        assert w.server.transport.open_calls == 0


async def test_streams_outliving_the_grace_end_with_draining_and_the_trailer() -> None:
    async with worker() as w, connect(w.target, SHARD) as conn:
        sessions = [await open_session(conn, f"s{i}") for i in range(3)]
        with trio.fail_after(10):
            assert await w.server.drain_for(0.2) is False  # nobody closed their session
        for s in sessions:
            assert await until_ended(s, pb.SessionResponse) == []
            assert_drained_status(s)
        assert w.engine.sessions() == ()  # released, not retained: the worker is going away
        assert w.server.registry.n_retained == 0


async def test_a_second_signal_gives_every_stream_a_status_before_stopping() -> None:
    from shard.cli.serve import stop_on_signal as _stop_on_signal

    async with worker() as w, connect(w.target, SHARD) as conn, connect(w.target, HEALTH) as h:
        session = await open_session(conn, "held")
        watch = await open_watch(h)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, w.server, w._scope, 60.0)  # noqa: SLF001
            await trio.testing.wait_all_tasks_blocked()
            os.kill(os.getpid(), signal.SIGTERM)
            with trio.fail_after(10):
                while not conn.going_away:
                    await trio.sleep(0.01)
            assert session.status is None  # the first signal only drains
            os.kill(os.getpid(), signal.SIGTERM)  # the second: stop now
            with trio.fail_after(10):
                await until_ended(session, pb.SessionResponse)
                await until_ended(watch, HealthCheckResponse)
        assert w._scope.cancel_called  # noqa: SLF001 - the server was stopped
        assert_drained_status(session)
        assert_drained_status(watch)


async def test_cancelling_serve_gives_open_streams_a_status() -> None:
    async with worker() as w, connect(w.target, SHARD) as conn:
        session = await open_session(conn, "x")
        w.stop()
        await until_ended(session, pb.SessionResponse)
        assert_drained_status(session)


async def test_raw_client_sees_goaway_in_two_steps_and_later_streams_are_refused() -> None:
    """GOAWAY(2^31-1) and a PING first: a stream the client opens before it acknowledged the PING
    (it had not seen the GOAWAY yet) is served, not refused unseen (grpcio would retry it
    transparently); the final GOAWAY names it, and streams after that are refused."""
    from raw_h2 import RawConnection

    async with worker() as w:
        host, port = w.target.rsplit(":", 1)
        raw = await RawConnection.open(host, int(port))
        try:
            await raw.handshake()
            watch = await raw.start(f"/{HEALTH}/Watch", HealthCheckRequest(service=""), end=True)
            await raw.until(lambda f: f.type == 0x0 and f.stream_id == watch)  # first status
            w.server.drain()
            first = await raw.until(lambda f: f.type == 0x7)
            assert first.last_stream_id == 2**31 - 1 and first.error_code == 0
            # Opened before the PING that follows the GOAWAY is read (and acknowledged).
            raced = await raw.start(f"/{SHARD}/Health", pb.HealthRequest(version=V), end=True)
            final = await raw.until(lambda f: f.type == 0x7)
            assert final.last_stream_id == raced and final.error_code == 0
            answer = await raw.headers_of(raced)
            assert answer["grpc-status"] == "0"  # served: Health answers while draining
            late = await raw.start(f"/{SHARD}/Health", pb.HealthRequest(version=V), end=True)
            reset = await raw.until(lambda f: f.type == 0x3 and f.stream_id == late)
            assert reset.error_code == 0x7  # REFUSED_STREAM: no work was done, retry elsewhere
            await w.server.end_streams()
            trailers = await raw.headers_of(watch)
            assert trailers["grpc-status"] == str(int(GrpcStatus.UNAVAILABLE))
            assert "shard-error-bin" in trailers
        finally:
            await raw.aclose()


async def test_a_client_that_never_answers_the_drain_ping_gets_the_final_goaway() -> None:
    from raw_h2 import RawConnection

    async with worker(transport_limits=TransportLimits(keepalive_timeout=0.2)) as w:
        host, port = w.target.rsplit(":", 1)
        raw = await RawConnection.open(host, int(port))
        try:
            await raw.handshake()
            opened = await raw.start(f"/{SHARD}/Health", pb.HealthRequest(version=V), end=True)
            await raw.headers_of(opened)
            raw.answer = False  # silent from now on: the PING is never acknowledged
            w.server.drain()
            first = await raw.until(lambda f: f.type == 0x7)
            assert first.last_stream_id == 2**31 - 1
            final = await raw.until(lambda f: f.type == 0x7)  # after keepalive_timeout
            assert final.last_stream_id == opened
        finally:
            await raw.aclose()


async def test_drain_with_only_a_watch_open_is_immediate() -> None:
    async with worker() as w, connect(w.target, HEALTH) as health:
        watch = await open_watch(health)
        with trio.fail_after(5):
            assert await w.server.drain_for(30) is True
        await until_ended(watch, HealthCheckResponse)
        assert_drained_status(watch)
