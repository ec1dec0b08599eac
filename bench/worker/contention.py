"""Sessions that compete: a prompt among decodes, decodes during a long prompt, one huge request.

Three scenarios through a live ``trio-shard serve`` (each with its own worker, so they do not
disturb each other), measured from the client side with the Trio client over loopback:

  starved_prompt     with ``--max-batch-sessions M``, N sessions generate 400 tokens each; once
                     they run, a 20-token prompt asks for one token: its time to first token,
                     and how many tokens the others still had to produce at that moment
  decode_deadline    one session prefills 1,500 tokens while another decodes token by token with
                     ``step_timeout_ms`` 300: how many of its steps timed out, and the worst and
                     median step latency (the default ``--batch-tokens``, 512 and 64; ``--repeat
                     N`` runs each N times in fresh workers)
  huge_request       one session generates while another sends a Prefill of 16 MiB of text
                     (then 4M token ids; sent by grpcio from a thread, so this client's event
                     loop is not the one stalled) and a third calls Health back to back: the
                     longest gap between two tokens of the generation and between two Health
                     answers, how long the refusal took, and the worker's peak RSS before/after

``--worker-root DIR`` runs the worker from another checkout (e.g. the previous commit, to print
before/after numbers from one run); the client always speaks protocol 1.0, which every version
of the worker serves.

    python -m bench.worker.contention [--quick] [--model PATH] [--threads N] [--worker-root DIR]
                               [--scenarios LIST] [--repeat N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import trio

from bench.common import options
from bench.common.environment import default_threads, environment, save_record
from bench.common.processes import V10, shard_server, status_kib, wait_serving
from shard.client import ShardClient, ShardError
from shard.v1 import shard_pb2 as pb

STEP_TIMEOUT = 0.3
DEFAULT_OUT = options.RESULTS / "contention.json"


def _prompt(n: int, salt: int) -> list[int]:
    """Token ids of a prompt (ids 300+ are word pieces of the generated vocabularies; the tiny
    one has 812 tokens, the bench one 32,000)."""
    return [1, *(300 + (i * 37 + salt * 101) % SIZES.vocab for i in range(n - 1))]


@contextmanager
def _worker(args: argparse.Namespace, log: str, extra: list[str]) -> Iterator[Any]:
    with shard_server(args.model, threads=args.threads, ctx=8 * 2048, max_sessions=8,
                      log=args.logs / log, extra=extra, root=args.worker_root) as server:
        yield server


@dataclass(frozen=True)
class Sizes:
    """How much work each scenario asks for (``--quick``: small, to check the harness)."""

    generate: int = 400
    long_prompt: int = 1500
    text_bytes: int = 16 * 1024 * 1024 - 4096
    token_ids: int = 4_000_000
    vocab: int = 20000  # word-piece ids 300..300+vocab are used in prompts


SIZES = Sizes()


async def starved_prompt(target: str, n_generators: int) -> dict[str, Any]:
    counts = [0] * n_generators
    started = [trio.Event() for _ in range(n_generators)]
    result: dict[str, Any] = {}
    async with ShardClient.connect(target, timeout=600, version=V10) as client:

        async def generate(i: int) -> None:
            async for _ in client.generate(_prompt(8, i), max_tokens=SIZES.generate, ignore_eos=True):
                counts[i] += 1
                started[i].set()

        async with trio.open_nursery() as nursery:
            for i in range(n_generators):
                nursery.start_soon(generate, i)
            for event in started:
                await event.wait()
            await trio.sleep(0.5)
            t0 = time.perf_counter()
            async for _ in client.generate(_prompt(20, 99), max_tokens=1, ignore_eos=True):
                result["first_token_s"] = round(time.perf_counter() - t0, 3)
            result["others_left_tokens"] = [SIZES.generate - c for c in counts]
    return result


async def decode_deadline(target: str) -> dict[str, Any]:
    latencies: list[float] = []
    timeouts = 0
    async with ShardClient.connect(target, timeout=600, version=V10) as client:
        async with client.session() as warm:  # a fresh worker's first native step is slow
            await warm.prefill(_prompt(8, 3))
        async with client.session(step_timeout=STEP_TIMEOUT) as d, client.session() as p:
            step = await d.prefill(_prompt(8, 1))
            token = step.logits.token_id
            done = trio.Event()

            async def long_prompt() -> None:
                await p.prefill(_prompt(SIZES.long_prompt, 2))
                done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(long_prompt)
                await trio.sleep(0.05)
                while True:  # at least one step, even if the prompt was already done
                    t0 = time.perf_counter()
                    try:
                        step = await d.decode(token)
                        token = step.logits.token_id
                    except ShardError as err:
                        if err.reason != "STEP_TIMEOUT":
                            raise
                        timeouts += 1
                    latencies.append(time.perf_counter() - t0)
                    if done.is_set():
                        break
    return {
        "decode_steps": len(latencies),
        "step_timeouts": timeouts,
        "worst_step_s": round(max(latencies), 3),
        "median_step_s": round(statistics.median(latencies), 3),
    }


async def huge_request(target: str, pid: int) -> dict[str, Any]:
    out: dict[str, Any] = {"rss_peak_before_mib": round(status_kib(pid, "VmHWM") / 1024, 1)}
    gaps: list[float] = []
    health: list[float] = []
    async with ShardClient.connect(target, timeout=600, version=V10) as client, \
            ShardClient.connect(target, timeout=600, version=V10) as probe:
        stop = trio.Event()

        async def generate() -> None:
            last = None
            async for _ in client.generate(_prompt(8, 3), max_tokens=100_000, ignore_eos=True):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                if stop.is_set():
                    return

        async def check_health() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                await probe.health()
                health.append(time.perf_counter() - t0)
                await trio.sleep(0.01)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate)
            nursery.start_soon(check_health)
            await trio.sleep(1.0)
            for name, make in (
                ("text_16mib", lambda: pb.Prefill(text=_random_text(SIZES.text_bytes))),
                ("token_ids_4m", lambda: pb.Prefill(tokens=pb.TokenIds(ids=[300] * SIZES.token_ids))),
            ):
                # Built and sent by grpcio in a worker thread, off this event loop, so the gaps
                # measured here are the worker's, not this client's.
                t0 = time.perf_counter()
                code = await trio.to_thread.run_sync(_send_huge, target, make)
                out[f"{name}_answer_s"] = round(time.perf_counter() - t0, 3)
                out[f"{name}_refused"] = code
                await trio.sleep(1.0)
            stop.set()
    out["worst_token_gap_s"] = round(max(gaps), 3)
    out["median_token_gap_s"] = round(statistics.median(gaps), 4)
    out["worst_health_s"] = round(max(health), 3)
    out["rss_peak_after_mib"] = round(status_kib(pid, "VmHWM") / 1024, 1)
    return out


def _random_text(n: int) -> str:
    """``n`` characters of seeded random letters, digits and punctuation: mostly one token per
    few characters, many byte tokens (repeating one word would tokenize unrealistically fast)."""
    import random

    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?-'\"()[]{}"
    return "".join(random.Random(0).choices(alphabet, k=n))


def _send_huge(target: str, make: Callable[[], pb.Prefill]) -> str:
    """Open a session and send one Prefill with grpcio (blocking); the step's error code name,
    or "accepted"."""
    import grpc

    version = pb.ProtocolVersion(major=V10[0], minor=V10[1])
    requests = [
        pb.SessionRequest(version=version, open=pb.OpenSession(session_id="huge")),
        pb.SessionRequest(version=version, prefill=make()),
        pb.SessionRequest(version=version, close=pb.CloseSession()),
    ]
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 32 << 20)]) as channel:
        call = channel.stream_stream(
            "/shard.v1.Shard/Session",
            request_serializer=pb.SessionRequest.SerializeToString,
            response_deserializer=pb.SessionResponse.FromString,
        )
        for response in call(iter(requests), timeout=120):
            if response.WhichOneof("kind") == "error":
                return pb.ErrorCode.Name(response.error.code).removeprefix("ERROR_CODE_")
    return "accepted"


SCENARIOS = ("starved_prompt", "decode_deadline", "huge_request")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    if "starved_prompt" in args.scenarios:
        for m, n in ((1, 1), (2, 4)):
            with _worker(args, f"starved_{m}.log", ["--max-batch-sessions", str(m)]) as server:
                await wait_serving(server.target, version=V10)
                results[f"starved_prompt_max_batch_sessions_{m}_generators_{n}"] = await starved_prompt(server.target, n)
                print(json.dumps(results), file=sys.stderr)
    if "decode_deadline" in args.scenarios:
        # the worker's default batch size too (no --batch-tokens), each run in a fresh worker
        for b in (None, 512, 64):
            runs = []
            for i in range(args.repeat):
                extra = [] if b is None else ["--batch-tokens", str(b)]
                with _worker(args, f"deadline_{b or 'default'}_{i}.log", extra) as server:
                    await wait_serving(server.target, version=V10)
                    runs.append(await decode_deadline(server.target))
            key = f"decode_deadline_batch_tokens_{b or 'default'}"
            results[key] = runs[0] if args.repeat == 1 else {
                "runs": runs, "step_timeouts_per_run": [r["step_timeouts"] for r in runs],
                "worst_step_s": max(r["worst_step_s"] for r in runs)}
            print(json.dumps(results), file=sys.stderr)
    if "huge_request" in args.scenarios:
        with _worker(args, "huge.log", []) as server:
            await wait_serving(server.target, version=V10)
            results["huge_request"] = await huge_request(server.target, server.proc.pid)
    return results


def _scenarios(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in names if x not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown scenario {', '.join(unknown) or '(none)'}; choose from {', '.join(SCENARIOS)}")
    return names


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_model(p)
    options.add_quick(p, "tiny model and small sizes: checks the harness, measures nothing useful")
    options.add_threads(p, default_threads())
    options.add_worker_root(p, "run the worker from this checkout")
    p.add_argument("--scenarios", type=_scenarios, default=SCENARIOS,
                   help=f"comma-separated, from {','.join(SCENARIOS)} (default: all)")
    p.add_argument("--repeat", type=int, default=1,
                   help="decode_deadline: runs per batch size, each in a fresh worker (default 1)")
    options.add_out(p, DEFAULT_OUT)
    options.add_logs(p)
    args = p.parse_args(argv)
    if args.quick:
        global SIZES
        SIZES = Sizes(generate=40, long_prompt=300, text_bytes=1024 * 1024, token_ids=100_000, vocab=500)
    if args.model is None:
        args.model = options.default_model(args.quick)
    results = trio.run(run, args)
    record = {
        "environment": environment(args.model, args.threads),
        "worker_root": str(args.worker_root) if args.worker_root else "this checkout",
        "results": results,
    }
    save_record(args.out, record)


if __name__ == "__main__":
    main()
