"""grpc.health.v1 served by shard.rpc.health, exercised with grpcio's official HealthStub."""

from __future__ import annotations

import grpc
import pytest
import trio
import trio.testing
from grpc_health.v1 import health_pb2
from grpc_health.v1.health_pb2_grpc import HealthStub

from shard.rpc.health import (
    NOT_SERVING,
    SERVICE_UNKNOWN,
    SERVING,
    HealthService,
)
from shard.rpc.transport import Server

SHARD = "shard.v1.Shard"
Request = health_pb2.HealthCheckRequest


async def start(nursery: trio.Nursery) -> tuple[Server, HealthService, int]:
    health = HealthService()
    server = Server(port=0)
    server.add_service(health.service)
    port = await nursery.start(server.serve)
    return server, health, port


def stub(port: int) -> tuple[grpc.Channel, HealthStub]:
    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
    return ch, HealthStub(ch)


async def test_check_reports_status_and_not_found(nursery: trio.Nursery) -> None:
    _, health, port = await start(nursery)
    health.set(SHARD, SERVING)

    def run() -> tuple[int, int, grpc.StatusCode]:
        ch, health_stub = stub(port)
        with ch:
            whole = health_stub.Check(Request(service=""), timeout=10).status
            shard = health_stub.Check(Request(service=SHARD), timeout=10).status
            with pytest.raises(grpc.RpcError) as info:
                health_stub.Check(Request(service="no.Such"), timeout=10)
            return whole, shard, info.value.code()

    assert await trio.to_thread.run_sync(run) == (NOT_SERVING, SERVING, grpc.StatusCode.NOT_FOUND)


async def test_watch_streams_current_status_then_changes(nursery: trio.Nursery) -> None:
    server, health, port = await start(nursery)
    health.set(SHARD, SERVING)

    def run() -> list[int]:
        ch, health_stub = stub(port)
        with ch:
            responses = health_stub.Watch(Request(service=SHARD), timeout=10)
            seen = [next(responses).status]
            trio.from_thread.run_sync(health.set, "other", SERVING)  # not ours: no message
            trio.from_thread.run_sync(health.set, SHARD, NOT_SERVING)
            seen.append(next(responses).status)
            responses.cancel()
            return seen

    assert await trio.to_thread.run_sync(run) == [SERVING, NOT_SERVING]
    await trio.testing.wait_all_tasks_blocked()
    assert server.open_calls == 0  # the client's cancel ended the Watch handler


async def test_watch_unknown_service_stays_open_until_known(nursery: trio.Nursery) -> None:
    _, health, port = await start(nursery)

    def run() -> list[int]:
        ch, health_stub = stub(port)
        with ch:
            responses = health_stub.Watch(Request(service=SHARD), timeout=10)
            seen = [next(responses).status]
            trio.from_thread.run_sync(health.set, SHARD, SERVING)
            seen.append(next(responses).status)
            responses.cancel()
            return seen

    assert await trio.to_thread.run_sync(run) == [SERVICE_UNKNOWN, SERVING]


async def test_list_returns_every_status(nursery: trio.Nursery) -> None:
    _, health, port = await start(nursery)
    health.set(SHARD, SERVING)

    def run() -> dict[str, int]:
        ch, health_stub = stub(port)
        with ch:
            response = health_stub.List(health_pb2.HealthListRequest(), timeout=10)
            return {name: s.status for name, s in response.statuses.items()}

    assert await trio.to_thread.run_sync(run) == {"": NOT_SERVING, SHARD: SERVING}


def test_set_maps_bools_to_serving_and_not_serving() -> None:
    health = HealthService()
    health.set(SHARD, False)  # not UNKNOWN (0), which is what False would be as an int
    assert health.get(SHARD) == NOT_SERVING
    health.set(SHARD, True)
    assert health.get(SHARD) == SERVING


def test_shutdown_reports_not_serving_and_ignores_later_sets() -> None:
    health = HealthService({"": SERVING, SHARD: SERVING})
    health.shutdown()
    health.set(SHARD, SERVING)
    assert (health.get(""), health.get(SHARD)) == (NOT_SERVING, NOT_SERVING)
    with pytest.raises(ValueError):
        health.set(SHARD, SERVICE_UNKNOWN)
