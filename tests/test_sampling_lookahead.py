"""Penalized steps computed ahead by the llama engine's native thread: it chooses with the
penalty window the event loop gave the claim, so every step is still computed ahead and the
tokens are those of plain decoding."""

from __future__ import annotations

import pytest
import trio

from shard.engine import DecodeRequest, Lookahead, PrefillRequest, SamplingParams, StreamRequest
from shard.engine.llama import LlamaCppEngine
from test_lookahead import PROMPT, settle
from test_llama_engine import engine, tiny_path  # noqa: F401 - fixtures

#: A presence penalty far above the logits' spread: each step takes a token the session has
#: not seen, so the window decides every choice.
FRESH = SamplingParams(presence_penalty=1e4, penalty_last_n=-1)
SAMPLED = SamplingParams(temperature=0.9, seed=4, repeat_penalty=1.4, frequency_penalty=0.7,
                         penalty_last_n=8, min_p=0.02)


async def decoded(engine: LlamaCppEngine, sid: str, n: int, params: SamplingParams, *,
                  hinted: bool) -> list[int]:
    await engine.open_session(sid)
    res = await engine.prefill(PrefillRequest(sid, tokens=PROMPT, sampling=params,
                                              lookahead=Lookahead(n) if hinted else None))
    out = [res.logits.token_id]  # type: ignore[union-attr]
    for i in range(n):
        hint = Lookahead(n - i - 1) if hinted and n - i - 1 > 0 else None
        res = await engine.decode(DecodeRequest(sid, token=out[-1], sampling=params, lookahead=hint))
        out.append(res.logits.token_id)  # type: ignore[union-attr]
    await engine.release(sid)
    return out


@pytest.mark.parametrize("params", [FRESH, SAMPLED], ids=["fresh", "sampled"])
async def test_penalized_decodes_are_computed_ahead_with_their_window(
        engine: LlamaCppEngine, params: SamplingParams) -> None:
    plain = await decoded(engine, "plain", 16, params, hinted=False)
    assert engine.metrics().lookahead_steps_total == 0
    if params is FRESH:
        assert len(set(plain)) == len(plain) and not set(plain) & set(PROMPT)
    hinted = await decoded(engine, "a", 16, params, hinted=True)
    await settle(engine)
    m = engine.metrics()
    assert hinted == plain
    assert m.lookahead_used_total == 16 and m.lookahead_dropped_total == 0


async def test_a_penalized_stream_is_computed_ahead(engine: LlamaCppEngine) -> None:
    plain = await decoded(engine, "plain", 12, SAMPLED, hinted=False)
    await engine.open_session("s")
    res = await engine.prefill(PrefillRequest("s", tokens=PROMPT, sampling=SAMPLED))
    got = [res.logits.token_id]  # type: ignore[union-attr]
    with trio.fail_after(60):
        await engine.stream(StreamRequest("s", got[0], 12, sampling=SAMPLED),
                            lambda r: got.append(r.logits.token_id) is None)  # type: ignore[union-attr]
    await settle(engine)
    assert got == plain
    assert engine.metrics().lookahead_used_total >= 10
