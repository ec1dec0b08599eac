"""The engine contract's typed errors; they live in the leaf module ``shard.errors`` (so shared
value types can raise them without importing this package) and are re-exported here."""

from shard.errors import (
    EngineCancelled,
    EngineError,
    EngineFailure,
    IllegalTransition,
    InvalidInput,
    KvCacheFull,
    NotReady,
    ResourcesExhausted,
    SessionBusy,
    SessionExists,
    StepTimeout,
    TooManySessions,
    UnknownSession,
    UnsupportedFeature,
)

__all__ = [
    "EngineCancelled",
    "EngineError",
    "EngineFailure",
    "IllegalTransition",
    "InvalidInput",
    "KvCacheFull",
    "NotReady",
    "ResourcesExhausted",
    "SessionBusy",
    "SessionExists",
    "StepTimeout",
    "TooManySessions",
    "UnknownSession",
    "UnsupportedFeature",
]
