"""A routed session's positions: this worker's engine, its next hop, and how far the two agree.

Why one object: a routed step moves positions in two places at once (this worker's engine
computes rows, the next hop takes them, either may fail, a Cancel may land in between, and with
a direct return a step is computed before the previous one's answer came back). If each step
moved the session's counters itself, two tasks of one step could each leave a different end
(a forward that fails moves it back, a compute result landing in the same scheduler pass moves
it forward again). Here every event only records a fact, and the session's end is always the
same function of the facts:

* ``engine``: positions this worker's engine holds;
* ``down``: positions the next hop said it holds (its last answer's ``n_past``, or its
  ``Usage.n_past`` after a failed step);
* ``synced``: ``[0, synced)`` hold the same history here and on the next hop. Computing rows
  from position ``p`` (a prefix reused below ``p`` is unchanged) lowers it to ``p``; the next
  hop taking rows from ``p <= synced`` raises it to what it then holds.

``end = min(engine, down, synced)``: what the whole chain from this worker on holds alike, and
what the client is told (``Usage.n_past``, ``StepResult.n_past``). After every request, failed
ones included, ``settle_plan`` says what to drop so that every hop holds exactly ``end``: this
worker's engine truncated to it, the next hop rewound to it (``Rewind``), so the next request
starts with ``engine == down == synced == end``. That is also why a prefix this worker reuses
is never a problem: rows computed from ``position + reused`` go to the next hop at that very
position (``first``), which holds the reused prefix because it holds ``end`` positions.
"""

from __future__ import annotations

from shard.engine import StepResult

from shard.rpc.positions import Positions

__all__ = ["ChainLedger"]


class ChainLedger(Positions):
    """The positions of one routed session on one relaying worker (see the module docstring).

    ``next_token`` is the token the last shard chose for position ``end`` (what a ``Generate``
    continues from); it is forgotten when ``end`` moves off that position. ``pending`` is
    where the next hop's end will be once it took every row sent to it (a step sent ahead of
    the previous answer, with a direct return, appends there)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = 0
        self.synced = 0
        self.pending = 0
        self._token_at = -1  # the position next_token was chosen for

    def __repr__(self) -> str:
        return (f"ChainLedger(end={self.end}, engine={self.engine}, down={self.down}, "
                f"synced={self.synced}, pending={self.pending})")

    def _recount(self) -> None:
        self.end = min(self.engine, self.down, self.synced)
        self.delivered = min(self.delivered, self.end)
        if self.next_token is not None and self._token_at != self.end:
            self.next_token = None

    # ---- events ---------------------------------------------------------------------------

    def resumed(self, end: int, engine: int) -> None:
        raise AssertionError("a routed session is never resumed")

    def forked(self, source: Positions) -> None:
        """A fork of the routed session ``source``: this engine and the next hop each forked
        their copy, so every count is the source's."""
        assert isinstance(source, ChainLedger)
        super().forked(source)
        self.down, self.synced, self.pending = source.down, source.synced, source.pending
        self._token_at = source._token_at
        self._recount()

    def computed(self, position: int, result: StepResult) -> None:
        """This engine holds ``[first, n_past)`` anew (``first = position + reused``: computed
        or copied from its prefix cache; the next hop takes the copied ones from its own)."""
        first = result.n_past - result.tokens_processed - result.cached_tokens
        self.engine = result.n_past
        self.synced = min(self.synced, first)
        self.delivered = min(self.delivered, position)
        self._recount()

    def resync(self, held: int) -> None:
        """This engine's step failed; it holds ``held`` (its reused prefix, or what it held)."""
        self.engine = held
        self.synced = min(self.synced, held)
        self._recount()

    def sending(self, first: int, rows: int) -> bool:
        """Rows ``[first, first + rows)`` go to the next hop now. True when they append to
        what it will hold by then (a ``Decode`` will do), False when it must be told the
        position (a ``Prefill`` at ``first``: it drops whatever it holds from there)."""
        appends = first == self.pending
        self.pending = first + rows
        return appends

    def forwarded(self, first: int, n_past: int, token: int | None) -> None:
        """The next hop took the rows from ``first`` and now holds ``n_past``; the last shard
        chose ``token`` for position ``n_past``."""
        self.down = n_past
        if first <= self.synced:
            self.synced = min(n_past, self.engine)
        if token is not None:
            self.next_token, self._token_at = token, n_past
        self._recount()

    def downstream_failed(self, held: int) -> None:
        """A step failed at or after the next hop, which now holds ``held`` (its Usage)."""
        self.down = self.pending = held
        self._recount()

    def rewound(self, keep: int) -> None:
        """This engine now holds ``[0, keep)`` (a Rewind, or a truncation after a failure)."""
        self.engine = min(self.engine, keep)
        self.synced = min(self.synced, keep)
        self._recount()

    def downstream_rewound(self, held: int) -> None:
        """The next hop was rewound and holds ``held``."""
        self.down = self.pending = held
        self._recount()

    def forget_after(self, keep: int) -> None:
        """The chain must hold no more than ``keep`` (its client was sent no result beyond):
        ``settle`` drops the rest wherever it is held."""
        self.synced = min(self.synced, keep)
        self._recount()

    def settle_plan(self) -> tuple[int | None, int | None]:
        """The one rule after a request: (truncate this engine to, rewind the next hop to),
        each None when nothing is to be dropped there, so that both hold exactly ``end``."""
        end = self.end
        return (end if self.engine > end else None, end if self.down > end else None)
