"""The RPC fuzzer's model of what the client believes (``SlotModel``, ``StepRun``) and the base
of its state machine, ``FuzzWorld``: one worker and two session slots per example, set up and torn
down, and the bookkeeping every rule shares (picking a slot, absorbing results, ending streams,
waiting for the worker to settle). The rules are in rpc_fuzz_steps.py, rpc_fuzz_streams.py and
rpc_fuzz_prefix.py; tests/test_rpc_fuzz.py composes them.

The worker runs with a prefix cache of ``cache_tokens`` (small, so entries are evicted under
pressure); the reference engine runs without one, so every result a cached prefill gives is
checked against the same history computed from scratch, with the same sampling (penalties and
grammars are functions of the session's ids: rpc_fuzz_sampling.py). The model records every
history the worker released (``released``), the bound of what any prefill may take from the
cache.
"""

from __future__ import annotations

import collections
import math
import threading
from dataclasses import dataclass, field, replace
from typing import Any

import trio
from hypothesis.stateful import RuleBasedStateMachine

from rpc_fuzz_harness import FAKE, RPC_TIMEOUT, EngineKind, Latency, LoopThread, trio_cache_thread
from rpc_fuzz_sampling import Sent, grammar_allows
from shard.client import ClientSession, ErrorCode, ShardClient, ShardError, cache_expectation
from shard.engine import PrefillRequest, ShardEngine
from shard.engine.prefix_cache import reserved_entries
from shard.engine.types import SamplingParams
from shard.rpc.server import serve
from shard.rpc.session import SessionCall, SessionLimits
from shard.v1 import shard_pb2 as pb

SLOTS = ("a", "b")
SETTLE = 5.0  # bound for the worker to finish ending a stream

#: Step-level errors the documentation allows (anything else fails the example).
STEP_ERRORS = {ErrorCode.DEADLINE_EXCEEDED, ErrorCode.CANCELLED, ErrorCode.RESOURCE_EXHAUSTED}


@dataclass
class StepRun:
    """A step request and what came back."""

    kind: str
    max_tokens: int = 1
    prompt: list[int] | None = None
    steps: list[pb.StepResult] = field(default_factory=list)
    error: ShardError | None = None
    crash: BaseException | None = None
    usage: pb.Usage | None = None
    done: trio.Event = field(default_factory=trio.Event)
    cancel_answer: tuple[bool, bool] | None = None
    n_past_at_cancel: int | None = None
    sent: Sent | None = None  # its sampling (None: plain greedy)


@dataclass
class SlotModel:
    """What the client believes about one session id."""

    sid: str
    state: str = "none"  # none | open | stepping | retained
    tokens: list[int] = field(default_factory=list)  # the history the client was sent results for
    choice: int | None = None  # token chosen by the last result (generate continues from it)
    exact: bool = True  # the engine holds exactly ``tokens`` (False: it may hold more)
    grammar_start: int = 0  # where the slot's last grammar started (0: none yet)
    grammar: int = 0  # which grammar that was (rpc_fuzz_sampling.GRAMMARS)
    deadline: float = math.inf  # trio time the stream's call deadline passes (at the latest)
    step_timeout: bool = False
    cut: bool = False  # we cut its connection: errors leaving that connection are expected
    client: ShardClient | None = None
    disconnect: trio.Event = field(default_factory=trio.Event)
    conn_done: trio.Event = field(default_factory=trio.Event)
    session: ClientSession | None = None
    run: StepRun | None = None

    def __repr__(self) -> str:
        return f"slot {self.sid!r}"

    def near_deadline(self) -> bool:
        return trio.current_time() >= self.deadline - 0.01


class FuzzWorld(RuleBasedStateMachine):
    """One example's world: a worker (and a reference engine), two slots on their own
    connections, and the model of each slot; subclasses add the rules and pick the engine."""

    engine_kind: EngineKind = FAKE

    check_reference = True

    #: The worker's prefix cache budget: two entries at most (a session holds 256), and two
    #: histories of more than half a session overflow it.
    cache_tokens = 260

    stats: collections.Counter[str] = collections.Counter()

    def __init__(self) -> None:
        super().__init__()
        self.threads_before = {t.ident for t in threading.enumerate()}
        self.loop = LoopThread()
        self.latency = Latency()
        self.slots = {sid: SlotModel(sid) for sid in SLOTS}
        self.reference_cache: dict[tuple[tuple[int, ...], SamplingParams], int] = {}
        self.server: Any = None
        self.engine: ShardEngine | None = None
        self.reference: ShardEngine | None = None
        self.server_scope = trio.CancelScope()
        self.server_done = trio.Event()
        self.problems: list[str] = []
        self.auto_opens = 0
        spec = self.engine_kind.spec()
        self.capacity = spec.n_ctx // spec.max_sessions  # positions a session may hold
        self.max_sessions = spec.max_sessions
        self.cache_entries = reserved_entries(self.cache_tokens, self.capacity)
        #: Every history the worker released, and whether it is exactly what the engine held
        #: (False: the engine may have held more after it, results the client never got).
        self.released: list[tuple[tuple[int, ...], bool]] = []
        #: The last release, when the cache surely kept it (exact, and no step in flight that
        #: could pin an entry): a prefill of a fresh session takes at least its shared prefix.
        self.last_release: tuple[int, ...] | None = None
        self.loop.run(self._start)
        FuzzWorld.stats["examples"] += 1

    # ---- set-up and tear-down (in the loop) ---------------------------------------------------

    async def _start(self) -> None:
        assert self.loop.nursery is not None
        self.engine = self.engine_kind.make(self.latency)
        if self.check_reference:
            self.reference = self.engine_kind.make(Latency(max_s=0))
            await self.reference.load(self.engine_kind.spec())
        self.server = await self.loop.nursery.start(self._serve)
        for slot in self.slots.values():
            await self._connect(slot)

    async def _serve(self, task_status: trio.TaskStatus[Any]) -> None:
        assert self.engine is not None
        try:
            async with self.engine:
                spec = replace(self.engine_kind.spec(), prefix_cache_tokens=self.cache_tokens)
                await self.engine.load(spec)
                with self.server_scope:
                    await serve(
                        self.engine,
                        limits=SessionLimits(resume_ttl=600.0, close_linger=1.0),
                        task_status=task_status,
                    )
                m = self.engine.metrics()
                if self.engine.sessions() or m.kv_cells_used:
                    self.problems.append(
                        f"leak after stop: {self.engine.sessions()}, {m.kv_cells_used} KV cells"
                    )
                FuzzWorld.stats["cache:evicted"] += m.prefix_cache_evictions_total
                if m.prefix_cache_tokens > self.cache_tokens:
                    self.problems.append(f"the cache holds {m.prefix_cache_tokens} tokens after stop")
                self.problems.extend(self.sequence_id_problems())
        finally:
            self.server_done.set()

    async def _connect(self, slot: SlotModel) -> None:
        assert self.loop.nursery is not None
        slot.disconnect, slot.conn_done, slot.cut = trio.Event(), trio.Event(), False
        await self.loop.nursery.start(self._hold_connection, slot)

    async def _hold_connection(self, slot: SlotModel, task_status: trio.TaskStatus[None]) -> None:
        try:
            async with ShardClient.connect(self.server.target, timeout=RPC_TIMEOUT) as client:
                slot.client = client
                task_status.started()
                await slot.disconnect.wait()
        except Exception as exc:  # noqa: BLE001 - reported, so the loop survives to tell
            if not slot.cut:
                self.problems.append(f"connection {slot.sid} failed: {exc!r}")
        finally:
            slot.client = None
            slot.conn_done.set()

    def teardown(self) -> None:
        try:
            if self.server is not None:
                self.loop.run(self._stop_all)
        finally:
            self.loop.close()
        assert not self.problems, self.problems
        extra = [
            t for t in threading.enumerate()
            if t.ident not in self.threads_before and not trio_cache_thread(t)
        ]
        assert not extra, f"threads left behind: {extra}"

    async def _stop_all(self) -> None:
        for slot in self.slots.values():
            if slot.session is not None:
                slot.session.abort()
            slot.disconnect.set()
            await slot.conn_done.wait()
        for slot in self.slots.values():
            if slot.run is not None:
                await slot.run.done.wait()
        self.server_scope.cancel()
        await self.server_done.wait()
        if self.reference is not None:
            await self.reference.aclose()

    # ---- helpers --------------------------------------------------------------------------

    def _in(self, *states: str) -> list[SlotModel]:
        return [s for s in self.slots.values() if s.state in states]

    def _pick(self, sid: str, *states: str) -> SlotModel | None:
        """The slot if a rule applies to it now. Rules never draw depending on the state (it
        depends on timing, and hypothesis replays draws), so a rule that does not apply is a
        no-op, counted as skipped."""
        slot = self.slots[sid]
        if "open" in states and slot.state in ("none", "retained"):
            # Open it first, so that fewer rules are skipped; the options cycle (the open rule
            # draws them), which changes no draw.
            n = self.auto_opens = self.auto_opens + 1
            timeout = (None, None, 0.25, None, 0.1)[n % 5]
            step_timeout = (None, 0.002, None)[n % 3]
            resume = ("right", "count", "wrong", "right")[n % 4]
            self.loop.run(self._open, slot, timeout, step_timeout, resume, n % 3)
        if slot.state in states:
            return slot
        FuzzWorld.stats["skipped"] += 1
        return None

    def _engine_sids(self) -> set[str]:
        assert self.engine is not None
        return {info.session_id for info in self.engine.sessions()}

    def sequence_id_problems(self) -> list[str]:
        """Every sequence id is free, a session's or a cache entry's, exactly one of them (none
        leaks, none is held twice): checked while no release is under way."""
        engine = self.engine
        assert engine is not None
        free = list(engine._sessions._free)  # noqa: SLF001
        held = [s.seq_id for s in engine._slots.values()]  # noqa: SLF001
        cached = engine._prefix.cache.keys()  # noqa: SLF001
        want = list(range(self.max_sessions + self.cache_entries))
        got = sorted([*free, *held, *cached])
        if got != want:
            return [f"sequence ids: free {sorted(free)}, sessions {held}, cache {cached}"]
        return []

    def _released(self, tokens: list[int], exact: bool) -> None:
        """The worker released a session holding ``tokens`` (and more unless ``exact``)."""
        if not tokens:
            return
        self.released.append((tuple(tokens), exact))
        quiet = all(s.run is None for s in self.slots.values())
        self.last_release = tuple(tokens) if exact and quiet else None

    def cache_bound(self, history: list[int]) -> int:
        """The most leading positions of ``history`` any prefill may hold from the cache: the
        longest prefix it shares with a released history (all of it, when the engine may have
        held more than the client knows of that one), less one position."""
        best = 0
        for kept, exact in self.released:
            m = min(len(kept), len(history))
            shared = next((i for i in range(m) if kept[i] != history[i]), m)
            best = max(best, len(history) if shared == len(kept) and not exact else shared)
        return min(best, len(history) - 1)

    def _call(self, sid: str) -> SessionCall | None:
        return self.server.registry.live(sid)

    def _control(self) -> ShardClient | None:
        return next((s.client for s in self.slots.values() if s.client is not None), None)

    async def _expected_choice(self, history: list[int], params: SamplingParams) -> int | None:
        """The token the same history gives when computed alone on a fresh engine."""
        if self.reference is None:
            return None
        key = (tuple(history), params)
        if key not in self.reference_cache:
            await self.reference.open_session("ref")
            try:
                result = await self.reference.prefill(PrefillRequest("ref", key[0], sampling=params))
            finally:
                await self.reference.release("ref")
            assert result.logits is not None
            self.reference_cache[key] = result.logits.token_id
        return self.reference_cache[key]

    async def _absorb(self, slot: SlotModel, step: pb.StepResult, fed: list[int],
                      sent: Sent | None = None) -> None:
        """A result the client received (of a step sent with ``sent``): extend the history,
        check it as if run alone, and that its grammar allows it."""
        slot.tokens = [*slot.tokens, *fed]
        assert step.n_past == len(slot.tokens), (slot.sid, step.n_past, len(slot.tokens))
        if step.cached_tokens:
            start = len(slot.tokens) - len(fed) + step.reused_tokens
            bound = self.cache_bound(slot.tokens)
            assert start + step.cached_tokens <= bound, (
                f"{slot.sid}: {step.cached_tokens} cached tokens from position {start}, but only"
                f" {bound} positions of its history were ever released"
            )
            FuzzWorld.stats["cache:hit"] += 1
        params = sent.params if sent is not None else SamplingParams()
        choice = step.logits.token_id
        want = await self._expected_choice(slot.tokens, params)
        assert want is None or choice == want, (
            f"{slot.sid}: a result differs from the same session run alone ({choice}, not {want},"
            f" with {params})"
        )
        if params.grammar is not None:
            assert self.engine is not None
            allowed = grammar_allows(self.engine._grammars, params, slot.tokens, choice)  # noqa: SLF001
            assert allowed is not False, (
                f"{slot.sid}: the grammar {params.grammar} refuses the token {choice} it chose")
            FuzzWorld.stats["grammar"] += 1
            FuzzWorld.stats["grammar:constrained" if allowed else "grammar:free"] += 1
        if params.penalized or params.logit_bias or params.min_p:
            FuzzWorld.stats["penalized"] += 1
            if want is not None:  # the reference without them: did they decide the token?
                plain = replace(params, repeat_penalty=1.0, presence_penalty=0.0,
                                frequency_penalty=0.0, logit_bias=(), min_p=0.0)
                if await self._expected_choice(slot.tokens, plain) != want:
                    FuzzWorld.stats["penalized:decisive"] += 1
        slot.choice = choice

    async def _absorb_run(self, slot: SlotModel, run: StepRun) -> None:
        for i, step in enumerate(run.steps):
            fed = run.prompt if i == 0 and run.prompt is not None else [slot.choice]
            await self._absorb(slot, step, fed, run.sent)  # type: ignore[arg-type]

    async def _ended(self, slot: SlotModel, err: ShardError, how: str, expect: str = "none") -> bool:
        """An error from a call on ``slot``: True if it ended the stream (the slot is updated)."""
        if slot.session is None or slot.session._dead is None:  # noqa: SLF001 - step-level
            return False
        if err.code is not ErrorCode.DEADLINE_EXCEEDED:
            raise AssertionError(f"{how}: undocumented end of the stream: {err!r}")
        assert slot.near_deadline() or trio.current_time() >= slot.deadline, f"{how}: early {err!r}"
        await self._end_stream(slot, expect, ambiguous=True)
        FuzzWorld.stats[f"{how}:deadline"] += 1
        return True

    async def _end_stream(self, slot: SlotModel, expect: str, *, ambiguous: bool = False) -> None:
        """The slot's stream is over. ``ambiguous``: the call deadline raced the end, so the
        worker may have released or retained it: read which (the invariant checks it)."""
        exact = slot.exact and slot.run is None  # a step's results not absorbed: the engine holds more
        if slot.run is not None:
            await slot.run.done.wait()
            slot.run = None
        if slot.session is not None:
            slot.session.abort()
        slot.session, slot.deadline = None, math.inf
        await self._stream_gone(slot)
        if ambiguous:
            expect = "retained" if self.server.registry.retained(slot.sid) is not None else "none"
            slot.exact = False
        slot.state = expect
        if expect == "none":
            self._released(slot.tokens, exact and slot.exact)
            slot.tokens, slot.choice, slot.exact, slot.grammar_start = [], None, True, 0

    async def _stream_gone(self, slot: SlotModel) -> None:
        """Wait (bounded) until the worker no longer holds the slot's stream: it released or
        retained the session, whichever it does."""
        with trio.move_on_after(SETTLE):
            while self._call(slot.sid) is not None:
                await trio.sleep(0.002)

    def deadline_near(self) -> bool:
        """A live slot's call deadline is near or past: the worker may be ending its stream."""
        return any(s.near_deadline() for s in self._in("open", "stepping"))

    async def _settle(self) -> bool:
        """Wait until the worker finished ending streams: one stream task per live slot. False
        as soon as a live slot's call deadline comes near (on a busy machine the wait may
        outlast it): the worker may be ending that stream, which the caller models first."""
        registry = self.server.registry
        live = {s.sid for s in self._in("open", "stepping")}
        with trio.move_on_after(SETTLE):
            while registry.streams.value != len(live) or {
                sid for sid in SLOTS if registry.live(sid) is not None
            } != live:
                if self.deadline_near():
                    return False
                await trio.sleep(0.002)
        if self.deadline_near():
            return False
        assert registry.streams.value == len(live), (
            f"{registry.streams.value} stream tasks for live slots {sorted(live)}"
        )
        return True

    async def _open(
        self, slot: SlotModel, timeout: float | None, step_timeout: float | None, resume: str, credit: int
    ) -> None:
        assert slot.client is not None
        R = pb.CacheResult
        cache = None
        if slot.state == "retained":
            if resume == "wrong" and slot.tokens:  # same length, another last token
                cache = cache_expectation([*slot.tokens[:-1], slot.tokens[-1] + 1])
            elif resume == "count":
                cache = pb.CacheExpectation(n_tokens=len(slot.tokens))
            else:
                resume = "right"
                cache = cache_expectation(slot.tokens)
        started = trio.current_time()
        try:
            slot.session = await slot.client.open_session(
                slot.sid,
                cache=cache,
                credit=credit,
                step_timeout=step_timeout,
                timeout=timeout if timeout is not None else RPC_TIMEOUT * 10,
            )
        except ShardError as err:  # only a short call deadline may end an open (a busy machine)
            assert timeout is not None and err.code is ErrorCode.DEADLINE_EXCEEDED, err
            assert trio.current_time() >= started + timeout - 0.01, err
            await self._end_stream(slot, "none", ambiguous=True)
            FuzzWorld.stats["open:deadline"] += 1
            return
        slot.deadline = started + timeout if timeout is not None else math.inf
        slot.step_timeout = step_timeout is not None
        outcome, held = slot.session.cache.outcome, slot.session.cache.tokens_held
        if slot.state == "retained" and resume != "wrong":
            assert (outcome, held) == (R.OUTCOME_HIT, len(slot.tokens)), slot.session.cache
        elif slot.state == "retained":
            assert outcome == R.OUTCOME_MISMATCH, slot.session.cache
            self._released(slot.tokens, slot.exact)  # the mismatched session was released
            slot.tokens, slot.exact = [], True
        else:
            assert outcome == R.OUTCOME_NEW, slot.session.cache
        slot.choice = None  # a new stream has no previous step to continue from
        slot.state = "open"
        FuzzWorld.stats[f"open:{resume if cache is not None else 'new'}"] += 1
