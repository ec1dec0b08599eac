"""Which file a worker loads (``shard.models.resolve``, what ``serve --model/--layers/--part``
uses): a whole model as is, a range of it sliced into the cache once, a slice as is, the I-th of
N balanced parts, a packaged model's name, and the errors for what cannot be served. Fast: the
tiny model the project's own writer makes (no llama.cpp)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from shard.layers import LayerRange
from shard.models import (
    SliceError,
    ensure_model,
    ensure_slice,
    file_fingerprint,
    read_model_info,
    slice_cache_path,
)
from shard.models.plan import PlanError, plan_parts
from shard.models.real import REAL_MODELS, RealModelError, real_model_path
from shard.models.resolve import PartError, ServedModel, resolve_served_model


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_model("tiny")  # (in the shared cache, like tests/test_slice.py's)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty model cache, so that what is sliced here is sliced by the test."""
    monkeypatch.setenv("TRIO_SHARD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_whole_model_is_served_as_is(tiny: Path) -> None:
    assert resolve_served_model(tiny) == ServedModel(path=tiny, layers=None, name="", part=None)
    assert resolve_served_model(str(tiny)).path == tiny
    assert resolve_served_model(None) == ServedModel(path=tiny, layers=None, name="")  # the default


def test_a_range_is_sliced_into_the_cache_once(tiny: Path, cache: Path) -> None:
    served = resolve_served_model(tiny, layers=LayerRange(1, 3))
    assert served.layers == LayerRange(1, 3) and served.name == ""
    assert served.path == slice_cache_path(file_fingerprint(tiny), LayerRange(1, 3))
    assert served.path.is_relative_to(cache)
    info = read_model_info(served.path)
    assert info.is_slice and info.block_count == 2
    written = served.path.stat().st_mtime_ns
    assert resolve_served_model(tiny, layers=LayerRange(1, 3)) == served  # reused, not rewritten
    assert served.path.stat().st_mtime_ns == written


def test_a_slice_given_is_served_as_is(tiny: Path, cache: Path) -> None:
    piece = ensure_slice(tiny, LayerRange(0, 2))
    before = sorted(cache.rglob("*"))
    served = resolve_served_model(piece, layers=LayerRange(0, 2))
    assert served == ServedModel(path=piece, layers=LayerRange(0, 2), name="")
    assert sorted(cache.rglob("*")) == before  # nothing sliced again


def test_a_part_is_the_planned_range_sliced(tiny: Path, cache: Path) -> None:
    served = resolve_served_model(tiny, part=(2, 2))
    assert served.part == (2, 2) and served.layers == plan_parts(tiny, 2)[1].layers == LayerRange(2, 4)
    assert served.path == slice_cache_path(file_fingerprint(tiny), LayerRange(2, 4))
    weighted = resolve_served_model(tiny, part=(1, 2), memory=[3 * 2**30, 2**30])
    assert weighted.layers == plan_parts(tiny, 2, [3 * 2**30, 2**30])[0].layers
    assert weighted.layers.count > 2  # the bigger worker takes more blocks


def test_what_cannot_be_served_is_an_error_saying_why(tiny: Path, cache: Path) -> None:
    with pytest.raises(PartError, match="the model has 4 blocks") as exc:
        resolve_served_model(tiny, part=(1, 5))
    assert (exc.value.index, exc.value.count) == (1, 5) and isinstance(exc.value, PlanError)
    with pytest.raises(PartError, match="1 sizes for 2 parts"):
        resolve_served_model(tiny, part=(1, 2), memory=[2**30])
    with pytest.raises(SliceError, match="outside the model's 4 blocks"):
        resolve_served_model(tiny, layers=LayerRange(2, 9))
    for bad in ({"layers": LayerRange(0, 2), "part": (1, 2)}, {"memory": [2**30]}):
        with pytest.raises(ValueError, match="not both"):
            resolve_served_model(tiny, **bad)  # type: ignore[arg-type]
    assert not any(cache.rglob("*.gguf"))


def test_a_packaged_models_name_is_its_cached_file_and_its_name(
    tiny: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A packaged model already assembled in the cache is used from there (its packages are
    only needed to assemble it); one whose packages are missing is a RealModelError."""
    model = replace(REAL_MODELS["gemma3-270m"], name="tiny-packaged", size=tiny.stat().st_size,
                    distribution="trio-shard-absent-package", parts=())
    monkeypatch.setitem(REAL_MODELS, model.name, model)
    with pytest.raises(RealModelError):
        resolve_served_model(model.name)
    real_model_path(model.name).parent.mkdir(parents=True)
    shutil.copyfile(tiny, real_model_path(model.name))
    served = resolve_served_model(model.name, layers=LayerRange(0, 2))
    assert served.name == "tiny-packaged" and served.layers == LayerRange(0, 2)
    assert read_model_info(served.path).is_slice
    assert resolve_served_model(model.name).path == real_model_path(model.name)
