"""The engine contract's typed errors; they live in the leaf module ``shard.errors`` (so shared
value types can raise them without importing this package) and are re-exported here."""

from shard import errors as _errors
from shard.errors import *  # noqa: F403 - the same classes under their old module name

__all__ = list(_errors.__all__)
