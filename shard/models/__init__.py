"""GGUF model files: small models written locally (never downloaded, ``shard.models.write``)
and layer-range slices of any llama model (``shard.models.slice``)."""

from .fingerprint import file_fingerprint
from .slice import (
    RANGE_ARCHITECTURES,
    SLICER_VERSION,
    ModelInfo,
    SliceError,
    ensure_slice,
    read_model_info,
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
    "GENERATOR_VERSION",
    "PRESETS",
    "RANGE_ARCHITECTURES",
    "SLICER_VERSION",
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
    "read_model_info",
    "slice_cache_path",
    "slice_model",
    "write_model",
]
