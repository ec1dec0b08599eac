"""``trio-shard`` with the door's path to each generation's first token stamped by stage.

    python -m bench.api.door_trace [shard.cli arguments, e.g. --log-level INFO api --target ...]

Runs ``shard.cli.main`` after wrapping the functions each stage ends in (no change to the
door's code, so nothing of it runs in production), and logs one line per generation::

    door trace stages_ms={"render": 0.21, "generate": 0.35, ...}

Each value is milliseconds from the request's arrival at the door's handler
(``GenerationResponse.started``) to the end of the stage, except ``render`` (the chat template's
own duration, before that point). Stages, in order:

* ``render``: ``Backend.render_chat`` (duration);
* ``generate``: the response's generation task started ``Backend.generate`` (after the
  ASGI response began: the handler returned, hypercorn called it);
* ``pipeline``: a route was leased and ``Pipeline.generate`` entered (the wait queue's turn);
* ``open_sent`` / ``opened``: ``OpenSession`` written / ``SessionOpened`` read (a session
  opened ahead, ``ShardClient.open_session(ahead=True)``, reads it after ``prefill_sent``);
* ``prefill_sent``: the prompt's first ``Prefill`` written;
* ``first_step``: its result (the first token) read back;
* ``prefilled``: the prompt's request ended (its ``Usage`` read);
* ``token``: the door's ``on_token`` took the first token;
* ``delta``: the response read the first text delta from its channel;
* ``written``: the first event's bytes handed to hypercorn (``send`` returned).

The stamps ride a context variable: trio hands a task's context to the tasks it starts, so
the response's tasks and the client calls they make see the stamps of their own request.
"""

from __future__ import annotations

import contextvars
import functools
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

import trio

log = logging.getLogger("bench.door_trace")

_STAMPS: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar(
    "door_trace", default=None)
_RENDER: contextvars.ContextVar[float | None] = contextvars.ContextVar("door_render", default=None)


def _mark(stage: str) -> None:
    stamps = _STAMPS.get()
    if stamps is not None and stage not in stamps:
        stamps[stage] = trio.current_time()


def _stamp_after(cls: Any, name: str, stage: str, before: str | None = None) -> None:
    """Wrap the coroutine method ``cls.name`` to mark ``before`` as it starts and ``stage``
    when it returns."""
    orig = getattr(cls, name)

    @functools.wraps(orig)
    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            _mark(before)
        out = await orig(*args, **kwargs)
        _mark(stage)
        return out

    setattr(cls, name, wrapped)


def install() -> None:
    """Wrap the door's stages (see the module docstring)."""
    from shard.api.backend import Backend
    from shard.api.streaming import GenerationResponse
    from shard.client.session import ClientSession
    from shard.api.text import TextAssembler
    from shard.pipeline import Pipeline
    from shard.pipeline.runner import HopRunner

    render = Backend.render_chat

    @functools.wraps(render)
    def render_chat(self: Backend, messages: Any, **kwargs: Any) -> str:
        t0 = trio.current_time()
        out = render(self, messages, **kwargs)
        _RENDER.set(trio.current_time() - t0)
        return out

    Backend.render_chat = render_chat  # type: ignore[method-assign]

    run = GenerationResponse._run

    @functools.wraps(run)
    async def traced_run(self: GenerationResponse, scope: Any, receive: Any,
                         send: Callable[..., Any]) -> None:
        stamps: dict[str, float] = {}
        _STAMPS.set(stamps)

        async def timed_send(message: Any) -> None:
            await send(message)
            if message.get("type") == "http.response.body":
                _mark("written")

        try:
            await run(self, scope, receive, timed_send)
        finally:
            rendered = _RENDER.get()
            out = {k: round((t - self.started) * 1e3, 3)
                   for k, t in sorted(stamps.items(), key=lambda kv: kv[1])}
            if rendered is not None:
                out = {"render": round(rendered * 1e3, 3), **out}
            log.info("door trace stages_ms=%s", json.dumps(out))

    GenerationResponse._run = traced_run  # type: ignore[method-assign]

    nxt = GenerationResponse._next

    @functools.wraps(nxt)
    async def traced_next(self: GenerationResponse, events: Any) -> Any:
        event = await nxt(self, events)
        if self._first_at is not None:
            _mark("delta")
        return event

    GenerationResponse._next = traced_next  # type: ignore[method-assign]
    _stamp_after(Backend, "generate", "done", before="generate")
    _stamp_after(Pipeline, "generate", "pipeline_done", before="pipeline")
    _stamp_after(HopRunner, "prefill_prompt", "prefilled")

    push = TextAssembler.push

    @functools.wraps(push)
    def traced_push(self: TextAssembler, token: Any) -> Any:
        _mark("token")
        return push(self, token)

    TextAssembler.push = traced_push  # type: ignore[method-assign]

    open_ = ClientSession._open

    @functools.wraps(open_)
    async def traced_open(self: ClientSession, open_msg: Any) -> None:
        send = self._send

        async def sent(req: Any) -> None:
            await send(req)
            _mark("open_sent")

        self._send = sent  # type: ignore[method-assign]
        try:
            await open_(self, open_msg)
        finally:
            del self._send
        _mark("opened")

    ClientSession._open = traced_open  # type: ignore[method-assign]

    ahead = ClientSession._open_ahead

    @functools.wraps(ahead)
    async def traced_ahead(self: ClientSession, open_msg: Any) -> None:
        await ahead(self, open_msg)
        _mark("open_sent")

    ClientSession._open_ahead = traced_ahead  # type: ignore[method-assign]

    read_opened = ClientSession._read_opened

    @functools.wraps(read_opened)
    async def traced_read_opened(self: ClientSession) -> None:
        await read_opened(self)
        _mark("opened")

    ClientSession._read_opened = traced_read_opened  # type: ignore[method-assign]

    begin = ClientSession._begin

    @functools.wraps(begin)
    async def traced_begin(self: ClientSession, req: Any, stream: Any = None) -> int:
        out = await begin(self, req, stream)
        if req.WhichOneof("kind") == "prefill":
            _mark("prefill_sent")
        return out

    ClientSession._begin = traced_begin  # type: ignore[method-assign]

    read = ClientSession._read_result

    @functools.wraps(read)
    async def traced_read(self: ClientSession, serial: int, *, state: bool = False) -> Any:
        out = await read(self, serial, state=state)
        if out is not None:
            _mark("first_step")
        return out

    ClientSession._read_result = traced_read  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    install()
    from shard.cli.main import main as cli_main
    return cli_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())
