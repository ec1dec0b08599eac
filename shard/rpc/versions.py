"""Protocol versioning: what this worker speaks and the one check every request goes through.

Policy (as llama.cpp's RPC HELLO, stricter than gRPC's "ignore unknown fields"): a request must
carry ``version``; its major must be one the worker supports and its minor must not be newer
than the worker's minor for that major. A newer minor may rely on fields this worker would
silently ignore, so it is refused instead of half-served. The check runs before any engine work
and fails with FAILED_PRECONDITION / ``UNSUPPORTED_VERSION`` listing the supported versions, so
version skew fails early and loudly instead of late and subtly.
"""

from __future__ import annotations

from shard.v1 import shard_pb2 as pb

from .errors import ErrorCode, ShardError

#: Every (major, minor) this worker serves, oldest first. Minor versions are additive: a v1.N
#: worker serves v1.0..v1.N requests.
#: 1.1 adds ``Usage.n_past``, ``GetCapabilitiesResponse.layer_ranges_supported`` and
#: ``layer_ranges_detail``, chain relay (``OpenSession.route``, ``relay_allowed``; its direct
#: return: ``Route.return_to``, ``Decode.relay_tag``, the ``Return`` RPC, ``relay_return``) and
#: verification (``Prefill.all_logits``/``echo_tokens``, ``StepResult.position_logits``/
#: ``input_tokens``, ``max_logits_positions``), the hop an error is from (``Error.relay_depth``,
#: ``failed_layers``), hung hops (``Route.step_timeout_ms``) and ``SessionRequest.rewind``
#: (``session_rewind``) and batch groups (``OpenSession.batch_group``, ``batch_groups``: a
#: scheduling hint a worker may ignore); clients gate relay, verification and rewind on
#: capabilities.
#: 1.2 adds session hand-off: ``SessionRequest.export_state``/``import_state``,
#: ``SessionResponse.state`` and ``session_handoff``/``kv_layout`` in the capabilities.
#: The prefix cache's fields (``StepResult``/``Usage.cached_tokens``, ``Prefill.token_ids``,
#: ``Decode.token_id``, ``prefix_cache_tokens``/``_detail``) need no minor: a worker without
#: them sends zeros and ignores the ids, and ids beyond the rows (the one use an older worker
#: would misread) go only to a worker that reports ``prefix_cache_tokens``. Neither do
#: ``SamplingParams`` fields 5-10 (min_p, penalties, logit_bias): clients send them only to a
#: worker that reports ``sampling_penalties``.
#: Forks (``OpenSession.fork_of``) need none either: an older worker would ignore the field and
#: open an empty session, so clients and relays send it only to one reporting ``session_fork``.
#: Nor ``StepResult.input_logprobs``: an older worker sends none, and clients that need them
#: (a prompt's log-probs) ask only a chain whose workers report ``input_logprobs``.
#: 1.3 adds group steps: the ``GroupSteps`` RPC (``GroupStepRequest``/``GroupStepResponse``)
#: and ``group_steps`` in the capabilities; clients use it only with a worker that reports it.
SUPPORTED_VERSIONS: tuple[tuple[int, int], ...] = ((1, 0), (1, 1), (1, 2), (1, 3))
CURRENT_VERSION: tuple[int, int] = SUPPORTED_VERSIONS[-1]


def current_proto() -> pb.ProtocolVersion:
    """The version this code sends (client) and answers with (server)."""
    return pb.ProtocolVersion(major=CURRENT_VERSION[0], minor=CURRENT_VERSION[1])


def supported_proto() -> list[pb.ProtocolVersion]:
    return [pb.ProtocolVersion(major=a, minor=b) for a, b in SUPPORTED_VERSIONS]


def is_supported(major: int, minor: int) -> bool:
    """A major we serve, at a minor no newer than ours for that major."""
    return any(major == a and minor <= b for a, b in SUPPORTED_VERSIONS)


def check_version(message: object, session_id: str = "") -> tuple[int, int]:
    """Return the request's (major, minor) or raise ``UNSUPPORTED_VERSION``.

    ``message`` is any request with a ``version`` field. A missing version is refused: a client
    that does not say what it speaks cannot be served safely.
    """
    if not message.HasField("version"):  # type: ignore[attr-defined]
        raise _unsupported("the request carries no protocol version", session_id)
    v = message.version  # type: ignore[attr-defined]
    if not is_supported(v.major, v.minor):
        raise _unsupported(f"protocol version {v.major}.{v.minor} is not supported", session_id)
    return (v.major, v.minor)


def _unsupported(message: str, session_id: str) -> ShardError:
    listed = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_VERSIONS)
    return ShardError(
        ErrorCode.UNSUPPORTED_VERSION,
        f"{message}; this worker supports {listed}",
        session_id=session_id,
        supported_versions=SUPPORTED_VERSIONS,
    )


__all__ = [
    "CURRENT_VERSION",
    "SUPPORTED_VERSIONS",
    "check_version",
    "current_proto",
    "is_supported",
    "supported_proto",
]
