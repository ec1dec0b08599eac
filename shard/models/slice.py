"""Cut a GGUF model into a layer-range shard that stock llama.cpp loads as a smaller model.

Why a file and not a load option: unpatched llama.cpp always runs every block of the file it
loaded, so a shard serving blocks ``A..B-1`` needs a GGUF holding exactly those blocks, renamed
``blk.0..`` with ``<arch>.block_count = B - A``. Quantized tensors are copied byte for byte
(nothing is re-quantized), so a chain of shards computes what the whole model computes.

Non-block tensors are chosen so that a non-last shard never stores or computes the LM head:

* first shard (``A == 0``): the real vocabulary and ``token_embd`` (llama.cpp tokenizes and
  embeds); ``output.weight`` is dropped, so llama.cpp ties its head to ``token_embd`` and
  stores nothing for it (the engine stops the graph before the head runs);
* middle shards: a stub vocabulary of ``STUB_VOCAB_SIZE`` dummy tokens (tokenizer model
  ``none``), so ``token_embd`` and the tied head are a few bytes; they take hidden states in;
* last shard (``B == block_count``): ``output_norm``, ``output.weight`` and the full vocabulary
  (token pieces, end-of-generation ids); its ``token_embd`` is never used (hidden states come
  in), so it is an all-zero stand-in of the right shape in the smallest type the width allows
  (IQ1_S, 1.56 bits per weight: 6.4 MB instead of 35 MB on the bench model; llama.cpp still
  maps it in at load);
* ``output_norm`` and every other non-block tensor (e.g. ``rope_freqs``) are copied everywhere:
  llama.cpp requires them and they are small.

The file records its origin in metadata (``trio_shard.*`` keys): the source file's SHA-256 and
block count, the range and the slicer version. The engine reports the *source* fingerprint, so
every shard of one model and a whole-model worker agree on it.

Only the ``llama`` architecture is sliced: others differ in ways a slice must respect (Gemma
scales input embeddings, some add per-layer tensors outside ``blk.N``), and none has an
equivalence test yet.

Resource handling: the source is memory-mapped by ``gguf.GGUFReader`` and streamed tensor by
tensor; the output is written to a temporary file next to the target, fsynced and renamed into
place with ``os.replace``, so readers never see a partial slice.
"""

from __future__ import annotations

import mmap
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from shard.layers import LayerRange

from .fingerprint import file_fingerprint
from .write import atomic_output, cache_dir, gguf_writer

#: Bump when the slicer's output changes; it is part of the cached slice's file name.
SLICER_VERSION = 2
#: Architectures whose slices are covered by an equivalence test.
RANGE_ARCHITECTURES: tuple[str, ...] = ("llama",)
#: Dummy tokens in a middle shard's stub vocabulary (token_embd and the tied head: 1 row each).
STUB_VOCAB_SIZE = 1

KEY_SOURCE_SHA256 = "trio_shard.source.sha256"
KEY_SOURCE_BLOCK_COUNT = "trio_shard.source.block_count"
KEY_SOURCE_N_VOCAB = "trio_shard.source.n_vocab"
KEY_RANGE_START = "trio_shard.layer_range.start"
KEY_RANGE_END = "trio_shard.layer_range.end"
KEY_SLICER_VERSION = "trio_shard.slicer.version"

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_TOKEN_EMBD = "token_embd.weight"
_OUTPUT = "output.weight"


class SliceError(ValueError):
    """The model cannot be read or sliced as asked; the message says why, for a user."""


@dataclass(frozen=True)
class ModelInfo:
    """What the slicer and the engine need to know about a GGUF file before loading it.

    For a sliced file, ``layer_range`` is the range it serves and ``source_*`` describe the
    model it was cut from; for a whole model they are None.
    """

    path: Path
    architecture: str
    block_count: int  # blocks in this file
    n_embd: int
    source_sha256: str | None = None
    source_block_count: int | None = None
    source_n_vocab: int | None = None
    layer_range: LayerRange | None = None

    @property
    def is_slice(self) -> bool:
        return self.layer_range is not None


def read_model_info(path: Path) -> ModelInfo:
    """Read architecture, block count, width and slice metadata from the GGUF header.

    Fast on any model (the engine calls it on every load): only scalar keys are decoded, arrays
    such as the vocabulary are skipped (``gguf.GGUFReader`` takes seconds on a 32k vocabulary).
    Raises SliceError when the file is not a readable GGUF or lacks the keys a model needs.
    """
    path = Path(path)
    return _info(_read_scalars(path), path)


def slice_model(source: Path, layers: LayerRange, out: Path, *, progress: bool = False) -> Path:
    """Write blocks ``layers.start .. layers.end - 1`` of ``source`` to ``out`` (atomically).

    Raises SliceError for an unsupported architecture, a range outside the model, or a source
    that is itself a slice. ``progress`` shows a tqdm bar (bytes written) on stderr. Returns
    ``out``.
    """
    source, out = Path(source), Path(out)
    if not isinstance(layers, LayerRange):
        raise SliceError(f"layers must be a LayerRange, got {type(layers).__name__}")
    info = read_model_info(source)
    if info.is_slice:
        raise SliceError(f"{str(source)!r} is already a slice; slice the whole model instead")
    if info.architecture not in RANGE_ARCHITECTURES:
        raise SliceError(
            f"architecture {info.architecture!r} cannot be sliced into layer ranges yet "
            f"(supported: {', '.join(RANGE_ARCHITECTURES)})"
        )
    if layers.end > info.block_count:
        raise SliceError(
            f"layer range [{layers.start}, {layers.end}) is outside the model's "
            f"{info.block_count} blocks"
        )
    sha = file_fingerprint(source)
    reader = _open(source)  # every tensor and key, memory-mapped (seconds on a large vocabulary)
    with atomic_output(out) as tmp:
        _write_slice(reader, info, sha, layers, tmp, progress)
    return out


def slice_cache_path(source_sha256: str, layers: LayerRange) -> Path:
    """Where ``ensure_slice`` keeps the slice of a source with this fingerprint."""
    return cache_dir() / "slices" / f"{source_sha256}-L{layers.start}-{layers.end}-v{SLICER_VERSION}.gguf"


def ensure_slice(source: Path, layers: LayerRange, *, progress: bool = False) -> Path:
    """The cached slice of ``source`` for ``layers``, written on first use.

    The cache key is the source file's SHA-256 (not its path), the range and the slicer
    version, so an edited or replaced source never reuses a stale slice. Concurrent callers
    each write a temporary file; the atomic rename makes the race harmless.
    """
    source = Path(source)
    path = slice_cache_path(file_fingerprint(source), layers)
    if path.is_file():
        return path
    return slice_model(source, layers, path, progress=progress)


# ---- internals ---------------------------------------------------------------------------------


def _open(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path, "r")
    except FileNotFoundError:
        raise SliceError(f"model file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise SliceError(f"model path {str(path)!r} is a directory") from None
    except (ValueError, OSError, IndexError, KeyError) as exc:  # gguf's parse errors
        raise SliceError(f"{str(path)!r} is not a readable GGUF file ({exc})") from None


def _scalar(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


# GGUF value types (gguf.GGUFValueType) -> struct format of one scalar, little-endian.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read_scalars(path: Path) -> dict[str, Any]:
    """Every scalar key of a little-endian GGUF v2/v3 header (arrays are skipped, not decoded)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_scalars(buf)
    except FileNotFoundError:
        raise SliceError(f"model file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise SliceError(f"model path {str(path)!r} is a directory") from None
    except (ValueError, OSError, struct.error, UnicodeDecodeError) as exc:  # empty file, truncation
        raise SliceError(f"{str(path)!r} is not a readable GGUF file ({exc})") from None


def _parse_scalars(buf: mmap.mmap) -> dict[str, Any]:
    if buf[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (only little-endian v2 and v3 are read)")
    (n_kv,) = struct.unpack_from("<Q", buf, 16)
    pos = 24
    out: dict[str, Any] = {}

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        if at + 8 + n > len(buf):
            raise ValueError("truncated string")
        return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8"), at + 8 + n

    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if vtype == _STRING:
            out[key], pos = string(pos)
        elif vtype in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[vtype]
            (out[key],) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
        elif vtype == _ARRAY:
            sub, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if sub == _STRING:
                for _ in range(count):
                    (n,) = struct.unpack_from("<Q", buf, pos)
                    pos += 8 + n
            elif sub in _SCALAR_FORMATS:
                pos += count * struct.calcsize(_SCALAR_FORMATS[sub])
            else:
                raise ValueError(f"unsupported array element type {sub} in {key!r}")
            if pos > len(buf):
                raise ValueError(f"truncated array {key!r}")
        else:
            raise ValueError(f"unknown value type {vtype} for {key!r}")
    return out


def _int_key(meta: dict[str, Any], key: str, path: Path) -> int:
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
    if KEY_RANGE_START not in meta:
        return ModelInfo(path, arch, block_count, n_embd)
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
    )


def _n_vocab(reader: gguf.GGUFReader, arch: str) -> int:
    tokens = reader.get_field(gguf.Keys.Tokenizer.LIST)
    if tokens is not None:
        return len(tokens.data)
    size = _scalar(reader, gguf.Keys.LLM.VOCAB_SIZE.format(arch=arch))
    if isinstance(size, int):
        return size
    embd = next((t for t in reader.tensors if t.name == _TOKEN_EMBD), None)
    if embd is None:
        raise SliceError("the model has neither a vocabulary nor token embeddings")
    return int(embd.shape[-1])  # GGUF shapes are innermost first: [n_embd, n_vocab]


#: Stand-in types, smallest first (bits per weight: 1.56, 4.5); F16 when no block size fits.
_STAND_IN_TYPES = (gguf.GGMLQuantizationType.IQ1_S, gguf.GGMLQuantizationType.Q4_0)


def _stand_in(rows: int, n_embd: int) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """All-zero ``[rows, n_embd]`` in the smallest type the row width allows.

    Never computed with, but llama.cpp maps model files with MAP_POPULATE, so its bytes are
    read into the page cache at load: size matters, not just shape.
    """
    for qtype in _STAND_IN_TYPES:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if n_embd % block == 0:
            return np.zeros((rows, n_embd // block * type_size), dtype=np.uint8), qtype
    return np.zeros((rows, n_embd), dtype=np.float16), gguf.GGMLQuantizationType.F16


def _write_slice(
    reader: gguf.GGUFReader, info: ModelInfo, sha: str, layers: LayerRange, out: Path, progress: bool
) -> None:
    arch, total = info.architecture, info.block_count
    first, last = layers.start == 0, layers.end == total
    middle = not first and not last
    n_vocab = _n_vocab(reader, arch)
    has_output = any(t.name == _OUTPUT for t in reader.tensors)
    block_count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    vocab_size_key = gguf.Keys.LLM.VOCAB_SIZE.format(arch=arch)

    with gguf_writer(out, arch) as writer:
        for field in reader.fields.values():
            name = field.name
            # GGUF.* are the reader's virtual fields; the writer adds the architecture itself and
            # pads to its own alignment (copying general.alignment would misplace the data).
            if name.startswith("GGUF.") or name in (gguf.Keys.General.ARCHITECTURE, "general.alignment"):
                continue
            if middle and (name.startswith("tokenizer.") or name == vocab_size_key):
                continue
            vtype = field.types[0]
            sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            value = field.contents()
            if name == block_count_key:
                value = layers.count
            elif name.startswith(f"{arch}.") and sub_type is not None and len(field.data) == total:
                value = value[layers.start : layers.end]  # a per-layer hyperparameter array
            writer.add_key_value(name, value, vtype, sub_type=sub_type)
        if middle:
            writer.add_tokenizer_model("none")  # llama.cpp then creates vocab_size dummy tokens
            writer.add_vocab_size(STUB_VOCAB_SIZE)
        writer.add_uint32(KEY_SOURCE_BLOCK_COUNT, total)
        writer.add_uint32(KEY_SOURCE_N_VOCAB, n_vocab)
        writer.add_string(KEY_SOURCE_SHA256, sha)
        writer.add_uint32(KEY_RANGE_START, layers.start)
        writer.add_uint32(KEY_RANGE_END, layers.end)
        writer.add_uint32(KEY_SLICER_VERSION, SLICER_VERSION)

        plan: list[tuple[str, np.ndarray, gguf.GGMLQuantizationType]] = []
        for tensor in reader.tensors:
            m = _BLOCK.match(tensor.name)
            if m is not None:
                index = int(m.group(1))
                if layers.start <= index < layers.end:
                    plan.append((f"blk.{index - layers.start}.{m.group(2)}", tensor.data, tensor.tensor_type))
            elif tensor.name == _TOKEN_EMBD:
                if first or (last and not has_output):  # the last shard's head may be tied to it
                    plan.append((tensor.name, tensor.data, tensor.tensor_type))
                else:
                    data, qtype = _stand_in(STUB_VOCAB_SIZE if middle else n_vocab, info.n_embd)
                    plan.append((tensor.name, data, qtype))
            elif tensor.name == _OUTPUT:
                if last:
                    plan.append((tensor.name, tensor.data, tensor.tensor_type))
            else:
                plan.append((tensor.name, tensor.data, tensor.tensor_type))
        for name, data, qtype in plan:
            writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=qtype)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(
                total=sum(d.nbytes for _, d, _ in plan), unit="B", unit_scale=True,
                desc=f"slicing blocks {layers.start}:{layers.end}", file=sys.stderr,
            )
        try:
            for _, data, _ in plan:
                writer.write_tensor_data(data, tensor_endianess=reader.endianess)
                if bar is not None:
                    bar.update(data.nbytes)
        finally:
            if bar is not None:
                bar.close()


__all__ = [
    "KEY_RANGE_END",
    "KEY_RANGE_START",
    "KEY_SLICER_VERSION",
    "KEY_SOURCE_BLOCK_COUNT",
    "KEY_SOURCE_N_VOCAB",
    "KEY_SOURCE_SHA256",
    "RANGE_ARCHITECTURES",
    "SLICER_VERSION",
    "STUB_VOCAB_SIZE",
    "ModelInfo",
    "SliceError",
    "ensure_slice",
    "read_model_info",
    "slice_cache_path",
    "slice_model",
]
