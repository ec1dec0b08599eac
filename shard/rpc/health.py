"""Standard ``grpc.health.v1.Health`` (Check, Watch, List) served by the purerpc transport.

Load balancers and ``grpc_health_probe`` speak this protocol, so the worker answers it with the
official messages (``grpc_health.v1.health_pb2``) and a hand-written ``purerpc.Service`` binding
(grpcio-health-checking's own servicer is for grpcio servers only).

The status table is one ``trio_util.AsyncValue`` holding an immutable snapshot
``{service name: ServingStatus}``; ``""`` is the whole server.  Replacing the snapshot on every
``set`` lets each Watch stream wake on change without per-watcher queues: a slow watcher skips
intermediate values but always converges on the latest status (what the health spec asks for).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from types import MappingProxyType

import purerpc
from grpc_health.v1.health_pb2 import (
    HealthCheckRequest,
    HealthCheckResponse,
    HealthListRequest,
    HealthListResponse,
)
from trio_util import AsyncValue

from shard.rpc.transport import StatusError

SERVICE_NAME = "grpc.health.v1.Health"
UNKNOWN = HealthCheckResponse.UNKNOWN
SERVING = HealthCheckResponse.SERVING
NOT_SERVING = HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = HealthCheckResponse.SERVICE_UNKNOWN  # Watch-only: never stored

_NOT_FOUND = 5


class HealthService:
    """Serving status per service; the owner calls ``set``, clients Check / Watch / List.

    Fails closed: the whole server (``""``) starts NOT_SERVING until the owner says otherwise,
    so a probe never sees SERVING before the engine is loaded.
    """

    def __init__(self, initial: Mapping[str, int | bool] | None = None) -> None:
        statuses = {"": NOT_SERVING} if initial is None else dict(initial)
        statuses = {name: _normalize(status) for name, status in statuses.items()}
        self._statuses: AsyncValue[Mapping[str, int]] = AsyncValue(MappingProxyType(statuses))
        self._shut_down = False

    def set(self, service: str, status: int | bool) -> None:
        """Publish ``status`` for ``service`` (``""`` = whole server); ignored after shutdown.

        A bool means serving or not (``True`` -> SERVING, ``False`` -> NOT_SERVING): as an int
        ``False`` would silently be UNKNOWN.
        """
        status = _normalize(status)
        if not self._shut_down:
            self._publish({**self._statuses.value, service: status})

    def get(self, service: str) -> int | None:
        """The current status, or None for a service never set."""
        return self._statuses.value.get(service)

    def shutdown(self) -> None:
        """Report every service NOT_SERVING and ignore later ``set`` calls, so a draining
        server cannot be flipped back to SERVING by a late engine event."""
        self._publish({name: NOT_SERVING for name in self._statuses.value})
        self._shut_down = True

    def _publish(self, statuses: dict[str, int]) -> None:
        self._statuses.value = MappingProxyType(statuses)

    async def check(self, request: HealthCheckRequest) -> HealthCheckResponse:
        status = self._statuses.value.get(request.service)
        if status is None:  # the spec: unknown service -> NOT_FOUND
            raise StatusError(_NOT_FOUND, f"unknown service {request.service!r}")
        return HealthCheckResponse(status=status)

    async def watch(self, request: HealthCheckRequest) -> AsyncIterator[HealthCheckResponse]:
        """The current status, then every change, until the client cancels.

        An unknown service yields SERVICE_UNKNOWN and the call stays open (per the spec); it
        reports the real status once the service is set.
        """
        last = None
        async with aclosing(self._statuses.eventual_values()) as snapshots:
            async for snapshot in snapshots:
                status = snapshot.get(request.service, SERVICE_UNKNOWN)
                if status != last:  # other services changed: nothing to tell this watcher
                    last = status
                    yield HealthCheckResponse(status=status)

    async def list(self, request: HealthListRequest) -> HealthListResponse:
        return HealthListResponse(statuses={
            name: HealthCheckResponse(status=status)
            for name, status in self._statuses.value.items()
        })

    @property
    def service(self) -> purerpc.Service:
        """The ``purerpc.Service`` to pass to ``Server.add_service``."""
        service = purerpc.Service(SERVICE_NAME)
        for name, method, cardinality, request_type, response_type in (
            ("Check", self.check, purerpc.Cardinality.UNARY_UNARY,
             HealthCheckRequest, HealthCheckResponse),
            ("Watch", self.watch, purerpc.Cardinality.UNARY_STREAM,
             HealthCheckRequest, HealthCheckResponse),
            ("List", self.list, purerpc.Cardinality.UNARY_UNARY,
             HealthListRequest, HealthListResponse),
        ):
            service.add_method(
                name, method, purerpc.RPCSignature(cardinality, request_type, response_type))
        return service


def _normalize(status: int | bool) -> int:
    if isinstance(status, bool):
        return SERVING if status else NOT_SERVING
    if status not in (UNKNOWN, SERVING, NOT_SERVING):
        raise ValueError(f"invalid serving status {status!r} (SERVICE_UNKNOWN is Watch-only)")
    return int(status)
