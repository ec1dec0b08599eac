"""Issue 54 through live worker processes: a generation constrained by a JSON schema and
sampled (seeded, temperature > 0) with every penalty and a logit bias gives the same tokens
when the worker serving its last part is SIGKILLed mid-generation (the replica replays the
history) or drained (SIGTERM: the session's state moves to the replica) as an uninterrupted
run, and the text still parses under the schema.

Engine-level replay and hand-off of a grammar are tests/test_grammar.py's; here the grammar's
start, the penalties' token window and the bias must cross processes: the signalled worker is
a real ``trio-shard serve`` of the generated ``chat`` model (a tokenizer good enough for JSON),
the others (a replica of each part) are LlamaCppEngine workers in this process, checked
afterwards over the wire. A 2-part pipeline in client and chain relay, a whole-model hop
decoding in its worker's loop (as the pool behind the front door drives it), and the front
door itself with ``response_format`` json_schema. The token after which the signal comes is
drawn as in tests/test_failover_chaos.py (``SHARD_CHAOS_SEED``).

Every worker computes one position per llama.cpp forward pass (``ONE_ROW``: ``serve --batch 1
--max-sessions 1 --prefix-cache-tokens 0``, and the in-process ones loaded alike), so a replay's
prefill of the history gives the KV cells and logits the decode steps gave, bit for bit: the
steps' log-probabilities are compared exactly, and so can the sampled tokens be. With llama.cpp's
default batches a replay computes the history in one batch whose rounding differs from the
decode steps' (log-probabilities up to ~7e-4 apart with flash attention's F16 KV cache, ~1e-5
without, and already with ``--batch 2``): the grammar, the penalty window and the bias crossed
intact, yet a sampled draw near a boundary of its cumulative distribution (temperature 0.8 over
the flat tiny model) took the neighbouring token for about 1 ``SHARD_CHAOS_SEED`` in 6. A
batched replay's rounding is the engine's tolerance tests' (docs/engine.md: 1e-3 on
log-probabilities); here it would only hide what crosses processes.
"""

from __future__ import annotations

import math
import random
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import trio

from rpc_harness import Worker, worker
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.client import ShardClient
from shard.engine import LayerRange, LoadSpec
from shard.engine.llama import LlamaCppEngine
from shard.models import ensure_model, ensure_slice
from shard.pipeline import Pipeline
from shard.v1 import shard_pb2 as pb
from test_failover_chaos import CHAIN_AHEAD, SEED, STEP_TIMEOUT, TIMEOUT, Served, serve_process, where
from test_grammar import SCHEMA, Person
from test_pipeline import assert_all_free

PROMPT = "Answer in JSON:"
MAX_TOKENS = 400  # far more than the schema's longest answer: every run ends at its grammar's end
PLAIN: dict[str, Any] = dict(temperature=0.8, seed=7, grammar_kind="json_schema", grammar=SCHEMA)
#: The issue's case: sampled under the schema with every penalty over a window and a bias.
PENALIZED: dict[str, Any] = dict(PLAIN, repeat_penalty=1.3, presence_penalty=0.5,
                                 frequency_penalty=0.3, penalty_last_n=32,
                                 logit_bias={656: 2.0, 747: -math.inf})
HOW = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}
TOP = 8  # alternatives compared at every step
#: ``serve`` computing one position per forward pass. llama.cpp needs ``n_batch`` >= its
#: sequences (a worker aborts otherwise), hence one session and no prefix cache (module doc).
ONE_ROW = ("--batch", "1", "--max-sessions", "1", "--prefix-cache-tokens", "0")


@asynccontextmanager
async def one_row_workers(ranges: list[LayerRange], *, relay: bool) -> AsyncIterator[list[Worker]]:
    """In-process LlamaCppEngine workers of the ``chat`` model's ``ranges``, loaded as
    ``ONE_ROW`` loads a ``serve`` process (the same KV layout, so a session moves between
    them); ``relay``: each one relays routes (``serve --allow-relay``)."""
    from shard.relay import ChainRelay

    source = ensure_model("chat")
    async with AsyncExitStack() as stack:
        workers = []
        for lr in ranges:
            path = await trio.to_thread.run_sync(ensure_slice, source, lr)
            spec = LoadSpec(model_path=path, layer_range=lr, n_ctx=1024, max_sessions=1, n_batch=1,
                            n_threads=1)
            workers.append(await stack.enter_async_context(worker(
                engine=LlamaCppEngine(), load=spec, relay=ChainRelay() if relay else None)))
        yield workers


@asynccontextmanager
async def two_parts(relay: str) -> AsyncIterator[tuple[list[list[str]], Served, list[Worker]]]:
    """Part [0, 2) on two in-process workers; part [2, 4) on a ``serve`` process (first) and an
    in-process replica. Yields the hop lists, the process and the in-process workers."""
    chained = relay == "chain"
    extra = ("--allow-relay",) if chained else ()
    async with one_row_workers([LayerRange(0, 2), LayerRange(0, 2), LayerRange(2, 4)],
                               relay=chained) as (a, ar, b2), \
            serve_process("2:4", "--grace", "60", *ONE_ROW, *extra,
                          model=str(ensure_model("chat"))) as b1:
        yield [[a.target, ar.target], [b1.target, b2.target]], b1, [a, ar, b2]


def distributions(result: Any) -> list[tuple[float, list[tuple[int, float]]]]:
    """Each step's chosen log-probability and its ``TOP`` alternatives (the model's masked row)."""
    return [(s.logits.logprob, [(t.token_id, t.logprob) for t in s.logits.top])
            for s in result.steps]


async def text_of(target: str, tokens: list[int]) -> str:
    """The text of ``tokens``, as the first-shard worker at ``target`` spells them."""
    async with ShardClient.connect(target, timeout=TIMEOUT) as client:
        pieces = (await client.tokenize(tokens=tokens)).pieces
    return b"".join(pieces).decode("utf-8", errors="replace")


async def signalled_run(pipe: Pipeline, served: Served, how: str, case: str, *,
                        going_away: bool = False, ahead: bool = False) -> tuple[Any, Any]:
    """An uninterrupted run, then the same with ``how`` sent to ``served`` after a token drawn
    from the seed (and ``case``), at least one decode step before the end (``ahead``: the
    workers decode without the client and may be up to a credit window past ``on_token``, so
    ``CHAIN_AHEAD`` steps before); ``going_away``: wait until the pipeline saw a SIGTERM's
    GOAWAY (client relay: it then hands over at the next step). Returns both results."""
    want = await pipe.generate(PROMPT, max_tokens=MAX_TOKENS, top_logprobs=TOP, **PENALIZED)
    assert want.failovers == [] and want.finish_reason == pb.FINISH_REASON_EOG, want
    last = len(want.tokens) - (CHAIN_AHEAD if ahead else 1)
    at = random.Random(f"{SEED}-{how}-{case}").randrange(1, last)
    print(f"SHARD_CHAOS_SEED={SEED}: {how} after token {at} of {len(want.tokens)}")
    seen: list[int] = []

    async def on_token(step: pb.StepResult) -> None:
        seen.append(step.logits.token_id)
        if len(seen) == at:
            served.proc.send_signal(HOW[how])
            if going_away:
                client = pipe.replicas[-1][0].client
                assert client is not None
                with trio.fail_after(10):
                    while not client.going_away:
                        await trio.sleep(0.001)

    got = await pipe.generate(PROMPT, max_tokens=MAX_TOKENS, on_token=on_token,
                              top_logprobs=TOP, **PENALIZED)
    assert got.tokens == seen == want.tokens, where(how, at)
    # One-row passes (module doc): the replica's distributions are the killed worker's, bit
    # for bit, so a sampled token cannot tip over a boundary its rounding moved.
    assert len(distributions(want)) == len(want.tokens)
    assert distributions(got) == distributions(want), where(how, at)
    assert got.finish_reason == want.finish_reason, where(how, at)
    return want, got


async def after_signal(served: Served, how: str) -> None:
    """A drained worker exits 0 well within its grace (a killed one is gone already)."""
    if how == "SIGTERM":
        with trio.fail_after(20):  # grace 60 s: only the hand-off's close (or the end) ends it so soon
            assert await served.proc.wait() == 0, served.log.decode(errors="replace")


@pytest.mark.parametrize("relay", ["client", "chain"])
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
async def test_a_constrained_penalised_generation_survives_its_last_part_worker(
        how: str, relay: str) -> None:
    """SIGKILL: the last part's replica replays the history (its rows and ids; with chain
    relay the token log through the first part) and goes on choosing what the killed worker
    would have; SIGTERM: with client relay the session's state moves to the replica, with
    chain relay the draining worker finishes the generation it carries."""
    async with two_parts(relay) as (hops, b1, (a, ar, b2)):
        async with Pipeline.connect(hops, timeout=TIMEOUT, step_timeout=STEP_TIMEOUT,
                                    relay=relay) as pipe:
            plain = await pipe.generate(PROMPT, max_tokens=MAX_TOKENS, **PLAIN)
            want, got = await signalled_run(pipe, b1, how, relay, ahead=relay == "chain",
                                            going_away=how == "SIGTERM" and relay == "client")
        assert plain.tokens != want.tokens  # the penalties and the bias are in effect
        Person.model_validate_json(await text_of(a.target, got.tokens))  # keeps to the schema
        if how == "SIGTERM" and relay == "chain":
            assert got.failovers == []
        else:
            (f,) = got.failovers
            assert (f.hop, f.from_target, f.to_target) == (1, b1.target, b2.target)
            assert (f.reason, f.handover, f.moved) == (
                ("NOT_READY", False, False) if how == "SIGKILL" else ("DRAINING", True, True))
        await after_signal(b1, how)
        await assert_all_free([a, ar, b2])


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
async def test_a_whole_model_hop_decoding_in_its_workers_loop_keeps_the_constrained_tokens(
        how: str) -> None:
    """One hop of two whole-model ``serve`` processes (alike, so the one takes the other's
    states), decoding in the worker's loop as a pool drives it (``step_replicas`` False):
    SIGKILL replays the history on the replica, SIGTERM yields the generation between two
    tokens and moves its state."""
    chat = str(ensure_model("chat"))
    async with serve_process(None, "--grace", "60", *ONE_ROW, model=chat) as w1, \
            serve_process(None, "--grace", "60", *ONE_ROW, model=chat) as w2:
        async with Pipeline.connect([[w1.target, w2.target]], timeout=TIMEOUT,
                                    step_timeout=STEP_TIMEOUT) as pipe:
            pipe.step_replicas = False
            _, got = await signalled_run(pipe, w1, how, "whole", ahead=True)
        Person.model_validate_json(await text_of(w2.target, got.tokens))
        (f,) = got.failovers
        assert (f.from_target, f.to_target) == (w1.target, w2.target)
        assert (f.reason, f.moved) == (("NOT_READY", False) if how == "SIGKILL" else ("DRAINING", True))
        await after_signal(w1, how)
        await assert_all_free([w2])  # type: ignore[list-item]


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
async def test_a_json_schema_stream_through_the_door_survives_its_workers_end(how: str) -> None:
    """The front door as an operator runs it (``trio-shard api --workers A,B`` over two
    ``serve`` processes of the chat model, with ``ONE_ROW``: module doc): a streamed chat
    completion with ``response_format`` json_schema, sampled with penalties and a bias, whose
    worker is SIGKILLed (replayed on the other worker) or drained (SIGTERM: its state moves
    there) mid-stream streams the text the uninterrupted request gives, JSON that keeps to the
    schema."""
    import json
    import urllib.request

    from rpc_harness import api_process

    chat = str(ensure_model("chat"))
    async with serve_process(None, *ONE_ROW, model=chat) as a, \
            serve_process(None, *ONE_ROW, model=chat) as b, \
            api_process(["--workers", f"{a.target},{b.target}", "--probe-interval", "0.2"]) as door:

        def request(path: str, body: Any = None) -> Any:
            req = urllib.request.Request(door.url + path, data=body and json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            return urllib.request.urlopen(req, timeout=TIMEOUT)

        def ids() -> list[str]:
            with request("/v1/models") as resp:
                return [m["id"] for m in json.loads(resp.read())["data"]]

        (model,) = await trio.to_thread.run_sync(ids)
        body = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": 7,
                "presence_penalty": 0.5, "frequency_penalty": 0.3, "repeat_penalty": 1.3,
                "logit_bias": {"656": 2, "747": -100},
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "person", "schema": json.loads(SCHEMA)}}}
        killed: list[Served] = []

        def kill_the_serving_worker() -> None:
            """Both workers stopped at once; the one whose log shows a session open and not yet
            closed gets the signal (none: the generation ended first); both go on."""
            for w in (a, b):
                w.proc.send_signal(signal.SIGSTOP)
            for w in (a, b):
                if w.log.count(b"session open") > w.log.count(b"session close"):
                    w.proc.send_signal(HOW[how])
                    killed.append(w)
                w.proc.send_signal(signal.SIGCONT)

        def post(stream: bool) -> str:
            with request("/v1/chat/completions", {**body, "stream": stream}) as resp:
                if not stream:
                    return json.loads(resp.read())["choices"][0]["message"]["content"]
                text, chunks = "", 0
                for line in resp:
                    if line.startswith(b"data: {"):
                        text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                        chunks += 1
                        if chunks == 2 and not killed:
                            kill_the_serving_worker()
                return text

        want = await trio.to_thread.run_sync(post, False)
        Person.model_validate_json(want)
        for _ in range(5):  # (a loaded machine may read its second chunk after the last token)
            assert await trio.to_thread.run_sync(post, True) == want
            if killed:
                break
        assert len(killed) == 1, door.log.decode(errors="replace")
        done = b"failed over" if how == "SIGKILL" else b"moved the state of"
        assert done in door.log, door.log.decode(errors="replace")
        await after_signal(killed[0], how)
