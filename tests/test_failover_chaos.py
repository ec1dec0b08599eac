"""Chaos: the serving middle worker of a 3-hop llama.cpp pipeline is killed, stopped or told to
drain at a random step of a 64-token greedy generation; its replica takes over and the result
is the whole-model worker's, token for token. In both relay modes: with client relay the client
replays the hop's rows on the replica; with chain relay the first worker relays to the middle
one, and the client moves the route to the replica and replays the token log through it (a
draining middle worker finishes the generation it carries instead).

The worker that gets the signal is a real ``trio-shard serve --layers 1:3`` process (the tiny
model; SIGKILL, SIGSTOP and SIGTERM mean what they mean in production). The other workers
(hop 0 ``[0, 1)``, the replica ``[1, 3)``, hop 2 ``[3, 4)`` and the whole model) are
LlamaCppEngine workers in this process, checked afterwards over the wire: no session, no KV
cell, nothing retained. The step at which the signal comes is drawn from a seeded RNG:
``SHARD_CHAOS_SEED=N`` replays a run, and every failure message names the seed.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import trio

from rpc_harness import Worker, api_process
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.client import ShardClient
from shard.engine import LayerRange
from shard.models import ensure_model
from shard.pipeline import Pipeline, PipelineError
from shard.v1 import shard_pb2 as pb
from test_pipeline import assert_all_free, whole_model_steps
from test_pipeline_llama import llama_workers

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("SHARD_CHAOS_SEED") or random.SystemRandom().randrange(2**32))
PROMPT = "hello world, a pipeline that survives a worker's death"
N_TOKENS = 64
TIMEOUT = 120.0
#: The bound for a hung worker: generous, since hops without a replica fail on it too.
STEP_TIMEOUT = 5.0
_SERVING = re.compile(rb"serving shard\.v1\.Shard on (\S+:\d+)")


def where(how: str, at: int) -> str:
    return f"{how} after token {at}; replay with SHARD_CHAOS_SEED={SEED}"


@dataclass
class Served:
    """A ``trio-shard serve`` process and what it logged so far."""

    target: str
    proc: trio.Process
    log: bytearray = field(default_factory=bytearray)


@asynccontextmanager
async def serve_process(layers: str | None, *extra: str, model: str | None = None) -> AsyncIterator[Served]:
    """``trio-shard serve --layers LAYERS`` (None: the whole model) of the tiny model (or
    ``model``, a packaged model's name) on a free port, loaded; killed (after SIGCONT, in case
    it was stopped) when the block ends unless it already exited."""
    ranged = ["--layers", layers] if layers is not None else []
    cmd = [sys.executable, "-m", "shard.cli", "--log-level", "INFO", "serve",
           "--model", model or str(ensure_model("tiny")), *ranged, "--port", "0",
           "--threads", "1", "--ctx", "1024", "--max-sessions", "2", *extra]
    proc = await trio.lowlevel.open_process(cmd, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    log = bytearray()
    try:
        async with trio.open_nursery() as nursery:
            with trio.fail_after(60):
                while (m := _SERVING.search(log)) is None:
                    chunk = await proc.stderr.receive_some()
                    assert chunk, f"serve exited:\n{log.decode(errors='replace')}"
                    log += chunk

            async def keep_reading() -> None:  # a full pipe would block the worker
                while chunk := await proc.stderr.receive_some():  # type: ignore[union-attr]
                    log.extend(chunk)

            nursery.start_soon(keep_reading)
            served = Served(m.group(1).decode(), proc, log)
            await wait_serving(served.target)
            try:
                yield served
            finally:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGCONT)
                    proc.kill()
                with trio.CancelScope(shield=True), trio.fail_after(30):
                    await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()


async def wait_serving(target: str) -> None:
    with trio.fail_after(60):
        async with ShardClient.connect(target, timeout=60) as client:
            await client.wait_for_ready()


async def middle_is_free(target: str) -> None:
    """The signalled worker, once it runs again: its session was released (the stream reset
    reached it; the engine frees the KV cells a moment after the session), nothing retained."""
    with trio.fail_after(30):
        while True:
            async with ShardClient.connect(target, timeout=10) as client:
                m = await client.metrics()
            busy = (m.engine["sessions_active"], m.engine["kv_cells_used"], m.worker["sessions_retained"])
            if busy == (0, 0, 0):
                return
            await trio.sleep(0.05)


@asynccontextmanager
async def chain(relay: bool = False) -> AsyncIterator[tuple[list[int], Worker, Worker, Worker, Worker]]:
    """The whole model's 64 greedy tokens, and in-process workers: whole, [0,1), [1,3), [3,4)
    (``relay``: each one relays routes, to loopback peers)."""
    ranges = [None, LayerRange(0, 1), LayerRange(1, 3), LayerRange(3, 4)]
    async with llama_workers(ranges, relay=relay) as ws:
        whole = ws[0]
        want = await whole_model_steps(whole.target, PROMPT, max_tokens=N_TOKENS, ignore_eos=True)
        yield [s.logits.token_id for s in want], *ws  # type: ignore[misc]


#: With chain relay the workers run up to a credit window (16 results) ahead of the client's
#: ``on_token``: the signal comes early enough that steps still follow it.
CHAIN_AHEAD = 24


@pytest.mark.parametrize("relay", ["client", "chain"])
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP", "SIGTERM"])
async def test_the_serving_middle_worker_dies_and_the_tokens_stay_the_whole_models(
    how: str, relay: str
) -> None:
    chained = relay == "chain"
    last = N_TOKENS - CHAIN_AHEAD if chained else N_TOKENS
    at = random.Random(f"{SEED}-{how}-{relay}").randrange(1, last)  # >= 1 decode step follows
    sig = getattr(signal, how)
    print(f"SHARD_CHAOS_SEED={SEED}: {how} after token {at}, {relay} relay")
    extra = ("--allow-relay",) if chained else ()
    async with chain(relay=chained) as (want, whole, a, b2, c), \
            serve_process("1:3", "--grace", "60", *extra) as b1:
        async with Pipeline.connect(
            [a.target, [b1.target, b2.target], c.target], timeout=TIMEOUT,
            step_timeout=STEP_TIMEOUT, relay=relay,
        ) as pipe:
            seen: list[int] = []

            async def on_token(step: pb.StepResult) -> None:
                seen.append(step.logits.token_id)
                if len(seen) == at:
                    b1.proc.send_signal(sig)
                    if sig == signal.SIGTERM and not chained:  # the GOAWAY reaches the client
                        client = pipe.replicas[1][0].client
                        assert client is not None
                        with trio.fail_after(10):
                            while not client.going_away:
                                await trio.sleep(0.001)

            got = await pipe.generate(PROMPT, max_tokens=N_TOKENS, ignore_eos=True, on_token=on_token)
        assert got.tokens == seen == want, where(how, at)
        if chained and sig == signal.SIGTERM:  # the draining worker finished what it carried
            assert got.failovers == [], where(how, at)
        else:
            assert [(f.hop, f.from_target, f.to_target) for f in got.failovers] == [
                (1, b1.target, b2.target)], where(how, at)
            (f,) = got.failovers
            reason = {"SIGKILL": "NOT_READY", "SIGSTOP": "DEADLINE_EXCEEDED", "SIGTERM": "DRAINING"}
            assert (f.reason, f.handover) == (reason[how], how == "SIGTERM"), where(how, at)
            # a drain moves the session's KV state (real processes, real llama.cpp contexts);
            # a death leaves nobody to export it: replayed
            assert f.moved is (how == "SIGTERM"), where(how, at)
            held = got.prompt_tokens + at - 1  # all it held (the first hop's log, chained:
            # the workers may have gone on up to a credit window past on_token)
            assert held <= f.positions <= held + CHAIN_AHEAD if chained else f.positions == held, \
                where(how, at)
        await assert_all_free([whole, a, b2, c])
        if sig == signal.SIGSTOP:
            b1.proc.send_signal(signal.SIGCONT)
            await middle_is_free(b1.target)  # it finds its stream reset and releases
        elif sig == signal.SIGTERM:
            with trio.fail_after(20):  # grace 60 s: the handover's close ended the drain
                assert await b1.proc.wait() == 0, b1.log.decode(errors="replace")


async def test_without_a_replica_the_error_names_the_hop_and_the_others_are_free() -> None:
    at = random.Random(f"{SEED}-alone").randrange(1, N_TOKENS)
    async with chain() as (_, whole, a, _b2, c), serve_process("1:3") as b1:
        async with Pipeline.connect([a.target, b1.target, c.target], timeout=TIMEOUT) as pipe:
            seen: list[int] = []

            def on_token(step: pb.StepResult) -> None:
                seen.append(step.logits.token_id)
                if len(seen) == at:
                    b1.proc.send_signal(signal.SIGKILL)

            with pytest.raises(PipelineError) as info:
                await pipe.generate(PROMPT, max_tokens=N_TOKENS, ignore_eos=True, on_token=on_token)
        err = info.value
        assert err.hop_index == 1 and err.target == b1.target, where("SIGKILL", at)
        assert err.message.startswith(f"hop 1 ({b1.target}, layers [1, 3)): "), err.message
        assert err.code.name == "NOT_READY" and len(seen) == at
        await assert_all_free([whole, a, c])


async def test_a_rolling_restart_behind_the_door_moves_a_streamed_chat_without_a_stall() -> None:
    """Real processes as an operator runs them: two `trio-shard serve` workers of the packaged
    instruct model and `trio-shard api --workers A,B` in front. A streamed chat completion is
    under way when its worker gets SIGTERM: the worker yields the generation between two
    tokens, the session's KV state moves to the other worker, the stream goes on with the text
    it gives undisturbed, and the drained worker exits 0 at once (its grace is 60 s)."""
    import json as _json
    import threading
    import urllib.request

    from shard.models.real import ensure_real_model  # noqa: F401 - installed by make models

    chat = "smollm2-135m-instruct"
    body = {"model": chat, "temperature": 0, "max_tokens": 96,
            "messages": [{"role": "user", "content": "Tell a long story about a lighthouse."}]}
    async with serve_process(None, "--grace", "60", model=chat) as a, \
            serve_process(None, "--grace", "60", model=chat) as b, \
            api_process(["--workers", f"{a.target},{b.target}", "--probe-interval", "0.2"]) as door:
        url = door.url + "/v1/chat/completions"

        def post(stream: bool, on_chunk: Any = None) -> str:
            req = urllib.request.Request(
                url, data=_json.dumps({**body, "stream": stream}).encode(),
                headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                if not stream:
                    return _json.loads(resp.read())["choices"][0]["message"]["content"]
                text = ""
                for line in resp:
                    if line.startswith(b"data: {"):
                        text += _json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                        on_chunk()
                return text

        want = await trio.to_thread.run_sync(post, False)
        assert len(want) > 200, want  # long enough to be interrupted
        chunks, under_way = [0], threading.Event()

        def counted() -> None:
            chunks[0] += 1
            if chunks[0] == 10:
                under_way.set()

        streamed: list[str] = []
        async with trio.open_nursery() as nursery:

            async def stream() -> None:
                streamed.append(await trio.to_thread.run_sync(post, True, counted))

            nursery.start_soon(stream)
            with trio.fail_after(60):
                while not under_way.is_set():
                    await trio.sleep(0.01)
            serving = []
            for w in (a, b):
                async with ShardClient.connect(w.target, timeout=10) as client:
                    if (await client.health()).sessions_active:
                        serving.append(w)
            (drained,) = serving
            other = b if drained is a else a
            drained.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(20):  # only the move ends its 60 s grace this soon
                assert await drained.proc.wait() == 0, drained.log.decode(errors="replace")
        log = door.log
        assert streamed == [want]
        assert b"moved the state of" in log, log.decode(errors="replace")
        async with ShardClient.connect(other.target, timeout=10) as client:
            m = await client.metrics()
        assert m.engine["sessions_imported_total"] == 1
