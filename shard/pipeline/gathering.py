"""Group steps in the client relay: the decodes a batch group's generations send one hop within
a tick, gathered into one ``GroupSteps`` message (protocol 1.3; docs/pipelines.md, "Group
steps").

Why: a hop serving a group of N generations otherwise reads N Decode messages and writes N
results per tick, a wake-up and a message each on both sides; gathered, it pays one. One
``Gatherer`` per (worker connection, batch group), its task owned by the pipeline's connection
nursery, collects the rows submitted by the group's running members and sends them once every
member has submitted, or half the group's last round trip after the first row (within
``GATHER_SECONDS`` and ``MAX_GATHER_SECONDS``): a lone or slow member holds the others back at
most that long, and a member never waits for more than the one message its row rides in. Each submitter gets its own session's outcome: a result, or the very ``ShardError`` its
own stream would have raised, so failover, replay and blame run as on the per-session path.
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

__all__ = ["GATHER_SECONDS", "MAX_GATHER_SECONDS", "Gatherer", "HopGroups"]

log = logging.getLogger(__name__)

#: How long the first row of a tick waits for the group's other members (seconds): half the
#: group's last round trip (flush to flush), within these bounds. Their rows came back from the
#: previous hop in one message, but the client handles each member's token in turn (a busy
#: client takes milliseconds for a group), and a message sent before the last member submitted
#: splits the group on every hop from then on, in smaller ticks.
GATHER_SECONDS = 0.002
MAX_GATHER_SECONDS = 0.02


@dataclass(eq=False)
class _Row:
    session: ClientSession
    decode: pb.Decode
    done: trio.Event = field(default_factory=trio.Event)
    outcome: pb.StepResult | ShardError | None = None  # None once done: send it per session


class Gatherer:
    """One worker connection's rows of one batch group (see the module docs)."""

    def __init__(self, client: ShardClient, on_unsupported: Callable[[], None]) -> None:
        self._client = client
        self._on_unsupported = on_unsupported
        self.members = 0  # runners of the group decoding on this connection
        self._rows: list[_Row] = []
        self._changed = trio.Event()
        self.closed = False  # stopped: rows go per session
        self._flushed: float | None = None  # when the last message left (trio clock)
        self._cycle = 0.0  # the time between the last two

    def join(self) -> None:
        self.members += 1

    def leave(self) -> None:
        self.members -= 1
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def submit(self, session: ClientSession, decode: pb.Decode) -> pb.StepResult | None:
        """``session``'s Decode in the group's next message; its result, or its error raised;
        None when this gatherer has stopped (the worker takes no group steps, the connection
        is gone): the caller steps the session on its own stream. Cancelled before the
        message left, the row is dropped; after, the session's own reset (the caller's
        cleanup) fails it on the worker."""
        if self.closed:
            return None
        row = _Row(session, decode)
        self._rows.append(row)
        self._wake()
        try:
            await row.done.wait()
        except BaseException:
            if row in self._rows:
                self._rows.remove(row)
                self._wake()
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
            wait = min(max(GATHER_SECONDS, self._cycle / 2), MAX_GATHER_SECONDS)
            with trio.move_on_after(wait):
                while len(self._rows) < self.members:
                    await self._changed.wait()
            rows, self._rows = self._rows, []
            now = trio.current_time()
            if self._flushed is not None:
                self._cycle = now - self._flushed
            self._flushed = now
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

    def _fail_all(self, err: ShardError | None) -> None:
        """End every waiting row with ``err`` (None: it is sent per session instead)."""
        rows, self._rows = self._rows, []
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
            found = self._gatherers[key] = Gatherer(client, lambda: self._unsupported.add(id(client)))
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
