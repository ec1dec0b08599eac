"""The rest of the door's surface that clients and UIs touch, as llama-server and OpenAI's API
offer it: a request without ``model``, ``system_fingerprint``, the chat stream's opening role
chunk, CORS for the operator's origins, several prompts in one completions request, ``echo``,
the context length in ``/v1/models`` and a clear refusal of ``/v1/embeddings``.

Through the official ``openai`` client where it can say it, plain HTTP otherwise (a request
without ``model``, preflights). Workers are FakeEngine workers (tests/test_api.py's door).
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
import trio
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from test_api import HALVES, MESSAGES, NAME, direct_text, front_door, in_thread, post, rendered
from test_pipeline import TIMEOUT, assert_all_free
from test_pool import A, B, Listed, fleet, pool_of

from shard.api import Catalog, Limits, build_app, serve_http
from shard.api.cors import parse_origins
from shard.api.replies import system_fingerprint
from shard.cli import build_parser
from shard.client import ShardClient
from shard.engine import LayerRange
from shard.engine.fake import FakeScript
from shard.rpc.errors import ErrorCode, ShardError

ORIGIN = "http://ui.example:3000"


def request(url: str, method: str, path: str, *, body: Any = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request with http.client (any method): (status, lower-case headers, body)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT)
    try:
        data = None if body is None else json.dumps(body).encode()
        sent = {"content-type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers={**sent, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def events(raw: bytes) -> list[dict[str, Any]]:
    """The JSON events of a server-sent event stream (``[DONE]`` and comments left out)."""
    return [json.loads(line[6:]) for line in raw.decode().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# ---- model, fingerprint, the opening chunk -----------------------------------------------


async def test_a_request_without_model_gets_the_one_served_and_an_unknown_one_is_404() -> None:
    async with front_door() as door:
        want, _ = await direct_text(door, "hello", max_tokens=4, temperature=0.0)
        url = door.url + "/v1/completions"
        status, _, got = await in_thread(lambda: post(url, {"prompt": "hello", "max_tokens": 4,
                                                            "temperature": 0}))
        assert status == 200 and got["model"] == NAME and got["choices"][0]["text"] == want
        status, _, got = await in_thread(lambda: post(
            door.url + "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}))
        assert status == 200 and got["model"] == NAME
        status, _, got = await in_thread(lambda: post(url, {"model": None, "prompt": "hi"}))
        assert status == 200 and got["model"] == NAME
        status, _, got = await in_thread(lambda: post(url, {"model": "gpt-4", "prompt": "hi"}))
        assert status == 404 and got["error"]["code"] == "model_not_found"


async def test_over_a_pool_of_two_models_a_request_must_name_one() -> None:
    layout = {"w1": (A, LayerRange(0, 4), "a"), "w2": (B, LayerRange(0, 4), "b")}
    async with fleet(layout) as f, pool_of(Listed(f.targets("w1", "w2"))) as pool, \
            trio.open_nursery() as nursery:
        shutdown = trio.Event()
        app = build_app(Catalog(pool=pool, timeout=TIMEOUT))
        url = (await nursery.start(partial(serve_http, app, host="127.0.0.1", port=0,
                                           shutdown=shutdown, grace=1.0)))[0]
        body = {"prompt": "hi", "max_tokens": 2}
        status, _, got = await in_thread(lambda: post(url + "/v1/completions", body))
        assert status == 400 and got["error"]["param"] == "model"
        assert "'a', 'b'" in got["error"]["message"]
        status, _, got = await in_thread(lambda: post(url + "/v1/completions",
                                                      {**body, "model": "b"}))
        assert status == 200 and got["model"] == "b"
        status, _, got = await in_thread(lambda: post(url + "/tokenize",
                                                      {"content": "hi", "model": "a"}))
        assert status == 200 and got == {"tokens": [3 + ord("h"), 3 + ord("i")]}
        shutdown.set()


async def test_every_reply_and_chunk_carries_the_system_fingerprint() -> None:
    async with front_door() as door:
        want = system_fingerprint(door.backend.first.model_fingerprint)

        def calls() -> list[Any]:
            c = door.client
            return [c.completions.create(model=NAME, prompt="hi", max_tokens=3),
                    c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=3),
                    *c.completions.create(model=NAME, prompt="hi", max_tokens=3, stream=True,
                                          stream_options={"include_usage": True}),
                    *c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=3,
                                               stream=True, stream_options={"include_usage": True})]

        replies = await in_thread(calls)
    assert re.fullmatch(r"fp_[0-9a-f]{12}", want)
    assert len(replies) > 6 and {r.system_fingerprint for r in replies} == {want}
    # another model (or another version of the door) is another fingerprint
    assert system_fingerprint(door.backend.first.model_fingerprint + "0") != want


async def test_a_chat_stream_opens_with_the_role_alone() -> None:
    async with front_door() as door:
        want, _ = await direct_text(door, rendered(), max_tokens=6, temperature=0.0)
        body = {"model": NAME, "messages": MESSAGES, "max_tokens": 6, "temperature": 0,
                "stream": True}
        status, _, raw = await in_thread(lambda: request(door.url, "POST", "/v1/chat/completions",
                                                         body=body))
        chunks = await in_thread(lambda: list(door.client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=6, temperature=0, stream=True)))
    assert status == 200
    first, *rest = events(raw)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in e["choices"][0]["delta"] for e in rest)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in rest) == want
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


# ---- CORS --------------------------------------------------------------------------------


async def test_cors_answers_preflights_for_the_listed_origins_only() -> None:
    async with front_door(cors_origins=[ORIGIN]) as door:
        preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"}
        status, headers, raw = await in_thread(lambda: request(
            door.url, "OPTIONS", "/v1/chat/completions", headers=preflight))
        assert status == 204 and raw == b""
        assert headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in headers["access-control-allow-methods"]
        assert "authorization" in headers["access-control-allow-headers"]
        status, headers, raw = await in_thread(lambda: request(
            door.url, "OPTIONS", "/v1/chat/completions",
            headers={**preflight, "Origin": "http://evil.example"}))
        assert status == 403 and "access-control-allow-origin" not in headers
        assert json.loads(raw)["error"]["code"] == "origin_not_allowed"
        body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
        for stream in (False, True):
            status, headers, raw = await in_thread(lambda s=stream: request(
                door.url, "POST", "/v1/completions", body={**body, "stream": s},
                headers={"Origin": ORIGIN}))
            assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
            assert "retry-after" in headers["access-control-expose-headers"].lower()
        status, headers, _ = await in_thread(lambda: request(
            door.url, "GET", "/v1/models", headers={"Origin": "http://evil.example"}))
        assert status == 200 and "access-control-allow-origin" not in headers
        status, headers, _ = await in_thread(lambda: request(
            door.url, "POST", "/v1/completions", body={**body, "model": "nope"},
            headers={"Origin": ORIGIN}))  # refusals are readable too
        assert status == 404 and headers["access-control-allow-origin"] == ORIGIN


async def test_without_cors_origins_no_preflight_is_answered() -> None:
    async with front_door() as door:
        status, headers, _ = await in_thread(lambda: request(
            door.url, "OPTIONS", "/v1/completions",
            headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}))
        assert status == 405 and "access-control-allow-origin" not in headers
        status, headers, _ = await in_thread(lambda: request(
            door.url, "GET", "/v1/models", headers={"Origin": ORIGIN}))
        assert status == 200 and "access-control-allow-origin" not in headers


def test_cors_origin_option_repeats_takes_lists_and_its_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    args: argparse.Namespace = build_parser().parse_args(
        ["api", "--cors-origin", "http://a:1,https://b", "--cors-origin", "*"])
    assert args.cors_origin == ["http://a:1", "https://b", "*"]
    assert build_parser().parse_args(["api"]).cors_origin == []
    monkeypatch.setenv("TRIO_SHARD_API_CORS_ORIGIN", "http://env:8080/")
    assert build_parser().parse_args(["api"]).cors_origin == ["http://env:8080"]
    assert build_parser().parse_args(["api", "--cors-origin", "http://x"]).cors_origin == ["http://x"]
    for bad in ("ui.example", "http://a/path", "ftp://a", ","):
        with pytest.raises(ValueError):
            parse_origins(bad)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["api", "--cors-origin", "http://a/b"])


# ---- several prompts, echo ---------------------------------------------------------------


@pytest.mark.parametrize("shape", ["whole", "pipeline"])
async def test_several_prompts_get_one_choice_each_with_usage_summed(shape: str) -> None:
    ranges = [None] if shape == "whole" else HALVES
    prompts = ["hello world", "something else", "x"]
    async with front_door(ranges) as door:
        wants = [(await direct_text(door, p, max_tokens=5, seed=3, temperature=0.8))[0]
                 for p in prompts]
        id_wants = [(await direct_text(door, p, max_tokens=3, temperature=0.0))[0]
                    for p in ([5, 6, 7], [9])]

        def calls() -> tuple[Any, list[Any], Any]:
            c = door.client
            whole = c.completions.create(model=NAME, prompt=prompts, max_tokens=5, seed=3,
                                         temperature=0.8)
            chunks = list(c.completions.create(
                model=NAME, prompt=prompts, max_tokens=5, seed=3, temperature=0.8, stream=True,
                stream_options={"include_usage": True}))
            ids = c.completions.create(model=NAME, prompt=[[5, 6, 7], [9]], max_tokens=3,
                                       temperature=0, logprobs=0)
            return whole, chunks, ids

        whole, chunks, ids = await in_thread(calls)
        await assert_all_free(door.workers)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == wants
    assert whole.usage.prompt_tokens == sum(len(p) + 1 for p in prompts)  # bytes + BOS each
    assert whole.usage.completion_tokens == 15
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)]
    assert streamed == wants
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert [len(c.logprobs.tokens) for c in ids.choices] == [3, 3]
    assert ids.usage.prompt_tokens == 3 + 1 and ids.usage.completion_tokens == 6
    assert [c.index for c in ids.choices] == [0, 1]
    assert [c.text for c in ids.choices] == id_wants


async def test_several_prompts_run_at_once_and_queue_past_the_sessions() -> None:
    """Two prompts' texts interleave in the stream (each its own generation, at once); with
    one session, three prompts still all complete, waiting in the model's queue."""
    slow = FakeScript(step_latency=0.01)
    async with front_door(script=slow) as door:
        chunks = await in_thread(lambda: list(door.client.completions.create(
            model=NAME, prompt=["hello", "world"], max_tokens=12, temperature=0, stream=True)))
    order = [c.choices[0].index for c in chunks if c.choices and c.choices[0].text]
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)  # 1 starts before 0 ends
    async with front_door(max_sessions=1, limits=Limits(queue_length=4)) as door:
        got = await in_thread(lambda: door.client.completions.create(
            model=NAME, prompt=["a", "b", "c"], max_tokens=3, temperature=0))
        assert [c.index for c in got.choices] == [0, 1, 2]
        assert got.usage.completion_tokens == 9
        await assert_all_free(door.workers)


async def test_one_failing_prompt_fails_the_request_and_frees_the_others() -> None:
    async with front_door(script=FakeScript(step_latency=0.005)) as door:
        body = {"model": NAME, "prompt": ["hello", "x" * 3000], "max_tokens": 50}
        status, _, got = await in_thread(lambda: post(door.url + "/v1/completions", body))
        assert status == 400 and got["error"]["code"] == "context_length_exceeded"
        await assert_all_free(door.workers)


async def test_echo_prefixes_the_prompt_text() -> None:
    async with front_door() as door:
        want, _ = await direct_text(door, "hello", max_tokens=4, temperature=0.0)

        def calls() -> tuple[Any, list[Any]]:
            c = door.client
            return (c.completions.create(model=NAME, prompt=["hello", "hello"], max_tokens=4,
                                         temperature=0, echo=True),
                    list(c.completions.create(model=NAME, prompt="hello", max_tokens=4,
                                              temperature=0, echo=True, stream=True)))

        whole, chunks = await in_thread(calls)
    assert [c.text for c in whole.choices] == ["hello" + want] * 2
    assert chunks[0].choices[0].text == "hello"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "hello" + want
    # (echo with logprobs: tests/test_api_echo.py)


# ---- models, embeddings ------------------------------------------------------------------


async def test_models_show_the_context_length() -> None:
    async with front_door(max_sessions=2) as door:
        listed, one = await in_thread(lambda: (door.client.models.list().data,
                                               door.client.models.retrieve(NAME)))
        context = door.backend.context
    assert context == 512  # n_ctx 2 * 512 over 2 sessions
    assert [m.model_extra["context_length"] for m in listed] == [context]
    assert one.model_extra["context_length"] == context


async def test_embeddings_are_refused_with_a_clear_reason() -> None:
    async with front_door() as door:
        with pytest.raises(openai.BadRequestError) as refused:
            await in_thread(lambda: door.client.embeddings.create(model=NAME, input="hello"))
        with pytest.raises(openai.NotFoundError):
            await in_thread(lambda: door.client.embeddings.create(model="nope", input="hello"))
        status, _, got = await in_thread(lambda: post(door.url + "/v1/embeddings",
                                                      {"input": ["a"], "frob": 1}))
        assert status == 400 and got["error"]["param"] == "frob"
    assert refused.value.body["param"] == "model"  # type: ignore[index]
    assert "pooling type 'none'" in refused.value.body["message"]  # type: ignore[index]


# ---- the Responses API -------------------------------------------------------------------


async def test_responses_text_in_text_out_whole_and_streamed() -> None:
    conversation = [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hello there"}]
    async with front_door() as door:
        want, _ = await direct_text(door, rendered(conversation), max_tokens=6, temperature=0.0)
        short, _ = await direct_text(door, rendered(conversation), max_tokens=2, temperature=0.0)

        def calls() -> tuple[Any, list[Any], Any]:
            c = door.client
            whole = c.responses.create(model=NAME, instructions="be brief", input="hello there",
                                       max_output_tokens=6, temperature=0)
            events_ = list(c.responses.create(
                model=NAME, input=[{"role": "developer", "content": "be brief"},
                                   {"role": "user", "content": [
                                       {"type": "input_text", "text": "hello there"}]}],
                max_output_tokens=2, temperature=0, stream=True))
            with_tools = None
            try:
                c.responses.create(model=NAME, input="hi", tools=[{"type": "web_search_preview"}])
            except openai.BadRequestError as err:
                with_tools = err.body
            return whole, events_, with_tools

        whole, streamed, with_tools = await in_thread(calls)
        status, _, raw = await in_thread(lambda: request(
            door.url, "POST", "/v1/responses",
            body={"input": "hello there", "instructions": "be brief", "stream": True,
                  "max_output_tokens": 6, "temperature": 0}))
        await assert_all_free(door.workers)
    assert whole.output_text == want and whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 6 and whole.usage.input_tokens > 0
    kinds = [e.type for e in streamed]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == short
    assert streamed[-1].response.output_text == short
    assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
    assert with_tools is not None and with_tools["param"] == "tools"
    lines = raw.decode().splitlines()
    named = [line[7:] for line in lines if line.startswith("event: ")]
    assert status == 200 and named[0] == "response.created" and named[-1] == "response.incomplete"
    assert [e["type"] for e in events(raw)] == named


# ---- /tokenize and /detokenize (the worker's Tokenize RPC) --------------------------------


async def test_the_tokenize_rpc_answers_a_first_shard_and_bounds_its_input() -> None:
    async with front_door(HALVES) as door:
        first, last = door.workers
        async with ShardClient.connect(first.target, timeout=TIMEOUT) as client:
            ids = (await client.tokenize("hi", add_bos=True)).tokens
            pieces = await client.tokenize(tokens=list(ids))
            with_pieces = await client.tokenize("hi", add_bos=False, with_pieces=True)
            with pytest.raises(ShardError) as too_many:
                await client.tokenize(tokens=[5] * 513)
            with pytest.raises(ShardError) as outside:
                await client.tokenize(tokens=[10**6])
        async with ShardClient.connect(last.target, timeout=TIMEOUT) as client:
            with pytest.raises(ShardError) as not_first:
                await client.tokenize("hi")
    assert list(ids) == [1, 3 + ord("h"), 3 + ord("i")]  # the fake vocabulary: BOS, bytes + 3
    assert b"".join(pieces.pieces[1:]) == b"hi" and list(pieces.tokens) == list(ids)
    assert list(with_pieces.pieces) == [b"h", b"i"]
    assert too_many.value.code is ErrorCode.INVALID_ARGUMENT
    assert outside.value.code is ErrorCode.INVALID_ARGUMENT
    assert not_first.value.code is not ErrorCode.INVALID_ARGUMENT and "first" in str(not_first.value)


async def test_tokenize_and_detokenize_in_llama_servers_shapes() -> None:
    async with front_door(HALVES) as door:
        url = door.url

        def calls() -> list[tuple[int, dict[str, str], Any]]:
            return [post(url + "/tokenize", {"content": "héllo"}),
                    post(url + "/tokenize", {"content": "hé", "add_special": True,
                                             "with_pieces": True}),
                    post(url + "/detokenize", {"tokens": [3 + b for b in "héllo".encode()]}),
                    post(url + "/detokenize", {"tokens": []}),
                    post(url + "/detokenize", {"tokens": [10**6]}),
                    post(url + "/tokenize", {"content": "x" * 3000}),
                    post(url + "/tokenize", {"content": "hi", "text": "hi"}),
                    post(url + "/tokenize", {"content": "hi", "model": "nope"})]

        got = await in_thread(calls)
    plain, pieces, back, empty, outside, long, unknown, model = got
    assert plain[0] == 200 and plain[2] == {"tokens": [3 + b for b in "héllo".encode()]}
    e_acute = list("é".encode())
    assert pieces[2] == {"tokens": [{"id": 1, "piece": pieces[2]["tokens"][0]["piece"]},
                                    {"id": 3 + ord("h"), "piece": "h"},
                                    {"id": 3 + e_acute[0], "piece": [e_acute[0]]},
                                    {"id": 3 + e_acute[1], "piece": [e_acute[1]]}]}
    assert back[2] == {"content": "héllo"} and empty[2] == {"content": ""}
    assert outside[0] == 400 and outside[2]["error"]["param"] == "tokens"
    assert long[0] == 400 and long[2]["error"]["param"] == "content"
    assert unknown[0] == 400 and unknown[2]["error"]["param"] == "text"
    assert model[0] == 404


async def test_tokenize_on_the_llama_engine_parses_special_texts_and_round_trips() -> None:
    """The chat test model's ChatML markers: one control token each when parsed, plain text
    otherwise; ids back to bytes give the text again (control tokens have none)."""
    from rpc_harness import worker

    from shard.engine import LoadSpec
    from shard.engine.llama import LlamaCppEngine
    from shard.models import ensure_model

    spec = LoadSpec(model_path=ensure_model("chat"), n_ctx=512, max_sessions=1, n_threads=1)
    text = "<|im_start|>user hi there<|im_end|>"
    async with worker(engine=LlamaCppEngine(), load=spec) as w, \
            ShardClient.connect(w.target, timeout=TIMEOUT) as client:
        parsed = await client.tokenize(text, add_bos=False, parse_special=True, with_pieces=True)
        plain = await client.tokenize(text, add_bos=False, parse_special=False)
        back = await client.tokenize(tokens=list(plain.tokens))
    assert len(parsed.tokens) < len(plain.tokens)
    # a control token has no bytes (as in generated text): only the message's words remain
    assert b"".join(parsed.pieces).decode().strip() == "user hi there"
    assert b"".join(back.pieces).decode().removeprefix(" ") == text  # the tokenizer's space
