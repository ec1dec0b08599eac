"""Constrained decoding: the grammar a last shard masks its choice with (docs/engine.md,
"Constrained decoding").

Why llguidance (the library llama.cpp and vLLM use) and not a matcher of our own: JSON schema,
GBNF and Lark are large languages, and a token mask over a 50k vocabulary has to be computed
in well under a step's time; a maintained library does both.

What is owned here: compiling a ``GrammarSpec`` against the engine's vocabulary (once per
distinct spec, in a worker thread, kept in a bounded cache) and each session's matcher. A
matcher's state is a pure function of the session's tokens from the grammar's start on, so it
is never sent anywhere: before each choice it is brought to the session's history (rolled back
to the common prefix, then advanced), which follows rewinds, resumes, replays, hand-offs and
verified drafts alike. No llguidance type leaves this module but as an opaque object.

A tick's rows are masked together (``GrammarBook.mask_tick``): where an engine finishes a
tick, the matchers of its constrained one-row steps are brought to their histories and their
masks filled by one parallel call of the library into one bitmask; each session keeps its
row, and building the result uses it when the matcher has not moved since. A mask not
computed there (a step of several rows, a matcher made after the tick) is computed alone, by
the same rules, so the tokens never depend on which path masked them.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from .errors import InvalidGrammar, InvalidInput
from .plans import ComputePlan
from .slots import Slot
from .types import GrammarSpec

try:  # the grammar library is a dependency, but an engine still loads without it
    import llguidance
    import llguidance.numpy as llg_numpy
except ImportError:  # pragma: no cover - the project's dependencies include it
    llguidance = llg_numpy = None

#: The JSON output llguidance emits: no free whitespace (a small model may otherwise write
#: newlines forever where JSON allows them), separators as OpenAI's models write them.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: Distinct compiled grammars kept per engine (least recently used dropped first).
CACHE_GRAMMARS = 64

_executor: object | None = None  # the library's pool of mask threads, one per process
_executor_lock = threading.Lock()


def _pool() -> object:
    """The library's executor (made on first use): its threads fill a tick's masks in parallel."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        return _executor


def available() -> bool:
    """Whether constrained decoding can run here (the grammar library imports)."""
    return llguidance is not None


def tokenizer_from_pieces(pieces: Sequence[bytes], eos: Sequence[int], special: Sequence[int],
                          tokenize: Callable[[bytes], list[int]]) -> object:
    """The grammar library's tokenizer over a vocabulary given as each token's bytes (the fake
    engine's; the llama engine builds its own from llama.cpp's vocabulary). ``special`` ids are
    never produced by a grammar (only ``eos``, when the grammar is complete)."""
    marked = list(pieces)
    for i in special:
        marked[i] = b"\xff" + marked[i]

    class _Vocab:
        eos_token_id = eos[0]
        bos_token_id = None
        tokens = marked
        special_token_ids = list(special)

        def __call__(self, text: bytes) -> list[int]:
            return tokenize(text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab()), eos_token=list(eos))


def _grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of ``spec``; InvalidInput naming the grammar when it is not one."""
    kind = spec.kind
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, _JSON_OPTIONS)
        if kind == "json_schema":
            schema = json.loads(spec.text)
            if not isinstance(schema, dict):
                raise InvalidGrammar("grammar (json_schema): the schema must be a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, _JSON_OPTIONS)
        if kind == "gbnf":
            return llguidance.grammar_from("gbnf", spec.text)
        return llguidance.LLMatcher.grammar_from_lark(spec.text)
    except (ValueError, TypeError) as exc:  # (json.JSONDecodeError is a ValueError)
        raise InvalidGrammar(f"grammar ({kind}) does not compile: {exc}") from exc


class GrammarBook:
    """One engine's compiled grammars and the tokenizer they are compiled against.

    ``make_tokenizer`` (the engine's hook) runs once, in the first ``compile``'s thread; the
    cache is shared by the event loop and those threads, hence the lock.
    """

    def __init__(self, make_tokenizer: Callable[[], object]) -> None:
        self._make_tokenizer = make_tokenizer
        self._tokenizer: object | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return (spec.kind, spec.text) in self._cache

    def compile(self, spec: GrammarSpec) -> object:
        """A fresh matcher of ``spec`` (a copy of the cached one; compiled on a miss, which may
        take a while: call it from a worker thread). InvalidInput naming the grammar when it
        does not compile."""
        key = (spec.kind, spec.text)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template.deep_copy()
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            tokenizer = self._tokenizer
        grammar = _grammar_text(spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidGrammar(f"grammar ({spec.kind}) does not compile: {error}")
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidGrammar(f"grammar ({spec.kind}) does not compile: {template.get_error()}")
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > CACHE_GRAMMARS:
                self._cache.popitem(last=False)
        return template.deep_copy()

    def constrain(self, slot: Slot, plan: ComputePlan, spec: GrammarSpec
                  ) -> Callable[[int, np.ndarray], np.ndarray] | None:
        """The mask of a step's rows under ``spec`` (``results.step_outputs``; None: the
        session's ids are unknown). The session's matcher (``slot.grammar``; a new one when
        it was of another spec, compiled here if the cache dropped it since the step's
        ``compile``) is brought to the history this step commits, row by row."""
        ids = plan.tokens if plan.tokens is not None else plan.token_ids
        history = pending_history(slot.tokens, plan.keep, plan.cached_ids, ids)
        if history is None:
            return None
        state = slot.grammar
        if not isinstance(state, SessionGrammar) or state.spec != spec:
            state = slot.grammar = SessionGrammar(spec, self.compile(spec))

        def constrain(n_past: int, row: np.ndarray) -> np.ndarray:
            if n_past < spec.start or not state.follow(history, n_past):
                return row  # a prompt's position, or after a token the grammar refused
            return state.mask(row)

        return constrain

    def attach(self, slot: Slot, spec: GrammarSpec | None) -> None:
        """Give the session the matcher of the operation about to run (``spec``; None: an
        unconstrained one), so that its tick masks it with the others (``mask_tick``). Never
        compiles: a spec the cache dropped gets its matcher when the result is built."""
        state = slot.grammar
        if spec is None:
            slot.grammar = None
        elif not isinstance(state, SessionGrammar) or state.spec != spec:
            key = (spec.kind, spec.text)
            with self._lock:
                template = self._cache.get(key)
                fresh = None if template is None else template.deep_copy()
            slot.grammar = None if fresh is None else SessionGrammar(spec, fresh)

    def mask_tick(self, steps: Iterable[tuple[Slot, ComputePlan]], n_vocab: int) -> int:
        """Mask together the next token of a tick's finished one-row steps (any thread; the
        sessions must be running them, so nothing else touches their matchers): each
        constrained session's matcher is brought to the history its step commits and keeps
        the mask of its row (``SessionGrammar.mask`` then uses it). Returns the masks filled."""
        ready: list[tuple[SessionGrammar, list[int], int]] = []
        for slot, plan in steps:
            state = slot.grammar
            if not isinstance(state, SessionGrammar) or (plan.all_logits and plan.n_new > 1):
                continue
            n_past = plan.keep + plan.n_new
            ids = plan.tokens if plan.tokens is not None else plan.token_ids
            history = pending_history(slot.tokens, plan.keep, plan.cached_ids, ids)
            if history is not None and n_past >= state.spec.start:
                ready.append((state, history, n_past))
        if not ready:
            return 0
        return mask_together(ready, n_vocab, getattr(self._tokenizer, "vocab_size", n_vocab))


def mask_together(entries: Sequence[tuple[SessionGrammar, Sequence[int], int]],
                  n_vocab: int, grammar_vocab: int) -> int:
    """Bring each ``(state, history, n_past)`` matcher to ``history[start:n_past]`` and fill
    the masks of those the grammar still follows in one parallel call into one bitmask (of
    the grammar's ``grammar_vocab`` tokens); each state keeps its row of ``n_vocab`` allowed
    flags for its next ``mask``, as ``mask`` would compute it alone. Returns the masks filled."""
    live = [state for state, history, n_past in entries if state.follow(history, n_past)]
    if not live:
        return 0
    # (zeros: ids past the grammar's vocabulary, if rows have more, are refused, as in ``mask``)
    bitmask = np.zeros((len(live), (max(n_vocab, grammar_vocab) + 31) // 32), dtype=np.int32)
    llg_numpy.fill_next_token_bitmask_par(
        _pool(), [(state._matcher, i) for i, state in enumerate(live)], bitmask)
    # (the bytes of each row are the library's bitmask: little-endian 32-bit words)
    allowed = np.unpackbits(bitmask.astype("<i4", copy=False).view(np.uint8), axis=1,
                            bitorder="little", count=n_vocab).view(bool)
    for state, row in zip(live, allowed):
        state._ready, state._ready_at = row, state._moves
    return len(live)


class SessionGrammar:
    """One session's matcher: it has consumed ``consumed``, the session's tokens from
    ``spec.start`` on, up to the first one the grammar refused (a token its caller forced)."""

    __slots__ = ("spec", "_matcher", "_fresh", "_consumed", "_moves", "_ready", "_ready_at")

    def __init__(self, spec: GrammarSpec, matcher: object) -> None:
        self.spec = spec
        self._fresh = matcher  # never advanced: what a failed rollback starts again from
        self._matcher = matcher.deep_copy()
        self._consumed: list[int] = []
        self._moves = 0  # counts the matcher's changes of state
        #: The next token's allowed flags, filled with a tick's others (``mask_together``)
        #: when the matcher had made ``_ready_at`` moves; stale once it moved since.
        self._ready: np.ndarray | None = None
        self._ready_at = -1

    def follow(self, history: Sequence[int], n_past: int) -> bool:
        """Bring the matcher to the session's tokens ``[start, n_past)``; False when one of
        them is outside the grammar (the choice after it is then not constrained)."""
        want = history[self.spec.start:n_past]
        have = self._consumed
        if len(have) <= len(want) and want[:len(have)] == have:  # (the usual case, in C)
            common = len(have)
        else:
            common = 0
            limit = min(len(have), len(want))
            while common < limit and have[common] == want[common]:
                common += 1
        if common < len(have):
            self._moves += 1
            if not self._matcher.rollback(len(have) - common):
                self._matcher, common = self._fresh.deep_copy(), 0
            del have[common:]
        rest = list(want[common:])
        if rest:
            self._moves += 1
            taken = self._matcher.try_consume_tokens(rest)
            have.extend(rest[:taken])
            if taken < len(rest):
                return False
        return not self._matcher.is_error()

    def mask(self, row: np.ndarray) -> np.ndarray:
        """``row`` with every token the grammar does not allow next at -inf (a copy); ``row``
        itself when the grammar allows nothing (a matcher in error: unconstrained). The flags
        its tick filled are used when the matcher has not moved since."""
        allowed, self._ready = self._ready, None
        if allowed is None or self._ready_at != self._moves or allowed.shape[0] != row.shape[0]:
            bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
            # (ids past the grammar's vocabulary, if the row has more, come out as zeros: refused)
            allowed = np.unpackbits(bits, bitorder="little", count=row.shape[0]).view(bool)
        if not allowed.any():
            return row
        return np.where(allowed, row, row.dtype.type(-np.inf))


def check_history(slot: Slot, plan: ComputePlan) -> None:
    """A last shard constrains a session only when it knows the session's token ids."""
    if slot.tokens is None or (plan.tokens is None and plan.token_ids is None):
        raise InvalidInput("grammar needs the token ids of the session's history at the last "
                           "shard (Prefill.token_ids, Decode.token_id)", session_id=slot.session_id)


def pending_history(tokens: list[int] | None, keep: int, cached: Sequence[int],
                    ids: Sequence[int] | None) -> list[int] | None:
    """The session's token history once a step keeping ``[0, keep)`` (its last ``cached``
    copied from the prefix cache) and adding ``ids`` is committed; None when it is unknown."""
    if tokens is None or ids is None:
        return None
    return [*tokens[: keep - len(cached)], *cached, *ids]


__all__ = ["CACHE_GRAMMARS", "GrammarBook", "SessionGrammar", "available", "check_history",
           "mask_together", "pending_history", "tokenizer_from_pieces"]
