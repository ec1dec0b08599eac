"""The door's wait for a free session (``shard.api.queue``): a request that finds a model's
sessions all taken waits its turn and is served when one frees; past the queue's length or its
timeout it gets 429 with Retry-After; a client that leaves while queued leaves no waiter; a
worker's refusal for sessions held by another client is tried again. And the door started
before its worker waits for it (``--connect-timeout``).

Workers are FakeEngine workers whose steps a ``StepGate`` holds, so "all sessions taken" is a
state the test sets up, never a race; /metrics shows the queue's depth, waits and refusals.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing
from rpc_harness import (
    StepGate,
    in_thread,
    no_engine_leaks,  # noqa: F401 - autouse: no sessions/KV cells leak
    worker,
)
from test_api import MODEL, NAME, SHAPES, FrontDoor, front_door, get, post
from test_api import _sessions as worker_sessions
from test_pipeline import TIMEOUT, assert_all_free
from test_pool import A, Listed, fleet, pool_of

from shard.api import Backend, Catalog, Limits, build_app, serve_http
from shard.api.queue import WaitQueue
from shard.engine import LayerRange, LoadSpec
from shard.engine.fake import FakeEngine, FakeScript
from shard.pipeline import Pipeline

BODY = {"model": NAME, "prompt": "hello", "max_tokens": 4}


def metric(page: bytes, name: str, **labels: str) -> float:
    """One sample of the /metrics page (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    sample = f"{name}{{{want}}}" if labels else name
    found = re.search(rb"^trio_shard_api_" + re.escape(sample.encode()) + rb" (\S+)$", page, re.M)
    return float(found.group(1)) if found else 0.0


async def page(url: str) -> bytes:
    return (await in_thread(lambda: get(url + "/metrics")))[1]


async def until_depth(url: str, depth: int, model: str = NAME) -> None:
    with trio.fail_after(20):
        while metric(await page(url), "queue_depth", model=model) != depth:
            await trio.sleep(0.02)


def call(url: str, body: dict[str, Any], stream: bool) -> tuple[int, dict[str, str], Any]:
    """One request (streamed: the events' text joined), as (status, headers, body)."""
    if not stream:
        return post(url + "/v1/completions", body)
    import urllib.error
    import urllib.request
    req = urllib.request.Request(url + "/v1/completions", method="POST",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
            events = [x for x in resp.read().split(b"\n\n") if x.startswith(b"data: {")]
            text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events
                           if json.loads(e[6:]).get("choices"))
            return resp.status, {}, {"text": text}
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, json.loads(err.read())


async def burst(url: str, n: int, *, into: list[tuple[int, dict[str, str], Any]],
                nursery: trio.Nursery) -> None:
    """Start ``n`` requests, every other one streamed, each its own connection."""
    for i in range(n):
        async def one(i: int = i) -> None:
            into.append(await in_thread(partial(call, url, {**BODY, "seed": i}, i % 2 == 1)))
        nursery.start_soon(one)


# ---- queued, served in turn ----------------------------------------------------------------


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_thirty_two_requests_on_four_sessions_all_complete(shape: str) -> None:
    ranges, relay = SHAPES[shape]
    gate = StepGate()
    async with front_door(ranges, relay=relay, max_sessions=4,
                          script=FakeScript(on_step=gate)) as door:
        gate.hold()
        got: list[Any] = []
        async with trio.open_nursery() as nursery:
            await burst(door.url, 32, into=got, nursery=nursery)
            await until_depth(door.url, 28)  # 4 sessions run (held), the others wait in line
            assert await _sessions(door) == 4
            gate.release()
        assert [s for s, _, _ in got] == [200] * 32, [b for s, _, b in got if s != 200]
        assert all(b.get("text") or b.get("choices") for _, _, b in got)
        text = await page(door.url)
        assert metric(text, "queue_depth", model=NAME) == 0
        assert metric(text, "queue_wait_seconds_count", model=NAME) == 32
        assert metric(text, "queue_refused_total", model=NAME, reason="full") == 0
        assert metric(text, "requests_total", endpoint="completions", status="200") == 32
        await assert_all_free(door.workers)


async def test_a_pool_queues_over_its_replicas_sessions() -> None:
    layout = {"w1": (A, LayerRange(0, 4), "a"), "w2": (A, LayerRange(0, 4), "a")}
    async with fleet(layout, max_sessions=2) as f, pool_of(Listed(f.targets("w1", "w2"))) as pool, \
            trio.open_nursery() as nursery:
        assert pool.capacity("a") == 4
        shutdown = trio.Event()
        app = build_app(Catalog(pool=pool, timeout=TIMEOUT))
        url = (await nursery.start(partial(serve_http, app, host="127.0.0.1", port=0,
                                           shutdown=shutdown, grace=1.0)))[0]
        for gate in f.gates.values():
            gate.hold()
        got: list[Any] = []
        async with trio.open_nursery() as requests:
            for i in range(12):
                requests.start_soon(lambda i=i: _append(got, in_thread(partial(
                    call, url, {**BODY, "model": "a", "seed": i}, i % 2 == 1))))
            await until_depth(url, 8, model="a")
            for gate in f.gates.values():
                gate.release()
        assert [s for s, _, _ in got] == [200] * 12, got
        assert metric(await page(url), "queue_depth", model="a") == 0
        assert all(m.sessions == 0 for m in pool.members.values())
        shutdown.set()
        await assert_all_free(list(f.workers.values()))


@pytest.mark.parametrize("sizes", [(2, 2), (1, 3)])
async def test_a_requests_choices_are_bounded_by_one_route_of_a_pool(
        sizes: tuple[int, int]) -> None:
    """Two whole-model workers (two routes) of ``sizes`` sessions: the pool runs 4
    generations at once, but one request's choices all run on one route, so more choices than
    the largest route's sessions are a 400 naming ``n`` (or ``best_of``), and as many run,
    each time on a route that has them (never on the smaller, whatever the turn)."""
    largest = max(sizes)
    async with fleet({"w1": (A, LayerRange(0, 4), "a")}, max_sessions=sizes[0]) as one, \
            fleet({"w2": (A, LayerRange(0, 4), "a")}, max_sessions=sizes[1]) as two, \
            pool_of(Listed([one.target("w1"), two.target("w2")])) as pool, \
            trio.open_nursery() as nursery:
        assert pool.capacity("a") == 4 and pool.route_capacity("a") == largest
        shutdown = trio.Event()
        app = build_app(Catalog(pool=pool, timeout=TIMEOUT))
        url = (await nursery.start(partial(serve_http, app, host="127.0.0.1", port=0,
                                           shutdown=shutdown, grace=1.0)))[0]
        body = {"model": "a", "prompt": "hello", "max_tokens": 3, "temperature": 0}
        for extra, param in (({"n": largest + 1}, "n"), ({"best_of": largest + 1}, "best_of")):
            status, _, got = await in_thread(lambda: post(url + "/v1/completions",
                                                          {**body, **extra}))
            assert (status, got["error"]["param"]) == (400, param), got
            assert f"largest route has {largest}" in got["error"]["message"]
        for _ in range(4):  # (ties between the routes are taken in turn)
            status, _, got = await in_thread(lambda: post(url + "/v1/completions",
                                                          {**body, "n": largest}))
            assert status == 200 and len(got["choices"]) == largest, got
        smaller = [w for f, size in ((one, sizes[0]), (two, sizes[1])) if size < largest
                   for w in f.workers.values()]
        assert all(not w.calls for w in smaller)  # (not even tried and refused)
        assert all(m.sessions == 0 for m in pool.members.values())
        shutdown.set()
        await assert_all_free([*one.workers.values(), *two.workers.values()])


async def test_waiters_are_served_in_order_of_arrival() -> None:
    """FIFO, and the door's own count: with one session, each request runs only once the one
    before it ended, in the order they came, and a newcomer never jumps the line."""
    queue = WaitQueue("m", lambda: 1, length=8, timeout=10)
    order: list[int] = []
    ends = [trio.Event() for _ in range(4)]

    async def one(i: int) -> None:
        async def attempt() -> None:
            order.append(i)
            await ends[i].wait()
        await queue.run(attempt)

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(one, i)
            await trio.testing.wait_all_tasks_blocked()
        assert order == [0] and queue.depth == 3 and queue.running == 1
        for i in range(4):
            ends[i].set()
            await trio.testing.wait_all_tasks_blocked()
            assert order == list(range(min(i + 2, 4)))
    assert queue.depth == 0 and queue.running == 0


# ---- past the bounds -----------------------------------------------------------------------


async def test_a_full_queue_answers_429_with_retry_after_and_the_queued_are_served() -> None:
    gate = StepGate()
    async with front_door(max_sessions=1, script=FakeScript(on_step=gate),
                          limits=Limits(queue_length=2)) as door:
        gate.hold()
        got: list[Any] = []
        async with trio.open_nursery() as nursery:
            await burst(door.url, 3, into=got, nursery=nursery)
            await until_depth(door.url, 2)
            for stream in (False, True):
                status, headers, body = await in_thread(partial(call, door.url, BODY, stream))
                assert status == 429 and headers["retry-after"] == "1", body
                assert body["error"]["code"] == "rate_limit_exceeded"
                assert "2 requests wait already" in body["error"]["message"]
            gate.release()
        assert [s for s, _, _ in got] == [200] * 3
        text = await page(door.url)
        assert metric(text, "queue_refused_total", model=NAME, reason="full") == 2
        assert metric(text, "queue_depth", model=NAME) == 0
        await assert_all_free(door.workers)


async def test_a_request_that_waits_past_the_timeout_gets_429() -> None:
    gate = StepGate()
    async with front_door(max_sessions=1, script=FakeScript(on_step=gate),
                          limits=Limits(queue_timeout=0.3)) as door:
        gate.hold()
        got: list[Any] = []
        async with trio.open_nursery() as nursery:
            await burst(door.url, 1, into=got, nursery=nursery)
            with trio.fail_after(10):
                while await _sessions(door) == 0:
                    await trio.sleep(0.01)
            status, headers, body = await in_thread(partial(call, door.url, BODY, False))
            assert status == 429 and headers["retry-after"] == "1", body
            assert "none came free within 0.3 s" in body["error"]["message"]
            gate.release()
        assert got[0][0] == 200
        text = await page(door.url)
        assert metric(text, "queue_refused_total", model=NAME, reason="timeout") == 1
        assert metric(text, "queue_wait_seconds_count", model=NAME) == 2
        assert metric(text, "queue_wait_seconds_sum", model=NAME) >= 0.3
        await assert_all_free(door.workers)


# ---- leaving the line ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_disconnects_while_queued_leaves_no_waiter(stream: bool) -> None:
    gate = StepGate()
    async with front_door(max_sessions=1, script=FakeScript(on_step=gate)) as door:
        gate.hold()
        got: list[Any] = []
        async with trio.open_nursery() as nursery:
            await burst(door.url, 1, into=got, nursery=nursery)
            host, port = door.url.removeprefix("http://").rsplit(":", 1)
            queued = [await _raw_request(host, int(port), {**BODY, "stream": stream})
                      for _ in range(3)]
            await until_depth(door.url, 3)
            for conn in queued:
                await conn.aclose()
            await until_depth(door.url, 0)
            gate.release()
        assert got[0][0] == 200
        status, _, _ = await in_thread(partial(call, door.url, BODY, stream))
        assert status == 200  # the line holds no ghost: the next request runs at once
        text = await page(door.url)
        assert metric(text, "requests_total", endpoint="completions", status="499") == 3
        await assert_all_free(door.workers)


async def _raw_request(host: str, port: int, body: dict[str, Any]) -> trio.SocketStream:
    """A POST sent on a connection the test closes itself (a client that leaves)."""
    data = json.dumps(body).encode()
    conn = await trio.open_tcp_stream(host, port)
    await conn.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                        b"content-type: application/json\r\n"
                        + f"content-length: {len(data)}\r\n\r\n".encode() + data)
    return conn


# ---- sessions taken by another client of the worker ------------------------------------------


async def test_a_refusal_for_sessions_held_elsewhere_is_retried_until_one_frees() -> None:
    """The door counts its own generations only: a session held by another client of the
    worker makes the worker refuse; the request keeps its place and is tried again."""
    async with front_door(max_sessions=1) as door:
        release = trio.Event()
        holding = trio.Event()

        async def on_token(step: Any) -> None:
            holding.set()
            await release.wait()

        async with Pipeline.connect([door.workers[0].target], timeout=TIMEOUT) as other, \
                trio.open_nursery() as nursery:
            nursery.start_soon(partial(other.generate, "x", max_tokens=2, on_token=on_token))
            await holding.wait()
            got: list[Any] = []
            await burst(door.url, 1, into=got, nursery=nursery)
            with trio.fail_after(10):
                while metric(await page(door.url), "requests_in_flight") != 1:
                    await trio.sleep(0.01)
            await trio.sleep(0.3)  # refused, and tried again, meanwhile
            assert not got
            release.set()
        assert got[0][0] == 200
        text = await page(door.url)
        assert metric(text, "queue_wait_seconds_sum", model=NAME) >= 0.3  # its last try: after
        assert metric(text, "queue_refused_total", model=NAME, reason="timeout") == 0
        await assert_all_free(door.workers)


# ---- the door started before its worker ------------------------------------------------------


async def test_a_door_started_before_its_worker_waits_for_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """Nothing listens on the worker's port when the door starts: it tries again until the
    worker is up (within ``connect_timeout``), then serves."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    target = f"127.0.0.1:{port}"
    caplog.set_level("INFO", logger="shard.api.backend")
    connected: list[Backend] = []

    async def door() -> None:
        async with Backend.connect([[target]], model_id=NAME, timeout=TIMEOUT,
                                   connect_timeout=30) as backend:
            connected.append(backend)
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(door)
        with trio.fail_after(10):
            while "waiting up to 30s for the workers" not in caplog.text:
                await trio.sleep(0.02)
        await trio.sleep(0.5)  # the door keeps trying
        assert not connected
        engine = FakeEngine(model=MODEL, script=FakeScript())
        async with worker(engine=engine, load=LoadSpec(n_ctx=1024, max_sessions=2),
                          port=port) as w:
            with trio.fail_after(20):
                while not connected:
                    await trio.sleep(0.02)
            async with _serving(connected[0]) as url:
                status, _, body = await in_thread(lambda: post(url + "/v1/completions", BODY))
            assert status == 200, body
            await assert_all_free([w])
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def _serving(backend: Backend) -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        shutdown = trio.Event()
        url = (await nursery.start(partial(serve_http, build_app(backend), host="127.0.0.1",
                                           port=0, shutdown=shutdown, grace=1.0)))[0]
        yield url
        shutdown.set()


async def _sessions(door: FrontDoor) -> int:
    return await worker_sessions(door.workers[0])


async def _append(into: list[Any], result: Any) -> None:
    into.append(await result)
