"""The seams of a session stream: what it needs from the table of sessions it lives in
(``SessionHost``), what a step's implementation may use of it (``StepHost``) and the chain
relay that plugs in (``Relay``/``Routed``/``Returner``, implemented by ``shard.relay``).

Why protocols: the registry creates calls and the relay serves their routed steps, so neither
may be imported back by the session (one-way dependencies), and tests can host a call in
something smaller.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar

import numpy as np
import trio
from trio_util import AsyncValue

from shard.engine import (
    Capabilities,
    DecodeRequest,
    PrefillRequest,
    SamplingParams,
    ShardEngine,
    StepResult,
)
from shard.v1 import shard_pb2 as pb

from ..errors import ErrorCode, ShardError
from ..positions import Positions

if TYPE_CHECKING:
    from .inputs import PrefillInput


R = TypeVar("R", PrefillRequest, DecodeRequest)


@dataclass(frozen=True)
class Retained:
    """A session whose stream ended but whose KV cache is kept for resume."""

    session_id: str
    expires_at: float  # trio.current_time() based
    end: int  # positions the client may resume from (what it was sent)
    engine_len: int  # positions the engine holds (>= end)
    kv_capacity: int


class SessionHost(Protocol):
    """What a ``SessionCall`` needs from the table of sessions it lives in (the ``Registry``).

    Why a protocol: the registry creates and owns calls, so the call must not import it back;
    tests can also host a call in something smaller.
    """

    draining: bool

    def claim(self, session_id: str, call: Any, *, resuming: bool) -> Retained | None: ...

    def unclaim(self, session_id: str, call: Any) -> None: ...

    def retain(self, session_id: str, *, end: int, engine_len: int, kv_capacity: int) -> bool: ...

    async def release_owned(self, session_id: str) -> None: ...

    async def evict_one(self) -> bool: ...

    def count(self, name: str, n: int = 1) -> None: ...

    def count_error(self, code: ErrorCode) -> None: ...


NOT_ALLOWED = (
    "this worker does not relay: its operator did not allow relay (start it with "
    "`trio-shard serve --allow-relay`); use client relay instead"
)


def return_refused(session_id: str = "") -> ShardError:
    """The one answer to a ``Return`` that no routed session takes (no such session, or not
    with that secret): one message for both, so it tells nothing about which sessions exist."""
    return ShardError(ErrorCode.PERMISSION_DENIED,
                      "Return: no routed session of this worker has that return address",
                      session_id=session_id, reason="RETURN_REFUSED")


class StepHost(Protocol):
    """The step API of a session stream: what a step's implementation (the plain steps here,
    a routed session's in ``shard.relay``) may use of its session. ``SessionCall`` is one."""

    session_id: str
    positions: Positions
    credit: AsyncValue[int]

    @property
    def engine(self) -> ShardEngine: ...

    @property
    def caps(self) -> Capabilities: ...

    @property
    def kv_capacity(self) -> int: ...

    @property
    def wire_dtype(self) -> str: ...

    @property
    def batch_group(self) -> int: ...

    @property
    def deadline(self) -> float: ...

    def cancellable(self) -> contextlib.AbstractContextManager[None]: ...

    async def take_credit(self) -> None: ...

    async def engine_call(self, fn: Callable[[R], Awaitable[StepResult]], request: R) -> StepResult: ...

    async def prefill_input(self, p: pb.Prefill) -> PrefillInput: ...

    async def first_chunk(self, inp: PrefillInput, result: StepResult) -> None: ...

    def decode_input(
        self, d: pb.Decode
    ) -> tuple[SamplingParams, int | None, np.ndarray | None, int | None]: ...

    async def generate_input(self, g: pb.Generate) -> tuple[SamplingParams, tuple[int, ...] | None]: ...

    def rewind_position(self, r: pb.Rewind) -> int: ...

    async def truncate_engine(self, keep: int) -> None: ...

    async def send_result(self, msg: pb.StepResult, *, usage_follows: bool = False) -> None: ...

    async def end_with(self, err: ShardError) -> NoReturn: ...


class Routed(Protocol):
    """This worker's side of a routed session (chain relay), opened by ``Relay.open``:
    ``shard.relay.RoutedSession``."""

    #: The session's positions, the next hop's included (the stream reads ``end``).
    positions: Positions
    #: The least KV capacity of the chain from this worker on.
    kv_capacity: int
    #: How many leading ids of ``OpenSession.prefix_probe`` the route from the next hop on
    #: holds in its prefix caches (None: unknown, a next hop older than the probe).
    prefix_held: int | None

    async def step(self, req: pb.SessionRequest, usage: pb.Usage) -> None:
        """Run one Prefill/Decode/Generate/Rewind through the chain (results sent with the
        host's ``send_result``); a step-level failure raises its ``ShardError``."""
        ...

    async def settle(self) -> None:
        """After every request, failed ones included: bring this worker and its next hop to
        the same positions (the ledger's one rule); raises a fatal error if it cannot."""
        ...

    def cancel(self) -> None:
        """A Cancel of the running step: forward it to the next hop (sync, never raises)."""
        ...

    def deadline_error(self) -> ShardError | None:
        """The error for the call deadline passing now: naming the next hop when a step was
        waiting for its answer, else None (the deadline is this worker's)."""
        ...

    def offer_return(self, secret: bytes, tag: int, step: pb.StepResult) -> bool:
        """A ``Return`` for this session (direct return): True if a step used it; raises
        ``return_refused`` for a wrong secret or a session that takes none."""
        ...

    async def close(self) -> None:
        """Close the downstream session gracefully (released); never raises."""
        ...

    def abort(self) -> None:
        """Reset the downstream stream now (the next worker releases its session)."""
        ...


class Returner(Protocol):
    """A last hop's sender of tagged results to the route's return address."""

    def push(self, tag: int, step: pb.StepResult) -> None:
        """Hand one result over, never blocking the step (a full queue drops it: the chain's
        own answer still carries it)."""
        ...

    def close(self) -> None:
        """No more results: the pusher's task ends (sync, idempotent)."""
        ...


class Relay(Protocol):
    """Opens the routed side of sessions (``serve(relay=...)``: ``shard.relay.ChainRelay``).
    Without one a route is refused with PERMISSION_DENIED, so no worker becomes an open relay."""

    def check(self, req: pb.OpenSession, caps: Capabilities, sid: str) -> None:
        """Refuse, before any session is claimed, a route or return address this worker will
        not serve (synchronous checks; where it may connect is checked by ``open``)."""
        ...

    async def open(self, host: StepHost, req: pb.OpenSession, *, nursery: trio.Nursery) -> Routed:
        """Open the next hop of ``req.route`` (held by a task in ``nursery``, the stream's)."""
        ...

    async def open_return(
        self, address: pb.ReturnAddress, *, deadline: float, nursery: trio.Nursery
    ) -> Returner:
        """A last hop's pusher to ``address`` (held by a task in ``nursery``)."""
        ...

    async def run(self, local: str, *, task_status: trio.TaskStatus[None]) -> None:
        """Own the relay's connections until cancelled (``serve`` starts it once bound);
        ``local``: the worker's bound HOST:PORT."""
        ...
