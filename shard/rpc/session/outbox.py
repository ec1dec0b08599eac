"""Where a session's responses go: numbered, chunked, and handed to the transport.

Responses leave through a bounded memory channel (capacity ``max_credit`` + a few control
messages) that the stream's handler forwards to the transport, or, while that handler waits on
an empty channel, straight to the transport from the session's own task (``DirectPath``).
A boundary result larger than one message is sent as several ``StepResult`` chunks
(``more_chunks``) for one credit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import trio

from shard.v1 import shard_pb2 as pb

from .credit import Credit

# Room left in each message for everything but the hidden-state rows (step fields, framing).
CHUNK_OVERHEAD = 4096


class DirectPath(Protocol):
    """The transport's way for a response to leave from the producing task (the handler
    registers one with ``Responses.send_directly``)."""

    def send_now(self, msg: pb.SessionResponse, more_follows: bool) -> bool:
        """Frame ``msg`` now if that needs no wait; False: nothing was sent."""
        ...


class Responses:
    """A session's responses: a bounded channel its handler forwards to the transport, or,
    while that handler waits on an empty channel (``next_response``), straight to the
    transport from the session's own task (the handler's ``DirectPath``).

    Why: a token that travels session task -> channel -> handler task -> transport costs a
    task step and a scheduler pass more than one framed by the task that produced it. The
    channel stays the bound and the path for anything that must wait (no window, a slow
    reader): the direct path refuses those, and once a response went through the channel,
    every later one follows it there until the handler has forwarded them all (order is
    kept)."""

    def __init__(self, size: int) -> None:
        self._send, self.receive = trio.open_memory_channel[pb.SessionResponse](size)
        self._direct: DirectPath | None = None
        self._idle = False  # the handler waits on an empty channel, holding nothing
        self.through_handler = False  # every response takes the channel (a slower path)

    def send_directly(self, direct: DirectPath | None) -> None:
        """The handler's direct path to the transport (None: none)."""
        self._direct = direct

    @property
    def idle(self) -> bool:
        """The handler waits on an empty channel (``next_response``), holding nothing."""
        return self._idle

    async def next_response(self) -> pb.SessionResponse | None:
        """The handler's next response to forward (None once the last was sent); one already
        queued is taken without a scheduler pass.

        Why: a step's result and its ``Usage`` are queued together (``Outbox.respond``); taken
        one scheduler pass apart, the transport's writer would send each in a socket write of
        its own (and wake the client twice). While this waits on an empty channel, the
        session's task frames its responses itself (the direct path)."""
        receive = self.receive
        try:
            return receive.receive_nowait()
        except trio.WouldBlock:
            pass
        except trio.EndOfChannel:
            return None
        self._idle = True
        try:
            return await receive.receive()
        except trio.EndOfChannel:
            return None
        finally:
            self._idle = False

    def statistics(self) -> Any:
        return self._send.statistics()

    def _sent_directly(self, msg: pb.SessionResponse, more_follows: bool) -> bool:
        direct = self._direct
        return (self._idle and direct is not None and not self.through_handler
                and direct.send_now(msg, more_follows))

    def send_nowait(self, msg: pb.SessionResponse, *, more_follows: bool = False) -> None:
        """``more_follows``: another response follows in this task step (they are written
        together)."""
        if not self._sent_directly(msg, more_follows):
            self._idle = False
            self._send.send_nowait(msg)

    async def send(self, msg: pb.SessionResponse) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()  # a cancel point, as the channel is
        if self._sent_directly(msg, False):
            await trio.lowlevel.cancel_shielded_checkpoint()  # and a scheduler pass
        else:
            self._idle = False
            await self._send.send(msg)

    def close(self) -> None:
        self._send.close()


class Outbox(Responses):
    """A session stream's ``Responses`` with its numbering (``StepResult.step``) and chunking:
    each result spends the credit its step took (``Credit``), however it is sent."""

    def __init__(
        self, size: int, *, max_message_bytes: int, credit: Credit,
        count: Callable[[str], None], lost: Callable[[], None],
    ) -> None:
        super().__init__(size)
        self.step_no = 0  # the last result's number
        self.max_message_bytes = max_message_bytes
        self._credit = credit
        self._count = count
        self._lost = lost  # the stream's end(CONNECTION_LOST)

    def next_result(self) -> int:
        """Number the next result and spend its credit (spent now, even if the stream ends
        during the send)."""
        self._credit.spend()
        self.step_no += 1
        return self.step_no

    async def respond(
        self, msg: pb.SessionResponse, *, more_follows: bool = False, now: bool = False
    ) -> None:
        """Hand a response to the transport; blocks while the bounded channel is full.

        ``more_follows``: this task sends another response right after this one (a step's
        result, then its ``Usage``). It is queued without a scheduler pass when there is room,
        so the transport finds both and frames them into one socket write (the next send is
        the schedule point). ``send_nowait`` is no cancel point: a result may be queued just
        after the stream ended, and is then counted as delivered, as ``send_step`` does for
        any result handed over. ``now``: queued so too (the caller's next await is a scheduler
        pass anyway), though nothing follows."""
        try:
            if more_follows or now:
                try:
                    self.send_nowait(msg, more_follows=more_follows)
                    return
                except trio.WouldBlock:
                    pass
            await self.send(msg)
        except trio.BrokenResourceError:
            # The handler stopped reading without telling us why: the connection is gone.
            self._lost()
            await trio.lowlevel.checkpoint()  # raises Cancelled: our scope was just cancelled

    async def send_numbered(self, msg: pb.StepResult, usage_follows: bool, now: bool = False) -> None:
        """Send one result (one credit) as the session's next step, in chunks if it exceeds
        one message. ``usage_follows``: the step's ``Usage`` comes next (see ``respond``)."""
        msg.step = self.next_result()
        for chunk in chunks(msg, self.max_message_bytes - CHUNK_OVERHEAD):
            # only the last chunk: chunks are far larger than one write, and each waits its turn
            await self.respond(pb.SessionResponse(step=chunk),
                               more_follows=usage_follows and not chunk.more_chunks, now=now)
        self._count("steps_sent_total")


def chunks(msg: pb.StepResult, budget: int) -> Iterator[pb.StepResult]:
    """Split a boundary result over several messages of at most ``budget`` bytes each.

    Every chunk repeats the step's fields and carries consecutive rows of ``hidden_states``;
    ``more_chunks`` is set on all but the last, so an unsplit result looks exactly as before.
    """
    if msg.WhichOneof("output") != "hidden_states" or msg.ByteSize() <= budget:
        yield msg
        return
    tensor = msg.hidden_states
    n_rows = tensor.shape[0]
    row_bytes = len(tensor.data) // max(n_rows, 1)
    per_chunk = max(1, budget // max(row_bytes, 1))
    head = pb.StepResult()
    head.CopyFrom(msg)
    head.ClearField("hidden_states")
    for first in range(0, n_rows, per_chunk):
        rows = min(per_chunk, n_rows - first)
        chunk = pb.StepResult()
        chunk.CopyFrom(head)
        chunk.hidden_states.dtype = tensor.dtype
        chunk.hidden_states.shape.extend([rows, *tensor.shape[1:]])
        chunk.hidden_states.data = tensor.data[first * row_bytes : (first + rows) * row_bytes]
        chunk.more_chunks = first + rows < n_rows
        yield chunk
