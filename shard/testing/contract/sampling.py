"""Contract tests of token choice: greedy and seeded sampling give the same tokens on every
run and every engine instance of one model."""

from __future__ import annotations

from shard.engine import (
    SamplingParams,
)

from ..factories import EngineFactory
from .harness import (
    generate,
    prompt_tokens,
)


class Sampling:
    """Greedy and seeded sampling are deterministic."""

    async def test_greedy_is_deterministic(self, engine_factory: EngineFactory) -> None:
        runs: list[list[int]] = []
        fingerprints: set[str] = set()
        for _ in range(2):  # two engine instances of the same model
            async with engine_factory.open() as engine:
                tokens = prompt_tokens(engine, 9, salt=2)
                await engine.open_session("a")
                await engine.open_session("b")
                runs.append(await generate(engine, "a", tokens, 12))
                runs.append(await generate(engine, "b", tokens, 12))
                fingerprints.add(engine.capabilities().model_fingerprint)
        assert all(run == runs[0] for run in runs)
        assert len(fingerprints) == 1

    async def test_seeded_sampling_is_deterministic(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            tokens = prompt_tokens(engine, 9, salt=6)

            async def sample(seed: int) -> list[int]:
                sid = f"seed-{seed}"
                await engine.open_session(sid)
                params = SamplingParams(temperature=1.5, top_k=64, top_p=0.98, seed=seed)
                out = await generate(engine, sid, tokens, 10, sampling=params)
                await engine.release(sid)
                return out

            first = await sample(7)
            assert await sample(7) == first
            assert await sample(7) == first
            assert len({tuple(await sample(seed)) for seed in range(6)}) > 1
