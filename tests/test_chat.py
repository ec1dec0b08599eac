"""Chat templates (``shard.chat``): the special-token texts in users' messages are broken
exactly where a longest-first search finds them, whatever the texts and the message."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from shard.chat import WORD_JOINER, ChatTemplate, _trie_pattern

#: A small alphabet, so that texts share prefixes and overlap in messages.
_CHARS = st.sampled_from("<>|ab")
_TEXTS = st.sets(st.text(_CHARS, min_size=1, max_size=6), min_size=1, max_size=12)


def _longest_first(texts: set[str]) -> re.Pattern[str]:
    """The plain definition: an alternation tried longest text first."""
    return re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True))))


@given(_TEXTS, st.text(_CHARS, max_size=60))
def test_the_trie_finds_what_a_longest_first_alternation_finds(texts: set[str], message: str) -> None:
    trie = re.compile(_trie_pattern(texts))
    assert [m.span() for m in trie.finditer(message)] == \
        [m.span() for m in _longest_first(texts).finditer(message)]


@given(_TEXTS, st.text(_CHARS, max_size=60))
def test_neutralise_breaks_each_special_text_after_its_first_character(
        texts: set[str], message: str) -> None:
    template = ChatTemplate("{{ messages[0].content }}", special_texts=tuple(texts))
    expected = _longest_first(texts).sub(lambda m: m.group()[0] + WORD_JOINER + m.group()[1:], message)
    out = template.neutralise(message)
    assert out == expected
    assert out.replace(WORD_JOINER, "") == message
    assert template.render([{"role": "user", "content": message}]) == out


def test_a_real_vocabularys_texts_share_one_branch_per_first_character() -> None:
    """Thousands of texts starting with ``<`` make one branch at the top, not thousands (the
    plain alternation tried each of them at every ``<`` of a message)."""
    texts = {f"<unused{i}>" for i in range(6000)} | {"<start_of_turn>", "<end_of_turn>", "[@BOS@]"}
    pattern = _trie_pattern(texts)
    assert pattern.startswith("(?:<") and pattern.count("|<") == 0
    assert ChatTemplate("x", special_texts=tuple(texts)).neutralise("<<unused12><unused1x") == \
        f"<<{WORD_JOINER}unused12><unused1x"
