"""The prefix every hop of a route holds: the first hop takes no more from its prefix cache.

A hop after the first gets the positions the first took from its cache as ids only, and must
take them from its own cache (``Prefill.token_ids``); replicas that evicted differently, or a
hop with a smaller budget, may not hold them. So the client asks every hop at the open what it
holds of the prompt (``OpenSession.prefix_probe``, answered in ``SessionOpened
.prefix_cached_tokens``; with chain relay the first hop asks its route and answers the least)
and holds the hops' prefills to the least answer (``Prefill.cache_limit``; a relaying worker
passes it on). That costs no
round trip: the answers come with the opens the generation makes anyway.

Why a retry as well: an entry can be evicted between the open and the step (another session's
release), and a text prompt's ids are known only once the first hop tokenized it, after the
opens. Then a later hop still answers ``PREFIX_NOT_CACHED``, before any token was emitted; the
turn runs once more on new sessions, probed with the ids the first hop echoed, or with no cache
at all where they are unknown (``PrefixTurn``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from shard.v1 import shard_pb2 as pb

from .errors import PipelineError
from .generation import Generation
from .result import PipelineResult

__all__ = ["PrefixTurn", "route_limit", "held_by"]

REASON = "PREFIX_NOT_CACHED"


class HopRunner(Protocol):
    """What this reads of a hop's runner (``shard.pipeline.runner.HopRunner``)."""

    gen: Generation
    prompt_ids: list[int] | None

    def honours_cache_limit(self) -> bool: ...

    def prefix_held(self) -> int | None: ...


def held_by(caps: pb.GetCapabilitiesResponse | None, opened: pb.SessionOpened) -> int | None:
    """What a hop's session answered to the probe; None: the hop cannot say (a worker older
    than the probe that has a prefix cache). A hop without a cache holds nothing."""
    if caps is None:
        return None
    if caps.prefix_cache_limit:
        return opened.prefix_cached_tokens
    return None if caps.prefix_cache_tokens else 0


def route_limit(runners: Sequence[HopRunner]) -> int | None:
    """The ``cache_limit`` of every hop's prefill: the least that the probed hops hold (None:
    no hop was probed or none can say, or the first hop would not honour a limit). Every hop
    but the last needs it, not only the first: a middle hop whose own cache holds more than it
    was sent as ids only would take that too, and send the next hop fewer rows than it can
    use. A retry whose prompt ids are unknown (a text the first hop did not echo) takes
    nothing from the cache."""
    first = runners[0]
    if not first.honours_cache_limit():
        return None
    held = [h for r in runners if (h := r.prefix_held()) is not None]
    if first.gen.prefix_retry and not first.gen.prefix_probe:
        return 0
    return min(held) if held else None


class PrefixTurn:
    """A generation's prefix probe (``Generation.prefix_probe``), and its one retry after
    ``PREFIX_NOT_CACHED``."""

    __slots__ = ("_gen",)

    def __init__(self, prompt: str | Sequence[int], gen: Generation) -> None:
        self._gen = gen
        # The prompt's ids asked about at each open (none for a text before it is tokenized).
        gen.prefix_probe = () if isinstance(prompt, str) else tuple(prompt)

    def retry(self, exc: BaseException, runners: Sequence[HopRunner],
              result: PipelineResult) -> bool:
        """Whether the turn that raised ``exc`` (its sessions released) runs once more: a later
        hop lacked what the first took from its cache, nothing was emitted, the first hop
        honours a limit, and this is the first retry. The retry opens new sessions (names of
        their own: a released one may linger on a worker) probed with the ids the first hop
        echoed, if any (``route_limit``: else the cache is not used)."""
        gen = self._gen
        err = _lone(exc)
        if (gen.prefix_retry or result.steps or not isinstance(err, PipelineError)
                or err.cause.reason != REASON or not runners[0].honours_cache_limit()):
            return False
        gen.prefix_retry = True
        gen.sid = f"{gen.sid}~p"
        if not gen.prefix_probe and runners[0].prompt_ids:
            gen.prefix_probe = tuple(runners[0].prompt_ids)
        gen.blames.failures.clear()
        gen.blames.interrupted.clear()
        return True


def _lone(exc: BaseException) -> BaseException:
    """The exception inside nested groups of one."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
