"""One ``Session`` stream: an explicit state machine running in its own nursery.

State machine (``Phase``)::

    AWAITING_OPEN --OpenSession--> IDLE --Prefill/Decode/Generate/Rewind--> RUNNING --done--> IDLE
    IDLE|RUNNING --CloseSession / half-close--> CLOSING --running step done--> CLOSED
    any --fatal error / deadline / end(reason)--> CLOSED

Anything else is a protocol violation and ends the stream with ILLEGAL_TRANSITION (a message
before OpenSession, a second OpenSession, a step while a step runs, anything after
CloseSession; the one exception is a session opened with a filled-in ``route.return_to``,
where one step may queue behind the running one, see ``shard.relay``). Request-level
problems (bad token ids, wrong hidden-state shape or dtype, a full KV budget, a step deadline,
an out-of-band Cancel) are *step-level*: reported in-stream as ``SessionResponse.error`` and the
session stays usable. Every Prefill/Decode/Generate/Rewind is answered by zero or more
``StepResult``, an optional ``Error``, then exactly one ``Usage``.

One module per concept:

- ``call``: ``SessionCall``, the stream's task tree, phase, dispatch, a request's end;
- ``credit``: the credit counters (grant, take, spend, give back);
- ``cancellation``: the Cancel region of a step;
- ``outbox``: responses, their numbering and chunking;
- ``lifecycle``: open (fresh, resumed, routed), close, release or retain (the call's);
- ``inputs``: checks of input before any engine work (pure functions);
- ``context``: ``StepContext``, the session as its steps see it (``StepHost``): engine
  calls, resync, tokenize, sending results; the relay's routed steps get it too;
- ``steps``: the plain steps; ``generation``: the one generation loop (its stop decisions
  and counters), run by the plain steps and by a routed session with its own step source;
- ``transfer``: state export/import; ``protocols``: the registry's and the relay's seams.

Positions: what the session holds lives in one object (``StepContext.positions``,
``Positions``; a routed session's is its relay's ``ChainLedger``), moved only by its event
methods. If the stream ends first, a retained session resumes from what was handed to the
transport (``positions.delivered``).

Chain relay: a session opened with a route is served by a ``Routed`` object the worker's relay
(``serve(relay=...)``, ``shard.relay``) opens; this package only dispatches to it through the
``Relay``/``Routed`` protocols and gives it the step API of ``StepHost``, so the relay never
touches the stream's internals.

Deadlines: the task's cancel scope carries the call deadline (``grpc-timeout``); expiry releases
the session and ends the stream with DEADLINE_EXCEEDED. ``OpenSession.step_timeout_ms`` bounds
each engine call; expiry is a step-level DEADLINE_EXCEEDED (the engine rolls the step back).
"""

from __future__ import annotations

from .call import SessionCall
from .credit import UNLIMITED_CREDIT
from .generation import Generation, StepSource, count_generated, count_prefill, generate, stop_rules
from .inputs import cache_limit
from .limits import LOOKAHEAD_MODES, MAX_SESSION_ID_BYTES, SessionLimits
from .outbox import Responses
from .phase import Phase, StreamEnd
from .protocols import (
    NOT_ALLOWED,
    Relay,
    Retained,
    Returner,
    Routed,
    SessionHost,
    StepHost,
    return_refused,
)

__all__ = [
    "LOOKAHEAD_MODES",
    "MAX_SESSION_ID_BYTES",
    "NOT_ALLOWED",
    "Generation",
    "Phase",
    "Relay",
    "Responses",
    "Retained",
    "Returner",
    "Routed",
    "SessionCall",
    "SessionHost",
    "SessionLimits",
    "StepHost",
    "StepSource",
    "StreamEnd",
    "UNLIMITED_CREDIT",
    "cache_limit",
    "count_generated",
    "count_prefill",
    "generate",
    "return_refused",
    "stop_rules",
]
