"""The operator's relay policy: which peers a relaying worker may connect to, and which routes
it takes.

Why a policy of its own: a routed session makes this worker open connections (with its own
credentials) on a caller's behalf. A caller must never choose where those go, so every address
the worker would connect to, a route's next hop or a direct return's target, is checked against
the peers its operator listed (``serve --relay-peers``) *before* any connection, and a route
must describe exactly the rest of this worker's model: each hop names this model's fingerprint
and the layer range that continues where the previous one ended, up to the model's last layer.
A route that revisits a hop, skips layers or names another model is refused before anything is
opened (docs/operations.md, "Chain relay").

Peers (``PeerList``): entries separated by commas or whitespace (a file: one or more a line, ``#``
comments), each an address, a CIDR block or a host name, optionally with a port:
``10.0.0.5``, ``10.0.0.0/24``, ``10.0.0.5:50051``, ``[fd00::5]:50051``, ``fd00::/8``,
``worker-b.internal:50051``, and ``loopback`` (127.0.0.0/8 and ::1). A host name is resolved
when the list is (re)loaded, and a target is checked by the addresses its name resolves to when
the worker connects; the connection then goes to the address that was checked (no second
lookup a DNS answer could change). Without ``--relay-peers`` only loopback peers are allowed.

Reload: a list read from a file (``--relay-peers @FILE``) is read again by ``reload()`` (the CLI
calls it on SIGHUP); a file that cannot be read or parsed keeps the previous list in force.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from shard.engine import Capabilities
from shard.v1 import shard_pb2 as pb

from shard.rpc import convert
from shard.rpc.errors import ErrorCode, ShardError
from shard.rpc.routes import MAX_ROUTE_HOPS, relay_session_id

__all__ = [
    "LOOPBACK",
    "NOT_ALLOWED",
    "Peer",
    "PeerList",
    "PeerListError",
    "check_route",
    "parse_target",
]

log = logging.getLogger(__name__)

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
#: The peers allowed when the operator lists none.
LOOPBACK = "loopback"
NOT_ALLOWED = (
    "this worker does not relay: its operator did not allow relay (start it with "
    "`trio-shard serve --allow-relay`); use client relay instead"
)
#: Seconds a relay peer's name may take to resolve.
RESOLVE_TIMEOUT = 5.0
_SPLIT = re.compile(r"[\s,]+")


class PeerListError(ValueError):
    """A peer list that cannot be used (a malformed entry, an unreadable file)."""


@dataclass(frozen=True)
class _Rule:
    network: IPNetwork
    port: int | None
    text: str

    def allows(self, address: IPAddress, port: int) -> bool:
        return address in self.network and (self.port is None or self.port == port)


@dataclass(frozen=True)
class Peer:
    """A checked place to connect to: the target as named, the address that was allowed, and
    the name TLS verifies (the target's host)."""

    target: str
    host: str
    address: str
    port: int

    @property
    def key(self) -> tuple[str, int, str]:
        """What makes two connections interchangeable (address, port, TLS name)."""
        return self.address, self.port, self.host


def parse_target(target: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as (host, port); ValueError otherwise."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"target must be HOST:PORT, got {target!r}")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"target must be HOST:PORT, got {target!r}")
        host = host[1:-1]
    return host, int(port)


def _address(text: str) -> IPAddress:
    return ipaddress.ip_address(text.split("%", 1)[0])


def _parse_entry(entry: str) -> list[_Rule]:
    """The rules one entry stands for (a host name is resolved now)."""
    if entry.lower() == LOOPBACK:
        return [_Rule(ipaddress.ip_network("127.0.0.0/8"), None, entry),
                _Rule(ipaddress.ip_network("::1/128"), None, entry)]
    host, port = entry, None
    if entry.startswith("["):
        close = entry.find("]")
        if close < 0:
            raise PeerListError(f"relay peer {entry!r}: no closing ']'")
        host, rest = entry[1:close], entry[close + 1:]
        if rest:
            if not rest.startswith(":") or not rest[1:].isdigit():
                raise PeerListError(f"relay peer {entry!r}: expected [ADDRESS]:PORT")
            port = int(rest[1:])
    else:
        try:
            return [_Rule(ipaddress.ip_network(entry, strict=False), None, entry)]
        except ValueError:
            pass
        head, sep, tail = entry.rpartition(":")
        if sep and tail.isdigit() and ":" not in head:
            host, port = head, int(tail)
    if port is not None and not 0 < port < 65536:
        raise PeerListError(f"relay peer {entry!r}: port out of range")
    try:
        return [_Rule(ipaddress.ip_network(host, strict=False), port, entry)]
    except ValueError:
        pass
    if not host or "/" in host:
        raise PeerListError(f"relay peer {entry!r}: not an address, CIDR block or host name")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise PeerListError(f"relay peer {entry!r}: cannot resolve {host!r}: {exc}") from None
    return [_Rule(ipaddress.ip_network(_address(str(info[4][0]))), port, entry) for info in infos]


def _parse(text: str) -> tuple[_Rule, ...]:
    rules: list[_Rule] = []
    for line in text.splitlines():
        for entry in _SPLIT.split(line.split("#", 1)[0].strip()):
            if entry:
                rules.extend(_parse_entry(entry))
    return tuple(rules)


class PeerList:
    """Where a relaying worker may connect (see the module docstring).

    ``spec``: entries (``"10.0.0.0/24, 10.0.1.5:50051"``), or ``@PATH`` for a file of them;
    None allows loopback peers only. ``loopback_only``: refuse every peer that is not a loopback
    address even if listed (a bearer token sent in plaintext, ``--relay-plaintext-loopback``).
    """

    def __init__(self, spec: str | None = None, *, loopback_only: bool = False) -> None:
        self.spec = spec if spec is not None else LOOPBACK
        self.loopback_only = loopback_only
        self.path = Path(self.spec[1:]) if self.spec.startswith("@") else None
        self._rules = self._read()
        if loopback_only:
            wide = [r.text for r in self._rules if not (r.network.is_loopback)]
            if wide:
                raise PeerListError(
                    "a relay token in plaintext (--relay-plaintext-loopback) allows loopback peers "
                    f"only; the peer list also names {', '.join(sorted(set(wide)))}")

    def _read(self) -> tuple[_Rule, ...]:
        if self.path is None:
            return _parse(self.spec)
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PeerListError(f"cannot read relay peer file {str(self.path)!r}: {exc}") from None
        return _parse(text)

    def __len__(self) -> int:
        return len(self._rules)

    def describe(self) -> str:
        """The entries in force (for logs), de-duplicated in order."""
        return ", ".join(dict.fromkeys(r.text for r in self._rules)) or "(none)"

    def reload(self) -> bool:
        """Re-read a file-based list (and re-resolve host names); on failure keep the list in
        force. Returns success."""
        try:
            rules = self._read()
        except PeerListError as exc:
            log.error("relay peers not reloaded, %d rule(s) stay in force: %s", len(self._rules), exc)
            return False
        if self.loopback_only and any(not r.network.is_loopback for r in rules):
            log.error("relay peers not reloaded: --relay-plaintext-loopback allows loopback peers only")
            return False
        self._rules = rules
        log.info("relay peers reloaded: %s", self.describe())
        return True

    def allows(self, address: str, port: int) -> bool:
        try:
            ip = _address(address)
        except ValueError:
            return False
        if self.loopback_only and not ip.is_loopback:
            return False
        return any(rule.allows(ip, port) for rule in self._rules)

    async def check(self, target: str) -> Peer:
        """The peer to connect to for ``target``: its name resolved, and the first address that
        is allowed. PERMISSION_DENIED, before any connection, when no address is (also when the
        name does not resolve or the target is malformed: one answer, whatever the reason)."""
        refusal = ShardError(
            ErrorCode.PERMISSION_DENIED, "its target is not a relay peer this worker's operator "
            "allows (`serve --relay-peers`)", reason="RELAY_PEER_NOT_ALLOWED")
        try:
            host, port = parse_target(target)
        except ValueError:
            raise refusal from None
        try:
            literal = _address(host)
        except ValueError:
            literal = None
        if literal is not None:
            candidates = [str(literal)]
        else:
            try:
                with trio.fail_after(RESOLVE_TIMEOUT):
                    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except (OSError, trio.TooSlowError) as exc:
                log.info("relay peer %s does not resolve: %s", target, exc)
                raise refusal from None
            candidates = list(dict.fromkeys(str(info[4][0]) for info in infos))
        for address in candidates:
            if self.allows(address, port):
                return Peer(target, host, address.split("%", 1)[0], port)
        log.info("relay to %s refused: %s is not an allowed relay peer", target, ", ".join(candidates))
        raise refusal


def check_route(req: pb.OpenSession, caps: Capabilities, sid: str) -> None:
    """Refuse, before any session is claimed or connection opened, a route this worker will not
    relay: it must continue this worker's range to the model's last layer, hop by hop, each hop
    naming this model and a range of its own."""
    hops = req.route.hops
    problem = ""
    if caps.is_last:
        problem = "this worker serves the last layers: there is nothing to relay to"
    elif len(hops) > MAX_ROUTE_HOPS:
        problem = f"a route may name at most {MAX_ROUTE_HOPS} hops, not {len(hops)}"
    elif req.HasField("cache"):
        problem = "a routed session cannot resume a retained one (routed sessions are never retained)"
    elif len(relay_session_id(sid).encode("utf-8")) > 128:
        problem = "the session id leaves no room for the downstream session's id (at most 127 bytes)"
    else:
        problem = _tiling_problem(hops, caps)
    if problem:
        raise convert.invalid(f"route: {problem}", sid)


def _tiling_problem(hops: Sequence[pb.RouteHop], caps: Capabilities) -> str:
    """Why ``hops`` does not describe the rest of this worker's model, or ""."""
    end = caps.layer_range.end
    seen: set[str] = set()
    for i, hop in enumerate(hops):
        name = f"route.hops[{i}]"
        if not hop.target:
            return f"{name} needs a target"
        try:
            host, port = parse_target(hop.target)
        except ValueError:
            return f"{name}.target must be HOST:PORT"
        key = f"{host.lower()}:{port}"
        if key in seen:
            return f"{name} names a target an earlier hop names (a route visits each hop once)"
        seen.add(key)
        if not hop.expected_model_fingerprint:
            return f"{name} needs expected_model_fingerprint (this worker's model)"
        if hop.expected_model_fingerprint != caps.model_fingerprint:
            return (f"{name} expects model {hop.expected_model_fingerprint}; this worker serves "
                    f"{caps.model_fingerprint} (every hop of a route serves the same model)")
        if not hop.HasField("expected_layer_range"):
            return f"{name} needs expected_layer_range"
        r = hop.expected_layer_range
        if r.start != end:
            what = "a gap" if r.start > end else "an overlap"
            return (f"{name} starts at layer {r.start}, but the route so far ends at layer "
                    f"{end} ({what})")
        if r.end <= r.start:
            return f"{name} names the empty layer range [{r.start}, {r.end})"
        end = r.end
    if end != caps.n_layers_total:
        return f"the route ends at layer {end}, not at the model's last ({caps.n_layers_total})"
    return ""
