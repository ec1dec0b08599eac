"""Floods of cheap frames (issue 33, findings 2 and 5): every frame counts as it is parsed.

A raw HTTP/2 peer sends one write of thousands of frames of one kind at a worker while a
neighbour session generates. It must get GOAWAY(ENHANCE_YOUR_CALM) after at most its budget of
that kind (counted from what the worker did: PING and SETTINGS ACKs, calls started), the
neighbour must go on generating and health must answer. Reconnecting must not buy a fresh
budget. Timing is the benchmark's (bench/worker/floods.py); here only counts and outcomes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import trio
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from raw_h2 import RawConnection
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import V, worker
from shard.client import ShardClient
from shard.rpc.transport import TransportLimits
from shard.rpc.transport.frames import (
    MAX_PEERS_REMEMBERED,
    FrameBudget,
    FrameFlood,
    FrameRate,
    FrameReader,
    HANDSHAKE_FRAMES,
    PeerMemory,
    kind_of,
)
from shard.v1 import shard_pb2 as pb

ENHANCE_YOUR_CALM = 0xB
SESSION = "/shard.v1.Shard/Session"
#: A unary method: its calls never count against the streaming-call limit, so each HEADERS
#: starts a call (and runs the auth hook) unless a budget stops it.
UNARY = "/shard.v1.Shard/GetCapabilities"
FLOOD_FRAMES = 20_000


def _resets(peer: RawConnection, n: int) -> bytes:
    out = bytearray()
    for _ in range(n):
        sid, head = peer.headers(UNARY)
        out += head + RstStreamFrame(sid, error_code=0x8).serialize()
    return bytes(out)


def _continuations(peer: RawConnection, n: int) -> bytes:
    """Header blocks cut into a HEADERS and 8 CONTINUATION frames each (legal, each block
    small), each stream reset after it."""
    out = bytearray()
    for _ in range(n // 8):
        sid, head = peer.headers(SESSION)
        block = head[9:]  # the encoded header block of a HEADERS frame with END_HEADERS
        step = max(1, (len(block) - 1) // 8)
        cuts = [block[1 + i * step:1 + (i + 1) * step] for i in range(7)] + [block[1 + 7 * step:]]
        out += HeadersFrame(sid, data=block[:1]).serialize()
        for i, chunk in enumerate(cuts):
            flags = {"END_HEADERS"} if i == len(cuts) - 1 else set()
            out += ContinuationFrame(sid, data=chunk, flags=flags).serialize()
        out += RstStreamFrame(sid, error_code=0x8).serialize()
    return bytes(out)


def _small_data(peer: RawConnection, n: int) -> bytes:
    """A Session call, then its request message one byte per DATA frame (flow control allows
    a whole stream window of them)."""
    sid, head = peer.headers(SESSION)
    return head + b"".join(DataFrame(sid, data=b"\0").serialize() for _ in range(n))


#: kind -> (the TransportLimits field, what one write of the flood looks like)
FLOODS: dict[str, tuple[str, Callable[[RawConnection, int], bytes]]] = {
    "resets": ("resets", _resets),
    "pings": ("pings", lambda _, n: PingFrame(0, opaque_data=b"flooding").serialize() * n),
    "settings": ("settings", lambda _, n: SettingsFrame(0).serialize() * n),
    "window_updates": ("window_updates", lambda _, n: WindowUpdateFrame(0, window_increment=1).serialize() * n),
    "continuations": ("continuations", _continuations),
    "empty": ("empty_frames", lambda _, n: PriorityFrame(1, depends_on=0, stream_weight=16).serialize() * n),
    "small_data": ("small_data_frames", lambda peer, n: _small_data(peer, n)),
}


async def _flood(port: int, payload: Callable[[RawConnection], bytes]) -> list[Any]:
    """Handshake, one write of the flood, then every frame the worker sent until it closed."""
    peer = await RawConnection.open("127.0.0.1", port)
    try:
        await peer.handshake()
        with contextlib.suppress(trio.BrokenResourceError):  # the worker may close first
            await peer.send(payload(peer))
        return await peer.closed_within(30)
    finally:
        await peer.aclose()


def _calmed(frames: list[Any]) -> bool:
    goaway = [f for f in frames if isinstance(f, GoAwayFrame)]
    return bool(goaway) and goaway[-1].error_code == ENHANCE_YOUR_CALM


@pytest.mark.parametrize("kind", sorted(FLOODS))
async def test_a_flood_of_one_frame_kind_ends_at_its_budget_while_a_neighbour_generates(
        kind: str, caplog: pytest.LogCaptureFixture) -> None:
    field, make = FLOODS[kind]
    limits = TransportLimits()
    budget: FrameRate = getattr(limits, field)
    authorized = 0

    async def authorize(ctx: Any) -> str:  # runs for every call the worker starts
        nonlocal authorized
        authorized += 1
        return "anyone"

    async with worker(latency=0.002, authorize=authorize) as w, \
            ShardClient.connect(w.target, timeout=60) as client:
        port = int(w.target.rpartition(":")[2])
        tokens = 0
        flooded = trio.Event()
        after_flood = 0

        async def neighbour() -> None:
            nonlocal tokens, after_flood
            async for _ in client.generate([1, 2, 3], max_tokens=200, ignore_eos=True):
                tokens += 1
                if flooded.is_set():
                    after_flood += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(neighbour)
            while tokens < 5:
                await trio.sleep(0.001)
            frames = await _flood(port, lambda peer: make(peer, FLOOD_FRAMES))
            flooded.set()
            assert (await client.health()).status == pb.HealthResponse.STATUS_SERVING
        assert _calmed(frames), frames[-3:]
        assert tokens == 200 and after_flood > 0  # the neighbour went on, and finished
        answered = {
            "pings": sum(isinstance(f, PingFrame) and "ACK" in f.flags for f in frames),
            # The handshake's SETTINGS is one of the budget's frames too.
            "settings": sum(isinstance(f, SettingsFrame) and "ACK" in f.flags for f in frames),
        }
        if kind in answered:
            # (plus the frames of the connection's handshake, which are free)
            assert 0 < answered[kind] <= budget.burst + HANDSHAKE_FRAMES.get(kind, 0), answered
        # Calls started (the auth hook runs from each call's headers) stay within the budgets:
        # before, one write of 20,000 HEADERS+RST_STREAM pairs started 3,504 calls.
        assert authorized <= 2 + limits.resets.burst, authorized  # + the neighbour's Session and Health
        await trio.testing.wait_all_tasks_blocked()
        assert w.server.transport.open_calls == 0 and w.server.transport.buffered_bytes == 0
        # Counted by reason (GetMetrics and Prometheus), and logged with the peer's counters.
        assert dict(w.server.transport.cuts) == {f"{kind}_flood": 1}
        assert w.server.metrics.snapshot().worker[f"connections_cut_total:{kind}_flood"] == 1
        cut = [r.getMessage() for r in caplog.records if "closing connection" in r.getMessage()]
        assert len(cut) == 1 and f" {kind}" in cut[0] and "it was sent 0 DATA frames" in cut[0], cut


async def test_a_peer_that_takes_data_floods_no_further_than_the_data_earned() -> None:
    """Earned frames are in proportion to what the worker sent: a peer that made 20 calls
    (each answered with one DATA frame) and then floods WINDOW_UPDATE frames is cut after its
    bucket plus 4 per DATA frame, as one that took nothing is cut after its bucket."""
    limits = TransportLimits()
    async with worker() as w:
        port = int(w.target.rpartition(":")[2])
        peer = await RawConnection.open("127.0.0.1", port)
        try:
            await peer.handshake()
            for _ in range(20):
                sid = await peer.start(UNARY, pb.GetCapabilitiesRequest(version=V), end=True)
                assert (await peer.headers_of(sid))["grpc-status"] == "0"
            budget = next(iter(w.server.transport._connections)).budget  # noqa: SLF001
            assert budget.data_frames_sent == 20 and budget.answers == 20
            with contextlib.suppress(trio.BrokenResourceError):
                await peer.send(WindowUpdateFrame(0, window_increment=1).serialize() * FLOOD_FRAMES)
            frames = await peer.closed_within(30)
        finally:
            await peer.aclose()
        assert _calmed(frames)
        taken = budget.received["window_updates"]
        allowed = limits.window_updates.burst + 20 * limits.window_updates.per_data_frame
        # (+ what the bucket refills, 500 a second, while the flood is read)
        assert allowed < taken <= allowed + HANDSHAKE_FRAMES["window_updates"] + 50, taken
        assert dict(w.server.transport.cuts) == {"window_updates_flood": 1}


async def test_reconnecting_buys_no_fresh_budget_and_a_polite_neighbour_on_the_host_still_connects() -> None:
    """Before, each reconnect started a fresh bucket. Now a host's next connection starts from
    the levels its closed ones left: a flood, then 10 resets on a new connection (far under a
    fresh budget) get GOAWAY at once, while a client on the same host that does not reset
    still opens sessions."""
    limits = dataclasses.replace(TransportLimits(), resets=FrameRate(100, 1.0))
    async with worker(transport_limits=limits) as w:
        port = int(w.target.rpartition(":")[2])
        assert _calmed(await _flood(port, lambda peer: _resets(peer, 1000)))
        started = w.server.registry.counters.get("rpc_Session_total", 0)
        assert _calmed(await _flood(port, lambda peer: _resets(peer, 10)))
        assert w.server.registry.counters.get("rpc_Session_total", 0) == started  # none started
        async with ShardClient.connect(w.target, timeout=30) as client:
            out = [t async for t in client.generate([1, 2], max_tokens=3, ignore_eos=True)]
            assert len(out) == 3


async def test_a_client_that_reconnects_often_is_never_cut_off() -> None:
    """Found by the RPC fuzzer's long profile: a client that reconnects about 4 times a second
    spent its host's SETTINGS budget (4 a second) on connection handshakes alone, the levels
    carrying over from one connection to the next, and got GOAWAY. With a budget of 2 SETTINGS
    a second, 30 connections in a row, each a Health call: every one is served."""
    limits = dataclasses.replace(TransportLimits(), settings=FrameRate(4, 2.0))
    async with worker(transport_limits=limits) as w:
        for _ in range(30):
            async with ShardClient.connect(w.target, timeout=10) as client:
                assert (await client.health()).status == pb.HealthResponse.STATUS_SERVING


# ---- the budget and the reader on plain data ------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_budget_allows_its_burst_then_its_rate() -> None:
    clock = Clock()
    budget = FrameBudget({"pings": FrameRate(5, 2.0)}, clock)
    for _ in range(5):
        budget.spend("pings")
    with pytest.raises(FrameFlood) as err:
        budget.spend("pings")
    assert err.value.kind == "pings" and err.value.error_code == ENHANCE_YOUR_CALM
    clock.now += 1.0  # two more
    budget.spend("pings")
    budget.spend("pings")
    with pytest.raises(FrameFlood):
        budget.spend("pings")
    budget.spend("window_updates")  # a kind without a budget is not counted


def test_data_the_worker_sent_earns_control_frames_up_to_the_burst() -> None:
    clock = Clock()
    budget = FrameBudget({"window_updates": FrameRate(10, 1.0, per_data_frame=2.0),
                          "resets": FrameRate(5, 1.0, per_answer=1.0)}, clock)
    for _ in range(3):
        budget.sent_data(100)  # 3 small DATA frames: 6 frames earned
    budget.sent_data(16384)  # a 16 KiB frame counts as 2: 4 more
    for _ in range(HANDSHAKE_FRAMES["window_updates"] + 10 + 10):  # handshake, earned, bucket
        budget.spend("window_updates")
    with pytest.raises(FrameFlood) as err:
        budget.spend("window_updates")
    assert "beyond the 2 per DATA frame sent" in str(err.value)
    for _ in range(1000):
        budget.sent_data(10)  # banked up to the burst, never beyond
    for _ in range(10):
        budget.spend("window_updates")
    with pytest.raises(FrameFlood):
        budget.spend("window_updates")
    # Answers earn what ``per_answer`` says, and only that kind.
    budget.answered()
    budget.answered()
    for _ in range(2 + 5):
        budget.spend("resets")
    with pytest.raises(FrameFlood):
        budget.spend("resets")
    assert budget.counters() == {"window_updates": 33, "resets": 8, "data_frames_sent": 1004,
                                 "data_bytes_sent": 3 * 100 + 16384 + 10_000,
                                 "calls_answered": 2}


def test_earned_frames_are_spent_first_and_never_carried_to_the_next_connection() -> None:
    """A busy honest client pays with earned frames, so it leaves its host's buckets full (a
    reconnect after a cut found them empty and was cut again); nothing earned carries over."""
    clock = Clock()
    memory = PeerMemory({"window_updates": FrameRate(10, 1.0, per_data_frame=1.0)}, clock)
    busy = memory.budget("10.0.0.1")
    for _ in range(5000):
        busy.sent_data(13)
        busy.spend("window_updates")
    memory.left("10.0.0.1", busy)
    assert len(memory) == 0  # every bucket full: nothing to remember
    banked = memory.budget("10.0.0.1")
    for _ in range(10):
        banked.sent_data(13)  # 10 banked on this connection
    memory.left("10.0.0.1", banked)
    fresh = memory.budget("10.0.0.1")
    for _ in range(HANDSHAKE_FRAMES["window_updates"] + 10):  # the bucket only
        fresh.spend("window_updates")
    with pytest.raises(FrameFlood):
        fresh.spend("window_updates")


@pytest.mark.parametrize("field", ["per_data_frame", "per_answer"])
@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan])
def test_a_frame_rate_refuses_a_bad_ratio(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        FrameRate(10, 1.0, **{field: value})


def test_a_connections_handshake_is_free_and_only_its_handshake() -> None:
    clock = Clock()
    budget = FrameBudget({"settings": FrameRate(1, 1.0), "window_updates": FrameRate(1, 1.0)}, clock)
    for _ in range(HANDSHAKE_FRAMES["settings"] + 1):  # the handshake's, then one from the bucket
        budget.spend("settings")
    with pytest.raises(FrameFlood):
        budget.spend("settings")
    for _ in range(HANDSHAKE_FRAMES["window_updates"] + 1):
        budget.spend("window_updates")
    with pytest.raises(FrameFlood):
        budget.spend("window_updates")


def test_a_host_starts_from_the_levels_its_closed_connections_left() -> None:
    clock = Clock()
    rates = {"resets": FrameRate(10, 1.0), "pings": FrameRate(10, 1.0)}
    memory = PeerMemory(rates, clock)
    first = memory.budget("10.0.0.1")
    for _ in range(10):
        first.spend("resets")
    memory.left("10.0.0.1", first)
    second = memory.budget("10.0.0.1")
    with pytest.raises(FrameFlood):
        second.spend("resets")
    for _ in range(10):
        memory.budget("10.0.0.2").spend("resets")  # another host: its own budget
    clock.now += 3.0
    third = memory.budget("10.0.0.1")
    for _ in range(3):
        third.spend("resets")
    with pytest.raises(FrameFlood):
        third.spend("resets")
    memory.left("10.0.0.1", third)
    clock.now += 60.0  # every bucket full again: the record goes
    memory.budget("10.0.0.1")
    assert len(memory) == 0


def test_the_memory_of_hosts_is_bounded() -> None:
    clock = Clock()
    memory = PeerMemory({"resets": FrameRate(1, 1e-6)}, clock)
    for i in range(MAX_PEERS_REMEMBERED + 10):
        budget = memory.budget(f"h{i}")
        budget.spend("resets")
        memory.left(f"h{i}", budget)
    assert len(memory) == MAX_PEERS_REMEMBERED


@pytest.mark.parametrize(("frame_type", "flags", "length", "kind"), [
    (0x0, 0x0, 16, None), (0x0, 0x0, 1, "small_data"), (0x0, 0x0, 15, "small_data"),
    (0x0, 0x1, 1, None), (0x0, 0x1, 0, None), (0x0, 0x0, 0, "empty"), (0x1, 0x4, 20, "streams"),
    (0x2, 0x0, 5, "empty"), (0x3, 0x0, 4, "resets"), (0x4, 0x0, 0, "settings"), (0x6, 0x0, 8, "pings"),
    (0x7, 0x0, 8, None), (0x8, 0x0, 4, "window_updates"), (0x9, 0x4, 3, "continuations"),
    (0x42, 0x0, 0, "empty"),
])
def test_every_frame_kind_has_a_budget_but_data_and_goaway(
    frame_type: int, flags: int, length: int, kind: str | None,
) -> None:
    assert kind_of(frame_type, flags, length) == kind


def test_the_reader_cuts_frames_without_copying_the_rest_of_the_read() -> None:
    """h2's own buffer copied what was left after every frame (quadratic: 80,000 WINDOW_UPDATE
    frames of one read took 1.7 s to cut). The reader keeps one buffer per read."""
    reader = FrameReader(server=False, header_block_limit=8192)
    reader.max_frame_size = 16384
    reader.add_data(WindowUpdateFrame(0, window_increment=1).serialize() * 1000 + b"\0\0")
    held = reader.data
    frames = 0
    for frame in reader:
        assert isinstance(frame, WindowUpdateFrame)
        assert reader.data is held  # never re-copied
        frames += 1
    assert frames == 1000 and reader.pending_bytes == 2
    reader.add_data(b"\0" * 17)
    assert reader.pending_bytes == 2 + 17


def test_the_reader_counts_each_frame_before_h2_sees_it() -> None:
    clock = Clock()
    reader = FrameReader(server=False, header_block_limit=8192,
                         budget=FrameBudget({"pings": FrameRate(3, 1.0)}, clock))
    reader.max_frame_size = 16384
    reader.add_data(PingFrame(0, opaque_data=b"12345678").serialize() * 5)
    assert next(reader) and next(reader) and next(reader)
    with pytest.raises(FrameFlood):
        next(reader)
