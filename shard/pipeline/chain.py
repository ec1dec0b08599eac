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

Why no failover: a replica would have to be opened, and the history replayed, by the worker
before the failed one; that is future work, so a hop with replicas is refused here.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from shard.rpc.errors import ErrorCode, ShardError
from shard.rpc.routes import relay_session_id
from shard.stops import StopRules
from shard.v1 import shard_pb2 as pb

from .errors import Blame, Blames, Hop, PipelineError
from .replicas import HopReplicas
from .result import PipelineResult
from .runner import Generation, HopOutput, HopRunner
from .speculation import PassCost

__all__ = ["check_relay_allowed", "first_hop_runner", "refuse_replicas", "release_downstream", "run"]

OnToken = Callable[[pb.StepResult], "Awaitable[None] | None"]


def refuse_replicas(hops: Sequence[Sequence[str]]) -> None:
    """Chain relay cannot fail over yet: refuse a hop with replicas, before connecting."""
    for i, targets in enumerate(hops):
        if len(targets) > 1:
            raise PipelineError(Hop(i, targets[0]), ShardError(
                ErrorCode.UNSUPPORTED_FEATURE,
                f"lists replicas ({', '.join(targets)}), and chain relay does not fail over "
                "(failover with chain relay is future work): use relay='client' "
                "(--relay client) for hops with replicas",
            ))


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


def route_after(replicas: Sequence[HopReplicas], index: int, step_timeout: float | None) -> pb.Route:
    """The route the worker of hop ``index`` is given: every hop after it, as checked, and
    the step timeout each hop has to answer a step (``Route.step_timeout_ms``)."""
    hops = []
    for r in replicas[index + 1:]:
        ref = r.reference
        assert ref is not None
        hops.append(pb.RouteHop(
            target=r.replica.target, expected_model_fingerprint=ref.model_fingerprint,
            expected_layer_range=pb.LayerRange(start=ref.layer_range.start, end=ref.layer_range.end),
        ))
    route = pb.Route(hops=hops)
    if step_timeout is not None:
        route.step_timeout_ms = max(1, round(step_timeout * 1000))
    if index == 0 and len(hops) >= 2:
        # direct return: the last hop hands each token to the first one straight away (at the
        # address the first worker's operator advertises; the workers take part only if every
        # hop reports relay_return; docs/pipelines.md)
        route.return_to.SetInParent()
    return route


def first_hop_runner(replicas: Sequence[HopReplicas], gen: Generation) -> HopRunner:
    """The one runner of a chain-relayed generation: hop 0, answering with logits."""
    return HopRunner(replicas[0], gen, last=True, route=route_after(replicas, 0, gen.step_timeout))


def release_downstream(
    nursery: trio.Nursery, replicas: Sequence[HopReplicas], runner: HopRunner, gen: Generation
) -> None:
    """After a failure: ``Release`` every later hop's session by its relay name (the workers
    reset them already; this covers a worker lost mid-chain, whose downstream would retain its
    session for resume)."""
    name = runner.name
    for r in replicas[1:]:
        name = relay_session_id(name)
        nursery.start_soon(gen.release, r.replica, name)


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
        await runner.open()
        last: list[pb.StepResult] = []

        async def keep(out: HopOutput) -> None:
            last[:] = [out.step]

        await runner.prefill_prompt(prompt, keep)
    if not last or last[0].WhichOneof("output") != "logits":
        raise PipelineError(runner.hop, ShardError(ErrorCode.INTERNAL, "no logits after prefill"))
    step = last[0]
    result.prompt_tokens = step.n_past
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
            await runner.generate(take, max_tokens=rules.max_tokens - 1,
                                  stop_tokens=sorted(rules.stop_tokens),
                                  ignore_eos=rules.ignore_eos, fed=step.logits.token_id)
            if cost is not None:
                cost.observe_loop(len(result.steps) - before, trio.current_time() - started)
        await runner.close()
