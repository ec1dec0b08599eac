"""The engine's open sessions: their slots by id and the sequence ids still free.

Why an object of its own: which sessions exist, which sequence id each holds and when an id is
free again is one piece of bookkeeping, apart from what the engine runs on them. The prefix
cache's entries hold sequence ids too (a released session's id passes to its entry, or the
entry moves to the highest free id, ``take_free_above``; an id comes back here when its entry
goes): the engine has ``max_sessions`` ids for sessions plus one per
entry the cache may keep, so a session can always open while fewer than ``max_sessions`` are.
"""

from __future__ import annotations

import heapq
import itertools

from .errors import SessionBusy, SessionExists, TooManySessions, UnknownSession
from .seq_ids import pick_seq_id
from .slots import Slot
from .types import Capabilities, SessionInfo, SessionState
from .validation import check_session_id, session_budget


class SessionTable:
    """Slots by session id (``slots``, the dict the implementations read too) and the free
    sequence ids.

    The free ids are a min-heap: a new session takes the lowest free id, so sessions opened at
    the same time hold neighbouring ids (llama.cpp batches runs of consecutive ids together); a
    session of a batch group takes one next to its group's (``shard.engine.seq_ids``).
    """

    __slots__ = ("slots", "_free", "_max", "_held")

    def __init__(self) -> None:
        self.slots: dict[str, Slot] = {}
        self._free: list[int] = []
        self._max = self._held = 0  # sessions allowed; sessions holding an id (releasing too)

    def reset(self, max_sessions: int, spare: int = 0) -> None:
        """Every sequence id free (on load): one per session and ``spare`` more for the prefix
        cache's entries."""
        self._free = list(range(max_sessions + spare))  # sorted: already a heap
        self._max, self._held = max_sessions, 0

    def open(self, session_id: str, kv_budget: int | None, batch_group: int,
             caps: Capabilities) -> Slot:
        """A new IDLE slot holding the sequence id it takes."""
        check_session_id(session_id)
        if session_id in self.slots:
            raise SessionExists(f"session {session_id!r} is already open", session_id=session_id)
        kv_budget = session_budget(kv_budget, batch_group, caps, session_id)
        free = self._free
        if self._held >= self._max or not free:
            raise TooManySessions(f"all {caps.max_sessions} sessions are in use")
        if batch_group:  # next to its group's sessions (shard.engine.seq_ids)
            held = {s.seq_id: s.batch_group for s in self.slots.values()}
            seq_id = pick_seq_id(free, held, batch_group)
            free.remove(seq_id)
            heapq.heapify(free)
        else:
            seq_id = heapq.heappop(free)
        slot = Slot(session_id=session_id, seq_id=seq_id, kv_budget=kv_budget,
                    batch_group=batch_group)
        slot.idle.set()
        self.slots[session_id] = slot
        self._held += 1
        return slot

    def lookup(self, session_id: str) -> Slot | None:
        """The open (not releasing) session with this id; None for anything else."""
        slot = self.slots.get(session_id) if isinstance(session_id, str) else None
        return None if slot is None or slot.releasing else slot

    def get(self, session_id: str, *, idle: bool = True) -> Slot:
        """The open session with this id (``idle``: one that runs no operation)."""
        slot = self.lookup(session_id)
        if slot is None:
            raise UnknownSession(f"session {session_id!r} is not open", session_id=session_id)
        if idle and slot.state is SessionState.RUNNING:
            raise SessionBusy(f"session {session_id!r} is running an operation", session_id=session_id)
        return slot

    def forget(self, slot: Slot) -> None:
        """Unknown from now on (its sequence id stays held until ``free``)."""
        if self.slots.get(slot.session_id) is slot:  # close_all may have cleared the table
            del self.slots[slot.session_id]

    def free(self, slot: Slot, *, cached: bool = False) -> None:
        """``slot`` holds its sequence id no more: free again (its KV cells are gone), or
        (``cached``) held by the prefix cache's entry that keeps its cells."""
        self._held -= 1
        if not cached:
            heapq.heappush(self._free, slot.seq_id)

    def take_free_above(self, seq_id: int) -> int | None:
        """Take the highest free id if it is above ``seq_id`` (None: no such id). Sessions
        take the lowest free ids, so what is stored at the highest stays out of their run."""
        free = self._free
        if not free or max(free) <= seq_id:
            return None
        top = max(free)
        free.remove(top)
        heapq.heapify(free)
        return top

    def free_id(self, seq_id: int) -> None:
        """A prefix cache entry's sequence id is free again (its cells are gone)."""
        heapq.heappush(self._free, seq_id)

    def running(self) -> int:
        return sum(1 for s in self.slots.values() if s.state is SessionState.RUNNING)

    def infos(self) -> tuple[SessionInfo, ...]:
        return tuple(slot.info() for slot in self.slots.values() if not slot.releasing)

    def stop_all(self) -> None:
        """Set every session's cancel flag (their running operations stop)."""
        for slot in self.slots.values():
            slot.cancel.set()

    async def close_all(self) -> None:
        """Stop every running operation, wait for each, and forget every session."""
        slots = list(self.slots.values())
        self.stop_all()
        for slot in slots:
            await slot.wait_idle()
        self.slots.clear()


_ids = itertools.count()


def new_session_id(prefix: str = "s") -> str:
    """A process-unique session id for callers that do not bring their own."""
    return f"{prefix}-{next(_ids)}"
