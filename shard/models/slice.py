"""Cut a GGUF model into a layer-range shard that stock llama.cpp loads as a smaller model.

Why a file and not a load option: unpatched llama.cpp always runs every block of the file it
loaded, so a shard serving blocks ``A..B-1`` needs a GGUF holding exactly those blocks, renamed
``blk.0..`` with ``<arch>.block_count = B - A``. Quantized tensors are copied byte for byte
(nothing is re-quantized), so a chain of shards computes what the whole model computes.

What a slice must change besides the blocks depends on the architecture; all of it comes from
the architecture table (``shard.models.architectures``): per-layer metadata arrays cut to the
range, the sliding-window pattern written out per block, keys a slice drops or rewrites, which
ranges are refused and why. This module applies it and knows no architecture by name.

Non-block tensors are chosen so that a non-last shard never stores or computes the LM head
(``Architecture.keep``):

* first shard (``A == 0``): the real vocabulary and ``token_embd`` (llama.cpp tokenizes and
  embeds); the head (``output.*``) is dropped, so llama.cpp ties it to ``token_embd`` and stores
  nothing for it (the engine stops the graph before the head runs); an architecture that
  requires ``output.weight`` gets an all-zero stand-in;
* middle shards: a stub vocabulary of ``STUB_VOCAB_SIZE`` dummy tokens (tokenizer model
  ``none``), so ``token_embd`` and the tied head are a few bytes; they take hidden states in;
* last shard (``B == block_count``): ``output_norm``, the head and the full vocabulary (token
  pieces, end-of-generation ids); its ``token_embd`` is never used (hidden states come in), so
  unless it is the (tied) head it is an all-zero stand-in of the right shape in the smallest type
  the width allows (IQ1_S, 1.56 bits per weight: 6.4 MB instead of 35 MB on the bench model;
  llama.cpp still maps it in at load);
* ``output_norm`` and every other non-block tensor (e.g. ``rope_freqs``) are copied everywhere:
  llama.cpp requires them and they are small.

The file records its origin in metadata (``trio_shard.*`` keys): the source file's SHA-256 and
block count, the range and the slicer version. The engine reports the *source* fingerprint, so
every shard of one model and a whole-model worker agree on it.

Resource handling: the source is memory-mapped by ``gguf.GGUFReader`` and streamed tensor by
tensor; the output is written to a temporary file next to the target, fsynced and renamed into
place with ``os.replace``, so readers never see a partial slice.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from shard.layers import LayerRange

from .architectures import Keep, Model, lookup, supported
from .fingerprint import file_fingerprint
from .header import (
    KEY_RANGE_END,
    KEY_RANGE_START,
    KEY_SLICER_VERSION,
    KEY_SOURCE_BLOCK_COUNT,
    KEY_SOURCE_N_VOCAB,
    KEY_SOURCE_SHA256,
    ModelInfo,
    SliceError,
    read_model_info,
)
from .write import atomic_output, cache_dir, gguf_writer

#: Bump when the slicer's output changes; it is part of the cached slice's file name.
SLICER_VERSION = 2
#: Architectures whose layer ranges are sliced and served (the table's supported rows).
RANGE_ARCHITECTURES: tuple[str, ...] = supported()
#: Dummy tokens in a middle shard's stub vocabulary (token_embd and the tied head: 1 row each).
STUB_VOCAB_SIZE = 1

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_TOKEN_EMBD = "token_embd.weight"
_OUTPUT = "output.weight"


def slice_model(source: Path, layers: LayerRange, out: Path, *, progress: bool = False) -> Path:
    """Write blocks ``layers.start .. layers.end - 1`` of ``source`` to ``out`` (atomically).

    Raises SliceError for a range the architecture table refuses (the message says why and
    which boundaries are allowed), a range outside the model, or a source that is itself a
    slice. ``progress`` shows a tqdm bar (bytes written) on stderr. Returns ``out``.
    """
    source, out = Path(source), Path(out)
    if not isinstance(layers, LayerRange):
        raise SliceError(f"layers must be a LayerRange, got {type(layers).__name__}")
    info = read_model_info(source)
    if info.is_slice:
        raise SliceError(f"{str(source)!r} is already a slice; slice the whole model instead")
    arch = lookup(info.architecture)
    if not arch.supported:
        raise SliceError(f"architecture {info.architecture!r} cannot be sliced into layer ranges: {arch.refused}")
    if layers.end > info.block_count:
        raise SliceError(
            f"layer range [{layers.start}, {layers.end}) is outside the model's "
            f"{info.block_count} blocks"
        )
    reason = arch.refusal(Model.of(info), layers)
    if reason is not None:
        raise SliceError(f"cannot slice blocks [{layers.start}, {layers.end}) of {str(source)!r}: {reason}")
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
    arch_name, total = info.architecture, info.block_count
    arch = lookup(arch_name)
    first, last = layers.start == 0, layers.end == total
    middle = not first and not last
    n_vocab = _n_vocab(reader, arch_name)
    tied = not any(t.name == _OUTPUT for t in reader.tensors)
    edits = arch.slice_edits(Model.of(info), layers, first=first)
    vocab_size_key = gguf.Keys.LLM.VOCAB_SIZE.format(arch=arch_name)

    with gguf_writer(out, arch_name) as writer:
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
            if name in edits:
                edit = edits.pop(name)
                if edit is None:
                    continue
                value = edit.value
                if edit.type is not None:
                    vtype, sub_type = edit.type, edit.sub_type
            writer.add_key_value(name, value, vtype, sub_type=sub_type)
        for name, edit in edits.items():  # keys the source does not have
            if edit is not None:
                assert edit.type is not None, name
                writer.add_key_value(name, edit.value, edit.type, sub_type=edit.sub_type)
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
                continue
            keep = arch.keep(tensor.name, first=first, last=last, tied=tied)
            if keep is Keep.REAL:
                plan.append((tensor.name, tensor.data, tensor.tensor_type))
            elif keep is Keep.STAND_IN:
                data, qtype = _stand_in(STUB_VOCAB_SIZE if middle else n_vocab, info.n_embd)
                plan.append((tensor.name, data, qtype))
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


# ModelInfo, SliceError and read_model_info live in shard.models.header; named here as before.
__all__ = [
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
