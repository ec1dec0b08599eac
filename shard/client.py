"""Trio client for the Shard protocol (used by the CLI, the tests and the bench).

Quick start::

    async with ShardClient.connect("127.0.0.1:50051", timeout=30) as client:
        caps = await client.capabilities()
        async for chunk in client.generate_text("hello", max_tokens=16, temperature=0.8, seed=1):
            print(chunk.text, end="", flush=True)        # chunk.token_id, .piece, .finish_reason

        async with client.session(session_id="chat-1") as s:   # explicit steps
            first = await s.prefill(tokens=[1, 104, 105])
            nxt = await s.decode(first.logits.token_id)
            async for step in s.generate(max_tokens=8):         # continues from `nxt`
                ...
            await s.close(retain=True)                          # keep the KV cache for resume

Why not purerpc's client as is: it never sends ``grpc-timeout``; a server
RST_STREAM or a dropped connection leaves a call waiting forever; breaking out of a bidi
iterator crashes Trio; errors of streaming calls arrive wrapped in exception groups; its task
groups span the caller's code. The wire side (purerpc's gRPC-over-h2 codec with
our own connection loop) lives in ``shard.rpc.transport`` with the server's, so purerpc's
internals stay in one module; this module adds the calls, sessions and typed errors:

* every call carries ``grpc-timeout`` (the remaining time to its deadline) and the client also
  enforces the deadline itself;
* a call that is cancelled, times out or is left early sends RST_STREAM, so the server stops
  and releases the session (it does not keep generating for nobody);
* a reset stream, a GOAWAY or a lost connection ends the affected calls with an error;
* every failure is a ``ShardError`` (``.code``, ``.retryable``, ``.grpc_status``) rebuilt from
  the status and the ``shard-error-bin`` trailer, never a raw exception group;
* session streams grant credit automatically as the caller consumes results, so a caller that
  stops reading pauses the worker instead of filling buffers;
* a result the worker split into chunks (a boundary result over ``max_message_bytes``) is
  reassembled, so callers always see one ``StepResult`` per step; what is buffered for it is
  bounded (at most the session's KV capacity in rows, and ``max_result_bytes`` if set);
* ``wait_for_ready()`` waits for a worker that is still loading to serve (gRPC's
  wait-for-ready), polling ``Health``.

Resource handling: ``connect()`` owns a nursery with the connection's reader and writer tasks
and closes the socket on exit; each call owns one HTTP/2 stream and frees it when it ends. The
connection tasks are shielded until the ``connect()`` block ends, so a caller cancelled from
outside still resets its streams (and can release sessions) instead of dropping the connection,
which would make the worker retain them.
"""

from __future__ import annotations

import codecs
import math
import secrets
import ssl
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import numpy as np
import trio
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from shard.rpc import convert
from shard.rpc.errors import ErrorCode, GrpcStatus, ShardError, unwrap_single_exception
from shard.rpc.transport import ClientConnection, ClientStream
from shard.rpc.versions import CURRENT_VERSION
from shard.v1 import shard_pb2 as pb

__all__ = [
    "ClientSession",
    "ErrorCode",
    "OneShot",
    "ShardClient",
    "ShardError",
    "StepStream",
    "TextChunk",
    "TextStream",
    "cache_expectation",
    "sampling",
]

SERVICE = "shard.v1.Shard"
M = TypeVar("M", bound=Message)
_DEFAULT: Any = object()  # "use the client's default timeout"
#: The credit a session whose results are tokens asks for (``ShardClient.generate``, a
#: pipeline's whole-model hop): a worker grants at most its ``max_credit`` (64 by default).
#: Credit is granted back when half of it is used, so a window of 64 costs one ``Credit``
#: message per 32 tokens where the worker's default (16) costs one per 8, each a message the
#: worker must read and a socket write on both sides. (Other sessions keep the worker's
#: default: a window of hidden-state results is memory the worker holds.)
TOKEN_CREDIT = 64
cache_expectation = convert.cache_expectation


def sampling(
    temperature: float = 0.0, *, top_k: int = 0, top_p: float = 1.0, seed: int = 0
) -> pb.SamplingParams:
    """Sampling parameters; ``temperature`` 0 is greedy."""
    return pb.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


def _parse_target(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"target must be HOST:PORT, got {target!r}")
    return host.strip("[]"), int(port)


# =============================================================================================
# Public API
# =============================================================================================


class ShardClient:
    """A connection to one worker. Create with ``ShardClient.connect(...)``."""

    def __init__(
        self,
        conn: ClientConnection,
        *,
        timeout: float | None,
        metadata: Sequence[tuple[str, str | bytes]],
        version: tuple[int, int] | None,
        max_result_bytes: int | None = None,
    ) -> None:
        self._conn = conn
        self.timeout = timeout
        self.metadata = tuple(metadata)
        self._negotiate = version is None  # may step down to an older minor the worker serves
        version = CURRENT_VERSION if version is None else version
        self.version = pb.ProtocolVersion(major=version[0], minor=version[1])
        self.max_result_bytes = max_result_bytes

    def _step_down(self, err: ShardError, sent: tuple[int, int]) -> bool:
        """After ``UNSUPPORTED_VERSION`` from an older worker for a call sent in version
        ``sent``: speak the newest version of our major it serves (it listed them) and say
        True, so the call is made again. Only when the caller did not pin a version, and only
        to an older minor (minors only add fields). Calls refused at once (several sessions
        opened together) each step down from the version they were sent with, never below
        what another already chose (each compared with the client's current version, the
        later ones found nothing older and failed)."""
        if not self._negotiate or err.code is not ErrorCode.UNSUPPORTED_VERSION:
            return False
        older = [v for v in err.supported_versions if v[0] == sent[0] and v[1] < sent[1]]
        if not older:
            return False
        best = max(older)
        if best < (self.version.major, self.version.minor):
            self.version = pb.ProtocolVersion(major=best[0], minor=best[1])
        return True

    @property
    def open_calls(self) -> int:
        """Calls (unary or streams) running on the connection now."""
        return len(self._conn.streams)

    @property
    def connected(self) -> bool:
        """False once the connection broke or was closed: every call on it fails at once."""
        return self._conn.dead is None

    @property
    def going_away(self) -> bool:
        """True once the worker sent GOAWAY (it drains or closes the connection): calls already
        open go on, new ones on this connection fail at once (``NOT_READY``)."""
        return self._conn.going_away

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        target: str,
        *,
        timeout: float | None = 30.0,
        ssl_context: ssl.SSLContext | None = None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
        version: tuple[int, int] | None = None,
        max_result_bytes: int | None = None,
        address: str | None = None,
    ) -> AsyncIterator[ShardClient]:
        """Connect to ``HOST:PORT``.

        ``timeout``: default deadline in seconds of every call (a session stream counts as one
        call) and of the TCP/TLS connect; None for none. ``metadata``: sent with every call
        (e.g. an ``authorization`` header for the worker's auth hook). ``version``: the
        protocol version sent in every request; by default the newest this client speaks,
        stepping down once to the newest older minor a worker lists when it refuses it (an
        older worker in a fleet being upgraded); a version given here is sent as is. ``max_result_bytes``: the most
        hidden-state bytes one result sent in chunks may add up to (None: bounded only by the
        session's KV capacity); a larger one fails its session with ``RESOURCE_EXHAUSTED``.
        ``address``: the IP address to connect to, already resolved (and checked) by the
        caller, instead of a fresh lookup of the target's host, which still names the server
        for TLS and the ``:authority`` header.
        """
        host, port = _parse_target(target)
        with unwrap_single_exception():
            try:
                with trio.fail_after(timeout if timeout is not None else math.inf):
                    stream: trio.abc.Stream = await trio.open_tcp_stream(address or host, port)
                    if ssl_context is not None:
                        ssl_context.set_alpn_protocols(["h2"])
                        tls = trio.SSLStream(stream, ssl_context, server_hostname=host)
                        try:
                            await tls.do_handshake()
                        except BaseException:
                            await trio.aclose_forcefully(stream)  # never leak the socket
                            raise
                        stream = tls
            # (UnicodeError/ValueError: a host name IDNA cannot encode, e.g. "w..local")
            except (OSError, trio.TooSlowError, trio.BrokenResourceError, ssl.SSLError,
                    UnicodeError, ValueError) as exc:
                raise ShardError(
                    ErrorCode.NOT_READY,
                    f"cannot connect to {target}: {exc or type(exc).__name__}",
                    grpc_status=GrpcStatus.UNAVAILABLE,
                    reason="CONNECT_FAILED",
                ) from None
            async with stream:
                conn = ClientConnection(
                    stream, f"{host}:{port}", "https" if ssl_context else "http", SERVICE
                )
                # Shielded: a cancellation of the caller's scope must not kill the connection
                # before the caller's cleanup (and goodbye below) used it to reset its streams
                # and release sessions. It stops when this block ends, not before.
                conn_scope = trio.CancelScope(shield=True)

                async def run_connection(task_status: trio.TaskStatus[None]) -> None:
                    with conn_scope:
                        await conn.run(task_status=task_status)

                async with trio.open_nursery() as nursery:
                    await nursery.start(run_connection)
                    try:
                        yield cls(conn, timeout=timeout, metadata=metadata, version=version,
                                  max_result_bytes=max_result_bytes)
                    finally:
                        conn.goodbye()
                        with trio.move_on_after(1.0) as scope:  # send RST/GOAWAY, bounded
                            scope.shield = True
                            await conn.drain()
                        conn_scope.cancel()

    # ---- unary calls ---------------------------------------------------------------------

    def _deadline(self, timeout: float | None) -> float:
        if timeout is _DEFAULT:
            timeout = self.timeout
        return math.inf if timeout is None else trio.current_time() + timeout

    async def _unary(self, method: str, request: Message, response_type: type[M], timeout: float | None) -> M:
        sent = (request.version.major, request.version.minor)  # type: ignore[attr-defined]
        try:
            return await self._unary_once(method, request, response_type, timeout)
        except ShardError as err:
            if not self._step_down(err, sent):
                raise
        request.version.CopyFrom(self.version)  # type: ignore[attr-defined]
        return await self._unary_once(method, request, response_type, timeout)

    async def _unary_once(self, method: str, request: Message, response_type: type[M], timeout: float | None) -> M:
        s = self._conn.open_stream(method, self._deadline(timeout), self.metadata)
        try:
            await s.send(request)
            await s.half_close()
            reply = await s.receive(response_type)
            extra = await s.receive(response_type) if reply is not None else None
            err = s.error()
            if err is not None:
                raise err
            if reply is None or extra is not None:
                raise ShardError(ErrorCode.INTERNAL, f"{method}: expected exactly one response")
            return reply
        finally:
            if s.status is None:
                s.abort()
            else:
                s.close()

    async def capabilities(self, *, timeout: float | None = _DEFAULT) -> pb.GetCapabilitiesResponse:
        """What the worker serves (model fingerprint, layer range, limits, versions)."""
        return await self._unary(
            "GetCapabilities", pb.GetCapabilitiesRequest(version=self.version),
            pb.GetCapabilitiesResponse, timeout,
        )

    async def capabilities_dict(self, *, timeout: float | None = _DEFAULT) -> dict[str, Any]:
        """``capabilities()`` as a JSON-ready dict in proto field order (for display)."""
        caps = await self.capabilities(timeout=timeout)
        out = MessageToDict(caps, always_print_fields_with_no_presence=True, preserving_proto_field_name=True)
        out["supported_versions"] = [f"{v.major}.{v.minor}" for v in caps.supported_versions]
        out["layer_range"] = [caps.layer_range.start, caps.layer_range.end]
        return out

    async def health(self, *, timeout: float | None = _DEFAULT) -> pb.HealthResponse:
        return await self._unary("Health", pb.HealthRequest(version=self.version), pb.HealthResponse, timeout)

    async def wait_for_ready(
        self, *, timeout: float | None = _DEFAULT, interval: float = 0.05
    ) -> pb.HealthResponse:
        """Wait until the worker is SERVING, like gRPC's wait-for-ready: a worker that is still
        loading (NOT_READY) is asked again (``Health``, every ``interval`` seconds, doubling up
        to 1 s) until it serves or ``timeout`` (default: the client's) has passed.

        Raises ``ShardError``: ``NOT_READY`` when it is not serving by then, naming its last
        status; at once ``ENGINE_FAILURE`` for a FAILED worker and ``DRAINING`` for a draining
        one (neither becomes ready by waiting).
        """
        H = pb.HealthResponse
        if timeout is _DEFAULT:
            timeout = self.timeout
        deadline = self._deadline(timeout)
        last = "no answer"
        while (remaining := deadline - trio.current_time()) > 0:
            try:
                health = await self.health(timeout=None if math.isinf(remaining) else remaining)
            except ShardError as err:
                if err.code is not ErrorCode.DEADLINE_EXCEEDED:
                    raise
                break
            status = H.Status.Name(health.status).removeprefix("STATUS_")
            if health.status == H.STATUS_SERVING:
                return health
            if health.status == H.STATUS_FAILED:
                raise ShardError(ErrorCode.ENGINE_FAILURE, f"the worker reports FAILED: {health.detail}")
            if health.status == H.STATUS_DRAINING:
                raise ShardError(ErrorCode.DRAINING, "the worker is draining")
            last = f"{status} ({health.detail})" if health.detail else status
            await trio.sleep(min(interval, max(0.0, deadline - trio.current_time())))
            interval = min(2 * interval, 1.0)
        raise ShardError(
            ErrorCode.NOT_READY,
            f"the worker did not become ready within {timeout:.3g} s (last status: {last})",
            reason="WAIT_FOR_READY_TIMEOUT",
        )

    async def metrics(self, *, timeout: float | None = _DEFAULT) -> pb.GetMetricsResponse:
        return await self._unary(
            "GetMetrics", pb.GetMetricsRequest(version=self.version), pb.GetMetricsResponse, timeout
        )

    async def cancel(self, session_id: str, *, timeout: float | None = _DEFAULT) -> pb.CancelResponse:
        """Stop the session's running step (out-of-band; the session stays open)."""
        return await self._unary(
            "Cancel", pb.CancelRequest(version=self.version, session_id=session_id),
            pb.CancelResponse, timeout,
        )

    async def return_step(
        self, address: pb.ReturnAddress, tag: int, step: pb.StepResult, *,
        timeout: float | None = _DEFAULT,
    ) -> bool:
        """Hand a routed session's result to its first hop (chain relay's direct return, sent by
        the last hop's worker); False when no step there waited for it."""
        reply = await self._unary(
            "Return", pb.ReturnRequest(
                version=self.version, session_id=address.session_id, secret=address.secret,
                relay_tag=tag, step=step,
            ), pb.ReturnResponse, timeout,
        )
        return reply.accepted

    async def release(self, session_id: str, *, timeout: float | None = _DEFAULT) -> bool:
        """Free the session's KV cache now (streaming or retained); False if it did not exist."""
        reply = await self._unary(
            "Release", pb.ReleaseRequest(version=self.version, session_id=session_id),
            pb.ReleaseResponse, timeout,
        )
        return reply.released

    # ---- sessions ------------------------------------------------------------------------

    async def open_session(
        self,
        session_id: str | None = None,
        *,
        cache: pb.CacheExpectation | None = None,
        kv_budget: int = 0,
        credit: int = 0,
        step_timeout: float | None = None,
        expected_model_fingerprint: str = "",
        expected_layer_range: tuple[int, int] | None = None,
        hidden_wire_dtype: str = "",
        route: pb.Route | None = None,
        batch_group: int = 0,
        timeout: float | None = _DEFAULT,
    ) -> ClientSession:
        """Open a session stream and return it (prefer ``session()``, which also closes it).

        The caller owns the result: finish it with ``close()`` or ``abort()``.
        """
        sid = session_id if session_id is not None else f"c-{secrets.token_hex(8)}"
        open_msg = pb.OpenSession(
            session_id=sid,
            expected_model_fingerprint=expected_model_fingerprint,
            kv_budget=kv_budget,
            initial_credit=credit,
            step_timeout_ms=0 if step_timeout is None else max(1, round(step_timeout * 1000)),
            hidden_wire_dtype=hidden_wire_dtype,
            batch_group=batch_group,
        )
        if cache is not None:
            open_msg.cache.CopyFrom(cache)
        if route is not None and (route.hops or route.HasField("return_to")):
            open_msg.route.CopyFrom(route)  # chain relay: the worker opens the next hop itself
        if expected_layer_range is not None:
            open_msg.expected_layer_range.CopyFrom(
                pb.LayerRange(start=expected_layer_range[0], end=expected_layer_range[1])
            )
        deadline = self._deadline(timeout)
        while True:
            stream = self._conn.open_stream("Session", deadline, self.metadata)
            session = ClientSession(self, stream, sid)
            sent = (self.version.major, self.version.minor)  # (what _open sends it in)
            try:
                await session._open(open_msg)
            except ShardError as err:
                session.abort()
                if self._step_down(err, sent):
                    continue  # an older worker: open again in its version
                raise
            except BaseException:
                session.abort()
                raise
            return session

    @asynccontextmanager
    async def session(
        self,
        session_id: str | None = None,
        *,
        cache: pb.CacheExpectation | None = None,
        kv_budget: int = 0,
        credit: int = 0,
        step_timeout: float | None = None,
        expected_model_fingerprint: str = "",
        expected_layer_range: tuple[int, int] | None = None,
        hidden_wire_dtype: str = "",
        route: pb.Route | None = None,
        batch_group: int = 0,
        timeout: float | None = _DEFAULT,
    ) -> AsyncIterator[ClientSession]:
        """Open a session stream for the block (``session_id`` defaults to a random id).

        ``cache``: resume a retained session (see ``cache_expectation``); the outcome is in
        ``session.cache``. ``credit``: results the worker may send ahead (0: its default;
        ``TOKEN_CREDIT`` suits a session that generates).
        ``step_timeout``: per-step deadline in seconds. ``hidden_wire_dtype``: ask for
        "float16" hidden states (see ``session.hidden_dtype`` for what the worker agreed to).
        ``route``: the hops after this worker, for chain relay (a worker that reports
        ``relay_allowed`` opens them itself; docs/pipelines.md, "Chain relay").
        ``batch_group``: the session's batch group (a scheduling hint for workers that report
        ``batch_groups``: a batched step holds one group's steps; 0: none).
        ``timeout``: deadline of the whole stream. Leaving the block normally closes the session (released, unless
        ``close(retain=True)`` was called); leaving it with an exception or a cancellation
        resets the stream, which releases the session on the worker.
        """
        session = await self.open_session(
            session_id,
            cache=cache,
            kv_budget=kv_budget,
            credit=credit,
            step_timeout=step_timeout,
            expected_model_fingerprint=expected_model_fingerprint,
            expected_layer_range=expected_layer_range,
            hidden_wire_dtype=hidden_wire_dtype,
            route=route,
            batch_group=batch_group,
            timeout=timeout,
        )
        try:
            yield session
            if session.closed is None and session._dead is None:
                await session.close()
        except BaseException:
            session.abort()
            raise
        session._stream.close()

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_tokens: Sequence[int] = (),
        ignore_eos: bool = False,
        timeout: float | None = _DEFAULT,
        top_logprobs: int = 0,
        parse_special: bool = False,
    ) -> OneShot:
        """One-shot generation in a fresh session: iterate it for one ``StepResult`` per token.

        ``prompt`` is text (tokenized by the worker, with BOS; ``parse_special``: special-token
        texts in it become special tokens, as a rendered chat template needs) or token ids. The
        session is
        released when the iteration ends, fails or is cancelled. To stop early *and* free the
        worker at once, use ``async with aclosing(client.generate(...)) as steps``; a plain
        ``break`` is safe too, but the stream then stays open (the worker parks once its
        credit is used up) until ``aclose()`` or until the client disconnects.
        """
        g = pb.Generate(max_tokens=max_tokens, stop_tokens=stop_tokens, ignore_eos=ignore_eos,
                        top_logprobs=top_logprobs)
        if isinstance(prompt, str):
            g.text = prompt
            g.parse_special = parse_special
        else:
            g.tokens.ids.extend(prompt)
        g.sampling.CopyFrom(sampling(temperature, top_k=top_k, top_p=top_p, seed=seed))
        return OneShot(self, g, timeout)

    def generate_text(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_tokens: Sequence[int] = (),
        ignore_eos: bool = False,
        timeout: float | None = _DEFAULT,
        parse_special: bool = False,
    ) -> TextStream:
        """Like ``generate`` but yields a ``TextChunk`` per token, with its text decoded.

        Tokens carry raw bytes that may split a UTF-8 character, so pieces go through one
        incremental decoder (invalid bytes become U+FFFD): ``chunk.text`` is empty while a
        character is incomplete, and joining every ``chunk.text`` gives the whole text.
        """
        return TextStream(self.generate(
            prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, stop_tokens=stop_tokens, ignore_eos=ignore_eos, timeout=timeout,
            parse_special=parse_special,
        ))


class ClientSession:
    """One open session stream. Steps never overlap: issue one request at a time.

    Step-level errors (bad input, a full KV budget, a step deadline, an out-of-band Cancel)
    raise ``ShardError`` and leave the session usable; errors that end the stream raise
    ``ShardError`` and every later call raises it again.

    One task at a time: a call from a second task while another task is inside a call, or
    while another task's ``generate()`` is still being iterated (neither finished nor
    ``aclose()``d), raises ``ShardError(ILLEGAL_TRANSITION)`` and leaves the first one alone.
    ``abort()`` works from any task.
    """

    def __init__(self, client: ShardClient, stream: ClientStream, session_id: str) -> None:
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
        self._user: trio.lowlevel.Task | None = None  # the task inside a call right now
        self._pending_owner: trio.lowlevel.Task | None = None  # who sent the pending request
        self._pending_stream: StepStream | None = None  # the pending request's generate, if any
        self._chunks: list[pb.StepResult] = []  # chunks of a split result, not yet complete
        self._chunk_rows = 0  # rows and bytes in ``_chunks`` (bounded, see ``_buffer_chunk``)
        self._chunk_bytes = 0

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

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The conflict guard: one task uses the session at a time (see the class docstring)."""
        task = trio.lowlevel.current_task()
        if self._user is not None and self._user is not task:
            raise ShardError(
                ErrorCode.ILLEGAL_TRANSITION,
                "this session is in use by another task (steps never overlap; use one "
                "session per task)",
                session_id=self.session_id,
            )
        outer = self._user is None
        self._user = task
        try:
            yield
        finally:
            if outer:
                self._user = None

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

    def _needs_top_up(self) -> bool:
        """Half the credit window is used (and credit can still be granted)."""
        return self._outstanding <= self._window // 2 and self.closed is None and self._dead is None

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
        self._pending_owner = trio.lowlevel.current_task()
        self._pending_stream = stream
        return self._serial

    async def _skip_abandoned(self) -> None:
        """A generate (or an export) was left early: tell the worker to stop it and skip its
        results. On a connection the worker sent GOAWAY on, no stream opens for a ``Cancel``:
        the request then runs to its end, its results read (and credit granted) and dropped."""
        if not self._pending:
            return
        stream = self._pending_stream
        if (
            self._pending_owner is not trio.lowlevel.current_task()
            and stream is not None
            and not stream._done
        ):
            raise ShardError(
                ErrorCode.ILLEGAL_TRANSITION,
                "another task is still iterating this session's generate(); finish or "
                "aclose() it first",
                session_id=self.session_id,
            )
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
                if msg.step.more_chunks or self._chunks:
                    self._buffer_chunk(msg.step)
                if msg.step.more_chunks:
                    continue
                self._outstanding -= 1
                return self._join_chunks(msg.step)
            if kind == "state":  # an export's (or one left early, which skipping reads)
                self._outstanding -= 1
                if state:
                    return msg.state
                continue
            self._drop_chunks()  # a step that ended mid-result (the stream fails next)
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

    def _buffer_chunk(self, chunk: pb.StepResult) -> None:
        """Keep one chunk of a split result, within bounds: every chunk well-formed (rows of the
        first chunk's width in the session's dtype), at most the session's KV capacity in rows
        (so at most kv_capacity x n_embd x itemsize bytes) and ``max_result_bytes`` in bytes.
        Past a bound the session fails (the stream is reset and the chunks are dropped)."""
        t = chunk.hidden_states
        first = self._chunks[0].hidden_states if self._chunks else t
        width = first.shape[1] if len(first.shape) == 2 else 0
        rows = t.shape[0] if len(t.shape) == 2 and t.shape[1] == width else 0
        itemsize = convert.WIRE_DTYPES[self.hidden_dtype].itemsize
        limit = self._client.max_result_bytes
        if rows < 1 or width < 1 or len(t.data) != rows * width * itemsize:
            self._fail_result(ShardError(
                ErrorCode.INVALID_ARGUMENT,
                f"malformed result chunk: shape {list(t.shape)}, {len(t.data)} bytes of "
                f"{self.hidden_dtype} (rows of width {width or '?'} expected)",
                session_id=self.session_id,
            ))
        self._chunk_rows += rows
        self._chunk_bytes += len(t.data)
        if limit is not None and self._chunk_bytes > limit:
            what = f"more than max_result_bytes={limit}"
        elif self._chunk_rows > self.opened.kv_capacity:
            what = f"more rows than the session's KV capacity ({self.opened.kv_capacity})"
        else:
            what = ""
        if what:
            self._fail_result(ShardError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"a result sent in chunks grew to {self._chunk_rows} rows, {self._chunk_bytes} "
                f"bytes: {what}",
                retryable=False, session_id=self.session_id, reason="RESULT_TOO_LARGE",
            ))
        self._chunks.append(chunk)

    def _drop_chunks(self) -> None:
        self._chunks = []
        self._chunk_rows = self._chunk_bytes = 0

    def _fail_result(self, err: ShardError) -> NoReturn:
        """A result that cannot be reassembled ends the session: free its chunks, reset the
        stream (the worker releases the session), and fail this and every later call."""
        self._drop_chunks()
        self._dead = err
        self._stream.abort()
        raise err

    def _join_chunks(self, last: pb.StepResult) -> pb.StepResult:
        """Reassemble a result the worker split into chunks (rows in order; ``last`` is
        buffered already)."""
        if not self._chunks:
            return last
        parts = self._chunks
        self._drop_chunks()
        whole = pb.StepResult()
        whole.CopyFrom(last)
        whole.hidden_states.data = b"".join(p.hidden_states.data for p in parts)
        whole.hidden_states.shape[0] = sum(p.hidden_states.shape[0] for p in parts)
        return whole

    async def _one_step(self, req: pb.SessionRequest) -> pb.StepResult:
        with self._exclusive():
            serial = await self._begin(req)
            step = await self._read_result(serial)
            if step is None:
                raise ShardError(
                    ErrorCode.INTERNAL, "the step produced no result", session_id=self.session_id
                )
            if await self._read_result(serial) is not None:
                raise ShardError(
                    ErrorCode.INTERNAL, "the step produced several results", session_id=self.session_id
                )
            return step

    # ---- steps -----------------------------------------------------------------------------

    def _prefill_msg(
        self,
        tokens: Sequence[int] | None,
        text: str | None,
        hidden_states: np.ndarray | None,
        position: int | None,
        sampling: pb.SamplingParams | None,
        top_logprobs: int,
        chunk_tokens: int = 0,
        all_logits: bool = False,
        echo_tokens: bool = False,
        parse_special: bool = False,
    ) -> pb.SessionRequest:
        p = pb.Prefill(top_logprobs=top_logprobs, chunk_tokens=chunk_tokens, all_logits=all_logits,
                       echo_tokens=echo_tokens, parse_special=parse_special)
        if tokens is not None:
            p.tokens.ids.extend(tokens)
        elif text is not None:
            p.text = text
        elif hidden_states is not None:
            p.hidden_states.CopyFrom(convert.array_to_tensor(hidden_states, self.hidden_dtype))
        if position is not None:
            p.position.value = position
        if sampling is not None:
            p.sampling.CopyFrom(sampling)
        return self._request(prefill=p)

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
    ) -> pb.StepResult:
        """Write a prompt (token ids, text, or float32 [n, n_embd] hidden states, sent in
        ``hidden_dtype``) at ``position`` (default: append at the session's end). ``all_logits``
        (a last shard reporting ``max_logits_positions``): one ``Logits`` per position in
        ``position_logits``, for verifying drafted tokens."""
        return await self._one_step(self._prefill_msg(
            tokens, text, hidden_states, position, sampling, top_logprobs, all_logits=all_logits
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
    ) -> StepStream:
        """Like ``prefill``, but the worker computes ``chunk_tokens`` positions at a time and
        sends each chunk's result as soon as it is done: iterate for one ``StepResult`` per
        chunk (``start_position`` says where it went). ``echo_tokens`` with ``text``: the first
        result's ``input_tokens`` holds the ids the worker tokenized it into;
        ``parse_special``: special-token texts in ``text`` become special tokens (a worker
        reports ``parse_special`` in its capabilities when it honours this)."""
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        return StepStream(self, self._prefill_msg(
            tokens, text, hidden_states, position, sampling, top_logprobs, chunk_tokens,
            echo_tokens=echo_tokens, parse_special=parse_special,
        ))

    async def decode(
        self,
        token: int | None = None,
        *,
        hidden_state: np.ndarray | None = None,
        sampling: pb.SamplingParams | None = None,
        top_logprobs: int = 0,
        relay_tag: int = 0,
    ) -> pb.StepResult:
        """Append one token (or one hidden-state row [1, n_embd]) and compute one step
        (``relay_tag``: a chain relay's direct return, see ``send_ahead``)."""
        return await self._one_step(
            self._decode_msg(token, hidden_state, sampling, top_logprobs, relay_tag)
        )

    def _decode_msg(
        self, token: int | None, hidden_state: np.ndarray | None,
        sampling: pb.SamplingParams | None, top_logprobs: int, relay_tag: int,
    ) -> pb.SessionRequest:
        d = pb.Decode(top_logprobs=top_logprobs, relay_tag=relay_tag)
        if token is not None:
            d.token = token
        elif hidden_state is not None:
            d.hidden_state.CopyFrom(convert.array_to_tensor(hidden_state, self.hidden_dtype))
        if sampling is not None:
            d.sampling.CopyFrom(sampling)
        return self._request(decode=d)

    async def rewind(self, position: int) -> int:
        """Drop the session's positions from ``position`` on, computing nothing (a worker that
        reports ``session_rewind``); returns what it holds afterwards (``Usage.n_past``)."""
        with self._exclusive():
            serial = await self._begin(self._request(rewind=pb.Rewind(position=position)))
            if await self._read_result(serial) is not None:
                raise ShardError(ErrorCode.INTERNAL, "a Rewind produced a result",
                                 session_id=self.session_id)
            return int(self.usage.n_past)

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
        with self._exclusive():
            serial = await self._begin(self._request(import_state=chunk))
            if await self._read_result(serial) is not None:
                raise ShardError(ErrorCode.INTERNAL, "an import_state produced a result",
                                 session_id=self.session_id)
            return int(self.usage.n_past)

    # ---- steps sent ahead (chain relay's direct return) ------------------------------------

    async def send_ahead(
        self, *, hidden_state: np.ndarray, sampling: pb.SamplingParams | None = None,
        top_logprobs: int = 0, relay_tag: int = 0,
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
        await self._send(self._decode_msg(None, hidden_state, sampling, top_logprobs, relay_tag))

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
    ) -> StepStream:
        """Server-driven decoding: iterate for one ``StepResult`` per token (the last one has
        ``finish_reason`` set). Without a prompt it continues from the last step's token.
        ``yield_on_drain`` (a worker reporting ``session_handoff``): once the worker drains,
        the request ends after the next token with ``ShardError(DRAINING, reason="YIELDED")``
        and the session stays open, to be moved (``move_session``).

        Leaving the loop early is safe: the next request on this session first tells the
        worker to stop (Cancel) and skips the rest; leaving the session block resets it.
        """
        g = pb.Generate(max_tokens=max_tokens, stop_tokens=stop_tokens, ignore_eos=ignore_eos,
                        top_logprobs=top_logprobs, yield_on_drain=yield_on_drain)
        if tokens is not None:
            g.tokens.ids.extend(tokens)
        elif text is not None:
            g.text = text
        if sampling is not None:
            g.sampling.CopyFrom(sampling)
        return StepStream(self, self._request(generate=g))

    async def close(self, *, retain: bool = False) -> pb.SessionClosed:
        """Close the session: free its KV cache, or keep it ``resume_ttl_ms`` for a later
        stream (``retain=True``; resume with ``cache=cache_expectation(tokens)``)."""
        if self.closed is not None:
            return self.closed
        with self._exclusive():
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
        with s._exclusive():
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


async def move_session(
    source: ClientSession, target: ClientSession, *, max_chunk_bytes: int = 0
) -> int:
    """Copy ``source``'s state into ``target`` (an empty session on a worker of the same model,
    range and KV layout) chunk by chunk, never holding more than one chunk; returns the
    positions ``target`` holds. ``source`` is unchanged. A refusal raises ``ShardError`` with
    ``target`` left empty (replay the history into it instead); the rest of the export is
    then skipped by ``source``'s next request."""
    held = 0
    stream = source.export_state(max_chunk_bytes=max_chunk_bytes)
    try:
        async for chunk in stream:
            held = await target.import_state(chunk)
    finally:
        await stream.aclose()
    return held


class OneShot:
    """``ShardClient.generate``: a session opened on first use, closed when exhausted, reset on
    error, cancellation or ``aclose()``."""

    def __init__(self, client: ShardClient, request: pb.Generate, timeout: float | None) -> None:
        self._client = client
        self._request = request
        self._timeout = timeout
        self._session: ClientSession | None = None
        self._steps: StepStream | None = None
        self._done = False

    def __aiter__(self) -> OneShot:
        return self

    async def __anext__(self) -> pb.StepResult:
        if self._done:
            raise StopAsyncIteration
        try:
            if self._steps is None:
                self._session = await self._client.open_session(credit=TOKEN_CREDIT,
                                                                timeout=self._timeout)
                self._steps = StepStream(self._session, self._session._request(generate=self._request))
            return await self._steps.__anext__()
        except StopAsyncIteration:
            self._done = True
            assert self._session is not None
            await self._session.close()
            raise
        except BaseException:
            self._done = True
            if self._session is not None:
                self._session.abort()
            raise

    async def aclose(self) -> None:
        """Stop now: reset the stream so the worker releases the session at once."""
        if not self._done:
            self._done = True
            if self._session is not None:
                self._session.abort()
        await trio.lowlevel.checkpoint()


@dataclass(frozen=True)
class TextChunk:
    """One generated token as text. ``text`` is what the token completes: it may be empty
    while a UTF-8 character is still incomplete, and the last chunk flushes the decoder."""

    text: str
    token_id: int
    piece: bytes  # the token's raw bytes
    logprob: float
    finish_reason: int  # pb.FinishReason; FINISH_REASON_UNSPECIFIED except on the last token
    n_past: int

    def __str__(self) -> str:
        return self.text


class TextStream:
    """``ShardClient.generate_text``: a ``TextChunk`` per token of a ``OneShot``."""

    def __init__(self, steps: OneShot) -> None:
        self._steps = steps
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __aiter__(self) -> TextStream:
        return self

    async def __anext__(self) -> TextChunk:
        step = await self._steps.__anext__()
        last = step.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        lg = step.logits
        return TextChunk(
            text=self._decoder.decode(lg.piece, final=last),
            token_id=lg.token_id,
            piece=lg.piece,
            logprob=lg.logprob,
            finish_reason=step.finish_reason,
            n_past=step.n_past,
        )

    async def aclose(self) -> None:
        await self._steps.aclose()
