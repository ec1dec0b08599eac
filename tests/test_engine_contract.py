"""The ShardEngine contract suite (shard.testing) run on every engine: fake and llama.cpp."""

from __future__ import annotations

import pytest

from shard.testing import EngineContractSuite, EngineFactory, fake_factory, llama_factory

# One llama.cpp thread: on a tiny model a second thread buys nothing, and llama.cpp's spinning
# thread pool turns milliseconds into seconds when other processes compete for the 2 cores
# (measured: a 12-token prefill took ~1 s with n_threads=2 under load, ~3 ms with 1).
FACTORIES = [fake_factory(), llama_factory("tiny", n_threads=1)]


@pytest.fixture(params=FACTORIES, ids=str)
def engine_factory(request: pytest.FixtureRequest) -> EngineFactory:
    return request.param


class TestEngineContract(EngineContractSuite):
    """Every contract test, once per engine."""
