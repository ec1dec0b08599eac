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
        x = src.reshape(-1, n_embd)
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
        if not np.isfinite(d).all():
            raise _overflow(self.name)
        d = np.where(finite, d, np.float16(np.nan))
        scale = np.where(finite & (amax > 0), d.astype(np.float32), np.float32(1))[..., None]
        with np.errstate(invalid="ignore"):
            q = np.rint(np.where(finite[..., None], x, 0) / scale)
        qs = np.clip(q, -127, 127).astype(np.int8)
        out = np.empty(d.shape, dtype=Q8_BLOCK)
        # a block that rounds to all zeros is sent as an all-zero block (scale 0), as it decodes
        out["d"] = np.where(finite & ~qs.any(axis=2), np.float16(0), d)
        out["qs"] = qs
        return out.tobytes()

    def decode(self, data: bytes, rows: int, n_embd: int) -> np.ndarray:
        blocks = np.frombuffer(data, dtype=Q8_BLOCK).reshape(rows, -1)
        with np.errstate(invalid="ignore", over="ignore"):  # a NaN/inf scale: refused later
            x = blocks["qs"].astype(np.float32) * blocks["d"].astype(np.float32)[..., None]
        return np.ascontiguousarray(x.reshape(rows, -1)[:, :n_embd])


#: Every encoding a worker accepts and sends, by wire name (``GetCapabilities.hidden_wire_dtypes``).
CODECS: dict[str, HiddenCodec] = {
    c.name: c for c in (FloatCodec("float32", "<f4"), FloatCodec("float16", "<f2"), Q8Codec())
}


def row_bytes(dtype: str, n_embd: int) -> int:
    """Bytes of one row of ``n_embd`` values in wire ``dtype``."""
    return CODECS[dtype].row_bytes(n_embd)


def max_row_bytes(n_embd: int) -> int:
    """The most bytes one row takes in any wire dtype (what a worker must fit in a message
    before it knows a session's dtype)."""
    return max(c.row_bytes(n_embd) for c in CODECS.values())
