"""Layer ranges: the value type the engine contract, the model tools (``shard.models``) and the
transport share.

A leaf module: it imports only ``shard.errors``, so ``shard.models`` (the slicer) and
``shard.engine`` (which loads slices) both depend on it instead of on each other. Import it
from here or, as before, from ``shard.engine``.
"""

from __future__ import annotations

from dataclasses import dataclass

from shard.errors import InvalidInput


@dataclass(frozen=True)
class LayerRange:
    """Half-open range ``[start, end)`` of transformer blocks served by this shard."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise InvalidInput(f"layer range [{self.start}, {self.end}) is empty or negative")

    @property
    def count(self) -> int:
        return self.end - self.start


__all__ = ["LayerRange"]
