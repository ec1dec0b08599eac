"""A pool routes a conversation to the route that holds its prefix (``shard.pool.prefix``,
``shard.pool.routing``): longest remembered prefix first, load second, a conversation nobody
holds to the least-loaded route, an overloaded holder passed over, and the memory bounded.

The index and the rule are pure and tested on their own (fake workers: a target, its open
generations and its sessions; hypothesis over random request sequences for the bound); the live
case runs a door over a pool of two FakeEngine replicas with prefix caches and checks that each
turn of a chat lands where the turn before left its conversation, so the worker reuses it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from rpc_harness import Worker, in_thread, worker
from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from shard.api import Catalog, build_app, serve_http
from shard.engine import LayerRange, LoadSpec
from shard.engine.fake import FakeEngine, FakeModel
from shard.pipeline import Pipeline
from shard.pool import Pool, PrefixIndex, Router, build_table
from shard.pool.prefix import BLOCK_CHARS, BLOCK_TOKENS
from shard.pool.routing import MIN_BLOCKS, SLACK
from shard.pool.spec import WorkerSource
from shard.v1 import shard_pb2 as pb
from test_api import TEMPLATE, get, post

# ---- the index -----------------------------------------------------------------------------


def conversation(seed: int, turns: int) -> str:
    """A chat-like text of ``turns`` turns, each longer than the prefix threshold."""
    return "".join(f"<turn {seed}.{t}>" + f"words of turn {t} in chat {seed} " * 12
                   for t in range(turns))


def test_a_route_matches_the_whole_blocks_of_the_prompts_it_was_sent() -> None:
    index = PrefixIndex(1000)
    first = conversation(1, 2)
    index.remember(("w1",), index.keys(first))
    longer = first + " and the answer, then a new question" * 8
    assert index.matches(index.keys(longer)) == {("w1",): len(first) // BLOCK_CHARS}
    assert index.matches(index.keys(conversation(2, 2))) == {}  # another conversation
    assert index.matches(index.keys(first[:BLOCK_CHARS - 1])) == {}  # no whole block
    tokens = list(range(5 * BLOCK_TOKENS + 3))
    index.remember(("w2",), index.keys(tokens))
    assert index.matches(index.keys(tokens + [7] * 40)) == {("w2",): 5}
    assert index.matches(index.keys([9] + tokens)) == {}  # a prefix, not a substring


def test_a_worker_forgotten_takes_every_route_through_it() -> None:
    index = PrefixIndex(1000)
    text = conversation(1, 2)
    for route in [("a", "b"), ("a2", "b"), ("a", "b2")]:
        index.remember(route, index.keys(text))
    assert index.forget("b") == 2 * (len(text) // BLOCK_CHARS)
    assert index.routes() == {("a", "b2")}
    assert set(index.matches(index.keys(text))) == {("a", "b2")}


#: Requests: (route, conversation, turns) to remember, or a worker to forget.
_request = st.one_of(
    st.tuples(st.sampled_from([("a",), ("b",), ("a", "c"), ("b", "c")]),
              st.integers(0, 5), st.integers(1, 4)),
    st.sampled_from(["a", "b", "c"]),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_request, max_size=40), st.integers(1, 40))
def test_the_index_stays_within_its_bound_and_never_claims_what_it_was_not_sent(
        requests: list[Any], bound: int) -> None:
    """Against a plain record of what each route was sent (and not forgotten since): the index
    holds at most ``bound`` pairs, every key maps back to a remembered pair, a match is never
    longer than the longest common prefix with a prompt the route was sent, and with nothing
    evicted it is exactly that; a match said to end a prompt ends one sent there."""
    index = PrefixIndex(bound)
    sent: dict[tuple[str, ...], list[str]] = {}
    evicted = False
    for req in requests:
        if isinstance(req, str):
            index.forget(req)
            sent = {r: p for r, p in sent.items() if req not in r}
        else:
            route, chat, turns = req
            prompt = conversation(chat, turns)
            before = len(index)
            index.remember(route, index.keys(prompt))
            sent.setdefault(route, []).append(prompt)
            evicted |= before + len(prompt) // BLOCK_CHARS > bound
        assert len(index) <= bound
        pairs = [r for r, _ in index._lru]
        assert index._pairs == {r: pairs.count(r) for r in set(pairs)}
        for chat in range(6):
            probe = conversation(chat, 4)
            got = index.matches(index.keys(probe))
            for route in set(got) | set(sent):
                common = max((_common(probe, p) // BLOCK_CHARS for p in sent.get(route, [])),
                             default=0)
                assert got.get(route, 0) <= common
                if not evicted:
                    assert got.get(route, 0) == common
                depth = got.get(route, 0)
                if depth and index.ended(route, index.keys(probe)[depth - 1]):
                    # a prompt sent there had exactly those blocks
                    assert any(len(p) // BLOCK_CHARS == depth <= _common(probe, p) // BLOCK_CHARS
                               for p in sent[route])


def _common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---- the rule, over fake workers -----------------------------------------------------------


@dataclass
class FakeWorker:
    target: str
    sessions: int = 0
    capacity: int = 4


class Fakes:
    """Workers of one model (ranges over 4 layers), their shapes, and a router picking."""

    def __init__(self, ranges: dict[str, tuple[int, int]], **router: Any) -> None:
        self.workers = {t: FakeWorker(t) for t in ranges}
        self.down: set[str] = set()
        table = build_table({t: pb.GetCapabilitiesResponse(
            model_fingerprint="f" * 64, n_layers_total=4, n_embd=8, model_name="m",
            layer_range=pb.LayerRange(start=a, end=b), max_sessions=4)
            for t, (a, b) in ranges.items()})
        self.shapes = [(s, cast(Pipeline, object())) for s in table.models["m"].shapes]
        self.router = Router(**router)
        self.turn = 0

    def live(self, target: str) -> FakeWorker | None:
        return None if target in self.down else self.workers[target]

    def pick(self, prompt: str | Sequence[int] | None, *, hold: bool = False) -> tuple[str, ...]:
        """The route one generation gets (``hold``: it keeps running, counted on its workers)."""
        self.turn += 1
        route = self.router.choose("m", self.shapes, self.live, self.turn, prompt).route
        if hold:
            for t in route:
                self.workers[t].sessions += 1
        return route


def test_a_conversation_resent_with_a_longer_tail_goes_back_to_its_route() -> None:
    fakes = Fakes({"a0": (0, 2), "a0r": (0, 2), "a1": (2, 4), "a1r": (2, 4)})
    chats = {n: conversation(n, 1) for n in range(4)}
    first = {n: fakes.pick(text, hold=True) for n, text in chats.items()}
    # four new conversations, running: spread by load over both replicas of each hop
    assert all(w.sessions == 2 for w in fakes.workers.values())
    for turn in range(2, 6):
        for n in chats:
            chats[n] = conversation(n, turn)
            assert fakes.pick(chats[n]) == first[n]
    assert fakes.router.picks[("m", "prefix")] == 16
    assert fakes.router.picks[("m", "load")] == 4


def test_a_new_conversation_goes_to_the_least_loaded_route() -> None:
    fakes = Fakes({"w1": (0, 4), "w2": (0, 4), "w3": (0, 4)})
    fakes.workers["w1"].sessions = 2
    fakes.workers["w3"].sessions = 1
    assert fakes.pick(conversation(1, 3)) == ("w2",)
    fakes.workers["w2"].sessions = 3
    # w1 was sent another conversation that starts with the same system prompt, shorter than
    # the threshold: it pins nothing (w1 would be taken, within the slack, if it did)
    short = "<|im_start|>system\n" + "the same system prompt for everyone " * 4
    assert len(short) < MIN_BLOCKS * BLOCK_CHARS
    index = fakes.router.index
    assert index is not None
    index.remember(("w1",), index.keys(short + "<|im_end|>\n" + conversation(9, 2)))
    assert fakes.pick(short + "<|im_end|>\na new question" + "of a new chat " * 9) == ("w3",)
    assert fakes.router.picks[("m", "prefix")] == 0


def test_a_short_first_turn_is_followed_by_its_next_turn() -> None:
    """The next turn of a first turn shorter than the threshold goes on from the whole prompt
    sent to its route: taken (a prompt that only shares its start is not, above)."""
    fakes = Fakes({"w1": (0, 4), "w2": (0, 4)})
    first = "<|im_start|>user\n" + "a short question " * 8  # two whole blocks
    assert BLOCK_CHARS <= len(first) < MIN_BLOCKS * BLOCK_CHARS
    route = fakes.pick(first)
    for turn in range(3):  # by load alone, the turns would alternate
        first += "<|im_start|>assistant\nan answer<|im_end|>\n" * (turn + 1)
        assert fakes.pick(first) == route
    assert fakes.router.picks[("m", "prefix")] == 3


def test_an_overloaded_holder_is_passed_over_for_the_least_loaded() -> None:
    fakes = Fakes({"w1": (0, 4), "w2": (0, 4)})
    text = conversation(1, 2)
    holder = fakes.pick(text)
    other = ({"w1", "w2"} - set(holder)).pop()
    fakes.workers[holder[0]].sessions = SLACK  # busier, within the slack: still taken
    assert fakes.pick(text + conversation(2, 1)) == holder
    fakes.workers[holder[0]].sessions = SLACK + 1  # past it
    assert fakes.pick(text + conversation(3, 1)) == (other,)
    assert fakes.router.picks[("m", "balance")] == 1
    fakes.workers[holder[0]].sessions = fakes.workers[other].sessions = 4  # both full: the longest
    assert fakes.pick(text + conversation(2, 1)) == holder


def test_a_full_holder_yields_to_a_route_with_a_free_session() -> None:
    fakes = Fakes({"w1": (0, 4), "w2": (0, 4)})
    for w in fakes.workers.values():
        w.capacity = 1
    text = conversation(1, 2)
    holder = fakes.pick(text)
    fakes.workers[holder[0]].sessions = 1  # its one session is taken
    assert fakes.pick(text + "more") != holder


def test_the_longest_holder_wins_and_a_worker_down_is_never_picked() -> None:
    fakes = Fakes({"w1": (0, 4), "w2": (0, 4), "w3": (0, 4)})
    short, long = conversation(1, 2), conversation(1, 4)
    fakes.router.index.remember(("w1",), fakes.router.index.keys(short))  # type: ignore[union-attr]
    fakes.router.index.remember(("w2",), fakes.router.index.keys(long))  # type: ignore[union-attr]
    fakes.workers["w2"].sessions = 2  # busier than w1 but within the slack: longest first
    assert fakes.pick(conversation(1, 5)) == ("w2",)
    fakes.down.add("w2")
    assert fakes.pick(conversation(1, 5)) == ("w1",)
    fakes.down.add("w1")
    assert fakes.pick(conversation(1, 5)) == ("w3",)


def test_without_a_prompt_or_with_the_index_off_the_pick_is_by_load() -> None:
    fakes = Fakes({"w1": (0, 4), "w2": (0, 4)}, entries=0)
    text = conversation(1, 3)
    assert {fakes.pick(text) for _ in range(4)} == {("w1",), ("w2",)}  # ties in turn
    assert fakes.router.picks[("m", "load")] == 4
    with pytest.raises(ValueError):
        Router(min_blocks=0)


# ---- live: a door over a pool of two replicas with prefix caches ---------------------------

TIMEOUT = 30.0
CHAT_MODEL = FakeModel(n_layers_total=4, n_embd=8, seed=7, chat_template=TEMPLATE)
N_CTX, SESSIONS = 16384, 4


class Listed(WorkerSource):
    def __init__(self, targets: list[str]) -> None:
        super().__init__("test list")
        self.now = targets

    async def targets(self) -> list[str]:
        await trio.lowlevel.checkpoint()
        return list(self.now)


@asynccontextmanager
async def replicas(n: int) -> AsyncIterator[list[Worker]]:
    """``n`` whole-model FakeEngine workers, each caching one conversation."""
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(worker(
            engine=FakeEngine(model=CHAT_MODEL), model_name="chat",
            load=LoadSpec(n_ctx=N_CTX, max_sessions=SESSIONS, layer_range=LayerRange(0, 4),
                          prefix_cache_tokens=N_CTX // SESSIONS))) for _ in range(n)]


async def test_each_turn_of_a_chat_through_the_door_reuses_the_replica_that_cached_it() -> None:
    """Two chats side by side, five turns each, over two replicas: after its first turn each
    turn is routed by prefix to the replica its conversation is cached on, which serves it from
    its cache; ``/metrics`` counts the picks."""
    async with replicas(2) as ws, Pool.open(Listed([w.target for w in ws]), probe_interval=0.05,
                                            connect_timeout=5.0) as pool, \
            trio.open_nursery() as nursery:
        await pool.settle(TIMEOUT)
        shutdown = trio.Event()
        app = build_app(Catalog(pool=pool, timeout=TIMEOUT))
        url = (await nursery.start(partial(serve_http, app, host="127.0.0.1", port=0,
                                           shutdown=shutdown, grace=1.0)))[0]
        histories: list[list[dict[str, str]]] = [[], []]
        cached: list[list[int]] = [[], []]
        for turn in range(5):
            for chat, messages in enumerate(histories):
                messages.append({"role": "user", "content": f"chat {chat} turn {turn}: " +
                                 "tell me more about the subject, " * 10})
                status, _, body = await in_thread(lambda m=messages: post(
                    url + "/v1/chat/completions", {"model": "chat", "messages": m,
                                                   "max_tokens": 12, "temperature": 0}))
                assert status == 200, body
                reply = body
                messages.append({"role": "assistant",
                                 "content": reply["choices"][0]["message"]["content"]})
                cached[chat].append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
        # every turn after the first computes only its new tail: the turn before is cached
        assert all(c[0] == 0 and all(x > 0 for x in c[1:]) for c in cached), cached
        picks = pool.router.picks
        assert picks[("chat", "load")] == 2 and picks[("chat", "prefix")] == 8, picks
        _, page = await in_thread(lambda: get(url + "/metrics"))
        assert b'trio_shard_api_pool_picks_total{by="prefix",model="chat"} 8.0' in page, page
        shutdown.set()


async def test_a_replica_that_leaves_takes_its_conversations_with_it() -> None:
    async with replicas(2) as ws, Pool.open(Listed([w.target for w in ws]), probe_interval=0.05,
                                            connect_timeout=5.0) as pool:
        await pool.settle(TIMEOUT)
        text = conversation(1, 3)
        async with pool.lease("chat", text) as lease:
            (held,) = lease.route
        assert pool.router.index is not None and pool.router.index.routes() == {(held,)}
        cast(Listed, pool.source).now = [w.target for w in ws if w.target != held]
        pool.reload()
        with trio.fail_after(10):
            while held in pool.members:
                await trio.sleep(0.05)
        assert pool.router.index.routes() == set()
        async with pool.lease("chat", text + "more") as lease:
            assert lease.route != (held,)
        assert pool.router.picks[("chat", "load")] == 2
