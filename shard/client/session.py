"""A session stream on one worker (``ClientSession``) and the results of one of its requests
(``StepStream``).

A session stream carries one request at a time. Credit is granted back as the caller consumes
results, so a caller that stops reading pauses the worker instead of filling buffers; a
request left early is stopped (``Cancel``) and its results skipped before the next one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn, Protocol

import numpy as np
import trio
from google.protobuf.message import Message

from shard.rpc import convert
from shard.rpc.errors import ErrorCode, ShardError
from shard.rpc.transport import ClientStream
from shard.v1 import shard_pb2 as pb

from .chunks import ResultChunks
from .guard import TaskGuard
from .requests import decode_request, generate_request, prefill_request

__all__ = ["ClientSession", "SessionClient", "StateStream", "StepStream"]


class SessionClient(Protocol):
    """What a session needs of the connection it runs on (``ShardClient``)."""

    version: pb.ProtocolVersion
    max_result_bytes: int | None

    @property
    def going_away(self) -> bool: ...

    async def cancel(self, session_id: str) -> pb.CancelResponse: ...


class ClientSession:
    """One open session stream. Steps never overlap: issue one request at a time.

    Step-level errors (bad input, a full KV budget, a step deadline, an out-of-band Cancel)
    raise ``ShardError`` and leave the session usable; errors that end the stream raise
    ``ShardError`` and every later call raises it again. One task at a time
    (``shard.client.guard``); ``abort()`` works from any task.
    """

    def __init__(self, client: SessionClient, stream: ClientStream, session_id: str) -> None:
        self._client = client
        self._stream = stream
        self.session_id = session_id
        self.opened: pb.SessionOpened = pb.SessionOpened()
        self.usage: pb.Usage = pb.Usage()  # of the last request
        self.closed: pb.SessionClosed | None = None
        self._dead: ShardError | None = None
        self._window = 1
        self._outstanding = 0  # credit granted and not yet used by a result
        self._serial = 0  # requests sent; a StepStream only reads its own request's results
        self._pending = False  # the last request's Usage has not been read (a generate left early)
        self._guard = TaskGuard(session_id)  # one task at a time
        self._chunks = ResultChunks()  # of a split result, not yet complete
        self._opening = False  # OpenSession sent, its SessionOpened not read yet (``_open_ahead``)

    @property
    def client(self) -> SessionClient:
        """The connection the session was opened on."""
        return self._client

    @property
    def hidden_dtype(self) -> str:
        """Wire dtype of this session's hidden states (the worker's answer to the request)."""
        return self.opened.hidden_wire_dtype or convert.HIDDEN_DTYPE

    @property
    def alive(self) -> bool:
        """The stream still serves: neither failed, reset nor closed."""
        return self._dead is None and self.closed is None

    @property
    def cache(self) -> pb.CacheResult:
        """The cache outcome of opening (NEW, HIT, PARTIAL, MISS, MISMATCH)."""
        return self.opened.cache

    # ---- plumbing --------------------------------------------------------------------------

    def _request(self, **kind: Message) -> pb.SessionRequest:
        return pb.SessionRequest(version=self._client.version, **kind)

    async def _send(self, req: pb.SessionRequest) -> None:
        if self._dead is not None:
            raise self._dead
        if self.closed is not None:
            raise ShardError(
                ErrorCode.ILLEGAL_TRANSITION, "the session is closed", session_id=self.session_id
            )
        try:
            await self._stream.send(req)
        except ShardError as err:  # the stream failed (deadline, reset, lost connection)
            self._dead = err
            raise

    async def _next(self) -> pb.SessionResponse:
        """The next response; a stream that ended becomes this session's fatal error."""
        if self._opening:
            await self._read_opened()
        if self._dead is not None:
            raise self._dead
        try:
            msg = await self._stream.receive(pb.SessionResponse)
        except ShardError as err:
            self._dead = err
            raise
        if msg is None:
            err = self._stream.error() or ShardError(
                ErrorCode.INTERNAL, "the worker ended the session stream without closing it",
                session_id=self.session_id,
            )
            self._dead = err
            raise err
        if msg.WhichOneof("kind") == "closed":
            self.closed = msg.closed
        return msg

    async def _open(self, open_msg: pb.OpenSession) -> None:
        await self._send(self._request(open=open_msg))
        msg = await self._next()
        if msg.WhichOneof("kind") != "opened":
            raise ShardError(ErrorCode.INTERNAL, f"expected SessionOpened, got {msg.WhichOneof('kind')}")
        self.opened = msg.opened
        self._window = self._outstanding = max(1, msg.opened.credit)

    async def _open_ahead(self, open_msg: pb.OpenSession) -> None:
        """Send ``OpenSession`` and return at once: the first request may follow it on the
        stream without a round trip (docs/protocol.md, "The Session stream"), and the
        ``SessionOpened`` is read before that request's first response. Until then ``opened``
        is empty and no credit is granted (the worker's initial grant covers the first
        results); a refused open fails the first read with the open's error."""
        await self._send(self._request(open=open_msg))
        self._opening = True

    async def _read_opened(self) -> None:
        """Read the ``SessionOpened`` of an ``_open_ahead``; anything else ends the session."""
        self._opening = False
        msg = await self._next()
        if msg.WhichOneof("kind") != "opened":
            err = ShardError(ErrorCode.INTERNAL, f"expected SessionOpened, got {msg.WhichOneof('kind')}",
                             session_id=self.session_id)
            self._dead = err
            self._stream.abort()
            raise err
        self.opened = msg.opened
        self._window = self._outstanding = max(1, msg.opened.credit)

    def _needs_top_up(self) -> bool:
        """Half the credit window is used (and credit can still be granted)."""
        return (self._outstanding <= self._window // 2 and self.closed is None and self._dead is None
                and not self._opening)

    async def _top_up(self) -> None:
        """Grant credit back once half the window is used (the caller consumed results)."""
        if self._needs_top_up():
            grant = self._window - self._outstanding
            await self._send(self._request(credit=pb.Credit(messages=grant)))
            self._outstanding += grant

    async def _begin(self, req: pb.SessionRequest, stream: StepStream | None = None) -> int:
        """Send a step request after finishing any abandoned one; return its serial."""
        await self._skip_abandoned()
        await self._top_up()
        await self._send(req)
        self._serial += 1
        self._pending = True
        self._guard.sent(stream)
        return self._serial

    async def _skip_abandoned(self) -> None:
        """A generate (or an export) was left early: tell the worker to stop it and skip its
        results. On a connection the worker sent GOAWAY on, no stream opens for a ``Cancel``:
        the request then runs to its end, its results read (and credit granted) and dropped."""
        if not self._pending:
            return
        self._guard.check_skip()
        stoppable = not self._client.going_away
        if stoppable:
            await self._client.cancel(self.session_id)
        while self._pending:
            try:
                if not stoppable:
                    await self._top_up()  # (a request that is not stopped waits for credit)
                await self._read_result(self._serial)
            except ShardError:
                if self._dead is not None or self.closed is not None:
                    raise  # the session itself ended
                # the abandoned request's own error (typically CANCELLED): nobody waits for it

    async def _read_result(self, serial: int, *, state: bool = False) -> Any:
        """The next StepResult of request ``serial`` (``state``: the next StateChunk of an
        export); None once its Usage arrived."""
        if serial != self._serial or not self._pending:
            raise ShardError(ErrorCode.ILLEGAL_TRANSITION, "this request's results were abandoned",
                             session_id=self.session_id)
        error: ShardError | None = None
        while True:
            msg = await self._next()
            kind = msg.WhichOneof("kind")
            if kind == "step":
                if msg.step.more_chunks or self._chunks:  # a result split into chunks
                    try:
                        self._chunks.add(msg.step, self.hidden_dtype, self.opened.kv_capacity,
                                         self._client.max_result_bytes, self.session_id)
                    except ShardError as err:
                        self._fail_result(err)
                    if msg.step.more_chunks:
                        continue
                    self._outstanding -= 1
                    return self._chunks.join(msg.step)
                self._outstanding -= 1
                return msg.step
            if kind == "state":  # an export's (or one left early, which skipping reads)
                self._outstanding -= 1
                if state:
                    return msg.state
                continue
            self._chunks.drop()  # a step that ended mid-result (the stream fails next)
            if kind == "error":
                error = ShardError.from_proto(msg.error)
            elif kind == "usage":
                self.usage = msg.usage
                self._pending = False
                if error is not None:
                    raise error
                return None
            elif kind == "closed":
                self._pending = False
                raise ShardError(ErrorCode.SESSION_NOT_FOUND, "the session was released",
                                 session_id=self.session_id)

    def _fail_result(self, err: ShardError) -> NoReturn:
        """A result that cannot be reassembled ends the session: free its chunks, reset the
        stream (the worker releases the session), and fail this and every later call."""
        self._chunks.drop()
        self._dead = err
        self._stream.abort()
        raise err

    async def _one_step(self, req: pb.SessionRequest) -> pb.StepResult:
        with self._guard.exclusive():
            serial = await self._begin(req)
            step = await self._read_result(serial)
            extra = await self._read_result(serial) if step is not None else None
            if step is None or extra is not None:
                what = "no result" if step is None else "several results"
                raise ShardError(ErrorCode.INTERNAL, f"the step produced {what}",
                                 session_id=self.session_id)
            return step

    async def _usage_only(self, req: pb.SessionRequest, what: str) -> int:
        """A request that computes nothing (a Rewind, a state chunk): the positions held then."""
        with self._guard.exclusive():
            serial = await self._begin(req)
            if await self._read_result(serial) is not None:
                raise ShardError(ErrorCode.INTERNAL, f"{what} produced a result",
                                 session_id=self.session_id)
            return int(self.usage.n_past)

    # ---- steps -----------------------------------------------------------------------------

    def _prefill_msg(
        self, tokens: Sequence[int] | None, text: str | None, hidden_states: np.ndarray | None,
        position: int | None, sampling: pb.SamplingParams | None, top_logprobs: int,
        chunk_tokens: int = 0, token_ids: Sequence[int] | None = None,
        cache_limit: int | None = None, **flags: bool,
    ) -> pb.SessionRequest:
        """A ``Prefill`` request, hidden states (used when neither ``tokens`` nor ``text`` is
        given) in this session's wire dtype; ``flags``: ``prefill_request``'s."""
        rows = (convert.array_to_tensor(hidden_states, self.hidden_dtype)
                if tokens is None and text is None and hidden_states is not None else None)
        return self._request(prefill=prefill_request(
            tokens, text, rows, position, sampling, top_logprobs, chunk_tokens,
            token_ids=token_ids, cache_limit=cache_limit, **flags))

    async def prefill(
        self,
        tokens: Sequence[int] | None = None,
        *,
        text: str | None = None,
        hidden_states: np.ndarray | None = None,
        position: int | None = None,
        sampling: pb.SamplingParams | None = None,
        top_logprobs: int = 0,
        all_logits: bool = False,
        token_ids: Sequence[int] | None = None,
        cache_limit: int | None = None,
    ) -> pb.StepResult:
        """Write a prompt (token ids, text, or float32 [n, n_embd] hidden states, sent in
        ``hidden_dtype``) at ``position`` (default: append at the session's end). ``all_logits``
        (a last shard reporting ``max_logits_positions``): one ``Logits`` per position in
        ``position_logits``, for verifying drafted tokens, and (a worker reporting
        ``input_logprobs``, the input's ids known) each input token's log-prob after the first
        in ``input_logprobs``. ``token_ids`` with hidden states:
        the ids they stand for, more than the rows when the hop before took the first ones from
        its prefix cache (``Prefill.token_ids``). ``cache_limit`` (a worker reporting
        ``prefix_cache_limit``): at most that many of the session's leading positions come
        from its prefix cache (None: any)."""
        return await self._one_step(self._prefill_msg(
            tokens, text, hidden_states, position, sampling, top_logprobs, all_logits=all_logits,
            token_ids=token_ids, cache_limit=cache_limit,
        ))

    def prefill_chunks(
        self,
        tokens: Sequence[int] | None = None,
        *,
        chunk_tokens: int,
        text: str | None = None,
        hidden_states: np.ndarray | None = None,
        position: int | None = None,
        sampling: pb.SamplingParams | None = None,
        top_logprobs: int = 0,
        echo_tokens: bool = False,
        parse_special: bool = False,
        token_ids: Sequence[int] | None = None,
        cache_limit: int | None = None,
    ) -> StepStream:
        """Like ``prefill``, but the worker computes ``chunk_tokens`` positions at a time and
        sends each chunk's result as soon as it is done: iterate for one ``StepResult`` per
        chunk (``start_position`` says where it went; ``chunk_tokens`` 0: one for the whole
        input, a stream for a caller that takes either). ``echo_tokens`` with ``text``: the first
        result's ``input_tokens`` holds the ids the worker tokenized it into;
        ``parse_special``: special-token texts in ``text`` become special tokens (a worker
        reports ``parse_special`` in its capabilities when it honours this); ``cache_limit``
        as ``prefill``'s."""
        if chunk_tokens < 0:
            raise ValueError("chunk_tokens must be >= 0")
        return StepStream(self, self._prefill_msg(
            tokens, text, hidden_states, position, sampling, top_logprobs, chunk_tokens,
            token_ids=token_ids, cache_limit=cache_limit, echo_tokens=echo_tokens,
            parse_special=parse_special,
        ))

    async def decode(
        self,
        token: int | None = None,
        *,
        hidden_state: np.ndarray | None = None,
        sampling: pb.SamplingParams | None = None,
        top_logprobs: int = 0,
        relay_tag: int = 0,
        token_id: int | None = None,
    ) -> pb.StepResult:
        """Append one token (or one hidden-state row [1, n_embd], ``token_id`` the id it stands
        for) and compute one step (``relay_tag``: a chain relay's direct return, see
        ``send_ahead``)."""
        return await self._one_step(
            self._decode_msg(token, hidden_state, sampling, top_logprobs, relay_tag, token_id)
        )

    def decode_message(
        self, token: int | None = None, *, hidden_state: np.ndarray | None = None,
        sampling: pb.SamplingParams | None = None, top_logprobs: int = 0,
        token_id: int | None = None,
    ) -> pb.Decode:
        """The Decode ``decode`` would send (the session's hidden dtype): a group step's row
        (``GroupStream.step``)."""
        return self._decode_msg(token, hidden_state, sampling, top_logprobs, 0, token_id).decode

    def _decode_msg(
        self, token: int | None, hidden_state: np.ndarray | None,
        sampling: pb.SamplingParams | None, top_logprobs: int, relay_tag: int,
        token_id: int | None = None,
    ) -> pb.SessionRequest:
        tensor = (None if token is not None or hidden_state is None
                  else convert.array_to_tensor(hidden_state, self.hidden_dtype))
        return self._request(decode=decode_request(token, tensor, sampling, top_logprobs,
                                                   relay_tag, token_id))

    async def rewind(self, position: int) -> int:
        """Drop the session's positions from ``position`` on, computing nothing (a worker that
        reports ``session_rewind``); returns what it holds afterwards (``Usage.n_past``)."""
        return await self._usage_only(self._request(rewind=pb.Rewind(position=position)),
                                      "a Rewind")

    # ---- session hand-off (a worker reporting session_handoff) -----------------------------

    def export_state(self, *, max_chunk_bytes: int = 0) -> StateStream:
        """The session's state (KV cells, positions, token ids): iterate for its
        ``StateChunk``s, in order, to feed another session's ``import_state``. The session
        itself is unchanged. ``max_chunk_bytes``: the most bytes one chunk may take (>= 4096;
        0: what fits one message of the worker's)."""
        return StateStream(self, self._request(export_state=pb.ExportState(
            max_chunk_bytes=max_chunk_bytes)))

    async def import_state(self, chunk: pb.StateChunk) -> int:
        """Send one chunk of a state to this (empty) session; returns the positions it holds
        (the state's ``n_past`` after the last chunk, 0 before). A refusal (another model,
        range or KV layout, a corrupt or oversized state) raises ``ShardError`` and leaves the
        session empty and usable."""
        return await self._usage_only(self._request(import_state=chunk), "an import_state")

    # ---- steps sent ahead (chain relay's direct return) ------------------------------------

    async def send_ahead(
        self, *, hidden_state: np.ndarray, sampling: pb.SamplingParams | None = None,
        top_logprobs: int = 0, relay_tag: int = 0, token_id: int | None = None,
    ) -> None:
        """Send a Decode without reading its answer (``read_ahead`` does, in order).

        Only for a session opened with a filled-in ``route.return_to``: such a worker queues one
        step behind the running one, so at most two may be unanswered (another worker ends the
        stream with ILLEGAL_TRANSITION). One task sends, another may read; the ordinary step
        calls must not be mixed in while an answer is outstanding.
        """
        if self._pending:
            raise ShardError(ErrorCode.ILLEGAL_TRANSITION, "a step is pending on this session",
                             session_id=self.session_id)
        await self._top_up()
        await self._send(self._decode_msg(None, hidden_state, sampling, top_logprobs, relay_tag,
                                          token_id))

    async def read_ahead(self) -> pb.StepResult:
        """The answer to the oldest unanswered ``send_ahead``; its step error is raised."""
        step: pb.StepResult | None = None
        error: ShardError | None = None
        while True:
            msg = await self._next()
            kind = msg.WhichOneof("kind")
            if kind == "step":
                if msg.step.more_chunks:  # a Decode's logits always fit one message
                    self._fail_result(ShardError(ErrorCode.INVALID_ARGUMENT,
                                                 "a chunked answer to a Decode"))
                self._outstanding -= 1
                step = msg.step
            elif kind == "error":
                error = ShardError.from_proto(msg.error)
            elif kind == "usage":
                self.usage = msg.usage
                if error is not None:
                    raise error
                if step is None:
                    raise ShardError(ErrorCode.INTERNAL, "the step produced no result",
                                     session_id=self.session_id)
                return step
            elif kind == "closed":
                raise ShardError(ErrorCode.SESSION_NOT_FOUND, "the session was released",
                                 session_id=self.session_id)

    def generate(
        self,
        tokens: Sequence[int] | None = None,
        *,
        text: str | None = None,
        max_tokens: int = 64,
        sampling: pb.SamplingParams | None = None,
        stop_tokens: Sequence[int] = (),
        ignore_eos: bool = False,
        top_logprobs: int = 0,
        yield_on_drain: bool = False,
        cache_limit: int | None = None,
    ) -> StepStream:
        """Server-driven decoding: iterate for one ``StepResult`` per token (the last one has
        ``finish_reason`` set). Without a prompt it continues from the last step's token.
        ``yield_on_drain`` (a worker reporting ``session_handoff``): once the worker drains,
        the request ends after the next token with ``ShardError(DRAINING, reason="YIELDED")``
        and the session stays open, to be moved (``move_session``).

        Leaving the loop early is safe: the next request on this session first tells the
        worker to stop (Cancel) and skips the rest; leaving the session block resets it.
        """
        return StepStream(self, self._request(generate=generate_request(
            tokens, text, max_tokens=max_tokens, sampling=sampling, stop_tokens=stop_tokens,
            ignore_eos=ignore_eos, top_logprobs=top_logprobs, yield_on_drain=yield_on_drain,
            cache_limit=cache_limit,
        )))

    async def close(self, *, retain: bool = False) -> pb.SessionClosed:
        """Close the session: free its KV cache, or keep it ``resume_ttl_ms`` for a later
        stream (``retain=True``; resume with ``cache=cache_expectation(tokens)``)."""
        if self.closed is not None:
            return self.closed
        with self._guard.exclusive():
            await self._skip_abandoned()
            await self._send(self._request(close=pb.CloseSession(retain=retain)))
            await self._stream.half_close()
            while self.closed is None:
                msg = await self._next()
                if msg.WhichOneof("kind") == "step" and not msg.step.more_chunks:
                    self._outstanding -= 1
            end = await self._stream.receive(pb.SessionResponse)  # the status follows
            err = self._stream.error()
            if end is not None or err is not None:
                self._dead = err or ShardError(
                    ErrorCode.INTERNAL, "unexpected message after SessionClosed"
                )
                raise self._dead
            self._stream.close()
            return self.closed

    def abort(self) -> None:
        """Reset the stream now (sync): the worker releases the session."""
        self._dead = self._dead or ShardError(ErrorCode.CANCELLED, "aborted by the client",
                                              session_id=self.session_id)
        self._stream.abort()


class StepStream:
    """The results of one Generate (an async iterator; not a generator, so an abandoned one
    needs no finalizer). Credit is granted each time the caller asks for the next result."""

    _state = False  # it reads StepResults (StateStream: StateChunks)

    def __init__(self, session: ClientSession, request: pb.SessionRequest) -> None:
        self._session = session
        self._guard = session._guard
        self._request = request
        self._serial: int | None = None
        self._consumed = False
        self._done = False

    def __aiter__(self) -> StepStream:
        return self

    async def __anext__(self) -> pb.StepResult:
        s = self._session
        if self._done:
            raise StopAsyncIteration
        with self._guard.exclusive():
            if self._serial is None:
                self._serial = await s._begin(self._request, self)
            elif self._consumed and s._needs_top_up():  # (no await per token otherwise)
                await s._top_up()  # the caller came back for more: grant credit
            try:
                step = await s._read_result(self._serial, state=self._state)
            except BaseException:
                self._done = True
                raise
            if step is None:
                self._done = True
                raise StopAsyncIteration
            self._consumed = True
            return step  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        """Stop reading; the session skips the rest before its next request."""
        self._done = True
        await trio.lowlevel.checkpoint()


class StateStream(StepStream):
    """The ``StateChunk``s of one ``export_state`` (credit granted as the caller reads)."""

    _state = True
