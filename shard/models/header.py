"""What a GGUF file says about itself, read from its header without loading it.

The engine reads this on every load and the slicer before every slice: the architecture, block
count and width, the slice metadata (``trio_shard.*``) and the small numeric arrays the
architecture table checks (per-layer hyperparameters, sliding-window patterns). Fast on any
model: vocabulary-sized arrays are skipped, not decoded (``gguf.GGUFReader`` takes seconds on a
32k vocabulary).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import gguf

from shard.layers import LayerRange

from .layout import ARRAY, STRING, decode_value, walk_keys

KEY_SOURCE_SHA256 = "trio_shard.source.sha256"
KEY_SOURCE_BLOCK_COUNT = "trio_shard.source.block_count"
KEY_SOURCE_N_VOCAB = "trio_shard.source.n_vocab"
KEY_RANGE_START = "trio_shard.layer_range.start"
KEY_RANGE_END = "trio_shard.layer_range.end"
KEY_SLICER_VERSION = "trio_shard.slicer.version"

#: Numeric arrays up to this length are decoded into ``ModelInfo.metadata`` (llama.cpp's
#: ``LLAMA_MAX_LAYERS`` is 512: every per-layer array fits; vocabulary arrays do not).
MAX_DECODED_ARRAY = 4096


class SliceError(ValueError):
    """The model cannot be read or sliced as asked; the message says why, for a user."""


@dataclass(frozen=True)
class ModelInfo:
    """What the slicer and the engine need to know about a GGUF file before loading it.

    For a sliced file, ``layer_range`` is the range it serves and ``source_*`` describe the
    model it was cut from; for a whole model they are None. ``metadata`` holds every scalar key
    and every numeric array of at most ``MAX_DECODED_ARRAY`` items (as a tuple), read-only.
    """

    path: Path
    architecture: str
    block_count: int  # blocks in this file
    n_embd: int
    source_sha256: str | None = None
    source_block_count: int | None = None
    source_n_vocab: int | None = None
    layer_range: LayerRange | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    #: The file's vocabulary size (``<arch>.vocab_size`` or the token list's length), if stated.
    n_vocab: int | None = None

    @property
    def is_slice(self) -> bool:
        return self.layer_range is not None

    @property
    def n_layers_total(self) -> int:
        """Blocks of the whole model (the source's, for a slice)."""
        return self.source_block_count or self.block_count


def read_model_info(path: Path) -> ModelInfo:
    """Read architecture, block count, width, slice metadata and small arrays from the header.

    Raises SliceError when the file is not a readable GGUF or lacks the keys a model needs.
    """
    path = Path(path)
    return _info(_read(path, MAX_DECODED_ARRAY), path)


def _read_scalars(path: Path) -> dict[str, Any]:
    """Every scalar key of a little-endian GGUF v2/v3 header (arrays are skipped, not decoded)."""
    return _read(path, 0)


def _read(path: Path, max_array: int) -> dict[str, Any]:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_header(buf, max_array)
    except FileNotFoundError:
        raise SliceError(f"model file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise SliceError(f"model path {str(path)!r} is a directory") from None
    except (ValueError, OSError, struct.error, UnicodeDecodeError) as exc:  # empty file, truncation
        raise SliceError(f"{str(path)!r} is not a readable GGUF file ({exc})") from None


#: Where ``_parse_header`` records the length of the vocabulary (a string array it skips).
_TOKENS_LENGTH = "\0tokens"


def _parse_header(buf: mmap.mmap, max_array: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for span in walk_keys(buf):
        if span.vtype == ARRAY and span.sub_type == STRING:
            if span.name == gguf.Keys.Tokenizer.LIST and max_array:
                out[_TOKENS_LENGTH] = span.count
            continue
        value = decode_value(buf, span, max_array)
        if value is not None:
            out[span.name] = value
    return out


def _int_key(meta: Mapping[str, Any], key: str, path: Path) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise SliceError(f"{str(path)!r} has no integer {key!r}")
    return value


def _info(meta: dict[str, Any], path: Path) -> ModelInfo:
    arch = meta.get(gguf.Keys.General.ARCHITECTURE)
    if not isinstance(arch, str):
        raise SliceError(f"{str(path)!r} does not name its architecture")
    block_count = _int_key(meta, gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch), path)
    n_embd = _int_key(meta, gguf.Keys.LLM.EMBEDDING_LENGTH.format(arch=arch), path)
    n_vocab = meta.pop(_TOKENS_LENGTH, None)
    size = meta.get(gguf.Keys.LLM.VOCAB_SIZE.format(arch=arch))
    if n_vocab is None and isinstance(size, int) and not isinstance(size, bool):
        n_vocab = size
    frozen = MappingProxyType(meta)
    if KEY_RANGE_START not in meta:
        return ModelInfo(path, arch, block_count, n_embd, metadata=frozen, n_vocab=n_vocab)
    start = _int_key(meta, KEY_RANGE_START, path)
    end = _int_key(meta, KEY_RANGE_END, path)
    total = _int_key(meta, KEY_SOURCE_BLOCK_COUNT, path)
    sha = meta.get(KEY_SOURCE_SHA256)
    if not (0 <= start < end <= total) or end - start != block_count or not isinstance(sha, str):
        raise SliceError(f"{str(path)!r} has inconsistent trio_shard slice metadata")
    return ModelInfo(
        path, arch, block_count, n_embd,
        source_sha256=sha,
        source_block_count=total,
        source_n_vocab=_int_key(meta, KEY_SOURCE_N_VOCAB, path),
        layer_range=LayerRange(start, end),
        metadata=frozen,
        n_vocab=n_vocab,
    )


__all__ = [
    "KEY_RANGE_END",
    "KEY_RANGE_START",
    "KEY_SLICER_VERSION",
    "KEY_SOURCE_BLOCK_COUNT",
    "KEY_SOURCE_N_VOCAB",
    "KEY_SOURCE_SHA256",
    "MAX_DECODED_ARRAY",
    "ModelInfo",
    "SliceError",
    "read_model_info",
]
