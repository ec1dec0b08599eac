"""Chain relay an operator can expose (issue 31, findings 1, 2, 3, 6 and 8): the operator's peers,
never a caller's, decide where a relaying worker connects and sends its credentials; a route must
describe exactly the rest of the worker's model; connection failures tell a caller nothing about
what listens where; connections to peers are shared.

Live FakeEngine workers on loopback, and raw TCP listeners standing for the places a hostile
caller would point a route at (each records every connection it gets).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from rpc_harness import MAX_SESSIONS, MODEL, N_CTX, worker
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.client import ShardClient, ShardError
from shard.engine import LayerRange, LoadSpec
from shard.engine.fake import FakeEngine, FakeModel, FakeScript
from shard.pipeline import Pipeline
from shard.rpc.auth import TokenAuthenticator, bearer_metadata
from shard.rpc.errors import ErrorCode
from shard.relay import ChainRelay, PeerList, PeerListError, PoolLimits
from shard.v1 import shard_pb2 as pb
from test_pipeline import TIMEOUT, assert_all_free, cuts_to_ranges
from test_relay import THREE, free_within, relay_shards, route_of

TWO = cuts_to_ranges([0, 2, 4])


@dataclass
class Listener:
    """A TCP port on loopback that is not a worker: it records what connects to it."""

    port: int
    connections: int = 0
    received: bytearray = field(default_factory=bytearray)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@asynccontextmanager
async def listener(banner: bytes | None = None) -> AsyncIterator[Listener]:
    """``banner``: sent at once (an SSH server, say); None: silent (reads and never answers)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    spot = Listener(listeners[0].socket.getsockname()[1])

    async def handle(stream: trio.SocketStream) -> None:
        spot.connections += 1
        async with stream:
            if banner is not None:
                await stream.send_all(banner)
            while data := await stream.receive_some(65536):
                spot.received += data

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handle, listeners)
        yield spot
        nursery.cancel_scope.cancel()


def closed_port() -> str:
    import socket

    with socket.socket() as s:  # bound and closed at once: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def hop(target: str, lr: LayerRange, fingerprint: str | None = None) -> pb.RouteHop:
    return pb.RouteHop(target=target, expected_model_fingerprint=fingerprint or MODEL.fingerprint(),
                       expected_layer_range=pb.LayerRange(start=lr.start, end=lr.end))


def spec(lr: LayerRange) -> LoadSpec:
    return LoadSpec(n_ctx=N_CTX, max_sessions=MAX_SESSIONS, layer_range=lr)


# ---- finding 1: where the worker connects, and with which credentials --------------------------


async def test_a_route_to_a_peer_the_operator_did_not_allow_is_refused_before_any_connection() -> None:
    """Finding 1: the route names a listener of the caller's choice. The worker, allowed to
    relay only to its real next hop, refuses it (PERMISSION_DENIED) and never connects there,
    so its bearer token never reaches the listener."""
    async with listener() as spy, relay_shards(TWO[1:]) as (b,):
        relay = ChainRelay(peers=b.target, metadata=bearer_metadata("worker-a-secret"),
                           plaintext_loopback=True)
        async with worker(engine=FakeEngine(model=MODEL, script=FakeScript()), load=spec(TWO[0]),
                          relay=relay) as a:
            async with ShardClient.connect(a.target, timeout=TIMEOUT) as client:
                with pytest.raises(ShardError) as info:
                    await client.open_session("x.0", route=pb.Route(hops=[hop(spy.target, TWO[1])]))
                err = info.value
                assert err.code == ErrorCode.PERMISSION_DENIED
                assert err.reason == "RELAY_PEER_NOT_ALLOWED"
                assert (err.relay_depth, err.failed_layers) == (1, (2, 4))
                # the allowed peer works, with the token
                async with client.session("ok.0", route=pb.Route(hops=[hop(b.target, TWO[1])])) as s:
                    assert (await s.prefill(tokens=[1, 5, 6])).n_past == 3
            # no connection at all: no byte of the token (HPACK would have Huffman-coded it)
            assert spy.connections == 0 and not spy.received
            await free_within([a, b])


async def test_the_return_address_is_the_first_hops_own_never_the_callers() -> None:
    """Finding 1: a client that names a listener as the return address (``route.return_to``)
    does not make the last hop push anything there: the first hop sends its own advertised
    address, and the direct return goes to it."""
    async with listener() as spy, relay_shards(THREE) as chain:
        route = route_of(chain[1:], THREE[1:])
        route.return_to.target = spy.target  # what an older client (or a hostile one) sends
        async with ShardClient.connect(chain[0].target, timeout=TIMEOUT) as client:
            async with client.session("r.0", route=route) as s:
                steps = [x async for x in s.generate([1, 5, 6, 7], max_tokens=8, ignore_eos=True)]
            used = (await client.metrics()).worker.get("direct_returns_used_total", 0)
        assert len(steps) == 8 and used > 0  # the copies came to the first hop itself
        assert spy.connections == 0
        await free_within(chain)


async def test_a_last_hop_pushes_returns_only_to_an_allowed_peer() -> None:
    """Finding 1: a session on the last hop with a filled-in return address (what a hostile
    caller would open directly) outside the last worker's peers is refused before it connects."""
    async with listener() as spy, relay_shards(THREE[2:], relays=[ChainRelay(peers="127.0.0.1:1")]) as (last,):
        route = pb.Route(return_to=pb.ReturnAddress(target=spy.target, session_id="s", secret=b"x" * 16))
        async with ShardClient.connect(last.target, timeout=TIMEOUT) as client:
            with pytest.raises(ShardError) as info:
                await client.open_session("l.0>>", route=route)
        assert info.value.code == ErrorCode.PERMISSION_DENIED
        assert "return address" in info.value.message
        assert spy.connections == 0
        await free_within([last])


@pytest.mark.parametrize(
    "args, words",
    [
        (["--allow-relay", "--relay-token-file", "TOKENS"], "--relay-token-file needs TLS"),
        (["--allow-relay", "--relay-tls-cert", "c.pem", "--relay-tls-key", "k.pem"],
         "--relay-tls-cert needs --relay-tls-ca"),
        (["--allow-relay", "--relay-token-file", "TOKENS", "--relay-plaintext-loopback",
          "--relay-peers", "10.0.0.0/8"], "allows loopback peers only"),
        (["--allow-relay", "--relay-plaintext-loopback"], "goes with --relay-token-file"),
        (["--allow-relay", "--relay-peers", "10.0.0.0/33"], "relay peer '10.0.0.0/33'"),
        (["--allow-relay", "--relay-peers", "@/nonexistent/peers"], "cannot read relay peer file"),
        (["--allow-relay", "--advertise", "nowhere"], "target must be HOST:PORT"),
        (["--relay-peers", "10.0.0.1"], "--relay-peers needs --allow-relay"),
        (["--advertise", "10.0.0.1:5"], "--advertise needs --allow-relay"),
    ],
    ids=["token-in-plaintext", "cert-without-ca", "plaintext-to-a-lan", "plaintext-alone",
         "bad-cidr", "missing-peer-file", "bad-advertise", "peers-alone", "advertise-alone"],
)
def test_serve_refuses_relay_credentials_it_would_send_unprotected(
    args: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finding 1: a bearer token needs TLS to the next hops (or the loopback-only opt-in), a
    client certificate needs the CA the next hops are checked against (never the system's)."""
    from shard.cli import main

    tokens = tmp_path / "tokens"
    tokens.write_text("t0ken relay\n")
    argv = ["serve", "--port", "0", *[str(tokens) if a == "TOKENS" else a for a in args]]

    def would_serve(*_: object) -> None:  # (a worker that took the options would run here)
        raise AssertionError("serve started: the options were not refused")

    monkeypatch.setattr(trio, "run", would_serve)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err, err
    assert "t0ken" not in err


def test_the_peer_list_parses_addresses_blocks_names_and_files(tmp_path: Path) -> None:
    peers = PeerList("10.0.0.0/24, 10.0.1.5:50051 [fd00::5]:7 fd01::/16 localhost:9 loopback")
    assert peers.allows("10.0.0.77", 1) and not peers.allows("10.0.1.77", 1)
    assert peers.allows("10.0.1.5", 50051) and not peers.allows("10.0.1.5", 50052)
    assert peers.allows("fd00::5", 7) and not peers.allows("fd00::5", 8)
    assert peers.allows("fd01:1::1", 1) and peers.allows("127.0.0.3", 4)
    assert PeerList().allows("127.0.0.1", 1) and not PeerList().allows("10.0.0.1", 1)
    with pytest.raises(PeerListError):
        PeerList("10.0.0.0/8", loopback_only=True)
    path = tmp_path / "peers"
    path.write_text("# the chain\n10.0.0.5:50051\n")
    listed = PeerList(f"@{path}")
    assert listed.allows("10.0.0.5", 50051) and not listed.allows("10.0.0.6", 50051)
    path.write_text("10.0.0.6:50051  # moved\n")
    assert listed.reload() and listed.allows("10.0.0.6", 50051) and not listed.allows("10.0.0.5", 50051)
    path.write_text("not an address!\n")
    assert not listed.reload() and listed.allows("10.0.0.6", 50051)  # the old list stays


async def test_the_peer_list_file_is_read_again_on_sighup(tmp_path: Path) -> None:
    """``serve --relay-peers @FILE``: SIGHUP re-reads the file (a real process)."""
    import os
    import signal
    import subprocess
    import sys

    peers = tmp_path / "peers"
    peers.write_text("127.0.0.1:1\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "shard.cli", "serve", "--port", "0", "--allow-relay",
         "--relay-peers", f"@{peers}"], stderr=subprocess.PIPE, text=True)
    seen: list[str] = []

    async def until(words: str) -> None:
        assert proc.stderr is not None
        with trio.fail_after(60):
            while not seen or words not in seen[-1]:
                seen.append(await trio.to_thread.run_sync(proc.stderr.readline))
                assert seen[-1], f"the worker stopped: {seen}"

    try:
        await until("chain relay: peers 127.0.0.1:1;")
        peers.write_text("127.0.0.1:2\n")
        os.kill(proc.pid, signal.SIGHUP)
        await until("relay peers reloaded: 127.0.0.1:2")
    finally:
        proc.terminate()
        proc.wait(30)
        assert proc.stderr is not None
        proc.stderr.close()


# ---- finding 2: connection failures are one answer ----------------------------------------------


async def test_a_hop_that_cannot_be_reached_gets_one_answer_whatever_listens_there() -> None:
    """Finding 2: a closed port, a port that sends a banner (an SSH server) and a port that
    accepts and stays silent give the caller the same code, reason and message, naming the hop
    by its place and range (no address, no byte of a banner, no OS error); the details go to
    the worker's log."""
    relay = ChainRelay(peers="loopback", limits=PoolLimits(connect_timeout=0.5))
    async with listener(b"SSH-2.0-OpenSSH_9.6\r\n") as ssh, listener() as silent, \
            worker(engine=FakeEngine(model=MODEL, script=FakeScript()), load=spec(TWO[0]),
                   relay=relay) as a:
        answers = []
        async with ShardClient.connect(a.target, timeout=TIMEOUT) as client:
            for target in (closed_port(), ssh.target, silent.target):
                with pytest.raises(ShardError) as info:
                    await client.open_session(route=pb.Route(hops=[hop(target, TWO[1])]))
                err = info.value
                answers.append((err.code, err.reason, err.message, err.relay_depth, err.failed_layers))
                assert target.rsplit(":", 1)[1] not in err.message
        assert answers[0] == answers[1] == answers[2], answers
        assert answers[0][:2] == (ErrorCode.NOT_READY, "RELAY_HOP_UNREACHABLE")
        assert answers[0][3:] == (1, (2, 4))
        assert "5460808" not in answers[1][2] and "SSH" not in answers[1][2]
        await free_within([a])


# ---- finding 3 and 6: a route must be the rest of this worker's model ---------------------------


async def test_a_route_that_revisits_a_worker_is_refused_before_any_session() -> None:
    """Finding 3: a route that visits the same worker six times (what made one OpenSession hold
    six sessions on it) is refused by the first hop; the other worker sees nothing."""
    async with relay_shards(TWO) as (a, b):
        route = pb.Route(hops=[hop(b.target, TWO[1])] * 6)
        async with ShardClient.connect(a.target, timeout=TIMEOUT) as client:
            with pytest.raises(ShardError) as info:
                await client.open_session(route=route)
        assert info.value.code == ErrorCode.INVALID_ARGUMENT and info.value.relay_depth == 0
        assert "route" in info.value.message
        assert len(b.calls) == 0 and b.server.transport.open_connections == 0
        await assert_all_free([a, b])


@pytest.mark.parametrize("how", ["no-model", "no-range", "gap", "short", "self-loop", "revisit"])
async def test_a_route_that_is_not_the_rest_of_the_model_is_refused(how: str) -> None:
    """Findings 3 and 6: every hop must name this model and continue this worker's range to the
    model's last layer, without a gap, an overlap or a hop named twice; a route through the
    worker itself (63 times: 64 sessions and 63 loop-back connections from one request before)
    is refused before any connection."""
    async with relay_shards(THREE) as chain:
        a, b, c = chain
        hops = {
            "no-model": [pb.RouteHop(target=b.target, expected_layer_range=pb.LayerRange(start=1, end=3)),
                         hop(c.target, THREE[2])],
            "no-range": [pb.RouteHop(target=b.target, expected_model_fingerprint=MODEL.fingerprint()),
                         hop(c.target, THREE[2])],
            "gap": [hop(c.target, THREE[2])],
            "short": [hop(b.target, THREE[1])],
            # the worker itself, 63 times, naming no model or range (nothing to check it against)
            "self-loop": [pb.RouteHop(target=a.target)] * 63,
            "revisit": [hop(b.target, LayerRange(1, 2)), hop(b.target, LayerRange(2, 4))],
        }[how]
        opened = a.engine.metrics().sessions_opened_total
        async with ShardClient.connect(a.target, timeout=TIMEOUT) as client:
            with pytest.raises(ShardError) as info:
                await client.open_session(route=pb.Route(hops=hops))
        assert info.value.code == ErrorCode.INVALID_ARGUMENT, info.value
        assert info.value.message.startswith("route: ")
        assert a.engine.metrics().sessions_opened_total == opened  # not even its own session
        assert len(b.calls) == len(c.calls) == 0
        assert a.server.transport.open_connections == 0  # (the client's connection is closed)
        await assert_all_free(chain)


async def test_a_next_hop_serving_another_model_of_the_same_width_is_refused() -> None:
    """Finding 6: a worker of another model (same n_embd: its rows would be accepted) is named
    in a route as this model's next hop. A route that names no model for it, or the other model,
    is refused by the first hop before it connects (the answer was a token of the two models
    together); one that names this model is refused at the hop's capabilities, INCOMPATIBLE_MODEL
    naming it, before any session opens there."""
    other = FakeModel(n_layers_total=MODEL.n_layers_total, n_embd=MODEL.n_embd, seed=MODEL.seed + 1)
    async with relay_shards(TWO[:1]) as (a,), \
            worker(engine=FakeEngine(model=other, script=FakeScript()), load=spec(TWO[1])) as b:
        async with ShardClient.connect(a.target, timeout=TIMEOUT) as client:
            for named in (pb.RouteHop(target=b.target, expected_layer_range=pb.LayerRange(start=2, end=4)),
                          hop(b.target, TWO[1], fingerprint=other.fingerprint())):
                with pytest.raises(ShardError) as info:
                    await client.open_session(route=pb.Route(hops=[named]))
                assert info.value.code == ErrorCode.INVALID_ARGUMENT and info.value.relay_depth == 0
            assert len(b.calls) == 0 and b.server.transport.open_connections == 0
            with pytest.raises(ShardError) as info:
                await client.open_session(route=pb.Route(hops=[hop(b.target, TWO[1])]))
        err = info.value
        assert err.code == ErrorCode.INCOMPATIBLE_MODEL and (err.relay_depth, err.failed_layers) == (1, (2, 4))
        assert other.fingerprint() in err.message
        assert len(b.calls) == 0
        await free_within([a])
        await assert_all_free([b])


# ---- finding 8: Return's one answer, and shared connections -------------------------------------


async def test_return_gives_one_answer_for_an_unknown_session_and_a_wrong_secret() -> None:
    """Finding 8: ``Return`` for a session that does not exist and for a live one with the
    wrong secret: the same code, reason and message (no oracle of which sessions exist)."""
    from test_direct_return import returning_route, returns_of

    async with relay_shards(THREE) as chain:
        async with ShardClient.connect(chain[0].target, timeout=TIMEOUT) as client:
            async with client.session("o.0", route=returning_route(chain)):
                returns = returns_of(chain[0], "o.0")
                assert returns is not None
                answers = []
                for sid, secret in (("o.0", b"w" * 16), ("nobody", b"w" * 16), ("o.0>", b"")):
                    with pytest.raises(ShardError) as info:
                        await client.return_step(pb.ReturnAddress(session_id=sid, secret=secret), 1,
                                                 pb.StepResult(logits=pb.Logits(token_id=3)))
                    answers.append((info.value.code, info.value.reason, info.value.message))
        assert answers[0] == answers[1] == answers[2]
        assert answers[0][:2] == (ErrorCode.PERMISSION_DENIED, "RETURN_REFUSED")
        await free_within(chain)


async def test_routed_sessions_share_one_connection_per_peer() -> None:
    """Finding 8: four routed sessions at once over three hops: each relaying worker holds one
    connection to its next hop, and the last one a single connection back to the first for all
    the direct returns; the first worker sees one inbound connection from the last (not one
    per session)."""
    relays = [ChainRelay(), ChainRelay(), ChainRelay()]
    async with relay_shards(THREE, relays=relays, latency=0.001) as chain:
        async with Pipeline.connect([w.target for w in chain], timeout=TIMEOUT, relay="chain") as pipe:

            async def one(i: int) -> None:
                got = await pipe.generate([1, 3 + i, 4, 5], max_tokens=12, ignore_eos=True)
                assert len(got.tokens) == 12

            connections: list[int] = []

            async def watch() -> None:
                while True:
                    connections.append(chain[1].server.transport.open_connections)
                    await trio.sleep(0.005)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                async with trio.open_nursery() as sessions:
                    for i in range(MAX_SESSIONS):
                        sessions.start_soon(one, i)
                nursery.cancel_scope.cancel()
        assert relays[0].pool.opened_total == 1  # hop 0 -> hop 1, for all four sessions
        assert relays[1].pool.opened_total == 1  # hop 1 -> hop 2
        assert relays[2].pool.opened_total == 1  # hop 2 -> hop 0: the direct returns
        assert max(connections) == 2  # hop 1's inbound connections: the client's, hop 0's
        assert (await _used(chain[0])) > 0
        await free_within(chain)


async def _used(w: object) -> int:
    async with ShardClient.connect(w.target, timeout=TIMEOUT) as client:  # type: ignore[attr-defined]
        return (await client.metrics()).worker.get("direct_returns_used_total", 0)


async def test_a_relay_token_reaches_only_its_peers_over_a_shared_connection(tmp_path: Path) -> None:
    """The token reaches the next hop (which requires it) on the pooled connection."""
    tokens = tmp_path / "tokens"
    tokens.write_text("hop-secret relay\n")
    async with worker(engine=FakeEngine(model=MODEL, script=FakeScript()), load=spec(TWO[1]),
                      authorize=TokenAuthenticator(tokens)) as b:
        relay = ChainRelay(peers=b.target, metadata=bearer_metadata("hop-secret"),
                           plaintext_loopback=True)
        async with worker(engine=FakeEngine(model=MODEL, script=FakeScript()), load=spec(TWO[0]),
                          relay=relay) as a:
            async with ShardClient.connect(a.target, timeout=TIMEOUT) as client:
                for i in range(3):
                    async with client.session(f"t{i}.0", route=pb.Route(hops=[hop(b.target, TWO[1])])) as s:
                        assert (await s.prefill(tokens=[1, 2, 3])).n_past == 3
            assert relay.pool.opened_total == 1
            await free_within([a])


@dataclass
class Partition:
    """A TCP proxy whose connections can go silent without closing (a partition, a stopped
    process): ``freeze()`` holds every byte of the connections open now; new ones pass."""

    target: str = ""
    frozen: set[int] = field(default_factory=set)
    live: list[int] = field(default_factory=list)

    def freeze(self) -> None:
        self.frozen |= set(self.live)


@asynccontextmanager
async def partition(upstream: str) -> AsyncIterator[Partition]:
    host, _, port = upstream.rpartition(":")
    spot = Partition()
    count = [0]

    async def pump(i: int, src: trio.SocketStream, dst: trio.SocketStream) -> None:
        with trio.move_on_after(60):
            while data := await src.receive_some():
                while i in spot.frozen:
                    await trio.sleep(0.01)
                await dst.send_all(data)

    async def handle(client: trio.SocketStream) -> None:
        count[0] += 1
        i = count[0]
        spot.live.append(i)
        async with client, await trio.open_tcp_stream(host, int(port)) as server:
            async with trio.open_nursery() as pumps:
                pumps.start_soon(pump, i, client, server)
                pumps.start_soon(pump, i, server, client)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handle, 0)
        spot.target = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        yield spot
        nursery.cancel_scope.cancel()


async def test_a_pooled_connection_that_went_silent_is_replaced_not_reused() -> None:
    """Health-checked pool: after the connection to the next hop went silent while idle (a
    partition: no FIN, no RST), the next routed session does not wait on it until its deadline:
    the idle connection is asked for Health, dropped, and a new one carries the session."""
    limits = PoolLimits(connect_timeout=0.5, check_idle_after=0.2)
    async with relay_shards(TWO[1:]) as (b,), partition(b.target) as link:
        relay = ChainRelay(peers="loopback", limits=limits)
        async with worker(engine=FakeEngine(model=MODEL, script=FakeScript()), load=spec(TWO[0]),
                          relay=relay) as a:
            async with ShardClient.connect(a.target, timeout=TIMEOUT) as client:
                route = pb.Route(hops=[hop(link.target, TWO[1])])
                async with client.session("s1.0", route=route) as s:
                    assert (await s.prefill(tokens=[1, 2, 3])).n_past == 3
                assert relay.pool.opened_total == 1
                link.freeze()
                await trio.sleep(0.3)
                with trio.fail_after(5):  # (the session's deadline is TIMEOUT)
                    async with client.session("s2.0", route=route) as s:
                        assert (await s.prefill(tokens=[1, 2, 3])).n_past == 3
                assert relay.pool.opened_total == 2
            await free_within([a, b], 3)
