"""``n`` and ``best_of`` at the front door: the prompt prefilled once (the workers' counters
show it) and forked on every hop, one choice per session; greedy choices equal, seeded ones
reproducible; streams interleave choices by ``index``; ``best_of`` returns the choices of
highest summed log-probability; too many choices for the route's sessions are refused."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest
import trio

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from test_api import HALVES, MESSAGES, NAME, front_door, in_thread, post
from test_pipeline import assert_all_free

SHAPES = {"whole": ([None], "client"), "pipeline": (HALVES, "client"), "chain": (HALVES, "chain")}
PROMPT = "the quick brown fox"


def texts(body: dict[str, Any]) -> list[str]:
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(len(choices)))
    return [c["text"] if "text" in c else c["message"]["content"] for c in choices]


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_n_choices_prefill_once_greedy_equal_seeded_reproducible(shape: str) -> None:
    ranges, relay = SHAPES[shape]
    async with front_door(ranges, relay=relay) as door:
        url = door.url + "/v1/completions"
        base = {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        status, _, one = await in_thread(lambda: post(url, base))
        assert status == 200, one
        before = [w.engine.metrics() for w in door.workers]
        status, _, four = await in_thread(lambda: post(url, {**base, "n": 4}))
        assert status == 200, four
        assert texts(four) == texts(one) * 4
        n_prompt = one["usage"]["prompt_tokens"]
        assert four["usage"]["prompt_tokens"] == n_prompt  # counted once
        assert four["usage"]["completion_tokens"] == 4 * one["usage"]["completion_tokens"]
        for w, was in zip(door.workers, before, strict=True):
            m = w.engine.metrics()  # the prompt once; each fork recomputes its last position
            assert (m.sessions_forked_total - was.sessions_forked_total,
                    m.prefill_tokens_total - was.prefill_tokens_total) == (3, n_prompt + 3)
        seeded = {**base, "n": 3, "temperature": 1.5, "seed": 42}
        answers = [await in_thread(lambda: post(url, seeded)) for _ in range(2)]
        assert answers[0][0] == answers[1][0] == 200
        assert texts(answers[0][2]) == texts(answers[1][2])
        assert len(set(texts(answers[0][2]))) > 1  # each choice samples its own stream
        await assert_all_free(door.workers)


async def test_a_streamed_chat_interleaves_choices_by_index() -> None:
    async with front_door([None]) as door:
        url = door.url + "/v1/chat/completions"
        body = {"model": NAME, "messages": MESSAGES, "max_tokens": 6, "n": 3, "seed": 7,
                "temperature": 1.0}
        status, _, whole = await in_thread(lambda: post(url, body))
        assert status == 200, whole
        client = door.client
        parts: dict[int, list[str]] = defaultdict(list)
        roles: dict[int, list[str]] = defaultdict(list)
        finishes: dict[int, str] = {}
        for chunk in await in_thread(
                lambda: list(client.chat.completions.create(stream=True, **body))):
            for choice in chunk.choices:
                parts[choice.index].append(choice.delta.content or "")
                if choice.delta.role:
                    roles[choice.index].append(choice.delta.role)
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
        assert sorted(parts) == [0, 1, 2] and all(roles[i] == ["assistant"] for i in range(3))
        assert ["".join(parts[i]) for i in range(3)] == texts(whole)
        assert finishes == {i: c["finish_reason"] for i, c in enumerate(whole["choices"])}


async def test_best_of_returns_the_choices_of_highest_summed_logprob() -> None:
    async with front_door([None]) as door:
        url = door.url + "/v1/completions"
        base = {"model": NAME, "prompt": PROMPT, "max_tokens": 6, "seed": 3, "temperature": 1.5}
        status, _, every = await in_thread(lambda: post(url, {**base, "n": 4, "logprobs": 0}))
        assert status == 200, every
        sums = [sum(c["logprobs"]["token_logprobs"]) for c in every["choices"]]
        order = sorted(range(4), key=lambda i: (-sums[i], i))
        assert len(set(sums)) > 1
        status, _, two = await in_thread(lambda: post(url, {**base, "n": 2, "best_of": 4}))
        assert status == 200, two
        assert texts(two) == [texts(every)[i] for i in order[:2]]
        assert two["usage"]["completion_tokens"] == every["usage"]["completion_tokens"]


async def test_more_choices_than_sessions_are_refused() -> None:
    async with front_door([None], max_sessions=4) as door:
        url = door.url + "/v1/completions"
        base = {"model": NAME, "prompt": PROMPT, "max_tokens": 2}
        for extra, param in (({"n": 5}, "n"), ({"best_of": 6}, "best_of")):
            status, _, body = await in_thread(lambda: post(url, {**base, **extra}))
            assert (status, body["error"]["param"]) == (400, param), body
        status, _, body = await in_thread(lambda: post(url, {**base, "n": 4}))
        assert status == 200 and len(body["choices"]) == 4
        assert json.dumps(body)  # a plain JSON body


async def test_requests_of_n_choices_wait_for_sessions_in_the_queue() -> None:
    """Three requests of 4 choices at once on a worker of 4 sessions: each takes every
    session, so they wait for each other in the model's queue (4 places each) and all succeed
    with the same greedy choices."""
    async with front_door([None], max_sessions=4) as door:
        url = door.url + "/v1/completions"
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "n": 4}
        answers: list[tuple[int, Any]] = []

        async def one() -> None:
            status, _, got = await in_thread(lambda: post(url, body))
            answers.append((status, got))

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
        assert [status for status, _ in answers] == [200] * 3, answers
        assert len({tuple(texts(got)) for _, got in answers}) == 1
        await assert_all_free(door.workers)


async def test_several_prompts_with_n_number_choices_prompt_by_prompt() -> None:
    """OpenAI's order: prompt ``p``'s choice ``j`` is choice ``p * n + j``; each choice equals a
    one-prompt request's (greedy), with ``echo`` its own prompt's text, streamed or not."""
    async with front_door([None]) as door:
        url = door.url + "/v1/completions"
        prompts = ["the quick brown fox", "a slow green turtle"]
        base = {"model": NAME, "max_tokens": 5, "temperature": 0}
        singles = []
        for p in prompts:
            status, _, one = await in_thread(lambda p=p: post(url, {**base, "prompt": p}))
            assert status == 200, one
            singles.append(texts(one)[0])
        body = {**base, "prompt": prompts, "n": 2, "echo": True}
        status, _, whole = await in_thread(lambda: post(url, body))
        assert status == 200, whole
        expected = [prompts[i // 2] + singles[i // 2] for i in range(4)]
        assert texts(whole) == expected
        streamed: dict[int, list[str]] = defaultdict(list)
        for chunk in await in_thread(
                lambda: list(door.client.completions.create(stream=True, **body))):
            for choice in chunk.choices:
                streamed[choice.index].append(choice.text)
        assert ["".join(streamed[i]) for i in range(4)] == expected
        await assert_all_free(door.workers)
