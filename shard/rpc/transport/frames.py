"""Inbound HTTP/2 frames: cut from the byte stream one by one, each counted as it is parsed.

Why a module of its own: what a frame costs us does not depend on its bytes. A PING,
SETTINGS, WINDOW_UPDATE, RST_STREAM or empty frame is 9 to 17 bytes, so one 1 MiB socket read
can hold 60,000 to 110,000 of them, each a round through h2 (and an answer queued for PING and
SETTINGS); flow control bounds bytes, never frames. Two things follow:

- **Every frame counts as it is parsed.** ``FrameBudget`` keeps one token bucket per kind of
  frame (``FrameRate``: a burst, then a rate); the frame over a bucket raises ``FrameFlood``
  before h2 sees it, so h2 answers with GOAWAY(ENHANCE_YOUR_CALM) and the events of the whole
  read are dropped: no call is created past the limit, whatever else the read held. A bound
  checked per read let one write of 20,000 HEADERS+RST_STREAM pairs start 3,504 calls.
- **What the worker sent pays for what answers it.** A control frame that answers the worker's
  own traffic is not abuse: a gRPC client sends a WINDOW_UPDATE as it consumes DATA, a BDP PING
  (and the SETTINGS that adjust its windows) with bursts of DATA, and a RST_STREAM or a new
  HEADERS for a call that was answered. So besides its bucket each kind *earns* frames on the
  connection (``FrameRate.per_data_frame``: per DATA frame the worker sent, a frame's worth per
  16 KiB counted as one more; ``FrameRate.per_answer``: per call the worker answered with a
  message), banked up to ``burst`` and spent before the bucket. A fixed rate alone would cut
  exactly the clients that matter most: grpcio multiplexing many generations on one channel sends
  WINDOW_UPDATE frames in step with the tokens it is sent, hundreds a second. A peer that takes
  no data earns nothing and is cut by its bucket alone; one that does can send control frames at
  most in proportion to what the worker chose to send it (as Envoy's
  ``max_inbound_window_update_frames_per_data_frame_sent``).
- **Cutting is linear.** h2 3.2's ``FrameBuffer`` copies the rest of its buffer after every
  frame (``data = data[n:]``), quadratic in the frames of one read: a flood of tens of
  thousands of small frames would take seconds to cut, before h2 handled any. ``FrameReader`` keeps an offset instead and
  compacts once per read. It also refuses an oversized frame on its 9-byte header (h2 waits
  for the whole frame first) and a header block (HEADERS + CONTINUATION) above the
  header-list limit (h2 lets it grow to 64 CONTINUATION frames of any size).

A peer cut off must not get a fresh budget by reconnecting: ``PeerMemory`` remembers, per
peer host, the levels its buckets had when its connections closed, and a new connection starts
from them, refilled for the time in between (a record goes once every bucket is full again).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from h2.exceptions import DenialOfServiceError, FrameDataMissingError, ProtocolError
from h2.frame_buffer import FrameBuffer
from hyperframe.exceptions import InvalidFrameError

#: Frame types (RFC 9113 section 6) and the budget kind each counts against.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
_END_STREAM = 0x1
KINDS = ("streams", "resets", "pings", "settings", "window_updates", "continuations", "empty",
         "small_data")
_KIND_OF_TYPE = {HEADERS: "streams", RST_STREAM: "resets", PING: "pings", SETTINGS: "settings",
                 WINDOW_UPDATE: "window_updates", CONTINUATION: "continuations"}

#: Frames every connection's setup takes, free of its host's budgets: the client's SETTINGS and
#: its ACK of ours, and the connection-level WINDOW_UPDATE gRPC clients send at once. Why: the
#: levels a host's closed connections leave carry over (``PeerMemory``), so a polite client that
#: reconnects often (a script, a prober, the RPC fuzzer: 4 connections a second) spent the
#: SETTINGS budget (4 a second) on handshakes alone and was sent GOAWAY. A peer that reconnects
#: to get these frames free pays a TCP and HTTP/2 handshake for each.
HANDSHAKE_FRAMES = {"settings": 2, "window_updates": 1}

#: Peer hosts remembered at once (``PeerMemory``); the oldest record goes first.
MAX_PEERS_REMEMBERED = 4096

#: A DATA frame with a payload shorter than this (and no END_STREAM) counts as ``small_data``:
#: flow control bounds its bytes, not its number, and 1-byte frames cost a round through h2
#: each (65,535 of them fit one stream window). A gRPC message of a client's decode step fits in
#: one such frame, so what the worker sends earns them (``TransportLimits.small_data_frames``).
SMALL_DATA_BYTES = 16

#: Bytes of DATA that earn as much as one more DATA frame (the default frame size): a client
#: acknowledges bytes, so a large frame may be answered by more than one WINDOW_UPDATE.
DATA_UNIT_BYTES = 16384


@dataclass(frozen=True)
class FrameRate:
    """A token bucket: ``burst`` frames at once, then ``per_second`` on average; plus frames
    earned on the connection by what the worker sent it (see the module docs):
    ``per_data_frame`` for each DATA frame (and each 16 KiB of it), ``per_answer`` for each
    call the worker answered with a message. Earned frames are banked up to ``burst``."""

    burst: int
    per_second: float
    per_data_frame: float = 0.0
    per_answer: float = 0.0

    def __post_init__(self) -> None:
        if self.burst < 1 or not (self.per_second > 0 and math.isfinite(self.per_second)):
            raise ValueError("a frame rate needs burst >= 1 and a finite per_second > 0")
        for name in ("per_data_frame", "per_answer"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"a frame rate's {name} must be a finite number >= 0")


def kind_of(frame_type: int, flags: int, length: int) -> str | None:
    """The budget a frame counts against; None for frames that move message bytes (DATA of
    ``SMALL_DATA_BYTES`` or more, or with END_STREAM: flow control bounds their bytes, and the
    end of a stream comes once per call) and for GOAWAY (the peer leaves).

    ``empty``: frames that carry nothing we act on: PRIORITY, PUSH_PROMISE (a protocol error
    from a client anyway), frame types this side does not know, DATA without payload or
    END_STREAM. ``small_data``: DATA with 1 to ``SMALL_DATA_BYTES - 1`` bytes, no END_STREAM."""
    kind = _KIND_OF_TYPE.get(frame_type)
    if kind is not None:
        return kind
    if frame_type == DATA:
        if flags & _END_STREAM or length >= SMALL_DATA_BYTES:
            return None
        return "small_data" if length else "empty"
    return None if frame_type == GOAWAY else "empty"


class FrameFlood(DenialOfServiceError):
    """A peer went over one of its frame budgets (h2 answers GOAWAY(ENHANCE_YOUR_CALM))."""

    def __init__(self, kind: str, rate: FrameRate) -> None:
        earned = []
        if rate.per_data_frame:
            earned.append(f"{rate.per_data_frame:g} per DATA frame sent")
        if rate.per_answer:
            earned.append(f"{rate.per_answer:g} per call answered")
        beyond = f" beyond the {' and '.join(earned)}" if earned else ""
        super().__init__(
            f"more {kind.replace('_', ' ')} frames than {rate.burst} at once or "
            f"{rate.per_second:g} per second{beyond}")
        self.kind = kind


Levels = dict[str, tuple[float, float]]  # kind -> (tokens, when they were counted)


class FrameBudget:
    """One connection's frame budgets: a token bucket per frame kind, and the frames each kind
    earned from what the worker sent (see the module docs). It also counts what it saw, so a
    cut connection can be logged with the evidence (``counters``)."""

    def __init__(self, rates: Mapping[str, FrameRate], clock: Callable[[], float],
                 levels: Levels | None = None) -> None:
        self._rates = dict(rates)
        self._clock = clock
        now = clock()
        self._tokens = {kind: float(rate.burst) for kind, rate in self._rates.items()}
        self._at = dict.fromkeys(self._rates, now)
        for kind, (tokens, at) in (levels or {}).items():
            if kind in self._rates:
                self._tokens[kind], self._at[kind] = tokens, at
        self._free = dict(HANDSHAKE_FRAMES)  # this connection's setup (see HANDSHAKE_FRAMES)
        self._earned = dict.fromkeys(self._rates, 0.0)
        # (kind, frames earned per unit, bank cap) of the kinds that earn: the per-frame loop
        # of ``sent_data`` runs on every DATA frame the worker sends.
        self._per_data = tuple((k, r.per_data_frame, float(r.burst))
                               for k, r in self._rates.items() if r.per_data_frame)
        self._per_answer = tuple((k, r.per_answer, float(r.burst))
                                 for k, r in self._rates.items() if r.per_answer)
        self.received = dict.fromkeys(self._rates, 0)  # budgeted frames the peer sent, by kind
        self.data_frames_sent = 0
        self.data_bytes_sent = 0
        self.answers = 0  # calls answered with a message

    def sent_data(self, size: int) -> None:
        """The worker sent one DATA frame of ``size`` bytes on this connection."""
        self.data_frames_sent += 1
        self.data_bytes_sent += size
        units = 1 + size // DATA_UNIT_BYTES
        earned = self._earned
        for kind, per, cap in self._per_data:
            value = earned[kind] + per * units
            earned[kind] = value if value < cap else cap

    def answered(self) -> None:
        """The worker answered a call on this connection (sent its first message)."""
        self.answers += 1
        earned = self._earned
        for kind, per, cap in self._per_answer:
            value = earned[kind] + per
            earned[kind] = value if value < cap else cap

    def counters(self) -> dict[str, int]:
        """What the peer sent (budgeted frames by kind) and what the worker sent it."""
        out = {kind: n for kind, n in self.received.items() if n}
        out.update(data_frames_sent=self.data_frames_sent,
                   data_bytes_sent=self.data_bytes_sent, calls_answered=self.answers)
        return out

    def spend(self, kind: str) -> None:
        """Count one frame of ``kind``; raises ``FrameFlood`` past what it earned and its
        bucket."""
        rate = self._rates.get(kind)
        if rate is None:
            return
        self.received[kind] += 1
        if self._free.get(kind):
            self._free[kind] -= 1
            return
        earned = self._earned[kind]
        if earned >= 1.0:
            self._earned[kind] = earned - 1.0
            return
        now = self._clock()
        tokens = min(float(rate.burst), self._tokens[kind] + (now - self._at[kind]) * rate.per_second)
        self._at[kind] = now
        if tokens < 1.0:
            self._tokens[kind] = tokens
            raise FrameFlood(kind, rate)
        self._tokens[kind] = tokens - 1.0

    def levels(self) -> Levels:
        """The buckets that are not full: what a reconnecting peer starts from."""
        now = self._clock()
        out: Levels = {}
        for kind, rate in self._rates.items():
            tokens = self._tokens[kind] + (now - self._at[kind]) * rate.per_second
            if tokens < rate.burst:
                out[kind] = (tokens, now)
        return out


class PeerMemory:
    """The frame budgets' levels of each peer host's closed connections (see the module docs):
    a new connection from the host starts from them, so reconnecting buys no fresh budget.

    Levels, not a ban: on loopback or behind one NAT, a well-behaved client shares its host with
    the peer that flooded; it only finds the flooded kind's bucket refilling at its rate.
    """

    def __init__(self, rates: Mapping[str, FrameRate], clock: Callable[[], float]) -> None:
        self._rates = dict(rates)
        self._clock = clock
        self._levels: dict[str, Levels] = {}

    def budget(self, host: str) -> FrameBudget:
        """A new connection's budget: its host's remembered levels, refilled since."""
        return FrameBudget(self._rates, self._clock, self._current(host))

    def left(self, host: str, budget: FrameBudget) -> None:
        """A connection of ``host`` closed: keep the lower level of each bucket."""
        levels = budget.levels()
        for kind, (tokens, at) in self._current(host).items():
            if kind not in levels or tokens < levels[kind][0]:
                levels[kind] = (tokens, at)
        self._levels.pop(host, None)
        if levels:
            self._levels[host] = levels
            _trim(self._levels)

    def _current(self, host: str) -> Levels:
        """``host``'s levels refilled to now, without the full buckets (dropped when all are)."""
        old = self._levels.get(host)
        if not old:
            return {}
        now = self._clock()
        levels: Levels = {}
        for kind, (tokens, at) in old.items():
            rate = self._rates[kind]
            refilled = tokens + (now - at) * rate.per_second
            if refilled < rate.burst:
                levels[kind] = (refilled, now)
        if not levels:
            del self._levels[host]
        return levels

    def __len__(self) -> int:
        return len(self._levels)


def _trim(table: dict[str, Any]) -> None:
    while len(table) > MAX_PEERS_REMEMBERED:
        del table[next(iter(table))]


class FrameReader(FrameBuffer):
    """h2's frame reassembly, cut linearly and counted per frame (see the module docs)."""

    def __init__(self, *, server: bool, header_block_limit: int,
                 budget: FrameBudget | None = None) -> None:
        super().__init__(server=server)
        self.header_block_limit = header_block_limit
        self.budget = budget
        self._pos = 0  # bytes of ``data`` already cut into frames

    @property
    def pending_bytes(self) -> int:
        """Bytes held for frames not complete yet (the header block's too)."""
        return len(self.data) - self._pos + sum(len(f.data) for f in self._headers_buffer)

    def add_data(self, data: bytes) -> None:
        if self._pos:
            self.data, self._pos = self.data[self._pos:], 0
        super().add_data(data)

    def next(self) -> Any:
        while True:
            data, pos = self.data, self._pos
            if len(data) - pos < 9:
                raise StopIteration
            try:
                frame, length = self._parse_frame_header(data[pos:pos + 9])
            except InvalidFrameError:  # pragma: no cover - h2 does the same
                raise ProtocolError("Received frame with invalid frame header.") from None
            self._validate_frame_length(length)  # before waiting for a body of that size
            if len(data) - pos < length + 9:
                raise StopIteration
            if self.budget is not None:
                kind = kind_of(data[pos + 3], data[pos + 4], length)
                if kind is not None:
                    self.budget.spend(kind)
            if frame is not None:
                try:
                    frame.parse_body(memoryview(data)[pos + 9:pos + 9 + length])
                except InvalidFrameError:
                    raise FrameDataMissingError("Frame data missing or invalid") from None
            self._pos = pos + 9 + length
            frame = self._update_header_buffer(frame)
            if frame is not None:
                return frame

    def _update_header_buffer(self, f: Any) -> Any:
        f = super()._update_header_buffer(f)
        pending = sum(len(x.data) for x in self._headers_buffer)
        if f is not None and f.type == HEADERS:  # a complete header block
            pending = len(f.data)
        if pending > self.header_block_limit:
            raise DenialOfServiceError(f"header block of {pending} bytes is too large")
        return f


__all__ = [
    "DATA_UNIT_BYTES",
    "KINDS",
    "MAX_PEERS_REMEMBERED",
    "FrameBudget",
    "FrameFlood",
    "FrameRate",
    "FrameReader",
    "PeerMemory",
    "kind_of",
]
