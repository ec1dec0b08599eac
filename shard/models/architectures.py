"""Everything layer ranges need to know about a model architecture: the one table.

A layer range is served from a sliced GGUF that stock llama.cpp loads as a smaller model
(``shard.models.slice``), so everything llama.cpp derives from a block's *index* or from the
*block count* must come out for the slice as it does inside the whole model. What llama.cpp
0.3.36 derives that way differs per architecture (read from the vendored sources,
``vendor/llama.cpp/src/llama-model.cpp`` and ``src/models/<arch>.cpp``); this module records it,
per architecture:

* **per-layer metadata arrays** read with ``get_key_or_arr`` (length-checked against the block
  count): cut to ``[A:B]``; an array of block-count length the table does not know is refused
  (cutting or copying it could misalign layers silently);
* **patterns written out**: the sliding-window (SWA) pattern, which llama.cpp otherwise
  derives as ``il % n`` on the *slice's* block index, is written as the explicit per-layer bool
  array ``<arch>.attention.sliding_window_pattern``; a slice without any SWA block drops
  ``<arch>.attention.sliding_window`` where llama.cpp allows it (otherwise it aborts the process
  with ``GGML_ASSERT(hparams.is_swa_any())``) and is refused where it does not;
* **what each part keeps** (``Head``): the LM head is optional (tied to ``token_embd`` when
  absent), always tied (Gemma 2: the last shard needs the real ``token_embd``) or required in
  every file (OLMo2: non-last parts get an all-zero stand-in); ``output.*`` tensors
  (``output.bias``) go with the head;
* **hidden-state input**: keys that scale token embeddings but that llama.cpp also applies to
  ``batch.embd`` input are dropped from non-first parts (Granite's ``embedding_scale``); where no
  key can be dropped, the engine divides incoming rows by the factor llama.cpp multiplies
  them with (Gemma 2, ``embd_input_scale``);
* **key rewrites** for values llama.cpp derives from the block count or the block index
  (DeepSeek2: leading dense blocks, expert gating, the "lite" variant);
* **boundaries**: which ranges are exact (Llama 4: multiples of the block-index periods), and
  **refusals** with their reason: a model "type" derived from the block count that changes the
  maths (Gemma 2/3 27B attention scale), and architectures whose state crosses blocks in ways
  a hidden-state boundary cannot carry (Gemma 3n; recurrent and hybrid models).

The slicer and the engine read this table; nothing else in the project names an architecture.
Adding one is one entry here plus its test model (``shard.models.arch_models``), which the
equivalence suite (``tests/test_architectures.py``) then chains against the whole model.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from shard.layers import LayerRange

from .header import ModelInfo

GT = gguf.GGUFValueType

#: Per-layer arrays llama.cpp reads for every architecture (``get_key_or_arr`` in
#: ``llama_model::load_hparams``), as key suffixes after ``<arch>.``.
COMMON_PER_LAYER_KEYS = (
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "expert_used_count",
)
SWA_PATTERN = "attention.sliding_window_pattern"
SLIDING_WINDOW = "attention.sliding_window"
NEXTN_LAYERS = "nextn_predict_layers"
#: Tensors that make up the LM head (``output.weight``, ``output.bias``, ...); not ``output_norm``.
HEAD_PREFIX = "output."
HEAD_WEIGHT = "output.weight"
TOKEN_EMBD = "token_embd.weight"


class Head(enum.Enum):
    """Where llama.cpp takes an architecture's LM head from."""

    OPTIONAL = "optional"  # output.weight when present, else tied to token_embd
    TIED = "tied"  # always token_embd (output.weight is never read)
    REQUIRED = "required"  # output.weight must be in every file, even where it never runs


class Keep(enum.Enum):
    """What a part of a sliced model stores for one tensor."""

    REAL = "real"
    STAND_IN = "stand-in"  # all zeros, the right shape for the part's vocabulary
    DROP = "drop"


@dataclass(frozen=True)
class Model:
    """A model's header as the table reads it: ``meta`` holds scalars and small numeric arrays
    (``shard.models.header``); ``n_layer`` the blocks of the file the header belongs to."""

    arch: str
    meta: Mapping[str, Any]
    n_layer: int
    n_vocab: int | None = None

    @classmethod
    def of(cls, info: ModelInfo) -> Model:
        """The table's view of a file's header (``shard.models.header.read_model_info``)."""
        return cls(info.architecture, info.metadata, info.block_count, info.n_vocab)

    def key(self, suffix: str) -> str:
        return f"{self.arch}.{suffix}"

    def get(self, suffix: str, default: Any = None) -> Any:
        return self.meta.get(self.key(suffix), default)

    @property
    def n_embd(self) -> int:
        return int(self.get("embedding_length", 0))

    def n_head(self, il: int = 0) -> int:
        value = self.get("attention.head_count", 0)
        return int(value[il] if isinstance(value, tuple) else value)


@dataclass(frozen=True)
class KeyValue:
    """A metadata value to write, with its GGUF type (None: the type the source key has)."""

    value: Any
    type: gguf.GGUFValueType | None = None
    sub_type: gguf.GGUFValueType | None = None


#: Key edits of a slice: a new value, or None to drop the key.
Edits = dict[str, KeyValue | None]


@dataclass(frozen=True)
class SlidingWindow:
    """How llama.cpp decides which blocks use sliding-window attention (``load_swa_pattern``):
    the per-layer array ``<arch>.attention.sliding_window_pattern`` if present, else a period
    ``n`` (the key as a scalar, or ``period``) applied to the block index: ``il % n < n - 1``
    is SWA (``dense_first``: ``il % n != 0``)."""

    period: int
    dense_first: bool = False
    #: When llama.cpp turns SWA on: ``"window"``, only with ``<arch>.attention.sliding_window``
    #: > 0 (Gemma 3, OLMo2: a slice without SWA blocks drops the key); ``"always"`` (Gemma 2)
    #: or ``"unless-zero"`` (Llama 4: unless the key is 0): a slice must hold an SWA block.
    on: str = "window"

    def active(self, model: Model) -> bool:
        window = model.get(SLIDING_WINDOW)
        if self.on == "always":
            return True
        if self.on == "unless-zero":
            return not (isinstance(window, int) and window == 0)
        return isinstance(window, int) and window > 0

    @property
    def droppable(self) -> bool:
        """Whether dropping ``sliding_window`` turns SWA off (so an all-dense slice loads)."""
        return self.on == "window"

    def pattern(self, model: Model) -> tuple[bool, ...] | None:
        """Which of the file's blocks are SWA blocks (None: SWA is off for this model)."""
        if not self.active(model):
            return None
        value = model.get(SWA_PATTERN)
        if isinstance(value, tuple):
            return tuple(bool(value[il]) if il < len(value) else False for il in range(model.n_layer))
        n = int(value) if isinstance(value, int) and not isinstance(value, bool) else self.period
        if n == 0:
            return (True,) * model.n_layer
        if self.dense_first:
            return tuple(il % n != 0 for il in range(model.n_layer))
        return tuple(il % n < n - 1 for il in range(model.n_layer))


Rule = Callable[[Model, LayerRange], str | None]


@dataclass(frozen=True)
class Architecture:
    """One row of the table. ``refused`` set: the architecture is served whole only."""

    name: str
    title: str
    refused: str | None = None
    head: Head = Head.OPTIONAL
    per_layer_keys: tuple[str, ...] = ()  # beyond COMMON_PER_LAYER_KEYS
    sliding_window: SlidingWindow | None = None
    #: Keys llama.cpp applies to token embeddings *and* to hidden-state input: dropped from
    #: non-first parts (their input is already scaled).
    token_input_keys: tuple[str, ...] = ()
    #: The factor llama.cpp multiplies hidden-state (``batch.embd``) input by, when no key can be
    #: dropped instead: the engine divides incoming rows by it.
    embd_input_scale: Callable[[Model], float] | None = None
    #: Which block boundaries are exact for a model (None: any). Returns the cut multiple:
    #: every boundary strictly inside the model must be a multiple of it (0: none is exact).
    cut_multiple: Callable[[Model], int] | None = None
    #: Further refusals of a range (a reason, or None).
    rules: tuple[Rule, ...] = ()
    #: Arch-specific key edits of a slice (values llama.cpp derives from the block count).
    edits: Callable[[Model, LayerRange], Edits] | None = None
    #: Largest |logit difference| a chain of shards shows against the whole model (0: bit-exact)
    #: and why it is not 0.
    tolerance: float = 0.0
    tolerance_why: str = ""
    #: What the docs and ``caps`` say about boundaries.
    boundaries: str = "any"

    @property
    def supported(self) -> bool:
        return self.refused is None

    # ---- checks ------------------------------------------------------------------------------

    def refusal(self, model: Model, layers: LayerRange) -> str | None:
        """Why ``layers`` of ``model`` (a whole model) cannot be served exactly, or None."""
        if self.refused is not None:
            return self.refused
        total = model.n_layer
        if layers == LayerRange(0, total):
            return None
        nextn = model.get(NEXTN_LAYERS, 0)
        if isinstance(nextn, int) and nextn > 0:
            return (f"the model stores {nextn} NextN/MTP block(s) after its {total - nextn} trunk "
                    f"blocks, and slicing those is not supported")
        known = {model.key(k) for k in (*COMMON_PER_LAYER_KEYS, *self.per_layer_keys, SWA_PATTERN)}
        for key, value in model.meta.items():
            if key.startswith(f"{self.name}.") and isinstance(value, tuple) and len(value) == total \
                    and key not in known:
                return (f"metadata key {key!r} looks like a per-layer array that the architecture "
                        f"table does not know: a slice could misalign its layers")
        if self.cut_multiple is not None:
            m = self.cut_multiple(model)
            bad = [c for c in (layers.start, layers.end) if 0 < c < total and (m == 0 or c % m)]
            if bad:
                return f"block boundary {bad[0]} is not exact for {self.title}: {self.allowed(model)}"
        for rule in self.rules:
            reason = rule(model, layers)
            if reason is not None:
                return reason
        if self.sliding_window is not None and not self.sliding_window.droppable:
            pattern = self.sliding_window.pattern(model)
            if pattern is not None and not any(pattern[layers.start : layers.end]):
                return (f"blocks {layers.start}..{layers.end - 1} are all global-attention blocks; "
                        f"llama.cpp's {self.title} graph needs a sliding-window block in every file "
                        f"(it would abort): {self.allowed(model)}")
        return None

    def allowed(self, model: Model) -> str:
        """The boundaries this model allows, said for a person (used in refusals)."""
        if self.refused is not None:
            return "none (the model is served whole)"
        if self.cut_multiple is not None:
            m = self.cut_multiple(model)
            if m == 0:
                return "none (the model is served whole)"
            cuts = ", ".join(str(c) for c in range(0, model.n_layer + 1, m))
            return f"allowed boundaries are multiples of {m} ({cuts})"
        return f"allowed boundaries: {self.boundaries}"

    def load_refusal(self, model: Model) -> str | None:
        """Why llama.cpp would abort the process on this file (whole or slice), or None."""
        sw = self.sliding_window
        if sw is not None and sw.active(model):
            pattern = sw.pattern(model)
            if pattern is not None and not any(pattern):
                return (f"{self.title} file with sliding-window attention on but no sliding-window "
                        f"block: llama.cpp would abort (GGML_ASSERT(hparams.is_swa_any()))")
        return None

    # ---- what a slice writes -----------------------------------------------------------------

    def slice_edits(self, model: Model, layers: LayerRange, *, first: bool) -> Edits:
        """Every metadata change a slice of ``layers`` needs (after ``refusal`` said None)."""
        a, b = layers.start, layers.end
        edits: Edits = {model.key("block_count"): KeyValue(layers.count, GT.UINT32)}
        for suffix in (*COMMON_PER_LAYER_KEYS, *self.per_layer_keys):
            value = model.get(suffix)
            if isinstance(value, tuple) and len(value) == model.n_layer:
                edits[model.key(suffix)] = _array(value[a:b])
        sw = self.sliding_window
        pattern = None if sw is None else sw.pattern(model)
        if pattern is not None:
            part = pattern[a:b]
            if any(part):
                edits[model.key(SWA_PATTERN)] = KeyValue(list(part), GT.ARRAY, GT.BOOL)
            else:  # only reachable when dropping the window turns SWA off (refusal())
                edits[model.key(SLIDING_WINDOW)] = None
                edits[model.key(SWA_PATTERN)] = None
        elif isinstance(model.get(SWA_PATTERN), tuple) and len(model.get(SWA_PATTERN)) == model.n_layer:
            # Not read while SWA is off, but keep it aligned with the blocks.
            edits[model.key(SWA_PATTERN)] = _array(model.get(SWA_PATTERN)[a:b])
        if not first:
            for suffix in self.token_input_keys:
                if model.key(suffix) in model.meta:
                    edits[model.key(suffix)] = None
        if self.edits is not None:
            edits.update(self.edits(model, layers))
        return edits

    def keep(self, tensor: str, *, first: bool, last: bool, tied: bool) -> Keep:
        """What a part stores for a non-block tensor. ``tied``: the source has no
        ``output.weight``, so llama.cpp uses ``token_embd`` as the head."""
        if tensor == TOKEN_EMBD:
            head_is_embd = self.head is Head.TIED or (self.head is Head.OPTIONAL and tied)
            return Keep.REAL if first or (last and head_is_embd) else Keep.STAND_IN
        if tensor.startswith(HEAD_PREFIX):
            if last:
                return Keep.REAL
            return Keep.STAND_IN if self.head is Head.REQUIRED and tensor == HEAD_WEIGHT else Keep.DROP
        return Keep.REAL


def _array(values: tuple[Any, ...]) -> KeyValue:
    """A cut per-layer array, written with the source key's types."""
    return KeyValue(list(values))


# ---- architecture-specific rules ---------------------------------------------------------------


def _attention_scale_by_block_count(title: str, big: int) -> Rule:
    """Gemma 2 and 3 (``models/gemma2.cpp``, ``gemma3.cpp``): llama.cpp classifies a model with
    ``big`` blocks as 27B and then scales attention by ``1/sqrt(n_embd / n_head)`` instead of
    ``1/sqrt(head_dim)``; no key overrides it. A slice that changes the classification and the
    value changes the maths."""

    def scale(model: Model, blocks: int) -> np.float32:
        head_dim = int(model.get("attention.key_length", 0)) or model.n_embd // max(model.n_head(), 1)
        dim = model.n_embd // max(model.n_head(), 1) if blocks == big else head_dim
        return np.float32(1.0) / np.sqrt(np.float32(dim))

    def rule(model: Model, layers: LayerRange) -> str | None:
        if scale(model, model.n_layer) == scale(model, layers.count):
            return None
        return (f"llama.cpp derives {title}'s attention scale from the block count ({big} blocks: "
                f"the 27B variant); a {layers.count}-block slice of this {model.n_layer}-block model "
                f"would use another scale, and no metadata key can say which: serve it whole")

    return rule


def _gemma2_input_scale(model: Model) -> float:
    # models/gemma2.cpp: inpL = ggml_scale(inpL, sqrtf(n_embd)), for token *and* embd input.
    return float(np.sqrt(np.float32(model.n_embd), dtype=np.float32))


_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2


def _deepseek2_lite(blocks: int, n_vocab: int | None) -> bool:
    # models/deepseek2.cpp: "lite" variants skip q_lora_rank and use one Q projection.
    return blocks in (26, 27) or (blocks == 48 and n_vocab == 128256)


def _deepseek2_rule(model: Model, layers: LayerRange) -> str | None:
    q_lora = model.get("attention.q_lora_rank", 0)
    whole_lite = _deepseek2_lite(model.n_layer, model.n_vocab)
    if not whole_lite and isinstance(q_lora, int) and q_lora > 0 and _deepseek2_lite(layers.count, model.n_vocab):
        return (f"llama.cpp treats a DeepSeek2 file of {layers.count} blocks as a 'lite' model "
                f"(no q_lora_rank: another Q projection) from its block count alone; a slice of "
                f"{layers.count} blocks of this model cannot load: choose another boundary")
    return None


def _deepseek2_edits(model: Model, layers: LayerRange) -> Edits:
    edits: Edits = {}
    lead = model.get("leading_dense_block_count")
    if isinstance(lead, int):  # blocks il < lead are dense: renumbered, the count moves
        edits[model.key("leading_dense_block_count")] = KeyValue(
            max(0, min(lead - layers.start, layers.count)), GT.UINT32)
    if not model.get("expert_gating_func"):  # the default depends on the block count
        glm_lite = model.n_layer in (47, 48) and model.n_vocab == 154880
        edits[model.key("expert_gating_func")] = KeyValue(
            _GATING_SIGMOID if glm_lite else _GATING_SOFTMAX, GT.UINT32)
    if _deepseek2_lite(model.n_layer, model.n_vocab) and not _deepseek2_lite(layers.count, model.n_vocab):
        # A lite model's slice is not classified lite: say "no Q LoRA" with the key instead.
        edits[model.key("attention.q_lora_rank")] = KeyValue(0, GT.UINT32)
    return edits


def _llama4_cut_multiple(model: Model) -> int:
    # models/llama4.cpp: with chunked attention, RoPE is off on blocks (il + 1) % 4 == 0 and
    # MoE runs on (il + 1) % interleave_moe_layer_step == 0; without it (sliding_window 0)
    # the NoPE step is the file's own block count: no boundary is exact.
    window = model.get(SLIDING_WINDOW)
    if isinstance(window, int) and window == 0:
        return 0
    step = model.get("interleave_moe_layer_step", 0)
    step = int(step) if isinstance(step, int) and step > 0 else 1
    return math.lcm(4, step)


_RECURRENT = (
    "has recurrent (state-space or linear-attention) layers whose per-layer arrays and state "
    "layout are not sliced, and no equivalence test covers it"
)

_ENTRIES = (
    Architecture("llama", "Llama"),  # also Mistral and tied-head models: nothing else differs
    Architecture("qwen2", "Qwen 2"),
    Architecture("qwen3", "Qwen 3"),
    Architecture("qwen3moe", "Qwen 3 MoE", per_layer_keys=("expert_feed_forward_length",)),
    Architecture("phi3", "Phi 3"),
    Architecture("granite", "Granite", token_input_keys=("embedding_scale",)),
    Architecture(
        "olmo2", "OLMo 2", head=Head.REQUIRED,
        sliding_window=SlidingWindow(period=4),
    ),
    Architecture(
        "gemma2", "Gemma 2", head=Head.TIED,
        sliding_window=SlidingWindow(period=2, on="always"),
        embd_input_scale=_gemma2_input_scale,
        rules=(_attention_scale_by_block_count("Gemma 2", 46),),
        tolerance=1e-3,
        tolerance_why="llama.cpp multiplies hidden-state input by sqrt(n_embd) in float32; the "
        "engine pre-divides, and about 13% of values (n_embd 96) have no float32 preimage, so "
        "they arrive one ulp off at each boundary (exact only when sqrt(n_embd) is a power of 2)",
        boundaries="any, except a range of global-attention blocks only (a single odd block); "
        "none for the 27B (46 blocks)",
    ),
    Architecture(
        "gemma3", "Gemma 3",
        sliding_window=SlidingWindow(period=6),
        rules=(_attention_scale_by_block_count("Gemma 3", 62),),
        boundaries="any; none for the 27B (62 blocks)",
    ),
    Architecture(
        "deepseek2", "DeepSeek 2", per_layer_keys=("expert_feed_forward_length",),
        rules=(_deepseek2_rule,), edits=_deepseek2_edits,
        boundaries="any, except a slice of 26 or 27 blocks (48 with a 128,256-token vocabulary) "
        "of a non-lite model",
    ),
    Architecture(
        "llama4", "Llama 4", per_layer_keys=("expert_feed_forward_length",),
        sliding_window=SlidingWindow(period=4, on="unless-zero"),
        cut_multiple=_llama4_cut_multiple,
        boundaries="multiples of 4 and of interleave_moe_layer_step; none without chunked attention",
    ),
    Architecture(
        "gemma3n", "Gemma 3n",
        refused="Gemma 3n feeds per-layer token embeddings into every block, carries a 4-stream "
        "hidden state (AltUp) across blocks and shares KV caches between blocks: one hidden "
        "state at a block boundary cannot carry that",
    ),
    *(Architecture(name, name, refused=f"{name} {_RECURRENT}")
      for name in ("jamba", "granitehybrid", "qwen3next", "mamba", "mamba2", "rwkv6", "rwkv7",
                   "falcon-h1", "lfm2", "nemotron_h", "plamo2", "qwen35", "qwen35moe")),
)

#: The table, by GGUF ``general.architecture`` name.
ARCHITECTURES: Mapping[str, Architecture] = {a.name: a for a in _ENTRIES}


def lookup(name: str) -> Architecture:
    """The table's entry for ``name``; an architecture without one is refused, saying so."""
    entry = ARCHITECTURES.get(name)
    if entry is not None:
        return entry
    return Architecture(
        name, name,
        refused=f"architecture {name!r} has no entry in the architecture table "
        f"(layer ranges are supported for: {', '.join(supported())})",
    )


def supported() -> tuple[str, ...]:
    """Architectures whose layer ranges are served, in table order."""
    return tuple(a.name for a in _ENTRIES if a.supported)


__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "Edits",
    "Head",
    "Keep",
    "KeyValue",
    "Model",
    "SlidingWindow",
    "lookup",
    "supported",
]
