"""``trio-shard generate --pipeline`` as a real process against live FakeEngine workers.

``trio-shard serve`` only serves llama.cpp models, so the workers here run in the test process
(real sockets, ``serve()``), and the command line runs as a separate process, the way a user
runs it. The llama version of the same check is in ``test_pipeline_llama.py``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import MAX_SESSIONS, MODEL, N_CTX, assert_no_leaks, running_server, signal_cli
from shard.cli import main
from shard.client import ShardClient
from shard.engine import Capabilities, LayerRange, LoadSpec
from shard.engine.fake import FakeEngine
from test_pipeline import PROMPT, THREE, TIMEOUT, assert_all_free, shards

CLI = [sys.executable, "-m", "shard.cli", "--log-level", "WARNING"]


async def run_cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [*CLI, *args], capture_stdout=True, capture_stderr=True, check=False
    )


async def test_generate_pipeline_json_prints_the_single_workers_tokens() -> None:
    async with shards([LayerRange(0, 4), *THREE]) as (whole, *chain):
        pipeline = ",".join(w.target for w in chain)
        common = ["--json", "--max-tokens", "40", PROMPT]
        runs = {
            "single": ["--target", whole.target, *common],
            "piped": ["--pipeline", pipeline, "--chunk-tokens", "3", *common],
            "text": ["--pipeline", pipeline, "--max-tokens", "40", PROMPT],
        }
        out: dict[str, subprocess.CompletedProcess[bytes]] = {}

        async def run(name: str) -> None:
            out[name] = await run_cli("generate", *runs[name])

        async with trio.open_nursery() as nursery:  # three processes side by side
            for name in runs:
                nursery.start_soon(run, name)
        assert all(p.returncode == 0 for p in out.values()), {k: p.stderr for k, p in out.items()}
        want, got = json.loads(out["single"].stdout), json.loads(out["piped"].stdout)
        assert len(want["tokens"]) >= 32 or want["finish_reason"] == "eog"
        # one pass for the prompt, then one per token after the first
        assert got.pop("traversals") == len(want["tokens"])
        assert got == want  # tokens, text and finish reason
        assert out["text"].stdout.decode() == want["text"] + "\n"
        await assert_all_free([whole, *chain])


@pytest.mark.parametrize(
    "args, words",
    [
        (["--pipeline", "127.0.0.1:1,,127.0.0.1:2"], "without empty entries"),
        (["--pipeline", "127.0.0.1:1,localhost"], "expected HOST:PORT, got 'localhost'"),
        (["--pipeline", "127.0.0.1:1,h:99999"], "expected HOST:PORT, got 'h:99999'"),
        (["--pipeline", "127.0.0.1:1", "--target", "127.0.0.1:2"], "not allowed with argument"),
        (["--pipeline", "127.0.0.1:1,127.0.0.1:2|,127.0.0.1:3"], "without empty entries"),
        (["--pipeline", "127.0.0.1:1,127.0.0.1:2|localhost"], "expected HOST:PORT, got 'localhost'"),
        (["--pipeline", "127.0.0.1:1|127.0.0.1:2,127.0.0.1:1"], "127.0.0.1:1 is listed twice"),
        (["--pipeline", "127.0.0.1:1", "--step-timeout", "0"], "expected a number > 0"),
        (["--pipeline", "127.0.0.1:1", "--replay-mib", "-1"], "expected a finite number >= 0"),
    ],
    ids=["empty-entry", "no-port", "bad-port", "with-target", "empty-replica", "bad-replica",
         "twice", "step-timeout", "replay-mib"],
)
def test_malformed_pipeline_lists_are_usage_errors(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", *args, "hello"])
    assert info.value.code == 2
    assert words in capsys.readouterr().err


def test_replicas_are_separated_by_a_bar() -> None:
    from shard.cli import build_parser

    args = build_parser().parse_args(
        ["generate", "--pipeline", "a:1, b:2|c:3 ,d:4", "--step-timeout", "2.5", "hi"])
    assert args.pipeline == [["a:1"], ["b:2", "c:3"], ["d:4"]]
    assert args.step_timeout == 2.5 and args.replay_mib == 256


async def test_a_failing_hop_with_a_replica_fails_over_and_json_reports_it() -> None:
    """The middle worker fails mid-generation (ENGINE_FAILURE); its replica takes over: the
    output is the single worker's, plus the failover."""
    ranges = [LayerRange(0, 4), THREE[0], THREE[1], THREE[1], THREE[2]]
    async with shards(ranges, fail_at_step={2: 40}) as (whole, a, b1, b2, c):
        common = ["--json", "--max-tokens", "40", PROMPT]
        single = await run_cli("generate", "--target", whole.target, *common)
        piped = await run_cli("generate", "--pipeline", f"{a.target},{b1.target}|{b2.target},{c.target}",
                              "--step-timeout", "30", *common)
        await assert_all_free([whole, a, b2, c])
    assert piped.returncode == 0, piped.stderr.decode()
    got = json.loads(piped.stdout)
    (failover,) = got.pop("failovers")
    assert got.pop("traversals") == len(got["tokens"])
    assert got == json.loads(single.stdout)
    assert failover["hop"] == 1 and failover["from"] == b1.target and failover["to"] == b2.target
    assert failover["reason"] == "ENGINE_FAILURE" and failover["handover"] is False
    assert failover["positions"] > 0 and failover["recovery_ms"] >= 0
    assert f"failed over from {b1.target} to {b2.target}" in piped.stderr.decode()


async def test_a_refused_chain_is_a_clear_error() -> None:
    async with shards([LayerRange(0, 2), LayerRange(3, 4)]) as chain:
        out = await run_cli("generate", "--pipeline", ",".join(w.target for w in chain), "hi")
    assert out.returncode == 1
    err = out.stderr.decode()
    assert "INCOMPATIBLE_MODEL: hop 1" in err and "gap" in err and "Traceback" not in err


@pytest.mark.parametrize("how", ["sigint", "sigkill"])
async def test_client_disconnect_frees_every_shard(how: str) -> None:
    """The pipeline process goes away mid-generation. SIGINT: it cancels, resets its streams and
    releases every session itself. SIGKILL: the connections just drop; each worker retains the
    session for resume_ttl (here 0.5 s), then frees it."""
    async with shards(THREE, latency=0.002, resume_ttl=0.5) as chain:
        out = bytearray()
        code, _ = await signal_cli(
            ["generate", "--pipeline", ",".join(w.target for w in chain), "--max-tokens", "5000",
             "--json", PROMPT],
            lambda: chain[2].gate.steps >= 30,  # decoding through every shard
            signal.SIGINT if how == "sigint" else signal.SIGKILL, timeout=TIMEOUT, stdout=out,
        )
        assert code == (130 if how == "sigint" else -signal.SIGKILL)
        if how == "sigint":
            got = json.loads(out)  # what it had received, then it stopped
            assert got["interrupted"] is True and 0 < len(got["tokens"]) < 5000
            await assert_all_free(chain)  # released by the client before it exited
        else:
            with trio.fail_after(10):
                while True:
                    busy = 0
                    for w in chain:
                        async with ShardClient.connect(w.target, timeout=TIMEOUT) as client:
                            m = await client.metrics()
                        busy += m.engine["sessions_active"] + m.engine["kv_cells_used"]
                    if not busy:
                        break
                    await trio.sleep(0.1)
            await assert_all_free(chain)


async def test_a_hop_failing_mid_generation_is_a_clear_error() -> None:
    async with shards(THREE, fail_at_step={2: 20}) as chain:
        out = await run_cli(
            "generate", "--pipeline", ",".join(w.target for w in chain), "--max-tokens", "50", PROMPT
        )
        await assert_all_free(chain[:2])
    assert out.returncode == 1
    err = out.stderr.decode()
    assert f"ENGINE_FAILURE: hop 2 ({chain[2].target}, layers [3, 4))" in err, err
    assert "Traceback" not in err


# ---- workers that are still loading (wait-for-ready) -----------------------------------------


class GatedLoadEngine(FakeEngine):
    """A FakeEngine whose load waits for ``may_load``: its worker says NOT_READY until then."""

    def __init__(self) -> None:
        super().__init__(model=MODEL)
        self.may_load = trio.Event()

    async def _impl_load(self, spec: LoadSpec) -> Capabilities:
        await self.may_load.wait()
        return await super()._impl_load(spec)


@asynccontextmanager
async def loading_worker(layers: LayerRange) -> AsyncIterator[tuple[GatedLoadEngine, Any]]:
    """A worker whose port is bound and whose engine loads once ``engine.may_load`` is set."""
    engine = GatedLoadEngine()
    spec = LoadSpec(n_ctx=N_CTX, max_sessions=MAX_SESSIONS, layer_range=layers)
    async with engine:
        async with running_server(engine, load=spec) as server:
            yield engine, server
        assert_no_leaks(engine)


@pytest.mark.parametrize("loads", [True, False], ids=["loads-later", "never-ready"])
@pytest.mark.parametrize("mode", ["target", "pipeline"])
async def test_generate_waits_for_a_worker_that_is_still_loading(mode: str, loads: bool) -> None:
    """The CLI asks Health until the worker serves (it used to fail with NOT_READY at once);
    one that does not serve within --timeout is a clear error naming its last status."""
    async with shards([LayerRange(0, 2)]) as (first,), loading_worker(
        LayerRange(0, 4) if mode == "target" else LayerRange(2, 4)
    ) as (engine, server):
        where = ["--target", server.target] if mode == "target" else ["--pipeline", f"{first.target},{server.target}"]
        done: list[subprocess.CompletedProcess[bytes]] = []

        async def generate() -> None:
            timeout = ["--timeout", "1"] * (not loads)
            done.append(await run_cli("generate", *where, *timeout, "--json", "--max-tokens", "5", PROMPT))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate)
            with trio.fail_after(TIMEOUT):  # until it has asked twice (or given up)
                while server.registry.counters["rpc_Health_total"] < 2 and not done:
                    await trio.sleep(0.01)
            if loads:
                engine.may_load.set()
        await assert_all_free([first])
    out, err = done[0], done[0].stderr.decode()
    if loads:
        assert out.returncode == 0, err
        assert len(json.loads(out.stdout)["tokens"]) == 5
        return
    assert out.returncode == 1 and "Traceback" not in err
    assert "NOT_READY" in err and "did not become ready within " in err, err
    assert "s (last status: NOT_READY (loading))" in err, err
    assert mode == "target" or f"hop 1 ({server.target})" in err


@pytest.mark.parametrize("mode", ["target", "pipeline"])
async def test_generate_waits_for_a_worker_that_is_not_listening_yet(mode: str) -> None:
    """Nothing listens on the (last) worker's port when the command starts: it tries again
    within --timeout, as the door does (it used to give up at once on the connection
    refused), and once a worker listens there it generates as usual."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        late = f"127.0.0.1:{probe.getsockname()[1]}"
    async with shards([LayerRange(0, 2)]) as (first,):
        where = ["--target", late] if mode == "target" else ["--pipeline", f"{first.target},{late}"]
        out, err = bytearray(), bytearray()

        async def collect(stream: Any, into: bytearray) -> None:
            async with stream:
                while chunk := await stream.receive_some():
                    into += chunk

        proc = await trio.lowlevel.open_process(
            [*CLI[:-1], "INFO", "generate", *where, "--timeout", str(TIMEOUT), "--json",
             "--max-tokens", "5", PROMPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(collect, proc.stdout, out)
                nursery.start_soon(collect, proc.stderr, err)
                with trio.fail_after(TIMEOUT):  # refused, and it says it waits
                    while b"waiting up to" not in err:
                        assert proc.poll() is None, f"it gave up: {err.decode()}"
                        await trio.sleep(0.02)
                await trio.sleep(0.3)  # a few more refused tries
                assert proc.poll() is None, err.decode()
                port = int(late.rsplit(":", 1)[1])
                async with shards([LayerRange(0, 4) if mode == "target" else LayerRange(2, 4)],
                                  port=port) as (w,):
                    with trio.fail_after(TIMEOUT):
                        code = await proc.wait()
                    await assert_all_free([first, w])
        finally:
            if proc.poll() is None:
                proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()
    assert code == 0, err.decode()
    assert f"cannot connect to {late}" in err.decode()  # what it waited out, logged once
    assert len(json.loads(out)["tokens"]) == 5


async def test_a_failed_generation_with_json_prints_what_it_received_and_the_error() -> None:
    """Issue 33, finding 8: the last worker fails mid-generation and its hop has no replica:
    ``--json`` prints the tokens received before the failure (the whole model's first ones)
    and the error with the hop, and the command exits 1 with the error on stderr."""
    ranges = [LayerRange(0, 4), *THREE]
    async with shards(ranges, fail_at_step={3: 30}) as (whole, a, b, c):
        single = await run_cli("generate", "--target", whole.target, "--json", "--max-tokens", "40", PROMPT)
        piped = await run_cli("generate", "--pipeline", f"{a.target},{b.target},{c.target}",
                              "--json", "--max-tokens", "40", PROMPT)
        await assert_all_free([whole, a, b])
    assert piped.returncode == 1, piped.stderr.decode()
    got, want = json.loads(piped.stdout), json.loads(single.stdout)
    assert 0 < len(got["tokens"]) < len(want["tokens"])
    assert got["tokens"] == want["tokens"][: len(got["tokens"])]
    assert got["finish_reason"] == "unspecified"
    assert got["error"]["code"] == "ENGINE_FAILURE" and got["error"]["hop"] == 2
    assert got["error"]["target"] == c.target
    assert "ENGINE_FAILURE" in piped.stderr.decode()


async def test_prompts_file_runs_every_prompt_at_once_and_prints_one_json_line_each(
    tmp_path: Any,
) -> None:
    """``--prompts-file``: three prompts (a blank line skipped), one of them too long for the
    context: two JSON lines with the single worker's tokens, one with the error, each with its
    index; exit status 1 because one failed; every shard free afterwards."""
    prompts = ["the quick brown fox", "a lazy dog", "x " * 2000]
    path = tmp_path / "prompts.txt"
    path.write_text(f"{prompts[0]}\n\n{prompts[1]}\n{prompts[2]}\n", encoding="utf-8")
    async with shards([LayerRange(0, 4), *THREE]) as (whole, *chain):
        want = [json.loads((await run_cli("generate", "--target", whole.target, "--json",
                                          "--max-tokens", "12", p)).stdout) for p in prompts[:2]]
        proc = await run_cli("generate", "--pipeline", ",".join(w.target for w in chain),
                             "--max-tokens", "12", "--prompts-file", str(path),
                             "--batch-groups", "2")
        assert proc.returncode == 1, proc.stderr
        lines = {x["index"]: x for x in map(json.loads, proc.stdout.decode().splitlines())}
        assert sorted(lines) == [0, 1, 2]
        for i in (0, 1):
            got = lines[i]
            assert got.pop("traversals") == len(want[i]["tokens"]) and got.pop("index") == i
            assert got == want[i]
        assert lines[2]["error"]["code"] == "INVALID_ARGUMENT" and lines[2]["tokens"] == []
        assert b"prompt 2: INVALID_ARGUMENT" in proc.stderr
        await assert_all_free([whole, *chain])


@pytest.mark.parametrize(
    "args, words",
    [
        (["--target", "127.0.0.1:1", "--prompts-file", "p.txt"], "--prompts-file needs --pipeline"),
        (["--target", "127.0.0.1:1", "--batch-groups", "2", "hi"], "--batch-groups needs --pipeline"),
        (["--pipeline", "127.0.0.1:1", "--prompts-file", "/nonexistent/p.txt"], "cannot read --prompts-file"),
    ],
)
def test_prompts_file_usage_errors(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", *args]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--pipeline", "127.0.0.1:1", "--prompts-file", "p.txt", "hi"],
                                  ["--pipeline", "127.0.0.1:1"]])
def test_prompt_and_prompts_file_exclude_each_other(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", *args])
    assert exc.value.code == 2
    assert "PROMPT" in capsys.readouterr().err
