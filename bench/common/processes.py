"""Servers under test as real subprocesses on loopback, and the clients that drive them.

* ``shard_server``: ``python -m shard.cli serve --port 0 ...``; the bound port is read from its
  log line (as tests/test_cli.py does), then ``Health`` is polled until the model is loaded;
  ``served``: the same for any command that logs that line (``bench.common.fake_worker``).
* ``http_server``: any HTTP server (llama-cpp-python's ``python -m llama_cpp.server``,
  llama.cpp's ``llama-server``) on a free port, polled on a readiness path.
* ``stream_sse``: one streamed HTTP completion, returning the arrival time of every
  server-sent event (blocking; run it in a thread, one per concurrent stream).
* ``cpu_seconds``, ``thread_cpu``, ``status_kib``: a server process's CPU time and memory, read
  from ``/proc``.
* ``module_in``: the module name of a bench helper (``bench.common.fake_worker``) inside
  another checkout, which may predate the grouped layout of bench/.

Every process is stopped (SIGTERM, then SIGKILL after a bound) when its block ends, and its log
file is kept for inspection.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from shard.client import ShardClient, ShardError
from shard.v1 import shard_pb2 as pb

_SERVING = re.compile(r"serving shard\.v1\.Shard on (\S+:\d+)")
#: The protocol version spoken by every worker version, so a worker from an older checkout
#: (``--worker-root``) can be measured with this checkout's client.
V10 = (1, 0)
#: The fake worker's module (bench/common/fake_worker.py), then its name in older checkouts.
FAKE_WORKER = ("bench.common.fake_worker", "bench.fake_worker")


def free_port() -> int:
    """A port that was free a moment ago (for servers that cannot report a port-0 binding)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def module_in(root: Path | None, module: str, *older: str) -> str:
    """The dotted name to run ``module`` by with ``python -m`` inside the checkout ``root``
    (None: this one): ``module`` where that checkout has it, else the first of ``older`` (its
    names before a move, e.g. ``bench.fake_worker`` before bench/ was grouped) that it has.

    Why: ``--worker-root`` points at any other checkout, often one from before a change, and the
    helper must come from that checkout (``PYTHONPATH``) to measure its code."""
    if root is None:
        return module
    for name in (module, *older):
        if (root / (name.replace(".", "/") + ".py")).is_file():
            return name
    raise FileNotFoundError(f"{root}: none of {', '.join((module, *older))} in that checkout")


@dataclass
class ShardServer:
    target: str
    proc: subprocess.Popen[bytes]
    log: Path
    fake: bool = False  # a bench.common.fake_worker: its engine's "native" steps are sleeps


@contextmanager
def shard_server(
    model: Path, *, threads: int, ctx: int, max_sessions: int, log: Path,
    extra: Sequence[str] = (), startup_timeout: float = 120.0, wrap: Sequence[str] = (),
    root: Path | None = None,
) -> Iterator[ShardServer]:
    """A running ``trio-shard serve`` on 127.0.0.1 port 0 (``wrap``: a command prefix such as
    ``py-spy record ... --``). Yields once the port is bound; call ``wait_serving`` next.

    ``root``: run the worker from another checkout (its directory comes first on the path; the
    process also starts there, since ``python -m`` puts the working directory first)."""
    cmd = [*wrap, sys.executable, "-m", "shard.cli", "--log-level", "INFO", "serve",
           "--model", str(model), "--host", "127.0.0.1", "--port", "0", "--threads", str(threads),
           "--ctx", str(ctx), "--max-sessions", str(max_sessions), *extra]
    with served(cmd, log=log, startup_timeout=startup_timeout, root=root) as server:
        yield server


@contextmanager
def served(
    cmd: Sequence[str], *, log: Path, startup_timeout: float = 120.0, root: Path | None = None,
    fake: bool = False,
) -> Iterator[ShardServer]:
    """Any command that serves the Shard protocol and logs ``serving shard.v1.Shard on
    HOST:PORT`` (``trio-shard serve``, ``python -m bench.common.fake_worker``); yields once it did."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = os.environ.copy()
    if root is not None:
        env["PYTHONPATH"] = str(root)
    with open(log, "wb") as sink:
        proc = subprocess.Popen(list(cmd), stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=root)
    try:
        deadline = time.monotonic() + startup_timeout
        target = None
        while target is None:
            m = _SERVING.search(log.read_text(errors="replace"))
            if m:
                target = m.group(1)
            elif proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(cmd[:4])} ... did not start:\n"
                                   f"{log.read_text(errors='replace')[-3000:]}")
            else:
                time.sleep(0.05)
        yield ShardServer(target, proc, log, fake)
    finally:
        _stop(proc)


async def wait_serving(target: str, timeout: float = 120.0, *, version: tuple[int, int] | None = None) -> None:
    """Poll ``Health`` until the worker has loaded its model (``version``: the protocol version to
    speak, for a worker older than this client)."""
    kwargs = {} if version is None else {"version": version}
    with trio.fail_after(timeout):
        while True:
            try:
                async with ShardClient.connect(target, timeout=10, **kwargs) as client:
                    if (await client.health()).status == pb.HealthResponse.STATUS_SERVING:
                        return
            except ShardError:
                pass
            await trio.sleep(0.1)


@dataclass
class HttpServer:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path


def _http_ok(port: int, path: str) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", path)
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


@contextmanager
def http_server(
    cmd: Sequence[str], *, port: int, ready_path: str, log: Path, startup_timeout: float = 120.0
) -> Iterator[HttpServer]:
    """Run ``cmd`` (already told to listen on ``port``) until ``GET ready_path`` answers 200."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as sink:
        proc = subprocess.Popen(list(cmd), stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + startup_timeout
        while not _http_ok(port, ready_path):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        yield HttpServer(port, proc, log)
    finally:
        _stop(proc)


def stream_sse(port: int, path: str, body: dict[str, Any], timeout: float = 300.0) -> tuple[float, list[tuple[float, dict[str, Any]]]]:
    """POST ``body`` and read the server-sent events; returns (request time, [(arrival time,
    event)]) with ``time.perf_counter`` stamps. ``[DONE]`` ends the stream."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    events: list[tuple[float, dict[str, Any]]] = []
    try:
        payload = json.dumps(body).encode()
        sent = time.perf_counter()
        conn.request("POST", path, body=payload, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"POST {path}: HTTP {resp.status}: {resp.read()[:500]!r}")
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            events.append((time.perf_counter(), json.loads(data)))
        return sent, events
    finally:
        conn.close()


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, tid: int | str | None = None) -> float:
    """CPU seconds (user + system) of process ``pid`` (all its threads), or of its thread ``tid``."""
    stat = Path(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of ``pid``, by thread id."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[tid] = cpu_seconds(pid, tid)
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return out


def status_kib(pid: int, key: str) -> int:
    """A memory field of ``/proc/PID/status`` in KiB (``VmRSS``: resident now, ``VmHWM``: its
    peak); 0 when the process does not report it."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0
