"""Contract tests of session hand-off: ``export_session`` on one engine, ``import_session`` on
another of the same model and range (how a draining worker moves its sessions)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shard.engine import (
    DecodeRequest,
    EngineError,
    IllegalTransition,
    IncompatibleState,
    InvalidInput,
    KvCacheFull,
    Lookahead,
    PrefillRequest,
    SessionSnapshot,
    SessionState,
    UnknownSession,
)

from ..factories import EngineFactory, EngineOptions, ShardPart
from .harness import (
    assert_same_logits,
    decode,
    prefill,
    prompt_tokens,
)


class HandOff:
    """A session's state exported from one engine and imported into another."""

    @pytest.mark.parametrize("part", [ShardPart.WHOLE, ShardPart.LAST], ids=lambda p: p.value)
    async def test_a_session_moves_to_another_engine_and_goes_on_there(
        self, engine_factory: EngineFactory, part: ShardPart
    ) -> None:
        """``export_session`` on one engine and ``import_session`` on another of the same model
        and range: the copy holds the same positions (and token ids, on a first shard) and its
        next step equals the original's; a step computed ahead is not part of the state; the
        original goes on as before. (Session hand-off on drain.)"""
        if part is not ShardPart.WHOLE and not engine_factory.layer_ranges:
            return
        options = EngineOptions(part=part)
        async with engine_factory.open(options) as a, engine_factory.open(options) as b:
            caps = a.capabilities()
            assert caps.kv_layout and caps.kv_layout == b.capabilities().kv_layout
            await a.open_session("s")
            if caps.is_first:
                history = prompt_tokens(a, 40, salt=9)
                first = await prefill(a, "s", history, lookahead=Lookahead())
                assert first.logits is not None
                nxt = first.logits.token_id
                await decode(a, "s", nxt, lookahead=Lookahead())  # a step computed ahead
                n_past = 41
            else:
                rows = np.random.default_rng(3).standard_normal((41, caps.n_embd)).astype(np.float32)
                await a.prefill(PrefillRequest("s", hidden_states=rows))
                n_past = 41
            snap = await a.export_session("s")
            assert isinstance(snap, SessionSnapshot) and snap.n_past == n_past
            assert snap.kv_layout == caps.kv_layout
            assert 0 < len(snap.data) <= a.state_bytes_bound(n_past)
            if caps.is_first:
                assert snap.tokens == (*history, nxt)
            else:
                assert snap.tokens is None
            assert a.metrics().lookahead_cells == 0 and a.metrics().kv_cells_used == n_past
            await b.open_session("copy")
            info = await b.import_session("copy", snap)
            assert (info.n_past, info.tokens, info.state) == (n_past, snap.tokens, SessionState.IDLE)
            assert b.metrics().kv_cells_used == n_past
            assert (a.metrics().sessions_exported_total, b.metrics().sessions_imported_total) == (1, 1)
            if caps.is_first:
                here, there = await decode(a, "s", 7), await decode(b, "copy", 7)
            else:
                row = np.random.default_rng(4).standard_normal((1, caps.n_embd)).astype(np.float32)
                here = await a.decode(DecodeRequest("s", hidden_state=row))
                there = await b.decode(DecodeRequest("copy", hidden_state=row))
            assert here.n_past == there.n_past == n_past + 1
            assert_same_logits(here, there)
            for engine, sid in ((a, "s"), (b, "copy")):
                await engine.release(sid)
                assert engine.metrics().kv_cells_used == 0

    async def test_an_import_that_does_not_fit_is_refused_and_leaves_the_session_empty(
        self, engine_factory: EngineFactory
    ) -> None:
        """Another layout, more positions than the budget, token ids that do not match the
        positions, more bytes than the positions take, bytes the engine cannot read, a session
        that holds positions already: each refused with its typed error, the session left
        empty and usable, the engine healthy."""
        async with engine_factory.open() as a, engine_factory.open() as b:
            await a.open_session("s")
            history = prompt_tokens(a, 12, salt=4)
            await prefill(a, "s", history)
            snap = await a.export_session("s")
            await b.open_session("t", kv_budget=8)
            await b.open_session("u")
            await prefill(b, "u", history[:3])
            r = dataclasses.replace
            refused: list[tuple[str, SessionSnapshot, type[EngineError]]] = [
                ("t", r(snap, kv_layout=snap.kv_layout + "/other"), IncompatibleState),
                ("t", snap, KvCacheFull),  # 12 positions, a budget of 8
                ("u", snap, IllegalTransition),  # holds 3 positions already
                ("nope", snap, UnknownSession),
            ]
            await b.open_session("v")
            refused += [
                ("v", r(snap, tokens=snap.tokens[:-1]), InvalidInput),  # type: ignore[index]
                ("v", r(snap, tokens=None), InvalidInput),  # a first shard's state has its ids
                ("v", r(snap, n_past=0), InvalidInput),
                ("v", r(snap, data=b""), InvalidInput),
                ("v", r(snap, data=snap.data + bytes(b.state_bytes_bound(12))), InvalidInput),
                ("v", r(snap, data=snap.data[: len(snap.data) // 2]), IncompatibleState),
                ("v", r(snap, data=snap.data[:-1]), IncompatibleState),
            ]
            for sid, bad, error in refused:
                with pytest.raises(error):
                    await b.import_session(sid, bad)
                assert b.health().ready
            for sid in ("t", "v"):
                assert b.session_info(sid).n_past == 0
            assert b.metrics().kv_cells_used == 3  # "u"'s
            assert b.metrics().sessions_imported_total == 0
            # the refused sessions stay usable: the state fits "v" and is imported after all
            assert (await b.import_session("v", snap)).n_past == 12
            assert_same_logits(await decode(b, "v", 9), await decode(a, "s", 9))
            assert (await prefill(b, "t", history[:5])).n_past == 5
