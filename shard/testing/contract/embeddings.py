"""Contract tests of pooled embeddings (``ShardEngine.embed``): served by a whole model that
declares a pooling type, refused with a typed error otherwise, and invisible to the sessions
(no cell, no sequence, no changed logits)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import trio

from shard.engine import (
    ContextExceeded,
    EngineError,
    IllegalTransition,
    InvalidInput,
    NotReady,
    UnsupportedFeature,
)

from ..factories import EngineFactory, EngineOptions, ShardPart
from .harness import (
    assert_layer_range_refused,
    assert_same_logits,
    decode,
    prefill,
    prompt_tokens,
)


def _pooled(factory: EngineFactory) -> EngineFactory:
    """The same engine over a model that declares a pooling type."""
    return factory.pooled if factory.pooled is not None else factory


class Embeddings:
    """Embeddings: pooled, normalized, bounded, refused where they cannot be computed."""

    async def test_a_model_without_pooling_refuses_and_stays_healthy(
        self, engine_factory: EngineFactory
    ) -> None:
        assert engine_factory.pooled is not None, "the suite's factories serve a text model"
        async with engine_factory.open() as engine:
            caps = engine.capabilities()
            assert caps.pooling_type == "" and not caps.embeds
            with pytest.raises(UnsupportedFeature, match="no pooling type"):
                await engine.embed(prompt_tokens(engine, 4))
            await engine.open_session("s")
            r = await prefill(engine, "s", prompt_tokens(engine, 4))
            assert r.logits is not None and engine.health().ready

    async def test_embedding_is_pooled_normalized_and_deterministic(
        self, engine_factory: EngineFactory
    ) -> None:
        async with _pooled(engine_factory).open() as engine:
            caps = engine.capabilities()
            assert caps.pooling_type == "mean" and caps.embeds
            ids = prompt_tokens(engine, 9)
            v = await engine.embed(ids)
            assert isinstance(v, np.ndarray) and v.dtype == np.float32 and v.shape == (caps.n_embd,)
            assert np.linalg.norm(v) == pytest.approx(1.0, abs=1e-5)
            raw = await engine.embed(ids, normalize=False)
            assert np.linalg.norm(raw) > 0
            np.testing.assert_allclose(v, raw / np.linalg.norm(raw), atol=1e-6)
            assert np.array_equal(await engine.embed(ids), v)  # nothing carried over between calls
            other = await engine.embed(prompt_tokens(engine, 9, salt=3))
            assert not np.allclose(other, v, atol=1e-3)
            one = await engine.embed(ids[:1])  # a single id pools to that id's own row
            assert one.shape == v.shape and not np.allclose(one, v, atol=1e-3)
            assert engine.metrics().kv_cells_used == 0 and engine.sessions() == ()

    async def test_an_embedding_leaves_sessions_as_they_were(
        self, engine_factory: EngineFactory
    ) -> None:
        """An embedding between two steps of a session changes nothing the session computes,
        also while another session's prompt runs beside it."""
        async with _pooled(engine_factory).open() as engine:
            prompt = prompt_tokens(engine, 12)
            for sid in ("a", "b"):
                await engine.open_session(sid)
                await prefill(engine, sid, prompt)
            held = engine.metrics().kv_cells_used
            alone = await engine.embed(prompt_tokens(engine, 30, salt=1))
            await engine.open_session("busy")
            got: dict[str, Any] = {}

            async def long_prompt() -> None:
                got["busy"] = await prefill(engine, "busy", prompt_tokens(engine, 120, salt=2))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(long_prompt)
                got["embedding"] = await engine.embed(prompt_tokens(engine, 30, salt=1))
            assert np.array_equal(got["embedding"], alone)
            assert got["busy"].n_past == 120
            assert engine.metrics().kv_cells_used == held + 120
            token = prompt[3]
            assert_same_logits(await decode(engine, "a", token), await decode(engine, "b", token))
            assert engine.session_info("a").n_past == len(prompt) + 1

    async def test_bad_embedding_input_is_refused_and_changes_nothing(
        self, engine_factory: EngineFactory
    ) -> None:
        async with _pooled(engine_factory).open() as engine:
            caps = engine.capabilities()
            fits = prompt_tokens(engine, caps.n_ctx_per_session)
            bad: list[tuple[type[EngineError], Callable[[], Awaitable[Any]]]] = [
                (InvalidInput, lambda: engine.embed(())),
                (InvalidInput, lambda: engine.embed((caps.n_vocab,))),
                (InvalidInput, lambda: engine.embed((1, -1))),
                (InvalidInput, lambda: engine.embed((1, True))),
                (InvalidInput, lambda: engine.embed("hello")),  # type: ignore[arg-type]
                (ContextExceeded, lambda: engine.embed(prompt_tokens(engine, caps.n_ctx_per_session + 1))),
            ]
            for error, call in bad:
                with pytest.raises(error):
                    await call()
            assert engine.health().ready and engine.metrics().kv_cells_used == 0
            # The longest input that fits is one whole sequence, pooled at once.
            assert (await engine.embed(fits)).shape == (caps.n_embd,)
            assert engine.metrics().kv_cells_used == 0

    async def test_a_cancelled_embedding_leaves_the_engine_healthy(
        self, engine_factory: EngineFactory
    ) -> None:
        async with _pooled(engine_factory).open() as engine:
            ids = prompt_tokens(engine, 40)
            expected = await engine.embed(ids)
            with trio.CancelScope() as scope:
                scope.cancel()
                await engine.embed(ids)
            assert scope.cancelled_caught
            with trio.move_on_after(0.001):  # cancelled at any point of its run
                await engine.embed(ids)
            assert engine.health().ready and engine.metrics().kv_cells_used == 0
            assert np.array_equal(await engine.embed(ids), expected)
            await engine.aclose()
            with pytest.raises(NotReady):
                await engine.embed(ids)

    @pytest.mark.parametrize("part", [ShardPart.FIRST, ShardPart.LAST])
    async def test_a_partial_shard_refuses(self, engine_factory: EngineFactory,
                                           part: ShardPart) -> None:
        """Only the whole model pools its last block's output from token ids."""
        factory = _pooled(engine_factory)
        if not factory.layer_ranges:  # an engine without layer ranges has no partial shard
            await assert_layer_range_refused(factory, part)
            return
        async with factory.open(EngineOptions(part=part)) as engine:
            caps = engine.capabilities()
            assert caps.pooling_type == "mean" and not caps.embeds
            with pytest.raises(IllegalTransition, match="whole model"):
                await engine.embed((1, 5, 6))
            assert engine.health().ready


__all__ = ["Embeddings"]
