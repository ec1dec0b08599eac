"""The choices of one request (``n``, ``best_of``): each one's text, counts and score, and
which of them the client gets.

Why apart from the backend: a request of ``n`` choices is ``n`` streams of text, each with its
own stop sequences, finish reason and tokens, and with ``best_of`` the door generates more than
it returns and keeps the ``n`` whose tokens have the highest summed log-probability (OpenAI's
rule). Their deltas then wait here until every choice ended; with ``best_of == n`` (the only
kind that streams) each delta goes out at once, tagged with its choice's ``index``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shard.v1 import shard_pb2 as pb

from .text import Alternative, Delta, TextAssembler, TokenOut

__all__ = ["ChoiceText", "best"]

_LENGTH = frozenset({pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_CONTEXT_FULL})


class ChoiceText:
    """One choice: its text so far (stop sequences), its tokens, its summed log-probability
    and its finish. ``held``: its deltas wait for the ranking (``best_of`` above ``n``)."""

    def __init__(self, index: int, stops: Sequence[str], *, held: bool = False,
                 preserved: Mapping[int, bytes] | None = None) -> None:
        self.index = index
        #: Control tokens whose text the choice keeps (``Request.preserved``): id -> text.
        self.preserved = preserved or {}
        self.text = TextAssembler(stops)
        self.tokens = 0
        self.logprob = 0.0
        self.finish = pb.FINISH_REASON_UNSPECIFIED
        self.held: list[Delta] | None = [] if held else None
        #: Where the generated text starts in the choice's text (an echoed prompt's length).
        self.offset = 0

    @property
    def stopped(self) -> bool:
        """A stop sequence matched: the choice is over (its generation is ended)."""
        return self.text.stopped

    def push(self, step: pb.StepResult) -> Delta | None:
        """One generated token; the delta to send now (None: nothing yet, or held)."""
        self.tokens += 1
        lg = step.logits
        self.logprob += lg.logprob
        self.finish = step.finish_reason
        piece = lg.piece or self.preserved.get(lg.token_id, b"")  # (a control token: b"")
        delta = self.text.push(TokenOut(piece, lg.logprob, tuple(
            Alternative(t.piece, t.logprob) for t in lg.top)))
        return self._out(delta)

    def echo(self, prompt: Delta) -> Delta | None:
        """The echoed prompt (``shard.api.echo``), before any generated text: the delta to
        send now (None: held), its own copy; the generated text's offsets continue after it."""
        delta = self._out(Delta(prompt.text, list(prompt.tokens), list(prompt.offsets)))
        self.offset = len(prompt.text)
        return delta

    def end(self) -> Delta | None:
        """The generation ended: the text still held back, to send now (None: nothing)."""
        return None if self.stopped else self._out(self.text.finish())

    @property
    def reason(self) -> str:
        """OpenAI's finish reason: "length" when a limit ended it, "stop" otherwise."""
        return "length" if self.finish in _LENGTH and not self.stopped else "stop"

    def _out(self, delta: Delta) -> Delta | None:
        if not delta:
            return None
        delta.index = self.index
        if self.offset:
            delta.offsets = [o + self.offset for o in delta.offsets]
        if self.held is not None:
            self.held.append(delta)
            return None
        return delta


def best(choices: Sequence[ChoiceText], n: int) -> list[ChoiceText]:
    """The ``n`` choices with the highest summed log-probability, best first (ties: the lower
    index), their held deltas renumbered to the places they get (0..n-1)."""
    ranked = sorted(choices, key=lambda c: (-c.logprob, c.index))[:n]
    for place, choice in enumerate(ranked):
        for delta in choice.held or ():
            delta.index = place
    return ranked
