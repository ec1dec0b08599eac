"""An OpenAI-compatible HTTP front door over one worker or a pipeline (``trio-shard api``).

``shard.api.app`` (routes, Starlette), ``limits`` (what a request and a key may take),
``schemas`` (Pydantic bodies), ``backend`` (the pipeline client and one generation), ``text``
(UTF-8 and stop sequences), ``replies`` (each endpoint's body and stream chunks),
``responses`` (the Responses API over the chat path), ``tokens`` (``/tokenize``,
``/detokenize``), ``embeddings`` (``/v1/embeddings``),
``streaming`` (a generation as an ASGI response), ``cors`` (the origins whose web pages may
call it), ``queue`` (each model's wait for a free
session), ``errors`` (OpenAI's error shape),
``metrics`` (Prometheus) and ``server`` (hypercorn on Trio). docs/api.md.
"""

from __future__ import annotations

import gc
import logging
import math
import signal
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import trio

from shard.chat import ChatTemplate
from shard.pool import Pool, WorkerSource
from shard.rpc.auth import TokenAuthenticator, is_loopback
from shard.v1 import shard_pb2 as pb

from .app import build_app
from .backend import Backend, Catalog
from .limits import DEFAULT_LIMITS, Limits
from .server import HttpTls, serve_http

__all__ = ["Backend", "Catalog", "HttpTls", "Limits", "build_app", "open_catalog", "run_api",
           "serve_http"]

log = logging.getLogger(__name__)


@asynccontextmanager
async def open_catalog(
    hops: Sequence[Sequence[str]] | None, *, workers: WorkerSource | None = None,
    model_name: str | None = None, chat_template: str | None = None, relay: str = "client",
    speculate: int = 0, step_timeout: float | None = None, timeout: float | None = 600.0,
    connect_timeout: float | None = 60.0, probe_interval: float = 2.0,
    ssl_context: ssl.SSLContext | None = None, metadata: Sequence[tuple[str, str]] = (),
) -> AsyncIterator[Catalog]:
    """What the door serves: one pipeline (``hops``: workers connected and checked within
    ``connect_timeout``), or a pool (``workers``: probed every ``probe_interval`` seconds; the
    door starts once each listed worker answered or ``connect_timeout`` passed, ready or not)."""
    if workers is None:
        assert hops is not None
        async with Backend.connect(
            hops, model_id=model_name, relay=relay, ssl_context=ssl_context, metadata=metadata,
            chat_template=chat_template, speculate=speculate, timeout=timeout,
            step_timeout=step_timeout, connect_timeout=connect_timeout,
        ) as backend:
            yield Catalog(backend)
        return
    if chat_template is not None:
        ChatTemplate.of(pb.ChatTemplate(), chat_template)  # a file that does not compile: now
    async with Pool.open(
        workers, probe_interval=probe_interval, connect_timeout=min(connect_timeout or 10.0, 10.0),
        ssl_context=ssl_context, metadata=metadata, relay=relay, step_timeout=step_timeout,
    ) as pool:
        await pool.settle(connect_timeout if connect_timeout is not None else math.inf)
        yield Catalog(pool=pool, chat_template=chat_template, speculate=speculate, timeout=timeout)


async def run_api(
    hops: Sequence[Sequence[str]] | None, *, host: str, port: int, tls: HttpTls | None = None,
    keys: TokenAuthenticator | None = None, model_name: str | None = None,
    chat_template: str | None = None, relay: str = "client", speculate: int = 0,
    step_timeout: float | None = None, timeout: float | None = 600.0,
    connect_timeout: float | None = 60.0, limits: Limits = DEFAULT_LIMITS, grace: float = 10.0,
    ssl_context: ssl.SSLContext | None = None, metadata: Sequence[tuple[str, str]] = (),
    workers: WorkerSource | None = None, probe_interval: float = 2.0,
    cors_origins: Sequence[str] = (),
) -> None:
    """Connect to the workers (``hops``, or the pool ``workers`` lists), then serve until
    SIGTERM/SIGINT (running requests get ``grace`` seconds; a second signal stops at once).
    SIGHUP re-reads the API key file and the pool's worker list."""
    async with open_catalog(
        hops, workers=workers, model_name=model_name, relay=relay, ssl_context=ssl_context,
        metadata=metadata, chat_template=chat_template, speculate=speculate, timeout=timeout,
        step_timeout=step_timeout, connect_timeout=connect_timeout, probe_interval=probe_interval,
    ) as catalog:
        app = build_app(catalog, keys=keys, limits=limits,
                        loopback_hosts_only=keys is None and is_loopback(host),
                        cors_origins=cors_origins)
        # What start-up made (libraries, the app, the chat template) lives as long as the
        # process: out of the collector's sight, a full collection does not walk it. Each such
        # walk would stall every stream on the event loop for tens of milliseconds.
        gc.collect()
        gc.freeze()
        shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(_handle_signals, shutdown, nursery.cancel_scope, keys, grace,
                                catalog.pool)

            async def serve(task_status: trio.TaskStatus[list[str]]) -> None:
                await serve_http(app, host=host, port=port, tls=tls, grace=grace,
                                 shutdown=shutdown, task_status=task_status)
                nursery.cancel_scope.cancel()  # drained: stop handling signals too

            binds = await nursery.start(serve)
            if catalog.pool is not None:
                models = catalog.ids()
                log.info("serving %s from the pool %s on %s",
                         f"models {', '.join(models)}" if models else "no model yet",
                         catalog.pool.source.describe, ", ".join(binds),
                         extra={"fields": {"models": models, "listen": binds}})
                return
            (model,) = catalog.ids()
            backend = catalog.get(model)
            assert hops is not None
            log.info("serving model %r from %s on %s", model,
                     " -> ".join("|".join(h) for h in hops), ", ".join(binds),
                     extra={"fields": {"model": model, "listen": binds}})
            if backend.chat is None:
                log.info("no chat template: /v1/chat/completions answers 400")


async def _handle_signals(
    shutdown: trio.Event, scope: trio.CancelScope, keys: TokenAuthenticator | None, grace: float,
    pool: Pool | None = None, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """SIGHUP re-reads the API keys; SIGTERM/SIGINT starts a graceful shutdown, a second one
    stops at once."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        task_status.started()
        async for signum in signals:
            if signum == signal.SIGHUP:
                if keys is not None:
                    keys.reload()
                if pool is not None:
                    log.info("SIGHUP: reading the worker list %s again", pool.source.describe)
                    pool.reload()
                continue
            name = signal.Signals(signum).name
            if shutdown.is_set():
                log.info("%s again: stopping now", name)
                scope.cancel()
                return
            log.info("%s: stopping (running requests may finish for up to %gs)", name, grace)
            shutdown.set()
