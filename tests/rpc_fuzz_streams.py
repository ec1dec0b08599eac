"""The RPC fuzzer's stream rules: Release, close (retain or not), half-close, RST_STREAM (client
cancel), an abrupt TCP close, extra credit at random points, and plain waits (deadlines and step
timeouts fire meanwhile); opening a stream is ``FuzzWorld._open``, shared with ``_pick``.
"""

from __future__ import annotations

import trio
from hypothesis import strategies as st
from hypothesis.stateful import rule

from rpc_fuzz_model import SLOTS, FuzzWorld, SlotModel
from shard.client import ErrorCode, ShardError
from shard.v1 import shard_pb2 as pb


class StreamRules(FuzzWorld):
    """Rules that open, end and disturb a session's stream and its connection."""

    @rule(
        sid=st.sampled_from(SLOTS),
        timeout=st.sampled_from([None, None, None, 0.05, 0.2]),
        step_timeout=st.sampled_from([None, None, None, 0.002]),
        resume=st.sampled_from(["right", "count", "wrong"]),
        credit=st.sampled_from([0, 1, 2]),
    )
    def open(
        self, sid: str, timeout: float | None, step_timeout: float | None, resume: str, credit: int
    ) -> None:
        slot = self._pick(sid, "none", "retained")
        if slot is None:
            return
        self.loop.run(self._open, slot, timeout, step_timeout, resume, credit)

    @rule(sid=st.sampled_from(SLOTS))
    def release(self, sid: str) -> None:
        slot = self._pick(sid, "open", "stepping", "retained")
        if slot is None:
            return
        self.loop.run(self._release, slot)

    async def _release(self, slot: SlotModel) -> None:
        control = self._control()
        assert control is not None
        was = slot.state
        released = await control.release(slot.sid)
        # Found nothing only if the call deadline ended the stream first: judged once the
        # answer is here (on a busy machine the Release may reach the worker well after it
        # was sent), as the worker's deadline is never before ours.
        assert released or slot.near_deadline(), f"Release of a {was} session found nothing"
        await self._end_stream(slot, "none")
        FuzzWorld.stats["release"] += 1

    @rule(sid=st.sampled_from(SLOTS), retain=st.booleans())
    def close(self, sid: str, retain: bool) -> None:
        slot = self._pick(sid, "open")
        if slot is None:
            return
        self.loop.run(self._close, slot, retain)

    async def _close(self, slot: SlotModel, retain: bool) -> None:
        assert slot.session is not None
        try:
            closed = await slot.session.close(retain=retain)
        except ShardError as err:
            if not await self._ended(slot, err, "close"):
                raise
            return
        assert closed.kv_retained is retain
        await self._end_stream(slot, "retained" if retain else "none")
        FuzzWorld.stats[f"close:{'retain' if retain else 'release'}"] += 1

    @rule(sid=st.sampled_from(SLOTS))
    def half_close(self, sid: str) -> None:
        slot = self._pick(sid, "open")
        if slot is None:
            return
        self.loop.run(self._half_close, slot)

    async def _half_close(self, slot: SlotModel) -> None:
        session = slot.session
        assert session is not None
        try:
            await session._stream.half_close()  # noqa: SLF001 - a bare half-close, no CloseSession
            while session.closed is None:
                await session._next()  # noqa: SLF001
        except ShardError as err:
            if not await self._ended(slot, err, "half_close"):
                raise
            return
        assert session.closed.reason == pb.SessionClosed.REASON_CLIENT_HALF_CLOSE
        assert session.closed.kv_retained
        await self._end_stream(slot, "retained")
        FuzzWorld.stats["half_close"] += 1

    @rule(sid=st.sampled_from(SLOTS))
    def reset_stream(self, sid: str) -> None:
        slot = self._pick(sid, "open", "stepping")
        if slot is None:
            return
        self.loop.run(self._reset, slot)

    async def _reset(self, slot: SlotModel) -> None:
        assert slot.session is not None
        slot.session.abort()  # RST_STREAM: the worker releases the session
        await self._end_stream(slot, "none")
        FuzzWorld.stats["rst_stream"] += 1

    @rule(sid=st.sampled_from(SLOTS))
    def cut_connection(self, sid: str) -> None:
        slot = self._pick(sid, "open", "stepping")
        if slot is None:
            return
        self.loop.run(self._cut, slot)

    async def _cut(self, slot: SlotModel) -> None:
        assert slot.client is not None
        slot.cut = True
        await trio.aclose_forcefully(slot.client._conn.stream)  # noqa: SLF001 - abrupt TCP close
        slot.disconnect.set()
        await slot.conn_done.wait()
        if slot.run is not None:
            await slot.run.done.wait()
            await self._absorb_run(slot, slot.run)  # what the client got stays valid
        # The worker retains the session (it may hold results the client never got), unless its
        # call deadline passed before it noticed the lost connection: then it released it. On a
        # busy machine that notice may come any time after the cut, so which one won is read
        # from the worker (ambiguous) when the stream was still live at the deadline, judged
        # from when it ended, not from when we cut: the worker's deadline is never before ours.
        await self._stream_gone(slot)
        racing = slot.near_deadline()
        await self._end_stream(slot, "retained", ambiguous=racing)
        slot.exact = False
        await self._connect(slot)
        FuzzWorld.stats["tcp_close"] += 1

    @rule(sid=st.sampled_from(SLOTS), messages=st.sampled_from([0, 1, 5, 1000]))
    def grant_credit(self, sid: str, messages: int) -> None:
        """An extra Credit message at a random point (also while a step runs or is parked).

        The client's own accounting is left alone: the worker caps the balance at max_credit,
        so the client only ever under-counts what it granted and keeps topping up."""
        slot = self._pick(sid, "open", "stepping")
        if slot is None:
            return
        self.loop.run(self._grant, slot, messages)

    async def _grant(self, slot: SlotModel, messages: int) -> None:
        session = slot.session
        assert session is not None
        if session._dead is not None or session.closed is not None:  # noqa: SLF001
            return  # ended meanwhile: the next rule or check sees how
        try:
            await session._send(session._request(credit=pb.Credit(messages=messages)))  # noqa: SLF001
        except ShardError as err:
            assert err.code is ErrorCode.DEADLINE_EXCEEDED and slot.near_deadline(), err
        FuzzWorld.stats["credit"] += 1

    @rule(ms=st.sampled_from([1, 5, 20, 60]))
    def wait(self, ms: int) -> None:
        """Let time pass: deadlines and step timeouts fire at random points of background work."""
        self.loop.run(trio.sleep, ms / 1000)
        FuzzWorld.stats["wait"] += 1
