"""Checks of what callers hand the engine, as pure functions of the request, the session's slot
and the engine's capabilities.

Why apart from the engine: every check runs before anything is touched and raises only
``InvalidInput`` (or the length errors ``ContextExceeded``/``KvCacheFull``, the state errors
``IllegalTransition``/``IncompatibleState``), so the engine's lifecycle code reads as lifecycle
code. A request that passes becomes a ``ComputePlan``; anything a check lets through that would
only fail while building the result would wrongly turn the engine FAILED.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import trio

from .errors import (
    ContextExceeded,
    IllegalTransition,
    IncompatibleState,
    InvalidInput,
    KvCacheFull,
    UnsupportedFeature,
)
from .lookahead import LookaheadPlan
from .plans import ComputePlan
from .sampling import lookahead_window
from .slots import Slot
from .types import (
    EMBEDDING_POOLING,
    Capabilities,
    DecodeRequest,
    Lookahead,
    PrefillRequest,
    SamplingParams,
    SessionSnapshot,
    StreamRequest,
    check_reserved_hooks,
    validate_hidden_states,
    validate_tokens,
)

MAX_TOP_K_LOGPROBS = 64
MAX_SESSION_ID_LEN = 128


def is_int(value: object) -> bool:
    """A real integer: ``True`` is an ``int`` to Python but never a position or a count here."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_sampling(params: SamplingParams, top_k: int, sid: str, caps: Capabilities) -> None:
    """How a step chooses its token and how many alternatives it reports."""
    if not is_int(top_k) or not 0 <= top_k <= MAX_TOP_K_LOGPROBS:
        raise InvalidInput(f"top_k_logprobs must be in [0, {MAX_TOP_K_LOGPROBS}]", session_id=sid)
    # SamplingParams validates itself; anything else would only fail while building the
    # result, which would wrongly turn the engine FAILED.
    if not isinstance(params, SamplingParams):
        raise InvalidInput("sampling must be a SamplingParams", session_id=sid)
    if params.logit_bias:
        if params.logit_bias[-1][0] >= caps.n_vocab:  # (sorted by id)
            raise InvalidInput(f"logit_bias: token id {params.logit_bias[-1][0]} is not below "
                               f"the vocabulary size {caps.n_vocab}", session_id=sid)
        if sum(1 for _, b in params.logit_bias if b == -math.inf) == caps.n_vocab:
            raise InvalidInput("logit_bias forbids every token", session_id=sid)


def check_history(plan: ComputePlan, params: SamplingParams, slot: Slot, caps: Capabilities
                  ) -> None:
    """A last shard's penalized step needs the session's ids: every step of it (a later hop:
    ``token_ids`` with the hidden states) must have brought them."""
    if caps.is_last and params.penalized and (
            slot.tokens is None or (plan.tokens is None and plan.token_ids is None)):
        raise InvalidInput(
            "penalties (repeat_penalty, presence_penalty, frequency_penalty) need the session's "
            "token ids: send token_ids with every hidden-state step", session_id=slot.session_id)


def step_deadline(timeout: float | None, sid: str) -> float:
    """The step's deadline on the Trio clock (``inf`` without a timeout)."""
    if timeout is None:
        return math.inf
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
        math.isfinite(timeout) and timeout > 0
    ):
        raise InvalidInput("step_timeout must be a finite number of seconds > 0", session_id=sid)
    return trio.current_time() + timeout


def check_length(slot: Slot, caps: Capabilities, new_len: int) -> None:
    """The session may hold ``new_len`` positions (its context and its KV budget)."""
    sid = slot.session_id
    if new_len > caps.n_ctx_per_session:
        raise ContextExceeded(
            f"{new_len} positions exceed the per-session context of {caps.n_ctx_per_session}",
            session_id=sid,
        )
    if new_len > slot.kv_budget:
        raise KvCacheFull(
            f"{new_len} positions exceed this session's KV budget of {slot.kv_budget}",
            session_id=sid,
        )


def lookahead_plan(
    hint: Lookahead | None, sampling: SamplingParams, slot: Slot, caps: Capabilities,
    position: int, tokens: Sequence[int],
) -> LookaheadPlan | None:
    """The hint as an implementation uses it, for a step of ``tokens`` at ``position``; None
    where no step could follow (a step of a shard that does not sample, no steps left, a
    penalized session that keeps no ids)."""
    if hint is None:
        return None
    if not isinstance(hint, Lookahead):
        raise InvalidInput("lookahead must be a Lookahead", session_id=slot.session_id)
    if hint.steps == 0 or not caps.is_last or (sampling.penalized and slot.tokens is None):
        return None
    limit = min(caps.n_ctx_per_session, slot.kv_budget)
    history = None
    if sampling.penalized and slot.tokens is not None:
        n = sampling.penalty_last_n
        held = slot.tokens[max(0, position - n) if n > 0 else 0:position]
        history = lookahead_window([*held, *tokens], sampling)
    return LookaheadPlan(sampling, hint.steps, hint.stop_tokens, hint.stop_at_eog, limit, history)


def check_session_id(session_id: str) -> None:
    if not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_SESSION_ID_LEN:
        raise InvalidInput(f"session id must be a non-empty string of <= {MAX_SESSION_ID_LEN}")


def session_budget(kv_budget: int | None, batch_group: int, caps: Capabilities,
                   session_id: str) -> int:
    """A new session's KV budget (None: the whole per-session context), its batch group checked."""
    if kv_budget is None:
        kv_budget = caps.n_ctx_per_session
    if not is_int(kv_budget) or not 0 < kv_budget <= caps.n_ctx_per_session:
        raise InvalidInput(
            f"kv_budget must be in [1, {caps.n_ctx_per_session}], got {kv_budget}",
            session_id=session_id,
        )
    if not is_int(batch_group) or not 0 <= batch_group < 2**32:
        raise InvalidInput(f"batch_group must be in [0, 2**32), got {batch_group!r}",
                           session_id=session_id)
    return kv_budget


def check_tokenize(text: str, caps: Capabilities) -> None:
    if not isinstance(text, str):
        raise InvalidInput("text must be a string")
    if not caps.is_first:
        raise IllegalTransition("only a first shard tokenizes text")


def check_embed(tokens: object, caps: Capabilities) -> tuple[int, ...]:
    """The ids of one embedding, checked: a model that declares a pooling type, served whole
    (only the last block's output can be pooled, and only a first shard reads ids), at least one
    id and at most a session's positions (what one embedding's transient sequence may hold)."""
    if not (caps.is_first and caps.is_last):
        r = caps.layer_range
        raise IllegalTransition(f"only a worker serving the whole model embeds; this one serves "
                                f"blocks [{r.start}, {r.end}) of {caps.n_layers_total}")
    if caps.pooling_type not in EMBEDDING_POOLING:
        raise UnsupportedFeature(
            "the model declares no pooling type: it generates text and computes no embeddings"
            if not caps.pooling_type else
            f"the model's pooling type {caps.pooling_type!r} scores pairs and computes no embeddings")
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise InvalidInput("an embedding's input must be a sequence of token ids")
    ids = tuple(tokens)
    if not ids:
        raise InvalidInput("an embedding's input is empty")
    if len(ids) > caps.n_ctx_per_session:
        raise ContextExceeded(f"{len(ids)} tokens, more than the {caps.n_ctx_per_session} "
                              "positions one embedding may hold")
    validate_tokens(ids, caps.n_vocab)
    return tuple(int(t) for t in ids)


def prefill_plan(request: PrefillRequest, slot: Slot, caps: Capabilities) -> tuple[ComputePlan, int]:
    """The plan of a prefill and how many of its tokens the session holds already (reused:
    a prefill recomputes at least one position)."""
    sid = request.session_id
    check_reserved_hooks(request.mtp, request.aux_state, caps)
    check_sampling(request.sampling, request.top_k_logprobs, sid, caps)
    deadline = step_deadline(request.step_timeout, sid)
    has_tokens, has_hidden = request.tokens is not None, request.hidden_states is not None
    if has_tokens == has_hidden:
        raise InvalidInput("prefill needs exactly one of tokens or hidden_states", session_id=sid)
    if not is_int(request.position) or not 0 <= request.position <= slot.n_past:
        raise InvalidInput(
            f"position {request.position} is outside [0, {slot.n_past}] for this session",
            session_id=sid,
        )
    limit = request.cache_limit
    if limit is not None and not (is_int(limit) and limit >= 0):
        raise InvalidInput(f"cache_limit must be an int >= 0 or None, not {limit!r}", session_id=sid)
    all_logits = bool(request.all_logits) and caps.is_last
    if all_logits and not 1 <= request.n_tokens <= caps.max_logits_positions:
        raise InvalidInput(
            f"all_logits takes 1 to {caps.max_logits_positions} positions, not "
            f"{request.n_tokens}", session_id=sid,
        )
    reused = 0
    if has_tokens:
        if not caps.is_first:
            raise InvalidInput("this shard does not start at layer 0: send hidden states", session_id=sid)
        validate_tokens(request.tokens, caps.n_vocab)
        if request.token_ids is not None:
            raise InvalidInput("token_ids go with hidden states only", session_id=sid)
        # every position is asked for (its logits, or the next shard's row for them)
        if slot.tokens is not None and not request.all_logits:
            held = slot.tokens[request.position :]
            limit = min(len(held), len(request.tokens) - 1)  # recompute at least one position
            while reused < limit and held[reused] == request.tokens[reused]:
                reused += 1
        plan = ComputePlan(
            request.position + reused, request.tokens[reused:], None, deadline,
            None if all_logits else lookahead_plan(request.lookahead, request.sampling, slot,
                                                   caps, request.position, request.tokens),
            all_logits=all_logits,
        )
    else:
        if caps.is_first:
            raise InvalidInput("a first shard takes token ids, not hidden states", session_id=sid)
        validate_hidden_states(request.hidden_states, caps.n_embd)
        ids = request.token_ids
        if ids is not None:
            validate_tokens(ids, caps.n_vocab)
            if len(ids) != request.n_tokens:
                raise InvalidInput(f"{len(ids)} token ids for {request.n_tokens} hidden-state "
                                   "rows", session_id=sid)
            ids = tuple(int(t) for t in ids)
        plan = ComputePlan(request.position, None, request.hidden_states, deadline,
                           all_logits=all_logits, token_ids=ids)
    check_history(plan, request.sampling, slot, caps)
    check_length(slot, caps, request.position + request.n_tokens)
    return plan, reused


def decode_plan(request: DecodeRequest, slot: Slot, caps: Capabilities) -> ComputePlan:
    """The plan of a decode: one token or hidden-state row appended to the session."""
    sid = request.session_id
    check_reserved_hooks(request.mtp, request.aux_state, caps)
    check_sampling(request.sampling, request.top_k_logprobs, sid, caps)
    deadline = step_deadline(request.step_timeout, sid)
    if (request.token is None) == (request.hidden_state is None):
        raise InvalidInput("decode needs exactly one of token or hidden_state", session_id=sid)
    if slot.n_past == 0:
        raise IllegalTransition("decode needs a prefilled session", session_id=sid)
    if request.token is not None:
        if not caps.is_first:
            raise InvalidInput("this shard does not start at layer 0: send a hidden state", session_id=sid)
        validate_tokens((request.token,), caps.n_vocab)
        if request.token_id is not None:
            raise InvalidInput("token_id goes with a hidden state only", session_id=sid)
        plan = ComputePlan(
            slot.n_past, (int(request.token),), None, deadline,
            lookahead_plan(request.lookahead, request.sampling, slot, caps, slot.n_past,
                           (int(request.token),)),
        )
    else:
        if caps.is_first:
            raise InvalidInput("a first shard takes token ids, not hidden states", session_id=sid)
        validate_hidden_states(request.hidden_state, caps.n_embd, rows=1)
        ids = None
        if request.token_id is not None:
            validate_tokens((request.token_id,), caps.n_vocab)
            ids = (int(request.token_id),)
        plan = ComputePlan(slot.n_past, None, request.hidden_state, deadline, token_ids=ids)
    check_history(plan, request.sampling, slot, caps)
    check_length(slot, caps, slot.n_past + 1)
    return plan


def check_stream(request: StreamRequest, slot: Slot, caps: Capabilities, deliver: object) -> None:
    sid = request.session_id
    check_sampling(request.sampling, request.top_k_logprobs, sid, caps)
    if not (caps.is_first and caps.is_last):
        raise InvalidInput("a stream needs a shard that takes tokens and samples (the whole "
                           "model): decode step by step", session_id=sid)
    if slot.n_past == 0:
        raise IllegalTransition("a stream needs a prefilled session", session_id=sid)
    if not callable(deliver):
        raise InvalidInput("stream needs a deliver callable", session_id=sid)
    validate_tokens((request.token,), caps.n_vocab)
    check_length(slot, caps, slot.n_past + 1)


def check_snapshot(snapshot: SessionSnapshot, slot: Slot, caps: Capabilities,
                   state_bound: Callable[[int], int]) -> None:
    """``snapshot`` fits the empty session ``slot`` (``state_bound``: the engine's
    ``_impl_state_bound``, the most bytes its positions may take)."""
    sid = slot.session_id
    if not isinstance(snapshot, SessionSnapshot):
        raise InvalidInput("snapshot must be a SessionSnapshot", session_id=sid)
    if slot.n_past:
        raise IllegalTransition(
            f"session {sid!r} holds {slot.n_past} positions: a state is imported "
            "only into an empty session", session_id=sid)
    if snapshot.kv_layout != caps.kv_layout:
        raise IncompatibleState(
            f"the state's KV layout {snapshot.kv_layout!r} is not this engine's "
            f"{caps.kv_layout!r}", session_id=sid)
    n_past = snapshot.n_past
    if not is_int(n_past) or n_past < 1:
        raise InvalidInput(f"a state holds at least one position, got {n_past!r}", session_id=sid)
    check_length(slot, caps, n_past)
    if snapshot.tokens is not None:
        if len(snapshot.tokens) != n_past:
            raise InvalidInput(f"the state has {len(snapshot.tokens)} token ids for "
                               f"{n_past} positions", session_id=sid)
        validate_tokens(snapshot.tokens, caps.n_vocab)
    elif caps.is_first:
        raise InvalidInput("a first shard's state carries its token ids", session_id=sid)
    if not isinstance(snapshot.data, bytes) or not snapshot.data:
        raise InvalidInput("the state holds no KV bytes", session_id=sid)
    bound = state_bound(n_past)
    if len(snapshot.data) > bound:
        raise InvalidInput(f"{len(snapshot.data)} bytes of state exceed the {bound} that "
                           f"{n_past} positions take here", session_id=sid)
