"""The door takes OpenAI's penalties and logit_bias and llama-server's top_k, min_p and
repeat_penalty: the workers apply them (the text is theirs with the same parameters), and a
bad value is a 400 naming the parameter."""

from __future__ import annotations

from typing import Any

import pytest

from shard.engine import LayerRange
from test_api import MESSAGES, NAME, direct_text, front_door, in_thread, post, rendered

PARAMS: dict[str, Any] = {"temperature": 0.8, "seed": 4, "presence_penalty": 1.5,
                          "frequency_penalty": 0.5, "repeat_penalty": 1.3, "top_k": 40,
                          "min_p": 0.05}


@pytest.mark.parametrize("ranges", [[None], [LayerRange(0, 2), LayerRange(2, 4)]],
                         ids=["whole", "2-workers"])
async def test_the_door_gets_the_workers_penalized_and_biased_text(ranges: list[Any]) -> None:
    async with front_door(ranges) as door:
        bias = {"40": 100.0, "41": -100.0}
        want, _ = await direct_text(door, "hello world", max_tokens=12, **PARAMS,
                                    logit_bias={40: 100.0, 41: -100.0})
        plain, _ = await direct_text(door, "hello world", max_tokens=12, temperature=0.8, seed=4)
        assert want != plain  # (the parameters change the text)
        status, _, body = await in_thread(lambda: post(door.url + "/v1/completions", {
            "model": NAME, "prompt": "hello world", "max_tokens": 12, **PARAMS,
            "logit_bias": bias}))
        assert status == 200, body
        assert body["choices"][0]["text"] == want
        want_chat, _ = await direct_text(door, rendered(), max_tokens=8, **PARAMS)
        chat = await in_thread(lambda: door.client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=8, seed=4, temperature=0.8,
            presence_penalty=1.5, frequency_penalty=0.5,
            extra_body={"repeat_penalty": 1.3, "top_k": 40, "min_p": 0.05}))
        assert chat.choices[0].message.content == want_chat


async def test_bad_sampling_values_are_400s_naming_the_parameter() -> None:
    async with front_door() as door:
        base = {"model": NAME, "prompt": "hello", "max_tokens": 2}
        cases = [
            ({"presence_penalty": 2.5}, "presence_penalty"),
            ({"frequency_penalty": -3}, "frequency_penalty"),
            ({"logit_bias": {"x": 1}}, "logit_bias"),
            ({"logit_bias": {"5": 101}}, "logit_bias"),
            ({"logit_bias": {"-5": 1}}, "logit_bias"),
            ({"logit_bias": {"100000": 1}}, "logit_bias"),
            ({"min_p": 1.5}, "min_p"),
            ({"top_k": -1}, "top_k"),
            ({"repeat_penalty": 0}, "repeat_penalty"),
        ]
        for extra, param in cases:
            for url, body in ((door.url + "/v1/completions", {**base, **extra}),
                              (door.url + "/v1/chat/completions",
                               {"model": NAME, "messages": MESSAGES, "max_tokens": 2, **extra})):
                status, _, answer = await in_thread(lambda: post(url, body))
                assert status == 400, (extra, answer)
                assert answer["error"]["param"] == param, (extra, answer)
        status, _, _ = await in_thread(lambda: post(door.url + "/v1/completions", base))
        assert status == 200  # the door and the workers stay healthy


#: Each parameter alone, at a value that changes the fake model's text (the test checks it),
#: with the temperature (and seed) it is tried at.
ALONE: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "presence_penalty": ({"presence_penalty": 2.0}, {"temperature": 0.0}),
    "frequency_penalty": ({"frequency_penalty": 2.0}, {"temperature": 0.0}),
    "repeat_penalty": ({"repeat_penalty": 4.0}, {"temperature": 0.0}),
    "top_k": ({"top_k": 1}, {"temperature": 2.0, "seed": 3}),
    "min_p": ({"min_p": 0.5}, {"temperature": 2.0, "seed": 3}),
    "logit_bias": ({"logit_bias": {40: 100.0}}, {"temperature": 0.0}),
}
REPEATED = "hello world hello world hello"


@pytest.mark.parametrize("ranges", [[None], [LayerRange(0, 2), LayerRange(2, 4)]],
                         ids=["whole", "2-workers"])
@pytest.mark.parametrize("param", list(ALONE))
async def test_each_parameter_alone_reaches_the_workers(param: str, ranges: list[Any]) -> None:
    """The parameter alone changes the workers' text, and the door answers the text with it:
    a door that dropped it would answer the text without it."""
    extra, base = ALONE[param]
    async with front_door(ranges) as door:
        want, _ = await direct_text(door, REPEATED, max_tokens=16, **base, **extra)
        without, _ = await direct_text(door, REPEATED, max_tokens=16, **base)
        assert want != without
        wire = {k: ({str(t): b for t, b in v.items()} if k == "logit_bias" else v)
                for k, v in extra.items()}
        status, _, body = await in_thread(lambda: post(door.url + "/v1/completions", {
            "model": NAME, "prompt": REPEATED, "max_tokens": 16, **base, **wire}))
        assert status == 200, body
        assert body["choices"][0]["text"] == want
