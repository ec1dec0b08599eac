"""A connection to one worker (``ShardClient``): connecting, the unary calls with version
negotiation, and opening session streams.

Every call carries ``grpc-timeout`` (the time left to its deadline) and the client enforces the
deadline itself; a call cancelled, timed out or left early resets its stream (the worker stops
and releases); every failure is a ``ShardError`` rebuilt from the status and the
``shard-error-bin`` trailer. The wire itself (gRPC over h2) is ``shard.rpc.transport``'s.
"""

from __future__ import annotations

import math
import secrets
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar

import trio
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from shard.rpc import convert
from shard.rpc.errors import ErrorCode, GrpcStatus, ShardError, unwrap_single_exception
from shard.rpc.transport import ClientConnection
from shard.rpc.versions import CURRENT_VERSION
from shard.v1 import shard_pb2 as pb

from .group import GroupStream
from .options import DEFAULT as _DEFAULT
from .options import TOKEN_CREDIT, check_sampling_support, sampling
from .requests import generate_request
from .session import ClientSession
from .text import OneShot, TextStream

__all__ = ["ShardClient"]

SERVICE = "shard.v1.Shard"
M = TypeVar("M", bound=Message)


def _parse_target(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"target must be HOST:PORT, got {target!r}")
    return host.strip("[]"), int(port)


async def _open_stream(
    target: str, address: str, port: int, host: str, timeout: float | None,
    ssl_context: ssl.SSLContext | None,
) -> trio.abc.Stream:
    """TCP to ``address:port`` (and TLS naming ``host``, ALPN h2) within ``timeout``; a
    failure is ``ShardError(NOT_READY, reason="CONNECT_FAILED")``."""
    try:
        with trio.fail_after(timeout if timeout is not None else math.inf):
            stream: trio.abc.Stream = await trio.open_tcp_stream(address, port)
            if ssl_context is not None:
                ssl_context.set_alpn_protocols(["h2"])
                tls = trio.SSLStream(stream, ssl_context, server_hostname=host)
                try:
                    await tls.do_handshake()
                except BaseException:
                    await trio.aclose_forcefully(stream)  # never leak the socket
                    raise
                stream = tls
            return stream
    # (UnicodeError/ValueError: a host name IDNA cannot encode, e.g. "w..local")
    except (OSError, trio.TooSlowError, trio.BrokenResourceError, ssl.SSLError,
            UnicodeError, ValueError) as exc:
        raise ShardError(
            ErrorCode.NOT_READY,
            f"cannot connect to {target}: {exc or type(exc).__name__}",
            grpc_status=GrpcStatus.UNAVAILABLE,
            reason="CONNECT_FAILED",
        ) from None


@asynccontextmanager
async def _running(conn: ClientConnection) -> AsyncIterator[ClientConnection]:
    """Run ``conn``'s reader and writer for the block, then reset its open streams and say
    goodbye (bounded). Shielded: a cancellation of the caller's scope must not kill the
    connection before the caller's cleanup used it to reset its streams and release
    sessions. It stops when the block ends, not before."""
    conn_scope = trio.CancelScope(shield=True)

    async def run_connection(task_status: trio.TaskStatus[None]) -> None:
        with conn_scope:
            await conn.run(task_status=task_status)

    async with trio.open_nursery() as nursery:
        await nursery.start(run_connection)
        try:
            yield conn
        finally:
            conn.goodbye()
            with trio.move_on_after(1.0) as scope:  # send RST/GOAWAY, bounded
                scope.shield = True
                await conn.drain()
            conn_scope.cancel()


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
            stream = await _open_stream(target, address or host, port, host, timeout, ssl_context)
            scheme = "https" if ssl_context else "http"
            async with stream, _running(ClientConnection(stream, f"{host}:{port}", scheme,
                                                         SERVICE)) as conn:
                yield cls(conn, timeout=timeout, metadata=metadata, version=version,
                          max_result_bytes=max_result_bytes)

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

    async def tokenize(
        self, text: str | None = None, *, tokens: Sequence[int] | None = None,
        add_bos: bool = True, parse_special: bool = False, with_pieces: bool = False,
        timeout: float | None = _DEFAULT,
    ) -> pb.TokenizeResponse:
        """A first shard's token ids for ``text``, or the bytes of ``tokens`` (pieces)."""
        request = pb.TokenizeRequest(version=self.version, add_bos=add_bos,
                                     parse_special=parse_special, with_pieces=with_pieces)
        if tokens is not None:
            request.tokens.ids.extend(tokens)
        else:
            request.text = text or ""
        return await self._unary("Tokenize", request, pb.TokenizeResponse, timeout)

    async def embed(
        self, inputs: Sequence[str | Sequence[int]], *, normalize: bool = True,
        timeout: float | None = _DEFAULT,
    ) -> pb.EmbedResponse:
        """A whole-model worker's pooled embedding of each input (a text, tokenized with BOS
        and special tokens, or token ids), in order; ``normalize``: unit L2 norm. At most
        ``convert.embeds_per_call`` inputs per call (``Embed``)."""
        request = pb.EmbedRequest(version=self.version, normalize=normalize)
        for item in inputs:
            if isinstance(item, str):
                request.inputs.add(text=item)
            else:
                request.inputs.add().tokens.ids.extend(item)
        return await self._unary("Embed", request, pb.EmbedResponse, timeout)

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
        prefix_probe: Sequence[int] = (),
        fork_of: str = "",
        timeout: float | None = _DEFAULT,
        ahead: bool = False,
    ) -> ClientSession:
        """Open a session stream and return it (prefer ``session()``, which also closes it).
        ``prefix_probe`` (a worker reporting ``prefix_cache_limit``): token ids, of which
        ``session.opened.prefix_cached_tokens`` says how many leading ones its prefix cache (and
        its route's) holds. ``fork_of`` (a worker reporting ``session_fork``): the id of a live
        session this caller opened on the worker; the new one starts as a copy of its history.
        ``ahead``: return once ``OpenSession`` is sent, so the first request follows it without
        waiting a round trip; ``session.opened`` is filled in by the first read, and a refused
        open fails it. Only for a worker whose protocol version this client already speaks (its
        capabilities were read): a refused version is not retried in an older one then.

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
            prefix_probe=prefix_probe,
            fork_of=fork_of,
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
        if ahead:
            stream = self._conn.open_stream("Session", deadline, self.metadata)
            session = ClientSession(self, stream, sid)
            try:
                await session._open_ahead(open_msg)
            except BaseException:
                session.abort()
                raise
            return session
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
        fork_of: str = "",
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
        ``fork_of``: open it as a fork of that live session of this caller (``open_session``).
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
            fork_of=fork_of,
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

    @asynccontextmanager
    async def group_steps(self, *, timeout: float | None = _DEFAULT) -> AsyncIterator[GroupStream]:
        """(1.3) A ``GroupSteps`` stream for the block: the decode steps of several sessions
        opened on this worker, one message per tick (``GroupStream.step``). Only with a worker
        that reports ``group_steps`` (and a client speaking 1.3): otherwise
        ``UNSUPPORTED_FEATURE`` before any call, and the caller steps each session on its own
        stream. ``timeout``: the deadline of the whole stream."""
        caps = await self.capabilities(timeout=timeout)
        if not caps.group_steps or (self.version.major, self.version.minor) < (1, 3):
            raise ShardError(ErrorCode.UNSUPPORTED_FEATURE,
                             "this worker does not take group steps (GroupSteps, protocol 1.3)")
        group = GroupStream(self, self._conn.open_stream("GroupSteps", self._deadline(timeout),
                                                         self.metadata))
        try:
            yield group
        except BaseException:
            group.abort()
            raise
        await group.aclose()

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
        grammar_kind: str = "",
        grammar: str = "",
        min_p: float = 0.0,
        repeat_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        penalty_last_n: int = 64,
        logit_bias: Mapping[int, float] | None = None,
    ) -> OneShot:
        """One-shot generation in a fresh session: iterate it for one ``StepResult`` per token.

        ``prompt`` is text (tokenized by the worker, with BOS; ``parse_special``: special-token
        texts in it become special tokens, as a rendered chat template needs) or token ids. The
        session is
        released when the iteration ends, fails or is cancelled. To stop early *and* free the
        worker at once, use ``async with aclosing(client.generate(...)) as steps``; a plain
        ``break`` is safe too, but the stream then stays open (the worker parks once its
        credit is used up) until ``aclose()`` or until the client disconnects.
        ``grammar_kind``/``grammar``: constrained decoding (``options.sampling``).

        ``min_p``, the penalties and ``logit_bias`` (``options.sampling``) are sent only to a
        worker that honours them (``sampling_penalties``): asked of another, the first step
        fails with UNSUPPORTED_FEATURE before a session opens.
        """
        text = prompt if isinstance(prompt, str) else None
        params = sampling(
            temperature, top_k=top_k, top_p=top_p, seed=seed, min_p=min_p,
            repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, penalty_last_n=penalty_last_n,
            logit_bias=logit_bias, grammar_kind=grammar_kind, grammar=grammar)
        g = generate_request(
            None if text is not None else prompt, text, max_tokens=max_tokens, sampling=params,
            stop_tokens=stop_tokens, ignore_eos=ignore_eos, top_logprobs=top_logprobs,
            parse_special=parse_special,
        )
        opener = partial(self.open_session, credit=TOKEN_CREDIT, timeout=timeout)
        if convert.uses_sampling_extensions(params):
            opener = partial(self._open_for_sampling, params, timeout)
        return OneShot(opener, g)

    async def _open_for_sampling(self, params: pb.SamplingParams, timeout: float | None
                                 ) -> ClientSession:
        """A ``generate`` session, once the worker says it honours ``params``."""
        check_sampling_support(await self.capabilities(timeout=timeout), params)
        return await self.open_session(credit=TOKEN_CREDIT, timeout=timeout)

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
        **penalties: Any,
    ) -> TextStream:
        """Like ``generate`` but yields a ``TextChunk`` per token, with its text decoded.

        Tokens carry raw bytes that may split a UTF-8 character, so pieces go through one
        incremental decoder (invalid bytes become U+FFFD): ``chunk.text`` is empty while a
        character is incomplete, and joining every ``chunk.text`` gives the whole text.
        ``penalties``: ``min_p``, the penalties and ``logit_bias``, as ``generate`` takes them.
        """
        return TextStream(self.generate(
            prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, stop_tokens=stop_tokens, ignore_eos=ignore_eos, timeout=timeout,
            parse_special=parse_special, **penalties,
        ))
