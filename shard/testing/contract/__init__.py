"""The ShardEngine contract suite: one set of tests every engine must pass unchanged.

Use it from any package by subclassing ``EngineContractSuite`` (the class name does not start
with ``Test``, so pytest only collects your subclass) and providing an ``engine_factory``
fixture, parametrized over as many factories as you like::

    import pytest
    from shard.testing import EngineContractSuite, fake_factory

    @pytest.fixture(params=[fake_factory()], ids=str)
    def engine_factory(request):
        return request.param

    class TestMyEngineContract(EngineContractSuite):
        pass

Requirements: pytest-trio with ``trio_mode = true`` (the tests are ``async def``). The suite
never skips, never assumes an engine's speed (it waits for ``SessionState.RUNNING`` rather than
sleeping), and only uses the public contract plus one documented hook name
(``_impl_compute``, overridden on the instance by ``inject_failure``).

Every test states the *same* expectation for every engine: the contract is identical lifecycle
semantics, so nothing here branches on the engine's name.

Each concept's tests are one mixin class in a module of its own (``lifecycle``, ``sessions``,
``cancellation``, ...); ``EngineContractSuite`` composes them all, and a suite that wants only
some concepts may compose those mixins alone. The helpers they share are in ``harness``.
"""

from __future__ import annotations

from .cancellation import Cancellation
from .concurrency import Concurrency
from .embeddings import Embeddings
from .forks import Forks
from .groups import Groups
from .handoff import HandOff
from .harness import (
    Pending,
    assert_layer_range_refused,
    assert_project_value,
    assert_same_logits,
    count_native_threads,
    count_tasks,
    decode,
    generate,
    inject_failure,
    prefill,
    prompt_tokens,
    start_op,
    wait_running,
)
from .layer_ranges import LayerRanges
from .lifecycle import Lifecycle
from .lookahead import LookAhead
from .prefix_cache import PrefixCache
from .sampling import Sampling
from .sessions import Sessions
from .streams import Streams
from .tokens import Tokens
from .trace import REFERENCE_TRACE, ReferenceTrace, run_reference_trace
from .validation import BadInput
from .verification import Verification


class EngineContractSuite(
    Lifecycle,
    Sessions,
    Cancellation,
    HandOff,
    Forks,
    Streams,
    LookAhead,
    Verification,
    Sampling,
    BadInput,
    Tokens,
    LayerRanges,
    Concurrency,
    Groups,
    PrefixCache,
    ReferenceTrace,
    Embeddings,
):
    """The contract tests. Subclass it as ``Test...`` and provide ``engine_factory``."""


__all__ = [
    "REFERENCE_TRACE",
    "BadInput",
    "Cancellation",
    "Concurrency",
    "Embeddings",
    "EngineContractSuite",
    "Forks",
    "Groups",
    "HandOff",
    "LayerRanges",
    "Lifecycle",
    "LookAhead",
    "Pending",
    "PrefixCache",
    "ReferenceTrace",
    "Sampling",
    "Sessions",
    "Streams",
    "Tokens",
    "Verification",
    "assert_layer_range_refused",
    "assert_project_value",
    "assert_same_logits",
    "count_native_threads",
    "count_tasks",
    "decode",
    "generate",
    "inject_failure",
    "prefill",
    "prompt_tokens",
    "run_reference_trace",
    "start_op",
    "wait_running",
]
