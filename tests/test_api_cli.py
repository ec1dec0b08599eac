"""``trio-shard api`` as an operator runs it, and the front door over llama.cpp workers of a
test model that carries a chat template (``make-model --preset chat``).

Tokens: the front door's chat and completions give exactly what ``trio-shard generate --chat``
and ``--parse-special`` give for the same prompt and seed, over one whole-model worker and over
a 2-hop pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path

import openai
import pytest
import trio
from rpc_harness import (
    CLI,
    no_engine_leaks,  # noqa: F401 - autouse: no sessions/KV cells leak
    worker,
)
from test_api import get, post
from test_pipeline import TIMEOUT, assert_all_free
from test_pipeline_llama import llama_workers

from shard.api import Backend, build_app, serve_http
from shard.cli import build_parser, environment_options
from shard.engine import LayerRange

NAME = "chat-test"
MESSAGES = [{"role": "user", "content": "hello, how are you"}]


def cli_generate(*argv: str) -> dict[str, object]:
    out = subprocess.run([*CLI, "generate", *argv, "--json"], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("shape", ["whole", "pipeline"])
async def test_llama_chat_through_the_front_door_equals_generate_chat(shape: str) -> None:
    ranges: list[LayerRange | None] = [None] if shape == "whole" else [LayerRange(0, 2), LayerRange(2, 4)]
    async with llama_workers(ranges, preset="chat") as workers, AsyncExitStack() as stack:
        targets = [w.target for w in workers]
        where = ["--target", targets[0]] if shape == "whole" else ["--pipeline", ",".join(targets)]
        backend = await stack.enter_async_context(
            Backend.connect([[t] for t in targets], model_id=NAME, timeout=TIMEOUT))
        assert backend.chat is not None and backend.first.chat.eot_token == "<|im_end|>"
        nursery = await stack.enter_async_context(trio.open_nursery())
        stop = trio.Event()
        url = (await nursery.start(partial(serve_http, build_app(backend), host="127.0.0.1",
                                           port=0, shutdown=stop)))[0]
        client = stack.enter_context(openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0))
        args = ["--max-tokens", "12", "--temperature", "0.7", "--seed", "9"]
        want_chat = await trio.to_thread.run_sync(lambda: cli_generate(
            *where, "--chat", MESSAGES[0]["content"], *args))
        want_text = await trio.to_thread.run_sync(lambda: cli_generate(
            *where, "--parse-special", "the quick brown fox<|im_end|>", *args))

        def calls() -> tuple[str, str, str]:
            chat = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12,
                                                  temperature=0.7, seed=9)
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=NAME, messages=MESSAGES, max_tokens=12, temperature=0.7, seed=9, stream=True))
            text = client.completions.create(model=NAME, prompt="the quick brown fox<|im_end|>",
                                             max_tokens=12, temperature=0.7, seed=9)
            return chat.choices[0].message.content or "", streamed, text.choices[0].text

        chat, streamed, text = await trio.to_thread.run_sync(calls)
        # Generation may end at the end-of-turn token (finish "stop"); the texts still agree.
        assert chat == streamed == want_chat["text"]
        assert text == want_text["text"]
        stop.set()
        await assert_all_free(workers)


# ---- the command --------------------------------------------------------------------------


def test_every_api_option_has_a_documented_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["api", "--help"])
    help_text = re.sub(r"\s+", " ", capsys.readouterr().out)
    options = environment_options("api")
    assert len(options) >= 20
    for option in options:
        assert option.variable.startswith("TRIO_SHARD_API_"), option.variable
        assert f"[env {option.variable}]" in help_text, option.variable


def test_environment_sets_api_options(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("TRIO_SHARD_") and k != "TRIO_SHARD_CACHE"]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("TRIO_SHARD_API_PORT", "9123")
    monkeypatch.setenv("TRIO_SHARD_API_PIPELINE", "127.0.0.1:1,127.0.0.1:2")
    monkeypatch.setenv("TRIO_SHARD_API_RELAY", "chain")
    monkeypatch.setenv("TRIO_SHARD_PORT", "1")  # serve's variable: not the api's
    monkeypatch.setenv("TRIO_SHARD_API_KEEPALIVE", "0")
    monkeypatch.setenv("TRIO_SHARD_API_REQUESTS_PER_KEY", "3")
    args: argparse.Namespace = build_parser().parse_args(["api", "--max-body-bytes", "100"])
    assert (args.port, args.relay, args.max_body_bytes) == (9123, "chain", 100)
    assert (args.keepalive, args.requests_per_key) == (0.0, 3)
    assert args.pipeline == [["127.0.0.1:1"], ["127.0.0.1:2"]]


def test_a_public_bind_without_keys_or_tls_is_refused() -> None:
    out = subprocess.run([*CLI, "api", "--host", "0.0.0.0", "--target", "127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2
    assert "--api-key-file" in out.stderr and "--insecure" in out.stderr


def test_requests_per_key_without_keys_is_refused() -> None:
    out = subprocess.run([*CLI, "api", "--target", "127.0.0.1:1", "--requests-per-key", "2"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "--requests-per-key needs --api-key-file" in out.stderr


def test_unreachable_workers_are_an_error_not_a_hang() -> None:
    out = subprocess.run([*CLI, "api", "--target", "127.0.0.1:1", "--port", "0",
                          "--connect-timeout", "2"], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 1
    assert "the workers cannot serve" in out.stderr


async def test_a_door_started_before_its_worker_waits_for_it_and_serves() -> None:
    """``--connect-timeout``: nothing listens on the worker's port yet when the door starts;
    it keeps trying (it said so in its log) and serves once the worker is up."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = await trio.lowlevel.open_process(
        [*CLI, "--log-level", "INFO", "api", "--target", f"127.0.0.1:{port}", "--port", "0",
         "--model-name", "m", "--connect-timeout", "60"],
        stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stderr is not None
    log = bytearray()

    async def read_until(pattern: bytes) -> re.Match[bytes]:
        with trio.fail_after(60):
            while not (found := re.search(pattern, log)):
                chunk = await proc.stderr.receive_some()  # type: ignore[union-attr]
                assert chunk, f"the front door exited:\n{log.decode(errors='replace')}"
                log.extend(chunk)
        return found

    try:
        await read_until(rb"waiting up to 60s for the workers")
        await trio.sleep(0.5)
        assert proc.poll() is None  # still waiting, not exited
        async with worker(port=port) as w:
            url = (await read_until(rb"Running on (http://\S+)")).group(1).decode()
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            status, _, got = await trio.to_thread.run_sync(lambda: post(url + "/v1/completions", body))
            assert status == 200, got
            proc.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                assert await proc.wait() == 0
            await w.idle()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_the_command_serves_reloads_keys_on_sighup_and_stops_on_sigterm(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-first\n")
    async with worker() as w:
        proc = await trio.lowlevel.open_process(
            [*CLI, "api", "--target", w.target, "--port", "0", "--api-key-file", str(keys),
             "--model-name", "m", "--log-format", "json"],
            stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.stderr is not None
        lines: list[dict[str, object]] = []
        buffer = b""

        async def read_until(pred: object) -> dict[str, object]:
            nonlocal buffer
            with trio.fail_after(60):
                while True:
                    for line in lines:
                        if pred(line):  # type: ignore[operator]
                            return line
                    chunk = await proc.stderr.receive_some()
                    assert chunk, "the front door exited"
                    buffer += chunk
                    *done, buffer = buffer.split(b"\n")
                    lines.extend(json.loads(x) for x in done if x.strip())

        try:
            ready = await read_until(lambda x: "listen" in x)
            url = ready["listen"][0]  # type: ignore[index]
            auth = {"authorization": "Bearer sk-first"}
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            status, _, _ = await trio.to_thread.run_sync(lambda: post(url + "/v1/completions", body, headers=auth))
            assert status == 200
            keys.write_text("sk-second\n")
            proc.send_signal(signal.SIGHUP)
            await read_until(lambda x: "token file reloaded" in str(x.get("message")))
            status, _, _ = await trio.to_thread.run_sync(lambda: post(url + "/v1/completions", body, headers=auth))
            assert status == 401
            status, _ = await trio.to_thread.run_sync(lambda: get(url + "/health"))
            assert status == 200
            done = await read_until(lambda x: x.get("message", "").startswith("generation done"))  # type: ignore[union-attr]
            assert done["completion_tokens"] == 2 and done["status"] == 200
            proc.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                assert await proc.wait() == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        await w.idle()
