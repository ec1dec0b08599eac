"""One generation as an ASGI response: run it while the client is connected, answer with the
whole body or with server-sent events.

Why an ASGI callable of its own rather than a streaming response over an async generator: the
generation, the reader of its deltas and the watch for the client's disconnect are three tasks
of one nursery that this response owns, so a disconnect cancels the generation (every hop's
session is reset and released by the pipeline client) and nothing outlives the request. The
deltas pass through a bounded channel: a client that reads slowly slows its own generation.
Every event waiting in that channel when the response writes goes out in one write (one ASGI
send, one socket write): a door that falls behind on a busy machine catches up in fewer,
larger writes instead of paying a write's fixed cost per token.
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
    """A ``DeltaSink`` for one generation whose choices are numbered from ``first``: its
    deltas (each with its choice's ``index`` within the generation) go to the shared events
    channel with their index in the reply."""

    def __init__(self, out: trio.MemorySendChannel[Event | None], first: int) -> None:
        self.out = out
        self.first = first

    async def send(self, delta: Delta, /) -> None:
        await self.out.send((self.first + delta.index, delta))

    def send_nowait(self, delta: Delta, /) -> None:
        self.out.send_nowait((self.first + delta.index, delta))


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
        #: Each generation's first choice index in the reply (a generation returns ``n``).
        self._first_choice = [sum(r.n for r in self.requests[:i]) for i in range(len(self.requests))]
        self._choices = sum(r.n for r in self.requests)
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
        #: When the write in progress began / the wait for the next event began (None: none).
        self._writing_since: float | None = None
        self._waiting_since: float | None = None

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
            events_in, events = trio.open_memory_channel[Event | None](DELTA_BUFFER)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, receive, nursery.cancel_scope)
                nursery.start_soon(self._watch_writes, nursery.cancel_scope)
                if self.stream and self.keepalive is not None:
                    nursery.start_soon(self._keep_alive, events_in.clone())
                nursery.start_soon(self._generate, events_in)

                async def bounded_send(message: MutableMapping[str, Any]) -> None:
                    self._writing_since = trio.current_time()  # (``_watch_writes``)
                    try:
                        await send(message)
                    finally:
                        self._writing_since = None

                await self._respond(events, scope, receive, bounded_send)
                nursery.cancel_scope.cancel()
        finally:
            self.metrics.in_flight.dec()
            self._account(self._outcome)

    # The two clocks of a response are sleeping tasks rather than a timeout around every
    # write and every wait for a token: a cancel scope costs more than the rest of a token's
    # bookkeeping in this module, and it would be paid per token of every stream.

    async def _watch_writes(self, scope: trio.CancelScope) -> None:
        """A write that waits ``send_timeout`` seconds (the client's socket is full: it stopped
        reading) cancels the response; the generation's sessions are released."""
        while True:
            began = self._writing_since
            if began is None:  # no write now: look again a period later at most
                await trio.sleep(self.send_timeout)
                continue
            await trio.sleep_until(began + self.send_timeout)
            if self._writing_since == began:  # the same write, still waiting
                _log("client not reading, generation cancelled", endpoint=self.endpoint,
                     id=self.reply.id, waited_s=self.send_timeout)
                self.status = 499
                scope.cancel()
                return

    async def _keep_alive(self, pulse: trio.MemorySendChannel[Event | None]) -> None:
        """While the response has waited ``keepalive`` seconds for an event, a None (a
        comment to send) into its channel, again every ``keepalive`` seconds of waiting."""
        assert self.keepalive is not None
        async with pulse:
            while True:
                since = self._waiting_since
                if since is None:  # the response is busy: look again a period later at most
                    await trio.sleep(self.keepalive)
                elif trio.current_time() < since + self.keepalive:
                    await trio.sleep_until(since + self.keepalive)
                else:
                    self._waiting_since = trio.current_time()  # the next one a period later
                    try:
                        pulse.send_nowait(None)
                    except trio.WouldBlock:  # events wait to be read: no silence to fill
                        pass

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

    async def _generate(self, out: trio.MemorySendChannel[Event | None]) -> None:
        """Every choice's generation at once; the first to fail cancels the others and is the
        answer."""
        outcomes: list[Outcome | None] = [None] * len(self.requests)
        failed: list[ApiError] = []

        async def one(index: int, request: Request, scope: trio.CancelScope) -> None:
            try:
                outcomes[index] = await self.backend.generate(
                    request, _Tagged(out, self._first_choice[index]), queue=self.queue)
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

    async def _next(self, events: trio.MemoryReceiveChannel[Event | None]) -> Event | None:
        """The next event; None: ``keepalive`` seconds passed without one (a stream only)."""
        self._waiting_since = trio.current_time()
        try:
            event = await events.receive()
        finally:
            self._waiting_since = None
        if isinstance(event, tuple) and self._first_at is None:
            self._first_at = trio.current_time()
            self.metrics.time_to_first_token.labels(self.endpoint).observe(
                self._first_at - self.started)
        return event

    def _buffered(self, events: trio.MemoryReceiveChannel[Event | None]) -> Event | None:
        """The next event if the generation already sent it, None otherwise (no wait; a
        keep-alive waiting there is dropped, since events are flowing; a channel closed without
        its end means the response is being cancelled, which the next checkpoint raises)."""
        try:
            return events.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return None

    async def _respond(
        self, events: trio.MemoryReceiveChannel[Event | None], scope: Scope, receive: Receive,
        send: Send,
    ) -> None:
        if not self.stream:
            await self._respond_whole(events, scope, receive, send)
            return
        event = await self._next(events)
        if isinstance(event, ApiError):  # nothing sent yet: a plain HTTP error
            await self._error(event, scope, receive, send)
            return
        self.status = 200
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        named = self.reply.sse_event_names
        parts: list[bytes] = [_event(c, named) for c in self.reply.opening_chunks()]
        while event is None or isinstance(event, tuple):
            if event is None:
                parts.append(_KEEPALIVE)
            # Every delta already buffered goes out in this write: a door behind its
            # generations (many streams on few cores) pays one send for several tokens.
            while isinstance(event, tuple):
                parts.extend(_event(c, named) for c in self.reply.chunks(event[1], event[0]))
                event = self._buffered(events)
            if event is not None:
                break  # the end is buffered too: it goes out with these
            if parts:
                await send({"type": "http.response.body", "body": b"".join(parts),
                            "more_body": True})
                parts.clear()
            event = await self._next(events)
        if isinstance(event, ApiError):
            self.status = event.status
            _log("generation failed mid-stream", endpoint=self.endpoint, id=self.reply.id,
                 status=event.status, code=event.code, message=event.detail or event.message)
            parts.append(_event(event.body(), named))
        else:
            parts.extend(_event(c, named) for c in self.reply.final_chunks(event))
            self._outcome = Outcome.total(event)
        self._complete = True
        parts.append(b"data: [DONE]\n\n")
        await send({"type": "http.response.body", "body": b"".join(parts)})

    async def _respond_whole(
        self, events: trio.MemoryReceiveChannel[Event | None], scope: Scope, receive: Receive,
        send: Send,
    ) -> None:
        event = await self._next(events)
        deltas: list[list[Delta]] = [[] for _ in range(self._choices)]
        while isinstance(event, tuple):
            deltas[event[0]].append(event[1])
            event = await self._next(events)
        assert event is not None  # (no keep-alive comments in a whole body)
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
