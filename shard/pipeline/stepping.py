"""Client-stepped generation: the client sends every pass through the hops itself.

Client relay's whole generation (and a chain relay's when it speculates): the prompt streams
through the hops in chunks (``prefill``: one task per hop, each forwarding chunk ``i`` while
the hop before it computes chunk ``i+1``, at most one chunk waiting per hop), then each token
goes through every hop (``decode``) or, speculating, the next token and its drafts in one pass
(``verify``), the longest agreeing prefix kept. ``run`` drives it with the stop rules of a
worker's ``Generate``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from contextlib import nullcontext
from functools import partial

import numpy as np
import trio

from shard.rpc.errors import ErrorCode, ShardError, unwrap_single_exception
from shard.stops import StopRules
from shard.v1 import shard_pb2 as pb

from .drafting import Drafter
from .errors import Blame, Blames, PipelineError
from .result import PipelineResult
from .runner import HopRunner
from .generation import HopOutput, OnToken
from .prefix import route_limit
from .scoring import score
from .speculation import DraftPlanner, PassCost

__all__ = ["decode", "prefill", "run", "traverse", "verify"]

#: A prefill chunk on its way to the next hop: (position, rows, the ids from position on).
_Chunk = tuple[int, np.ndarray, Sequence[int] | None]



async def run(
    runners: list[HopRunner],
    result: PipelineResult,
    prompt: str | Sequence[int],
    rules: StopRules,
    on_token: OnToken | None,
    blames: Blames,
    cost: PassCost,
    speculate: int = 0,
    drafter: Drafter | None = None,
    *,
    loop: bool = False,
) -> None:
    """The client steps every pass. ``cost``: what a pass through this chain costs,
    learned across generations (speculation drafts only as many tokens as pay for their
    rows). ``loop`` (chain relay, speculating): plain decoding is a stretch of the
    workers' own loop (``Generate`` on the first hop) instead."""
    for runner in runners:
        with Blame(runner, blames):
            await runner.open()
    window = runners[0].gen.score_window
    if window:  # the prompt's log-probs: passes of all_logits steps (shard.pipeline.scoring)
        assert not isinstance(prompt, str)
        # the passes write the prompt as positions: a replay sends those (the log's tokens)
        runners[0].tokens.hold_prompt((), 0)
        step = await score(lambda at, ids: traverse(runners, at, ids, blames, score=True),
                           prompt, window, result)
    else:
        step = await prefill(runners, prompt, blames)
    result.prompt_tokens = step.n_past
    runners[0].gen.prompt_held(step.n_past)
    result.cached_tokens = runners[0].cached_tokens
    result.traversals = 1
    # Drafting reads the prompt's ids (a text's as the first shard echoed them; none from a
    # worker that does not) and every token generated.
    history = list(prompt) if not isinstance(prompt, str) else list(runners[0].prompt_ids or ())
    drafter = drafter if speculate else None
    planner = DraftPlanner(speculate, cost, loop=loop) if drafter is not None else None
    synced = True  # every hop holds exactly the positions before ``token`` (none rejected)
    capacity = min(r.session.opened.kv_capacity for r in runners if r.session is not None)

    async def emit(out: pb.StepResult) -> bool:
        """Hand one step to the result and the caller; True when the generation ends."""
        out.finish_reason = rules.finish_reason(  # type: ignore[assignment]
            out.logits.token_id, out.logits.is_eog, emitted=len(result.steps) + 1,
            n_past=out.n_past, capacity=capacity)
        result.steps.append(out)
        history.append(out.logits.token_id)
        if on_token is not None:
            maybe = on_token(out)
            if inspect.isawaitable(maybe):
                await maybe
        if out.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            return True
        # a caller that cancelled from on_token sees no token of the pass after it
        await trio.lowlevel.checkpoint_if_cancelled()
        return False

    pending = [step]
    while rules.max_tokens:  # (0: the prompt scored, nothing generated)
        capacity = min(r.session.opened.kv_capacity for r in runners if r.session is not None)
        finished = False
        for step in pending:
            if finished := await emit(step):
                break
        if finished:
            break
        token = step.logits.token_id
        result.traversals += 1
        if drafter is None or planner is None:
            pending = [await decode(runners, token, blames)]
            continue
        wanted = planner.drafts()
        if wanted == 0 and loop and synced and planner.cost.known:
            # Plain decoding with chain relay: a stretch of the workers' loop, then the
            # planner looks again (a text may become worth drafting).
            got: list[pb.StepResult] = []

            async def take(out: pb.StepResult) -> None:
                if not got or got[-1].finish_reason == pb.FINISH_REASON_UNSPECIFIED:
                    got.append(out)
                    await emit(out)  # the workers stop on the same rules

            started = trio.current_time()
            with Blame(runners[0], blames):
                await runners[0].generate(
                    take, max_tokens=min(planner.stretch(), rules.max_tokens - len(result.steps)),
                    stop_tokens=sorted(rules.stop_tokens), ignore_eos=rules.ignore_eos,
                    fed=token)
            planner.looped(len(got), trio.current_time() - started)
            result.traversals += max(len(got) - 1, 0)  # one trip along the chain per token
            if not got:
                raise PipelineError(runners[0].hop, ShardError(
                    ErrorCode.INTERNAL, "the workers' loop returned no token"))
            if got[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                break
            step, pending = got[-1], []
            continue
        # Drafts that pay for their rows (the planner), and that, every one kept, still
        # leave a token to emit within max_tokens and fit every hop's KV budget.
        room = min(wanted, rules.max_tokens - len(result.steps) - 1, capacity - step.n_past - 1)
        drafts = list(drafter.propose(history, room))[:room] if room > 0 else []
        started = trio.current_time()
        if not drafts and synced:  # nothing to verify or roll back: a plain decode step
            pending = [await decode(runners, token, blames)]
        else:
            pending = await verify(runners, step.n_past, [token, *drafts], blames)
        accepted = len(pending) - 1
        planner.passed(len(drafts), accepted, trio.current_time() - started)
        synced = accepted == len(drafts)  # else the hops hold rejected positions
        result.drafted_tokens += len(drafts)
        result.accepted_tokens += accepted
    for runner in runners:
        runner.leave_group()  # (every hop's group stops waiting for it before the closes)
    for runner in runners:
        with Blame(runner, blames):
            await runner.close()


async def prefill(
    runners: list[HopRunner], prompt: str | Sequence[int], blames: Blames
) -> pb.StepResult:
    """Stream the prompt through the chain in chunks; return the last shard's last result."""
    n = len(runners)
    last: list[pb.StepResult] = []
    limit = route_limit(runners)  # what every hop holds of the prompt

    async def forward(out: trio.MemorySendChannel[_Chunk] | None, o: HopOutput) -> None:
        if out is None:
            last[:] = [o.step]
        else:
            assert o.rows is not None
            # positions the hop took from its prefix cache go on as ids only (the next hop
            # takes them from its own), then the rows with the ids they stand for
            position = o.start - o.step.cached_tokens
            ids = runners[0].prompt_ids
            await out.send((position, o.rows,
                            None if ids is None else ids[position : o.step.n_past]))

    async def first(out: trio.MemorySendChannel[_Chunk] | None) -> None:
        with Blame(runners[0], blames, nursery.cancel_scope):
            async with out if out is not None else nullcontext():  # closing ends the next hop
                await runners[0].prefill_prompt(prompt, partial(forward, out), limit)

    async def later(
        k: int, inbox: trio.MemoryReceiveChannel[_Chunk], out: trio.MemorySendChannel[_Chunk] | None,
    ) -> None:
        with Blame(runners[k], blames, nursery.cancel_scope):
            async with inbox, out if out is not None else nullcontext():
                async for position, rows, ids in inbox:
                    await forward(out, await runners[k].prefill_rows(position, rows, ids, limit))

    with unwrap_single_exception():
        async with trio.open_nursery() as nursery:
            channels = [trio.open_memory_channel[_Chunk](1) for _ in range(n - 1)]
            nursery.start_soon(first, channels[0][0] if n > 1 else None)
            for k in range(1, n):
                out = channels[k][0] if k < n - 1 else None
                nursery.start_soon(later, k, channels[k - 1][1], out)
    if blames.failures:
        raise blames.failures[0]
    if not last or last[0].WhichOneof("output") != "logits":
        raise PipelineError(runners[-1].hop, ShardError(ErrorCode.INTERNAL,
                                                     "no logits after prefill"))
    return last[0]


async def verify(
    runners: list[HopRunner], position: int, tokens: list[int], blames: Blames
) -> list[pb.StepResult]:
    """One pass of ``tokens`` (the next token, then drafts) written at ``position`` on every
    hop; returns the results to emit: one per draft the model agreed with (in order) and
    the model's own token after them. A position's result looks like the decode's that
    would have produced it (its ``logits``, ``n_past``)."""
    last = await traverse(runners, position, tokens, blames)
    start = last.n_past - len(last.position_logits)
    emitted: list[pb.StepResult] = []
    for i, logits in enumerate(last.position_logits):
        emitted.append(pb.StepResult(
            step=last.step, n_past=start + i + 1, tokens_processed=1, logits=logits,
            start_position=start + i,
        ))
        if i + 1 >= len(tokens) or logits.token_id != tokens[i + 1]:
            break  # the model's own token here: the drafts after it are rejected
    return emitted

async def traverse(runners: list[HopRunner], position: int, tokens: Sequence[int],
                   blames: Blames, *, score: bool = False) -> pb.StepResult:
    """``tokens`` written at ``position`` through every hop in one ``all_logits`` pass
    (``HopRunner.verify``; ``score``: a pass over the prompt); the last shard's result."""
    with Blame(runners[0], blames):
        out = await runners[0].verify(position, tokens=tokens, score=score)
    for runner in runners[1:]:
        with Blame(runner, blames):
            assert out.rows is not None
            start = out.start - out.step.cached_tokens
            out = await runner.verify(start, rows=out.rows, ids=tokens[start - position :],
                                      score=score)
    return out.step


async def decode(runners: list[HopRunner], token: int, blames: Blames) -> pb.StepResult:
    """One token through every hop; the last hop's result carries the next token."""
    with Blame(runners[0], blames):
        out = await runners[0].decode(token=token)
    for runner in runners[1:]:
        with Blame(runner, blames):
            out = await runner.decode(row=out.rows, token_id=token)
    return out.step
