"""Conversion between ``shard.v1`` protobuf messages and engine types, in one place.

Why separate: the engine never sees protobuf, and the session state machine should not care how
a tensor is laid out on the wire. Everything here is pure and synchronous; malformed input
becomes ``ShardError(INVALID_ARGUMENT)`` before it can reach the engine.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping

import numpy as np

from shard.engine import (
    Capabilities,
    EngineMetrics,
    GrammarSpec,
    InvalidInput,
    LayerRange,
    LogitsResult,
    SamplingParams,
    StepResult,
)
from shard.v1 import shard_pb2 as pb

from .errors import ErrorCode, ShardError
from .hidden_codec import CODECS, HiddenCodec
from .versions import supported_proto

HIDDEN_DTYPE = "float32"  # what the engine computes in, and the default on the wire
#: Hidden-state dtypes a worker accepts and sends (float16 halves the bytes per token, q8_0
#: takes about a quarter; layouts in ``hidden_codec``); the engine never sees them: conversion
#: happens here, at the RPC edge.
WIRE_DTYPES: dict[str, HiddenCodec] = CODECS


def invalid(message: str, session_id: str = "") -> ShardError:
    return ShardError(ErrorCode.INVALID_ARGUMENT, message, session_id=session_id)


# ---- requests ------------------------------------------------------------------------------


#: ``SamplingParams.penalty_last_n`` that an unset (0) ``penalty_last_n`` reads as.
DEFAULT_PENALTY_LAST_N = SamplingParams().penalty_last_n


def sampling_from_proto(msg: pb.SamplingParams, session_id: str = "",
                        grammar_start: int = 0) -> SamplingParams:
    """Proto sampling parameters; ``top_p`` and ``repeat_penalty`` 0 read as 1.0,
    ``penalty_last_n`` 0 as its default (proto3 defaults = off), a ``grammar_start`` 0 as the
    given one (where the step's prompt ends). An empty message (every field its default, as
    most steps send it) is read once: its parameters are shared (they are immutable)."""
    if not msg.ByteSize():
        return _DEFAULT_SAMPLING
    if msg.grammar_kind and not (msg.grammar_start or grammar_start):
        raise ShardError(ErrorCode.INVALID_ARGUMENT, "grammar_start is needed: the session has "
                         "no grammar to continue", session_id=session_id, reason="INVALID_GRAMMAR")
    try:
        return SamplingParams(
            temperature=float(msg.temperature),
            top_k=int(msg.top_k),
            top_p=float(msg.top_p) if msg.top_p != 0.0 else 1.0,
            seed=int(msg.seed),
            min_p=float(msg.min_p),
            repeat_penalty=float(msg.repeat_penalty) if msg.repeat_penalty != 0.0 else 1.0,
            presence_penalty=float(msg.presence_penalty),
            frequency_penalty=float(msg.frequency_penalty),
            penalty_last_n=int(msg.penalty_last_n) or DEFAULT_PENALTY_LAST_N,
            logit_bias={int(k): float(v) for k, v in msg.logit_bias.items()},
            grammar=(GrammarSpec(msg.grammar_kind, msg.grammar,
                                 int(msg.grammar_start or grammar_start))
                     if msg.grammar_kind else None),
        )
    except InvalidInput as exc:
        raise ShardError(ErrorCode.INVALID_ARGUMENT, exc.message, session_id=session_id,
                         reason=exc.code if exc.code == "INVALID_GRAMMAR" else "") from None


_DEFAULT_SAMPLING = SamplingParams(top_p=1.0, repeat_penalty=1.0, penalty_last_n=DEFAULT_PENALTY_LAST_N)


def uses_sampling_extensions(msg: pb.SamplingParams) -> bool:
    """``msg`` sets a field that only a worker with ``sampling_penalties`` honours."""
    return bool(msg.min_p or (msg.repeat_penalty not in (0.0, 1.0)) or msg.presence_penalty
                or msg.frequency_penalty or msg.logit_bias)


def wire_dtype(name: str, session_id: str = "") -> str:
    """The session's hidden-state wire dtype from ``OpenSession.hidden_wire_dtype`` ("" =
    float32); an unknown name is INVALID_ARGUMENT."""
    if not name:
        return HIDDEN_DTYPE
    if name not in WIRE_DTYPES:
        raise invalid(
            f"hidden_wire_dtype must be one of {sorted(WIRE_DTYPES)}, got {name!r}", session_id
        )
    return name


def offered_dtype(caps: pb.GetCapabilitiesResponse, asked: str) -> str:
    """The dtype to ask of a worker for hidden states: ``asked`` if the worker offers it
    (``hidden_wire_dtypes``), else float32 (what every worker takes)."""
    return asked if asked in caps.hidden_wire_dtypes else HIDDEN_DTYPE


def tensor_to_array(
    msg: pb.Tensor,
    n_embd: int,
    session_id: str = "",
    *,
    dtype: str = HIDDEN_DTYPE,
    rows: int | None = None,
) -> np.ndarray:
    """A float32 [n, n_embd] array from a tensor that must be in the session's wire ``dtype``.

    Checked on receipt, before anything reaches the engine: dtype, shape, ``rows`` (when the
    caller knows how many positions it needs), byte size, and finite values (a NaN or an
    infinity would poison every later position of the session).
    """
    if msg.dtype != dtype:
        raise invalid(f"hidden states on this session must have dtype {dtype!r}, got {msg.dtype!r}", session_id)
    shape = tuple(msg.shape)
    if len(shape) != 2 or shape[0] == 0 or shape[1] != n_embd:
        raise invalid(f"hidden states must have shape [n>0, {n_embd}], got {list(shape)}", session_id)
    if rows is not None and shape[0] != rows:
        raise invalid(f"expected {rows} hidden-state row(s), got {shape[0]}", session_id)
    codec = WIRE_DTYPES[dtype]
    expected = shape[0] * codec.row_bytes(shape[1])
    if len(msg.data) != expected:
        raise invalid(
            f"hidden-state data holds {len(msg.data)} bytes, shape {list(shape)} in {dtype} "
            f"needs {expected}",
            session_id,
        )
    arr = codec.decode(msg.data, shape[0], shape[1])
    if not np.isfinite(arr).all():
        raise invalid("hidden states contain NaN or infinite values", session_id)
    return arr


def array_to_tensor(arr: np.ndarray, dtype: str = HIDDEN_DTYPE) -> pb.Tensor:
    """Encode hidden states for the wire in ``dtype`` (``hidden_codec``).

    Finite float32 values the dtype cannot carry (beyond float16's range, about 65504; for
    q8_0 a block whose float16 scale would overflow) would arrive as infinities and be refused
    by the receiver; they are refused here instead (INVALID_ARGUMENT, reason
    ``FLOAT16_OVERFLOW``: use float32 for this model). Non-finite input is sent as
    non-finite values: the receiver decides (tests rely on being able to send it).
    """
    codec = WIRE_DTYPES.get(dtype)
    if codec is None:
        raise invalid(f"unknown hidden-state wire dtype {dtype!r}")
    src = np.asarray(arr, dtype=np.float32)
    return pb.Tensor(data=codec.encode(src), shape=list(src.shape), dtype=dtype)


def prefix_sha256(tokens: Iterable[int]) -> bytes:
    """SHA-256 over token ids as little-endian uint32: the CacheExpectation digest."""
    h = hashlib.sha256()
    for t in tokens:
        h.update(struct.pack("<I", t))
    return h.digest()


def cache_expectation(tokens: Iterable[int]) -> pb.CacheExpectation:
    """The expectation a client sends to resume a session that holds exactly ``tokens``."""
    ids = list(tokens)
    return pb.CacheExpectation(n_tokens=len(ids), prefix_sha256=prefix_sha256(ids))


# ---- results -------------------------------------------------------------------------------


def step_to_proto(
    result: StepResult, step: int, start_position: int, hidden_dtype: str = HIDDEN_DTYPE
) -> pb.StepResult:
    msg = pb.StepResult()
    step_into(msg, result, step, start_position, hidden_dtype)
    return msg


def step_into(msg: pb.StepResult, result: StepResult, step: int, start_position: int,
              hidden_dtype: str = HIDDEN_DTYPE) -> None:
    """``step_to_proto`` written into an empty ``msg`` (a group row's result: built in its
    answer rather than apart and copied in)."""
    msg.step = step
    msg.n_past = result.n_past
    msg.tokens_processed = result.tokens_processed
    msg.reused_tokens = result.reused_tokens
    msg.start_position = start_position
    msg.cached_tokens = result.cached_tokens
    lg = result.logits
    if lg is not None:
        out = msg.logits
        out.token_id = lg.token_id
        out.logprob = lg.logprob
        out.piece = lg.piece
        out.is_eog = lg.is_eog
        for t in lg.top:
            out.top.add(token_id=t.token_id, logprob=t.logprob, piece=t.piece)
        if result.position_logits:  # (a decode has none: no generator per token)
            msg.position_logits.extend(logits_to_proto(lg) for lg in result.position_logits)
        if result.input_logprobs:
            msg.input_logprobs.extend(result.input_logprobs)
    elif result.boundary is not None:
        msg.hidden_states.CopyFrom(array_to_tensor(result.boundary.hidden_states, hidden_dtype))


def token_response(result: StepResult, step: int, start_position: int, finish: int) -> pb.SessionResponse:
    """A generated token's whole response, built in place: the same message as
    ``SessionResponse(step=step_to_proto(...))`` with ``finish_reason``, without building the
    step and its logits apart and copying them in (two copies per token)."""
    assert result.logits is not None
    resp = pb.SessionResponse()
    step_into(resp.step, result, step, start_position)
    resp.step.finish_reason = finish  # type: ignore[assignment]
    return resp


def logits_to_proto(lg: LogitsResult) -> pb.Logits:
    return pb.Logits(
        top=[pb.TokenLogprob(token_id=t.token_id, logprob=t.logprob, piece=t.piece) for t in lg.top],
        token_id=lg.token_id,
        logprob=lg.logprob,
        piece=lg.piece,
        is_eog=lg.is_eog,
    )


def layer_range_to_proto(lr: LayerRange) -> pb.LayerRange:
    return pb.LayerRange(start=lr.start, end=lr.end)


#: The most inputs one ``Embed`` call may hold (OpenAI's limit on one request's inputs).
MAX_EMBED_INPUTS = 2048


def embeds_per_call(n_embd: int, max_message_bytes: int) -> int:
    """How many inputs one ``Embed`` call may hold: ``MAX_EMBED_INPUTS``, fewer when the
    answer's embeddings (``n_embd`` packed floats and a count each, with their tags) would not
    fit one message. Worker and client compute it alike from the capabilities."""
    per_embedding = 4 * n_embd + 32  # floats, length prefixes, tags and the count
    return max(1, min(MAX_EMBED_INPUTS, (max_message_bytes - 1024) // per_embedding))


def capabilities_to_proto(
    caps: Capabilities, *, max_message_bytes: int, max_credit: int, resume_ttl_ms: int
) -> pb.GetCapabilitiesResponse:
    return pb.GetCapabilitiesResponse(
        supported_versions=supported_proto(),
        engine=caps.engine,
        model_fingerprint=caps.model_fingerprint,
        architecture=caps.architecture,
        n_layers_total=caps.n_layers_total,
        layer_range=layer_range_to_proto(caps.layer_range),
        is_first=caps.is_first,
        is_last=caps.is_last,
        n_embd=caps.n_embd,
        n_vocab=caps.n_vocab,
        n_ctx=caps.n_ctx,
        n_ctx_per_session=caps.n_ctx_per_session,
        max_sessions=caps.max_sessions,
        bos_token_id=-1 if caps.bos_token_id is None else caps.bos_token_id,
        eos_token_id=-1 if caps.eos_token_id is None else caps.eos_token_id,
        hidden_dtype=caps.hidden_dtype,
        hidden_wire_dtypes=list(WIRE_DTYPES),
        mtp_enabled=caps.mtp.enabled,
        mtp_max_draft_tokens=caps.mtp.max_draft_tokens,
        aux_state_kinds=[k.value for k in caps.aux_state.kinds],
        max_message_bytes=max_message_bytes,
        max_credit=max_credit,
        resume_ttl_ms=resume_ttl_ms,
        system_info=caps.system_info,
        layer_ranges_supported=caps.layer_ranges.supported,
        layer_ranges_detail=caps.layer_ranges.detail,
        max_logits_positions=caps.max_logits_positions,
        chat=pb.ChatTemplate(
            template=caps.chat.template, bos_token=caps.chat.bos_token,
            eos_token=caps.chat.eos_token, eot_token=caps.chat.eot_token, add_bos=caps.chat.add_bos,
            special_texts=caps.chat.special_texts,
        ),
        parse_special=caps.is_first,
        prefix_cache_tokens=caps.prefix_cache_tokens,
        prefix_cache_detail=caps.prefix_cache_detail,
        sampling_penalties=True,
        prefix_cache_limit=True,  # Prefill.cache_limit, OpenSession.prefix_probe
        session_fork=True,  # OpenSession.fork_of
        input_logprobs=True,  # StepResult.input_logprobs
        grammar_kinds=caps.grammar_kinds,
        pooling_type=caps.pooling_type,
        embeddings=caps.embeds,
    )


def metrics_to_proto(engine: EngineMetrics, worker: Mapping[str, int]) -> pb.GetMetricsResponse:
    fields = {name: int(getattr(engine, name)) for name in EngineMetrics.__dataclass_fields__}
    return pb.GetMetricsResponse(
        engine={k: max(v, 0) for k, v in fields.items()},
        worker={k: max(int(v), 0) for k, v in worker.items()},
    )


__all__ = [
    "array_to_tensor",
    "cache_expectation",
    "MAX_EMBED_INPUTS",
    "capabilities_to_proto",
    "embeds_per_call",
    "invalid",
    "layer_range_to_proto",
    "metrics_to_proto",
    "offered_dtype",
    "prefix_sha256",
    "sampling_from_proto",
    "step_into",
    "step_to_proto",
    "tensor_to_array",
    "wire_dtype",
    "WIRE_DTYPES",
]
