"""Hardened gRPC transport over purerpc 0.8.0: the only package touching purerpc internals and h2.

- ``wire``: what both sides share: ``TransportLimits``, the bounded h2 machine with its flow
  ledger (inbound memory caps), the outbox, GOAWAY framing;
- ``server``: ``Server`` (connections, calls, deadlines, cancels, drain) and the call API
  handlers use (``current_call``, ``CallContext``, ``StatusError``, ``EndReason``);
- ``client``: ``ClientConnection`` / ``ClientStream`` for ``shard/client.py``.

Everything outside this package imports from here, never from purerpc's internals or h2.
"""

from .client import ClientConnection, ClientStream
from .server import CallContext, EndReason, Server, StatusError, current_call
from .wire import TransportLimits

__all__ = [
    "CallContext",
    "ClientConnection",
    "ClientStream",
    "EndReason",
    "Server",
    "StatusError",
    "TransportLimits",
    "current_call",
]
