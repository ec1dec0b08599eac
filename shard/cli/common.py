"""What several commands do alike: report a failure (``trio-shard: error: ...`` and an exit
status), set up the client credentials, read a ``--workers`` spec or a chat template, quiet the
GGUF writer, and ask one worker one question."""

from __future__ import annotations

import argparse
import logging
import ssl
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from shard.cli.credentials import client_options

if TYPE_CHECKING:
    from shard.client import ShardClient
    from shard.pool import WorkerSource

T = TypeVar("T")


class Failure(Exception):
    """A command cannot go on: ``main`` prints ``message`` and exits with ``code`` (2: the
    options or files given are wrong, 1: the run failed)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def fail(message: str, code: int = 1) -> int:
    """Report a failure on stderr; ``code`` is returned as the exit status."""
    print(f"trio-shard: error: {message}", file=sys.stderr)
    return code


def client_setup(args: argparse.Namespace) -> dict[str, object]:
    """``credentials.client_options``, a file that cannot be used a Failure (exit status 2)."""
    try:
        return client_options(args)
    except (ValueError, OSError, ssl.SSLError) as exc:
        raise Failure(f"client set-up failed: {exc}", 2) from None


def workers_source(spec: str, **kwargs: float) -> WorkerSource:
    """The pool a ``--workers`` value names; a malformed one is a Failure (exit status 2)."""
    from shard.pool import PoolSpecError, parse_workers

    try:
        return parse_workers(spec, **kwargs)
    except PoolSpecError as exc:
        raise Failure(f"--workers: {exc}", 2) from None


def read_chat_template(path: Path | None) -> str | None:
    """The text of ``--chat-template`` (None without it); unreadable is a Failure (2)."""
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise Failure(f"cannot read --chat-template {path}: {exc}", 2) from None


def quiet_gguf() -> None:
    """The GGUF writer's INFO lines are noise on a command's output."""
    logging.getLogger("gguf").setLevel(logging.WARNING)


def ask_worker(args: argparse.Namespace, ask: Callable[[ShardClient], Awaitable[T]]) -> T:
    """One request to ``--target`` with the client options (TLS, token); a failure is a
    Failure (exit status 1)."""
    options = client_setup(args)

    import trio

    from shard.client import ShardClient, ShardError

    async def run() -> T:
        async with ShardClient.connect(args.target, timeout=args.timeout, **options) as client:  # type: ignore[arg-type]
            return await ask(client)

    try:
        return trio.run(run)
    except ShardError as exc:
        raise Failure(str(exc)) from None
