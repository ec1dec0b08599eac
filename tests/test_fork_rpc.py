"""``OpenSession.fork_of`` on a worker: a fork holds a copy of its source's history and goes on
alone; only the source's own caller may fork it; capacity and unknown ids are refused as opening
is; a routed session forks its next hop too. On the fake engine over the wire."""

from __future__ import annotations

from pathlib import Path

import pytest

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse leak check
from rpc_harness import worker
from shard.client import ShardClient, ShardError
from shard.engine import LayerRange
from shard.rpc.auth import TokenAuthenticator, bearer_metadata
from shard.rpc.errors import ErrorCode
from test_relay import relay_shards, route_of

TIMEOUT = 30.0
PROMPT = [1, *b"fork me once"]
TOKEN_A, TOKEN_B = "tok-A-fork-1234", "tok-B-fork-5678"


async def greedy(session: object, first: int, n: int) -> list[int]:
    """``n`` greedy decodes from ``first`` on ``session``."""
    out = [first]
    for _ in range(n):
        out.append((await session.decode(out[-1])).logits.token_id)  # type: ignore[attr-defined]
    return out


async def test_forks_share_one_prefill_and_go_on_alone() -> None:
    """Three forks of a prefilled session: the prompt is computed once, every fork holds it
    and decodes what the source does; the worker counts the forks."""
    async with worker() as w, ShardClient.connect(w.target, timeout=TIMEOUT) as client:
        caps = await client.capabilities()
        assert caps.session_fork
        async with client.session("src") as src:
            first = (await src.prefill(PROMPT)).logits.token_id
            outs = []
            for i in range(3):
                async with client.session(f"f{i}", fork_of="src") as fork:
                    assert fork.opened.n_past == len(PROMPT)
                    outs.append(await greedy(fork, first, 5))
            outs.append(await greedy(src, first, 5))
        assert outs[0] == outs[1] == outs[2] == outs[3]
        m = w.engine.metrics()
        assert (m.prefill_tokens_total, m.sessions_forked_total) == (len(PROMPT), 3)
        metrics = await client.metrics()
        assert metrics.engine["sessions_forked_total"] == 3
        assert metrics.worker["sessions_forked_total"] == 3


async def test_unknown_self_and_full_refusals_leave_nothing() -> None:
    """An unknown source, the session itself, and a fork past max_sessions (the source and
    three others fill the worker's four) are refused; the source goes on; nothing leaks (the
    autouse check)."""
    async with worker() as w, ShardClient.connect(w.target, timeout=TIMEOUT) as client:
        async with client.session("src") as src:
            await src.prefill(PROMPT)
            with pytest.raises(ShardError) as info:
                async with client.session("f", fork_of="nope"):
                    pass
            assert info.value.code == ErrorCode.SESSION_NOT_FOUND
            with pytest.raises(ShardError) as info:
                async with client.session("src2", fork_of="src2"):
                    pass
            assert info.value.code == ErrorCode.INVALID_ARGUMENT
            async with client.session("o1"), client.session("o2"), client.session("o3"):
                with pytest.raises(ShardError) as info:
                    async with client.session("f", fork_of="src"):
                        pass
                assert info.value.code == ErrorCode.RESOURCE_EXHAUSTED
            assert w.engine.metrics().sessions_forked_total == 0
            async with client.session("f", fork_of="src") as fork:  # room again
                assert fork.opened.n_past == len(PROMPT)


async def test_only_the_sources_own_caller_may_fork_it(tmp_path: Path) -> None:
    """With an authenticator, another principal's fork of a live session is answered as an
    unknown id; the same principal on another connection forks it."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN_A} router-a\n{TOKEN_B} router-b\n")
    async with worker(authorize=TokenAuthenticator(tokens)) as w:
        async with ShardClient.connect(w.target, timeout=TIMEOUT,
                                       metadata=bearer_metadata(TOKEN_A)) as a, \
                ShardClient.connect(w.target, timeout=TIMEOUT,
                                    metadata=bearer_metadata(TOKEN_B)) as b, \
                ShardClient.connect(w.target, timeout=TIMEOUT,
                                    metadata=bearer_metadata(TOKEN_A)) as a2:
            async with a.session("src") as src:
                await src.prefill(PROMPT)
                with pytest.raises(ShardError) as info:
                    async with b.session("steal", fork_of="src"):
                        pass
                assert info.value.code == ErrorCode.SESSION_NOT_FOUND
                async with a2.session("mine", fork_of="src") as fork:
                    assert fork.opened.n_past == len(PROMPT)
        assert w.engine.metrics().sessions_forked_total == 1


async def test_a_routed_fork_forks_every_hop() -> None:
    """A fork of a routed session (chain relay over two halves) forks the next hop's session
    too: each hop prefilled the prompt once, and the fork decodes what the source does."""
    ranges = [LayerRange(0, 2), LayerRange(2, 4)]
    async with relay_shards(ranges) as shards:
        route = route_of(shards[1:], ranges[1:])
        async with ShardClient.connect(shards[0].target, timeout=TIMEOUT) as client:
            async with client.session("src", route=route) as src:
                first = (await src.prefill(PROMPT)).logits.token_id
                async with client.session("fork", route=route, fork_of="src") as fork:
                    assert fork.opened.n_past == len(PROMPT)
                    mine = await greedy(fork, first, 4)
                theirs = await greedy(src, first, 4)
                with pytest.raises(ShardError) as info:  # a fork keeps its source's kind
                    async with client.session("plain", fork_of="src"):
                        pass
                assert info.value.code == ErrorCode.INVALID_ARGUMENT
        assert mine == theirs
        for shard in shards:
            m = shard.engine.metrics()
            assert (m.prefill_tokens_total, m.sessions_forked_total) == (len(PROMPT), 1)
