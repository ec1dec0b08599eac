"""TLS, mutual TLS and the auth hook (DGR-022: TLS/auth hooks, with authentication policy left
to the router): the worker verifies what it is configured to verify and nothing more."""

from __future__ import annotations

import ssl
from collections.abc import Iterator

import grpc
import pytest
import trio
import trustme

from shard.client import ShardClient
from shard.rpc.errors import ErrorCode, ShardError
from shard.rpc.transport import CallContext
from shard.v1 import shard_pb2 as pb

from rpc_harness import V, no_engine_leaks, worker  # noqa: F401 (fixture)

CAPS = "/shard.v1.Shard/GetCapabilities"


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def server_cert(ca: trustme.CA) -> trustme.LeafCert:
    return ca.issue_cert("127.0.0.1", "localhost")


def server_context(server_cert: trustme.LeafCert, client_ca: trustme.CA | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_cert.configure_cert(ctx)
    if client_ca is not None:  # mutual TLS: only clients with a certificate from client_ca
        ctx.verify_mode = ssl.CERT_REQUIRED
        client_ca.configure_trust(ctx)
    return ctx


def grpcio_caps(target: str, creds: grpc.ChannelCredentials, metadata: tuple = ()) -> pb.GetCapabilitiesResponse:
    with grpc.secure_channel(target, creds) as channel:
        call = channel.unary_unary(
            CAPS,
            request_serializer=pb.GetCapabilitiesRequest.SerializeToString,
            response_deserializer=pb.GetCapabilitiesResponse.FromString,
        )
        return call(pb.GetCapabilitiesRequest(version=V), timeout=10, metadata=metadata)


def grpcio_caps_plain(target: str) -> None:
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(
            CAPS,
            request_serializer=pb.GetCapabilitiesRequest.SerializeToString,
            response_deserializer=pb.GetCapabilitiesResponse.FromString,
        )
        call(pb.GetCapabilitiesRequest(version=V), timeout=5)


@pytest.fixture
def pem(ca: trustme.CA) -> Iterator[bytes]:
    yield ca.cert_pem.bytes()


async def test_tls_with_grpcio_and_the_trio_client(
    ca: trustme.CA, server_cert: trustme.LeafCert, pem: bytes
) -> None:
    async with worker(ssl_context=server_context(server_cert)) as w:
        creds = grpc.ssl_channel_credentials(root_certificates=pem)
        reply = await trio.to_thread.run_sync(grpcio_caps, w.target, creds)
        assert reply.engine == "fake"

        client_ctx = ssl.create_default_context()
        ca.configure_trust(client_ctx)
        async with ShardClient.connect(w.target, ssl_context=client_ctx, timeout=10) as client:
            chunks = [c async for c in client.generate_text([1, 3, 4], max_tokens=3)]
            assert len(chunks) == 3

        # A plaintext client cannot talk to a TLS worker, and the worker stays healthy.
        with pytest.raises(grpc.RpcError) as info:
            await trio.to_thread.run_sync(grpcio_caps_plain, w.target)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        reply = await trio.to_thread.run_sync(grpcio_caps, w.target, creds)
        assert reply.engine == "fake"


async def test_mutual_tls_requires_a_client_certificate(
    ca: trustme.CA, server_cert: trustme.LeafCert, pem: bytes
) -> None:
    client_ca = trustme.CA()
    client_cert = client_ca.issue_cert("router.example")
    async with worker(ssl_context=server_context(server_cert, client_ca)) as w:
        without = grpc.ssl_channel_credentials(root_certificates=pem)
        with pytest.raises(grpc.RpcError) as info:
            await trio.to_thread.run_sync(grpcio_caps, w.target, without)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE

        with_cert = grpc.ssl_channel_credentials(
            root_certificates=pem,
            private_key=client_cert.private_key_pem.bytes(),
            certificate_chain=client_cert.cert_chain_pems[0].bytes(),
        )
        reply = await trio.to_thread.run_sync(grpcio_caps, w.target, with_cert)
        assert reply.engine == "fake"


async def test_auth_hook_sees_metadata_and_refuses_with_a_structured_error() -> None:
    seen: list[tuple[str, object]] = []

    async def authorize(ctx: CallContext) -> None:
        seen.append((ctx.method, dict(ctx.metadata).get("authorization")))
        if dict(ctx.metadata).get("authorization") != "Bearer router-token":
            raise ShardError(ErrorCode.UNAUTHENTICATED, "missing or wrong token")

    async with worker(authorize=authorize) as w:
        async with ShardClient.connect(w.target, timeout=10) as client:
            with pytest.raises(ShardError) as info:
                await client.capabilities()
            assert info.value.code is ErrorCode.UNAUTHENTICATED
            assert not info.value.retryable
        good = (("authorization", "Bearer router-token"),)
        async with ShardClient.connect(w.target, timeout=10, metadata=good) as client:
            assert (await client.capabilities()).engine == "fake"
            chunks = [c async for c in client.generate_text([1, 3, 4], max_tokens=2)]
            assert len(chunks) == 2
    assert (CAPS, None) in seen
    assert ("/shard.v1.Shard/Session", "Bearer router-token") in seen
