"""What a session holds, as its stream counts it: one object, one place that moves the counts.

A session's positions are read by everything that answers a client (``StepResult.n_past``,
``Usage.n_past``, the next step's position, a resume) and moved by every engine call, so they
live in one object with one method per event instead of fields of the stream task that any step
could assign. A routed session (chain relay) uses a subclass that also tracks its next hop
(``shard.relay.ledger.ChainLedger``); the stream only ever asks ``end``.

The counts:

* ``engine``: positions the engine holds;
* ``end``: the session's logical end, what the client may build on (``<= engine`` after a
  partial resume: the next step rewrites the surplus);
* ``delivered``: positions whose results were handed to the transport (a resume never keeps a
  result the client was not sent);
* ``next_token``: the token the last logits step chose (what a ``Generate`` without a prompt, or
  a look-ahead, continues from); None once the position it was chosen for is gone.
"""

from __future__ import annotations

from shard.engine import StepResult

__all__ = ["Positions"]


class Positions:
    """A plain session's positions (see the module docstring)."""

    def __init__(self) -> None:
        self.end = 0
        self.engine = 0
        self.delivered = 0
        self.next_token: int | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(end={self.end}, engine={self.engine}, delivered={self.delivered})"

    def resumed(self, end: int, engine: int) -> None:
        """A retained session resumed: the client may build on ``end`` of ``engine`` positions."""
        self.end, self.engine, self.delivered = end, engine, end

    def forked(self, source: Positions) -> None:
        """A fork of the session ``source`` counts: it holds what that one holds, and its
        client knows it (it was sent the source's results)."""
        self.end, self.engine, self.delivered = source.end, source.engine, source.end
        self.next_token = source.next_token

    def computed(self, position: int, result: StepResult) -> None:
        """An engine step whose input went to ``position`` returned ``result``: the session
        holds what it says, and positions from ``position`` on differ from what was sent."""
        self.end = self.engine = result.n_past
        self.delivered = min(self.delivered, position)
        if result.logits is not None:
            self.next_token = result.logits.token_id

    def resync(self, held: int) -> None:
        """After a failed step: the engine holds ``held`` (a rewriting prefill that began
        computing keeps only its reused prefix; anything else leaves the session as it was)."""
        if held < self.end:
            self.next_token = None  # it was chosen for a position that is gone
        self.end = min(self.end, held)
        self.engine = held
        self.delivered = min(self.delivered, held)

    def rewound(self, keep: int) -> None:
        """The session now holds ``[0, keep)`` (a Rewind, or a truncation after a failure)."""
        if keep < self.end:
            self.next_token = None
        self.end = min(self.end, keep)
        self.engine = min(self.engine, keep)
        self.delivered = min(self.delivered, keep)

    def sent(self, end: int) -> None:
        """Results up to ``end`` were handed to the transport."""
        self.delivered = end
