"""gRPC server reflection, read with grpcio-reflection's own client (what grpcurl relies on)."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import in_thread, worker
from shard.rpc.reflection import ReflectionService
from shard.v1 import shard_pb2 as pb

SHARD = "shard.v1.Shard"


def _reflect(target: str) -> tuple[list[str], descriptor_pb2.FileDescriptorProto, list[str]]:
    with grpc.insecure_channel(target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = list(db.get_services())
        proto = db.FindFileContainingSymbol(SHARD)
        # A client builds the whole contract from reflection alone, as grpcurl does.
        pool = descriptor_pool.DescriptorPool(db)
        shard = pool.FindServiceByName(SHARD)
        methods = [
            f"{m.name}:{'stream' if m.client_streaming else 'unary'}->"
            f"{'stream' if m.server_streaming else 'unary'}"
            for m in shard.methods
        ]
        return services, proto, methods


async def test_grpcio_reflection_client_lists_the_service_and_fetches_its_file() -> None:
    async with worker() as w:
        services, proto, methods = await in_thread(_reflect, w.target)
    assert SHARD in services
    assert "grpc.health.v1.Health" in services
    assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= set(services)
    assert proto.name == pb.DESCRIPTOR.name == "shard/v1/shard.proto"
    assert proto.package == "shard.v1"
    assert proto.SerializeToString() == pb.DESCRIPTOR.serialized_pb  # the generated contract
    assert "Session:stream->stream" in methods
    assert "GetCapabilities:unary->unary" in methods


def _v1_call(target: str, request: reflection_pb2.ServerReflectionRequest) -> reflection_pb2.ServerReflectionResponse:
    """One request to ``grpc.reflection.v1`` (same wire format as v1alpha)."""
    with grpc.insecure_channel(target) as channel:
        call = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        (response,) = list(call(iter([request]), timeout=10))
        return response


async def test_reflection_v1_answers_too() -> None:
    async with worker() as w:
        listed = await in_thread(_v1_call, w.target, reflection_pb2.ServerReflectionRequest(list_services=""))
        by_name = await in_thread(_v1_call, w.target, reflection_pb2.ServerReflectionRequest(
            file_by_filename="shard/v1/shard.proto"))
        missing = await in_thread(_v1_call, w.target, reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="no.such.Service"))
    assert SHARD in [s.name for s in listed.list_services_response.service]
    (blob,) = by_name.file_descriptor_response.file_descriptor_proto
    assert descriptor_pb2.FileDescriptorProto.FromString(blob).service[0].name == "Shard"
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_an_unknown_service_name_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="no.such.Service"):
        ReflectionService(["no.such.Service"])


async def test_reflection_can_be_turned_off() -> None:
    async with worker(reflection=False) as w:

        def run() -> grpc.StatusCode:
            try:
                _reflect(w.target)
            except grpc.RpcError as err:
                return err.code()
            return grpc.StatusCode.OK

        assert await in_thread(run) == grpc.StatusCode.UNIMPLEMENTED
