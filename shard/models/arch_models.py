"""One small random-weight GGUF per supported architecture, with that architecture's quirks.

Why: layer ranges must be proven per architecture (``tests/test_architectures.py`` chains
slices of each model against the whole model), and the project never downloads weights. Each
model here has the tensors and keys llama.cpp 0.3.36 reads for its architecture
(``src/models/<arch>.cpp`` in the vendored sources) and exercises what a slice must respect:
sliding-window patterns with small windows, attention biases, q/k norms, post-norms, tied or
untied heads (``output.bias`` included), MoE experts, logit soft-capping, embedding scales,
per-layer arrays, non-block tensors. A few MB each (64-96 wide, 5-12 blocks, F32, the
812-token vocabulary of ``shard.models.write``). Deterministic: the same recipe gives the
same bytes.

``chains`` are the block boundaries the equivalence suite cuts each model at: not multiples
of any pattern period, with a one-block first and last part, wherever the table allows that.

Resource handling: as ``shard.models.write`` (temporary file + ``os.replace``, cached by
recipe hash under ``$TRIO_SHARD_CACHE``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from .write import add_vocab, atomic_output, build_vocab, cache_dir, gguf_writer

#: Bump when the output changes for reasons the recipe's hash does not capture.
ARCH_MODEL_VERSION = 1

GT = gguf.GGUFValueType


@dataclass(frozen=True)
class Dims:
    n_layer: int
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 128

    @property
    def q(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv(self) -> int:
        return self.n_head_kv * self.head_dim


@dataclass
class _Spec:
    """Keys and tensors of a model being described (file order)."""

    arch: str
    dims: Dims
    keys: list[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]] = field(default_factory=list)
    tensors: list[tuple[str, tuple[int, ...], str | np.ndarray]] = field(default_factory=list)

    def key(self, suffix: str, value: Any, vtype: gguf.GGUFValueType | None = None) -> None:
        sub = None
        if vtype is None:
            if isinstance(value, bool):
                vtype = GT.BOOL
            elif isinstance(value, int):
                vtype = GT.UINT32
            elif isinstance(value, float):
                vtype = GT.FLOAT32
            elif isinstance(value, str):
                vtype = GT.STRING
            else:
                vtype, sub = GT.ARRAY, GT.UINT32 if isinstance(value[0], int) else GT.FLOAT32
        name = f"{self.arch}.{suffix}"
        self.keys = [k for k in self.keys if k[0] != name]  # a later value replaces a default
        self.keys.append((name, value, vtype, sub))

    def tensor(self, name: str, shape: tuple[int, ...], kind: str | np.ndarray = "w") -> None:
        """``kind``: "w" (weights, std fan_in^-0.5), "embd" (std 1), "norm" (1 +- 0.1), "bias"
        (std 0.1), or the values themselves."""
        self.tensors.append((name, shape, kind))


@dataclass(frozen=True)
class ArchModel:
    """A test model recipe: the architecture, its shape, its quirks (``build`` adds the keys and
    block tensors, ``head``/``head_bias`` the untied head), and the block boundaries the
    equivalence suite cuts it at."""

    arch: str
    dims: Dims
    build: Callable[[_Spec], None]
    chains: tuple[tuple[int, ...], ...]
    quirks: str
    head: bool
    head_bias: bool = False
    seed: int = 2026
    #: Standard deviation of token_embd. With a tied head a random model echoes its input token
    #: unless the blocks' outputs dominate the residual stream: small embeddings make them.
    embd_std: float = 1.0

    def spec(self) -> _Spec:
        s = _Spec(self.arch, self.dims)
        self.build(s)
        _ends(s, len(build_vocab(None)[0]), head=self.head, head_bias=self.head_bias)
        return s

    def digest(self) -> str:
        """A hash of everything the file holds but the random draws (keys, tensor shapes and
        kinds, the seed): a changed recipe never reuses a cached file."""
        s = self.spec()
        tensors = [(n, shape, k if isinstance(k, str) else k.tobytes().hex()) for n, shape, k in s.tensors]
        return hashlib.sha256(repr((s.keys, tensors, self.seed, self.embd_std)).encode()).hexdigest()[:10]


# ---- building blocks -----------------------------------------------------------------------------


def _common(s: _Spec, *, rope_dims: int | None = None) -> None:
    d = s.dims
    s.key("context_length", 4096)
    s.key("embedding_length", d.n_embd)
    s.key("block_count", d.n_layer)
    s.key("feed_forward_length", d.n_ff)
    s.key("attention.head_count", d.n_head)
    s.key("attention.head_count_kv", d.n_head_kv)
    if d.head_dim != d.n_embd // d.n_head:
        s.key("attention.key_length", d.head_dim)
        s.key("attention.value_length", d.head_dim)
    s.key("rope.dimension_count", rope_dims or d.head_dim)
    s.key("rope.freq_base", 10000.0)
    s.key("attention.layer_norm_rms_epsilon", 1e-6)


def _attention(s: _Spec, i: int, *, bias: bool = False, qk_norm: int = 0, norm: bool = True) -> None:
    """Separate Q/K/V/O; ``qk_norm``: width of per-head (or whole) q/k norms (0: none)."""
    d = s.dims
    if norm:
        s.tensor(f"blk.{i}.attn_norm.weight", (d.n_embd,), "norm")
    s.tensor(f"blk.{i}.attn_q.weight", (d.q, d.n_embd))
    s.tensor(f"blk.{i}.attn_k.weight", (d.kv, d.n_embd))
    s.tensor(f"blk.{i}.attn_v.weight", (d.kv, d.n_embd))
    if bias:
        s.tensor(f"blk.{i}.attn_q.bias", (d.q,), "bias")
        s.tensor(f"blk.{i}.attn_k.bias", (d.kv,), "bias")
        s.tensor(f"blk.{i}.attn_v.bias", (d.kv,), "bias")
    if qk_norm:
        s.tensor(f"blk.{i}.attn_q_norm.weight", (qk_norm,), "norm")
        s.tensor(f"blk.{i}.attn_k_norm.weight", (qk_norm if qk_norm != d.q else d.kv,), "norm")
    s.tensor(f"blk.{i}.attn_output.weight", (d.n_embd, d.q))


def _ffn(s: _Spec, i: int, *, norm: bool = True, n_ff: int | None = None) -> None:
    d = s.dims
    f = n_ff or d.n_ff
    if norm:
        s.tensor(f"blk.{i}.ffn_norm.weight", (d.n_embd,), "norm")
    s.tensor(f"blk.{i}.ffn_gate.weight", (f, d.n_embd))
    s.tensor(f"blk.{i}.ffn_up.weight", (f, d.n_embd))
    s.tensor(f"blk.{i}.ffn_down.weight", (d.n_embd, f))


def _experts(s: _Spec, i: int, n_expert: int, n_ff_exp: int, *, shared: int = 0, probs_bias: bool = False) -> None:
    d = s.dims
    s.tensor(f"blk.{i}.ffn_gate_inp.weight", (n_expert, d.n_embd))
    if probs_bias:
        s.tensor(f"blk.{i}.exp_probs_b.bias", (n_expert,), "bias")
    s.tensor(f"blk.{i}.ffn_gate_exps.weight", (n_expert, n_ff_exp, d.n_embd))
    s.tensor(f"blk.{i}.ffn_up_exps.weight", (n_expert, n_ff_exp, d.n_embd))
    s.tensor(f"blk.{i}.ffn_down_exps.weight", (n_expert, d.n_embd, n_ff_exp))
    if shared:
        s.tensor(f"blk.{i}.ffn_gate_shexp.weight", (shared, d.n_embd))
        s.tensor(f"blk.{i}.ffn_up_shexp.weight", (shared, d.n_embd))
        s.tensor(f"blk.{i}.ffn_down_shexp.weight", (d.n_embd, shared))


def _ends(s: _Spec, n_vocab: int, *, head: bool, head_bias: bool = False) -> None:
    """token_embd first, output_norm and (``head``) an untied output.weight last."""
    d = s.dims
    s.tensors.insert(0, ("token_embd.weight", (n_vocab, d.n_embd), "embd"))
    s.tensor("output_norm.weight", (d.n_embd,), "norm")
    if head:
        s.tensor("output.weight", (n_vocab, d.n_embd))
    if head_bias:
        s.tensor("output.bias", (n_vocab,), "bias")


# ---- one recipe per architecture ---------------------------------------------------------------


def _llama(s: _Spec) -> None:
    # Llama 3 style: GQA, per-dimension RoPE factors (a non-block tensor every part keeps),
    # and a tied head (no output.weight: the last part keeps the real token_embd).
    _common(s)
    for i in range(s.dims.n_layer):
        _attention(s, i)
        _ffn(s, i)
    s.tensor("rope_freqs.weight", (s.dims.head_dim // 2,), np.linspace(1.0, 4.0, s.dims.head_dim // 2))


def _qwen2(s: _Spec) -> None:
    _common(s)
    s.key("rope.freq_base", 1000000.0)
    for i in range(s.dims.n_layer):
        _attention(s, i, bias=True)  # Q/K/V biases
        _ffn(s, i)


def _qwen3(s: _Spec) -> None:
    _common(s)  # head_dim 32 != n_embd / n_head: key_length / value_length
    for i in range(s.dims.n_layer):
        _attention(s, i, qk_norm=s.dims.head_dim)  # per-head RMS norms on Q and K
        _ffn(s, i)


def _qwen3moe(s: _Spec) -> None:
    d = s.dims
    _common(s)
    s.key("expert_count", 4)
    s.key("expert_used_count", 2)
    # Per-layer arrays (llama.cpp checks their length against the block count: cut per slice).
    s.key("attention.head_count_kv", [d.n_head_kv] * d.n_layer)
    s.key("expert_feed_forward_length", [32] * d.n_layer)
    for i in range(d.n_layer):
        _attention(s, i, qk_norm=d.head_dim)
        s.tensor(f"blk.{i}.ffn_norm.weight", (d.n_embd,), "norm")
        _experts(s, i, 4, 32)


def _phi3(s: _Spec) -> None:
    d = s.dims
    _common(s)
    s.key("attention.sliding_window", 2047)  # present in Phi 3 files; llama.cpp turns SWA off
    s.key("rope.scaling.original_context_length", 32)  # longer contexts use the long factors
    s.key("rope.scaling.attn_factor", 1.19)
    for i in range(d.n_layer):
        s.tensor(f"blk.{i}.attn_norm.weight", (d.n_embd,), "norm")
        s.tensor(f"blk.{i}.attn_qkv.weight", (d.q + 2 * d.kv, d.n_embd))  # fused Q/K/V
        s.tensor(f"blk.{i}.attn_output.weight", (d.n_embd, d.q))
        s.tensor(f"blk.{i}.ffn_norm.weight", (d.n_embd,), "norm")
        s.tensor(f"blk.{i}.ffn_up.weight", (2 * d.n_ff, d.n_embd))  # fused gate + up (SwiGLU)
        s.tensor(f"blk.{i}.ffn_down.weight", (d.n_embd, d.n_ff))
    half = d.head_dim // 2
    s.tensor("rope_factors_long.weight", (half,), np.linspace(1.0, 6.0, half))
    s.tensor("rope_factors_short.weight", (half,), np.linspace(1.0, 1.5, half))


def _granite(s: _Spec) -> None:
    _common(s)
    s.key("embedding_scale", 12.0)  # llama.cpp applies it to batch.embd input too: first part only
    s.key("residual_scale", 0.22)
    s.key("attention.scale", 0.0625)
    s.key("logit_scale", 8.0)  # required by llama.cpp in every part; divides the logits
    for i in range(s.dims.n_layer):
        _attention(s, i)
        _ffn(s, i)


def _olmo2(s: _Spec) -> None:
    d = s.dims
    _common(s)
    s.key("attention.sliding_window", 8)  # OLMo 3 style: blocks 3, 7, ... global, the rest SWA
    for i in range(d.n_layer):
        _attention(s, i, qk_norm=d.q, norm=False)  # Q/K norms over all heads, no pre-norms
        s.tensor(f"blk.{i}.post_attention_norm.weight", (d.n_embd,), "norm")
        _ffn(s, i, norm=False)
        s.tensor(f"blk.{i}.post_ffw_norm.weight", (d.n_embd,), "norm")


def _gemma2(s: _Spec) -> None:
    d = s.dims
    _common(s)
    s.key("attention.sliding_window", 8)  # even blocks SWA, always on
    s.key("attn_logit_softcapping", 50.0)
    s.key("final_logit_softcapping", 30.0)
    for i in range(d.n_layer):
        _attention(s, i)
        s.tensor(f"blk.{i}.post_attention_norm.weight", (d.n_embd,), "norm")
        _ffn(s, i)
        s.tensor(f"blk.{i}.post_ffw_norm.weight", (d.n_embd,), "norm")


def _gemma3(s: _Spec) -> None:
    d = s.dims
    _common(s)
    s.key("attention.sliding_window", 8)  # block 5 global (period 6), the rest SWA
    s.key("rope.freq_base", 1000000.0)  # global blocks, scaled linearly by 8
    s.key("rope.freq_base_swa", 10000.0)  # SWA blocks, unscaled
    s.key("rope.scaling.type", "linear")
    s.key("rope.scaling.factor", 8.0)
    for i in range(d.n_layer):
        _attention(s, i, qk_norm=d.head_dim)
        s.tensor(f"blk.{i}.post_attention_norm.weight", (d.n_embd,), "norm")
        _ffn(s, i)
        s.tensor(f"blk.{i}.post_ffw_norm.weight", (d.n_embd,), "norm")


def _deepseek2(s: _Spec) -> None:
    # Low-rank Q and compressed KV (the MHA form of MLA: attn_kv_b), a leading dense block,
    # MoE with a shared expert and a selection bias; no expert_gating_func key (llama.cpp's
    # default depends on the block count, so slices write it out).
    d = s.dims
    q_lora, kv_lora, nope, rope, v = 32, 16, 16, 8, 16
    _common(s, rope_dims=rope)
    s.key("attention.head_count_kv", d.n_head)  # K and V per head, decompressed from the latent
    s.key("attention.key_length", nope + rope)
    s.key("attention.value_length", v)
    s.key("attention.q_lora_rank", q_lora)
    s.key("attention.kv_lora_rank", kv_lora)
    s.key("leading_dense_block_count", 1)
    s.key("expert_count", 4)
    s.key("expert_used_count", 2)
    s.key("expert_shared_count", 1)
    s.key("expert_feed_forward_length", 32)
    s.key("expert_weights_scale", 1.0)
    s.key("expert_weights_norm", True)
    for i in range(d.n_layer):
        s.tensor(f"blk.{i}.attn_norm.weight", (d.n_embd,), "norm")
        s.tensor(f"blk.{i}.attn_q_a.weight", (q_lora, d.n_embd))
        s.tensor(f"blk.{i}.attn_q_a_norm.weight", (q_lora,), "norm")
        s.tensor(f"blk.{i}.attn_q_b.weight", (d.n_head * (nope + rope), q_lora))
        s.tensor(f"blk.{i}.attn_kv_a_mqa.weight", (kv_lora + rope, d.n_embd))
        s.tensor(f"blk.{i}.attn_kv_a_norm.weight", (kv_lora,), "norm")
        s.tensor(f"blk.{i}.attn_kv_b.weight", (d.n_head * (nope + v), kv_lora))
        s.tensor(f"blk.{i}.attn_output.weight", (d.n_embd, d.n_head * v))
        if i < 1:
            _ffn(s, i)
        else:
            s.tensor(f"blk.{i}.ffn_norm.weight", (d.n_embd,), "norm")
            _experts(s, i, 4, 32, shared=32, probs_bias=True)


def _llama4(s: _Spec) -> None:
    # Chunked attention (no sliding_window key), RoPE off on every 4th block, MoE (one routed
    # expert, sigmoid, plus a shared one) on every 2nd block: only multiples of 4 are exact.
    d = s.dims
    _common(s)
    s.key("interleave_moe_layer_step", 2)
    s.key("expert_count", 4)
    s.key("expert_used_count", 1)
    s.key("expert_feed_forward_length", 32)
    for i in range(d.n_layer):
        _attention(s, i)
        if (i + 1) % 2 == 0:
            s.tensor(f"blk.{i}.ffn_norm.weight", (d.n_embd,), "norm")
            _experts(s, i, 4, 32, shared=32)
        else:
            _ffn(s, i)


def _model(arch: str, dims: Dims, build: Callable[[_Spec], None], chains: tuple[tuple[int, ...], ...],
           quirks: str, *, head: bool, head_bias: bool = False, embd_std: float = 1.0) -> ArchModel:
    return ArchModel(arch, dims, build, chains, quirks, head, head_bias, embd_std=embd_std)


MODELS: dict[str, ArchModel] = {
    m.arch: m
    for m in (
        _model("llama", Dims(5), _llama, ((0, 2, 5), (0, 1, 4, 5)),
               "GQA, rope_freqs factors, tied head", head=False, embd_std=0.1),
        _model("qwen2", Dims(5), _qwen2, ((0, 3, 5), (0, 1, 4, 5)),
               "Q/K/V biases, untied head with output.bias", head=True, head_bias=True),
        _model("qwen3", Dims(5, head_dim=32), _qwen3, ((0, 2, 5), (0, 1, 4, 5)),
               "per-head Q/K norms, head_dim 32 (key_length), tied head", head=False, embd_std=0.1),
        _model("qwen3moe", Dims(5), _qwen3moe, ((0, 3, 5), (0, 1, 4, 5)),
               "4 experts (2 used), Q/K norms, per-layer arrays, untied head", head=True),
        _model("phi3", Dims(5), _phi3, ((0, 2, 5), (0, 1, 4, 5)),
               "fused QKV and gate/up, long/short RoPE factors, sliding_window key (ignored)", head=True),
        _model("granite", Dims(5), _granite, ((0, 3, 5), (0, 1, 4, 5)),
               "embedding, residual, attention and logit scales, tied head", head=False, embd_std=0.001),
        _model("olmo2", Dims(6), _olmo2, ((0, 3, 6), (0, 1, 5, 6), (0, 3, 4, 6)),
               "SWA (window 8, period 4), Q/K norms, post-norms only, required head", head=True),
        _model("gemma2", Dims(5, n_embd=96, head_dim=24, n_ff=192), _gemma2, ((0, 3, 5), (0, 1, 4, 5)),
               "SWA on even blocks (window 8), attention and final logit soft-capping, "
               "post-norms, sqrt(96) input scale, tied head", head=False, embd_std=0.03),
        _model("gemma3", Dims(8, n_head_kv=1, head_dim=32), _gemma3, ((0, 5, 8), (0, 1, 7, 8), (0, 5, 6, 8)),
               "SWA (window 8, period 6) with its own RoPE base, linear RoPE scaling on global "
               "blocks, Q/K norms, post-norms, MQA, tied head", head=False, embd_std=0.03),
        _model("deepseek2", Dims(5), _deepseek2, ((0, 2, 5), (0, 1, 4, 5)),
               "low-rank Q/KV attention, leading dense block, 4 experts + shared expert with "
               "selection bias, default gating", head=True),
        _model("llama4", Dims(12), _llama4, ((0, 4, 12), (0, 4, 8, 12)),
               "chunked attention, NoPE every 4th block, MoE every 2nd block with a shared "
               "expert (boundaries: multiples of 4)", head=True),
    )
}
#: Architectures with a test model.
ARCHS: tuple[str, ...] = tuple(MODELS)


def get_arch_model(arch: str) -> ArchModel:
    try:
        return MODELS[arch]
    except KeyError:
        raise ValueError(f"no test model for architecture {arch!r}; choose one of {', '.join(ARCHS)}") from None


def _values(rng: np.random.Generator, shape: tuple[int, ...], kind: str | np.ndarray, embd_std: float) -> np.ndarray:
    if isinstance(kind, np.ndarray):
        return kind.astype(np.float32).reshape(shape)
    if kind == "norm":
        return (1.0 + 0.2 * (rng.random(shape, dtype=np.float32) - 0.5)).astype(np.float32)
    std = {"embd": embd_std, "bias": 0.1}.get(kind, shape[-1] ** -0.5)
    data = rng.random(shape, dtype=np.float32)
    data -= np.float32(0.5)
    data *= np.float32(std * 12**0.5)
    return data


def write_arch_model(arch: str, out: Path) -> Path:
    """Write ``arch``'s test model to ``out`` atomically; return ``out``."""
    model = get_arch_model(arch)
    spec = model.spec()
    tokens, scores, types = build_vocab(None)
    out = Path(out)
    with atomic_output(out) as tmp, gguf_writer(tmp, model.arch) as writer:
        # Neutral name: llama.cpp keys vocabulary quirks on model names ("phi3" wants <|endoftext|>).
        writer.add_name("trio-shard test model")
        writer.add_description(f"random-weight {model.arch} test model ({model.quirks}), v{ARCH_MODEL_VERSION}")
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        for name, value, vtype, sub in spec.keys:
            writer.add_key_value(name, value, vtype, sub_type=sub)
        add_vocab(writer, tokens, scores, types)
        rng = np.random.Generator(np.random.PCG64(model.seed))
        for name, shape, kind in spec.tensors:
            writer.add_tensor(name, _values(rng, shape, kind, model.embd_std))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    return out


def ensure_arch_model(arch: str) -> Path:
    """The cached test model of ``arch``, written once (safe under concurrent callers)."""
    model = get_arch_model(arch)
    path = cache_dir() / f"arch-{arch}-v{ARCH_MODEL_VERSION}-{model.digest()}.gguf"
    if path.is_file():
        return path
    return write_arch_model(arch, path)


__all__ = ["ARCHS", "ARCH_MODEL_VERSION", "MODELS", "ArchModel", "Dims", "ensure_arch_model",
           "get_arch_model", "write_arch_model"]
