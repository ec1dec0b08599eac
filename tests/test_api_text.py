"""The front door's text assembly (``shard.api.text``): whatever way the bytes are cut into
tokens, the client gets the text up to the first stop sequence, never the stop sequence, and
each token's log-probs with the last of its text (property tests)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shard.api.text import TextAssembler, TokenOut

ALPHABET = st.sampled_from(["a", "b", "c", " ", "\n", "é", "€", "ab", "ba"])
TEXTS = st.lists(ALPHABET, max_size=30).map("".join)
STOPS = st.lists(st.lists(ALPHABET, min_size=1, max_size=3).map("".join), max_size=4)


@st.composite
def cut(draw: st.DrawFn) -> tuple[str, list[bytes]]:
    """A text and its UTF-8 bytes cut at arbitrary points (a character may span tokens)."""
    text = draw(TEXTS)
    data = text.encode()
    points = sorted(draw(st.sets(st.integers(1, max(len(data) - 1, 1)), max_size=len(data))))
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)]) if a < b]
    return text, pieces


def assemble(pieces: list[bytes], stops: list[str]) -> tuple[str, list[TokenOut], bool]:
    text = TextAssembler(stops)
    out, tokens = [], []
    for i, piece in enumerate(pieces):
        delta = text.push(TokenOut(piece, -float(i)))
        out.append(delta.text)
        tokens.extend(delta.tokens)
        if text.stopped:
            break
    else:
        delta = text.finish()
        out.append(delta.text)
        tokens.extend(delta.tokens)
    return "".join(out), tokens, text.stopped


@given(cut(), STOPS)
def test_the_text_ends_before_the_first_stop_sequence(case: tuple[str, list[bytes]], stops: list[str]) -> None:
    whole, pieces = case
    got, tokens, stopped = assemble(pieces, stops)
    hits = [whole.find(s) for s in stops if s and s in whole]
    if hits:
        assert stopped and got == whole[:min(hits)]
    else:
        assert not stopped and got == whole
        assert [t.piece for t in tokens] == pieces  # every token, in order, once
    assert not any(s and s in got for s in stops)
    # Released tokens are a prefix of the generated ones, and their bytes never run past the
    # released text (a token is sent with the last of its text).
    assert [t.piece for t in tokens] == pieces[:len(tokens)]
    assert len(b"".join(t.piece for t in tokens)) <= len(got.encode()) or not stopped


def test_a_stop_sequence_split_over_tokens_is_held_back_then_dropped() -> None:
    text = TextAssembler(["END"])
    assert text.push(TokenOut(b"fin E", 0.0)).text == "fin "
    assert text.push(TokenOut(b"N", 0.0)).text == ""
    delta = text.push(TokenOut(b"D and more", 0.0))
    assert delta.text == "" and text.stopped
    assert text.push(TokenOut(b"x", 0.0)).text == "" and text.finish().text == ""


def test_a_false_start_is_released_once_it_cannot_be_a_stop() -> None:
    text = TextAssembler(["END"])
    assert text.push(TokenOut(b"E", 0.0)).text == ""
    delta = text.push(TokenOut(b"x", 0.0))
    assert delta.text == "Ex" and len(delta.tokens) == 2 and not text.stopped
