"""Contract tests of tokenization and token pieces (special-token texts parsed only when asked)."""

from __future__ import annotations

from ..factories import EngineFactory
from .harness import (
    prefill,
)


class Tokens:
    """Tokenize and token pieces."""

    async def test_tokenize_and_pieces(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            caps = engine.capabilities()
            with_bos = engine.tokenize("hello world")
            without = engine.tokenize("hello world", add_bos=False)
            assert with_bos[0] == caps.bos_token_id and with_bos[1:] == without
            assert all(0 <= t < caps.n_vocab for t in with_bos)
            text = b"".join(engine.token_piece(t) for t in without)
            assert b"hello" in text and b"world" in text

    async def test_special_token_texts_are_parsed_only_when_asked(
        self, engine_factory: EngineFactory
    ) -> None:
        """A chat template's markers must become special tokens; a user's text must not."""
        async with engine_factory.open() as engine:
            caps = engine.capabilities()
            assert caps.chat.bos_token and caps.chat.eos_token and caps.bos_token_id is not None
            assert caps.chat.add_bos is (engine.tokenize("x")[0] == caps.bos_token_id)
            text = f"hello{caps.chat.eos_token}world"
            parsed = engine.tokenize(text, add_bos=False, parse_special=True)
            plain = engine.tokenize(text, add_bos=False)
            assert caps.eos_token_id in parsed and caps.eos_token_id not in plain
            assert parsed == (*engine.tokenize("hello", add_bos=False), caps.eos_token_id,
                              *engine.tokenize("world", add_bos=False))
            # A step's top alternatives carry their pieces, as the chosen token does.
            await engine.open_session("s")
            r = await prefill(engine, "s", list(engine.tokenize("hello world")), top_k_logprobs=4)
            assert r.logits is not None and len(r.logits.top) == 4
            assert all(t.piece == engine.token_piece(t.token_id) for t in r.logits.top)
