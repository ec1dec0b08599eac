"""Which hop of a pipeline failed: ``Hop``, ``PipelineError`` and the blame of one generation.

Why a module of its own: every part of the client pipeline (the runners, the chain driver, the
pipeline itself) turns a ``ShardError`` into a ``PipelineError`` naming a hop, and the rules for
which hop must be one set. A chain-relayed error names its hop by structure: the worker that
failed is ``relay_depth`` hops after the one the client talks to (``ShardError.relay_depth``,
carried in the error's status details), never found by reading a message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from shard.rpc.errors import ErrorCode, GrpcStatus, ShardError
from shard.v1 import shard_pb2 as pb

__all__ = ["STEP_DEADLINE", "Blame", "Blames", "Hop", "PipelineError", "should_fail_over"]

#: ``ShardError.reason`` of a step that got no answer within ``step_timeout`` (the client's,
#: or a relaying worker's for its next hop: the same word for the same finding).
STEP_DEADLINE = "STEP_DEADLINE"


@dataclass(frozen=True)
class Hop:
    """One shard of the chain, as its worker described itself."""

    index: int
    target: str
    caps: pb.GetCapabilitiesResponse | None = None

    @property
    def layers(self) -> tuple[int, int] | None:
        if self.caps is None:
            return None
        return self.caps.layer_range.start, self.caps.layer_range.end

    def __str__(self) -> str:
        if self.layers is None:
            return f"hop {self.index} ({self.target})"
        return f"hop {self.index} ({self.target}, layers [{self.layers[0]}, {self.layers[1]}))"


class PipelineError(ShardError):
    """A ``ShardError`` that says which hop failed (``hop_index``, ``target``) and, for a hop
    with replicas, every replica tried and why it failed last (``tried``: (target, error)
    pairs, in the order first tried). ``cause``: the error as the hop's worker reported it."""

    def __init__(
        self, hop: Hop, err: ShardError, *, tried: Sequence[tuple[str, ShardError]] = (),
        note: str = "",
    ) -> None:
        super().__init__(
            err.code,
            f"{hop}: {err.message}" + (f"; {note}" if note else ""),
            retryable=err.retryable,
            session_id=err.session_id,
            reason=err.reason,
            supported_versions=err.supported_versions,
            grpc_status=err.grpc_status,
        )
        self.hop_index = hop.index
        self.target = hop.target
        self.cause = err
        self.tried = list(tried)


def should_fail_over(err: ShardError) -> bool:
    """Whether ``err`` says the worker is gone, going or hung (another replica may serve),
    rather than that the request itself cannot be served."""
    return err.grpc_status == GrpcStatus.UNAVAILABLE or err.reason == STEP_DEADLINE


def chained_hop(err: ShardError, index: int, hops: Sequence[Hop]) -> Hop | None:
    """The hop a chain-relayed error is from: ``relay_depth`` hops after hop ``index`` (the
    one the client talks to), if that hop exists and serves the range the error names."""
    if not err.relay_depth:
        return None
    k = index + err.relay_depth
    if k >= len(hops):
        return None
    hop = hops[k]
    if err.failed_layers is not None and hop.layers is not None and hop.layers != err.failed_layers:
        return None
    return hop


@dataclass
class Blames:
    """Which hop one ``generate``'s failure is blamed on."""

    #: The hops of the pipeline, as connected (for errors a chain relay names by depth).
    hops: Sequence[Hop] = ()
    #: The first error of a prefill task (the others are cancelled rather than raising).
    failures: list[PipelineError] = field(default_factory=list)
    #: Hops whose call a cancellation interrupted (the pipeline's deadline, or the caller's).
    interrupted: list[int] = field(default_factory=list)

    def error(self, hop: Hop, err: ShardError) -> PipelineError:
        """``err`` raised by a call to ``hop``, as the caller gets it: naming the hop it is
        from (a later one, for an error a chain relay passed up)."""
        if isinstance(err, PipelineError):
            return err
        return PipelineError(chained_hop(err, hop.index, self.hops) or hop, err)

    def deadline_error(self, hops: Sequence[Hop]) -> PipelineError:
        """The error for the pipeline's deadline scope having passed. A hop's own call deadline
        falls just before it, but both usually pass in one scheduler tick, and the hop's call
        then ends in a cancellation: name the first hop whose call it interrupted, else the
        last hop (the deadline passed in ``on_token``, handling that hop's result)."""
        if self.failures:
            return self.failures[0]
        hop = hops[min(self.interrupted)] if self.interrupted else hops[-1]
        return PipelineError(hop, ShardError(ErrorCode.DEADLINE_EXCEEDED, "the pipeline deadline expired"))


class Blame:
    """Turn a ``ShardError`` inside the block into a ``PipelineError`` naming the hop (the
    runner's, or the later one a chain relay named), and note in ``blames`` when a
    cancellation interrupted the block.

    In a prefill task (``scope`` given) the first error is recorded in ``blames.failures`` and
    the sibling tasks are cancelled instead of raising, so the caller gets one error, not an
    exception group.
    """

    def __init__(self, hop: Any, blames: Blames, scope: trio.CancelScope | None = None) -> None:
        self._hop, self._blames, self._scope = hop, blames, scope

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if isinstance(exc, trio.Cancelled):
            self._blames.interrupted.append(self._hop.index)
        if exc is None or not isinstance(exc, ShardError):
            return False
        err = self._blames.error(self._hop.hop, exc)
        if self._scope is None:
            raise err from None
        if not self._blames.failures:
            self._blames.failures.append(err)
        self._scope.cancel()
        return True
