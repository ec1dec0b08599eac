"""The operator's commands and configuration: ``health`` and ``metrics``, ``TRIO_SHARD_*``
environment variables for every ``serve`` option, ``--print-config``, and one real worker
process with metrics, tokens, JSON logs and SIGHUP."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest
import trio

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from conftest import sigint_default
from rpc_harness import CLI, signal_cli, worker
from shard.cli import build_parser, environment_options, main
from shard.cli.env import ENV_PREFIX, EnvOption, Options
from shard.client import ShardClient, ShardError
from shard.rpc.auth import bearer_metadata
from shard.rpc.errors import ErrorCode
from shard.rpc.metrics import snapshot_values



def serve_options() -> list[EnvOption]:
    return environment_options("serve")


# ---- environment ------------------------------------------------------------------------------


def parse(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    for key in [k for k in os.environ if k.startswith("TRIO_SHARD_") and k != "TRIO_SHARD_CACHE"]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return build_parser().parse_args(argv)


def test_every_serve_option_has_a_documented_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = re.sub(r"\s+", " ", capsys.readouterr().out)
    names = [o.variable for o in serve_options()]
    assert len(names) >= 18 and "TRIO_SHARD_MAX_SESSIONS" in names
    for name in names:
        assert f"[env {name}]" in help_text, name


def test_environment_sets_serve_options_and_the_command_line_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "TRIO_SHARD_PORT": "6001", "TRIO_SHARD_HOST": "::1", "TRIO_SHARD_MAX_SESSIONS": "7",
        "TRIO_SHARD_GRACE": "2.5", "TRIO_SHARD_MODEL": "/models/m.gguf",
        "TRIO_SHARD_INSECURE": "true", "TRIO_SHARD_LOG_FORMAT": "json",
        "TRIO_SHARD_LOG_LEVEL": "DEBUG", "TRIO_SHARD_THREADS": "",  # empty: unset
    }
    args = parse(["serve", "--max-sessions", "3"], env, monkeypatch)
    assert (args.port, args.host, args.max_sessions, args.grace) == (6001, "::1", 3, 2.5)
    assert args.model == Path("/models/m.gguf") and args.insecure is True
    assert (args.log_format, args.log_level, args.threads) == ("json", "DEBUG", None)
    assert parse(["serve"], {"TRIO_SHARD_INSECURE": "0"}, monkeypatch).insecure is False
    # Other commands ignore serve's variables.
    assert parse(["caps"], {"TRIO_SHARD_PORT": "nonsense"}, monkeypatch).command == "caps"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [("TRIO_SHARD_PORT", "70000", "expected an integer in [0, 65535]"),
     ("TRIO_SHARD_CTX", "lots", "expected an integer"),
     ("TRIO_SHARD_LOG_FORMAT", "xml", "invalid choice"),
     ("TRIO_SHARD_INSECURE", "maybe", "expected one of")],
)
def test_a_bad_variable_is_a_usage_error_naming_it(
    name: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["serve"], {name: value}, monkeypatch)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"environment variable {name}={value!r}" in err and message in err


def test_options_added_later_are_covered_without_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """An option declared through ``Options.add`` gets its variable, its help note and its
    --print-config line with no further code; one that takes a list is refused up front."""
    for key, value in {"TRIO_SHARD_LAYERS": "0:4", "TRIO_SHARD_NO_EXTRA_BUFTS": "yes",
                       "TRIO_SHARD_DEVICES": "3"}.items():
        monkeypatch.setenv(key, value)
    args = build_parser().parse_args(["serve"])
    assert (tuple(args.layers), args.extra_bufts) == ((0, 4), False)
    parser = argparse.ArgumentParser()
    opts = Options(parser, ENV_PREFIX)
    opts.add("--devices", type=int, help="devices")  # an option added after the fact
    assert parser.parse_args([]).devices == 3 and parser.parse_args(["--devices", "5"]).devices == 5
    assert [(o.variable, o.raw) for o in opts.table] == [("TRIO_SHARD_DEVICES", "3")]
    assert "[env TRIO_SHARD_DEVICES]" in parser.format_help()
    with pytest.raises(TypeError):
        opts.add("--gpus", nargs="+", type=int)


def test_print_config_shows_every_value_and_its_source(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TRIO_SHARD_PORT", "6002")
    monkeypatch.setenv("TRIO_SHARD_RESUME_TTL", "5")
    assert main(["serve", "--host", "0.0.0.0", "--resume-ttl", "9", "--print-config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "TRIO_SHARD_PORT=6002  # environment" in lines
    assert "TRIO_SHARD_HOST=0.0.0.0  # command line" in lines
    assert "TRIO_SHARD_RESUME_TTL=9.0  # command line" in lines
    assert "TRIO_SHARD_MAX_SESSIONS=4  # default" in lines
    assert "TRIO_SHARD_AUTH_TOKEN_FILE=  # default" in lines
    shown = {line.split("=", 1)[0] for line in lines if not line.startswith("#")}
    assert {o.variable for o in serve_options()} - {"TRIO_SHARD_PRINT_CONFIG"} <= shown


def config_options() -> list[EnvOption]:
    """What ``--print-config`` prints: the global ``--log-level`` and every serve option."""
    return [o for o in environment_options() + environment_options("serve") if o.dest != "print_config"]


def non_default_argv(option: EnvOption) -> list[str]:
    """The option set to a value other than its default (a KeyError for a new kind of option:
    give it a sample here)."""
    from shard.cli import options as o

    if option.flag:
        return [option.option]
    if option.choices:
        return [option.option, next(str(c) for c in option.choices if c != option.default)]
    sample = {
        o.port: "7", o.positive_int: "7", o.non_negative_int: "7",
        o.non_negative_float: "2.5", o.layer_range: "1:3", o.part: "2/3",
        o.memory: "1G,512M,2G",
        Path: "/srv/my models/it's.gguf", None: "10.0.0.5",
    }[option.type]
    return [option.option, sample]


def printed_config(argv: list[str]) -> dict[str, str]:
    """``--print-config`` of ``argv`` under the current environment, as a shell reads the lines
    (the quoting undone, the ``# source`` comments dropped)."""
    import contextlib
    import io
    import shlex

    from shard.cli.serve import print_config

    args = build_parser().parse_args([*argv, "--print-config"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert print_config(config_options(), args) == 0
    words = [shlex.split(line, comments=True) for line in out.getvalue().splitlines()]
    return dict(w[0].split("=", 1) for w in words if w)


@pytest.mark.parametrize("changed", ["defaults", "every-option"])
def test_print_config_round_trips_through_the_environment(
    changed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The printed lines, fed back as the environment alone, give the same configuration."""
    argv = ["serve"]
    if changed == "every-option":
        argv = [*non_default_argv(next(a for a in config_options() if a.dest == "log_level")), "serve"]
        argv += [w for a in config_options() if a.dest != "log_level" for w in non_default_argv(a)]
    want = parse(argv, {}, monkeypatch)
    config = printed_config(argv)
    assert set(config) == {o.variable for o in config_options()}
    got = parse(["serve"], config, monkeypatch)
    assert vars(got) == vars(want)
    assert printed_config(["serve"]) == config  # printed again from the environment: the same
    if changed == "every-option":
        defaults = parse(["serve"], {}, monkeypatch)
        assert all(getattr(want, a.dest) != getattr(defaults, a.dest) for a in config_options())
        assert config["TRIO_SHARD_NO_EXTRA_BUFTS"] == "1" and want.extra_bufts is False
    else:
        assert config["TRIO_SHARD_NO_EXTRA_BUFTS"] == "0" and want.extra_bufts is True


@pytest.mark.parametrize("broken", ["missing-cert", "garbage-key", "garbage-client-ca"])
def test_serve_says_which_of_its_tls_files_failed(
    broken: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    files = {name: tmp_path / name for name in ("server.pem", "server.key", "ca.pem")}
    cert.cert_chain_pems[0].write_to_path(str(files["server.pem"]))
    cert.private_key_pem.write_to_path(str(files["server.key"]))
    ca.cert_pem.write_to_path(str(files["ca.pem"]))
    if broken == "missing-cert":
        files["server.pem"] = tmp_path / "nowhere.pem"
    else:
        files["server.key" if broken == "garbage-key" else "ca.pem"].write_text("garbage\n")
    argv = ["serve", "--tls-cert", str(files["server.pem"]), "--tls-key", str(files["server.key"]),
            "--tls-client-ca", str(files["ca.pem"])]
    assert main(argv) == 2
    err = capsys.readouterr().err
    option = "--tls-client-ca" if broken == "garbage-client-ca" else "--tls-cert"
    assert err.startswith(f"trio-shard: error: TLS set-up failed: cannot load {option} "), err
    assert "client set-up" not in err and "Traceback" not in err


# ---- health and metrics commands --------------------------------------------------------------


async def run_cli(*argv: str) -> int:
    return await trio.to_thread.run_sync(main, list(argv))


async def test_health_exits_0_when_serving_and_1_when_draining(capsys: pytest.CaptureFixture[str]) -> None:
    async with worker() as w:
        assert await run_cli("health", "--target", w.target) == 0
        assert capsys.readouterr().out.startswith("SERVING  sessions: 0 active, 0 retained, max 4")
        # A draining worker closes its listener and sends GOAWAY at once (docs/protocol.md,
        # "Drain"), so a probe can no longer reach it: non-zero, as a load balancer needs.
        w.server.drain()
        assert await run_cli("health", "--target", w.target, "--json") == 1
        report = json.loads(capsys.readouterr().out)
        assert report["status"] == "UNREACHABLE"
    assert await run_cli("health", "--target", "127.0.0.1:1", "--timeout", "5") == 1
    assert capsys.readouterr().out.startswith("UNREACHABLE")


async def test_health_watch_prints_each_change_until_interrupted() -> None:
    async with worker() as w:
        watch = subprocess.Popen(
            [*CLI, "health", "--target", w.target, "--watch", "--interval", "0.05", "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default,
        )
        assert watch.stdout is not None

        async def next_status() -> str:
            with trio.fail_after(60):
                # Abandoned on timeout (the thread ends when the process does, below).
                line = await trio.to_thread.run_sync(watch.stdout.readline, abandon_on_cancel=True)
            return str(json.loads(line)["status"])

        try:
            assert await next_status() == "SERVING"
            w.server.drain()  # listener closed, GOAWAY: the next probe cannot connect
            assert await next_status() == "UNREACHABLE"  # printed once, when it changed
            w.stop()
        finally:
            watch.send_signal(signal.SIGINT)
            try:
                _, err = await trio.to_thread.run_sync(watch.communicate, None, 60)
            except subprocess.TimeoutExpired:
                watch.kill()
                _, err = await trio.to_thread.run_sync(watch.communicate)
        assert watch.returncode == 130, err


async def test_generate_ctrl_c_releases_the_session_before_exiting() -> None:
    """Ctrl-C during ``generate`` cancels the stream: the session is released at once, not
    left to the worker's resume TTL (an hour here), and the command exits 130."""
    async with worker(latency=0.005, resume_ttl=3600) as w:
        code, err = await signal_cli(
            ["generate", "--target", w.target, "--max-tokens", "5000", "hello"],
            lambda: w.gate.steps >= 20, signal.SIGINT,  # once generating
        )
        assert code == 130, err
        assert "Traceback" not in err, err
        # Released by the client before it exited: nothing running, nothing retained.
        with trio.fail_after(10):
            while w.engine.sessions():
                await trio.sleep(0.01)
        assert w.server.registry.n_retained == 0 and w.server.registry.n_live == 0


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
async def test_an_interrupted_generate_prints_what_it_received(as_json: bool) -> None:
    """Ctrl-C: the text received so far (then a newline), or with --json the object so far
    with "interrupted": true; exit 130, the session released."""
    async with worker(latency=0.002) as w:
        out = bytearray()
        code, err = await signal_cli(
            ["generate", "--target", w.target, "--max-tokens", "5000", *(["--json"] * as_json), "hello"],
            # credit (16) lets the worker run only so far ahead: the CLI has received tokens
            lambda: w.gate.steps >= 60, signal.SIGINT, stdout=out,
        )
        assert code == 130, err
        assert "Traceback" not in err, err
        await w.idle()
        assert w.server.registry.n_retained == 0 and not w.engine.sessions()
        if not as_json:
            assert out.endswith(b"\n") and len(out) > 1, out
            return
        got = json.loads(out)
        assert got["interrupted"] is True and got["finish_reason"] == "unspecified"
        assert 20 <= len(got["tokens"]) < 5000
        async with ShardClient.connect(w.target, timeout=30) as client:  # greedy: a prefix
            want = [s.logits.token_id async for s in client.generate("hello", max_tokens=len(got["tokens"]))]
        assert got["tokens"] == want


async def test_metrics_command_prints_get_metrics(capsys: pytest.CaptureFixture[str]) -> None:
    async with worker() as w:
        async with ShardClient.connect(w.target, timeout=30) as client:
            async for _ in client.generate([1, 2, 3], max_tokens=3):
                pass
            before = snapshot_values(await client.metrics())
        assert await run_cli("metrics", "--target", w.target, "--json") == 0
        printed = json.loads(capsys.readouterr().out)
        assert await run_cli("metrics", "--target", w.target) == 0
        text = capsys.readouterr().out
    flat = {f"{section}.{k}": v for section, values in printed.items() for k, v in values.items()}
    assert flat.pop("worker.rpc_GetMetrics_total") == before.pop("worker.rpc_GetMetrics_total") + 1
    flat.pop("worker.rpc_GetMetrics_total", None)
    assert flat == before and flat["engine.decode_tokens_total"] == 2
    assert re.search(r"^engine\.decode_tokens_total +2$", text, re.M)


# ---- a real worker process ------------------------------------------------------------------


@pytest.mark.slow
def test_real_worker_with_metrics_tokens_json_logs_and_sighup(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("sekret-one router-a\n")
    proc = subprocess.Popen(
        [*CLI, "serve", "--port", "0", "--threads", "1", "--max-sessions", "2", "--ctx", "1024",
         "--auth-token-file", str(tokens), "--log-format", "json"],
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TRIO_SHARD_METRICS_PORT": "0"},  # from the environment
    )
    assert proc.stderr is not None
    lines: list[str] = []
    target = metrics = None
    try:
        for line in proc.stderr:
            lines.append(line)
            message = json.loads(line)["message"]  # every line is one JSON object
            if m := re.search(r"Prometheus metrics on http://(\S+)/metrics", message):
                metrics = m.group(1)
            if m := re.search(r"serving shard\.v1\.Shard on (\S+:\d+)", message):
                target = m.group(1)
                break
        assert target and metrics, "".join(lines)

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)

        token_one = tmp_path / "client-one"
        token_one.write_text("sekret-one\n")
        assert cli("health", "--target", target, "--token-file", str(token_one)).returncode == 0
        gen = cli("generate", "--target", target, "--token-file", str(token_one), "--json",
                  "--max-tokens", "4", "hello")
        assert gen.returncode == 0, gen.stderr
        got = json.loads(cli("metrics", "--target", target, "--token-file", str(token_one),
                             "--json").stdout)
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=30) as reply:
            page = reply.read().decode()
        assert f"trio_shard_engine_decode_tokens_total {float(got['engine']['decode_tokens_total'])}" in page
        assert f"trio_shard_worker_sessions_opened_total {float(got['worker']['sessions_opened_total'])}" in page

        # Rotate: a new token file, SIGHUP, the new token works and the old one is refused.
        tokens.write_text("sekret-two router-b\n")
        proc.send_signal(signal.SIGHUP)
        assert trio.run(_wait_accepted, target, "sekret-two")
        assert not trio.run(_accepted, target, "sekret-one")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        proc.stderr.close()
        code = proc.wait(timeout=60)
    log = "".join(lines) + rest
    assert code == 0, log
    records = [json.loads(line) for line in log.splitlines()]
    events = [(r.get("event"), r.get("principal")) for r in records if r["logger"] == "shard.sessions"]
    assert ("open", "router-a") in events and ("close", "router-a") in events
    assert any("token file reloaded" in r["message"] for r in records)
    assert "sekret" not in log


async def _accepted(target: str, token: str) -> bool:
    async with ShardClient.connect(target, timeout=30, metadata=bearer_metadata(token)) as client:
        try:
            await client.health()
        except ShardError as err:
            assert err.code is ErrorCode.UNAUTHENTICATED
            return False
    return True


async def _wait_accepted(target: str, token: str) -> bool:
    """Until the worker has handled the SIGHUP (bounded)."""
    with trio.move_on_after(60):
        while not await _accepted(target, token):
            await trio.sleep(0.1)
        return True
    return False
