"""What a computed step's output becomes: checked logits with the chosen token, or boundary
hidden states.

Why checked here: an implementation's output reaches callers only through these functions, so
a row of the wrong shape or a non-finite logit fails the engine (``EngineFailure``) instead of
sampling garbage.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from . import sampling
from .errors import EngineFailure
from .plans import ComputePlan
from .slots import Slot
from .types import BoundaryResult, Capabilities, LogitsResult, SamplingParams

#: What ``step_outputs`` gives: (logits, position_logits, boundary, input_logprobs).
StepOutputs = tuple[LogitsResult | None, tuple[LogitsResult, ...], BoundaryResult | None,
                    tuple[float, ...]]


def step_outputs(
    caps: Capabilities,
    plan: ComputePlan,
    n_new: int,
    raw: np.ndarray,
    params: SamplingParams,
    top_k: int,
    chosen: tuple[int, float] | None,
    piece: Callable[[int], bytes],
    is_eog: Callable[[int], bool],
    constrain: Callable[[int, np.ndarray], np.ndarray] | None = None,
    history: Sequence[int] | None = None,
) -> StepOutputs:
    """(last position's logits, every position's when ``plan.all_logits``, boundary, the
    input's log-probs: ``input_logprobs``) of ``plan``'s computed ``raw`` output for its
    ``n_new`` positions; the last shard's or the boundary's part is None.
    ``chosen`` (a one-row step): the token ``params`` chooses and the row's log-sum-exp,
    computed already by the implementation from this very row, which it found finite.
    ``constrain(n_past, row)``: the row a grammar masked for a session of ``n_past`` (the
    choice is then made, and the log-probabilities reported, over that row).
    ``history``: the session's ids through the step (``step_history``: its last ones), for
    penalties: the row ending at position ``p`` sees those before ``p + 1``."""
    if not caps.is_last:
        hidden = np.asarray(raw, dtype=np.float32)
        if hidden.shape != (n_new, caps.n_embd):
            raise EngineFailure("engine produced hidden states of the wrong shape")
        return None, (), BoundaryResult(hidden_states=hidden, start_position=plan.keep), ()
    new_len = plan.keep + n_new
    rows = n_new if plan.all_logits else 1
    logits = np.asarray(raw, dtype=np.float32).reshape(rows, -1)
    if logits.shape[1] != caps.n_vocab or (
            (chosen is None or rows != 1) and not np.isfinite(logits).all()):
        raise EngineFailure("engine produced invalid logits")
    inputs = input_logprobs(plan, logits)  # (the raw rows: before a grammar masks them)
    if constrain is not None:
        per_position = tuple(
            logits_result(constrain(new_len - rows + 1 + i, row), params, top_k,
                          new_len - rows + 1 + i, None, piece, is_eog, _window(history, rows, i))
            for i, row in enumerate(logits)
        )
        return per_position[-1], (per_position if plan.all_logits else ()), None, inputs
    # Row i ends at position keep + i: sampled as a decode ending there would be (the
    # sampler's stream is keyed by the session length), so a verified draft gives the
    # very tokens plain decoding gives, sampled or greedy.
    if rows == 1:  # (every decode: no generator per step)
        last = logits_result(logits[0], params, top_k, new_len, chosen, piece, is_eog, history)
        return last, ((last,) if plan.all_logits else ()), None, ()
    per_position = tuple(
        logits_result(row, params, top_k, new_len - rows + 1 + i, None, piece, is_eog,
                      _window(history, rows, i))
        for i, row in enumerate(logits)
    )
    return per_position[-1], per_position, None, inputs


def input_logprobs(plan: ComputePlan, logits: np.ndarray) -> tuple[float, ...]:
    """``StepResult.input_logprobs`` of an ``all_logits`` step's raw ``logits`` rows: row
    ``i``'s log-prob of the input's id ``i + 1`` (none when the ids are unknown), with the
    log-sum-exp ``logits_result`` takes of an unmasked row, so a value equals the one a decode
    ending there reports for that token among its top-k."""
    ids = plan.tokens if plan.tokens is not None else plan.token_ids
    if not plan.all_logits or ids is None or len(ids) != logits.shape[0]:
        return ()
    return tuple(float(row[ids[i + 1]]) - sampling.logsumexp(row)
                 for i, row in enumerate(logits[:-1]))


def _window(history: Sequence[int] | None, rows: int, i: int) -> Sequence[int] | None:
    """The ids row ``i`` of ``rows`` sees: the step's history without the later rows' ids."""
    return None if history is None else history[: len(history) - (rows - 1 - i)]


def logits_result(
    logits: np.ndarray,
    params: SamplingParams,
    top_k: int,
    n_past: int,
    chosen: tuple[int, float] | None,
    piece: Callable[[int], bytes],
    is_eog: Callable[[int], bool],
    history: Sequence[int] | None = None,
) -> LogitsResult:
    """The token chosen from one position's ``logits`` for a session of ``n_past``;
    ``chosen``: that token and the row's log-sum-exp, already computed. ``piece`` and
    ``is_eog``: the engine's vocabulary hooks; ``history``: the session's ids before the
    chosen position (penalties).
    Log-probabilities are the model's (the logits before any bias or penalty)."""
    if chosen is None:
        token = sampling.choose_token(logits, params, n_past, history)
        # plain greedy chose the (first) maximum: the row's largest value is known
        lse = sampling.logsumexp(logits, logits[token] if params.plain_greedy else None)
    else:
        token, lse = chosen
    return LogitsResult(
        top=tuple(dataclasses.replace(t, piece=piece(t.token_id))
                  for t in sampling.top_logprobs(logits, top_k, lse)
                  if t.logprob != -math.inf) if top_k > 0 else (),  # (a grammar's masked ids)
        token_id=token,
        logprob=float(logits[token]) - lse,
        piece=piece(token),
        is_eog=is_eog(token),
    )


def step_history(slot: Slot, plan: ComputePlan, last_n: int) -> list[int] | None:
    """The session's ids once ``plan``'s step is committed (as ``_make_result`` and
    ``commit_history`` commit them), up to position ``keep + n_new`` and from as far back as
    the penalty window (``last_n``; -1: all) of the step's first chosen token reaches; None where
    the session keeps no history or the step brings no ids (hidden states without
    ``token_ids``)."""
    new = plan.tokens if plan.tokens is not None else plan.token_ids
    if new is None or slot.tokens is None:
        return None
    first_row_end = plan.keep + (1 if plan.all_logits else plan.n_new)  # (its n_past)
    start = 0 if last_n < 0 else max(0, first_row_end - last_n)
    cut = plan.keep - len(plan.cached_ids)
    ids = [*slot.tokens[min(start, cut):cut], *plan.cached_ids, *new]
    return ids[max(0, start - cut):]
