"""Balanced parts: which contiguous layer ranges N workers should serve so that each holds a
fair share of the model's bytes (``trio-shard plan``, ``serve --part i/N``).

Why bytes and not blocks: a part's memory is its blocks plus what the slicer keeps beside them
(``shard.models.slice``): the first part holds the token embeddings, the last the output norm and
the LM head (on a tied head: the embeddings again), middle parts only stand-ins. On Gemma 3 270M
the embeddings are 178 MB and all 18 blocks together 68 MB, so splitting by block count would
give the first and last parts most of the memory. Here every candidate range is priced exactly as
the slicer would write it, and a range the architecture table refuses is never proposed.

The split minimises the largest part's load (its bytes divided by its worker's memory weight,
``memory``: all equal by default), then, among the splits with that largest load, the sum of
the squared loads (so parts are as even as the layer sizes allow). Both are exact dynamic
programmes over the block boundaries: O(N * L^2) for L blocks, instant for any GGUF model.

``serve --part i/N`` runs the same function on the same file, so a worker started with it and a
``plan`` printed earlier agree; the range then goes through ``ensure_slice`` like ``--layers``.
"""

from __future__ import annotations

import mmap
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shard.layers import LayerRange

from . import layout
from .architectures import Architecture, Keep, Model, lookup
from .header import ModelInfo, SliceError, read_model_info
from .slice import STUB_VOCAB_SIZE, stand_in_bytes

__all__ = ["Part", "PlanError", "parse_memory", "parse_part", "plan_parts"]

_BLOCK = re.compile(r"^blk\.(\d+)\.")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class PlanError(SliceError):
    """No split of the model into the parts asked for is possible (or the request is bad)."""


@dataclass(frozen=True)
class Part:
    """One part of a plan: 1-based ``index`` of ``count``, its blocks and the bytes it holds."""

    index: int
    count: int
    layers: LayerRange
    nbytes: int
    memory: int | None = None  # the memory weight it was planned for, if given

    def as_dict(self) -> dict[str, object]:
        return {"part": f"{self.index}/{self.count}", "layers": f"{self.layers.start}:{self.layers.end}",
                "blocks": self.layers.count, "bytes": self.nbytes, "memory": self.memory}


def parse_part(text: str) -> tuple[int, int]:
    """``"i/N"`` -> (i, N), 1 <= i <= N; ValueError with the rule otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if m is None:
        raise ValueError(f"expected I/N (the I-th of N parts, 1-based), got {text!r}")
    i, n = int(m.group(1)), int(m.group(2))
    if not 1 <= i <= n:
        raise ValueError(f"part {i}/{n}: I must be between 1 and N (1 is the first part)")
    return i, n


def parse_memory(text: str) -> list[int]:
    """``"8G,4G,4096M"`` -> bytes per worker (suffixes K, M, G, T are powers of 1024)."""
    sizes = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)I?B?\s*", item.upper())
        size = int(float(m.group(1)) * _UNITS[m.group(2)]) if m is not None else 0
        if size < 1:
            raise ValueError(f"expected sizes such as 8G,4G or 512MiB (one per part, at least a "
                             f"byte), got {item.strip()!r}")
        sizes.append(size)
    return sizes


def plan_parts(path: Path, parts: int, memory: Sequence[int] | None = None) -> list[Part]:
    """Split the whole model at ``path`` into ``parts`` contiguous ranges (see the module
    docstring). ``memory``: one weight per part (bytes of the worker meant to serve it).
    Raises PlanError when the request or the model allows no split."""
    if parts < 1:
        raise PlanError("the number of parts must be at least 1")
    if memory is not None and len(memory) != parts:
        raise PlanError(f"--memory lists {len(memory)} sizes for {parts} parts: give one per part")
    info = read_model_info(Path(path))
    if info.is_slice:
        raise PlanError(f"{str(path)!r} is already a slice; plan the whole model")
    arch = lookup(info.architecture)
    total = info.block_count
    if parts > 1 and not arch.supported:
        raise PlanError(f"architecture {info.architecture!r} cannot be split into layer ranges: "
                        f"{arch.refused}")
    if parts > total:
        raise PlanError(f"the model has {total} blocks: it cannot be split into {parts} parts")
    blocks, fixed = _costs(Path(path), info, arch)
    prefix = [0]
    for b in blocks:
        prefix.append(prefix[-1] + b)
    model = Model.of(info)
    weights = [float(m) for m in memory] if memory is not None else [1.0] * parts

    def cost(a: int, b: int) -> int | None:
        """Bytes of blocks a..b-1 as a part, None when the table refuses the range."""
        if (a, b) != (0, total) and arch.refusal(model, LayerRange(a, b)) is not None:
            return None
        return prefix[b] - prefix[a] + fixed[(a == 0, b == total)]

    costs = {(a, b): cost(a, b) for a in range(total) for b in range(a + 1, total + 1)}
    best_max = _split(parts, total, costs, weights, None)
    if best_max is None:
        raise PlanError(f"no split of this {info.architecture} model into {parts} parts has only "
                        f"ranges it can serve: {arch.allowed(model)}")
    cuts = _split(parts, total, costs, weights, best_max[0])
    assert cuts is not None
    bounds = [0, *cuts[1], total]
    return [
        Part(k + 1, parts, LayerRange(a, b), costs[(a, b)] or 0,
             None if memory is None else int(memory[k]))
        for k, (a, b) in enumerate(zip(bounds, bounds[1:]))
    ]


def _split(
    parts: int, total: int, costs: dict[tuple[int, int], int | None], weights: list[float],
    bound: float | None,
) -> tuple[float, list[int]] | None:
    """Without ``bound``: the smallest achievable largest load (and a split reaching it).
    With ``bound``: the split with the smallest sum of squared loads whose every load is within
    ``bound`` (a relative 1e-9 of slack for float error). Returns (value, inner cuts) or None."""
    inf = float("inf")
    # best[k][b]: blocks 0..b-1 as the first k parts -> (value, previous cut)
    best: list[list[tuple[float, int]]] = [[(inf, -1)] * (total + 1) for _ in range(parts + 1)]
    best[0][0] = (0.0, -1)
    for k in range(1, parts + 1):
        w = weights[k - 1]
        for b in range(k, total + 1):
            for a in range(k - 1, b):
                prev = best[k - 1][a][0]
                c = costs.get((a, b))
                if prev == inf or c is None:
                    continue
                load = c / w
                if bound is None:
                    value = max(prev, load)
                elif load > bound * (1 + 1e-9):
                    continue
                else:
                    value = prev + load * load
                if value < best[k][b][0]:
                    best[k][b] = (value, a)
    if best[parts][total][0] == inf:
        return None
    cuts, b = [], total
    for k in range(parts, 0, -1):
        a = best[k][b][1]
        cuts.append(a)
        b = a
    return best[parts][total][0], sorted(cuts)[1:]  # drop the leading 0


def _costs(path: Path, info: ModelInfo, arch: Architecture
           ) -> tuple[list[int], dict[tuple[bool, bool], int]]:
    """Bytes of every block, and of the non-block tensors a part keeps, by (first, last)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            lay = layout.read_layout(buf)
    except OSError as exc:
        raise PlanError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    except (ValueError, KeyError) as exc:
        raise PlanError(f"{str(path)!r} is not a readable GGUF file ({exc})") from None
    blocks = [0] * info.block_count
    others = []
    for t in lay.tensors:
        m = _BLOCK.match(t.name)
        if m is not None and int(m.group(1)) < len(blocks):
            blocks[int(m.group(1))] += t.nbytes
        else:
            others.append(t)
    tied = not any(t.name == "output.weight" for t in lay.tensors)
    vocab = info.n_vocab or next((int(t.shape[-1]) for t in others if t.name == "token_embd.weight"), 0)
    fixed = {}
    for first in (False, True):
        for last in (False, True):
            middle = not first and not last
            size = 0
            for t in others:
                keep = arch.keep(t.name, first=first, last=last, tied=tied)
                if keep is Keep.REAL:
                    size += t.nbytes
                elif keep is Keep.STAND_IN:
                    size += stand_in_bytes(STUB_VOCAB_SIZE if middle else vocab, info.n_embd)
            fixed[(first, last)] = size
    return blocks, fixed
