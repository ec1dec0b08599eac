"""Cross-origin requests (CORS) from the origins the operator lists (``api --cors-origin``).

Why: a chat UI served from another origin (a web page at ``http://localhost:3000``) calls the
door from the browser, which first sends an ``OPTIONS`` preflight for a JSON POST with an
``Authorization`` header and reads an answer only when it carries
``Access-Control-Allow-Origin``. Off by default: without a list no preflight is answered and no
response carries the header, so no page of another origin can read the door's answers (and its
JSON POSTs never leave the browser: they need a preflight). ``*`` allows every origin.

An ASGI middleware rather than Starlette's own: a preflight answers 204 (no body, as llama.cpp's
server and most proxies), one from an origin not listed 403 in OpenAI's error shape, and the
generation responses of ``shard.api.streaming`` are ASGI callables whose headers it adds to as
they start.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from .errors import ApiError

__all__ = ["CorsMiddleware", "parse_origins"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Seconds a browser may reuse a preflight's answer.
MAX_AGE = 600
_METHODS = b"GET, POST, OPTIONS"
#: What a page's script may read of a response besides the safe headers: a 429's retry delay.
_EXPOSE = b"Retry-After"


def parse_origins(text: str) -> list[str]:
    """``ORIGIN[,ORIGIN...]`` -> the origins (``scheme://host[:port]``, no path), ``*`` for any;
    ValueError naming a bad one."""
    origins = [o.strip().rstrip("/") for o in text.split(",") if o.strip()]
    if not origins:
        raise ValueError("no origin given")
    for origin in origins:
        scheme, sep, rest = origin.partition("://")
        if origin != "*" and (not sep or scheme not in ("http", "https") or not rest
                              or "/" in rest):
            raise ValueError(f"{origin!r} is not an origin (scheme://host[:port], or *)")
    return origins


class CorsMiddleware:
    """Answer preflights from ``origins`` and mark plain responses to them as readable."""

    def __init__(self, app: Asgi, origins: Iterable[str]) -> None:
        self.app = app
        self.origins = frozenset(origins)

    def _allowed(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        origin = headers.get(b"origin", b"").decode("latin-1")
        if not origin:  # not a browser's cross-origin request
            await self.app(scope, receive, send)
            return
        preflight = scope["method"] == "OPTIONS" and b"access-control-request-method" in headers
        if not self._allowed(origin):
            if preflight:
                refusal = ApiError(403, f"the origin {origin!r} is not allowed (--cors-origin)",
                                   code="origin_not_allowed")
                await refusal.response()(scope, receive, send)
                return
            await self.app(scope, receive, send)  # answered, but the browser keeps it from the page
            return
        allow = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
        if preflight:
            requested = headers.get(b"access-control-request-headers", b"")
            await send({"type": "http.response.start", "status": 204, "headers": [
                *allow, (b"access-control-allow-methods", _METHODS),
                (b"access-control-allow-headers", requested or b"authorization, content-type"),
                (b"access-control-max-age", str(MAX_AGE).encode())]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *allow,
                                      (b"access-control-expose-headers", _EXPOSE)]
            await send(message)

        await self.app(scope, receive, marked)
