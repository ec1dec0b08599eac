"""Worker metrics: one snapshot feeds both ``GetMetrics`` and the Prometheus ``/metrics`` page.

Why one snapshot: an operator who reads ``trio-shard metrics`` and a dashboard fed by
Prometheus must see the same numbers. ``WorkerMetrics.snapshot()`` builds the
``GetMetricsResponse`` from the engine's counters and the registry's counters and gauges; the
``GetMetrics`` RPC returns it as is, and a custom Prometheus collector renders the very same
message as metric families (``trio_shard_engine_*``, ``trio_shard_worker_*``), so the two
cannot disagree. Latency histograms (time to first token, engine queue wait, decode step,
prefill time per token) live only in the Prometheus registry: a histogram does not fit the
``map<string, uint64>`` of ``GetMetrics``. So do the engine's per-tick distributions (tick
duration, rows and sessions per tick, idle gaps: ``shard.engine.tick_stats``), which the
collector reads from the engine with the snapshot (their sums are ``GetMetrics`` counters).

Each worker has its own ``CollectorRegistry`` (not prometheus_client's global one), so several
workers in one process (tests) never share or collide.

Threads: the ``/metrics`` HTTP server is prometheus_client's own (a thread per scrape). Engine
and registry state belong to the Trio thread, so the collector hops into Trio
(``trio.from_thread.run_sync``) for each snapshot instead of reading that state from another
thread. ``serve_metrics`` owns the server: it stops it and closes its socket on exit.

Queue wait and step time: ``MeteredEngine`` wraps the engine the registry uses. An operation is
taken to start when the engine last finished one: ``start = max(called, last completion)``.
That splits each step's latency into the wait for the engine (``queue_wait``) and its own
compute time, without touching the engine. Engines that batch run several sessions' steps in
one native step, so "compute" includes sharing it (docs/operations.md). A ``Generate``'s stream
of steps is one operation: its first step is split so, each later one timed from the step before.
"""

from __future__ import annotations

import bisect
import logging
import re
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from shard.engine import (
    DecodeRequest, Distribution, EngineError, PrefillRequest, ShardEngine, StepResult,
    StreamRequest, TickDistributions,
)
from shard.v1 import shard_pb2 as pb

from . import convert
from .registry import Registry

log = logging.getLogger(__name__)

PREFIX = "trio_shard"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_PER_TOKEN_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
_NAME = re.compile(r"[^a-zA-Z0-9_]")


class WorkerMetrics:
    """The worker's metrics: counters (in the registry), histograms, the snapshot.

    ``attach(engine, registry)`` before ``snapshot()``; ``prometheus`` is the registry to
    expose (``serve_metrics``).
    """

    def __init__(self) -> None:
        self.prometheus = CollectorRegistry(auto_describe=False)
        self._engine: ShardEngine | None = None
        self._registry: Registry | None = None
        self._cuts: Callable[[], Mapping[str, int]] = dict

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, buckets=buckets, registry=self.prometheus)

        self.ttft = hist(
            "time_to_first_token_seconds",
            "From a Prefill or Generate request to its first result (a token, or hidden states "
            "on a non-last shard) leaving the worker.", _LATENCY_BUCKETS)
        self.queue_wait = hist(
            "queue_wait_seconds",
            "Time an engine operation waited for the engine (busy with other sessions) before "
            "it started.", _LATENCY_BUCKETS)
        self.decode_step = hist(
            "decode_step_seconds", "Engine compute time of one decode step.", _LATENCY_BUCKETS)
        self.prefill_per_token = hist(
            "prefill_seconds_per_token",
            "Engine compute time of a prefill divided by the positions it computed.",
            _PER_TOKEN_BUCKETS)
        self._collector = _SnapshotCollector(self)
        self.prometheus.register(self._collector)

    def attach(self, engine: ShardEngine, registry: Registry,
               cuts: Callable[[], Mapping[str, int]] | None = None) -> None:
        """What the snapshot reads; ``cuts``: the transport's connections cut, by reason."""
        self._engine, self._registry = engine, registry
        if cuts is not None:
            self._cuts = cuts

    # ---- lifecycle.Counts (what a StreamWatch reports) -----------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        if self._registry is not None:
            self._registry.count(name, n)

    def time_to_first_token(self, seconds: float) -> None:
        self.ttft.observe(max(seconds, 0.0))

    # ---- the snapshot ------------------------------------------------------------------------

    def snapshot(self) -> pb.GetMetricsResponse:
        """Everything ``GetMetrics`` returns (Trio thread only)."""
        engine, registry = self._engine, self._registry
        if engine is None or registry is None:
            raise RuntimeError("WorkerMetrics.attach() was not called")
        em = engine.metrics()
        worker: dict[str, int] = dict(registry.worker_metrics())
        for reason, n in self._cuts().items():
            worker[f"connections_cut_total:{reason}"] = n
        if engine.health().ready:
            try:
                total = engine.capabilities().n_ctx
            except EngineError:
                total = None
            if total is not None:
                worker["kv_cells_total"] = total
                worker["kv_cells_free"] = max(total - em.kv_cells_used - em.lookahead_cells, 0)
        return convert.metrics_to_proto(em, worker)

    def exposition(self) -> tuple[pb.GetMetricsResponse, TickDistributions]:
        """The snapshot and the engine's per-tick distributions, read together (Trio thread
        only): what the Prometheus page shows."""
        snapshot = self.snapshot()
        assert self._engine is not None  # (snapshot checked it)
        return snapshot, self._engine.tick_distributions()

    def meter(self, engine: ShardEngine) -> ShardEngine:
        """``engine`` with its operations timed into the histograms (see the module doc)."""
        return MeteredEngine(engine, self)  # type: ignore[return-value]


def families(snapshot: pb.GetMetricsResponse) -> Iterator[Metric]:
    """A ``GetMetricsResponse`` as Prometheus metric families (the one mapping both use).

    ``engine`` key ``k`` -> ``trio_shard_engine_k``; ``worker`` key ``k`` ->
    ``trio_shard_worker_k``; keys ending in ``_total`` are counters, others gauges. Worker keys
    ``errors_total:ERROR_CODE_X`` -> ``trio_shard_worker_errors_total{code="X"}``,
    ``connections_cut_total:R`` -> ``trio_shard_worker_connections_cut_total{reason="R"}`` and
    ``rpc_M_total`` -> ``trio_shard_worker_rpc_total{method="M"}``.
    """
    labelled: dict[str, tuple[str, str, list[tuple[str, int]]]] = {}
    for section, values in (("engine", snapshot.engine), ("worker", snapshot.worker)):
        for key in sorted(values):
            value = values[key]
            if section == "worker" and key.startswith("errors_total:"):
                code = key.split(":", 1)[1].removeprefix("ERROR_CODE_")
                labelled.setdefault("errors_total", ("code", "Errors sent, by code.", []))[2].append((code, value))
                continue
            if section == "worker" and key.startswith("connections_cut_total:"):
                reason = key.split(":", 1)[1]
                labelled.setdefault("connections_cut_total", (
                    "reason", "Connections the worker closed on their peer, by reason (a frame "
                    "kind's budget: <kind>_flood; protocol_error, handshake_timeout, "
                    "keepalive_timeout, max_connections).", []))[2].append((reason, value))
                continue
            m = re.fullmatch(r"rpc_(\w+?)_total", key)
            if section == "worker" and m:
                labelled.setdefault("rpc_total", ("method", "RPCs received, by method.", []))[2].append((m[1], value))
                continue
            name = f"{PREFIX}_{section}_{_NAME.sub('_', key)}"
            doc = f"GetMetrics {section}[{key!r}]"
            if key.endswith("_total"):
                yield CounterMetricFamily(name, doc, value=value)
            else:
                yield GaugeMetricFamily(name, doc, value=value)
    for key, (label, doc, samples) in labelled.items():
        family = CounterMetricFamily(f"{PREFIX}_worker_{key}", doc, labels=[label])
        for label_value, value in samples:
            family.add_metric([label_value], value)
        yield family


#: The engine's per-tick distributions as Prometheus histograms: field, name, help.
_TICK_HISTOGRAMS = (
    ("seconds", "batch_tick_seconds",
     "Duration of one batched native step (tick), as the sessions in it waited for it."),
    ("rows", "batch_tick_rows", "Rows (tokens or hidden rows) evaluated in one tick."),
    ("sessions", "batch_tick_sessions", "Sessions served in one tick."),
    ("idle_seconds", "batch_idle_seconds",
     "Each gap between two ticks while a session of the earlier one stayed open: the engine "
     "idle with a session mid-way (a pipeline's bubble on this hop)."),
)


def tick_families(ticks: TickDistributions) -> Iterator[Metric]:
    """The engine's per-tick distributions as Prometheus histograms
    (``trio_shard_engine_batch_tick_seconds`` ...; see ``_TICK_HISTOGRAMS``)."""
    for field, name, doc in _TICK_HISTOGRAMS:
        dist: Distribution = getattr(ticks, field)
        cumulative, buckets = 0, []
        for bound, n in zip((*dist.bounds, float("inf")), dist.counts):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(f"{PREFIX}_engine_{name}", doc, buckets=buckets,
                                    sum_value=dist.total)


def snapshot_values(snapshot: pb.GetMetricsResponse) -> dict[str, int]:
    """``section.key`` -> value: a flat view for display and comparisons."""
    out = {f"engine.{k}": int(v) for k, v in snapshot.engine.items()}
    out.update({f"worker.{k}": int(v) for k, v in snapshot.worker.items()})
    return dict(sorted(out.items()))


class _SnapshotCollector(Collector):
    """Renders ``WorkerMetrics.snapshot()`` for Prometheus; called from the HTTP thread."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self._metrics = metrics
        self.trio_token: trio.lowlevel.TrioToken | None = None

    def collect(self) -> Iterator[Metric]:
        if _in_trio_thread() or self.trio_token is None:
            snapshot, ticks = self._metrics.exposition()
        else:  # a scrape thread; fails (HTTP 500) once the worker's Trio run has ended
            snapshot, ticks = trio.from_thread.run_sync(self._metrics.exposition,
                                                        trio_token=self.trio_token)
        yield from families(snapshot)
        yield from tick_families(ticks)


def _in_trio_thread() -> bool:
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


def observe_many(hist: Histogram, amount: float, n: int) -> None:
    """``n`` observations of ``amount``, as ``n`` calls of ``hist.observe(amount)`` count them
    (its count, its bucket and its sum by ``n * amount``), with one bucket lookup: a group's
    rows share one wait and one compute time. (prometheus_client has no such call; where its
    histogram's fields are not the ones this reads, each observation is made alone.)"""
    try:
        bounds, buckets, total = hist._upper_bounds, hist._buckets, hist._sum  # noqa: SLF001
    except AttributeError:
        for _ in range(n):
            hist.observe(amount)
        return
    total.inc(amount * n)
    buckets[bisect.bisect_left(bounds, amount)].inc(n)


class MeteredEngine:
    """A ``ShardEngine`` proxy that times prefill and decode (everything else passes through)."""

    def __init__(self, engine: ShardEngine, metrics: WorkerMetrics) -> None:
        self._engine = engine
        self._metrics = metrics
        self._last_done = -float("inf")  # when the engine last finished an operation

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def prefill(self, request: PrefillRequest) -> StepResult:
        return await self._timed(self._engine.prefill, request, decode=False)

    async def decode(self, request: DecodeRequest) -> StepResult:
        return await self._timed(self._engine.decode, request, decode=True)

    async def decode_group(self, requests: Sequence[DecodeRequest]) -> list[StepResult | EngineError]:
        """Each row that computed is timed as a decode is (the group's queue wait and compute)."""
        called = trio.current_time()
        try:
            outcomes = await self._engine.decode_group(requests)
        finally:
            done = trio.current_time()
            started = max(called, min(self._last_done, done))
            self._last_done = done
        computed = sum(isinstance(o, StepResult) for o in outcomes)
        if computed:  # (every row waited and computed alike: one bucket lookup per histogram)
            metrics = self._metrics
            observe_many(metrics.queue_wait, started - called, computed)
            observe_many(metrics.decode_step, done - started, computed)
        return outcomes

    async def stream(self, request: StreamRequest, deliver: Callable[[StepResult], bool]) -> int:
        """A stream is one operation: its first step is split into queue wait and compute as
        a decode is; each later step's time is the time since the step before it (the engine
        computes a stream's steps back to back)."""
        called = last = trio.current_time()
        metrics = self._metrics
        first = True

        def timed(result: StepResult) -> bool:
            nonlocal last, first
            now = trio.current_time()
            if first:
                first = False
                last = max(called, min(self._last_done, now))
                metrics.queue_wait.observe(last - called)
            metrics.decode_step.observe(now - last)
            last = self._last_done = now  # (an operation beside the stream waited for it)
            return deliver(result)

        try:
            return await self._engine.stream(request, timed)
        finally:
            self._last_done = trio.current_time()

    async def open_session(
        self, session_id: str, *, kv_budget: int | None = None, batch_group: int = 0
    ) -> Any:
        try:
            return await self._engine.open_session(session_id, kv_budget=kv_budget,
                                                   batch_group=batch_group)
        finally:
            self._last_done = trio.current_time()

    async def release(self, session_id: str) -> bool:
        try:
            return await self._engine.release(session_id)
        finally:
            self._last_done = trio.current_time()

    async def _timed(self, fn: Callable[[Any], Any], request: Any, *, decode: bool) -> StepResult:
        called = trio.current_time()
        try:
            result: StepResult = await fn(request)
        finally:
            done = trio.current_time()
            started = max(called, min(self._last_done, done))
            self._last_done = done
        self._metrics.queue_wait.observe(started - called)
        compute = done - started
        if decode:
            self._metrics.decode_step.observe(compute)
        elif result.tokens_processed:
            self._metrics.prefill_per_token.observe(compute / result.tokens_processed)
        return result


@asynccontextmanager
async def serve_metrics(metrics: WorkerMetrics, host: str, port: int) -> AsyncIterator[int]:
    """Serve ``/metrics`` on ``host:port`` (0 picks a free port) while the block runs; yields
    the bound port. On exit the HTTP server is stopped and its socket closed."""
    metrics._collector.trio_token = trio.lowlevel.current_trio_token()
    try:
        httpd, thread = start_http_server(port, addr=host, registry=metrics.prometheus)
    except OSError as exc:  # say which of the worker's two ports failed
        raise OSError(exc.errno, f"metrics on {host}:{port}: {exc.strerror or exc}") from None
    try:
        yield httpd.server_port
    finally:
        with trio.CancelScope(shield=True):
            # shutdown() waits for the serve loop (up to its 0.5 s poll): not on the Trio thread.
            await trio.to_thread.run_sync(_stop, httpd, thread)


def _stop(httpd: Any, thread: threading.Thread) -> None:
    httpd.shutdown()
    httpd.server_close()
    thread.join()


__all__ = [
    "MeteredEngine", "WorkerMetrics", "families", "serve_metrics", "snapshot_values", "tick_families",
]
