"""A prompt's log-probs (OpenAI's ``echo`` with ``logprobs``): the prompt goes through the
chain in ``all_logits`` passes instead of a prefill, and each pass's last shard reports every
input token's log-prob under the position before it (``StepResult.input_logprobs``) beside
that position's top alternatives (``position_logits``).

Why passes that overlap: a pass holds at most the last shard's ``max_logits_positions``, and
the log-prob of a pass's first token belongs to the position before it, which the pass before
computed without knowing that token. So each pass after the first starts at the last position
of the one before and writes it again (every hop recomputes it: an ``all_logits`` step reuses
nothing and takes nothing from the prefix cache), one position more per pass. The last pass's
result is the prompt's, as a prefill's would be (its ``logits`` choose the first token).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from shard.v1 import shard_pb2 as pb

from .result import PipelineResult, PromptLogprob

__all__ = ["Traverse", "score"]

#: One ``all_logits`` pass of ``tokens`` written at ``position`` through every hop, every
#: position computed on each (``shard.pipeline.stepping.traverse``): the last shard's result.
Traverse = Callable[[int, Sequence[int]], Awaitable[pb.StepResult]]


async def score(traverse: Traverse, prompt: Sequence[int], window: int,
                result: PipelineResult) -> pb.StepResult:
    """Write ``prompt`` through the chain in passes of at most ``window`` positions that
    overlap by one, adding each prompt token's log-prob but the first's to
    ``result.prompt_logprobs``; returns the last position's result, as a prefill's."""
    ids = list(prompt)
    position = 0
    result.prompt_logprobs.clear()  # (a turn run again scores the prompt again)
    while True:
        tokens = ids[position : position + window]
        last = await traverse(position, tokens)
        result.prompt_logprobs.extend(
            PromptLogprob(lp, tuple(lg.top))
            for lp, lg in zip(last.input_logprobs, last.position_logits[:-1], strict=True))
        end = position + len(tokens)
        if end >= len(ids):
            return pb.StepResult(step=last.step, n_past=last.n_past, tokens_processed=len(ids),
                                 logits=last.logits, start_position=0)
        position = end - 1
