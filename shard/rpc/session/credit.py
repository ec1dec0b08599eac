"""A stream's credit: the one owner of its counters (granted, taken, spent, given back).

Each result needs one credit, taken *before* the engine computes it and given back if the step
ends without a result, so a client that stops granting credit parks generation at once and at
most ``credit`` results are ever buffered. After CloseSession or a half-close the client can no
longer grant credit: from then on it is unlimited and only HTTP/2 flow control paces the stream.
"""

from __future__ import annotations

import sys

from trio_util import AsyncBool, AsyncValue


UNLIMITED_CREDIT = sys.maxsize


class Credit:
    """Credit of one stream. ``value`` and ``parked`` are observable (tests, the relay);
    only this object's methods move them."""

    __slots__ = ("value", "parked", "_max", "_taken", "_spent")

    def __init__(self, max_credit: int) -> None:
        self.value: AsyncValue[int] = AsyncValue(0)
        self.parked = AsyncBool(False)  # a step waits for credit
        self._max = max_credit
        # Credits the running step took and results it sent: the difference goes back.
        self._taken = self._spent = 0

    def open(self, initial: int) -> int:
        """The credit a session opens with (``initial`` 0: ``default``), bounded by the max."""
        self.value.value = credit = min(initial, self._max)
        return credit

    def grant(self, messages: int) -> None:
        """The client grants ``messages`` more (bounded by the max; nothing once unlimited)."""
        value = self.value.value
        if value != UNLIMITED_CREDIT:
            self.value.value = min(value + messages, self._max)

    def unlimited(self) -> None:
        """The client can no longer grant credit (CloseSession, half-close)."""
        self.value.value = UNLIMITED_CREDIT

    async def take(self) -> None:
        """Wait for one credit: a client that grants none parks the step before it computes.
        A credit the step takes and never spends on a result goes back when the step ends."""
        credit = self.value
        if credit.value <= 0:
            self.parked.value = True
            try:
                await credit.wait_value(lambda c: c > 0)
            finally:
                self.parked.value = False
        if credit.value != UNLIMITED_CREDIT:
            credit.value -= 1
        self._taken += 1

    def take_now(self) -> bool:
        """One credit if there is one, without waiting (an engine stream's next token)."""
        credit = self.value
        left = credit.value
        if left <= 0:
            return False
        if left != UNLIMITED_CREDIT:
            credit.value = left - 1
        self._taken += 1
        return True

    def spend(self) -> None:
        """A result was handed over (counted at once, even if the stream ends in the send)."""
        self._spent += 1

    def begin_step(self) -> None:
        self._taken = self._spent = 0

    def end_step(self) -> None:
        """The step ended: credits it took for results never sent go back."""
        self.parked.value = False
        unspent = self._taken - self._spent
        if unspent > 0:
            self.grant(unspent)
        self._taken = self._spent = 0
