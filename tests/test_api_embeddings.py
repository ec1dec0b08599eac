"""``POST /v1/embeddings`` through the door: OpenAI's input shapes and encodings (the official
client, which asks for base64 unless told otherwise), order and usage, ``dimensions``, bad input
refused with a 400 naming it while the worker stays healthy, a text model or a pipeline refused
as llama-server refuses, and a pool that routes to a worker serving the whole model.

Workers are FakeEngine workers of a model that declares mean pooling (tests/test_api.py's door),
and one llama.cpp worker of the generated ``embed`` model."""

from __future__ import annotations

import base64
import dataclasses
from contextlib import AsyncExitStack
from functools import partial
from typing import Any

import numpy as np
import openai
import pytest
import trio
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import worker
from test_api import HALVES, MODEL, NAME, _append, _sessions, front_door, in_thread, post
from test_pipeline import TIMEOUT
from test_pool import Listed, fleet, pool_of

from shard.api import Backend, Catalog, Limits, build_app, serve_http
from shard.engine import LayerRange, LoadSpec, ShardEngine
from shard.engine.fake import FakeScript, FakeStep
from shard.rpc.auth import TokenAuthenticator

POOLED = dataclasses.replace(MODEL, pooling_type="mean")


async def expected(engine: ShardEngine, item: str | list[int]) -> np.ndarray:
    """What the worker's engine computes for one input, tokenized as the worker does."""
    ids = engine.tokenize(item, parse_special=True) if isinstance(item, str) else item
    return await engine.embed(ids)


async def test_the_official_client_gets_floats_and_base64_alike_in_input_order() -> None:
    async with front_door(model=POOLED) as door:
        engine = door.workers[0].engine
        texts = ["hello world", "the quick brown fox", "hello world"]
        floats = await in_thread(lambda: door.client.embeddings.create(
            model=NAME, input=texts, encoding_format="float"))
        by_default = await in_thread(lambda: door.client.embeddings.create(model=NAME, input=texts))
        status, _, raw = await in_thread(lambda: post(door.url + "/v1/embeddings", {
            "input": texts, "encoding_format": "base64"}))
        want = [await expected(engine, t) for t in texts]
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == NAME
    for got, w in zip(floats.data, want):
        assert np.array_equal(np.array(got.embedding, dtype=np.float32), w)
    for a, b in zip(floats.data, by_default.data):  # the client decoded base64 itself
        assert np.array_equal(np.array(a.embedding, dtype=np.float32), np.array(b.embedding, dtype=np.float32))
    assert status == 200 and [d["object"] for d in raw["data"]] == ["embedding"] * 3
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]]
    assert all(np.array_equal(d, w) for d, w in zip(decoded, want))
    assert not np.allclose(want[0], want[1]) and np.array_equal(want[0], want[2])
    tokens = sum(1 + len(t.encode()) for t in texts)  # BOS and a byte per token (the fake's)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens


async def test_every_input_shape_and_the_model_size_as_dimensions() -> None:
    async with front_door(model=POOLED) as door:
        engine = door.workers[0].engine
        ids = list(engine.tokenize("hi there"))
        url = door.url + "/v1/embeddings"
        bodies: list[dict[str, Any]] = [
            {"input": "hi there"},
            {"input": ["hi there"]},
            {"input": ids},
            {"input": [ids, ids[:3]], "dimensions": POOLED.n_embd, "user": "u1"},
        ]
        answers = [await in_thread(partial(post, url, body)) for body in bodies]
        want, short = await expected(engine, ids), await expected(engine, ids[:3])
    for status, _, got in answers:
        assert status == 200, got
        assert np.array_equal(np.array(got["data"][0]["embedding"], dtype=np.float32), want)
        assert got["usage"]["prompt_tokens"] == len(ids) * len(got["data"]) - (
            len(ids) - 3 if len(got["data"]) == 2 else 0)
    assert np.array_equal(np.array(answers[-1][2]["data"][1]["embedding"], dtype=np.float32), short)


async def test_bad_input_is_a_400_naming_it_and_the_worker_stays_healthy() -> None:
    async with front_door(model=POOLED, session_ctx=64) as door:
        url = door.url + "/v1/embeddings"
        cases: list[tuple[dict[str, Any], str, str]] = [
            ({"input": ""}, "input", "input is empty"),
            ({"input": []}, "input", "must not be empty"),
            ({"input": ["ok", ""]}, "input", "input[1] is empty"),
            ({"input": [[1, 72], []]}, "input", "input[1] is empty"),
            ({"input": [1, 10_000]}, "input", "token ids must be in"),
            ({"input": [[1, 72], [1] * 65]}, "input", "input[1] holds 65 tokens"),
            ({"input": ["ok", "x" * 80]}, "input", "input 1: 81 tokens, more than the 64"),  # (the worker)
            ({"input": ["ok", 1]}, "input", ""),
            ({"input": "ok", "encoding_format": "hex"}, "encoding_format", ""),
            ({"input": "ok", "dimensions": 4}, "dimensions", f"have {POOLED.n_embd} dimensions"),
            ({"input": "ok", "dimensions": 0}, "dimensions", ""),
            ({"input": "ok", "frob": 1}, "frob", ""),
            ({"input": ["ok"] * 2049}, "input", "at most 2048"),
        ]
        for body, param, message in cases:
            status, _, got = await in_thread(partial(post, url, body))
            assert status == 400 and got["error"]["param"] == param, (body, got)
            assert message in got["error"]["message"], (message, got)
        status, _, got = await in_thread(partial(post, url, {"input": ["ok", "fine"]}))
        assert status == 200 and len(got["data"]) == 2
        health = await door.workers[0].engine.embed((1, 72))
        assert health.shape == (POOLED.n_embd,) and door.workers[0].engine.health().ready


async def test_a_text_model_and_a_pipeline_are_refused_as_llama_server_refuses() -> None:
    async with front_door() as door:  # the fake model declares no pooling type
        with pytest.raises(openai.BadRequestError) as text_model:
            await in_thread(lambda: door.client.embeddings.create(model=NAME, input="hello"))
        with pytest.raises(openai.NotFoundError):
            await in_thread(lambda: door.client.embeddings.create(model="nope", input="hello"))
    async with front_door(HALVES, model=POOLED) as door:
        with pytest.raises(openai.BadRequestError) as pipeline:
            await in_thread(lambda: door.client.embeddings.create(model=NAME, input="hello"))
        # The pipeline still generates.
        done = await in_thread(lambda: door.client.completions.create(model=NAME, prompt="hi", max_tokens=2))
        assert done.choices[0].finish_reason in ("length", "stop")
    body = text_model.value.body
    assert body["param"] == "model" and "pooling type 'none'" in body["message"]  # type: ignore[index]
    assert "not OAI compatible" in body["message"]  # type: ignore[index]
    body = pipeline.value.body
    assert body["param"] == "model" and "pipeline of 2 workers" in body["message"]  # type: ignore[index]


async def test_a_pool_embeds_on_a_worker_serving_the_whole_model() -> None:
    """A model served both as two halves and whole: the embedding goes to the whole one; a model
    served only in halves is refused."""
    layout = {"h0": (POOLED, LayerRange(0, 2), "e"), "h1": (POOLED, LayerRange(2, 4), "e"),
              "w": (POOLED, LayerRange(0, 4), "e"),
              "s0": (dataclasses.replace(POOLED, seed=9), LayerRange(0, 2), "split"),
              "s1": (dataclasses.replace(POOLED, seed=9), LayerRange(2, 4), "split")}
    async with fleet(layout) as f, pool_of(Listed(f.targets(*layout))) as pool, \
            trio.open_nursery() as nursery:
        shutdown = trio.Event()
        app = build_app(Catalog(pool=pool, timeout=TIMEOUT))
        url = (await nursery.start(partial(serve_http, app, host="127.0.0.1", port=0,
                                           shutdown=shutdown, grace=1.0)))[0]
        answers = [await in_thread(partial(post, url + "/v1/embeddings",
                                           {"model": "e", "input": ["hello", "there"]}))
                   for _ in range(3)]
        refused = await in_thread(partial(post, url + "/v1/embeddings",
                                          {"model": "split", "input": "hello"}))
        whole = f.workers["w"].engine
        want = [await expected(whole, t) for t in ("hello", "there")]
        shutdown.set()
    for status, _, got in answers:
        assert status == 200
        assert all(np.array_equal(np.array(d["embedding"], dtype=np.float32), w)
                   for d, w in zip(got["data"], want))
    status, _, got = refused
    assert status == 400 and got["error"]["param"] == "model"
    assert "served as a pipeline only" in got["error"]["message"]


async def test_a_llama_worker_of_the_embed_model_through_the_door() -> None:
    """The real path: llama.cpp's embedding context behind the door, floats equal to base64,
    and the engine's own embedding of the same ids."""
    from shard.engine.llama import LlamaCppEngine
    from shard.models import ensure_model

    spec = LoadSpec(model_path=ensure_model("embed"), n_ctx=512, max_sessions=2, n_threads=1)
    texts = ["the quick brown fox", "hello world"]
    async with AsyncExitStack() as stack:
        w = await stack.enter_async_context(worker(engine=LlamaCppEngine(), load=spec))
        backend = await stack.enter_async_context(Backend.connect([[w.target]], model_id="embed",
                                                                  timeout=TIMEOUT))
        nursery = await stack.enter_async_context(trio.open_nursery())
        shutdown = trio.Event()
        url = (await nursery.start(partial(serve_http, build_app(backend), host="127.0.0.1",
                                           port=0, shutdown=shutdown, grace=1.0)))[0]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
        try:
            floats = await in_thread(lambda: client.embeddings.create(
                model="embed", input=texts, encoding_format="float"))
            b64 = await in_thread(lambda: client.embeddings.create(model="embed", input=texts))
            ids = [w.engine.tokenize(t, parse_special=True) for t in texts]
            want = [await w.engine.embed(i) for i in ids]
        finally:
            client.close()
            shutdown.set()
    got = [np.array(d.embedding, dtype=np.float32) for d in floats.data]
    assert all(np.array_equal(g, x) for g, x in zip(got, want)) and got[0].shape == (64,)
    assert all(np.array_equal(a, np.array(b.embedding, dtype=np.float32)) for a, b in zip(got, b64.data))
    assert not np.allclose(got[0], got[1], atol=1e-3)
    assert floats.usage.prompt_tokens == sum(len(i) for i in ids)


async def test_a_keys_embeddings_count_against_its_requests_per_key(tmp_path: Any) -> None:
    """``requests_per_key`` bounds a key's embeddings as its generations: while one of alice's
    generations runs (held at its first step), her embedding is a 429 and bob's is answered."""
    keys_file = tmp_path / "keys"
    keys_file.write_text("sk-a alice\nsk-b bob\n")
    gate = trio.Event()

    async def hold(step: FakeStep) -> None:
        await gate.wait()

    async with front_door(model=POOLED, keys=TokenAuthenticator(keys_file),
                          script=FakeScript(on_step=hold),
                          limits=Limits(requests_per_key=1)) as door:
        def as_key(key: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
            return post(door.url + path, body, headers={"authorization": f"Bearer {key}"})

        embed = {"model": NAME, "input": "hello", "encoding_format": "float"}
        async with trio.open_nursery() as nursery:
            first: list[Any] = []
            nursery.start_soon(lambda: _append(first, in_thread(partial(
                as_key, "sk-a", "/v1/completions", {"model": NAME, "prompt": "a", "max_tokens": 2}))))
            try:  # (the held generation is let go whatever is asserted)
                with trio.fail_after(10):
                    while await _sessions(door.workers[0]) == 0:
                        await trio.sleep(0.01)
                status, _, got = await in_thread(partial(as_key, "sk-a", "/v1/embeddings", embed))
                assert status == 429 and got["error"]["code"] == "too_many_requests_for_key", got
                status, _, got = await in_thread(partial(as_key, "sk-b", "/v1/embeddings", embed))
                assert status == 200 and len(got["data"]) == 1, got
            finally:
                gate.set()
        assert first[0][0] == 200
        status, _, got = await in_thread(partial(as_key, "sk-a", "/v1/embeddings", embed))
        assert status == 200, got  # alice's slot came back
