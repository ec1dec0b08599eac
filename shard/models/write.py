"""Write small, deterministic llama-architecture GGUF files without downloading anything.

Why: tests, the contract suite and benchmarks need a *real* GGUF that llama.cpp loads and runs,
but the project must never fetch model weights. A model with random weights from a fixed seed
exercises every code path that matters here (tokenizer, KV cache, decode, cancellation); its
text is gibberish, which is fine. The same preset always yields the same bytes, so a file's
SHA-256 (the engine's model fingerprint) is stable across machines and runs.

Resource handling: ``write_model`` writes to a temporary file next to the target and renames it
into place with ``os.replace``; readers never observe a partial file, and two concurrent
writers simply race to rename identical bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import os
import string
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np

#: Bump when the generator's output changes for reasons not captured by ``ModelPreset``
#: (tensor order, vocabulary rules, metadata keys). It is part of the cache file name.
GENERATOR_VERSION = 2

_SPM_SPACE = "\u2581"  # SentencePiece's word-boundary marker "▁"

# Common English words: enough for readable tokenization of test prompts.
_WORDS = (
    "the of and to in is was for on that with as by at from it his an were are which this be "
    "or has had not but first one their its new after who they have her she two been other when "
    "there all during into school time may years more most only over city some world would where "
    "later up such used many can state about national out known university united then made year "
    "hello how what why your you we our us me my he him them i a do does did go going come "
    "good great small large long short old young big little high low right left yes no "
    "day night week month today tomorrow morning evening water fire earth air sun moon star "
    "tree house car road river sea mountain book word name story people man woman child "
    "friend family work play run walk talk say said tell ask answer question quick brown fox "
    "jumps lazy dog cat bird fish once upon model token shard trio llama test prompt "
    "one two three four five six seven eight nine ten hundred thousand number"
).split()


@dataclass(frozen=True)
class ModelPreset:
    """Shape of a generated model. Every field changes the output, so all of them are hashed
    into the cache file name (see ``cache_file_name``)."""

    name: str
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int | None  # None: just the base vocabulary (specials + bytes + words)
    context_length: int
    weight_type: str  # "F32" | "F16" | "Q8_0" (norms are always F32)
    seed: int
    rms_eps: float = 1e-5
    rope_freq_base: float = 10000.0
    #: ChatML: the control tokens ``<|im_start|>``/``<|im_end|>`` (end of turn) in the
    #: vocabulary and ``CHATML_TEMPLATE`` as ``tokenizer.chat_template``.
    chat: bool = False
    #: ``<arch>.pooling_type`` (llama.cpp's ``LLM_KV_POOLING_TYPE``, read for every
    #: architecture): 0 writes none (a text generator), 1 mean, 2 CLS, 3 last. A model that
    #: declares one computes pooled embeddings (``ShardEngine.embed``).
    pooling_type: int = 0


#: The chat template of the ``chat`` preset (ChatML, as Qwen and many fine-tunes use), with a
#: leading BOS so that a renderer's handling of it is exercised.
CHATML_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
_CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")

#: ChatML with tools as Qwen 2.5 renders them (Hermes' ``<tool_call>`` format): the tools in
#: the system turn, earlier calls as ``<tool_call>`` blocks, tool answers as
#: ``<tool_response>`` blocks in a user turn. The ``tools`` preset's template.
HERMES_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": \\\"' + tool_call.name + '\\\", \\\"arguments\\\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
#: Presets whose chat template is not plain ChatML.
_TEMPLATES = {"tools": HERMES_TOOLS_TEMPLATE}


_PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(
        name="tiny",
        n_embd=64,
        n_layer=4,
        n_head=4,
        n_head_kv=2,
        n_ff=128,
        n_vocab=None,
        context_length=4096,
        weight_type="F32",
        seed=20240601,
    ),
    "bench": ModelPreset(
        name="bench",
        n_embd=1024,
        n_layer=12,
        n_head=16,
        n_head_kv=4,
        n_ff=2816,
        n_vocab=32000,
        context_length=4096,
        weight_type="Q8_0",
        seed=20240602,
    ),
}
# The tiny shape with a chat template and its end-of-turn token (tests of chat rendering).
_PRESETS["chat"] = dataclasses.replace(_PRESETS["tiny"], name="chat", seed=20240603, chat=True)
# The tiny shape with a chat template that renders tools (``HERMES_TOOLS_TEMPLATE``).
_PRESETS["tools"] = dataclasses.replace(_PRESETS["chat"], name="tools", seed=20240604)
# The tiny shape declaring mean pooling: an embedding model (``/v1/embeddings``).
_PRESETS["embed"] = dataclasses.replace(_PRESETS["tiny"], name="embed", seed=20240605, pooling_type=1)

#: Names accepted by ``write_model`` and ``ensure_model``.
PRESETS: tuple[str, ...] = tuple(_PRESETS)


def get_preset(preset: str) -> ModelPreset:
    """The preset's shape; unknown names raise ValueError listing the valid ones."""
    try:
        return _PRESETS[preset]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}") from None


# ---- vocabulary --------------------------------------------------------------------------------


def build_vocab(
    n_vocab: int | None, controls: tuple[str, ...] = ()
) -> tuple[list[str], list[float], list[int]]:
    """An SPM ("llama") vocabulary: ``<unk> <s> </s>``, 256 byte-fallback tokens, word pieces.

    Word pieces include every prefix of each ``▁word`` so llama.cpp's SPM merge loop (which only
    merges adjacent symbols whose concatenation is a token) can actually reach whole words.
    Scores rise with piece length so longer matches win. When ``n_vocab`` is larger, the rest is
    filled with deterministic letter pairs/triples (with and without ``▁``). ``controls``:
    more control tokens (a chat template's markers), right after ``</s>``.
    """
    tokens = ["<unk>", "<s>", "</s>", *controls]
    scores = [0.0] * len(tokens)
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL,
             *[gguf.TokenType.CONTROL] * len(controls)]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(gguf.TokenType.BYTE)

    seen = set(tokens)

    def add(piece: str) -> None:
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            scores.append(-1000.0 + 10.0 * len(piece) - 0.001 * len(tokens))
            types.append(gguf.TokenType.NORMAL)

    add(_SPM_SPACE)
    for ch in string.ascii_lowercase + string.ascii_uppercase + string.digits + ".,!?'-:;\"()":
        add(ch)
    for word in _WORDS:
        piece = _SPM_SPACE + word
        for end in range(2, len(piece) + 1):
            add(piece[:end])
    if n_vocab is not None:
        if n_vocab < len(tokens):
            raise ValueError(f"n_vocab {n_vocab} is smaller than the base vocabulary ({len(tokens)})")
        for filler in _filler_pieces():
            if len(tokens) >= n_vocab:
                break
            add(filler)
        if len(tokens) < n_vocab:  # pragma: no cover - the filler supply is far larger
            raise ValueError(f"cannot build a vocabulary of {n_vocab} tokens")
    return tokens, scores, [int(t) for t in types]


def _filler_pieces() -> Iterator[str]:
    letters = string.ascii_lowercase
    for n in (2, 3, 4):
        for combo in itertools.product(letters, repeat=n):
            s = "".join(combo)
            yield _SPM_SPACE + s
            yield s


# ---- tensors -----------------------------------------------------------------------------------


def _tensor_specs(p: ModelPreset, n_vocab: int) -> list[tuple[str, tuple[int, ...], float]]:
    """(name, numpy shape [rows, cols], std) in file order. 1-D tensors are RMS-norm weights."""
    head_dim = p.n_embd // p.n_head
    kv_dim = head_dim * p.n_head_kv
    specs: list[tuple[str, tuple[int, ...], float]] = [("token_embd.weight", (n_vocab, p.n_embd), 1.0)]
    for i in range(p.n_layer):
        e, f = p.n_embd, p.n_ff
        specs += [
            (f"blk.{i}.attn_norm.weight", (e,), 0.0),
            (f"blk.{i}.attn_q.weight", (e, e), e**-0.5),
            (f"blk.{i}.attn_k.weight", (kv_dim, e), e**-0.5),
            (f"blk.{i}.attn_v.weight", (kv_dim, e), e**-0.5),
            (f"blk.{i}.attn_output.weight", (e, e), e**-0.5),
            (f"blk.{i}.ffn_norm.weight", (e,), 0.0),
            (f"blk.{i}.ffn_gate.weight", (f, e), e**-0.5),
            (f"blk.{i}.ffn_up.weight", (f, e), e**-0.5),
            (f"blk.{i}.ffn_down.weight", (e, f), f**-0.5),
        ]
    specs += [("output_norm.weight", (p.n_embd,), 0.0), ("output.weight", (n_vocab, p.n_embd), p.n_embd**-0.5)]
    return specs


def _make_tensor(
    rng: np.random.Generator, shape: tuple[int, ...], std: float, weight_type: str
) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    if len(shape) == 1:  # norm weight: ones, always F32 (llama.cpp expects F32 norms)
        return np.ones(shape, dtype=np.float32), None
    # Uniform with the requested standard deviation: three times faster to draw than normal
    # samples (the bench preset has 200M weights), and the distribution shape is irrelevant.
    data = rng.random(shape, dtype=np.float32)
    data -= np.float32(0.5)
    data *= np.float32(std * 12**0.5)
    if weight_type == "F32":
        return data, None
    if weight_type == "F16":
        return data.astype(np.float16), None
    qtype = gguf.GGMLQuantizationType[weight_type]
    return gguf.quants.quantize(data, qtype), qtype


def _file_type(weight_type: str) -> int:
    return {
        "F32": gguf.LlamaFileType.ALL_F32,
        "F16": gguf.LlamaFileType.MOSTLY_F16,
        "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }[weight_type]


def add_vocab(
    writer: gguf.GGUFWriter, tokens: list[str], scores: list[float], types: list[int],
    chat_template: str = "",
) -> None:
    """The vocabulary keys of a generated model (``build_vocab``'s SPM vocabulary, BOS added)."""
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if _CHATML_TOKENS[1] in tokens:
        writer.add_eot_token_id(tokens.index(_CHATML_TOKENS[1]))
    if chat_template:
        writer.add_chat_template(chat_template)


def _write(p: ModelPreset, path: Path, progress: bool, chat_template: str | None,
           controls: tuple[str, ...] = ()) -> None:
    tokens, scores, types = build_vocab(p.n_vocab, (_CHATML_TOKENS if p.chat else ()) + controls)
    if chat_template is None:
        chat_template = _TEMPLATES.get(p.name, CHATML_TEMPLATE) if p.chat else ""
    n_vocab = len(tokens)
    arch = "llama"
    with gguf_writer(path, arch) as writer:
        writer.add_name(f"trio-shard-{p.name}")
        writer.add_description(f"random-weight test model, preset {p.name!r}, generator v{GENERATOR_VERSION}")
        writer.add_file_type(_file_type(p.weight_type))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_context_length(p.context_length)
        writer.add_embedding_length(p.n_embd)
        writer.add_block_count(p.n_layer)
        writer.add_feed_forward_length(p.n_ff)
        writer.add_head_count(p.n_head)
        writer.add_head_count_kv(p.n_head_kv)
        writer.add_rope_dimension_count(p.n_embd // p.n_head)
        writer.add_rope_freq_base(p.rope_freq_base)
        writer.add_layer_norm_rms_eps(p.rms_eps)
        if p.pooling_type:
            writer.add_pooling_type(gguf.PoolingType(p.pooling_type))
        add_vocab(writer, tokens, scores, types, chat_template)

        rng = np.random.Generator(np.random.PCG64(p.seed))
        specs = _tensor_specs(p, n_vocab)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(specs), desc=f"generating {p.name}", unit="tensor")
        try:
            for name, shape, std in specs:
                data, raw_dtype = _make_tensor(rng, shape, std, p.weight_type)
                writer.add_tensor(name, data, raw_dtype=raw_dtype)
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=progress)


def write_model(
    preset: str, out: Path, *, progress: bool = False, chat_template: str | None = None,
    controls: tuple[str, ...] = (),
) -> Path:
    """Write the preset's GGUF to ``out`` atomically (temp file + ``os.replace``); return ``out``.

    ``progress`` shows tqdm bars (useful for the ~200 MB ``bench`` preset). ``chat_template``:
    the ``tokenizer.chat_template`` to write instead of the preset's (ChatML for ``chat``,
    ``HERMES_TOOLS_TEMPLATE`` for ``tools``, none for the others); "" writes none.
    ``controls``: more control tokens after the preset's (another template's markers, such as
    Mistral's ``[TOOL_CALLS]``).
    """
    p = get_preset(preset)
    out = Path(out)
    with atomic_output(out) as tmp:
        _write(p, tmp, progress, chat_template, controls)
    return out


@contextlib.contextmanager
def gguf_writer(path: Path, arch: str) -> Iterator[gguf.GGUFWriter]:
    """A GGUF writer for ``path``: flushed and fsynced when the block succeeds (the file is then
    renamed into a cache others read), closed either way."""
    writer = gguf.GGUFWriter(path, arch)
    try:
        yield writer
        writer.flush()
        assert writer.fout is not None
        for fout in writer.fout:
            os.fsync(fout.fileno())
    finally:
        writer.close()


@contextlib.contextmanager
def atomic_output(out: Path) -> Iterator[Path]:
    """A temporary file next to ``out`` that becomes ``out`` (mode 0644, ``os.replace``) when the
    block succeeds and disappears when it fails: readers never see a partial file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a cached file is meant to be shared
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


# ---- cache -------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """``$TRIO_SHARD_CACHE`` if set, else ``~/.cache/trio-shard``."""
    env = os.environ.get("TRIO_SHARD_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "trio-shard"


def cache_file_name(preset: str) -> str:
    """File name tagged with the generator version and a hash of the preset's shape, so a changed
    generator or preset never reuses a stale cached file."""
    p = get_preset(preset)
    fields = asdict(p)
    if not fields["pooling_type"]:
        del fields["pooling_type"]  # the files of presets without one keep their names
    digest = hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:10]
    return f"{p.name}-g{GENERATOR_VERSION}-{digest}.gguf"


def ensure_model(preset: str = "tiny", *, progress: bool = False) -> Path:
    """Return the cached GGUF for ``preset``, writing it once if missing.

    Safe under concurrent callers (threads or processes): each writes its own temp file and the
    atomic rename publishes a complete file; identical bytes make the race harmless.
    """
    path = cache_dir() / cache_file_name(preset)
    if path.is_file():
        return path
    return write_model(preset, path, progress=progress)
