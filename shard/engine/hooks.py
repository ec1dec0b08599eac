"""The hooks an engine implementation provides: the numeric work behind ``ShardEngine``.

``ShardEngine`` (``shard.engine.base``) implements every lifecycle rule once and calls these
``_impl_*`` methods for the work itself; FakeEngine and LlamaCppEngine implement them. The one
hook with a default built on the base class's machinery, ``_impl_stream``, is declared there.
This class is the interface only: it holds no state but the one flag an implementation sets.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import numpy as np

from .errors import UnsupportedFeature
from .plans import ComputePlan
from .slots import Claimed, Slot
from .types import Capabilities, LoadSpec

if TYPE_CHECKING:
    from .scheduler import BatchScheduler, Job


class EngineHooks(abc.ABC):
    """The ``_impl_*`` interface. Every hook may raise ``EngineError`` subclasses; anything
    else turns the engine FAILED (the base class's guard)."""

    #: Set by an implementation whose ``_impl_compute`` stops by itself when its caller is
    #: cancelled: it sets the slot's cancel flag and returns (raising ``trio.Cancelled``) only
    #: once its work stopped (``BatchScheduler.compute``). Then a one-row step without a
    #: timeout (every decode) is awaited directly, not through a watching task and nursery.
    #: (It sets the flag once its tick ended, where the watching task sets it at once: a prompt
    #: chunk stops early only then, so prompts keep the task.)
    _compute_stops_itself: bool = False

    @abc.abstractmethod
    async def _impl_load(self, spec: LoadSpec) -> Capabilities:
        """Load the model and return its capabilities. May block only inside worker threads."""

    @abc.abstractmethod
    async def _impl_compute(self, slot: Slot, plan: ComputePlan) -> np.ndarray:
        """Execute ``plan`` for ``slot``. Check ``slot.cancel`` between steps and raise
        ``EngineCancelled`` when set. Must not return before native work on the slot stops.
        With ``plan.copy_from`` (an engine with a prefix cache), the slot's cells are first
        replaced by positions ``[0, keep)`` of that sequence, when the slot is touched."""

    async def _impl_claim(self, slot: Slot, plan: ComputePlan) -> Claimed | None:
        """The result of ``plan`` if the implementation computes it already (a step computed
        ahead), waiting for it; None when it does not (``_impl_compute`` then runs).

        Runs in the caller's cancel scope, unshielded and in the caller's task (no nursery, no
        extra task: this is the path of every generated token), so it must own no native work:
        a claim cancelled while it waits leaves the step to its owner, ready for a later claim.
        It ends early, with ``slot.cancel``'s error, when that flag is set."""
        return None

    def _impl_group_scheduler(self) -> BatchScheduler | None:
        """The batching scheduler ``decode_group`` submits a group's rows to at once (None:
        each row runs as ``decode`` runs it, concurrently)."""
        return None

    def _impl_group_job(self, slot: Slot, plan: ComputePlan) -> Job | None:
        """The scheduler job of a one-row step of a group (``_impl_compute``'s, not yet
        submitted), or None: this row runs as ``decode`` runs it (e.g. a step computed
        ahead may be claimed for it). Called on the event loop; must not block."""
        return None

    def _impl_group_raw(self, job: Job) -> np.ndarray:
        """What ``_impl_compute`` returns for a finished group job (raises its error)."""
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[no-any-return]

    @abc.abstractmethod
    async def _impl_truncate(self, slot: Slot, keep: int) -> None:
        """Remove the slot's KV cells at positions ``>= keep`` (``keep=0``: all of them)."""

    @abc.abstractmethod
    def _impl_tokenize(self, text: str, add_bos: bool, parse_special: bool) -> list[int]: ...

    @abc.abstractmethod
    def _impl_token_piece(self, token_id: int) -> bytes: ...

    @abc.abstractmethod
    def _impl_is_eog(self, token_id: int) -> bool: ...

    def _impl_grammar_tokenizer(self) -> object:
        """The grammar library's tokenizer over this engine's vocabulary
        (``shard.engine.grammar``); runs once, in a worker thread, on first use."""
        raise UnsupportedFeature("this engine has no vocabulary for a grammar")

    @abc.abstractmethod
    def _impl_kv_cells_used(self) -> int:
        """KV cells in use, read from the implementation's own state (used to prove no leaks)."""

    async def _impl_export(self, slot: Slot) -> bytes:
        """The slot's KV cells ``[0, n_past)`` as bytes in ``Capabilities.kv_layout`` (engines
        that report a layout). Anything computed ahead is dropped first."""
        raise UnsupportedFeature("this engine cannot export a session")

    async def _impl_import(self, slot: Slot, data: bytes, n_past: int) -> None:
        """Load exported cells into the slot, which holds none: afterwards it holds exactly
        ``[0, n_past)``. On any failure it must hold none again and raise ``IncompatibleState``
        (cells that do not fit: ``KvCacheFull``)."""
        raise UnsupportedFeature("this engine cannot import a session")

    def _impl_state_bound(self, n_past: int) -> int:
        """An upper bound of the bytes ``_impl_export`` returns for ``n_past`` positions, so a
        transport can refuse a larger import before it buffers it."""
        return 0

    async def _impl_fork(self, source: Slot, slot: Slot) -> None:
        """Give the empty ``slot`` a copy of ``source``'s cells ``[0, source.n_past)`` (a step
        computed ahead for ``source`` is dropped first). On failure ``slot`` holds none."""
        raise UnsupportedFeature("this engine cannot fork a session")

    async def _impl_forget_cells(self, seq_ids: list[int]) -> None:
        """Free every cell of these sequences, prefix cache entries that no session holds
        (engines that report ``Capabilities.prefix_cache_tokens``)."""
        raise UnsupportedFeature("this engine keeps no prefix cache")

    async def _impl_embed(self, tokens: tuple[int, ...]) -> np.ndarray:
        """The pooled (not normalized) embedding of ``tokens``, checked already
        (``validation.check_embed``), as a vector of ``n_embd`` floats. Must hold no KV cell
        and no sequence id once it returns, and must not touch any session's cells."""
        raise UnsupportedFeature("this engine computes no embeddings")

    async def _impl_move_cells(self, source: int, seq: int) -> None:
        """Move every cell of sequence ``source`` (a prefix cache entry's) to the empty ``seq``,
        leaving ``source`` empty (engines that report ``Capabilities.prefix_cache_tokens``)."""
        raise UnsupportedFeature("this engine keeps no prefix cache")

    def _impl_moves_cells(self) -> bool:
        """Whether ``_impl_move_cells`` moves an entry whole here (False: entries stay at the
        released session's id)."""
        return True

    def _impl_lookahead_cells(self) -> int:
        """KV cells held by steps computed ahead and not claimed (engines that look ahead)."""
        return 0

    @abc.abstractmethod
    async def _impl_close(self) -> None:
        """Free every native resource. Called once, also after a failure."""
