"""The RPC fuzzer's grammar rules (issue 54): a broken grammar spec is refused and leaves the
session as it was; a replay inside a grammar's output (a rewind, then the same tokens again)
gives the reference's token. The sampling the step rules draw is in rpc_fuzz_sampling.py.
"""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import strategies as st
from hypothesis.stateful import rule

from rpc_fuzz_model import SLOTS, FuzzWorld, SlotModel, StepRun
from rpc_fuzz_prefix import PrefixRules
from rpc_fuzz_sampling import BROKEN, DRAWS, GRAMMARS, Draw, resolve
from shard.client import ErrorCode, ShardError, sampling


class SamplingRules(PrefixRules):
    """Rules that need sampling: a broken grammar, and a replay inside a grammar's output."""

    @rule(sid=st.sampled_from(SLOTS), which=st.integers(0, len(BROKEN) - 1),
          tokens=st.lists(st.integers(3, 258), min_size=1, max_size=4), generate=st.booleans())
    def broken_grammar(self, sid: str, which: int, tokens: list[int], generate: bool) -> None:
        """A prefill or a generate with a grammar that does not compile: refused
        INVALID_ARGUMENT / INVALID_GRAMMAR, the session as it was (the next steps go on)."""
        slot = self._pick(sid, "open")
        if slot is None:
            return
        self.loop.run(self._broken, slot, BROKEN[which], tokens, generate)

    async def _broken(self, slot: SlotModel, spec: tuple[str, str], tokens: list[int], generate: bool) -> None:
        session = slot.session
        assert session is not None
        msg = sampling(grammar_kind=spec[0], grammar=spec[1])
        try:
            if generate:
                async for _ in session.generate(tokens, max_tokens=2, sampling=msg):
                    raise AssertionError(f"a generate with the grammar {spec} gave a token")
            else:
                await session.prefill(tokens, sampling=msg)
        except ShardError as err:
            if await self._ended(slot, err, "grammar"):
                return
            if err.code is ErrorCode.INVALID_ARGUMENT and err.reason == "INVALID_GRAMMAR":
                FuzzWorld.stats["grammar:refused"] += 1
            else:
                overflow = len(slot.tokens) + len(tokens) > self.capacity
                self._step_error("grammar", slot, err, overflow=overflow)
        else:
            raise AssertionError(f"the grammar {spec} was accepted")
        assert session.usage.n_past == len(slot.tokens), (
            f"{slot.sid}: a refused grammar left {session.usage.n_past} positions, not {len(slot.tokens)}")
        assert self.engine is not None and self.engine.health().ready, self.engine.health()

    @rule(sid=st.sampled_from(SLOTS), back=st.integers(1, 8), keep=st.integers(1, 8),
          grammar=st.integers(0, len(GRAMMARS) - 1), first=st.integers(3, 258), draw=DRAWS)
    def replay(self, sid: str, back: int, keep: int, grammar: int, first: int, draw: Draw | None) -> None:
        """Rewind ``back`` positions into the output of the slot's last grammar (a generate
        under ``grammar`` first, when it has none) and prefill ``keep`` of them again, under
        that grammar (from its start) and ``draw``'s penalties: a matcher and a penalty window
        that follow the rewind give the reference's token."""
        slot = self._pick(sid, "open")
        if slot is None:
            return
        if not 0 < slot.grammar_start < len(slot.tokens):
            prompt = None if slot.choice is not None else [first]
            run = StepRun("generate", back + 1, prompt)
            run.sent = resolve(slot, Draw(grammar=grammar), None if prompt is None else 1)
            self.loop.run(self._start_generate, slot, run)
            self.loop.run(self._finish, slot)
        if slot.state != "open" or not 0 < slot.grammar_start < len(slot.tokens):
            FuzzWorld.stats["replay:skipped"] += 1
            return
        draw = draw or Draw()  # (finite biases only with a grammar: rpc_fuzz_sampling._FINITE_BIAS)
        bias = tuple(p for p in draw.logit_bias if p[1] != -math.inf)
        draw = replace(draw, logit_bias=bias, grammar=slot.grammar, resume=True)
        self.loop.run(self._replay, slot, back, keep, draw)

    async def _replay(self, slot: SlotModel, back: int, keep: int, draw: Draw) -> None:
        session = slot.session
        assert session is not None
        position = max(len(slot.tokens) - back, slot.grammar_start)
        cut = slot.tokens[position:position + keep]
        try:
            assert await session.rewind(position) == position
        except ShardError as err:
            if await self._ended(slot, err, "replay"):
                return
            raise AssertionError(f"rewind: undocumented step error {err!r}") from None
        slot.tokens, slot.choice, slot.exact = slot.tokens[:position], None, True
        if await self._step(slot, "prefill", cut, draw) is not None:
            FuzzWorld.stats["replay"] += 1
