from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_ARGUMENT: _ClassVar[ErrorCode]
    ERROR_CODE_UNSUPPORTED_VERSION: _ClassVar[ErrorCode]
    ERROR_CODE_INCOMPATIBLE_MODEL: _ClassVar[ErrorCode]
    ERROR_CODE_ILLEGAL_TRANSITION: _ClassVar[ErrorCode]
    ERROR_CODE_SESSION_NOT_FOUND: _ClassVar[ErrorCode]
    ERROR_CODE_SESSION_EXISTS: _ClassVar[ErrorCode]
    ERROR_CODE_RESOURCE_EXHAUSTED: _ClassVar[ErrorCode]
    ERROR_CODE_DEADLINE_EXCEEDED: _ClassVar[ErrorCode]
    ERROR_CODE_CANCELLED: _ClassVar[ErrorCode]
    ERROR_CODE_UNAUTHENTICATED: _ClassVar[ErrorCode]
    ERROR_CODE_PERMISSION_DENIED: _ClassVar[ErrorCode]
    ERROR_CODE_ENGINE_FAILURE: _ClassVar[ErrorCode]
    ERROR_CODE_NOT_READY: _ClassVar[ErrorCode]
    ERROR_CODE_DRAINING: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_UNSUPPORTED_FEATURE: _ClassVar[ErrorCode]
    ERROR_CODE_SESSION_BUSY: _ClassVar[ErrorCode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_EOG: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT_FULL: _ClassVar[FinishReason]
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_INVALID_ARGUMENT: ErrorCode
ERROR_CODE_UNSUPPORTED_VERSION: ErrorCode
ERROR_CODE_INCOMPATIBLE_MODEL: ErrorCode
ERROR_CODE_ILLEGAL_TRANSITION: ErrorCode
ERROR_CODE_SESSION_NOT_FOUND: ErrorCode
ERROR_CODE_SESSION_EXISTS: ErrorCode
ERROR_CODE_RESOURCE_EXHAUSTED: ErrorCode
ERROR_CODE_DEADLINE_EXCEEDED: ErrorCode
ERROR_CODE_CANCELLED: ErrorCode
ERROR_CODE_UNAUTHENTICATED: ErrorCode
ERROR_CODE_PERMISSION_DENIED: ErrorCode
ERROR_CODE_ENGINE_FAILURE: ErrorCode
ERROR_CODE_NOT_READY: ErrorCode
ERROR_CODE_DRAINING: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_UNSUPPORTED_FEATURE: ErrorCode
ERROR_CODE_SESSION_BUSY: ErrorCode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_EOG: FinishReason
FINISH_REASON_CONTEXT_FULL: FinishReason

class ProtocolVersion(_message.Message):
    __slots__ = ("major", "minor")
    MAJOR_FIELD_NUMBER: _ClassVar[int]
    MINOR_FIELD_NUMBER: _ClassVar[int]
    major: int
    minor: int
    def __init__(self, major: _Optional[int] = ..., minor: _Optional[int] = ...) -> None: ...

class LayerRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message", "retryable", "session_id", "supported_versions", "reason", "relay_depth", "failed_layers")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RELAY_DEPTH_FIELD_NUMBER: _ClassVar[int]
    FAILED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    retryable: bool
    session_id: str
    supported_versions: _containers.RepeatedCompositeFieldContainer[ProtocolVersion]
    reason: str
    relay_depth: int
    failed_layers: LayerRange
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., retryable: _Optional[bool] = ..., session_id: _Optional[str] = ..., supported_versions: _Optional[_Iterable[_Union[ProtocolVersion, _Mapping]]] = ..., reason: _Optional[str] = ..., relay_depth: _Optional[int] = ..., failed_layers: _Optional[_Union[LayerRange, _Mapping]] = ...) -> None: ...

class GetCapabilitiesRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: ProtocolVersion
    def __init__(self, version: _Optional[_Union[ProtocolVersion, _Mapping]] = ...) -> None: ...

class GetCapabilitiesResponse(_message.Message):
    __slots__ = ("supported_versions", "engine", "model_fingerprint", "architecture", "n_layers_total", "layer_range", "is_first", "is_last", "n_embd", "n_vocab", "n_ctx", "n_ctx_per_session", "max_sessions", "bos_token_id", "eos_token_id", "hidden_dtype", "hidden_wire_dtypes", "mtp_enabled", "mtp_max_draft_tokens", "aux_state_kinds", "max_message_bytes", "max_credit", "resume_ttl_ms", "system_info", "layer_ranges_supported", "layer_ranges_detail", "max_logits_positions", "relay_allowed", "relay_return", "session_rewind", "batch_groups", "chat", "parse_special", "model_name", "session_handoff", "kv_layout", "prefix_cache_tokens", "prefix_cache_detail", "sampling_penalties", "grammar_kinds", "prefix_cache_limit", "session_fork", "pooling_type", "embeddings", "input_logprobs", "group_steps")
    SUPPORTED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAYER_RANGE_FIELD_NUMBER: _ClassVar[int]
    IS_FIRST_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    N_EMBD_FIELD_NUMBER: _ClassVar[int]
    N_VOCAB_FIELD_NUMBER: _ClassVar[int]
    N_CTX_FIELD_NUMBER: _ClassVar[int]
    N_CTX_PER_SESSION_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_DTYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_WIRE_DTYPES_FIELD_NUMBER: _ClassVar[int]
    MTP_ENABLED_FIELD_NUMBER: _ClassVar[int]
    MTP_MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AUX_STATE_KINDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CREDIT_FIELD_NUMBER: _ClassVar[int]
    RESUME_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_INFO_FIELD_NUMBER: _ClassVar[int]
    LAYER_RANGES_SUPPORTED_FIELD_NUMBER: _ClassVar[int]
    LAYER_RANGES_DETAIL_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGITS_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    RELAY_ALLOWED_FIELD_NUMBER: _ClassVar[int]
    RELAY_RETURN_FIELD_NUMBER: _ClassVar[int]
    SESSION_REWIND_FIELD_NUMBER: _ClassVar[int]
    BATCH_GROUPS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PARSE_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_HANDOFF_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PENALTIES_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_KINDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    SESSION_FORK_FIELD_NUMBER: _ClassVar[int]
    POOLING_TYPE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    INPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GROUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    supported_versions: _containers.RepeatedCompositeFieldContainer[ProtocolVersion]
    engine: str
    model_fingerprint: str
    architecture: str
    n_layers_total: int
    layer_range: LayerRange
    is_first: bool
    is_last: bool
    n_embd: int
    n_vocab: int
    n_ctx: int
    n_ctx_per_session: int
    max_sessions: int
    bos_token_id: int
    eos_token_id: int
    hidden_dtype: str
    hidden_wire_dtypes: _containers.RepeatedScalarFieldContainer[str]
    mtp_enabled: bool
    mtp_max_draft_tokens: int
    aux_state_kinds: _containers.RepeatedScalarFieldContainer[str]
    max_message_bytes: int
    max_credit: int
    resume_ttl_ms: int
    system_info: str
    layer_ranges_supported: bool
    layer_ranges_detail: str
    max_logits_positions: int
    relay_allowed: bool
    relay_return: bool
    session_rewind: bool
    batch_groups: bool
    chat: ChatTemplate
    parse_special: bool
    model_name: str
    session_handoff: bool
    kv_layout: str
    prefix_cache_tokens: int
    prefix_cache_detail: str
    sampling_penalties: bool
    grammar_kinds: _containers.RepeatedScalarFieldContainer[str]
    prefix_cache_limit: bool
    session_fork: bool
    pooling_type: str
    embeddings: bool
    input_logprobs: bool
    group_steps: bool
    def __init__(self, supported_versions: _Optional[_Iterable[_Union[ProtocolVersion, _Mapping]]] = ..., engine: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., architecture: _Optional[str] = ..., n_layers_total: _Optional[int] = ..., layer_range: _Optional[_Union[LayerRange, _Mapping]] = ..., is_first: _Optional[bool] = ..., is_last: _Optional[bool] = ..., n_embd: _Optional[int] = ..., n_vocab: _Optional[int] = ..., n_ctx: _Optional[int] = ..., n_ctx_per_session: _Optional[int] = ..., max_sessions: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., hidden_dtype: _Optional[str] = ..., hidden_wire_dtypes: _Optional[_Iterable[str]] = ..., mtp_enabled: _Optional[bool] = ..., mtp_max_draft_tokens: _Optional[int] = ..., aux_state_kinds: _Optional[_Iterable[str]] = ..., max_message_bytes: _Optional[int] = ..., max_credit: _Optional[int] = ..., resume_ttl_ms: _Optional[int] = ..., system_info: _Optional[str] = ..., layer_ranges_supported: _Optional[bool] = ..., layer_ranges_detail: _Optional[str] = ..., max_logits_positions: _Optional[int] = ..., relay_allowed: _Optional[bool] = ..., relay_return: _Optional[bool] = ..., session_rewind: _Optional[bool] = ..., batch_groups: _Optional[bool] = ..., chat: _Optional[_Union[ChatTemplate, _Mapping]] = ..., parse_special: _Optional[bool] = ..., model_name: _Optional[str] = ..., session_handoff: _Optional[bool] = ..., kv_layout: _Optional[str] = ..., prefix_cache_tokens: _Optional[int] = ..., prefix_cache_detail: _Optional[str] = ..., sampling_penalties: _Optional[bool] = ..., grammar_kinds: _Optional[_Iterable[str]] = ..., prefix_cache_limit: _Optional[bool] = ..., session_fork: _Optional[bool] = ..., pooling_type: _Optional[str] = ..., embeddings: _Optional[bool] = ..., input_logprobs: _Optional[bool] = ..., group_steps: _Optional[bool] = ...) -> None: ...

class ChatTemplate(_message.Message):
    __slots__ = ("template", "bos_token", "eos_token", "eot_token", "add_bos", "special_texts")
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TEXTS_FIELD_NUMBER: _ClassVar[int]
    template: str
    bos_token: str
    eos_token: str
    eot_token: str
    add_bos: bool
    special_texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, template: _Optional[str] = ..., bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ..., eot_token: _Optional[str] = ..., add_bos: _Optional[bool] = ..., special_texts: _Optional[_Iterable[str]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: ProtocolVersion
    def __init__(self, version: _Optional[_Union[ProtocolVersion, _Mapping]] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "detail", "sessions_active", "sessions_retained", "max_sessions")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[HealthResponse.Status]
        STATUS_SERVING: _ClassVar[HealthResponse.Status]
        STATUS_NOT_READY: _ClassVar[HealthResponse.Status]
        STATUS_FAILED: _ClassVar[HealthResponse.Status]
        STATUS_DRAINING: _ClassVar[HealthResponse.Status]
    STATUS_UNSPECIFIED: HealthResponse.Status
    STATUS_SERVING: HealthResponse.Status
    STATUS_NOT_READY: HealthResponse.Status
    STATUS_FAILED: HealthResponse.Status
    STATUS_DRAINING: HealthResponse.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_RETAINED_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    status: HealthResponse.Status
    detail: str
    sessions_active: int
    sessions_retained: int
    max_sessions: int
    def __init__(self, status: _Optional[_Union[HealthResponse.Status, str]] = ..., detail: _Optional[str] = ..., sessions_active: _Optional[int] = ..., sessions_retained: _Optional[int] = ..., max_sessions: _Optional[int] = ...) -> None: ...

class GetMetricsRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: ProtocolVersion
    def __init__(self, version: _Optional[_Union[ProtocolVersion, _Mapping]] = ...) -> None: ...

class GetMetricsResponse(_message.Message):
    __slots__ = ("engine", "worker")
    class EngineEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class WorkerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    engine: _containers.ScalarMap[str, int]
    worker: _containers.ScalarMap[str, int]
    def __init__(self, engine: _Optional[_Mapping[str, int]] = ..., worker: _Optional[_Mapping[str, int]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("version", "session_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    version: ProtocolVersion
    session_id: str
    def __init__(self, version: _Optional[_Union[ProtocolVersion, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("found", "was_running")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    WAS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    found: bool
    was_running: bool
    def __init__(self, found: _Optional[bool] = ..., was_running: _Optional[bool] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("version", "session_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    version: ProtocolVersion
    session_id: str
    def __init__(self, version: _Optional[_Union[ProtocolVersion, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("version", "open", "prefill", "decode", "generate", "credit", "close", "rewind", "export_state", "import_state")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    REWIND_FIELD_NUMBER: _ClassVar[int]
    EXPORT_STATE_FIELD_NUMBER: _ClassVar[int]
    IMPORT_STATE_FIELD_NUMBER: _ClassVar[int]
    version: ProtocolVersion
    open: OpenSession
    prefill: Prefill
    decode: Decode
    generate: Generate
    credit: Credit
    close: CloseSession
    rewind: Rewind
    export_state: ExportState
    import_state: StateChunk
    def __init__(self, version: _Optional[_Union[ProtocolVersion, _Mapping]] = ..., open: _Optional[_Union[OpenSession, _Mapping]] = ..., prefill: _Optional[_Union[Prefill, _Mapping]] = ..., decode: _Optional[_Union[Decode, _Mapping]] = ..., generate: _Optional[_Union[Generate, _Mapping]] = ..., credit: _Optional[_Union[Credit, _Mapping]] = ..., close: _Optional[_Union[CloseSession, _Mapping]] = ..., rewind: _Optional[_Union[Rewind, _Mapping]] = ..., export_state: _Optional[_Union[ExportState, _Mapping]] = ..., import_state: _Optional[_Union[StateChunk, _Mapping]] = ...) -> None: ...

class ExportState(_message.Message):
    __slots__ = ("max_chunk_bytes",)
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_chunk_bytes: int
    def __init__(self, max_chunk_bytes: _Optional[int] = ...) -> None: ...

class StateHeader(_message.Message):
    __slots__ = ("model_fingerprint", "layer_range", "kv_layout", "n_past", "has_tokens", "tokens", "data_bytes", "data_sha256", "has_next_token", "next_token")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYER_RANGE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    N_PAST_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_SHA256_FIELD_NUMBER: _ClassVar[int]
    HAS_NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    layer_range: LayerRange
    kv_layout: str
    n_past: int
    has_tokens: bool
    tokens: _containers.RepeatedScalarFieldContainer[int]
    data_bytes: int
    data_sha256: bytes
    has_next_token: bool
    next_token: int
    def __init__(self, model_fingerprint: _Optional[str] = ..., layer_range: _Optional[_Union[LayerRange, _Mapping]] = ..., kv_layout: _Optional[str] = ..., n_past: _Optional[int] = ..., has_tokens: _Optional[bool] = ..., tokens: _Optional[_Iterable[int]] = ..., data_bytes: _Optional[int] = ..., data_sha256: _Optional[bytes] = ..., has_next_token: _Optional[bool] = ..., next_token: _Optional[int] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("header", "data", "last")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    header: StateHeader
    data: bytes
    last: bool
    def __init__(self, header: _Optional[_Union[StateHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class Rewind(_message.Message):
    __slots__ = ("position",)
    POSITION_FIELD_NUMBER: _ClassVar[int]
    position: int
    def __init__(self, position: _Optional[int] = ...) -> None: ...

class CacheExpectation(_message.Message):
    __slots__ = ("n_tokens", "prefix_sha256")
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SHA256_FIELD_NUMBER: _ClassVar[int]
    n_tokens: int
    prefix_sha256: bytes
    def __init__(self, n_tokens: _Optional[int] = ..., prefix_sha256: _Optional[bytes] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("session_id", "expected_model_fingerprint", "expected_layer_range", "kv_budget", "cache", "initial_credit", "step_timeout_ms", "hidden_wire_dtype", "route", "batch_group", "prefix_probe", "fork_of")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LAYER_RANGE_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    INITIAL_CREDIT_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    BATCH_GROUP_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PROBE_FIELD_NUMBER: _ClassVar[int]
    FORK_OF_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    expected_model_fingerprint: str
    expected_layer_range: LayerRange
    kv_budget: int
    cache: CacheExpectation
    initial_credit: int
    step_timeout_ms: int
    hidden_wire_dtype: str
    route: Route
    batch_group: int
    prefix_probe: _containers.RepeatedScalarFieldContainer[int]
    fork_of: str
    def __init__(self, session_id: _Optional[str] = ..., expected_model_fingerprint: _Optional[str] = ..., expected_layer_range: _Optional[_Union[LayerRange, _Mapping]] = ..., kv_budget: _Optional[int] = ..., cache: _Optional[_Union[CacheExpectation, _Mapping]] = ..., initial_credit: _Optional[int] = ..., step_timeout_ms: _Optional[int] = ..., hidden_wire_dtype: _Optional[str] = ..., route: _Optional[_Union[Route, _Mapping]] = ..., batch_group: _Optional[int] = ..., prefix_probe: _Optional[_Iterable[int]] = ..., fork_of: _Optional[str] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("hops", "return_to", "step_timeout_ms")
    HOPS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TO_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    hops: _containers.RepeatedCompositeFieldContainer[RouteHop]
    return_to: ReturnAddress
    step_timeout_ms: int
    def __init__(self, hops: _Optional[_Iterable[_Union[RouteHop, _Mapping]]] = ..., return_to: _Optional[_Union[ReturnAddress, _Mapping]] = ..., step_timeout_ms: _Optional[int] = ...) -> None: ...

class ReturnAddress(_message.Message):
    __slots__ = ("target", "session_id", "secret")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    target: str
    session_id: str
    secret: bytes
    def __init__(self, target: _Optional[str] = ..., session_id: _Optional[str] = ..., secret: _Optional[bytes] = ...) -> None: ...

class RouteHop(_message.Message):
    __slots__ = ("target", "expected_model_fingerprint", "expected_layer_range")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LAYER_RANGE_FIELD_NUMBER: _ClassVar[int]
    target: str
    expected_model_fingerprint: str
    expected_layer_range: LayerRange
    def __init__(self, target: _Optional[str] = ..., expected_model_fingerprint: _Optional[str] = ..., expected_layer_range: _Optional[_Union[LayerRange, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "penalty_last_n", "logit_bias", "grammar_kind", "grammar", "grammar_start")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPEAT_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PENALTY_LAST_N_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_KIND_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_START_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_p: float
    repeat_penalty: float
    presence_penalty: float
    frequency_penalty: float
    penalty_last_n: int
    logit_bias: _containers.ScalarMap[int, float]
    grammar_kind: str
    grammar: str
    grammar_start: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., repeat_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., penalty_last_n: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., grammar_kind: _Optional[str] = ..., grammar: _Optional[str] = ..., grammar_start: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("data", "shape", "dtype")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, data: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class Position(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Prefill(_message.Message):
    __slots__ = ("tokens", "hidden_states", "text", "position", "sampling", "top_logprobs", "chunk_tokens", "all_logits", "echo_tokens", "parse_special", "token_ids", "has_cache_limit", "cache_limit")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALL_LOGITS_FIELD_NUMBER: _ClassVar[int]
    ECHO_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARSE_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_CACHE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    CACHE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenIds
    hidden_states: Tensor
    text: str
    position: Position
    sampling: SamplingParams
    top_logprobs: int
    chunk_tokens: int
    all_logits: bool
    echo_tokens: bool
    parse_special: bool
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_cache_limit: bool
    cache_limit: int
    def __init__(self, tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., text: _Optional[str] = ..., position: _Optional[_Union[Position, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., top_logprobs: _Optional[int] = ..., chunk_tokens: _Optional[int] = ..., all_logits: _Optional[bool] = ..., echo_tokens: _Optional[bool] = ..., parse_special: _Optional[bool] = ..., token_ids: _Optional[_Iterable[int]] = ..., has_cache_limit: _Optional[bool] = ..., cache_limit: _Optional[int] = ...) -> None: ...

class Decode(_message.Message):
    __slots__ = ("token", "hidden_state", "sampling", "top_logprobs", "relay_tag", "has_token_id", "token_id")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RELAY_TAG_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token: int
    hidden_state: Tensor
    sampling: SamplingParams
    top_logprobs: int
    relay_tag: int
    has_token_id: bool
    token_id: int
    def __init__(self, token: _Optional[int] = ..., hidden_state: _Optional[_Union[Tensor, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., top_logprobs: _Optional[int] = ..., relay_tag: _Optional[int] = ..., has_token_id: _Optional[bool] = ..., token_id: _Optional[int] = ...) -> None: ...

class Generate(_message.Message):
    __slots__ = ("tokens", "text", "sampling", "max_tokens", "stop_tokens", "ignore_eos", "top_logprobs", "parse_special", "yield_on_drain", "has_cache_limit", "cache_limit")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PARSE_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    YIELD_ON_DRAIN_FIELD_NUMBER: _ClassVar[int]
    HAS_CACHE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    CACHE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenIds
    text: str
    sampling: SamplingParams
    max_tokens: int
    stop_tokens: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    top_logprobs: int
    parse_special: bool
    yield_on_drain: bool
    has_cache_limit: bool
    cache_limit: int
    def __init__(self, tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop_tokens: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., parse_special: _Optional[bool] = ..., yield_on_drain: _Optional[bool] = ..., has_cache_limit: _Optional[bool] = ..., cache_limit: _Optional[int] = ...) -> None: ...

class Credit(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: int
    def __init__(self, messages: _Optional[int] = ...) -> None: ...

class CloseSession(_message.Message):
    __slots__ = ("retain",)
    RETAIN_FIELD_NUMBER: _ClassVar[int]
    retain: bool
    def __init__(self, retain: _Optional[bool] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("opened", "step", "usage", "error", "closed", "state")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    step: StepResult
    usage: Usage
    error: Error
    closed: SessionClosed
    state: StateChunk
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., step: _Optional[_Union[StepResult, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., closed: _Optional[_Union[SessionClosed, _Mapping]] = ..., state: _Optional[_Union[StateChunk, _Mapping]] = ...) -> None: ...

class CacheResult(_message.Message):
    __slots__ = ("outcome", "tokens_held", "reason")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[CacheResult.Outcome]
        OUTCOME_NEW: _ClassVar[CacheResult.Outcome]
        OUTCOME_HIT: _ClassVar[CacheResult.Outcome]
        OUTCOME_PARTIAL: _ClassVar[CacheResult.Outcome]
        OUTCOME_MISS: _ClassVar[CacheResult.Outcome]
        OUTCOME_MISMATCH: _ClassVar[CacheResult.Outcome]
    OUTCOME_UNSPECIFIED: CacheResult.Outcome
    OUTCOME_NEW: CacheResult.Outcome
    OUTCOME_HIT: CacheResult.Outcome
    OUTCOME_PARTIAL: CacheResult.Outcome
    OUTCOME_MISS: CacheResult.Outcome
    OUTCOME_MISMATCH: CacheResult.Outcome
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TOKENS_HELD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    outcome: CacheResult.Outcome
    tokens_held: int
    reason: str
    def __init__(self, outcome: _Optional[_Union[CacheResult.Outcome, str]] = ..., tokens_held: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("session_id", "cache", "kv_capacity", "n_past", "credit", "version", "hidden_wire_dtype", "prefix_cached_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    N_PAST_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    cache: CacheResult
    kv_capacity: int
    n_past: int
    credit: int
    version: ProtocolVersion
    hidden_wire_dtype: str
    prefix_cached_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., cache: _Optional[_Union[CacheResult, _Mapping]] = ..., kv_capacity: _Optional[int] = ..., n_past: _Optional[int] = ..., credit: _Optional[int] = ..., version: _Optional[_Union[ProtocolVersion, _Mapping]] = ..., hidden_wire_dtype: _Optional[str] = ..., prefix_cached_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "piece")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    piece: bytes
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., piece: _Optional[bytes] = ...) -> None: ...

class Logits(_message.Message):
    __slots__ = ("top", "token_id", "logprob", "piece", "is_eog")
    TOP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    IS_EOG_FIELD_NUMBER: _ClassVar[int]
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    token_id: int
    logprob: float
    piece: bytes
    is_eog: bool
    def __init__(self, top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., piece: _Optional[bytes] = ..., is_eog: _Optional[bool] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step", "n_past", "tokens_processed", "reused_tokens", "logits", "hidden_states", "start_position", "finish_reason", "more_chunks", "position_logits", "input_tokens", "cached_tokens", "input_logprobs")
    STEP_FIELD_NUMBER: _ClassVar[int]
    N_PAST_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MORE_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    POSITION_LOGITS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step: int
    n_past: int
    tokens_processed: int
    reused_tokens: int
    logits: Logits
    hidden_states: Tensor
    start_position: int
    finish_reason: FinishReason
    more_chunks: bool
    position_logits: _containers.RepeatedCompositeFieldContainer[Logits]
    input_tokens: TokenIds
    cached_tokens: int
    input_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, step: _Optional[int] = ..., n_past: _Optional[int] = ..., tokens_processed: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., logits: _Optional[_Union[Logits, _Mapping]] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., start_position: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., more_chunks: _Optional[bool] = ..., position_logits: _Optional[_Iterable[_Union[Logits, _Mapping]]] = ..., input_tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., input_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "reused_tokens", "n_past", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_PAST_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    reused_tokens: int
    n_past: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., n_past: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class SessionClosed(_message.Message):
    __slots__ = ("reason", "totals", "kv_retained", "resume_ttl_ms")
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[SessionClosed.Reason]
        REASON_CLIENT_CLOSE: _ClassVar[SessionClosed.Reason]
        REASON_CLIENT_HALF_CLOSE: _ClassVar[SessionClosed.Reason]
        REASON_RELEASED: _ClassVar[SessionClosed.Reason]
        REASON_ERROR: _ClassVar[SessionClosed.Reason]
        REASON_SHUTDOWN: _ClassVar[SessionClosed.Reason]
    REASON_UNSPECIFIED: SessionClosed.Reason
    REASON_CLIENT_CLOSE: SessionClosed.Reason
    REASON_CLIENT_HALF_CLOSE: SessionClosed.Reason
    REASON_RELEASED: SessionClosed.Reason
    REASON_ERROR: SessionClosed.Reason
    REASON_SHUTDOWN: SessionClosed.Reason
    REASON_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    KV_RETAINED_FIELD_NUMBER: _ClassVar[int]
    RESUME_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    reason: SessionClosed.Reason
    totals: Usage
    kv_retained: bool
    resume_ttl_ms: int
    def __init__(self, reason: _Optional[_Union[SessionClosed.Reason, str]] = ..., totals: _Optional[_Union[Usage, _Mapping]] = ..., kv_retained: _Optional[bool] = ..., resume_ttl_ms: _Optional[int] = ...) -> None: ...

class ReturnRequest(_message.Message):
    __slots__ = ("version", "session_id", "secret", "relay_tag", "step")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    RELAY_TAG_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    version: ProtocolVersion
    session_id: str
    secret: bytes
    relay_tag: int
    step: StepResult
    def __init__(self, version: _Optional[_Union[ProtocolVersion, _Mapping]] = ..., session_id: _Optional[str] = ..., secret: _Optional[bytes] = ..., relay_tag: _Optional[int] = ..., step: _Optional[_Union[StepResult, _Mapping]] = ...) -> None: ...

class ReturnResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("version", "text", "tokens", "add_bos", "parse_special", "with_pieces")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_FIELD_NUMBER: _ClassVar[int]
    PARSE_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    WITH_PIECES_FIELD_NUMBER: _ClassVar[int]
    version: ProtocolVersion
    text: str
    tokens: TokenIds
    add_bos: bool
    parse_special: bool
    with_pieces: bool
    def __init__(self, version: _Optional[_Union[ProtocolVersion, _Mapping]] = ..., text: _Optional[str] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., add_bos: _Optional[bool] = ..., parse_special: _Optional[bool] = ..., with_pieces: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens", "pieces")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    pieces: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., pieces: _Optional[_Iterable[bytes]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("version", "inputs", "normalize")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    version: ProtocolVersion
    inputs: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    normalize: bool
    def __init__(self, version: _Optional[_Union[ProtocolVersion, _Mapping]] = ..., inputs: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ..., normalize: _Optional[bool] = ...) -> None: ...

class EmbedInput(_message.Message):
    __slots__ = ("text", "tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: TokenIds
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "n_tokens")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    n_tokens: int
    def __init__(self, values: _Optional[_Iterable[float]] = ..., n_tokens: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings",)
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ...) -> None: ...

class GroupStepRequest(_message.Message):
    __slots__ = ("version", "rows")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    version: ProtocolVersion
    rows: _containers.RepeatedCompositeFieldContainer[GroupRow]
    def __init__(self, version: _Optional[_Union[ProtocolVersion, _Mapping]] = ..., rows: _Optional[_Iterable[_Union[GroupRow, _Mapping]]] = ...) -> None: ...

class GroupRow(_message.Message):
    __slots__ = ("session_id", "decode")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    decode: Decode
    def __init__(self, session_id: _Optional[str] = ..., decode: _Optional[_Union[Decode, _Mapping]] = ...) -> None: ...

class GroupStepResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[GroupRowResult]
    def __init__(self, rows: _Optional[_Iterable[_Union[GroupRowResult, _Mapping]]] = ...) -> None: ...

class GroupRowResult(_message.Message):
    __slots__ = ("session_id", "result", "error", "n_past")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    N_PAST_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    result: StepResult
    error: Error
    n_past: int
    def __init__(self, session_id: _Optional[str] = ..., result: _Optional[_Union[StepResult, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., n_past: _Optional[int] = ...) -> None: ...
