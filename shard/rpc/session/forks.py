"""Which live session an ``OpenSession.fork_of`` may copy: its own caller's, idle, and of the
same kind (routed or not).

Why so strict: a fork holds a copy of the source's history, the prompt and every answer so
far. A session id is no secret (a client chooses it, a log shows it), so the source must have
been opened by the same caller: the same authenticated principal (``shard.rpc.auth``; "" for
everyone without an authenticator), from the same host. Anything else is answered as an unknown
id would be, so a caller cannot learn which ids another caller holds.
"""

from __future__ import annotations

import contextvars
from typing import Protocol

from shard.v1 import shard_pb2 as pb

from .. import convert
from ..errors import ErrorCode, ShardError
from ..lifecycle import principal
from ..positions import Positions
from ..transport import current_call


class ForkSource(Protocol):
    """What a fork reads of its source's stream (``SessionCall``)."""

    @property
    def session_id(self) -> str: ...

    @property
    def positions(self) -> Positions: ...

    @property
    def caller(self) -> tuple[str, str]: ...

    @property
    def forkable(self) -> bool: ...

    routed: object | None


class ForkHost(Protocol):
    """The stream that opens the fork: its registry finds the source."""

    _registry: object

    @property
    def caller(self) -> tuple[str, str]: ...


def caller_of(context: contextvars.Context) -> tuple[str, str]:
    """(principal, host) of the call whose context this is."""
    call = context.run(_call_or_none)
    peer = "" if call is None else call.peer
    return context.get(principal, ""), peer.rsplit(":", 1)[0]


def _call_or_none() -> object | None:
    try:
        return current_call()
    except LookupError:  # no transport (tests driving the registry directly)
        return None


def fork_source(host: ForkHost, req: pb.OpenSession, routed: bool) -> ForkSource:
    """The live session ``req.fork_of`` names, checked (see the module docstring)."""
    sid, source_id = req.session_id, req.fork_of
    if req.HasField("cache"):
        raise convert.invalid("fork_of and cache exclude each other (a fork is never resumed)", sid)
    if source_id == sid:
        raise convert.invalid("a session cannot be a fork of itself", sid)
    source = host._registry.live(source_id)  # type: ignore[attr-defined]
    if source is None or source.caller != host.caller:
        raise ShardError(ErrorCode.SESSION_NOT_FOUND,
                         "fork_of names no live session of this caller on this worker",
                         session_id=sid)
    if not source.forkable:
        raise ShardError(ErrorCode.SESSION_BUSY,
                         "the session fork_of names is running a step or closing",
                         session_id=sid)
    if (source.routed is not None) != routed:
        raise convert.invalid("a fork has a route exactly when the session it copies has one", sid)
    return source


__all__ = ["ForkSource", "caller_of", "fork_source"]
