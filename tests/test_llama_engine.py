"""LlamaCppEngine against llama-cpp-python's own high-level API, plus cancellation and errors.

The oracle tests compare with ``llama_cpp.Llama`` (this test module may import llama_cpp; the
import-boundary rule applies to ``shard/`` only).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
import trio

from shard.engine import (
    DecodeRequest,
    EngineCancelled,
    EngineFailure,
    EngineState,
    InvalidInput,
    KvCacheFull,
    NotReady,
    LayerRange,
    LoadSpec,
    PrefillRequest,
    SamplingParams,
    SessionState,
    StepResult,
    StepTimeout,
)
from shard.engine.llama import LlamaCppEngine
from shard.models import ensure_model
from shard.models.arch_models import ARCHS, ensure_arch_model

N_THREADS = 1  # robust on a busy 2-core machine (ggml's threads spin at barriers inside a step)
PROMPTS = ("hello world, the quick brown fox", "Once upon a time there was a little dog named")


@pytest.fixture(scope="module")
def tiny_path() -> Path:
    return ensure_model("tiny")


@pytest.fixture
async def engine(tiny_path: Path) -> AsyncIterator[LlamaCppEngine]:
    async with LlamaCppEngine() as eng:
        await eng.load(LoadSpec(model_path=tiny_path, n_ctx=2048, max_sessions=4, n_threads=N_THREADS))
        yield eng


async def _generate(
    engine: LlamaCppEngine,
    session: str,
    prompt: tuple[int, ...],
    n: int,
    sampling: SamplingParams = SamplingParams(),
    position: int = 0,
) -> list[int]:
    """Prefill then decode ``n - 1`` more tokens; the tokens chosen, in order."""
    res = await engine.prefill(PrefillRequest(session, tokens=prompt, position=position, sampling=sampling))
    assert res.logits is not None
    out = [res.logits.token_id]
    while len(out) < n:
        res = await engine.decode(DecodeRequest(session, token=out[-1], sampling=sampling))
        assert res.logits is not None
        out.append(res.logits.token_id)
    return out


def _oracle_greedy(path: Path, prompt: str, n: int, flash_attn: bool) -> tuple[list[int], list[int]]:
    """Prompt tokens and ``n`` greedy tokens from llama-cpp-python's high-level API."""
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=512,
        n_batch=512,
        n_threads=N_THREADS,
        seed=1234,
        flash_attn=flash_attn,
        verbose=False,
    )
    try:
        tokens = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        out: list[int] = []
        for tok in llm.generate(tokens, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            out.append(int(tok))
            if len(out) == n:
                break
        return list(tokens), out
    finally:
        llm.close()


# ---- oracle ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("flash_attn", [None, False], ids=["default", "no-flash-attn"])
async def test_greedy_matches_llama_cpp_python(tiny_path: Path, prompt: str, flash_attn: bool | None) -> None:
    # The engine's default lets llama.cpp choose flash attention ("auto" enables it on CPU);
    # the high-level API takes a bool, so compare like with like.
    oracle_fa = flash_attn is None
    ref_prompt, ref_out = await trio.to_thread.run_sync(_oracle_greedy, tiny_path, prompt, 24, oracle_fa)
    async with LlamaCppEngine(flash_attn=flash_attn) as engine:
        await engine.load(LoadSpec(model_path=tiny_path, n_ctx=2048, max_sessions=4, n_threads=N_THREADS))
        tokens = engine.tokenize(prompt)
        assert list(tokens) == ref_prompt
        await engine.open_session("s")
        out = await _generate(engine, "s", tokens, 24)
    assert out == ref_out
    assert len(set(out)) > 1  # the model is not degenerate, so the comparison means something


@pytest.mark.parametrize("layers", [None, LayerRange(0, 2), LayerRange(2, 4)], ids=str)
async def test_load_warms_up_and_leaves_no_trace(tiny_path: Path, layers: LayerRange | None) -> None:
    """Before READY the engine ran a prompt chunk and a one-row step (llama.cpp's first steps
    on a fresh context built their graphs: a Gemma 3 slice's first 8-token prompt took 5x the
    next one, failing a short step timeout; docs/engine.md, "Warm-up at load"), and freed
    their cells: the first session starts from an empty sequence and computes what a session
    on a context that never warmed up computes (the oracle test above; here: the same
    greedy tokens twice)."""
    from shard.models import ensure_slice

    path = tiny_path if layers is None else await trio.to_thread.run_sync(ensure_slice, tiny_path, layers)
    async with LlamaCppEngine() as engine:
        await engine.load(LoadSpec(model_path=path, layer_range=layers, n_ctx=2048, max_sessions=4,
                                   n_threads=N_THREADS))
        m = engine.metrics()
        assert m.warmup_steps_total == 2 and m.warmup_us_total > 0
        assert m.kv_cells_used == 0 and m.sessions_active == 0 and m.steps_total == 0
        if layers is None:
            runs = []
            for name in ("first", "second"):
                await engine.open_session(name)
                runs.append(await _generate(engine, name, engine.tokenize(PROMPTS[0]), 8))
                assert engine.session_info(name).n_past == len(engine.tokenize(PROMPTS[0])) + 7
                await engine.release(name)
            assert runs[0] == runs[1]


async def test_capabilities(engine: LlamaCppEngine, tiny_path: Path) -> None:
    caps = engine.capabilities()
    assert caps.engine == "llama.cpp"
    assert caps.architecture == "llama"
    assert caps.n_layers_total == 4 and caps.layer_range == LayerRange(0, 4)
    assert caps.is_first and caps.is_last
    assert caps.n_embd == 64
    assert caps.n_vocab > 300
    assert (caps.bos_token_id, caps.eos_token_id) == (1, 2)
    assert caps.n_ctx == 2048 and caps.max_sessions == 4 and caps.n_ctx_per_session == 512
    assert caps.model_fingerprint == hashlib.sha256(tiny_path.read_bytes()).hexdigest()
    assert not caps.mtp.enabled and not caps.aux_state.enabled


async def test_tokenizer_and_pieces(engine: LlamaCppEngine) -> None:
    tokens = engine.tokenize("hello world")
    assert tokens[0] == 1 and len(tokens) == 3
    assert b"".join(engine.token_piece(t) for t in tokens[1:]) == b" hello world"
    assert engine.tokenize("hello world", add_bos=False) == tokens[1:]
    # Characters outside the vocabulary fall back to byte tokens: each piece is one raw byte.
    snow = engine.tokenize("\u2603", add_bos=False)
    assert b"".join(engine.token_piece(t) for t in snow) == " \u2603".encode()
    assert engine.token_piece(3 + 0xE2) == b"\xe2"  # a partial UTF-8 sequence
    assert engine.token_piece(2) == b""  # control tokens are not rendered
    assert engine._impl_is_eog(2) and not engine._impl_is_eog(tokens[1])


# ---- sessions, sampling, prefix reuse ----------------------------------------------------------


async def test_seeded_sampling_is_deterministic(engine: LlamaCppEngine) -> None:
    prompt = engine.tokenize(PROMPTS[1])

    runs = iter(range(100))

    async def run(seed: int) -> list[int]:
        sid = f"seed-{seed}-{next(runs)}"
        await engine.open_session(sid)
        try:
            return await _generate(engine, sid, prompt, 16, SamplingParams(temperature=1.5, seed=seed))
        finally:
            await engine.release(sid)

    a, b, c = await run(7), await run(7), await run(8)
    assert a == b
    assert a != c


async def test_prefix_reuse_matches_fresh_session(engine: LlamaCppEngine) -> None:
    first = engine.tokenize("the quick brown fox jumps over the lazy dog and the cat")
    second = engine.tokenize("the quick brown fox jumps over the lazy dog and a bird")
    n_common = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    assert n_common > 8
    common = second[:n_common]
    await engine.open_session("a")
    await engine.open_session("b")
    await _generate(engine, "a", first, 5)
    res = await engine.prefill(PrefillRequest("a", tokens=second))
    assert res.reused_tokens == len(common)
    assert res.tokens_processed == len(second) - len(common)
    assert res.n_past == len(second)
    assert engine.metrics().kv_cells_used == len(second)
    assert res.logits is not None
    cont = [res.logits.token_id]
    for _ in range(11):
        step = await engine.decode(DecodeRequest("a", token=cont[-1]))
        assert step.logits is not None
        cont.append(step.logits.token_id)
    fresh = await _generate(engine, "b", second, 12)
    assert cont == fresh
    assert engine.metrics().kv_cells_used == 2 * (len(second) + 11)


async def test_truncating_prefill_rewinds(engine: LlamaCppEngine) -> None:
    prompt = engine.tokenize(PROMPTS[0])
    await engine.open_session("r")
    ref = await _generate(engine, "r", prompt, 8)
    # Rewind to the prompt end and regenerate: same continuation, KV holds only what is kept.
    res = await engine.prefill(PrefillRequest("r", tokens=(prompt[-1],), position=len(prompt) - 1))
    assert res.logits is not None and res.logits.token_id == ref[0]
    assert engine.metrics().kv_cells_used == len(prompt)


async def test_every_session_holds_its_full_share(tiny_path: Path) -> None:
    """kv_unified=false gives each sequence its own stream: all sessions can fill their share."""
    async with LlamaCppEngine() as eng:
        caps = await eng.load(LoadSpec(model_path=tiny_path, n_ctx=1000, max_sessions=3, n_threads=N_THREADS))
        per = caps.n_ctx_per_session
        assert per == 333
        rng = random.Random(5)
        for i in range(3):
            await eng.open_session(f"s{i}")
            toks = (1, *(rng.randrange(3, caps.n_vocab) for _ in range(per - 2)))
            res = await eng.prefill(PrefillRequest(f"s{i}", tokens=toks))
            assert res.logits is not None
            res = await eng.decode(DecodeRequest(f"s{i}", token=res.logits.token_id))
            assert res.n_past == per
        assert eng.metrics().kv_cells_used == 3 * per
        with pytest.raises(InvalidInput):
            await eng.decode(DecodeRequest("s0", token=5))
        for i in range(3):
            await eng.release(f"s{i}")
        assert eng.metrics().kv_cells_used == 0


async def test_chunked_prefill_equals_single_chunk(tiny_path: Path) -> None:
    """A prompt longer than n_batch is evaluated in chunks with the same result."""
    rng = random.Random(11)
    prompt = (1, *(rng.randrange(3, 800) for _ in range(150)))
    outs = []
    for n_batch in (512, 64, 7):
        async with LlamaCppEngine() as eng:
            await eng.load(
                LoadSpec(model_path=tiny_path, n_ctx=512, max_sessions=1, n_batch=n_batch, n_threads=N_THREADS)
            )
            await eng.open_session("c")
            outs.append(await _generate(eng, "c", prompt, 6))
            assert eng.metrics().kv_cells_used == len(prompt) + 5
    assert outs[0] == outs[1] == outs[2]


async def test_release_cycles_do_not_leak(engine: LlamaCppEngine) -> None:
    prompt = engine.tokenize(PROMPTS[0])
    for i in range(200):
        await engine.open_session(f"leak-{i}")
        await engine.prefill(PrefillRequest(f"leak-{i}", tokens=prompt))
        assert engine.metrics().kv_cells_used == len(prompt)
        assert await engine.release(f"leak-{i}")
    m = engine.metrics()
    assert m.kv_cells_used == 0 and m.sessions_active == 0


async def test_cancel_between_chunks(tiny_path: Path) -> None:
    """With small chunks, cancel stops the prefill between llama_decode calls."""
    async with LlamaCppEngine() as eng:
        caps = await eng.load(
            LoadSpec(model_path=tiny_path, n_ctx=4096, max_sessions=1, n_batch=8, n_threads=N_THREADS)
        )
        await eng.open_session("c")
        rng = random.Random(3)
        prompt = (1, *(rng.randrange(3, caps.n_vocab) for _ in range(3000)))
        await eng.prefill(PrefillRequest("c", tokens=prompt[:10]))
        polls = eng.abort_polls
        result: list[str] = []

        async def run() -> None:
            try:
                await eng.prefill(PrefillRequest("c", tokens=prompt[:10] + prompt[10:]))
                result.append("done")
            except EngineCancelled:
                result.append("cancelled")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            while eng.abort_polls == polls and not result:
                await trio.sleep(0.001)
            eng.cancel("c")
        assert result == ["cancelled"]
        info = eng.session_info("c")
        assert info.state is SessionState.IDLE and info.n_past == 10  # rolled back to `keep` (the reused prefix)
        assert eng.metrics().kv_cells_used == 10
        assert eng.metrics().cancelled_total == 1


async def test_caller_cancellation_waits_for_native_work(tiny_path: Path) -> None:
    async with LlamaCppEngine() as eng:
        caps = await eng.load(LoadSpec(model_path=tiny_path, n_ctx=4096, max_sessions=1, n_batch=16))
        await eng.open_session("c")
        rng = random.Random(4)
        prompt = (1, *(rng.randrange(3, caps.n_vocab) for _ in range(4000)))
        polls = eng.abort_polls
        with trio.CancelScope() as scope:

            async def canceller() -> None:
                while eng.abort_polls == polls:
                    await trio.sleep(0.001)
                scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(canceller)
                await eng.prefill(PrefillRequest("c", tokens=prompt))
        assert scope.cancelled_caught
        assert eng.session_info("c").n_past == 0
        assert eng.metrics().kv_cells_used == 0
        res = await eng.prefill(PrefillRequest("c", tokens=prompt[:5]))
        assert res.n_past == 5


async def test_abort_callback_armed_for_multi_token_steps_only(tiny_path: Path) -> None:
    """Single-token decode skips the GIL-taking abort callback unless asked for it."""
    for min_tokens, decode_polls in ((2, False), (1, True)):
        async with LlamaCppEngine(abort_min_tokens=min_tokens) as eng:
            await eng.load(LoadSpec(model_path=tiny_path, n_ctx=256, max_sessions=1))
            await eng.open_session("a")
            polls = eng.abort_polls
            res = await eng.prefill(PrefillRequest("a", tokens=(1, 5, 6)))
            assert eng.abort_polls > polls
            polls = eng.abort_polls
            assert res.logits is not None
            await eng.decode(DecodeRequest("a", token=res.logits.token_id))
            assert (eng.abort_polls > polls) is decode_polls


async def test_hidden_state_plan_is_an_engine_failure(engine: LlamaCppEngine) -> None:
    """Unreachable through the public API (the base class checks the input kind; a whole-model
    shard is a first shard): the hook still refuses hidden states rather than misreading them."""
    from shard.engine import EngineFailure
    from shard.engine.base import ComputePlan

    await engine.open_session("h")
    slot = engine._slots["h"]
    with pytest.raises(EngineFailure, match="hidden states"):
        await engine._impl_compute(slot, ComputePlan(0, None, np.zeros((1, 64), np.float32)))


# ---- abort inside one native step (bench model) -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2], ids=["1-thread", "2-threads-pool"])
async def test_abort_callback_stops_a_single_decode(threads: int) -> None:
    # With 2 threads the step runs on the context's ggml pool: the abort polled on the calling
    # thread must stop the pool's thread too (llama_decode returns only when both stopped).
    path = await trio.to_thread.run_sync(ensure_model, "bench")
    async with LlamaCppEngine() as eng:
        caps = await eng.load(
            LoadSpec(model_path=path, n_ctx=4096, max_sessions=1, n_batch=2048, n_threads=threads)
        )
        assert (eng._threads is not None) == (threads > 1)
        assert caps.n_vocab == 32000
        await eng.open_session("big")
        rng = random.Random(1)
        prompt = (1, *(rng.randrange(3, caps.n_vocab) for _ in range(1999)))
        before = eng.metrics()
        polls = eng.abort_polls
        result: list[str] = []

        async def run() -> None:
            try:
                await eng.prefill(PrefillRequest("big", tokens=prompt))  # one llama_decode call
                result.append("done")
            except EngineCancelled:
                result.append("cancelled")

        with trio.fail_after(300):  # hang guard only
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                while eng.abort_polls == polls and not result:
                    await trio.sleep(0.001)
                assert eng.cancel("big")
        assert result == ["cancelled"]
        after = eng.metrics()
        assert after.aborted_in_step_total == before.aborted_in_step_total + 1
        assert after.cancelled_total == before.cancelled_total + 1
        info = eng.session_info("big")
        assert info.state is SessionState.IDLE and info.n_past == 0
        assert after.kv_cells_used == 0
        res = await eng.prefill(PrefillRequest("big", tokens=prompt[:8]))
        assert res.n_past == 8 and res.logits is not None
        assert eng.metrics().kv_cells_used == 8


@pytest.mark.slow
async def test_a_step_timeout_inside_a_prompt_step_is_a_step_timeout() -> None:
    """Issue 33, finding 9: the step's own timeout stops a long prompt inside its llama_decode
    (the abort callback): the step fails with ``StepTimeout`` (``DEADLINE_EXCEEDED``, reason
    ``STEP_TIMEOUT`` on the wire), not as a cancel, and the session holds what it held."""
    path = await trio.to_thread.run_sync(ensure_model, "bench")
    async with LlamaCppEngine() as eng:
        caps = await eng.load(
            LoadSpec(model_path=path, n_ctx=4096, max_sessions=1, n_batch=2048, n_threads=1))
        await eng.open_session("big")
        rng = random.Random(2)
        prompt = (1, *(rng.randrange(3, caps.n_vocab) for _ in range(1999)))
        await eng.prefill(PrefillRequest("big", tokens=prompt[:8]))  # warm: the step is the prompt's
        before = eng.metrics()
        with pytest.raises(StepTimeout):  # (about 2 s of compute on one thread: 0.3 s is mid-step)
            await eng.prefill(PrefillRequest("big", tokens=prompt[8:], position=8, step_timeout=0.3))
        after = eng.metrics()
        assert after.aborted_in_step_total == before.aborted_in_step_total + 1  # inside the step
        info = eng.session_info("big")
        assert info.state is SessionState.IDLE and info.n_past == 8
        assert after.kv_cells_used == 8


def _native_threads() -> set[int]:
    """Ids of this process's OS threads that Python did not start (ggml's pool threads)."""
    python = {t.native_id for t in threading.enumerate()}
    return {int(tid) for tid in os.listdir("/proc/self/task")} - python


def _cpu_ticks(tid: int) -> int:
    """User + system clock ticks one thread of this process ran."""
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _ggml_copies() -> dict[str, list[str]]:
    """Native libraries of llama_cpp mapped twice under different file names (the wheel ships
    ``libggml-cpu.so`` and ``libggml-cpu.so.0`` as separate copies)."""
    lib_dir = (Path(llama_cpp.__file__).parent / "lib").resolve()
    names: dict[str, set[str]] = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and Path(fields[5]).parent == lib_dir:
            name = Path(fields[5]).name
            names.setdefault(name.split(".so")[0], set()).add(name)
    return {stem: sorted(files) for stem, files in names.items() if len(files) > 1}


async def _settled_native_threads(expect: Callable[[set[int]], bool]) -> set[int]:
    """The native threads once ``expect`` holds (a Python thread that is exiting has left
    ``threading.enumerate()`` a moment before its OS thread ends); the last sample otherwise."""
    for _ in range(200):
        found = _native_threads()
        if expect(found):
            return found
        await trio.sleep(0.01)
    return found


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
async def test_more_than_one_thread_computes_on_a_pool_freed_with_the_context(tiny_path: Path) -> None:
    """n_threads=2: the context gets one ggml pool (one extra OS thread besides the caller's),
    which computes the same tokens as one thread and is joined when the engine closes."""
    prompt = PROMPTS[1]
    async with LlamaCppEngine() as one:
        caps = await one.load(LoadSpec(model_path=tiny_path, n_ctx=2048, max_sessions=1, n_threads=1))
        assert "threads 1 (the native thread)" in caps.system_info
        assert one._threads is None  # one thread computes on the calling thread, no pool
        await one.open_session("s")
        expected = await _generate(one, "s", one.tokenize(prompt), 24)
    before = _native_threads()
    eng = LlamaCppEngine()
    async with eng:
        caps = await eng.load(LoadSpec(model_path=tiny_path, n_ctx=4096, max_sessions=2, n_threads=2))
        assert "threads 2 (one ggml pool)" in caps.system_info  # what `caps` and health show
        pool = eng._threads
        assert pool is not None and pool.open and pool.n_threads == 2 and pool.poll == 0
        added = await _settled_native_threads(lambda now: len(now - before) == 1) - before
        assert len(added) == 1  # the pool's one thread (the native thread computes too)
        (pool_tid,) = added
        await eng.open_session("s")
        assert await _generate(eng, "s", eng.tokenize(prompt), 24) == expected
        # The context computes on this pool (attached): its thread works during a long prefill.
        # Unattached, ggml would make and join a pool per graph and this thread would stay idle.
        rng = random.Random(5)
        spent = _cpu_ticks(pool_tid)
        await eng.open_session("long")
        await eng.prefill(PrefillRequest("long", tokens=(1, *(rng.randrange(3, 800) for _ in range(1500)))))
        assert _cpu_ticks(pool_tid) > spent
        # steps reuse the pool, they create no threads
        assert await _settled_native_threads(lambda now: now - before == added) - before == added
        assert _ggml_copies() == {}  # ggml's functions came from the copies libllama loaded
    assert not pool.open and eng._threads is None
    assert not await _settled_native_threads(lambda now: not now & added) & added  # joined


def test_missing_pool_functions_are_an_engine_failure(tmp_path: Path) -> None:
    """A llama_cpp whose library directory lacks ggml's pool functions fails the load with a
    typed error (the load's ExitStack then frees what it made), never an AttributeError."""
    from shard.engine import llama_threads

    (tmp_path / "libggml-base.so.0").write_bytes(b"not a library")
    with pytest.raises(EngineFailure, match="thread pool functions are not available|not found"):
        llama_threads._resolve(tmp_path)
    with pytest.raises(EngineFailure, match="not found"):
        llama_threads._resolve(tmp_path / "empty")


def test_missing_capture_functions_are_an_engine_failure(tmp_path: Path) -> None:
    """The same for the functions a non-last shard captures hidden states with: a library that
    will not load, or none at all, is an EngineFailure, never an OSError."""
    from shard.engine import llama_capture

    (tmp_path / "libggml-base.so.0").write_bytes(b"not a library")
    with pytest.raises(EngineFailure, match="tensor functions are not available"):
        llama_capture._resolve(tmp_path)
    with pytest.raises(EngineFailure, match="not found"):
        llama_capture._resolve(tmp_path / "empty")


# ---- long prefill in one native step (bench model) ---------------------------------------------


@pytest.fixture(scope="module")
def long_prefill_logits() -> dict[bool, np.ndarray]:
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("extra_bufts", [True, False], ids=["extra-bufts", "no-extra-bufts"])
async def test_long_prefill_in_one_llama_decode(
    extra_bufts: bool, long_prefill_logits: dict[bool, np.ndarray]
) -> None:
    """1,024 tokens of a Q8_0 model in one ``llama_decode``: the large-batch matrix kernels a
    native build would run on AMX (SIGILL on CPUs that advertise AMX but trap on it). Both weight
    layouts give the same answer."""
    path = await trio.to_thread.run_sync(ensure_model, "bench")
    async with LlamaCppEngine() as eng:
        caps = await eng.load(LoadSpec(
            model_path=path, n_ctx=2048, max_sessions=1, n_batch=2048, n_threads=N_THREADS,
            use_extra_bufts=extra_bufts,
        ))
        assert f"extra bufts {'on' if extra_bufts else 'off'}" in caps.system_info
        assert "CPU :" in caps.system_info  # llama.cpp's own system info line
        await eng.open_session("long")
        rng = random.Random(7)
        prompt = (1, *(rng.randrange(3, caps.n_vocab) for _ in range(1023)))
        res = await eng.prefill(PrefillRequest("long", tokens=prompt, top_k_logprobs=8))
        assert res.n_past == 1024 and res.tokens_processed == 1024 and res.logits is not None
        assert eng.metrics().kv_cells_used == 1024
        top = np.array([t.logprob for t in res.logits.top])
        assert np.isfinite(top).all()
        long_prefill_logits[extra_bufts] = np.array([[t.token_id, t.logprob] for t in res.logits.top])
        assert await eng.release("long")
        assert eng.metrics().kv_cells_used == 0
    if len(long_prefill_logits) == 2:  # the second parametrization compares with the first
        on, off = long_prefill_logits[True], long_prefill_logits[False]
        assert on[0, 0] == off[0, 0]  # same greedy token
        np.testing.assert_allclose(on[:, 1], off[:, 1], atol=1e-2)


# ---- errors ----------------------------------------------------------------------------------


async def test_decode_return_codes_map_to_typed_errors(engine: LlamaCppEngine) -> None:
    """llama_decode: 1 -> KvCacheFull, 2 -> cancelled (only if a cancel was asked), else failure.
    Return code 1 cannot be provoked through the contract (per-session budgets stop it first),
    so the mapping itself is checked here; 2 and -1 are also provoked for real elsewhere."""
    await engine.open_session("m")
    slot = engine._slots["m"]
    with pytest.raises(KvCacheFull) as info:
        engine._raise_decode_error(1, slot)
    assert not info.value.retryable and info.value.session_id == "m"
    with pytest.raises(EngineFailure, match="without a cancel"):
        engine._raise_decode_error(2, slot)
    slot.cancel.set()
    with pytest.raises(EngineCancelled) as cancelled:
        engine._raise_decode_error(2, slot)
    assert not isinstance(cancelled.value, StepTimeout)
    slot.cancel.clear()
    slot.cancel.set_timeout()  # the step's own timeout: a StepTimeout, not a cancel
    with pytest.raises(StepTimeout):
        engine._raise_decode_error(2, slot)
    slot.cancel.clear()
    for rc in (-1, -3, 3):
        with pytest.raises(EngineFailure, match=f"status {rc}"):
            engine._raise_decode_error(rc, slot)
    assert engine.health().ready  # the mapping alone changes nothing


@pytest.mark.parametrize("keep", [2, 0], ids=["gap", "emptied"])
async def test_kv_cache_out_of_step_is_an_engine_failure(engine: LlamaCppEngine, keep: int) -> None:
    """Cells lost behind the engine's back: llama_decode returns -1 for a gap (mapped to
    EngineFailure); an emptied sequence is caught by the engine's own length check. Never
    silently wrong logits."""
    await engine.open_session("s")
    await engine.open_session("other")
    await engine.prefill(PrefillRequest("s", tokens=(1, 5, 6, 7, 8)))
    await engine.prefill(PrefillRequest("other", tokens=(1, 5, 6)))
    engine._truncate_sync(engine._slots["s"].seq_id, keep)
    with pytest.raises(EngineFailure):
        await engine.decode(DecodeRequest("s", token=9))
    assert engine.health().state is EngineState.FAILED
    with pytest.raises(EngineFailure):
        await engine.decode(DecodeRequest("other", token=9))


async def test_close_during_load_frees_the_loaded_model(tiny_path: Path) -> None:
    """aclose() while the load runs in its worker thread: the engine is CLOSED at once, the load
    thread is not abandoned, and the load frees what it loaded and raises NotReady."""
    eng = LlamaCppEngine()
    async with trio.open_nursery() as nursery:
        errors: list[Exception] = []

        async def load() -> None:
            try:
                await eng.load(LoadSpec(model_path=tiny_path, n_ctx=256, n_threads=N_THREADS))
            except NotReady as exc:
                errors.append(exc)

        nursery.start_soon(load)
        while eng.health().state is not EngineState.LOADING:
            await trio.lowlevel.checkpoint()
        await eng.aclose()
        assert eng.health().state is EngineState.CLOSED
    assert len(errors) == 1
    assert eng._ctx is None and eng._model is None and eng._batch is None
    assert eng.health().state is EngineState.CLOSED and eng.metrics().kv_cells_used == 0



async def test_missing_file(tmp_path: Path) -> None:
    async with LlamaCppEngine() as eng:
        with pytest.raises(InvalidInput, match="does not exist"):
            await eng.load(LoadSpec(model_path=tmp_path / "nope.gguf"))
        assert eng.health().state is EngineState.FAILED


async def test_directory_and_missing_path(tmp_path: Path) -> None:
    async with LlamaCppEngine() as eng:
        with pytest.raises(InvalidInput, match="directory"):
            await eng.load(LoadSpec(model_path=tmp_path))
    async with LlamaCppEngine() as eng:
        with pytest.raises(InvalidInput, match="model_path"):
            await eng.load(LoadSpec(model_path=None))


async def test_non_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a model\n" * 100)
    async with LlamaCppEngine() as eng:
        with pytest.raises(InvalidInput, match="not a GGUF"):
            await eng.load(LoadSpec(model_path=bad))


@pytest.mark.parametrize("keep", [4, 24, 4096, 100_000])
async def test_truncated_gguf_fails_cleanly(tmp_path: Path, tiny_path: Path, keep: int) -> None:
    """A file with the GGUF magic but cut short reaches llama.cpp's loader, which must refuse it."""
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(tiny_path.read_bytes()[:keep])
    async with LlamaCppEngine() as eng:
        with pytest.raises(InvalidInput, match=r"could not load .*\(llama\.cpp: .*\)"):
            await eng.load(LoadSpec(model_path=bad))
        assert eng.health().state is EngineState.FAILED


async def test_layer_range_of_a_whole_model_file_says_slice_first(tiny_path: Path) -> None:
    # Loading never writes files: a strict range of an unsliced model is refused with a hint.
    async with LlamaCppEngine() as eng:
        with pytest.raises(InvalidInput, match=r"slice it first .*--layers 0:2"):
            await eng.load(LoadSpec(model_path=tiny_path, layer_range=LayerRange(0, 2)))
        assert eng.health().state is EngineState.FAILED
    async with LlamaCppEngine() as eng:
        caps = await eng.load(LoadSpec(model_path=tiny_path, layer_range=LayerRange(0, 4), n_ctx=256))
        assert caps.layer_range == LayerRange(0, 4)


async def test_too_many_sessions_for_context(tiny_path: Path) -> None:
    async with LlamaCppEngine() as eng:
        with pytest.raises(InvalidInput, match="smaller than max_sessions"):
            await eng.load(LoadSpec(model_path=tiny_path, n_ctx=4, max_sessions=8))
    async with LlamaCppEngine() as eng:
        with pytest.raises(InvalidInput, match="max_sessions"):
            await eng.load(LoadSpec(model_path=tiny_path, n_ctx=1 << 16, max_sessions=300))


async def test_a_batch_smaller_than_the_sequences_is_refused_not_aborted(tiny_path: Path) -> None:
    """llama.cpp aborts the whole process when n_batch is below its sequence count (sessions
    plus prefix cache entries): the load refuses it first, and a batch that holds them loads."""
    async with LlamaCppEngine() as eng:
        with pytest.raises(InvalidInput, match="n_batch 1 is smaller than the 2 sequences"):
            await eng.load(LoadSpec(model_path=tiny_path, n_ctx=256, n_batch=1, max_sessions=2))
        assert eng.health().state is EngineState.FAILED
    async with LlamaCppEngine() as eng:
        with pytest.raises(InvalidInput, match=r"2 sessions \+ \d+ prefix cache entries"):
            await eng.load(LoadSpec(model_path=tiny_path, n_ctx=256, n_batch=2, max_sessions=2,
                                    prefix_cache_tokens=128))
    async with LlamaCppEngine() as eng:
        await eng.load(LoadSpec(model_path=tiny_path, n_ctx=256, n_batch=2, max_sessions=2))


async def test_close_is_idempotent(tiny_path: Path) -> None:
    eng = LlamaCppEngine()
    await eng.load(LoadSpec(model_path=tiny_path, n_ctx=256))
    await eng.open_session("x")
    await eng.prefill(PrefillRequest("x", tokens=(1, 5, 6)))
    await eng.aclose()
    await eng.aclose()
    assert eng.health().state is EngineState.CLOSED
    assert eng.metrics().kv_cells_used == 0


# ---- session hand-off: a state's cells are checked before llama.cpp reads them ---------------


def _first_cell(data: bytes) -> int:
    """Offset of the first cell's position in a one-cache sequence state (magic, seq id,
    n_stream, then each stream's cell count; the first stream with cells)."""
    import struct

    at = 8
    (n_stream,) = struct.unpack_from("<I", data, at)
    at += 4
    for _ in range(n_stream):
        (count,) = struct.unpack_from("<I", data, at)
        at += 4
        if count:
            return at
    raise AssertionError("no cells")


@pytest.mark.parametrize("position", [-5, 2**31 - 1, 3], ids=["negative", "int32-max", "twice"])
async def test_a_state_with_cells_at_positions_the_session_cannot_hold_is_refused(
    engine: LlamaCppEngine, tiny_path: Path, position: int,
) -> None:
    """A crafted state: its first cell moved to a negative position, to 2**31-1 (where
    llama.cpp's ``seq_rm`` never reaches) or onto another cell's position. It is refused
    before llama.cpp reads it, nothing is left in the KV cache, and the sequence id serves
    its next session (such a cell used to leak and fail the engine at the next prefill)."""
    import struct

    from shard.engine import IncompatibleState, SessionSnapshot

    await engine.open_session("s")
    tokens = tuple(range(10, 22))
    await engine.prefill(PrefillRequest("s", tokens))
    snap = await engine.export_session("s")
    await engine.release("s")
    data = bytearray(snap.data)
    struct.pack_into("<i", data, _first_cell(snap.data), position)
    await engine.open_session("t")
    with pytest.raises(IncompatibleState):
        await engine.import_session("t", SessionSnapshot(12, tokens, snap.kv_layout, bytes(data)))
    assert engine.metrics().kv_cells_used == 0 and engine.health().ready
    await engine.release("t")
    for sid in ("u", "v"):  # every sequence id serves again
        await engine.open_session(sid)
        assert (await engine.prefill(PrefillRequest(sid, tokens))).n_past == 12
    assert engine.health().ready


# ---- the prefix cache on every architecture's test model -------------------------------------

async def _greedy_after(engine: LlamaCppEngine, sid: str, first: StepResult, n: int) -> list[int]:
    assert first.logits is not None
    out = [first.logits.token_id]
    for _ in range(n):
        r = await engine.decode(DecodeRequest(sid, token=out[-1]))
        assert r.logits is not None
        out.append(r.logits.token_id)
    return out


@pytest.mark.parametrize("arch", sorted(ARCHS))
async def test_the_prefix_cache_equals_the_same_steps_without_it(arch: str) -> None:
    """On each architecture's test model (sliding windows, chunked attention, low-rank KV
    included): a session started from a cached history, and one of them rewound into the shared
    part, compute the greedy tokens (and logits) that a cacheless engine computes from the same
    steps in the same chunks. Prompts are longer than the sliding windows (8)."""
    path = await trio.to_thread.run_sync(ensure_arch_model, arch)
    spec = LoadSpec(model_path=path, n_ctx=512, max_sessions=2, n_batch=16, n_threads=N_THREADS)
    async with LlamaCppEngine() as cached, LlamaCppEngine() as plain:
        caps = await cached.load(dataclasses.replace(spec, prefix_cache_tokens=256))
        await plain.load(spec)
        assert caps.prefix_cache_tokens == 256, caps.prefix_cache_detail
        span = min(caps.n_vocab, 259) - 3
        prompt = tuple(3 + (i * 37 + 11) % span for i in range(40))
        tail = tuple(3 + (i * 13 + 5) % span for i in range(9))
        other = tuple(3 + (i * 29 + 7) % span for i in range(6))
        histories = []
        for engine in (cached, plain):
            await engine.open_session("a")
            first = await engine.prefill(PrefillRequest("a", tokens=prompt))
            made = await _greedy_after(engine, "a", first, 3)
            histories.append(prompt + tuple(made[:3]))
        assert histories[0] == histories[1]
        history = histories[0]
        await cached.release("a")
        await cached.open_session("b")
        got = await cached.prefill(PrefillRequest("b", tokens=history + tail))
        assert got.cached_tokens == len(history) and got.tokens_processed == len(tail)
        want = await plain.prefill(PrefillRequest("a", tokens=tail, position=len(history)))
        assert got.logits is not None and want.logits is not None
        assert [t.token_id for t in got.logits.top] == [t.token_id for t in want.logits.top]
        assert got.logits.logprob == pytest.approx(want.logits.logprob, abs=1e-5)
        assert await _greedy_after(cached, "b", got, 6) == await _greedy_after(plain, "a", want, 6)
        # A rewind into the copied prefix, then other tokens: as the same steps without a cache.
        for engine, sid in ((cached, "b"), (plain, "a")):
            await engine.truncate(sid, 30)
        got = await cached.prefill(PrefillRequest("b", tokens=other, position=30))
        want = await plain.prefill(PrefillRequest("a", tokens=other, position=30))
        assert await _greedy_after(cached, "b", got, 6) == await _greedy_after(plain, "a", want, 6)
        await cached.release("b")
        assert cached.metrics().kv_cells_used == 0


# ---- embeddings ------------------------------------------------------------------------------


def _oracle_embeddings(path: Path, texts: list[str]) -> list[tuple[list[int], np.ndarray]]:
    """llama-cpp-python's own pooled, L2-normalized embedding of each text (a context made for
    embeddings, as llama-server's ``--embeddings``), with the ids it pooled."""
    llm = llama_cpp.Llama(model_path=str(path), embedding=True, n_ctx=256, n_batch=256,
                          n_ubatch=256, n_threads=N_THREADS, flash_attn=True, verbose=False)
    try:
        return [(list(llm.tokenize(t.encode(), add_bos=True, special=True)),
                 np.asarray(llm.embed(t, normalize=True), dtype=np.float32)) for t in texts]
    finally:
        llm.close()


async def test_embedding_matches_llama_cpp_python_and_leaks_nothing() -> None:
    """The generated ``embed`` model declares mean pooling: the engine's embedding equals
    llama-cpp-python's, for a short text and for one that fills a session (pooled whole, not
    from its last chunk), and the embedding context holds no cell once it answered."""
    path = ensure_model("embed")
    short = "the quick brown fox jumps over the lazy dog"
    texts = [short, " ".join([short] * 25)]
    refs = await trio.to_thread.run_sync(_oracle_embeddings, path, texts)
    async with LlamaCppEngine() as engine:
        caps = await engine.load(LoadSpec(model_path=path, n_ctx=1024, max_sessions=4,
                                          n_batch=64, n_threads=N_THREADS))
        assert caps.pooling_type == "mean" and caps.embeds
        embedder = engine._llama.embedder
        assert embedder is not None
        for text, (ref_tokens, ref) in zip(texts, refs):
            tokens = engine.tokenize(text, parse_special=True)
            assert list(tokens) == ref_tokens
            np.testing.assert_allclose(await engine.embed(tokens), ref, atol=1e-3)
            assert embedder.cells_used() == 0
        # The long text nearly fills a session and is longer than the serving batch.
        assert 200 < len(refs[1][0]) <= caps.n_ctx_per_session
        assert engine._llama.n_batch < len(refs[1][0])
    assert engine._llama.embedder is None
