"""Balanced parts (``shard.models.plan``; ``trio-shard plan``, ``serve --part``): contiguous
ranges that tile the model, only ranges the architecture table allows, the bytes a part holds
equal to what its slice carries, the largest part as small as any split allows, memory weights,
and clear errors. The real Gemma 3 case (tied 178 MB head) is in tests/test_gemma3.py."""

from __future__ import annotations

import itertools
import mmap
from pathlib import Path

import pytest

from shard.cli import main
from shard.engine import LayerRange
from shard.models import ensure_model, ensure_slice, layout
from shard.models import slice as slice_module
from shard.models.architectures import Model, lookup
from shard.models.header import read_model_info
from shard.models.arch_models import ensure_arch_model
from shard.models.plan import PlanError, parse_memory, parse_part, plan_parts


def _tiles(parts: list, total: int) -> bool:
    bounds = [p.layers for p in parts]
    return (bounds[0].start == 0 and bounds[-1].end == total
            and all(a.end == b.start for a, b in zip(bounds, bounds[1:])))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "llama4"])
def test_every_split_tiles_and_is_the_best_the_allowed_ranges_give(arch: str) -> None:
    path = ensure_arch_model(arch)
    one = plan_parts(path, 1)
    total = one[0].layers.end
    info = read_model_info(path)
    table, model = lookup(info.architecture), Model.of(info)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        src = layout.read_layout(buf)
    n_vocab = slice_module._n_vocab(src, info)

    def written(r: LayerRange) -> int:
        return sum(o.nbytes for o in slice_module._plan(src, info, r, n_vocab))

    for n in range(2, min(total, 4) + 1):
        try:
            parts = plan_parts(path, n)
        except PlanError as exc:  # llama4's boundaries are multiples of 4: fewer splits exist
            assert arch == "llama4" and "cannot serve" not in str(exc)
            continue
        assert len(parts) == n and _tiles(parts, total)
        assert [p.index for p in parts] == list(range(1, n + 1))
        # Brute force, priced by the slicer's own list of what a slice writes: no split into
        # allowed ranges has a smaller largest part, and each part's bytes are the slicer's.
        largest = {}
        for cuts in itertools.combinations(range(1, total), n - 1):
            bounds = [0, *cuts, total]
            ranges = [LayerRange(a, b) for a, b in zip(bounds, bounds[1:])]
            if any(table.refusal(model, r) is not None for r in ranges):
                continue
            largest[cuts] = max(written(r) for r in ranges)
        assert largest, "the planner found a split where none is allowed"
        assert tuple(p.layers.start for p in parts[1:]) in largest
        assert max(p.nbytes for p in parts) == min(largest.values())
        assert all(p.nbytes == written(p.layers) for p in parts)


def test_a_parts_bytes_are_what_its_slice_carries_and_memory_weights_the_split() -> None:
    path = ensure_model("tiny")
    parts = plan_parts(path, 2)
    assert [p.layers for p in parts] == [LayerRange(0, 2), LayerRange(2, 4)]
    for p in parts:
        size = ensure_slice(path, p.layers).stat().st_size
        assert p.nbytes <= size <= p.nbytes + 2**20  # the rest is the GGUF header and padding
    big_first = plan_parts(path, 2, [3 * 2**30, 2**30])
    assert big_first[0].layers.count > big_first[1].layers.count
    assert big_first[0].memory == 3 * 2**30


def test_requests_that_cannot_be_planned_are_errors(tmp_path: Path) -> None:
    path = ensure_model("tiny")
    with pytest.raises(PlanError, match="4 blocks: it cannot be split into 5 parts"):
        plan_parts(path, 5)
    with pytest.raises(PlanError, match="1 sizes for 2 parts"):
        plan_parts(path, 2, [2**30])
    with pytest.raises(PlanError, match="already a slice"):
        plan_parts(ensure_slice(path, LayerRange(0, 2)), 2)
    with pytest.raises(PlanError, match="no split of this llama4 model into 4 parts"):
        plan_parts(ensure_arch_model("llama4"), 4)  # 12 blocks cut only at multiples of 4: 3 parts
    assert parse_part("2/3") == (2, 3)
    assert parse_memory("8G, 512M,1.5g,8GiB,100") == [8 * 2**30, 512 * 2**20, int(1.5 * 2**30),
                                                     8 * 2**30, 100]
    for bad in ("0/3", "4/3", "x", "1/"):
        with pytest.raises(ValueError):
            parse_part(bad)
    for bad in ("0G", "8X", "", "0.5", "0.0001K"):
        with pytest.raises(ValueError):
            parse_memory(bad)


def test_serve_part_refuses_what_it_cannot_serve(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = str(ensure_model("tiny"))
    assert main(["serve", "--model", tiny, "--part", "1/5"]) == 2
    assert "--part 1/5: the model has 4 blocks" in capsys.readouterr().err
    assert main(["serve", "--model", tiny, "--part", "1/2", "--layers", "0:2"]) == 2
    assert "give one" in capsys.readouterr().err
    assert main(["serve", "--model", tiny, "--memory", "1G,1G"]) == 2
    assert "--memory goes with --part" in capsys.readouterr().err
    assert main(["plan", "--model", tiny, "--parts", "2", "--memory", "1G"]) == 2
    assert "1 sizes for 2 parts" in capsys.readouterr().err
    assert main(["plan", "--model", tiny, "--parts", "2"]) == 0
    out = capsys.readouterr().out
    assert "1/2     0:2" in out and "2/2     2:4" in out
