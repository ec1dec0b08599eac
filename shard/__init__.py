"""trio-shard: a Trio gRPC worker serving one shard of a GGUF language model."""

__version__ = "0.1.0"
