"""``/v1/completions`` with ``echo`` and ``logprobs``: the prompt's tokens come back first with
their log-probs (OpenAI's legacy completions, llama-server, vLLM), what evaluation harnesses
read (lm-eval-harness's ``loglikelihood``: ``max_tokens`` 0, ``echo``, ``logprobs`` 1..5).

Through the official ``openai`` client, on FakeEngine workers (tests/test_api.py's door): one
whole-model worker, two hops with client relay and with chain relay. The references are the
workers' own results through a pipeline: the prompt's log-probs as ``Pipeline.generate(
prompt_logprobs=True)`` gives them (checked against the whole model stepped token by token in
tests/test_prompt_logprobs.py), and a greedy continuation's log-probs, which the echoed
prompt of prompt + continuation must repeat (what the harness's ``is_greedy`` relies on).
"""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from test_api import NAME, SHAPES, front_door, in_thread, post
from test_pipeline import TIMEOUT, assert_all_free

from shard.engine.types import MAX_LOGITS_POSITIONS
from shard.pipeline import Pipeline

TEXT = "hello world"
IDS = [1, *(3 + b for b in TEXT.encode())]  # the fake's byte tokenizer: BOS, then the bytes


async def scored(door: Any, prompt: list[int], top: int) -> Any:
    async with Pipeline.connect([w.target for w in door.workers], timeout=TIMEOUT) as pipe:
        return await pipe.generate(prompt, max_tokens=0, top_logprobs=top, prompt_logprobs=True)


def assert_prompt_echoed(lp: Any, text: str, want: Any, top: int) -> None:
    """``lp``: a choice's logprobs whose first tokens are the prompt (``want``: the pipeline's
    scores of it): the bytes' texts, null then each log-prob, the top alternatives, offsets."""
    n = len(want.prompt_logprobs) + 1
    assert lp.tokens[:n] == ["", *text]  # BOS renders as nothing
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for got, ref, alternatives in zip(lp.token_logprobs[1:n], want.prompt_logprobs,
                                      lp.top_logprobs[1:n], strict=True):
        assert math.isclose(got, ref.logprob, abs_tol=1e-5)
        assert len(ref.top) == top
        # keyed by text, as the legacy format is (two bytes that are no character both
        # render as U+FFFD: the later one's value stays, as for a completion's tokens)
        expected = {t.piece.decode("utf-8", "replace"): t.logprob for t in ref.top}
        assert alternatives.keys() == expected.keys()
        for key, value in expected.items():
            assert math.isclose(alternatives[key], value, abs_tol=1e-5)
    assert lp.text_offset[:n] == [0, *range(len(text))]


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_lm_eval_loglikelihood_request(shape: str) -> None:
    """The harness's request: ``max_tokens`` 0, ``echo``, ``logprobs`` 1, a text or token ids;
    the answer is the prompt alone with its log-probs, ``length``, nothing generated. The
    prompt + a greedy continuation echoes the continuation's own log-probs, each its top-1."""
    ranges, relay = SHAPES[shape]
    async with front_door(ranges, relay=relay) as door:
        want = await scored(door, IDS, 1)
        async with Pipeline.connect([w.target for w in door.workers], timeout=TIMEOUT) as pipe:
            greedy = await pipe.generate(IDS, max_tokens=4, top_logprobs=1, ignore_eos=True)
        body = {"model": NAME, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}

        def calls() -> tuple[Any, Any, Any]:
            c = door.client
            text = c.completions.create(prompt=TEXT, **body)
            ids = c.completions.create(prompt=IDS, **body)
            _, _, raw = post(door.url + "/v1/completions",
                             {**body, "prompt": [*IDS, *greedy.tokens]})
            return text, ids, raw

        text, ids, raw = await in_thread(calls)
        await assert_all_free(door.workers)
    for reply in (text, ids):
        (choice,) = reply.choices
        assert choice.text == TEXT and choice.finish_reason == "length"
        assert_prompt_echoed(choice.logprobs, TEXT, want, 1)
        assert len(choice.logprobs.tokens) == len(IDS)
        assert reply.usage.prompt_tokens == len(IDS) and reply.usage.completion_tokens == 0
    lp = raw["choices"][0]["logprobs"]
    tail = range(len(IDS), len(IDS) + 4)
    for i, step in zip(tail, greedy.steps, strict=True):
        assert math.isclose(lp["token_logprobs"][i], step.logits.logprob, abs_tol=1e-5)
        (best,) = lp["top_logprobs"][i].items()  # the harness's is_greedy: top-1 is the token
        assert best[0] == lp["tokens"][i] == step.logits.piece.decode("utf-8", "replace")


@pytest.mark.parametrize("shape", ["whole", "pipeline"])
async def test_echo_with_logprobs_then_the_completion_streamed_and_whole(shape: str) -> None:
    """With ``max_tokens`` > 0 the completion follows the prompt: its text and log-probs are a
    plain completion's, its offsets continue after the prompt's text; streamed, the first
    chunk is the prompt with its log-probs. ``n`` 2 and two prompts: every choice starts with
    its prompt."""
    ranges, _ = SHAPES[shape]
    async with front_door(ranges) as door:
        want = await scored(door, IDS, 2)
        args = {"model": NAME, "max_tokens": 5, "temperature": 0, "logprobs": 2}

        def calls() -> tuple[Any, Any, list[Any], Any]:
            c = door.client
            plain = c.completions.create(prompt=TEXT, **args)
            whole = c.completions.create(prompt=TEXT, echo=True, **args)
            chunks = list(c.completions.create(prompt=TEXT, echo=True, stream=True, **args))
            several = c.completions.create(prompt=[TEXT, TEXT], n=2, echo=True, **args)
            return plain, whole, chunks, several

        plain, whole, chunks, several = await in_thread(calls)
        await assert_all_free(door.workers)
    done = plain.choices[0]
    n = len(IDS)
    for choice in (whole.choices[0], *several.choices):
        assert choice.text == TEXT + done.text
        lp = choice.logprobs
        assert_prompt_echoed(lp, TEXT, want, 2)
        assert lp.tokens[n:] == done.logprobs.tokens
        assert lp.token_logprobs[n:] == done.logprobs.token_logprobs
        assert lp.top_logprobs[n:] == done.logprobs.top_logprobs
        assert lp.text_offset[n:] == [len(TEXT) + o for o in done.logprobs.text_offset]
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.usage.prompt_tokens == 2 * n
    first = chunks[0].choices[0]
    assert first.text == TEXT and first.logprobs.token_logprobs[0] is None
    assert_prompt_echoed(first.logprobs, TEXT, want, 2)
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in streamed) == TEXT + done.text
    assert [o for c in streamed if c.logprobs for o in c.logprobs.text_offset] == \
        whole.choices[0].logprobs.text_offset


async def test_a_prompt_longer_than_one_pass_and_the_refusals() -> None:
    """A prompt over several scoring passes (the last shard takes ``max_logits_positions`` a
    step) echoes every token; ``max_tokens`` 0 without echo and logprobs is a 400 naming it,
    and the door stays healthy."""
    text = "".join(chr(97 + i % 26) for i in range(2 * MAX_LOGITS_POSITIONS + 5))
    ids = [1, *(3 + b for b in text.encode())]
    async with front_door(SHAPES["pipeline"][0]) as door:
        want = await scored(door, ids, 1)
        body = {"model": NAME, "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1}
        got = await in_thread(lambda: door.client.completions.create(**body))
        assert_prompt_echoed(got.choices[0].logprobs, text, want, 1)
        for bad in ({"echo": False}, {"logprobs": None}):
            with pytest.raises(openai.BadRequestError) as refused:
                await in_thread(lambda: door.client.completions.create(**{**body, **bad}))
            assert refused.value.body["param"] == "max_tokens"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as refused:
            await in_thread(lambda: door.client.completions.create(
                **{**body, "prompt": [5, 6], "logprobs": None, "max_tokens": 2}))
        assert refused.value.body["param"] == "echo"  # type: ignore[index]
        again = await in_thread(lambda: door.client.completions.create(**body))
        assert again.choices[0].logprobs.token_logprobs == got.choices[0].logprobs.token_logprobs
        # best_of above n: the kept choice's held deltas start with its prompt too
        best = await in_thread(lambda: door.client.completions.create(
            **{**body, "max_tokens": 3, "best_of": 2, "seed": 1, "temperature": 0.9}))
        (choice,) = best.choices
        assert choice.text.startswith(text) and len(choice.logprobs.tokens) == len(ids) + 3
        assert choice.logprobs.token_logprobs[: len(ids)] == got.choices[0].logprobs.token_logprobs
        assert choice.logprobs.text_offset[len(ids)] == len(text)
        await assert_all_free(door.workers)


async def test_a_prompt_the_prefix_cache_holds_is_scored_in_full() -> None:
    """Two hops with a prefix cache that holds the prompt (a plain completion of it ran first):
    the echo still scores every token (no hop takes positions from its cache for a pass, so the
    last shard gets every row), the same values as before the cache held it."""
    async with front_door(SHAPES["pipeline"][0], prefix_cache_tokens=4096) as door:
        body = {"model": NAME, "prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 2}
        before = await in_thread(lambda: door.client.completions.create(**body))
        plain = await in_thread(lambda: door.client.completions.create(
            model=NAME, prompt=TEXT + " again", max_tokens=2, temperature=0))
        again = await in_thread(lambda: door.client.completions.create(
            **{**body, "prompt": TEXT + " again"}))
        held = await in_thread(lambda: door.client.completions.create(**body))
        await assert_all_free(door.workers)
    assert held.choices[0].logprobs.token_logprobs == before.choices[0].logprobs.token_logprobs
    assert held.choices[0].logprobs.top_logprobs == before.choices[0].logprobs.top_logprobs
    lp = again.choices[0].logprobs
    assert len(lp.tokens) == len(IDS) + len(" again") and lp.token_logprobs[0] is None
    assert lp.token_logprobs[: len(IDS)] == before.choices[0].logprobs.token_logprobs
    assert plain.usage.prompt_tokens == again.usage.prompt_tokens == len(lp.tokens)
