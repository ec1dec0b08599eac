"""The served token's short path (issue "a lean per-token path"): a response framed by the
session's own task (``session.Responses``, ``_Call.send_now``), a DATA frame built without h2's
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

    def direct(msg: pb.SessionResponse, more_follows: bool) -> bool:
        if msg.step.step in refuse:
            return False
        wire_order.append(msg.step.step)
        return True

    out = Responses(8)
    out.direct = direct
    out.idle = True  # the handler waits on an empty channel
    out.send_nowait(_response(1))  # direct
    out.send_nowait(_response(2))  # refused: the channel
    out.send_nowait(_response(3))  # the direct path would take it, but 2 waits in the channel
    assert wire_order == [1]
    assert out.receive.receive_nowait().step.step == 2  # the handler forwards both, in order
    wire_order.append(2)
    assert out.receive.receive_nowait().step.step == 3
    wire_order.append(3)
    out.idle = True  # the handler waits again
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
