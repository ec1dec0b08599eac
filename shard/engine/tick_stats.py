"""Per-tick statistics of a batching engine: how long each native step took, how many rows and
sessions it held, and how long the engine sat idle between steps while sessions waited.

Why: on a pipeline's hop the counters (``batch_ticks_total``, ``batch_rows_total``) give only
averages, and an average hides the bubbles an operator looks for: a hop whose ticks hold one
row where the others hold eight, or one idle between ticks while a session is mid-generation
(its next step is on another hop). So every tick is also counted into fixed buckets here; the
worker renders them as Prometheus histograms (``shard.rpc.metrics``). Plain Python, no lock:
only the event loop observes (once per tick: one ``bisect`` and a few increments per
distribution), and a snapshot is read on the event loop too.

No label by batch group: a group id is chosen per pipeline at random, so one series per group
would grow without bound.

Idle time (the bubble): the time from the end of one tick to the start of the next, counted
only when a session of the earlier tick is still open when the next one starts (a session
released meanwhile no longer waits; a worker without sessions is not in a bubble). It includes
the scheduler's wait for resubmitting sessions (``BatchScheduler._let_submitters_in``). Steps
computed ahead in the native thread during that gap (look-ahead) are ticks themselves and are
taken off the gap.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

#: Upper bounds of the buckets (Prometheus ``le``; a last ``+Inf`` bucket is implied).
TICK_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                        2.5, 5.0, 10.0)
TICK_ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
TICK_SESSIONS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class Distribution:
    """A snapshot of one distribution: ``counts[i]`` observations at most ``bounds[i]`` and
    above ``bounds[i - 1]`` (not cumulative); ``counts[-1]`` those above every bound."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float  # the sum of the observed values

    @property
    def count(self) -> int:
        return sum(self.counts)


class _Buckets:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self) -> Distribution:
        return Distribution(self.bounds, tuple(self.counts), self.total)


@dataclass(frozen=True)
class TickDistributions:
    """What ``TickStats.snapshot`` returns (``ShardEngine.tick_distributions``)."""

    seconds: Distribution  # a tick's duration, from the scheduler's side (the caller waits it)
    rows: Distribution  # rows (tokens or hidden rows) a tick evaluated
    sessions: Distribution  # sessions a tick served
    idle_seconds: Distribution  # each gap between ticks counted as idle (see the module doc)


class TickStats:
    """Counts ticks into the engine's counters and the distributions (event loop only).

    ``counters`` is the engine's counter table: ``batch_ticks_total``, ``batch_rows_total``,
    ``batch_sessions_total``, ``batch_tick_us_total`` and ``batch_idle_us_total`` grow here.
    """

    __slots__ = ("_counters", "_seconds", "_rows", "_sessions", "_idle", "_ahead")

    def __init__(self, counters: dict[str, int]) -> None:
        self._counters = counters
        self._seconds = _Buckets(TICK_SECONDS_BUCKETS)
        self._rows = _Buckets(TICK_ROWS_BUCKETS)
        self._sessions = _Buckets(TICK_SESSIONS_BUCKETS)
        self._idle = _Buckets(TICK_SECONDS_BUCKETS)
        self._ahead = 0.0  # seconds of look-ahead ticks since the last scheduled tick

    def tick(self, seconds: float, rows: int, sessions: int, *, idle: float | None = None) -> None:
        """One tick of ``rows`` rows for ``sessions`` sessions took ``seconds``; ``idle``: the
        gap before it, when a session was waiting through it (None: not a bubble)."""
        self._count(seconds, rows, sessions)
        if idle is not None:
            idle = max(idle - self._ahead, 0.0)
            self._counters["batch_idle_us_total"] += int(idle * 1e6)
            self._idle.observe(idle)
        self._ahead = 0.0

    def ahead(self, seconds: float, rows: int) -> None:
        """A look-ahead tick (one row per session it computed ahead), run between scheduled
        ticks: counted as a tick, and not idle time."""
        self._ahead += seconds
        self._count(seconds, rows, rows)

    def _count(self, seconds: float, rows: int, sessions: int) -> None:
        counters = self._counters
        counters["batch_ticks_total"] += 1
        counters["batch_rows_total"] += rows
        counters["batch_sessions_total"] += sessions
        counters["batch_tick_us_total"] += int(seconds * 1e6)
        self._seconds.observe(seconds)
        self._rows.observe(rows)
        self._sessions.observe(sessions)

    def snapshot(self) -> TickDistributions:
        return TickDistributions(self._seconds.snapshot(), self._rows.snapshot(),
                                 self._sessions.snapshot(), self._idle.snapshot())


__all__ = [
    "Distribution",
    "TICK_ROWS_BUCKETS",
    "TICK_SECONDS_BUCKETS",
    "TICK_SESSIONS_BUCKETS",
    "TickDistributions",
    "TickStats",
]
