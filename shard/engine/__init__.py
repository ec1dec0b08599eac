"""The project-owned engine contract (see docs/engine.md).

Import the contract from here; implementations live in ``shard.engine.fake`` and
``shard.engine.llama`` (with its ``llama_*`` modules, the only ones allowed to import
``llama_cpp``/``ctypes``; tests/test_import_boundary.py lists them); ``shard.engine.layer_ranges`` decides what a model file serves as a
layer range (from the architecture table, ``shard.models.architectures``).
"""

from .base import ShardEngine
from .plans import ComputePlan
from .sessions import new_session_id
from .slots import CancelFlag, Slot
from .tick_stats import Distribution, TickDistributions
from .errors import (
    ContextExceeded,
    EngineCancelled,
    EngineError,
    EngineFailure,
    IllegalTransition,
    IncompatibleState,
    InvalidGrammar,
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
    EMBEDDING_POOLING,
    GRAMMAR_KINDS,
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
    GrammarSpec,
    LayerRangeSupport,
    LoadSpec,
    LogitsResult,
    Lookahead,
    MtpCapability,
    MtpRequest,
    MtpResult,
    POOLING_TYPES,
    PrefillRequest,
    ResultKind,
    SamplingParams,
    SessionInfo,
    SessionSnapshot,
    SessionState,
    StepResult,
    StreamRequest,
    TokenLogprob,
)

__all__ = [name for name in dir() if not name.startswith("_")]
