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
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import trio

from shard.engine import Capabilities, PrefillRequest, StepResult
from shard.v1 import shard_pb2 as pb

from . import convert
from .errors import ErrorCode, ShardError, unwrap_single_exception

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
        self, row: np.ndarray, sampling: pb.SamplingParams, top_logprobs: int
    ) -> pb.StepResult: ...

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


class RelayOpener(Protocol):
    """Opens a routed session's downstream session (``serve(relay=...)``)."""

    async def open(
        self, route: pb.Route, *, session_id: str, deadline: float, hidden_dtype: str,
        nursery: trio.Nursery,
    ) -> Downstream:
        """Open a session on ``route.hops[0]`` with the rest of the route, held by a task in
        ``nursery`` (the session stream's), within ``deadline`` (trio clock). Raises
        ``ShardError`` naming the hop."""
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
            lambda dn: dn.decode(_rows(result), d.sampling, d.top_logprobs), start
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

    async def _forward(
        self: SessionCall, call: Callable[[Downstream], Awaitable[pb.StepResult]], start: int
    ) -> pb.StepResult:
        """One step downstream. Its step-level error is this step's (named, the session moved
        back to what the downstream holds); a downstream that ended ends this stream."""
        down = self._down()
        try:
            final = await call(down)
        except ShardError as err:
            named = ShardError(
                err.code, f"{down.name}: {err.message}", retryable=err.retryable,
                reason=err.reason, supported_versions=err.supported_versions,
                grpc_status=err.grpc_status,
            )
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
        self._delivered_end = self._end


__all__ = [
    "MAX_ROUTE_HOPS",
    "NOT_ALLOWED",
    "RELAY_SUFFIX",
    "Downstream",
    "RelayOpener",
    "RelaySteps",
    "check_route",
    "relay_session_id",
]
