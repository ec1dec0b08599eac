"""Small GGUF models written locally (never downloaded); see ``shard.models.write``."""

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
    "ModelPreset",
    "build_vocab",
    "cache_dir",
    "cache_file_name",
    "ensure_model",
    "get_preset",
    "write_model",
]
