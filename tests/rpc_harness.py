"""Shared helpers for the RPC tests (session core, live server, grpcio, client, wire fixtures).

Not a conftest on purpose: the RPC tests import what they use, so the other test modules stay
unaffected. Every engine made here is checked for leaks when its test ends: no sessions and no
KV cells may remain once the server (or registry) that used it has stopped.
"""

from __future__ import annotations

import functools
import math
import os
import queue
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
import trio

from conftest import sigint_default
from shard.engine import LayerRange, LoadSpec, PrefillRequest, ShardEngine, StepResult
from shard.engine.fake import FakeEngine, FakeModel, FakeScript, FakeStep
from shard.rpc.registry import Registry
from shard.rpc.session import SessionCall, SessionLimits
from shard.rpc.versions import current_proto
from shard.v1 import shard_pb2 as pb

V = current_proto()
E = TypeVar("E", bound=ShardEngine)
MODEL = FakeModel(n_layers_total=4, n_embd=8, seed=7)
N_CTX, MAX_SESSIONS = 1024, 4  # 256 positions per session


@dataclass
class StepGate:
    """An ``on_step`` hook: counts engine steps and can hold them until released.

    ``hold()`` makes every later step wait (the test then observes a RUNNING session);
    ``release()`` lets them go. ``after(t)`` counts steps whose hook ran after trio time ``t`` (the
fake calls the hook once a step's latency has passed, just before computing it).
    """

    steps: int = 0
    _open: trio.Event = field(default_factory=trio.Event)
    _held: bool = False
    times: list[float] = field(default_factory=list)
    waiting: int = 0

    def __post_init__(self) -> None:
        self._open.set()

    def hold(self) -> None:
        self._held = True
        self._open = trio.Event()

    def release(self) -> None:
        self._held = False
        self._open.set()

    async def __call__(self, step: FakeStep | None = None) -> None:
        self.steps += 1
        self.times.append(trio.current_time())
        if self._held:
            self.waiting += 1
            try:
                await self._open.wait()
            finally:
                self.waiting -= 1

    def after(self, t: float) -> int:
        return sum(1 for x in self.times if x > t)


def make_engine(
    *, latency: float = 0.0, gate: StepGate | None = None, fail_at_step: int | None = None
) -> FakeEngine:
    return FakeEngine(
        model=MODEL,
        script=FakeScript(step_latency=latency, on_step=gate, fail_at_step=fail_at_step),
    )


class PrefillLog(FakeEngine):
    """A FakeEngine that records the positions of every prefill it is asked for, in order:
    one entry per ``Prefill`` step a worker runs (a chunk, or the whole input)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefills: list[int] = []

    async def prefill(self, request: PrefillRequest) -> StepResult:
        rows = request.hidden_states
        self.prefills.append(len(request.tokens) if request.tokens is not None
                             else 0 if rows is None else int(rows.shape[0]))
        return await super().prefill(request)


def assert_no_leaks(engine: ShardEngine) -> None:
    m = engine.metrics()
    assert engine.sessions() == (), f"sessions leaked: {engine.sessions()}"
    assert m.sessions_active == 0
    assert m.kv_cells_used == 0, f"{m.kv_cells_used} KV cells leaked"


_LEAK_REPORTS: list[str] = []  # filled by ``loaded``, checked by the ``no_engine_leaks`` fixture


@asynccontextmanager
async def loaded(
    engine: E,
    *,
    layer_range: LayerRange | None = None,
    check_leaks: bool = True,
    spec: LoadSpec | None = None,
) -> AsyncIterator[E]:
    """Load ``engine`` (with ``spec``, default: the FakeEngine test spec); on exit (after the
    server or registry using it stopped) record whether it still holds sessions or KV cells,
    then close it."""
    if spec is None:
        spec = LoadSpec(n_ctx=N_CTX, max_sessions=MAX_SESSIONS, layer_range=layer_range)
    async with engine:
        await engine.load(spec)
        yield engine
        if check_leaks:
            try:
                assert_no_leaks(engine)
            except AssertionError as exc:
                _LEAK_REPORTS.append(str(exc))


@pytest.fixture(autouse=True)
def no_engine_leaks() -> Iterator[None]:
    """After every RPC test: every engine it loaded ended with 0 sessions and 0 KV cells.

    Import it into a test module to activate it there."""
    del _LEAK_REPORTS[:]
    yield
    leaks, _LEAK_REPORTS[:] = list(_LEAK_REPORTS), []
    assert not leaks, f"engine state leaked: {leaks}"


@asynccontextmanager
async def running_registry(engine: FakeEngine, limits: SessionLimits = SessionLimits()) -> AsyncIterator[Registry]:
    """A session registry without any network, stopped (and everything freed) on exit."""
    async with trio.open_nursery() as nursery:
        registry = await nursery.start(Registry(engine, limits).run)
        yield registry
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def running_server(engine: FakeEngine, **kwargs: Any) -> AsyncIterator[Any]:
    """``serve()`` in a nursery on a free loopback port; stopped on exit (a RunningServer)."""
    from shard.rpc.server import serve

    async with trio.open_nursery() as nursery:
        server = await nursery.start(lambda task_status: serve(engine, task_status=task_status, **kwargs))
        yield server
        nursery.cancel_scope.cancel()


@dataclass
class Worker:
    """A live worker for network tests: its engine, server handle, step gate and streams."""

    engine: Any  # FakeEngine, or any ShardEngine given to ``worker(engine=...)``
    server: Any  # RunningServer
    gate: StepGate
    calls: list[SessionCall]  # every Session stream the worker started, in order
    _scope: trio.CancelScope

    def stop(self) -> None:
        """Stop the server now (as a shutdown would); the test goes on."""
        self._scope.cancel()

    @property
    def target(self) -> str:
        return self.server.target

    async def idle(self) -> None:
        """Wait until no Session stream runs on the worker (bounded, so a bug fails fast)."""
        with trio.fail_after(10):
            await self.server.registry.streams.wait_value(0)

    def call(self, session_id: str) -> SessionCall | None:
        return self.server.registry.live(session_id)

    def last_end(self) -> float:
        """When the worker was told to stop the last stream (deadline, RST, error)."""
        ended_at = self.calls[-1].ended_at
        assert ended_at is not None
        return ended_at


@asynccontextmanager
async def worker(
    *,
    latency: float = 0.0,
    engine: ShardEngine | None = None,
    gate: StepGate | None = None,
    load: LoadSpec | None = None,
    **serve_kwargs: Any,
) -> AsyncIterator[Worker]:
    """A loaded engine (default: a FakeEngine) served on a free port; leak-checked when the
    server has stopped. With ``engine``, pass the ``gate`` its steps call (if any) and the
    ``load`` spec it needs."""
    gate = gate if gate is not None else StepGate()
    engine = engine if engine is not None else make_engine(latency=latency, gate=gate)
    from shard.rpc.server import serve

    server_scope = trio.CancelScope()  # stops the server only, never the test body

    async def run_server(task_status: trio.TaskStatus[Any]) -> None:
        with server_scope:
            await serve(engine, task_status=task_status, **serve_kwargs)

    async with loaded(engine, spec=load), trio.open_nursery() as nursery:
        server = await nursery.start(run_server)
        calls: list[SessionCall] = []
        start_call = server.registry.start_call

        async def recording_start_call(*args: Any, **kwargs: Any) -> SessionCall:
            call = await start_call(*args, **kwargs)
            calls.append(call)
            return call

        server.registry.start_call = recording_start_call
        yield Worker(engine, server, gate, calls, server_scope)
        server_scope.cancel()


@dataclass
class TcpProxy:
    """A loopback TCP proxy in front of a worker: ``cut()`` drops every connection made so far
    (both sides see the socket close, the worker keeps running), new ones still go through."""

    target: str  # where clients connect: the proxy
    _conns: list[tuple[trio.SocketStream, trio.SocketStream]]
    accepted: int = 0

    def cut(self) -> None:
        for pair in self._conns:
            for stream in pair:
                stream.socket.close()
        self._conns.clear()


@asynccontextmanager
async def tcp_proxy(upstream: str) -> AsyncIterator[TcpProxy]:
    """A ``TcpProxy`` to ``upstream`` (HOST:PORT) for the block."""
    host, _, port = upstream.rpartition(":")
    proxy = TcpProxy("", [])

    async def pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
        try:
            while data := await src.receive_some():
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            dst.socket.close()

    async def handle(client: trio.SocketStream) -> None:
        proxy.accepted += 1
        server = await trio.open_tcp_stream(host, int(port))
        proxy._conns.append((client, server))
        async with trio.open_nursery() as pumps:
            pumps.start_soon(pump, client, server)
            pumps.start_soon(pump, server, client)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        proxy.target = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        yield proxy
        nursery.cancel_scope.cancel()


# ---- driving a SessionCall without a network -------------------------------------------------


class StepReader:
    """Reads session responses; subclasses say where they come from (``recv``)."""

    async def recv(self) -> pb.SessionResponse:
        raise NotImplementedError

    async def recv_kind(self, kind: str) -> Any:
        msg = await self.recv()
        assert msg.WhichOneof("kind") == kind, msg
        return getattr(msg, kind)

    async def until_usage(self) -> tuple[list[pb.StepResult], pb.Error | None, pb.Usage]:
        """Responses of one step request: steps, optional error, then usage."""
        steps, error = [], None
        while True:
            msg = await self.recv()
            kind = msg.WhichOneof("kind")
            if kind == "step":
                steps.append(msg.step)
            elif kind == "error":
                error = msg.error
            elif kind == "usage":
                return steps, error, msg.usage
            else:
                raise AssertionError(f"unexpected {msg}")


class Driver(StepReader):
    """Feeds requests to a ``SessionCall`` and reads its responses (no transport)."""

    def __init__(self, call: SessionCall, send: trio.MemorySendChannel[pb.SessionRequest]) -> None:
        self.call = call
        self._send = send

    async def send(self, **kind: Any) -> None:
        await self._send.send(pb.SessionRequest(version=V, **kind))

    async def send_raw(self, req: pb.SessionRequest) -> None:
        await self._send.send(req)

    async def half_close(self) -> None:
        await self._send.aclose()

    async def recv(self) -> pb.SessionResponse:
        return await self.call.responses.receive()

    async def open(self, session_id: str = "s1", **fields: Any) -> pb.SessionOpened:
        await self.send(open=pb.OpenSession(session_id=session_id, **fields))
        return await self.recv_kind("opened")

    async def drain(self) -> list[pb.SessionResponse]:
        """Every remaining response until the call's channel closes."""
        return [msg async for msg in self.call.responses]

    async def finished(self) -> None:
        await self.call.done.wait()


@asynccontextmanager
async def driver(registry: Registry, *, deadline: float = math.inf) -> AsyncIterator[Driver]:
    send, recv = trio.open_memory_channel[pb.SessionRequest](16)
    call = await registry.start_call(recv, deadline=deadline)
    try:
        with trio.fail_after(60):  # a regression fails the test instead of hanging it
            yield Driver(call, send)
    finally:
        send.close()
        if not call.done.is_set():
            from shard.rpc.session import StreamEnd

            call.end(StreamEnd.CLIENT_CANCELLED)
        with trio.CancelScope(shield=True):
            await call.done.wait()
        call.responses.close()


# ---- grpcio helpers (blocking; run them with trio.to_thread.run_sync) ------------------------


class Requests:
    """A grpcio request iterator fed from the test: ``put`` requests, ``end()`` half-closes."""

    _END = object()

    def __init__(self, *initial: pb.SessionRequest) -> None:
        self._q: queue.Queue[Any] = queue.Queue()
        for req in initial:
            self.put(req)

    def put(self, req: pb.SessionRequest) -> None:
        self._q.put(req)

    def end(self) -> None:
        self._q.put(self._END)

    def __iter__(self) -> Iterator[pb.SessionRequest]:
        while True:
            item = self._q.get()
            if item is self._END:
                return
            yield item


class TaskSteps(trio.abc.Instrument):
    """Counts the steps the event loop gives a set of tasks (``tasks``)."""

    def __init__(self) -> None:
        self.tasks: set[trio.lowlevel.Task] = set()
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task in self.tasks:
            self.steps += 1


def req(**kind: Any) -> pb.SessionRequest:
    return pb.SessionRequest(version=V, **kind)


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await trio.to_thread.run_sync(fn, *args)


CLI = [sys.executable, "-m", "shard.cli"]


async def signal_cli(
    args: list[str], ready: Callable[[], bool], sig: int, *, timeout: float = 60,
    stdout: bytearray | None = None,
) -> tuple[int, str]:
    """Run ``trio-shard ARGS``, send it ``sig`` once ``ready()`` holds (polled), and return its
    exit status and stderr; its standard output goes into ``stdout`` if given. The child gets
    the default SIGINT handler (``sigint_default``)."""
    proc = await trio.lowlevel.open_process(
        [*CLI, *args], stdout=subprocess.DEVNULL if stdout is None else subprocess.PIPE,
        stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=sigint_default,
    )
    assert proc.stderr is not None
    err = bytearray()

    async def collect(stream: trio.abc.ReceiveStream, into: bytearray) -> None:
        async with stream:
            while chunk := await stream.receive_some():
                into += chunk

    try:
        async with trio.open_nursery() as nursery:  # both pipes read until the process ends
            nursery.start_soon(collect, proc.stderr, err)
            if proc.stdout is not None and stdout is not None:
                nursery.start_soon(collect, proc.stdout, stdout)
            with trio.fail_after(timeout):
                while not ready():
                    await trio.sleep(0.01)
            proc.send_signal(sig)
            with trio.fail_after(timeout):
                code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return code, err.decode(errors="replace")


@dataclass
class Door:
    """A ``trio-shard api`` process: its base URL and what it logged so far."""

    proc: trio.Process
    url: str
    log: bytearray


@asynccontextmanager
async def api_process(args: list[str]) -> AsyncIterator[Door]:
    """``trio-shard api ARGS`` (text logs, a free port) until it serves; when the block ends
    it gets SIGTERM and must exit 0 (it is killed if the block failed)."""
    import re
    import signal

    proc = await trio.lowlevel.open_process(
        [*CLI, "--log-level", "INFO", "api", "--port", "0", *args], stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stderr is not None
    log = bytearray()

    async def read_log() -> None:
        while chunk := await proc.stderr.receive_some():  # type: ignore[union-attr]
            log.extend(chunk)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_log)
            with trio.fail_after(60):
                while not (m := re.search(rb"Running on (http://\S+)", log)):
                    assert proc.poll() is None, f"api exited:\n{log.decode(errors='replace')}"
                    await trio.sleep(0.05)
            yield Door(proc, m.group(1).decode(), log)
            proc.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                assert await proc.wait() == 0, log.decode(errors="replace")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
