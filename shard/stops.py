"""When a generation stops: the one set of stop rules every driver of one applies.

A worker's ``Generate`` (whole model, or the first hop of a chain relay), the client pipeline's
decode loop and its chain-relayed generation all end a generation at the same token for the same
reason, because they all ask ``StopRules.finish_reason``. A leaf module (it imports only the
generated protocol code), so the worker and the client share it without importing each other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shard.v1 import shard_pb2 as pb

__all__ = ["StopRules"]


@dataclass(frozen=True)
class StopRules:
    """A generation's stop rules, checked in this order: end of generation (unless
    ``ignore_eos``), a stop token, ``max_tokens`` emitted, the session's KV capacity."""

    max_tokens: int
    stop_tokens: frozenset[int] = frozenset()
    ignore_eos: bool = False

    @classmethod
    def of(cls, max_tokens: int, stop_tokens: Iterable[int] = (), ignore_eos: bool = False) -> StopRules:
        return cls(max_tokens, frozenset(stop_tokens), ignore_eos)

    def finish_reason(
        self, token: int, is_eog: bool, *, emitted: int, n_past: int, capacity: int
    ) -> int:
        """The ``FinishReason`` the ``emitted``-th token of the generation ends it with, or
        ``FINISH_REASON_UNSPECIFIED`` when it goes on. ``n_past``: positions held after that
        token's step (the next step would need one more); ``capacity``: the most positions the
        session (the chain's smallest) may hold."""
        if is_eog and not self.ignore_eos:
            return pb.FINISH_REASON_EOG
        if token in self.stop_tokens:
            return pb.FINISH_REASON_STOP_TOKEN
        if emitted >= self.max_tokens:
            return pb.FINISH_REASON_LENGTH
        if n_past + 1 > capacity:
            return pb.FINISH_REASON_CONTEXT_FULL
        return pb.FINISH_REASON_UNSPECIFIED
