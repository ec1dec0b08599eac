"""What a caller passes the client besides a prompt: sampling, cache expectations, credit."""

from __future__ import annotations

from typing import Any

from shard.rpc import convert
from shard.v1 import shard_pb2 as pb

__all__ = ["DEFAULT", "TOKEN_CREDIT", "cache_expectation", "sampling"]

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
    grammar_kind: str = "", grammar: str = "",
) -> pb.SamplingParams:
    """Sampling parameters; ``temperature`` 0 is greedy. ``grammar_kind`` (``json_object``,
    ``json_schema``, ``gbnf``, ``lark``) and ``grammar``: constrained decoding from the end of
    the prompt on (``SamplingParams.grammar_start`` left 0: the worker's prompt end)."""
    return pb.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                             grammar_kind=grammar_kind, grammar=grammar)
