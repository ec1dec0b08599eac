"""A Generate's stop rules and counters."""

from __future__ import annotations

from shard.engine import StepResult
from shard.stops import StopRules
from shard.v1 import shard_pb2 as pb


def count_generated(usage: pb.Usage, result: StepResult, *, prompt_step: bool) -> None:
    """A Generate's token delivered: the request's ``Usage`` counts it (and, for the step that
    prefilled the prompt, the prompt's positions computed and reused)."""
    if prompt_step:
        usage.prompt_tokens += result.tokens_processed
        usage.reused_tokens += result.reused_tokens
    usage.generated_tokens += 1


def stop_rules(g: pb.Generate) -> StopRules:
    """A Generate's stop rules (``shard.stops``)."""
    return StopRules.of(g.max_tokens, g.stop_tokens, g.ignore_eos)
