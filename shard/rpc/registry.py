"""Which sessions exist on this worker: streaming (owned by a ``SessionCall``) or retained.

Why one registry: session ids are chosen by the router, so the worker needs one place that
decides whether an id is free, attached to a live stream, or retained for resume; the
out-of-band Cancel and Release RPCs, the TTL reaper and shutdown all look sessions up here.

Dependencies run one way: the registry creates ``SessionCall``s; a call sees its registry only
through the small ``SessionHost`` protocol defined next to it.

Ownership: a session id is *claimed* by exactly one ``SessionCall`` while its stream runs. When
the stream ends without a release (CloseSession{retain}, half-close, lost connection), the
call hands the engine session to the registry as *retained* until ``resume_ttl`` expires; the
reaper task frees it then. ``Release`` frees a session at once, streaming or retained.
Every way a retained session ends is the engine's ``release``, so with a prefix cache its
history becomes a cache entry (one mechanism: docs/protocol.md, "Resume and TTL").

Resource handling: ``run()`` is started in the server's nursery and owns a nursery of its own
in which every ``SessionCall`` and the reaper run (no task lives outside it). When ``run()`` is
cancelled, every stream is cancelled (each frees its engine session, shielded) and then every
retained session is freed, so a stopped server leaves the engine with no sessions.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import AsyncIterable

import trio
from trio_util import AsyncValue

from shard.engine import EngineError, ShardEngine
from shard.v1 import shard_pb2 as pb

from .errors import ErrorCode, ShardError
from .session import Relay, Retained, SessionCall, SessionLimits, StreamEnd

log = logging.getLogger(__name__)


class Registry:
    """Open and retained sessions; the TTL reaper; Cancel/Release lookup; worker counters."""

    def __init__(
        self, engine: ShardEngine, limits: SessionLimits = SessionLimits(),
        relay: Relay | None = None,
    ) -> None:
        self.engine = engine
        self.limits = limits
        #: Opens the downstream session of a routed session (chain relay); None refuses routes.
        self.relay = relay
        self.draining = False
        self.counters: collections.Counter[str] = collections.Counter()
        self.streams = AsyncValue(0)  # running SessionCall tasks
        self._live: dict[str, SessionCall] = {}
        self._retained: dict[str, Retained] = {}
        self._changed = AsyncValue(0)  # bumped on every change of the retained table
        #: Retained sessions the registry forgot and the engine is still releasing (``_free``).
        self._freeing = AsyncValue(0)
        self._nursery: trio.Nursery | None = None

    # ---- task ------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[Registry] = trio.TASK_STATUS_IGNORED) -> None:
        """Own every stream task and the reaper until cancelled; then free everything."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._reap)
                task_status.started(self)
                await trio.sleep_forever()
        finally:
            self._nursery = None
            with trio.CancelScope(shield=True):
                await self.release_all_retained()

    async def start_call(
        self,
        requests: AsyncIterable[pb.SessionRequest],
        *,
        deadline: float = math.inf,
        max_message_bytes: int = 16 * 1024 * 1024,
    ) -> SessionCall:
        """Start a ``SessionCall`` task in the registry's nursery and return it.

        ``max_message_bytes``: the transport's message limit; larger results are chunked.
        """
        nursery = self._nursery
        if nursery is None:
            raise ShardError(ErrorCode.NOT_READY, "the worker is not serving sessions")
        call = SessionCall(
            engine=self.engine,
            registry=self,
            limits=self.limits,
            requests=requests,
            deadline=deadline,
            max_message_bytes=max_message_bytes,
            relay=self.relay,
        )
        self.counters["rpc_session_total"] += 1
        try:
            await nursery.start(self._run_call, call)
        except RuntimeError:  # the nursery closed under us: the server is stopping
            raise ShardError(ErrorCode.NOT_READY, "the worker is shutting down") from None
        return call

    async def _run_call(self, call: SessionCall, *, task_status: trio.TaskStatus[None]) -> None:
        self.streams.value += 1
        try:
            await call.run(task_status=task_status)
        finally:
            self.streams.value -= 1

    async def _reap(self) -> None:
        """Free retained sessions whose TTL expired (sleeps until the earliest expiry)."""
        while True:
            now = trio.current_time()
            expired = [sid for sid, r in self._retained.items() if r.expires_at <= now]
            for sid in expired:
                if self._retained.pop(sid, None) is not None:
                    self._bump()
                    self.counters["sessions_expired_total"] += 1
                    await self._free(sid)
            if expired:
                continue
            next_at = min((r.expires_at for r in self._retained.values()), default=math.inf)
            with trio.move_on_at(next_at):
                await self._changed.wait_transition()

    def _bump(self) -> None:
        self._changed.value += 1

    # ---- used by SessionCall ---------------------------------------------------------------

    def claim(self, session_id: str, call: SessionCall, *, resuming: bool) -> Retained | None:
        """Attach ``session_id`` to ``call``; return the retained state it resumes, if any.

        Fails with SESSION_EXISTS when another stream holds the id, or when a retained session
        has it and the caller did not ask to resume (no CacheExpectation).
        """
        if session_id in self._live:
            raise ShardError(
                ErrorCode.SESSION_EXISTS, "the session is open in another stream", session_id=session_id
            )
        if session_id in self._retained and not resuming:
            raise ShardError(
                ErrorCode.SESSION_EXISTS,
                "the session is retained: send a CacheExpectation to resume it, or Release it",
                session_id=session_id,
            )
        self._live[session_id] = call
        retained = self._retained.pop(session_id, None)
        if retained is not None:
            self._bump()
        return retained

    def unclaim(self, session_id: str, call: SessionCall) -> None:
        """Forget a claim that never got an engine session."""
        if self._live.get(session_id) is call:
            del self._live[session_id]

    def retain(self, session_id: str, *, end: int, engine_len: int, kv_capacity: int) -> bool:
        """Keep the engine session for ``resume_ttl``; False when retention is disabled."""
        if self.limits.resume_ttl <= 0 or self.draining:
            return False
        self._live.pop(session_id, None)
        self._retained[session_id] = Retained(
            session_id=session_id,
            expires_at=trio.current_time() + self.limits.resume_ttl,
            end=end,
            engine_len=engine_len,
            kv_capacity=kv_capacity,
        )
        self.counters["sessions_retained_total"] += 1
        self._bump()
        return True

    async def release_owned(self, session_id: str) -> None:
        """Free a claimed session's engine state, then its id (so no one resumes it midway)."""
        try:
            await self.engine.release(session_id)
        finally:
            self._live.pop(session_id, None)

    async def evict_one(self) -> bool:
        """Free the retained session closest to expiry to make room; False if none.

        A retained session already being freed (its TTL expired, or another open evicted it)
        makes room too: wait until it is. Without that, an open on a full worker was refused
        while the engine still released a session the registry no longer listed."""
        if not self._retained:
            if not self._freeing.value:
                return False
            await self._freeing.wait_value(0)
            return True
        sid = min(self._retained.values(), key=lambda r: r.expires_at).session_id
        del self._retained[sid]
        self._bump()
        self.counters["sessions_evicted_total"] += 1
        await self._free(sid)
        return True

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def count_error(self, code: ErrorCode) -> None:
        self.counters[f"errors_total:ERROR_CODE_{code.name}"] += 1

    # ---- out-of-band RPCs ------------------------------------------------------------------

    def cancel(self, session_id: str) -> tuple[bool, bool]:
        """(found, was_running): stop the session's running step, if any."""
        call = self._live.get(session_id)
        if call is not None:
            return True, call.cancel_step()
        return session_id in self._retained, False

    async def release(self, session_id: str) -> bool:
        """Free a session now, streaming or retained. Idempotent: False if none."""
        call = self._live.get(session_id)
        if call is not None:
            call.end(StreamEnd.RELEASED)
            await call.done.wait()
            if session_id not in self._retained:
                return True
            # The stream was already ending for a lost connection and retained the session.
        if self._retained.pop(session_id, None) is not None:
            self._bump()
            self._freeing.value += 1  # an open meanwhile waits for it (``evict_one``)
            try:
                await self.engine.release(session_id)
            finally:
                self._freeing.value -= 1
            return True
        await trio.lowlevel.checkpoint()
        return False

    async def release_all_retained(self) -> None:
        while self._retained:
            sid = next(iter(self._retained))
            del self._retained[sid]
            self._bump()
            await self._free(sid)

    async def _free(self, session_id: str) -> None:
        """Release a retained session's engine state from a background path (reaper, eviction,
        shutdown). An engine error is logged, not raised: the engine frees the session's slot
        even when it fails (and then reports FAILED health), and one failure must neither stop
        the reaper (whose nursery holds every stream) nor skip the other sessions."""
        self._freeing.value += 1
        try:
            await self.engine.release(session_id)
        except EngineError:
            log.exception("releasing retained session %r failed", session_id)
        finally:
            self._freeing.value -= 1

    # ---- observation -----------------------------------------------------------------------

    @property
    def n_live(self) -> int:
        """Sessions attached to a running stream."""
        return len(self._live)

    @property
    def n_retained(self) -> int:
        return len(self._retained)

    def live(self, session_id: str) -> SessionCall | None:
        return self._live.get(session_id)

    def retained(self, session_id: str) -> Retained | None:
        return self._retained.get(session_id)

    def worker_metrics(self) -> dict[str, int]:
        return {
            **self.counters,
            "sessions_streaming": self.streams.value,
            "sessions_open": self.n_live,
            "sessions_retained": self.n_retained,
            "draining": int(self.draining),
        }


__all__ = ["Registry", "Retained"]
