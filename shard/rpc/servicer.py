"""The ``shard.v1.Shard`` RPC handlers: authorize, check the version, call, map errors.

Why thin: the session state machine lives in ``session/`` and the session table in
``registry.py``; this module only adapts them to the transport API (``current_call()``,
``StatusError``) and to protobuf. Every error leaves as a gRPC status plus the
``shard-error-bin`` trailer; an unexpected exception becomes a generic INTERNAL status and a log
line, never a traceback on the wire.

Error handling: handlers catch ``Exception`` only, so ``trio.Cancelled`` always propagates.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextvars import ContextVar, copy_context
from typing import TypeVar

import trio
from google.protobuf.message import DecodeError

from shard.engine import EngineError, EngineState, IllegalTransition, InvalidInput, ShardEngine
from shard.v1 import shard_pb2 as pb
from shard.v1.shard_grpc import ShardServicer as _ShardServicerBase

from . import convert, lifecycle
from .convert import embeds_per_call
from .errors import ERROR_TRAILER, ErrorCode, ShardError, internal_error
from .metrics import WorkerMetrics
from .registry import Registry
from .session import SessionCall, SessionLimits, StreamEnd, return_refused
from .session.forks import caller_of
from .session.group import run_group
from .session.inputs import text_floor
from .transport import CallContext, EndReason, StatusError, TransportLimits, current_call
from .versions import check_version

log = logging.getLogger(__name__)
Req = TypeVar("Req")
Resp = TypeVar("Resp")

#: Optional authentication hook: inspect the call (metadata such as a bearer token, the peer)
#: and raise ``ShardError(UNAUTHENTICATED | PERMISSION_DENIED)`` to refuse it. It may return
#: the caller's principal name (shown in session logs; never a credential). The worker only
#: verifies; who may do what, and billing, stay with the router.
Authorizer = Callable[[CallContext], Awaitable[str | None]]

_STREAM_END: dict[EndReason, StreamEnd] = {
    EndReason.DEADLINE: StreamEnd.DEADLINE,
    EndReason.CLIENT_CANCELLED: StreamEnd.CLIENT_CANCELLED,
    EndReason.CONNECTION_LOST: StreamEnd.CONNECTION_LOST,
    EndReason.SHUTDOWN: StreamEnd.SHUTDOWN,
    # The client stopped reading (send_idle_timeout): released, since a client that reads
    # nothing holds a session slot for nothing.
    EndReason.SEND_STALLED: StreamEnd.SEND_STALLED,
}

#: The call whose auth hook the transport already ran from its headers (``authorize_call``);
#: the handler then does not run it again.
_authorized: ContextVar[CallContext | None] = ContextVar("shard_authorized_call", default=None)

#: The Shard error that rides along when the transport itself ends a call with a status.
_END_ERRORS: dict[EndReason, ShardError] = {
    EndReason.DEADLINE: ShardError(ErrorCode.DEADLINE_EXCEEDED, "the call deadline expired"),
    EndReason.SHUTDOWN: ShardError(ErrorCode.DRAINING, "the worker is draining: stream ended"),
}


def status_error(err: ShardError) -> StatusError:
    """The transport exception that ends a call with ``err`` as status + trailer."""
    return StatusError(int(err.grpc_status), err.message, err.trailers())


class _Requests:
    """The request stream as the session sees it: transport failures become ShardErrors."""

    def __init__(
        self,
        inner: AsyncIterable[pb.SessionRequest],
        observe: Callable[[pb.SessionRequest], None] | None = None,
    ) -> None:
        self._inner = aiter(inner)
        self._observe = observe

    def __aiter__(self) -> _Requests:
        return self

    async def __anext__(self) -> pb.SessionRequest:
        try:
            request = await anext(self._inner)
        except StatusError as exc:  # oversized, unparsable, unfinished or compressed message
            # The transport's statuses carry their Shard error (code, reason, retryable): the
            # stream fails with it, as the same request would on a unary call.
            raise ShardError.from_status(exc.code, exc.message, exc.trailers) from None
        if self._observe is not None:
            self._observe(request)
        return request


class ShardServicer(_ShardServicerBase):
    """Handlers of ``shard.v1.Shard``; register ``servicer.service`` with the transport."""

    def __init__(
        self,
        engine: ShardEngine,
        registry: Registry,
        *,
        transport_limits: TransportLimits = TransportLimits(),
        authorize: Authorizer | None = None,
        metrics: WorkerMetrics | None = None,
        model_name: str = "",
    ) -> None:
        self.engine = engine
        #: What ``GetCapabilitiesResponse.model_name`` says (``serve --model-name``).
        self.model_name = model_name
        self.registry = registry
        self._transport_limits = transport_limits
        self._authorize = authorize
        if metrics is None:
            metrics = WorkerMetrics()
            metrics.attach(engine, registry)
        #: Counters, histograms and the snapshot GetMetrics returns (also served on /metrics).
        self.metrics = metrics
        #: Called when an error suggests the engine's health changed (set by ``serve``), so
        #: grpc.health.v1 turns NOT_SERVING at once rather than at the next periodic check.
        self.on_health_change: Callable[[], None] | None = None

    @property
    def limits(self) -> SessionLimits:
        return self.registry.limits

    # ---- unary RPCs ------------------------------------------------------------------------

    async def GetCapabilities(self, input_message: pb.GetCapabilitiesRequest) -> pb.GetCapabilitiesResponse:
        return await self._unary(input_message, self._capabilities)

    async def Health(self, input_message: pb.HealthRequest) -> pb.HealthResponse:
        return await self._unary(input_message, self._health)

    async def Cancel(self, input_message: pb.CancelRequest) -> pb.CancelResponse:
        return await self._unary(input_message, self._cancel)

    async def Release(self, input_message: pb.ReleaseRequest) -> pb.ReleaseResponse:
        return await self._unary(input_message, self._release)

    async def GetMetrics(self, input_message: pb.GetMetricsRequest) -> pb.GetMetricsResponse:
        return await self._unary(input_message, self._metrics)

    async def Return(self, input_message: pb.ReturnRequest) -> pb.ReturnResponse:
        return await self._unary(input_message, self._return)

    async def Tokenize(self, input_message: pb.TokenizeRequest) -> pb.TokenizeResponse:
        return await self._unary(input_message, self._tokenize)

    async def Embed(self, input_message: pb.EmbedRequest) -> pb.EmbedResponse:
        return await self._unary(input_message, self._embed)

    async def _unary(self, request: Req, handler: Callable[[Req], Awaitable[Resp]]) -> Resp:
        ctx = current_call()
        self.registry.count(f"rpc_{ctx.method.rsplit('/', 1)[-1]}_total")
        try:
            await self._authenticate(ctx)
            check_version(request, getattr(request, "session_id", ""))
            return await handler(request)
        except ShardError as err:
            raise self._refuse(err) from None
        except EngineError as exc:
            raise self._refuse(ShardError.from_engine(exc)) from None
        except Exception:
            log.exception("%s failed", ctx.method)
            raise self._refuse(internal_error()) from None
        finally:
            _note_end(ctx)

    async def _authenticate(self, ctx: CallContext) -> None:
        """Run the auth hook (unless ``authorize_call`` already did for this call); remember
        the principal for this call's log lines."""
        if self._authorize is not None and _authorized.get() is not ctx:
            lifecycle.principal.set(await self._authorize(ctx) or "")

    async def authorize_call(self, ctx: CallContext) -> None:
        """The transport's gate for ``shard.v1.Shard`` (``Server.add_service(authorize=)``):
        runs the auth hook from the call's headers, before a byte of its request is
        acknowledged or its handler starts, so an unauthenticated peer cannot make the worker
        buffer message bytes. Refusals are counted and carry the Shard trailers."""
        try:
            await self._authenticate(ctx)
        except ShardError as err:
            if not ctx.method.endswith("/Session"):  # unary calls are counted when refused too
                self.registry.count(f"rpc_{ctx.method.rsplit('/', 1)[-1]}_total")
            raise self._refuse(err) from None
        except Exception:
            log.exception("the authorize hook failed on %s", ctx.method)
            raise self._refuse(internal_error()) from None
        _authorized.set(ctx)

    async def _capabilities(self, _: pb.GetCapabilitiesRequest) -> pb.GetCapabilitiesResponse:
        await trio.lowlevel.checkpoint()
        caps = convert.capabilities_to_proto(
            self.engine.capabilities(),
            max_message_bytes=self._transport_limits.max_message_bytes,
            max_credit=self.limits.max_credit,
            resume_ttl_ms=self.limits.resume_ttl_ms,
        )
        caps.relay_allowed = caps.relay_return = self.registry.relay is not None  # unset unless allowed
        caps.session_rewind = caps.batch_groups = caps.group_steps = True
        caps.model_name = self.model_name
        layout = self.engine.capabilities().kv_layout
        caps.session_handoff, caps.kv_layout = bool(layout), layout
        return caps

    async def _health(self, _: pb.HealthRequest) -> pb.HealthResponse:
        await trio.lowlevel.checkpoint()
        status, detail = self.health_status()
        max_sessions = 0
        if self.engine.health().ready:
            max_sessions = self.engine.capabilities().max_sessions
        return pb.HealthResponse(
            status=status,  # type: ignore[arg-type]
            detail=detail,
            sessions_active=self.registry.n_live,
            sessions_retained=self.registry.n_retained,
            max_sessions=max_sessions,
        )

    def health_status(self) -> tuple[int, str]:
        """Honest health: from the engine's own state and the worker's draining flag."""
        H = pb.HealthResponse
        health = self.engine.health()
        if health.state is EngineState.FAILED:
            return H.STATUS_FAILED, health.detail or "engine failed"
        if health.state is not EngineState.READY:
            return H.STATUS_NOT_READY, health.detail or health.state.value
        if self.registry.draining:
            return H.STATUS_DRAINING, "draining: finishing sessions, refusing new ones"
        # Serving: the detail says which native kernels run (useful in a crash report).
        return H.STATUS_SERVING, self.engine.capabilities().system_info

    async def _cancel(self, req: pb.CancelRequest) -> pb.CancelResponse:
        await trio.lowlevel.checkpoint()
        found, was_running = self.registry.cancel(req.session_id)
        lifecycle.event("cancel", req.session_id, scope="rpc", found=found, was_running=was_running)
        return pb.CancelResponse(found=found, was_running=was_running)

    async def _release(self, req: pb.ReleaseRequest) -> pb.ReleaseResponse:
        released = await self.registry.release(req.session_id)
        lifecycle.event("release", req.session_id, released=released)
        return pb.ReleaseResponse(released=released)

    async def _return(self, req: pb.ReturnRequest) -> pb.ReturnResponse:
        """A routed session's last hop hands over one result (chain relay's direct return)."""
        await trio.lowlevel.checkpoint()
        call = self.registry.live(req.session_id)
        if call is None:  # the same answer as a wrong secret: no oracle of which sessions exist
            raise return_refused(req.session_id)
        accepted = call.offer_return(req.secret, req.relay_tag, req.step)
        # used: a step went on with it; late: the chain's answer had come first
        self.registry.count("direct_returns_used_total" if accepted else "direct_returns_late_total")
        return pb.ReturnResponse(accepted=accepted)

    async def _tokenize(self, req: pb.TokenizeRequest) -> pb.TokenizeResponse:
        """A text's ids (a tokenizer thread, as a Prefill's text), or ids' bytes; at most a
        session's positions either way, so no caller makes the worker hold more."""
        caps = self.engine.capabilities()
        if not caps.is_first:
            raise IllegalTransition("only a first shard tokenizes")
        limit = caps.n_ctx_per_session
        if req.WhichOneof("input") == "tokens":
            ids: tuple[int, ...] = tuple(req.tokens.ids)
        else:
            ids = await self._text_ids(req.text, add_bos=req.add_bos, parse_special=req.parse_special)
        if len(ids) > limit:
            raise InvalidInput(f"{len(ids)} tokens, more than the {limit} positions of a session")
        await trio.lowlevel.checkpoint()
        pieces = ([self.engine.token_piece(t) for t in ids]
                  if req.with_pieces or req.WhichOneof("input") == "tokens" else [])
        return pb.TokenizeResponse(tokens=ids, pieces=pieces)

    async def _text_ids(self, text: str, *, add_bos: bool, parse_special: bool) -> tuple[int, ...]:
        """A text's ids, in a tokenizer thread; a text that cannot fit a session is refused
        before it is tokenized (``text_floor``)."""
        caps = self.engine.capabilities()
        limit = caps.n_ctx_per_session
        if text_floor(caps, text) > limit:
            raise InvalidInput(f"the text takes more than the {limit} positions of a session")
        return await self.engine.tokenize_async(text, add_bos=add_bos, parse_special=parse_special)

    async def _embed(self, req: pb.EmbedRequest) -> pb.EmbedResponse:
        """One pooled embedding per input, computed one after the other (each is one native
        step of the engine's embedding context). The batch is refused whole before any work
        when the worker cannot embed, holds too many inputs, or its answer would not fit a
        message; a bad input fails the call (the front door reports which)."""
        self.engine.check_embeds()
        caps = self.engine.capabilities()
        per_call = embeds_per_call(caps.n_embd, self._transport_limits.max_message_bytes)
        if not req.inputs:
            raise InvalidInput("inputs is empty")
        if len(req.inputs) > per_call:
            raise InvalidInput(f"{len(req.inputs)} inputs; at most {per_call} per call "
                               f"(embeddings of {caps.n_embd} floats in one message)")
        out = pb.EmbedResponse()
        for i, item in enumerate(req.inputs):
            try:
                if item.WhichOneof("input") == "tokens":
                    ids: tuple[int, ...] = tuple(item.tokens.ids)
                elif not item.text:  # (BOS alone would be an embedding of nothing)
                    raise InvalidInput("the text is empty")
                else:
                    ids = await self._text_ids(item.text, add_bos=True, parse_special=True)
                vector = await self.engine.embed(ids, normalize=req.normalize)
            except InvalidInput as exc:  # (ContextExceeded keeps its class, so its reason)
                raise type(exc)(f"input {i}: {exc.message}") from None
            out.embeddings.add(values=vector.tolist(), n_tokens=len(ids))
        return out

    async def _metrics(self, _: pb.GetMetricsRequest) -> pb.GetMetricsResponse:
        await trio.lowlevel.checkpoint()
        return self.metrics.snapshot()

    # ---- the session stream ----------------------------------------------------------------

    async def Session(
        self, input_messages: AsyncIterable[pb.SessionRequest]
    ) -> AsyncIterator[pb.SessionResponse]:
        """Relay one ``SessionCall``'s responses; end it with the transport's end reason.

        No nursery or cancel scope is open across ``yield`` (see ``shard.rpc.session``): the session's work
        runs in the registry's nursery; this generator only forwards messages
        (``Responses.next_response``).
        """
        ctx = current_call()
        watch = lifecycle.StreamWatch(self.metrics, ctx)
        try:
            await self._authenticate(ctx)
            call = await self.registry.start_call(
                _Requests(input_messages, watch.request),
                deadline=ctx.deadline,
                max_message_bytes=self._transport_limits.max_message_bytes,
            )
        except ShardError as err:
            raise self._refuse(err) from None

        stream = _SessionStream(ctx, call, watch)
        finished = False
        try:
            next_response = call.outbox.next_response
            while (message := await next_response()) is not None:
                watch.response(message)
                yield message
            finished = True
        finally:
            stream.close()
            if not finished:
                reason = ctx.end_reason
                call.end(_STREAM_END[reason] if reason is not None else StreamEnd.CONNECTION_LOST)
                _note_end(ctx)
            with trio.CancelScope(shield=True):
                await call.done.wait()  # the session is released or retained by now
            call.responses.close()
            retained = bool(watch.session_id) and self.registry.retained(watch.session_id) is not None
            watch.end(call.error, retained)
            if not finished:
                # The transport ended the call (its deadline timer, a drain, the peer), so the
                # ``_refuse`` below never runs: count the error the call ended with here.
                ended = call.error or _END_ERRORS.get(ctx.end_reason)  # type: ignore[arg-type]
                if ended is not None:
                    self.registry.count_error(ended.code)
        if call.error is not None:
            raise self._refuse(call.error)

    async def GroupSteps(
        self, input_messages: AsyncIterable[pb.GroupStepRequest]
    ) -> AsyncIterator[pb.GroupStepResponse]:
        """(1.3) One answer per request: a batch group's rows run as one tick
        (``session.group``). A request's own faults (its version, a message that does not
        parse) end the stream; a row's are that row's outcome. No nursery is open across
        ``yield``: each request's rows run (and end) before its answer is yielded."""
        ctx = current_call()
        ctx.write_through = True  # (each answer is a whole group's: nothing to coalesce with)
        self.registry.count("rpc_GroupSteps_total")
        requests = _Requests(input_messages)
        limit = self._transport_limits.max_message_bytes
        try:
            await self._authenticate(ctx)
            caller = caller_of(copy_context())  # the Session streams' own check
            while True:
                try:
                    req = await anext(requests)
                except StopAsyncIteration:
                    return
                except DecodeError:
                    raise convert.invalid("a GroupStepRequest could not be parsed") from None
                check_version(req)
                reply = await run_group(self.registry, req, caller, limit)
                yield reply
        except ShardError as err:
            raise self._refuse(err) from None
        except Exception:
            log.exception("GroupSteps failed")
            raise self._refuse(internal_error()) from None
        finally:
            _note_end(ctx)

    def _refuse(self, err: ShardError) -> StatusError:
        self.registry.count_error(err.code)
        if err.code in (ErrorCode.ENGINE_FAILURE, ErrorCode.NOT_READY) and self.on_health_change:
            self.on_health_change()
        return status_error(err)


class _SessionStream:
    """A Session handler's fast paths, both ways (``StreamHandler`` for the transport,
    ``DirectPath`` for the session's responses): a request taken by the session from the
    connection's task, a response framed by the session's task, each observed as the
    handler's own would be."""

    __slots__ = ("_call", "_watch", "_send_now", "_ctx")

    def __init__(self, ctx: CallContext, call: SessionCall, watch: lifecycle.StreamWatch) -> None:
        self._ctx, self._call, self._watch = ctx, call, watch
        self._send_now = ctx.register(self).send_now
        call.send_directly(self)

    def take_now(self, message: pb.SessionRequest) -> bool:
        if self._call.take_request_now(message):
            self._watch.request(message)
            return True
        return False

    def send_now(self, message: pb.SessionResponse, more_follows: bool) -> bool:
        if self._send_now(message, not more_follows):
            self._watch.response(message)
            return True
        return False

    def close(self) -> None:
        """No more requests are taken (the call ends)."""
        self._ctx.unregister()


def _note_end(ctx: CallContext) -> None:
    """When the transport ends the call itself, attach the matching Shard error trailer."""
    if ctx.end_reason in _END_ERRORS and not any(k == ERROR_TRAILER for k, _ in ctx.trailers):
        ctx.trailers.extend(_END_ERRORS[ctx.end_reason].trailers())


__all__ = ["Authorizer", "ShardServicer", "status_error"]
