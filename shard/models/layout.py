"""The byte layout of a GGUF file: where every key and tensor is, found without decoding them.

Why not ``gguf.GGUFReader``: it decodes every key, building numpy views for each element of
every array, and a vocabulary is several arrays of 150,000-260,000 elements: on a real model
that takes seconds and most of a GB just to open the file, far more than writing a slice. A
slice changes a few
small keys and renames tensors; everything else is copied as bytes. So this module walks the
header once (``walk_keys``: each key's span; string arrays by their length prefixes only),
lists the tensors (``read_layout``) and encodes the few keys and tensor entries a slice writes
anew (``encode_key``, ``encode_tensor_info``). Little-endian GGUF v2 and v3 only, like
``shard.models.header``, which decodes its small keys from the same walk.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import gguf

# GGUF value types (gguf.GGUFValueType) -> struct format of one scalar, little-endian.
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                  10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"


@dataclass(frozen=True)
class KeySpan:
    """One key-value entry: ``buf[start:end]`` is the whole entry (name, type, value), the
    value's bytes begin at ``value`` (for an array: after its element type and count)."""

    name: str
    vtype: int
    start: int
    value: int
    end: int
    sub_type: int | None = None  # arrays: the element type
    count: int | None = None  # arrays: the element count


@dataclass(frozen=True)
class TensorSpan:
    """One tensor: ``shape`` innermost first (as GGUF stores it), data at ``offset`` (absolute)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    version: int
    keys: tuple[KeySpan, ...]
    tensors: tuple[TensorSpan, ...]
    alignment: int
    data_start: int


def _string(buf: Any, at: int) -> tuple[int, int]:
    """The span ``(start, end)`` of the string whose length prefix is at ``at``."""
    (n,) = struct.unpack_from("<Q", buf, at)
    if at + 8 + n > len(buf):
        raise ValueError("truncated string")
    return at + 8, at + 8 + n


def header_counts(buf: Any) -> tuple[int, int, int]:
    """``(version, tensor count, key count)``; raises ValueError for what is not GGUF v2/v3."""
    if len(buf) < 24 or buf[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (only little-endian v2 and v3 are read)")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    return version, n_tensors, n_kv


def walk_keys(buf: Any) -> Iterator[KeySpan]:
    """Every key-value entry of the header, in file order (bounds checked, nothing decoded)."""
    _, _, n_kv = header_counts(buf)
    pos = 24
    for _ in range(n_kv):
        start = pos
        a, b = _string(buf, pos)
        name = bytes(buf[a:b]).decode("utf-8")
        (vtype,) = struct.unpack_from("<I", buf, b)
        pos = value = b + 4
        sub = count = None
        if vtype == STRING:
            pos = _string(buf, pos)[1]
        elif vtype in SCALAR_FORMATS:
            pos += struct.calcsize(SCALAR_FORMATS[vtype])
        elif vtype == ARRAY:
            sub, count = struct.unpack_from("<IQ", buf, pos)
            pos = value = pos + 12
            if sub == STRING:
                unpack = struct.Struct("<Q").unpack_from
                for _ in range(count):
                    pos += 8 + unpack(buf, pos)[0]
            elif sub in SCALAR_FORMATS:
                pos += count * struct.calcsize(SCALAR_FORMATS[sub])
            else:
                raise ValueError(f"unsupported array element type {sub} in {name!r}")
        else:
            raise ValueError(f"unknown value type {vtype} for {name!r}")
        if pos > len(buf):
            raise ValueError(f"truncated value of {name!r}")
        yield KeySpan(name, vtype, start, value, pos, sub, count)


def decode_value(buf: Any, span: KeySpan, max_array: int) -> Any:
    """The value of a scalar or string key; a numeric array of at most ``max_array`` items as a
    tuple; None for a longer or a string array (not decoded)."""
    if span.vtype == STRING:
        return bytes(buf[span.value + 8:span.end]).decode("utf-8")
    if span.vtype in SCALAR_FORMATS:
        return struct.unpack_from(SCALAR_FORMATS[span.vtype], buf, span.value)[0]
    assert span.count is not None and span.sub_type is not None
    if span.sub_type in SCALAR_FORMATS and span.count <= max_array:
        return struct.unpack_from(f"<{span.count}{SCALAR_FORMATS[span.sub_type][1]}", buf, span.value)
    return None


def tensor_nbytes(shape: Sequence[int], ggml_type: int) -> int:
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    n = math.prod(shape)
    if shape and shape[0] % block:
        raise ValueError(f"a row of {shape[0]} is not a whole number of {block}-element blocks")
    return n // block * type_size


def read_layout(buf: Any) -> Layout:
    """Every key's span and every tensor's place (see the module docs)."""
    version, n_tensors, _ = header_counts(buf)
    keys = tuple(walk_keys(buf))
    alignment = DEFAULT_ALIGNMENT
    for span in keys:
        if span.name == ALIGNMENT_KEY and span.vtype in SCALAR_FORMATS:
            alignment = int(decode_value(buf, span, 0))
    if alignment <= 0 or alignment % 8:
        raise ValueError(f"alignment {alignment} is not a positive multiple of 8")
    pos = keys[-1].end if keys else 24
    infos = []
    for _ in range(n_tensors):
        a, b = _string(buf, pos)
        name = bytes(buf[a:b]).decode("utf-8")
        (n_dims,) = struct.unpack_from("<I", buf, b)
        if n_dims > 8:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        shape = struct.unpack_from(f"<{n_dims}Q", buf, b + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, b + 4 + 8 * n_dims)
        pos = b + 4 + 8 * n_dims + 12
        infos.append((name, tuple(shape), ggml_type, offset))
    data_start = _align(pos, alignment)
    tensors = []
    for name, shape, ggml_type, offset in infos:
        nbytes = tensor_nbytes(shape, ggml_type)
        if data_start + offset + nbytes > len(buf):
            raise ValueError(f"tensor {name!r} lies past the end of the file")
        tensors.append(TensorSpan(name, shape, ggml_type, data_start + offset, nbytes))
    return Layout(version, keys, tuple(tensors), alignment, data_start)


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


# ---- writing -------------------------------------------------------------------------------


def _encode_string(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _encode_scalar(vtype: int, value: Any) -> bytes:
    if vtype == STRING:
        return _encode_string(value)
    return struct.pack(SCALAR_FORMATS[vtype], value)


def encode_key(name: str, vtype: int, value: Any, sub_type: int | None = None) -> bytes:
    """One key-value entry (scalars, strings, arrays of either)."""
    out = _encode_string(name) + struct.pack("<I", vtype)
    if vtype != ARRAY:
        return out + _encode_scalar(vtype, value)
    if sub_type is None:
        raise ValueError(f"array {name!r} needs an element type")
    items = list(value)
    out += struct.pack("<IQ", sub_type, len(items))
    if sub_type == STRING:
        return out + b"".join(_encode_string(v) for v in items)
    return out + struct.pack(f"<{len(items)}{SCALAR_FORMATS[sub_type][1]}", *items)


def encode_tensor_info(name: str, shape: Sequence[int], ggml_type: int, offset: int) -> bytes:
    """One tensor entry; ``offset`` is relative to the data section."""
    return (_encode_string(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
            + struct.pack("<IQ", ggml_type, offset))


def encode_header(version: int, n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def padding(n: int, alignment: int) -> bytes:
    """Zero bytes that bring ``n`` to a multiple of ``alignment``."""
    return b"\0" * (_align(n, alignment) - n)


__all__ = [
    "ALIGNMENT_KEY",
    "ARRAY",
    "DEFAULT_ALIGNMENT",
    "SCALAR_FORMATS",
    "STRING",
    "KeySpan",
    "Layout",
    "TensorSpan",
    "decode_value",
    "encode_header",
    "encode_key",
    "encode_tensor_info",
    "header_counts",
    "padding",
    "read_layout",
    "tensor_nbytes",
    "walk_keys",
]
