"""Drafting tokens for speculative verification by prompt lookup: no draft model needed.

Why prompt lookup: a pipeline's cost per token is a traversal of the chain (one round trip per
hop), not compute, so any draft that is right some of the time pays, and the cheapest one is in
the text itself. Lists, code, tables and quoted passages repeat n-grams of the prompt and of the
output so far; when the last ``n`` tokens occurred before, the tokens that followed them then
are a good guess for what follows now. The pipeline verifies the guess in one traversal
(``Prefill.all_logits`` on the last shard) and keeps the longest prefix the model agrees with,
so a wrong draft costs only the positions it occupied, never a token of output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["Drafter", "PromptLookup"]


class Drafter(Protocol):
    """Anything that guesses the next tokens (the pipeline verifies every guess)."""

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens likely to follow ``history`` (its last element is the newest)."""
        ...


class PromptLookup:
    """Propose the tokens that followed the latest earlier occurrence of the history's last
    ``n``-gram, trying ``max_ngram`` down to ``min_ngram`` (longer matches are surer).

    Why ``min_ngram=2`` by default: a drafted row is not free (on Gemma 3 270M each verified
    row costs the last shard nearly a whole step, its 262,144-token head), and a single
    repeated token is a poor predictor: requiring two tokens of context verifies far fewer rows
    for a few more passes (docs/pipelines.md, "Speculative verification").
    """

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``history`` (its last element is the newest token);
        empty when no n-gram of the configured sizes occurred before."""
        if k < 1:
            return []
        hist = list(history)
        size = len(hist)
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            tail = hist[size - n:]
            # Latest start i < size - n with hist[i:i+n] == tail (the newest repeat is the
            # likeliest to go on the same way: a loop, the current row of a list).
            for i in range(size - n - 1, -1, -1):
                if hist[i:i + n] == tail:
                    return _continue(hist, i + n, k)
        return []


def _continue(hist: list[int], start: int, k: int) -> list[int]:
    """``k`` tokens from ``hist[start:]``; a match near the end (a loop of period
    ``len(hist) - start``) goes on repeating the loop instead of stopping short."""
    period = len(hist) - start
    return [hist[start + j % period] for j in range(k)]
