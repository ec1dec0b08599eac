"""The engine's own state as its callers see it: lifecycle state, health detail and counters.

Why an object of its own: health and metrics are read by every layer above the engine (the
server's Health and GetMetrics, the pool's checks) and must stay honest whatever an
implementation does; one owner keeps the rules (first failure wins, counters only grow).
"""

from __future__ import annotations

from .errors import EngineError, EngineFailure, NotReady
from .types import EngineHealth, EngineMetrics, EngineState


class EngineStatus:
    """Lifecycle state (CREATED -> LOADING -> READY -> FAILED/CLOSED), the detail health
    reports with it, and the counters since load.

    ``counters`` holds every ``*_total`` field of ``EngineMetrics``; the engine, its
    implementation and its scheduler add to them directly (a dict: no call per step).
    """

    __slots__ = ("state", "detail", "counters")

    def __init__(self) -> None:
        self.state = EngineState.CREATED
        self.detail = "not loaded"
        self.counters: dict[str, int] = {
            name: 0 for name in EngineMetrics.__dataclass_fields__ if name.endswith("_total")
        }

    def fail(self, detail: str) -> bool:
        """Turn FAILED unless the engine is not (or no longer) live; returns whether it did
        (the first failure wins, and a closed engine stays closed)."""
        if self.state not in (EngineState.LOADING, EngineState.READY):
            return False
        self.state, self.detail = EngineState.FAILED, detail
        return True

    def not_ready(self) -> EngineError:
        """The error for work asked of an engine that is not READY."""
        if self.state is EngineState.FAILED:
            return EngineFailure(f"engine failed: {self.detail}")
        return NotReady(f"engine is {self.state.value}")

    def health(self) -> EngineHealth:
        return EngineHealth(state=self.state, detail=self.detail)

    def metrics(self, *, sessions: int, running: int, kv_cells: int, lookahead_cells: int,
                cache_entries: int = 0, cache_tokens: int = 0) -> EngineMetrics:
        """The counters with the gauges the engine reads now."""
        return EngineMetrics(
            sessions_active=sessions,
            kv_cells_used=kv_cells,
            lookahead_cells=lookahead_cells,
            operations_running=running,
            prefix_cache_entries=cache_entries,
            prefix_cache_tokens=cache_tokens,
            **self.counters,
        )
