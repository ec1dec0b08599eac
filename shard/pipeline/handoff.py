"""Session hand-off, the client's side: when a worker drains, a hop's session moves to the
replica as state (KV cells, positions, token ids) instead of being replayed there, where both
workers report ``session_handoff`` with the same KV layout (the worker may still refuse one)."""

from __future__ import annotations

import logging

from shard.client import ClientSession
from shard.rpc.errors import ShardError
from shard.rpc.handoff import MIN_CHUNK_BYTES
from shard.v1 import shard_pb2 as pb

from .errors import STEP_DEADLINE, Hop
from .generation import next_or_none
from .history import REPLAY_CHUNKS, Timed
from .replicas import Replica

__all__ = ["MOVED", "REPLICA", "SOURCE", "move_state", "takes_state"]

log = logging.getLogger(__name__)

#: What became of a session's state on a drain (``move_state``): it moved; the replica did not
#: take it; the draining worker did not give it.
MOVED, REPLICA, SOURCE = "moved", "replica", "source"


def takes_state(mine: pb.GetCapabilitiesResponse | None,
                theirs: pb.GetCapabilitiesResponse | None) -> bool:
    """A worker reporting ``theirs`` takes states of a worker reporting ``mine`` (it may still
    refuse one: the worker decides)."""
    return (mine is not None and theirs is not None and theirs.session_handoff
            and theirs.kv_layout == mine.kv_layout)


async def move_state(
    source: ClientSession, target: ClientSession, replica: Replica, *, serving: Replica,
    positions: int, timed: Timed, hop: Hop,
) -> str:
    """Copy ``source``'s state (the draining worker's session, on ``serving``, holding
    ``positions``) into ``target`` (on ``replica``) chunk by chunk, within ``REPLAY_CHUNKS``
    step timeouts. Returns ``MOVED``; ``REPLICA`` when the replica cannot take it (its worker
    takes no states, or refused this one: another model, range or KV layout, too large,
    corrupt), which leaves ``target`` empty; ``SOURCE`` when the draining worker gave none (its
    stream ended, it refused). A ``target`` that failed raises, as a failed replay would.

    A refused export is read to its end rather than abandoned: skipping it would take a
    ``Cancel`` on a new stream, which a connection that got GOAWAY no longer opens."""
    old, new = serving.caps, replica.caps
    if positions == 0 or not source.alive:
        return SOURCE
    if new is None or not takes_state(old, new):
        return REPLICA  # (no transfer that its worker would refuse at the header)
    assert old is not None
    limit = min(x for x in (old.max_message_bytes, new.max_message_bytes, 16 * 2**20) if x)
    chunks = source.export_state(max_chunk_bytes=max(MIN_CHUNK_BYTES, limit - 4096))
    held, outcome = 0, MOVED

    async def copy() -> None:
        nonlocal held, outcome
        while True:
            try:
                chunk = await next_or_none(chunks)
            except ShardError as err:  # the draining worker's side: the replica is fine
                log.warning("%s: the draining worker gave no state (%s)", hop, err)
                outcome = SOURCE
                return
            if chunk is None:
                return
            if outcome is not MOVED:
                continue  # refused: the rest of the export is only read
            try:
                held = await target.import_state(chunk)
            except ShardError as err:
                if not target.alive or err.reason == STEP_DEADLINE:
                    raise
                log.warning("%s: %s refused the session's state: %s", hop,
                            replica.target, err)
                outcome = REPLICA

    try:
        await timed(copy, REPLAY_CHUNKS)
    finally:  # a failed move leaves the export to be skipped by the source's next request
        await chunks.aclose()
    if outcome is MOVED and held != positions:  # never expected: the counts are one
        log.warning("%s: the moved state holds %d positions, not %d", hop, held, positions)
        if held:
            await timed(lambda: target.rewind(0))
        outcome = REPLICA
    return outcome
