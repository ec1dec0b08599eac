"""Chain relay, the client's side: a pipeline whose workers relay to each other.

With ``Pipeline.connect(..., relay="chain")`` the client opens a session on the first hop only,
with ``OpenSession.route`` naming the others (target, model fingerprint, layer range); that
worker opens the next hop itself, and so on (``shard.relay``). The client streams the prompt
to the first hop in chunks (each chunk's result is the last shard's, come back up the chain) and
then asks the first hop for a ``Generate``: the first worker feeds each token the last shard
chose into its own next step, so a token costs one trip along the chain and back, and none to
the client. Results, stop rules and errors are the client relay's: the same
``PipelineResult``, and a ``PipelineError`` naming the failing hop (from the error's
``relay_depth``, which each worker on the route counts up as it passes the error on).

Failover: a hop with replicas fails over as with client relay, from the client: the first hop's
runner moves to its next replica itself; a later hop's failure (``relay_depth``) moves the route
to that hop's next replica (``shard.pipeline.route.ChainRoute``), and the first hop's runner
opens a routed session again and replays the token log through the new route. A hung hop is
found by the route's step timeout (each worker bounds its next hop's answers). A draining
worker of a later hop finishes the generation it carries (its open streams may), so only the
first hop hands over.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

import trio

from shard.rpc.errors import ErrorCode, ShardError
from shard.stops import StopRules
from shard.v1 import shard_pb2 as pb

from .errors import Blame, Blames, Hop, PipelineError
from .generation import Generation, HopOutput, OnToken
from .prefix import route_limit
from .replicas import HopReplicas
from .result import PipelineResult
from .route import ChainRoute
from .runner import HopRunner
from .speculation import PassCost

__all__ = ["check_relay_allowed", "first_hop_runner", "run"]

log = logging.getLogger(__name__)



def check_relay_allowed(hops: Sequence[Hop]) -> None:
    """Every hop but the last must relay: refuse the chain naming the first that does not."""
    for hop in hops[:-1]:
        if hop.caps is not None and not hop.caps.relay_allowed:
            raise PipelineError(hop, ShardError(
                ErrorCode.UNSUPPORTED_FEATURE,
                "does not report relay_allowed (its operator did not start it with `trio-shard "
                "serve --allow-relay`), so it cannot relay to the next hop: use relay='client' "
                "(--relay client)",
            ))


def set_aside_non_relaying(replicas: Sequence[HopReplicas]) -> None:
    """A standby of a hop but the last that does not relay cannot take over in a chain: set
    it aside (``Replica.refused``, a warning), as a standby of another model or range is."""
    for hop in replicas[:-1]:
        for replica in hop.replicas:
            caps = replica.caps
            if replica is not hop.replica and caps is not None and not caps.relay_allowed \
                    and replica.refused is None:
                replica.refused = ShardError(
                    ErrorCode.UNSUPPORTED_FEATURE,
                    "does not report relay_allowed, so it cannot take over a hop of a chain")
                log.warning("%s: replica %s set aside: %s", hop.hop(), replica.target,
                            replica.refused)


def first_hop_runner(replicas: Sequence[HopReplicas], gen: Generation) -> HopRunner:
    """The one runner of a chain-relayed generation: hop 0, answering with logits, its route
    moving to a later hop's replica when that hop fails."""
    return HopRunner(replicas[0], gen, last=True, route=ChainRoute(replicas, gen.step_timeout))


async def run(
    runner: HopRunner,
    result: PipelineResult,
    prompt: str | Sequence[int],
    rules: StopRules,
    on_token: OnToken | None,
    blames: Blames,
    cost: PassCost | None = None,
) -> None:
    """``Pipeline.generate`` over a chain relay: the same steps, stop rules and result.
    ``cost`` learns the workers' loop's time per token (what speculation must beat)."""
    with Blame(runner, blames):
        # Without a route the hop probes nothing: its prefill may follow the open at once.
        await runner.open(ahead=True)
        last: list[pb.StepResult] = []

        async def keep(out: HopOutput) -> None:
            last[:] = [out.step]

        await runner.prefill_prompt(prompt, keep, route_limit([runner]))
    if not last or last[0].WhichOneof("output") != "logits":
        raise PipelineError(runner.hop, ShardError(ErrorCode.INTERNAL, "no logits after prefill"))
    step = last[0]
    result.prompt_tokens = step.n_past
    runner.gen.prompt_held(step.n_past)
    result.cached_tokens = runner.cached_tokens
    result.traversals = 1  # the prompt's; then one trip along the chain per token
    assert runner.session is not None
    capacity = runner.session.opened.kv_capacity  # the chain's least (the workers take the min)
    step.finish_reason = rules.finish_reason(  # type: ignore[assignment]
        step.logits.token_id, step.logits.is_eog, emitted=1, n_past=step.n_past, capacity=capacity)

    async def take(step: pb.StepResult) -> None:
        result.traversals += len(result.steps) > 0
        result.steps.append(step)
        if on_token is not None:
            maybe: Any = on_token(step)
            if inspect.isawaitable(maybe):
                await maybe

    await take(step)
    with Blame(runner, blames):
        if step.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            before, started = len(result.steps), trio.current_time()
            # (no more than the session holds: the loop stops at the context anyway, and the
            # wire's max_tokens is 32 bits)
            await runner.generate(take, max_tokens=min(rules.max_tokens - 1, capacity),
                                  stop_tokens=sorted(rules.stop_tokens),
                                  ignore_eos=rules.ignore_eos, fed=step.logits.token_id)
            if cost is not None:
                cost.observe_loop(len(result.steps) - before, trio.current_time() - started)
        await runner.close()
