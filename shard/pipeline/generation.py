"""What every hop of one ``generate`` shares (``Generation``), what one hop's step gives
(``HopOutput``) and what a failover leaves on the record (``Failover``)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import trio

from shard.rpc.errors import ShardError
from shard.v1 import shard_pb2 as pb

from .errors import Blames
from .replay import ReplayBudget
from .replicas import Replica

if TYPE_CHECKING:
    from .gathering import HopGroups

__all__ = [
    "OnToken",
    "CLEANUP_GRACE",
    "RELEASE_TIMEOUT",
    "Failover",
    "Generation",
    "HopOutput",
    "Release",
    "next_or_none",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: A caller's callback for each token a generation produces (plain or async).
OnToken = Callable[[pb.StepResult], "Awaitable[None] | None"]

RELEASE_TIMEOUT = 2.0  # seconds a cleanup (Release, shielded) may take at most...
CLEANUP_GRACE = 0.5  # ...and how long it may go on after the caller's deadline


@dataclass(frozen=True)
class Failover:
    """A hop that moved to another replica during a generation (``PipelineResult.failovers``).

    ``recovery_ms``: from the failure reaching the client (or the GOAWAY being noticed) to the
    replacement holding the whole history again; ``positions``: how many it replayed."""

    hop: int
    from_target: str
    to_target: str
    reason: str  # the failure's ErrorCode name (DRAINING for a handover)
    message: str
    handover: bool  # a draining worker handed over: no step failed
    positions: int
    recovery_ms: float
    #: The session's state moved from the draining worker (session hand-off): the replacement
    #: recomputed nothing; False: it replayed ``positions``.
    moved: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"hop": self.hop, "from": self.from_target, "to": self.to_target,
                "reason": self.reason, "handover": self.handover, "moved": self.moved,
                "positions": self.positions, "recovery_ms": round(self.recovery_ms, 1)}


#: Releases a session by name on a replica; never raises (the pipeline's, it has the TLS
#: context and metadata to connect again).
Release = Callable[[Replica, str], Awaitable[None]]


@dataclass
class Generation:
    """What every hop of one ``generate`` shares."""

    sid: str
    deadline: float
    sampling: pb.SamplingParams
    top_logprobs: int
    #: Prompt positions per prefill step (0: the whole prompt in one, a route of one hop).
    chunk_tokens: int
    hidden_dtype: str
    step_timeout: float | None
    budget: ReplayBudget
    release: Release
    #: ``start_soon`` of the nursery that owns the releases of failed sessions (the
    #: generation's): they run while it goes on and it waits for them, bounded.
    spawn: Callable[..., None]
    failovers: list[Failover] = field(default_factory=list)
    #: Names the hop of every error (a later hop's, for an error a chain relay passed up).
    blames: Blames = field(default_factory=Blames)
    #: Every session of the generation is opened in this batch group (``shard.pipeline.groups``).
    batch_group: int = 0
    #: The pipeline's group-step gatherers (``shard.pipeline.gathering``; None: per session).
    groups: HopGroups | None = None
    #: A text prompt's special-token texts become special tokens (``Prefill.parse_special``).
    parse_special: bool = False
    #: A draining worker's sessions move to the replica as state (``shard.pipeline.handoff``).
    handoff: bool = True
    #: The prompt's ids each hop is asked about at its open (``shard.pipeline.prefix``).
    prefix_probe: tuple[int, ...] = ()
    #: The turn runs again after a later hop lacked the first hop's cached prefix.
    prefix_retry: bool = False
    #: The generation whose sessions this one's forks at their first open (its ``sid``; "":
    #: none): each hop's session starts as a copy of that one's (``shard.pipeline.choices``).
    fork_of: str = ""
    #: Positions of one scoring pass over the prompt (``prompt_logprobs``; 0: the prompt is
    #: prefilled, not scored; ``shard.pipeline.scoring``).
    score_window: int = 0

    def prompt_held(self, n_past: int) -> None:
        """The prompt's ``n_past`` positions are held: a grammar starts there, and every later
        step says so (a replay's or a hand-off's prompt ends elsewhere)."""
        if self.sampling.grammar_kind and not self.sampling.grammar_start:
            self.sampling.grammar_start = n_past

    def cleanup_deadline(self) -> float:
        return min(trio.current_time() + RELEASE_TIMEOUT, self.deadline + CLEANUP_GRACE)

    def record(
        self, hop: int, cause: ShardError, old: Replica, new: Replica, *, handover: bool,
        started: float, positions: int, moved: bool = False,
    ) -> None:
        """Put a failover of ``hop`` on the record (``failovers``) and in the log."""
        ms = (trio.current_time() - started) * 1000
        self.failovers.append(Failover(hop, old.target, new.target, cause.code.name,
                                       cause.message, handover, positions, ms, moved))
        log.warning(
            "hop %d: %s from %s to %s (%s); %s %d positions in %.1f ms", hop,
            "handed over" if handover else "failed over", old.target, new.target,
            cause.code.name, "moved the state of" if moved else "replayed", positions, ms,
        )


@dataclass
class HopOutput:
    """One step's result at a hop: the StepResult and, for a non-last hop, its validated
    float32 boundary rows starting at position ``start``."""

    step: pb.StepResult
    start: int
    rows: np.ndarray | None


async def next_or_none(steps: AsyncIterator[T]) -> T | None:
    """The next item of ``steps``, None once it is exhausted."""
    try:
        return await steps.__anext__()
    except StopAsyncIteration:
        return None
