"""The project-owned engine contract (see docs/engine.md).

Import the contract from here; implementations live in ``shard.engine.fake`` and
``shard.engine.llama`` (the only module allowed to import ``llama_cpp``/``ctypes``).
"""

from .base import CancelFlag, ComputePlan, ShardEngine, Slot, new_session_id
from .errors import (
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
from shard.layers import LayerRange

from .types import (
    GREEDY,
    AuxState,
    AuxStateCapability,
    AuxStateKind,
    BoundaryResult,
    Capabilities,
    DecodeRequest,
    EngineHealth,
    EngineMetrics,
    EngineState,
    LoadSpec,
    LogitsResult,
    MtpCapability,
    MtpRequest,
    MtpResult,
    PrefillRequest,
    ResultKind,
    SamplingParams,
    SessionInfo,
    SessionState,
    StepResult,
    TokenLogprob,
)

__all__ = [name for name in dir() if not name.startswith("_")]
