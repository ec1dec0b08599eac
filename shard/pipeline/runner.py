"""One hop of one generation: the steps the pipeline sends it (``HopRunner``).

``HopRunner`` drives a hop for one ``generate``: it sends each step, checks its result and logs
what it sent (``shard.pipeline.history``), so that when the worker fails the hop's failover
(``shard.pipeline.failover``) can move it to the next replica (``shard.pipeline.replicas``)
and replay the log there; its caller sees each step's result once, as if nothing had happened.
Why a class per hop rather than code in the pipeline: the client-relayed pipeline drives one
runner per hop, and a chain-relayed one drives the runner of the hop it talks to.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from shard.client import ClientSession
from shard.rpc import convert
from shard.rpc.errors import ErrorCode, ShardError
from shard.v1 import shard_pb2 as pb

from .errors import Hop, PipelineError
from .failover import HopFailover
from .gathering import Gatherer
from .generation import Generation, HopOutput, next_or_none
from .history import HopHistory
from .prefix import held_by
from .replay import RowLog, TokenLog
from .replicas import HopReplicas
from .route import ChainRoute

__all__ = ["HopRunner"]


class HopRunner:
    """One hop of one ``generate``: ``open``, then ``prefill_prompt`` (first hop) or
    ``prefill_rows``, ``decode``, and ``close``; on failure ``abort`` and ``release``. Every
    step call fails over by itself (``HopFailover.attempt``) and returns its result once."""

    def __init__(
        self, replicas: HopReplicas, gen: Generation, *, last: bool, route: ChainRoute | None = None
    ) -> None:
        self.gen = gen
        self.index = replicas.index
        self.first = self.index == 0
        #: With chain relay (``route``) ``last`` is True: the worker answers with the last
        #: shard's results.
        self.last = last
        self._replicas = replicas
        alternatives = len(replicas.replicas) > 1
        self.history = HopHistory(
            self.first, TokenLog(),  # the first hop's input (a few bytes a position)
            RowLog(gen.budget) if alternatives and not self.first else None,
        )
        self.tokens, self.rows = self.history.tokens, self.history.rows  # (the same logs)
        #: The prompt's token ids: the caller's, or a text's as the first shard tokenized it
        #: (``Prefill.echo_tokens``; None from a worker that does not echo them).
        self.prompt_ids: list[int] | None = None
        #: Prompt positions this hop took from its prefix cache (``StepResult.cached_tokens``).
        self.cached_tokens = 0
        #: Where the hop runs and how it moves; every step runs through its ``attempt``.
        self.failover = HopFailover(replicas, gen, self.history, route=route)
        # bound once, so a step reaches them in one call, as when they were the runner's
        self._attempt = self.failover.attempt
        self._gatherer: Gatherer | None = None  # the group-step gatherer this runner is in
        self._member = ""  # as which generation
        self._routed = route is not None
        self._timed = self.failover.timed

    @property
    def session(self) -> ClientSession | None:
        return self.failover.session

    @property
    def hop(self) -> Hop:
        return self.failover.hop

    # ---- steps ----------------------------------------------------------------------------

    async def open(self, *, ahead: bool = False) -> None:
        """Open the hop's session on the current replica (or the next that takes it);
        ``ahead``: without waiting for the answer where it can (``HopFailover.open``)."""
        await self.failover.open(ahead=ahead)

    def honours_cache_limit(self) -> bool:
        """The hop's worker takes ``Prefill.cache_limit`` (reports ``prefix_cache_limit``)."""
        caps = self.failover.replica.caps
        return caps is not None and caps.prefix_cache_limit

    def prefix_held(self) -> int | None:
        """What the hop's session (with chain relay: its route) holds of the prompt, as it
        answered the open's probe; None when it was not asked or cannot say."""
        session = self.session
        if session is None or not self.failover.probes(self.failover.replica):
            return None
        return held_by(self.failover.replica.caps, session.opened)

    async def prefill_prompt(
        self, prompt: str | Sequence[int], emit: Callable[[HopOutput], Awaitable[None]],
        cache_limit: int | None = None,
    ) -> None:
        """First hop: prefill the prompt in chunks (``Generation.chunk_tokens``; 0: in one
        step), ``emit`` each chunk's output once (after a failover the replacement computes
        the prompt again; what was emitted is not repeated). ``cache_limit``: the most
        positions it may take from its prefix cache (what every later hop holds,
        ``shard.pipeline.prefix``)."""
        text = prompt if isinstance(prompt, str) else None
        tokens = None if isinstance(prompt, str) else list(prompt)
        if tokens is not None:
            self.prompt_ids = tokens
        emitted = 0

        async def action(session: ClientSession) -> None:
            nonlocal emitted
            steps = session.prefill_chunks(
                tokens, text=text, chunk_tokens=self.gen.chunk_tokens,
                # a fork holds its source's prompt: written from 0, all but its last position
                # is reused (a fresh session appends at 0 all the same)
                position=0 if session.opened.n_past else None,
                sampling=self.gen.sampling, top_logprobs=self.gen.top_logprobs,
                echo_tokens=text is not None, parse_special=self.gen.parse_special,
                cache_limit=cache_limit,
            )
            while (step := await self._timed(lambda: next_or_none(steps))) is not None:
                if step.HasField("input_tokens"):
                    self.prompt_ids = list(step.input_tokens.ids)
                out = self._output(step, session)
                if step.n_past <= emitted:
                    continue  # already emitted before a failover
                if out.rows is not None and out.start < emitted:
                    out = HopOutput(step, emitted, out.rows[emitted - out.start:])
                emitted = step.n_past
                self.cached_tokens += step.cached_tokens
                await emit(out)

        await self._attempt(action)  # a replacement replays nothing: held stays 0 until here
        self.tokens.hold_prompt(prompt, emitted)
        self.history.held = emitted

    async def prefill_rows(
        self, position: int, rows: np.ndarray, ids: Sequence[int] | None = None,
        cache_limit: int | None = None,
    ) -> HopOutput:
        """Later hop: prefill boundary ``rows`` at ``position``, with the token ids of the
        positions from ``position`` on (``ids``: more than the rows when the hop before took
        the first ones from its prefix cache, which this hop must then hold too), taking at
        most ``cache_limit`` positions from its own cache."""
        lead = self._lead(rows, ids)
        out = await self._attempt(lambda s: self._step(s, lambda: s.prefill(
            hidden_states=rows, position=position, sampling=self.gen.sampling,
            top_logprobs=self.gen.top_logprobs, token_ids=ids, cache_limit=cache_limit,
        )))
        self.cached_tokens += out.step.cached_tokens
        if lead and self.rows is not None:
            self.rows.gap(lead)
        self._log_rows(rows, ids)
        return out

    def _lead(self, rows: np.ndarray, ids: Sequence[int] | None) -> int:
        """Positions sent as ids only; refused before sending to a hop without a prefix cache
        (a worker older than ``Prefill.token_ids`` would take the rows for those positions)."""
        lead = 0 if ids is None else len(ids) - int(rows.shape[0])
        reference = self._replicas.reference
        if lead and (reference is None or not reference.prefix_cache_tokens):
            raise ShardError(
                ErrorCode.ILLEGAL_TRANSITION,
                f"the hop before took {lead} positions from its prefix cache and this hop has "
                "none (serve --prefix-cache-tokens on every hop of a chain, or on none)",
                retryable=False, reason="PREFIX_NOT_CACHED")
        return lead

    async def verify(
        self, position: int, *, tokens: Sequence[int] | None = None,
        rows: np.ndarray | None = None, ids: Sequence[int] | None = None, score: bool = False,
    ) -> HopOutput:
        """A speculative step at ``position``: token ids (first hop) or boundary rows (later
        hops) written over whatever the session holds from there (the rejected drafts of the
        step before, on every hop alike). The last hop returns one ``Logits`` per position
        (``step.position_logits``, checked). ``score`` (a pass over the prompt,
        ``shard.pipeline.scoring``): every hop computes every position (no reuse, nothing from
        its prefix cache) and the last also returns the input's log-probs (checked)."""
        n = len(tokens) if tokens is not None else int(rows.shape[0])  # type: ignore[union-attr]
        lead = 0 if rows is None else self._lead(rows, ids)
        out = await self._attempt(lambda s: self._step(s, lambda: s.prefill(
            tokens, hidden_states=rows, position=position, sampling=self.gen.sampling,
            top_logprobs=self.gen.top_logprobs, all_logits=self.last or score, token_ids=ids,
            cache_limit=0 if score else None,
        )))
        got = len(out.step.position_logits), len(out.step.input_logprobs)
        if self.last and (got[0] != n or (score and got[1] != n - 1)):
            raise PipelineError(self.hop, ShardError(
                ErrorCode.INTERNAL, f"asked for the logits of {n} positions"
                f"{' and the log-probs of the inputs' if score else ''}, got {got[0]}"
                f"{f' and {got[1]}' if score else ''}",
            ))
        if tokens is not None:
            self.tokens.write(position, tokens)
        elif self.rows is not None and self.session is not None:
            self.rows.truncate(position)
            if lead:
                self.rows.gap(lead)
            self.rows.append(rows, self.session.hidden_dtype, ids)  # type: ignore[arg-type]
        return out

    async def decode(
        self, *, token: int | None = None, row: np.ndarray | None = None,
        token_id: int | None = None,
    ) -> HopOutput:
        """One position: a token id (first hop) or one boundary row (later hops; ``token_id``
        the id it stands for)."""
        gen = self.gen

        async def call(s: ClientSession) -> pb.StepResult:
            gatherer = self._gatherer_for(s)
            if gatherer is not None:  # the group's rows to this worker go as one message
                row_msg = s.decode_message(token, hidden_state=row, sampling=gen.sampling,
                                           top_logprobs=gen.top_logprobs, token_id=token_id)
                result = await gatherer.submit(gen.sid, s, row_msg)
                if result is not None:
                    return result
            return await s.decode(token, hidden_state=row, sampling=gen.sampling,
                                  top_logprobs=gen.top_logprobs, token_id=token_id)

        out = await self._attempt(lambda s: self._step(s, lambda: call(s)))
        if token is not None:
            self.tokens.append(token)
        elif row is not None:
            self._log_rows(row, None if token_id is None else (token_id,))
        return out

    async def generate(
        self, emit: Callable[[pb.StepResult], Awaitable[None]], *, max_tokens: int,
        stop_tokens: Sequence[int], ignore_eos: bool, fed: int | None = None,
    ) -> None:
        """Server-driven decoding from the last result on (a routed first hop: the workers
        loop, the client only reads); ``emit`` sees each step once, the last with its
        ``finish_reason``. ``fed``: the token of that last result, which the loop feeds first
        (each step's token is fed by the next; the log records what the session holds)."""
        feeding, emitted, runs = fed, 0, 0
        history, tokens = self.history, self.tokens

        async def action(session: ClientSession) -> None:
            nonlocal feeding, emitted, runs
            # After a failover the replay holds every position before the token to feed: feed
            # it explicitly (a sampled replay's own last choice may differ from it).
            prompt = [feeding] if runs and feeding is not None else None
            runs += 1
            steps = session.generate(
                prompt,
                max_tokens=max_tokens - emitted, sampling=self.gen.sampling,
                stop_tokens=stop_tokens, ignore_eos=ignore_eos,
                top_logprobs=self.gen.top_logprobs,
                # a drain yields the session between two tokens, to be moved to a replica
                yield_on_drain=self.failover.yields_on_drain(),
            )
            while (step := await self._timed(lambda: next_or_none(steps))) is not None:
                self._output(step, session)
                history.held = step.n_past
                if feeding is not None:
                    tokens.append(feeding)
                feeding = step.logits.token_id
                emitted += 1
                await emit(step)

        await self._attempt(action)

    def leave_group(self) -> None:
        """No more decodes from this runner: its group's messages stop waiting for it."""
        self._join(None)

    async def close(self) -> None:
        """Close the session (released; see ``HopFailover.close``)."""
        self._join(None)
        await self.failover.close()

    def abort(self) -> None:
        """Reset every stream this runner holds now (sync: the workers stop and release)."""
        self._join(None)
        self.failover.sessions.abort()

    async def release(self) -> None:
        """``Release`` on every replica where this runner may hold a session (never raises;
        the caller bounds and shields it)."""
        await self.failover.sessions.release()

    # ---- plumbing -------------------------------------------------------------------------

    def _gatherer_for(self, session: ClientSession) -> Gatherer | None:
        """Where this step's decode goes with the group's (None: on the session's stream);
        the runner is a member of one gatherer at a time (a failover may move it)."""
        groups = self.gen.groups
        found = None
        if groups is not None and not self._routed:  # (a chain's steps go on its route)
            found = groups.gatherer(session.client, self.gen.batch_group)  # type: ignore[arg-type]
        self._join(found, self.gen.sid)
        return found

    def _join(self, gatherer: Gatherer | None, member: str = "") -> None:
        if gatherer is not self._gatherer or member != self._member:
            if self._gatherer is not None:
                self._gatherer.leave(self._member)
            self._gatherer, self._member = gatherer, member

    async def _step(
        self, session: ClientSession, call: Callable[[], Awaitable[pb.StepResult]]
    ) -> HopOutput:
        step = await self._timed(call)
        out = self._output(step, session)
        self.history.held = step.n_past
        return out

    def _output(self, step: pb.StepResult, session: ClientSession) -> HopOutput:
        """Validate a result: logits from the last hop, well-formed rows from the others."""
        if self.last:
            if step.WhichOneof("output") != "logits":
                raise ShardError(ErrorCode.INTERNAL, "expected logits from the last shard")
            return HopOutput(step, step.n_past, None)
        if step.WhichOneof("output") != "hidden_states":
            raise ShardError(ErrorCode.INTERNAL, "expected hidden states from a non-last shard")
        reference = self._replicas.reference
        assert reference is not None
        rows = convert.tensor_to_array(
            step.hidden_states, reference.n_embd, session.session_id,
            dtype=session.hidden_dtype, rows=step.tokens_processed or None,
        )
        return HopOutput(step, step.n_past - rows.shape[0], rows)

    def _log_rows(self, rows: np.ndarray, ids: Sequence[int] | None) -> None:
        if self.rows is not None and self.session is not None:
            self.rows.append(rows, self.session.hidden_dtype, ids)
