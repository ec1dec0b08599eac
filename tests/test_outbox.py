"""The connection outbox's writer (shard.rpc.transport.wire.Outbox): on a plain TCP stream it
writes to the descriptor itself; every byte must still arrive, in order, through full socket
buffers, and socket errors must surface as the stream errors ``SocketStream`` raises. And a
served step's result and its Usage leave the worker in one write."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import trio
import trio.testing

from shard.rpc.transport import wire


async def _stream_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    # a small send buffer: most writes below meet a full socket and must wait for the reader
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    return trio.SocketStream(a), trio.SocketStream(b)


async def test_a_plain_socket_gets_every_byte_in_order_through_full_buffers() -> None:
    ours, peer = await _stream_pair()
    assert wire._plain_sender(ours) is not None  # the direct path is the one under test
    outbox = wire.Outbox()
    pieces = [bytes([i % 251]) * (1000 + 37 * i) for i in range(200)]
    expected = b"".join(pieces)
    received = bytearray()
    waits = 0

    async def write_pieces() -> None:
        nonlocal waits
        for piece in pieces:
            outbox.push(piece)
            waits += len(outbox) > 0  # still queued: the writer met a full socket
            assert await outbox.wait_below(64 * 1024)
            await trio.sleep(0)

    async with ours, peer:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outbox.write_forever, ours)
            nursery.start_soon(write_pieces)
            with trio.fail_after(30):
                while len(received) < len(expected):
                    chunk = await peer.receive_some(1500)
                    assert chunk
                    received.extend(chunk)
                    await trio.sleep(0)  # let the writer meet a full buffer again
            nursery.cancel_scope.cancel()
    assert bytes(received) == expected
    assert waits > 0


async def test_a_peer_that_went_away_is_a_broken_stream() -> None:
    ours, peer = await _stream_pair()
    await peer.aclose()
    outbox = wire.Outbox()
    outbox.push(b"x" * 100_000)
    async with ours:
        with pytest.raises(trio.BrokenResourceError):
            await outbox.write_forever(ours)
    assert await outbox.wait_below(0)  # the broken writer releases every waiter


async def test_closing_our_socket_while_the_writer_waits_is_a_closed_stream() -> None:
    ours, peer = await _stream_pair()
    outbox = wire.Outbox()
    outbox.push(b"y" * 1_000_000)  # far more than the buffers hold: the writer must wait
    caught: list[BaseException] = []

    async def write() -> None:
        try:
            await outbox.write_forever(ours)
        except trio.ClosedResourceError as exc:
            caught.append(exc)

    async with peer:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            await trio.testing.wait_all_tasks_blocked()
            await ours.aclose()
    assert len(caught) == 1


async def test_other_streams_keep_their_own_send_all() -> None:
    send, receive = trio.testing.memory_stream_pair()
    assert wire._plain_sender(send) is None
    outbox = wire.Outbox()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outbox.write_forever, send)
        outbox.push(b"hello")
        assert await receive.receive_some(5) == b"hello"
        nursery.cancel_scope.cancel()
    await send.aclose()
    await receive.aclose()


async def test_a_decode_result_and_its_usage_leave_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client-driven step's StepResult and the Usage after it are framed together and go out
    in one socket write (they used to take two, and wake the client twice)."""
    from rpc_harness import worker

    from shard.client import ShardClient

    server_writes: list[bytes] = []
    server_fds: set[int] = set()
    real, real_now = wire._plain_sender, wire._write_now
    port = 0

    def counting(stream: trio.abc.SendStream) -> Any:
        send = real(stream)
        if send is None or not isinstance(stream, trio.SocketStream):
            return send
        local_port = stream.socket.getsockname()[1]
        if local_port == port:
            server_fds.add(stream.socket.fileno())

        async def counted(data: bytes) -> None:
            if local_port == port:  # the worker's side of the connection
                server_writes.append(data)
            await send(data)

        return counted

    def counting_now(fd: int, data: bytearray) -> int:  # a lone stream's write-through
        if fd in server_fds:
            server_writes.append(bytes(data))
        return real_now(fd, data)

    monkeypatch.setattr(wire, "_plain_sender", counting)
    monkeypatch.setattr(wire, "_write_now", counting_now)
    async with worker() as w:
        port = int(w.target.rsplit(":", 1)[1])
        async with ShardClient.connect(w.target, timeout=10) as client:
            async with client.session(session_id="one-write") as s:
                token = (await s.prefill([1, 72, 101, 108])).logits.token_id
                before = len(server_writes)
                for _ in range(20):
                    token = (await s.decode(token=token)).logits.token_id
                decode_writes = len(server_writes) - before
            await w.idle()
    assert 20 <= decode_writes <= 22, decode_writes  # one per step, slack for a PING or SETTINGS ack


async def test_a_write_through_that_empties_the_outbox_wakes_the_waiters_for_room() -> None:
    """A task waits for room (``wait_below``) while the writer, woken for the bytes, has not
    run yet; another task's write-through then writes them all (a GroupSteps answer writes
    through beside other streams' responses). The writer then finds nothing to write, so the
    write-through itself must wake the waiter: otherwise it waits until the writer next writes
    something, and a send with an idle timeout takes that for a peer that stopped reading."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    outbox = wire.Outbox()
    outbox._fd = a.fileno()  # noqa: SLF001 - the writer idles on this socket (it is not run here)
    outbox.push(b"x" * 3000)  # queued, the writer woken
    got: list[bool] = []

    async def wait_room() -> None:
        got.append(await outbox.wait_below(1000))

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_room)
            await trio.testing.wait_all_tasks_blocked()
            assert not got
            outbox.push(b"", write_through=True)  # writes what is queued: all of it
            assert len(outbox) == 0
            with trio.fail_after(5):
                while not got:
                    await trio.sleep(0)
        assert got == [True]
        assert b.recv(10_000) == b"x" * 3000
    finally:
        a.close()
        b.close()
