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
    """One generated token, for log-probs."""

    piece: bytes
    logprob: float
    top: tuple[Alternative, ...] = ()

    @property
    def text(self) -> str:
        return token_text(self.piece)


@dataclass
class Delta:
    """Text released to the client, and the tokens whose text it completes."""

    text: str = ""
    tokens: list[TokenOut] = field(default_factory=list)
    #: Offset of ``text`` in the whole completion (a completion's ``text_offset``).
    offset: int = 0

    def __bool__(self) -> bool:
        return bool(self.text or self.tokens)


class TextAssembler:
    """Feed every token (``push``), then ``finish``; each returns the ``Delta`` to send."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self._stops = tuple(s for s in stops if s)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""  # everything decoded so far
        self._sent = 0  # characters of it released
        self._tokens: list[tuple[TokenOut, int]] = []  # held tokens, with where their text ends
        self.stopped = False

    def push(self, token: TokenOut) -> Delta:
        """Add one token. After a stop sequence matched (``stopped``) the generation is over:
        further tokens are ignored."""
        if self.stopped:
            return Delta(offset=self._sent)
        self._text += self._decoder.decode(token.piece)
        # A token that ends inside a character ends with that character (the next one).
        pending = bool(self._decoder.getstate()[0])
        self._tokens.append((token, len(self._text) + pending))
        # No stop sequence can start in released text: its start would have been held back.
        hits = [i for i in (self._text.find(s, self._sent) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            return self._release(min(hits), stop=True)
        return self._release(len(self._text) - self._held_back())

    def finish(self) -> Delta:
        """The generation ended without a stop sequence: release everything held."""
        if self.stopped:
            return Delta(offset=self._sent)
        self._text += self._decoder.decode(b"", final=True)
        if self._tokens:  # the decoder's flush belongs to the last token
            self._tokens[-1] = (self._tokens[-1][0], len(self._text))
        return self._release(len(self._text), flush=True)

    def _held_back(self) -> int:
        """Characters at the end that are the start of a stop sequence."""
        tail = self._text[self._sent:]
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(tail)), longest, -1):
                if tail.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _release(self, end: int, *, stop: bool = False, flush: bool = False) -> Delta:
        delta = Delta(self._text[self._sent:end], offset=self._sent)
        self._sent = max(self._sent, end)
        keep = []
        for token, token_end in self._tokens:
            if token_end <= end or flush:
                delta.tokens.append(token)
            elif not stop:
                keep.append((token, token_end))
        self._tokens = keep
        return delta
