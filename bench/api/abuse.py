"""Abusive requests against the front door while a neighbour streams: what one client costs
everyone else.

One ``trio-shard serve`` worker (the real Gemma 3 270M by default: its tokenizer reports 6,250
special-token texts) and one ``trio-shard api`` in front of it, with a simple chat template
(``--chat-template``: the package's GGUF carries none). For each kind of abuse an attacker
sends it for ``--seconds`` while a neighbour streams greedy completions back to back and a probe
calls ``GET /health`` back to back. Printed per kind: the neighbour's worst and median gap
between two events, the probe's worst answer, the attacker's requests and their statuses; plus
a quiet baseline.

Kinds:

* ``specials``: chat whose one message is 1 MB of ``<`` (the first character of most special
  texts), back to back.
* ``conversation``: chat of as many two-character messages as fit in 4 MiB, back to back.
* ``slow_bodies``: ``--slow-connections`` connections that each send a request's headers, then
  one byte of a 1 MB body a second, for ``--slow-seconds`` (default 40: past the door's
  30 s ``--body-timeout``); reported: how many the door still held open at the end.
* ``stops``: a greedy completion of 1,024 tokens whose stop sequences hold its whole text back:
  one is the text itself (learnt from a first request) and one more character, three more are
  long and never match; each as long as the door accepts (1 MB, else 1,024 characters).
  The real model's greedy text is short (it ends), so the same stops are also run through
  each checkout's ``TextAssembler`` alone over a 16,000-character text of 3-character tokens
  (``assembler_s``: the event loop's seconds for that text; ``assembler_worst_push_ms``).

``--door-root DIR`` also runs every kind against a front door from another checkout (e.g. the
commit before a change, ``git worktree add DIR REV``) in the same run, alternating, so the two
columns compare on one machine.

    python -m bench.api.abuse [--model gemma3-270m] [--seconds 8] [--kinds K,...]
        [--door-root DIR] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio

from bench.api.overhead import model_path
from bench.common import options
from bench.common.environment import default_threads, environment
from bench.common.processes import free_port, shard_server, stream_sse, wait_serving

KINDS = ("specials", "conversation", "slow_bodies", "stops")
TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n"
            "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
MODEL = "m"
NEIGHBOUR = {"model": MODEL, "prompt": "Once upon a time, in a city by the sea, there lived a",
             "max_tokens": 48, "temperature": 0, "stream": True}


def _body(kind: str) -> bytes:
    if kind == "specials":
        messages = [{"role": "user", "content": "<" * 2**20}]
    else:  # conversation: '{"role":"user","content":"hi"},' is 31 bytes
        messages = [{"role": "user", "content": "hi"}] * ((4 * 2**20 - 200) // 31)
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}, separators=(",", ":"))
    assert len(body) <= 4 * 2**20, len(body)  # the door's default --max-body-bytes
    return body.encode()


def _post(port: int, body: bytes, path: str = "/v1/chat/completions") -> int:
    return _request(port, body, path)[0]


def _request(port: int, body: bytes, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except OSError:
        return 0, b""
    finally:
        conn.close()


def _stops_body(port: int) -> bytes:
    """The strongest ``stops`` request the door takes (see the module docstring)."""
    plain = {"model": MODEL, "prompt": NEIGHBOUR["prompt"], "max_tokens": 1024, "temperature": 0}
    status, answer = _request(port, json.dumps(plain).encode(), "/v1/completions")
    assert status == 200, answer
    text = json.loads(answer)["choices"][0]["text"]
    for length in (2**20, 1024):
        stops = ["\x7f" * length, "a" * (length - 1) + "\x7f", "ab" * (length // 2 - 1) + "x",
                 text[:length - 1] + "\x7f"]
        body = json.dumps({**plain, "stop": stops}).encode()
        if _request(port, body, "/v1/completions")[0] == 200:
            return body
    raise RuntimeError("the door took neither stops request")


def _slow_bodies(port: int, connections: int, stop: threading.Event) -> dict[str, int]:
    """Open ``connections`` requests whose bodies trickle; count the ones still open at the end."""
    socks = []
    for _ in range(connections):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{")
        s.setblocking(False)
        socks.append(s)
    while not stop.wait(1.0):
        for s in socks:
            try:
                s.send(b" ")
            except OSError:
                pass
    open_, answered = 0, Counter[str]()
    for s in socks:
        try:
            data = s.recv(4096)
            if data:
                answered[data.split(b" ", 2)[1].decode()] += 1
            else:
                answered["closed"] += 1
        except BlockingIOError:
            open_ += 1  # nothing to read: the door still holds it
        except OSError:
            answered["closed"] += 1
        s.close()
    return {"held_open": open_, **answered}


_ASSEMBLER = """
import json, sys, time
from shard.api.text import TextAssembler, TokenOut
out = ("lorem ipsum dolor sit amet " * 1000)[:16000]
for length in (2**20, 1024):
    stops = ["\\x7f" * length, "\\x7f" * (length - 1), "\\x7f" * (length - 2), out[:length - 1] + "\\x7f"]
    try:
        from shard.api.schemas import MAX_STOP_CHARS
    except ImportError:
        MAX_STOP_CHARS = None
    if MAX_STOP_CHARS is None or length <= MAX_STOP_CHARS:
        break
text, worst, t0 = TextAssembler(stops), 0.0, time.perf_counter()
for i in range(0, len(out), 3):
    s = time.perf_counter()
    text.push(TokenOut(out[i:i + 3].encode(), 0.0))
    worst = max(worst, time.perf_counter() - s)
text.finish()
print(json.dumps({"assembler_s": round(time.perf_counter() - t0, 3), "assembler_stop_chars": length,
                  "assembler_worst_push_ms": round(worst * 1e3, 2)}))
"""


def assembler(root: Path | None) -> dict[str, Any]:
    """``_ASSEMBLER`` in a process of its own, with ``root``'s checkout (None: this one)."""
    checkout = root or options.CHECKOUT
    env = os.environ.copy()
    env["PYTHONPATH"] = str(checkout)
    out = subprocess.run([sys.executable, "-c", _ASSEMBLER], env=env, capture_output=True,
                         text=True, check=True, timeout=1800, cwd=checkout)  # -c: cwd first
    return dict(json.loads(out.stdout))


def _neighbour(port: int, stop: threading.Event, gaps: list[float]) -> None:
    while not stop.is_set():
        _, events = stream_sse(port, "/v1/completions", NEIGHBOUR)
        stamps = [t for t, _ in events]
        gaps.extend(b - a for a, b in itertools.pairwise(stamps))


def _health(port: int, stop: threading.Event, waits: list[float]) -> None:
    while not stop.is_set():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        t = time.perf_counter()
        try:
            conn.request("GET", "/health")
            conn.getresponse().read()
            waits.append(time.perf_counter() - t)
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.01)


def run_kind(port: int, kind: str | None, seconds: float, slow_connections: int) -> dict[str, Any]:
    """The neighbour and the probe for ``seconds``, with ``kind``'s attacker (None: quiet)."""
    stop, gaps, waits = threading.Event(), list[float](), list[float]()
    statuses: Counter[str] = Counter()
    result: dict[str, Any] = {}

    if kind == "stops":  # learnt before the window opens
        body, path = _stops_body(port), "/v1/completions"
    elif kind is not None and kind != "slow_bodies":
        body, path = _body(kind), "/v1/chat/completions"

    def attack() -> None:
        if kind == "slow_bodies":
            result["slow_bodies"] = _slow_bodies(port, slow_connections, stop)
            return
        while not stop.is_set():
            statuses[str(_post(port, body, path))] += 1

    threads = [threading.Thread(target=_neighbour, args=(port, stop, gaps)),
               threading.Thread(target=_health, args=(port, stop, waits))]
    if kind is not None:
        threads.append(threading.Thread(target=attack))
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return {
        "neighbour_worst_gap_ms": round(max(gaps) * 1e3, 1) if gaps else None,
        "neighbour_median_gap_ms": round(statistics.median(gaps) * 1e3, 2) if gaps else None,
        "neighbour_events": len(gaps),
        "health_worst_ms": round(max(waits) * 1e3, 1) if waits else None,
        "health_answers": len(waits),
        "attacker_statuses": dict(statuses),
        **result,
    }


@contextmanager
def front_door(target: str, template: Path, log: Path, root: Path | None) -> Iterator[int]:
    """``trio-shard api`` over ``target`` (from ``root``'s checkout when given)."""
    port = free_port()
    env = os.environ.copy()
    if root is not None:
        env["PYTHONPATH"] = str(root)
    cmd = [sys.executable, "-m", "shard.cli", "api", "--target", target, "--port", str(port),
           "--model-name", MODEL, "--chat-template", str(template)]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=root)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the front door did not start:\n{log.read_text()[-2000:]}") from None
                time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_model(parser, None, type=str, default="gemma3-270m")
    options.add_seconds(parser, 8.0)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated, from {', '.join(KINDS)}")
    parser.add_argument("--slow-connections", type=int, default=200)
    parser.add_argument("--slow-seconds", type=float, default=40.0)
    parser.add_argument("--door-root", type=Path, help="also run a front door from this checkout")
    options.add_threads(parser, default_threads())
    options.add_out_dir(parser)
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"unknown kinds: {', '.join(sorted(unknown))}")
    model = model_path(args.model)
    env = environment(model, args.threads, argv=sys.argv if argv is None else ["bench.api.abuse", *argv])
    logs = options.LOGS  # bench/results: not kept in git
    template = (logs / "api_abuse_template.jinja").resolve()
    logs.mkdir(parents=True, exist_ok=True)
    template.write_text(TEMPLATE)
    doors: dict[str, Path | None] = {"this": None}
    if args.door_root is not None:
        doors["other"] = args.door_root.resolve()
    results: dict[str, dict[str, Any]] = {name: {} for name in doors}
    with shard_server(model, threads=args.threads, ctx=8192, max_sessions=4,
                      log=logs / "api_abuse_worker.log") as worker:
        trio.run(wait_serving, worker.target)
        for kind in [None, *kinds]:
            for name, root in doors.items():
                with front_door(worker.target, template, logs / f"api_abuse_{name}.log", root) as port:
                    stream_sse(port, "/v1/completions", {**NEIGHBOUR, "max_tokens": 4})  # warm-up
                    seconds = args.slow_seconds if kind == "slow_bodies" else args.seconds
                    row = run_kind(port, kind, seconds, args.slow_connections)
                if kind == "stops":
                    row.update(assembler(root))
                results[name][kind or "quiet"] = row
                print(f"{kind or 'quiet':>12} {name:>5}: {json.dumps(row)}", flush=True)
    out = args.out_dir / "api_abuse.json"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": env, "seconds": args.seconds,
                               "door_root": str(args.door_root) if args.door_root else None,
                               "results": results}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
