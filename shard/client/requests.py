"""The step requests a session sends (``Prefill``, ``Decode``, ``Generate``), built in one place
for every caller (a session's steps and ``ShardClient.generate``)."""

from __future__ import annotations

from collections.abc import Sequence

from shard.v1 import shard_pb2 as pb

__all__ = ["decode_request", "generate_request", "prefill_request"]


def prefill_request(
    tokens: Sequence[int] | None,
    text: str | None,
    hidden_states: pb.Tensor | None,
    position: int | None,
    sampling: pb.SamplingParams | None,
    top_logprobs: int,
    chunk_tokens: int = 0,
    all_logits: bool = False,
    echo_tokens: bool = False,
    parse_special: bool = False,
    token_ids: Sequence[int] | None = None,
    cache_limit: int | None = None,
) -> pb.Prefill:
    """A prompt (the first of token ids, text, hidden states given) at ``position``;
    ``token_ids``: the ids hidden states stand for (``Prefill.token_ids``); ``cache_limit``:
    the most leading positions the worker's prefix cache may serve (None: any)."""
    p = pb.Prefill(top_logprobs=top_logprobs, chunk_tokens=chunk_tokens, all_logits=all_logits,
                   echo_tokens=echo_tokens, parse_special=parse_special)
    if cache_limit is not None:
        p.has_cache_limit, p.cache_limit = True, cache_limit
    if tokens is not None:
        p.tokens.ids.extend(tokens)
    elif text is not None:
        p.text = text
    elif hidden_states is not None:
        p.hidden_states.CopyFrom(hidden_states)
        if token_ids is not None:
            p.token_ids.extend(token_ids)
    if position is not None:
        p.position.value = position
    if sampling is not None:
        p.sampling.CopyFrom(sampling)
    return p


def decode_request(
    token: int | None, hidden_state: pb.Tensor | None, sampling: pb.SamplingParams | None,
    top_logprobs: int, relay_tag: int, token_id: int | None = None,
) -> pb.Decode:
    """One position: a token id or one hidden-state row (``token_id``: the id it stands for)."""
    d = pb.Decode(top_logprobs=top_logprobs, relay_tag=relay_tag)
    if token is not None:
        d.token = token
    elif hidden_state is not None:
        d.hidden_state.CopyFrom(hidden_state)
        if token_id is not None:
            d.has_token_id, d.token_id = True, token_id
    if sampling is not None:
        d.sampling.CopyFrom(sampling)
    return d


def generate_request(
    tokens: Sequence[int] | None,
    text: str | None,
    *,
    max_tokens: int,
    sampling: pb.SamplingParams | None,
    stop_tokens: Sequence[int],
    ignore_eos: bool,
    top_logprobs: int,
    parse_special: bool = False,
    yield_on_drain: bool = False,
    cache_limit: int | None = None,
) -> pb.Generate:
    """Server-driven decoding; no prompt (neither ``tokens`` nor ``text``) continues from the
    session's last step. ``parse_special`` applies to ``text`` only; ``cache_limit`` as
    ``prefill_request``'s."""
    g = pb.Generate(max_tokens=max_tokens, stop_tokens=stop_tokens, ignore_eos=ignore_eos,
                    top_logprobs=top_logprobs, yield_on_drain=yield_on_drain)
    if cache_limit is not None:
        g.has_cache_limit, g.cache_limit = True, cache_limit
    if tokens is not None:
        g.tokens.ids.extend(tokens)
    elif text is not None:
        g.text = text
        g.parse_special = parse_special
    if sampling is not None:
        g.sampling.CopyFrom(sampling)
    return g
