"""The front door's Prometheus metrics: requests by endpoint and status, time to first token,
tokens per second and token counts, each model's wait queue (depth, waits, refusals past its
bounds), and over a pool its workers by state, each model's complete routes and how its routes
were picked (by prefix or by load), served at ``GET /metrics``.

Each app has its own ``CollectorRegistry`` (not prometheus_client's global one), so several
front doors in one process (tests) never share counters. Everything is updated on the Trio
thread that serves the requests; the page is rendered there too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["ApiMetrics"]

if TYPE_CHECKING:
    from shard.pool import Pool

PREFIX = "trio_shard_api"
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ApiMetrics:
    """Counters and histograms of one front door."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests answered, by endpoint and "
                                "status code", ["endpoint", "status"], registry=r)
        self.in_flight = Gauge(f"{PREFIX}_requests_in_flight", "generation requests being "
                               "answered now (queued ones included)", registry=r)
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "from a generation request's arrival to its "
            "first text", ["endpoint"], buckets=_TTFT_BUCKETS, registry=r)
        self.tokens_per_second = Histogram(
            f"{PREFIX}_tokens_per_second", "completion tokens per second of one generation, after "
            "its first token", ["endpoint"], buckets=_RATE_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens computed",
                                     registry=r)
        self.cached_tokens = Counter(f"{PREFIX}_cached_prompt_tokens", "prompt tokens the "
                                     "workers took from their prefix cache", registry=r)
        self.completion_tokens = Counter(f"{PREFIX}_completion_tokens", "tokens generated",
                                         registry=r)
        self.queue_depth = Gauge(f"{PREFIX}_queue_depth", "requests waiting for a session of "
                                 "the model now", ["model"], registry=r)
        self.queue_wait = Histogram(
            f"{PREFIX}_queue_wait_seconds", "from a generation request's arrival until its "
            "last try for a session began (0: a session was free), or until it was refused",
            ["model"], buckets=_WAIT_BUCKETS, registry=r)
        self.queue_refused = Counter(
            f"{PREFIX}_queue_refused", "requests answered 429 past the model's queue: full "
            "(--queue-length) or timeout (--queue-timeout)", ["model", "reason"], registry=r)
        self.pool_workers = Gauge(f"{PREFIX}_pool_workers", "workers listed in the pool, by "
                                  "state (up, down, connecting, refused)", ["state"], registry=r)
        self.pool_routes = Gauge(f"{PREFIX}_pool_routes", "complete routes (one replica per hop) "
                                 "a model of the pool has now", ["model"], registry=r)
        self.pool_picks = Counter(
            f"{PREFIX}_pool_picks", "generations given a route, by how it was picked: prefix "
            "(the route holding the prompt's prefix), load (none held it: the least-loaded "
            "route), balance (the holder was overloaded: the least-loaded route)",
            ["model", "by"], registry=r)
        self._picks_seen: dict[tuple[str, str], int] = {}

    def show_pool(self, pool: Pool) -> None:
        """Set the pool's gauges to what it holds now (called before each scrape)."""
        for state, n in pool.counts().items():
            self.pool_workers.labels(state).set(n)
        self.pool_routes.clear()
        for name, routes in pool.table.models.items():
            self.pool_routes.labels(name).set(routes.routes if name in pool.servable() else 0)
        for (name, by), n in list(pool.router.picks.items()):
            seen = self._picks_seen.get((name, by), 0)
            if n > seen:
                self.pool_picks.labels(name, by).inc(n - seen)
                self._picks_seen[(name, by)] = n

    def render(self) -> bytes:
        return generate_latest(self.registry)
