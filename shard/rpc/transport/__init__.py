"""Hardened gRPC transport over purerpc 0.8.0: the only package touching purerpc internals and h2.

- ``wire``: what both sides share: ``TransportLimits``, the bounded h2 machine with its flow
  ledger (inbound memory caps) and the receive pool (a reserve per connection, fair shares of
  the rest), the outbox, GOAWAY framing, the check of the h2 / purerpc internals we rely on;
- ``frames``: inbound frames cut linearly and counted per frame against a budget per kind
  (resets, PING, SETTINGS, ...), remembered per peer host across reconnects;
- ``server``: ``Server`` (connections, their tasks, deadlines, cancels, drain, authorization
  from the headers, message and send-idle timeouts);
- ``call``: one call's inbox and writer, and the call API handlers use (``current_call``,
  ``CallContext``, ``StatusError``, ``EndReason``, ``StreamHandler``, ``ResponseSink``);
- ``client``: ``ClientConnection`` / ``ClientStream`` for ``shard/client.py``.

Everything outside this package imports from here, never from purerpc's internals or h2.
"""

from .client import ClientConnection, ClientStream
from .call import (
    CallContext,
    EndReason,
    ResponseSink,
    StatusError,
    StreamHandler,
    current_call,
)
from .server import Server
from .wire import TransportLimits

__all__ = [
    "CallContext",
    "ClientConnection",
    "ClientStream",
    "EndReason",
    "ResponseSink",
    "Server",
    "StatusError",
    "StreamHandler",
    "TransportLimits",
    "current_call",
]
