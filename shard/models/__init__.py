"""GGUF model files: small models written locally (never downloaded, ``shard.models.write``
and, one per architecture, ``shard.models.arch_models``), their headers
(``shard.models.header``), the per-architecture rules for layer ranges
(``shard.models.architectures``) and layer-range slices (``shard.models.slice``)."""

from .architectures import ARCHITECTURES, Architecture, lookup
from .fingerprint import file_fingerprint
from .header import ModelInfo, SliceError, read_model_info
from .slice import (
    RANGE_ARCHITECTURES,
    SLICER_VERSION,
    ensure_slice,
    slice_cache_path,
    slice_model,
)
from .write import (
    GENERATOR_VERSION,
    PRESETS,
    ModelPreset,
    build_vocab,
    cache_dir,
    cache_file_name,
    ensure_model,
    get_preset,
    write_model,
)

__all__ = [
    "ARCHITECTURES",
    "GENERATOR_VERSION",
    "PRESETS",
    "RANGE_ARCHITECTURES",
    "SLICER_VERSION",
    "Architecture",
    "ModelInfo",
    "ModelPreset",
    "SliceError",
    "build_vocab",
    "cache_dir",
    "cache_file_name",
    "ensure_model",
    "ensure_slice",
    "file_fingerprint",
    "get_preset",
    "lookup",
    "read_model_info",
    "slice_cache_path",
    "slice_model",
    "write_model",
]
