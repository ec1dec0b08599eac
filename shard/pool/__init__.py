"""A pool of workers behind one endpoint: who is listed (``spec``), which complete routes their
capabilities offer (``table``) and a live pool that probes them and leases a route to each
generation (``pool``). docs/operations.md, "A pool of workers"."""

from .pool import Lease, Member, Pool
from .spec import PoolSpecError, WorkerSource, parse_workers
from .table import ModelRoutes, Shape, Table, build_table, model_id

__all__ = [
    "Lease",
    "Member",
    "ModelRoutes",
    "Pool",
    "PoolSpecError",
    "Shape",
    "Table",
    "WorkerSource",
    "build_table",
    "model_id",
    "parse_workers",
]
