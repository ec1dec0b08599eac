"""llama.cpp's sequence state, read far enough to check its cells before llama.cpp reads it.

Why: ``llama_state_seq_set_data`` trusts the cell positions in the bytes. A state from a client
(session hand-off) with a cell at a negative position, at 2**31-1 or twice at one position is
taken, and such a cell outlives every ``seq_rm`` (which clamps its range to ``[0, INT32_MAX)``):
it leaks, and the next session on that sequence id fails the engine. So a state is imported only
when this reader finds exactly the layout the pinned llama.cpp writes (``llama-cpp-python``
0.3.36: ``llama_context::state_seq_get_data``, ``llama_kv_cache::state_write`` per cache, two for
an interleaved-SWA model), in the format this context writes itself (learned from the warm-up's
state: cell extensions or not, the stream count), and every cell's position is one the session
may hold. Anything it does not recognise is refused (the caller replays the history instead):
it fails closed, and a context whose own state it cannot read moves no sessions at all.

The layout: a magic ``u32`` and the source ``seq_id``; then per cache ``n_stream`` and per
stream ``cell_count``, then (if any cells) each cell's ``pos``, ``n_seq_id`` (1 for one
sequence), an optional 12-byte extension (M-RoPE models) and its sequence ids, then ``v_trans``,
``n_layer`` and per layer the K rows and the V rows (each with its type and row size; a
transposed V with its element size and width).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["MAGIC", "StateFormat", "cell_positions", "check_cells", "learn_format"]

MAGIC = 0xAF143CD8
_EXT_BYTES = 12  # llama_kv_cell_ext: x, y, tok
_MAX_STREAMS = 256
_MAX_LAYERS = 4096


class _Malformed(Exception):
    pass


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise _Malformed("ends early")
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return int(value)

    def skip(self, n: int) -> None:
        if n < 0 or self.at + n > len(self.data):
            raise _Malformed("ends early")
        self.at += n


@dataclass(frozen=True)
class StateFormat:
    """How this context writes a sequence's state, learned from its own (the warm-up's): whether
    cells carry the 12-byte extension, and how many streams each cache writes."""

    ext: bool
    n_stream: int


def _cache(r: _Reader, fmt: StateFormat | None) -> tuple[list[int], int]:
    """One cache's cell positions and how many of its streams hold cells."""
    positions: list[int] = []
    n_stream = r.take("<I")
    if not 0 < n_stream <= _MAX_STREAMS or (fmt is not None and n_stream != fmt.n_stream):
        raise _Malformed(f"{n_stream} streams")
    ext = fmt is not None and fmt.ext
    filled = 0
    for _ in range(n_stream):
        count = r.take("<I")
        if count == 0:
            continue
        filled += 1
        for _ in range(count):
            positions.append(r.take("<i"))
            n_seq = r.take("<I")
            if n_seq != 1:
                raise _Malformed(f"a cell of {n_seq} sequences")
            if ext:
                r.skip(_EXT_BYTES)
            r.skip(4 * n_seq)
        v_trans, n_layer = r.take("<I"), r.take("<I")
        if v_trans > 1 or n_layer > _MAX_LAYERS:
            raise _Malformed("not a layer header")
        for _ in range(n_layer):  # K rows
            r.take("<i")
            r.skip(r.take("<Q") * count)
        for _ in range(n_layer):  # V rows
            r.take("<i")
            if v_trans:
                size, width = r.take("<I"), r.take("<I")
                r.skip(size * width * count)
            else:
                r.skip(r.take("<Q") * count)
    return positions, filled


def _read(data: bytes, fmt: StateFormat | None) -> list[tuple[list[int], int]] | None:
    r = _Reader(data)
    try:
        if r.take("<I") != MAGIC:
            return None
        r.take("<i")  # the source sequence id (the importer uses its own)
        caches = []
        while r.at < len(data):
            caches.append(_cache(r, fmt))
    except _Malformed:
        return None
    return caches or None


def learn_format(data: bytes) -> StateFormat | None:
    """The format of a state this context wrote itself (the warm-up's), or None when it is
    not one this module reads, or could be read both with and without cell extensions: then
    sessions are not moved (``kv_layout`` ""), never guessed."""
    found = []
    for ext in (False, True):
        r = _Reader(data)
        try:
            if r.take("<I") != MAGIC:
                return None
            r.take("<i")
            n_stream = r.take("<I")
        except _Malformed:
            return None
        fmt = StateFormat(ext, n_stream)
        if _read(data, fmt) is not None:
            found.append(fmt)
    return found[0] if len(found) == 1 else None


def cell_positions(data: bytes, fmt: StateFormat) -> list[list[int]] | None:
    """Each cache's cell positions in a one-sequence state of format ``fmt`` (None: not one)."""
    caches = _read(data, fmt)
    return None if caches is None else [positions for positions, _ in caches]


def check_cells(data: bytes, n_past: int, fmt: StateFormat) -> str:
    """Why a state must not be imported as ``n_past`` positions ("" when it may): this
    context's format, each cache's cells in one stream (llama.cpp maps every stream of a
    one-sequence state onto the importer's, each replacing the one before), their positions
    distinct and in ``[0, n_past)`` with the last one present, and the first cache (the one
    every layer without a sliding window uses) holding all of them."""
    caches = _read(data, fmt)
    if caches is None:
        return "it is not a one-sequence llama.cpp state in this worker's format"
    for positions, filled in caches:
        if filled > 1:
            return f"one of its caches spreads its cells over {filled} streams"
        held = set(positions)
        if len(held) != len(positions):
            return "it holds a position twice"
        if positions and (min(positions) < 0 or max(positions) != n_past - 1):
            return f"its positions run from {min(positions)} to {max(positions)}, not to {n_past - 1}"
    if len(caches[0][0]) != n_past:
        return f"its first cache holds {len(caches[0][0])} positions, not {n_past}"
    return ""
