"""The step context of a session stream (``StepHost``): the session as its steps see it
(id, capabilities, capacity, positions, credit, the Cancel region, the outbox), checked input,
engine calls and their resync, tokenization, room checks, and sending a step's results.

Why one object: the plain steps (``steps.py``) and a routed session's (``shard.relay``) use the
same calls, so both check, compute and account alike, and neither reaches into the stream's
task, phase or dispatch (``SessionCall``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn

import numpy as np
import trio
from trio_util import AsyncValue

from shard.engine import (
    Capabilities,
    DecodeRequest,
    EngineError,
    Lookahead,
    PrefillRequest,
    SamplingParams,
    ShardEngine,
    StepResult,
    StepTimeout,
)
from shard.v1 import shard_pb2 as pb

from .. import convert
from ..errors import ErrorCode, ShardError
from . import inputs
from ..positions import Positions
from .cancellation import Region, StepCancel
from .credit import Credit
from .limits import SessionLimits
from .outbox import Outbox
from .phase import illegal
from .protocols import R, SessionHost

_CONTROL_SLOTS = 4  # opened + error + usage + closed never need credit


#: The hint ``client_hint`` gives (immutable: one for every step).
_HINT = Lookahead()


class StepContext:
    """A session stream's step API (``StepHost``); its ``SessionCall`` opens it (``opened``)
    and runs the steps with it."""

    def __init__(
        self, *, engine: ShardEngine, registry: SessionHost, limits: SessionLimits,
        deadline: float = math.inf, max_message_bytes: int, fail: Callable[[ShardError], None],
        lost: Callable[[], None],
    ) -> None:
        self._engine = engine
        self.registry = registry
        self.limits = limits
        self._deadline = deadline
        self._fail = fail  # the call's: end the stream with an error
        self.credits = credits = Credit(limits.max_credit)
        self.credit: AsyncValue[int] = credits.value
        self.parked = credits.parked  # a step waits for credit
        self.take_credit = credits.take  # (StepHost: the credit's own method, no layer between)
        self.outbox = Outbox(limits.max_credit + _CONTROL_SLOTS, max_message_bytes=max_message_bytes,
                             credit=credits, count=registry.count, lost=lost)
        self.cancel_state = StepCancel()
        self.session_id = ""
        self._caps: Capabilities | None = None
        self.version = (1, 0)  # the protocol version the session was opened with
        self._wire_dtype = convert.HIDDEN_DTYPE  # hidden states on the wire, both directions
        self._batch_group = 0  # OpenSession.batch_group
        self.kv_capacity = 0  # the most positions the session may hold (routed: the chain's least)
        self.step_timeout: float | None = None  # seconds per engine step (step_timeout_ms)
        self.positions = Positions()  # what the session holds (a routed one's: its ledger)
        # The client's last Decode sent the token the worker had sampled (look-ahead pays).
        self.follows = False
        # Where the session's grammar starts (SamplingParams.grammar_start), once a step set
        # it: a Decode that leaves it 0 continues that grammar. A step's own start is kept
        # only once its result is sent (``_step_grammar_start``): a refused step leaves it.
        self.grammar_start = 0
        self._step_grammar_start: int | None = None

    def opened(self, sid: str, caps: Capabilities, version: tuple[int, int], wire_dtype: str,
               step_timeout: float | None, batch_group: int) -> None:
        """The session ``sid`` was claimed with these settings (OpenSession)."""
        self.session_id = sid
        self._caps = caps
        self.version = version
        self._wire_dtype = wire_dtype
        self.step_timeout = step_timeout
        self._batch_group = batch_group

    # ---- the session as a step sees it ---------------------------------------------------

    @property
    def deadline(self) -> float:
        """The call deadline (trio clock); ``inf`` without ``grpc-timeout``."""
        return self._deadline

    @property
    def engine(self) -> ShardEngine:
        return self._engine

    @property
    def caps(self) -> Capabilities:
        """The engine's capabilities as the session was opened with them."""
        assert self._caps is not None
        return self._caps

    @property
    def wire_dtype(self) -> str:
        """Hidden states on the wire, both directions."""
        return self._wire_dtype

    @property
    def batch_group(self) -> int:
        """``OpenSession.batch_group`` (a relaying worker opens its next hop in the same)."""
        return self._batch_group

    def count(self, name: str) -> None:
        """Bump a worker counter (``GetMetrics``' ``worker.<name>``)."""
        self.registry.count(name)

    def cancellable(self) -> Region:
        """A region an out-of-band Cancel stops (also one requested before it was entered);
        ends with ``ShardError(CANCELLED)`` when it did."""
        return Region(self.cancel_state, self.session_id)

    async def end_with(self, err: ShardError) -> NoReturn:
        """End the stream with ``err`` now (the step's task is cancelled here)."""
        self._fail(err)
        await trio.lowlevel.checkpoint()  # raises Cancelled: the stream's scope was cancelled
        raise AssertionError("unreachable")

    # ---- checked input -------------------------------------------------------------------

    async def prefill_input(self, p: pb.Prefill) -> inputs.PrefillInput:
        """A Prefill's checked input, before any engine work."""
        caps, sid = self.caps, self.session_id
        end = self.positions.end
        position = p.position.value if p.HasField("position") else end
        if position > end:
            raise convert.invalid(f"position {position} is beyond the session end {end}", sid)
        which = p.WhichOneof("input")
        tokens = hidden = None
        ids: tuple[int, ...] | None = None
        lead = 0
        if which == "tokens":
            self._check_room(position, len(p.tokens.ids))  # before copying millions of ids
            tokens = tuple(p.tokens.ids)
        elif which == "text":
            tokens = await self._tokenize(p.text, add_bos=position == 0, position=position,
                                          parse_special=p.parse_special)
        elif which == "hidden_states":
            hidden = convert.tensor_to_array(p.hidden_states, caps.n_embd, sid, dtype=self._wire_dtype)
            if p.token_ids:
                hidden, ids, lead = inputs.hidden_ids(hidden, p.token_ids, position, end, sid)
        else:
            raise convert.invalid("Prefill needs tokens, text or hidden_states", sid)
        inputs.check_row_fits(caps, self.outbox.max_message_bytes, sid)
        n = len(tokens) if tokens is not None else len(hidden)  # type: ignore[arg-type]
        # Before any chunk is computed: a prompt in chunks that cannot fit is refused whole (it
        # used to be refused at the first chunk past the context, the earlier ones computed).
        self._check_room(position, n)
        limit = inputs.cache_limit(p)
        covered = self._covered(position, tokens if tokens is not None else ids, limit) \
            if p.chunk_tokens else 0
        sampling = self._sampling(p.sampling, position + n)  # (a grammar starts after it)
        return inputs.PrefillInput(position, sampling, tokens, hidden, ids, n, lead,
                                   inputs.rows_per_message(caps, self.outbox.max_message_bytes),
                                   limit, covered)

    def _covered(self, position: int, ids: Sequence[int] | None, limit: int | None) -> int:
        """How many leading positions of input ``ids`` at ``position`` the prefix cache holds
        now, within ``limit`` and never the last (a step computes one): what a chunked
        prefill's first step takes besides its chunk (0 where the engine would not use it)."""
        if not ids or not self.caps.prefix_cache_tokens or position != self.positions.engine:
            return 0
        try:
            held = self._engine.session_info(self.session_id).tokens
        except EngineError:
            return 0
        if held is None or len(held) != position:
            return 0
        most = position + len(ids) - 1 if limit is None else min(limit, position + len(ids) - 1)
        return max(0, min(self._engine.cached_prefix([*held, *ids]), most) - position)

    def decode_input(
        self, d: pb.Decode
    ) -> tuple[SamplingParams, int | None, np.ndarray | None, int | None]:
        """A Decode's checked input: (sampling, token or one hidden row, the id that row
        stands for if the client sent it)."""
        caps, sid = self.caps, self.session_id
        sampling = self._sampling(d.sampling, self.grammar_start)
        which = d.WhichOneof("input")
        if which == "token":
            token, hidden = d.token, None
        elif which == "hidden_state":
            token, hidden = None, convert.tensor_to_array(
                d.hidden_state, caps.n_embd, sid, dtype=self._wire_dtype, rows=1
            )
        else:
            raise convert.invalid("Decode needs a token or a hidden_state", sid)
        inputs.check_row_fits(caps, self.outbox.max_message_bytes, sid)
        token_id = d.token_id if hidden is not None and d.has_token_id else None
        return sampling, token, hidden, token_id

    async def generate_input(
        self, g: pb.Generate
    ) -> tuple[SamplingParams, tuple[int, ...] | None]:
        """A Generate's checked input: (sampling, prompt ids; None: continue from the token
        the previous step chose)."""
        sid = self.session_id
        if g.max_tokens == 0:
            raise convert.invalid("Generate.max_tokens must be >= 1", sid)
        which = g.WhichOneof("prompt")
        prompt: tuple[int, ...] | None = None
        end = self.positions.end
        if which == "tokens":
            self._check_room(end, len(g.tokens.ids))
            prompt = tuple(g.tokens.ids)
        elif which == "text":
            prompt = await self._tokenize(g.text, add_bos=end == 0, position=end,
                                          parse_special=g.parse_special)
            self._check_room(end, len(prompt))
        elif self.positions.next_token is None:
            raise illegal("Generate without a prompt needs a previous step to continue from", sid)
        start = end + len(prompt) if prompt is not None else self.grammar_start
        return self._sampling(g.sampling, start), prompt

    def _sampling(self, msg: pb.SamplingParams, grammar_start: int) -> SamplingParams:
        """A step's sampling; ``grammar_start``: where its grammar starts when the message
        leaves it 0 (kept for the session's next steps once the step's result is sent)."""
        self._step_grammar_start = None  # (before a refusal: none of this step's is kept)
        sampling = convert.sampling_from_proto(msg, self.session_id, grammar_start)
        if sampling.grammar is not None:
            self._step_grammar_start = sampling.grammar.start
        return sampling

    def step_accepted(self) -> None:
        """A step's result goes out: its grammar start is the session's from now on."""
        if self._step_grammar_start is not None:
            self.grammar_start, self._step_grammar_start = self._step_grammar_start, None

    def rewind_position(self, r: pb.Rewind) -> int:
        """A Rewind's checked position."""
        return inputs.check_rewind(r, self.positions.end, self.session_id)

    def _check_room(self, position: int, n_tokens: int) -> None:
        inputs.check_room(self.caps, self.kv_capacity, position, n_tokens, self.session_id)

    async def _tokenize(
        self, text: str, *, add_bos: bool, position: int, parse_special: bool = False
    ) -> tuple[int, ...]:
        """Tokenize a remote caller's text off the event loop, after refusing (before any work)
        a text too long to fit (``inputs.text_floor``)."""
        if self.caps.max_token_bytes:
            self._check_room(position, inputs.text_floor(self.caps, text))
        try:
            return await self._engine.tokenize_async(text, add_bos=add_bos, parse_special=parse_special)
        except EngineError as exc:
            raise ShardError.from_engine(exc) from None

    # ---- engine calls --------------------------------------------------------------------

    def client_hint(self) -> Lookahead | None:
        """A client-driven step's look-ahead hint: only for a client that decoded the token the
        worker sampled last time (a router that samples for itself would waste the work)."""
        return _HINT if self.limits.lookahead == "auto" and self.follows else None

    async def decode_one(
        self,
        token: int | None,
        hidden: np.ndarray | None,
        sampling: SamplingParams,
        top_k: int,
        lookahead: Lookahead | None = None,
        token_id: int | None = None,
    ) -> StepResult:
        """Append one position at the logical end.

        After a resume that kept fewer positions than the engine holds, the engine's own end is
        past the logical one; a one-position prefill at the logical end drops the surplus.
        """
        sid = self.session_id
        end = self.positions.end
        if end != self.positions.engine:
            request = PrefillRequest(
                session_id=sid,
                tokens=None if token is None else (token,),
                hidden_states=hidden,
                position=end,
                token_ids=None if token_id is None else (token_id,),
                sampling=sampling,
                top_k_logprobs=top_k,
                lookahead=lookahead,
            )
            return await self.engine_call(self._engine.prefill, request)
        return await self.engine_call(
            self._engine.decode,
            DecodeRequest(
                session_id=sid,
                token=token,
                hidden_state=hidden,
                sampling=sampling,
                top_k_logprobs=top_k,
                lookahead=lookahead,
                token_id=token_id,
            ),
        )

    async def engine_call(
        self, fn: Callable[[R], Awaitable[StepResult]], request: R
    ) -> StepResult:
        """One engine step under the per-step timeout; engine errors become ShardErrors.

        The engine owns the step timeout (``step_timeout`` of the request): it keeps the step
        out of shared steps that cannot end in time and delivers a result computed in time.
        After any failure the positions are read back from the engine (``resync``).
        """
        position = getattr(request, "position", None)
        start = self.positions.engine if position is None else position
        try:
            if request.step_timeout != self.step_timeout:  # (a copy per step only when needed)
                request = dataclasses.replace(request, step_timeout=self.step_timeout)
            result = await fn(request)
        except StepTimeout as exc:
            self.resync()
            assert self.step_timeout is not None
            raise ShardError(
                ErrorCode.DEADLINE_EXCEEDED,
                f"the step exceeded step_timeout_ms={round(self.step_timeout * 1000)}",
                session_id=self.session_id,
                reason=exc.code,
            ) from None
        except EngineError as exc:
            self.resync()
            raise ShardError.from_engine(exc) from None
        except BaseException:  # a Cancel RPC, the call deadline, a reset: the step was rolled back
            self.resync()
            raise
        self.positions.computed(start, result)
        return result

    def resync(self) -> None:
        """Read back what the engine holds after a failed step.

        A failed step normally leaves the session as it was, but a prefill that rewrote from an
        earlier position keeps only ``[0, position + reused)`` once it began computing (the old
        positions after it were being replaced). Every position reported afterwards (``Usage``,
        the next ``StepResult.start_position``, a resume) must be the engine's, never a stale one.
        """
        try:
            held = self._engine.session_info(self.session_id).n_past
        except EngineError:
            return  # released or the engine failed: the stream ends anyway
        self.positions.resync(held)

    async def first_chunk(self, inp: inputs.PrefillInput, result: StepResult) -> None:
        """After a prefill's first step: positions that came without rows were taken from this
        engine's cache, or the step is dropped (``PREFIX_NOT_CACHED``; the session holds what
        it held before)."""
        if inp.lead and inp.lead_missed(result):
            await self.truncate_engine(inp.position)
            raise inputs.prefix_not_cached(inp.lead, self.session_id)

    async def truncate_engine(self, keep: int) -> None:
        """Drop the engine's positions from ``keep`` on (nothing if it holds no more)."""
        if keep < self.positions.engine:
            try:
                await self._engine.truncate(self.session_id, keep)
            except EngineError as exc:
                raise ShardError.from_engine(exc) from None
        self.positions.rewound(keep)

    # ---- results -------------------------------------------------------------------------

    async def send_step(
        self, result: StepResult, start: int,
        finish: int = pb.FINISH_REASON_UNSPECIFIED, input_tokens: Sequence[int] | None = None,
        *, usage_follows: bool = False, now: bool = False,
    ) -> None:
        """Send one of this engine's results (one credit), split into chunks when it exceeds
        one message. ``usage_follows``: the step's ``Usage`` comes next; ``now``: queued
        without a scheduler pass when there is room (``Outbox.respond``)."""
        outbox = self.outbox
        msg = convert.step_to_proto(result, outbox.step_no + 1, start, self._wire_dtype)
        if input_tokens is not None:
            msg.input_tokens.ids.extend(input_tokens)
        msg.finish_reason = finish  # type: ignore[assignment]
        self.step_accepted()
        await outbox.send_numbered(msg, usage_follows, now)
        self.positions.sent(result.n_past)

    async def send_result(self, msg: pb.StepResult, *, usage_follows: bool = False) -> None:
        """Send a result built by the step (a routed session's: the last shard's answer, with
        this worker's own accounting), numbered as this session's next step (one credit)."""
        self.step_accepted()
        await self.outbox.send_numbered(msg, usage_follows)
