"""Frame floods against a live worker while a neighbour session generates.

For each kind of cheap frame (stream resets, PING, SETTINGS, WINDOW_UPDATE, CONTINUATION,
empty PRIORITY frames, 1-byte DATA frames of a Session call) an attacker process sends it as fast as it can for ``--seconds`` over a
raw socket, reconnecting whenever the worker closes the connection (so the reset flood is also
"resets across reconnects"). Meanwhile a neighbour generates on the worker and a probe calls
Health back to back on a connection of its own. Printed per flood: the neighbour's worst and
median gap between two tokens, the worst Health answer, the attacker's connections and the
GOAWAY(ENHANCE_YOUR_CALM) frames it got, and the worker's RSS growth; plus a quiet baseline.

``--worker-root DIR`` also runs every flood against a worker from another checkout (e.g. the
commit before a change) in the same run, alternating, so the two columns compare on one machine.

    python -m bench.worker.floods [--quick] [--seconds S] [--kinds K,...] [--model PATH] [--worker-root DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from typing import Any

import trio

from bench.common import options
from bench.common.environment import default_threads, environment, save_record
from bench.common.processes import shard_server, status_kib, wait_serving

KINDS = ("resets", "pings", "settings", "window_updates", "continuations", "empty", "small_data")
DEFAULT_OUT = options.RESULTS / "floods.json"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
ENHANCE_YOUR_CALM = 0xB


# ---- the attacker (a process of its own: its work must not slow this event loop) ----------


def _chunk(kind: str, encoder: Any, next_sid: list[int], n: int) -> bytes:
    from hyperframe.frame import (
        ContinuationFrame,
        DataFrame,
        HeadersFrame,
        PingFrame,
        PriorityFrame,
        RstStreamFrame,
        SettingsFrame,
        WindowUpdateFrame,
    )

    if kind == "pings":
        return PingFrame(0, opaque_data=b"flooding").serialize() * n
    if kind == "settings":
        return SettingsFrame(0).serialize() * n
    if kind == "window_updates":
        return WindowUpdateFrame(0, window_increment=1).serialize() * n
    if kind == "empty":
        return PriorityFrame(1, depends_on=0, stream_weight=16).serialize() * n
    if kind == "small_data":  # a Session call, its request one byte per DATA frame
        sid = next_sid[0]
        next_sid[0] += 2
        block = encoder.encode([
            (":method", "POST"), (":scheme", "http"), (":path", "/shard.v1.Shard/Session"),
            (":authority", "flood"), ("te", "trailers"), ("content-type", "application/grpc")])
        one = DataFrame(sid, data=b"\0").serialize()
        return HeadersFrame(sid, data=block, flags={"END_HEADERS"}).serialize() + one * min(n, 60000)
    out = bytearray()
    for _ in range(n // (2 if kind == "resets" else 10)):
        sid = next_sid[0]
        next_sid[0] += 2
        block = encoder.encode([
            (":method", "POST"), (":scheme", "http"), (":path", "/shard.v1.Shard/GetCapabilities"),
            (":authority", "flood"), ("te", "trailers"), ("content-type", "application/grpc")])
        if kind == "resets":
            out += HeadersFrame(sid, data=block, flags={"END_HEADERS"}).serialize()
        else:  # continuations: a HEADERS and 8 CONTINUATION frames per block
            out += HeadersFrame(sid, data=block[:1]).serialize()
            rest = block[1:]
            step = max(1, len(rest) // 8)
            cuts = [rest[i * step:(i + 1) * step] for i in range(7)] + [rest[7 * step:]]
            for i, cut in enumerate(cuts):
                out += ContinuationFrame(sid, data=cut, flags={"END_HEADERS"} if i == 7 else set()).serialize()
        out += RstStreamFrame(sid, error_code=0x8).serialize()
    return bytes(out)


def _goaways(data: bytes) -> list[int]:
    """Error codes of the GOAWAY frames in ``data`` (the worker's frames, from the start)."""
    codes, pos = [], 0
    while len(data) - pos >= 9:
        length = int.from_bytes(data[pos:pos + 3], "big")
        if data[pos + 3] == 0x7 and len(data) - pos >= 9 + 8:
            codes.append(int.from_bytes(data[pos + 13:pos + 17], "big"))
        pos += 9 + length
    return codes


def attack(kind: str, host: str, port: int, seconds: float) -> dict[str, Any]:
    """Flood for ``seconds``, reconnecting; returns what happened."""
    import hpack

    end = time.monotonic() + seconds
    connections = calm = sent = 0
    while time.monotonic() < end:
        try:
            sock = socket.create_connection((host, port), timeout=5)
        except OSError:
            time.sleep(0.01)
            continue
        connections += 1
        sock.settimeout(2)
        encoder, sid = hpack.Encoder(), [1]
        received = bytearray()
        try:
            sock.sendall(PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            while True:  # every connection floods at least one chunk (more than any burst)
                sock.sendall(_chunk(kind, encoder, sid, 2000))
                sent += 2000
                if time.monotonic() >= end:
                    break
        except OSError:
            pass
        try:  # what the worker said before it closed
            sock.settimeout(0.5)
            while chunk := sock.recv(1 << 16):
                received += chunk
        except OSError:
            pass
        sock.close()
        calm += sum(code == ENHANCE_YOUR_CALM for code in _goaways(bytes(received)))
    return {"connections": connections, "frames_sent": sent, "goaway_enhance_your_calm": calm}


# ---- the neighbour, the probe, the measurement --------------------------------------------


async def measure(target: str, pid: int, kind: str | None, seconds: float) -> dict[str, Any]:
    from shard.client import ShardClient

    gaps: list[float] = []
    health: list[float] = []
    result: dict[str, Any] = {}
    async with ShardClient.connect(target, timeout=600) as client, \
            ShardClient.connect(target, timeout=600) as probe:
        stop = trio.Event()
        flooding = trio.Event()

        async def generate() -> None:
            # Generations of 400 tokens back to back (a session's context is 1,024 positions);
            # a gap is measured between two tokens of one generation.
            while not stop.is_set():
                last = None
                async for _ in client.generate([1, 300, 301], max_tokens=400, ignore_eos=True):
                    now = time.perf_counter()
                    if last is not None and flooding.is_set():
                        gaps.append(now - last)
                    last = now
                    if stop.is_set():
                        return

        async def check_health() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                await probe.health()
                if flooding.is_set():
                    health.append(time.perf_counter() - t0)
                await trio.sleep(0.01)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate)
            nursery.start_soon(check_health)
            await trio.sleep(1.0)  # the generation runs
            before = status_kib(pid, "VmRSS") / 1024
            flooding.set()
            if kind is None:
                await trio.sleep(seconds)
            else:
                cmd = [sys.executable, "-m", "bench.worker.floods", "--attack", kind, "--target", target,
                       "--seconds", str(seconds)]
                proc = await trio.run_process(cmd, capture_stdout=True, cwd=options.CHECKOUT)
                result.update(json.loads(proc.stdout))
            await trio.sleep(0.5)  # what was queued before the flood ended
            stop.set()
    result.update({
        "tokens_during_flood": len(gaps),
        "worst_token_gap_s": round(max(gaps), 3) if gaps else None,
        "median_token_gap_s": round(statistics.median(gaps), 4) if gaps else None,
        "worst_health_s": round(max(health), 3) if health else None,
        "rss_growth_mib": round(status_kib(pid, "VmRSS") / 1024 - before, 1),
    })
    return result


async def run(args: argparse.Namespace) -> dict[str, Any]:
    roots = options.checkouts(args, "this_checkout", "worker_root")
    results: dict[str, Any] = {}
    for kind in (None, *args.kinds):
        for label, root in roots.items():
            name = kind or "quiet"
            with shard_server(args.model, threads=args.threads, ctx=4096, max_sessions=4,
                              log=args.logs / f"floods_{name}_{label}.log", root=root) as server:
                await wait_serving(server.target)
                out = await measure(server.target, server.proc.pid, kind, args.seconds)
            results.setdefault(name, {})[label] = out
            print(name, label, json.dumps(out), file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_model(p)
    options.add_quick(p, "tiny model, 2 s floods: checks the harness")
    options.add_seconds(p, 8.0, "how long each flood lasts (default: 8)")
    p.add_argument("--kinds", type=lambda text: text.split(","), default=list(KINDS),
                   help=f"comma-separated floods to run (default: all of {','.join(KINDS)})")
    options.add_threads(p, default_threads())
    options.add_worker_root(p, "also flood a worker from this checkout")
    options.add_out(p, DEFAULT_OUT)
    options.add_logs(p)
    p.add_argument("--attack", choices=KINDS, help=argparse.SUPPRESS)  # the attacker process
    p.add_argument("--target", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.kinds) - set(KINDS)
    if unknown:
        p.error(f"unknown flood kinds: {', '.join(sorted(unknown))}")
    if args.attack:
        host, _, port = args.target.rpartition(":")
        print(json.dumps(attack(args.attack, host, int(port), args.seconds)))
        return
    if args.quick:
        args.seconds = min(args.seconds, 2.0)
    if args.model is None:
        args.model = options.default_model(args.quick)
    args.logs.mkdir(parents=True, exist_ok=True)
    results = trio.run(run, args)
    record = {
        "environment": environment(args.model, args.threads),
        "seconds_per_flood": args.seconds,
        "worker_root": str(args.worker_root) if args.worker_root else None,
        "results": results,
    }
    save_record(args.out, record)


if __name__ == "__main__":
    main()
