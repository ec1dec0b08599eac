"""The q8_0 hidden-state wire dtype (issue 55): llama.cpp's Q8_0 block layout, negotiated like
float16; and q8_0_outliers, the same with each row's largest channels sent apart, exact.

The codec: every value within half a block's scale of what was sent, a decoded row encoding to
the very bytes it came from (replays and both relays send the same bytes), the exact byte
layout (checked against gguf-py's own Q8_0 dequantizer), non-finite and out-of-range input
refused. On the wire: a worker lists it, a session asked for it carries 34 bytes per 32
values, a worker that does not list it is never asked for it, and a chain relay gives the
client relay's results bit for bit. On the tiny llama.cpp model a 2-part q8_0 pipeline gives
the whole model's greedy tokens up to the first near-tie of the whole model's two best tokens.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rpc_harness import MODEL
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.client import ShardClient, ShardError
from shard.engine import LayerRange
from shard.pipeline import Pipeline
from shard.rpc import convert
from shard.rpc.errors import ErrorCode
from shard.rpc.hidden_codec import CODECS, OUTLIERS, Q8_BLOCK, max_row_bytes, row_bytes
from shard.v1 import shard_pb2 as pb
from test_pipeline import PROMPT, TIMEOUT, _raw_prefill, assert_all_free, cuts_to_ranges, shards

Q8 = CODECS["q8_0"]
Q8X = CODECS["q8_0_outliers"]


def scale_bound(block: np.ndarray) -> float:
    """The largest scale the encoder may pick for a block (max|x| / 127 rounded up to a float16,
    at least float16's smallest normal)."""
    amax = float(np.abs(block).max()) if block.size else 0.0
    return 0.0 if amax == 0 else max(amax / 127 * (1 + 2**-10), 2**-14)


magnitudes = st.sampled_from([0.0, 1e-9, 1e-5, 1e-2, 1.0, 300.0, 6e4, 8e6])


@st.composite
def hidden_rows(draw: Any) -> np.ndarray:
    """Rows of any width (padded blocks too) mixing zeros, tiny, ordinary and huge values."""
    rows, n_embd = draw(st.integers(1, 4)), draw(st.integers(1, 100))
    base = draw(hnp.arrays(np.float32, (rows, n_embd),
                           elements=st.floats(-1, 1, width=32, allow_subnormal=False)))
    scales = draw(hnp.arrays(np.float32, (rows, 1 + (n_embd - 1) // 32), elements=magnitudes))
    return (base * np.repeat(scales, 32, axis=1)[:, :n_embd]).astype(np.float32)


@settings(max_examples=300, deadline=None)
@given(x=hidden_rows())
@example(x=np.zeros((2, 64), np.float32))
@example(x=np.full((1, 32), 8e6, np.float32))
@example(x=np.array([[1.0, -1.0, 0.5] * 11], np.float32))
def test_q8_round_trip_is_within_half_a_scale_and_re_encodes_to_the_same_bytes(x: np.ndarray) -> None:
    rows, n_embd = x.shape
    data = Q8.encode(x)
    assert len(data) == rows * -(-n_embd // 32) * 34 == rows * row_bytes("q8_0", n_embd)
    y = Q8.decode(data, rows, n_embd)
    assert y.dtype == np.float32 and y.shape == x.shape and y.flags.c_contiguous
    for r in range(rows):
        for b in range(0, n_embd, 32):
            block, back = x[r, b:b + 32], y[r, b:b + 32]
            bound = 0.5 * scale_bound(block) * (1 + 1e-5)
            assert np.abs(back - block).max() <= bound, (block, back)
    assert Q8.encode(y) == data  # idempotent: what a replay or a relay re-sends is identical
    # gguf-py (llama.cpp's reference in Python) reads the same values back
    if n_embd % 32 == 0:
        ref = dequantize(np.frombuffer(data, np.uint8).reshape(rows, -1), GGMLQuantizationType.Q8_0)
        assert np.array_equal(ref.astype(np.float32), y)


def test_q8_byte_layout_is_llama_cpp_q8_0() -> None:
    """One 33-value row: two blocks (the second padded), each a float16 scale then 32 int8."""
    x = np.zeros((1, 33), np.float32)
    x[0, :4] = [1.27, -0.635, 0.0, 0.01]
    x[0, 32] = -2.54
    data = Q8.encode(x)
    # block 0: max 1.27 -> scale 0.01 rounded up to a float16 (0x211f = 0.0100021...);
    # 1.27 / 0.0100021 = 126.97 -> 127, -0.635 -> -63.49 -> -63, 0.01 -> 1
    # block 1: max 2.54 -> scale 0.02 rounded up (0x251f), -2.54 -> -127, padding zeros
    want = (struct.pack("<H", 0x211F) + bytes([127, 256 - 63, 0, 1]) + bytes(28)
            + struct.pack("<H", 0x251F) + bytes([256 - 127]) + bytes(31))
    assert data == want
    assert Q8_BLOCK.itemsize == 34 and row_bytes("q8_0", 33) == 68
    assert row_bytes("q8_0", 8) == 34 > row_bytes("float32", 8)  # a narrow row: q8_0 is wider
    assert max_row_bytes(8) == row_bytes("q8_0_outliers", 8) == 4 * 8 + 34  # and the outliers'
    y = Q8.decode(data, 1, 33)
    assert np.allclose(y[0, :4], [1.27, -0.635, 0.0, 0.01], atol=0.0051) and y[0, 32] < -2.53


def test_q8_non_finite_blocks_arrive_non_finite_and_huge_ones_are_refused() -> None:
    x = np.ones((2, 64), np.float32)
    x[0, 5], x[1, 40] = np.nan, -np.inf
    y = Q8.decode(Q8.encode(x), 2, 64)
    assert np.isnan(y[0, :32]).all() and np.isfinite(y[0, 32:]).all()
    assert not np.isfinite(y[1, 32:]).any() and np.isfinite(y[1, :32]).all()
    with pytest.raises(ShardError) as info:
        convert.tensor_to_array(pb.Tensor(data=Q8.encode(x), shape=[2, 64], dtype="q8_0"), 64,
                                dtype="q8_0")
    assert "NaN or infinite" in info.value.message
    with pytest.raises(ShardError) as info:
        convert.array_to_tensor(np.full((1, 64), 9e6, np.float32), "q8_0")
    assert info.value.code == ErrorCode.INVALID_ARGUMENT and info.value.reason == "FLOAT16_OVERFLOW"


def test_tensor_checks_use_the_q8_row_size() -> None:
    exact = np.full((3, 40), 127 / 128, np.float32)  # scale 2**-7, q 127: no rounding
    t = convert.array_to_tensor(exact, "q8_0")
    assert t.dtype == "q8_0" and list(t.shape) == [3, 40] and len(t.data) == 3 * 2 * 34
    assert np.array_equal(convert.tensor_to_array(t, 40, dtype="q8_0"), exact)
    short = pb.Tensor(data=t.data[:-34], shape=[3, 40], dtype="q8_0")
    with pytest.raises(ShardError, match="needs 204"):
        convert.tensor_to_array(short, 40, dtype="q8_0")
    with pytest.raises(ShardError, match="dtype 'q8_0'"):
        convert.tensor_to_array(convert.array_to_tensor(np.ones((3, 40))), 40, dtype="q8_0")


def test_q8_is_under_0_3_of_float32_per_position() -> None:
    for n_embd in (576, 640, 1024, 4096):  # SmolLM2, Gemma 3 270M, the bench model, 7B class
        assert row_bytes("q8_0", n_embd) <= 0.3 * row_bytes("float32", n_embd)
        assert row_bytes("float16", n_embd) == n_embd * 2


def test_docs_state_the_q8_bytes_per_step_measured_on_real_messages() -> None:
    from pathlib import Path

    from test_pipeline import BENCH_N_EMBD, wire_sizes

    doc = (Path(__file__).resolve().parents[1] / "docs" / "pipelines.md").read_text()
    for n, what in ((1, "decode step"), (512, "512-token prefill")):
        data, request, result = wire_sizes(n, BENCH_N_EMBD, "q8_0")
        assert data == n * BENCH_N_EMBD // 32 * 34
        row = f"| {what} | q8_0 | {data:,} | {request:,} | {result:,} | {request + result:,} |"
        assert row in doc, row


# ---- q8_0 with outlier channels apart -------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(x=hidden_rows())
@example(x=np.zeros((2, 64), np.float32))
@example(x=np.full((1, 40), 3.0, np.float32))  # ties everywhere: the lowest indices go apart
@example(x=np.array([[1e-7, 2e-7, 3e-7, 4e-7, 5e-7, -5e-7] * 6], np.float32))  # tiny row
@example(x=np.array([[5000.0] + [1.0, -0.5, 0.25] * 21], np.float32))  # Gemma-like
def test_q8_outliers_keep_the_largest_exact_and_re_encode_to_the_same_bytes(x: np.ndarray) -> None:
    """The ``k`` largest magnitudes arrive exact; every other value within half its block's
    scale (plus, in a block capped below the smallest of them, a 512th of it); a decoded row
    encodes to the very same bytes."""
    rows, n_embd = x.shape
    k = min(OUTLIERS, n_embd)
    data = Q8X.encode(x)
    assert len(data) == rows * (8 * k + -(-n_embd // 32) * 34) == rows * row_bytes("q8_0_outliers", n_embd)
    y = Q8X.decode(data, rows, n_embd)
    assert y.dtype == np.float32 and y.shape == x.shape and y.flags.c_contiguous
    for r in range(rows):
        apart = np.argsort(-np.abs(x[r]), kind="stable")[:k]
        assert np.array_equal(y[r, apart], x[r, apart])
        m = float(np.abs(x[r, apart]).min())
        rest = x[r].copy()
        rest[apart] = 0
        back = y[r].copy()
        back[apart] = 0
        assert np.abs(back).max() < m or m == 0  # strictly below what went apart
        for b in range(0, n_embd, 32):
            bound = 0.5 * scale_bound(rest[b:b + 32]) * (1 + 1e-5) + m * 2**-9 + 127 * 2**-24
            assert np.abs(back[b:b + 32] - rest[b:b + 32]).max() <= bound
    assert Q8X.encode(y) == data


def test_q8_outliers_byte_layout() -> None:
    """A 40-value row: 4 ascending uint32 indices, their float32 values, then two Q8_0 blocks of
    the rest (channel 1's 900 no longer sets block 0's scale)."""
    x = np.zeros((1, 40), np.float32)
    x[0, [1, 3, 33, 39]] = [900.0, -7.5, 2.0, 1.5]
    x[0, 0], x[0, 38] = 1.27, -0.02
    data = Q8X.encode(x)
    want = (struct.pack("<4I", 1, 3, 33, 39) + struct.pack("<4f", 900.0, -7.5, 2.0, 1.5)
            + Q8.encode(np.where(np.isin(np.arange(40), [1, 3, 33, 39]), 0, x)))
    assert data == want and len(data) == row_bytes("q8_0_outliers", 40) == 32 + 68
    assert np.allclose(Q8X.decode(data, 1, 40), x, atol=0.0051)


def test_q8_outliers_refuse_bad_indices_and_carry_non_finite_values() -> None:
    good = Q8X.encode(np.arange(64, dtype=np.float32).reshape(1, 64))
    for indices in ((60, 61, 62, 64), (60, 62, 61, 63), (60, 60, 62, 63)):  # out of range, order
        bad = struct.pack("<4I", *indices) + good[16:]
        with pytest.raises(ShardError) as info:
            convert.tensor_to_array(pb.Tensor(data=bad, shape=[1, 64], dtype="q8_0_outliers"), 64,
                                    dtype="q8_0_outliers")
        assert info.value.code == ErrorCode.INVALID_ARGUMENT and info.value.reason == "BAD_OUTLIER_INDEX"
    x = np.ones((1, 64), np.float32)
    x[0, 7] = np.nan
    x[0, 8:14] = np.inf  # more non-finite values than go apart: the rest's block is NaN
    y = Q8X.decode(Q8X.encode(x), 1, 64)
    assert np.isnan(y[0, 7]) and not np.isfinite(y[0, :32]).all() and np.isfinite(y[0, 32:]).all()
    with pytest.raises(ShardError) as info:
        convert.array_to_tensor(np.full((1, 64), 9e6, np.float32), "q8_0_outliers")
    assert info.value.reason == "FLOAT16_OVERFLOW"
    huge = np.ones((1, 64), np.float32)
    huge[0, :4] = 9e6  # beyond q8_0's scales, but sent apart: fine
    y = Q8X.decode(Q8X.encode(huge), 1, 64)
    assert np.array_equal(y[0, :4], huge[0, :4]) and np.allclose(y, huge, rtol=0.004)


# ---- on the wire -----------------------------------------------------------------------------


async def test_q8_sessions_are_negotiated_and_refuse_other_tensors() -> None:
    async with shards([LayerRange(1, 3)]) as (w,):
        async with ShardClient.connect(w.target, timeout=TIMEOUT) as client:
            caps = await client.capabilities()
            assert list(caps.hidden_wire_dtypes) == ["float32", "float16", "q8_0", "q8_0_outliers"]
            async with client.session(hidden_wire_dtype="q8_0") as s:
                assert s.hidden_dtype == "q8_0" and s.opened.hidden_wire_dtype == "q8_0"
                f16 = convert.array_to_tensor(np.ones((1, MODEL.n_embd)), "float16")
                assert "dtype" in (await _raw_prefill(s, f16)).message
                bad = pb.Tensor(data=b"\0" * 33, shape=[1, MODEL.n_embd], dtype="q8_0")
                assert "bytes" in (await _raw_prefill(s, bad)).message
                nan = np.full((1, MODEL.n_embd), np.nan, np.float32)
                assert "NaN or infinite" in (await _raw_prefill(
                    s, convert.array_to_tensor(nan, "q8_0"))).message
                step = await s.prefill(hidden_states=np.full((3, MODEL.n_embd), 0.5, np.float32))
                assert step.n_past == 3 and step.hidden_states.dtype == "q8_0"
                assert len(step.hidden_states.data) == 3 * 34  # n_embd 8: one padded block
        await assert_all_free([w])


async def test_a_worker_that_does_not_list_q8_is_never_asked_for_it(monkeypatch: Any) -> None:
    """Hop 2 answers GetCapabilities as an older worker would (no q8_0): the pipeline opens it
    in float32 and every other hop in q8_0, and still generates."""
    listing = convert.capabilities_to_proto

    def older_last_hop(caps: Any, **kw: Any) -> pb.GetCapabilitiesResponse:
        msg = listing(caps, **kw)
        if caps.layer_range.start == 3:
            msg.ClearField("hidden_wire_dtypes")
            msg.hidden_wire_dtypes.extend(["float32", "float16"])
        return msg

    monkeypatch.setattr(convert, "capabilities_to_proto", older_last_hop)
    async with shards(cuts_to_ranges([0, 1, 3, 4])) as chain:
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT,
                                    hidden_dtype="q8_0") as pipe:
            got = await pipe.generate(PROMPT, max_tokens=6, ignore_eos=True)
        assert len(got.tokens) == 6
        assert [w.calls[-1].ctx.wire_dtype for w in chain] == ["q8_0", "q8_0", "float32"]
        await assert_all_free(chain)


@pytest.mark.parametrize("dtype", ["q8_0", "q8_0_outliers"])
async def test_chain_relay_carries_q8_and_equals_the_client_relay(dtype: str) -> None:
    """Every hop in q8_0 both ways: the worker-to-worker sessions are q8_0 too, and the results
    equal the client relay's bit for bit (decoding and re-encoding gives the same bytes)."""
    async with shards(cuts_to_ranges([0, 1, 3, 4]), relay=True) as chain:
        got = {}
        for relay in ("client", "chain"):
            async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT, relay=relay,
                                        hidden_dtype=dtype) as pipe:
                got[relay] = await pipe.generate(PROMPT, max_tokens=12, ignore_eos=True,
                                                 top_logprobs=3, chunk_tokens=3)
        assert [s.logits for s in got["chain"].steps] == [s.logits for s in got["client"].steps]
        assert [w.calls[-1].ctx.wire_dtype for w in chain] == [dtype] * 3
        await assert_all_free(chain)


# ---- accuracy on a real llama.cpp model ------------------------------------------------------


async def test_q8_pipeline_of_the_tiny_llama_model_keeps_the_whole_models_tokens() -> None:
    """Greedy tokens of a 2-part q8_0 pipeline equal the whole model's up to the first token
    where the whole model's two best log-probabilities are within 0.05 nats (a near-tie q8_0
    may flip; this random-weight model has many), with log-probabilities within 0.03 before it.
    (On real models: bench/pipeline/wire_q8.py, docs/protocol.md.)"""
    from test_pipeline import whole_model_steps
    from test_pipeline_llama import llama_workers, ranges_of

    async with llama_workers([None, *ranges_of([0, 2, 4])]) as (whole, *chain):
        want = await whole_model_steps(whole.target, PROMPT, max_tokens=32, ignore_eos=True,
                                       top_logprobs=2)
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT,
                                    hidden_dtype="q8_0") as pipe:
            got = await pipe.generate(PROMPT, max_tokens=32, ignore_eos=True, top_logprobs=2,
                                      chunk_tokens=4)
        assert [w.calls[-1].ctx.wire_dtype for w in chain] == ["q8_0", "q8_0"]
        tokens = [s.logits.token_id for s in want]
        same = next((i for i, (a, b) in enumerate(zip(got.tokens, tokens)) if a != b), len(tokens))
        if same < len(tokens):
            top = want[same].logits.top
            assert top[0].logprob - top[1].logprob < 0.05, f"q8_0 changed greedy token {same}"
        for g, w in zip(got.steps[:same], want[:same]):
            assert abs(g.logits.logprob - w.logits.logprob) < 0.03
        await assert_all_free([whole, *chain])


# ---- replay after a failover -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["q8_0", "q8_0_outliers"])
@given(chunks=st.lists(st.integers(1, 9), min_size=1, max_size=8), max_rows=st.integers(1, 20),
       truncate=st.integers(0, 72))
def test_a_q8_row_log_keeps_the_bytes_sent(dtype: str, chunks: list[int], max_rows: int,
                                           truncate: int) -> None:
    """The log keeps q8_0 rows encoded (34 bytes per 32 values; 32 more with the outliers);
    what it gives back encodes to exactly the bytes each row was sent as, also after a rewind."""
    from shard.pipeline.replay import ReplayBudget, RowLog

    codec, row = CODECS[dtype], row_bytes(dtype, 40)
    assert row == {"q8_0": 68, "q8_0_outliers": 100}[dtype]
    rng = np.random.default_rng(len(chunks))
    parts = [(rng.standard_normal((n, 40)) * 10).astype(np.float32) for n in chunks]
    rows = RowLog(ReplayBudget(None))
    for part in parts:
        rows.append(part, dtype)
    sent = b"".join(codec.encode(p) for p in parts)
    assert rows.positions == sum(chunks) and rows.nbytes == len(sent) == sum(chunks) * row
    slices = list(rows.slices(max_rows))
    assert all(1 <= s.shape[0] <= max_rows and s.dtype == np.float32 for s in slices)
    assert codec.encode(np.concatenate(slices)) == sent
    keep = min(truncate, rows.positions)
    rows.truncate(keep)
    if keep:
        assert codec.encode(np.concatenate(list(rows.slices(max_rows)))) == sent[:keep * row]
    assert rows.nbytes == keep * row


async def test_q8_hops_replay_exactly_what_was_sent() -> None:
    """q8_0 is lossy, but a replacement worker is replayed the very bytes the failed one was
    sent: a run with a failover gives the log-probabilities of one without."""
    from test_failover import LONG, assert_same, fleet, gate_of, generate, run_with
    from test_pipeline import after_steps

    async with fleet() as (_, hops, gates):
        targets = [[w.target for w in ws] for ws in hops]
        async with Pipeline.connect(targets, timeout=TIMEOUT, hidden_dtype="q8_0") as pipe:
            calm, _ = await generate(pipe)
            gate = gate_of(gates, 2, 0)
            at = gate.steps + len(LONG) + 1 + 10  # mid-decode of the second run
            got, seen = await run_with(lambda: after_steps(gate, at, hops[2][0].stop), pipe)
        assert [f.hop for f in got.failovers] == [2]
        assert_same(got, calm.steps, seen)
