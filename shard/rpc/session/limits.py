"""A session stream's bounds (``SessionLimits``), set once per worker by ``serve``."""

from __future__ import annotations

import math
from dataclasses import dataclass


MAX_SESSION_ID_BYTES = 128
LOOKAHEAD_MODES = ("auto", "generate", "off")


@dataclass(frozen=True)
class SessionLimits:
    """Per-stream bounds; test defaults are the production defaults."""

    default_credit: int = 16  # OpenSession.initial_credit == 0
    max_credit: int = 64  # outstanding step messages a client may grant (channel capacity)
    resume_ttl: float = 30.0  # seconds a retained session keeps its KV cache
    close_linger: float = 5.0  # seconds to wait for the client's half-close after CloseSession
    #: Which steps ask the engine to compute the next one ahead (docs/engine.md, "Look-ahead"):
    #: "auto" (Generate, and client steps of a client that decoded the token the worker sampled
    #: last time), "generate" (Generate only) or "off".
    lookahead: str = "auto"

    def __post_init__(self) -> None:
        if not 1 <= self.default_credit <= self.max_credit:
            raise ValueError("need 1 <= default_credit <= max_credit")
        if self.lookahead not in LOOKAHEAD_MODES:
            raise ValueError(f"lookahead must be one of {', '.join(LOOKAHEAD_MODES)}")
        for name in ("resume_ttl", "close_linger"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0")

    @property
    def resume_ttl_ms(self) -> int:
        return int(self.resume_ttl * 1000)
