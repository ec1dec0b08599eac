"""Option types and the option groups several commands share (the worker to talk to, the pool,
client TLS and tokens): one definition each, so that a check or a help text is the same in
every command that takes the option. A bad value is an ``ArgumentTypeError`` (a usage error
that says what was expected)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from shard.cli.env import Options

DEFAULT_PORT = 50051
DEFAULT_API_PORT = 8000


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers in ``[minimum, maximum]``, with a clear message."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
port = int_at_least(0, 65535)


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def target(text: str) -> str:
    """HOST:PORT (an IPv6 host in brackets), checked here so that a typo is a usage error."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host.strip("[]") or not port_text.isdigit() or not 0 < int(port_text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return text


def targets(text: str) -> list[list[str]]:
    """HOST:PORT[|HOST:PORT...],... for --pipeline: one entry per hop, first hop first, a hop's
    replicas separated by '|'; every target checked like --target, none listed twice."""
    hops = [[t.strip() for t in entry.split("|")] for entry in text.split(",")]
    if any(not t for hop in hops for t in hop):
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT[|HOST:PORT...][,...] without empty entries, got {text!r}")
    seen: set[str] = set()
    for each in (t for hop in hops for t in hop):
        try:
            target(each)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {each!r} in {text!r}") from None
        if each in seen:
            raise argparse.ArgumentTypeError(
                f"{each} is listed twice in {text!r} (a worker serves one hop)")
        seen.add(each)
    return hops


class Layers(NamedTuple):
    """A parsed ``--layers``; ``str()`` gives it back as ``A:B`` (for ``--print-config``)."""

    start: int
    end: int

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"


def layer_range(text: str) -> Layers:
    """A:B, the half-open block range [A, B) (0-based), with A < B."""
    start, sep, end = text.partition(":")
    if not sep or not start.isdigit() or not end.isdigit():
        raise argparse.ArgumentTypeError(f"expected A:B (blocks A..B-1), got {text!r}")
    if int(start) >= int(end):
        raise argparse.ArgumentTypeError(f"empty layer range {text!r}: A must be smaller than B")
    return Layers(int(start), int(end))


class Part(NamedTuple):
    """A parsed ``--part``; ``str()`` gives it back as ``I/N``."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def part(text: str) -> Part:
    """I/N: the I-th (1-based) of N balanced parts."""
    from shard.models.plan import parse_part

    try:
        return Part(*parse_part(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class Memory(tuple[int, ...]):
    """A parsed ``--memory`` (bytes per worker); ``str()`` gives it back as a comma list."""

    def __str__(self) -> str:
        return ",".join(str(n) for n in self)


def memory(text: str) -> Memory:
    from shard.models.plan import parse_memory

    try:
        return Memory(parse_memory(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


WORKERS_HELP = ("a pool of workers: HOST:PORT,... (a fixed list), @FILE (one HOST:PORT per "
                "line, read again on SIGHUP) or dns:NAME:PORT (every A/AAAA record of NAME, "
                "resolved again every --resolve-interval); their capabilities say which "
                "model and layers each serves, and the complete routes are found from them "
                "(docs/operations.md, \"A pool of workers\")")


def add_pool_options(opts: Options) -> None:
    """How often a pool (``--workers``) is looked up and probed."""
    opts.add("--resolve-interval", type=positive_float, default=10.0, metavar="SECONDS",
             help="with --workers dns:...: seconds between lookups of the name "
             "(default: 10)")
    opts.add("--probe-interval", type=positive_float, default=2.0, metavar="SECONDS",
             help="with --workers: seconds between two checks of each worker's health and "
             "capabilities; a worker that stops serving is out of new routes from the "
             "next check (default: 2)")


def add_target(opts: Options, *, pipeline: bool = False, workers: bool = False) -> None:
    """The worker to talk to (``--target``; with ``pipeline``/``workers`` instead a chain or a
    pool, one of the three) and the client credentials."""
    where = opts.exclusive() if pipeline else opts
    where.add("--target", type=target, default=f"127.0.0.1:{DEFAULT_PORT}",
              help=f"worker address HOST:PORT (default: 127.0.0.1:{DEFAULT_PORT})")
    if pipeline:
        where.add("--pipeline", type=targets, metavar="HOST:PORT[|HOST:PORT...],...",
                  help="generate through a chain of workers, first shard first; a hop "
                  "may list replicas of the same range separated by '|' (quote the list "
                  "in a shell), which take over when the serving one fails or drains "
                  "(the TLS options apply to every worker)")
    if workers:
        where.add("--workers", metavar="SPEC", help=WORKERS_HELP)
    add_client_credentials(opts)


def add_client_credentials(opts: Options) -> None:
    """Client TLS and the bearer token (``credentials.client_options`` reads them)."""
    opts.add("--tls-ca", type=Path, metavar="PEM",
             help="connect with TLS, trusting this CA bundle")
    opts.add("--tls-cert", type=Path, metavar="PEM",
             help="client certificate chain for mutual TLS (with --tls-key)")
    opts.add("--tls-key", type=Path, metavar="PEM", help="client private key")
    opts.add("--token-file", type=Path, metavar="FILE",
             help="send the first token in FILE as 'authorization: Bearer TOKEN'")
