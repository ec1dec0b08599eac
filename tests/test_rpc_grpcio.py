"""The official grpcio client against a live worker (``shard.rpc.server.serve`` on the hardened
transport). grpcio calls block, so they run in threads (``trio.to_thread``) while the server runs
in the test's nursery; every assertion about the worker goes through its state (engine metrics,
session registry, step counters), never through timing."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import trio
import trio.testing
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import (
    MODEL,
    V,
    Requests,
    StepReader,
    Worker,
    assert_no_leaks,
    in_thread,
    req,
    worker,
)
from shard.engine import EngineError, LoadSpec
from shard.engine.fake import FakeEngine, FakeScript
from shard.rpc.errors import ERROR_TRAILER, ErrorCode, ShardError
from shard.rpc import convert
from shard.rpc.convert import cache_expectation
from shard.rpc.server import serve
from shard.rpc.transport import CallContext, TransportLimits
from shard.rpc.versions import SUPPORTED_VERSIONS
from shard.v1 import shard_pb2 as pb

METHOD = "/shard.v1.Shard/"
TOKENS = [1, 72, 101, 108, 108, 111]


class Stub:
    """A grpcio stub for shard.v1.Shard, built from the generated protobuf messages."""

    def __init__(self, channel: grpc.Channel) -> None:
        def unary(name: str, response: Any) -> Callable[..., Any]:
            return channel.unary_unary(
                METHOD + name,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=response.FromString,
            )

        self.GetCapabilities = unary("GetCapabilities", pb.GetCapabilitiesResponse)
        self.Health = unary("Health", pb.HealthResponse)
        self.Cancel = unary("Cancel", pb.CancelResponse)
        self.Release = unary("Release", pb.ReleaseResponse)
        self.GetMetrics = unary("GetMetrics", pb.GetMetricsResponse)
        self.Embed = unary("Embed", pb.EmbedResponse)
        self.Session = channel.stream_stream(
            METHOD + "Session",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.SessionResponse.FromString,
        )


@dataclass
class Live(Worker):
    channel: grpc.Channel
    stub: Stub


@asynccontextmanager
async def live(**kwargs: Any) -> AsyncIterator[Live]:
    async with worker(**kwargs) as w:
        with grpc.insecure_channel(w.target) as channel:
            yield Live(w.engine, w.server, w.gate, w.calls, w._scope, channel, Stub(channel))  # noqa: SLF001


class Responses(StepReader):
    """A grpcio response iterator read from Trio (each ``next`` runs in a thread)."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self._it: Iterator[pb.SessionResponse] = iter(call)

    async def recv(self) -> pb.SessionResponse:
        return await in_thread(next, self._it)

    next = recv
    kind = StepReader.recv_kind

    async def rest(self) -> list[pb.SessionResponse]:
        return await in_thread(list, self._it)


def shard_error(exc: grpc.RpcError) -> ShardError:
    """Decode the ``shard-error-bin`` trailer grpcio received."""
    for key, value in exc.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == ERROR_TRAILER:
            return ShardError.from_proto(pb.Error.FromString(value))
    raise AssertionError(f"no {ERROR_TRAILER} trailer in {exc!r}")


def expect_rpc_error(fn: Callable[[], Any]) -> Callable[[], grpc.RpcError]:
    def run() -> grpc.RpcError:
        try:
            fn()
        except grpc.RpcError as exc:
            return exc
        raise AssertionError("the call succeeded")

    return run


# ---- every RPC ----------------------------------------------------------------------------------


async def test_grpcio_drives_every_rpc() -> None:
    async with live() as w:
        caps = await in_thread(lambda: w.stub.GetCapabilities(pb.GetCapabilitiesRequest(version=V), timeout=10))
        assert caps.engine == "fake" and caps.is_first and caps.is_last
        assert [(v.major, v.minor) for v in caps.supported_versions] == list(SUPPORTED_VERSIONS)
        assert caps.model_fingerprint == w.engine.capabilities().model_fingerprint
        assert caps.max_credit == 64 and caps.resume_ttl_ms == 30_000

        health = await in_thread(lambda: w.stub.Health(pb.HealthRequest(version=V), timeout=10))
        assert health.status == pb.HealthResponse.STATUS_SERVING and health.max_sessions == 4

        reqs = Requests(req(open=pb.OpenSession(session_id="g1")))
        rs = Responses(w.stub.Session(iter(reqs), timeout=10))
        try:
            opened = await rs.kind("opened")
            assert opened.session_id == "g1" and opened.cache.outcome == pb.CacheResult.OUTCOME_NEW

            reqs.put(req(prefill=pb.Prefill(tokens=pb.TokenIds(ids=TOKENS))))
            (step,), err, usage = await rs.until_usage()
            assert err is None and step.n_past == 6 and usage.prompt_tokens == 6

            reqs.put(req(decode=pb.Decode(token=step.logits.token_id)))
            (step,), err, _ = await rs.until_usage()
            assert err is None and step.n_past == 7

            reqs.put(req(generate=pb.Generate(max_tokens=4)))
            steps, err, usage = await rs.until_usage()
            assert err is None and len(steps) == 4 and usage.generated_tokens == 4
            assert steps[-1].finish_reason == pb.FINISH_REASON_LENGTH

            found = await in_thread(lambda: w.stub.Cancel(pb.CancelRequest(version=V, session_id="g1"), timeout=10))
            assert found.found and not found.was_running
            metrics = await in_thread(lambda: w.stub.GetMetrics(pb.GetMetricsRequest(version=V), timeout=10))
            assert metrics.engine["sessions_active"] == 1 and metrics.worker["sessions_open"] == 1
            assert metrics.engine["steps_total"] == 6 and metrics.worker["steps_sent_total"] == 6

            reqs.put(req(close=pb.CloseSession(retain=False)))
            closed = await rs.kind("closed")
            assert closed.reason == pb.SessionClosed.REASON_CLIENT_CLOSE and not closed.kv_retained
        finally:
            reqs.end()
        assert await rs.rest() == []
        assert rs.call.code() == grpc.StatusCode.OK
        released = await in_thread(lambda: w.stub.Release(pb.ReleaseRequest(version=V, session_id="g1"), timeout=10))
        assert not released.released  # already freed by CloseSession
        await w.idle()
        assert w.engine.sessions() == ()


async def test_grpcio_embeds_on_a_pooling_model_and_reads_the_refusal_of_another() -> None:
    pooled = FakeEngine(dataclasses.replace(MODEL, pooling_type="mean"))
    async with live(engine=pooled) as w:
        request = pb.EmbedRequest(version=V, normalize=True, inputs=[
            pb.EmbedInput(text="hi"), pb.EmbedInput(tokens=pb.TokenIds(ids=TOKENS))])
        got = await in_thread(lambda: w.stub.Embed(request, timeout=10))
        assert [e.n_tokens for e in got.embeddings] == [3, len(TOKENS)]
        assert got.embeddings[1].values == pytest.approx(list(await pooled.embed(TOKENS)), abs=1e-7)
    async with live() as w:  # a text model: UNIMPLEMENTED with the Shard error trailer
        exc = await in_thread(expect_rpc_error(lambda: w.stub.Embed(request, timeout=10)))
        assert exc.code() == grpc.StatusCode.UNIMPLEMENTED
        assert shard_error(exc).code == ErrorCode.UNSUPPORTED_FEATURE


async def test_grpcio_half_close_retains_and_a_new_stream_resumes() -> None:
    async with live() as w:
        first = [req(open=pb.OpenSession(session_id="r1")),
                 req(generate=pb.Generate(tokens=pb.TokenIds(ids=TOKENS), max_tokens=3))]
        msgs = await in_thread(lambda: list(w.stub.Session(iter(first), timeout=10)))
        closed = msgs[-1].closed
        assert closed.reason == pb.SessionClosed.REASON_CLIENT_HALF_CLOSE and closed.kv_retained
        held = list(w.engine.session_info("r1").tokens)
        assert len(held) == 6 + 2  # the prompt and every generated token but the last

        second = [req(open=pb.OpenSession(session_id="r1", cache=cache_expectation(held))),
                  req(close=pb.CloseSession(retain=False))]
        msgs = await in_thread(lambda: list(w.stub.Session(iter(second), timeout=10)))
        assert msgs[0].opened.cache.outcome == pb.CacheResult.OUTCOME_HIT
        assert msgs[0].opened.cache.tokens_held == 8
        assert w.engine.sessions() == ()


async def test_grpcio_requests_that_arrive_together_keep_their_order() -> None:
    """The connection's reader starts a step itself while the stream's reader waits with nothing
    queued (``CallContext.take_now``); a message it cannot take goes to that reader, and every
    later one follows it there. So a Decode sent right behind a CloseSession is refused as a
    step after the close (it never runs), and one right behind a running step is refused as an
    interleaved step, exactly as when each was read by the stream's own task."""
    async with live(latency=0.05) as w:  # a step runs long enough for a request to come in
        reqs = Requests(req(open=pb.OpenSession(session_id="o1")),
                        req(prefill=pb.Prefill(tokens=pb.TokenIds(ids=TOKENS))))
        rs = Responses(w.stub.Session(iter(reqs), timeout=10))
        try:
            await rs.kind("opened")
            (step,), err, _ = await rs.until_usage()
            assert err is None
            reqs.put(req(close=pb.CloseSession(retain=False)))
            reqs.put(req(decode=pb.Decode(token=step.logits.token_id)))
            exc = await in_thread(expect_rpc_error(lambda: list(rs._it)))  # noqa: SLF001
        finally:
            reqs.end()
        assert shard_error(exc).code is ErrorCode.ILLEGAL_TRANSITION
        assert "after CloseSession" in shard_error(exc).message
        assert w.engine.metrics().steps_total == 1  # the prefill only
        await w.idle()
        assert w.engine.sessions() == ()

        reqs = Requests(req(open=pb.OpenSession(session_id="o2")),
                        req(prefill=pb.Prefill(tokens=pb.TokenIds(ids=TOKENS))),
                        req(decode=pb.Decode(token=1)))
        exc = await in_thread(expect_rpc_error(lambda: list(w.stub.Session(iter(reqs), timeout=10))))
        assert shard_error(exc).code is ErrorCode.ILLEGAL_TRANSITION
        await w.idle()
        assert w.engine.sessions() == ()


# ---- deadlines and cancellation ------------------------------------------------------------------


async def test_grpcio_timeout_ends_in_deadline_exceeded_and_releases_within_one_step() -> None:
    async with live(latency=0.005) as w:
        calls: list[Any] = []

        def run() -> grpc.RpcError:
            reqs = [req(open=pb.OpenSession(session_id="dl")),
                    req(generate=pb.Generate(tokens=pb.TokenIds(ids=[1]), max_tokens=100_000, ignore_eos=True))]
            call = w.stub.Session(iter(reqs), timeout=0.5)  # half-closed: no credit needed
            calls.append(call)
            return expect_rpc_error(lambda: list(call))()

        exc = await in_thread(run)
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await w.idle()
        # Released (not retained) and the engine stopped within one decode step of the end.
        assert w.engine.sessions() == () and w.server.registry.n_retained == 0
        assert w.gate.steps >= 2  # the prompt and at least one generated token: it was running
        # grpcio's own deadline may fire first (it then resets the stream): either way released.
        assert w.calls[-1].error is None or w.calls[-1].error.code is ErrorCode.DEADLINE_EXCEEDED
        assert w.gate.after(w.last_end()) <= 1


async def test_grpcio_cancel_mid_stream_releases_the_session() -> None:
    async with live(latency=0.002) as w:
        reqs = Requests(req(open=pb.OpenSession(session_id="c1", initial_credit=64)),
                        req(generate=pb.Generate(tokens=pb.TokenIds(ids=[1]), max_tokens=100_000, ignore_eos=True)))
        rs = Responses(w.stub.Session(iter(reqs), timeout=10))
        try:
            await rs.kind("opened")
            for _ in range(5):
                await rs.kind("step")
            assert w.call("c1") is not None
            rs.call.cancel()
            await w.idle()
        finally:
            reqs.end()
        assert rs.call.code() == grpc.StatusCode.CANCELLED
        assert w.engine.sessions() == () and w.server.registry.n_retained == 0  # released, not kept
        assert w.gate.after(w.last_end()) <= 1


async def test_grpcio_slow_reader_parks_generation() -> None:
    async with live() as w:
        reqs = Requests(req(open=pb.OpenSession(session_id="slow", initial_credit=4)),
                        req(generate=pb.Generate(tokens=pb.TokenIds(ids=[1]), max_tokens=1000, ignore_eos=True)))
        rs = Responses(w.stub.Session(iter(reqs), timeout=10))
        try:
            await rs.kind("opened")
            call = w.call("slow")
            with trio.fail_after(10):
                await call.parked.wait_value(True)
            # Credit exhausted: the generate loop waits *before* computing; nothing piles up.
            assert w.engine.metrics().steps_total == 4
            assert call.buffered() <= 4 and call.credit.value == 0
            for _ in range(4):
                await rs.kind("step")
            assert w.engine.metrics().steps_total == 4 and call.parked.value
            reqs.put(req(credit=pb.Credit(messages=2)))
            for _ in range(2):
                await rs.kind("step")
            with trio.fail_after(10):
                await call.parked.wait_value(True)
            assert w.engine.metrics().steps_total == 6 and call.buffered() == 0
            rs.call.cancel()
            await w.idle()
        finally:
            reqs.end()
        assert w.engine.sessions() == ()


# ---- errors on the wire ----------------------------------------------------------------------------


async def test_unknown_method_is_unimplemented() -> None:
    async with live() as w:
        for path in ("/shard.v1.Shard/Nope", "/no.such.Service/Call"):
            method = w.channel.unary_unary(path, request_serializer=None, response_deserializer=None)
            exc = await in_thread(expect_rpc_error(lambda: method(b"", timeout=10)))
            assert exc.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_unsupported_version_is_refused_with_the_error_trailer() -> None:
    async with live() as w:
        for version in (pb.ProtocolVersion(major=2), pb.ProtocolVersion(major=1, minor=4), None):
            request = pb.GetCapabilitiesRequest(version=version)
            exc = await in_thread(expect_rpc_error(lambda: w.stub.GetCapabilities(request, timeout=10)))
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
            err = shard_error(exc)
            assert err.code is ErrorCode.UNSUPPORTED_VERSION and err.supported_versions == SUPPORTED_VERSIONS
        bad = [pb.SessionRequest(version=pb.ProtocolVersion(major=9), open=pb.OpenSession(session_id="v"))]
        exc = await in_thread(expect_rpc_error(lambda: list(w.stub.Session(iter(bad), timeout=10))))
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert shard_error(exc).code is ErrorCode.UNSUPPORTED_VERSION
        assert w.engine.metrics().sessions_opened_total == 0


async def test_malformed_session_transitions_over_the_wire() -> None:
    async with live() as w:
        cases = {
            "decode-before-open": [req(decode=pb.Decode(token=3))],
            "second-open": [req(open=pb.OpenSession(session_id="m")), req(open=pb.OpenSession(session_id="m2"))],
        }
        for name, reqs in cases.items():
            exc = await in_thread(expect_rpc_error(lambda: list(w.stub.Session(iter(reqs), timeout=10))))
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, name
            assert shard_error(exc).code is ErrorCode.ILLEGAL_TRANSITION, name
        mismatch = [req(open=pb.OpenSession(session_id="m", expected_layer_range=pb.LayerRange(start=1, end=4)))]
        exc = await in_thread(expect_rpc_error(lambda: list(w.stub.Session(iter(mismatch), timeout=10))))
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert shard_error(exc).code is ErrorCode.INCOMPATIBLE_MODEL
        await w.idle()
        assert w.engine.sessions() == ()


async def test_step_while_running_and_after_close_fail_closed_without_touching_other_sessions() -> None:
    async with live() as w:
        other_reqs = Requests(req(open=pb.OpenSession(session_id="other")),
                              req(prefill=pb.Prefill(tokens=pb.TokenIds(ids=TOKENS))))
        other = Responses(w.stub.Session(iter(other_reqs), timeout=30))
        try:
            await other.kind("opened")
            await other.until_usage()

            # A prefill while a generate runs (parked on credit: still RUNNING).
            reqs = Requests(req(open=pb.OpenSession(session_id="busy", initial_credit=1)),
                            req(generate=pb.Generate(tokens=pb.TokenIds(ids=[1]), max_tokens=50)))
            rs = Responses(w.stub.Session(iter(reqs), timeout=30))
            await rs.kind("opened")
            call = w.call("busy")
            assert call is not None
            with trio.fail_after(10):
                await call.parked.wait_value(True)
            reqs.put(req(prefill=pb.Prefill(tokens=pb.TokenIds(ids=[2]))))
            reqs.end()
            exc = await in_thread(expect_rpc_error(lambda: list(rs.call)))
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
            err = shard_error(exc)
            assert err.code is ErrorCode.ILLEGAL_TRANSITION and err.session_id == "busy"
            assert "while a step is running" in err.message

            # Anything after CloseSession.
            after_close = [req(open=pb.OpenSession(session_id="done")),
                           req(close=pb.CloseSession(retain=True)), req(decode=pb.Decode(token=3))]
            exc = await in_thread(expect_rpc_error(lambda: list(w.stub.Session(iter(after_close), timeout=30))))
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert shard_error(exc).code is ErrorCode.ILLEGAL_TRANSITION
            assert w.server.registry.retained("done") is not None  # closed before the error

            # A hidden state of the wrong shape is step-level: reported in-stream.
            bad = pb.Tensor(data=b"\0" * 12, shape=[1, 3], dtype="float32")
            other_reqs.put(req(decode=pb.Decode(hidden_state=bad)))
            _, err_msg, _ = await other.until_usage()
            assert err_msg is not None and err_msg.code == pb.ERROR_CODE_INVALID_ARGUMENT

            # The other session never noticed any of it.
            assert w.call("busy") is None and w.call("other") is not None
            other_reqs.put(req(decode=pb.Decode(token=7)))
            (step,), err_msg, _ = await other.until_usage()
            assert err_msg is None and step.n_past == len(TOKENS) + 1
            other_reqs.put(req(close=pb.CloseSession()))
            await other.kind("closed")
        finally:
            other_reqs.end()
        assert await other.rest() == []
        released = await in_thread(lambda: w.stub.Release(pb.ReleaseRequest(version=V, session_id="done"), timeout=10))
        assert released.released
        await w.idle()
        assert w.engine.sessions() == ()


async def test_oversized_or_unparsable_session_messages_fail_that_stream_with_the_trailer() -> None:
    async with live(transport_limits=TransportLimits(max_message_bytes=4096)) as w:
        raw = w.channel.stream_stream(METHOD + "Session", request_serializer=None, response_deserializer=None)
        big = req(prefill=pb.Prefill(tokens=pb.TokenIds(ids=[5] * 5000))).SerializeToString()
        cases = {
            "oversized": (big, grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorCode.RESOURCE_EXHAUSTED),
            "unparsable": (b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT, ErrorCode.INVALID_ARGUMENT),
        }
        for name, (second, status, code) in cases.items():
            opened = req(open=pb.OpenSession(session_id=name)).SerializeToString()
            exc = await in_thread(expect_rpc_error(lambda: list(raw(iter([opened, second]), timeout=10))))
            assert exc.code() == status, name
            assert shard_error(exc).code is code and shard_error(exc).session_id == name, name
        await w.idle()
        assert w.engine.sessions() == () and w.server.registry.n_retained == 0


async def test_internal_errors_never_leak_internals(monkeypatch: pytest.MonkeyPatch) -> None:
    async with live() as w:
        def boom(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("secret-internal-detail")

        monkeypatch.setattr(w.engine, "capabilities", boom)
        exc = await in_thread(expect_rpc_error(
            lambda: w.stub.GetCapabilities(pb.GetCapabilitiesRequest(version=V), timeout=10)))
        assert exc.code() == grpc.StatusCode.INTERNAL and exc.details() == "internal error"
        assert shard_error(exc).code is ErrorCode.INTERNAL
        monkeypatch.undo()

        monkeypatch.setattr(convert, "step_to_proto", boom)
        reqs = [req(open=pb.OpenSession(session_id="i")), req(prefill=pb.Prefill(tokens=pb.TokenIds(ids=[1])))]
        exc = await in_thread(expect_rpc_error(lambda: list(w.stub.Session(iter(reqs), timeout=10))))
        assert exc.code() == grpc.StatusCode.INTERNAL
        text = f"{exc.details()} {exc.trailing_metadata()}"
        assert "secret" not in text and "Traceback" not in text and "RuntimeError" not in text
        await w.idle()
        assert w.engine.sessions() == ()


async def test_engine_fault_fails_closed_and_health_turns_failed() -> None:
    def boom(step: Any) -> None:
        if step.index == 2:
            raise RuntimeError("secret-engine-detail")

    engine = FakeEngine(model=MODEL, script=FakeScript(on_step=boom))
    async with live(engine=engine) as w:
        reqs = [req(open=pb.OpenSession(session_id="f")),
                req(generate=pb.Generate(tokens=pb.TokenIds(ids=[1]), max_tokens=5))]
        exc = await in_thread(expect_rpc_error(lambda: list(w.stub.Session(iter(reqs), timeout=10))))
        assert exc.code() == grpc.StatusCode.UNAVAILABLE
        err = shard_error(exc)
        assert err.code is ErrorCode.ENGINE_FAILURE and "secret" not in err.message
        health = await in_thread(lambda: w.stub.Health(pb.HealthRequest(version=V), timeout=10))
        assert health.status == pb.HealthResponse.STATUS_FAILED
        check = w.channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        await trio.testing.wait_all_tasks_blocked()
        reply = await in_thread(lambda: check(health_pb2.HealthCheckRequest(service=""), timeout=10))
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_custom_metadata_reaches_the_auth_hook_and_refusals_carry_the_trailer() -> None:
    seen: list[tuple[tuple[str, str | bytes], ...]] = []

    async def authorize(ctx: CallContext) -> None:
        seen.append(ctx.metadata)
        if ("authorization", "Bearer good") not in ctx.metadata:
            raise ShardError(ErrorCode.UNAUTHENTICATED, "a bearer token is required")

    async with live(authorize=authorize) as w:
        ok = await in_thread(lambda: w.stub.Health(
            pb.HealthRequest(version=V), timeout=10,
            metadata=[("authorization", "Bearer good"), ("x-router-bin", b"\x00\x01")]))
        assert ok.status == pb.HealthResponse.STATUS_SERVING
        assert ("x-router-bin", b"\x00\x01") in seen[-1]
        exc = await in_thread(expect_rpc_error(
            lambda: w.stub.Health(pb.HealthRequest(version=V), timeout=10, metadata=[("authorization", "Bearer bad")])))
        assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
        err = shard_error(exc)
        assert err.code is ErrorCode.UNAUTHENTICATED and not err.retryable
        reqs = [req(open=pb.OpenSession(session_id="a"))]
        exc = await in_thread(expect_rpc_error(lambda: list(w.stub.Session(iter(reqs), timeout=10))))
        assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
        assert w.engine.metrics().sessions_opened_total == 0

        # A session stream carries the metadata too, and its (OK) trailers are readable.
        reqs = [req(open=pb.OpenSession(session_id="a")), req(close=pb.CloseSession())]
        call = w.stub.Session(iter(reqs), timeout=10,
                              metadata=[("authorization", "Bearer good"), ("x-router-bin", b"\xff")])
        msgs = await in_thread(lambda: list(call))
        assert [m.WhichOneof("kind") for m in msgs] == ["opened", "closed"]
        assert call.code() == grpc.StatusCode.OK and call.trailing_metadata() is not None
        assert ("x-router-bin", b"\xff") in seen[-1]


async def test_grpc_health_v1_follows_engine_and_draining() -> None:
    async with live() as w:
        check = w.channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        for service in ("", "shard.v1.Shard"):
            reply = await in_thread(lambda: check(health_pb2.HealthCheckRequest(service=service), timeout=10))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        w.server.drain()
        await trio.testing.wait_all_tasks_blocked()
        # Draining closed the listener and sent GOAWAY: new calls fail over at once (no wait
        # for the deadline); health is NOT_SERVING / DRAINING for those still watching.
        assert w.server.health.get("") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert w.server.servicer.health_status()[0] == pb.HealthResponse.STATUS_DRAINING
        reqs = [req(open=pb.OpenSession(session_id="late"))]
        exc = await in_thread(expect_rpc_error(lambda: list(w.stub.Session(iter(reqs), timeout=10))))
        assert exc.code() == grpc.StatusCode.UNAVAILABLE


async def test_serve_loads_after_binding_and_reports_not_ready_meanwhile() -> None:
    gate = trio.Event()

    async with FakeEngine(model=MODEL, script=FakeScript()) as engine:
        real_load = engine._impl_load  # noqa: SLF001 - hold the load until the test looked

        async def slow_load(spec: LoadSpec) -> Any:
            await gate.wait()
            return await real_load(spec)

        engine._impl_load = slow_load  # type: ignore[method-assign]  # noqa: SLF001
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                lambda task_status: serve(engine, load=LoadSpec(n_ctx=256, max_sessions=2), task_status=task_status))
            with grpc.insecure_channel(server.target) as channel:
                stub = Stub(channel)
                health = await in_thread(lambda: stub.Health(pb.HealthRequest(version=V), timeout=10))
                assert health.status == pb.HealthResponse.STATUS_NOT_READY
                exc = await in_thread(expect_rpc_error(
                    lambda: stub.GetCapabilities(pb.GetCapabilitiesRequest(version=V), timeout=10)))
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
                assert shard_error(exc).code is ErrorCode.NOT_READY
                gate.set()
                with trio.fail_after(10):
                    while not engine.health().ready:
                        await trio.sleep(0.01)
                health = await in_thread(lambda: stub.Health(pb.HealthRequest(version=V), timeout=10))
                assert health.status == pb.HealthResponse.STATUS_SERVING
            nursery.cancel_scope.cancel()
        assert_no_leaks(engine)



async def test_serve_raises_plain_exceptions_for_a_busy_port_and_a_failed_load() -> None:
    async with worker() as w:
        with pytest.raises(OSError):  # not an ExceptionGroup: the CLI reports it as is
            await serve(w.engine, port=w.server.port)
    async with FakeEngine(model=MODEL, script=FakeScript(fail_on_load=True)) as engine:
        with pytest.raises(EngineError):
            await serve(engine, load=LoadSpec())  # binds, starts loading, fails, stops
        assert engine.health().state.value == "failed"


async def test_graceful_stop_lets_a_running_generate_finish_and_refuses_new_sessions() -> None:
    async with live() as w:
        w.gate.hold()  # the generate below cannot finish until the gate opens
        reqs = Requests(req(open=pb.OpenSession(session_id="g", initial_credit=64)),
                        req(generate=pb.Generate(tokens=pb.TokenIds(ids=[1]), max_tokens=6,
                                                 ignore_eos=True)))
        rs = Responses(w.stub.Session(iter(reqs), timeout=10))
        try:
            await rs.kind("opened")
            async with trio.open_nursery() as nursery:
                drained: list[bool] = []
                nursery.start_soon(lambda: _append(drained, w.server.drain_for(30)))
                await trio.testing.wait_all_tasks_blocked()
                late = [req(open=pb.OpenSession(session_id="late"))]
                exc = await in_thread(expect_rpc_error(lambda: list(w.stub.Session(iter(late), timeout=10))))
                assert exc.code() == grpc.StatusCode.UNAVAILABLE  # GOAWAY, listener closed
                assert not drained  # still waiting for the running generate
                w.gate.release()
                steps, error, _ = await rs.until_usage()
                assert error is None and len(steps) == 6  # the generate finished in full
                reqs.put(req(close=pb.CloseSession()))
                await rs.kind("closed")
                reqs.end()  # half-close: the stream is done, the drain can complete
            assert drained == [True]
        finally:
            reqs.end()
        assert w.engine.sessions() == ()


async def test_graceful_stop_gives_up_after_the_grace_period() -> None:
    async with live() as w:
        w.gate.hold()
        reqs = Requests(req(open=pb.OpenSession(session_id="stuck")),
                        req(generate=pb.Generate(tokens=pb.TokenIds(ids=[1]), max_tokens=6)))
        rs = Responses(w.stub.Session(iter(reqs), timeout=10))
        try:
            await rs.kind("opened")
            assert await w.server.drain_for(0.01) is False  # the step is still held
            w.stop()  # what the CLI does next: cancel serve; the session is released
            w.gate.release()  # a held fake step is shielded like a native one: let it end
            await w.idle()
            assert w.gate.after(w.last_end()) <= 1  # stopped within one step
        finally:
            w.gate.release()
            reqs.end()
        assert w.engine.sessions() == () and w.server.registry.n_retained == 0


async def _append(box: list[Any], awaitable: Any) -> None:
    box.append(await awaitable)


def error_info(exc: grpc.RpcError) -> tuple[int, error_details_pb2.ErrorInfo]:
    """gRPC's richer error model, read as any grpcio client would: the google.rpc.Status in
    ``grpc-status-details-bin`` and its ErrorInfo detail."""
    for key, value in exc.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            info = error_details_pb2.ErrorInfo()
            assert len(status.details) == 1 and status.details[0].Unpack(info)
            assert status.code == exc.code().value[0] and status.message == exc.details()
            return status.code, info
    raise AssertionError(f"no grpc-status-details-bin trailer in {exc!r}")


async def test_grpcio_reads_the_error_info_from_grpc_status_details_bin() -> None:
    async with live() as w:
        request = pb.GetCapabilitiesRequest(version=pb.ProtocolVersion(major=2))
        exc = await in_thread(expect_rpc_error(lambda: w.stub.GetCapabilities(request, timeout=10)))
        code, info = error_info(exc)
        assert code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert (info.reason, info.domain) == ("UNSUPPORTED_VERSION", "shard.v1")
        assert info.metadata["retryable"] == "false"
        assert shard_error(exc).code is ErrorCode.UNSUPPORTED_VERSION  # the old trailer stays

        # On a session stream too, with the session id.
        first = Requests(req(open=pb.OpenSession(session_id="dup")))
        held = Responses(w.stub.Session(iter(first), timeout=10))
        await held.kind("opened")
        dup = [req(open=pb.OpenSession(session_id="dup"))]
        exc = await in_thread(expect_rpc_error(lambda: list(w.stub.Session(iter(dup), timeout=10))))
        code, info = error_info(exc)
        assert code == grpc.StatusCode.ALREADY_EXISTS.value[0]
        assert info.reason == "SESSION_EXISTS" and info.metadata["session_id"] == "dup"
        first.put(req(close=pb.CloseSession()))
        first.end()
        await held.rest()
        await w.idle()


async def test_oversized_session_request_is_not_retryable() -> None:
    async with live(transport_limits=TransportLimits(max_message_bytes=1024)) as w:
        big = [req(open=pb.OpenSession(session_id="big")), req(prefill=pb.Prefill(tokens=pb.TokenIds(ids=[5] * 2000)))]
        exc = await in_thread(expect_rpc_error(lambda: list(w.stub.Session(iter(big), timeout=10))))
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        _, info = error_info(exc)
        assert info.reason == "RESOURCE_EXHAUSTED" and info.metadata["retryable"] == "false"
        assert not shard_error(exc).retryable
        await w.idle()


async def test_oversized_unary_request_carries_a_non_retryable_error() -> None:
    async with live(transport_limits=TransportLimits(max_message_bytes=1024)) as w:
        request = pb.CancelRequest(version=V, session_id="x" * 4000)
        exc = await in_thread(expect_rpc_error(lambda: w.stub.Cancel(request, timeout=10)))
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        err = shard_error(exc)
        assert err.code is ErrorCode.RESOURCE_EXHAUSTED and not err.retryable
        assert err.reason == "MESSAGE_TOO_LARGE"
        assert error_info(exc)[1].metadata["retryable"] == "false"
