"""Where a session stream is in its state machine (``Phase``) and why it ended from outside
it (``StreamEnd``, which decides release vs. retain and the ``SessionClosed`` reason)."""

from __future__ import annotations

import enum

from shard.v1 import shard_pb2 as pb

from ..errors import ErrorCode, ShardError


class Phase(enum.Enum):
    AWAITING_OPEN = "awaiting_open"
    IDLE = "idle"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class StreamEnd(enum.Enum):
    """Why a stream ended from outside the state machine; decides release vs. retain."""

    DEADLINE = "deadline"  # released
    CLIENT_CANCELLED = "client_cancelled"  # RST_STREAM: released
    CONNECTION_LOST = "connection_lost"  # retained for resume_ttl
    SHUTDOWN = "shutdown"  # released
    RELEASED = "released"  # Release RPC: released
    SEND_STALLED = "send_stalled"  # the client read no response for send_idle_timeout: released


RETAIN_ON_END = frozenset({StreamEnd.CONNECTION_LOST})
CLOSED_REASON = {
    StreamEnd.DEADLINE: pb.SessionClosed.REASON_ERROR,
    StreamEnd.CLIENT_CANCELLED: pb.SessionClosed.REASON_ERROR,
    StreamEnd.CONNECTION_LOST: pb.SessionClosed.REASON_ERROR,
    StreamEnd.SHUTDOWN: pb.SessionClosed.REASON_SHUTDOWN,
    StreamEnd.RELEASED: pb.SessionClosed.REASON_RELEASED,
    StreamEnd.SEND_STALLED: pb.SessionClosed.REASON_ERROR,
}

#: The requests that run as a step (``SessionCall._run_step``).
STEP_KINDS = frozenset(("prefill", "decode", "generate", "rewind", "export_state", "import_state"))


def illegal(message: str, session_id: str = "") -> ShardError:
    """A protocol violation: ends the stream with ILLEGAL_TRANSITION."""
    return ShardError(ErrorCode.ILLEGAL_TRANSITION, message, session_id=session_id)
