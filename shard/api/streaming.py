"""One generation as an ASGI response: run it while the client is connected, answer with the
whole body or with server-sent events.

Why an ASGI callable of its own rather than a streaming response over an async generator: the
generation, the reader of its deltas and the watch for the client's disconnect are three tasks
of one nursery that this response owns, so a disconnect cancels the generation (every hop's
session is reset and released by the pipeline client) and nothing outlives the request. The
deltas pass through a bounded channel: a client that reads slowly slows its own generation.
Several prompts (one completions request) are several generations in that task's own nursery,
at once, their deltas tagged with their choice's index; the first to fail cancels the others.

Errors: before the first text, a refusal is an HTTP error with its status (429, 503, 400, ...);
a streamed generation that fails later ends with an ``error`` event (OpenAI's SDKs raise it),
a non-streamed one is an HTTP error as a whole.

Keep-alive: a stream that has nothing to send for ``keepalive`` seconds (a long prompt, a slow
or failing-over hop) sends an SSE comment (``: keep-alive``, which clients ignore), so proxies
and load balancers that cut idle connections (nginx: 60 s) do not end a healthy generation. A
stream whose first text takes longer than that commits to 200 at the first comment: a refusal
after it arrives as an ``error`` event, as a later failure does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import trio

from shard.logs import kv

from .backend import Backend, Outcome, Request
from .errors import ApiError
from .limits import DEFAULT_LIMITS, KeySlots, Limits
from .metrics import ApiMetrics
from .queue import WaitQueue
from .replies import Reply
from .text import Delta

__all__ = ["GenerationResponse"]

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Piece = tuple[int, Delta]  # a choice's index and its next text
Event = Piece | list[Outcome] | ApiError

#: Deltas buffered between the generation and a slow client.
DELTA_BUFFER = 8
_KEEPALIVE = b": keep-alive\n\n"
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies: pass every event on at once
]


def _log(what: str, /, **fields: object) -> None:
    log.info("%s %s", what, kv(fields), extra={"fields": fields})


def _event(body: dict[str, Any], named: bool = False) -> bytes:
    """One server-sent event; ``named``: with an ``event:`` line, its ``type`` (``error``)."""
    data = b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    if not named:
        return data
    return f"event: {body.get('type', 'error')}\n".encode() + data


class _Tagged:
    """A ``DeltaSink`` for choice ``index``: its deltas go to the shared events channel."""

    def __init__(self, out: trio.MemorySendChannel[Event], index: int) -> None:
        self.out = out
        self.index = index

    async def send(self, delta: Delta, /) -> None:
        await self.out.send((self.index, delta))


class GenerationResponse:
    """``await response(scope, receive, send)``: see the module docstring. ``requests``: one
    generation per choice (several prompts: each its own, run at once)."""

    def __init__(
        self, backend: Backend, requests: Sequence[Request], reply: Reply, *, stream: bool,
        endpoint: str, metrics: ApiMetrics, started: float, principal: str | None = None,
        user: str | None = None, limits: Limits = DEFAULT_LIMITS, slots: KeySlots | None = None,
        queue: WaitQueue | None = None,
    ) -> None:
        self.backend = backend
        self.requests = list(requests)
        self.reply = reply
        self.stream = stream
        self.endpoint = endpoint
        self.metrics = metrics
        self.started = started
        self.principal = principal
        self.user = user
        self.send_timeout = limits.send_timeout
        self.keepalive = limits.keepalive  # None: no comments
        self.slots = slots if slots is not None else KeySlots(None)
        self.queue = queue
        self.status = 0
        self._first_at: float | None = None
        #: Set before the last bytes are sent: the client may disconnect (and cancel this
        #: response's tasks) as soon as it has them.
        self._outcome: Outcome | None = None
        self._complete = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            slot = self.slots.take(self.principal)
        except ApiError as err:  # the key runs its most already: nothing started
            await self._error(err, scope, receive, send)
            self._account(None)
            return
        with slot:
            await self._run(scope, receive, send)

    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.metrics.in_flight.inc()
        try:
            events_in, events = trio.open_memory_channel[Event](DELTA_BUFFER)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, receive, nursery.cancel_scope)
                nursery.start_soon(self._generate, events_in)

                async def bounded_send(message: MutableMapping[str, Any]) -> None:
                    with trio.move_on_after(self.send_timeout) as waited:
                        await send(message)
                    if waited.cancelled_caught:
                        _log("client not reading, generation cancelled", endpoint=self.endpoint,
                             id=self.reply.id, waited_s=self.send_timeout)
                        self.status = 499
                        nursery.cancel_scope.cancel()
                        await trio.lowlevel.checkpoint()

                await self._respond(events, scope, receive, bounded_send)
                nursery.cancel_scope.cancel()
        finally:
            self.metrics.in_flight.dec()
            self._account(self._outcome)

    async def _watch_disconnect(self, receive: Receive, scope: trio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if self._complete:
                    return  # the whole response was handed over: the client may leave
                _log("client disconnected, generation cancelled",
                     endpoint=self.endpoint, id=self.reply.id)
                self.status = 499  # nginx's "client closed request"
                scope.cancel()
                return

    async def _generate(self, out: trio.MemorySendChannel[Event]) -> None:
        """Every choice's generation at once; the first to fail cancels the others and is the
        answer."""
        outcomes: list[Outcome | None] = [None] * len(self.requests)
        failed: list[ApiError] = []

        async def one(index: int, request: Request, scope: trio.CancelScope) -> None:
            try:
                outcomes[index] = await self.backend.generate(
                    request, _Tagged(out, index), queue=self.queue)
            except ApiError as err:
                failed.append(err)
                scope.cancel()
            except Exception:
                log.exception("generation failed", extra={"fields": {"id": self.reply.id}})
                failed.append(ApiError(500, "internal error in the front door",
                                       type="server_error", code="internal_error"))
                scope.cancel()

        async with out:
            async with trio.open_nursery() as nursery:
                for index, request in enumerate(self.requests):
                    nursery.start_soon(one, index, request, nursery.cancel_scope)
            await out.send(failed[0] if failed else [o for o in outcomes if o is not None])

    async def _next(self, events: trio.MemoryReceiveChannel[Event]) -> Event:
        event = await events.receive()
        if isinstance(event, tuple) and self._first_at is None:
            self._first_at = trio.current_time()
            self.metrics.time_to_first_token.labels(self.endpoint).observe(
                self._first_at - self.started)
        return event

    async def _next_or_silence(self, events: trio.MemoryReceiveChannel[Event]) -> Event | None:
        """The next event, or None after ``keepalive`` seconds without one (a stream only)."""
        if self.keepalive is None:
            return await self._next(events)
        with trio.move_on_after(self.keepalive):
            return await self._next(events)  # a cancelled receive loses no event
        return None

    async def _respond(
        self, events: trio.MemoryReceiveChannel[Event], scope: Scope, receive: Receive, send: Send
    ) -> None:
        if not self.stream:
            await self._respond_whole(events, scope, receive, send)
            return
        event = await self._next_or_silence(events)
        if isinstance(event, ApiError):  # nothing sent yet: a plain HTTP error
            await self._error(event, scope, receive, send)
            return
        self.status = 200
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        named = self.reply.sse_event_names
        opening = b"".join(_event(c, named) for c in self.reply.opening_chunks())
        if opening:
            await send({"type": "http.response.body", "body": opening, "more_body": True})
        while event is None or isinstance(event, tuple):
            chunk = _KEEPALIVE if event is None else self.reply.chunk(event[1], event[0])
            if chunk is not None:
                body = chunk if isinstance(chunk, bytes) else _event(chunk, named)
                await send({"type": "http.response.body", "body": body, "more_body": True})
            event = await self._next_or_silence(events)
        if isinstance(event, ApiError):
            self.status = event.status
            _log("generation failed mid-stream", endpoint=self.endpoint, id=self.reply.id,
                 status=event.status, code=event.code, message=event.detail or event.message)
            tail = _event(event.body(), named)
        else:
            tail = b"".join(_event(c, named) for c in self.reply.final_chunks(event))
            self._outcome = Outcome.total(event)
        self._complete = True
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n"})

    async def _respond_whole(
        self, events: trio.MemoryReceiveChannel[Event], scope: Scope, receive: Receive, send: Send
    ) -> None:
        event = await self._next(events)
        deltas: list[list[Delta]] = [[] for _ in self.requests]
        while isinstance(event, tuple):
            deltas[event[0]].append(event[1])
            event = await self._next(events)
        if isinstance(event, ApiError):
            await self._error(event, scope, receive, send)
            return
        self.status, self._outcome, self._complete = 200, Outcome.total(event), True
        body = json.dumps(self.reply.body(deltas, event), ensure_ascii=False).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _error(self, err: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
        self.status, self._complete = err.status, True
        _log("generation refused", endpoint=self.endpoint, id=self.reply.id, status=err.status,
             code=err.code, message=err.detail or err.message)
        await err.response()(scope, receive, send)

    def _account(self, outcome: Outcome | None) -> None:
        m, now = self.metrics, trio.current_time()
        m.requests.labels(self.endpoint, str(self.status or 499)).inc()
        if outcome is None:
            return
        m.prompt_tokens.inc(outcome.prompt_tokens)
        m.cached_tokens.inc(outcome.cached_tokens)
        m.completion_tokens.inc(outcome.completion_tokens)
        if self._first_at is not None and outcome.completion_tokens > 1 and now > self._first_at:
            m.tokens_per_second.labels(self.endpoint).observe(
                (outcome.completion_tokens - 1) / (now - self._first_at))
        _log("generation done", endpoint=self.endpoint, id=self.reply.id, status=self.status,
             principal=self.principal, user=self.user, prompt_tokens=outcome.prompt_tokens,
             cached_tokens=outcome.cached_tokens,
             completion_tokens=outcome.completion_tokens, finish_reason=outcome.finish_reason,
             ttft_ms=None if self._first_at is None else round((self._first_at - self.started) * 1e3, 1))
