"""Contract tests of look-ahead hints (docs/engine.md, "Look-ahead"): a step computed ahead is
the engine's scratch, never visible in a result or in a session's cells."""

from __future__ import annotations

import numpy as np
import pytest

from shard.engine import (
    DecodeRequest,
    InvalidInput,
    Lookahead,
    StepResult,
)

from ..factories import EngineFactory
from .harness import (
    FIRST_BYTE_ID,
    assert_same_logits,
    decode,
    open_with_history,
    prefill,
    prompt_tokens,
)


class LookAhead:
    """Look-ahead hints never change a result and leave no scratch behind."""

    async def test_lookahead_hints_never_change_results(self, engine_factory: EngineFactory) -> None:
        """A session that asks for look-ahead on every step gets exactly the results of one that
        never does, and its cells are its history after every step: a step computed ahead is the
        engine's scratch (``lookahead_cells``) until the next decode claims it."""
        async with engine_factory.open() as engine:
            tokens = prompt_tokens(engine, 12, salt=6)

            async def run(sid: str, hinted: bool) -> list[StepResult]:
                await engine.open_session(sid)
                hint = Lookahead(steps=8) if hinted else None
                out = [await prefill(engine, sid, tokens, lookahead=hint)]
                for i in range(8):
                    assert engine.metrics().kv_cells_used == out[-1].n_past
                    hint = Lookahead(steps=8 - i) if hinted else None
                    token = out[-1].logits.token_id  # type: ignore[union-attr]
                    out.append(await decode(engine, sid, token, lookahead=hint))
                assert engine.metrics().kv_cells_used == out[-1].n_past
                return out

            plain = await run("plain", False)
            await engine.release("plain")
            hinted = await run("hinted", True)
            assert [r.n_past for r in hinted] == [r.n_past for r in plain]
            for a, b in zip(plain, hinted, strict=True):
                assert_same_logits(a, b)
            m = engine.metrics()
            assert m.lookahead_cells <= 1  # the last hint allowed one more step
            assert m.lookahead_used_total + m.lookahead_dropped_total <= m.lookahead_steps_total
            await engine.release("hinted")
            m = engine.metrics()
            assert (m.kv_cells_used, m.lookahead_cells) == (0, 0)

    @pytest.mark.parametrize("then", ["other token", "rewind", "hidden step", "release"])
    async def test_a_step_computed_ahead_is_dropped_by_any_other_call(
        self, engine_factory: EngineFactory, then: str
    ) -> None:
        """After a hinted step, whatever the caller does instead of decoding the chosen token
        computes exactly what a session without the hint computes, and leaves no scratch cell."""
        async with engine_factory.open() as engine:
            history, chosen = await open_with_history(engine)
            r = await decode(engine, "s", chosen, lookahead=Lookahead(steps=4))
            assert r.logits is not None
            ahead = r.logits.token_id
            other = FIRST_BYTE_ID + (ahead + 1 - FIRST_BYTE_ID) % 200
            await engine.open_session("ref")
            await prefill(engine, "ref", (*history, chosen))
            if then == "other token":
                got = await decode(engine, "s", other)
                ref = await decode(engine, "ref", other)
                assert_same_logits(got, ref)
            elif then == "rewind":
                got = await prefill(engine, "s", (other, ahead), position=len(history))
                ref = await prefill(engine, "ref", (other, ahead), position=len(history))
                assert_same_logits(got, ref)
                assert got.n_past == ref.n_past == len(history) + 2
            elif then == "hidden step":
                with pytest.raises(InvalidInput):  # refused before it runs: the scratch may stay
                    await engine.decode(DecodeRequest("s", hidden_state=np.zeros((1, 4), np.float32)))
                got = await decode(engine, "s", ahead)  # ... and is still the right step
                ref = await decode(engine, "ref", ahead)
                assert_same_logits(got, ref)
            else:
                assert await engine.release("s") is True
            await engine.release("ref")
            m = engine.metrics()
            held = 0 if then == "release" else engine.session_info("s").n_past
            assert (m.kv_cells_used, m.lookahead_cells) == (held, 0)
            if then != "release":
                await engine.release("s")
            assert (engine.metrics().kv_cells_used, engine.metrics().lookahead_cells) == (0, 0)

    async def test_lookahead_hints_are_checked(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            history, chosen = await open_with_history(engine)
            with pytest.raises(InvalidInput):
                await engine.decode(DecodeRequest("s", token=chosen, lookahead=1))  # type: ignore[arg-type]
            with pytest.raises(ValueError):
                Lookahead(steps=-1)
            assert engine.session_info("s").n_past == len(history)
            # No step can follow: nothing is computed ahead (stop token, eog rule, no steps left).
            r = await decode(engine, "s", chosen, lookahead=Lookahead(steps=0))
            assert r.logits is not None
            r = await decode(engine, "s", r.logits.token_id, lookahead=Lookahead(stop_tokens=range(1 << 17)))
            assert engine.metrics().lookahead_cells == 0
