"""llama.cpp's fork specifics: the copy between streams happens at the next native step, so a
state read or write before it is refused (``KvCells.copies_pending``), not served stale."""

from __future__ import annotations

import pytest

from shard.engine import SessionBusy
from shard.testing import llama_factory
from shard.testing.contract.harness import decode, prefill, prompt_tokens, whole_options


async def test_a_forks_state_moves_only_once_its_copy_was_performed() -> None:
    """Exporting the fork before any step is refused; after one step on the source the fork's
    export holds the source's cells, and an import of it goes on as the source does."""
    factory = llama_factory("tiny", n_threads=1)
    async with factory.open(whole_options()) as engine, factory.open(whole_options()) as other:
        await engine.open_session("src")
        prompt = prompt_tokens(engine, 20, salt=4)
        first = await prefill(engine, "src", prompt)
        assert first.logits is not None
        await engine.fork_session("src", "fork")
        with pytest.raises(SessionBusy):
            await engine.export_session("fork")
        assert engine.health().ready
        nxt = first.logits.token_id
        here = await decode(engine, "src", nxt)  # a native step: the copy is performed
        snap = await engine.export_session("fork")
        assert snap.n_past == len(prompt) and snap.tokens == prompt
        await other.open_session("moved")
        await other.import_session("moved", snap)
        there = await decode(other, "moved", nxt)
        assert here.logits is not None and there.logits is not None
        assert here.logits.token_id == there.logits.token_id
