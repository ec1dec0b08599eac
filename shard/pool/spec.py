"""Where a pool's workers are listed: a fixed list, a file, or a DNS name (``--workers SPEC``).

* ``HOST:PORT,HOST:PORT,...``: a fixed list.
* ``@FILE``: one ``HOST:PORT`` per line (``#`` starts a comment; blank lines and commas are
  fine), read at start and again on ``reload`` (SIGHUP in the CLI), so an operator adds or
  removes a worker by editing the file.
* ``dns:NAME:PORT``: every A and AAAA record of NAME, each at PORT, resolved at start and again
  every ``resolve_interval`` seconds and on ``reload``: a Kubernetes headless Service gives one
  record per ready pod. Targets are the addresses (``10.0.0.7:50051``, ``[fd00::7]:50051``).

A source that cannot be read or resolved raises ``PoolSpecError``; the pool then keeps the
workers it had (a DNS hiccup must not empty a pool) and logs why.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

__all__ = ["PoolSpecError", "Resolver", "WorkerSource", "check_target", "parse_workers"]

#: (name, port) -> the addresses of every A/AAAA record, as strings.
Resolver = Callable[[str, int], Awaitable[list[str]]]


class PoolSpecError(ValueError):
    """A worker list that cannot be parsed, read or resolved."""


def check_target(text: str) -> str:
    """``HOST:PORT`` (an IPv6 host in brackets, a name IDNA can encode) or PoolSpecError."""
    text = text.strip()
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) <= 65535:
        raise PoolSpecError(f"expected HOST:PORT, got {text!r}")
    _check_host(host.strip("[]"), text)
    return text


def _check_host(host: str, text: str) -> None:
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    try:
        host.encode("idna")
    except UnicodeError:
        raise PoolSpecError(f"{text!r}: {host!r} is not a valid host name") from None


def _target_of(address: str, port: int) -> str:
    try:
        if ipaddress.ip_address(address).version == 6:
            return f"[{address}]:{port}"
    except ValueError:
        pass
    return f"{address}:{port}"


async def system_resolver(name: str, port: int) -> list[str]:
    """Every address of ``name`` (A and AAAA), via the system's resolver."""
    try:
        infos = await trio.socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise PoolSpecError(f"cannot resolve {name!r}: {exc.strerror or exc}") from None
    except (UnicodeError, ValueError) as exc:  # a name IDNA cannot encode
        raise PoolSpecError(f"cannot resolve {name!r}: {exc}") from None
    seen: dict[str, None] = {}
    for *_, sockaddr in infos:
        seen[str(sockaddr[0])] = None
    return list(seen)


class WorkerSource:
    """The current list of workers' targets (see the module docstring)."""

    #: Seconds between re-resolutions without a ``reload`` (None: only on reload).
    interval: float | None = None

    def __init__(self, describe: str) -> None:
        self.describe = describe

    async def targets(self) -> list[str]:
        raise NotImplementedError


class _Fixed(WorkerSource):
    def __init__(self, targets: list[str]) -> None:
        super().__init__(",".join(targets))
        self._targets = targets

    async def targets(self) -> list[str]:
        await trio.lowlevel.checkpoint()
        return list(self._targets)


class _File(WorkerSource):
    def __init__(self, path: Path) -> None:
        super().__init__(f"@{path}")
        self.path = path

    async def targets(self) -> list[str]:
        try:
            text = await trio.Path(self.path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PoolSpecError(f"cannot read the worker list {self.path}: {exc}") from None
        return _split(text, f"{self.path}")


class _Dns(WorkerSource):
    def __init__(self, name: str, port: int, interval: float, resolver: Resolver) -> None:
        super().__init__(f"dns:{name}:{port}")
        self.name, self.port, self.interval = name, port, interval
        self._resolve = resolver

    async def targets(self) -> list[str]:
        addresses = await self._resolve(self.name, self.port)
        return sorted({_target_of(a, self.port) for a in addresses})


def _split(text: str, where: str) -> list[str]:
    targets: dict[str, None] = {}
    for n, line in enumerate(text.splitlines(), 1):
        for item in line.split("#", 1)[0].replace(",", " ").split():
            try:
                targets[check_target(item)] = None
            except PoolSpecError as exc:
                raise PoolSpecError(f"{where} line {n}: {exc}") from None
    return list(targets)


def parse_workers(
    spec: str, *, resolve_interval: float = 10.0, resolver: Resolver | None = None
) -> WorkerSource:
    """The source a ``--workers`` value names; PoolSpecError when it is malformed."""
    spec = spec.strip()
    if spec.startswith("@"):
        if not spec[1:]:
            raise PoolSpecError("@FILE names no file")
        return _File(Path(spec[1:]))
    if spec.startswith("dns:"):
        name, sep, port = spec[4:].rpartition(":")
        if not sep or not name or not port.isdigit() or not 0 < int(port) <= 65535:
            raise PoolSpecError(f"expected dns:NAME:PORT, got {spec!r}")
        _check_host(name, spec)
        if not resolve_interval > 0:
            raise PoolSpecError("the resolve interval must be > 0 seconds")
        return _Dns(name, int(port), resolve_interval, resolver or system_resolver)
    targets = _split(spec, "--workers")
    if not targets:
        raise PoolSpecError("--workers lists no worker (HOST:PORT,..., @FILE or dns:NAME:PORT)")
    return _Fixed(targets)
