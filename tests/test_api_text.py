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
    # The naive reference: after each token, the first stop sequence anywhere in the text so far
    # (tokens arrive whole, so of the stops one token completes the earliest-starting wins, as
    # in llama.cpp's server).
    want = None
    for n in range(1, len(pieces) + 1):
        so_far = b"".join(pieces[:n]).decode("utf-8", "ignore")
        hits = [so_far.find(s) for s in stops if s and s in so_far]
        if hits:
            want = so_far[:min(hits)]
            break
    if want is not None:
        assert stopped and got == want
    else:
        assert not stopped and got == whole
        assert [t.piece for t in tokens] == pieces  # every token, in order, once
    assert not any(s and s in got for s in stops)
    # Released tokens are a prefix of the generated ones: every token whose text was sent (in
    # part, after a stop sequence that starts inside it), and no other.
    assert [t.piece for t in tokens] == pieces[:len(tokens)]
    # Token n covers the characters [ends[n-1], ends[n]): those its bytes complete, and the one
    # it leaves incomplete (a token that ends inside a character ends with that character).
    ends = [0]
    for n in range(1, len(pieces) + 1):
        data = b"".join(pieces[:n])
        complete = data.decode("utf-8", "ignore")
        ends.append(len(complete) + (len(complete.encode()) < len(data)))
    wanted = sum(1 for n in range(1, len(pieces) + 1)
                 if ends[n] <= len(got) or (stopped and ends[n - 1] < len(got)))
    assert len(tokens) == (wanted if stopped else len(pieces))


def test_offsets_say_where_each_tokens_text_starts() -> None:
    text = TextAssembler()
    deltas = [text.push(TokenOut(b"abx", 0.0)), text.push(TokenOut(b"q\xc3", 0.0)),
              text.push(TokenOut(b"\xa9!", 0.0)), text.finish()]
    assert "".join(d.text for d in deltas) == "abxq\u00e9!"
    assert [o for d in deltas for o in d.offsets] == [0, 3, 5]


def test_a_stop_inside_a_token_keeps_that_tokens_log_probs() -> None:
    text = TextAssembler(["ST"])
    delta = text.push(TokenOut(b"hello ST more", -0.5))
    assert (delta.text, [t.logprob for t in delta.tokens], text.stopped) == ("hello ", [-0.5], True)


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


@given(cut(), STOPS)
def test_text_is_held_back_only_while_it_may_start_a_stop_sequence(
        case: tuple[str, list[bytes]], stops: list[str]) -> None:
    """After every token, the client has all the text except the longest end of it that is a
    stop sequence's beginning (the naive definition: every length tried)."""
    _, pieces = case
    text, released = TextAssembler(stops), ""
    for n, piece in enumerate(pieces, 1):
        released += text.push(TokenOut(piece, 0.0)).text
        if text.stopped:
            return
        decoded = b"".join(pieces[:n]).decode("utf-8", "ignore")
        held = max([k for s in stops if s for k in range(1, len(s))
                    if decoded.endswith(s[:k])], default=0)
        assert released == decoded[:len(decoded) - held]


def test_an_output_held_back_whole_by_long_stop_sequences_is_released_at_the_end() -> None:
    """A stop sequence that the whole output begins holds it back to the end, beside long ones
    that never match (what costs each token its look is measured by bench/api/abuse.py)."""
    out = "ab" * 500
    stops = ["\x7f" * 1024, "a" * 1023 + "\x7f", "ab" * 511 + "x", out + "\x7f"]
    text = TextAssembler(stops)
    for i in range(0, len(out), 2):
        assert not text.push(TokenOut(out[i:i + 2].encode(), 0.0))  # all held back
        assert len(text._tokens) == i // 2 + 1
    assert text.finish().text == out
