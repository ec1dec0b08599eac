"""Chain relay's direct return, the first hop's side: where results handed over by ``Return`` land.

In a relayed ``Generate`` each token's result travels from the last hop back up every hop to the
first, which needs only the token to start its next step. With a direct return
(``Route.return_to``) the last hop also sends the result straight to the first hop (the
``Return`` RPC), and the first hop starts the next step with whichever copy arrives first. Why
keep the chain's answer at all: it stays the authority (it carries the step's errors, the
downstream's ``Usage`` and the order of steps), so a direct copy is only ever a head start and a
lost, late or forged one costs time, never tokens: each is checked against the chain's answer.

``Slot`` is one tagged step in flight; ``DirectReturns`` holds a session's slots and its secret.
The address handed down the route is the first hop's own, as its operator configured it
(``serve --advertise``), never one a caller names.
"""

from __future__ import annotations

import hmac
import secrets

import trio

from shard.v1 import shard_pb2 as pb

from shard.rpc.errors import ShardError
from shard.rpc.session import return_refused

__all__ = ["DirectReturns", "Slot"]

#: Bytes of a return address's secret (a forged ``Return`` must guess them).
SECRET_BYTES = 16


class Slot:
    """One step sent downstream with a relay tag: its direct copy, its chain answer, and events
    for the first of them and for the chain's."""

    def __init__(self, tag: int, start: int) -> None:
        self.tag = tag
        self.start = start  # the position the step computes
        self.direct: pb.StepResult | None = None
        self.chain: pb.StepResult | None = None
        self.chain_error: ShardError | None = None
        self.first = trio.Event()  # either copy (or the chain's error) arrived
        self.answered = trio.Event()  # the chain's answer (or error) arrived

    def offer_direct(self, step: pb.StepResult) -> bool:
        if self.direct is not None or self.answered.is_set():
            return False  # the chain answered first: nothing waits for this copy
        self.direct = step
        self.first.set()
        return True

    def answer(self, step: pb.StepResult | None, error: ShardError | None) -> None:
        self.chain, self.chain_error = step, error
        self.answered.set()
        self.first.set()

    @property
    def used(self) -> pb.StepResult | None:
        """The copy the step went on with (the direct one if it came first)."""
        return self.direct if self.direct is not None else self.chain


class DirectReturns:
    """A routed first hop's return address: its secret and the slots waiting for a ``Return``."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self._slots: dict[int, Slot] = {}
        self._tag = 0
        self.accepted = 0  # direct copies used before the chain's (observers, tests)

    def expect(self, start: int) -> Slot:
        """A slot with a fresh tag for the next step sent downstream."""
        self._tag += 1
        slot = Slot(self._tag, start)
        self._slots[slot.tag] = slot
        return slot

    def forget(self, slot: Slot) -> None:
        self._slots.pop(slot.tag, None)

    def offer(self, secret: bytes, tag: int, step: pb.StepResult) -> bool:
        """A ``Return``: True if a step waited for it. A wrong secret gets the answer an
        unknown session gets (``return_refused``)."""
        if not hmac.compare_digest(secret, self.secret):
            raise return_refused(self.session_id)
        slot = self._slots.get(tag)
        if slot is None or step.WhichOneof("output") != "logits":
            return False
        accepted = slot.offer_direct(step)
        self.accepted += accepted
        return accepted

    def address(self, target: str) -> pb.ReturnAddress:
        return pb.ReturnAddress(target=target, session_id=self.session_id, secret=self.secret)
