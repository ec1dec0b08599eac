"""A pool of workers behind one endpoint (``shard.pool``; ``api --workers``, ``generate
--workers``, ``trio-shard pool``): routes found from the workers' capabilities, the least-loaded
route per generation, live membership (a file re-read on SIGHUP, a DNS name re-resolved), and
bad pools reported per worker.

The routing rules are tested on their own (``build_table``: pure, with hypothesis against a
brute-force tiling); the live cases run FakeEngine workers on loopback, whose tokens are exact
whatever the route, so a generation through the pool must equal a whole-model worker's.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import openai
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from rpc_harness import StepGate, Worker, api_process, in_thread, worker
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.api import Catalog, build_app, serve_http
from shard.engine import LayerRange, LoadSpec
from shard.engine.fake import FakeEngine, FakeModel, FakeScript, FakeStep
from shard.pool import Pool, PoolSpecError, build_table, model_id, parse_workers
from shard.pool.spec import WorkerSource
from shard.v1 import shard_pb2 as pb
from test_api import TEMPLATE, get
from test_pipeline_cli import run_cli
from test_pipeline import TIMEOUT, after_steps, assert_all_free, whole_model_steps

A = FakeModel(n_layers_total=4, n_embd=8, seed=7, chat_template=TEMPLATE)
B = FakeModel(n_layers_total=4, n_embd=8, seed=8)
PROMPT = "the quick brown fox jumps"
N_TOKENS = 24
PROBE = 0.05  # seconds between probes: membership changes show within a few


# ---- the routing rules (pure) ------------------------------------------------------------------


def caps(start: int, end: int, *, total: int = 4, fp: str = "f" * 64, name: str = "m",
         arch: str = "llama") -> pb.GetCapabilitiesResponse:
    return pb.GetCapabilitiesResponse(
        model_fingerprint=fp, architecture=arch, n_layers_total=total, n_embd=8,
        layer_range=pb.LayerRange(start=start, end=end), model_name=name, max_sessions=4)


def test_replicas_of_a_range_are_one_hop_and_two_models_are_served_side_by_side() -> None:
    table = build_table({
        "a1": caps(0, 2), "a2": caps(0, 2), "b1": caps(2, 4), "b2": caps(2, 4),
        "w": caps(0, 4, fp="e" * 64, name="other"),
    })
    m = table.models["m"]
    assert [s.ranges for s in m.shapes] == [((0, 2), (2, 4))]
    assert [h.targets for h in m.shapes[0].hops] == [("a1", "a2"), ("b1", "b2")]
    assert m.routes == 4 and not table.unused
    assert table.models["other"].routes == 1


def test_a_whole_worker_and_parts_are_two_shapes_fewest_hops_first() -> None:
    table = build_table({"p0": caps(0, 1), "w": caps(0, 4), "p1": caps(1, 4)})
    assert [s.ranges for s in table.models["m"].shapes] == [((0, 4),), ((0, 1), (1, 4))]


def test_ranges_that_overlap_without_tiling_are_reported_per_worker() -> None:
    table = build_table({"x": caps(0, 2), "y": caps(1, 4)})
    m = table.models["m"]
    assert not m.servable and "overlap without tiling" in m.problem
    assert "overlap [0, 2) without tiling" in table.unused["y"]
    assert "overlap [1, 4) without tiling" in table.unused["x"]


def test_a_gap_is_named() -> None:
    table = build_table({"x": caps(0, 1), "y": caps(2, 4)})
    assert table.models["m"].problem == "no complete route: no worker serves layers [1, 2) (a gap)"
    assert "gap" in table.unused["x"] and "gap" in table.unused["y"]


def test_a_stray_range_beside_a_complete_route_is_reported_and_the_route_serves() -> None:
    table = build_table({"x": caps(0, 2), "y": caps(2, 4), "z": caps(1, 3)})
    assert table.models["m"].routes == 1
    assert set(table.unused) == {"z"} and "overlap" in table.unused["z"]


def test_two_fingerprints_under_one_name_are_refused() -> None:
    table = build_table({"x": caps(0, 4), "y": caps(0, 4, fp="e" * 64)})
    assert not table.models["m"].servable
    assert "claimed by 2 different models" in table.unused["x"] == table.unused["y"]


def test_a_worker_without_a_name_is_named_by_architecture_and_fingerprint() -> None:
    assert model_id(caps(0, 4, name="", fp="0123456789abcdef" * 4)) == "llama-0123456789ab"


def test_dead_end_ranges_never_crowd_out_the_complete_route() -> None:
    """48 layers tiled by 2-layer ranges, beside 68 ranges that lead only into a dead end (even
    to odd, odd to odd): the partial routes searched are bounded, and before the dead ends were
    dropped first they filled that bound and hid the one complete route."""
    good = [(2 * i, 2 * i + 2) for i in range(24)]
    dead = ([(2 * i, 2 * i + 3) for i in range(23)] + [(o, o + 2) for o in range(1, 46, 2)]
            + [(o, o + 4) for o in range(1, 44, 2)])
    table = build_table({f"w{i}": caps(a, b, total=48) for i, (a, b) in enumerate(good + dead)})
    assert [s.ranges for s in table.models["m"].shapes] == [tuple(good)]
    assert len(table.unused) == len(dead)


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), min_size=1, max_size=7))
def test_shapes_are_exactly_the_tilings(pairs: list[tuple[int, int]]) -> None:
    """Every shape tiles [0, total) in order; a model is servable iff some tiling exists; every
    worker is in a shape or reported."""
    total = 6
    workers = {f"w{i}": caps(a, b, total=total) for i, (a, b) in enumerate(pairs) if a < b}
    if not workers:
        return
    table = build_table(workers)
    m = table.models["m"]
    ranges = {(c.layer_range.start, c.layer_range.end) for c in workers.values()}
    tilings = [
        combo for n in range(1, total + 1) for combo in itertools.permutations(sorted(ranges), n)
        if combo[0][0] == 0 and combo[-1][1] == total
        and all(x[1] == y[0] for x, y in zip(combo, combo[1:]))
    ]
    assert m.servable == bool(tilings)
    for shape in m.shapes:
        assert shape.ranges in tilings
        for hop in shape.hops:
            assert {(workers[t].layer_range.start, workers[t].layer_range.end) for t in hop.targets} \
                == {(hop.start, hop.end)}
    in_shape = {t for s in m.shapes for h in s.hops for t in h.targets}
    assert in_shape | set(table.unused) == set(workers) and not in_shape & set(table.unused)
    if m.servable:  # fewest hops first
        assert len(m.shapes[0].hops) == min(len(t) for t in tilings)


# ---- the worker list ---------------------------------------------------------------------------


async def test_worker_lists_parse_and_refuse_what_they_cannot_use(tmp_path: Path) -> None:
    assert await parse_workers("h:1, h:2,h:1").targets() == ["h:1", "h:2"]
    f = tmp_path / "workers"
    f.write_text("# the pool\nh:1  # first\n\n[::1]:2, h:3\n")
    source = parse_workers(f"@{f}")
    assert await source.targets() == ["h:1", "[::1]:2", "h:3"]
    f.write_text("h:1\nnot-a-target\n")
    with pytest.raises(PoolSpecError, match="line 2: expected HOST:PORT"):
        await source.targets()
    f.unlink()
    with pytest.raises(PoolSpecError, match="cannot read the worker list"):
        await source.targets()
    for bad, words in [("w..local:50051", "not a valid host name"),
                       ("dns:workers..svc:50051", "not a valid host name"),
                       ("", "lists no worker"), ("dns:name", "expected dns:NAME:PORT"),
                       ("dns:name:0", "expected dns:NAME:PORT"), ("@", "names no file"),
                       ("h:99999", "expected HOST:PORT")]:
        with pytest.raises(PoolSpecError, match=words):
            parse_workers(bad)

    async def resolver(name: str, port: int) -> list[str]:
        assert (name, port) == ("svc", 7)
        return ["10.0.0.2", "fd00::1", "10.0.0.1", "10.0.0.2"]

    dns = parse_workers("dns:svc:7", resolve_interval=3, resolver=resolver)
    assert dns.interval == 3
    assert await dns.targets() == ["10.0.0.1:7", "10.0.0.2:7", "[fd00::1]:7"]


# ---- live pools ----------------------------------------------------------------------------


@dataclass
class Fleet:
    workers: dict[str, Worker]  # label -> worker
    gates: dict[str, StepGate]

    def target(self, label: str) -> str:
        return self.workers[label].target

    def targets(self, *labels: str) -> list[str]:
        return [self.target(x) for x in labels]


@asynccontextmanager
async def fleet(layout: dict[str, tuple[FakeModel, LayerRange, str]], *,
                max_sessions: int = 8, **serve_kwargs: Any) -> AsyncIterator[Fleet]:
    """One FakeEngine worker per label: (model, range, model name)."""
    async with AsyncExitStack() as stack:
        workers, gates = {}, {}
        for label, (model, lr, name) in layout.items():
            gate = gates[label] = StepGate()

            async def hook(step: FakeStep, gate: StepGate = gate) -> None:
                await gate(step)

            engine = FakeEngine(model=model, script=FakeScript(on_step=hook))
            spec = LoadSpec(n_ctx=max_sessions * 256, max_sessions=max_sessions, layer_range=lr)
            workers[label] = await stack.enter_async_context(
                worker(engine=engine, gate=gate, load=spec, model_name=name, **serve_kwargs))
        yield Fleet(workers, gates)


#: model "a" in two parts with two replicas each, model "b" whole
FIVE = {"a0": (A, LayerRange(0, 2), "a"), "a0r": (A, LayerRange(0, 2), "a"),
        "a1": (A, LayerRange(2, 4), "a"), "a1r": (A, LayerRange(2, 4), "a"),
        "b": (B, LayerRange(0, 4), "b")}


class Listed(WorkerSource):
    """A worker list a test edits (the pool reads it on ``reload``, as a file on SIGHUP)."""

    def __init__(self, targets: list[str], interval: float | None = None) -> None:
        super().__init__("test list")
        self.now = list(targets)
        self.interval = interval

    async def targets(self) -> list[str]:
        await trio.lowlevel.checkpoint()
        return list(self.now)


@asynccontextmanager
async def pool_of(source: WorkerSource, **kw: Any) -> AsyncIterator[Pool]:
    async with Pool.open(source, probe_interval=PROBE, connect_timeout=5.0, **kw) as pool:
        await pool.settle(TIMEOUT)
        yield pool


async def tokens_via(pool: Pool, model: str, failovers: list[Any] | None = None,
                     **kw: Any) -> list[int]:
    async with pool.lease(model) as lease:
        result = await lease.pipeline.generate(PROMPT, max_tokens=N_TOKENS, ignore_eos=True,
                                               route=lease.route, timeout=TIMEOUT, **kw)
    if failovers is not None:
        failovers.extend(result.failovers)
    return result.tokens


async def reference(model: FakeModel) -> list[int]:
    async with fleet({"w": (model, LayerRange(0, 4), "")}) as ref:
        steps = await whole_model_steps(ref.target("w"), PROMPT, max_tokens=N_TOKENS,
                                        ignore_eos=True)
    return [s.logits.token_id for s in steps]


async def wait_until(predicate: Any, what: str) -> None:
    with trio.fail_after(10):
        while not predicate():
            await trio.sleep(PROBE)
    assert predicate(), what


@pytest.mark.parametrize("relay", ["client", "chain"])
async def test_a_pool_of_five_serves_both_models_with_the_whole_models_tokens(relay: str) -> None:
    want_a, want_b = await reference(A), await reference(B)
    relaying: dict[str, Any] = {}
    if relay == "chain":
        from shard.relay import ChainRelay
        relaying = {"relay": ChainRelay()}
    async with fleet(FIVE, **relaying) as f, pool_of(Listed(f.targets(*FIVE)), relay=relay) as pool:
        assert sorted(pool.servable()) == ["a", "b"] and not pool.not_serving()
        assert pool.table.models["a"].routes == 4
        for _ in range(2):  # both replicas of each hop take a turn
            assert await tokens_via(pool, "a") == want_a
        assert await tokens_via(pool, "b") == want_b
        used = {x for x in ("a0", "a0r", "a1", "a1r") if f.workers[x].calls}
        assert used == ({"a0", "a0r", "a1", "a1r"} if relay == "client" else used) and used
        await assert_all_free(list(f.workers.values()))


async def test_chain_relay_routes_only_through_replicas_that_relay() -> None:
    """With ``relay="chain"`` a first-hop replica that does not relay is left out of the route
    (it would be set aside by the pipeline), so every lease of the hop goes to the one that
    does; without any relaying replica the model has no route, saying why."""
    from shard.relay import ChainRelay

    want = await reference(A)
    async with fleet({"a0": FIVE["a0"]}) as plain, \
            fleet({"a0r": FIVE["a0r"], "a1": FIVE["a1"]}, relay=ChainRelay()) as relaying:
        listed = Listed(plain.targets("a0") + relaying.targets("a0r", "a1"))
        async with pool_of(listed, relay="chain") as pool:
            routes = set()
            for _ in range(4):
                async with pool.lease("a") as lease:
                    routes.add(lease.route)
            assert routes == {tuple(relaying.targets("a0r", "a1"))}
            assert await tokens_via(pool, "a") == want
        async with pool_of(Listed(plain.targets("a0") + relaying.targets("a1")),
                           relay="chain") as pool:
            assert pool.servable() == []
            assert any("relays" in w for w in pool.not_serving()), pool.not_serving()


async def test_sixteen_leases_spread_eight_on_each_replica_and_end_with_their_generations() -> None:
    async with fleet({k: FIVE[k] for k in ("a0", "a0r", "a1", "a1r")}) as f, \
            pool_of(Listed(f.targets("a0", "a0r", "a1", "a1r"))) as pool:
        async with AsyncExitStack() as stack:
            routes = [(await stack.enter_async_context(pool.lease("a"))).route for _ in range(16)]
            per_target = {t: sum(t in r for r in routes) for t in f.targets("a0", "a0r", "a1", "a1r")}
            assert sorted(per_target.values()) == [8, 8, 8, 8], per_target
            assert all(pool.members[t].sessions == 8 for t in per_target)
        assert all(m.sessions == 0 for m in pool.members.values())


async def test_a_replica_killed_mid_generation_loses_no_generation() -> None:
    want = await reference(A)
    async with fleet({k: FIVE[k] for k in ("a0", "a0r", "a1", "a1r")}) as f, \
            pool_of(Listed(f.targets("a0", "a0r", "a1", "a1r"))) as pool:
        got: list[list[int]] = []
        moved: list[Any] = []

        async def one() -> None:
            got.append(await tokens_via(pool, "a", moved))

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(one)
            # two of the four run on it
            nursery.start_soon(after_steps, f.gates["a1"], 12, f.workers["a1"].stop)
        assert got == [want] * 4
        assert len(moved) == 2 and {f.hop for f in moved} == {1}  # both moved off it
        await wait_until(lambda: pool.members[f.target("a1")].state == "down", "a1 seen down")
        assert pool.table.models["a"].routes == 2  # out of new routes
        for _ in range(3):
            assert await tokens_via(pool, "a") == want
        await assert_all_free([f.workers[x] for x in ("a0", "a0r", "a1r")])


async def test_whole_model_replicas_decode_in_their_own_loop_and_fail_over_by_replay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole-model route with replicas decodes in its worker's loop (``step_replicas``
    False: no client round trip per token); a replica stopped mid-generation fails over by
    replay on the other."""
    want = await reference(B)
    layout = {"b1": (B, LayerRange(0, 4), "b"), "b2": (B, LayerRange(0, 4), "b")}
    from shard.pipeline import chain

    loops = []
    real_run = chain.run

    async def run(*args: Any, **kw: Any) -> Any:  # the workers' loop: Generate on the hop
        loops.append(args)
        return await real_run(*args, **kw)

    monkeypatch.setattr(chain, "run", run)
    async with fleet(layout) as f, pool_of(Listed(f.targets("b1", "b2"))) as pool:
        got: list[list[int]] = []
        moved: list[Any] = []

        async def one() -> None:
            got.append(await tokens_via(pool, "b", moved))

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(one)
            nursery.start_soon(after_steps, f.gates["b1"], 12, f.workers["b1"].stop)
        assert got == [want] * 4 and len(moved) == 2 and len(loops) == 4
        await assert_all_free([f.workers["b2"]])


async def test_a_list_that_fails_oddly_keeps_the_pool_and_its_workers() -> None:
    """Any failure reading the list (not only a PoolSpecError) is logged and the workers listed
    before stay; a worker whose name cannot even be connected to is down, never the pool's end."""
    from shard.client import ShardClient, ShardError

    with pytest.raises(ShardError, match="cannot connect"):
        async with ShardClient.connect("x" * 64 + ".local:1", timeout=5):
            pass

    class Flaky(Listed):
        async def targets(self) -> list[str]:
            await trio.lowlevel.checkpoint()
            if self.now == ["boom"]:
                raise RuntimeError("the list's backend broke")
            return list(self.now)

    async with fleet({"b1": FIVE["b"]}) as f, pool_of(Flaky(f.targets("b1"))) as pool:
        source = pool.source
        assert isinstance(source, Flaky)
        source.now = ["boom"]
        pool.reload()
        await wait_until(lambda: "broke" in pool.source_error, "the failure seen")
        assert pool.servable() == ["b"] and await tokens_via(pool, "b") == await reference(B)


async def test_a_worker_added_to_the_list_is_used_after_a_reload(tmp_path: Path) -> None:
    async with fleet({k: FIVE[k] for k in ("a0", "a0r", "a1", "a1r")}) as f:
        listed = tmp_path / "workers"
        listed.write_text("\n".join(f.targets("a0", "a1")) + "\n")
        async with pool_of(parse_workers(f"@{listed}")) as pool:
            assert pool.table.models["a"].routes == 1
            listed.write_text("\n".join(f.targets("a0", "a1", "a0r", "a1r")) + "\n")
            await tokens_via(pool, "a")  # (the file alone changes nothing before a reload)
            assert pool.table.models["a"].routes == 1
            pool.reload()
            await wait_until(lambda: pool.table.models["a"].routes == 4, "the new replicas used")
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(tokens_via, pool, "a")
            assert f.workers["a0r"].calls and f.workers["a1r"].calls
            listed.write_text(f.target("a0r") + "\n" + f.target("a1r") + "\n")
            pool.reload()  # the first two leave
            await wait_until(lambda: set(pool.members) == set(f.targets("a0r", "a1r")), "left")
            before = len(f.workers["a0"].calls)
            await tokens_via(pool, "a")
            assert len(f.workers["a0"].calls) == before


async def test_a_dns_name_whose_records_change_is_followed() -> None:
    records = ["127.0.0.1"]

    async def resolver(name: str, port: int) -> list[str]:
        await trio.lowlevel.checkpoint()
        assert name == "workers.svc"
        return list(records)

    async with fleet({"w1": (B, LayerRange(0, 4), "b")}, host="127.0.0.1") as f1:
        port = f1.workers["w1"].server.port
        async with fleet({"w2": (B, LayerRange(0, 4), "b")}, host="127.0.0.2", port=port) as f2:
            source = parse_workers(f"dns:workers.svc:{port}", resolve_interval=0.05,
                                   resolver=resolver)
            async with pool_of(source) as pool:
                assert set(pool.members) == {f"127.0.0.1:{port}"}
                records.append("127.0.0.2")
                await wait_until(lambda: pool.table.models["b"].routes == 2, "the new record")
                async with trio.open_nursery() as nursery:
                    for _ in range(4):
                        nursery.start_soon(tokens_via, pool, "b")
                assert f2.workers["w2"].calls
                records.remove("127.0.0.1")
                await wait_until(lambda: set(pool.members) == {f"127.0.0.2:{port}"}, "gone")
                assert pool.table.models["b"].routes == 1


async def test_a_worker_that_comes_back_serving_another_model_is_read_again() -> None:
    async with fleet({k: FIVE[k] for k in ("a0", "a0r", "a1")}) as f:
        moving = f.workers["a0r"]
        port = moving.server.port
        async with pool_of(Listed(f.targets("a0", "a0r", "a1"))) as pool:
            assert pool.table.models["a"].routes == 2
            moving.stop()
            await wait_until(lambda: pool.members[f"127.0.0.1:{port}"].state == "down", "down")
            async with fleet({"new": (B, LayerRange(0, 4), "b")}, port=port):
                await wait_until(lambda: "b" in pool.servable(), "read again")
                assert pool.table.models["a"].routes == 1  # never mixed into a's route
                assert await tokens_via(pool, "b") == await reference(B)


async def test_the_door_lists_every_model_and_is_ready_while_each_has_a_route() -> None:
    async with fleet(FIVE) as f, pool_of(Listed(f.targets(*FIVE))) as pool, \
            trio.open_nursery() as nursery:
        shutdown = trio.Event()
        app = build_app(Catalog(pool=pool, timeout=TIMEOUT))
        url = (await nursery.start(partial(serve_http, app, host="127.0.0.1", port=0,
                                           shutdown=shutdown, grace=1.0)))[0]
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                           timeout=TIMEOUT) as client:
            await door_checks(url, client, f, pool)
        shutdown.set()


async def door_checks(url: str, client: openai.OpenAI, f: Fleet, pool: Pool) -> None:
    """What a door over a pool answers (see the test above)."""
    def ask() -> tuple[list[str], str, str, str]:
        ids = sorted(m.id for m in client.models.list())
        chat = client.chat.completions.create(
            model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True,
            temperature=0) if c.choices)
        text = client.completions.create(model="b", prompt=PROMPT, max_tokens=8).choices[0].text
        return ids, chat.choices[0].message.content or "", streamed, text

    ids, chat, streamed, text = await in_thread(ask)
    assert ids == ["a", "b"] and chat == streamed and text
    status, body = await in_thread(lambda: get(url + "/health"))
    assert status == 200 and json.loads(body)["models"] == ["a", "b"]
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        await in_thread(lambda: client.chat.completions.create(
            model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=4))
    with pytest.raises(openai.NotFoundError, match="serves 'a', 'b'"):
        await in_thread(lambda: client.completions.create(model="c", prompt="x", max_tokens=1))
    _, page = await in_thread(lambda: get(url + "/metrics"))
    assert b'trio_shard_api_pool_workers{state="up"} 5.0' in page
    assert b'trio_shard_api_pool_routes{model="a"} 4.0' in page
    f.workers["b"].stop()  # model b has no route left: not ready, and a still serves
    await wait_until(lambda: "b" not in pool.servable(), "b gone")
    status, _ = await in_thread(lambda: get(url + "/health"))
    assert status == 503
    with pytest.raises(openai.InternalServerError, match="no complete route now") as refused:
        await in_thread(lambda: client.completions.create(model="b", prompt="x", max_tokens=1))
    assert refused.value.status_code == 503  # retryable, not 404: b is known, only down
    assert await in_thread(lambda: client.completions.create(
        model="a", prompt=PROMPT, max_tokens=4).choices[0].text)


async def test_a_pool_that_cannot_serve_a_model_says_why_per_worker(tmp_path: Path) -> None:
    from shard.rpc.auth import TokenAuthenticator

    token = tmp_path / "tokens"
    token.write_text("s3cret door\n")
    layout = {"x": (A, LayerRange(0, 2), "a"), "y": (A, LayerRange(1, 4), "a"),
              "b": (B, LayerRange(0, 4), "b")}
    async with fleet(layout) as f, fleet({"locked": (B, LayerRange(0, 4), "b")},
                                         authorize=TokenAuthenticator(token)) as g:
        spec = ",".join(f.targets("x", "y", "b") + g.targets("locked"))
        done = await run_cli("pool", "--workers", spec, "--timeout", "10", "--json")
        assert done.returncode == 1, done.stderr
        report = json.loads(done.stdout)
        rows = {r["worker"]: r for r in report["workers"]}
        assert rows[f.target("b")]["state"] == "up"
        assert rows[f.target("y")]["state"] == "unused" and "overlap" in rows[f.target("y")]["why"]
        assert rows[g.target("locked")]["state"] == "refused"
        assert "UNAUTHENTICATED" in rows[g.target("locked")]["why"]
        assert report["models"]["b"]["routes"] == 1
        assert any(p.startswith("model a: no complete route") for p in report["problems"])
        # with the token, the locked worker is a replica of b; a is still not servable
        done = await run_cli("pool", "--workers", spec, "--token-file", str(token), "--json")
        assert done.returncode == 1 and json.loads(done.stdout)["models"]["b"]["routes"] == 2
        done = await run_cli("pool", "--workers", ",".join(f.targets("b") + g.targets("locked")),
                             "--token-file", str(token))
        assert done.returncode == 0 and b"model b: 2 complete route(s)" in done.stdout


async def test_generate_workers_picks_the_model_and_prints_the_whole_models_tokens() -> None:
    want = await reference(A)
    async with fleet({k: FIVE[k] for k in ("a0", "a1", "b")}) as f:
        spec = ",".join(f.targets("a0", "a1", "b"))
        base = ("generate", PROMPT, "--workers", spec, "--json", "--max-tokens", str(N_TOKENS),
                "--timeout", "20")
        done = await run_cli(*base)
        assert done.returncode == 1 and b"choose one with --model-name" in done.stderr
        done = await run_cli(*base, "--model-name", "a")
        tokens = json.loads(done.stdout)["tokens"]
        assert done.returncode == 0 and tokens and tokens == want[:len(tokens)]


def test_the_kubernetes_manifests_in_the_docs_parse_and_their_arguments_are_accepted() -> None:
    """docs/operations.md's manifests cannot be applied here (no cluster): they must at least be
    valid YAML whose containers run commands `trio-shard` accepts, behind a headless Service."""
    import re

    import yaml

    from shard.cli import build_parser

    text = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    section = text[text.index("### On Kubernetes"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    docs = [d for d in yaml.safe_load_all(block.group(1)) if d]
    kinds = [d["kind"] for d in docs]
    assert kinds == ["Service", "Deployment", "Deployment"]
    assert docs[0]["spec"]["clusterIP"] == "None"
    commands = [c["args"] for d in docs[1:] for c in d["spec"]["template"]["spec"]["containers"]]
    parser = build_parser()
    for args in commands:
        parsed = parser.parse_args([str(a) for a in args])  # a usage error exits the test
        assert parsed.command in ("serve", "api")
    door = parser.parse_args([str(a) for a in commands[-1]])
    source = parse_workers(door.workers)
    assert source.describe == "dns:trio-shard-workers.default.svc.cluster.local:50051"


async def test_the_door_reads_its_worker_file_again_on_sighup(tmp_path: Path) -> None:
    """`trio-shard api --workers @FILE`: a worker added to the file is used after SIGHUP."""
    import signal

    layout = {"b1": (B, LayerRange(0, 4), "b"), "b2": (B, LayerRange(0, 4), "b")}
    async with fleet(layout) as f:
        listed = tmp_path / "workers"
        listed.write_text(f.target("b1") + "\n")

        def routes(url: str) -> bytes:
            page = get(url + "/metrics")[1]
            return next((line for line in page.splitlines()
                         if line.startswith(b'trio_shard_api_pool_routes{model="b"}')), b"")

        async with api_process(["--workers", f"@{listed}", "--probe-interval", "0.1"]) as door:
            assert (await in_thread(lambda: routes(door.url))).endswith(b" 1.0")
            listed.write_text(f.target("b1") + "\n" + f.target("b2") + "\n")
            door.proc.send_signal(signal.SIGHUP)
            with trio.fail_after(30):
                while not (await in_thread(lambda: routes(door.url))).endswith(b" 2.0"):
                    await trio.sleep(0.1)
        assert b"SIGHUP: reading the worker list" in door.log and b"joined" in door.log


async def test_a_draining_whole_model_replica_yields_its_generations_to_be_moved() -> None:
    """A whole-model route decodes in its worker's loop; when that worker drains, each running
    ``Generate`` (asked with ``yield_on_drain``) ends after its next token with its session left
    open, the session's KV state moves to the other replica (which prefills nothing of the
    moved histories) and the generation goes on there with the whole model's tokens. The drain
    then ends at once instead of waiting out the generations."""
    want = await reference(B)
    layout = {"b1": (B, LayerRange(0, 4), "b"), "b2": (B, LayerRange(0, 4), "b")}
    async with fleet(layout) as f, pool_of(Listed(f.targets("b1", "b2"))) as pool:
        got: list[list[int]] = []
        moved: list[Any] = []
        drained: list[bool] = []

        async def one() -> None:
            got.append(await tokens_via(pool, "b", moved))

        async def drain() -> None:
            await after_steps(f.gates["b1"], 3 * len(PROMPT), lambda: None)
            with trio.fail_after(10):  # the grace is 60 s: only the moves end it this soon
                drained.append(await f.workers["b1"].server.drain_for(60))

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(one)
            nursery.start_soon(drain)
        assert got == [want] * 4 and drained == [True]
        assert moved and all(m.moved and m.handover for m in moved), moved
        b2 = f.workers["b2"].engine.metrics()
        assert b2.sessions_imported_total == len(moved)
        assert f.workers["b1"].engine.sessions() == ()
        await assert_all_free([f.workers["b2"]])
