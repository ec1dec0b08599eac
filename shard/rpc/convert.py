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
    InvalidInput,
    LayerRange,
    SamplingParams,
    StepResult,
)
from shard.v1 import shard_pb2 as pb

from .errors import ErrorCode, ShardError
from .versions import supported_proto

HIDDEN_DTYPE = "float32"


def invalid(message: str, session_id: str = "") -> ShardError:
    return ShardError(ErrorCode.INVALID_ARGUMENT, message, session_id=session_id)


# ---- requests ------------------------------------------------------------------------------


def sampling_from_proto(msg: pb.SamplingParams, session_id: str = "") -> SamplingParams:
    """Proto sampling parameters; ``top_p`` 0 reads as 1.0 (proto3 default = no filter)."""
    try:
        return SamplingParams(
            temperature=float(msg.temperature),
            top_k=int(msg.top_k),
            top_p=float(msg.top_p) if msg.top_p != 0.0 else 1.0,
            seed=int(msg.seed),
        )
    except InvalidInput as exc:
        raise invalid(exc.message, session_id) from None


def tensor_to_array(msg: pb.Tensor, n_embd: int, session_id: str = "") -> np.ndarray:
    """A little-endian float32 [n, n_embd] tensor; shape, dtype and size are checked here."""
    if msg.dtype != HIDDEN_DTYPE:
        raise invalid(f"hidden states must have dtype {HIDDEN_DTYPE!r}, got {msg.dtype!r}", session_id)
    shape = tuple(msg.shape)
    if len(shape) != 2 or shape[0] == 0 or shape[1] != n_embd:
        raise invalid(f"hidden states must have shape [n>0, {n_embd}], got {list(shape)}", session_id)
    expected = shape[0] * shape[1] * 4
    if len(msg.data) != expected:
        raise invalid(
            f"hidden-state data holds {len(msg.data)} bytes, shape {list(shape)} needs {expected}",
            session_id,
        )
    return np.frombuffer(msg.data, dtype="<f4").astype(np.float32).reshape(shape)


def array_to_tensor(arr: np.ndarray) -> pb.Tensor:
    a = np.ascontiguousarray(arr, dtype="<f4")
    return pb.Tensor(data=a.tobytes(), shape=list(a.shape), dtype=HIDDEN_DTYPE)


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


def step_to_proto(result: StepResult, step: int, start_position: int) -> pb.StepResult:
    msg = pb.StepResult(
        step=step,
        n_past=result.n_past,
        tokens_processed=result.tokens_processed,
        reused_tokens=result.reused_tokens,
        start_position=start_position,
    )
    if result.logits is not None:
        lg = result.logits
        msg.logits.CopyFrom(
            pb.Logits(
                top=[pb.TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in lg.top],
                token_id=lg.token_id,
                logprob=lg.logprob,
                piece=lg.piece,
                is_eog=lg.is_eog,
            )
        )
    elif result.boundary is not None:
        msg.hidden_states.CopyFrom(array_to_tensor(result.boundary.hidden_states))
    return msg


def layer_range_to_proto(lr: LayerRange) -> pb.LayerRange:
    return pb.LayerRange(start=lr.start, end=lr.end)


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
        mtp_enabled=caps.mtp.enabled,
        mtp_max_draft_tokens=caps.mtp.max_draft_tokens,
        aux_state_kinds=[k.value for k in caps.aux_state.kinds],
        max_message_bytes=max_message_bytes,
        max_credit=max_credit,
        resume_ttl_ms=resume_ttl_ms,
        system_info=caps.system_info,
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
    "capabilities_to_proto",
    "invalid",
    "layer_range_to_proto",
    "metrics_to_proto",
    "prefix_sha256",
    "sampling_from_proto",
    "step_to_proto",
    "tensor_to_array",
]
