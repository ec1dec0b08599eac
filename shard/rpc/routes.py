"""Chain relay's naming rules, shared by the worker that relays and the client that routes.

Both sides must agree on how a routed session's downstream sessions are named (a client releases
them by name after a failure) and how many hops a route may name; neither side imports the
other for it.
"""

from __future__ import annotations

__all__ = ["MAX_ROUTE_HOPS", "RELAY_SUFFIX", "hop_label", "relay_session_id"]

#: Most hops a route may name (a bound on what one OpenSession can make workers open).
MAX_ROUTE_HOPS = 64
#: Appended to a session id to name the session a worker opens downstream (``p-1.0`` on the
#: first hop -> ``p-1.0>`` on the second -> ``p-1.0>>`` ...): deterministic, so a client can
#: name (and release) every hop's session.
RELAY_SUFFIX = ">"


def relay_session_id(session_id: str) -> str:
    """The id of the session a worker opens downstream for ``session_id``."""
    return session_id + RELAY_SUFFIX


def hop_label(depth: int, layers: tuple[int, int] | None) -> str:
    """How a worker names a hop of its route in an error: by its place after this worker and
    its layer range, never by the address a caller put in the route."""
    where = "the next hop" if depth == 1 else f"the hop {depth} after this worker"
    return where if layers is None else f"{where} (layers [{layers[0]}, {layers[1]}))"
