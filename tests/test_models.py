"""Generated GGUF models: deterministic bytes, expected metadata, cached once, clear errors."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest

from shard.models import PRESETS, build_vocab, cache_file_name, ensure_model, get_preset, write_model


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _field(reader: gguf.GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


def test_presets_listed() -> None:
    assert PRESETS == ("tiny", "bench", "chat", "tools", "embed")


def test_the_embed_preset_declares_mean_pooling(tmp_path: Path) -> None:
    reader = gguf.GGUFReader(write_model("embed", tmp_path / "e.gguf"))
    assert _field(reader, "llama.pooling_type") == int(gguf.PoolingType.MEAN)
    assert "llama.pooling_type" not in gguf.GGUFReader(write_model("tiny", tmp_path / "t.gguf")).fields
    # A preset without pooling keeps the cache file it had before the field existed.
    assert cache_file_name("tiny") == "tiny-g2-68680fbc1a.gguf"


def test_the_chat_preset_carries_a_template_and_its_end_of_turn_token(tmp_path: Path) -> None:
    from shard.models.write import CHATML_TEMPLATE

    reader = gguf.GGUFReader(write_model("chat", tmp_path / "c.gguf"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert _field(reader, "tokenizer.chat_template") == CHATML_TEMPLATE
    assert tokens[_field(reader, "tokenizer.ggml.eot_token_id")] == "<|im_end|>"  # type: ignore[index]
    assert "tokenizer.chat_template" not in gguf.GGUFReader(write_model("tiny", tmp_path / "t.gguf")).fields
    custom = write_model("tiny", tmp_path / "x.gguf", chat_template="{{ messages }}")
    assert _field(gguf.GGUFReader(custom), "tokenizer.chat_template") == "{{ messages }}"


def test_tiny_is_deterministic(tmp_path: Path) -> None:
    a = write_model("tiny", tmp_path / "a.gguf")
    b = write_model("tiny", tmp_path / "sub" / "b.gguf")
    assert a == tmp_path / "a.gguf"
    assert _sha(a) == _sha(b)
    # No temp files are left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "sub"]


@pytest.mark.slow
def test_bench_is_deterministic(tmp_path: Path) -> None:
    a = write_model("bench", tmp_path / "a.gguf")
    b = write_model("bench", tmp_path / "b.gguf")
    assert _sha(a) == _sha(b)
    size = a.stat().st_size
    assert 200e6 < size < 230e6
    reader = gguf.GGUFReader(a)
    assert _field(reader, "llama.embedding_length") == 1024
    assert _field(reader, "llama.block_count") == 12
    assert _field(reader, "llama.attention.head_count") == 16
    assert _field(reader, "llama.attention.head_count_kv") == 4
    assert _field(reader, "llama.feed_forward_length") == 2816
    assert len(_field(reader, "tokenizer.ggml.tokens")) == 32000
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32


def test_tiny_metadata(tmp_path: Path) -> None:
    path = write_model("tiny", tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(path)
    p = get_preset("tiny")
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.context_length") == 4096
    assert _field(reader, "llama.embedding_length") == p.n_embd == 64
    assert _field(reader, "llama.block_count") == p.n_layer
    assert _field(reader, "llama.attention.head_count") == 4
    assert _field(reader, "llama.attention.head_count_kv") == 2
    assert _field(reader, "tokenizer.ggml.model") == "llama"
    assert _field(reader, "tokenizer.ggml.bos_token_id") == 1
    assert _field(reader, "tokenizer.ggml.eos_token_id") == 2
    assert _field(reader, "tokenizer.ggml.add_bos_token") is True

    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    scores = _field(reader, "tokenizer.ggml.scores")
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)]
    assert set(types[3:259]) == {int(gguf.TokenType.BYTE)}
    assert types[:3] == [int(gguf.TokenType.UNKNOWN), int(gguf.TokenType.CONTROL), int(gguf.TokenType.CONTROL)]
    assert "\u2581the" in tokens and "\u2581hello" in tokens and "\u2581world" in tokens
    assert len(tokens) == len(set(tokens)) == len(types) == len(scores)
    assert 300 < len(tokens) < 2000

    n_vocab = len(tokens)
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 2 + 1 + 9 * p.n_layer
    emb = tensors["token_embd.weight"]
    assert [int(x) for x in emb.shape] == [p.n_embd, n_vocab]  # GGUF order: fastest dim first
    assert emb.tensor_type == gguf.GGMLQuantizationType.F32
    assert np.isfinite(np.asarray(emb.data)).all()


def test_vocab_fill_to_size() -> None:
    tokens, scores, types = build_vocab(5000)
    assert len(tokens) == len(set(tokens)) == len(scores) == len(types) == 5000
    with pytest.raises(ValueError, match="smaller than the base vocabulary"):
        build_vocab(100)


def test_unknown_preset(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny, bench"):
        write_model("huge", tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="unknown model preset"):
        ensure_model("huge")
    assert not list(tmp_path.iterdir())


def test_ensure_model_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIO_SHARD_CACHE", str(tmp_path / "cache"))
    first = ensure_model("tiny")
    assert first.parent == tmp_path / "cache"
    assert first.name == cache_file_name("tiny")
    assert "tiny" in first.name and "-g" in first.name
    stat = first.stat()
    second = ensure_model("tiny")
    assert second == first
    again = second.stat()
    assert (again.st_ino, again.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)  # not rewritten
    assert ensure_model() == first  # "tiny" is the default


def test_ensure_model_concurrent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIO_SHARD_CACHE", str(tmp_path))
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(ensure_model("tiny"))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]  # temp files cleaned up
    assert _sha(results[0]) == _sha(write_model("tiny", tmp_path / "ref" / "t.gguf"))


def test_cache_name_changes_with_preset() -> None:
    assert cache_file_name("tiny") != cache_file_name("bench")
    assert os.sep not in cache_file_name("tiny")
