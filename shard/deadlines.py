"""Deadlines as both sides of a chain carry them: absolute Trio times, and what each hop is given.

A leaf module: the worker's relay (``shard.relay``) and the client pipeline
(``shard.pipeline``) both turn one caller's deadline into the ``grpc-timeout`` of the hops after
it, and must round the same way, so neither imports the other for it.

Why round *down*: the transport rounds a timeout up to what ``grpc-timeout`` can carry, so a hop
given exactly the time left could end after the caller. Each hop's deadline falls strictly before
the one above it.
"""

from __future__ import annotations

import math

import trio

__all__ = [
    "HOP_DEADLINE_MARGIN",
    "RELAY_DEADLINE_MARGIN",
    "absolute_deadline",
    "bounded",
    "hop_timeout",
    "time_left",
]

#: Hop streams get the time left minus this, rounded down, as their timeout, so that a hop's
#: deadline is never after its caller's although it is computed a moment later.
HOP_DEADLINE_MARGIN = 0.001
#: A chain relay's hops: each worker gives its next hop this much less time than it has, so
#: that when the deadline passes the deepest hop still working ends first and its error (naming
#: it) travels up the chain before the hops above it reach their own deadlines.
RELAY_DEADLINE_MARGIN = 0.05


def absolute_deadline(timeout: float | None) -> float:
    """The Trio time ``timeout`` seconds from now (``inf`` for None)."""
    return math.inf if timeout is None else trio.current_time() + timeout


def time_left(deadline: float) -> float | None:
    """Seconds until ``deadline`` (None for none), for a call's ``timeout``."""
    return None if math.isinf(deadline) else deadline - trio.current_time()


def bounded(deadline: float, cap: float) -> float:
    """A call's timeout: at most ``cap`` seconds, and never past ``deadline`` (0 once it
    passed)."""
    left = time_left(deadline)
    return cap if left is None else max(0.0, min(cap, left))


def hop_timeout(deadline: float, margin: float = HOP_DEADLINE_MARGIN) -> float | None:
    """A hop stream's timeout: the time left until ``deadline`` less ``margin``, rounded *down*
    to what ``grpc-timeout`` carries (whole seconds from 99 s, microseconds below)."""
    left = time_left(deadline)
    if left is None:
        return None
    left -= margin
    if left >= 99:
        return float(math.floor(left))
    return math.floor(left * 1e6) / 1e6
