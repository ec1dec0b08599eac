"""Generated protobuf and purerpc code for Shard protocol v1 (``python -m shard.rpc.codegen``)."""
