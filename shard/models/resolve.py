"""Which file a worker loads for a model argument and the blocks it serves.

A worker is told a model (a GGUF file, a packaged model's name such as ``gemma3-270m``, or
nothing: the embedded tiny model, written on first use) and optionally which part of it to
serve: a layer range, or the I-th of N balanced parts (``plan_parts``, as ``trio-shard plan``
prints them). llama.cpp runs every block of the file it loads, so a range of a whole model
becomes its cached slice (``ensure_slice``); a model that is already a slice is loaded as is
(the engine checks that its range matches). One function does all of it so that ``serve`` and
any other caller resolve a model the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shard.layers import LayerRange

from .header import SliceError, read_model_info
from .plan import PlanError, plan_parts
from .real import packaged_name, resolve_model
from .slice import ensure_slice
from .write import ensure_model

__all__ = ["PartError", "ServedModel", "resolve_served_model"]


@dataclass(frozen=True)
class ServedModel:
    """What a worker serves: the file to load, its blocks and the model's name."""

    path: Path  # the model, or the cached slice of its range
    layers: LayerRange | None  # None: the whole model (or the range a slice given holds)
    name: str  # a packaged model's name, "" for a file or the tiny model
    part: tuple[int, int] | None = None  # (I, N) when the range is the I-th of N parts


class PartError(PlanError):
    """Part ``index`` of ``count`` cannot be planned for this model (the message says why)."""

    def __init__(self, index: int, count: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index
        self.count = count


def resolve_served_model(
    model: str | Path | None,
    *,
    layers: LayerRange | None = None,
    part: tuple[int, int] | None = None,
    memory: Sequence[int] | None = None,
    progress: bool = False,
) -> ServedModel:
    """The file to load for ``model`` serving ``layers``, or ``part`` = (I, N) planned with
    ``memory`` (one size per part, as ``plan_parts`` takes it), slicing into the cache on first
    use (``progress``: show the slicer's progress).

    Raises RealModelError (a packaged model that cannot be assembled), PartError (no such part),
    SliceError (a range the architecture table refuses, a file that is no model) and ValueError
    for both ``layers`` and ``part``, or ``memory`` without ``part``.
    """
    if (layers is not None and part is not None) or (memory is not None and part is None):
        raise ValueError("give a layer range or a part (with its memory sizes), not both")
    path = resolve_model(model) if model is not None else ensure_model("tiny")
    if part is not None:
        index, count = part
        try:
            layers = plan_parts(path, count, memory)[index - 1].layers
        except SliceError as exc:  # PlanError included
            raise PartError(index, count, str(exc)) from None
    if layers is not None and not read_model_info(path).is_slice:
        path = ensure_slice(path, layers, progress=progress)
    return ServedModel(path=path, layers=layers, name=packaged_name(model), part=part)
