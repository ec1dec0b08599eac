"""What an implementation computes: one step's plan, and the run of steps of a stream.

The base class (``shard.engine.base``) builds both from validated requests; implementations
execute them through the ``_impl_*`` hooks (``shard.engine.hooks``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .errors import EngineError, EngineFailure
from .lookahead import LookaheadPlan
from .sampling import lookahead_window
from .slots import Slot, known_choice
from .types import Capabilities, SamplingParams, StepResult, StreamRequest

log = logging.getLogger(__name__)

#: ``ShardEngine._make_result``: commits a computed step and builds its result.
MakeResult = Callable[..., StepResult]


@dataclass(frozen=True)
class ComputePlan:
    """What an implementation must compute for one prefill or decode.

    Keep positions ``[0, keep)`` of the slot, drop the rest, then evaluate ``tokens`` (or
    ``hidden`` rows) at positions ``keep, keep+1, ...``. Return the logits of the last position
    (last shard) or the hidden states of every evaluated position (non-last shard).

    ``deadline`` (``trio.current_time()`` clock; ``inf``: none) is when the result is due; the
    base class sets the slot's cancel flag (reason TIMEOUT) then. A batching implementation
    uses it to size the steps it shares with this one.
    """

    keep: int
    tokens: tuple[int, ...] | None
    hidden: np.ndarray | None
    deadline: float = math.inf
    #: The caller's look-ahead hint, resolved (``shard.engine.lookahead``); implementations
    #: that do not look ahead ignore it.
    lookahead: LookaheadPlan | None = None
    #: Last shard: return the logits of every evaluated position ([n_new, n_vocab]), not only
    #: the last one's (``PrefillRequest.all_logits``).
    all_logits: bool = False
    #: Hidden-state input: the token ids its rows stand for (``PrefillRequest.token_ids``), so
    #: the session keeps its history; None: it stops keeping one.
    token_ids: tuple[int, ...] | None = None
    #: Prefix cache (``shard.engine.base``, docs/engine.md): before its first row the step
    #: replaces the session's cells by the first ``keep`` positions of the entry held by
    #: sequence ``copy_from``; ``cached_ids`` are the ids of the positions that copy adds
    #: (from the session's length to ``keep``), committed with the step.
    copy_from: int | None = None
    cached_ids: tuple[int, ...] = ()

    @property
    def n_new(self) -> int:
        return len(self.tokens) if self.tokens is not None else int(self.hidden.shape[0])


class StreamRun:
    """One ``ShardEngine.stream`` call: the step to compute next and what to do with each
    step computed, shared by the base class and the implementation that runs the steps.

    ``step(raw)`` commits a computed step, hands its result to the caller's ``deliver`` and
    returns the next step's plan (None: the run ends). It never raises, so an implementation
    may call it from any task or callback on the event loop: the result check's error is kept
    in ``fault`` (an engine error), the caller's in ``caller_error``; either ends the run. A
    step whose session was stopped meanwhile (``slot.cancel``), or whose ``stream`` call has
    returned (``closed``), is not committed.
    """

    __slots__ = ("_make_result", "_slot", "_caps", "_deliver", "_sampling", "_top_k", "_max",
                 "_lookahead", "_stops", "_eog", "_limit", "plan", "delivered", "fault",
                 "caller_error", "closed")

    def __init__(self, make_result: MakeResult, slot: Slot, caps: Capabilities,
                 request: StreamRequest, deliver: Callable[[StepResult], bool]) -> None:
        self._make_result, self._slot, self._caps, self._deliver = make_result, slot, caps, deliver
        self._sampling, self._top_k = request.sampling, request.top_k_logprobs
        self._max, self._lookahead = request.max_steps, request.lookahead
        self._stops, self._eog = request.stop_tokens, request.stop_at_eog
        self._limit = min(caps.n_ctx_per_session, slot.kv_budget)
        self.delivered = 0
        self.fault: EngineError | None = None
        self.caller_error: Exception | None = None
        #: The ``stream`` call is over (set before any rollback): nothing is committed after
        #: it, whoever still holds the run (a batched tick that finished its step meanwhile).
        self.closed = False
        self.plan: ComputePlan | None = self._plan(int(request.token))

    @property
    def sampling(self) -> SamplingParams:
        """How the run chooses its tokens (an implementation that chooses beside its rows
        passes its choice to ``step`` as ``chosen``)."""
        return self._sampling

    def _plan(self, token: int) -> ComputePlan:
        left = self._max - self.delivered - 1
        tokens, params = self._slot.tokens, self._sampling
        if not (self._lookahead and left > 0) or (params.penalized and tokens is None):
            ahead = None
        else:
            history = None
            if params.penalized and tokens is not None:  # (the window through ``token``)
                history = lookahead_window([*tokens[-params.penalty_last_n:], token]
                                           if params.penalty_last_n > 0 else [*tokens, token],
                                           params)
            ahead = LookaheadPlan(params, left, self._stops, self._eog, self._limit, history)
        return ComputePlan(self._slot.n_past, (token,), None, math.inf, ahead)

    def step(self, raw: np.ndarray, chosen: tuple[SamplingParams, int, float] | None = None
             ) -> ComputePlan | None:
        """``chosen``: (sampling, token, log-sum-exp), the token a sampling chose from ``raw``
        and the row's log-sum-exp, when the implementation computed them already; used when
        that sampling is this run's (``_make_result``)."""
        plan, slot = self.plan, self._slot
        self.plan = None
        if plan is None or self.closed or slot.cancel.is_set():
            return None
        known = known_choice(chosen, self._sampling)
        try:
            result = self._make_result(slot, self._caps, plan, raw, self._sampling,
                                       self._top_k, 0, "decode_tokens_total", known)
        except EngineError as exc:
            self.fault = exc
            return None
        except Exception as exc:  # noqa: BLE001 - a hook (piece, is_eog) misbehaved
            log.exception("engine implementation fault while building a result")
            self.fault = EngineFailure(f"engine fault: {type(exc).__name__}")
            return None
        slot.touched = False  # committed: a later failure keeps it
        self.delivered += 1
        try:
            go = self._deliver(result)
        except Exception as exc:  # noqa: BLE001 - raised to the caller by ShardEngine.stream
            self.caller_error = exc
            return None
        if not go or self.delivered >= self._max or slot.n_past >= self._limit:
            return None
        assert result.logits is not None
        self.plan = self._plan(result.logits.token_id)
        return self.plan
