"""What a caller passes the client besides a prompt: sampling, cache expectations, credit."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shard.rpc import convert
from shard.rpc.errors import ErrorCode, ShardError
from shard.v1 import shard_pb2 as pb

__all__ = ["DEFAULT", "TOKEN_CREDIT", "cache_expectation", "check_sampling_support", "sampling"]

DEFAULT: Any = object()  # "use the client's default timeout"
#: The credit a session whose results are tokens asks for (``ShardClient.generate``, a
#: pipeline's whole-model hop): a worker grants at most its ``max_credit`` (64 by default).
#: Credit is granted back when half of it is used, so a window of 64 costs one ``Credit``
#: message per 32 tokens where the worker's default (16) costs one per 8, each a message the
#: worker must read and a socket write on both sides. (Other sessions keep the worker's
#: default: a window of hidden-state results is memory the worker holds.)
TOKEN_CREDIT = 64
cache_expectation = convert.cache_expectation


def sampling(
    temperature: float = 0.0, *, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
    min_p: float = 0.0, repeat_penalty: float = 1.0, presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0, penalty_last_n: int = 64,
    logit_bias: Mapping[int, float] | None = None,
    grammar_kind: str = "", grammar: str = "",
) -> pb.SamplingParams:
    """Sampling parameters; ``temperature`` 0 is greedy. ``min_p``, the penalties and
    ``logit_bias`` are llama.cpp's (docs/engine.md, "Determinism and sampling"); a worker
    honours them only with ``sampling_penalties`` (``check_sampling_support``).
    ``grammar_kind`` (``json_object``, ``json_schema``, ``gbnf``, ``lark``) and ``grammar``:
    constrained decoding from the end of the prompt on (``SamplingParams.grammar_start`` left
    0: the worker's prompt end)."""
    if penalty_last_n == 0:  # no window: no penalties (a 0 on the wire reads as the default)
        repeat_penalty, presence_penalty, frequency_penalty = 1.0, 0.0, 0.0
    return pb.SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, min_p=min_p,
        repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, penalty_last_n=penalty_last_n,
        logit_bias=dict(logit_bias or {}), grammar_kind=grammar_kind, grammar=grammar,
    )


def check_sampling_support(caps: pb.GetCapabilitiesResponse, msg: pb.SamplingParams) -> None:
    """Refuse ``msg`` for a worker that would ignore some of it: one without
    ``sampling_penalties`` (older) takes min_p, the penalties and logit_bias as unset."""
    if convert.uses_sampling_extensions(msg) and not caps.sampling_penalties:
        raise ShardError(
            ErrorCode.UNSUPPORTED_FEATURE,
            "this worker does not honour min_p, penalties or logit_bias (no sampling_penalties "
            "in its capabilities): it would ignore them")
