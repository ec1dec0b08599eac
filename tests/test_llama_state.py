"""The reader of llama.cpp's sequence state (``shard.engine.llama_state``) on states built by
hand in the layout the pinned llama.cpp writes: what it accepts, and each crafted state it must
refuse before llama.cpp reads it (real exports: tests/test_llama_engine.py, the contract
suite)."""

from __future__ import annotations

import struct

import pytest

from shard.engine.llama_state import MAGIC, StateFormat, cell_positions, check_cells, learn_format

ROW = 8  # bytes of one cell's K (and V) row in these states: 2 layers


def _stream(positions: list[int], *, ext: bool = False, layers: int = 2) -> bytes:
    out = struct.pack("<I", len(positions))
    if not positions:
        return out
    for pos in positions:
        out += struct.pack("<iI", pos, 1) + (bytes(12) if ext else b"") + struct.pack("<i", 0)
    out += struct.pack("<II", 0, layers)
    for _ in range(2 * layers):  # K rows, then V rows (untransposed)
        out += struct.pack("<iQ", 1, ROW) + bytes(ROW * len(positions))
    return out


def state(*caches: list[list[int]], ext: bool = False, seq: int = 1) -> bytes:
    """One cache per argument, each a list of streams' cell positions."""
    out = struct.pack("<Ii", MAGIC, seq)
    for streams in caches:
        out += struct.pack("<I", len(streams)) + b"".join(_stream(p, ext=ext) for p in streams)
    return out


FMT = StateFormat(ext=False, n_stream=2)
N = 6


def test_a_well_formed_state_is_read_and_accepted() -> None:
    data = state([[], list(range(N))])
    assert learn_format(data) == FMT
    assert cell_positions(data, FMT) == [list(range(N))]
    assert check_cells(data, N, FMT) == ""
    # an interleaved-SWA model: the base cache full, the window's cache its tail
    swa = state([list(range(N)), []], [[3, 4, 5], []])
    assert check_cells(swa, N, FMT) == ""
    # cells need not be in position order (a reused slot)
    assert check_cells(state([[5, 0, 1, 2, 3, 4], []]), N, FMT) == ""


@pytest.mark.parametrize("data, why", [
    (state([[-5, 1, 2, 3, 4, 5], []]), "positions run from -5"),
    (state([[0, 1, 2, 3, 4, 2**31 - 1], []]), "positions run from 0 to 2147483647"),
    (state([[0, 1, 2, 3, 5, 5], []]), "twice"),
    (state([[0, 1, 2], [3, 4, 5]]), "spreads its cells over 2 streams"),
    (state([[0, 1, 2, 3, 4], []]), "positions run from 0 to 4"),
    (state([[3, 4, 5], []], [list(range(N)), []]), "first cache holds 3"),
    (state([list(range(N)), [], []]), "not a one-sequence"),  # 3 streams, the context has 2
    (state([list(range(N)), []], ext=True), "not a one-sequence"),  # cell extensions
    (state([list(range(N)), []]) + b"\\0", "not a one-sequence"),  # trailing bytes
    (state([list(range(N)), []])[:-1], "not a one-sequence"),  # cut short
    (b"\\0" * 64, "not a one-sequence"),  # no magic
], ids=["negative", "int32-max", "twice", "split-streams", "short", "base-not-full",
        "streams", "ext", "trailing", "cut", "magic"])
def test_a_crafted_state_is_refused_with_its_reason(data: bytes, why: str) -> None:
    assert why in check_cells(data, N, FMT)


def test_the_format_is_learned_from_the_contexts_own_state() -> None:
    """Whether cells carry the extension and how many streams a cache writes come from the
    context's own state (the warm-up's), never from the bytes a client sends."""
    assert learn_format(state([list(range(N)), []], ext=True)) == StateFormat(True, 2)
    assert learn_format(state([[], [], [0, 1]])) == StateFormat(False, 3)
    assert learn_format(b"\0" * 16) is None
    ext = StateFormat(True, 2)
    assert check_cells(state([list(range(N)), []], ext=True), N, ext) == ""
    assert "not a one-sequence" in check_cells(state([list(range(N)), []]), N, ext)
