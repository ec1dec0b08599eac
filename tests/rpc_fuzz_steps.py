"""The RPC fuzzer's step rules: prefill, decode, generate (awaited or left running), session
hand-off, the Cancel RPC (while a step computes, and right after it is dispatched: the race of
issue 8 item 3), rewinds stopped at random points, and long prompts left running; each checks
that a call ended with a documented status for its cause.
"""

from __future__ import annotations

from typing import Any

import trio
from hypothesis import strategies as st
from hypothesis.stateful import rule

from rpc_fuzz_model import SLOTS, STEP_ERRORS, FuzzWorld, SlotModel, StepRun
from rpc_fuzz_sampling import DRAWS, Draw, resolve
from shard.client import ClientSession, ErrorCode, ShardError
from shard.engine import SessionState
from shard.v1 import shard_pb2 as pb


class StepRules(FuzzWorld):
    """Rules that run steps on an open session, and stop them."""

    @rule(sid=st.sampled_from(SLOTS), tokens=st.lists(st.integers(3, 258), min_size=1, max_size=6),
          draw=DRAWS)
    def prefill(self, sid: str, tokens: list[int], draw: Draw | None) -> None:
        slot = self._pick(sid, "open")
        if slot is None:
            return
        self.loop.run(self._step, slot, "prefill", tokens, draw)

    @rule(sid=st.sampled_from(SLOTS), draw=DRAWS)
    def decode(self, sid: str, draw: Draw | None) -> None:
        slot = self._pick(sid, "open")
        if slot is None or slot.choice is None:
            return
        self.loop.run(self._step, slot, "decode", [], draw)

    async def _step(self, slot: SlotModel, kind: str, tokens: list[int],
                    draw: Draw | None = None) -> pb.StepResult | None:
        """One prefill or decode (with ``draw``'s sampling); its result, or None when it failed
        (checked here)."""
        assert slot.session is not None
        fed = tokens if kind == "prefill" else [slot.choice]
        sent = resolve(slot, draw, len(tokens) if kind == "prefill" else None)
        msg = sent.msg if sent is not None else None
        try:
            if kind == "prefill":
                step = await slot.session.prefill(tokens, sampling=msg)
            else:
                step = await slot.session.decode(slot.choice, sampling=msg)
        except ShardError as err:
            if await self._ended(slot, err, kind):
                return None
            self._step_error(kind, slot, err, overflow=len(slot.tokens) + len(fed) > self.capacity)
            return None
        await self._absorb(slot, step, fed, sent)  # type: ignore[arg-type]
        slot.exact = True
        usage = slot.session.usage
        assert usage.n_past == len(slot.tokens), (slot.sid, usage, len(slot.tokens))
        if kind == "prefill":
            assert usage.prompt_tokens + usage.reused_tokens + usage.cached_tokens == len(tokens), usage
            assert usage.cached_tokens == step.cached_tokens, (usage, step)
        else:
            assert usage.generated_tokens == 1, usage
        FuzzWorld.stats[kind] += 1
        return step

    @staticmethod
    def _step_error(kind: str, slot: SlotModel, err: ShardError, *, overflow: bool = False) -> None:
        """A step-level error: only the documented ones, each for its cause. ``overflow``: the
        input would take the session past its per-session context (refused INVALID_ARGUMENT)."""
        if overflow and err.code is ErrorCode.INVALID_ARGUMENT:
            assert "per-session context" in err.message, err
            FuzzWorld.stats[f"{kind}:overflow"] += 1
            return
        assert err.code in STEP_ERRORS, f"{kind}: undocumented step error {err!r}"
        if err.code is ErrorCode.DEADLINE_EXCEEDED:
            assert slot.step_timeout and err.reason == "STEP_TIMEOUT", err
        if err.code is ErrorCode.RESOURCE_EXHAUSTED:
            assert err.reason == "KV_CACHE_FULL" and not err.retryable, err
        FuzzWorld.stats[f"{kind}:{err.code.name}"] += 1

    @rule(src=st.sampled_from(SLOTS), dst=st.sampled_from(SLOTS), corrupt=st.booleans(),
          clear=st.booleans(), prompt=st.lists(st.integers(3, 258), min_size=1, max_size=6))
    def handoff(self, src: str, dst: str, corrupt: bool, clear: bool, prompt: list[int]) -> None:
        """Session hand-off within the worker: ``src``'s state exported and imported into
        ``dst`` (which must be empty: ``clear`` rewinds it to 0 first), with a byte of the state
        flipped when ``corrupt``; an empty ``src`` is prefilled with ``prompt`` first. The
        moved session then goes on as ``src`` would (its results are checked against the
        reference like every other); refusals are step-level and leave ``dst`` as it was."""
        if src == dst:
            return
        a, b = self._pick(src, "open"), self._pick(dst, "open")
        if a is not None and a.exact and not a.tokens:
            self.loop.run(self._step, a, "prefill", prompt)
        if a is None or b is None or a.state != "open" or b.state != "open" or not a.tokens \
                or not (a.exact and b.exact):
            FuzzWorld.stats["handoff:skipped"] += 1
            return
        self.loop.run(self._handoff, a, b, corrupt, clear)

    async def _handoff(self, a: SlotModel, b: SlotModel, corrupt: bool, clear: bool) -> None:
        assert a.session is not None and b.session is not None
        if clear and b.tokens:
            try:
                assert await b.session.rewind(0) == 0
            except ShardError as err:
                if await self._ended(b, err, "import"):
                    return
                raise AssertionError(f"rewind(0): undocumented step error {err!r}") from None
            b.tokens, b.choice = [], None
        try:
            chunks = [c async for c in a.session.export_state(max_chunk_bytes=4096)]
        except ShardError as err:
            if await self._ended(a, err, "export"):
                return
            raise AssertionError(f"export: undocumented step error {err!r}") from None
        header = chunks[0].header
        assert header.n_past == a.session.usage.n_past == len(a.tokens), (header.n_past, a)
        assert list(header.tokens) == a.tokens, a
        if corrupt:
            last = chunks[-1]
            last.data = bytes([last.data[0] ^ 0x40]) + last.data[1:]
        try:
            for chunk in chunks:
                held = await b.session.import_state(chunk)
        except ShardError as err:
            if await self._ended(b, err, "import"):
                return
            if b.tokens:
                assert err.code is ErrorCode.ILLEGAL_TRANSITION, err
            else:
                assert corrupt and err.code is ErrorCode.INVALID_ARGUMENT, err
                assert err.reason == "STATE_CORRUPT", err
            assert b.session.usage.n_past == len(b.tokens)
            FuzzWorld.stats[f"handoff:{err.code.name}"] += 1
            return
        assert not corrupt and not b.tokens, f"{b}: an import was taken that must be refused"
        assert held == len(a.tokens)
        b.tokens, b.exact, b.grammar_start = list(a.tokens), True, a.grammar_start
        b.choice = header.next_token if header.has_next_token else None
        FuzzWorld.stats["handoff"] += 1

    @rule(
        sid=st.sampled_from(SLOTS),
        max_tokens=st.integers(1, 12),
        background=st.booleans(),
        first=st.integers(3, 258),
        draw=DRAWS,
    )
    def generate(self, sid: str, max_tokens: int, background: bool, first: int, draw: Draw | None) -> None:
        slot = self._pick(sid, "open")
        if slot is None:
            return
        prompt = None if slot.choice is not None else [first]
        run = StepRun("generate", max_tokens, prompt)
        run.sent = resolve(slot, draw, None if prompt is None else len(prompt))
        self.loop.run(self._start_generate, slot, run)
        if not background:
            self.loop.run(self._finish, slot)

    async def _start_generate(self, slot: SlotModel, run: StepRun) -> None:
        assert self.loop.nursery is not None and slot.session is not None
        slot.run, slot.state = run, "stepping"
        self.loop.nursery.start_soon(self._generating, slot.session, run)
        await trio.sleep(0)

    @staticmethod
    async def _generating(session: ClientSession, run: StepRun) -> None:
        try:
            sampling = run.sent.msg if run.sent is not None else None
            async for step in session.generate(run.prompt, max_tokens=run.max_tokens, sampling=sampling):
                run.steps.append(step)
            run.usage = session.usage
        except ShardError as err:
            run.error = err
            if session._dead is None:  # noqa: SLF001 - a step-level error: Usage was read
                run.usage = session.usage
        except Exception as exc:  # noqa: BLE001 - reported by _finish
            run.crash = exc
        finally:
            run.done.set()

    @rule(sid=st.sampled_from(SLOTS))
    def finish_step(self, sid: str) -> None:
        slot = self._pick(sid, "stepping")
        if slot is None:
            return
        self.loop.run(self._finish, slot)

    async def _finish(self, slot: SlotModel) -> None:
        run = slot.run
        assert run is not None
        await run.done.wait()
        assert run.crash is None, f"generate raised {run.crash!r}"
        await self._absorb_run(slot, run)
        if run.error is not None:
            if await self._ended(slot, run.error, "generate"):
                return
            before = len(slot.tokens) - (len(run.prompt or ()) + len(run.steps) - 1 if run.steps else 0)
            # (without a prompt, the step feeds the last result's token: one position)
            overflow = before + (len(run.prompt) if run.prompt is not None else 1) > self.capacity
            self._step_error("generate", slot, run.error, overflow=overflow)
        else:
            assert run.steps and run.steps[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
            if run.steps[-1].finish_reason == pb.FINISH_REASON_LENGTH:
                assert len(run.steps) == run.max_tokens
            FuzzWorld.stats["generate"] += 1
        slot.run = None
        assert run.usage is not None
        assert run.usage.generated_tokens == len(run.steps), (run.usage, len(run.steps))
        # Usage reports the positions held: the client's history (a generate does not feed
        # its last token back), unless a lost connection left it unsure.
        if slot.exact:
            assert run.usage.n_past == len(slot.tokens), (slot.sid, run.usage, len(slot.tokens))
        if run.cancel_answer == (True, True) and slot.sid in self._engine_sids():
            # A Cancel that found the step running stops it within one step.
            assert self.engine is not None and run.n_past_at_cancel is not None
            grown = self.engine.session_info(slot.sid).n_past - run.n_past_at_cancel
            assert grown <= 1, f"the step went on for {grown} positions after Cancel"
            if run.kind == "dispatch-race":
                assert run.error is not None and run.error.code is ErrorCode.CANCELLED, (
                    f"a Cancel right after dispatch ended the step with {run.error!r}"
                )
                assert not run.steps, f"a Cancel right after dispatch let {len(run.steps)} steps out"
        slot.exact = slot.exact or bool(run.steps)
        slot.state = "open"

    @rule(sid=st.sampled_from(SLOTS), max_tokens=st.integers(2, 12))
    def cancel_right_after_dispatch(self, sid: str, max_tokens: int) -> None:
        """A Cancel lands after the worker dispatched the step, before its task ran (not on a
        full session: the step is refused before it could be cancelled)."""
        slot = self._pick(sid, "open")
        if slot is None or len(slot.tokens) >= self.capacity:
            return
        run = StepRun("dispatch-race", max_tokens, None if slot.choice is not None else [5])
        self.loop.run(self._race, slot, run)

    async def _race(self, slot: SlotModel, run: StepRun) -> None:
        call = self._call(slot.sid)
        if call is None:  # the call deadline ended the stream already
            assert slot.near_deadline(), "an open session has no stream on the worker"
            await self._end_stream(slot, "none", ambiguous=True)
            return
        assert call._nursery is not None  # noqa: SLF001
        registry, engine = self.server.registry, self.engine
        assert engine is not None
        real = call._nursery  # noqa: SLF001

        class CancelAfterDispatch:
            """Stands in for the call's nursery once: the Cancel RPC's own call (the registry's
            ``cancel``) runs right after the step task is scheduled, before it starts."""

            def start_soon(self, fn: Any, *args: Any) -> None:
                call._nursery = real  # noqa: SLF001
                real.start_soon(fn, *args)
                run.cancel_answer = registry.cancel(slot.sid)
                run.n_past_at_cancel = engine.session_info(slot.sid).n_past

        call._nursery = CancelAfterDispatch()  # type: ignore[assignment]  # noqa: SLF001
        await self._start_generate(slot, run)
        await run.done.wait()
        call._nursery = real  # noqa: SLF001 - if the stream ended before the dispatch
        if run.cancel_answer is not None:
            assert run.cancel_answer == (True, True), f"Cancel after dispatch answered {run.cancel_answer}"
        FuzzWorld.stats["cancel_after_dispatch"] += 1
        await self._finish(slot)

    @rule(sid=st.sampled_from(SLOTS), max_tokens=st.integers(6, 12), first=st.integers(3, 258))
    def cancel_rpc_mid_step(self, sid: str, max_tokens: int, first: int) -> None:
        """A generate, and a Cancel RPC while the engine computes one of its tokens."""
        slot = self._pick(sid, "open")
        if slot is None:
            return
        run = StepRun("generate", max_tokens, None if slot.choice is not None else [first])
        self.loop.run(self._cancel_mid_step, slot, run)

    async def _cancel_mid_step(self, slot: SlotModel, run: StepRun) -> None:
        engine = self.engine
        assert engine is not None
        await self._start_generate(slot, run)
        with trio.move_on_after(1.0):
            while not run.done.is_set() and not (
                slot.sid in self._engine_sids()
                and engine.session_info(slot.sid).state is SessionState.RUNNING
            ):
                await trio.sleep(0)
        await self._cancel(slot)
        await self._finish(slot)

    @rule(sid=st.sampled_from(SLOTS))
    def cancel_rpc(self, sid: str) -> None:
        slot = self._pick(sid, "stepping")
        if slot is None:
            return
        self.loop.run(self._cancel, slot)

    async def _cancel(self, slot: SlotModel) -> None:
        run, control, engine = slot.run, self._control(), self.engine
        assert engine is not None and control is not None
        if run is None:  # the step ended with the stream (deadline) before we got here
            return
        reply = await control.cancel(slot.sid)
        assert reply.found or run.done.is_set() or slot.near_deadline(), "Cancel found no session"
        if reply.was_running and run.cancel_answer is None and slot.sid in self._engine_sids():
            run.cancel_answer, run.n_past_at_cancel = (True, True), engine.session_info(slot.sid).n_past
        FuzzWorld.stats[f"cancel_rpc:{'running' if reply.was_running else 'idle'}"] += 1

    @rule(
        sid=st.sampled_from(SLOTS),
        back=st.integers(1, 12),
        share=st.integers(0, 3),
        extra=st.integers(8, 60),
        how=st.sampled_from(["cancel", "cancel", "plain", "too_long"]),
        pause=st.integers(0, 40),
    )
    def rewind_prefill(self, sid: str, back: int, share: int, extra: int, how: str, pause: int) -> None:
        """A Prefill at an earlier position with a new continuation, stopped by a Cancel RPC
        (after ``pause`` scheduling rounds of its computation), by the slot's step timeout or
        the call deadline, refused for the KV budget, or left to finish."""
        slot = self._pick(sid, "open")
        if slot is None:
            return
        self.loop.run(self._rewind, slot, back, share, extra, how, pause)

    async def _rewind(self, slot: SlotModel, back: int, share: int, extra: int, how: str, pause: int) -> None:
        if len(slot.tokens) < back:  # something to rewind into first
            await self._step(slot, "prefill", [3 + (i * 5 + back) % 256 for i in range(back + 4)])
            if slot.state != "open":
                return
        session, engine, control = slot.session, self.engine, self._control()
        assert session is not None and engine is not None and control is not None
        n = len(slot.tokens)
        position = max(0, n - back)
        filler = [3 + (i * 29 + extra) % 256 for i in range(extra if how != "too_long" else 300)]
        new = [*slot.tokens[position : position + share], *filler]
        reused = 0
        while reused < min(n - position, len(new) - 1) and slot.tokens[position + reused] == new[reused]:
            reused += 1
        outcome: dict[str, Any] = {}

        async def run() -> None:
            try:
                outcome["step"] = await session.prefill(new, position=position)
            except ShardError as err:
                outcome["error"] = err

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            if how == "cancel":
                for _ in range(pause):
                    await trio.lowlevel.checkpoint()
                await control.cancel(slot.sid)
        if "step" in outcome:
            step = outcome["step"]
            slot.tokens = slot.tokens[:position]
            await self._absorb(slot, step, new)
            assert session.usage.n_past == step.n_past == len(slot.tokens), session.usage
            slot.exact = True
            FuzzWorld.stats["rewind:done"] += 1
            return
        err = outcome["error"]
        if await self._ended(slot, err, "rewind"):
            return
        if how == "too_long":  # refused before any work, as the engine's length check would
            assert err.code in (ErrorCode.INVALID_ARGUMENT, ErrorCode.RESOURCE_EXHAUSTED), err
            FuzzWorld.stats["rewind:refused"] += 1
        else:
            self._step_error("rewind", slot, err, overflow=position + len(new) > self.capacity)
        held = session.usage.n_past
        # A failed step leaves the session as it was, or (a rewind that began computing) cut at
        # position + reused; what the worker reports is what the engine holds (the invariant).
        if how == "too_long":
            assert held == n, f"a refused rewind changed the session: {held} of {n}"
        assert held in (n, position + reused), f"a failed rewind left {held} (had {n}, keep {position + reused})"
        if held < n:
            slot.tokens, slot.choice = slot.tokens[:held], None
            FuzzWorld.stats["rewind:cut"] += 1
        slot.exact = slot.exact or held < n

    @rule(sid=st.sampled_from(SLOTS), length=st.integers(40, 200), salt=st.integers(0, 255))
    def long_prompt(self, sid: str, length: int, salt: int) -> None:
        """A long prompt (a generate of one token) left running while other rules go on."""
        slot = self._pick(sid, "open")
        if slot is None:
            return
        prompt = [3 + (i * 7 + salt) % 256 for i in range(length)]
        self.loop.run(self._start_generate, slot, StepRun("generate", 1, prompt))
