"""The inbound short path (``BoundedH2.receive_data``): the common DATA frame is taken without
h2's frame objects, state machines and events. It must be indistinguishable from h2's path:
the same gRPC events, the same ledger (queued / partial / deferred bytes, charges, the pool,
the gate, message timing), the same h2 state (inbound windows, stream states, body lengths)
and the same bytes sent back (WINDOW_UPDATE, RST_STREAM, GOAWAY), for any frames a peer sends;
and it must keep every bound h2's path keeps (frame budgets, frame size, windows, header
blocks)."""

from __future__ import annotations

import struct
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.exceptions
import h2.frame_buffer
import pytest
from hyperframe.frame import DataFrame, GoAwayFrame
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shard.rpc.transport import wire
from shard.rpc.transport.frames import FrameBudget, FrameFlood, FrameRate

HEADERS = [(":method", "POST"), (":scheme", "http"), (":path", "/shard.v1.Shard/Session"),
           (":authority", "test"), ("te", "trailers"), ("content-type", "application/grpc")]

# Small enough that a few hundred frames reach every bound: windows, deferral, the pool,
# oversized messages, frame budgets.
LIMITS = wire.TransportLimits(
    max_message_bytes=3000, stream_window_bytes=100000, connection_window_bytes=65535,
    connection_buffer_bytes=6000, total_buffer_bytes=6000,
    small_data_frames=FrameRate(5, 1.0), empty_frames=FrameRate(3, 1.0))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _server(fast: bool, clock: Clock, *, gate: bool, limits: wire.TransportLimits = LIMITS
            ) -> wire.BoundedH2:
    conn = wire.BoundedH2(limits, client_side=False, gate_streams=gate, clock=clock,
                          budget=FrameBudget(limits.frame_rates, clock))
    conn.fast_inbound = fast
    conn.starts = 0  # type: ignore[attr-defined]

    def started() -> None:
        conn.starts += 1  # type: ignore[attr-defined]

    conn.on_message_start = started
    conn.initiate_connection()
    return conn


def _frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    n = len(payload)
    return struct.pack(">BHBBI", n >> 16, n & 0xFFFF, kind, flags, sid) + payload


def _data_frame(sid: int, body: bytes, *, end: bool = False, pad: int | None = None) -> bytes:
    if pad is None:
        return _frame(0, 0x1 if end else 0, sid, body)
    return _frame(0, (0x1 if end else 0) | 0x8, sid, bytes([pad]) + body + bytes(pad))


def _message(body: bytes, compressed: bool = False) -> bytes:
    return struct.pack(">?I", compressed, len(body)) + body


def _event(e: Any) -> Any:
    if isinstance(e, tuple):
        return (type(e).__name__, tuple(e))
    return (type(e).__name__, sorted((k, repr(v)) for k, v in vars(e).items()))


def _state(conn: wire.BoundedH2) -> dict[str, Any]:
    h2c = conn.h2_connection
    cw = h2c._inbound_flow_control_window_manager
    reader = h2c.incoming_buffer
    return {
        "sent": conn.data_to_send(),
        "ledger": (conn.held, conn.charge, conn.pool.held, sorted(conn.deferring),
                   sorted(conn.gated), conn.starts),  # type: ignore[attr-defined]
        "flow": {sid: (f.queued, f.partial, f.deferred, f.charge, f.started)
                 for sid, f in conn.flow.items()},
        "buffers": {sid: (len(b._buffer), b._message_length)
                    for sid, b in conn.message_read_buffers.items()},
        "connection": (h2c.state_machine.state, cw.current_window_size, cw._bytes_processed,
                       cw.max_window_size, h2c.highest_inbound_stream_id,
                       list(h2c._closed_streams.items())),
        "streams": {sid: (s.state_machine.state, s._inbound_window_manager.current_window_size,
                          s._inbound_window_manager._bytes_processed,
                          s._actual_content_length) for sid, s in h2c.streams.items()},
        "budget": (reader.budget._tokens, reader.budget._earned, reader.budget.received),
        "reader": (reader.data[reader._pos:], [f.data for f in reader._headers_buffer]),
    }


class Pair:
    """The same peer bytes and the same server-side calls, on a short-path and an h2-path
    connection; after each step both must be in the same state."""

    def __init__(self, *, gate: bool) -> None:
        self.clock = Clock()
        self.fast = _server(True, self.clock, gate=gate)
        self.slow = _server(False, self.clock, gate=gate)
        self.peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.peer.initiate_connection()
        self.pending = self.peer.data_to_send()
        self.delivered: dict[int, list[int]] = {}  # sid -> sizes of messages not consumed
        self.dead = False
        self.fast_frames = 0
        self.check()

    def feed(self, cut: int | None = None) -> None:
        if self.dead or not self.pending:
            return
        cut = len(self.pending) if cut is None else cut % (len(self.pending) + 1)
        data, self.pending = self.pending[:cut], self.pending[cut:]
        outcomes = []
        for conn in (self.fast, self.slow):
            try:
                events = conn.receive_data(data)
            except Exception as exc:  # noqa: BLE001 - compared below
                outcomes.append(("raised", type(exc).__name__, str(exc)))
            else:
                outcomes.append(("events", [_event(e) for e in events]))
                if conn is self.fast:
                    for e in events:
                        if type(e).__name__ == "MessageReceived":
                            self.delivered.setdefault(e.stream_id, []).append(
                                e.flow_controlled_length + wire.PREFIX)
        assert outcomes[0] == outcomes[1]
        if outcomes[0][0] == "raised":
            self.dead = True
        self.check()

    def both(self, method: str, *args: Any) -> None:
        for conn in (self.fast, self.slow):
            getattr(conn, method)(*args)
        self.check()

    def check(self) -> None:
        assert _state(self.fast) == _state(self.slow)


def _count_fast(conn: wire.BoundedH2) -> list[int]:
    """Counts the frames that reached h2 (so a test can tell the short path ran)."""
    h2c = conn.h2_connection
    receive = h2c._receive_frame
    seen = [0, 0]  # DATA frames through h2, other frames

    def counted(frame: Any) -> Any:
        seen[0 if isinstance(frame, DataFrame) else 1] += 1
        return receive(frame)

    h2c._receive_frame = counted
    return seen


# ---- the short path against h2's, for random frame sequences --------------------------------

STREAM = st.integers(0, 23)  # a stream opened (23: one the peer never opened; see sid_of)
BODY = st.one_of(st.binary(max_size=24), st.binary(min_size=200, max_size=3100))
MESSAGES = st.tuples(
    st.just("messages"), STREAM,
    st.lists(st.tuples(BODY, st.integers(0, 30)), min_size=1, max_size=4),  # 0: compressed
    st.lists(st.integers(0, 4000), max_size=3),  # where the frames cut the messages
    st.integers(0, 15).map(lambda n: n == 0),  # END_STREAM on the last frame
    st.one_of(st.none(), st.none(), st.integers(0, 20)))  # padding of every other frame
OPS = st.lists(st.one_of(
    st.tuples(st.just("open"), st.integers(0, 7).map(lambda n: n == 0)),
    MESSAGES, MESSAGES, MESSAGES,
    st.tuples(st.just("junk"), STREAM, st.one_of(st.integers(0, 40), st.integers(0, 70000)),
              st.integers(0, 7).map(lambda n: n == 0)),
    st.tuples(st.just("raw"), st.sampled_from(
        ["rst", "ping", "window", "priority", "settings"] * 3 + ["continuation", "headers_open"]),
        STREAM),
    st.tuples(st.just("read"), st.integers(0, 2**20)),
    st.tuples(st.just("consume"), STREAM),
    st.tuples(st.just("server"), st.sampled_from(["forget", "drop_input", "open_gate"]), STREAM),
    st.tuples(st.just("tick"), st.floats(0, 5)),
), min_size=8, max_size=80)


def _run(ops: list[tuple[Any, ...]], gate: bool) -> Pair:
    pair = Pair(gate=gate)
    pair.feed()
    # the peer needs the server's SETTINGS before it may open streams
    pair.peer.receive_data(_first_settings())
    pair.pending += pair.peer.data_to_send()
    sids: list[int] = []

    def sid_of(i: int) -> int:
        return sids[i % len(sids)] if i < 23 else max(sids) + 2

    ops = [("open", False), *ops]

    for op in ops:
        kind = op[0]
        if kind == "open":
            if len(sids) >= 40:
                continue
            sid = pair.peer.get_next_available_stream_id()
            pair.peer.send_headers(sid, HEADERS, end_stream=op[1])
            pair.pending += pair.peer.data_to_send()
            sids.append(sid)
        elif kind == "messages":
            _, i, bodies, cuts, end, pad = op
            blob = b"".join(_message(b, compressed=(flag == 0)) for b, flag in bodies)
            points = sorted({c % (len(blob) + 1) for c in cuts} | {0, len(blob)})
            pieces = [blob[a:b] for a, b in zip(points, points[1:])] or [b""]
            for n, piece in enumerate(pieces):
                last = n == len(pieces) - 1
                pair.pending += _data_frame(sid_of(i), piece, end=end and last,
                                            pad=pad if n % 2 else None)
        elif kind == "junk":
            _, i, size, end = op
            pair.pending += _data_frame(sid_of(i), bytes(k % 251 for k in range(size)),
                                        end=end)
        elif kind == "raw":
            _, what, i = op
            sid = sid_of(i)
            pair.pending += {
                "rst": _frame(3, 0, sid, struct.pack(">I", 8)),
                "ping": _frame(6, 0, 0, bytes(8)),
                "window": _frame(8, 0, sid, struct.pack(">I", 1000)),
                "priority": _frame(2, 0, sid, struct.pack(">IB", 0, 15)),
                "settings": _frame(4, 0, 0, b""),
                "continuation": _frame(9, 0, sid, b""),
                "headers_open": _frame(1, 0, sid, b"\x82"),  # a header block left open
            }[what]
        elif kind == "read":
            pair.feed(op[1])
        elif kind == "consume":
            sid = sid_of(op[1])
            if pair.delivered.get(sid):
                pair.both("consumed", sid, pair.delivered[sid].pop(0))
        elif kind == "server":
            _, what, i = op
            sid = sid_of(i)
            if what == "forget":
                pair.delivered.pop(sid, None)
            pair.both(what, sid)
        elif kind == "tick":
            pair.clock.now += op[1]
        if pair.dead:
            break
    pair.feed()
    return pair


def _first_settings() -> bytes:
    conn = wire.BoundedH2(LIMITS, client_side=False)
    conn.initiate_connection()
    return conn.data_to_send()


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, gate=st.booleans())
def test_the_short_path_is_indistinguishable_from_h2s(ops: list[tuple[Any, ...]], gate: bool
                                                      ) -> None:
    _run(ops, gate)


def test_the_random_sequences_do_take_the_short_path() -> None:
    """(So the comparison above compares something.)"""
    pair = Pair(gate=False)
    seen = _count_fast(pair.fast)
    pair.peer.receive_data(_first_settings())
    pair.pending += pair.peer.data_to_send()
    sid = pair.peer.get_next_available_stream_id()
    pair.peer.send_headers(sid, HEADERS)
    pair.pending += pair.peer.data_to_send()
    pair.pending += _data_frame(sid, _message(b"a token"))
    pair.pending += _data_frame(sid, _message(b"two") + _message(b"in one frame")[:7])
    pair.pending += _data_frame(sid, _message(b"in one frame")[7:])
    pair.pending += _data_frame(sid, _message(b"padded"), pad=3)
    pair.pending += _data_frame(sid, b"", end=True)
    pair.feed()
    assert seen[0] == 2  # the padded frame and END_STREAM went through h2; the rest did not
    assert pair.delivered[sid] == [12, 8, 17, 11]


# ---- one test per bound the short path must keep ----------------------------------------------

def _open(gate: bool = False, limits: wire.TransportLimits = LIMITS,
          fast: bool = True) -> tuple[wire.BoundedH2, int, list[int]]:
    conn = _server(fast, Clock(), gate=gate, limits=limits)
    peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    peer.initiate_connection()
    peer.receive_data(conn.data_to_send())
    sid = peer.get_next_available_stream_id()
    peer.send_headers(sid, HEADERS)
    conn.receive_data(peer.data_to_send())
    conn.data_to_send()
    return conn, sid, _count_fast(conn)


def _frames(data: bytes) -> list[Any]:
    buffer = h2.frame_buffer.FrameBuffer(server=False)
    buffer.max_frame_size = 2**24 - 1
    buffer.add_data(data)
    return list(buffer)


@pytest.mark.parametrize("fast", [True, False])
def test_small_data_frames_spend_their_budget_on_the_short_path(fast: bool) -> None:
    conn, sid, seen = _open(fast=fast)
    burst = LIMITS.small_data_frames.burst
    msg = _message(b"")  # 5 bytes: a small DATA frame
    conn.receive_data(b"".join(_data_frame(sid, msg) for _ in range(burst)))
    assert conn.flow[sid].queued == 5 * burst
    with pytest.raises(FrameFlood):
        conn.receive_data(_data_frame(sid, msg))
    (goaway,) = _frames(conn.data_to_send())
    assert isinstance(goaway, GoAwayFrame) and goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert seen[0] == (0 if fast else burst)


def test_empty_data_frames_spend_the_empty_budget() -> None:
    conn, sid, _ = _open()
    conn.receive_data(_data_frame(sid, b"") * LIMITS.empty_frames.burst)
    with pytest.raises(FrameFlood) as caught:
        conn.receive_data(_data_frame(sid, b""))
    assert caught.value.kind == "empty"


def test_a_flood_drops_the_whole_reads_events() -> None:
    conn, sid, _ = _open()
    frames = b"".join(_data_frame(sid, _message(b"")) for _ in range(LIMITS.small_data_frames.burst + 1))
    with pytest.raises(FrameFlood):
        conn.receive_data(frames)
    assert conn.flow.get(sid) is None or conn.flow[sid].queued == 0  # nothing delivered


def test_data_beyond_the_stream_window_is_a_flow_control_error() -> None:
    limits = wire.TransportLimits(stream_window_bytes=65535, connection_window_bytes=1 << 20)
    conn, sid, seen = _open(gate=True, limits=limits)  # gated: nothing is acknowledged
    chunk = _data_frame(sid, bytes(16384))
    for _ in range(3):
        conn.receive_data(chunk)
    assert conn.data_to_send() == b""  # no WINDOW_UPDATE for a gated stream
    with pytest.raises(h2.exceptions.FlowControlError):
        conn.receive_data(_data_frame(sid, bytes(16384)))  # 4 x 16384 > 65535
    (goaway,) = _frames(conn.data_to_send())
    assert goaway.error_code == h2.errors.ErrorCodes.FLOW_CONTROL_ERROR
    assert seen[0] == 1  # the frame over the window went to h2, which refused it


def test_data_beyond_the_connection_window_is_a_flow_control_error() -> None:
    conn, sid, seen = _open(gate=True)  # stream window 100,000, connection window 65,535
    conn.receive_data(_data_frame(sid, bytes(40000)))
    with pytest.raises(h2.exceptions.FlowControlError):
        conn.receive_data(_data_frame(sid, bytes(30000)))
    (goaway,) = _frames(conn.data_to_send())
    assert goaway.error_code == h2.errors.ErrorCodes.FLOW_CONTROL_ERROR
    assert seen[0] == 1


def test_a_frame_above_the_frame_size_is_refused_on_its_header() -> None:
    conn, sid, _ = _open()
    header = _data_frame(sid, bytes(LIMITS.max_frame_bytes + 1))[:9]
    with pytest.raises(h2.exceptions.FrameTooLargeError):
        conn.receive_data(header)


def test_data_inside_a_header_block_is_a_protocol_error() -> None:
    conn, sid, _ = _open()
    with pytest.raises(h2.exceptions.ProtocolError):
        conn.receive_data(_frame(1, 0, sid + 2, b"\x82") + _data_frame(sid, _message(b"x")))
    (goaway,) = _frames(conn.data_to_send())
    assert goaway.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR


def test_data_on_a_reset_stream_gets_rst_stream_and_its_bytes_back() -> None:
    conn, sid, seen = _open()
    conn.receive_data(_frame(3, 0, sid, struct.pack(">I", 8)))  # the client resets
    conn.receive_data(_data_frame(sid, _message(b"late")))
    assert seen[0] == 1
    assert "RstStreamFrame" in {type(f).__name__ for f in _frames(conn.data_to_send())}


def test_a_gated_streams_data_is_not_acknowledged_before_the_gate_opens() -> None:
    conn, sid, seen = _open(gate=True)
    conn.receive_data(_data_frame(sid, _message(b"hello")))
    assert conn.data_to_send() == b"" and conn.flow[sid].deferred == 10
    conn.open_gate(sid)
    assert conn.flow[sid].deferred == 0 and sid not in conn.deferring
    assert seen[0] == 0


def test_queued_messages_beyond_the_stream_window_wait_for_the_reader() -> None:
    limits = wire.TransportLimits(max_message_bytes=60000, stream_window_bytes=65535,
                                  connection_buffer_bytes=1 << 20)
    conn, sid, seen = _open(limits=limits)
    for _ in range(2):
        conn.receive_data(_data_frame(sid, _message(bytes(30000))))
    conn.data_to_send()
    conn.receive_data(_data_frame(sid, _message(bytes(5995))))
    flow = conn.flow[sid]
    assert (flow.queued, flow.deferred) == (66010, 6000)  # more than a window queued: held back
    assert conn.data_to_send() == b"" and sid in conn.deferring
    conn.consumed(sid, 30005)  # the reader took one: the rest is acknowledged
    assert flow.deferred == 0 and sid not in conn.deferring
    assert seen[0] == 0


def test_an_unfinished_message_is_timed_from_its_first_frame() -> None:
    conn, sid, seen = _open(gate=False)
    clock = conn.clock
    clock.now = 7.0  # type: ignore[union-attr]
    conn.receive_data(_data_frame(sid, _message(b"0123456789")[:8]))
    assert conn.flow[sid].started == 7.0 and conn.starts == 1  # type: ignore[attr-defined]
    assert conn.oldest_message_start() == 7.0
    conn.receive_data(_data_frame(sid, _message(b"0123456789")[8:]))
    assert conn.flow[sid].started is None and conn.flow[sid].partial == 0
    assert seen[0] == 0


@pytest.mark.parametrize("fast", [True, False])
def test_an_oversized_or_compressed_message_fails_its_stream_only(fast: bool) -> None:
    conn, sid, _ = _open(fast=fast)
    events = conn.receive_data(_data_frame(sid, _message(bytes(3001))))
    assert [tuple(e) for e in events] == [("oversized", sid, 0)]
    assert conn.flow[sid].partial == 0 and conn.held == 0
    conn2, sid2, _ = _open(fast=fast)
    events = conn2.receive_data(_data_frame(sid2, _message(b"zip", compressed=True)))
    assert [tuple(e) for e in events] == [("compressed", sid2, 0)]


def test_the_end_of_the_stream_goes_through_h2() -> None:
    conn, sid, seen = _open()
    events = conn.receive_data(_data_frame(sid, _message(b"last"), end=True))
    assert [type(e).__name__ for e in events] == ["MessageReceived", "RequestEnded"]
    assert seen[0] == 1
    # and DATA after it is a stream error that h2 answers
    conn.receive_data(_data_frame(sid, _message(b"more")))
    assert "RstStreamFrame" in {type(f).__name__ for f in _frames(conn.data_to_send())}


def test_check_frame_builder() -> None:
    """The test's own frames are HTTP/2 as hyperframe reads them."""
    (frame,) = _frames(_data_frame(3, b"abc", pad=2))
    assert isinstance(frame, DataFrame) and frame.data == b"abc" and frame.flow_controlled_length == 6
