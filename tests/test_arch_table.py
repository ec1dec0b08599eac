"""The architecture table (shard.models.architectures) as the slicer and the engine apply it,
on small GGUF files that hold only the keys and the non-block tensors a rule looks at: every
refusal (with its reason and the allowed boundaries), and every metadata and tensor edit a
slice makes. No llama.cpp here; tests/test_architectures.py chains real models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from shard.engine import InvalidInput, LayerRange, LoadSpec, UnsupportedFeature
from shard.engine.layer_ranges import EmbdInput, range_support
from shard.models import ARCHITECTURES, RANGE_ARCHITECTURES, SliceError, lookup, read_model_info, slice_model
from shard.models.architectures import Head, Keep

GT = gguf.GGUFValueType
N_EMBD = 32


def model_file(path: Path, arch: str, n_layer: int, keys: dict[str, Any] | None = None, *,
               tensors: tuple[str, ...] = ("token_embd.weight", "output_norm.weight"),
               n_vocab: int = 8) -> Path:
    """A GGUF with ``arch``'s block count, width, ``keys`` (suffixes after ``<arch>.``, or full
    names with a dot-prefix ``.``; values typed by Python type) and the named non-block tensors
    plus one tiny tensor per block."""
    writer = gguf.GGUFWriter(path, arch)
    try:
        writer.add_block_count(n_layer)
        writer.add_embedding_length(N_EMBD)
        writer.add_head_count(4)
        writer.add_vocab_size(n_vocab)
        for key, value in (keys or {}).items():
            name = key[1:] if key.startswith(".") else f"{arch}.{key}"
            if isinstance(value, bool):
                writer.add_bool(name, value)
            elif isinstance(value, int):
                writer.add_uint32(name, value)
            elif isinstance(value, float):
                writer.add_float32(name, value)
            elif isinstance(value, list) and value and isinstance(value[0], bool):
                writer.add_key_value(name, value, GT.ARRAY, sub_type=GT.BOOL)
            elif isinstance(value, list):
                writer.add_array(name, value)
            else:
                writer.add_string(name, value)
        for name in tensors:
            shape = (N_EMBD,) if name.endswith("norm.weight") or name.endswith(".bias") else (n_vocab, N_EMBD)
            if name == "output.bias":
                shape = (n_vocab,)
            writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
        for i in range(n_layer):
            writer.add_tensor(f"blk.{i}.attn_norm.weight", np.full((N_EMBD,), i, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path


def field(path: Path, key: str) -> Any:
    f = gguf.GGUFReader(path).get_field(key)
    return None if f is None else f.contents()


def tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


# ---- the table itself --------------------------------------------------------------------------


def test_the_table_lists_the_supported_architectures_and_refuses_the_others() -> None:
    assert set(RANGE_ARCHITECTURES) >= {"llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3",
                                        "phi3", "granite", "olmo2", "deepseek2"}
    for name in ("gemma3n", "jamba", "granitehybrid", "qwen3next"):
        entry = ARCHITECTURES[name]
        assert not entry.supported and entry.refused and name not in RANGE_ARCHITECTURES
    unknown = lookup("no-such-arch")
    assert not unknown.supported and "no entry in the architecture table" in (unknown.refused or "")
    assert lookup("olmo2").head is Head.REQUIRED and lookup("gemma2").head is Head.TIED


@pytest.mark.parametrize("arch", ["gemma3n", "jamba", "granitehybrid", "qwen3next", "no-such-arch"])
def test_refused_architectures_are_not_sliced_and_say_why(tmp_path: Path, arch: str) -> None:
    path = model_file(tmp_path / "m.gguf", arch, 4)
    with pytest.raises(SliceError, match=f"architecture '{arch}' cannot be sliced into layer ranges: .+"):
        slice_model(path, LayerRange(0, 2), tmp_path / "s.gguf")
    support = range_support(read_model_info(path), arch)
    assert not support.supported and support.detail


async def test_the_engine_refuses_those_ranges_before_llama_cpp_sees_the_file(tmp_path: Path) -> None:
    from shard.engine.llama import LlamaCppEngine

    cases = [
        (model_file(tmp_path / "g3n.gguf", "gemma3n", 4), LayerRange(0, 2), UnsupportedFeature,
         "gemma3n.*per-layer token embeddings"),
        (model_file(tmp_path / "jamba.gguf", "jamba", 4), LayerRange(2, 4), UnsupportedFeature,
         "jamba.*recurrent"),
        (model_file(tmp_path / "g2.gguf", "gemma2", 6), LayerRange(5, 6), UnsupportedFeature,
         r"blocks 5..5 are all global-attention blocks.*allowed boundaries"),
        (model_file(tmp_path / "l4.gguf", "llama4", 8), LayerRange(0, 3), UnsupportedFeature,
         r"boundary 3 is not exact.*multiples of 4 \(0, 4, 8\)"),
        (model_file(tmp_path / "g2bad.gguf", "gemma2", 2, {"attention.sliding_window_pattern": [False, False]}),
         None, InvalidInput, r"would abort \(GGML_ASSERT\(hparams.is_swa_any\(\)\)\)"),
    ]
    for path, layers, error, message in cases:
        async with LlamaCppEngine() as engine:
            with pytest.raises(error, match=message):
                await engine.load(LoadSpec(model_path=path, layer_range=layers, n_ctx=64, max_sessions=1))


# ---- refusals of a range -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "n_layer", "keys", "layers", "message"),
    [
        # Gemma 2/3 27B: the attention scale comes from the block count (n_embd/n_head = 8 != 16).
        ("gemma2", 46, {"attention.key_length": 16}, LayerRange(0, 23),
         r"Gemma 2's attention scale from the block count \(46 blocks"),
        ("gemma3", 62, {"attention.key_length": 16, "attention.sliding_window": 8}, LayerRange(30, 62),
         r"Gemma 3's attention scale from the block count \(62 blocks"),
        # ... and a 46-block slice of a bigger Gemma 2 would be classified 27B.
        ("gemma2", 50, {"attention.key_length": 16}, LayerRange(0, 46), "a 46-block slice"),
        # Gemma 2 always runs SWA: a slice of global blocks only would abort llama.cpp.
        ("gemma2", 6, {}, LayerRange(3, 4), r"blocks 3..3 are all global-attention blocks"),
        # DeepSeek2: a 27-block slice of a non-lite model would be read as "lite".
        ("deepseek2", 30, {"attention.q_lora_rank": 8}, LayerRange(3, 30), "as a 'lite' model"),
        # Llama 4: NoPE and MoE placement follow (il + 1) % 4 and % interleave step.
        ("llama4", 12, {"interleave_moe_layer_step": 2}, LayerRange(4, 10), r"boundary 10 is not exact"),
        ("llama4", 12, {"interleave_moe_layer_step": 3}, LayerRange(0, 4), r"multiples of 12 \(0, 12\)"),
        ("llama4", 8, {"attention.sliding_window": 0}, LayerRange(0, 4), "none"),
        # Generic: NextN/MTP blocks after the trunk; a per-layer array the table does not know.
        ("qwen3", 4, {"nextn_predict_layers": 1}, LayerRange(0, 2), "NextN/MTP"),
        ("qwen2", 4, {"rope.mystery_per_layer": [1, 2, 3, 4]}, LayerRange(0, 2),
         "'qwen2.rope.mystery_per_layer' looks like a per-layer array"),
    ],
)
def test_refused_ranges_name_the_reason(tmp_path: Path, arch: str, n_layer: int, keys: dict[str, Any],
                                         layers: LayerRange, message: str) -> None:
    path = model_file(tmp_path / "m.gguf", arch, n_layer, keys)
    with pytest.raises(SliceError, match=message):
        slice_model(path, layers, tmp_path / "s.gguf")
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_caps_say_when_no_boundary_of_a_model_is_exact(tmp_path: Path) -> None:
    big = model_file(tmp_path / "g2.gguf", "gemma2", 46, {"attention.key_length": 16})
    support = range_support(read_model_info(big), "gemma2")
    assert not support.supported and "27B" in support.detail
    fine = model_file(tmp_path / "g2s.gguf", "gemma2", 46, {"attention.key_length": 8})  # same scale
    assert range_support(read_model_info(fine), "gemma2").supported
    l4 = model_file(tmp_path / "l4.gguf", "llama4", 8, {"interleave_moe_layer_step": 2})
    assert range_support(read_model_info(l4), "llama4").detail == "allowed boundaries are multiples of 4 (0, 4, 8)"
    llama = model_file(tmp_path / "llama.gguf", "llama", 4)
    assert range_support(read_model_info(llama), "llama").detail == "allowed boundaries: any"


# ---- what a slice writes -------------------------------------------------------------------------


def test_per_layer_arrays_are_cut_and_other_keys_kept(tmp_path: Path) -> None:
    path = model_file(tmp_path / "m.gguf", "qwen3moe", 5, {
        "feed_forward_length": [10, 11, 12, 13, 14], "attention.head_count_kv": [1, 2, 1, 2, 1],
        "expert_feed_forward_length": [20, 21, 22, 23, 24], "rope.freq_base": 1e6,
    })
    out = slice_model(path, LayerRange(1, 4), tmp_path / "s.gguf")
    assert field(out, "qwen3moe.feed_forward_length") == [11, 12, 13]
    assert field(out, "qwen3moe.attention.head_count_kv") == [2, 1, 2]
    assert field(out, "qwen3moe.expert_feed_forward_length") == [21, 22, 23]
    assert field(out, "qwen3moe.rope.freq_base") == 1e6 and field(out, "qwen3moe.block_count") == 3
    # Blocks renumbered, in order.
    assert [float(np.asarray(t.data)[0]) for n, t in sorted(tensors(out).items()) if n.startswith("blk.")] == [1, 2, 3]


@pytest.mark.parametrize(
    ("keys", "layers", "pattern"),
    [
        # Gemma 3's default period 6 (blocks 5, 11 global): written out for the slice's blocks.
        ({"attention.sliding_window": 8}, LayerRange(4, 8), [True, False, True, True]),
        # A scalar period in the source becomes the explicit array.
        ({"attention.sliding_window": 8, "attention.sliding_window_pattern": 3}, LayerRange(1, 5),
         [True, False, True, True]),
        # An explicit array is cut.
        ({"attention.sliding_window": 8,
          "attention.sliding_window_pattern": [True, False, False, True, True, True, False, True]},
         LayerRange(2, 6), [False, True, True, True]),
    ],
)
def test_the_sliding_window_pattern_is_written_out(tmp_path: Path, keys: dict[str, Any], layers: LayerRange,
                                                   pattern: list[bool]) -> None:
    path = model_file(tmp_path / "m.gguf", "gemma3", 8, keys)
    out = slice_model(path, layers, tmp_path / "s.gguf")
    assert field(out, "gemma3.attention.sliding_window_pattern") == pattern
    assert field(out, "gemma3.attention.sliding_window") == 8


def test_a_slice_without_sliding_window_blocks_drops_the_window(tmp_path: Path) -> None:
    path = model_file(tmp_path / "m.gguf", "gemma3", 8, {"attention.sliding_window": 8})
    out = slice_model(path, LayerRange(5, 6), tmp_path / "s.gguf")  # block 5: global attention
    assert field(out, "gemma3.attention.sliding_window") is None
    assert field(out, "gemma3.attention.sliding_window_pattern") is None
    # OLMo2 (period 4, blocks 3, 7 global) likewise; without a window nothing is written.
    olmo = model_file(tmp_path / "o.gguf", "olmo2", 8, {"attention.sliding_window": 8},
                      tensors=("token_embd.weight", "output_norm.weight", "output.weight"))
    out = slice_model(olmo, LayerRange(3, 4), tmp_path / "o3.gguf")
    assert field(out, "olmo2.attention.sliding_window") is None
    plain = model_file(tmp_path / "p.gguf", "gemma3", 8)
    out = slice_model(plain, LayerRange(2, 5), tmp_path / "p2.gguf")
    assert field(out, "gemma3.attention.sliding_window_pattern") is None


def test_gemma2_keeps_its_window_and_the_tied_head_on_the_last_part(tmp_path: Path) -> None:
    path = model_file(tmp_path / "m.gguf", "gemma2", 5)
    out = slice_model(path, LayerRange(1, 5), tmp_path / "s.gguf")
    assert field(out, "gemma2.attention.sliding_window_pattern") == [False, True, False, True]
    emb = tensors(out)["token_embd.weight"]
    assert emb.tensor_type == gguf.GGMLQuantizationType.F32  # the real one: Gemma 2's head


def test_granite_input_scale_only_on_the_first_part(tmp_path: Path) -> None:
    path = model_file(tmp_path / "m.gguf", "granite", 4, {"embedding_scale": 12.0, "logit_scale": 8.0})
    first = slice_model(path, LayerRange(0, 2), tmp_path / "a.gguf")
    last = slice_model(path, LayerRange(2, 4), tmp_path / "b.gguf")
    assert field(first, "granite.embedding_scale") == 12.0
    assert field(last, "granite.embedding_scale") is None
    assert field(first, "granite.logit_scale") == field(last, "granite.logit_scale") == 8.0


def test_deepseek2_keys_derived_from_the_block_count_are_written(tmp_path: Path) -> None:
    path = model_file(tmp_path / "m.gguf", "deepseek2", 6,
                      {"leading_dense_block_count": 2, "attention.q_lora_rank": 8})
    a = slice_model(path, LayerRange(0, 1), tmp_path / "a.gguf")
    b = slice_model(path, LayerRange(1, 4), tmp_path / "b.gguf")
    c = slice_model(path, LayerRange(4, 6), tmp_path / "c.gguf")
    assert [field(p, "deepseek2.leading_dense_block_count") for p in (a, b, c)] == [1, 1, 0]
    assert {field(p, "deepseek2.expert_gating_func") for p in (a, b, c)} == {1}  # softmax, explicit
    assert field(b, "deepseek2.attention.q_lora_rank") == 8
    # A lite source (27 blocks, no q_lora_rank): its slices say "no Q LoRA" with the key.
    lite = model_file(tmp_path / "lite.gguf", "deepseek2", 27, {"leading_dense_block_count": 1})
    part = slice_model(lite, LayerRange(0, 10), tmp_path / "lite0.gguf")
    assert field(part, "deepseek2.attention.q_lora_rank") == 0


@pytest.mark.parametrize(
    ("arch", "extra", "first", "middle", "last"),
    [
        # OPTIONAL head, untied: the head goes to the last part only, with its bias.
        ("qwen2", ("output.weight", "output.bias"), set(), set(), {"output.weight", "output.bias"}),
        # REQUIRED head: every part stores an output.weight, all-zero stand-ins before the last.
        ("olmo2", ("output.weight",), {"output.weight"}, {"output.weight"}, {"output.weight"}),
    ],
)
def test_each_part_keeps_the_head_tensors_its_architecture_needs(
    tmp_path: Path, arch: str, extra: tuple[str, ...], first: set[str], middle: set[str], last: set[str]
) -> None:
    path = model_file(tmp_path / "m.gguf", arch, 4, tensors=("token_embd.weight", "output_norm.weight", *extra),
                      n_vocab=8)
    parts = [slice_model(path, r, tmp_path / f"{r.start}.gguf") for r in
             (LayerRange(0, 1), LayerRange(1, 3), LayerRange(3, 4))]
    for part, expected in zip(parts, (first, middle, last), strict=True):
        got = tensors(part)
        assert {n for n in got if n.startswith("output.")} == expected, part.name
    head = {n: t for n, t in tensors(parts[0]).items() if n == "output.weight"}
    if head:  # a stand-in of the first part's vocabulary, all zeros
        assert list(head["output.weight"].shape) == [N_EMBD, 8] and not np.asarray(head["output.weight"].data).any()
    mid = tensors(parts[1])
    if "output.weight" in mid:
        assert list(mid["output.weight"].shape) == [N_EMBD, 1]  # the stub vocabulary's size


def test_keep_rules() -> None:
    optional, tied, required = lookup("llama"), lookup("gemma2"), lookup("olmo2")
    assert optional.keep("token_embd.weight", first=False, last=True, tied=True) is Keep.REAL
    assert optional.keep("token_embd.weight", first=False, last=True, tied=False) is Keep.STAND_IN
    assert tied.keep("token_embd.weight", first=False, last=True, tied=False) is Keep.REAL
    assert required.keep("output.weight", first=True, last=False, tied=False) is Keep.STAND_IN
    assert optional.keep("output.bias", first=True, last=False, tied=False) is Keep.DROP
    assert optional.keep("rope_freqs.weight", first=False, last=False, tied=False) is Keep.REAL


# ---- hidden-state input -------------------------------------------------------------------------


def test_embd_input_pre_divides_so_that_the_product_returns_the_row() -> None:
    rng = np.random.default_rng(7)
    rows = (rng.standard_normal((64, 96)) * 10).astype(np.float32)
    scale = lookup("gemma2").embd_input_scale
    assert scale is not None
    s = np.float32(np.sqrt(np.float32(96)))
    dest = np.empty_like(rows)
    EmbdInput(float(s)).write(dest, rows)
    back = dest * s  # what ggml_scale computes: one float32 multiply
    # Every value comes back within one ulp, and exactly wherever the rounding allows (about 87%
    # of values for s = sqrt(96) = 9.80); where it does not, no neighbouring float32 would.
    assert np.all(np.abs(back - rows) <= np.spacing(np.abs(rows)))
    assert float(np.mean(back == rows)) > 0.8
    for direction in (np.inf, -np.inf):
        assert not np.any((back != rows) & (np.nextafter(dest, np.float32(direction)) * s == rows))
    exact = np.empty_like(rows)
    EmbdInput(8.0).write(exact, rows)  # a power of two: always exact
    assert np.array_equal(exact * np.float32(8.0), rows)
    plain = np.empty_like(rows)
    EmbdInput(None).write(plain, rows)
    assert np.array_equal(plain, rows)


def test_only_gemma2_rescales_hidden_state_input() -> None:
    scaled = {name for name, a in ARCHITECTURES.items() if a.embd_input_scale is not None}
    assert scaled == {"gemma2"}


def test_header_reader_decodes_small_arrays(tmp_path: Path) -> None:
    path = model_file(tmp_path / "m.gguf", "gemma3", 3, {"attention.sliding_window_pattern": [True, False, True],
                                                        "feed_forward_length": [1, 2, 3]})
    info = read_model_info(path)
    assert info.metadata["gemma3.attention.sliding_window_pattern"] == (True, False, True)
    assert info.metadata["gemma3.feed_forward_length"] == (1, 2, 3)
    assert info.n_vocab == 8
