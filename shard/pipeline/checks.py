"""What a pipeline checks before it runs: the chain (one model cut into consecutive ranges), the
targets given for it, a prefill chunk's message size and the last shard's speculation limit."""

from __future__ import annotations

from collections.abc import Sequence

from shard.client import check_sampling_support
from shard.rpc import convert
from shard.rpc.errors import ErrorCode, ShardError
from shard.v1 import shard_pb2 as pb

from .errors import Hop, PipelineError
from .replicas import HopReplicas

__all__ = ["check_chain", "check_chunk", "check_grammar", "check_sampling", "check_speculation",
           "hop_targets"]


def _incompatible(hop: Hop, message: str) -> PipelineError:
    return PipelineError(hop, ShardError(ErrorCode.INCOMPATIBLE_MODEL, message))


def check_chain(hops: Sequence[Hop]) -> None:
    """Refuse a chain whose shards are not one model cut into consecutive ranges."""
    if not hops:
        raise ValueError("a pipeline needs at least one worker")
    first = hops[0].caps
    assert first is not None
    end = 0
    for hop in hops:
        caps = hop.caps
        assert caps is not None
        if caps.model_fingerprint != first.model_fingerprint:
            raise _incompatible(
                hop, f"serves model {caps.model_fingerprint}, hop 0 serves {first.model_fingerprint}"
            )
        if (caps.n_layers_total, caps.n_embd) != (first.n_layers_total, first.n_embd):
            raise _incompatible(hop, "n_layers_total / n_embd differ from hop 0's")
        start, stop = caps.layer_range.start, caps.layer_range.end
        if stop <= start:
            raise _incompatible(hop, f"reports the empty layer range [{start}, {stop})")
        if start != end:
            what = "a gap" if start > end else "an overlap"
            raise _incompatible(
                hop, f"starts at layer {start} but the previous hops end at {end} ({what})"
            )
        end = stop
    if end != first.n_layers_total:
        raise _incompatible(hops[-1], f"the chain ends at layer {end} of {first.n_layers_total}")


def hop_targets(targets: Sequence[str | Sequence[str]]) -> list[list[str]]:
    """Every hop's targets (a str: one worker; a sequence: the worker and its replicas, tried
    in order); a ValueError for an empty chain, an empty hop or a target listed twice."""
    hops = [[t] if isinstance(t, str) else list(t) for t in targets]
    if not hops:
        raise ValueError("a pipeline needs at least one worker")
    seen: set[str] = set()
    for i, hop in enumerate(hops):
        if not hop or not all(hop):
            raise ValueError(f"hop {i} names no worker")
        for target in hop:
            if target in seen:
                raise ValueError(f"{target} is listed twice (a worker serves one hop)")
            seen.add(target)
    return hops



def check_chunk(hops: Sequence[HopReplicas], chunk_tokens: int, hidden_dtype: str) -> None:
    """A chunk's hidden states must fit in one message of every hop that carries them."""
    def known(replicas: HopReplicas) -> list[pb.GetCapabilitiesResponse]:
        return [r.caps for r in replicas.replicas if r.caps is not None]

    for prev, hop in zip(hops, hops[1:]):
        both = known(prev) + known(hop)
        limit = min((c.max_message_bytes for c in both if c.max_message_bytes), default=0)
        assert hop.reference is not None
        n_embd = hop.reference.n_embd
        size = chunk_tokens * max(
            convert.WIRE_DTYPES[convert.offered_dtype(c, hidden_dtype)].row_bytes(n_embd)
            for c in known(hop))
        if limit and size + 1024 > limit:
            raise PipelineError(hop.hop(), ShardError(
                ErrorCode.INVALID_ARGUMENT,
                f"chunk_tokens={chunk_tokens} makes {size}-byte hidden-state messages; "
                f"this chain accepts at most {limit} bytes per message",
            ))


def check_speculation(last: HopReplicas, k: int) -> None:
    """The last shard (every replica of it) must verify k drafted tokens and the next one in
    one step."""
    for replica in last.replicas:
        caps = replica.caps
        if caps is not None and caps.max_logits_positions < k + 1:
            why = ("does not verify drafted tokens (it reports no max_logits_positions: "
                   "an older worker)" if not caps.max_logits_positions else
                   f"verifies at most {caps.max_logits_positions - 1} drafted tokens a step")
            raise PipelineError(last.hop(replica), ShardError(
                ErrorCode.UNSUPPORTED_FEATURE, f"speculate={k}: the last shard {why}"))


def check_prompt_logprobs(hops: Sequence[HopReplicas]) -> int:
    """Every replica of every hop scores a prompt (``input_logprobs``: each shard computes
    every position an ``all_logits`` pass writes over, the last reports the input's log-probs)
    in passes of at least two positions; returns the positions of one pass (the last shard's
    least ``max_logits_positions``)."""
    for hop in hops:
        for replica in hop.replicas:
            caps = replica.caps
            if caps is not None and not caps.input_logprobs:
                raise PipelineError(hop.hop(replica), ShardError(
                    ErrorCode.UNSUPPORTED_FEATURE, "prompt log-probs: this worker does not "
                    "report input_logprobs (an older worker)"))
    last = hops[-1]
    window = min((r.caps.max_logits_positions for r in last.replicas if r.caps is not None),
                 default=0)
    if window < 2:
        raise PipelineError(last.hop(), ShardError(
            ErrorCode.UNSUPPORTED_FEATURE, "prompt log-probs: the last shard returns the "
            f"logits of {window} positions a step (at least 2 are needed)"))
    return window


def check_grammar(last: HopReplicas, kind: str) -> None:
    """The last shard (every replica of it) must constrain its choice to a ``kind`` grammar: a
    worker that does not know the grammar fields would ignore them and answer unconstrained."""
    for replica in last.replicas:
        caps = replica.caps
        if caps is not None and kind not in caps.grammar_kinds:
            have = ", ".join(caps.grammar_kinds) or "none (an older worker, or no grammar library)"
            raise PipelineError(last.hop(replica), ShardError(
                ErrorCode.INVALID_ARGUMENT, f"grammar {kind!r}: the last shard constrains "
                f"decoding to {have}", reason="INVALID_GRAMMAR"))


def check_sampling(last: HopReplicas, params: pb.SamplingParams) -> None:
    """The last shard (every replica of it) honours ``params`` (min_p, penalties, logit_bias:
    an older worker would ignore them)."""
    for replica in last.replicas:
        if replica.caps is not None:
            try:
                check_sampling_support(replica.caps, params)
            except ShardError as exc:
                raise PipelineError(last.hop(replica), exc) from None
