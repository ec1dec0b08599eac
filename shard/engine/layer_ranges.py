"""What a model file serves as a layer range, and how a shard's input differs from a whole
model's: the engine's side of the architecture table (``shard.models.architectures``).

A range is served from a file cut by ``shard.models.slice``; this module decides, before
llama.cpp sees the file, which range it can serve for a requested one (refusing with the
table's reason), whether llama.cpp could load it without aborting the process, what the
capabilities say about layer ranges of its architecture, and how hidden-state input is adapted
where llama.cpp treats it like token embeddings (``EmbdInput``). Pure Python: no native calls.
"""

from __future__ import annotations

import numpy as np

from shard.layers import LayerRange
from shard.models.architectures import Model, lookup
from shard.models.header import ModelInfo

from .errors import InvalidInput, UnsupportedFeature
from .types import LayerRangeSupport


def range_support(info: ModelInfo | None, architecture: str) -> LayerRangeSupport:
    """What ``Capabilities.layer_ranges`` says: whether layer ranges of this (source) model are
    served and on which boundaries, or why not. ``info`` None: a header the slicer cannot read
    (``architecture`` is then llama.cpp's name for the model)."""
    arch = lookup(info.architecture if info is not None else architecture)
    if not arch.supported:
        return LayerRangeSupport(False, arch.refused or "")
    if info is None:
        return LayerRangeSupport(False, "the model file's GGUF header cannot be read by the slicer")
    if info.is_slice:  # the slice's header describes its blocks only; the table's rule stands
        return LayerRangeSupport(True, f"allowed boundaries: {arch.boundaries}")
    whole, total = Model.of(info), info.block_count
    if total < 2:
        return LayerRangeSupport(False, "the model has a single block")
    refusals = [arch.refusal(whole, LayerRange(0, c)) or arch.refusal(whole, LayerRange(c, total))
                for c in range(1, total)]
    if all(refusals):
        return LayerRangeSupport(False, refusals[len(refusals) // 2] or "")
    return LayerRangeSupport(True, arch.allowed(whole))


def served_range(info: ModelInfo, requested: LayerRange | None) -> LayerRange:
    """The layer range a file can serve for a requested range (None: whatever the file holds).

    A sliced file serves exactly its recorded range. A whole model serves itself; a strict
    range of a whole model is refused (slice it first: loading never writes files), with the
    architecture table's reason when its architecture cannot be sliced at all.
    """
    path = str(info.path)
    total = info.n_layers_total
    if requested is not None and requested.end > total:
        raise InvalidInput(
            f"layer range [{requested.start}, {requested.end}) is outside the model's {total} blocks"
        )
    arch = lookup(info.architecture)
    if info.layer_range is not None:
        recorded = info.layer_range
        if requested is not None and requested != recorded:
            raise InvalidInput(
                f"{path!r} is a slice of layers [{recorded.start}, {recorded.end}); it cannot "
                f"serve [{requested.start}, {requested.end})"
            )
        if recorded.count != total and not arch.supported:
            raise UnsupportedFeature(f"layer ranges of architecture {info.architecture!r} are not supported: {arch.refused}")
        return recorded
    whole = LayerRange(0, total)
    if requested is None or requested == whole:
        return whole
    if not arch.supported:
        raise UnsupportedFeature(f"layer ranges of architecture {info.architecture!r} are not supported: {arch.refused}")
    reason = arch.refusal(Model.of(info), requested)
    if reason is not None:
        raise UnsupportedFeature(f"layer range [{requested.start}, {requested.end}) cannot be served: {reason}")
    raise InvalidInput(
        f"{path!r} is a whole {total}-layer model: slice it first (shard.models.ensure_slice, or "
        f"`trio-shard slice --layers {requested.start}:{requested.end}`) and load the slice"
    )


def check_loadable(info: ModelInfo) -> None:
    """Refuse a file llama.cpp would abort the process on (InvalidInput), before it sees it."""
    reason = lookup(info.architecture).load_refusal(Model.of(info))
    if reason is not None:
        raise InvalidInput(f"{str(info.path)!r} cannot be loaded: {reason}")


class EmbdInput:
    """Writes a shard's incoming hidden-state rows into llama.cpp's ``batch.embd``.

    Where llama.cpp multiplies hidden-state input by a factor ``s`` (the table's
    ``embd_input_scale``: Gemma 2 scales even ``batch.embd`` rows by ``sqrt(n_embd)``), each row
    ``x`` is written as ``float32(x / s)``. ggml's scale is one float32 multiply, so llama.cpp
    sees ``x`` back exactly where the rounding allows and within one ulp elsewhere (a power-of-
    two ``s`` is always exact; for ``s = sqrt(96)`` about 87% of values are, and no neighbouring
    float32 does better): the reason such an architecture's chain has a tolerance.
    """

    def __init__(self, scale: float | None) -> None:
        self.scale = None if scale is None or scale == 1.0 else np.float32(scale)

    @classmethod
    def for_model(cls, info: ModelInfo | None, *, first: bool) -> EmbdInput:
        if first or info is None:
            return cls(None)
        scale = lookup(info.architecture).embd_input_scale
        return cls(None if scale is None else scale(Model.of(info)))

    def write(self, dest: np.ndarray, rows: np.ndarray) -> None:
        if self.scale is None:
            dest[...] = rows
        else:
            np.divide(rows, self.scale, out=dest, dtype=np.float32)


__all__ = ["EmbdInput", "check_loadable", "range_support", "served_range"]
