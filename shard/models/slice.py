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
  llama.cpp still maps it in at load), written as a hole (no disk blocks). Nothing smaller
  loads: llama.cpp checks its shape and wants every tensor's bytes of its own, in order;
* ``output_norm`` and every other non-block tensor (e.g. ``rope_freqs``) are copied everywhere:
  llama.cpp requires them and they are small.

The file records its origin in metadata (``trio_shard.*`` keys): the source file's SHA-256 and
block count, the range and the slicer version. The engine reports the *source* fingerprint, so
every shard of one model and a whole-model worker agree on it.

Speed and memory: nothing the slice does not change is decoded (``shard.models.layout``: the
header is walked once, each unchanged key copied as bytes, each tensor copied by the kernel or
through one buffer), where ``gguf.GGUFReader`` would decode every vocabulary array first
(seconds and about a GB per range on a real model's vocabulary). The output is written to a
temporary file next to the target, fsynced and renamed into place with ``os.replace``, so
readers never see a partial slice.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import gguf

from shard.layers import LayerRange

from . import layout
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
from .write import atomic_output, cache_dir

#: Bump when the slicer's output changes; it is part of the cached slice's file name.
SLICER_VERSION = 3
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
    with atomic_output(out) as tmp:
        _write_slice(source, info, sha, layers, tmp, progress)
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


@contextlib.contextmanager
def _mapped(path: Path) -> Iterator[mmap.mmap]:
    """``path`` memory-mapped read-only (closed on exit)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            yield buf
    except FileNotFoundError:
        raise SliceError(f"model file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise SliceError(f"model path {str(path)!r} is a directory") from None


def _read_layout(buf: mmap.mmap, path: Path) -> layout.Layout:
    try:
        return layout.read_layout(buf)
    except (ValueError, struct.error, UnicodeDecodeError, KeyError) as exc:
        raise SliceError(f"{str(path)!r} is not a readable GGUF file ({exc})") from None


def _n_vocab(src: layout.Layout, info: ModelInfo) -> int:
    if info.n_vocab is not None:
        return info.n_vocab
    embd = next((t for t in src.tensors if t.name == _TOKEN_EMBD), None)
    if embd is None:
        raise SliceError("the model has neither a vocabulary nor token embeddings")
    return int(embd.shape[-1])  # GGUF shapes are innermost first: [n_embd, n_vocab]


#: Stand-in types, smallest first (bits per weight: 1.56, 4.5); F16 when no block size fits.
_STAND_IN_TYPES = (gguf.GGMLQuantizationType.IQ1_S, gguf.GGMLQuantizationType.Q4_0)


def _stand_in(rows: int, n_embd: int) -> tuple[tuple[int, int], int, int]:
    """An all-zero ``[rows, n_embd]`` tensor in the smallest type the row width allows: its
    GGUF shape, type and size in bytes. Never computed with, but llama.cpp maps model files with
    MAP_POPULATE, so its bytes are read into the page cache at load: size matters."""
    for qtype in _STAND_IN_TYPES:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if n_embd % block == 0:
            return (n_embd, rows), int(qtype), rows * (n_embd // block) * type_size
    return (n_embd, rows), int(gguf.GGMLQuantizationType.F16), rows * n_embd * 2


def stand_in_bytes(rows: int, n_embd: int) -> int:
    """Bytes of the stand-in a part writes for a ``[rows, n_embd]`` tensor it never uses."""
    return _stand_in(rows, n_embd)[2]


@dataclass(frozen=True)
class _Out:
    """One tensor of the slice: copied from ``source`` (an absolute offset), or all zeros."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    nbytes: int
    source: int | None = None


def _plan(src: layout.Layout, info: ModelInfo, layers: LayerRange, n_vocab: int) -> list[_Out]:
    arch = lookup(info.architecture)
    first, last = layers.start == 0, layers.end == info.block_count
    middle = not first and not last
    tied = not any(t.name == _OUTPUT for t in src.tensors)
    plan: list[_Out] = []
    for t in src.tensors:
        m = _BLOCK.match(t.name)
        if m is not None:
            index = int(m.group(1))
            if layers.start <= index < layers.end:
                name = f"blk.{index - layers.start}.{m.group(2)}"
                plan.append(_Out(name, t.shape, t.ggml_type, t.nbytes, source=t.offset))
            continue
        keep = arch.keep(t.name, first=first, last=last, tied=tied)
        if keep is Keep.REAL:
            plan.append(_Out(t.name, t.shape, t.ggml_type, t.nbytes, source=t.offset))
        elif keep is Keep.STAND_IN:
            shape, qtype, nbytes = _stand_in(STUB_VOCAB_SIZE if middle else n_vocab, info.n_embd)
            plan.append(_Out(t.name, shape, qtype, nbytes))
    return plan


def _keys(buf: mmap.mmap, src: layout.Layout, info: ModelInfo, sha: str, layers: LayerRange,
          n_vocab: int) -> list[bytes]:
    """The slice's key-value entries: the source's as bytes, except the edited ones."""
    arch_name = info.architecture
    arch = lookup(arch_name)
    first, last = layers.start == 0, layers.end == info.block_count
    middle = not first and not last
    edits = arch.slice_edits(Model.of(info), layers, first=first)
    vocab_size_key = gguf.Keys.LLM.VOCAB_SIZE.format(arch=arch_name)
    out: list[bytes] = []
    for span in src.keys:
        name = span.name
        if middle and (name.startswith("tokenizer.") or name == vocab_size_key):
            continue
        if name not in edits:
            out.append(bytes(buf[span.start:span.end]))
            continue
        edit = edits.pop(name)
        if edit is None:
            continue
        vtype = int(edit.type) if edit.type is not None else span.vtype
        sub = edit.sub_type if edit.type is not None else span.sub_type
        out.append(layout.encode_key(name, vtype, edit.value, None if sub is None else int(sub)))
    for name, edit in edits.items():  # keys the source does not have
        if edit is not None:
            assert edit.type is not None, name
            sub = None if edit.sub_type is None else int(edit.sub_type)
            out.append(layout.encode_key(name, int(edit.type), edit.value, sub))
    u32, text = int(gguf.GGUFValueType.UINT32), int(gguf.GGUFValueType.STRING)
    if middle:  # llama.cpp then creates vocab_size dummy tokens
        out.append(layout.encode_key(gguf.Keys.Tokenizer.MODEL, text, "none"))
        out.append(layout.encode_key(vocab_size_key, u32, STUB_VOCAB_SIZE))
    out.append(layout.encode_key(KEY_SOURCE_BLOCK_COUNT, u32, info.block_count))
    out.append(layout.encode_key(KEY_SOURCE_N_VOCAB, u32, n_vocab))
    out.append(layout.encode_key(KEY_SOURCE_SHA256, text, sha))
    out.append(layout.encode_key(KEY_RANGE_START, u32, layers.start))
    out.append(layout.encode_key(KEY_RANGE_END, u32, layers.end))
    out.append(layout.encode_key(KEY_SLICER_VERSION, u32, SLICER_VERSION))
    return out


def _write_slice(source: Path, info: ModelInfo, sha: str, layers: LayerRange, out: Path,
                 progress: bool) -> None:
    with _mapped(source) as buf:
        src = _read_layout(buf, source)
        n_vocab = _n_vocab(src, info)
        keys = _keys(buf, src, info, sha, layers, n_vocab)
        plan = _plan(src, info, layers, n_vocab)
    align = src.alignment
    offsets: dict[str, int] = {}
    at = 0
    for o in plan:  # llama.cpp wants the tensors' bytes in order, each aligned, none shared
        offsets[o.name] = at
        at += o.nbytes + len(layout.padding(o.nbytes, align))
    infos = [layout.encode_tensor_info(o.name, o.shape, o.ggml_type, offsets[o.name]) for o in plan]
    head = layout.encode_header(3, len(plan), len(keys)) + b"".join(keys) + b"".join(infos)
    head += layout.padding(len(head), align)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=at, unit="B", unit_scale=True,
                   desc=f"slicing blocks {layers.start}:{layers.end}", file=sys.stderr)
    try:
        with open(source, "rb") as src_file, open(out, "wb") as dst:
            dst.write(head)
            written = 0
            for o in plan:
                if o.source is None:  # a stand-in: a hole, no disk blocks (read back as zeros)
                    dst.seek(o.nbytes, os.SEEK_CUR)
                else:
                    _copy_range(src_file, dst, o.source, o.nbytes)
                dst.write(layout.padding(o.nbytes, align))
                if bar is not None:
                    bar.update(offsets[o.name] + o.nbytes - written)
                    written = offsets[o.name] + o.nbytes
            dst.truncate(len(head) + at)  # a stand-in last leaves a hole at the end
            dst.flush()
            os.fsync(dst.fileno())
    finally:
        if bar is not None:
            bar.close()


#: Bytes moved per read/write when the kernel cannot copy between the files itself.
_COPY_CHUNK = 4 * 1024 * 1024


def _copy_range(src: BinaryIO, dst: BinaryIO, offset: int, size: int) -> None:
    """Copy ``size`` bytes of ``src`` from ``offset`` to ``dst``'s position: in the kernel
    (``copy_file_range``) where it can, else through one reused buffer (never the whole tensor
    in memory)."""
    dst.flush()
    if hasattr(os, "copy_file_range"):
        try:
            while size > 0:
                n = os.copy_file_range(src.fileno(), dst.fileno(), size, offset)
                if n <= 0:
                    break
                offset += n
                size -= n
            if size == 0:
                dst.seek(0, os.SEEK_END)
                return
        except OSError:
            pass  # e.g. across file systems on old kernels: copy the rest by hand
        dst.seek(0, os.SEEK_END)
    chunk = bytearray(min(_COPY_CHUNK, size))
    view = memoryview(chunk)
    while size > 0:
        n = os.preadv(src.fileno(), [view[:min(size, len(chunk))]], offset)
        if n <= 0:
            raise SliceError("the model file ended inside a tensor")
        dst.write(view[:n])
        offset += n
        size -= n


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
