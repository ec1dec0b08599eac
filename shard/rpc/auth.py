"""Who may call the worker: a bearer-token authenticator for the ``authorize`` hook, and the
safe-binding rule for ``serve``.

Why here and this small: authentication *policy* (who may do what, billing) stays with the
router; the worker only verifies that a call carries one of the tokens the operator gave it.
The token file holds one token per line, optionally followed by a principal name used in logs
(``TOKEN [NAME]``; ``#`` starts a comment). Several tokens allow rotation without downtime:
add the new one, reload, move the clients, remove the old one, reload.

Secrets: tokens are compared with ``hmac.compare_digest`` against *every* configured token (no
early exit that would time which one matched), and no token ever reaches a log line or an
error message: a principal without a name is shown as ``token-<first 8 hex digits of its
SHA-256>``, which identifies it to the operator without revealing it.

Reload: ``reload()`` re-reads the file (the CLI calls it on SIGHUP). A file that cannot be read
or holds no token leaves the previous tokens in force, so a half-written file never locks every
client out.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import socket
from dataclasses import dataclass
from pathlib import Path

from .errors import ErrorCode, ShardError
from .transport import CallContext

log = logging.getLogger(__name__)

AUTH_HEADER = "authorization"
_SCHEME = "bearer"


@dataclass(frozen=True)
class _Token:
    secret: bytes
    principal: str
    digest: bytes  # SHA-256 of the secret: what calls are compared against


class TokenFileError(ValueError):
    """The token file cannot be used (unreadable, no token, a malformed line)."""


def read_tokens(path: Path) -> tuple[_Token, ...]:
    """Parse a token file: ``TOKEN [NAME]`` per line, blank lines and ``#`` comments ignored."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenFileError(f"cannot read token file {str(path)!r}: {exc}") from None
    tokens = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) > 2:
            # Never echo the line: it holds a secret.
            raise TokenFileError(f"{path}:{lineno}: expected 'TOKEN [NAME]'")
        secret = parts[0].encode("utf-8")
        principal = parts[1] if len(parts) == 2 else _anonymous(secret)
        tokens.append(_Token(secret, principal, hashlib.sha256(secret).digest()))
    if not tokens:
        raise TokenFileError(f"token file {str(path)!r} holds no token")
    return tuple(tokens)


def first_token(path: Path) -> str:
    """The first token of a token file (what a client sends)."""
    return read_tokens(path)[0].secret.decode("utf-8")


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` (for ``ShardClient.connect(metadata=...)``)."""
    return ((AUTH_HEADER, f"Bearer {token}"),)


def _anonymous(secret: bytes) -> str:
    return "token-" + hashlib.sha256(secret).hexdigest()[:8]


class TokenAuthenticator:
    """``serve(authorize=TokenAuthenticator(path))``: accept calls whose ``authorization``
    metadata is ``Bearer <one of the tokens>``; refuse others with UNAUTHENTICATED.

    Returns the caller's principal name, which the worker puts in its session logs.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._tokens = read_tokens(self.path)

    def __len__(self) -> int:
        return len(self._tokens)

    def reload(self) -> bool:
        """Re-read the token file; on failure keep the tokens in force. Returns success."""
        try:
            tokens = read_tokens(self.path)
        except TokenFileError as exc:
            log.error("token file not reloaded, %d token(s) stay in force: %s", len(self._tokens), exc)
            return False
        self._tokens = tokens
        log.info("token file reloaded: %d token(s)", len(tokens))
        return True

    def principal(self, offered: bytes) -> str | None:
        """The principal whose token ``offered`` is, None for none (also used by the HTTP front
        door for its API keys)."""
        # Digests have one length, so the comparison does not even reveal a token's length;
        # every token is compared, so nothing times which one matched.
        offered_digest = hashlib.sha256(offered).digest()
        principal = None
        for token in self._tokens:
            if hmac.compare_digest(token.digest, offered_digest) and principal is None:
                principal = token.principal
        return principal

    async def __call__(self, ctx: CallContext) -> str:
        offered = _bearer(ctx)
        if offered is None:
            log.warning("unauthenticated call %s from %s: no bearer token", ctx.method, ctx.peer)
            raise ShardError(ErrorCode.UNAUTHENTICATED, "missing bearer token (authorization metadata)")
        principal = self.principal(offered)
        if principal is None:
            log.warning("unauthenticated call %s from %s: unknown bearer token", ctx.method, ctx.peer)
            raise ShardError(ErrorCode.UNAUTHENTICATED, "invalid bearer token")
        return principal


def _bearer(ctx: CallContext) -> bytes | None:
    for key, value in ctx.metadata:
        if key.lower() != AUTH_HEADER:
            continue
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() == _SCHEME and token.strip():
            return token.strip().encode("utf-8")
    return None


# ---- safe binding ----------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address (fails closed: a name that
    does not resolve, or the empty "all interfaces" host, is not loopback)."""
    host = host.strip("[]")
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(
        ipaddress.ip_address(str(a).split("%", 1)[0]).is_loopback for a in addresses
    )


def binding_refusal(host: str, *, tls: bool, authenticated: bool, insecure: bool) -> str | None:
    """Why serving on ``host`` is refused, or None when it is allowed.

    Plaintext without authentication is only allowed on loopback: anywhere else any client on
    the network could open sessions, or Cancel and Release other clients' sessions by id.
    """
    if tls or authenticated or insecure or is_loopback(host):
        return None
    return (
        f"refusing to serve on non-loopback address {host or '(all interfaces)'!r} without TLS "
        "and without authentication: any client on the network could use, cancel or release "
        "sessions. Add --tls-cert/--tls-key, or --auth-token-file, or pass --insecure to serve "
        "plaintext anyway."
    )


__all__ = [
    "AUTH_HEADER",
    "TokenAuthenticator",
    "TokenFileError",
    "bearer_metadata",
    "binding_refusal",
    "first_token",
    "is_loopback",
    "read_tokens",
]
