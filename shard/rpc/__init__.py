"""Shard protocol transport, sessions and servicer (depends on shard.engine, never the reverse)."""
