"""gRPC server reflection (``grpc.reflection.v1`` and ``v1alpha``) served by the purerpc
transport, so ``grpcurl``, Postman and ``grpc_cli`` can list and call the worker's services
without a copy of ``shard.proto``.

Why this shape: grpcio-reflection's ``ReflectionServicer`` already answers every reflection
request (list services, file by name, file containing a symbol, extensions) from a protobuf
descriptor pool, but it is bound to grpcio servers. Here its per-request logic is reused as is
and only the binding is ours: a ``purerpc.Service`` whose bidi handler answers each request in
turn. The descriptors are the generated modules' own (the default pool), so reflection can
never describe a different contract than the one served.

grpcio-reflection ships the messages of ``v1alpha`` only. ``v1`` is the same file under another
package (newer clients try it first), so its descriptor is derived once from ``v1alpha`` by
renaming the package, and its messages are built from that descriptor.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any

import purerpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha
from grpc_reflection.v1alpha.reflection import ReflectionServicer

_V1ALPHA = "grpc.reflection.v1alpha"
_V1 = "grpc.reflection.v1"
_V1_FILE = "grpc/reflection/v1/reflection.proto"
SERVICE_NAMES = (f"{_V1}.ServerReflection", f"{_V1ALPHA}.ServerReflection")


def _v1_messages() -> tuple[type[Any], type[Any]]:
    """(ServerReflectionRequest, ServerReflectionResponse) of ``grpc.reflection.v1``."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
    except KeyError:
        proto = descriptor_pb2.FileDescriptorProto()
        v1alpha.DESCRIPTOR.CopyToProto(proto)
        proto.name, proto.package = _V1_FILE, _V1
        proto.ClearField("options")
        old, new = f".{_V1ALPHA}.", f".{_V1}."
        for message in proto.message_type:
            for field in message.field:
                if field.type_name.startswith(old):  # assigning "" would mark scalars typed
                    field.type_name = field.type_name.replace(old, new)
        for service in proto.service:
            for method in service.method:
                method.input_type = method.input_type.replace(old, new)
                method.output_type = method.output_type.replace(old, new)
        pool.Add(proto)
    return tuple(  # type: ignore[return-value]
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_V1}.{name}"))
        for name in ("ServerReflectionRequest", "ServerReflectionResponse")
    )


class ReflectionService:
    """Reflection for ``service_names`` (plus reflection itself), from the default pool."""

    def __init__(self, service_names: Iterable[str]) -> None:
        self._v1_request, self._v1_response = _v1_messages()
        self.service_names = tuple(sorted({*service_names, *SERVICE_NAMES}))
        pool = descriptor_pool.Default()
        for name in self.service_names:  # fail at start-up, not on a client's first request
            try:
                pool.FindServiceByName(name)
            except KeyError:
                raise ValueError(f"no descriptor for service {name!r}: import its _pb2 module") from None
        self._answers = ReflectionServicer(self.service_names)

    def answer(self, request: v1alpha.ServerReflectionRequest) -> v1alpha.ServerReflectionResponse:
        """The response to one reflection request (grpcio-reflection's own logic)."""
        return next(iter(self._answers.ServerReflectionInfo(iter((request,)), None)))

    async def _info_v1alpha(
        self, requests: AsyncIterable[v1alpha.ServerReflectionRequest]
    ) -> AsyncIterator[v1alpha.ServerReflectionResponse]:
        async for request in requests:
            yield self.answer(request)

    async def _info_v1(self, requests: AsyncIterable[Any]) -> AsyncIterator[Any]:
        async for request in requests:  # the same wire format: re-read as v1alpha and back
            answer = self.answer(v1alpha.ServerReflectionRequest.FromString(request.SerializeToString()))
            yield self._v1_response.FromString(answer.SerializeToString())

    @property
    def services(self) -> tuple[purerpc.Service, ...]:
        """The ``purerpc.Service`` objects to pass to ``Server.add_service``."""
        out = []
        for name, handler, req, resp in (
            (SERVICE_NAMES[0], self._info_v1, self._v1_request, self._v1_response),
            (SERVICE_NAMES[1], self._info_v1alpha, v1alpha.ServerReflectionRequest,
             v1alpha.ServerReflectionResponse),
        ):
            service = purerpc.Service(name)
            service.add_method(
                "ServerReflectionInfo", handler,
                purerpc.RPCSignature(purerpc.Cardinality.STREAM_STREAM, req, resp),
            )
            out.append(service)
        return tuple(out)


__all__ = ["ReflectionService", "SERVICE_NAMES"]
