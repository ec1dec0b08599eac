"""Assemble a worker: engine + Shard servicer + grpc.health.v1 + the hardened transport.

``serve()`` is the one entry point the CLI calls. It owns every task it starts (session
registry with its reaper and stream tasks, the health synchroniser, the transport) in one
nursery, and reports readiness with ``task_status.started(RunningServer)`` only once the port is
bound. Cancelling it stops the transport, releases every session and returns; the engine itself
belongs to the caller (``async with engine:``), so it is not closed here.

Health is honest in both protocols: the Shard ``Health`` RPC and the standard
``grpc.health.v1`` service report SERVING only while the engine is READY and the worker is not
draining, and the standard one is kept in step by a small task that re-reads the engine state
whenever it is nudged (load, drain) and at least every ``health_interval`` seconds (an engine
can fail inside any step).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import ssl
from dataclasses import dataclass

import trio
from trio_util import AsyncValue

from shard.engine import LoadSpec, ShardEngine
from shard.v1 import shard_pb2 as pb

from .errors import unwrap_single_exception
from .health import NOT_SERVING, SERVING, HealthService
from .health import SERVICE_NAME as HEALTH_SERVICE
from .metrics import WorkerMetrics, serve_metrics
from .reflection import ReflectionService
from .registry import Registry
from .servicer import Authorizer, ShardServicer
from .session import Relay, SessionLimits
from .transport import Server, TransportLimits

log = logging.getLogger(__name__)

SHARD_SERVICE = "shard.v1.Shard"
SESSION_METHOD = f"/{SHARD_SERVICE}/Session"


@dataclass
class RunningServer:
    """Handle on a serving worker, given by ``task_status.started``."""

    host: str
    port: int
    servicer: ShardServicer
    registry: Registry
    health: HealthService
    _nudge: AsyncValue[int]
    transport: Server | None = None
    metrics: WorkerMetrics | None = None
    metrics_port: int | None = None  # where /metrics is served, if it is

    @property
    def target(self) -> str:
        """``host:port`` for ``ShardClient.connect`` or ``grpc.insecure_channel``."""
        return f"{self.host}:{self.port}"

    def drain(self) -> None:
        """Refuse new sessions (DRAINING) while running ones finish; health turns DRAINING;
        every connection gets GOAWAY at once (later streams are refused, clients go elsewhere)."""
        self.registry.draining = True
        if self.transport is not None:
            self.transport.drain()
        self._nudge.value += 1

    async def wait_idle(self) -> None:
        """Wait until no Session stream is running (e.g. after ``drain()``): its session is
        released and its final status handed to the transport."""
        await self.registry.streams.wait_value(0)
        if self.transport is not None:
            await self.transport.wait_calls_ended(SESSION_METHOD)

    async def drain_for(self, grace: float) -> bool:
        """Graceful stop, first half: ``drain()``, wait up to ``grace`` seconds for the Session
        streams (only those: a health Watch does not hold the drain), then ``end_streams()``.
        Returns whether the sessions all finished in time; the caller then cancels ``serve``."""
        self.drain()
        finished = False
        with trio.move_on_after(grace):
            await self.wait_idle()
            finished = True
        await self.end_streams()
        return finished

    async def end_streams(self) -> None:
        """End every stream still open (Watch, sessions past the grace) with UNAVAILABLE and a
        DRAINING ``shard-error-bin`` trailer, and wait until the statuses are written (at
        most ``flush_timeout`` seconds): a router can tell a drain from a crash."""
        if self.transport is not None:
            self.transport.end_calls()
            with trio.move_on_after(self.transport.limits.flush_timeout):
                await self.transport.wait_flushed()

    def sync_health(self) -> None:
        """Push the current health to grpc.health.v1 now (also done periodically)."""
        self._nudge.value += 1


async def serve(
    engine: ShardEngine,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    load: LoadSpec | None = None,
    limits: SessionLimits = SessionLimits(),
    resume_ttl: float | None = None,
    transport_limits: TransportLimits = TransportLimits(),
    ssl_context: ssl.SSLContext | None = None,
    authorize: Authorizer | None = None,
    health_interval: float = 1.0,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    reflection: bool = True,
    relay: Relay | None = None,
    model_name: str = "",
    task_status: trio.TaskStatus[RunningServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``engine`` on ``host:port`` until cancelled.

    ``load``: when given, the engine (still CREATED) is loaded *after* the port is bound, so
    health reports NOT_READY while it loads; a failed load raises out of ``serve``. Otherwise
    pass an engine that is already loaded. ``port=0`` picks a free port (see
    ``RunningServer.port``). ``limits`` bounds each session stream (credit, resume TTL, close
    linger); ``resume_ttl`` (seconds, 0 disables retention) overrides ``limits.resume_ttl``.
    ``authorize`` is the optional auth hook (see ``servicer.Authorizer``).
    ``metrics_port``: also serve Prometheus ``/metrics`` on ``metrics_host:metrics_port`` (0
    picks a free port, see ``RunningServer.metrics_port``). ``reflection``: serve gRPC server
    reflection (v1 and v1alpha) next to the Shard and health services. ``relay``: serve the
    routed side of sessions opened with a route (chain relay, ``shard.relay.ChainRelay``;
    ``serve --allow-relay``; it runs in the server's nursery, told the bound address) and report
    ``relay_allowed``; None (default) refuses every route. ``model_name``: the model's name as
    ``GetCapabilitiesResponse.model_name`` reports it (a pool's front door serves it under it).
    """
    if not (math.isfinite(health_interval) and health_interval > 0):
        raise ValueError("health_interval must be a positive number of seconds")
    if resume_ttl is not None:
        limits = dataclasses.replace(limits, resume_ttl=resume_ttl)
    metrics = WorkerMetrics()
    engine = metrics.meter(engine)  # times every step for the latency histograms
    registry = Registry(engine, limits, relay)
    transport = Server(host=host, port=port, limits=transport_limits, ssl_context=ssl_context)
    metrics.attach(engine, registry, cuts=lambda: transport.cuts)
    servicer = ShardServicer(
        engine, registry, transport_limits=transport_limits, authorize=authorize, metrics=metrics,
        model_name=model_name,
    )
    health = HealthService()
    # The auth hook runs from each call's headers, before its request bytes are acknowledged.
    transport.add_service(
        servicer.service, authorize=servicer.authorize_call if authorize is not None else None
    )
    transport.add_service(health.service)
    if reflection:
        for service in ReflectionService([SHARD_SERVICE, HEALTH_SERVICE]).services:
            transport.add_service(service)
    nudge = AsyncValue(0)
    _apply_health(servicer, health)
    try:
        with unwrap_single_exception():  # callers get OSError / EngineError, not a group
            async with trio.open_nursery() as nursery:
                await nursery.start(registry.run)
                nursery.start_soon(_sync_health, servicer, health, nudge, health_interval)
                bound = await nursery.start(transport.serve)
                running = RunningServer(
                    host, bound, servicer, registry, health, nudge, transport, metrics
                )
                if relay is not None:  # its connections to peers live as long as the server
                    await nursery.start(relay.run, _host_port(host, bound))
                if metrics_port is not None:
                    running.metrics_port = await nursery.start(
                        _serve_metrics, metrics, metrics_host, metrics_port
                    )
                    log.info("serving Prometheus metrics on http://%s/metrics",
                             _host_port(metrics_host, running.metrics_port))
                servicer.on_health_change = running.sync_health
                log.info("serving %s on %s:%d", SHARD_SERVICE, host, bound)
                task_status.started(running)
                if load is not None:
                    caps = await engine.load(load)  # an EngineError here stops the worker
                    log.info(
                        "engine ready: %s %s, layers [%d, %d) of %d, %d sessions x %d tokens",
                        caps.engine, caps.architecture, caps.layer_range.start,
                        caps.layer_range.end, caps.n_layers_total, caps.max_sessions,
                        caps.n_ctx_per_session,
                    )
                    running.sync_health()
    finally:
        health.shutdown()


async def _serve_metrics(
    metrics: WorkerMetrics, host: str, port: int, *, task_status: trio.TaskStatus[int]
) -> None:
    async with serve_metrics(metrics, host, port) as bound:
        task_status.started(bound)
        await trio.sleep_forever()


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _apply_health(servicer: ShardServicer, health: HealthService) -> None:
    serving = servicer.health_status()[0] == pb.HealthResponse.STATUS_SERVING
    for name in ("", SHARD_SERVICE):
        health.set(name, SERVING if serving else NOT_SERVING)


async def _sync_health(
    servicer: ShardServicer, health: HealthService, nudge: AsyncValue[int], interval: float
) -> None:
    while True:
        _apply_health(servicer, health)
        with trio.move_on_after(interval):
            await nudge.wait_transition()


__all__ = ["RunningServer", "SESSION_METHOD", "SHARD_SERVICE", "serve"]
