"""The RPC fuzzer's prefix cache rules: a chat's next turn (a conversation released, then sent
again plus a tail on a fresh session), several live sessions forking one released prefix, and
rewinds that cut into a prefix taken from the cache. The worker's cache is small
(``FuzzWorld.cache_tokens``), so the other rules' releases evict entries under pressure.

Checked here and in ``FuzzWorld._absorb``: a prefill never takes from the cache more than a
released history shares with it (``FuzzWorld.cache_bound``), a fresh session sending the last
release's history takes at least what it shares (the cache kept it), and every result equals
the same history computed on a cacheless engine (the reference check). The invariant checks the
cache's budget and the sequence ids (tests/test_rpc_fuzz.py).
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import rule

from rpc_fuzz_model import SLOTS, FuzzWorld, SlotModel
from rpc_fuzz_sampling import DRAWS, Draw
from rpc_fuzz_steps import StepRules
from rpc_fuzz_streams import StreamRules

TAIL = st.lists(st.integers(3, 258), min_size=1, max_size=6)


class PrefixRules(StreamRules, StepRules):
    """Rules that resend released conversations and fork them."""

    @rule(sid=st.sampled_from(SLOTS), pick=st.integers(0, 7), tail=TAIL, grow=st.integers(0, 200),
          draw=DRAWS)
    def next_turn(self, sid: str, pick: int, tail: list[int], grow: int, draw: Draw | None) -> None:
        """The slot's conversation ends (released), and a fresh session sends a released
        history (its own, just released, for ``pick`` 0) plus ``tail`` and ``grow`` more
        tokens (long histories fill the cache's budget: entries are evicted for tokens, not
        only for their count), with ``draw``'s sampling (penalties see the cached ids)."""
        slot = self._pick(sid, "open")
        if slot is None:
            return
        tail = [*tail, *(3 + (i * 11 + grow) % 256 for i in range(grow))]
        self.loop.run(self._next_turn, slot, pick, tail, draw)

    @rule(pick=st.integers(0, 7), tails=st.lists(TAIL, min_size=len(SLOTS), max_size=len(SLOTS)))
    def fork(self, pick: int, tails: list[list[int]]) -> None:
        """Every slot's conversation ends, then each fresh session sends the same released
        history plus a tail of its own: live sessions forking one cache entry."""
        slots = [self._pick(sid, "open") for sid in SLOTS]
        for slot in slots:
            if slot is not None:
                self.loop.run(self._fresh, slot)
        history = self._history(pick)
        for slot, tail in zip(slots, tails, strict=True):
            if slot is not None:
                self.loop.run(self._send, slot, history, tail)
        FuzzWorld.stats["fork"] += 1

    @rule(sid=st.sampled_from(SLOTS), cut=st.integers(0, 99), share=st.integers(0, 3),
          extra=st.integers(8, 20))
    def rewind_into_prefix(self, sid: str, cut: int, share: int, extra: int) -> None:
        """A rewind to ``cut`` percent of the history (after a fork: inside the prefix the
        session took from the cache, which other sessions hold copies of) with a new
        continuation; the other sessions keep theirs (the invariant)."""
        slot = self._pick(sid, "open")
        if slot is None or not slot.tokens:
            return
        back = len(slot.tokens) - len(slot.tokens) * cut // 100
        self.loop.run(self._rewind, slot, back, share, extra, "plain", 0)
        FuzzWorld.stats["rewind_into_prefix"] += 1

    def _history(self, pick: int) -> list[int]:
        """A released history, the most recent for ``pick`` 0 ([] before any release)."""
        if not self.released:
            return []
        return list(self.released[-1 - pick % len(self.released)][0])

    async def _fresh(self, slot: SlotModel) -> None:
        """End the slot's conversation with a release and open an empty session in its place
        (no call deadline or step timeout: the next prefill must not fail)."""
        if slot.tokens or not slot.exact:
            await self._close(slot, False)
        if slot.state == "retained":  # the call deadline raced the close
            await self._release(slot)
        if slot.state in ("none", "retained"):
            await self._open(slot, None, None, "right", 0)

    async def _next_turn(self, slot: SlotModel, pick: int, tail: list[int], draw: Draw | None) -> None:
        await self._fresh(slot)
        await self._send(slot, self._history(pick), tail, draw)
        FuzzWorld.stats["next_turn"] += 1

    async def _send(self, slot: SlotModel, history: list[int], tail: list[int],
                    draw: Draw | None = None) -> None:
        """Prefill ``history`` + ``tail`` on the slot's fresh session (the history cut to fit
        the session); at least what the prompt shares with the last release comes from the
        cache."""
        if slot.state != "open" or slot.tokens or not slot.exact:
            FuzzWorld.stats["send:skipped"] += 1
            return
        prompt = [*history[: self.capacity - len(tail)], *tail]
        last = self.last_release
        shared = 0
        if last is not None:
            m = min(len(last), len(prompt) - 1)
            shared = next((i for i in range(m) if last[i] != prompt[i]), m)
        step = await self._step(slot, "prefill", prompt, draw)
        if step is None:
            return
        assert step.cached_tokens >= shared, (
            f"{slot.sid}: {step.cached_tokens} cached tokens, but the last release shares {shared}"
        )
        FuzzWorld.stats["send:cached" if step.cached_tokens else "send:computed"] += 1
