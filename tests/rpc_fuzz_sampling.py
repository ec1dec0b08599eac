"""The RPC fuzzer's sampling (issue 54): what a step is sent besides its tokens, and the rules
that need it. A step draws plain greedy, penalties (repeat/presence/frequency over a window,
``logit_bias`` that may forbid a token, ``min_p``, sometimes a seeded temperature) and/or one of
a small fixed set of grammars every fuzzed vocabulary can satisfy (bytes on the fake engine).

Both are pure functions of the session's token ids (docs/engine.md, "Determinism and sampling",
"Constrained decoding"), so the reference engine, which computes each history alone and
without a cache, must choose the same token after rewinds, resumes, cancels, cached prefills
and hand-offs; and a grammar's choice must be one its matcher allows after the history when the
history from the grammar's start is within it. A broken grammar spec is a step-level
``INVALID_ARGUMENT`` (reason ``INVALID_GRAMMAR``) that leaves the session as it was (the rules
that send one, or replay inside a grammar's output, are in rpc_fuzz_grammar.py).

A grammar starts (``grammar_start``) where the step's prompt ends when the message leaves it 0;
a step that continues the slot's grammar (a decode, a generate without a prompt, or a draw
that resumes) sends the start explicitly, as a client that remembers it does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from hypothesis import strategies as st

from shard.client import sampling
from shard.engine.types import SamplingParams
from shard.rpc import convert
from shard.v1 import shard_pb2 as pb

if TYPE_CHECKING:
    from rpc_fuzz_model import SlotModel

#: Grammars the byte vocabulary (and a real one) can satisfy: some end soon, some run on.
GRAMMARS = (
    ("json_object", ""),
    ("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'),
    ("gbnf", 'root ::= ("yes" | "no") "." [0-9]'),
    ("lark", 'start: NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'),
)
#: Specs that do not compile (or name no kind): refused before any work.
BROKEN = (
    ("gbnf", "root ::= (("),
    ("gbnf", "root ::= undefined"),
    ("lark", "start: ???"),
    ("json_schema", "{not json"),
    ("json_schema", "[1]"),
    ("regex", "a+"),
)


@dataclass(frozen=True)
class Draw:
    """The sampling a rule drew for a step: ``grammar`` indexes ``GRAMMARS`` (None: none);
    ``resume``: continue the slot's grammar from where it started (an explicit start)."""

    temperature: float = 0.0
    seed: int = 0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: int | None = None
    resume: bool = False


# (``st.builds``, not ``.map``: a mapped draw enters ``warnings.catch_warnings`` in the main
# thread, racing with the llama engine's worker thread that builds its grammar tokenizer under
# the same (shard/engine/llama.py): the warning it silences then fails the step under the
# suite's "error" filter. ``catch_warnings`` is not thread-safe.)
_PENALTIES = {
    "temperature": st.sampled_from([0.0, 0.0, 0.7]),
    "seed": st.integers(0, 3),
    "repeat_penalty": st.sampled_from([1.0, 1.3, 2.0, 0.8]),
    "presence_penalty": st.sampled_from([0.0, 0.5, 3.0, 30.0, -30.0]),
    "frequency_penalty": st.sampled_from([0.0, 0.4, 2.0, -4.0]),
    "penalty_last_n": st.sampled_from([64, -1, 4, 0]),
    "min_p": st.sampled_from([0.0, 0.05, 0.5]),
    "logit_bias": st.builds(tuple, st.lists(
        st.tuples(st.integers(3, 258), st.sampled_from([-math.inf, -4.0, 3.0, 30.0])),
        max_size=3, unique_by=lambda p: p[0])),
}
_GRAMMAR = {"grammar": st.integers(0, len(GRAMMARS) - 1), "resume": st.booleans()}
#: With a grammar, biases stay finite: a -inf bias on every token the grammar allows leaves
#: nothing to choose, and the engines then answer token 0 with logprob -inf (a known open
#: question of shard/engine: an error or an end of generation?), which the grammar check flags.
_FINITE_BIAS = {**_PENALTIES, "logit_bias": st.builds(tuple, st.lists(
    st.tuples(st.integers(3, 258), st.sampled_from([-4.0, 3.0, 30.0])),
    max_size=3, unique_by=lambda p: p[0]))}

#: A step's sampling: None (plain greedy), penalties, a grammar, or both. (Negative presence and
#: frequency penalties pull the choice to the window's ids, so a wrong window shows.)
DRAWS = st.one_of(
    st.none(),
    st.builds(Draw, **_PENALTIES),
    st.builds(Draw, **_GRAMMAR),
    st.builds(Draw, **_FINITE_BIAS, **_GRAMMAR),
)


@dataclass(frozen=True)
class Sent:
    """A draw as sent for one step: the message, and the parameters it means on the worker
    (its grammar's start resolved), which the reference and the grammar check use."""

    msg: pb.SamplingParams
    params: SamplingParams


def resolve(slot: SlotModel, draw: Draw | None, prompt: int | None) -> Sent | None:
    """``draw`` for a step on ``slot`` appending ``prompt`` tokens at its end (None: a decode or
    a generate that continues); records the grammar's start in ``slot.grammar_start``."""
    if draw is None:
        return None
    kind, text = GRAMMARS[draw.grammar] if draw.grammar is not None else ("", "")
    msg = sampling(
        draw.temperature, seed=draw.seed, min_p=draw.min_p, repeat_penalty=draw.repeat_penalty,
        presence_penalty=draw.presence_penalty, frequency_penalty=draw.frequency_penalty,
        penalty_last_n=draw.penalty_last_n, logit_bias=dict(draw.logit_bias),
        grammar_kind=kind, grammar=text)
    start = 0
    if kind:
        if draw.resume and slot.grammar_start:
            start = msg.grammar_start = slot.grammar_start
        elif prompt is not None:  # the worker's default: where the prompt ends
            start = len(slot.tokens) + prompt
        else:  # the decoded token is the prompt
            start = msg.grammar_start = len(slot.tokens) + 1
        slot.grammar_start, slot.grammar = start, draw.grammar
    return Sent(msg, convert.sampling_from_proto(msg, slot.sid, start))


def grammar_allows(book: object, params: SamplingParams, history: list[int], choice: int) -> bool | None:
    """Whether ``params``' grammar allows ``choice`` after ``history``; None when it does not
    constrain that choice (a position before its start, a history that left the grammar, or a
    grammar that allows nothing more). ``book``: the worker engine's ``GrammarBook``, for a
    fresh matcher of the spec (compiled already by the step)."""
    spec = params.grammar
    if spec is None or len(history) < spec.start:
        return None
    matcher = book.compile(spec)  # type: ignore[attr-defined]
    rest = history[spec.start:]
    if matcher.try_consume_tokens(rest) < len(rest) or matcher.is_error():
        return None
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    allowed = np.unpackbits(bits, bitorder="little")
    if not allowed.any():
        return None
    return choice < allowed.shape[0] and bool(allowed[choice])
