"""How many tokens a speculative pass drafts: only as many as pay, from measured costs.

Why: a pass that verifies ``k`` drafted tokens costs the chain's traversal (a round trip per
hop, one step on each) plus ``k`` extra rows, and a row is not free: on Gemma 3 270M each
verified row costs the last shard nearly a whole step (its 262,144-token head), and drafting
every pass can make a real model slower than plain chain relay. A user who turns speculation on
must never lose, so the
pipeline measures what a pass costs and drafts only when the expected tokens per second beat
plain decoding.

The model (``PassCost``, kept by the ``Pipeline`` across its generations, as the batching
scheduler keeps ``LearnedTickCost``): a pass of ``k`` drafts takes ``traversal + k x per_row``;
``traversal`` is learned from passes without drafts, ``per_row`` from passes with them (their
time beyond ``traversal``, per draft), both moving averages. With chain relay, plain decoding
is not a pass the client steps but the workers' own loop (``Generate`` on the first hop: no
trip to the client per token), so its time per token (``loop``, learned from stretches of it)
is what drafting must beat. Per generation (``DraftPlanner``): each draft is accepted with
probability ``a`` once the ones before it were (a geometric run; ``a`` from this generation's
passes, decaying, starting at 1/2), so ``k`` drafts yield ``1 + a + ... + a^k`` tokens on
average. The planner drafts the ``k`` in ``0..K`` with the most tokens per second; ``k = 0`` is
plain decoding (with chain relay, a stretch of ``EXPLORE_EVERY`` tokens of the workers' loop).
Until the costs are known it measures them (a plain pass first, then one with drafts, and with
chain relay ``MEASURE_LOOP`` tokens of the loop unless a plain generation timed it already),
and while drafting does not pay it still tries one draft every ``EXPLORE_EVERY`` tokens, so a
text that becomes repetitive is noticed (at most one extra row per that many tokens).
"""

from __future__ import annotations

__all__ = ["EXPLORE_EVERY", "MEASURE_LOOP", "DraftPlanner", "PassCost"]

#: While drafting does not pay, one pass in this many drafts one token anyway (see the docs).
EXPLORE_EVERY = 32
#: Tokens of the workers' loop run to learn its speed when nothing has measured it yet.
MEASURE_LOOP = 8


def _ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


class PassCost:
    """A pass's expected duration, ``traversal + drafts x per_row``, learned from passes."""

    ALPHA = 0.3

    def __init__(self) -> None:
        self.traversal: float | None = None
        self.per_row: float | None = None
        self.loop: float | None = None  # chain relay: seconds per token of the workers' loop

    def observe(self, drafts: int, seconds: float) -> None:
        if drafts == 0:
            self.traversal = _ewma(self.traversal, seconds, self.ALPHA)
        elif self.traversal is not None:
            self.per_row = _ewma(self.per_row, max(seconds - self.traversal, 0.0) / drafts, self.ALPHA)

    def observe_loop(self, tokens: int, seconds: float) -> None:
        """A stretch of the workers' loop produced ``tokens`` in ``seconds`` (its first token
        pays the request's own trip, so one token says nothing about the loop)."""
        if tokens >= 2:
            self.loop = _ewma(self.loop, seconds / tokens, self.ALPHA)

    @property
    def known(self) -> bool:
        return self.traversal is not None and self.per_row is not None


class DraftPlanner:
    """How many tokens to draft on a generation's next pass (see the module docs)."""

    DECAY = 0.9  # per pass, on the acceptance counts: the text's repetitiveness changes

    def __init__(self, limit: int, cost: PassCost, *, loop: bool = False) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.limit = limit
        self.cost = cost
        self.loop = loop  # plain decoding is the workers' loop (chain relay)
        self._accepted = 1.0  # a Beta(1, 1) start: a = 1/2
        self._tried = 2.0
        self._since_draft = 0

    @property
    def acceptance(self) -> float:
        return self._accepted / self._tried

    def drafts(self) -> int:
        """Tokens to draft on the next pass (0: a plain pass)."""
        traversal, per_row = self.cost.traversal, self.cost.per_row
        if traversal is None:
            return 0  # measure a plain pass first
        if per_row is None:
            return self.limit  # then one with drafts
        if self.loop and self.cost.loop is None:
            return 0  # and, with chain relay, a short stretch of the workers' loop
        best = self.best(traversal, per_row)
        if best == 0 and self._since_draft + 1 >= EXPLORE_EVERY:
            return 1
        return best

    def best(self, traversal: float, per_row: float) -> int:
        """The ``k`` in ``0..limit`` with the most expected tokens per second."""
        a = self.acceptance
        plain = self.cost.loop if self.loop and self.cost.loop is not None else traversal
        best_k, best_rate = 0, 1.0 / max(plain, 1e-9)
        expected, run = 1.0, 1.0
        for k in range(1, self.limit + 1):
            run *= a
            expected += run
            rate = expected / max(traversal + k * per_row, 1e-9)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def stretch(self) -> int:
        """Tokens of the workers' loop to run when ``drafts()`` said 0 (chain relay)."""
        return MEASURE_LOOP if self.cost.loop is None else EXPLORE_EVERY

    def looped(self, tokens: int, seconds: float) -> None:
        """A stretch of the workers' loop produced ``tokens`` in ``seconds``."""
        self.cost.observe_loop(tokens, seconds)
        self._since_draft += tokens

    def passed(self, drafts: int, accepted: int, seconds: float) -> None:
        """A pass with ``drafts`` drafted tokens, ``accepted`` of them kept, took ``seconds``."""
        self.cost.observe(drafts, seconds)
        if drafts == 0:
            self._since_draft += 1
            return
        self._since_draft = 0
        self._accepted = self._accepted * self.DECAY + accepted
        # A run of ``accepted`` hits, then a miss unless every draft was kept.
        self._tried = self._tried * self.DECAY + accepted + (1 if accepted < drafts else 0)
