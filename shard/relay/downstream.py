"""A routed session's next hop, as the relaying worker drives it; and a last hop's return pusher.

``NextHop`` wraps the session this worker opened on the next hop (a ``ClientSession`` on a
pooled connection, held by a task of the upstream stream's nursery: the downstream lives exactly
as long as the upstream stream). Every error it raises is the next hop's, named structurally
(``ShardError.one_hop_up``: one hop deeper, with the range the route gave that hop), never by
the address a caller put in the route. With a step timeout on the route (``Route.step_timeout_ms``)
it waits at most that many milliseconds per hop still ahead for an answer; past that the hop
counts as hung: its stream is reset and the step fails DEADLINE_EXCEEDED (``STEP_DEADLINE``)
naming it.

``ReturnPusher``: a last hop's direct return (``Returner``) hands each tagged result to the
route's first hop with the ``Return`` RPC over a pooled connection. Never in the step's way:
results wait in a small queue, a full queue drops one, and a return address that cannot be
reached is logged once and then ignored (the chain's answers carry every result anyway).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import numpy as np
import trio

from shard.client import ClientSession, ShardClient
from shard.deadlines import bounded
from shard.v1 import shard_pb2 as pb

from shard.rpc.errors import ErrorCode, ShardError
from shard.rpc.routes import hop_label
from .peers import PeerPool
from .policy import Peer

__all__ = ["CLOSE_TIMEOUT", "RELAY_CALL_TIMEOUT", "STEP_DEADLINE", "NextHop", "ReturnPusher"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Seconds a relay's own unary calls (GetCapabilities, a forwarded Cancel, a Return) and its
#: TCP/TLS connect may take at most (and never past the session's deadline).
RELAY_CALL_TIMEOUT = 10.0
#: How long a graceful downstream close may take before the stream is reset instead.
CLOSE_TIMEOUT = 2.0
#: ``ShardError.reason`` of a step a hop did not answer within its step timeout.
STEP_DEADLINE = "STEP_DEADLINE"


class NextHop:
    """The session on a routed session's next hop (see the module docstring)."""

    def __init__(
        self, *, layers: tuple[int, int], caps: pb.GetCapabilitiesResponse, client: ShardClient,
        session: ClientSession, nursery: trio.Nursery, pipelined: bool,
        answer_timeout: float | None,
    ) -> None:
        self.layers = layers
        self.kv_capacity = session.opened.kv_capacity
        #: It took the route's return address (reports relay_return): its session queues one
        #: step behind the running one, so steps may be sent ahead of the previous answer.
        self.pipelined = pipelined
        self.rewinds = caps.session_rewind  # it takes Rewind
        #: It has a prefix cache: positions this worker took from its own may go to it as ids
        #: only (a worker without one, or older than the field, would misplace the rows).
        self.caches = caps.prefix_cache_tokens > 0
        #: How many leading ids of the probe it was opened with the route from it on holds
        #: (``SessionOpened.prefix_cached_tokens``); None: it is older than the probe and has
        #: a cache, so nobody knows.
        self.prefix_held: int | None = (
            session.opened.prefix_cached_tokens if caps.prefix_cache_limit
            else None if self.caches else 0)
        self._client = client
        self._session = session
        self._nursery = nursery
        self._answer_timeout = answer_timeout
        self.busy = 0  # steps sent and not answered
        self.done = trio.Event()  # the holder task may end (closed or reset)
        # Cancels forwarded and not answered yet: no new request goes out before they are (a
        # Cancel that arrived after its step ended would stop the next one instead).
        self._cancelling = 0
        self._cancels_done = trio.Event()
        self._cancels_done.set()

    @property
    def label(self) -> str:
        return hop_label(1, self.layers)

    def named(self, err: ShardError) -> ShardError:
        """``err``, raised by this hop's session, as this worker reports it."""
        return err.one_hop_up(self.layers)

    # ---- steps ----------------------------------------------------------------------------

    async def prefill(
        self, rows: np.ndarray, first: int, sampling: pb.SamplingParams, top_logprobs: int,
        all_logits: bool = False, token_ids: Sequence[int] | None = None,
        cache_limit: int | None = None,
    ) -> pb.StepResult:
        """Rows written at ``first`` (whatever the hop holds from there is dropped), with the
        token ids they stand for (``Prefill.token_ids``) when known; ``cache_limit``: the
        route's (``Prefill.cache_limit``), which holds every hop but the last to it."""
        return await self._answer(lambda: self._session.prefill(
            hidden_states=rows, position=first, sampling=sampling, top_logprobs=top_logprobs,
            all_logits=all_logits, token_ids=token_ids, cache_limit=cache_limit))

    async def decode(
        self, row: np.ndarray, sampling: pb.SamplingParams, top_logprobs: int, relay_tag: int = 0,
        token_id: int | None = None,
    ) -> pb.StepResult:
        """One row appended at the hop's end."""
        return await self._answer(lambda: self._session.decode(
            hidden_state=row, sampling=sampling, top_logprobs=top_logprobs, relay_tag=relay_tag,
            token_id=token_id))

    async def send_decode(
        self, row: np.ndarray, sampling: pb.SamplingParams, top_logprobs: int, relay_tag: int,
        token_id: int | None = None,
    ) -> None:
        """A Decode sent without waiting for its answer (``read_answer``; at most two
        unanswered: the hop queues one behind the running one)."""
        await self._after_cancels()
        try:
            await self._session.send_ahead(hidden_state=row, sampling=sampling,
                                           top_logprobs=top_logprobs, relay_tag=relay_tag,
                                           token_id=token_id)
        except ShardError as err:
            raise self.named(err) from None
        self.busy += 1

    async def read_answer(self) -> pb.StepResult:
        """The answer to the oldest unanswered ``send_decode`` (raises its step error)."""
        try:
            with self._timed():
                return await self._session.read_ahead()
        except ShardError as err:
            raise self.named(err) from None
        finally:
            self.busy -= 1

    async def rewind(self, keep: int) -> int:
        """Drop the hop's positions from ``keep`` on; what it holds afterwards."""
        return await self._answer_value(lambda: self._session.rewind(keep))

    async def _answer(self, call: Callable[[], Awaitable[pb.StepResult]]) -> pb.StepResult:
        return await self._answer_value(call)

    async def _answer_value(self, call: Callable[[], Awaitable[T]]) -> T:
        await self._after_cancels()
        self.busy += 1
        try:
            with self._timed():
                return await call()
        except ShardError as err:
            raise self.named(err) from None
        finally:
            self.busy -= 1

    @contextmanager
    def _timed(self) -> Iterator[None]:
        """No answer within the answer timeout: the hop is hung; reset its stream (it can no
        longer be trusted to answer in order) and say so, naming it."""
        if self._answer_timeout is None:
            yield
            return
        with trio.move_on_after(self._answer_timeout) as scope:
            yield
        if scope.cancelled_caught:
            self.abort()
            raise ShardError(
                ErrorCode.DEADLINE_EXCEEDED,
                f"no answer within {self._answer_timeout:g} s (the route's step timeout for the "
                "hops from there on): the hop may be hung", reason=STEP_DEADLINE)

    # ---- state ----------------------------------------------------------------------------

    def alive(self) -> bool:
        return self._session.alive

    def held(self) -> int | None:
        """Positions the hop holds after its last request (None: its stream ended, or a 1.0
        hop that does not say)."""
        if not self._session.alive or self._session.opened.version.minor < 1:
            return None
        return int(self._session.usage.n_past)

    def cancel(self) -> None:
        """Forward a Cancel (out-of-band) if a step is in flight; sync, never raises."""
        if self.busy and self._session.alive:
            self._cancelling += 1
            self._cancels_done = trio.Event()
            self._nursery.start_soon(self._forward_cancel)

    async def _forward_cancel(self) -> None:
        try:
            await self._client.cancel(self._session.session_id, timeout=RELAY_CALL_TIMEOUT)
        except ShardError as err:  # the step goes on or fails by itself; log why
            log.info("%s: forwarding Cancel failed: %s", self.label, err)
        finally:
            self._cancelling -= 1
            if not self._cancelling:
                self._cancels_done.set()

    async def _after_cancels(self) -> None:
        """Wait until every Cancel forwarded was answered (each is bounded)."""
        if self._cancelling:
            await self._cancels_done.wait()

    async def close(self) -> None:
        """Close the session gracefully (released); never raises."""
        try:
            if self._session.alive:
                with trio.move_on_after(CLOSE_TIMEOUT):
                    await self._session.close()
        except ShardError as err:
            log.info("%s: closing the downstream session failed: %s", self.label, err)
        finally:
            self.abort()

    def abort(self) -> None:
        """Reset the stream now (the next worker releases its session); idempotent."""
        self._session.abort()  # a no-op on the wire once the stream ended
        self.done.set()


class ReturnPusher:
    """A last hop's direct return (see the module docstring)."""

    #: Results waiting to be handed over (each Return waits for its answer, one at a time).
    QUEUE = 4

    def __init__(self, address: pb.ReturnAddress, peer: Peer, pool: PeerPool, deadline: float) -> None:
        self.address = address
        self._peer = peer
        self._pool = pool
        self._deadline = deadline
        self._send, self._recv = trio.open_memory_channel[tuple[int, pb.StepResult]](self.QUEUE)
        self.pushed = self.dropped = 0
        self._scope = trio.CancelScope()

    def push(self, tag: int, step: pb.StepResult) -> None:
        try:
            self._send.send_nowait((tag, step))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self.dropped += 1

    def close(self) -> None:
        self._send.close()
        self._scope.cancel()  # a connect or a Return in flight is of no use any more

    async def run(self) -> None:
        """Push until the session closes (``close``) or its stream ends."""
        with self._scope:
            await self._push_all()

    async def _push_all(self) -> None:
        try:
            async with self._pool.lease(self._peer, deadline=self._deadline) as conn, self._recv:
                client = conn.client
                assert client is not None
                async for tag, step in self._recv:
                    await client.return_step(self.address, tag, step,
                                             timeout=bounded(self._deadline, RELAY_CALL_TIMEOUT))
                    self.pushed += 1
        except ShardError as err:
            log.info("direct return to %s stopped (results go up the chain): %s",
                     self._peer.target, err)
        finally:
            self._send.close()  # later pushes are dropped
