"""Bearer-token authentication over grpcio (missing, wrong, right token; the token never
logged; reload), and the safe-binding rule of ``serve``."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest
import trio

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import V, in_thread, req, worker
from shard.cli import main
from shard.client import ShardClient, ShardError
from shard.rpc.auth import (
    TokenAuthenticator,
    TokenFileError,
    bearer_metadata,
    binding_refusal,
    first_token,
    is_loopback,
    read_tokens,
)
from shard.rpc.errors import ERROR_TRAILER, ErrorCode
from shard.v1 import shard_pb2 as pb

TOKEN_A = "tok-A-7f3c9e1d2b"
TOKEN_B = "tok-B-0a9d8c7b6e"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(f"# router tokens\n{TOKEN_A} router-a\n\n{TOKEN_B}\n")
    return path


def test_token_file_format(token_file: Path, tmp_path: Path) -> None:
    tokens = read_tokens(token_file)
    assert [t.principal for t in tokens] == ["router-a", tokens[1].principal]
    assert tokens[1].principal.startswith("token-") and TOKEN_B not in tokens[1].principal
    assert first_token(token_file) == TOKEN_A
    for text, problem in (("", "holds no token"), ("# only a comment\n", "holds no token"),
                          (f"{TOKEN_A} a b\n", r"bad:1: expected 'TOKEN \[NAME\]'")):
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(TokenFileError, match=problem) as info:
            read_tokens(bad)
        assert TOKEN_A not in str(info.value)
    with pytest.raises(TokenFileError, match="cannot read"):
        read_tokens(tmp_path / "missing")


def _unary(target: str, metadata: tuple[tuple[str, str], ...] | None) -> tuple[grpc.StatusCode, bytes]:
    """GetCapabilities over grpcio: (status, the shard-error-bin trailer or b"")."""
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(
            "/shard.v1.Shard/GetCapabilities",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.GetCapabilitiesResponse.FromString,
        )
        try:
            call(pb.GetCapabilitiesRequest(version=V), metadata=metadata, timeout=10)
        except grpc.RpcError as err:
            trailer = dict(err.trailing_metadata() or ()).get(ERROR_TRAILER, b"")
            return err.code(), trailer
        return grpc.StatusCode.OK, b""


def _session(target: str, metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    with grpc.insecure_channel(target) as channel:
        call = channel.stream_stream(
            "/shard.v1.Shard/Session",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.SessionResponse.FromString,
        )
        requests = [req(open=pb.OpenSession(session_id="auth-1")),
                    req(close=pb.CloseSession())]
        try:
            kinds = [r.WhichOneof("kind") for r in call(iter(requests), metadata=metadata, timeout=10)]
        except grpc.RpcError as err:
            return err.code()
        assert kinds == ["opened", "closed"]
        return grpc.StatusCode.OK


async def test_missing_wrong_and_right_tokens_over_grpcio(
    token_file: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, every level: the token must be in none
    async with worker(authorize=TokenAuthenticator(token_file)) as w:
        missing = await in_thread(_unary, w.target, None)
        assert missing[0] == grpc.StatusCode.UNAUTHENTICATED
        assert pb.Error.FromString(missing[1]).code == pb.ERROR_CODE_UNAUTHENTICATED
        for wrong in (f"Bearer {TOKEN_A}x", f"Bearer {TOKEN_A[:-1]}", f"Basic {TOKEN_A}", TOKEN_A):
            status, _ = await in_thread(_unary, w.target, (("authorization", wrong),))
            assert status == grpc.StatusCode.UNAUTHENTICATED, wrong
        for right in (f"Bearer {TOKEN_A}", f"bearer {TOKEN_B}"):
            status, _ = await in_thread(_unary, w.target, (("authorization", right),))
            assert status == grpc.StatusCode.OK, right
        # Session streams are authenticated too, before any session is opened.
        assert await in_thread(_session, w.target, ()) == grpc.StatusCode.UNAUTHENTICATED
        assert await in_thread(_session, w.target, (("authorization", "Bearer nope"),)) == (
            grpc.StatusCode.UNAUTHENTICATED)
        ok = await in_thread(_session, w.target, (("authorization", f"Bearer {TOKEN_A}"),))
        assert ok == grpc.StatusCode.OK
        # The Trio client encodes the header itself (hpack): nothing of it is logged either.
        async with ShardClient.connect(w.target, timeout=10, metadata=bearer_metadata(TOKEN_B)) as c:
            assert (await c.health()).status == pb.HealthResponse.STATUS_SERVING
        await w.idle()
        assert w.engine.metrics().sessions_opened_total == 1  # refused streams opened nothing
    records = [r for r in caplog.records]
    assert any(r.name == "shard.rpc.auth" for r in records)  # refusals are logged...
    assert any(getattr(r, "fields", {}).get("principal") == "router-a" for r in records)
    logged = "\n".join(f"{r.getMessage()} {getattr(r, 'fields', '')}" for r in records)
    out, err = capfd.readouterr()
    for secret in (TOKEN_A, TOKEN_B, TOKEN_A[:-1]):  # ...but no token, nor a near miss
        assert secret not in logged + out + err


async def test_sighup_style_reload_rotates_tokens(token_file: Path) -> None:
    auth = TokenAuthenticator(token_file)
    async with worker(authorize=auth) as w:

        async def caps(token: str) -> ErrorCode | None:
            async with ShardClient.connect(
                w.target, timeout=10, metadata=(("authorization", f"Bearer {token}"),)
            ) as client:
                try:
                    await client.capabilities()
                except ShardError as err:
                    return err.code
            return None

        assert await caps(TOKEN_A) is None
        token_file.write_text("tok-C-new\n")
        assert await caps("tok-C-new") is ErrorCode.UNAUTHENTICATED  # not reloaded yet
        assert auth.reload()
        assert await caps("tok-C-new") is None
        assert await caps(TOKEN_A) is ErrorCode.UNAUTHENTICATED
        token_file.write_text("# emptied by mistake\n")
        assert not auth.reload()  # a file without tokens keeps the tokens in force
        assert await caps("tok-C-new") is None


# ---- safe binding ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.8.9.1", True), ("::1", True), ("[::1]", True),
     ("localhost", True), ("0.0.0.0", False), ("::", False), ("", False), ("10.1.2.3", False),
     ("no-such-host.invalid", False)],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_binding_rule() -> None:
    assert binding_refusal("127.0.0.1", tls=False, authenticated=False, insecure=False) is None
    reason = binding_refusal("0.0.0.0", tls=False, authenticated=False, insecure=False)
    assert reason is not None and "--insecure" in reason and "--auth-token-file" in reason
    for allowed in ({"tls": True}, {"authenticated": True}, {"insecure": True}):
        kwargs = {"tls": False, "authenticated": False, "insecure": False, **allowed}
        assert binding_refusal("0.0.0.0", **kwargs) is None


def test_serve_on_all_interfaces_without_tls_token_or_insecure_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "refusing to serve on non-loopback address '0.0.0.0' without TLS" in err
    assert "Traceback" not in err


async def test_serve_with_a_token_on_all_interfaces_is_allowed(token_file: Path) -> None:
    # The same refusal check the CLI runs, then a real server on 0.0.0.0 with the token.
    assert binding_refusal("0.0.0.0", tls=False, authenticated=True, insecure=False) is None
    async with worker(host="0.0.0.0", authorize=TokenAuthenticator(token_file)) as w:
        target = f"127.0.0.1:{w.server.port}"
        assert (await in_thread(_unary, target, None))[0] == grpc.StatusCode.UNAUTHENTICATED
        ok = await in_thread(_unary, target, (("authorization", f"Bearer {TOKEN_A}"),))
        assert ok[0] == grpc.StatusCode.OK
    await trio.lowlevel.checkpoint()
