"""Session hand-off from the client: copy one session's state into another, chunk by chunk."""

from __future__ import annotations

from .session import ClientSession

__all__ = ["move_session"]


async def move_session(
    source: ClientSession, target: ClientSession, *, max_chunk_bytes: int = 0
) -> int:
    """Copy ``source``'s state into ``target`` (an empty session on a worker of the same model,
    range and KV layout) chunk by chunk, never holding more than one chunk; returns the
    positions ``target`` holds. ``source`` is unchanged. A refusal raises ``ShardError`` with
    ``target`` left empty (replay the history into it instead); the rest of the export is
    then skipped by ``source``'s next request."""
    held = 0
    stream = source.export_state(max_chunk_bytes=max_chunk_bytes)
    try:
        async for chunk in stream:
            held = await target.import_state(chunk)
    finally:
        await stream.aclose()
    return held
