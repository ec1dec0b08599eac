"""Contract tests of ``decode_group``: the rows of many sessions submitted together, each row
still its own session's decode (its result, its failure, its cancellation, its rollback)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import trio

from shard.engine import (
    DecodeRequest,
    EngineCancelled,
    EngineError,
    IllegalTransition,
    Lookahead,
    SessionBusy,
    SessionState,
    ShardEngine,
    StepResult,
    UnknownSession,
)

from ..factories import EngineFactory
from .harness import assert_same_logits, decode, prefill, prompt_tokens, start_op, wait_running, whole_options

SIDS = ("a", "b", "c")


async def _open_rows(engine: ShardEngine, sids: Sequence[str] = SIDS) -> dict[str, int]:
    """Open and prefill each session (its own prompt); the greedy token each decodes next."""
    nxt = {}
    for i, sid in enumerate(sids):
        await engine.open_session(sid)
        r = await prefill(engine, sid, prompt_tokens(engine, 6 + 2 * i, salt=i))
        assert r.logits is not None
        nxt[sid] = r.logits.token_id
    return nxt


def _ok(outcome: StepResult | EngineError) -> StepResult:
    assert isinstance(outcome, StepResult), outcome
    return outcome


class Groups:
    """A group's rows compute what each session's decode computes, and fail, stop and roll
    back alone."""

    @pytest.mark.parametrize("hint", [False, True], ids=["plain", "lookahead"])
    async def test_a_groups_rows_compute_what_each_decode_computes(
        self, engine_factory: EngineFactory, hint: bool
    ) -> None:
        async with engine_factory.open(whole_options(max_sessions=8)) as engine:
            # The reference: each session's decodes alone, one session after the other.
            refs: dict[str, list[StepResult]] = {}
            for sid, token in (await _open_rows(engine, [f"ref-{s}" for s in SIDS])).items():
                refs[sid[4:]] = []
                for _ in range(3):
                    r = await decode(engine, sid, token, top_k_logprobs=2)
                    refs[sid[4:]].append(r)
                    assert r.logits is not None
                    token = r.logits.token_id
            nxt = await _open_rows(engine)
            for step in range(3):
                outcomes = await engine.decode_group([
                    DecodeRequest(sid, token=nxt[sid], top_k_logprobs=2,
                                  lookahead=Lookahead() if hint else None) for sid in SIDS])
                for sid, outcome in zip(SIDS, outcomes, strict=True):
                    got, ref = _ok(outcome), refs[sid][step]
                    assert got.session_id == sid and got.n_past == ref.n_past
                    assert_same_logits(got, ref)
                    assert got.logits is not None
                    nxt[sid] = got.logits.token_id
            for sid in SIDS:
                info = engine.session_info(sid)
                assert info.state is SessionState.IDLE and info.n_past == refs[sid][-1].n_past

    async def test_a_rows_failure_is_that_rows_only(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open(whole_options(max_sessions=8)) as engine:
            nxt = await _open_rows(engine, ("a", "b"))
            await engine.open_session("empty")
            before = {sid: engine.session_info(sid).n_past for sid in ("a", "b")}
            outcomes = await engine.decode_group([
                DecodeRequest("a", token=nxt["a"]),
                DecodeRequest("nope", token=nxt["a"]),
                DecodeRequest("b", token=nxt["b"]),
                DecodeRequest("b", token=nxt["b"]),  # named twice: the second is busy
                DecodeRequest("empty", token=nxt["a"]),  # nothing prefilled
            ])
            assert _ok(outcomes[0]).n_past == before["a"] + 1
            assert isinstance(outcomes[1], UnknownSession)
            assert _ok(outcomes[2]).n_past == before["b"] + 1
            assert isinstance(outcomes[3], SessionBusy)
            assert isinstance(outcomes[4], IllegalTransition)
            for sid in ("a", "b", "empty"):
                assert engine.session_info(sid).state is SessionState.IDLE
            assert engine.session_info("b").n_past == before["b"] + 1
            assert engine.metrics().operations_running == 0

    @pytest.mark.parametrize("how", ["cancel", "release"])
    async def test_a_rows_session_stopped_mid_group_stops_that_row_only(
        self, engine_factory: EngineFactory, how: str
    ) -> None:
        async with engine_factory.open(whole_options(max_sessions=8)) as engine:
            nxt = await _open_rows(engine)
            held = {sid: engine.session_info(sid).n_past for sid in SIDS}
            cells = engine.metrics().kv_cells_used
            async with trio.open_nursery() as nursery:
                op = start_op(nursery, engine.decode_group,
                              [DecodeRequest(sid, token=nxt[sid]) for sid in SIDS])
                await wait_running(engine, "b")
                # Every row is RUNNING once the group started: a cancel of any is never lost.
                assert all(engine.session_info(sid).state is SessionState.RUNNING for sid in SIDS)
                if how == "cancel":
                    assert engine.cancel("b") is True
                else:
                    assert await engine.release("b") is True
            assert op.error is None and not op.caller_cancelled
            a, b, c = op.value
            assert isinstance(b, EngineCancelled), b
            assert _ok(a).n_past == held["a"] + 1 and _ok(c).n_past == held["c"] + 1
            if how == "cancel":  # rolled back: as it was, and it decodes as it would have
                info = engine.session_info("b")
                assert info.state is SessionState.IDLE and info.n_past == held["b"]
                assert engine.metrics().kv_cells_used == cells + 2
                assert _ok((await engine.decode_group([DecodeRequest("b", token=nxt["b"])]))[0]
                           ).n_past == held["b"] + 1
            else:
                with pytest.raises(UnknownSession):
                    engine.session_info("b")
            assert engine.metrics().operations_running == 0

    async def test_a_cancelled_caller_rolls_back_every_row(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open(whole_options(max_sessions=8)) as engine:
            nxt = await _open_rows(engine)
            held = {sid: engine.session_info(sid).n_past for sid in SIDS}
            cells = engine.metrics().kv_cells_used
            async with trio.open_nursery() as nursery:
                op = start_op(nursery, engine.decode_group,
                              [DecodeRequest(sid, token=nxt[sid]) for sid in SIDS])
                await wait_running(engine, "a")
                op.scope.cancel()
            assert op.caller_cancelled and op.value is None
            for sid in SIDS:
                info = engine.session_info(sid)
                assert info.state is SessionState.IDLE and info.n_past == held[sid]
            assert engine.metrics().kv_cells_used == cells
            assert engine.metrics().operations_running == 0
            outcomes = await engine.decode_group([DecodeRequest(sid, token=nxt[sid]) for sid in SIDS])
            assert [_ok(o).n_past for o in outcomes] == [held[sid] + 1 for sid in SIDS]
