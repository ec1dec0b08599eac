"""The README's user flow, end to end through real processes: ``trio-shard serve`` in one
process (llama engine, embedded tiny model), ``trio-shard generate`` / ``caps`` in others."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trustme

from shard.cli import build_parser, main

CLI = [sys.executable, "-m", "shard.cli"]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


@contextmanager
def running_worker(*extra: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A real ``trio-shard serve --port 0 ...`` process; yields its HOST:PORT and the process,
    then SIGTERMs it (unless the test did) and checks it stopped cleanly."""
    proc = subprocess.Popen(
        [*CLI, "serve", "--port", "0", "--threads", "1", "--max-sessions", "2", "--ctx", "1024",
         *extra],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "always::ResourceWarning"},  # shown, then refused
    )
    assert proc.stderr is not None
    target = None
    lines = []
    for line in proc.stderr:  # the bound port is logged once the socket listens
        lines.append(line)
        m = re.search(r"serving shard\.v1\.Shard on (\S+:\d+)", line)
        if m:
            target = m.group(1)
            break
    try:
        assert target, "".join(lines)
        yield target, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        with proc.stderr:
            rest = proc.stderr.read()
        assert proc.wait(timeout=30) == 0, rest
        assert "SIGTERM: stopping" in rest
        # Sockets, listener and files are closed. The only exception is third-party:
        # llama_cpp/_utils.py opens two /dev/null files at import and never closes them.
        leaks = [ln for ln in (*lines, *rest.splitlines()) if "ResourceWarning" in ln]
        assert all("name='/dev/null'" in ln for ln in leaks), leaks


@pytest.fixture(scope="module")
def worker() -> Iterator[str]:
    with running_worker() as (target, _):
        yield target


def test_tls_and_mutual_tls_from_the_command_line(tmp_path: Path) -> None:
    ca, client_ca = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    client = client_ca.issue_cert("router")
    files = {
        "ca.pem": ca.cert_pem, "client-ca.pem": client_ca.cert_pem,
        "server.pem": server.cert_chain_pems[0], "server.key": server.private_key_pem,
        "client.pem": client.cert_chain_pems[0], "client.key": client.private_key_pem,
    }
    for name, blob in files.items():
        blob.write_to_path(str(tmp_path / name))
    p = {name: str(tmp_path / name) for name in files}
    with running_worker("--tls-cert", p["server.pem"], "--tls-key", p["server.key"],
                        "--tls-client-ca", p["client-ca.pem"]) as (target, _):
        mtls = ("--tls-ca", p["ca.pem"], "--tls-cert", p["client.pem"], "--tls-key", p["client.key"])
        out = _run("generate", "--target", target, *mtls, "--json", "--max-tokens", "3", "hi")
        assert out.returncode == 0, out.stderr
        assert len(json.loads(out.stdout)["tokens"]) == 3
        # Without a client certificate, or without TLS at all, the worker refuses the peer.
        for refused in (("--tls-ca", p["ca.pem"]), ()):
            out = _run("caps", "--target", target, "--timeout", "10", *refused)
            assert out.returncode == 1, out.stdout
            assert "Traceback" not in out.stderr


def test_generate_json_and_streaming_agree(worker: str) -> None:
    out = _run("generate", "--target", worker, "--json", "--max-tokens", "12", "hello")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["tokens"]) == 12
    assert result["finish_reason"] == "length"
    streamed = _run("generate", "--target", worker, "--max-tokens", "12", "hello")
    assert streamed.returncode == 0, streamed.stderr
    # Greedy is deterministic: the streamed text is the JSON text plus the final newline.
    assert streamed.stdout == result["text"] + "\n"


def test_sigterm_drains_a_running_generate_before_stopping() -> None:
    with running_worker("--grace", "60") as (target, server):
        # Unbuffered: ``read(1)`` takes one byte off the pipe. A buffered reader would take
        # whatever the pipe held, keep all but one byte in its own buffer, and ``communicate``
        # (which reads the descriptor) would never see them: text lost by the test, not the CLI.
        gen = subprocess.Popen(
            [*CLI, "generate", "--target", target, "--max-tokens", "1000", "hello"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
        )
        assert gen.stdout is not None
        first = gen.stdout.read(1)  # text is streaming: the generate is running
        server.send_signal(signal.SIGTERM)
        rest, err = gen.communicate(timeout=120)
        assert gen.returncode == 0, err  # it finished in full rather than being cut off
        assert server.wait(timeout=60) == 0
    full = _run_json_against_fresh_worker()
    assert (first + rest).decode() == full["text"] + "\n"


def test_serve_without_extra_bufts_says_so_in_caps() -> None:
    with running_worker("--no-extra-bufts") as (target, _):
        out = _run("caps", "--target", target, "--json")
        assert out.returncode == 0, out.stderr
        assert "extra bufts off" in json.loads(out.stdout)["system_info"]
        gen = _run("generate", "--target", target, "--json", "--max-tokens", "4", "hello")
        assert gen.returncode == 0, gen.stderr
        assert len(json.loads(gen.stdout)["tokens"]) == 4


def test_serve_with_flash_attention_off_says_so_in_caps() -> None:
    """``--flash-attn off`` reaches llama.cpp's context: the state layout says so (sessions
    move only between workers of the same choice), and the worker generates."""
    with running_worker("--flash-attn", "off") as (target, _):
        out = _run("caps", "--target", target, "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["kv_layout"].endswith("/fa=off")
        gen = _run("generate", "--target", target, "--json", "--max-tokens", "4", "hello")
        assert gen.returncode == 0, gen.stderr
        assert len(json.loads(gen.stdout)["tokens"]) == 4


def _run_json_against_fresh_worker() -> dict[str, object]:
    with running_worker() as (target, _):
        out = _run("generate", "--target", target, "--json", "--max-tokens", "1000", "hello")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_caps_reports_the_llama_engine(worker: str) -> None:
    out = _run("caps", "--target", worker, "--json")
    assert out.returncode == 0, out.stderr
    caps = json.loads(out.stdout)
    assert caps["engine"] == "llama.cpp"
    assert caps["is_first"] and caps["is_last"]
    assert caps["max_sessions"] == 2
    assert "1.0" in caps["supported_versions"]
    # Which native code runs: llama.cpp's system info line and the recorded build profile.
    assert "CPU :" in caps["system_info"] and "extra bufts on" in caps["system_info"]
    assert "build not recorded" not in caps["system_info"]


def test_seeded_sampling_is_reproducible_from_the_cli(worker: str) -> None:
    args = ("generate", "--target", worker, "--json", "--max-tokens", "8",
            "--temperature", "0.9", "--seed", "7", "hello")
    first, second = _run(*args), _run(*args)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert json.loads(first.stdout)["tokens"] == json.loads(second.stdout)["tokens"]


def test_unreachable_worker_is_a_clear_error() -> None:
    out = _run("generate", "--target", "127.0.0.1:1", "--timeout", "1", "hi")  # tried until then
    assert out.returncode == 1
    assert "cannot connect to 127.0.0.1:1" in out.stderr
    assert "Traceback" not in out.stderr


def test_serve_refuses_a_non_gguf_model(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file")
    out = _run("serve", "--port", "0", "--model", str(bad))
    assert out.returncode == 1
    assert "is not a GGUF file" in out.stderr
    assert "Traceback" not in out.stderr


def test_make_model_writes_a_loadable_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny.gguf"
    assert main(["make-model", "--preset", "tiny", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:4] == b"GGUF"
    assert main(["make-model", "--preset", "nope", "--out", str(out)]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "70000"],
        ["serve", "--max-sessions", "0"],
        ["generate", "--temperature", "-1", "x"],
        ["generate"],
        ["generate", "--target", "nonsense", "x"],
        ["generate", "--target", "127.0.0.1:", "x"],
        ["caps", "--target", "host:99999"],
    ],
)
def test_bad_arguments_are_rejected_by_the_parser(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
