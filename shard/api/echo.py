"""An echoed prompt's tokens with their log-probs (``/v1/completions`` with ``echo`` and
``logprobs``, what evaluation harnesses score a text with): the first delta of each choice.

Why a delta: the reply already turns deltas into legacy log-probs (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``), streamed or whole. The prompt's tokens
come first, the first one with null log-probs (nothing precedes it), each later one with its
log-prob under the positions before it (the pipeline's ``prompt_logprobs``); the text is the
prompt as its tokens spell it, and the completion's offsets continue after it
(``ChoiceText.offset``).
"""

from __future__ import annotations

from collections.abc import Sequence

from shard.pipeline.result import PromptLogprob

from .text import Alternative, Delta, TextAssembler, TokenOut

__all__ = ["prompt_delta"]


def prompt_delta(pieces: Sequence[bytes], scored: Sequence[PromptLogprob]) -> Delta:
    """The prompt's tokens (``pieces``: each one's bytes; ``scored``: every one's but the
    first's log-prob and alternatives) as one delta, each token with where its text starts."""
    if len(scored) != max(len(pieces) - 1, 0):
        raise ValueError(f"{len(scored)} log-probs for a prompt of {len(pieces)} tokens")
    text = TextAssembler()
    out = Delta()
    for i, piece in enumerate(pieces):
        if i == 0:
            token = TokenOut(piece, None)
        else:
            s = scored[i - 1]
            token = TokenOut(piece, s.logprob, tuple(Alternative(t.piece, t.logprob) for t in s.top))
        _extend(out, text.push(token))
    _extend(out, text.finish())
    return out


def _extend(out: Delta, more: Delta) -> None:
    out.text += more.text
    out.tokens.extend(more.tokens)
    out.offsets.extend(more.offsets)
