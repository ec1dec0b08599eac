"""The one generation loop of a ``Generate``, whoever produces its tokens.

A plain session computes each token here (step by step, or as one engine stream once the
prompt is in); a routed session (``shard.relay``) computes its rows here and forwards them down
the chain, or runs steps ahead of the chain's answers (direct return). Whatever the source,
``generate`` and its ``Generation`` are the one place that decides when a generation ends (the
shared stop rules, ``shard.stops``), how its tokens are counted (``Usage``) and when it yields to
a drain; each token's credit is the session's ``Credit``'s. Why one place: four loops that each
decided these drifted apart (vLLM keeps one output stage and one stop check for the same reason).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from shard.engine import SamplingParams, StepResult
from shard.stops import StopRules
from shard.v1 import shard_pb2 as pb

from .. import handoff
from ..errors import ErrorCode, ShardError
from .protocols import SessionHost, StepHost

UNFINISHED = pb.FINISH_REASON_UNSPECIFIED


def count_prefill(usage: pb.Usage, result: StepResult) -> None:
    """A delivered prefill step's input in the request's ``Usage``: positions computed, held
    by the session already, and copied from the prefix cache."""
    usage.prompt_tokens += result.tokens_processed
    usage.reused_tokens += result.reused_tokens
    usage.cached_tokens += result.cached_tokens


def count_generated(usage: pb.Usage, result: StepResult, *, prompt_step: bool) -> None:
    """A Generate's token delivered: the request's ``Usage`` counts it (and, for the step that
    prefilled the prompt, the prompt's input)."""
    if prompt_step:
        count_prefill(usage, result)
    usage.generated_tokens += 1


def stop_rules(g: pb.Generate) -> StopRules:
    """A Generate's stop rules (``shard.stops``)."""
    return StopRules.of(g.max_tokens, g.stop_tokens, g.ignore_eos)


class Generation:
    """One running Generate: its request, checked input, stop decisions and counters."""

    __slots__ = ("request", "sampling", "prompt", "rules", "usage", "drain", "emitted", "finish",
                 "_capacity")

    def __init__(
        self, g: pb.Generate, usage: pb.Usage, sampling: SamplingParams,
        prompt: tuple[int, ...] | None, capacity: int, drain: SessionHost | None,
    ) -> None:
        self.request = g
        self.sampling = sampling
        self.prompt = prompt  # None: the generation continues from the session's next token
        self.rules = stop_rules(g)
        self.usage = usage
        #: Whose ``draining`` makes the generation yield its session (None: it never yields).
        self.drain = drain
        self.emitted = 0  # tokens decided on so far
        self.finish = UNFINISHED  # the last token's finish reason
        self._capacity = capacity

    @property
    def left(self) -> int:
        """Tokens the request still allows."""
        return self.request.max_tokens - self.emitted

    @property
    def prompt_step(self) -> bool:
        """The next token's step prefills the prompt."""
        return self.emitted == 0 and self.prompt is not None

    def decide(self, token: int, is_eog: bool, n_past: int) -> int:
        """The next token is ``token``, the session holding ``n_past`` positions with it: its
        finish reason (``UNFINISHED``: the generation goes on)."""
        self.emitted = emitted = self.emitted + 1
        self.finish = finish = self.rules.finish_reason(
            token, is_eog, emitted=emitted, n_past=n_past, capacity=self._capacity)
        return finish

    def count(self, result: StepResult) -> None:
        """A token was delivered; ``result`` is this worker's own step for it."""
        count_generated(self.usage, result, prompt_step=self.emitted == 1 and self.prompt is not None)


class StepSource(Protocol):
    """How a generation's tokens are produced (a plain session's engine, a routed session's
    chain). One step is ``compute`` (in the Cancel region, after its credit), ``forward``
    (optional: the answer the token is read from, else the step itself), then ``send``."""

    def batched(self, run: Generation) -> bool:
        """The next tokens come as a batch (``run_batch``) rather than one step."""
        ...

    async def run_batch(self, run: Generation) -> None:
        """Produce, decide (``Generation.decide``), send and count tokens until the batch ends
        (finished, out of credit, a drain); raises what stops it."""
        ...

    async def compute(self, run: Generation) -> StepResult:
        """This worker's step for the next token, at the session's end."""
        ...

    #: The answer a computed step's token is read from (a routed session's: the last shard's).
    forward: Callable[[Generation, StepResult], Awaitable[pb.StepResult]] | None

    async def send(self, run: Generation, answer: StepResult | pb.StepResult, start: int,
                   mine: StepResult) -> None:
        """Send the token's result (``run.finish`` decided), numbered, for one credit."""
        ...


async def generate(host: StepHost, g: pb.Generate, usage: pb.Usage, source: StepSource, *,
                   drain: SessionHost | None = None) -> None:
    """Run a Generate to its end: tokens from ``source`` until a stop rule ends it (or a drain
    makes it yield, when ``drain`` is given)."""
    sampling, prompt = await host.generate_input(g)
    run = Generation(g, usage, sampling, prompt, host.kv_capacity, drain)
    forward = source.forward
    while True:
        if source.batched(run):
            await source.run_batch(run)
        else:
            with host.cancellable():
                await host.take_credit()
                start = host.positions.end
                mine = await source.compute(run)
            answer = mine if forward is None else await forward(run, mine)
            logits = answer.logits
            run.decide(logits.token_id, logits.is_eog, answer.n_past)
            await source.send(run, answer, start, mine)
            run.count(mine)
        if run.finish != UNFINISHED:
            return
        if drain is not None and drain.draining:
            raise ShardError(ErrorCode.DRAINING, "the worker is draining: the generation "
                             "yields its session to be moved (export_state)",
                             session_id=host.session_id, reason=handoff.YIELDED)
