"""Hidden states on the wire: the encodings a session may negotiate, and their byte layouts.

Why one owner: the worker (receipt and results), the client (chunks, requests), the pipeline
(replay logs, message sizes) and the benches all need the bytes of a row and the conversion
both ways; the engine never sees any of it (it computes in float32).

Encodings (little-endian, row-major ``[n_tokens, n_embd]``):

* ``float32``: 4 bytes a value, exact (the default).
* ``float16``: 2 bytes a value; a finite value beyond float16's range is refused by the sender.
* ``q8_0``: llama.cpp's Q8_0 block layout. Each row is cut into ``ceil(n_embd / 32)`` blocks of
  32 values (the last one padded with zeros when ``n_embd`` is not a multiple of 32; the
  receiver ignores the padding); a block is 34 bytes: a float16 scale ``d`` then 32 int8
  ``q``, and stands for ``q[i] * d``. So a row takes ``ceil(n_embd / 32) * 34`` bytes
  (0.27x float32 when 32 divides ``n_embd``). The encoder picks ``d`` as ``max|x| / 127``
  rounded *up* to a float16 and at least 2**-14 (float16's smallest normal), and
  ``q = round(x / d)`` (ties to even), with ``d`` 0 for a block whose ``q`` are all 0: every
  value is then within ``d / 2`` of what was sent, no value is clipped, and encoding a decoded row gives the very same bytes (a
  replay sends exactly what was sent; a chain relay and a client relay agree). A block with a
  NaN or an infinity gets a NaN scale (the receiver refuses it, as it refuses any non-finite
  value); a finite block whose scale would pass float16's range (``max|x|`` above about
  8.3e6) is refused by the sender.
* ``q8_0_outliers``: per row, the ``OUTLIERS`` channels of largest magnitude sent apart,
  exact, and the row as ``q8_0`` blocks with those channels zeroed: ``k = min(OUTLIERS,
  n_embd)`` uint32 channel indices (ascending), their ``k`` float32 values, then the blocks
  (``8 k + ceil(n_embd / 32) * 34`` bytes a row). Why: some models (Gemma 3) carry a channel
  hundreds of times larger than the rest in every row; in ``q8_0`` it sets its block's scale
  and the block's other 31 values lose their precision. The channels sent apart are the ``k``
  largest ``|x|``, ties to the lower index (a NaN counts as largest). Every other value must
  decode strictly below the smallest of them, ``m``, in magnitude, so a block whose scale
  would reach ``m / 127`` gets the largest float16 scale below that instead (its values
  clipped to 127 steps; if ``m`` is below ``127 * 2**-24`` it is sent as zeros). Then a
  decoded row picks the same channels and scales: encoding it gives the very same bytes, as
  for ``q8_0``. A receiver refuses indices out of range or not ascending.
"""

from __future__ import annotations

import numpy as np

from .errors import ErrorCode, ShardError

__all__ = ["CODECS", "HiddenCodec", "Q8_BLOCK", "max_row_bytes", "row_bytes"]

#: Values per Q8_0 block, and a block's bytes on the wire (float16 scale + 32 int8).
Q8_VALUES = 32
Q8_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (Q8_VALUES,))])
_MIN_SCALE = np.float16(2.0**-14)


def _overflow(name: str) -> ShardError:
    return ShardError(
        ErrorCode.INVALID_ARGUMENT,
        f"hidden states exceed the {name} range; use float32 on the wire",
        reason="FLOAT16_OVERFLOW",  # float16 values, or q8_0's float16 scales
    )


class HiddenCodec:
    """One wire encoding: its name, the bytes of a row, and the conversion both ways."""

    name: str

    def row_bytes(self, n_embd: int) -> int:
        raise NotImplementedError

    def encode(self, arr: np.ndarray) -> bytes:
        """float32 rows (the last axis is ``n_embd``) as wire bytes; refuses (``ShardError``
        INVALID_ARGUMENT, reason ``FLOAT16_OVERFLOW``) finite values it cannot represent."""
        raise NotImplementedError

    def decode(self, data: bytes, rows: int, n_embd: int) -> np.ndarray:
        """A new float32 ``[rows, n_embd]`` array from ``data`` (its size already checked)."""
        raise NotImplementedError


class FloatCodec(HiddenCodec):
    """An IEEE float type, value by value."""

    def __init__(self, name: str, dtype: str) -> None:
        self.name = name
        self.dtype = np.dtype(dtype)

    def row_bytes(self, n_embd: int) -> int:
        return n_embd * self.dtype.itemsize

    def encode(self, arr: np.ndarray) -> bytes:
        src = np.asarray(arr, dtype=np.float32)
        with np.errstate(over="ignore"):  # overflow is detected below, with a clear error
            a = np.ascontiguousarray(src, dtype=self.dtype)
        # Non-finite input is sent as it is (the receiver refuses it; tests send it on purpose).
        if self.dtype != np.float32 and not np.array_equal(np.isfinite(a), np.isfinite(src)):
            raise _overflow(self.name)
        return a.tobytes()

    def decode(self, data: bytes, rows: int, n_embd: int) -> np.ndarray:
        return np.frombuffer(data, dtype=self.dtype).astype(np.float32).reshape(rows, n_embd)


class Q8Codec(HiddenCodec):
    """llama.cpp's Q8_0 layout, one float16 scale per 32 values (see the module docstring)."""

    name = "q8_0"

    def row_bytes(self, n_embd: int) -> int:
        return -(-n_embd // Q8_VALUES) * Q8_BLOCK.itemsize

    def encode(self, arr: np.ndarray) -> bytes:
        src = np.asarray(arr, dtype=np.float32)
        n_embd = src.shape[-1] if src.ndim else 1
        return _q8_blocks(src.reshape(-1, n_embd), self.name).tobytes()

    def decode(self, data: bytes, rows: int, n_embd: int) -> np.ndarray:
        return _q8_values(np.frombuffer(data, dtype=Q8_BLOCK).reshape(rows, -1), n_embd)


class Q8OutliersCodec(HiddenCodec):
    """``q8_0`` with each row's ``k`` largest channels sent apart, exact (module docstring)."""

    name = "q8_0_outliers"

    def __init__(self, k: int) -> None:
        self.k = k

    def _layout(self, n_embd: int) -> np.dtype:
        k = min(self.k, n_embd)
        return np.dtype([("i", "<u4", (k,)), ("v", "<f4", (k,)),
                         ("b", Q8_BLOCK, (-(-n_embd // Q8_VALUES),))])

    def row_bytes(self, n_embd: int) -> int:
        return self._layout(n_embd).itemsize

    def encode(self, arr: np.ndarray) -> bytes:
        src = np.asarray(arr, dtype=np.float32)
        n_embd = src.shape[-1] if src.ndim else 1
        x = src.reshape(-1, n_embd)
        out = np.empty(x.shape[0], dtype=self._layout(n_embd))
        k = out["i"].shape[1]
        mag = np.abs(x)
        if np.isnan(mag.sum()):
            mag[np.isnan(mag)] = np.inf
        idx, m = _largest(mag, k)
        rows = np.arange(x.shape[0])[:, None]
        rest = x.copy()
        rest[rows, idx] = 0
        out["i"], out["v"] = idx, x[rows, idx]
        out["b"] = _q8_blocks(rest, self.name, cap=m)
        return out.tobytes()

    def decode(self, data: bytes, rows: int, n_embd: int) -> np.ndarray:
        msg = np.frombuffer(data, dtype=self._layout(n_embd)).reshape(rows)
        idx = msg["i"].astype(np.int64)
        if idx.size and (idx.max() >= n_embd or (np.diff(idx, axis=1) <= 0).any()):
            raise ShardError(ErrorCode.INVALID_ARGUMENT, "q8_0_outliers channel indices must be "
                             f"ascending and below n_embd {n_embd}", reason="BAD_OUTLIER_INDEX")
        x = _q8_values(msg["b"], n_embd)
        x[np.arange(rows)[:, None], idx] = msg["v"]
        return x


def _largest(mag: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``mag``, the indices (ascending) of the ``k`` largest values, ties to the
    lower index, and the smallest of those values (``[rows, 1]``). A partition, not a sort;
    only rows with ties across the k-th value take the slower exact path."""
    n = mag.shape[1]
    idx = np.argpartition(mag, n - k, axis=1)[:, n - k:]
    rows = np.arange(mag.shape[0])[:, None]
    m = mag[rows, idx].min(axis=1, keepdims=True)
    tied = np.nonzero((mag >= m).sum(axis=1) > k)[0]  # more candidates than room: break ties
    if tied.size:
        sub, cut = mag[tied], m[tied]
        above, equal = sub > cut, sub == cut
        need = k - above.sum(axis=1, keepdims=True)
        idx[tied] = np.nonzero(above | (equal & (np.cumsum(equal, axis=1) <= need)))[1].reshape(-1, k)
    return np.sort(idx, axis=1), m


def _q8_blocks(x: np.ndarray, name: str, cap: np.ndarray | None = None) -> np.ndarray:
    """Float32 rows ``x`` as ``[rows, n_blocks]`` Q8_0 blocks (the module docstring's rules);
    with ``cap`` (``[rows, 1]``), every value of a row decodes strictly below its cap in
    magnitude (``q8_0_outliers``). ``name``: the dtype an overflow is reported for."""
    n_embd = x.shape[1]
    n_blocks = -(-n_embd // Q8_VALUES)
    if n_blocks * Q8_VALUES != n_embd:
        x = np.pad(x, ((0, 0), (0, n_blocks * Q8_VALUES - n_embd)))
    x = x.reshape(x.shape[0], n_blocks, Q8_VALUES)
    finite = np.isfinite(x).all(axis=2)
    with np.errstate(invalid="ignore", over="ignore"):
        amax = np.where(finite, np.abs(x).max(axis=2), 0).astype(np.float32)
        wanted = amax / np.float32(127)
        d = wanted.astype(np.float16)
        d = np.where(d.astype(np.float32) < wanted, np.nextafter(d, np.float16(np.inf)), d)
    d = np.where(amax > 0, np.maximum(d, _MIN_SCALE), np.float16(0))
    if cap is not None:
        with np.errstate(invalid="ignore", over="ignore"):  # (an overflow is refused below)
            over = (amax > 0) & np.isfinite(d) & (d.astype(np.float32) * 127 >= cap)
        d = np.where(over, _scale_below(cap), d)
    if not np.isfinite(d).all():
        raise _overflow(name)
    d = np.where(finite, d, np.float16(np.nan))
    scale = np.where(finite & (d != 0), d.astype(np.float32), np.float32(np.inf))[..., None]
    with np.errstate(invalid="ignore"):
        q = np.rint(np.where(finite[..., None], x, 0) / scale)  # (a zero scale: all zeros)
    qs = np.clip(q, -127, 127).astype(np.int8)
    out = np.empty(d.shape, dtype=Q8_BLOCK)
    # a block that rounds to all zeros is sent as an all-zero block (scale 0), as it decodes
    out["d"] = np.where(finite & ~qs.any(axis=2), np.float16(0), d)
    out["qs"] = qs
    return out


def _scale_below(cap: np.ndarray) -> np.ndarray:
    """The largest float16 ``d`` (0 at least) with ``127 * d < cap``, per row."""
    with np.errstate(over="ignore", invalid="ignore"):
        d = (cap / np.float32(127)).astype(np.float16)
        for _ in range(2):  # the nearest float16 may be a step above; 127 * d is exact in float32
            d = np.where((d > 0) & (d.astype(np.float32) * 127 >= cap),
                         np.nextafter(d, np.float16(0)), d)
    return d


def _q8_values(blocks: np.ndarray, n_embd: int) -> np.ndarray:
    """A new float32 ``[rows, n_embd]`` array from ``[rows, n_blocks]`` Q8_0 blocks."""
    with np.errstate(invalid="ignore", over="ignore"):  # a NaN/inf scale: refused later
        x = blocks["qs"].astype(np.float32) * blocks["d"].astype(np.float32)[..., None]
    return np.ascontiguousarray(x.reshape(blocks.shape[0], -1)[:, :n_embd])


#: Channels a ``q8_0_outliers`` row sends apart.
OUTLIERS = 4

#: Every encoding a worker accepts and sends, by wire name (``GetCapabilities.hidden_wire_dtypes``;
#: a new one goes at the end).
CODECS: dict[str, HiddenCodec] = {
    c.name: c for c in (FloatCodec("float32", "<f4"), FloatCodec("float16", "<f2"), Q8Codec(),
                        Q8OutliersCodec(OUTLIERS))
}


def row_bytes(dtype: str, n_embd: int) -> int:
    """Bytes of one row of ``n_embd`` values in wire ``dtype``."""
    return CODECS[dtype].row_bytes(n_embd)


def max_row_bytes(n_embd: int) -> int:
    """The most bytes one row takes in any wire dtype (what a worker must fit in a message
    before it knows a session's dtype)."""
    return max(c.row_bytes(n_embd) for c in CODECS.values())
