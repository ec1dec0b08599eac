"""Generated tokens into the text a client sees: UTF-8 across token boundaries, stop sequences
matched across them and never emitted.

Tokens carry raw bytes (``Logits.piece``), and one character may span tokens, so pieces go
through one incremental decoder. A stop sequence may span tokens too: text that could be the
start of one is held back until the next token says whether it is; once one matches, the text
before it is released and the generation ends (``finish_reason`` "stop"). A token's log-probs
are released with the last of its text, so a client never sees a token whose text it was not
sent; tokens of a matched stop sequence are not sent at all (they still count as generated).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Alternative", "Delta", "TextAssembler", "TokenOut"]


def token_text(piece: bytes) -> str:
    """A token's own text (a piece that splits a character shows U+FFFD for it)."""
    return piece.decode("utf-8", "replace")


@dataclass(frozen=True)
class Alternative:
    piece: bytes
    logprob: float

    @property
    def text(self) -> str:
        return token_text(self.piece)


@dataclass(frozen=True)
class TokenOut:
    """One generated token, for log-probs (``logprob`` None: an echoed prompt's first token,
    which nothing precedes)."""

    piece: bytes
    logprob: float | None
    top: tuple[Alternative, ...] = ()

    @property
    def text(self) -> str:
        return token_text(self.piece)


@dataclass
class Delta:
    """Text released to the client, and the tokens whose text it completes, with where each
    token's text starts in the whole completion (a completion's ``text_offset``)."""

    text: str = ""
    tokens: list[TokenOut] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    index: int = 0  # the choice it belongs to (a request's ``n``)

    def __bool__(self) -> bool:
        return bool(self.text or self.tokens)


class TextAssembler:
    """Feed every token (``push``), then ``finish``; each returns the ``Delta`` to send."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self._stops = tuple(s for s in stops if s)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._sent = 0  # characters released
        self._tail = ""  # decoded text not released yet (it starts at ``_sent``)
        #: held tokens: (token, where its text starts, where it ends), in characters
        self._tokens: list[tuple[TokenOut, int, int]] = []
        self._end = 0  # where the last token's text ends
        self.stopped = False

    def push(self, token: TokenOut) -> Delta:
        """Add one token. After a stop sequence matched (``stopped``) the generation is over:
        further tokens are ignored."""
        if self.stopped:
            return Delta()
        self._tail += self._decoder.decode(token.piece)
        # A token that ends inside a character ends with that character (the next one).
        pending = bool(self._decoder.getstate()[0])
        start, self._end = self._end, self._sent + len(self._tail) + pending
        self._tokens.append((token, start, self._end))
        # No stop sequence can start in released text: its start would have been held back.
        hits = [i for i in (self._tail.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            return self._release(self._sent + min(hits), stop=True)
        return self._release(self._sent + len(self._tail) - self._held_back())

    def finish(self) -> Delta:
        """The generation ended without a stop sequence: release everything held."""
        if self.stopped:
            return Delta()
        self._tail += self._decoder.decode(b"", final=True)
        return self._release(self._sent + len(self._tail), flush=True)

    def _held_back(self) -> int:
        """Characters at the end that are the start of a stop sequence.

        Only where a stop's first character occurs can its start be; ``str.find`` jumps
        between those places and one comparison checks each, both in C (trying every length
        was a Python loop of as many steps as the tail has characters, for every stop and
        every token)."""
        tail, longest = self._tail, 0
        for stop in self._stops:
            at = tail.find(stop[0], max(len(tail) - len(stop) + 1, 0), len(tail) - longest)
            while at >= 0:
                if stop.startswith(tail[at:]):
                    longest = len(tail) - at
                    break
                at = tail.find(stop[0], at + 1, len(tail) - longest)
        return longest

    def _release(self, end: int, *, stop: bool = False, flush: bool = False) -> Delta:
        """Release the text up to ``end`` with the tokens it completes (after a stop: the
        tokens any released text is from; their text past ``end`` is the stop's, never sent)."""
        cut = max(end - self._sent, 0)
        delta = Delta(self._tail[:cut])
        self._tail, self._sent = self._tail[cut:], self._sent + cut
        # Tokens are in order: the released ones are the first ones (looking at the others
        # too made a long held-back text quadratic in its tokens).
        released = 0
        for token, start, token_end in self._tokens:
            if not (flush or token_end <= end or (stop and start < end)):
                break
            delta.tokens.append(token)
            delta.offsets.append(start)
            released += 1
        if stop:
            self._tokens = []
        elif released:
            del self._tokens[:released]
        return delta
