"""The steps of a plain session: Prefill, Decode and Generate (a Rewind and state moves are
the step context's and ``transfer``'s), each sending its results through the step context.

Only credit waits and engine calls are cancellable by an out-of-band Cancel (``cancellable``);
handing a computed result to the transport is not, so a Cancel can never drop a committed
result, and ``Usage`` counts exactly the results sent.
"""

from __future__ import annotations

import trio

from shard.engine import EngineError, Lookahead, PrefillRequest, StepResult, StreamRequest
from shard.v1 import shard_pb2 as pb

from .. import convert
from ..errors import ErrorCode, ShardError
from . import inputs
from .context import StepContext
from .generation import UNFINISHED, Generation, count_prefill, generate
from .protocols import Returner, SessionHost


async def prefill(ctx: StepContext, p: pb.Prefill, usage: pb.Usage) -> None:
    """One StepResult for the whole input, or one per ``chunk_tokens`` positions, each sent
    as soon as it is computed (a failed chunk leaves the earlier chunks in the session)."""
    sid = ctx.session_id
    inp = await ctx.prefill_input(p)
    hint = ctx.client_hint() if inp.tokens is not None and not p.all_logits else None
    echo = inp.tokens if p.WhichOneof("input") == "text" and p.echo_tokens else None
    chunks = inp.chunks(p.chunk_tokens)
    for start, stop in chunks:
        last = stop >= inp.n
        with ctx.cancellable():
            await ctx.take_credit()
            result = await ctx.engine_call(ctx.engine.prefill, inp.request(
                sid, start, stop, top_k_logprobs=p.top_logprobs,
                lookahead=hint if last else None, all_logits=p.all_logits,
            ))
        if start == 0:
            await ctx.first_chunk(inp, result)
        chunks.took(result, start, stop)
        await ctx.send_step(result, inp.position + start, input_tokens=echo, usage_follows=last)
        echo = None
        # Counted once delivered: Usage reports only what the client received.
        count_prefill(usage, result)


async def decode(ctx: StepContext, d: pb.Decode, usage: pb.Usage, returner: Returner | None) -> None:
    """One position appended (a token or a hidden row); a last hop of a direct-return route
    also hands its result to the route's return address (``returner``)."""
    result, start = await compute_decode(ctx, d)
    if returner is not None and d.relay_tag and result.logits is not None:
        # the chain's first hop may start its next step before this reaches it up the chain
        returner.push(d.relay_tag, convert.step_to_proto(
            result, ctx.outbox.step_no + 1, start, ctx.wire_dtype))
    await ctx.send_step(result, start, usage_follows=True)
    usage.generated_tokens += 1


async def compute_decode(ctx: StepContext, d: pb.Decode, *, credit: bool = True
                         ) -> tuple[StepResult, int]:
    """A Decode's checked input computed (within the Cancel region): (result, its start).
    ``credit``: take one first (a group row's result leaves on the group's stream, which is
    paced by its one answer per request, not by the session's credit)."""
    sampling, token, hidden, token_id = ctx.decode_input(d)
    if token is not None:
        ctx.follows = (ctx.positions.next_token is not None
                       and token == ctx.positions.next_token)
    hint = ctx.client_hint() if token is not None else None
    with ctx.cancellable():
        if credit:
            await ctx.take_credit()
        start = ctx.positions.end
        result = await ctx.decode_one(token, hidden, sampling, d.top_logprobs, hint, token_id)
    return result, start


async def run_generate(ctx: StepContext, g: pb.Generate, usage: pb.Usage, registry: SessionHost) -> None:
    """A Generate on a worker that serves the whole model (the one generation loop, with this
    engine as its step source); it yields to a drain when asked to and the session can move."""
    caps = ctx.caps
    if not (caps.is_first and caps.is_last):
        raise ShardError(
            ErrorCode.UNSUPPORTED_FEATURE,
            "Generate needs a worker that serves the whole model (first and last shard)",
            session_id=ctx.session_id,
        )
    drain = registry if g.yield_on_drain and caps.kv_layout else None
    await generate(ctx, g, usage, LocalSteps(ctx), drain=drain)


class LocalSteps:
    """A plain session's generation source (``StepSource``): this engine's steps, and once
    the prompt is in (and no step timeout applies) the next tokens as one engine stream."""

    __slots__ = ("_ctx", "_ahead")

    forward = None  # the token is read from this engine's own result

    def __init__(self, ctx: StepContext) -> None:
        self._ctx = ctx
        self._ahead = ctx.limits.lookahead != "off"  # the engine may compute the next step ahead

    def batched(self, run: Generation) -> bool:
        ctx = self._ctx
        positions = ctx.positions
        return bool(run.emitted) and ctx.step_timeout is None and positions.end == positions.engine

    async def compute(self, run: Generation) -> StepResult:
        ctx, g = self._ctx, run.request
        # The steps that may follow this one: the engine may compute the next ahead.
        hint = None
        if self._ahead and run.left > 1:
            hint = Lookahead(run.left - 1, run.rules.stop_tokens, stop_at_eog=not g.ignore_eos)
        if run.prompt_step:
            result = await ctx.engine_call(ctx.engine.prefill, PrefillRequest(
                ctx.session_id, run.prompt, position=ctx.positions.end, sampling=run.sampling,
                top_k_logprobs=g.top_logprobs, lookahead=hint, cache_limit=inputs.cache_limit(g),
            ))
        else:
            token = ctx.positions.next_token
            assert token is not None
            result = await ctx.decode_one(token, None, run.sampling, g.top_logprobs, hint)
        assert result.logits is not None
        return result

    async def send(self, run: Generation, answer: StepResult | pb.StepResult, start: int,
                   mine: StepResult) -> None:
        finish = run.finish
        # (queued without a scheduler pass: the next step's engine call is one)
        await self._ctx.send_step(mine, start, finish, now=True,
                                  usage_follows=finish != UNFINISHED)

    async def run_batch(self, run: Generation) -> None:
        """The next tokens as one engine stream (``ShardEngine.stream``): each token is framed
        by ``deliver`` where the engine finished its step (for a batching engine, one pass over
        a tick's sessions), not by this task, which sleeps until the stream ends: the
        generation finished, the credit ran out (the next stream waits for it), a response
        must wait for room, or a drain asks the generation to yield. The same messages,
        credits, counts and positions as step by step (``send_step``)."""
        ctx, g = self._ctx, run.request
        token = ctx.positions.next_token
        assert token is not None
        held: pb.SessionResponse | None = None
        positions, outbox, count = ctx.positions, ctx.outbox, ctx.registry.count
        decide, counted, drain = run.decide, run.count, run.drain
        take_credit = ctx.credits.take_now

        def deliver(result: StepResult) -> bool:
            nonlocal held
            start = positions.end
            positions.computed(start, result)
            logits = result.logits
            finish = decide(logits.token_id, logits.is_eog, result.n_past)
            msg = convert.token_response(result, outbox.next_result(), start, finish)
            counted(result)
            last = finish != UNFINISHED
            try:
                outbox.send_nowait(msg, more_follows=last)
            except (trio.WouldBlock, trio.BrokenResourceError):
                held = msg  # sent by the task once the stream ended (it may wait)
                return False
            count("steps_sent_total")
            positions.sent(result.n_past)
            if last or (drain is not None and drain.draining):
                return False
            return take_credit()  # none left: the next step waits for credit in this task

        try:
            with ctx.cancellable():
                await ctx.take_credit()
                try:
                    await ctx.engine.stream(StreamRequest(
                        ctx.session_id, token, run.left, run.sampling, g.top_logprobs,
                        lookahead=self._ahead, stop_tokens=run.rules.stop_tokens,
                        stop_at_eog=not g.ignore_eos), deliver)
                except EngineError as exc:
                    ctx.resync()
                    raise ShardError.from_engine(exc) from None
                except BaseException:  # a Cancel, the call deadline, a reset: rolled back
                    ctx.resync()
                    raise
        finally:
            if held is not None:  # a delivered token that found no room: it waits its turn
                await outbox.respond(held, more_follows=run.finish != UNFINISHED)
                count("steps_sent_total")
                positions.sent(positions.end)
