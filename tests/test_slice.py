"""Layer-range slices (shard.models.slice and ``trio-shard slice`` / ``serve --layers``):
renumbered blocks, recorded origin, the non-block tensors each part keeps, refusals, cache."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shard.engine import InvalidInput, LayerRange
from shard.models import (
    RANGE_ARCHITECTURES,
    SLICER_VERSION,
    SliceError,
    ensure_model,
    ensure_slice,
    file_fingerprint,
    read_model_info,
    slice_cache_path,
    slice_model,
)
from shard.models.slice import STUB_VOCAB_SIZE

CLI = [sys.executable, "-m", "shard.cli"]


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_model("tiny")


def _tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def _field(path: Path, key: str) -> object:
    field = gguf.GGUFReader(path).get_field(key)
    return None if field is None else field.contents()


@pytest.mark.parametrize("layers", [LayerRange(0, 2), LayerRange(1, 3), LayerRange(2, 4)])
def test_blocks_are_renumbered_and_copied_byte_for_byte(tiny: Path, tmp_path: Path, layers: LayerRange) -> None:
    out = slice_model(tiny, layers, tmp_path / "s.gguf")
    src, sl = _tensors(tiny), _tensors(out)
    blocks = sorted({int(n.split(".")[1]) for n in sl if n.startswith("blk.")})
    assert blocks == list(range(layers.count))
    for name, t in src.items():
        if not name.startswith("blk."):
            continue
        index = int(name.split(".")[1])
        new = f"blk.{index - layers.start}.{name.split('.', 2)[2]}"
        if layers.start <= index < layers.end:
            assert sl[new].tensor_type == t.tensor_type
            assert np.array_equal(np.asarray(sl[new].data), np.asarray(t.data))
    assert _field(out, "llama.block_count") == layers.count
    # Everything else about the architecture is kept.
    for key in ("llama.embedding_length", "llama.attention.head_count", "llama.rope.freq_base"):
        assert _field(out, key) == _field(tiny, key)
    # No temporary file is left next to the output.
    assert [p.name for p in tmp_path.iterdir()] == ["s.gguf"]


def test_origin_is_recorded_and_read_back(tiny: Path, tmp_path: Path) -> None:
    out = slice_model(tiny, LayerRange(1, 3), tmp_path / "s.gguf")
    info = read_model_info(out)
    assert info.is_slice and info.layer_range == LayerRange(1, 3)
    assert info.source_sha256 == file_fingerprint(tiny) and info.source_block_count == 4
    assert info.architecture == "llama" and info.block_count == 2 and info.n_embd == 64
    assert info.source_n_vocab == len(gguf.GGUFReader(tiny).fields["tokenizer.ggml.tokens"].data)
    assert _field(out, "trio_shard.slicer.version") == SLICER_VERSION
    whole = read_model_info(tiny)
    assert not whole.is_slice and whole.layer_range is None and whole.block_count == 4


def test_each_part_keeps_only_the_tensors_it_needs(tiny: Path, tmp_path: Path) -> None:
    src = _tensors(tiny)
    n_vocab = int(src["output.weight"].shape[1])
    first = slice_model(tiny, LayerRange(0, 2), tmp_path / "first.gguf")
    middle = slice_model(tiny, LayerRange(1, 3), tmp_path / "middle.gguf")
    last = slice_model(tiny, LayerRange(2, 4), tmp_path / "last.gguf")
    f, m, la = _tensors(first), _tensors(middle), _tensors(last)

    # First: real embeddings and vocabulary, no LM head (llama.cpp ties it to token_embd).
    assert "output.weight" not in f
    assert np.array_equal(np.asarray(f["token_embd.weight"].data), np.asarray(src["token_embd.weight"].data))
    assert _field(first, "tokenizer.ggml.model") == "llama"
    # Middle: no head, a stub vocabulary and a one-row token_embd stand-in.
    assert "output.weight" not in m
    assert _field(middle, "tokenizer.ggml.model") == "none"
    assert _field(middle, "tokenizer.ggml.tokens") is None
    assert _field(middle, "llama.vocab_size") == STUB_VOCAB_SIZE
    assert list(m["token_embd.weight"].shape) == [64, STUB_VOCAB_SIZE]
    # Last: the real head and vocabulary; token_embd is an all-zero 4.5-bit stand-in.
    assert np.array_equal(np.asarray(la["output.weight"].data), np.asarray(src["output.weight"].data))
    assert _field(last, "tokenizer.ggml.model") == "llama"
    stand_in = la["token_embd.weight"]
    assert list(stand_in.shape) == [64, n_vocab]
    assert stand_in.tensor_type == gguf.GGMLQuantizationType.Q4_0
    assert not np.asarray(stand_in.data).any()
    # Everyone keeps output_norm (llama.cpp requires it).
    for part in (f, m, la):
        assert "output_norm.weight" in part
    assert middle.stat().st_size < first.stat().st_size and middle.stat().st_size < last.stat().st_size


def test_slicing_decodes_nothing_it_does_not_change(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 33, finding 7: ``gguf.GGUFReader`` decoded every vocabulary array before a slice
    was written (Gemma 3 270M: 12-16 s and about 1 GB per range). The slicer walks the header
    and copies every key it does not edit as bytes, and the stand-in as a hole."""
    import mmap

    from shard.models import layout

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the slicer decoded the whole file with gguf.GGUFReader")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    out = slice_model(tiny, LayerRange(2, 4), tmp_path / "last.gguf")
    monkeypatch.undo()
    with open(tiny, "rb") as a, mmap.mmap(a.fileno(), 0, access=mmap.ACCESS_READ) as src, \
            open(out, "rb") as b, mmap.mmap(b.fileno(), 0, access=mmap.ACCESS_READ) as dst:
        before = {k.name: bytes(src[k.start:k.end]) for k in layout.walk_keys(src)}
        after = {k.name: bytes(dst[k.start:k.end]) for k in layout.walk_keys(dst)}
        edited = {"llama.block_count"}
        for name, raw in before.items():
            if name not in edited:
                assert after[name] == raw, name  # the vocabulary too, byte for byte
        placed = {t.name: t for t in layout.read_layout(dst).tensors}
        stand_in = placed["token_embd.weight"]
        assert not any(dst[stand_in.offset:stand_in.offset + stand_in.nbytes])
    assert _field(out, "llama.block_count") == 2


def test_every_range_of_the_tiny_model_has_the_expected_tensor_set(tiny: Path, tmp_path: Path) -> None:
    src = _tensors(tiny)
    per_block = sorted(n.split(".", 2)[2] for n in src if n.startswith("blk.0."))
    for a in range(4):
        for b in range(a + 1, 5):
            out = slice_model(tiny, LayerRange(a, b), tmp_path / f"{a}-{b}.gguf")
            expected = {f"blk.{i}.{rest}" for i in range(b - a) for rest in per_block}
            expected |= {"token_embd.weight", "output_norm.weight"}
            if b == 4:
                expected.add("output.weight")
            assert set(_tensors(out)) == expected, (a, b)
            assert _field(out, "tokenizer.ggml.model") == ("llama" if a == 0 or b == 4 else "none")
            assert read_model_info(out).layer_range == LayerRange(a, b)


def header_only_model(path: Path, arch: str, block_count: int = 4) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(block_count)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_refusals(tiny: Path, tmp_path: Path) -> None:
    gemma = header_only_model(tmp_path / "gemma.gguf", "gemma3n")  # refused by the table
    assert "gemma3n" not in RANGE_ARCHITECTURES
    with pytest.raises(SliceError, match="architecture 'gemma3n' cannot be sliced"):
        slice_model(gemma, LayerRange(0, 2), tmp_path / "g.gguf")
    with pytest.raises(SliceError, match=r"\[2, 5\) is outside the model's 4 blocks"):
        slice_model(tiny, LayerRange(2, 5), tmp_path / "x.gguf")
    with pytest.raises(InvalidInput, match="empty"):  # A >= B cannot even be expressed
        LayerRange(2, 2)
    with pytest.raises(InvalidInput):
        LayerRange(3, 1)
    part = slice_model(tiny, LayerRange(0, 2), tmp_path / "part.gguf")
    with pytest.raises(SliceError, match="already a slice"):
        slice_model(part, LayerRange(0, 1), tmp_path / "x.gguf")
    not_gguf = tmp_path / "junk.gguf"
    not_gguf.write_bytes(b"not a model at all")
    with pytest.raises(SliceError, match="not a readable GGUF"):
        slice_model(not_gguf, LayerRange(0, 1), tmp_path / "x.gguf")
    with pytest.raises(SliceError, match="does not exist"):
        read_model_info(tmp_path / "missing.gguf")
    for size in (0, 4, 30, 200):  # empty, magic only, cut in the header
        cut = tmp_path / "cut.gguf"
        cut.write_bytes(tiny.read_bytes()[:size])
        with pytest.raises(SliceError, match="not a readable GGUF"):
            read_model_info(cut)
    cut.unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma.gguf", "junk.gguf", "part.gguf"]


def test_ensure_slice_writes_once_into_the_cache(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIO_SHARD_CACHE", str(tmp_path / "cache"))
    layers = LayerRange(1, 3)
    path = ensure_slice(tiny, layers)
    assert path == slice_cache_path(file_fingerprint(tiny), layers)
    assert path.parent == tmp_path / "cache" / "slices"
    assert file_fingerprint(tiny) in path.name and f"-v{SLICER_VERSION}" in path.name
    stamp = path.stat().st_mtime_ns
    assert ensure_slice(tiny, layers) == path
    assert path.stat().st_mtime_ns == stamp  # reused, not rewritten
    assert ensure_slice(tiny, LayerRange(1, 2)) != path  # keyed by the range too


def test_progress_bar_on_request(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slice_model(tiny, LayerRange(0, 1), tmp_path / "a.gguf")
    assert "slicing" not in capsys.readouterr().err
    slice_model(tiny, LayerRange(0, 1), tmp_path / "b.gguf", progress=True)
    assert "slicing blocks 0:1" in capsys.readouterr().err
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


@pytest.mark.slow
def test_a_non_last_bench_slice_holds_no_lm_head_and_is_much_smaller(tmp_path: Path) -> None:
    bench = ensure_model("bench")
    whole = bench.stat().st_size
    middle = slice_model(bench, LayerRange(4, 6), tmp_path / "middle.gguf")
    part = _tensors(middle)  # (a stub vocabulary: quick to read, unlike the 32k-token source)
    assert "output.weight" not in part
    assert list(part["token_embd.weight"].shape) == [1024, STUB_VOCAB_SIZE]
    blocks = sum(t.n_bytes for n, t in part.items() if n.startswith("blk."))
    assert blocks > 20e6  # 2 of 12 Q8_0 blocks
    # Two blocks and a few KB of stand-ins: no head (35 MB), no embeddings (35 MB).
    assert middle.stat().st_size < blocks + 1_000_000
    assert middle.stat().st_size < 0.15 * whole
    print(f"bench: whole {whole / 1e6:.1f} MB, middle [4, 6) {middle.stat().st_size / 1e6:.1f} MB")


# ---- the command line ------------------------------------------------------------------------


def test_slice_command(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "part.gguf"
    done = subprocess.run([*CLI, "slice", "--model", str(tiny), "--layers", "1:3", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    assert read_model_info(out).layer_range == LayerRange(1, 3)
    bad = subprocess.run([*CLI, "slice", "--model", str(tiny), "--layers", "3:9", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "outside the model's 4 blocks" in bad.stderr


@pytest.mark.parametrize("text", ["3:3", "4:2", "1", "a:b", "-1:2", "1:2:3"])
def test_bad_layer_ranges_are_usage_errors(text: str) -> None:
    from shard.cli import build_parser

    for argv in (["slice", "--model", "m", "--out", "o", "--layers", text], ["serve", "--layers", text]):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(argv)
        assert exc.value.code == 2


def test_serve_layers_slices_into_the_cache_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_cli import running_worker  # the README flow's worker harness

    source = ensure_model("tiny")
    monkeypatch.setenv("TRIO_SHARD_CACHE", str(tmp_path))  # inherited by the worker processes
    expected = slice_cache_path(file_fingerprint(source), LayerRange(2, 4))
    stamps = []
    for _ in range(2):
        with running_worker("--model", str(source), "--layers", "2:4") as (target, _proc):
            caps = subprocess.run([*CLI, "caps", "--json", "--target", target],
                                  capture_output=True, text=True, timeout=60)
        assert caps.returncode == 0, caps.stderr
        shown = json.loads(caps.stdout)
        assert shown["layer_range"] == [2, 4] and shown["n_layers_total"] == 4
        assert shown["model_fingerprint"] == file_fingerprint(source)
        assert [f.name for f in (tmp_path / "slices").iterdir()] == [expected.name]
        stamps.append(expected.stat().st_mtime_ns)
    assert stamps[0] == stamps[1]  # the second worker reused the slice


@pytest.mark.parametrize(
    ("n_embd", "qtype"),
    [(1024, gguf.GGMLQuantizationType.IQ1_S), (64, gguf.GGMLQuantizationType.Q4_0),
     (48, gguf.GGMLQuantizationType.F16)],
)
def test_stand_ins_use_the_smallest_type_the_width_allows(n_embd: int, qtype: gguf.GGMLQuantizationType) -> None:
    from shard.models.slice import _stand_in

    shape, got, nbytes = _stand_in(3, n_embd)
    assert got == qtype and shape == (n_embd, 3)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    assert nbytes == 3 * n_embd // block * type_size


# ---- the header reader (read_model_info) -------------------------------------------------------

_VALUES = st.one_of(
    st.integers(0, 2**32 - 1).map(lambda v: (v, gguf.GGUFValueType.UINT32)),
    st.integers(-(2**63), 2**63 - 1).map(lambda v: (v, gguf.GGUFValueType.INT64)),
    st.integers(-128, 127).map(lambda v: (v, gguf.GGUFValueType.INT8)),
    st.booleans().map(lambda v: (v, gguf.GGUFValueType.BOOL)),
    st.floats(width=32, allow_nan=False).map(lambda v: (v, gguf.GGUFValueType.FLOAT32)),
    st.floats(allow_nan=False).map(lambda v: (v, gguf.GGUFValueType.FLOAT64)),
    st.text(max_size=20).map(lambda v: (v, gguf.GGUFValueType.STRING)),
    st.lists(st.text(max_size=8), min_size=1, max_size=30).map(lambda v: (v, gguf.GGUFValueType.ARRAY)),
    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=30).map(
        lambda v: (v, gguf.GGUFValueType.ARRAY)),
)


@settings(max_examples=60, deadline=None)
@given(items=st.dictionaries(st.text(st.characters(codec="utf-8"), min_size=1, max_size=12).map(
    lambda k: f"x.{k}"), _VALUES, max_size=8), cut=st.integers(0, 400))
def test_header_reader_agrees_with_gguf_reader(items: dict[str, tuple[object, gguf.GGUFValueType]],
                                              cut: int) -> None:
    from shard.models.header import _read_scalars

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.gguf"
        writer = gguf.GGUFWriter(path, "llama")
        try:
            writer.add_block_count(3)
            writer.add_embedding_length(8)
            for key, (value, vtype) in items.items():
                writer.add_key_value(key, value, vtype)
            writer.add_tensor("token_embd.weight", np.zeros((2, 8), dtype=np.float32))
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
        expected = {f.name: f.contents() for f in gguf.GGUFReader(path).fields.values()
                    if not f.name.startswith("GGUF.") and f.types[0] != gguf.GGUFValueType.ARRAY}
        got = _read_scalars(path)
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert got[key] == value or (isinstance(value, float) and np.float32(got[key]) == np.float32(value))
        info = read_model_info(path)
        assert (info.architecture, info.block_count, info.n_embd, info.is_slice) == ("llama", 3, 8, False)
        # Cut anywhere inside the metadata: a clean SliceError, never a crash or a wrong answer.
        data = path.read_bytes()
        kv_end = data.index(b"token_embd.weight") - 8  # the first tensor info's name length
        path.write_bytes(data[: min(cut, kv_end - 1)])
        with pytest.raises(SliceError):
            _read_scalars(path)


def test_inconsistent_slice_metadata_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(8)
    writer.add_uint32("trio_shard.layer_range.start", 1)
    writer.add_uint32("trio_shard.layer_range.end", 4)  # 3 blocks, but the file says 2
    writer.add_uint32("trio_shard.source.block_count", 4)
    writer.add_uint32("trio_shard.source.n_vocab", 10)
    writer.add_string("trio_shard.source.sha256", "0" * 64)
    writer.add_tensor("token_embd.weight", np.zeros((2, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SliceError, match="inconsistent"):
        read_model_info(path)
