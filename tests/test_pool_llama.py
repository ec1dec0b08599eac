"""A pool of live llama.cpp workers (``shard.pool``; tests/test_pool.py has the rules and the
fake-engine cases): two models side by side, greedy tokens equal to each whole model's, a replica
killed mid-generation, and the official openai client chatting with the packaged instruct model
(SmolLM2 135M Instruct) through the front door, whole and through a 2-part pool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from rpc_harness import Worker, in_thread, worker
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.api import Backend, Catalog, build_app, serve_http
from shard.engine import LayerRange, LoadSpec
from shard.engine.llama import LlamaCppEngine
from shard.models import ensure_model, ensure_slice
from shard.models.plan import plan_parts
from shard.models.real import ensure_real_model, packaged_name
from shard.pool import Pool
from test_pipeline import TIMEOUT, assert_all_free, whole_model_steps
from test_pool import Listed

PROMPT = "hello world, this is a pool"
N_TOKENS = 24
CHAT = "smollm2-135m-instruct"


@asynccontextmanager
async def llama_fleet(
    layout: Sequence[tuple[Path, LayerRange | None, str]], *, max_sessions: int = 4,
    session_ctx: int = 512,
) -> AsyncIterator[list[Worker]]:
    """One LlamaCppEngine worker per (model file, range or None for whole, model name)."""
    async with AsyncExitStack() as stack:
        workers = []
        for path, lr, name in layout:
            served = path if lr is None else await trio.to_thread.run_sync(ensure_slice, path, lr)
            spec = LoadSpec(model_path=served, layer_range=lr, n_ctx=session_ctx * max_sessions,
                            max_sessions=max_sessions, n_threads=1)
            workers.append(await stack.enter_async_context(
                worker(engine=LlamaCppEngine(), load=spec, model_name=name)))
        yield workers


async def greedy(target: str, prompt: str = PROMPT) -> list[int]:
    steps = await whole_model_steps(target, prompt, max_tokens=N_TOKENS, ignore_eos=True)
    return [s.logits.token_id for s in steps]


async def via_pool(pool: Pool, model: str, on_token: Any = None,
                   failovers: list[Any] | None = None) -> list[int]:
    async with pool.lease(model) as lease:
        result = await lease.pipeline.generate(
            PROMPT, max_tokens=N_TOKENS, ignore_eos=True, route=lease.route, timeout=TIMEOUT,
            on_token=on_token)
    if failovers is not None:
        failovers.extend(result.failovers)
    return result.tokens


async def test_a_llama_pool_of_five_serves_two_models_and_survives_a_killed_replica() -> None:
    tiny, chat = ensure_model("tiny"), ensure_model("chat")
    halves = [p.layers for p in plan_parts(tiny, 2)]
    assert halves == [LayerRange(0, 2), LayerRange(2, 4)]
    layout = [(tiny, halves[0], "a"), (tiny, halves[0], "a"), (tiny, halves[1], "a"),
              (tiny, halves[1], "a"), (chat, None, "b")]
    async with llama_fleet([(tiny, None, ""), (chat, None, "")]) as (ref_a, ref_b):
        want_a, want_b = await greedy(ref_a.target), await greedy(ref_b.target)
    async with llama_fleet(layout) as ws, Pool.open(
            Listed([w.target for w in ws]), probe_interval=0.1) as pool:
        await pool.settle(TIMEOUT)
        assert sorted(pool.servable()) == ["a", "b"]
        assert await via_pool(pool, "b") == want_b
        got: list[list[int]] = []
        moved: list[Any] = []
        seen = [0]

        def count(_: Any) -> None:
            seen[0] += 1
            if seen[0] == 2 * N_TOKENS:  # half-way through the four generations
                ws[2].stop()  # a replica of the second hop: two of the four run on it

        async def one() -> None:
            got.append(await via_pool(pool, "a", count, moved))

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(one)
        assert got == [want_a] * 4
        assert len(moved) == 2 and {f.hop for f in moved} == {1}  # both moved off it
        assert await via_pool(pool, "a") == want_a
        await assert_all_free([ws[i] for i in (0, 1, 3, 4)])


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return ensure_real_model(CHAT)


@pytest.mark.parametrize("where", ["whole", "pool"])
async def test_the_openai_client_chats_with_the_packaged_instruct_model(
        smollm2: Path, where: str) -> None:
    name = packaged_name(CHAT)
    assert name == CHAT  # what `serve --model smollm2-135m-instruct` reports by default
    question = [{"role": "user", "content": "What is 2+2?"}]
    async with AsyncExitStack() as stack:
        if where == "whole":
            (w,) = await stack.enter_async_context(llama_fleet([(smollm2, None, name)]))
            backend = await stack.enter_async_context(Backend.connect([[w.target]], timeout=TIMEOUT))
            served: Backend | Catalog = backend
        else:
            parts = [p.layers for p in plan_parts(smollm2, 2)]
            workers = await stack.enter_async_context(llama_fleet([(smollm2, lr, name) for lr in parts]))
            pool = await stack.enter_async_context(
                Pool.open(Listed([w.target for w in workers]), probe_interval=0.2))
            await pool.settle(TIMEOUT)
            served = Catalog(pool=pool, timeout=TIMEOUT)
        nursery = await stack.enter_async_context(trio.open_nursery())
        shutdown = trio.Event()
        url = (await nursery.start(partial(serve_http, build_app(served), host="127.0.0.1",
                                           port=0, shutdown=shutdown, grace=1.0)))[0]
        client = stack.enter_context(openai.OpenAI(
            base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT))

        def chat() -> tuple[list[str], str, str, str | None]:
            ids = [m.id for m in client.models.list()]
            whole = client.chat.completions.create(model=CHAT, messages=question, max_tokens=32,
                                                   temperature=0)
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=CHAT, messages=question, max_tokens=32, temperature=0, stream=True)
                if c.choices)
            return ids, whole.choices[0].message.content or "", streamed, whole.choices[0].finish_reason

        ids, text, streamed, finish = await in_thread(chat)
        assert ids == [CHAT]
        assert text == streamed and "4" in text and finish == "stop", text
        shutdown.set()
