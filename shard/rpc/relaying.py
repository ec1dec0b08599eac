"""Chain relay, the worker's side of a session: steps of a session opened with a ``route``.

A session whose ``OpenSession.route`` names the hops after this worker forwards every boundary
result (hidden states) of this worker's engine to the next hop and answers each step with what
comes back: the last shard's result (logits), travelling back up the chain. Why return the
downstream's final result rather than stream our own boundary too: the client then needs one
stream (to the first hop) and sees exactly what a client-relayed pipeline sees; and a
``Generate`` on the first hop runs the decode loop on the workers, so a token costs no round
trip to the client at all (docs/pipelines.md, "Chain relay").

Dependencies run one way (rpc -> engine): the session never imports the client. The
downstream session is opened through a ``RelayOpener`` that ``serve(relay=...)`` is given
(``shard.relay.ChainRelay``, built on ``shard.client``); without one (``serve --allow-relay`` not
given) a route is refused with PERMISSION_DENIED, so no worker becomes an open relay.

Ownership: the opener starts the task that holds the downstream connection and session in the
session stream's own nursery, so it ends with the stream: a close closes it, a reset, a
deadline, a Release or a failure resets it (the next worker releases its session in turn).
Consistency: a step the downstream did not take (its step-level error, a Cancel) leaves this
worker's engine ahead; the session's logical end is moved back to what the downstream holds
(its ``Usage.n_past``), and the next step rewrites the surplus positions, as after a partial
resume. A downstream whose session ended ends this stream with its error, naming the hop.

Direct return (``Route.return_to``, ``shard.rpc.returns``): on a route of two or more hops the
first hop's ``Generate`` tags each decode step; the last hop hands the tagged result straight
back (the ``Return`` RPC), and the first hop goes on with the first copy to arrive, sending the
next step before the previous answer came up the chain. So a hop given a return address queues
one step behind the running one (and drops it, answered ``CANCELLED``, if the running one
fails); the chain's answers are still read, in order, checked against the copy used and only
then delivered. A token then costs one trip around the ring of workers instead of a trip down
the chain and back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import trio

from shard.engine import Capabilities, PrefillRequest, SamplingParams, StepResult
from shard.v1 import shard_pb2 as pb

from . import convert
from .errors import ErrorCode, ShardError, unwrap_single_exception
from .returns import Slot

if TYPE_CHECKING:
    from .session import SessionCall

#: Most hops a route may name (a bound on what one OpenSession can make workers open).
MAX_ROUTE_HOPS = 64
#: Appended to a session id to name the session a worker opens downstream (``p-1.0`` on the
#: first hop -> ``p-1.0>`` on the second -> ``p-1.0>>`` ...): deterministic, so a client can
#: name (and release) every hop's session.
RELAY_SUFFIX = ">"
NOT_ALLOWED = (
    "this worker does not relay: its operator did not allow relay (start it with "
    "`trio-shard serve --allow-relay`); use client relay instead"
)


def relay_session_id(session_id: str) -> str:
    """The id of the session a worker opens downstream for ``session_id``."""
    return session_id + RELAY_SUFFIX


class Downstream(Protocol):
    """The next hop of a routed session, as the session sees it (``shard.relay.DownstreamHop``)."""

    #: How errors from this hop are prefixed: ``relay hop HOST:PORT (layers [A, B))``.
    name: str
    #: The downstream session's capacity (itself the least of the rest of the chain).
    kv_capacity: int

    async def prefill(
        self, rows: np.ndarray, position: int, sampling: pb.SamplingParams, top_logprobs: int,
        all_logits: bool = False,
    ) -> pb.StepResult: ...

    async def decode(
        self, row: np.ndarray, sampling: pb.SamplingParams, top_logprobs: int, relay_tag: int = 0,
    ) -> pb.StepResult: ...

    #: The downstream took the route's return address (it reports relay_return): its session
    #: queues one step behind the running one, so ``send_decode`` may run one step ahead.
    pipelined: bool

    async def send_decode(
        self, row: np.ndarray, sampling: pb.SamplingParams, top_logprobs: int, relay_tag: int,
    ) -> None:
        """Send a Decode without waiting for its answer (at most two unanswered)."""
        ...

    async def read_answer(self) -> pb.StepResult:
        """The answer to the oldest unanswered ``send_decode`` (raises its step error)."""
        ...

    def alive(self) -> bool:
        """The downstream session still serves (False once its stream ended)."""
        ...

    def held(self) -> int | None:
        """Positions the downstream session holds after its last request (None: unknown)."""
        ...

    def cancel(self) -> None:
        """Forward a Cancel (out-of-band) if a step is in flight; sync, never raises."""
        ...

    async def close(self) -> None:
        """Close the downstream session gracefully (released); never raises."""
        ...

    def abort(self) -> None:
        """Reset the downstream stream now (the next worker releases the session)."""
        ...


class Returner(Protocol):
    """A last hop's sender of tagged results to the route's return address."""

    def push(self, tag: int, step: pb.StepResult) -> None:
        """Hand one result over, never blocking the step (a full queue drops it: the chain's
        own answer still carries it)."""
        ...

    def close(self) -> None:
        """No more results: the pusher's task ends (sync, idempotent)."""
        ...


class RelayOpener(Protocol):
    """Opens a routed session's downstream session (``serve(relay=...)``)."""

    async def open(
        self, route: pb.Route, *, session_id: str, deadline: float, hidden_dtype: str,
        nursery: trio.Nursery, return_to: pb.ReturnAddress | None = None,
    ) -> Downstream:
        """Open a session on ``route.hops[0]`` with the rest of the route, held by a task in
        ``nursery`` (the session stream's), within ``deadline`` (trio clock); ``return_to``
        goes down the route to hops that take part in a direct return. Raises ``ShardError``
        naming the hop."""
        ...

    async def open_return(
        self, address: pb.ReturnAddress, *, deadline: float, nursery: trio.Nursery
    ) -> Returner:
        """A pusher to ``address``, held by a task in ``nursery`` (connects in the
        background: a return address that cannot be reached only costs the head start)."""
        ...


def check_route(
    opener: RelayOpener | None, req: pb.OpenSession, caps: Capabilities, sid: str
) -> None:
    """Refuse, before any session is claimed, a route this worker will not or cannot relay."""
    hops = req.route.hops
    if opener is None:
        raise ShardError(ErrorCode.PERMISSION_DENIED, NOT_ALLOWED, session_id=sid,
                         reason="RELAY_NOT_ALLOWED")
    problem = ""
    if caps.is_last:
        problem = "this worker serves the last layers: there is nothing to relay to"
    elif len(hops) > MAX_ROUTE_HOPS:
        problem = f"a route may name at most {MAX_ROUTE_HOPS} hops, not {len(hops)}"
    elif req.HasField("cache"):
        problem = "a routed session cannot resume a retained one (routed sessions are never retained)"
    elif len(relay_session_id(sid).encode("utf-8")) > 128:
        problem = "the session id leaves no room for the downstream session's id (at most 127 bytes)"
    elif any(not hop.target for hop in hops):
        problem = "every route hop needs a target"
    elif hops[0].HasField("expected_layer_range") and (
        hops[0].expected_layer_range.start != caps.layer_range.end
    ):
        problem = (f"route.hops[0] starts at layer {hops[0].expected_layer_range.start}; this "
                   f"worker's layers end at {caps.layer_range.end}")
    if problem:
        raise convert.invalid(f"route: {problem}", sid)


def check_return(
    opener: RelayOpener | None, req: pb.OpenSession, caps: Capabilities, sid: str
) -> None:
    """Refuse a return address on a session that names no hops unless this worker is a last
    shard allowed to connect out (its pushes go to an address a caller chose)."""
    if opener is None:
        raise ShardError(ErrorCode.PERMISSION_DENIED, NOT_ALLOWED, session_id=sid,
                         reason="RELAY_NOT_ALLOWED")
    if not caps.is_last:
        raise convert.invalid("route: a return address without hops needs the last shard "
                              "(this worker's hops would have to be named)", sid)
    if not req.route.return_to.target:
        raise convert.invalid("route: return_to needs a target", sid)


def _rows(result: StepResult) -> np.ndarray:
    """This worker's boundary rows (a routed worker is never the last shard)."""
    if result.boundary is None:
        raise ShardError(ErrorCode.INTERNAL, "a routed shard produced no boundary hidden states")
    return result.boundary.hidden_states


class RelaySteps:
    """The steps of a routed session; mixed into ``SessionCall`` (which owns the state used
    here), so that the session module only dispatches to them."""

    _downstream: Downstream | None

    def _down(self: SessionCall) -> Downstream:
        assert self._downstream is not None
        return self._downstream

    async def _relay_step(self: SessionCall, req: pb.SessionRequest, usage: pb.Usage) -> None:
        kind = req.WhichOneof("kind")
        if kind == "prefill":
            await self._relay_prefill(req.prefill, usage)
        elif kind == "decode":
            await self._relay_decode(req.decode, usage)
        else:
            await self._relay_generate(req.generate, usage)

    async def _relay_prefill(self: SessionCall, p: pb.Prefill, usage: pb.Usage) -> None:
        """Pipelined as the client relay is: this engine computes chunk i+1 while the
        downstream takes chunk i (a channel of one chunk between the two tasks)."""
        sid = self.session_id
        position, sampling, tokens, hidden, n = await self._prefill_input(p)
        chunk = p.chunk_tokens or max(n, 1)
        echo = (list(tokens) if p.WhichOneof("input") == "text" and p.echo_tokens
                and tokens is not None else None)
        failed: list[ShardError] = []
        counts = {"taken": 0, "sent": 0}
        send, recv = trio.open_memory_channel[tuple[StepResult, int]](1)

        async def compute() -> None:
            async with send:
                try:
                    for offset in range(0, max(n, 1), chunk):
                        with self._cancellable():
                            await self._take_credit()
                            counts["taken"] += 1
                            result = await self._engine_call(self._engine.prefill, PrefillRequest(
                                sid,
                                None if tokens is None else tokens[offset : offset + chunk],
                                None if hidden is None else hidden[offset : offset + chunk],
                                position=position + offset, sampling=sampling,
                                top_k_logprobs=p.top_logprobs,
                            ))
                        await send.send((result, position + offset))
                except ShardError as err:  # computed chunks are still forwarded, then it raises
                    failed.append(err)

        async def forward() -> None:
            async with recv:
                async for result, start in recv:
                    final = await self._forward(
                        lambda d: d.prefill(_rows(result), start, p.sampling, p.top_logprobs,
                                            p.all_logits),  # verification: the last shard's
                        start,
                    )
                    await self._send_forwarded(final, start, result,
                                               input_tokens=echo if counts["sent"] == 0 else None)
                    counts["sent"] += 1
                    usage.prompt_tokens += result.tokens_processed
                    usage.reused_tokens += result.reused_tokens

        try:
            with unwrap_single_exception():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(compute)
                    nursery.start_soon(forward)
        finally:
            # every credit taken for a chunk that was not sent goes back (``_run_step`` only
            # knows of one)
            self._credit_unspent = False
            if counts["taken"] > counts["sent"]:
                self._grant(counts["taken"] - counts["sent"])
        if failed:
            raise failed[0]

    async def _relay_decode(self: SessionCall, d: pb.Decode, usage: pb.Usage) -> None:
        sampling, token, hidden = self._decode_input(d)
        with self._cancellable():
            await self._take_credit()
            start = self._end
            result = await self._decode_one(token, hidden, sampling, d.top_logprobs)
        final = await self._forward(
            lambda dn: dn.decode(_rows(result), d.sampling, d.top_logprobs, d.relay_tag), start
        )
        await self._send_forwarded(final, start, result)
        usage.generated_tokens += 1

    async def _relay_generate(self: SessionCall, g: pb.Generate, usage: pb.Usage) -> None:
        """Server-driven decoding over the chain: the first hop feeds each token the last shard
        chose back into its own next step, with the worker's stop rules (``_generate``), the
        capacity being the least of the chain's."""
        caps, sid = self._require_caps(), self.session_id
        if not caps.is_first:
            raise ShardError(
                ErrorCode.UNSUPPORTED_FEATURE,
                "Generate on a routed session needs the first shard", session_id=sid,
            )
        sampling, prompt = await self._generate_input(g)
        stop = frozenset(g.stop_tokens)
        emitted = 0
        while True:
            if self.direct_returns is not None and (emitted > 0 or prompt is None):
                await self._relay_generate_ahead(g, usage, sampling, stop, emitted)
                return
            with self._cancellable():
                await self._take_credit()
                start = self._end
                if emitted == 0 and prompt is not None:
                    result = await self._engine_call(self._engine.prefill, PrefillRequest(
                        sid, prompt, position=start, sampling=sampling,
                        top_k_logprobs=g.top_logprobs,
                    ))
                else:
                    assert self._next_token is not None
                    result = await self._decode_one(
                        self._next_token, None, sampling, g.top_logprobs
                    )
            rows = _rows(result)
            if emitted == 0 and prompt is not None:
                call: Callable[[Downstream], Awaitable[pb.StepResult]] = (
                    lambda dn: dn.prefill(rows, start, g.sampling, g.top_logprobs))
            else:
                call = lambda dn: dn.decode(rows, g.sampling, g.top_logprobs)  # noqa: E731
            final = await self._forward(call, start)
            emitted += 1
            finish = self._finish_reason(final.logits.token_id, final.logits.is_eog, g, stop, emitted)
            await self._send_forwarded(final, start, result, finish)
            if emitted == 1 and prompt is not None:
                usage.prompt_tokens += result.tokens_processed
                usage.reused_tokens += result.reused_tokens
            usage.generated_tokens += 1
            if finish != pb.FINISH_REASON_UNSPECIFIED:
                return

    async def _relay_generate_ahead(
        self: SessionCall, g: pb.Generate, usage: pb.Usage, sampling: SamplingParams,
        stop: frozenset[int], emitted: int,
    ) -> None:
        """``_relay_generate``'s decode loop with a direct return: each step goes on with the
        first copy of the last hop's result to arrive (``Return`` or the chain's answer), so the
        next step is sent before the previous one's answer came back up the chain (its session
        queues it). Results reach the client in order, each once the chain's answer confirmed
        the copy used; a chain error (a Cancel, a failed hop) stops the loop, every step sent is
        answered, and the session moves back to what the downstream holds, as in ``_forward``."""
        returns, down = self.direct_returns, self._down()
        assert returns is not None
        inflight: deque[Slot] = deque()  # sent downstream, not delivered yet (oldest first)
        mine: dict[int, StepResult] = {}  # this worker's own result per tag (its accounting)
        finish_of: dict[int, int] = {}  # tags the loop went on with, and their finish reasons
        counts = {"taken": 0, "sent": 0}
        chain_errors: list[ShardError] = []  # what the downstream answered, named, in order
        own_errors: list[ShardError] = []  # this worker's own step's (a Cancel, its engine)
        last: list[tuple[int, int]] = []  # (position, token) of the last step delivered
        send, recv = trio.open_memory_channel[Slot](2)

        async def read_answers() -> None:
            async with recv:
                async for slot in recv:
                    try:
                        slot.answer(await down.read_answer(), None)
                    except ShardError as err:
                        slot.answer(None, _named(down, err))

        async def deliver(slot: Slot) -> bool:
            """Send the oldest step on once its chain answer arrived; False: it failed."""
            await slot.answered.wait()
            inflight.popleft()
            returns.forget(slot)
            if slot.chain_error is not None:
                chain_errors.append(slot.chain_error)
                return False
            if slot.tag not in finish_of:  # answered, but after a failure the loop stopped at
                return False
            answer, used = slot.chain, slot.used
            assert answer is not None and used is not None
            if answer.WhichOneof("output") != "logits" or answer.logits.token_id != used.logits.token_id:
                self._fail(ShardError(ErrorCode.INTERNAL, f"{down.name}: the result handed back "
                                      "directly disagrees with the chain's answer"))
                await trio.lowlevel.checkpoint()
            await self._send_forwarded(answer, slot.start, mine.pop(slot.tag),
                                       finish_of[slot.tag], end=slot.start + 1)
            counts["sent"] += 1
            usage.generated_tokens += 1
            last[:] = [(slot.start, answer.logits.token_id)]
            return True

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_answers)
                async with send:
                    try:
                        while True:
                            # with no credit left, the client waits for a result that is still
                            # in flight: deliver it first (its answer comes without us)
                            while inflight and self.credit.value <= 0:
                                if not await deliver(inflight[0]):
                                    break
                            if chain_errors:
                                break
                            with self._cancellable():
                                await self._take_credit()
                                counts["taken"] += 1
                                start = self._end
                                assert self._next_token is not None
                                result = await self._decode_one(
                                    self._next_token, None, sampling, g.top_logprobs
                                )
                            slot = returns.expect(start)
                            mine[slot.tag] = result
                            await down.send_decode(_rows(result), g.sampling, g.top_logprobs,
                                                   slot.tag)
                            inflight.append(slot)
                            await send.send(slot)
                            await slot.first.wait()
                            used = slot.used
                            if used is None:  # the chain's answer came first, and is an error
                                break
                            self._next_token = used.logits.token_id
                            emitted += 1
                            finish = self._finish_reason(used.logits.token_id, used.logits.is_eog,
                                                         g, stop, emitted)
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
        finally:
            self._credit_unspent = False  # every credit taken for a result not sent goes back
            if counts["taken"] > counts["sent"]:
                self._grant(counts["taken"] - counts["sent"])
        if not (chain_errors or own_errors):
            return
        err = (chain_errors or own_errors)[0]
        held = down.held() if down.alive() else None
        if held is None:
            self._fail(err)
            await trio.lowlevel.checkpoint()
            raise AssertionError("unreachable")
        if held < self._end:
            self._end = held
            self._delivered_end = min(self._delivered_end, held)
            self._next_token = last[0][1] if last and last[0][0] == held - 1 else None
        raise err

    async def _forward(
        self: SessionCall, call: Callable[[Downstream], Awaitable[pb.StepResult]], start: int
    ) -> pb.StepResult:
        """One step downstream. Its step-level error is this step's (named, the session moved
        back to what the downstream holds); a downstream that ended ends this stream."""
        down = self._down()
        try:
            final = await call(down)
        except ShardError as err:
            named = _named(down, err)
            held = down.held() if down.alive() else None
            if held is None:
                self._fail(named)
                await trio.lowlevel.checkpoint()  # raises Cancelled: the stream ends
                raise AssertionError("unreachable") from None
            if held < self._end:
                self._end = held
                self._delivered_end = min(self._delivered_end, held)
            if held < start:
                self._next_token = None  # it was chosen for a position that is gone
            raise named from None
        if final.WhichOneof("output") != "logits":
            self._fail(ShardError(ErrorCode.INTERNAL, f"{down.name}: the route did not end at "
                                  "the last shard (no logits came back)"))
            await trio.lowlevel.checkpoint()
        self._next_token = final.logits.token_id
        return final

    async def _send_forwarded(
        self: SessionCall, final: pb.StepResult, start: int, mine: StepResult,
        finish: int = pb.FINISH_REASON_UNSPECIFIED, input_tokens: Sequence[int] | None = None,
        end: int | None = None,
    ) -> None:
        """Answer the step with the last shard's result, numbered as this session's step, with
        this worker's own input accounting (positions computed here, reused here)."""
        msg = pb.StepResult()
        msg.CopyFrom(final)
        self._step_no += 1
        msg.step = self._step_no
        msg.start_position = start
        msg.tokens_processed = mine.tokens_processed
        msg.reused_tokens = mine.reused_tokens
        msg.finish_reason = finish  # type: ignore[assignment]
        msg.more_chunks = False
        if input_tokens is not None:  # Prefill.echo_tokens: this worker tokenized the text
            msg.input_tokens.ids.extend(input_tokens)
        self._credit_unspent = False
        await self._send(pb.SessionResponse(step=msg))
        self._registry.count("steps_sent_total")
        self._delivered_end = self._end if end is None else end


def _named(down: Downstream, err: ShardError) -> ShardError:
    """A downstream's error as this worker reports it: prefixed with the hop's name."""
    return ShardError(
        err.code, f"{down.name}: {err.message}", retryable=err.retryable, reason=err.reason,
        supported_versions=err.supported_versions, grpc_status=err.grpc_status,
    )


__all__ = [
    "MAX_ROUTE_HOPS",
    "NOT_ALLOWED",
    "RELAY_SUFFIX",
    "Downstream",
    "RelayOpener",
    "RelaySteps",
    "Returner",
    "check_return",
    "check_route",
    "relay_session_id",
]
