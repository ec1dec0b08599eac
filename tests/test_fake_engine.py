"""Fake-engine specifics: layer ranges, scripted latency and scripted failures.

The common lifecycle rules are in the shared contract suite (tests/test_engine_contract.py);
this file covers what only the fake can script deterministically.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import trio
import trio.testing

from shard.engine import (
    DecodeRequest,
    EngineCancelled,
    EngineFailure,
    EngineState,
    InvalidInput,
    LayerRange,
    LoadSpec,
    NotReady,
    PrefillRequest,
    ResultKind,
    SamplingParams,
    SessionState,
    UnknownSession,
)
from shard.engine.fake import FakeEngine, FakeModel, FakeScript, FakeStep
from shard.testing import prompt_tokens, start_op, wait_running

TOKENS = (1, 40, 41, 42, 99, 120, 7, 8, 200, 13)


async def loaded(
    model: FakeModel | None = None,
    script: FakeScript | None = None,
    layers: LayerRange | None = None,
    **spec: int,
) -> FakeEngine:
    engine = FakeEngine(model, script)
    await engine.load(LoadSpec(layer_range=layers, **spec))
    return engine


async def run_chain(ranges: list[LayerRange], tokens: tuple[int, ...], n_decode: int = 3,
                    model: FakeModel | None = None) -> list[np.ndarray]:
    """Run ``tokens`` through shards covering ``ranges`` in order; return each step's logits
    vector (reconstructed from the top-64 logprobs) from the last shard."""
    engines = [await loaded(model, layers=r) for r in ranges]
    out: list[np.ndarray] = []
    try:
        for e in engines:
            await e.open_session("s")
        token = None
        for step in range(n_decode + 1):
            x: object = tokens if step == 0 else token
            for e in engines:
                if e.capabilities().is_first:
                    req = (PrefillRequest("s", tokens=x, top_k_logprobs=64) if step == 0  # type: ignore[arg-type]
                           else DecodeRequest("s", token=x, top_k_logprobs=64))  # type: ignore[arg-type]
                else:
                    req = (PrefillRequest("s", hidden_states=x, top_k_logprobs=64) if step == 0  # type: ignore[arg-type]
                           else DecodeRequest("s", hidden_state=x, top_k_logprobs=64))  # type: ignore[arg-type]
                r = await (e.prefill(req) if step == 0 else e.decode(req))  # type: ignore[arg-type]
                if r.boundary is not None:
                    assert r.kind is ResultKind.BOUNDARY
                    x = r.boundary.hidden_states
                else:
                    assert r.logits is not None
                    out.append(np.array([[t.token_id, t.logprob] for t in r.logits.top]))
                    token = r.logits.token_id
        return out
    finally:
        for e in engines:
            await e.aclose()


# ---- layer ranges --------------------------------------------------------------------------


async def test_boundary_results_have_the_right_shape_and_are_deterministic() -> None:
    model = FakeModel(n_layers_total=4, n_embd=16)
    outs = []
    for _ in range(2):
        e = await loaded(model, layers=LayerRange(0, 2))
        caps = e.capabilities()
        assert caps.is_first and not caps.is_last and caps.result_kind is ResultKind.BOUNDARY
        await e.open_session("s")
        r = await e.prefill(PrefillRequest("s", tokens=TOKENS))
        assert r.boundary is not None and r.logits is None
        h = r.boundary.hidden_states
        assert h.shape == (len(TOKENS), 16) and h.dtype == np.float32
        assert not h.flags.writeable
        assert np.isfinite(h).all() and np.abs(h).max() > 0
        d = await e.decode(DecodeRequest("s", token=5))
        assert d.boundary is not None and d.boundary.hidden_states.shape == (1, 16)
        assert d.boundary.start_position == len(TOKENS)
        outs.append((h, d.boundary.hidden_states))
        await e.aclose()
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])


async def test_middle_shard_takes_and_returns_hidden_states() -> None:
    e = await loaded(layers=LayerRange(1, 3))
    caps = e.capabilities()
    assert not caps.is_first and not caps.is_last
    await e.open_session("s")
    x = np.random.default_rng(1).standard_normal((4, caps.n_embd)).astype(np.float32)
    r = await e.prefill(PrefillRequest("s", hidden_states=x))
    assert r.boundary is not None and r.boundary.hidden_states.shape == (4, caps.n_embd)
    assert e.session_info("s").tokens is None
    await e.aclose()


async def test_two_shard_chain_is_deterministic_and_bit_identical_to_the_whole_model() -> None:
    whole = await run_chain([LayerRange(0, 4)], TOKENS)
    chain = await run_chain([LayerRange(0, 2), LayerRange(2, 4)], TOKENS)
    again = await run_chain([LayerRange(0, 2), LayerRange(2, 4)], TOKENS)
    three = await run_chain([LayerRange(0, 1), LayerRange(1, 3), LayerRange(3, 4)], TOKENS)
    for a, b, c, d in zip(whole, chain, again, three, strict=True):
        assert np.array_equal(a, b) and np.array_equal(b, c) and np.array_equal(a, d)


async def test_outputs_depend_on_seed_and_history() -> None:
    base = await run_chain([LayerRange(0, 4)], TOKENS, n_decode=0)
    reseeded = await run_chain([LayerRange(0, 4)], TOKENS, n_decode=0, model=FakeModel(seed=1))
    other_history = await run_chain([LayerRange(0, 4)], (1, *TOKENS[2:]), n_decode=0)
    assert not np.array_equal(base[0], reseeded[0])
    assert not np.array_equal(base[0], other_history[0])


async def test_fingerprint_identifies_the_whole_model() -> None:
    a = await loaded(layers=LayerRange(0, 2))
    b = await loaded(layers=LayerRange(2, 4))
    c = await loaded(FakeModel(seed=5))
    assert a.capabilities().model_fingerprint == b.capabilities().model_fingerprint
    assert a.capabilities().model_fingerprint != c.capabilities().model_fingerprint
    assert a.capabilities().model_fingerprint == FakeModel().fingerprint()
    int(a.capabilities().model_fingerprint, 16)
    for e in (a, b, c):
        await e.aclose()


async def test_layer_range_beyond_the_model_fails_the_load() -> None:
    e = FakeEngine(FakeModel(n_layers_total=4))
    with pytest.raises(InvalidInput):
        await e.load(LoadSpec(layer_range=LayerRange(2, 5)))
    assert e.health().state is EngineState.FAILED
    with pytest.raises(EngineFailure):
        await e.open_session("s")
    await e.aclose()


async def test_capacity_formula_and_bad_capacity() -> None:
    e = await loaded(n_ctx=1000, max_sessions=3)
    assert e.capabilities().n_ctx_per_session == 333
    await e.aclose()
    e = FakeEngine()
    with pytest.raises(InvalidInput):
        await e.load(LoadSpec(n_ctx=2, max_sessions=3))
    await e.aclose()


def test_config_validation() -> None:
    with pytest.raises(InvalidInput):
        FakeModel(n_vocab=100)
    with pytest.raises(InvalidInput):
        FakeModel(n_layers_total=0)
    with pytest.raises(InvalidInput):
        FakeScript(step_latency=-1)
    with pytest.raises(InvalidInput):
        FakeScript(step_latency=math.inf)
    with pytest.raises(InvalidInput):
        FakeScript(fail_at_step=0)


# ---- tokenizer and distribution ------------------------------------------------------------


async def test_byte_tokenizer_round_trips_utf8() -> None:
    e = await loaded()
    text = "héllo, wörld ✓"
    ids = e.tokenize(text)
    assert ids[0] == 1 and len(ids) == 1 + len(text.encode())
    assert b"".join(e.token_piece(t) for t in ids).decode() == text
    assert e.token_piece(0) == e.token_piece(1) == e.token_piece(2) == b""
    assert e.tokenize("", add_bos=False) == ()
    await e.aclose()


async def test_eos_is_rare_under_greedy_but_reachable_by_sampling() -> None:
    e = await loaded(n_ctx=4096, max_sessions=1)
    rng = np.random.default_rng(0)
    greedy_eos = 0
    for i in range(60):
        await e.open_session("s")
        toks = tuple(int(t) for t in rng.integers(3, 259, size=1 + i % 12))
        r = await e.prefill(PrefillRequest("s", tokens=(1, *toks)))
        assert r.logits is not None
        greedy_eos += r.logits.is_eog
        await e.release("s")
    assert greedy_eos <= 3
    found = None
    await e.open_session("s")
    r = await e.prefill(PrefillRequest("s", tokens=TOKENS))
    assert r.logits is not None
    token = r.logits.token_id
    for i in range(2000):
        r = await e.decode(DecodeRequest("s", token=token,
                                         sampling=SamplingParams(temperature=1.5, seed=i)))
        assert r.logits is not None
        token = r.logits.token_id
        if r.logits.is_eog:
            found = i
            break
        if e.session_info("s").n_past >= e.capabilities().n_ctx_per_session - 1:
            await e.prefill(PrefillRequest("s", tokens=TOKENS))
    assert found is not None
    await e.aclose()


# ---- scripted latency (virtual time) --------------------------------------------------------


async def test_step_latency_uses_trio_time(autojump_clock: trio.abc.Clock) -> None:
    e = await loaded(script=FakeScript(step_latency=0.5, load_latency=3.0))
    await e.open_session("s")
    t0 = trio.current_time()
    await e.prefill(PrefillRequest("s", tokens=TOKENS))
    assert trio.current_time() - t0 == pytest.approx(0.5 * len(TOKENS))
    t0 = trio.current_time()
    await e.decode(DecodeRequest("s", token=5))
    assert trio.current_time() - t0 == pytest.approx(0.5)
    await e.aclose()
    t0 = trio.current_time()
    e2 = await loaded(script=FakeScript(load_latency=3.0))
    assert trio.current_time() - t0 == pytest.approx(3.0)
    await e2.aclose()


async def test_deadline_stops_a_prefill_within_one_step(autojump_clock: trio.abc.Clock) -> None:
    steps: list[FakeStep] = []
    e = await loaded(script=FakeScript(step_latency=1.0, on_step=steps.append))
    await e.open_session("s")
    await e.prefill(PrefillRequest("s", tokens=TOKENS[:3]))
    steps.clear()
    with trio.move_on_after(4.5) as scope:
        await e.prefill(PrefillRequest("s", tokens=TOKENS, position=3))
    assert scope.cancelled_caught
    # Steps started at t=1,2,3,4 ran; the one sleeping at t=4.5 saw the flag after its sleep.
    assert [s.position for s in steps] == [3, 4, 5, 6, 7]
    info = e.session_info("s")
    assert info.state is SessionState.IDLE and info.n_past == 3
    assert e.metrics().kv_cells_used == 3  # the fake's own bookkeeping was rolled back
    await e.aclose()


async def test_engine_cancel_stops_within_one_step(autojump_clock: trio.abc.Clock) -> None:
    steps: list[FakeStep] = []
    e = await loaded(script=FakeScript(step_latency=1.0, on_step=steps.append))
    await e.open_session("s")
    async with trio.open_nursery() as nursery:
        op = start_op(nursery, e.prefill, PrefillRequest("s", tokens=TOKENS))
        await trio.sleep(2.5)
        assert e.cancel("s") is True
    assert isinstance(op.error, EngineCancelled)
    assert len(steps) == 3
    assert e.session_info("s").n_past == 0 and e.metrics().kv_cells_used == 0
    await e.aclose()


async def test_sessions_make_progress_concurrently(autojump_clock: trio.abc.Clock) -> None:
    e = await loaded(script=FakeScript(step_latency=1.0))
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        for sid in ("a", "b", "c"):
            await e.open_session(sid)
            nursery.start_soon(e.prefill, PrefillRequest(sid, tokens=TOKENS))
    assert trio.current_time() - t0 == pytest.approx(len(TOKENS))
    await e.aclose()


async def test_a_started_release_makes_the_session_unknown_at_once() -> None:
    gate = trio.Event()

    async def hold(step: FakeStep) -> None:
        await gate.wait()

    e = await loaded(script=FakeScript(on_step=hold))
    await e.open_session("s")
    async with trio.open_nursery() as nursery:
        op = start_op(nursery, e.prefill, PrefillRequest("s", tokens=TOKENS))
        await wait_running(e, "s")
        rel = start_op(nursery, e.release, "s")
        while e.sessions():
            await trio.lowlevel.checkpoint()
        # The op is still held inside a step, yet nothing can slip in before the cells go.
        assert not op.done.is_set()
        with pytest.raises(UnknownSession):
            await e.prefill(PrefillRequest("s", tokens=TOKENS))
        with pytest.raises(UnknownSession):
            e.session_info("s")
        assert e.cancel("s") is False
        assert await e.release("s") is False
        gate.set()
    assert isinstance(op.error, EngineCancelled) and rel.value is True
    assert e.metrics().kv_cells_used == 0 and e.metrics().sessions_active == 0
    await e.aclose()


# ---- scripted failures ---------------------------------------------------------------------


async def test_scripted_failure_turns_health_failed() -> None:
    e = await loaded(script=FakeScript(fail_at_step=13))
    await e.open_session("s")
    await e.prefill(PrefillRequest("s", tokens=TOKENS))  # steps 1..10
    await e.decode(DecodeRequest("s", token=5))  # 11
    await e.decode(DecodeRequest("s", token=5))  # 12
    with pytest.raises(EngineFailure) as info:
        await e.decode(DecodeRequest("s", token=5))  # 13
    assert "scripted" in info.value.message
    health = e.health()
    assert health.state is EngineState.FAILED and not health.ready
    assert "scripted" in health.detail
    for call in (
        lambda: e.open_session("t"),
        lambda: e.decode(DecodeRequest("s", token=5)),
        lambda: e.prefill(PrefillRequest("s", tokens=TOKENS)),
    ):
        with pytest.raises(EngineFailure):
            await call()
    with pytest.raises(EngineFailure):
        e.capabilities()
    assert e.metrics().errors_total == 1
    assert await e.release("s") is True
    await e.aclose()
    assert e.health().state is EngineState.CLOSED


async def test_scripted_load_failure() -> None:
    e = FakeEngine(script=FakeScript(fail_on_load=True))
    with pytest.raises(EngineFailure):
        await e.load(LoadSpec())
    assert e.health().state is EngineState.FAILED
    with pytest.raises(EngineFailure):
        await e.load(LoadSpec())
    await e.aclose()


async def test_unexpected_exception_in_a_hook_becomes_engine_failure() -> None:
    def boom(step: FakeStep) -> None:
        if step.position == 2:
            raise ZeroDivisionError("bug in engine")

    e = await loaded(script=FakeScript(on_step=boom))
    await e.open_session("s")
    with pytest.raises(EngineFailure) as info:
        await e.prefill(PrefillRequest("s", tokens=TOKENS))
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert e.health().state is EngineState.FAILED
    await e.aclose()


async def test_a_failure_stops_operations_running_on_other_sessions() -> None:
    gate = trio.Event()

    async def script(step: FakeStep) -> None:
        if step.session_id == "slow":
            await gate.wait()
        elif step.position == 1:
            raise EngineFailure("device lost")

    e = await loaded(script=FakeScript(on_step=script))
    await e.open_session("slow")
    await e.open_session("bad")
    async with trio.open_nursery() as nursery:
        slow = start_op(nursery, e.prefill, PrefillRequest("slow", tokens=TOKENS))
        await wait_running(e, "slow")
        with pytest.raises(EngineFailure):
            await e.prefill(PrefillRequest("bad", tokens=TOKENS))
        gate.set()
    assert isinstance(slow.error, EngineFailure), slow.error
    assert e.health().state is EngineState.FAILED
    assert e.health().detail == "device lost"
    await e.aclose()


async def test_kv_bookkeeping_is_the_fakes_own() -> None:
    e = await loaded()
    await e.open_session("a")
    await e.open_session("b")
    await e.prefill(PrefillRequest("a", tokens=TOKENS))
    await e.prefill(PrefillRequest("b", tokens=TOKENS[:4]))
    assert e.metrics().kv_cells_used == len(TOKENS) + 4
    await e.prefill(PrefillRequest("a", tokens=TOKENS[:2], position=3))  # rewrite from 3
    assert e.metrics().kv_cells_used == 5 + 4
    await e.release("a")
    assert e.metrics().kv_cells_used == 4
    # If the fake's cells disagree with what the base believes, the fake refuses (FAILED).
    e._kv.clear()
    with pytest.raises(EngineFailure):
        await e.decode(DecodeRequest("b", token=5))
    assert e.health().state is EngineState.FAILED
    await e.aclose()


async def test_prompt_tokens_helper_is_valid_for_the_fake() -> None:
    e = await loaded()
    toks = prompt_tokens(e, 300, salt=3)
    assert toks[0] == 1 and all(3 <= t < 259 for t in toks[1:])
    await e.aclose()


# ---- closing ----------------------------------------------------------------------------------


async def test_close_admits_no_new_work_and_frees_natives_once() -> None:
    """While aclose() waits for a running operation the engine is already CLOSED: nothing new
    starts on it, and concurrent aclose() calls free the resources exactly once."""
    gate = trio.Event()

    async def hold(step: FakeStep) -> None:
        if step.session_id == "s":
            await gate.wait()

    e = await loaded(script=FakeScript(on_step=hold))
    closes: list[int] = []
    impl_close = e._impl_close

    async def counting_close() -> None:
        closes.append(1)
        await impl_close()

    e._impl_close = counting_close  # type: ignore[method-assign]
    await e.open_session("idle")
    await e.open_session("s")
    with trio.fail_after(30):  # a regression must fail, not hang on the gate
        async with trio.open_nursery() as nursery:
            try:
                op = start_op(nursery, e.prefill, PrefillRequest("s", tokens=TOKENS))
                await wait_running(e, "s")
                first = start_op(nursery, e.aclose)
                second = start_op(nursery, e.aclose)
                await trio.testing.wait_all_tasks_blocked()
                assert not first.done.is_set() and not second.done.is_set()  # both wait for "s"
                assert e.health().state is EngineState.CLOSED and not e.health().ready
                with pytest.raises(NotReady):
                    await e.open_session("late")
                with pytest.raises(NotReady):
                    await e.prefill(PrefillRequest("idle", tokens=TOKENS))
            finally:
                gate.set()
    assert isinstance(op.error, EngineCancelled), op.error
    assert first.error is None and second.error is None
    assert closes == [1]
    assert e.metrics().sessions_active == 0 and e.sessions() == ()


async def test_close_during_load(autojump_clock: trio.abc.Clock) -> None:
    """aclose() while LOADING returns at once (CLOSED); the load then frees what it loaded and
    raises NotReady, so nothing stays allocated."""
    e = FakeEngine(script=FakeScript(load_latency=5.0))
    async with trio.open_nursery() as nursery:
        load = start_op(nursery, e.load, LoadSpec())
        await trio.sleep(1.0)
        assert e.health().state is EngineState.LOADING
        await e.aclose()
        assert e.health().state is EngineState.CLOSED
        assert not load.done.is_set()
    assert isinstance(load.error, NotReady), load.error
    assert e._weights is None  # the load's cleanup ran
    assert e.health().state is EngineState.CLOSED
    with pytest.raises(NotReady):
        e.capabilities()
    await e.aclose()  # still idempotent


async def test_a_failing_rollback_still_returns_the_session_to_idle() -> None:
    class Boom(BaseException):
        pass

    def cancel_in_step(step: FakeStep) -> None:
        if step.position == 1:  # the first position changed the KV cells: a rollback is due
            e.cancel("s")

    async def truncate(slot: object, keep: int) -> None:
        raise Boom

    e = await loaded(script=FakeScript(on_step=cancel_in_step))
    await e.open_session("s")
    e._impl_truncate = truncate  # type: ignore[method-assign]  # the rollback will raise
    with pytest.raises(Boom):
        await e.prefill(PrefillRequest("s", tokens=TOKENS))
    assert e.session_info("s").state is SessionState.IDLE  # not RUNNING forever
    assert e.metrics().operations_running == 0


async def test_hidden_states_cannot_change_after_validation() -> None:
    """A request keeps its own immutable copy: changing the caller's buffer after the request
    was validated (here: NaN while the operation runs) cannot reach the computation."""
    gate = trio.Event()

    async def hold(step: FakeStep) -> None:
        await gate.wait()

    e = await loaded(script=FakeScript(on_step=hold), layers=LayerRange(2, 4))
    await e.open_session("s")
    buffer = np.random.default_rng(2).standard_normal((6, e.capabilities().n_embd)).astype(np.float32)
    view = buffer.view()
    view.flags.writeable = False
    async with trio.open_nursery() as nursery:
        op = start_op(nursery, e.prefill, PrefillRequest("s", hidden_states=view))
        await wait_running(e, "s")
        buffer[:] = np.nan
        gate.set()
    assert op.error is None, op.error
    assert e.health().ready
    assert op.value.logits is not None and math.isfinite(op.value.logits.logprob)
    await e.aclose()


# ---- embeddings ----------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
async def test_embedding_pools_the_last_blocks_outputs_as_declared(pooling: str) -> None:
    """The fake pools the last block's rows of the whole input, computed position by position
    from an empty state (the fake's own forward pass): their mean, the first or the last."""
    whole = await loaded(FakeModel(pooling_type=pooling))
    try:
        raw = await whole.embed(TOKENS, normalize=False)
        rows, prev = [], None
        assert whole._weights is not None and whole._weights.embd is not None
        for token in TOKENS:
            hidden, prev = whole._forward(whole._weights.embd[token], prev)
            rows.append(hidden.astype(np.float64))
        expected = {"mean": np.mean(rows, axis=0), "cls": rows[0], "last": rows[-1]}[pooling]
        np.testing.assert_allclose(raw, expected.astype(np.float32), rtol=1e-6)
        unit = await whole.embed(TOKENS)
        np.testing.assert_allclose(unit, expected / np.linalg.norm(expected), rtol=1e-5)
    finally:
        await whole.aclose()


def test_pooling_type_is_checked_and_fingerprinted() -> None:
    with pytest.raises(InvalidInput, match="pooling_type"):
        FakeModel(pooling_type="max")
    assert FakeModel(pooling_type="mean").fingerprint() != FakeModel().fingerprint()
    assert FakeModel(pooling_type="").fingerprint() == FakeModel().fingerprint()
