"""A pool of workers behind one endpoint: who is listed (``spec``), which complete routes their
capabilities offer (``table``), a live pool that probes them and leases a route to each
generation (``pool``): the route that holds its prompt's prefix first (``routing``, ``prefix``).
docs/operations.md, "A pool of workers"."""

from .pool import Member, Pool
from .prefix import PrefixIndex
from .routing import Lease, Router
from .spec import PoolSpecError, WorkerSource, parse_workers
from .table import ModelRoutes, Shape, Table, build_table, model_id

__all__ = [
    "Lease",
    "Member",
    "ModelRoutes",
    "Pool",
    "PoolSpecError",
    "PrefixIndex",
    "Router",
    "Shape",
    "Table",
    "WorkerSource",
    "build_table",
    "model_id",
    "parse_workers",
]
