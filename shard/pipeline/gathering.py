"""Group steps in the client relay: the decodes a batch group's generations send one hop within
a tick, gathered into one ``GroupSteps`` message (protocol 1.3; docs/pipelines.md, "Group
steps").

Why: a hop serving a group of N generations otherwise reads N Decode messages and writes N
results per tick, a wake-up and a message each on both sides; gathered, it pays one. One
``Gatherer`` per (worker connection, batch group), its task owned by the pipeline's connection
nursery, collects the rows submitted by the group's members and sends them once every member of
its last two messages has submitted (or has a row queued at another hop: the two halves of a
split group would otherwise wait for each other), or ``MAX_GATHER_SECONDS`` after the first
row: a slow
member holds the others back at most that long (and only while it keeps coming), a lone one not
at all, and a member never waits for more than the one message its row rides in. Each
submitter gets its own session's outcome: a result, or the very ``ShardError`` its own stream
would have raised, so failover, replay and blame run as on the per-session path.
A worker that does not report ``group_steps`` is driven per session, as is a generation alone in
its group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from shard.client import ClientSession, GroupStream, ShardClient
from shard.rpc.errors import ErrorCode, ShardError
from shard.v1 import shard_pb2 as pb

__all__ = ["MAX_GATHER_SECONDS", "Gatherer", "HopGroups"]

log = logging.getLogger(__name__)

#: The longest the first row of a tick waits for the group's awaited members (seconds): the
#: members that rode in one of the gatherer's last two messages. Their rows came back from the
#: previous hop in one message, but the client handles each member's token in turn (a busy
#: client takes milliseconds for a group), and a message sent before the last member submitted
#: splits the group on every hop from then on, in smaller ticks; waiting for the members of
#: the last two messages merges such halves again (as a worker's scheduler waits for the
#: sessions of a group's last two ticks), and a member that stopped decoding (it verifies
#: drafts, it fails over) is no longer awaited after two messages without it.
MAX_GATHER_SECONDS = 0.02


@dataclass(eq=False)
class _Row:
    member: str  # the generation (one per pipeline: the same on every hop)
    session: ClientSession
    decode: pb.Decode
    done: trio.Event = field(default_factory=trio.Event)
    outcome: pb.StepResult | ShardError | None = None  # None once done: send it per session


class _Group:
    """What the gatherers of one batch group (one per hop) share: which members have a row
    queued where, so that none waits for a member queued at another (which may be waiting for
    one queued here: two halves of a group would each wait for the other)."""

    def __init__(self) -> None:
        self.gatherers: list[Gatherer] = []
        self.queued: dict[str, Gatherer] = {}

    def changed(self) -> None:
        for gatherer in self.gatherers:
            gatherer._wake()


class Gatherer:
    """One worker connection's rows of one batch group (see the module docs)."""

    def __init__(self, client: ShardClient, on_unsupported: Callable[[], None],
                 group: _Group | None = None) -> None:
        self._client = client
        self._on_unsupported = on_unsupported
        self._group = group if group is not None else _Group()
        self._group.gatherers.append(self)
        self._rows: list[_Row] = []
        self._changed = trio.Event()
        self.closed = False  # stopped: rows go per session
        self._sent = 0  # messages sent
        self._recent: dict[str, int] = {}  # member -> the last message it rode in

    def leave(self, member: str) -> None:
        """That member decodes no more here: no message waits for it."""
        self._recent.pop(member, None)
        self._wake()

    def _all_in(self) -> bool:
        """Every member of the last two messages has submitted its row here, or has one
        queued at another hop (waiting for it could wait for this very message)."""
        present = {row.member for row in self._rows}
        queued, since = self._group.queued, self._sent - 1
        return all(m in present or queued.get(m, self) is not self
                   for m, n in self._recent.items() if n >= since)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def submit(self, member: str, session: ClientSession, decode: pb.Decode
                     ) -> pb.StepResult | None:
        """``session``'s Decode (of generation ``member``) in the group's next message; its
        result, or its error raised;
        None when this gatherer has stopped (the worker takes no group steps, the connection
        is gone): the caller steps the session on its own stream. Cancelled before the
        message left, the row is dropped; after, the session's own reset (the caller's
        cleanup) fails it on the worker."""
        if self.closed:
            return None
        row = _Row(member, session, decode)
        self._rows.append(row)
        self._group.queued[member] = self
        self._group.changed()
        try:
            await row.done.wait()
        except BaseException:
            if row in self._rows:
                self._rows.remove(row)
                self._unqueue([row])
            raise
        if isinstance(row.outcome, ShardError):
            raise row.outcome
        return row.outcome

    async def run(self, closing: trio.Event) -> None:
        """Send the gathered rows, one message per tick, until ``closing`` (the pipeline's),
        the worker turns out not to take group steps, or the connection is gone."""
        try:
            async with trio.open_nursery() as nursery:
                async def stop() -> None:
                    await closing.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(stop)
                while self._client.connected:
                    while not self._rows:
                        await self._changed.wait()
                    try:
                        async with self._client.group_steps(timeout=None) as stream:
                            await self._serve(stream)
                    except ShardError as err:
                        if err.code is ErrorCode.UNSUPPORTED_FEATURE:
                            self._on_unsupported()
                            break  # (its rows are sent per session: see the finally)
                        self._fail_all(err)  # each session's own failure (failover runs)
                nursery.cancel_scope.cancel()
        finally:
            self.closed = True
            self._fail_all(None)

    async def _serve(self, stream: GroupStream) -> None:
        while True:
            while not self._rows:
                await self._changed.wait()
            with trio.move_on_after(MAX_GATHER_SECONDS):
                while not self._all_in():
                    await self._changed.wait()
            rows, self._rows = self._rows, []
            self._unqueue(rows)
            self._sent += 1
            recent = self._recent
            for row in rows:
                recent[row.member] = self._sent
            for sid in [sid for sid, n in recent.items() if n < self._sent - 1]:
                del recent[sid]  # (in neither of the last two messages)
            try:
                outcomes = await stream.step([(r.session, r.decode) for r in rows])
            except ShardError as err:
                for row in rows:
                    row.outcome = err
                    row.done.set()
                raise
            for row, outcome in zip(rows, outcomes, strict=True):
                row.outcome = outcome
                row.done.set()

    def _unqueue(self, rows: list[_Row]) -> None:
        queued = self._group.queued
        for row in rows:
            if queued.get(row.member) is self:
                del queued[row.member]
        self._group.changed()

    def _fail_all(self, err: ShardError | None) -> None:
        """End every waiting row with ``err`` (None: it is sent per session instead)."""
        rows, self._rows = self._rows, []
        self._unqueue(rows)
        for row in rows:
            row.outcome = err
            row.done.set()


class HopGroups:
    """A pipeline's gatherers, one per (worker connection, batch group), each started on first
    use in the pipeline's nursery (``spawn``) and stopped when it closes (``closing``)."""

    def __init__(self, spawn: Callable[..., None], closing: trio.Event,
                 running: Callable[[int], int]) -> None:
        self._spawn = spawn
        self._closing = closing
        self._running = running  # generations running in a group (``BatchGroups.running``)
        self._gatherers: dict[tuple[int, int], Gatherer] = {}
        self._groups: dict[int, _Group] = {}
        self._unsupported: set[int] = set()  # connections whose worker takes no group steps

    def gatherer(self, client: ShardClient, group: int) -> Gatherer | None:
        """The gatherer of ``client``'s rows of ``group`` (None: driven per session, as a
        generation alone in its group, or in none, and a worker without group steps are)."""
        if (not group or self._running(group) < 2 or id(client) in self._unsupported
                or self._closing.is_set()):
            return None
        key = (id(client), group)
        found = self._gatherers.get(key)
        if found is None:
            found = self._gatherers[key] = Gatherer(
                client, lambda: self._unsupported.add(id(client)),
                self._groups.setdefault(group, _Group()))
            self._spawn(self._run, key, found)
        return found

    async def _run(self, key: tuple[int, int], gatherer: Gatherer) -> None:
        try:
            await gatherer.run(self._closing)
        except Exception:  # a bug here must not end the pipeline: its rows go per session
            log.exception("a group-step gatherer failed")
        finally:
            if self._gatherers.get(key) is gatherer:
                del self._gatherers[key]
            shared = self._groups.get(key[1])
            if shared is not None:
                shared.gatherers.remove(gatherer)
                if not shared.gatherers:
                    del self._groups[key[1]]
