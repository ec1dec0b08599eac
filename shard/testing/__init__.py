"""Reusable engine conformance suite and fixtures (importable by other packages).

``EngineContractSuite`` holds the contract tests; subclass it in a ``Test*`` class and provide
an ``engine_factory`` fixture returning an ``EngineFactory`` (see ``shard.testing.factories``
and docs/engine.md).
"""

from .contract import (
    REFERENCE_TRACE,
    EngineContractSuite,
    Pending,
    assert_same_logits,
    count_native_threads,
    count_tasks,
    generate,
    inject_failure,
    prompt_tokens,
    run_reference_trace,
    start_op,
    wait_running,
)
from .factories import EngineFactory, EngineOptions, ShardPart, fake_factory, llama_factory

__all__ = [
    "REFERENCE_TRACE",
    "EngineContractSuite",
    "EngineFactory",
    "EngineOptions",
    "Pending",
    "ShardPart",
    "assert_same_logits",
    "count_native_threads",
    "count_tasks",
    "fake_factory",
    "generate",
    "inject_failure",
    "llama_factory",
    "prompt_tokens",
    "run_reference_trace",
    "start_op",
    "wait_running",
]
