"""The served token's short path (issue "a lean per-token path"): a response framed by the
session's own task (``session.Responses``, ``Call.send_now``), a DATA frame built without h2's
frame objects (``BoundedH2.send_message``) and a lone stream's bytes written by the task that
framed them (``wire.Outbox.push(write_through=True)``). Each must be indistinguishable on the
wire from the long path it replaces, and must refuse whatever would need a wait."""

from __future__ import annotations

import socket

import h2.config
import h2.connection
import h2.settings
import pytest
import trio
import trio.testing

from shard.rpc.session import Responses
from shard.rpc.transport import wire
from shard.v1 import shard_pb2 as pb

HEADERS = [(":method", "POST"), (":scheme", "http"), (":path", "/shard.v1.Shard/Session"),
           (":authority", "test"), ("te", "trailers"), ("content-type", "application/grpc")]


def _answered_stream(window: int = 65535) -> tuple[wire.BoundedH2, h2.connection.H2Connection, int]:
    """A server-side ``BoundedH2`` with one stream it answered (headers sent), and its peer."""
    server = wire.BoundedH2(wire.TransportLimits(), client_side=False)
    server.initiate_connection()
    peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    peer.initiate_connection()
    peer.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
    server.receive_data(peer.data_to_send())
    peer.receive_data(server.data_to_send())
    sid = peer.get_next_available_stream_id()
    peer.send_headers(sid, HEADERS)
    server.receive_data(peer.data_to_send())
    server.start_response(sid)
    server.data_to_send()  # (the response headers: not under test)
    return server, peer, sid


def _windows(server: wire.BoundedH2, sid: int) -> tuple[int, int]:
    h2c = server.h2_connection
    return h2c.outbound_flow_control_window, h2c.streams[sid].outbound_flow_control_window


@pytest.mark.parametrize("size", [0, 1, 5, 300, 16384])
def test_a_message_frame_is_byte_for_byte_h2s_data_frame(size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    long_path, _, sid = _answered_stream()
    short_path, peer, sid2 = _answered_stream()
    assert sid == sid2
    long_path.send_data(sid, data)
    assert short_path.send_message(sid, data) is True
    framed = short_path.data_to_send()
    assert framed == long_path.data_to_send()
    assert _windows(short_path, sid) == _windows(long_path, sid)
    events = peer.receive_data(framed)  # and a real HTTP/2 peer reads it as DATA
    assert [type(e).__name__ for e in events] == ["DataReceived"]
    assert events[0].data == data


def test_a_message_that_needs_a_wait_is_left_to_h2() -> None:
    server, _, sid = _answered_stream(window=100)
    before = _windows(server, sid)
    assert server.send_message(sid, bytes(101)) is False  # more than the stream's window
    assert server.send_message(sid, bytes(20000)) is False  # more than one frame
    assert server.send_message(sid + 2, b"x") is False  # no such stream
    assert _windows(server, sid) == before and server.data_to_send() == b""
    server.h2_connection.end_stream(sid)  # half-closed (local): no more DATA may go
    server.data_to_send()
    assert server.send_message(sid, b"x") is False


def _response(n: int) -> pb.SessionResponse:
    return pb.SessionResponse(step=pb.StepResult(step=n))


async def test_responses_keep_their_order_across_the_direct_path_and_the_channel() -> None:
    """Once a response took the channel (no window), later ones follow it there until the
    handler has forwarded them all; then the direct path is used again."""
    wire_order: list[int] = []
    refuse = {2}

    class Wire:
        def send_now(self, msg: pb.SessionResponse, more_follows: bool) -> bool:
            if msg.step.step in refuse:
                return False
            wire_order.append(msg.step.step)
            return True

    out = Responses(8)
    out.send_directly(Wire())
    out._idle = True  # noqa: SLF001 - the handler waits on an empty channel (next_response)
    out.send_nowait(_response(1))  # direct
    out.send_nowait(_response(2))  # refused: the channel
    out.send_nowait(_response(3))  # the direct path would take it, but 2 waits in the channel
    assert wire_order == [1]
    assert out.receive.receive_nowait().step.step == 2  # the handler forwards both, in order
    wire_order.append(2)
    assert out.receive.receive_nowait().step.step == 3
    wire_order.append(3)
    out._idle = True  # noqa: SLF001 - the handler waits again
    await out.send(_response(4))
    assert wire_order == [1, 2, 3, 4]
    out.through_handler = True  # (a relayed last hop: the chain's copy is the slow one)
    await out.send(_response(5))
    assert wire_order == [1, 2, 3, 4] and out.receive.receive_nowait().step.step == 5


async def test_a_lone_streams_bytes_leave_from_the_task_that_framed_them() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours, peer = trio.SocketStream(trio.socket.from_stdlib_socket(a)), trio.SocketStream(
        trio.socket.from_stdlib_socket(b))
    outbox = wire.Outbox()
    async with ours, peer, trio.open_nursery() as nursery:
        nursery.start_soon(outbox.write_forever, ours)
        await trio.testing.wait_all_tasks_blocked()  # the writer idles
        outbox.push(b"first", write_through=True)
        assert len(outbox) == 0  # written already: no writer step needed
        assert await peer.receive_some(100) == b"first"
        outbox.push(b"second")  # without write-through the writer sends it
        assert len(outbox) == 6
        with trio.fail_after(10):
            assert await peer.receive_some(100) == b"second"
        await trio.testing.wait_all_tasks_blocked()
        outbox.push(b"a result, ")  # (its Usage follows in the same task step)
        outbox.push(b"its usage", write_through=True)  # both in one write
        assert len(outbox) == 0
        assert await peer.receive_some(100) == b"a result, its usage"
        nursery.cancel_scope.cancel()
    outbox.push(b"late", write_through=True)  # the writer is gone: queued, never written
    assert len(outbox) == 4


@pytest.mark.parametrize("kind", ["decode", "credit"])
async def test_a_client_driven_step_is_started_by_the_connections_reader(
    kind: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Decode (and a credit grant) is taken by the connection's reader while the stream's own
    reader waits with nothing queued (``CallContext.take_now``): that task is not woken per
    request (it was: one task step and one scheduler pass each)."""
    from rpc_harness import TaskSteps, worker
    from shard.client import ShardClient
    from shard.rpc.session import SessionCall

    counter = TaskSteps()  # counts the stream's reader task, found by its first requests
    dispatch = SessionCall._dispatch

    async def spy(self: SessionCall, req: pb.SessionRequest) -> None:
        counter.tasks.add(trio.lowlevel.current_task())
        await dispatch(self, req)

    monkeypatch.setattr(SessionCall, "_dispatch", spy)
    steps = 24
    async with worker() as w, ShardClient.connect(w.target, timeout=10) as client:
        async with client.session("lean", credit=1 if kind == "credit" else 0) as s:
            token = (await s.prefill([1, 72, 101, 108, 108, 111])).logits.token_id
            assert counter.tasks
            trio.lowlevel.add_instrument(counter)
            try:
                tokens = []
                if kind == "decode":
                    for _ in range(steps):
                        token = (await s.decode(token=token)).logits.token_id
                        tokens.append(token)
                else:  # a generation under a credit window of one: a grant per token
                    async for step in s.generate(max_tokens=steps, ignore_eos=True):
                        tokens.append(step.logits.token_id)
            finally:
                trio.lowlevel.remove_instrument(counter)
        assert len(tokens) == steps
        assert counter.steps <= 2, counter.steps


async def test_a_request_behind_one_the_streams_reader_must_take_is_not_taken_ahead_of_it() -> None:
    """A CloseSession is left to the stream's reader task; a Decode in the same read, right
    behind it, must not be started by the connection's reader while the close waits for that
    task (the session would still be IDLE): it is refused as a step after the close and never
    runs. Sent as one write by a raw HTTP/2 peer, so that the server reads both at once."""
    from urllib.parse import unquote

    from hyperframe.frame import DataFrame

    from raw_h2 import RawConnection, grpc_message
    from rpc_harness import req, worker

    async def until(peer: RawConnection, sid: int, kind: str, buf: bytearray) -> pb.SessionResponse:
        while True:
            while len(buf) >= 5 and len(buf) >= 5 + int.from_bytes(buf[1:5], "big"):
                n = int.from_bytes(buf[1:5], "big")
                msg = pb.SessionResponse.FromString(bytes(buf[5:5 + n]))
                del buf[:5 + n]
                if msg.WhichOneof("kind") == kind:
                    return msg
            frame = await peer.until(lambda f: isinstance(f, DataFrame) and f.stream_id == sid)
            buf += frame.data

    def data(message: pb.SessionRequest, sid: int) -> bytes:
        return DataFrame(sid, data=grpc_message(message)).serialize()

    async with worker() as w:
        host, port = w.target.rsplit(":", 1)
        peer = await RawConnection.open(host, int(port))
        try:
            await peer.handshake()
            buf = bytearray()
            sid = await peer.start("/shard.v1.Shard/Session", req(open=pb.OpenSession(session_id="raw")),
                                   end=False)
            await until(peer, sid, "opened", buf)
            await peer.send(data(req(prefill=pb.Prefill(tokens=pb.TokenIds(ids=[1, 72, 101]))), sid))
            await until(peer, sid, "usage", buf)
            await peer.send(data(req(close=pb.CloseSession(retain=False)), sid)
                            + data(req(decode=pb.Decode(token=1)), sid))
            status = await peer.headers_of(sid)
        finally:
            await peer.aclose()
        assert status["grpc-status"] == "9", status  # FAILED_PRECONDITION: ILLEGAL_TRANSITION
        assert "decode after CloseSession" in unquote(status["grpc-message"]), status
        assert w.engine.metrics().steps_total == 1  # the prefill only


async def test_a_fault_in_taking_a_request_fails_nothing_but_leaves_it_to_the_streams_reader(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """``take_now`` runs in the connection's reader, which serves every stream of the
    connection: a bug there is logged and the request goes to the stream's own reader task,
    so the connection (here: a second session on it) goes on."""
    from rpc_harness import worker
    from shard.client import ShardClient
    from shard.rpc.session import SessionCall

    take = SessionCall.take_request_now
    faults = {"left": 1}

    def faulty(self: SessionCall, req: pb.SessionRequest) -> bool:
        if req.WhichOneof("kind") == "decode" and faults["left"]:
            faults["left"] -= 1
            raise RuntimeError("a bug in take_request_now")
        return take(self, req)

    monkeypatch.setattr(SessionCall, "take_request_now", faulty)
    async with worker() as w, ShardClient.connect(w.target, timeout=10) as client:
        async with client.session("a") as a, client.session("b") as b:
            ta = (await a.prefill([1, 72, 101])).logits.token_id
            tb = (await b.prefill([1, 72, 101])).logits.token_id
            for _ in range(3):
                ta = (await a.decode(token=ta)).logits.token_id
                tb = (await b.decode(token=tb)).logits.token_id
    assert faults["left"] == 0
    assert "take_now failed" in caplog.text
    assert w.engine.metrics().steps_total == 2 * 4
