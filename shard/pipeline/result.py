"""What one ``Pipeline.generate`` produced (``PipelineResult``): shared by the pipeline and its
chain-relay driver."""

from __future__ import annotations

from dataclasses import dataclass, field

from shard.v1 import shard_pb2 as pb

from .generation import Failover

__all__ = ["PipelineResult", "PromptLogprob"]


@dataclass(frozen=True)
class PromptLogprob:
    """A prompt token after the first, scored (``generate(prompt_logprobs=True)``): its
    log-prob under the position before it, and that position's top alternatives."""

    logprob: float
    top: tuple[pb.TokenLogprob, ...]


@dataclass
class PipelineResult:
    """What ``generate`` produced: the last shard's StepResult per token (``finish_reason`` set
    on the last one, as a worker's Generate does), the prompt length, and every hop that moved
    to another replica on the way (``failovers``, in order)."""

    steps: list[pb.StepResult] = field(default_factory=list)
    prompt_tokens: int = 0
    #: Prompt positions the first hop took from its prefix cache instead of computing them
    #: (``StepResult.cached_tokens``; every later hop took at least as many from its own).
    cached_tokens: int = 0
    failovers: list[Failover] = field(default_factory=list)
    #: Passes through the chain: the prompt's, then one per decode or speculative step (a
    #: generation without speculation takes one per token).
    traversals: int = 0
    #: Speculation (``generate(speculate=K)``): tokens drafted, and those the model agreed with.
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    #: ``prompt_logprobs``: one entry per prompt token after the first, in order.
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [s.logits.token_id for s in self.steps]

    @property
    def finish_reason(self) -> int:
        return self.steps[-1].finish_reason if self.steps else pb.FINISH_REASON_UNSPECIFIED
