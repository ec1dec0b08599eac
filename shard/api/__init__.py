"""An OpenAI-compatible HTTP front door over one worker or a pipeline (``trio-shard api``).

``shard.api.app`` (routes, Starlette), ``limits`` (what a request and a key may take),
``schemas`` (Pydantic bodies), ``backend`` (the pipeline client and one generation), ``text``
(UTF-8 and stop sequences), ``replies`` (each endpoint's body and stream chunks),
``streaming`` (a generation as an ASGI response), ``errors`` (OpenAI's error shape),
``metrics`` (Prometheus) and ``server`` (hypercorn on Trio). docs/api.md.
"""

from __future__ import annotations

import gc
import logging
import signal
import ssl
from collections.abc import Sequence

import trio

from shard.rpc.auth import TokenAuthenticator, is_loopback

from .app import build_app
from .backend import Backend
from .limits import DEFAULT_LIMITS, Limits
from .server import HttpTls, serve_http

__all__ = ["Backend", "HttpTls", "Limits", "build_app", "run_api", "serve_http"]

log = logging.getLogger(__name__)


async def run_api(
    hops: Sequence[Sequence[str]], *, host: str, port: int, tls: HttpTls | None = None,
    keys: TokenAuthenticator | None = None, model_name: str | None = None,
    chat_template: str | None = None, relay: str = "client", speculate: int = 0,
    step_timeout: float | None = None, timeout: float | None = 600.0,
    connect_timeout: float | None = 60.0, limits: Limits = DEFAULT_LIMITS, grace: float = 10.0,
    ssl_context: ssl.SSLContext | None = None, metadata: Sequence[tuple[str, str]] = (),
) -> None:
    """Connect to the workers, then serve until SIGTERM/SIGINT (running requests get ``grace``
    seconds; a second signal stops at once). SIGHUP re-reads the API key file."""
    async with Backend.connect(
        hops, model_id=model_name, relay=relay, ssl_context=ssl_context, metadata=metadata,
        chat_template=chat_template, speculate=speculate, timeout=timeout,
        step_timeout=step_timeout, connect_timeout=connect_timeout,
    ) as backend:
        app = build_app(backend, keys=keys, limits=limits,
                        loopback_hosts_only=keys is None and is_loopback(host))
        # What start-up made (libraries, the app, the chat template) lives as long as the
        # process: out of the collector's sight, a full collection no longer walks it. Those
        # walks took 27-33 ms each, stalling every stream on the event loop (bench/api_abuse.py,
        # "quiet": the worst gap between two tokens 41.7 -> 29.1 ms, /health 35.3 -> 7.1 ms).
        gc.collect()
        gc.freeze()
        shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(_handle_signals, shutdown, nursery.cancel_scope, keys, grace)

            async def serve(task_status: trio.TaskStatus[list[str]]) -> None:
                await serve_http(app, host=host, port=port, tls=tls, grace=grace,
                                 shutdown=shutdown, task_status=task_status)
                nursery.cancel_scope.cancel()  # drained: stop handling signals too

            binds = await nursery.start(serve)
            log.info("serving model %r from %s on %s", backend.model_id,
                     " -> ".join("|".join(h) for h in hops), ", ".join(binds),
                     extra={"fields": {"model": backend.model_id, "listen": binds}})
            if backend.chat is None:
                log.info("no chat template: /v1/chat/completions answers 400")


async def _handle_signals(
    shutdown: trio.Event, scope: trio.CancelScope, keys: TokenAuthenticator | None, grace: float,
    *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """SIGHUP re-reads the API keys; SIGTERM/SIGINT starts a graceful shutdown, a second one
    stops at once."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        task_status.started()
        async for signum in signals:
            if signum == signal.SIGHUP:
                if keys is not None:
                    keys.reload()
                continue
            name = signal.Signals(signum).name
            if shutdown.is_set():
                log.info("%s again: stopping now", name)
                scope.cancel()
                return
            log.info("%s: stopping (running requests may finish for up to %gs)", name, grace)
            shutdown.set()
