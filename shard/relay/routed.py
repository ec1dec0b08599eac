"""The steps of a routed session: this worker's engine, then the rest of the chain.

A session opened with a route forwards every boundary result of this worker's engine to the next
hop and answers each step with what comes back: the last shard's result (logits), travelling
back up the chain. Why return the downstream's final result rather than stream our own boundary
too: the client then needs one stream (to the first hop) and sees exactly what a client-relayed
pipeline sees; and a ``Generate`` on the first hop runs the decode loop on the workers, so a
token costs no round trip to the client at all (docs/pipelines.md, "Chain relay").

Positions: every step records what happened in the session's ``ChainLedger`` (rows computed
here from ``first``, the next hop holding ``n_past``, a failure there) and never moves the
session's end itself; after every request ``settle`` applies the ledger's one rule, so every hop
holds exactly the chain's ``n_past`` again, failed requests included. Rows always go to the next
hop at their own position (``first = n_past - rows``: a prefix this engine reused is not
recomputed, so its rows are not sent either, and the next hop already holds that prefix).

Direct return (``Route.return_to``, ``returns.DirectReturns``): on a route of two or more hops
the first hop's ``Generate`` tags each decode step; the last hop hands the tagged result straight
back (the ``Return`` RPC), and the first hop goes on with the first copy to arrive, sending the
next step before the previous answer came up the chain. So a hop given a return address queues
one step behind the running one (and drops it, answered ``CANCELLED``, if the running one
fails); the chain's answers are still read, in order, checked against the copy used and only
then delivered. A token then costs one trip around the ring of workers instead of a trip down
the chain and back.

Errors: what the next hop reports is raised as it came (named structurally by ``NextHop``); a
next hop whose stream ended ends this stream with its error.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import trio

from shard.engine import DecodeRequest, PrefillRequest, SamplingParams, StepResult
from shard.v1 import shard_pb2 as pb

from shard.rpc.errors import ErrorCode, ShardError
from shard.rpc.session import (
    Generation, StepHost, cache_limit, count_prefill, generate, return_refused,
)
from .downstream import NextHop
from .ledger import ChainLedger
from .returns import DirectReturns, Slot

__all__ = ["RoutedSession"]


def _rows(result: StepResult) -> np.ndarray:
    """This worker's boundary rows (a routed worker is never the last shard)."""
    if result.boundary is None:
        raise ShardError(ErrorCode.INTERNAL, "a routed shard produced no boundary hidden states")
    return result.boundary.hidden_states


def first_row(result: StepResult) -> int:
    """The position of ``result``'s first row: the step's position plus the prefix the engine
    reused (held already, so neither computed nor sent). Rows go to the next hop there."""
    return result.n_past - int(_rows(result).shape[0])


def _disagree(answer: pb.StepResult, used: pb.StepResult) -> bool:
    """The chain's answer differs from the copy handed back directly (which the next step went
    on with): another token, another position, or another log-probability (a copy from a
    stale or foreign push; an honest copy is the same result, bit for bit)."""
    return (answer.n_past != used.n_past or answer.logits.token_id != used.logits.token_id
            or answer.logits.logprob != used.logits.logprob)


class RoutedSession:
    """This worker's side of one routed session (``shard.rpc.session.Routed``)."""

    def __init__(self, host: StepHost, down: NextHop, returns: DirectReturns | None) -> None:
        self.host = host
        self.down = down
        #: A first hop's return address (the Return RPC hands results to it), if the chain
        #: takes part in a direct return.
        self.returns = returns
        self.ledger = ChainLedger()
        self.positions = self.ledger
        self.kv_capacity = down.kv_capacity
        self.prefix_held = down.prefix_held
        #: The token ids of the generation step just computed (what its rows stand for).
        self._step_ids: tuple[int, ...] = ()

    # ---- the Routed protocol ---------------------------------------------------------------

    async def step(self, req: pb.SessionRequest, usage: pb.Usage) -> None:
        kind = req.WhichOneof("kind")
        if kind == "prefill":
            await self._prefill(req.prefill, usage)
        elif kind == "decode":
            await self._decode(req.decode, usage)
        elif kind == "rewind":
            await self.host.truncate_engine(self.host.rewind_position(req.rewind))
        else:
            await self._generate(req.generate, usage)

    async def settle(self) -> None:
        """Drop what the chain does not hold alike (``ChainLedger.settle_plan``): this engine's
        surplus, and the next hop's (``Rewind``; a next hop without it is told the position by
        the next step instead, which rewrites from there)."""
        truncate_to, rewind_to = self.ledger.settle_plan()
        if truncate_to is not None:
            await self.host.truncate_engine(truncate_to)
        if rewind_to is not None and self.down.rewinds:
            if not self.down.alive():
                await self.host.end_with(self.down.named(ShardError(
                    ErrorCode.NOT_READY, "the session on the next hop ended")))
            try:
                held = await self.down.rewind(rewind_to)
            except ShardError as err:
                await self.host.end_with(err)
            self.ledger.downstream_rewound(held)

    def cancel(self) -> None:
        self.down.cancel()

    def deadline_error(self) -> ShardError | None:
        if not self.down.busy:
            return None
        return self.down.named(ShardError(
            ErrorCode.DEADLINE_EXCEEDED, "the call deadline expired before it answered the step"))

    def offer_return(self, secret: bytes, tag: int, step: pb.StepResult) -> bool:
        if self.returns is None:
            raise return_refused(self.host.session_id)
        return self.returns.offer(secret, tag, step)

    async def close(self) -> None:
        await self.down.close()

    def abort(self) -> None:
        self.down.abort()

    # ---- forwarding ----------------------------------------------------------------------

    async def _forward(
        self, rows: np.ndarray, first: int, sampling: pb.SamplingParams, top_logprobs: int,
        *, all_logits: bool = False, relay_tag: int = 0, cached: int = 0,
        ids: Sequence[int] | None = None, limit: int | None = None,
    ) -> pb.StepResult:
        """Rows computed here from ``first`` go to the next hop, at ``first``: one row appended
        (a Decode) when that is where its end will be, else written there (a Prefill). ``ids``:
        the token ids of the step's input from its first position on, of which the ``cached``
        positions before ``first`` (copied here from the prefix cache, so without rows) go as
        ids only: the next hop takes them from its own cache (``limit``: the step's
        ``cache_limit``, passed on so that no hop before the last takes more from its cache than
        the hops after it hold). Returns the last shard's answer;
        the ledger records what the next hop holds either way."""
        n = int(rows.shape[0])
        start = first - cached
        send_ids = None if ids is None else ids[len(ids) - n - cached :]
        if cached and (send_ids is None or not self.down.caches):
            raise self.down.named(ShardError(
                ErrorCode.ILLEGAL_TRANSITION,
                f"this worker took {cached} positions from its prefix cache and the next hop has "
                "none (serve --prefix-cache-tokens on every hop of a route, or on none)",
                retryable=False, reason="PREFIX_NOT_CACHED"))
        appends = self.ledger.sending(start, n + cached)
        try:
            if appends and start > 0 and n == 1 and not cached and not all_logits:
                final = await self.down.decode(rows, sampling, top_logprobs, relay_tag,
                                               None if send_ids is None else send_ids[0])
            else:
                final = await self.down.prefill(rows, start, sampling, top_logprobs, all_logits,
                                                send_ids, limit)
        except ShardError as err:
            await self._failed_downstream(err)
            raise
        self._check_answer(final, first + n)
        self.ledger.forwarded(start, final.n_past, final.logits.token_id)
        return final

    def _check_answer(self, final: pb.StepResult, n_past: int) -> None:
        """The answer is the last shard's, for the rows sent (anything else is a chain that
        cannot be trusted: INTERNAL, which ends the stream)."""
        if final.WhichOneof("output") != "logits":
            raise ShardError(ErrorCode.INTERNAL, f"{self.down.label}: the route did not end at "
                             "the last shard (no logits came back)")
        if final.n_past != n_past:
            raise ShardError(ErrorCode.INTERNAL, f"{self.down.label} holds {final.n_past} "
                             f"positions after the step, not {n_past}")

    async def _failed_downstream(self, err: ShardError) -> None:
        """A step failed at or after the next hop: record what it holds now, or end this
        stream with the error if its session ended (nothing is known to hold any more)."""
        held = self.down.held() if self.down.alive() else None
        if held is None:
            await self.host.end_with(err)
        self.ledger.downstream_failed(held)

    async def _answer(
        self, final: pb.StepResult, start: int, mine: StepResult,
        finish: int = pb.FINISH_REASON_UNSPECIFIED, input_tokens: Sequence[int] | None = None,
        *, usage_follows: bool = False,
    ) -> None:
        """Answer the step with the last shard's result, numbered as this session's step, with
        this worker's own input accounting (positions computed here, reused here)."""
        msg = pb.StepResult()
        msg.CopyFrom(final)
        msg.start_position = start
        msg.tokens_processed = mine.tokens_processed
        msg.reused_tokens = mine.reused_tokens
        msg.cached_tokens = mine.cached_tokens
        msg.finish_reason = finish  # type: ignore[assignment]
        msg.more_chunks = False
        if input_tokens is not None:  # Prefill.echo_tokens: this worker tokenized the text
            msg.input_tokens.ids.extend(input_tokens)
        await self.host.send_result(msg, usage_follows=usage_follows)
        self.ledger.sent(final.n_past)

    async def _compute_decode(
        self, token: int | None, hidden: np.ndarray | None, sampling: SamplingParams, top_k: int,
        token_id: int | None = None,
    ) -> StepResult:
        """One position appended at this engine's end (which is ahead of the chain's while a
        direct return runs a step ahead); ``token_id``: what a hidden row stands for."""
        host = self.host
        return await host.engine_call(host.engine.decode, DecodeRequest(
            host.session_id, token=token, hidden_state=hidden, sampling=sampling, top_k_logprobs=top_k,
            token_id=token_id))

    # ---- Prefill, Decode, Generate ---------------------------------------------------------

    async def _prefill(self, p: pb.Prefill, usage: pb.Usage) -> None:
        """Pipelined as the client relay is: this engine computes chunk i+1 while the next hop
        takes chunk i (a channel of one chunk between the two tasks)."""
        host = self.host
        inp = await host.prefill_input(p)
        ids = inp.tokens if inp.tokens is not None else inp.token_ids
        echo = (list(inp.tokens) if p.WhichOneof("input") == "text" and p.echo_tokens
                and inp.tokens is not None else None)
        failed: list[ShardError] = []
        send, recv = trio.open_memory_channel[tuple[StepResult, int]](1)

        async def compute() -> None:
            async with send:
                try:
                    chunks = inp.chunks(p.chunk_tokens)
                    for start, stop in chunks:
                        with host.cancellable():
                            await host.take_credit()
                            result = await host.engine_call(host.engine.prefill, inp.request(
                                host.session_id, start, stop, top_k_logprobs=p.top_logprobs,
                                all_logits=p.all_logits))  # (every position computed)
                        if start == 0:
                            await host.first_chunk(inp, result)
                        chunks.took(result, start, stop)
                        try:
                            await send.send((result, inp.position + start))
                        except trio.BrokenResourceError:
                            return  # the forward failed: its error is the request's
                except ShardError as err:  # computed chunks are still forwarded, then it raises
                    failed.append(err)

        async def forward() -> None:
            sent = 0
            async with recv:
                async for result, start in recv:
                    try:  # verification (all_logits): the last shard's
                        final = await self._forward(
                            _rows(result), first_row(result), p.sampling, p.top_logprobs,
                            all_logits=p.all_logits, cached=result.cached_tokens,
                            limit=inp.cache_limit, ids=None if ids is None
                            else ids[start - inp.position : result.n_past - inp.position])
                    except ShardError as err:  # the next hop's: stop computing, it is the error
                        failed.insert(0, err)
                        nursery.cancel_scope.cancel()
                        return
                    await self._answer(final, start, result,
                                       input_tokens=echo if sent == 0 else None)
                    sent += 1
                    count_prefill(usage, result)

        # Neither task raises a ShardError out of the nursery: a failure is recorded and the
        # other task cancelled, so the request ends with one error, never a group (a group of
        # an error and the stream's own cancellation would escape the step).
        async with trio.open_nursery() as nursery:
            nursery.start_soon(compute)
            nursery.start_soon(forward)
        if failed:
            raise failed[0]

    async def _decode(self, d: pb.Decode, usage: pb.Usage) -> None:
        host = self.host
        sampling, token, hidden, token_id = host.decode_input(d)
        with host.cancellable():
            await host.take_credit()
            start = self.ledger.end
            result = await self._compute_decode(token, hidden, sampling, d.top_logprobs, token_id)
        own = token if token is not None else token_id
        final = await self._forward(_rows(result), first_row(result), d.sampling, d.top_logprobs,
                                    relay_tag=d.relay_tag, ids=None if own is None else (own,))
        await self._answer(final, start, result, usage_follows=True)
        usage.generated_tokens += 1

    async def _generate(self, g: pb.Generate, usage: pb.Usage) -> None:
        """Server-driven decoding over the chain (the session's one generation loop, with this
        session as its step source): the first hop feeds each token the last shard chose back
        into its own next step, with the worker's stop rules, the capacity being the least of
        the chain's."""
        host = self.host
        if not host.caps.is_first:
            raise ShardError(ErrorCode.UNSUPPORTED_FEATURE,
                             "Generate on a routed session needs the first shard",
                             session_id=host.session_id)
        await generate(host, g, usage, self)

    # ---- the generation's step source (``shard.rpc.session.StepSource``) -----------------

    def batched(self, run: Generation) -> bool:
        """With a direct return, once the chain holds the prompt: steps run ahead of the
        chain's answers (``run_batch``)."""
        ledger = self.ledger
        return (self.returns is not None and (run.emitted > 0 or run.prompt is None)
                and ledger.pending == ledger.engine)

    async def compute(self, run: Generation) -> StepResult:
        host, g = self.host, run.request
        if run.prompt_step:
            assert run.prompt is not None
            self._step_ids = run.prompt
            return await host.engine_call(host.engine.prefill, PrefillRequest(
                host.session_id, run.prompt, position=self.ledger.end, sampling=run.sampling,
                top_k_logprobs=g.top_logprobs, cache_limit=cache_limit(g),
            ))
        token = self.ledger.next_token
        assert token is not None
        self._step_ids = (token,)
        return await self._compute_decode(token, None, run.sampling, g.top_logprobs)

    async def forward(self, run: Generation, mine: StepResult) -> pb.StepResult:
        g = run.request
        return await self._forward(_rows(mine), first_row(mine), g.sampling, g.top_logprobs,
                                   cached=mine.cached_tokens, ids=self._step_ids,
                                   limit=cache_limit(g))

    async def send(self, run: Generation, answer: StepResult | pb.StepResult, start: int,
                   mine: StepResult) -> None:
        assert isinstance(answer, pb.StepResult)
        finish = run.finish
        await self._answer(answer, start, mine, finish,
                           usage_follows=finish != pb.FINISH_REASON_UNSPECIFIED)

    async def run_batch(self, run: Generation) -> None:
        """The generation's steps with a direct return: each step goes on with the first
        copy of the last hop's result to arrive (``Return`` or the chain's answer), so the next
        step is sent before the previous one's answer came back up the chain (its session
        queues it). Results reach the client in order, each once the chain's answer confirmed
        the copy used; a chain error (a Cancel, a failed hop) stops the loop and every step
        sent is answered before the ledger is told what the next hop holds."""
        host, ledger, down, returns = self.host, self.ledger, self.down, self.returns
        assert returns is not None
        g = run.request
        token = ledger.next_token
        assert token is not None
        inflight: deque[Slot] = deque()  # sent downstream, not delivered yet (oldest first)
        mine: dict[int, StepResult] = {}  # this worker's own result per tag (its accounting)
        finish_of: dict[int, int] = {}  # tags the loop went on with, and their finish reasons
        chain_errors: list[ShardError] = []  # what the downstream answered, in order
        own_errors: list[ShardError] = []  # this worker's own step's (a Cancel, its engine)
        delivered = [ledger.end]  # the chain's n_past after the last result delivered
        send, recv = trio.open_memory_channel[Slot](2)

        async def read_answers() -> None:
            async with recv:
                async for slot in recv:
                    try:
                        slot.answer(await down.read_answer(), None)
                    except ShardError as err:
                        slot.answer(None, err)

        async def deliver(slot: Slot) -> bool:
            """Send the oldest step on once its chain answer arrived; False: it failed."""
            await slot.answered.wait()
            inflight.popleft()
            returns.forget(slot)
            if slot.chain_error is not None:
                chain_errors.append(slot.chain_error)
                return False
            answer, used = slot.chain, slot.used
            assert answer is not None and used is not None
            self._check_answer(answer, slot.start + 1)
            ledger.forwarded(slot.start, answer.n_past, answer.logits.token_id)
            if slot.tag not in finish_of:  # answered, but the loop stopped before using it
                return False
            if _disagree(answer, used):
                await host.end_with(ShardError(
                    ErrorCode.INTERNAL, f"{down.label}: the result handed back directly "
                    "disagrees with the chain's answer"))
            result = mine.pop(slot.tag)
            await self._answer(answer, slot.start, result, finish_of[slot.tag])
            delivered[0] = answer.n_past
            run.count(result)
            return True

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_answers)
            async with send:
                try:
                    while True:
                        # with no credit left, the client waits for a result that is still in
                        # flight: deliver it first (its answer comes without us)
                        while inflight and host.credit.value <= 0:
                            if not await deliver(inflight[0]):
                                break
                        if chain_errors:
                            break
                        with host.cancellable():
                            await host.take_credit()
                            result = await self._compute_decode(token, None, run.sampling,
                                                                g.top_logprobs)
                        first = first_row(result)
                        slot = returns.expect(first)
                        mine[slot.tag] = result
                        try:
                            await down.send_decode(_rows(result), g.sampling, g.top_logprobs,
                                                   slot.tag, token)
                        except BaseException:
                            returns.forget(slot)  # no answer will come for it
                            mine.pop(slot.tag, None)
                            raise
                        ledger.sending(first, 1)  # (appends: the loop starts where it will be)
                        inflight.append(slot)
                        await send.send(slot)
                        await slot.first.wait()
                        used = slot.used
                        if used is None:  # the chain's answer came first, and is an error
                            break
                        token = used.logits.token_id
                        finish = run.decide(token, used.logits.is_eog, first + 1)
                        finish_of[slot.tag] = finish
                        while inflight[0] is not slot and inflight[0].answered.is_set():
                            if not await deliver(inflight[0]):
                                break
                        if chain_errors or finish != pb.FINISH_REASON_UNSPECIFIED:
                            break
                except ShardError as err:
                    own_errors.append(err)
                while inflight:  # every step sent is answered; deliver what the chain kept
                    await deliver(inflight[0])
        if not (chain_errors or own_errors):
            return
        if chain_errors:
            await self._failed_downstream(chain_errors[0])
        ledger.forget_after(delivered[0])  # the chain keeps only what the client was sent
        raise (chain_errors or own_errors)[0]
