"""Honest busy clients are never cut by the frame budgets (issue 43).

A gRPC client sends control frames in step with the traffic it is sent: grpc-core a
WINDOW_UPDATE as it consumes DATA (0.45-0.73 per DATA frame measured), BDP PINGs with bursts of
data, keepalive PINGs. A fixed per-second budget cut exactly the busiest clients: 16 grpcio
generations on one channel got GOAWAY(ENHANCE_YOUR_CALM) within two seconds, every stream
UNAVAILABLE. Here 32 generations on one connection (20,480 tokens in all) through each client a
worker meets: the official grpcio client with keepalive and BDP probing on, ``ShardClient``,
and the front door (``trio-shard api``); every stream completes and no connection is cut.

Counts only, never timing: the fake engine is batched and instant, so the token rate is what
the event loop allows (the test is heavier than most; it still runs in seconds).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import grpc
import trio

from bench.worker.busy_client import KEEPALIVE, generation, session_method
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import MODEL, V, Worker, worker
from shard.api import Backend, build_app, serve_http
from shard.client import ShardClient
from shard.engine import LoadSpec
from shard.engine.fake import FakeEngine, FakeScript

STREAMS, TOKENS = 32, 640  # 20,480 tokens on one connection
# grpcio reads as the tracker did (16 more messages every 16 tokens), with keepalive
# PINGs every second allowed without data and BDP probing: bench.worker.busy_client's reader.


@asynccontextmanager
async def busy_worker() -> AsyncIterator[Worker]:
    engine = FakeEngine(model=MODEL, script=FakeScript(batched=True))
    spec = LoadSpec(n_ctx=STREAMS * 1024, max_sessions=STREAMS, max_batch_sessions=STREAMS)
    async with worker(engine=engine, load=spec) as w:
        yield w


def assert_never_cut(w: Worker) -> None:
    transport = w.server.transport
    assert not transport.cuts, dict(transport.cuts)


async def test_grpcio_32_generations_on_one_channel_with_keepalive_are_never_cut() -> None:
    async with busy_worker() as w:
        with grpc.insecure_channel(w.target, options=KEEPALIVE) as channel:
            results: list[tuple[int, str | None]] = []
            session = session_method(channel)

            async def one(i: int) -> None:
                results.append(await trio.to_thread.run_sync(
                    generation, session, f"busy-{i}", V, TOKENS))

            async with trio.open_nursery() as nursery:
                for i in range(STREAMS):
                    nursery.start_soon(one, i)
        assert [r for r in results if r != (TOKENS, None)] == []
        assert sum(n for n, _ in results) >= 20_000
        assert_never_cut(w)


async def test_shard_client_32_generations_on_one_connection_are_never_cut() -> None:
    async with busy_worker() as w, ShardClient.connect(w.target, timeout=60) as client:
        counts: list[int] = []

        async def one() -> None:
            n = 0
            async for _ in client.generate([1, 2, 3], max_tokens=TOKENS, ignore_eos=True):
                n += 1
            counts.append(n)

        async with trio.open_nursery() as nursery:
            for _ in range(STREAMS):
                nursery.start_soon(one)
        assert counts == [TOKENS] * STREAMS
        assert_never_cut(w)


def _streamed_completion(url: str, i: int) -> int:
    """One streamed /v1/completions through the front door: the tokens it generated."""
    body = json.dumps({"model": "busy", "prompt": [1, 2, 3 + i], "max_tokens": TOKENS,
                       "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                     headers={"content-type": "application/json"})
    finish, usage = None, None
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or ():
                finish = choice.get("finish_reason") or finish
            usage = event.get("usage") or usage
    assert finish == "length" and usage is not None, (finish, usage)
    return int(usage["completion_tokens"])


async def test_the_front_door_32_streamed_generations_are_never_cut() -> None:
    async with busy_worker() as w, Backend.connect(
            [[w.target]], model_id="busy", timeout=120) as backend:
        app = build_app(backend)
        async with trio.open_nursery() as nursery:
            shutdown = trio.Event()
            binds = await nursery.start(partial(serve_http, app, host="127.0.0.1", port=0,
                                                shutdown=shutdown, grace=1.0))
            tokens: list[int] = []

            async def one(i: int) -> None:
                tokens.append(await trio.to_thread.run_sync(_streamed_completion, binds[0], i))

            async with trio.open_nursery() as clients:
                for i in range(STREAMS):
                    clients.start_soon(one, i)
            shutdown.set()
        assert tokens == [TOKENS] * STREAMS
        assert_never_cut(w)
