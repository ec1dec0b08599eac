"""Serving the front door: hypercorn's Trio worker, its TLS, and graceful shutdown.

HTTP/1.1 only (ALPN offers ``http/1.1``): the project pins h2 3.2 for its gRPC transport, older
than hypercorn's HTTP/2 code is written for, and OpenAI's clients speak HTTP/1.1. A shutdown
(``shutdown`` set: SIGTERM/SIGINT in the CLI) stops accepting connections and gives running
requests ``grace`` seconds before they are cancelled; a cancelled generation releases its
sessions on every hop.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette

__all__ = ["HttpTls", "serve_http"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpTls:
    """The front door's own certificate, and the CA its clients' certificates must chain to
    (``client_ca``: mutual TLS)."""

    cert: Path
    key: Path
    client_ca: Path | None = None


def _config(host: str, port: int, tls: HttpTls | None, grace: float) -> Config:
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.alpn_protocols = ["http/1.1"]
    config.graceful_timeout = grace
    config.accesslog = None
    config.errorlog = logging.getLogger("shard.api.http")
    if tls is not None:
        config.certfile, config.keyfile = str(tls.cert), str(tls.key)
        if tls.client_ca is not None:
            config.ca_certs = str(tls.client_ca)
            config.verify_mode = ssl.CERT_REQUIRED
        config.create_ssl_context()  # a file that cannot be used fails here, before binding
    return config


async def serve_http(
    app: Starlette, *, host: str, port: int, tls: HttpTls | None = None, grace: float = 10.0,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until ``shutdown`` is set (or the task is cancelled); ``task_status``
    gets the bound addresses (``http://127.0.0.1:PORT``: port 0 picks a free one)."""
    config = _config(host, port, tls, grace)
    trigger = (shutdown if shutdown is not None else trio.Event()).wait
    await hypercorn_serve(app, config, shutdown_trigger=trigger, task_status=task_status)  # type: ignore[arg-type]
