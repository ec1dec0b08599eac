"""The HTTP/2 layer both sides share: limits, the bounded h2 machine, the flow ledger, the outbox.

Server and client drive purerpc's gRPC-over-h2 codec (``GRPCConnection``) with their own reader
and writer tasks; what they share lives here, so both sides get the same bounds.

Inbound memory (the ledger).  Every stream keeps ``queued`` (complete messages the reader has
not taken, each counting its 5-byte prefix, so empty messages are bounded too), ``partial``
(bytes of an unfinished message) and ``deferred`` (bytes received but not yet acknowledged).
A stream's *charge* is what it holds of the bytes already acknowledged (WINDOW_UPDATE):
``max(0, queued + partial - deferred)``; the peer can send at most one connection window more
than that, so a connection holds at most its charge plus ``connection_window_bytes`` of
message bytes, and unfinished messages cannot escape the count.

Received bytes are acknowledged while the stream has at most one window of queued messages, the
connection's charge stays within ``connection_buffer_bytes`` and the server's ``BufferPool``
grants it room; otherwise they are deferred until the reader consumes, the pool has room again
or the call ends.  The pool (``total_buffer_bytes``) keeps ``connection_reserve_bytes`` for each
of the ``max_connections`` connection slots, for that connection alone, and lends the rest to
connections that need more, never beyond an equal share of it while others wait for it: so one
connection can never take the whole pool, and a connection always gets one stream window of
messages acknowledged, whatever the others hold.  A message larger than the stream window
still flows (its bytes are acknowledged while there is room), and one the peer does not finish
within ``message_timeout`` fails its stream and gives its bytes back.

Frames: ``shard.rpc.transport.frames`` cuts the inbound byte stream into frames (linearly; h2's
own buffer is quadratic in the frames of one read), refuses an oversized frame on its 9-byte
header and an oversized header block, and (server side) counts every frame against its kind's
budget as it is parsed (``TransportLimits.new_streams``, ``resets``, ``pings``, ...). The
header list size is enforced from the first frame, not only after the peer acknowledged our
SETTINGS.

Internals: this package uses private names of h2, hyperframe and purerpc (pinned to exact
versions in pyproject.toml); ``check_private_names`` runs at import and refuses, with a clear
message, an installation that lacks one, rather than failing on the first unusual frame.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import h2.connection
import h2.exceptions
import h2.stream
import h2.utilities
import trio
from h2.settings import SettingCodes, Settings
from hyperframe.frame import GoAwayFrame
from purerpc.grpclib.config import GRPCConfiguration
from purerpc.grpclib.connection import GRPCConnection
from purerpc.grpclib.events import MessageReceived
from purerpc.grpclib.exceptions import (
    MessageTooLargeError,
    ProtocolError,
    UnsupportedMessageEncodingError,
)

from .frames import FrameBudget, FrameRate, FrameReader

#: The versions whose private names this package uses (pinned in pyproject.toml); see
#: ``check_private_names``, which runs at import.
PINNED = {"h2": "3.2.0", "hyperframe": "5.2.0", "purerpc": "0.8.0"}


def missing_private_names() -> list[str]:
    """The private (or undocumented) names of h2, hyperframe and purerpc this package relies
    on that the installed versions lack. An override of a renamed purerpc method would be
    silently dead, and a missing h2 attribute would only fail on the first odd frame."""
    import h2.connection
    import h2.frame_buffer
    import h2.stream
    import h2.utilities
    import hyperframe.frame
    from purerpc.grpclib.buffers import MessageReadBuffer

    h2c = h2.connection.H2Connection()
    stream = h2.stream.H2Stream(1, h2c.config, 1, 1)
    checks: list[tuple[str, object, str]] = [
        ("h2.utilities", h2.utilities, "SizeLimitDict"),
        ("h2.connection", h2.connection, "ConnectionState"),
        ("h2.frame_buffer.FrameBuffer", h2.frame_buffer.FrameBuffer, "_validate_frame_length"),
        ("h2.frame_buffer.FrameBuffer", h2.frame_buffer.FrameBuffer, "_parse_frame_header"),
        ("h2.frame_buffer.FrameBuffer", h2.frame_buffer.FrameBuffer, "_update_header_buffer"),
        ("h2.frame_buffer.FrameBuffer", h2.frame_buffer.FrameBuffer(server=True), "_headers_buffer"),
        ("h2.frame_buffer.FrameBuffer", h2.frame_buffer.FrameBuffer(server=True), "data"),
        ("h2.connection.H2Connection", h2c, "_closed_streams"),
        ("h2.connection.H2Connection", h2c, "_receive_goaway_frame"),
        ("h2.connection.H2Connection", h2c, "_frame_dispatch_table"),
        ("h2.connection.H2Connection", h2c, "_data_to_send"),
        ("h2.connection.H2Connection", h2c, "incoming_buffer"),
        ("h2.connection.H2Connection", h2c, "max_inbound_frame_size"),
        ("h2.connection.H2Connection", h2c, "state_machine"),
        ("h2.connection.H2Connection", h2c, "outbound_flow_control_window"),
        ("h2.stream.H2Stream", stream, "state_machine"),
        ("h2.stream.H2Stream", stream, "outbound_flow_control_window"),
        ("h2.connection.H2Connection", h2c.decoder, "max_header_list_size"),
        ("hyperframe.frame", hyperframe.frame, "GoAwayFrame"),
        ("purerpc.grpclib.buffers.MessageReadBuffer", MessageReadBuffer(), "_buffer"),
        ("purerpc.grpclib.buffers.MessageReadBuffer", MessageReadBuffer(), "_message_length"),
        ("purerpc.grpclib.buffers.MessageReadBuffer", MessageReadBuffer, "decompress"),
        ("purerpc.grpclib.buffers.MessageReadBuffer", MessageReadBuffer,
         "read_all_complete_messages_flowcontrol"),
    ]
    if not hasattr(h2.connection.ConnectionState, "CLIENT_OPEN"):
        checks.append(("h2.connection.ConnectionState", h2.connection.ConnectionState, "CLIENT_OPEN"))
    # Methods BoundedH2 overrides: renamed in purerpc, the override would never run.
    checks += [("purerpc.grpclib.connection.GRPCConnection", GRPCConnection, name) for name in (
        "_set_h2_connection_local_settings", "_request_received", "_response_received",
        "send_data", "start_response",
        "_data_received", "_remote_settings_changed", "_stream_reset", "_connection_terminated",
    )]
    grpc_conn = GRPCConnection(GRPCConfiguration(client_side=False))
    checks += [("purerpc.grpclib.connection.GRPCConnection", grpc_conn, name)
               for name in ("message_read_buffers", "h2_connection", "config")]
    return [f"{owner}.{name}" for owner, obj, name in checks if not hasattr(obj, name)]


def check_private_names() -> None:
    """Fail at import, with a clear message, when an upgrade removed a name we rely on."""
    missing = missing_private_names()
    if missing:
        pins = ", ".join(f"{name}=={version}" for name, version in PINNED.items())
        raise ImportError(
            "shard.rpc.transport relies on private names of " + pins + " that the installed "
            "packages lack: " + ", ".join(missing) + ". Install the versions pinned in "
            "pyproject.toml, or port shard/rpc/transport to the new ones.")


check_private_names()

OUTBOX_HIGH_WATER = 256 * 1024  # queued outbound bytes before a sending task waits
READ_SIZE = 1024 * 1024  # one read per 1 MiB message: 64 KiB reads cost a pass each
PREFIX = 5  # the gRPC message prefix (compressed flag + length)
Outcome = tuple[int, str, Sequence[tuple[str, "str | bytes"]]]  # (code, message, trailers)

MiB = 1024 * 1024


@dataclass(frozen=True)
class TransportLimits:
    """Bounds that keep any peer from exhausting the worker (or a client from its server).

    Worst-case inbound memory of message bytes: per connection ``connection_buffer_bytes +
    connection_window_bytes`` plus one read and one frame being reassembled (``max_frame_bytes``
    each); over all connections ``total_buffer_bytes + max_connections x (connection_window_bytes
    + 2 x max_frame_bytes)``.  With the defaults: 42 MiB per connection, 896 MiB in total.
    Fairness: of ``total_buffer_bytes`` every connection slot keeps ``connection_reserve_bytes``
    (1 MiB) for itself and the rest (192 MiB) is lent out, never beyond an equal share to a
    connection while others wait; see ``BufferPool``.
    Bookkeeping comes on top: about 100 bytes per remembered closed stream, at most
    ``closed_streams_remembered`` per connection (100 KiB with the default).
    """

    max_message_bytes: int = 16 * MiB
    stream_window_bytes: int = 1 * MiB
    connection_window_bytes: int = 8 * MiB
    #: Long-lived (streaming) calls per connection; a further one is refused RESOURCE_EXHAUSTED.
    max_concurrent_streams: int = 64
    #: Extra streams advertised for unary calls, so Cancel / GetMetrics still get through on a
    #: connection whose streaming calls are all in use.
    unary_reserve: int = 16
    max_header_list_bytes: int = 8192
    connection_buffer_bytes: int = 32 * MiB
    total_buffer_bytes: int = 256 * MiB
    max_connections: int = 64
    #: Seconds a new connection has to send the HTTP/2 preface and its SETTINGS.
    handshake_timeout: float = 10.0
    #: After this many seconds without a byte from the peer, PING it ...
    keepalive_interval: float = 60.0
    #: ... and close the connection if nothing arrives within this many more seconds.
    keepalive_timeout: float = 20.0
    #: Seconds a stopping server waits for final statuses to be written before closing sockets.
    flush_timeout: float = 2.0
    #: Closed streams each connection remembers, so that a late frame on a stream reset a moment
    #: ago gets RST_STREAM instead of killing the connection. h2 keeps 65,536 (about 100 bytes
    #: each), so a long-lived connection would grow by megabytes over its first 65,536 calls.
    closed_streams_remembered: int = 1024
    #: Seconds a peer has to finish a request message it started (first byte to last); past
    #: that its stream fails RESOURCE_EXHAUSTED (reason MESSAGE_TIMEOUT) and the bytes held for
    #: the message are given back: an unfinished message cannot hold buffer space for ever.
    message_timeout: float = 30.0
    #: Frames a peer may send of each kind: a burst, then a rate (token buckets, counted per
    #: frame as it is parsed; see ``shard.rpc.transport.frames``), plus what the worker's own
    #: traffic on the connection earns it: ``per_data_frame`` frames for each DATA frame sent,
    #: ``per_answer`` for each call answered with a message (banked up to the burst, spent
    #: first). Past them the connection gets GOAWAY(ENHANCE_YOUR_CALM) before h2 handles that
    #: frame; a new connection from the same host starts from the levels its closed ones left
    #: (earned frames do not carry over). ``new_streams`` counts HEADERS (a gRPC client sends
    #: one per call); ``resets`` RST_STREAM ("rapid reset": a client resets at most the streams
    #: it has open, 80, at once); ``empty_frames`` PRIORITY, unknown frame types and DATA frames
    #: with neither payload nor END_STREAM; ``small_data_frames`` DATA frames of 1 to 15 bytes
    #: without END_STREAM (a client's decode step is one, answered by the worker's result: each
    #: DATA frame sent earns two). Why each number (what grpcio sends per DATA frame):
    #: docs/protocol.md, "Transport limits".
    new_streams: FrameRate = FrameRate(1000, 500.0, per_answer=1.0)
    resets: FrameRate = FrameRate(500, 100.0, per_answer=1.0)
    pings: FrameRate = FrameRate(100, 10.0, per_data_frame=1.0)
    settings: FrameRate = FrameRate(32, 4.0, per_data_frame=1 / 16)
    window_updates: FrameRate = FrameRate(1000, 500.0, per_data_frame=4.0)
    continuations: FrameRate = FrameRate(64, 8.0)
    empty_frames: FrameRate = FrameRate(200, 20.0, per_answer=2.0)
    small_data_frames: FrameRate = FrameRate(1000, 500.0, per_data_frame=2.0, per_answer=2.0)
    #: Seconds a call may wait with a response to send while the peer reads nothing (no
    #: flow-control window, or nothing written to the socket); past that the call ends
    #: RESOURCE_EXHAUSTED (reason SEND_IDLE_TIMEOUT), which releases a session.  ``math.inf``
    #: turns it off.
    send_idle_timeout: float = 300.0

    def __post_init__(self) -> None:
        # HTTP/2 bounds (RFC 9113 6.5.2, 6.9.1): fail at construction, not on the first client.
        if not 0 < self.max_message_bytes < 2**32:
            raise ValueError("max_message_bytes must be in 1..2**32-1")
        if not 65535 <= self.stream_window_bytes < 2**31:
            raise ValueError("stream_window_bytes must be in 65535..2**31-1")
        if not 65535 <= self.connection_window_bytes < 2**31:
            raise ValueError("connection_window_bytes must be in 65535..2**31-1")
        if self.max_concurrent_streams < 1 or self.unary_reserve < 0:
            raise ValueError("max_concurrent_streams must be >= 1 and unary_reserve >= 0")
        if self.max_concurrent_streams + self.unary_reserve >= 2**31:
            raise ValueError("max_concurrent_streams + unary_reserve must be < 2**31")
        if not 1024 <= self.max_header_list_bytes < 2**31:
            raise ValueError("max_header_list_bytes must be in 1024..2**31-1")
        if self.connection_buffer_bytes < self.max_message_bytes + PREFIX:
            raise ValueError("connection_buffer_bytes must hold one message of max_message_bytes")
        if self.total_buffer_bytes < self.connection_buffer_bytes:
            raise ValueError("total_buffer_bytes must be >= connection_buffer_bytes")
        if self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        if self.closed_streams_remembered < 1:
            raise ValueError("closed_streams_remembered must be >= 1")
        for name, rate in self.frame_rates.items():
            if not isinstance(rate, FrameRate):
                raise TypeError(f"{name} must be a FrameRate")
        for name in ("handshake_timeout", "keepalive_interval", "keepalive_timeout",
                     "flush_timeout", "message_timeout", "send_idle_timeout"):
            value = getattr(self, name)
            if not (value > 0 and not math.isnan(value)):
                raise ValueError(f"{name} must be > 0")

    @property
    def frame_rates(self) -> dict[str, FrameRate]:
        """The frame budgets by kind (``frames.KINDS``)."""
        return {"streams": self.new_streams, "resets": self.resets, "pings": self.pings,
                "settings": self.settings, "window_updates": self.window_updates,
                "continuations": self.continuations, "empty": self.empty_frames,
                "small_data": self.small_data_frames}

    @property
    def max_frame_bytes(self) -> int:
        """Advertised MAX_FRAME_SIZE: big frames cut h2's per-frame Python cost on large
        messages; a DATA frame never needs to exceed the stream window."""
        return max(16384, min(self.stream_window_bytes, 2**24 - 1))

    @property
    def connection_reserve_bytes(self) -> int:
        """Acknowledged bytes the pool keeps for each connection slot alone: one stream window
        (at most an equal share of ``total_buffer_bytes``), so that calls with messages up to
        about two windows are never starved by other connections."""
        return min(self.stream_window_bytes, self.total_buffer_bytes // self.max_connections)

    @property
    def per_connection_memory_bytes(self) -> int:
        """The documented worst case of inbound bytes one connection can make us hold."""
        return (self.connection_buffer_bytes + self.connection_window_bytes
                + READ_SIZE + 2 * self.max_frame_bytes + 9)


class Outbox:
    """Bytes h2 produced for one connection, written to the socket by a single task.

    Producers append without blocking (h2 has already committed the frames); ``wait_below``
    lets a producer wait while the peer reads slowly, which bounds what can pile up here.
    """

    def __init__(self, on_drained: Callable[[], None] | None = None) -> None:
        self._data = bytearray()
        self._wake, self._drained = trio.Event(), trio.Event()
        self._broken = False  # the writer stopped: nothing more will drain
        self._on_drained = on_drained
        self._fd = -1  # the plain socket's descriptor while the writer is idle; -1 otherwise
        self._room_waiters = 0  # tasks in ``wait_below``

    def __len__(self) -> int:
        return len(self._data)

    def push(self, data: bytes, *, write_through: bool = False, wake: bool = True) -> None:
        """Queue ``data`` for the writer. ``write_through``: write it, and whatever is
        queued before it, from the caller's task when the writer is idle (a plain socket
        only): a lone stream's response then leaves in the task step that framed it; what
        the socket does not take at once is left to the writer as usual. ``wake=False``:
        the caller pushes again at once (a result, then its ``Usage``), and that push writes
        or wakes the writer for both (every push does, even an empty one)."""
        if data:
            self._data += data
        if not self._data or not wake:
            return
        if write_through and self._fd >= 0:
            try:
                sent = _write_now(self._fd, self._data)
            except OSError:  # full (BlockingIOError) or broken: the writer owns the reaction
                sent = 0
            if sent:
                del self._data[:sent]
                if not self._data:
                    if self._room_waiters:  # they learn it here: the writer, if it was woken
                        self._drained.set()  # for these bytes, finds nothing left to write
                        self._drained = trio.Event()
                    return
        self._wake.set()

    async def flush(self, h2: Any, idle: float = math.inf, *, schedule: bool = True,
                    write_through: bool = False) -> bool:
        """Queue what ``h2`` produced, then wait while more than ``OUTBOX_HIGH_WATER`` bytes
        are unsent (the peer reads slowly): the back-pressure of both connection kinds.
        False if nothing was written for ``idle`` seconds (see ``wait_below``).

        ``schedule=False``: no scheduler pass unless it must wait, for a caller whose next
        await is one anyway; what it queues next then goes out in the same socket write.
        ``write_through``: as ``push``'s."""
        self.push(h2.data_to_send(), write_through=write_through)
        if schedule:
            await trio.lowlevel.checkpoint()
        return await self.wait_below(OUTBOX_HIGH_WATER, idle)

    async def wait_below(self, limit: int, idle: float = math.inf) -> bool:
        """Return True once at most ``limit`` bytes are unsent, or the writer has stopped;
        False as soon as ``idle`` seconds pass without the writer getting anything out."""
        while len(self._data) > limit and not self._broken:
            self._room_waiters += 1
            try:
                with trio.move_on_after(idle):
                    await self._drained.wait()
                    continue
            finally:
                self._room_waiters -= 1
            return False
        return True

    async def write_forever(self, stream: trio.abc.SendStream) -> None:
        """The writer task; socket errors propagate to the caller, which owns the reaction."""
        send = _plain_sender(stream)
        fd = stream.socket.fileno() if send is not None else -1  # type: ignore[attr-defined]
        try:
            while True:
                self._fd = fd  # idle: a producer may write through (see ``push``)
                try:
                    await self._wake.wait()
                finally:
                    self._fd = -1
                self._wake = trio.Event()
                while self._data:
                    data = bytes(self._data)
                    if send is None:
                        await stream.send_all(data)
                    else:
                        await send(data)
                    del self._data[: len(data)]
                    self._drained.set()
                    self._drained = trio.Event()
                if self._on_drained is not None:
                    self._on_drained()
        finally:
            self._broken = True
            self._drained.set()  # wake every waiter: nothing more will drain


def _write_now(fd: int, data: bytearray) -> int:
    """One non-blocking write of ``data`` to a plain socket's descriptor (``Outbox.push``)."""
    return os.write(fd, data)


def _plain_sender(stream: trio.abc.SendStream) -> Callable[[bytes], Awaitable[None]] | None:
    """``send_all`` for a plain TCP ``SocketStream``, writing to its descriptor directly; None
    for any other stream (TLS), which keeps its own ``send_all``.

    Why: the outbox has a single writer, so ``SocketStream.send_all``'s conflict detector and
    its two checkpoints per write buy nothing here, and on the served token's path they cost
    a scheduler pass of their own (a write that fits in the socket buffer, nearly every one,
    now finishes without yielding; the caller's ``_wake.wait()`` is the schedule point). Errors
    are translated as ``SocketStream`` translates them. A peer gone is EPIPE, not SIGPIPE:
    CPython ignores SIGPIPE at startup, which trio's own ``send`` relies on too. (POSIX only,
    as the worker is.)"""
    if type(stream) is not trio.SocketStream:
        return None
    sock = stream.socket

    async def send(data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                try:
                    view = view[os.write(sock.fileno(), view):]
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(sock)
            except OSError as exc:
                if sock.fileno() == -1:
                    raise trio.ClosedResourceError("the socket was closed") from None
                raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc

    return send


#: The last stream id of a draining server's first GOAWAY: "no new streams", none refused yet.
MAX_STREAM_ID = 2**31 - 1
#: The PING sent with that first GOAWAY; its ACK says the peer saw the GOAWAY (frames are ordered).
DRAIN_PING = b"shard-dr"


def goaway_frame(last_stream_id: int, error_code: int = 0) -> bytes:
    """A GOAWAY frame built outside h2: h2 3.2 refuses every later frame once it sent GOAWAY
    itself, but a graceful drain must keep serving the streams up to ``last_stream_id``."""
    return bytes(GoAwayFrame(0, last_stream_id=last_stream_id, error_code=error_code).serialize())


class BufferPool:
    """Acknowledged inbound message bytes over many connections (its members), with a cap.

    Each of ``slots`` connection slots keeps ``reserve`` bytes for itself alone; the rest,
    ``shared``, is lent to members that need more, in equal shares while it is contended:
    a member that already borrowed ``shared / n`` (``n``: members that borrow or wait to) gets
    no more until it gives some back.  So no member ever takes the whole pool, and whatever the
    others hold, a member can always be acknowledged its reserve.  Members whose
    acknowledgements wait for lent bytes register a retry callback; freed bytes go first to
    the waiting member that borrowed least.
    """

    def __init__(self, limit: int, *, slots: int = 1, reserve: int = 0) -> None:
        if not 0 <= reserve * slots <= limit:
            raise ValueError("the reserves must fit the pool")
        self.limit, self.reserve = limit, reserve
        self.shared = limit - slots * reserve
        self.held = 0  # every inbound message byte the members hold (acknowledged or not)
        self.lent = 0  # bytes of ``shared`` acknowledged to members beyond their reserve
        self._borrowed: dict[object, int] = {}  # member -> its part of ``lent`` (if > 0)
        self._waiting: dict[object, Callable[[], None]] = {}

    def room(self, member: object, charge: int) -> int:
        """How many more bytes ``member``, charged ``charge`` now, may be acknowledged."""
        own = max(0, self.reserve - charge)
        borrowed = max(0, charge - self.reserve)
        if self._waiting:
            contenders = len(self._borrowed.keys() | self._waiting.keys() | {member})
        else:  # the common case, without building sets
            contenders = len(self._borrowed) + (member not in self._borrowed)
        lend = min(self.shared // contenders - borrowed, self.shared - self.lent)
        return own + max(0, lend)

    def recharge(self, member: object, old: int, new: int) -> None:
        """``member``'s charge went from ``old`` to ``new`` bytes."""
        before, after = max(0, old - self.reserve), max(0, new - self.reserve)
        if before == after:
            return
        self.lent += after - before
        if after:
            self._borrowed[member] = after
        else:
            self._borrowed.pop(member, None)
        if after < before:
            self._wake()

    def wait_for_room(self, member: object, retry: Callable[[], None]) -> None:
        self._waiting[member] = retry

    def forget(self, member: object) -> None:
        """``member`` left (its charge is already back to 0): its share goes to the others."""
        self._waiting.pop(member, None)
        if self._borrowed.pop(member, None) is not None:
            self._wake()

    def _wake(self) -> None:
        if not self._waiting or self.lent >= self.shared:
            return
        for member in sorted(self._waiting, key=lambda m: self._borrowed.get(m, 0)):
            retry = self._waiting.pop(member, None)
            if retry is not None:
                retry()  # may register again


class _Flow:
    __slots__ = ("queued", "partial", "deferred", "charge", "started")

    def __init__(self) -> None:
        self.queued = 0  # complete message bytes (+ prefixes) the reader has not taken
        self.partial = 0  # bytes of an unfinished message
        self.deferred = 0  # received, not yet acknowledged
        self.charge = 0  # acknowledged bytes still held: max(0, queued + partial - deferred)
        self.started: float | None = None  # when the unfinished message began (if timed)


class Signal(NamedTuple):
    """Transport events purerpc drops or turns into connection errors."""

    kind: str  # "reset", "oversized", "compressed", "malformed", "goaway", "drain_ack"
    stream_id: int
    detail: int = 0  # the HTTP/2 error code (reset) or last stream id (goaway)


def _refuse_compressed(data: bytes) -> bytes:
    raise UnsupportedMessageEncodingError("compressed messages are not supported")


_DATA_STATES = (h2.stream.StreamState.OPEN, h2.stream.StreamState.HALF_CLOSED_REMOTE)
_OPEN_CONNECTION = (h2.connection.ConnectionState.CLIENT_OPEN, h2.connection.ConnectionState.SERVER_OPEN)
_DATA_HEADER = struct.Struct(">BHBBI")  # length (24 bits), type DATA (0), no flags, stream id


class BoundedH2(GRPCConnection):
    """purerpc's gRPC-over-h2 machine with bounded settings, the flow ledger and per-stream
    failures (an oversized or compressed message fails its stream, not the connection).

    Server side (``gate_streams``): every new stream starts *gated*: its DATA is received but
    never acknowledged until ``open_gate`` (the server authorizes the call from its headers
    first), and each unfinished message's start is timed (``clock``) for ``message_timeout``.
    """

    def __init__(
        self, limits: TransportLimits, *, client_side: bool, pool: BufferPool | None = None,
        gate_streams: bool = False, clock: Callable[[], float] | None = None,
        budget: FrameBudget | None = None,
    ) -> None:
        self.limits = limits
        self.flow: dict[int, _Flow] = {}
        self.held = 0  # message bytes this connection holds (queued + partial)
        self.charge = 0  # of which acknowledged (the sum of the streams' charges)
        self.deferring: set[int] = set()  # streams with acknowledgements held back
        self.gated: set[int] = set()  # streams whose DATA is not acknowledged before open_gate
        self.gate_streams = gate_streams
        self.clock = clock  # times unfinished messages when set
        self.pool = pool if pool is not None else BufferPool(limits.connection_buffer_bytes)
        self.on_acks: Callable[[], None] = lambda: None  # deferred acks were sent: flush h2
        self.on_message_start: Callable[[], None] = lambda: None  # an unfinished message began
        super().__init__(GRPCConfiguration(client_side, max_message_length=limits.max_message_bytes))
        self.h2_connection.incoming_buffer = FrameReader(
            server=not client_side, header_block_limit=limits.max_header_list_bytes,
            budget=budget)
        # h2 has no public knob for this; its own dict type, with a smaller bound.
        self.h2_connection._closed_streams = h2.utilities.SizeLimitDict(
            size_limit=limits.closed_streams_remembered)
        self.budget = budget

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        """One DATA frame (purerpc never splits); it earns the peer control frames."""
        super().send_data(stream_id, data, end_stream=end_stream)
        if self.budget is not None:
            self.budget.sent_data(len(data))

    def send_message(self, stream_id: int, data: bytes) -> bool:
        """``send_data`` of one whole DATA frame, framed here: False (nothing done) unless
        the connection and the stream are open for sending and ``data`` fits the frame size
        and both flow-control windows (then ``send_data`` decides, or raises).

        Why: h2 builds a frame object, runs two state machines and joins a list per frame;
        for a served token that was a third of the transport's work. In those states a
        DATA frame changes nothing but the two windows (h2 3.2's transition tables), which
        this updates as h2 does."""
        h2c = self.h2_connection
        stream = h2c.streams.get(stream_id)
        n = len(data)
        if (stream is None or stream.state_machine.state not in _DATA_STATES
                or h2c.state_machine.state not in _OPEN_CONNECTION
                or n > h2c.max_outbound_frame_size or n > stream.outbound_flow_control_window
                or n > h2c.outbound_flow_control_window):
            return False
        stream.outbound_flow_control_window -= n
        h2c.outbound_flow_control_window -= n
        h2c._data_to_send += _DATA_HEADER.pack(n >> 16, n & 0xFFFF, 0, 0, stream_id) + data
        if self.budget is not None:
            self.budget.sent_data(n)
        return True

    def start_response(self, stream_id: int, *args: Any, **kwargs: Any) -> None:
        """The call on ``stream_id`` is answered (its first message follows)."""
        super().start_response(stream_id, *args, **kwargs)
        if self.budget is not None:
            self.budget.answered()

    def _set_h2_connection_local_settings(self) -> None:
        limits, h2c = self.limits, self.h2_connection
        # gRPC servers never open streams (and push is off), but a client advertises 1, not 0:
        # h2 applies this limit before it recognises a late frame on a stream the client has
        # already reset (trailers racing an RST_STREAM), and with 0 it calls that frame a new
        # stream over the limit and kills the whole connection (found by tests/test_rpc_fuzz.py).
        streams = 1 if self.config.client_side else (
            limits.max_concurrent_streams + limits.unary_reserve)
        h2c.local_settings = Settings(client=self.config.client_side, initial_values={
            SettingCodes.MAX_CONCURRENT_STREAMS: streams,
            SettingCodes.INITIAL_WINDOW_SIZE: limits.stream_window_bytes,
            SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_list_bytes,
            SettingCodes.MAX_FRAME_SIZE: limits.max_frame_bytes,
        })
        h2c.max_inbound_frame_size = limits.max_frame_bytes
        h2c.decoder.max_header_list_size = limits.max_header_list_bytes  # before the ACK too

    def initiate_connection(self) -> None:
        self.h2_connection.initiate_connection()
        extra = self.limits.connection_window_bytes - self.h2_connection.inbound_flow_control_window
        if extra > 0:
            self.h2_connection.increment_flow_control_window(extra)

    def _request_received(self, event: Any) -> list[Any]:
        try:
            events = super()._request_received(event)
        except (ProtocolError, ValueError, KeyError, AttributeError):
            return [Signal("malformed", event.stream_id)]
        # purerpc would inflate compressed messages with no size limit (a zip bomb walks past
        # max_message_bytes) and a bad one raised out of the connection loop: refuse them.
        self.message_read_buffers[event.stream_id].decompress = _refuse_compressed
        if self.gate_streams:  # before any DATA of the stream (it may be in this same read)
            self.gated.add(event.stream_id)
        return events

    def _response_received(self, event: Any) -> list[Any]:
        events = super()._response_received(event)
        buffer = self.message_read_buffers.get(event.stream_id)
        if buffer is not None:
            buffer.decompress = _refuse_compressed
        return events

    def _data_received(self, event: Any) -> list[Any]:
        sid, size = event.stream_id, event.flow_controlled_length
        buffer = self.message_read_buffers.get(sid)
        if buffer is None:  # a stream we no longer read: give its bytes back at once
            if size:
                self.h2_connection.acknowledge_received_data(size, sid)
            return []
        flow = self.flow.setdefault(sid, _Flow())
        flow.deferred += size
        events: list[Any] = []
        failure = None
        try:
            buffer.data_received(event.data, size)
        except MessageTooLargeError:  # fail this stream only; purerpc failed the connection
            failure = "oversized"
        except UnsupportedMessageEncodingError:
            failure = "compressed"
        added = 0
        for data, _ in buffer.read_all_complete_messages_flowcontrol():
            added += len(data) + PREFIX
            events.append(MessageReceived(sid, data, len(data)))
        flow.queued += added
        if failure is not None:
            del self.message_read_buffers[sid]
            partial, pending = 0, False
        else:
            partial = len(buffer._buffer)  # noqa: SLF001 - the unfinished message's bytes
            pending = partial > 0 or buffer._message_length is not None  # noqa: SLF001
        self._hold(added + partial - flow.partial)
        flow.partial = partial
        if self.clock is not None:
            if not pending:
                flow.started = None
            elif flow.started is None or added:  # a new message began in this frame
                first = flow.started is None
                flow.started = self.clock()
                if first:
                    self.on_message_start()
        self._account(flow)
        self._maybe_ack(sid, flow)
        return events + ([Signal(failure, sid)] if failure else [])

    def _remote_settings_changed(self, event: Any) -> list[Any]:
        super()._remote_settings_changed(event)
        return [Signal("settings", 0)]  # the peer's SETTINGS: it speaks HTTP/2

    def _stream_reset(self, event: Any) -> list[Any]:
        return [Signal("reset", event.stream_id, int(event.error_code))]

    def _connection_terminated(self, event: Any) -> list[Any]:
        return [Signal("goaway", 0, event.last_stream_id or 0)]

    def _ping_acknowledged(self, event: Any) -> list[Any]:
        return [Signal("drain_ack", 0)] if event.ping_data == DRAIN_PING else []

    # ---- the ledger ----------------------------------------------------------------------

    def _hold(self, delta: int) -> None:
        self.held += delta
        self.pool.held += delta

    def _account(self, flow: _Flow) -> None:
        """Bring the stream's charge (and the connection's, and the pool's) up to date."""
        charge = max(0, flow.queued + flow.partial - flow.deferred)
        if charge != flow.charge:
            before = self.charge
            self.charge += charge - flow.charge
            flow.charge = charge
            self.pool.recharge(self, before, self.charge)

    def _room(self) -> tuple[int, bool]:
        """Bytes this connection may still be acknowledged; whether the pool is the bound."""
        own = self.limits.connection_buffer_bytes - self.charge
        pooled = self.pool.room(self, self.charge)
        return max(0, min(own, pooled)), pooled < own

    def _maybe_ack(self, sid: int, flow: _Flow) -> bool:
        """Acknowledge what the stream may have acknowledged now; True if anything was."""
        if not flow.deferred:
            self.deferring.discard(sid)
            return False
        if sid in self.gated or flow.queued > self.limits.stream_window_bytes:
            self.deferring.add(sid)  # waits for open_gate, or for the reader
            return False
        room, pool_bound = self._room()
        # Bytes the reader already took cost nothing to acknowledge.
        free = max(0, flow.deferred - flow.queued - flow.partial)
        size = min(flow.deferred, free + room)
        if size:
            flow.deferred -= size
            self.h2_connection.acknowledge_received_data(size, sid)
            self._account(flow)
        if not flow.deferred:
            self.deferring.discard(sid)
        else:
            self.deferring.add(sid)
            if pool_bound:
                self.pool.wait_for_room(self, self.retry_acks)  # waits on memory, not the reader
        return size > 0

    def retry_acks(self) -> None:
        """Send the acknowledgements that waited (for memory, for the reader, for the gate)."""
        if not self.deferring:
            return
        sent = False
        for sid in sorted(self.deferring):
            flow = self.flow.get(sid)
            if flow is None:
                self.deferring.discard(sid)
            elif self._maybe_ack(sid, flow):
                sent = True
        if sent:
            self.on_acks()

    def open_gate(self, sid: int) -> None:
        """The call on ``sid`` is authorized: its DATA may be acknowledged from now on."""
        if sid in self.gated:
            self.gated.discard(sid)
            flow = self.flow.get(sid)
            if flow is not None and self._maybe_ack(sid, flow):
                self.on_acks()

    def consumed(self, sid: int, size: int) -> None:
        """The reader took a message of ``size`` bytes (``size`` counts the prefix)."""
        flow = self.flow.get(sid)
        if flow is None:
            return
        flow.queued -= size
        self._hold(-size)
        self._account(flow)
        self.retry_acks()

    def drop_input(self, sid: int) -> None:
        """Stop reading ``sid``: its unfinished message is dropped (its bytes given back to
        the peer's window) and later DATA is acknowledged and dropped at once."""
        self.message_read_buffers.pop(sid, None)
        flow = self.flow.get(sid)
        if flow is not None:
            self._hold(-flow.partial)
            flow.partial, flow.started = 0, None
            self._account(flow)
            self.deferring.add(sid)  # its dropped bytes are acknowledged now
            self.retry_acks()  # and the connection's other streams may have room again

    def oldest_message_start(self) -> float | None:
        """When the oldest unfinished message (of a timed connection) began; None if none."""
        return min((f.started for f in self.flow.values() if f.started is not None), default=None)

    def messages_started_before(self, when: float) -> list[int]:
        """Streams whose unfinished message began before ``when``."""
        return [sid for sid, f in self.flow.items() if f.started is not None and f.started <= when]

    def forget(self, sid: int) -> None:
        """Drop per-stream state and give deferred bytes back to the connection window."""
        self.message_read_buffers.pop(sid, None)
        flow = self.flow.pop(sid, None)
        self.deferring.discard(sid)
        self.gated.discard(sid)
        if flow is not None:
            self._hold(-(flow.queued + flow.partial))
            before = self.charge
            self.charge -= flow.charge
            self.pool.recharge(self, before, self.charge)
            if flow.deferred:
                with contextlib.suppress(h2.exceptions.ProtocolError):  # connection closed
                    self.h2_connection.acknowledge_received_data(flow.deferred, sid)
            self.retry_acks()

    def close_ledger(self) -> None:
        """The connection is gone: return what it held to the pool."""
        for flow in self.flow.values():
            self._hold(-(flow.queued + flow.partial))
        self.flow.clear()
        self.deferring.clear()
        self.gated.clear()
        before, self.charge = self.charge, 0
        self.pool.recharge(self, before, 0)
        self.pool.forget(self)

    @property
    def buffered_frame_bytes(self) -> int:
        """Bytes h2 holds for frames not complete yet (the reassembly buffer)."""
        return self.h2_connection.incoming_buffer.pending_bytes
