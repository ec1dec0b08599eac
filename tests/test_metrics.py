"""Prometheus ``/metrics`` and ``GetMetrics`` come from one snapshot; latency histograms fill;
every session lifecycle event is one log line with session id, peer and principal."""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest
import trio
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import MAX_SESSIONS, MODEL, N_CTX, StepGate, worker
from shard.engine import Distribution, LayerRange, LoadSpec, TickDistributions
from shard.engine.fake import FakeEngine, FakeScript
from shard.client import ShardClient, ShardError, cache_expectation
from shard.rpc.errors import ErrorCode
from shard.rpc.lifecycle import StreamWatch
from shard.rpc.metrics import families, observe_many, snapshot_values, tick_families
from shard.rpc.transport import CallContext, EndReason
from shard.v1 import shard_pb2 as pb


def scrape(port: int) -> dict[str, float]:
    """``/metrics`` as ``{name{labels}: value}`` (blocking: run it in a thread)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def exposed_name(key: str) -> str:
    """Where a ``GetMetrics`` key (``section.name``) appears on ``/metrics``."""
    section, _, name = key.partition(".")
    if name.startswith("errors_total:"):
        return f'trio_shard_worker_errors_total{{code="{name.split(":")[1].removeprefix("ERROR_CODE_")}"}}'
    if name.startswith("connections_cut_total:"):
        return f'trio_shard_worker_connections_cut_total{{reason="{name.split(":")[1]}"}}'
    if section == "worker" and name.startswith("rpc_") and name.endswith("_total"):
        return f'trio_shard_worker_rpc_total{{method="{name[4:-6]}"}}'
    return f"trio_shard_{section}_{name}"


async def run_some_sessions(target: str) -> None:
    """Two generates, a refused open and a step-level error: every counter kind moves."""
    async with ShardClient.connect(target, timeout=30) as client:
        async with client.session(session_id="m-1") as s:
            steps = [step async for step in s.generate([1, 72, 101], max_tokens=4)]
            assert len(steps) == 4
            await s.close(retain=True)
        async with client.session(session_id="m-1", cache=cache_expectation([1, 72, 101])) as s:
            await s.decode(7)
            with pytest.raises(ShardError) as bad:
                await s.decode(10**6)  # outside the vocabulary: in-stream INVALID_ARGUMENT
            assert bad.value.code is ErrorCode.INVALID_ARGUMENT
        with pytest.raises(ShardError):
            async with client.session(session_id="x" * 200):  # refused at open: id too long
                pass


async def test_scrape_after_a_run_matches_get_metrics() -> None:
    async with worker(metrics_port=0) as w:
        await run_some_sessions(w.target)
        await w.idle()
        async with ShardClient.connect(w.target, timeout=30) as client:
            snapshot = snapshot_values(await client.metrics())
        scraped = await trio.to_thread.run_sync(scrape, w.server.metrics_port)
        async with ShardClient.connect(w.target, timeout=30) as client:  # the scrape changed nothing
            assert snapshot_values(await client.metrics()) == {
                **snapshot, "worker.rpc_GetMetrics_total": snapshot["worker.rpc_GetMetrics_total"] + 1
            }

    # The counts the issue names, and then every other key, agree exactly.
    assert snapshot["worker.sessions_opened_total"] == 2
    assert snapshot["worker.sessions_rejected_total"] == 1
    assert snapshot["engine.prefill_tokens_total"] >= 3
    assert snapshot["engine.decode_tokens_total"] >= 3
    assert snapshot["worker.errors_total:ERROR_CODE_INVALID_ARGUMENT"] == 2
    for key in ("worker.sessions_opened_total", "worker.sessions_rejected_total",
                "worker.sessions_open", "worker.sessions_retained", "engine.sessions_active",
                "engine.prefill_tokens_total", "engine.decode_tokens_total"):
        assert scraped[exposed_name(key)] == snapshot[key], key
    assert {key: scraped[exposed_name(key)] for key in snapshot} == snapshot

    # The latency histograms saw the run: one first token per generate/prefill request, one
    # decode-step observation per decode the engine ran (streamed or not), one queue wait per
    # engine operation (the generate's prompt and its stream of 3 steps; 1 decode that ran).
    assert scraped["trio_shard_time_to_first_token_seconds_count"] == 1
    assert scraped["trio_shard_decode_step_seconds_count"] == snapshot["engine.decode_tokens_total"]
    assert scraped["trio_shard_prefill_seconds_per_token_count"] >= 1
    assert scraped["trio_shard_queue_wait_seconds_count"] >= 3


async def test_per_tick_histograms_count_the_ticks_the_counters_count() -> None:
    """A batching engine's ticks (issue 55): ``/metrics`` has one observation per tick of its
    duration, rows and sessions, summing to the ``GetMetrics`` counters, and the gaps while a
    generating session waited between its ticks as idle time."""
    engine = FakeEngine(model=MODEL, script=FakeScript(batched=True, tick_latency=0.001))
    async with worker(engine=engine, metrics_port=0) as w:
        await run_some_sessions(w.target)
        await w.idle()
        async with ShardClient.connect(w.target, timeout=30) as client:
            snapshot = snapshot_values(await client.metrics())
        scraped = await trio.to_thread.run_sync(scrape, w.server.metrics_port)
    ticks = snapshot["engine.batch_ticks_total"]
    assert ticks >= 5  # a prompt, 3 streamed decodes, a decode of the resumed session
    assert snapshot["engine.batch_rows_total"] == (
        snapshot["engine.prefill_tokens_total"] + snapshot["engine.decode_tokens_total"])
    name = "trio_shard_engine_batch_tick"
    for hist in ("seconds", "rows", "sessions"):
        assert scraped[f"{name}_{hist}_count"] == ticks
        assert scraped[f'{name}_{hist}_bucket{{le="+Inf"}}'] == ticks
    assert scraped[f"{name}_rows_sum"] == snapshot["engine.batch_rows_total"]
    assert scraped[f"{name}_sessions_sum"] == snapshot["engine.batch_sessions_total"]
    assert scraped[f'{name}_sessions_bucket{{le="1.0"}}'] == ticks  # one session at a time
    assert 3 <= scraped["trio_shard_engine_batch_idle_seconds_count"] < ticks
    assert snapshot["engine.batch_idle_us_total"] <= (
        scraped["trio_shard_engine_batch_idle_seconds_sum"] * 1e6 + 1e-3)


async def test_concurrent_sessions_show_as_shared_ticks_on_the_worker() -> None:
    """Four sessions generating at once through a worker of a batching engine: their steps
    share ticks (a tick with several sessions), and the rows per tick add up to every token
    the sessions computed."""
    engine = FakeEngine(model=MODEL, script=FakeScript(batched=True, tick_latency=0.001))
    async with worker(engine=engine, metrics_port=0) as w:
        async with ShardClient.connect(w.target, timeout=30) as client:

            async def one(i: int) -> None:
                async with client.session() as s:
                    assert len([x async for x in s.generate([1, 60 + i, 70 + i], max_tokens=6)]) == 6

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(one, i)
        await w.idle()
        scraped = await trio.to_thread.run_sync(scrape, w.server.metrics_port)
    name = "trio_shard_engine_batch_tick"
    assert scraped[f"{name}_rows_sum"] == 4 * (3 + 5)  # each: a 3-token prompt, 5 decodes
    assert scraped[f"{name}_sessions_sum"] <= 4 * (3 + 5)
    assert scraped[f'{name}_sessions_bucket{{le="1.0"}}'] < scraped[f"{name}_sessions_count"]


def test_tick_families_are_cumulative_histograms() -> None:
    empty = Distribution((1.0, 2.0), (0, 0, 0), 0.0)
    ticks = TickDistributions(seconds=empty, rows=Distribution((1, 4), (3, 1, 2), 21.0),
                              sessions=empty, idle_seconds=empty)
    rendered = {f.name: f for f in tick_families(ticks)}
    assert set(rendered) == {"trio_shard_engine_batch_tick_seconds", "trio_shard_engine_batch_tick_rows",
                             "trio_shard_engine_batch_tick_sessions", "trio_shard_engine_batch_idle_seconds"}
    rows = {(s.name, s.labels.get("le")): s.value for s in rendered["trio_shard_engine_batch_tick_rows"].samples}
    assert rows == {
        ("trio_shard_engine_batch_tick_rows_bucket", "1.0"): 3,
        ("trio_shard_engine_batch_tick_rows_bucket", "4.0"): 4,
        ("trio_shard_engine_batch_tick_rows_bucket", "+Inf"): 6,
        ("trio_shard_engine_batch_tick_rows_count", None): 6,
        ("trio_shard_engine_batch_tick_rows_sum", None): 21.0,
    }


@pytest.mark.parametrize("amount", [0.0, 0.0004, 0.001, 0.003, 0.25, 7.0, 99.0])
def test_observe_many_counts_as_that_many_observations(amount: float) -> None:
    """A group's rows are observed at once (``observe_many``): the same count, buckets and sum
    as one ``observe`` per row, also on a bucket's bound and past the last one."""
    registry = CollectorRegistry()
    buckets = (0.001, 0.0025, 0.005, 0.01, 0.25, 1.0, 10.0)
    one = Histogram("one_by_one", "", buckets=buckets, registry=registry)
    many = Histogram("all_at_once", "", buckets=buckets, registry=registry)
    for _ in range(5):
        one.observe(amount)
    observe_many(many, amount, 5)
    samples = {f.name: [(s.name.split("_")[-1], s.labels.get("le"), s.value) for s in f.samples
                        if not s.name.endswith("_created")]
               for f in registry.collect()}
    assert [s[:2] for s in samples["all_at_once"]] == [s[:2] for s in samples["one_by_one"]]
    for (_, _, got), (_, _, want) in zip(samples["all_at_once"], samples["one_by_one"]):
        assert got == pytest.approx(want)


async def test_metrics_server_stops_with_the_worker() -> None:
    async with worker(metrics_port=0) as w:
        port = w.server.metrics_port
        assert (await trio.to_thread.run_sync(scrape, port))["trio_shard_worker_draining"] == 0
        w.server.drain()
        assert (await trio.to_thread.run_sync(scrape, port))["trio_shard_worker_draining"] == 1
    with pytest.raises(urllib.error.URLError):  # the port is closed with the worker
        await trio.to_thread.run_sync(scrape, port)


async def test_hidden_state_bytes_in_and_out_on_a_middle_shard() -> None:
    spec = LoadSpec(n_ctx=N_CTX, max_sessions=MAX_SESSIONS, layer_range=LayerRange(1, 3))
    async with worker(load=spec) as w:
        rows = np.linspace(-1, 1, 3 * MODEL.n_embd, dtype=np.float32).reshape(3, MODEL.n_embd)
        async with ShardClient.connect(w.target, timeout=30) as client:
            async with client.session() as s:
                out = await s.prefill(hidden_states=rows)
                step = await s.decode(hidden_state=rows[:1])
            metrics = snapshot_values(await client.metrics())
    sent = len(out.hidden_states.data) + len(step.hidden_states.data)
    assert sent > 0
    assert metrics["worker.hidden_state_bytes_in_total"] == rows.nbytes + rows[:1].nbytes
    assert metrics["worker.hidden_state_bytes_out_total"] == sent


def test_families_map_every_key_once() -> None:
    snap = pb.GetMetricsResponse(
        engine={"kv_cells_used": 3, "steps_total": 9},
        worker={"errors_total:ERROR_CODE_CANCELLED": 2, "rpc_Health_total": 4, "sessions_open": 1,
                "connections_cut_total:pings_flood": 1},
    )
    rendered = {f.name: (f.type, [(s.labels, s.value) for s in f.samples]) for f in families(snap)}
    assert rendered == {
        "trio_shard_engine_kv_cells_used": ("gauge", [({}, 3)]),
        "trio_shard_engine_steps": ("counter", [({}, 9)]),
        "trio_shard_worker_sessions_open": ("gauge", [({}, 1)]),
        "trio_shard_worker_errors": ("counter", [({"code": "CANCELLED"}, 2)]),
        "trio_shard_worker_rpc": ("counter", [({"method": "Health"}, 4)]),
        "trio_shard_worker_connections_cut": ("counter", [({"reason": "pings_flood"}, 1)]),
    }


# ---- lifecycle logs ------------------------------------------------------------------------


def events(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [dict(r.fields) for r in caplog.records if r.name == "shard.sessions"]


async def test_every_lifecycle_event_is_one_line_with_id_peer_and_principal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)

    async def authorize(ctx: CallContext) -> str:
        await trio.lowlevel.checkpoint()
        return "router-7"

    gate = StepGate()

    async def step_stopped_by(stop: Any, code: ErrorCode, step: Any) -> None:
        """Run ``step`` held in the engine; ``stop()`` while it waits; expect ``code``."""
        gate.hold()
        async with trio.open_nursery() as nursery:

            async def run_step() -> None:
                with pytest.raises(ShardError) as err:
                    await step()
                assert err.value.code is code

            nursery.start_soon(run_step)
            with trio.fail_after(10):
                while gate.waiting == 0:
                    await trio.sleep(0.01)
            await stop()
            gate.release()

    async with worker(gate=gate, authorize=authorize) as w:
        async with ShardClient.connect(w.target, timeout=30) as client:
            async with client.session(session_id="life") as s:
                await s.prefill([1, 72, 101])
                await s.close(retain=True)
            async with client.session(session_id="life", cache=cache_expectation([1, 72, 101])) as s:

                async def cancel() -> None:
                    assert (await client.cancel("life")).was_running

                await step_stopped_by(cancel, ErrorCode.CANCELLED, lambda: s.decode(5))
                await s.close(retain=True)
            assert await client.release("life")
            with pytest.raises(ShardError):
                async with client.session(session_id="x" * 200):  # too long: refused at open
                    pass
            async with client.session(session_id="late", step_timeout=0.05) as s:
                # The engine step is held past its 50 ms deadline (the same Trio clock).
                await step_stopped_by(lambda: trio.sleep(0.2), ErrorCode.DEADLINE_EXCEEDED,
                                      lambda: s.prefill([1, 2, 3]))
        await w.idle()

    seen = [(e["event"], e["session_id"], e.get("scope"), e.get("cache"), e.get("reason"))
            for e in events(caplog)]
    assert seen == [
        ("open", "life", None, "new", None),
        ("close", "life", None, None, "client_close"),
        ("open", "life", None, "hit", None),
        ("cancel", "life", "rpc", None, None),
        ("cancel", "life", "step", None, None),
        ("close", "life", None, None, "client_close"),
        ("release", "life", None, None, None),
        ("error", "x" * 200, "open", None, None),
        ("open", "late", None, "new", None),
        ("deadline", "late", "step", None, "STEP_TIMEOUT"),
        ("close", "late", None, None, "client_close"),
    ]
    for e in events(caplog):
        assert e["principal"] == "router-7"
        assert e["peer"].startswith("ipv4:127.0.0.1:")
    closes = [e["retained"] for e in events(caplog) if e["event"] == "close"]
    assert closes == [True, True, False]
    # The text of each line carries the same fields (what `--log-format text` prints).
    line = next(r.getMessage() for r in caplog.records if r.name == "shard.sessions")
    assert line.startswith("session open session_id=life peer=ipv4:127.0.0.1:")
    assert "principal=router-7" in line


async def test_sessions_ended_by_their_call_deadline_are_counted() -> None:
    """Whichever notices the call deadline first on the worker (its transport's timer or the
    session's own scope), GetMetrics counts the session, as the log always did."""
    async with worker(latency=0.005) as w, ShardClient.connect(w.target, timeout=30) as client:
        for _ in range(3):
            with pytest.raises(ShardError) as info:
                async with client.session(timeout=0.3) as s:
                    steps = s.generate([1, 2, 3], max_tokens=1000)
                    await steps.__anext__()
                    await trio.sleep(0.6)  # not reading: no client-side reset, the worker's deadline passes
                    async for _ in steps:
                        pass
            assert info.value.code is ErrorCode.DEADLINE_EXCEEDED
        await w.idle()
        counts = snapshot_values(await client.metrics())
    assert counts["worker.sessions_deadline_exceeded_total"] == 3
    assert counts["worker.sessions_failed_total"] == 3
    assert counts["worker.errors_total:ERROR_CODE_DEADLINE_EXCEEDED"] == 3
    assert "worker.sessions_cancelled_total" not in counts


class _Counts:
    """A fake ``lifecycle.Counts``: plain counters and recorded first-token times."""

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}
        self.ttft: list[float] = []

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def time_to_first_token(self, seconds: float) -> None:
        self.ttft.append(seconds)


@pytest.mark.parametrize(
    ("error", "end", "expected_events", "expected_counters"),
    [
        (ShardError(ErrorCode.DEADLINE_EXCEEDED, "the call deadline expired"), EndReason.DEADLINE,
         [("deadline", "call"), ("close", "error")],
         {"sessions_failed_total": 1, "sessions_deadline_exceeded_total": 1}),
        # The worker's transport saw the deadline first: the session itself reports no error.
        (None, EndReason.DEADLINE, [("deadline", "call"), ("close", "error")],
         {"sessions_failed_total": 1, "sessions_deadline_exceeded_total": 1}),
        (ShardError(ErrorCode.ENGINE_FAILURE, "boom"), None,
         [("error", "session"), ("close", "error")], {"sessions_failed_total": 1}),
        (None, EndReason.CLIENT_CANCELLED, [("close", "client_cancelled")],
         {"sessions_cancelled_total": 1}),
        (None, EndReason.CONNECTION_LOST, [("close", "connection_lost")], {}),
    ],
)
async def test_stream_watch_tells_how_a_session_ended(
    error: ShardError | None, end: EndReason | None, expected_events: list[tuple[str, str]],
    expected_counters: dict[str, int], caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    counts = _Counts()
    ctx = CallContext(method="/shard.v1.Shard/Session", metadata=(), peer="ipv4:10.0.0.9:4242")
    watch = StreamWatch(counts, ctx)
    watch.request(pb.SessionRequest(open=pb.OpenSession(session_id="w")))
    watch.response(pb.SessionResponse(opened=pb.SessionOpened(session_id="w")))
    watch.request(pb.SessionRequest(generate=pb.Generate(max_tokens=2)))
    watch.response(pb.SessionResponse(step=pb.StepResult(step=1)))
    watch.response(pb.SessionResponse(step=pb.StepResult(step=2)))  # not a first token
    ctx.end_reason = end
    watch.end(error, retained=False)
    got = [(e["event"], e.get("scope") or e.get("reason")) for e in events(caplog)]
    assert got == [("open", None), *expected_events]
    assert all(e["peer"] == "ipv4:10.0.0.9:4242" and e["session_id"] == "w" for e in events(caplog))
    assert len(counts.ttft) == 1
    assert counts.counters == {"sessions_opened_total": 1, "sessions_closed_total": 1, **expected_counters}
