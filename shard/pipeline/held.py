"""The sessions one hop of a generation answers for, and giving them up so none is left behind.

A failed worker's session is reset (``RST_STREAM``) and, when its connection was lost (the
worker may be alive and would retain it), released through a new connection; a draining
worker's is closed on its stream. With chain relay a session also answers for the sessions its
route's later hops opened (named after it), which a lost upstream worker leaves retained. Every
cleanup runs in a task of the nursery the generation owns, bounded (``cleanup_deadline``).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import trio

from shard.client import ClientSession, ShardClient
from shard.deadlines import time_left
from shard.rpc.errors import ShardError
from shard.rpc.routes import relay_session_id

from .errors import STEP_DEADLINE
from .generation import Generation
from .replicas import HopReplicas, Replica

__all__ = ["HeldSession", "HeldSessions", "release_session"]

log = logging.getLogger(__name__)


@dataclass
class HeldSession:
    """A session a runner answers for (None: its open was started, outcome unknown), by its
    name; with chain relay, the replicas its route named (each may hold the session its worker
    opened, named after this one: ``relay_session_id``)."""

    replica: Replica
    name: str
    session: ClientSession | None = None
    downstream: list[Replica] = field(default_factory=list)
    moved: bool = False  # it took the history as a state moved from a draining worker

    def downstream_names(self) -> list[tuple[Replica, str]]:
        """Chain relay: each later hop's replica on the route and the name its session has
        there (every worker names the session it opens after its own)."""
        out, name = [], self.name
        for replica in self.downstream:
            name = relay_session_id(name)
            out.append((replica, name))
        return out


class HeldSessions:
    """Every session one hop's runner answers for now (the serving one, and those opened on a
    replacement whose outcome is not settled yet)."""

    def __init__(self, gen: Generation, replicas: HopReplicas) -> None:
        self._gen = gen
        self._replicas = replicas
        self._live: list[HeldSession] = []

    def __iter__(self) -> Iterator[HeldSession]:
        return iter(list(self._live))  # a copy: retiring while iterating is fine

    def add(self, held: HeldSession) -> None:
        self._live.append(held)

    def forget(self, held: HeldSession) -> None:
        """``held`` was closed: nothing is left to give up."""
        self._live.remove(held)

    def of(self, session: ClientSession | None) -> list[HeldSession]:
        return [h for h in self._live if h.session is session]

    def retire(
        self, held: HeldSession, *, graceful: bool = False, cause: ShardError | None = None
    ) -> None:
        """Give up a session: reset its stream now (the worker stops and releases) or, for a
        draining worker, close it on its stream; release it through a new connection if the
        old one was lost (a live worker would retain it), in a task the generation owns.

        With chain relay, also ``Release`` what the route's later hops may hold: a hop whose
        upstream worker was lost retains its session. From the failed hop on (``cause``'s
        ``relay_depth``; every later hop for the first hop's own failure), the failed one
        itself only if it was not hung: a stopped worker finds its stream reset when it runs
        again, and a Release would only wait for it."""
        if held in self._live:
            self._live.remove(held)
        if held.session is not None and not graceful:
            held.session.abort()
        self._gen.spawn(self._retire_task, held, graceful)
        if graceful:
            return
        failed = cause.relay_depth if cause is not None else 0
        hung = cause is not None and cause.reason == STEP_DEADLINE
        for depth, (replica, name) in enumerate(held.downstream_names(), start=1):
            if depth > failed or (depth == failed and not hung):
                self._gen.spawn(self._release_task, replica, name)

    def abort(self) -> None:
        """Reset every stream held now (sync: the workers stop and release)."""
        for held in self._live:
            if held.session is not None:
                held.session.abort()

    async def release(self) -> None:
        """``Release`` on every replica where a session may be held (never raises; the caller
        bounds and shields it)."""
        async with trio.open_nursery() as nursery:
            for held in self._live:
                nursery.start_soon(self._gen.release, held.replica, held.name)
                # a worker lost mid-chain leaves the next one retaining its session
                for replica, name in held.downstream_names():
                    nursery.start_soon(self._gen.release, replica, name)

    async def _release_task(self, replica: Replica, name: str) -> None:
        with trio.CancelScope(shield=True, deadline=self._gen.cleanup_deadline()):
            await self._gen.release(replica, name)

    async def _retire_task(self, held: HeldSession, graceful: bool) -> None:
        with trio.CancelScope(shield=True, deadline=self._gen.cleanup_deadline()):
            if graceful and held.session is not None:
                try:
                    await held.session.close()
                    return
                except ShardError as err:
                    log.info("%s: closing the session on %s failed: %s",
                             self._replicas.hop(held.replica), held.replica.target, err)
                    held.session.abort()
            client = held.replica.client
            if client is None or not client.connected:
                await self._gen.release(held.replica, held.name)


async def release_session(
    replica: Replica, name: str, *, ssl_context: ssl.SSLContext | None,
    metadata: Sequence[tuple[str, str | bytes]],
) -> None:
    """``Release`` session ``name`` on ``replica`` within the enclosing scope's deadline; never
    raises. Through a new connection where the old one was lost: a live worker retains a
    session whose connection dropped (for resume), and nobody would resume it. Not on a
    connection the worker sent GOAWAY on (it refuses new calls there and its listener is
    closed): the stream reset already released the session."""
    client = replica.client
    try:
        if client is not None and client.connected:
            if client.going_away:
                return
            try:
                await client.release(name, timeout=time_left(trio.current_effective_deadline()))
                return
            except ShardError:
                if client.connected:
                    raise
        async with ShardClient.connect(
            replica.target, timeout=time_left(trio.current_effective_deadline()),
            ssl_context=ssl_context, metadata=metadata,
        ) as fresh:
            await fresh.release(name)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the cleanup goes on
        gone = isinstance(exc, ShardError) and exc.reason == "CONNECT_FAILED"
        # a worker that refuses connections is gone: it freed the session with its process
        log.log(logging.INFO if gone else logging.WARNING, "%s: release of %s failed: %s",
                replica.target, name, exc)
