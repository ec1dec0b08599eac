"""LlamaCppEngine on layer-range slices of the tiny model, chained in one process.

A chain of 2 or 3 shards must equal the whole model: the same greedy tokens over 32 decode
steps after a prefill sent in two requests (and several llama.cpp chunks), and last-shard logits
within 1e-4 of the whole model's at every step. Also: the boundary capture stops the graph
before the LM head, capabilities describe the source model, bad ranges are refused, and a
cancelled or released shard session leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import trio

from shard.engine import (
    DecodeRequest,
    EngineCancelled,
    EngineState,
    IllegalTransition,
    InvalidInput,
    LayerRange,
    LoadSpec,
    PrefillRequest,
    ResultKind,
    StepResult,
    UnsupportedFeature,
)
from shard.engine.llama import LlamaCppEngine
from shard.models import ensure_model, ensure_slice, file_fingerprint
from shard.testing import start_op, wait_running
from test_slice import header_only_model

N_THREADS = 1
N_DECODE = 32
LOGITS_ATOL = 1e-4
PROMPT = "hello world, the quick brown fox jumps over the lazy dog once upon a time"


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_model("tiny")


def _spec(path: Path, *, n_batch: int = 8, layer_range: LayerRange | None = None) -> LoadSpec:
    return LoadSpec(model_path=path, layer_range=layer_range, n_ctx=256, max_sessions=2,
                    n_batch=n_batch, n_threads=N_THREADS)


def spy_outputs(engine: LlamaCppEngine) -> list[np.ndarray]:
    """Record the raw result (logits or hidden states, unchanged) of every step the engine
    commits, however it was computed: a step of its own, one computed ahead and claimed, or
    one a stream delivered (``_make_result`` builds every step's result)."""
    seen: list[np.ndarray] = []
    make = engine._make_result

    def spy_make(slot, caps, plan, raw, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(np.array(raw, copy=True))
        return make(slot, caps, plan, raw, *args, **kwargs)

    engine._make_result = spy_make  # type: ignore[method-assign]
    return seen


@contextlib.asynccontextmanager
async def open_chain(source: Path, cuts: Sequence[int], *, n_batch: int = 8) -> AsyncIterator[list[LlamaCppEngine]]:
    async with contextlib.AsyncExitStack() as stack:
        chain = []
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            path = await trio.to_thread.run_sync(ensure_slice, source, LayerRange(a, b))
            engine = await stack.enter_async_context(LlamaCppEngine())
            await engine.load(_spec(path, n_batch=n_batch))
            chain.append(engine)
        yield chain


async def chain_prefill(chain: Sequence[LlamaCppEngine], sid: str, tokens: Sequence[int],
                        position: int) -> StepResult:
    step = await chain[0].prefill(PrefillRequest(sid, tokens=tuple(tokens), position=position))
    for engine in chain[1:]:
        assert step.kind is ResultKind.BOUNDARY and step.boundary is not None
        h = step.boundary.hidden_states
        assert h.dtype == np.float32 and h.shape == (step.tokens_processed, 64)
        step = await engine.prefill(
            PrefillRequest(sid, hidden_states=h, position=step.boundary.start_position))
    return step


async def chain_decode(chain: Sequence[LlamaCppEngine], sid: str, token: int) -> StepResult:
    step = await chain[0].decode(DecodeRequest(sid, token=token))
    for engine in chain[1:]:
        assert step.boundary is not None and step.boundary.hidden_states.shape == (1, 64)
        step = await engine.decode(DecodeRequest(sid, hidden_state=step.boundary.hidden_states))
    return step


@pytest.mark.parametrize(
    "cuts", [(0, 2, 4), (0, 3, 4), (0, 1, 3, 4), (0, 1, 2, 3, 4)], ids=["2-way", "2-way-late", "3-way", "4-way"]
)
async def test_a_chain_of_shards_equals_the_whole_model(tiny: Path, cuts: tuple[int, ...]) -> None:
    async with (
        open_chain(tiny, cuts, n_batch=8) as chain,
        LlamaCppEngine() as whole,
    ):
        await whole.load(_spec(tiny, n_batch=512))  # another batch layout than the shards
        last_out, whole_out = spy_outputs(chain[-1]), spy_outputs(whole)
        tokens = whole.tokenize(PROMPT)
        assert len(tokens) > 10
        for engine in (*chain, whole):
            await engine.open_session("s")
        # The prompt arrives in two requests; the first is two llama.cpp chunks on the shards.
        split = 10
        await chain_prefill(chain, "s", tokens[:split], 0)
        chained = await chain_prefill(chain, "s", tokens[split:], split)
        await whole.prefill(PrefillRequest("s", tokens=tokens[:split]))
        direct = await whole.prefill(PrefillRequest("s", tokens=tokens[split:], position=split))
        got, want = [], []
        for _ in range(N_DECODE):
            assert chained.logits is not None and direct.logits is not None
            got.append(chained.logits.token_id)
            want.append(direct.logits.token_id)
            chained = await chain_decode(chain, "s", got[-1])
            direct = await whole.decode(DecodeRequest("s", token=want[-1]))
        assert got == want
        assert len(set(want)) > 1  # a real sequence, not one token repeated
        assert len(last_out) == len(whole_out) == N_DECODE + 2
        max_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(last_out, whole_out, strict=True))
        print(f"{len(chain)}-way chain: max |logit difference| {max_diff:.3g} over {len(last_out)} steps")
        assert max_diff <= LOGITS_ATOL
        n = len(tokens) + N_DECODE
        assert [e.metrics().kv_cells_used for e in (*chain, whole)] == [n] * (len(chain) + 1)
        for engine in (*chain, whole):
            assert await engine.release("s")
            assert engine.metrics().kv_cells_used == 0


async def test_prefix_reuse_through_a_chain(tiny: Path) -> None:
    """The first shard reuses what it holds; later shards recompute from its start_position."""
    async with open_chain(tiny, (0, 1, 3, 4)) as chain, LlamaCppEngine() as whole:
        await whole.load(_spec(tiny))
        last_out, whole_out = spy_outputs(chain[-1]), spy_outputs(whole)
        tokens = whole.tokenize(PROMPT)
        for engine in (*chain, whole):
            await engine.open_session("s")
        await chain_prefill(chain, "s", tokens[:12], 0)
        await whole.prefill(PrefillRequest("s", tokens=tokens[:12]))
        # Resend the whole prompt from 0, with a different tail: 12 tokens are reused.
        edited = (*tokens[:12], 700, 701, 702)
        first_step = await chain[0].prefill(PrefillRequest("s", tokens=edited))
        assert first_step.reused_tokens == 12 and first_step.boundary is not None
        assert first_step.boundary.start_position == 12
        step = first_step
        for engine in chain[1:]:
            step = await engine.prefill(PrefillRequest(
                "s", hidden_states=step.boundary.hidden_states, position=step.boundary.start_position))
        direct = await whole.prefill(PrefillRequest("s", tokens=edited))
        assert direct.reused_tokens == 12
        assert step.logits is not None and direct.logits is not None
        assert step.logits.token_id == direct.logits.token_id
        assert float(np.max(np.abs(last_out[-1] - whole_out[-1]))) <= LOGITS_ATOL
        assert [e.session_info("s").n_past for e in (*chain, whole)] == [15] * 4


async def test_boundary_capture_stops_the_graph_before_the_lm_head(tiny: Path) -> None:
    path = await trio.to_thread.run_sync(ensure_slice, tiny, LayerRange(0, 2))
    async with LlamaCppEngine() as engine:
        await engine.load(_spec(path))
        asked: list[bytes] = []
        boundary = engine._boundary  # shard.engine.llama_capture.BoundaryCapture
        assert boundary is not None
        api = boundary.api

        def recording_get_name(tensor: int) -> bytes:
            name = api.get_name(tensor)
            asked.append(name)
            return name

        boundary.api = dataclasses.replace(api, get_name=recording_get_name)
        await engine.open_session("s")
        r = await engine.prefill(PrefillRequest("s", tokens=(1, 5, 6, 7)))
        assert r.boundary is not None and r.boundary.hidden_states.shape == (4, 64)
        assert b"l_out-0" in asked and b"l_out-1" in asked  # both blocks ran
        # Nothing after the last block was even offered: no output norm, no LM head.
        assert asked[-2:] == [b"l_out-1", b"l_out-1"]  # asked, then handed over
        assert not any(name.startswith(b"result") for name in asked)
        # All blocks wrote their KV cells: decoding on continues from position 4.
        d = await engine.decode(DecodeRequest("s", token=9))
        assert d.boundary is not None and d.boundary.start_position == 4
        assert engine.metrics().kv_cells_used == 5


async def test_shards_describe_the_source_model(tiny: Path) -> None:
    async with LlamaCppEngine() as whole:
        cw = await whole.load(_spec(tiny))
        assert cw.model_fingerprint == file_fingerprint(tiny)
        for layers, first, last in ((LayerRange(0, 1), True, False), (LayerRange(1, 3), False, False),
                                    (LayerRange(3, 4), False, True)):
            path = await trio.to_thread.run_sync(ensure_slice, tiny, layers)
            async with LlamaCppEngine() as engine:
                caps = await engine.load(_spec(path))  # no range given: the file's own
                assert caps.layer_range == layers
                assert (caps.is_first, caps.is_last) == (first, last)
                assert caps.model_fingerprint == cw.model_fingerprint
                assert caps.n_layers_total == 4 and caps.n_embd == 64 and caps.hidden_dtype == "float32"
                assert caps.n_vocab == cw.n_vocab and caps.architecture == "llama"
                if first:
                    assert engine.tokenize("hello world") == whole.tokenize("hello world")
                else:
                    with pytest.raises(IllegalTransition):
                        engine.tokenize("hello")
                if last:
                    assert engine.token_piece(700) == whole.token_piece(700)
                    assert caps.eos_token_id == cw.eos_token_id
                elif not first:
                    with pytest.raises(IllegalTransition, match="middle shard"):
                        engine.token_piece(700)
            async with LlamaCppEngine() as engine:  # the same range, stated explicitly
                assert (await engine.load(_spec(path, layer_range=layers))).layer_range == layers


async def test_bad_ranges_are_refused_at_load(tiny: Path, tmp_path: Path) -> None:
    middle = await trio.to_thread.run_sync(ensure_slice, tiny, LayerRange(1, 3))
    gemma = header_only_model(tmp_path / "gemma.gguf", "gemma3n")  # refused by the table
    cases = [
        (middle, LayerRange(0, 2), InvalidInput, r"is a slice of layers \[1, 3\); it cannot serve \[0, 2\)"),
        (tiny, LayerRange(2, 5), InvalidInput, r"\[2, 5\) is outside the model's 4 blocks"),
        (tiny, LayerRange(1, 3), InvalidInput, "slice it first"),
        (gemma, LayerRange(0, 2), UnsupportedFeature, "architecture 'gemma3n'"),
    ]
    for path, layers, error, message in cases:
        async with LlamaCppEngine() as engine:
            with pytest.raises(error, match=message):
                await engine.load(_spec(path, layer_range=layers))
            assert engine.health().state is EngineState.FAILED


async def test_cancel_and_release_on_a_middle_shard_leave_nothing(tiny: Path) -> None:
    path = await trio.to_thread.run_sync(ensure_slice, tiny, LayerRange(1, 3))
    rng = np.random.default_rng(3)
    hidden = rng.standard_normal((120, 64)).astype(np.float32)  # n_ctx_per_session is 128
    async with LlamaCppEngine() as engine:
        await engine.load(_spec(path, n_batch=8))
        await engine.open_session("s")
        await engine.open_session("ref")
        await engine.prefill(PrefillRequest("s", hidden_states=hidden[:5]))
        async with trio.open_nursery() as nursery:
            op = start_op(nursery, engine.prefill, PrefillRequest("s", hidden_states=hidden[5:], position=5))
            await wait_running(engine, "s")
            assert engine.cancel("s")
        assert isinstance(op.error, EngineCancelled)
        assert engine.session_info("s").n_past == 5 and engine.metrics().kv_cells_used == 5
        # Rolled back to exactly 5 positions: the next step equals a fresh session's.
        after = await engine.decode(DecodeRequest("s", hidden_state=hidden[5:6]))
        await engine.prefill(PrefillRequest("ref", hidden_states=hidden[:6]))
        ref_info = engine.session_info("ref")
        assert ref_info.n_past == after.n_past == 6
        fresh = await engine.decode(DecodeRequest("ref", hidden_state=hidden[6:7]))
        again = await engine.decode(DecodeRequest("s", hidden_state=hidden[6:7]))
        assert after.boundary is not None and fresh.boundary is not None and again.boundary is not None
        np.testing.assert_allclose(again.boundary.hidden_states, fresh.boundary.hidden_states, atol=1e-4)
        # Release while running frees every cell.
        async with trio.open_nursery() as nursery:
            op = start_op(nursery, engine.prefill, PrefillRequest("s", hidden_states=hidden[7:], position=7))
            await wait_running(engine, "s")
            assert await engine.release("s")
        assert isinstance(op.error, EngineCancelled)
        assert await engine.release("ref")
        assert engine.metrics().kv_cells_used == 0 and engine.metrics().sessions_active == 0
        assert engine.health().ready
