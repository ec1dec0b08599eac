"""Fuzzing the front door's request bodies (hypothesis): whatever JSON a client sends, the
answer is a success or a structured OpenAI error with a 4xx status, never a 500 or a hang, and
afterwards the door is healthy and every worker session is free.

The front door and its worker run in a Trio loop of their own in a thread (hypothesis drives
plain functions), for the whole module.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_api import NAME, front_door, get, post

from shard.client import ShardClient

ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
NUMBERS = st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.sampled_from([0, 1, 2, 16, 20, 21])
PARAMS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from([NAME, "", "other"]) | st.text(max_size=10),
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 300), max_size=8)
    | st.lists(st.text(max_size=5), max_size=3) | ANY_JSON,
    "max_tokens": NUMBERS, "temperature": NUMBERS, "top_p": NUMBERS, "n": NUMBERS,
    "seed": NUMBERS, "logprobs": NUMBERS, "stop": st.text(max_size=4) | st.lists(st.text(max_size=3), max_size=6),
    "echo": ANY_JSON, "user": ANY_JSON, "presence_penalty": NUMBERS, "logit_bias": ANY_JSON,
    "stream_options": ANY_JSON, "unknown_field": ANY_JSON,
}


#: Values the front door must take (a huge max_tokens ends at the context, a negative seed is
#: taken modulo 2**64): a body of these with at most one fuzzed parameter reaches the workers.
VALID: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(1, 6) | st.integers(2**31, 2**70),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "seed": st.integers(-(2**63), 2**64 - 1), "logprobs": st.integers(0, 20),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=4), "user": st.text(max_size=8),
    "prompt": st.text(min_size=1, max_size=40) | st.lists(st.integers(3, 258), min_size=1, max_size=8),
}


@st.composite
def bodies(draw: st.DrawFn) -> Any:
    mode = draw(st.integers(0, 9))
    if mode == 0:
        return draw(ANY_JSON)  # not even an object, sometimes
    if mode <= 5:  # valid, but for at most one parameter
        body = {"model": NAME, "prompt": "hello"}
        body.update({k: draw(VALID[k]) for k in draw(st.sets(st.sampled_from(sorted(VALID))))})
        if draw(st.booleans()):
            key = draw(st.sampled_from(sorted(PARAMS)))
            body[key] = draw(PARAMS[key])
        return body
    keys = draw(st.sets(st.sampled_from(sorted(PARAMS)), max_size=len(PARAMS)))
    body = {k: draw(PARAMS[k]) for k in keys}
    body.setdefault("model", NAME)
    if draw(st.booleans()):
        body.setdefault("prompt", "hello")
    body["max_tokens"] = body.get("max_tokens", 2) if draw(st.booleans()) else 2
    return body


@pytest.fixture(scope="module")
def door() -> Iterator[tuple[str, list[str]]]:
    """The front door's URL and its worker's target, served from a thread."""
    started: queue.Queue[tuple[str, list[str]]] = queue.Queue()
    stop: dict[str, Any] = {}

    async def main() -> None:
        async with front_door(max_sessions=2) as d:
            stop["event"] = trio.Event()
            stop["token"] = trio.lowlevel.current_trio_token()
            started.put((d.url, [w.target for w in d.workers]))
            await stop["event"].wait()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    yield started.get(timeout=60)
    trio.from_thread.run_sync(stop["event"].set, trio_token=stop["token"])
    thread.join(60)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies())
def test_any_body_gets_a_structured_answer(door: tuple[str, list[str]], body: Any) -> None:
    url, _ = door
    body.pop("stream", None) if isinstance(body, dict) else None
    status, _, answer = post(url + "/v1/completions", body)
    assert status in (200, 400, 404, 413, 429), (status, body, answer)
    if status == 200:
        assert answer["choices"][0]["finish_reason"] in ("stop", "length"), answer
    else:
        assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
        assert answer["error"]["message"]


def test_the_door_is_healthy_and_every_session_free_afterwards(door: tuple[str, list[str]]) -> None:
    url, targets = door
    assert get(url + "/health")[0] == 200

    async def sessions() -> list[int]:
        out = []
        for target in targets:
            async with ShardClient.connect(target, timeout=10) as client:
                m = await client.metrics()
                out.append(m.engine["sessions_active"] + m.engine["kv_cells_used"])
        return out

    assert trio.run(sessions) == [0] * len(targets)
    status, body = get(url + "/metrics")
    assert status == 200 and b'status="500"' not in body, json.dumps(body.decode()[-500:])
