"""Project-owned value types that cross the ShardEngine contract.

All types are frozen dataclasses (numpy arrays are allowed, and are made read-only). Nothing from
llama.cpp, ggml or ctypes appears here: that keeps the transport and the tests independent of the
engine library, and lets a fake engine satisfy the same contract.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shard.layers import LayerRange

from .errors import InvalidGrammar, InvalidInput, UnsupportedFeature


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


class EngineState(enum.Enum):
    """Engine lifecycle; see docs/engine.md for the transitions."""

    CREATED = "created"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    CLOSED = "closed"


class SessionState(enum.Enum):
    """Session lifecycle; a released session no longer exists (UnknownSession)."""

    IDLE = "idle"
    RUNNING = "running"


class ResultKind(enum.Enum):
    LOGITS = "logits"  # last shard: distribution over the vocabulary
    BOUNDARY = "boundary"  # non-last shard: hidden states for the next shard


@dataclass(frozen=True)
class LoadSpec:
    """What to load and how much capacity to reserve.

    ``model_path`` may be None only for engines that need no file (the fake engine).
    ``layer_range`` None means the whole model.
    ``use_extra_bufts`` False loads weights without the engine's extra buffer types (llama.cpp's
    repacked and AMX weight layouts): slower on some quantizations, but it keeps a build that
    includes AMX kernels off them (see docs/engine.md, "Native builds").
    ``batch_tokens`` caps the rows of one batched step across sessions (None: ``n_batch``), so a
    long prompt delays running decodes by at most one such chunk; ``max_batch_sessions`` caps the
    sessions in one step (None: ``max_sessions``). Engines that do not batch ignore both.
    ``prefix_cache_tokens``: the prefix cache's budget in tokens (0: off; docs/engine.md,
    "Prefix cache"): released histories are kept up to it and a new prompt that starts with one
    reuses its cells. Off by default here, so a caller that does not ask pays no memory; the
    worker's options choose the operator's default.
    """

    model_path: Path | None = None
    layer_range: LayerRange | None = None
    n_ctx: int = 2048
    n_threads: int | None = None
    max_sessions: int = 4
    n_batch: int = 512
    use_extra_bufts: bool = True
    batch_tokens: int | None = None
    max_batch_sessions: int | None = None
    prefix_cache_tokens: int = 0

    def __post_init__(self) -> None:
        if self.n_ctx <= 0:
            raise InvalidInput("n_ctx must be positive")
        if self.max_sessions <= 0:
            raise InvalidInput("max_sessions must be positive")
        if self.n_batch <= 0:
            raise InvalidInput("n_batch must be positive")
        if self.n_threads is not None and self.n_threads <= 0:
            raise InvalidInput("n_threads must be positive")
        if self.batch_tokens is not None and self.batch_tokens <= 0:
            raise InvalidInput("batch_tokens must be positive")
        if self.max_batch_sessions is not None and self.max_batch_sessions <= 0:
            raise InvalidInput("max_batch_sessions must be positive")
        if not isinstance(self.use_extra_bufts, bool):
            raise InvalidInput("use_extra_bufts must be a boolean")
        if not _is_int(self.prefix_cache_tokens) or self.prefix_cache_tokens < 0:
            raise InvalidInput("prefix_cache_tokens must be an integer >= 0")


# --- Reserved hooks -------------------------------------------------------------------------
# Multi-token prediction and architecture auxiliary state are part of the contract's shape so
# that enabling them later is additive. Today every engine reports them disabled and a request
# that sets them fails closed with UnsupportedFeature (see ``check_reserved_hooks``).


@dataclass(frozen=True)
class MtpCapability:
    """Multi-token prediction support: ``max_draft_tokens`` > 0 when enabled."""

    enabled: bool = False
    max_draft_tokens: int = 0


class AuxStateKind(enum.Enum):
    RECURRENT = "recurrent"  # RNN / SSM (Mamba, RWKV) state carried between steps
    CROSS_ATTENTION = "cross_attention"  # encoder memory for cross-attention layers


@dataclass(frozen=True)
class AuxStateCapability:
    """Which auxiliary-state kinds the engine can import/export; empty when disabled."""

    kinds: tuple[AuxStateKind, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.kinds)


@dataclass(frozen=True)
class MtpRequest:
    """Ask for ``n_draft`` speculative tokens from MTP heads (reserved, not yet served)."""

    n_draft: int


@dataclass(frozen=True)
class AuxState:
    """Opaque architecture state of one kind, as bytes with a shape and dtype (reserved)."""

    kind: AuxStateKind
    data: bytes
    shape: tuple[int, ...]
    dtype: str = "float32"


@dataclass(frozen=True)
class MtpResult:
    """Draft tokens proposed by MTP heads (reserved; always None today)."""

    draft_token_ids: tuple[int, ...]


# --- Capabilities ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerRangeSupport:
    """Whether an engine serves layer ranges of its model's architecture. ``detail`` names the
    allowed block boundaries, or the reason ranges are refused ("" when unknown)."""

    supported: bool
    detail: str = ""



@dataclass(frozen=True)
class ChatTemplate:
    """A first shard's chat template (GGUF ``tokenizer.chat_template``, Jinja2) and the texts of
    the special tokens it is rendered with, so that a client renders a conversation without the
    model file. Empty texts where the model has none (and on later shards)."""

    template: str = ""
    bos_token: str = ""
    eos_token: str = ""
    eot_token: str = ""  # end of turn
    add_bos: bool = False  # tokenizing a text at position 0 adds BOS
    #: Every text that ``parse_special`` turns into a control token.
    special_texts: tuple[str, ...] = ()


#: Pooling types a model may declare (llama.cpp's ``llama_pooling_type`` 1..4, by name).
POOLING_TYPES = ("mean", "cls", "last", "rank")
#: Those that pool a sequence into one embedding ("rank" gives a reranker's score instead).
EMBEDDING_POOLING = ("mean", "cls", "last")


@dataclass(frozen=True)
class Capabilities:
    """What a loaded engine serves. Stable for the engine's lifetime."""

    engine: str  # "fake" | "llama.cpp"
    model_fingerprint: str  # hex digest identifying the full model's weights + metadata
    architecture: str
    n_layers_total: int
    layer_range: LayerRange
    n_embd: int
    n_vocab: int
    n_ctx: int  # total KV cells of the engine
    n_ctx_per_session: int  # most tokens one session can hold
    max_sessions: int
    bos_token_id: int | None
    eos_token_id: int | None
    hidden_dtype: str = "float32"
    #: The engine's own account of the native kernels it runs (llama.cpp's system info line and
    #: build profile), so a crash report or a benchmark says which code ran; "" for the fake.
    system_info: str = ""
    #: The most text bytes one token stands for (0: unknown). A first shard can then refuse a
    #: text that cannot fit a session before it tokenizes it (``tokenize_bounded``).
    max_token_bytes: int = 0
    #: Whether the model's architecture can be served as layer ranges, and on which boundaries
    #: (or why not): the architecture table's answer (``shard.models.architectures``).
    layer_ranges: LayerRangeSupport = field(default_factory=lambda: LayerRangeSupport(False, ""))
    #: First shard: the chat template and its special tokens (``ChatTemplate``).
    chat: ChatTemplate = field(default_factory=ChatTemplate)
    mtp: MtpCapability = field(default_factory=MtpCapability)
    aux_state: AuxStateCapability = field(default_factory=AuxStateCapability)
    #: How this engine lays out one session's KV state (``SessionSnapshot``): two engines of
    #: one model and range with the same layout can move a session between them (hand-off on
    #: drain); "" when this engine cannot export or import a session.
    kv_layout: str = ""
    #: The prefix cache's budget in effect, in tokens (0: off), and what it does or why it is
    #: off on this engine (docs/engine.md, "Prefix cache").
    prefix_cache_tokens: int = 0
    prefix_cache_detail: str = ""
    #: The grammar kinds this engine constrains its choice to (``GrammarSpec.kind``; last
    #: shards only, empty elsewhere or without the grammar library).
    grammar_kinds: tuple[str, ...] = ()
    #: The pooling type the model declares (GGUF ``<arch>.pooling_type``): one of
    #: ``POOLING_TYPES``, "" for none (a text generator). A whole-model engine of a model
    #: with an ``EMBEDDING_POOLING`` type computes pooled embeddings (``ShardEngine.embed``).
    pooling_type: str = ""

    @property
    def embeds(self) -> bool:
        """Whether ``ShardEngine.embed`` serves: a pooling model, served whole."""
        return self.pooling_type in EMBEDDING_POOLING and self.is_first and self.is_last

    @property
    def is_first(self) -> bool:
        """A first shard takes token ids; later shards take hidden states."""
        return self.layer_range.start == 0

    @property
    def is_last(self) -> bool:
        """A last shard returns logits; earlier shards return boundary hidden states."""
        return self.layer_range.end == self.n_layers_total

    @property
    def max_logits_positions(self) -> int:
        """The most positions one ``all_logits`` prefill may hold (0: not a last shard)."""
        return MAX_LOGITS_POSITIONS if self.is_last else 0

    @property
    def result_kind(self) -> ResultKind:
        return ResultKind.LOGITS if self.is_last else ResultKind.BOUNDARY


@dataclass(frozen=True)
class SessionSnapshot:
    """One session's state as an engine exported it (``ShardEngine.export_session``): the
    positions it holds, its token ids (None once it was fed hidden states), and its KV cells as
    opaque bytes in the engine's ``kv_layout``. Another engine of the same model, layer range
    and layout resumes the session from it without recomputing a position."""

    n_past: int
    tokens: tuple[int, ...] | None
    kv_layout: str
    data: bytes


# --- Requests -------------------------------------------------------------------------------


#: The grammar kinds of constrained decoding (``GrammarSpec.kind``): any JSON object, a JSON
#: schema, llama.cpp's GBNF, llguidance's Lark.
GRAMMAR_KINDS = ("json_object", "json_schema", "gbnf", "lark")
MAX_GRAMMAR_CHARS = 1 << 20


@dataclass(frozen=True)
class GrammarSpec:
    """Constrain a last shard's choice of tokens to a grammar (docs/engine.md, "Constrained
    decoding"). ``text``: the schema (JSON) or grammar; ignored for ``json_object``.

    ``start``: the session position of the first constrained token (the prompt's length). The
    grammar's state is then a function of the session's tokens from ``start`` on, as the
    sampler's stream is of the position: it follows a rewind, a resume, a replay or a hand-off
    without any state of its own crossing a wire.
    """

    kind: str
    text: str = ""
    start: int = 1

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidGrammar(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, "
                               f"got {self.kind!r}")
        if not isinstance(self.text, str) or len(self.text) > MAX_GRAMMAR_CHARS:
            raise InvalidGrammar(f"grammar must be a text of at most {MAX_GRAMMAR_CHARS} characters")
        if self.kind != "json_object" and not self.text.strip():
            raise InvalidGrammar(f"grammar of kind {self.kind!r} is empty")
        if not _is_int(self.start) or not 1 <= self.start < 2**32:
            raise InvalidGrammar("grammar start must be a position >= 1 (the prompt's length)")


@dataclass(frozen=True)
class SamplingParams:
    """How a last shard chooses the next token.

    ``temperature`` 0 means greedy (argmax). Sampling is a pure function of the logits, these
    parameters, the session position and (with penalties) the session's last ``penalty_last_n``
    token ids, so the same seed reproduces the same tokens.

    The rest follow llama.cpp's samplers (docs/engine.md, "Determinism and sampling"):
    ``min_p`` (0: off) keeps the tokens whose probability is at least ``min_p`` times the
    likeliest's; ``repeat_penalty`` (1: off), ``presence_penalty`` and ``frequency_penalty``
    (0: off) act on the tokens among the session's last ``penalty_last_n`` ids (prompt and
    generated; -1: the whole session, 0: no penalties); ``logit_bias`` adds to a token's logit
    (``-inf`` forbids it), given as a mapping or pairs of token id and bias, kept as sorted pairs.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64  # llama.cpp's default; -1: the whole session, 0: no penalties
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: Constrained decoding (last shard): the choice is masked to what the grammar allows.
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        # Types are checked too: a wrong type would otherwise surface only while sampling, as an
        # engine fault (FAILED engine) instead of this request's InvalidInput.
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidInput("temperature must be a finite number >= 0")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidInput("top_k must be an integer >= 0")
        if not _is_real(self.top_p) or not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidInput("top_p must be in (0, 1]")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**64:
            raise InvalidInput("seed must be an integer that fits in an unsigned 64 bits")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidInput("min_p must be in [0, 1]")
        # (Bounded so that the float32 arithmetic of the samplers stays finite.)
        if not _is_real(self.repeat_penalty) or not _PENALTY_MIN <= self.repeat_penalty <= _LIMIT:
            raise InvalidInput(f"repeat_penalty must be in [{_PENALTY_MIN:g}, {_LIMIT:g}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -_LIMIT <= value <= _LIMIT:
                raise InvalidInput(f"{name} must be in [{-_LIMIT:g}, {_LIMIT:g}]")
        if not _is_int(self.penalty_last_n) or not -1 <= self.penalty_last_n < 2**31:
            raise InvalidInput("penalty_last_n must be an integer >= -1")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise InvalidInput("grammar must be a GrammarSpec")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Some penalty applies: the token depends on the session's token ids too."""
        return self.penalty_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0)

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the logits as they are (no bias, no penalty): the first maximum."""
        return self.temperature == 0.0 and not self.logit_bias and not self.penalized


_LIMIT = 1e6  # the largest penalty or bias
_PENALTY_MIN = 1e-6  # the smallest repeat_penalty


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, bias) pairs; each id once, each bias finite or -inf
    (the token is never chosen). Ids are checked against the vocabulary by the engine."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    try:
        pairs = [(k, v) for k, v in items]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise InvalidInput("logit_bias must map token ids to biases") from None
    out: dict[int, float] = {}
    for token, value in pairs:
        if not _is_int(token) or token < 0:
            raise InvalidInput(f"logit_bias: token id {token!r} must be an integer >= 0")
        if not _is_real(value) or not (value == -math.inf or -_LIMIT <= value <= _LIMIT):
            raise InvalidInput(f"logit_bias: the bias of token {token} must be in "
                               f"[{-_LIMIT:g}, {_LIMIT:g}] or -inf")
        if int(token) in out:
            raise InvalidInput(f"logit_bias: token {token} appears twice")
        out[int(token)] = float(value)
    return tuple(sorted(out.items()))


GREEDY = SamplingParams()


@dataclass(frozen=True)
class Lookahead:
    """A hint on a prefill or decode: after this step the caller will most likely decode the
    token the step samples, up to ``steps`` more times, stopping at a token of ``stop_tokens``
    or (``stop_at_eog``) an end-of-generation token.

    An engine may compute that next step ahead, in its native thread right after this one, and
    keep the result until the caller's next decode of exactly that token claims it; any other
    next call (or release) drops it first. Results never depend on the hint; only when work is
    done does. Engines that do not look ahead ignore it (docs/engine.md, "Look-ahead").
    """

    steps: int = 1
    stop_tokens: frozenset[int] = frozenset()
    stop_at_eog: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError("Lookahead.steps must be an int >= 0")
        object.__setattr__(self, "stop_tokens", frozenset(self.stop_tokens))


#: The most positions of one ``all_logits`` prefill: a speculative step verifies a few drafted
#: tokens, and each position costs a vocabulary-sized row of logits in the engine's result.
MAX_LOGITS_POSITIONS = 64


@dataclass(frozen=True)
class PrefillRequest:
    """Write ``tokens`` (first shard) or ``hidden_states`` (later shards) at ``position``.

    The session keeps what it holds before ``position``. Tokens it holds from ``position`` on that
    equal the start of the new input are reused (not recomputed) and reported in
    ``StepResult.reused_tokens``; everything after the reused part is replaced. ``position``
    must not exceed the session's current length; pass the current length to append.

    ``step_timeout`` (seconds, ``None``: none) bounds the step from the moment the engine
    accepts it: if its result is not computed by then it fails with ``StepTimeout`` and is rolled
    back; a batching engine does not put it into a step that cannot end in time because of
    other sessions' work.

    ``lookahead`` (first-and-last shards, token input): see ``Lookahead``.

    ``all_logits`` (last shard; ignored by the others, whose boundary already holds every
    position): the result carries one ``LogitsResult`` per input position
    (``StepResult.position_logits``), each sampled as a decode ending at that position would
    be, so one step verifies several drafted tokens (speculative decoding). At most
    ``Capabilities.max_logits_positions`` positions; such a step reuses no held prefix (every
    position's logits are computed), on a shard before the last neither (every position is
    computed, so the shards after it see every row), and it also reports each input token's
    log-prob under the position before it (``StepResult.input_logprobs``).

    ``token_ids`` (hidden-state input only, optional): the token ids the rows stand for, one per
    row (4 bytes a position beside kilobytes of hidden state). Only with them does a later shard
    keep the session's history for the prefix cache and serve its start from there; without
    them the session is never cached.

    ``cache_limit`` (``None``: no limit): at most this many of the session's leading positions
    come from the prefix cache (a pipeline's first hop held to what every later hop holds,
    which must take the same positions from its own cache).
    """

    session_id: str
    tokens: tuple[int, ...] | None = None
    hidden_states: np.ndarray | None = None  # float32 [n_tokens, n_embd]
    position: int = 0
    sampling: SamplingParams = GREEDY
    top_k_logprobs: int = 5
    mtp: MtpRequest | None = None
    aux_state: AuxState | None = None
    step_timeout: float | None = None
    lookahead: Lookahead | None = None
    all_logits: bool = False
    token_ids: tuple[int, ...] | None = None
    cache_limit: int | None = None

    def __post_init__(self) -> None:
        if self.tokens is not None:
            object.__setattr__(self, "tokens", tuple(self.tokens))
        if self.token_ids is not None:
            object.__setattr__(self, "token_ids", tuple(self.token_ids))
        if self.hidden_states is not None:
            object.__setattr__(self, "hidden_states", _frozen_array(self.hidden_states))

    @property
    def n_tokens(self) -> int:
        if self.tokens is not None:
            return len(self.tokens)
        if self.hidden_states is not None:
            return int(self.hidden_states.shape[0]) if self.hidden_states.ndim >= 1 else 0
        return 0


@dataclass(frozen=True)
class DecodeRequest:
    """Append one token (first shard) or one hidden-state row (later shards) and step once.
    ``step_timeout`` and ``lookahead`` as for ``PrefillRequest``; ``token_id`` (hidden-state
    input only, optional) as its ``token_ids``: without it the session is no longer cached."""

    session_id: str
    token: int | None = None
    hidden_state: np.ndarray | None = None  # float32 [1, n_embd]
    sampling: SamplingParams = GREEDY
    top_k_logprobs: int = 5
    mtp: MtpRequest | None = None
    aux_state: AuxState | None = None
    step_timeout: float | None = None
    lookahead: Lookahead | None = None
    token_id: int | None = None

    def __post_init__(self) -> None:
        if self.hidden_state is not None:
            object.__setattr__(self, "hidden_state", _frozen_array(self.hidden_state))


@dataclass(frozen=True)
class StreamRequest:
    """A run of decodes of one session, each decoding the token the step before it chose
    (``ShardEngine.stream``): a server-driven generation's steady state.

    Why its own request: a generation's steps differ only in their token and position, so the
    engine validates the run once and may deliver each step's result from wherever the step
    finished (the task that ran its tick, a callback of its native thread) instead of waking the
    caller's task per token. ``token`` is decoded first (the token the session's last step
    chose); at most ``max_steps`` steps run. ``lookahead``: the engine may compute the next step
    ahead, stopping at ``stop_tokens`` or (``stop_at_eog``) an end-of-generation token, as for
    ``Lookahead``. First-and-last shards only; no step timeout (a caller that needs one decodes
    step by step).
    """

    session_id: str
    token: int
    max_steps: int
    sampling: SamplingParams = GREEDY
    top_k_logprobs: int = 0
    lookahead: bool = True
    stop_tokens: frozenset[int] = frozenset()
    stop_at_eog: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps < 1:
            raise InvalidInput("StreamRequest.max_steps must be an int >= 1", session_id=self.session_id)
        object.__setattr__(self, "stop_tokens", frozenset(self.stop_tokens))


# --- Results --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    piece: bytes = b""  # the token's raw bytes, as ``LogitsResult.piece``


@dataclass(frozen=True)
class LogitsResult:
    """Last-shard output for the final position: the top-k alternatives and the chosen token.

    ``piece`` is the chosen token's raw bytes: a token may hold part of a UTF-8 character, so
    callers decode incrementally rather than per token.
    """

    top: tuple[TokenLogprob, ...]
    token_id: int
    logprob: float
    piece: bytes
    is_eog: bool  # the chosen token ends generation (EOS/EOT)


@dataclass(frozen=True)
class BoundaryResult:
    """Non-last-shard output: hidden states of the computed positions, float32 [n, n_embd]."""

    hidden_states: np.ndarray
    start_position: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden_states", _frozen_array(self.hidden_states))


@dataclass(frozen=True)
class StepResult:
    """Result of one prefill or decode.

    Exactly one of ``logits`` / ``boundary`` is set, according to ``Capabilities.result_kind``.
    ``tokens_processed`` counts positions actually computed (for usage reporting);
    ``reused_tokens`` counts positions served from the session's existing KV cache;
    ``cached_tokens`` those copied from the engine's prefix cache (neither computed nor held by
    the session before): ``tokens_processed + reused_tokens + cached_tokens`` is the input's
    length.
    ``position_logits`` (a prefill asked with ``all_logits`` on a last shard): one entry per
    computed position, in order; the last one is ``logits``.
    ``input_logprobs`` (the same steps, when the input's ids are known: token input, or hidden
    states with ``token_ids``): entry ``i`` is the log-prob of the input's token ``i + 1`` under
    position ``i``'s distribution, one fewer than the positions (the token after the last is not
    known). The model's log-softmax of the raw logits, as ``LogitsResult.logprob`` and ``top``
    (before any bias, penalty or grammar mask): a prompt's log-probs (OpenAI's ``echo`` with
    ``logprobs``), which need not be among the top-k.
    """

    session_id: str
    n_past: int  # session length after this step
    tokens_processed: int
    reused_tokens: int
    logits: LogitsResult | None = None
    boundary: BoundaryResult | None = None
    position_logits: tuple[LogitsResult, ...] = ()
    cached_tokens: int = 0
    input_logprobs: tuple[float, ...] = ()
    mtp: MtpResult | None = None  # reserved
    aux_state: AuxState | None = None  # reserved

    @property
    def kind(self) -> ResultKind:
        return ResultKind.LOGITS if self.logits is not None else ResultKind.BOUNDARY


@dataclass(frozen=True)
class SessionInfo:
    """Snapshot of one open session.

    ``tokens`` is the token history for sessions fed token ids, or None once hidden states were
    fed (a non-first shard cannot know the ids). Used for cache expectations on resume.
    """

    session_id: str
    state: SessionState
    n_past: int
    kv_budget: int
    tokens: tuple[int, ...] | None


@dataclass(frozen=True)
class EngineHealth:
    """Honest health: ``ready`` is True only when the engine can serve a new request now."""

    state: EngineState
    detail: str = ""

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY


@dataclass(frozen=True)
class EngineMetrics:
    """Counters and gauges since load; monotonic counters end in ``_total``."""

    sessions_active: int = 0
    sessions_opened_total: int = 0
    sessions_released_total: int = 0
    kv_cells_used: int = 0
    prefill_tokens_total: int = 0
    decode_tokens_total: int = 0
    reused_tokens_total: int = 0
    steps_total: int = 0
    cancelled_total: int = 0
    aborted_in_step_total: int = 0  # ops stopped inside a native step (abort callback)
    errors_total: int = 0
    operations_running: int = 0
    # Continuous batching (engines that batch; others report 0). Per tick averages are ratios:
    # occupancy = batch_sessions_total / batch_ticks_total, tokens per tick = batch_rows_total /
    # batch_ticks_total, mean queue wait ~ batch_queue_wait_us_total / steps_total.
    batch_ticks_total: int = 0  # batched native steps (one llama_decode each)
    batch_rows_total: int = 0  # rows (tokens or hidden rows) evaluated in them
    batch_sessions_total: int = 0  # sessions served in them (one per session and tick)
    batch_queue_wait_us_total: int = 0  # microseconds from submit to a compute's first tick
    # Microseconds inside the native step call (llama_decode) of those ticks: a session's step
    # time minus its share of this is what the worker itself costs per step.
    native_step_us_total: int = 0
    # Microseconds of those ticks as the scheduler saw them (what the sessions waited for), and
    # of the gaps between ticks while a session of the earlier tick stayed open (the bubbles of
    # a pipeline's hop; shard.engine.tick_stats). Per-tick distributions: Prometheus only.
    batch_tick_us_total: int = 0
    batch_idle_us_total: int = 0
    # The load's warm-up (docs/engine.md, "Warm-up at load"): native steps run before the
    # engine reported READY, and the microseconds they took.
    warmup_steps_total: int = 0
    warmup_us_total: int = 0
    # Look-ahead (docs/engine.md, "Look-ahead"): steps computed ahead in the native thread, how
    # many a session's next decode claimed, how many were dropped unclaimed (wasted work), and
    # the cells held now by computed, unclaimed steps (not part of ``kv_cells_used``).
    lookahead_steps_total: int = 0
    lookahead_used_total: int = 0
    lookahead_dropped_total: int = 0
    lookahead_cells: int = 0
    # Session hand-off (docs/engine.md, "Moving a session"): sessions exported and imported.
    sessions_exported_total: int = 0
    sessions_imported_total: int = 0
    # Prefix cache (docs/engine.md, "Prefix cache"): prefills that started from a cached
    # history and the positions they took from it; released histories kept, and entries
    # evicted for room (least recently used); the entries and tokens held now.
    prefix_cache_hits_total: int = 0
    prefix_cache_hit_tokens_total: int = 0
    prefix_cache_stored_total: int = 0
    prefix_cache_evictions_total: int = 0
    prefix_cache_entries: int = 0
    prefix_cache_tokens: int = 0
    # Forks (docs/engine.md, "Forking a session"): sessions opened as a copy of another.
    sessions_forked_total: int = 0


# --- Helpers shared by every implementation --------------------------------------------------


def _frozen_array(value: np.ndarray) -> np.ndarray:
    """An array nobody can change: its memory is an immutable ``bytes`` object.

    A plain read-only copy is not enough: numpy lets the holder set ``writeable`` back to True
    on an array that owns its memory, and a read-only *view* still changes when its writeable
    base does (so a request validated now could hold NaN by the time it is computed). An array
    already backed by ``bytes`` (e.g. a previous result, or ``np.frombuffer`` of wire bytes) is
    kept as is; anything else is copied once.
    """
    arr = np.asarray(value)
    if arr.dtype.hasobject:  # cannot live in a bytes buffer; rejected by validation anyway
        arr = arr.copy()
        arr.flags.writeable = False
        return arr
    if _is_immutable(arr):
        return arr
    return np.frombuffer(arr.tobytes(), dtype=arr.dtype).reshape(arr.shape)


def _is_immutable(arr: np.ndarray) -> bool:
    base: object = arr
    while isinstance(base, np.ndarray):
        if base.flags.writeable:
            return False
        base = base.base
    return isinstance(base, bytes)


def check_reserved_hooks(
    mtp: MtpRequest | None, aux_state: AuxState | None, caps: Capabilities
) -> None:
    """Fail closed when a request uses a reserved hook the engine does not enable.

    Any value other than None counts as using the hook (a malformed one included): nothing is
    silently ignored.
    """
    if mtp is not None and not caps.mtp.enabled:
        raise UnsupportedFeature("multi-token prediction (MTP) is not enabled on this engine")
    if aux_state is not None:
        kind = getattr(aux_state, "kind", None)
        if not isinstance(aux_state, AuxState) or kind not in caps.aux_state.kinds:
            name = kind.value if isinstance(kind, AuxStateKind) else type(aux_state).__name__
            raise UnsupportedFeature(f"auxiliary state {name!r} is not enabled on this engine")


def validate_hidden_states(value: np.ndarray, n_embd: int, *, rows: int | None = None) -> None:
    """Reject hidden states of the wrong dtype, shape or with non-finite values."""
    if not isinstance(value, np.ndarray):
        raise InvalidInput("hidden states must be a numpy array")
    if value.dtype != np.float32:
        raise InvalidInput(f"hidden states must be float32, got {value.dtype}")
    if value.ndim != 2 or value.shape[1] != n_embd or value.shape[0] == 0:
        raise InvalidInput(f"hidden states must have shape [n>0, {n_embd}], got {list(value.shape)}")
    if rows is not None and value.shape[0] != rows:
        raise InvalidInput(f"expected {rows} hidden-state row(s), got {value.shape[0]}")
    if not np.isfinite(value).all():
        raise InvalidInput("hidden states contain NaN or infinite values")


def validate_tokens(tokens: tuple[int, ...], n_vocab: int) -> None:
    """Reject empty input and token ids outside ``[0, n_vocab)``."""
    if len(tokens) == 0:
        raise InvalidInput("prompt is empty")
    for t in tokens:
        if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < n_vocab:
            raise InvalidInput(f"token id {t!r} is outside the vocabulary [0, {n_vocab})")
