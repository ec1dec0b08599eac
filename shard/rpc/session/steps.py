"""The steps of a plain session: Prefill, Decode, Generate, Rewind (and state moves), each
answered by zero or more ``StepResult``, an optional ``Error``, then exactly one ``Usage``.

Only credit waits and engine calls are cancellable by an out-of-band Cancel (``cancellable``);
handing a computed result to the transport is not, so a Cancel can never drop a committed
result, and ``Usage`` counts exactly the results sent.
"""

from __future__ import annotations

import trio

from shard.engine import EngineError, Lookahead, PrefillRequest, StepResult, StreamRequest
from shard.v1 import shard_pb2 as pb

from .. import convert, handoff
from ..errors import FATAL_IN_SESSION, ErrorCode, ShardError
from .generation import UNFINISHED, Generation, generate
from .phase import Phase, StreamEnd


class Steps:
    """``SessionCall``'s steps (a mixin: a step runs in a task of the call's nursery)."""

    async def _run_step(self, req: pb.SessionRequest) -> None:
        """One step request: its results, an optional Error, then its Usage."""
        usage = pb.Usage()
        err: ShardError | None = None
        try:
            kind = req.WhichOneof("kind")
            if kind != "import_state":
                self._importing = None  # an import's chunks come one after another, or not at all
            if kind in ("export_state", "import_state") and (
                    self.routed is not None or self.returner is not None):
                raise ShardError(ErrorCode.UNSUPPORTED_FEATURE, "a session of a chain relay route "
                                 "cannot be moved (its hops hold it together)",
                                 session_id=self.session_id)
            if self.routed is not None:
                await self.routed.step(req, usage)
            elif kind == "prefill":
                await self._prefill(req.prefill, usage)
            elif kind == "decode":
                await self._decode(req.decode, usage)
            elif kind == "rewind":
                await self.truncate_engine(self.rewind_position(req.rewind))
            elif kind == "export_state":
                await self._export_state(req.export_state)
            elif kind == "import_state":
                await self._import_state(req.import_state)
            else:
                await self._generate(req.generate, usage)
        except ShardError as exc:
            if exc.code in FATAL_IN_SESSION:
                raise
            err = exc
        finally:
            self._cancel.finished()  # nothing left to stop: a Cancel now finds no step
            self._credits.end_step()  # credits taken for results never sent go back
        if self.routed is not None:
            # the one rule, after every request: this worker and its next hop hold the same
            # positions again (a fatal error if they cannot be made to)
            await self.routed.settle()
        if err is not None:
            if not err.session_id:
                err.session_id = self.session_id
            if err.reason == handoff.YIELDED:  # a drain's doing, not a failure
                self._registry.count("generations_yielded_total")
            else:
                self._registry.count_error(err.code)
            await self._outbox.respond(pb.SessionResponse(error=err.to_proto()))
        for field in ("prompt_tokens", "generated_tokens", "reused_tokens"):
            setattr(self._totals, field, getattr(self._totals, field) + getattr(usage, field))
        if self._version >= (1, 1):
            usage.n_past = self.positions.end  # what the session holds now, also after a failure
        ended = pb.SessionResponse(usage=usage)
        queued, self._queued = self._queued, None
        if queued is None:
            await self._end_request(ended)
            return
        # A direct-return route's next step, sent before this one ended (also before a
        # CloseSession: the close waits for it).
        await self._outbox.respond(ended)
        if err is None:
            self._start_step(queued)  # (the session stays RUNNING: no request slips in)
            return
        # it was sent for the state the failed step would have left: it must not run
        await self._outbox.respond(pb.SessionResponse(error=ShardError(
            ErrorCode.CANCELLED, "not run: the step queued before it failed",
            session_id=self.session_id, reason="QUEUED_STEP_DROPPED",
        ).to_proto()))
        dropped = pb.Usage()
        if self._version >= (1, 1):
            dropped.n_past = self.positions.end
        await self._end_request(pb.SessionResponse(usage=dropped))

    async def _end_request(self, usage: pb.SessionResponse) -> None:
        """Queue a request's last ``Usage`` and leave RUNNING with no scheduler pass between
        the two: a client may send its next request the moment it reads the Usage, and that
        request must find the session idle (a pass in between let it find the step still
        RUNNING and end the stream with ILLEGAL_TRANSITION: seen with a relaying worker,
        which sends its next hop a Rewind as soon as the failed step's Usage arrives).
        With the channel full (never, by the credit bound) the Usage waits first in line.
        Queued, it is the step task's last act: no checkpoint (it would only cost the task one
        more scheduler pass before it ends)."""
        try:
            self._outbox.send_nowait(usage)
            queued = True
        except trio.WouldBlock:
            queued = False
        except trio.BrokenResourceError:
            self.end(StreamEnd.CONNECTION_LOST)
            await trio.lowlevel.checkpoint()  # raises Cancelled: our scope was just cancelled
            raise AssertionError("unreachable") from None
        if self.phase.value is Phase.RUNNING:
            self.phase.value = Phase.IDLE
        self._cancel.ended()
        if not queued:  # blocked senders go first when room frees: no later response overtakes it
            await self._outbox.respond(usage)

    async def _prefill(self, p: pb.Prefill, usage: pb.Usage) -> None:
        """One StepResult for the whole input, or one per ``chunk_tokens`` positions, each sent
        as soon as it is computed (a failed chunk leaves the earlier chunks in the session)."""
        sid = self.session_id
        position, sampling, tokens, hidden, n = await self.prefill_input(p)
        chunk = p.chunk_tokens or max(n, 1)
        hint = self._client_hint() if tokens is not None and not p.all_logits else None
        echo = tokens if p.WhichOneof("input") == "text" and p.echo_tokens else None
        for offset in range(0, max(n, 1), chunk):
            with self.cancellable():
                await self.take_credit()
                result = await self.engine_call(
                    self._engine.prefill,
                    PrefillRequest(
                        sid,
                        None if tokens is None else tokens[offset : offset + chunk],
                        None if hidden is None else hidden[offset : offset + chunk],
                        position=position + offset, sampling=sampling,
                        top_k_logprobs=p.top_logprobs,
                        lookahead=hint if offset + chunk >= n else None,
                        all_logits=p.all_logits,
                    ),
                )
            await self.send_step(result, position + offset, input_tokens=echo,
                                 usage_follows=offset + chunk >= n)
            echo = None
            # Counted once delivered: Usage reports only what the client received.
            usage.prompt_tokens += result.tokens_processed
            usage.reused_tokens += result.reused_tokens

    async def _decode(self, d: pb.Decode, usage: pb.Usage) -> None:
        sampling, token, hidden = self.decode_input(d)
        if token is not None:
            self._follows = (self.positions.next_token is not None
                             and token == self.positions.next_token)
        hint = self._client_hint() if token is not None else None
        with self.cancellable():
            await self.take_credit()
            start = self.positions.end
            result = await self.decode_one(token, hidden, sampling, d.top_logprobs, hint)
        if self.returner is not None and d.relay_tag and result.logits is not None:
            # the chain's first hop may start its next step before this reaches it up the chain
            self.returner.push(d.relay_tag, convert.step_to_proto(
                result, self._outbox.step_no + 1, start, self._wire_dtype))
        await self.send_step(result, start, usage_follows=True)
        usage.generated_tokens += 1

    async def _generate(self, g: pb.Generate, usage: pb.Usage) -> None:
        caps = self.caps
        if not (caps.is_first and caps.is_last):
            raise ShardError(
                ErrorCode.UNSUPPORTED_FEATURE,
                "Generate needs a worker that serves the whole model (first and last shard)",
                session_id=self.session_id,
            )
        drain = self._registry if g.yield_on_drain and caps.kv_layout else None
        await generate(self, g, usage, LocalSteps(self), drain=drain)


class LocalSteps:
    """A plain session's generation source (``StepSource``): this engine's steps, and once
    the prompt is in (and no step timeout applies) the next tokens as one engine stream."""

    __slots__ = ("_call", "_ahead")

    forward = None  # the token is read from this engine's own result

    def __init__(self, call: Steps) -> None:  # (the SessionCall)
        self._call = call
        self._ahead = call._limits.lookahead != "off"  # the engine may compute the next step ahead

    def batched(self, run: Generation) -> bool:
        call = self._call
        positions = call.positions
        return bool(run.emitted) and call._step_timeout is None and positions.end == positions.engine

    async def compute(self, run: Generation) -> StepResult:
        call, g = self._call, run.request
        # The steps that may follow this one: the engine may compute the next ahead.
        hint = None
        if self._ahead and run.left > 1:
            hint = Lookahead(run.left - 1, run.rules.stop_tokens, stop_at_eog=not g.ignore_eos)
        if run.prompt_step:
            result = await call.engine_call(call.engine.prefill, PrefillRequest(
                call.session_id, run.prompt, position=call.positions.end, sampling=run.sampling,
                top_k_logprobs=g.top_logprobs, lookahead=hint,
            ))
        else:
            token = call.positions.next_token
            assert token is not None
            result = await call.decode_one(token, None, run.sampling, g.top_logprobs, hint)
        assert result.logits is not None
        return result

    async def send(self, run: Generation, answer: StepResult | pb.StepResult, start: int,
                   mine: StepResult) -> None:
        finish = run.finish
        # (queued without a scheduler pass: the next step's engine call is one)
        await self._call.send_step(mine, start, finish, now=True,
                                   usage_follows=finish != UNFINISHED)

    async def run_batch(self, run: Generation) -> None:
        """The next tokens as one engine stream (``ShardEngine.stream``): each token is framed
        by ``deliver`` where the engine finished its step (for a batching engine, one pass over
        a tick's sessions), not by this task, which sleeps until the stream ends: the
        generation finished, the credit ran out (the next stream waits for it), a response
        must wait for room, or a drain asks the generation to yield. The same messages,
        credits, counts and positions as step by step (``send_step``)."""
        call, g = self._call, run.request
        token = call.positions.next_token
        assert token is not None
        held: pb.SessionResponse | None = None
        positions, outbox, count = call.positions, call._outbox, call._registry.count
        decide, counted, drain = run.decide, run.count, run.drain
        take_credit = call._credits.take_now

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
            with call.cancellable():
                await call.take_credit()
                try:
                    await call.engine.stream(StreamRequest(
                        call.session_id, token, run.left, run.sampling, g.top_logprobs,
                        lookahead=self._ahead, stop_tokens=run.rules.stop_tokens,
                        stop_at_eog=not g.ignore_eos), deliver)
                except EngineError as exc:
                    call.resync()
                    raise ShardError.from_engine(exc) from None
                except BaseException:  # a Cancel, the call deadline, a reset: rolled back
                    call.resync()
                    raise
        finally:
            if held is not None:  # a delivered token that found no room: it waits its turn
                await outbox.respond(held, more_follows=run.finish != UNFINISHED)
                count("steps_sent_total")
                positions.sent(positions.end)
