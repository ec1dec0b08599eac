"""The grpcio client against a live worker serving the real ``LlamaCppEngine`` (embedded tiny
model, one thread): every session step, and the deadline / cancel releases, asserted through
the worker's state (registry, engine sessions, llama.cpp's own KV cell count, engine steps).

The engine is ``LlamaCppEngine`` with one test hook: each compute first waits ``LATENCY`` (so
a generate is still running when the deadline passes, instead of filling the tiny context
first) and is counted by a ``StepGate``; the numeric work is llama.cpp's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import numpy as np
import trio

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import V, StepGate, in_thread, req
from shard.engine import LoadSpec
from shard.engine.base import Claimed, ComputePlan, ShardEngine, Slot, StreamRun
from shard.engine.llama import LlamaCppEngine
from shard.models import ensure_model
from shard.v1 import shard_pb2 as pb
from test_rpc_grpcio import Live, Requests, Responses, expect_rpc_error, live

LATENCY = 0.005  # seconds before each llama.cpp step


class SteppedLlama(LlamaCppEngine):
    """LlamaCppEngine whose steps are counted (and optionally delayed) by a StepGate."""

    def __init__(self, gate: StepGate, latency: float) -> None:
        super().__init__()
        self.gate, self.latency = gate, latency

    async def _impl_compute(self, slot: Slot, plan: ComputePlan) -> np.ndarray:
        if self.latency:
            await trio.sleep(self.latency)
        await self.gate()
        return await super()._impl_compute(slot, plan)

    async def _impl_stream(self, slot: Slot, run: StreamRun) -> None:
        """A Generate's steps one by one through the two hooks above, each awaited in the
        session's task (the base class's path), so that the gate sees (and may hold) every
        step; the engine's own path delivers steps computed ahead in a callback of its native
        thread (tests/test_llama_engine.py, tests/test_lookahead.py)."""
        await ShardEngine._impl_stream(self, slot, run)

    async def _impl_claim(self, slot: Slot, plan: ComputePlan) -> Claimed | None:
        """A step claimed from the look-ahead is a step too (counted and delayed alike)."""
        claimed = await super()._impl_claim(slot, plan)
        if claimed is not None:
            if self.latency:
                await trio.sleep(self.latency)
            await self.gate()
        return claimed


@asynccontextmanager
async def llama_live(latency: float = 0.0, **kwargs: Any) -> AsyncIterator[Live]:
    gate = StepGate()
    engine = SteppedLlama(gate, latency)
    spec = LoadSpec(model_path=ensure_model("tiny"), n_ctx=1024, max_sessions=2, n_threads=1)
    async with live(engine=engine, gate=gate, load=spec, **kwargs) as w:
        yield w


def kv_cells(w: Live) -> int:
    return w.engine.metrics().kv_cells_used


async def test_grpcio_drives_every_rpc_on_the_llama_engine() -> None:
    async with llama_live() as w:
        caps = await in_thread(lambda: w.stub.GetCapabilities(pb.GetCapabilitiesRequest(version=V), timeout=30))
        assert caps.engine == "llama.cpp" and caps.is_first and caps.is_last
        assert caps.n_ctx_per_session == 512 and caps.max_sessions == 2
        health = await in_thread(lambda: w.stub.Health(pb.HealthRequest(version=V), timeout=30))
        assert health.status == pb.HealthResponse.STATUS_SERVING

        open_msg = pb.OpenSession(
            session_id="L1", expected_model_fingerprint=caps.model_fingerprint,
            expected_layer_range=caps.layer_range, kv_budget=64,
        )
        reqs = Requests(req(open=open_msg))
        rs = Responses(w.stub.Session(iter(reqs), timeout=60))
        try:
            opened = await rs.kind("opened")
            assert opened.cache.outcome == pb.CacheResult.OUTCOME_NEW and opened.kv_capacity == 64

            reqs.put(req(prefill=pb.Prefill(text="hello world", top_logprobs=3)))
            (step,), err, usage = await rs.until_usage()
            n_prompt = step.n_past
            assert err is None and n_prompt == usage.prompt_tokens > 2 and len(step.logits.top) == 3
            assert kv_cells(w) == n_prompt  # llama.cpp's own count of the session's cells

            reqs.put(req(decode=pb.Decode(token=step.logits.token_id)))
            (step,), err, usage = await rs.until_usage()
            assert err is None and step.n_past == n_prompt + 1 and usage.generated_tokens == 1

            reqs.put(req(generate=pb.Generate(max_tokens=4, ignore_eos=True)))
            steps, err, usage = await rs.until_usage()
            assert err is None and len(steps) == 4 and usage.generated_tokens == 4
            assert steps[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert [s.n_past for s in steps] == list(range(n_prompt + 2, n_prompt + 6))
            assert all(s.logits.piece for s in steps)

            reqs.put(req(prefill=pb.Prefill(tokens=pb.TokenIds(ids=[1, caps.n_vocab + 5]))))
            _, err, _ = await rs.until_usage()  # step-level: the session stays usable
            assert err is not None and err.code == pb.ERROR_CODE_INVALID_ARGUMENT

            cancel = await in_thread(lambda: w.stub.Cancel(pb.CancelRequest(version=V, session_id="L1"), timeout=30))
            assert cancel.found and not cancel.was_running
            metrics = await in_thread(lambda: w.stub.GetMetrics(pb.GetMetricsRequest(version=V), timeout=30))
            assert metrics.engine["sessions_active"] == 1 and metrics.worker["sessions_open"] == 1
            assert metrics.engine["kv_cells_used"] == n_prompt + 5

            reqs.put(req(close=pb.CloseSession(retain=False)))
            closed = await rs.kind("closed")
            assert closed.reason == pb.SessionClosed.REASON_CLIENT_CLOSE and not closed.kv_retained
            assert closed.totals.generated_tokens == 5
        finally:
            reqs.end()
        assert await rs.rest() == []
        assert rs.call.code() == grpc.StatusCode.OK
        assert w.engine.sessions() == () and kv_cells(w) == 0
        released = await in_thread(lambda: w.stub.Release(pb.ReleaseRequest(version=V, session_id="L1"), timeout=30))
        assert not released.released
        await w.idle()


def _long_generate(session_id: str, credit: int = 0) -> list[pb.SessionRequest]:
    return [
        req(open=pb.OpenSession(session_id=session_id, initial_credit=credit)),
        req(generate=pb.Generate(text="hello", max_tokens=100_000, ignore_eos=True)),
    ]


async def test_grpcio_timeout_on_llama_ends_in_deadline_exceeded_and_releases_within_one_step() -> None:
    async with llama_live(latency=LATENCY) as w:

        def run() -> grpc.RpcError:
            call = w.stub.Session(iter(_long_generate("Ldl")), timeout=0.5)  # half-closed
            return expect_rpc_error(lambda: list(call))()

        exc = await in_thread(run)
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await w.idle()
        assert w.engine.sessions() == () and w.server.registry.n_retained == 0 and kv_cells(w) == 0
        assert w.gate.steps >= 2  # the prompt and at least one generated token: it was running
        assert w.gate.after(w.last_end()) <= 1  # at most the step in flight when it ended


async def test_grpcio_cancel_on_llama_releases_within_one_step() -> None:
    async with llama_live(latency=LATENCY) as w:
        reqs = Requests(*_long_generate("Lcx", credit=64))
        rs = Responses(w.stub.Session(iter(reqs), timeout=60))
        try:
            await rs.kind("opened")
            for _ in range(5):
                await rs.kind("step")
            assert w.call("Lcx") is not None and kv_cells(w) > 0
            rs.call.cancel()
            await w.idle()
        finally:
            reqs.end()
        assert rs.call.code() == grpc.StatusCode.CANCELLED
        assert w.engine.sessions() == () and w.server.registry.n_retained == 0 and kv_cells(w) == 0
        assert w.gate.after(w.last_end()) <= 1


async def test_out_of_band_cancel_on_llama_stops_the_step_and_keeps_the_session() -> None:
    async with llama_live(latency=LATENCY) as w:
        reqs = Requests(*_long_generate("Loob", credit=64))
        rs = Responses(w.stub.Session(iter(reqs), timeout=60))
        try:
            await rs.kind("opened")
            for _ in range(3):
                await rs.kind("step")
            registry, handled = w.server.registry, []
            real_cancel = registry.cancel

            def recording_cancel(session_id: str) -> tuple[bool, bool]:
                handled.append(trio.current_time())  # when the worker acted on the Cancel
                return real_cancel(session_id)

            registry.cancel = recording_cancel
            reply = await in_thread(lambda: w.stub.Cancel(pb.CancelRequest(version=V, session_id="Loob"), timeout=30))
            assert reply.found and reply.was_running
            _, err, _ = await rs.until_usage()
            assert err is not None and err.code == pb.ERROR_CODE_CANCELLED
            assert w.gate.after(handled[0]) <= 1  # at most the step in flight when it arrived
            held = w.engine.session_info("Loob").n_past
            assert kv_cells(w) == held  # the interrupted step left nothing behind
            reqs.put(req(decode=pb.Decode(token=5)))
            (step,), err, _ = await rs.until_usage()
            assert err is None and step.n_past == held + 1
            reqs.put(req(close=pb.CloseSession()))
            await rs.kind("closed")
        finally:
            reqs.end()
        assert await rs.rest() == []
        assert w.engine.sessions() == () and kv_cells(w) == 0
