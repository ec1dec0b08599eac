"""``shard.client.ShardClient`` against a live worker: the convenience API, typed errors (never
exception groups), deadlines (``grpc-timeout`` sent and enforced), RST_STREAM on cancellation,
leaving streams early, automatic credit, resume, and a lost connection."""

from __future__ import annotations

import math
import shutil
import ssl
import subprocess
from contextlib import aclosing
from pathlib import Path

import pytest
import trio
import trio.testing

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import MODEL, loaded, make_engine, worker
from shard.client import (
    TOKEN_CREDIT, ClientSession, ErrorCode, ShardClient, ShardError, cache_expectation, sampling,
)
from shard.rpc.session import SessionLimits
from shard.rpc.transport import CallContext
from shard.rpc.versions import SUPPORTED_VERSIONS
from shard.v1 import shard_pb2 as pb

TOKENS = [1, 72, 101, 108, 108, 111]


async def test_capabilities_health_metrics_and_generate_text() -> None:
    async with worker() as w, ShardClient.connect(w.target, timeout=10) as c:
        caps = await c.capabilities()
        assert caps.engine == "fake" and caps.n_vocab == MODEL.n_vocab
        assert (await c.health()).status == pb.HealthResponse.STATUS_SERVING

        chunks = [ch async for ch in c.generate_text("hello", max_tokens=24, temperature=0.9, seed=5)]
        steps = [s async for s in c.generate("hello", max_tokens=24, temperature=0.9, seed=5)]
        assert len(steps) == 24 and steps[-1].finish_reason == pb.FINISH_REASON_LENGTH
        # Same seed, same tokens; the chunks' text is the incremental decoding of the pieces,
        # so joining it equals decoding all bytes at once (no character is ever split).
        assert [ch.token_id for ch in chunks] == [s.logits.token_id for s in steps]
        assert [ch.piece for ch in chunks] == [s.logits.piece for s in steps]
        raw = b"".join(s.logits.piece for s in steps)
        assert "".join(ch.text for ch in chunks) == raw.decode("utf-8", errors="replace")
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH and str(chunks[0]) == chunks[0].text
        assert all(ch.finish_reason == pb.FINISH_REASON_UNSPECIFIED for ch in chunks[:-1])

        shown = await c.capabilities_dict()
        assert shown["supported_versions"] == ["1.0", "1.1", "1.2", "1.3"] and shown["layer_range"] == [0, MODEL.n_layers_total]
        assert shown["engine"] == "fake" and shown["mtp_enabled"] is False  # defaults are shown too

        metrics = await c.metrics()
        assert metrics.worker["rpc_session_total"] == 2 and metrics.engine["sessions_active"] == 0
        await w.idle()


async def test_session_steps_and_resume() -> None:
    async with worker() as w, ShardClient.connect(w.target, timeout=10) as c:
        async with c.session(session_id="s1", credit=8) as s:
            assert s.cache.outcome == pb.CacheResult.OUTCOME_NEW and s.opened.credit == 8
            first = await s.prefill(TOKENS, top_logprobs=2)
            assert first.n_past == 6 and len(first.logits.top) == 2 and s.usage.prompt_tokens == 6
            second = await s.decode(first.logits.token_id)
            assert second.n_past == 7
            steps = [st async for st in s.generate(max_tokens=20, sampling=sampling(0.7, seed=3))]
            assert len(steps) == 20 and s.usage.generated_tokens == 20  # credit topped up as consumed
            closed = await s.close(retain=True)
            assert closed.kv_retained and closed.reason == pb.SessionClosed.REASON_CLIENT_CLOSE
        held = list(w.engine.session_info("s1").tokens)
        assert len(held) == 7 + 20  # each generated token is fed back, except the last one

        async with c.session(session_id="s1", cache=cache_expectation(held)) as s:
            assert s.cache.outcome == pb.CacheResult.OUTCOME_HIT and s.opened.n_past == 27
            step = await s.decode(steps[-1].logits.token_id)
            assert step.n_past == 28
        # Leaving the block closes without retain: released.
        assert w.engine.sessions() == ()

        async with c.session(session_id="s1", cache=cache_expectation(held)) as s:
            assert s.cache.outcome == pb.CacheResult.OUTCOME_MISS
        await w.idle()


async def test_wait_for_ready_returns_when_serving_and_fails_at_once_on_a_failed_worker() -> None:
    async with worker(engine=make_engine(fail_at_step=1)) as w, ShardClient.connect(w.target, timeout=30) as c:
        assert (await c.wait_for_ready()).status == pb.HealthResponse.STATUS_SERVING
        with pytest.raises(ShardError):
            async with c.session() as s:
                await s.prefill(TOKENS)  # the engine fails: restart needed
        with trio.fail_after(10):  # not the 30 s timeout: waiting cannot help
            with pytest.raises(ShardError) as info:
                await c.wait_for_ready()
        assert info.value.code == ErrorCode.ENGINE_FAILURE and "FAILED" in str(info.value)


async def test_step_errors_are_typed_and_keep_the_session() -> None:
    async with worker() as w, ShardClient.connect(w.target, timeout=10) as c:
        async with c.session() as s:
            with pytest.raises(ShardError) as info:
                await s.prefill([1, 99_999])
            assert info.value.code is ErrorCode.INVALID_ARGUMENT and not info.value.retryable
            assert info.value.grpc_status == 3 and info.value.session_id == s.session_id
            step = await s.prefill(TOKENS)
            assert step.n_past == 6
        await w.idle()


async def test_fatal_errors_are_typed_never_groups() -> None:
    async with worker() as w:
        # A refused version: a plain ShardError out of the connect block, not an ExceptionGroup.
        with pytest.raises(ShardError) as info:
            async with ShardClient.connect(w.target, timeout=10, version=(2, 0)) as c:
                await c.capabilities()
        assert type(info.value) is ShardError
        assert info.value.code is ErrorCode.UNSUPPORTED_VERSION and info.value.supported_versions == SUPPORTED_VERSIONS
        assert info.value.grpc_status == 9

        async with ShardClient.connect(w.target, timeout=10) as c:
            async with c.session(session_id="dup"):
                with pytest.raises(ShardError) as info:
                    async with c.session(session_id="dup"):
                        pass
                assert info.value.code is ErrorCode.SESSION_EXISTS
            with pytest.raises(ShardError) as info:
                async with c.session(expected_model_fingerprint="nope"):
                    pass
            assert info.value.code is ErrorCode.INCOMPATIBLE_MODEL
            assert not await c.release("never-opened")
        await w.idle()
        assert w.engine.sessions() == ()


async def test_connect_failures_are_typed() -> None:
    with pytest.raises(ValueError):
        async with ShardClient.connect("no-port"):
            pass
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there now
    with pytest.raises(ShardError) as info:
        async with ShardClient.connect(f"127.0.0.1:{port}", timeout=5):
            pass
    assert info.value.reason == "CONNECT_FAILED" and info.value.retryable


def test_grpc_timeout_is_rounded_down() -> None:
    """The worker is never told there is more time than the caller has."""
    from shard.rpc.transport.client import _grpc_timeout

    assert _grpc_timeout(150.9).total_seconds() == 150
    assert _grpc_timeout(0.0000019).total_seconds() == 0.000001
    assert _grpc_timeout(2.5000009).total_seconds() == 2.5


async def test_grpc_timeout_is_sent_and_metadata_reaches_the_worker() -> None:
    seen: list[CallContext] = []

    async def authorize(ctx: CallContext) -> None:
        seen.append(ctx)

    async with worker(authorize=authorize) as w:
        async with ShardClient.connect(w.target, timeout=7, metadata=[("x-tenant", "t1")]) as c:
            before = trio.current_time()
            await c.health()
            assert math.isfinite(seen[-1].deadline) and before < seen[-1].deadline <= before + 7.01
            assert ("x-tenant", "t1") in seen[-1].metadata
            await c.health(timeout=None)
            assert seen[-1].deadline == math.inf
            async with c.session(timeout=120.5):  # > 99 s: whole seconds, still a valid header
                assert 119 <= w.calls[-1].deadline - trio.current_time() <= 120.01  # rounded down
        await w.idle()


async def test_client_deadline_resets_and_the_worker_releases() -> None:
    async with worker(latency=0.002) as w, ShardClient.connect(w.target, timeout=10) as c:
        with pytest.raises(ShardError) as info:
            async with c.session(session_id="slowpoke", timeout=0.3) as s:
                async for _ in s.generate(TOKENS, max_tokens=100_000, ignore_eos=True):
                    pass
        assert info.value.code is ErrorCode.DEADLINE_EXCEEDED and info.value.retryable
        await w.idle()
        assert w.engine.sessions() == () and w.server.registry.n_retained == 0
        assert w.gate.after(w.last_end()) <= 1
        assert (await c.health()).status == pb.HealthResponse.STATUS_SERVING  # connection still fine


async def test_a_generating_session_asks_for_a_wide_credit_window_and_grants_it_back_in_halves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Credit is granted back in messages of half the window. ``ShardClient.generate`` (and a
    session opened with ``credit=TOKEN_CREDIT``) asks for 64, so a long generation costs the
    worker one ``Credit`` message per 32 tokens instead of one per 8 (its default window of
    16, which other sessions keep); a worker with a smaller ``max_credit`` grants what it
    allows."""
    sent: list[pb.SessionRequest] = []
    send = ClientSession._send

    async def counting(self: ClientSession, req: pb.SessionRequest) -> None:
        sent.append(req)
        await send(self, req)

    monkeypatch.setattr(ClientSession, "_send", counting)

    def grants() -> list[int]:
        return [r.credit.messages for r in sent if r.WhichOneof("kind") == "credit"]

    async with worker() as w, ShardClient.connect(w.target, timeout=10) as c:
        steps = [st async for st in c.generate(TOKENS, max_tokens=224, ignore_eos=True)]
        assert len(steps) == 224
        assert 5 <= len(grants()) <= 224 // 32 and set(grants()) == {32}, grants()  # (16: 13 of 8)
        sent.clear()
        async with c.session(session_id="wide", credit=TOKEN_CREDIT) as s:
            assert s.opened.credit == TOKEN_CREDIT == 64
            assert len([st async for st in s.generate(TOKENS, max_tokens=100, ignore_eos=True)]) == 100
            assert set(grants()) == {32}, grants()
        async with c.session(session_id="plain") as s:
            assert s.opened.credit == SessionLimits().default_credit == 16
        await w.idle()
    async with worker(limits=SessionLimits(default_credit=4, max_credit=8)) as w, \
            ShardClient.connect(w.target, timeout=10) as c:
        sent.clear()
        assert len([st async for st in c.generate(TOKENS, max_tokens=40, ignore_eos=True)]) == 40
        assert set(grants()) == {4}, grants()
        await w.idle()


async def test_caller_cancellation_sends_rst_and_the_worker_releases() -> None:
    async with worker(latency=0.002) as w, ShardClient.connect(w.target, timeout=10) as c:
        got = 0
        with trio.CancelScope() as caller:  # the caller is cancelled mid-generate
            async with c.session(session_id="cx") as s:
                async for _ in s.generate(TOKENS, max_tokens=100_000, ignore_eos=True):
                    got += 1
                    if got == 5:
                        caller.cancel()
        assert caller.cancelled_caught and got == 5
        await w.idle()
        assert w.engine.sessions() == () and w.server.registry.n_retained == 0
        assert w.gate.after(w.last_end()) <= 1


async def test_leaving_generate_early_keeps_the_session_usable() -> None:
    async with worker(latency=0.001) as w, ShardClient.connect(w.target, timeout=10) as c:
        async with c.session(session_id="brk") as s:
            async for step in s.generate(TOKENS, max_tokens=10_000, ignore_eos=True):
                if step.step == 3:
                    break
            # The worker is told to stop the abandoned generate before the next request.
            nxt = await s.decode(5)
            assert nxt.n_past == w.engine.session_info("brk").n_past
            assert w.server.registry.counters["rpc_Cancel_total"] == 1
        await w.idle()

        # Leaving a one-shot generate early through aclosing resets its stream at once.
        async with aclosing(c.generate_text("abc", max_tokens=10_000, ignore_eos=True)) as texts:
            async for _ in texts:
                break
        await w.idle()
        assert w.engine.sessions() == ()

    # A plain break is safe too (no finalizer, no warning); the stream ends with the client.
    async with worker(latency=0.001) as w:
        async with ShardClient.connect(w.target, timeout=10) as c:
            async for _ in c.generate_text("abc", max_tokens=10_000, ignore_eos=True):
                break
        await w.idle()
        assert w.engine.sessions() == () and w.server.registry.n_retained == 0


async def test_client_that_stops_reading_parks_the_worker() -> None:
    async with worker() as w, ShardClient.connect(w.target, timeout=10) as c:
        async with c.session(session_id="park", credit=4) as s:
            gen = s.generate(TOKENS, max_tokens=100, ignore_eos=True)
            async with aclosing(gen):
                await gen.__anext__()  # take one result, then stop reading
                call = w.call("park")
                assert call is not None
                with trio.fail_after(10):
                    await call.parked.wait_value(True)
                assert w.engine.metrics().steps_total == 4 and call.buffered() <= 4
                for _ in range(20):
                    await trio.testing.wait_all_tasks_blocked()
                assert w.engine.metrics().steps_total == 4
                rest = [step async for step in gen]  # reading again grants credit
                assert len(rest) == 99
        await w.idle()


async def test_out_of_band_cancel_and_release_through_the_client() -> None:
    async with worker(latency=0.002) as w, ShardClient.connect(w.target, timeout=10) as c:
        async with c.session(session_id="oob") as s:
            results: list[pb.StepResult] = []

            async def consume(session: ClientSession) -> None:
                with pytest.raises(ShardError) as info:
                    async for step in session.generate(TOKENS, max_tokens=100_000, ignore_eos=True):
                        results.append(step)
                assert info.value.code is ErrorCode.CANCELLED

            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume, s)
                while len(results) < 3:
                    await trio.sleep(0.001)
                reply = await c.cancel("oob")
                assert reply.found and reply.was_running
            assert s.usage.generated_tokens >= 3
            step = await s.decode(7)  # still usable
            assert step.n_past == w.engine.session_info("oob").n_past

            assert await c.release("oob")
            with pytest.raises(ShardError) as info:
                await s.decode(7)
            assert info.value.code is ErrorCode.SESSION_NOT_FOUND
        assert w.engine.sessions() == ()
        await w.idle()


async def test_server_stopping_mid_stream_fails_calls_with_a_typed_error() -> None:
    async with worker(latency=0.002) as w, ShardClient.connect(w.target, timeout=10) as c:
        with pytest.raises(ShardError) as info:
            async with c.session(session_id="gone") as s:
                async for step in s.generate(TOKENS, max_tokens=100_000, ignore_eos=True):
                    if step.step == 5:
                        w.stop()
        assert type(info.value) is ShardError
        assert info.value.grpc_status == 14 and info.value.retryable  # UNAVAILABLE: try elsewhere
        with pytest.raises(ShardError):
            await c.health()  # the connection is gone too
    assert w.engine.sessions() == ()


async def test_lost_connection_retains_the_session_for_resume() -> None:
    async with worker(latency=0.002) as w:
        async with ShardClient.connect(w.target, timeout=10) as c:
            with pytest.raises(ShardError) as info:
                async with c.session(session_id="drop") as s:
                    await s.prefill(TOKENS)
                    await c._conn.stream.aclose()  # noqa: SLF001 - the network goes away
                    await s.decode(5)
            assert info.value.grpc_status == 14 and type(info.value) is ShardError
        await w.idle()
        assert w.server.registry.retained("drop") is not None  # kept for resume_ttl
        async with ShardClient.connect(w.target, timeout=10) as c:
            async with c.session(session_id="drop", cache=cache_expectation(TOKENS)) as s:
                assert s.cache.outcome == pb.CacheResult.OUTCOME_HIT and s.cache.tokens_held == 6
        assert w.engine.sessions() == ()


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path]:
    """A throwaway self-signed certificate for 127.0.0.1 (EC key: fast to make)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    return key, cert


async def test_tls_end_to_end(tls_files: tuple[Path, Path]) -> None:
    key, cert = tls_files
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))
    async with worker(ssl_context=server_ctx) as w:
        async with ShardClient.connect(w.target, timeout=10, ssl_context=client_ctx) as c:
            assert (await c.capabilities()).engine == "fake"
            chunks = [ch async for ch in c.generate_text("tls", max_tokens=4)]
            assert len(chunks) == 4
        with pytest.raises(ShardError) as info:  # a client that does not trust the worker
            async with ShardClient.connect(w.target, timeout=10, ssl_context=ssl.create_default_context()):
                pass
        assert info.value.reason == "CONNECT_FAILED"
        await w.idle()


def loaded_reference(model: object, spec: object) -> object:
    """A second engine of the same model, computing the expected results directly."""
    from shard.engine.fake import FakeEngine

    return loaded(FakeEngine(model=model), spec=spec)  # type: ignore[arg-type]


async def test_chunked_boundary_results_are_reassembled() -> None:
    from shard.engine import LayerRange, LoadSpec, PrefillRequest
    from shard.engine.fake import FakeEngine, FakeModel
    from shard.rpc.convert import tensor_to_array
    from shard.rpc.transport import TransportLimits

    wide = FakeModel(n_layers_total=4, n_embd=256, seed=3)
    spec = LoadSpec(n_ctx=512, max_sessions=2, layer_range=LayerRange(0, 2))
    limits = TransportLimits(max_message_bytes=16 * 1024)  # 40 rows of 1 KiB: 4 chunks
    tokens = list(range(3, 43))
    async with (
        worker(engine=FakeEngine(model=wide), load=spec, transport_limits=limits) as w,
        ShardClient.connect(w.target, timeout=10) as c,
    ):
        async with c.session(credit=2) as s:
            first = await s.prefill(tokens)
            assert not first.more_chunks and list(first.hidden_states.shape) == [40, 256]
            again = await s.prefill(list(range(50, 80)))  # 30 new rows: 3 chunks
            assert list(again.hidden_states.shape) == [30, 256] and again.start_position == 40
            decoded = await s.decode(70)  # credit 2 went exactly twice: one per chunked result
            assert decoded.n_past == 71 and list(decoded.hidden_states.shape) == [1, 256]
        await w.idle()
    async with loaded_reference(wide, spec) as reference:
        await reference.open_session("r")
        want = await reference.prefill(PrefillRequest("r", tuple(tokens)))
        assert want.boundary is not None
        assert tensor_to_array(first.hidden_states, 256).tobytes() == want.boundary.hidden_states.tobytes()
        await reference.release("r")


async def test_a_chunked_result_over_max_result_bytes_fails_the_session_and_frees_it() -> None:
    from shard.engine import LayerRange, LoadSpec
    from shard.engine.fake import FakeEngine, FakeModel
    from shard.rpc.transport import TransportLimits

    wide = FakeModel(n_layers_total=4, n_embd=256, seed=3)
    spec = LoadSpec(n_ctx=512, max_sessions=2, layer_range=LayerRange(0, 2))
    limits = TransportLimits(max_message_bytes=16 * 1024)  # 40 rows of 1 KiB: 4 chunks
    async with (
        worker(engine=FakeEngine(model=wide), load=spec, transport_limits=limits) as w,
        ShardClient.connect(w.target, timeout=10, max_result_bytes=20 * 1024) as c,
    ):
        async with c.session() as s:
            assert (await s.prefill(list(range(3, 13)))).hidden_states.shape[0] == 10  # 10 KiB
            with pytest.raises(ShardError) as info:
                await s.prefill(list(range(13, 53)))  # 40 KiB
            assert info.value.code == ErrorCode.RESOURCE_EXHAUSTED and not info.value.retryable
            assert info.value.reason == "RESULT_TOO_LARGE" and "max_result_bytes=20480" in str(info.value)
            assert s._chunks == []
            with pytest.raises(ShardError) as again:
                await s.decode(5)
            assert again.value is info.value  # the session is over
        await w.idle()  # the stream was reset: the worker released the session
        assert w.engine.metrics().sessions_active == 0


class _ChunkingStream:
    """A fake session stream (the transport under a ``ClientSession``): it opens a session with
    a KV capacity of 4 positions, then answers any step with ``chunks`` hidden-state chunks, each
    with ``more_chunks`` set (a worker that never finishes its result), and counts them."""

    def __init__(self, chunks: list[pb.Tensor]) -> None:
        self._replies = [pb.SessionResponse(opened=pb.SessionOpened(session_id="s", kv_capacity=4, credit=8))]
        self._replies += [pb.SessionResponse(step=pb.StepResult(step=1, hidden_states=t, more_chunks=True))
                          for t in chunks]
        self.delivered = -1  # chunks handed to the client (after SessionOpened)
        self.aborted = False

    async def send(self, message: object) -> None:
        await trio.lowlevel.checkpoint()

    async def receive(self, message_type: object) -> pb.SessionResponse | None:
        await trio.lowlevel.checkpoint()
        if self.aborted or not self._replies:
            return None
        self.delivered += 1
        return self._replies.pop(0)

    def error(self) -> ShardError | None:
        return ShardError(ErrorCode.INTERNAL, "the fake stream ended")

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        pass


def _rows(n: int, width: int = 8) -> pb.Tensor:
    return pb.Tensor(data=bytes(4 * n * width), shape=[n, width], dtype="float32")


@pytest.mark.parametrize(
    "chunks, delivered, code, words",
    [
        ([_rows(1)] * 1000, 5, ErrorCode.RESOURCE_EXHAUSTED, "more rows than the session's KV capacity (4)"),
        ([_rows(2), _rows(1, width=9)], 2, ErrorCode.INVALID_ARGUMENT, "malformed result chunk"),
        ([_rows(2), pb.Tensor(data=bytes(5), shape=[1, 8], dtype="float32")], 2,
         ErrorCode.INVALID_ARGUMENT, "malformed result chunk"),
    ],
    ids=["endless", "other-width", "wrong-size"],
)
async def test_chunk_reassembly_is_bounded_by_the_sessions_kv_capacity(
    chunks: list[pb.Tensor], delivered: int, code: ErrorCode, words: str
) -> None:
    """A worker whose result never ends (or whose chunks do not fit together): the client stops
    at the session's KV capacity in rows, drops what it buffered and resets the stream."""
    stream = _ChunkingStream(chunks)
    client = ShardClient(None, timeout=None, metadata=(), version=(1, 0))  # type: ignore[arg-type]
    session = ClientSession(client, stream, "s")  # type: ignore[arg-type]
    await session._open(pb.OpenSession(session_id="s"))
    with pytest.raises(ShardError) as info:
        await session.prefill([1, 2, 3])
    assert info.value.code == code and words in str(info.value), info.value
    assert stream.delivered == delivered and stream.aborted
    assert session._chunks == [] and session._chunks.rows == session._chunks.nbytes == 0


async def test_a_second_task_cannot_step_into_a_busy_session() -> None:
    async with worker(latency=0.01) as w, ShardClient.connect(w.target, timeout=10) as c:
        async with c.session(credit=4) as s:
            await s.prefill(TOKENS)
            got: list[int] = []
            refused: list[ShardError] = []
            started = trio.Event()

            async def generating() -> None:
                async for step in s.generate(max_tokens=12):
                    got.append(step.logits.token_id)
                    started.set()
                    await trio.sleep(0.02)  # between items the generate is still pending

            async def intruder() -> None:
                await started.wait()
                for attempt in (lambda: s.decode(5), lambda: s.prefill([3]), lambda: s.close()):
                    try:
                        await attempt()
                    except ShardError as err:
                        refused.append(err)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(generating)
                nursery.start_soon(intruder)
            assert len(got) == 12  # the first task's generate was never cancelled
            assert [e.code for e in refused] == [ErrorCode.ILLEGAL_TRANSITION] * 3
            assert "another task" in refused[0].message
            assert s.closed is None
            step = await s.decode(got[-1])  # the owner (or anyone, once it is done) goes on
            assert step.n_past == len(TOKENS) + 12 + 1  # 12 decodes of the generate, then ours
        await w.idle()


async def test_the_client_steps_down_to_an_older_workers_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that serves only 1.0 (a fleet being upgraded): a client left at its default
    version speaks 1.0 to it after the first refusal; a client that pinned 1.1 is refused."""
    from shard.rpc import versions

    monkeypatch.setattr(versions, "SUPPORTED_VERSIONS", ((1, 0),))
    async with worker() as w:
        async with ShardClient.connect(w.target, timeout=10) as c:
            caps = await c.capabilities()
            assert [(v.major, v.minor) for v in caps.supported_versions] == [(1, 0)]
            assert (c.version.major, c.version.minor) == (1, 0)
        async with ShardClient.connect(w.target, timeout=10) as c:  # a session opens first
            async with c.session() as s:
                assert (s.opened.version.major, s.opened.version.minor) == (1, 0)
                step = await s.prefill([1, 104, 105])
                assert step.n_past == 3 and s.usage.n_past == 0  # a 1.0 session: no n_past
        async with ShardClient.connect(w.target, timeout=10, version=(1, 1)) as c:
            with pytest.raises(ShardError) as info:
                await c.capabilities()
            assert info.value.code is ErrorCode.UNSUPPORTED_VERSION
        await w.idle()


async def test_sessions_opened_together_all_step_down_to_the_newest_version_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four generations start at once on a fresh client against a worker one minor behind:
    all four are refused, and each steps down from the version it was sent in, to the newest
    the worker serves. (Each used to compare with the client's current version: the first
    stepped down to 1.1, the second on to 1.0, the rest found nothing older and failed.)"""
    from shard.rpc import versions

    monkeypatch.setattr(versions, "SUPPORTED_VERSIONS", ((1, 0), (1, 1)))
    async with worker() as w, ShardClient.connect(w.target, timeout=10) as c:
        got: list[int] = []

        async def generate(i: int) -> None:
            steps = [st async for st in c.generate([1, 104 + i], max_tokens=3, ignore_eos=True)]
            got.append(len(steps))

        async with trio.open_nursery() as nursery:
            for i in range(4):  # (the test worker's every session)
                nursery.start_soon(generate, i)
        assert got == [3] * 4
        assert (c.version.major, c.version.minor) == (1, 1)
        await w.idle()


async def test_a_session_whose_connection_its_owner_closed_fails_with_a_shard_error() -> None:
    """A connection held by another task (as a pool holds each worker's) is closed by its owner
    after it broke, while a session on it still reads: the session fails with the status its
    stream ended with (the worker's DRAINING here), not with the transport's
    ClosedResourceError."""
    async with worker() as w, trio.open_nursery() as nursery:
        closer = trio.Event()

        async def hold(task_status: trio.TaskStatus[ShardClient]) -> None:
            async with ShardClient.connect(w.target, timeout=10) as client:
                task_status.started(client)
                await closer.wait()

        client: ShardClient = await nursery.start(hold)
        session = await client.open_session("orphan")
        await session.prefill(tokens=[1, 2, 3])
        w.stop()  # the connection breaks under the open session
        with trio.fail_after(10):
            while client.connected:
                await trio.sleep(0.01)
        closer.set()  # its owner closes it (resetting the streams it still lists)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(ShardError) as caught:
            await session.decode(token=4)
        assert caught.value.code in (ErrorCode.DRAINING, ErrorCode.NOT_READY), caught.value


async def test_a_session_opened_ahead_sends_its_first_step_without_waiting_for_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``open_session(ahead=True)`` returns once ``OpenSession`` is sent: the prefill follows
    it before any response was read, ``opened`` is filled in by the first read (credit with
    it, none granted before), and a refused open fails that first step with the open's
    error (and frees the worker's side)."""
    events: list[str] = []
    send, nxt = ClientSession._send, ClientSession._next

    async def sending(self: ClientSession, req: pb.SessionRequest) -> None:
        events.append(f"send {req.WhichOneof('kind')}")
        await send(self, req)

    async def reading(self: ClientSession) -> pb.SessionResponse:
        msg = await nxt(self)
        events.append(f"read {msg.WhichOneof('kind')}")
        return msg

    monkeypatch.setattr(ClientSession, "_send", sending)
    monkeypatch.setattr(ClientSession, "_next", reading)
    async with worker() as w, ShardClient.connect(w.target, timeout=10) as c:
        s = await c.open_session("ahead", credit=TOKEN_CREDIT, ahead=True)
        try:
            assert s.opened == pb.SessionOpened()  # not read yet
            step = await s.prefill(TOKENS)
            assert step.n_past == 6 and s.opened.credit == TOKEN_CREDIT
            assert s.opened.session_id == "ahead"
            assert events[:3] == ["send open", "send prefill", "read opened"], events
            assert "send credit" not in events
            assert len([st async for st in s.generate(max_tokens=80, ignore_eos=True)]) == 80
            await s.close()
        finally:
            s.abort()
        events.clear()
        refused = await c.open_session(expected_model_fingerprint="nope", ahead=True)
        with pytest.raises(ShardError) as info:
            await refused.prefill(TOKENS)
        assert info.value.code is ErrorCode.INCOMPATIBLE_MODEL and not refused.alive
        assert events[:2] == ["send open", "send prefill"], events
        await w.idle()
        assert w.engine.sessions() == ()
