"""Every error status carries its Shard trailers, the same way on every call kind (issue 14,
item 6).

* An unparsable request message is INVALID_ARGUMENT with ``shard-error-bin`` and
  ``grpc-status-details-bin`` on unary calls too (it was INTERNAL without trailers there, and
  INVALID_ARGUMENT with them on Session streams).
* A call deadline that expires while the handler's own status is being produced (or its
  response is being sent) ends the call DEADLINE_EXCEEDED *with* the trailer: the handler's
  refusal was dropped, and the trailer with it.
"""

from __future__ import annotations

import base64
from typing import Any

import grpc
import trio
from google.protobuf.wrappers_pb2 import StringValue
from h2.settings import SettingCodes

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import V, in_thread, worker
from shard.rpc.errors import ERROR_TRAILER, STATUS_DETAILS_TRAILER, ErrorCode, ShardError
from shard.rpc.transport import Server, StatusError, current_call
from shard.v1 import shard_pb2 as pb
from test_transport import LIMITS, SERVICE, Echo, RawClient, frame
from test_transport_abuse import shard_error_of, until_status


def _trailer_error(exc: grpc.RpcError) -> tuple[ShardError, bool]:
    """The ``shard-error-bin`` trailer grpcio received; whether status details came too."""
    trailers = dict(exc.trailing_metadata() or ())  # type: ignore[attr-defined]
    assert ERROR_TRAILER in trailers, f"no {ERROR_TRAILER} trailer in {exc!r}"
    return (ShardError.from_proto(pb.Error.FromString(trailers[ERROR_TRAILER])),
            STATUS_DETAILS_TRAILER in trailers)


async def test_an_unparsable_request_is_invalid_argument_on_unary_calls_and_sessions() -> None:
    async with worker() as w:
        with grpc.insecure_channel(w.target) as ch:
            codes = {}
            for method in ("GetCapabilities", "Health", "Cancel", "Session"):
                path = f"/shard.v1.Shard/{method}"
                if method == "Session":
                    rpc: Any = ch.stream_stream(path, request_serializer=None,
                                                response_deserializer=None)
                    run = (lambda rpc=rpc: list(rpc(iter([b"\xff\xff\xff"]), timeout=10)))
                else:
                    rpc = ch.unary_unary(path, request_serializer=None, response_deserializer=None)
                    run = (lambda rpc=rpc: rpc(b"\xff\xff\xff", timeout=10))

                def call(run: Any = run) -> grpc.RpcError:
                    try:
                        run()
                    except grpc.RpcError as exc:
                        return exc
                    raise AssertionError("the call succeeded")

                exc = await in_thread(call)
                err, details = _trailer_error(exc)
                codes[method] = (exc.code(), err.code, err.retryable, details)
        expected = (grpc.StatusCode.INVALID_ARGUMENT, ErrorCode.INVALID_ARGUMENT, False, True)
        assert codes == dict.fromkeys(codes, expected), codes
        await w.idle()


async def test_a_unary_call_without_exactly_one_message_is_invalid_argument(
    nursery: trio.Nursery,
) -> None:
    echo = Echo()
    server = Server(port=0, limits=LIMITS)
    server.add_service(echo.service)
    port = await nursery.start(server.serve)
    client = await RawClient.connect(port)
    try:
        for body in (b"", frame("one") + frame("two")):
            sid = await client.request("Unary", body)
            headers = await until_status(client, sid, poke=lambda: None)
            assert headers["grpc-status"] == "3", headers
            assert shard_error_of(headers).code is ErrorCode.INVALID_ARGUMENT
    finally:
        await client.stream.aclose()


class LateRefusal:
    """A handler whose error status is still being produced when the call deadline expires
    (as the Session handler waits, shielded, for its session's cleanup before it raises)."""

    async def unary(self, message: StringValue) -> StringValue:
        deadline = current_call().deadline
        with trio.CancelScope(shield=True):
            await trio.sleep_until(deadline + 0.05)
        raise StatusError(9, "refused", ShardError(ErrorCode.ILLEGAL_TRANSITION, "refused").trailers())

    @property
    def service(self) -> Any:
        import purerpc

        service = purerpc.Service(SERVICE)
        service.add_method("Unary", self.unary, purerpc.RPCSignature(
            purerpc.Cardinality.UNARY_UNARY, StringValue, StringValue))
        return service


async def test_a_deadline_racing_the_handlers_error_status_keeps_the_trailer(
    nursery: trio.Nursery,
) -> None:
    server = Server(port=0, limits=LIMITS)
    server.add_service(LateRefusal().service)
    port = await nursery.start(server.serve)
    client = await RawClient.connect(port)
    try:
        sid = await client.request("Unary", frame("x"), headers=(("grpc-timeout", "200m"),))
        headers = await until_status(client, sid, poke=lambda: None)
        assert headers["grpc-status"] == "4", headers
        err = shard_error_of(headers)
        assert err.code is ErrorCode.DEADLINE_EXCEEDED and err.retryable
        assert STATUS_DETAILS_TRAILER in headers
    finally:
        await client.stream.aclose()


async def test_a_deadline_expiring_while_a_unary_response_is_sent_keeps_the_trailer() -> None:
    """The real worker: GetCapabilities answered to a client that grants 16 bytes of window;
    the deadline passes while the response waits, after the handler had already returned."""
    async with worker() as w:
        host, port = w.target.rsplit(":", 1)
        client = RawClient(await trio.open_tcp_stream(host, int(port)))
        try:
            client.h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 16})
            body = pb.GetCapabilitiesRequest(version=V).SerializeToString()
            sid = await client.request("GetCapabilities", frame(body), service="shard.v1.Shard",
                                       headers=(("grpc-timeout", "300m"),))
            headers = await until_status(client, sid, poke=lambda: None)
            assert headers["grpc-status"] == "4", headers
            assert shard_error_of(headers).code is ErrorCode.DEADLINE_EXCEEDED
            assert STATUS_DETAILS_TRAILER in headers
        finally:
            await client.stream.aclose()


def test_binary_trailers_are_base64_in_raw_h2() -> None:  # the helper the tests above rely on
    err = ShardError(ErrorCode.INTERNAL)
    text = base64.b64encode(err.trailers()[0][1]).decode().rstrip("=")
    assert shard_error_of({ERROR_TRAILER: text}).code is ErrorCode.INTERNAL
