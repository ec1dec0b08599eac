"""Drive a chain of shard workers as one model: the pipeline client.

Quick start::

    async with Pipeline.connect(["10.0.0.1:50051", "10.0.0.2:50051"], timeout=60) as pipe:
        result = await pipe.generate("hello", max_tokens=32)
        print(result.tokens)

Why a library call of its own (not a router): a router adds placement, retries and billing;
this is the smallest correct chain, used by ``trio-shard generate --pipeline``, the tests and
the bench, and a reference for routers. What it guarantees:

* **Compatibility first.** ``connect`` reads every worker's capabilities and refuses the chain
  unless all report the same ``model_fingerprint``, ``n_layers_total`` and ``n_embd`` and their
  layer ranges tile ``[0, n_layers_total)`` in order, without gap or overlap. Each session is then
  opened with ``expected_model_fingerprint`` and ``expected_layer_range``, so a worker swapped in
  between is refused by the worker itself (INCOMPATIBLE_MODEL).
* **One session per shard**, ids ``<id>.<hop>``. Hidden states travel in float32, or float16 on
  the hops whose worker offers it when the caller asks for it (``hidden_dtype``); the client
  validates every tensor it receives (dtype, shape, rows, finite) before forwarding it.
* **Pipelined prefill.** The first shard computes the prompt ``chunk_tokens`` positions at a time
  and streams each chunk's boundary (``Prefill.chunk_tokens``); one Trio task per later hop
  forwards chunk ``i`` to its shard while the shard before it computes chunk ``i+1``. Hops are
  connected by memory channels of capacity 1, so at most one chunk waits per hop.
* **Decoding** sends each chosen token through the chain; the last shard samples (its
  ``Logits.token_id`` is the token), with the same stop rules as the worker's ``Generate``, so the
  result equals a whole-model worker's ``Generate`` token for token.
* **Deadlines.** The caller's deadline is absolute and bounds the whole ``generate`` (one Trio
  deadline scope): every hop's session stream is opened with the time left, rounded *down*, as its
  ``grpc-timeout`` (the worker releases the session when it expires, the client resets the
  stream), so no hop's deadline falls after the caller's.
* **Failure semantics.** A failure, a deadline or a cancellation at any hop resets every hop's
  stream and then calls ``Release`` on every shard (shielded), through a new connection where
  the old one was lost (a live worker retains a session whose connection dropped), so no live
  shard keeps a session or KV cells. The cleanup takes at most ``RELEASE_TIMEOUT`` seconds and
  never ends later than ``CLEANUP_GRACE`` seconds after the caller's deadline. The error raised
  is a ``PipelineError`` (a ``ShardError``) that names the failing hop: index, target and layer
  range, and for a hop with replicas every replica tried.
* **Replicas and failover.** A hop may list replicas (``connect([a, [b1, b2], c])``, CLI
  ``a,b1|b2,c``): workers of the same model and range (checked). When the serving one is lost,
  unavailable, draining or silent for ``step_timeout``, the hop moves to the next replica, which
  replays the hop's history (kept by ``shard.pipeline.runner``/``shard.pipeline.replay``: token
  ids for the first hop, boundary rows for the others, bounded by ``replay_bytes``), so the generation goes on
  where it stopped: the same greedy tokens, each seen once by the caller. A draining worker
  hands over at the next step without any error. ``PipelineResult.failovers`` says what moved.
* **Chain relay** (``relay="chain"``, ``shard.pipeline.chain``): the client opens only the first hop, with
  the route of the others; each worker forwards its boundary to the next and the last shard's
  results come back up the chain, and decoding runs as a ``Generate`` on the first hop, so a
  token costs no round trip to the client. Needs ``relay_allowed`` on every hop but the last;
  replicas fail over (the client moves the route to a failed hop's replica and replays the
  token log through the first hop).
"""

from __future__ import annotations

import inspect
import secrets
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager, nullcontext
from functools import partial
from typing import Any

import numpy as np
import trio

from shard.client import ShardClient, sampling
from shard.deadlines import HOP_DEADLINE_MARGIN, absolute_deadline
from shard.rpc import convert
from shard.rpc.errors import ErrorCode, ShardError, unwrap_single_exception
from shard.stops import StopRules
from shard.v1 import shard_pb2 as pb

from . import chain
from .drafting import Drafter, PromptLookup
from .speculation import DraftPlanner, PassCost
from .errors import Blame, Blames, Hop, PipelineError
from .groups import BatchGroups, default_groups
from .replay import DEFAULT_REPLAY_BYTES, ReplayBudget
from .replicas import HopReplicas, Replica
from .result import PipelineResult
from .runner import (
    CLEANUP_GRACE,
    RELEASE_TIMEOUT,
    Failover,
    Generation,
    HopOutput,
    HopRunner,
    release_session,
)

__all__ = [
    "CLEANUP_GRACE",
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_REPLAY_BYTES",
    "HOP_DEADLINE_MARGIN",
    "RELAY_MODES",
    "RELEASE_TIMEOUT",
    "Failover",
    "Hop",
    "Pipeline",
    "PipelineError",
    "PipelineResult",
    "check_chain",
    "hop_targets",
]

DEFAULT_CHUNK_TOKENS = 32
RELAY_MODES = ("client", "chain")
_DEFAULT: Any = object()

OnToken = Callable[[pb.StepResult], "Awaitable[None] | None"]


def _incompatible(hop: Hop, message: str) -> PipelineError:
    return PipelineError(hop, ShardError(ErrorCode.INCOMPATIBLE_MODEL, message))


def check_chain(hops: Sequence[Hop]) -> None:
    """Refuse a chain whose shards are not one model cut into consecutive ranges."""
    if not hops:
        raise ValueError("a pipeline needs at least one worker")
    first = hops[0].caps
    assert first is not None
    end = 0
    for hop in hops:
        caps = hop.caps
        assert caps is not None
        if caps.model_fingerprint != first.model_fingerprint:
            raise _incompatible(
                hop, f"serves model {caps.model_fingerprint}, hop 0 serves {first.model_fingerprint}"
            )
        if (caps.n_layers_total, caps.n_embd) != (first.n_layers_total, first.n_embd):
            raise _incompatible(hop, "n_layers_total / n_embd differ from hop 0's")
        start, stop = caps.layer_range.start, caps.layer_range.end
        if stop <= start:
            raise _incompatible(hop, f"reports the empty layer range [{start}, {stop})")
        if start != end:
            what = "a gap" if start > end else "an overlap"
            raise _incompatible(
                hop, f"starts at layer {start} but the previous hops end at {end} ({what})"
            )
        end = stop
    if end != first.n_layers_total:
        raise _incompatible(hops[-1], f"the chain ends at layer {end} of {first.n_layers_total}")


def hop_targets(targets: Sequence[str | Sequence[str]]) -> list[list[str]]:
    """Every hop's targets (a str: one worker; a sequence: the worker and its replicas, tried
    in order); a ValueError for an empty chain, an empty hop or a target listed twice."""
    hops = [[t] if isinstance(t, str) else list(t) for t in targets]
    if not hops:
        raise ValueError("a pipeline needs at least one worker")
    seen: set[str] = set()
    for i, hop in enumerate(hops):
        if not hop or not all(hop):
            raise ValueError(f"hop {i} names no worker")
        for target in hop:
            if target in seen:
                raise ValueError(f"{target} is listed twice (a worker serves one hop)")
            seen.add(target)
    return hops


class Pipeline:
    """Connections to every shard of a checked chain. Create with ``Pipeline.connect``."""

    def __init__(
        self,
        hops: list[list[str]],
        connect: Callable[[str, float | None], Awaitable[ShardClient]],
        *,
        timeout: float | None,
        hidden_dtype: str,
        ssl_context: ssl.SSLContext | None = None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
        step_timeout: float | None = None,
        replay_bytes: int | None = DEFAULT_REPLAY_BYTES,
        relay: str = "client",
        batch_groups: int | None = None,
        step_replicas: bool = True,
        handoff: bool = True,
    ) -> None:
        self._replicas = [HopReplicas(i, targets, connect) for i, targets in enumerate(hops)]
        #: A whole-model hop with replicas: the client steps each token (True), so that a
        #: draining worker hands over between tokens; or the worker decodes in its own loop
        #: like a lone worker (False: a pool's replicas; a failure still fails over, by replay).
        self.step_replicas = step_replicas
        #: Concurrent generations move through the hops in these groups (shard.pipeline.groups).
        self.batch_groups = BatchGroups(
            default_groups(len(hops)) if batch_groups is None else batch_groups)
        self.relay = relay
        self.timeout = timeout
        self.hidden_dtype = hidden_dtype
        self.step_timeout = step_timeout
        self.replay_bytes = replay_bytes
        #: On a drain, move each session's state to the replica (session hand-off) where both
        #: workers can; False: always replay the history there (shard.pipeline.runner).
        self.handoff = handoff
        self._ssl_context = ssl_context  # to reconnect for a Release (see ``release_session``)
        self._metadata = tuple(metadata)
        # What a pass through this chain costs, learned across generations (speculation drafts
        # only as many tokens as pay for their rows; shard.pipeline.speculation).
        self.pass_cost = PassCost()

    @classmethod
    def of_known(
        cls,
        hops: Sequence[Sequence[tuple[str, ShardClient | None, pb.GetCapabilitiesResponse]]],
        connect: Callable[[str, float | None], Awaitable[ShardClient]],
        **options: Any,
    ) -> Pipeline:
        """A pipeline over workers whose connections and capabilities the caller already holds
        (a pool: ``shard.pool``): each hop a list of (target, client, capabilities), the first
        one serving; ``connect(target, timeout)`` gives a usable connection to a target again
        (the caller owns them all). Checked as ``connect`` checks a chain (PipelineError);
        ``options``: ``Pipeline.connect``'s keywords but ``targets``, ``wait_for_ready``."""
        options.setdefault("timeout", None)
        options.setdefault("hidden_dtype", convert.HIDDEN_DTYPE)
        pipe = cls(hop_targets([[t for t, _, _ in hop] for hop in hops]), connect, **options)
        for replicas, known in zip(pipe._replicas, hops):
            for replica, (_, client, caps) in zip(replicas.replicas, known):
                replica.client, replica.caps = client, caps
            replicas.reference = replicas.replica.caps
        check_chain(pipe.hops)
        for replicas in pipe._replicas:
            replicas.check_alternatives()
        if pipe.relay == "chain":
            chain.check_relay_allowed(pipe.hops)
            chain.set_aside_non_relaying(pipe._replicas)
        return pipe

    @property
    def hops(self) -> list[Hop]:
        """Every hop as the replica serving it now describes itself."""
        return [r.hop() for r in self._replicas]

    @property
    def replicas(self) -> list[list[Replica]]:
        """Every hop's replicas, in the order given (the serving one is ``hops[i].target``)."""
        return [list(r.replicas) for r in self._replicas]

    @property
    def _clients(self) -> list[ShardClient]:
        clients = [r.replica.client for r in self._replicas]
        assert all(c is not None for c in clients)
        return clients  # type: ignore[return-value]

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        targets: Sequence[str | Sequence[str]],
        *,
        timeout: float | None = 30.0,
        hidden_dtype: str = convert.HIDDEN_DTYPE,
        ssl_context: ssl.SSLContext | None = None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
        wait_for_ready: bool = False,
        step_timeout: float | None = None,
        replay_bytes: int | None = DEFAULT_REPLAY_BYTES,
        relay: str = "client",
        batch_groups: int | None = None,
        handoff: bool = True,
    ) -> AsyncIterator[Pipeline]:
        """Connect to every worker (in order: first shard first) and check the chain.

        ``targets``: one entry per hop, first hop first: ``"HOST:PORT"``, or a sequence of
        replicas serving the same range of the same model, tried in order (the first that
        answers serves; the others take over when it fails, see ``generate``).
        ``timeout``: default deadline of each ``generate``, and of connecting (one deadline for
        all hops); None for none. ``hidden_dtype``: "float32" (default) or "float16" on the hops
        whose worker offers it. ``wait_for_ready``: wait (within ``timeout``) for workers that
        are still loading to serve, instead of failing with ``NOT_READY`` at once (see
        ``ShardClient.wait_for_ready``). ``step_timeout``: seconds any one step (a decode, a
        prefill chunk, an open) may go unanswered before its worker counts as hung and its hop
        fails over (None: no bound but the deadline; with chain relay each worker on the route
        bounds its next hop's answers the same way, so a hung hop is named). ``replay_bytes``:
        the boundary rows one generation may keep for replay (None: unbounded; see
        ``shard.pipeline.replay``). ``relay``: "client" (default: the client relays every hop's
        hidden states) or "chain" (the workers relay to each other; refused, naming the hop,
        when a hop but the last does not report ``relay_allowed``; hops with replicas fail over
        as with client relay; see ``shard.pipeline.chain``). ``batch_groups``: how many
        groups concurrent ``generate`` calls are spread over, so that the hops compute different
        groups at once instead of waiting for each other (default None: one per hop, none for
        one hop; 0: none; see ``shard.pipeline.groups``). ``handoff``: when a worker drains, move
        each session's KV state to its replica instead of replaying the history there (where
        both workers report ``session_handoff``; default True).

        One ``Pipeline`` serves any number of concurrent ``generate`` calls (start them in a
        nursery) over its shared connections; each has its own sessions, so one call's failure,
        failover or cancellation leaves the others' tokens and sessions as they were.
        """
        if hidden_dtype not in convert.WIRE_DTYPES:
            raise ValueError(f"hidden_dtype must be one of {sorted(convert.WIRE_DTYPES)}")
        if step_timeout is not None and not step_timeout > 0:
            raise ValueError("step_timeout must be > 0 (or None)")
        if relay not in RELAY_MODES:
            raise ValueError(f"relay must be one of {', '.join(RELAY_MODES)}")
        if batch_groups is not None and batch_groups < 0:
            raise ValueError("batch_groups must be >= 0 (or None)")
        hops = hop_targets(targets)
        deadline = absolute_deadline(timeout)
        closing = trio.Event()
        with unwrap_single_exception():
            async with trio.open_nursery() as connections:

                async def hold(
                    target: str, connect_timeout: float | None,
                    task_status: trio.TaskStatus[ShardClient] = trio.TASK_STATUS_IGNORED,
                ) -> None:
                    """Own one connection until the pipeline closes (shielded until then, so a
                    caller cancelled from outside can still release its sessions)."""
                    async with ShardClient.connect(
                        target, timeout=connect_timeout, ssl_context=ssl_context,
                        metadata=metadata,
                    ) as client:
                        task_status.started(client)
                        with trio.CancelScope(shield=True):
                            await closing.wait()

                async def connect(target: str, connect_timeout: float | None) -> ShardClient:
                    client: ShardClient = await connections.start(hold, target, connect_timeout)
                    return client

                try:
                    pipe = cls(
                        hops, connect, timeout=timeout, hidden_dtype=hidden_dtype,
                        ssl_context=ssl_context, metadata=metadata, step_timeout=step_timeout,
                        replay_bytes=replay_bytes, relay=relay, batch_groups=batch_groups,
                        handoff=handoff,
                    )
                    for replicas in pipe._replicas:
                        await replicas.attach(deadline, wait_for_ready)
                    check_chain(pipe.hops)
                    for replicas in pipe._replicas:
                        replicas.check_alternatives()
                    if relay == "chain":
                        chain.check_relay_allowed(pipe.hops)
                        chain.set_aside_non_relaying(pipe._replicas)
                    yield pipe
                finally:
                    closing.set()

    async def serving(self, *, timeout: float | None = 5.0) -> list[tuple[Hop, str]]:
        """Every hop that cannot take a generation now, with why (empty: all can). A hop can
        when one of its replicas answers Health with SERVING (a generation fails over to it);
        all replicas are asked at once, each within ``timeout``."""

        async def ask(replica: Replica, answers: dict[str, str]) -> None:
            if replica.client is None or replica.refused is not None:
                answers[replica.target] = "not connected" if replica.refused is None else str(replica.refused)
                return
            try:
                status = (await replica.client.health(timeout=timeout)).status
            except ShardError as err:
                answers[replica.target] = f"{err.code.name}: {err.message}"
                return
            answers[replica.target] = pb.HealthResponse.Status.Name(status)

        answers: list[dict[str, str]] = [{} for _ in self._replicas]
        async with trio.open_nursery() as nursery:
            for hop, out in zip(self._replicas, answers):
                for replica in hop.replicas:
                    nursery.start_soon(ask, replica, out)
        return [(hop.hop(), "; ".join(f"{t}: {a}" for t, a in out.items()))
                for hop, out in zip(self._replicas, answers) if "STATUS_SERVING" not in out.values()]

    # ---- generation ----------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_tokens: Sequence[int] = (),
        ignore_eos: bool = False,
        top_logprobs: int = 0,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        session_id: str | None = None,
        timeout: float | None = _DEFAULT,
        on_token: OnToken | None = None,
        speculate: int = 0,
        drafter: Drafter | None = None,
        parse_special: bool = False,
        route: Sequence[str] | None = None,
    ) -> PipelineResult:
        """Prefill ``prompt`` (text, tokenized by the first shard with BOS, or token ids) through
        the chain, then generate up to ``max_tokens`` tokens; same stop rules and results as a
        whole-model worker's ``Generate``. ``on_token`` (sync or async) sees each token's
        StepResult as it arrives, once, also across failovers. Every shard's session is released
        when this returns or fails. ``parse_special``: special-token texts in a text prompt
        become special tokens (a rendered chat template; ``Hop.caps.parse_special`` says
        whether the first shard honours it). A pipeline of one hop (a whole-model worker)
        without replicas decodes in the worker's own loop (``Generate``), as a chain relay
        does; with replicas the client steps, so a draining worker hands over between tokens.

        ``speculate=K`` (K >= 1): each pass through the chain carries the next token and up to K
        tokens drafted by prompt lookup (``shard.pipeline.drafting``: n-grams of the prompt, a
        text's ids as the first shard echoes them, and of the output so far), as many as the
        measured costs say pay and none when drafting would be slower than plain decoding
        (``shard.pipeline.speculation``); the last shard returns every position's token and the
        longest agreeing prefix is kept, the rest rolled back on every hop by the next step. The tokens are the ones plain decoding gives, greedy or sampled (the last shard
        samples each position as a decode ending there would; see docs/pipelines.md). Needs a
        last shard that reports ``max_logits_positions`` > K. ``drafter``: any object with
        ``propose(history, k) -> list[int]`` instead of prompt lookup.

        ``route``: the replica each hop starts on (one target per hop, each one of the hop's
        replicas), for this generation only; by default the one serving the hop now. A
        failover then moves this generation alone.
        """
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        if speculate < 0:
            raise ValueError("speculate must be >= 0")
        self._check_chunk(chunk_tokens)
        hops = self._replicas
        if route is not None:
            if len(route) != len(hops) or any(
                    t not in {r.target for r in h.replicas} for t, h in zip(route, hops)):
                raise ValueError("route must name one replica of each hop, first hop first")
            hops = [h.starting_at(t) for h, t in zip(hops, route)]
        if speculate:
            self._check_speculation(speculate)
        if timeout is _DEFAULT:
            timeout = self.timeout
        deadline = absolute_deadline(timeout)
        blames = Blames(self.hops)
        result = PipelineResult()
        rules = StopRules.of(max_tokens, stop_tokens, ignore_eos)
        with self.batch_groups.member() as group, unwrap_single_exception():
            async with trio.open_nursery() as retirements:  # releases of failed-over sessions
                gen = Generation(
                    sid=session_id if session_id is not None else f"p-{secrets.token_hex(8)}",
                    deadline=deadline,
                    sampling=sampling(temperature, top_k=top_k, top_p=top_p, seed=seed),
                    top_logprobs=top_logprobs,
                    chunk_tokens=chunk_tokens,
                    hidden_dtype=self.hidden_dtype,
                    step_timeout=self.step_timeout,
                    budget=ReplayBudget(self.replay_bytes),
                    release=partial(
                        release_session, ssl_context=self._ssl_context, metadata=self._metadata
                    ),
                    spawn=retirements.start_soon,
                    failovers=result.failovers,
                    blames=blames,
                    batch_group=group,
                    parse_special=parse_special,
                    handoff=self.handoff,
                )
                last = len(hops) - 1
                chained = self.relay == "chain" and last > 0
                # A whole-model worker without replicas decodes in its own loop; with replicas
                # the client steps, so that a draining worker hands over at the next token
                # (the hand-over is checked before each step the client sends).
                alone = last == 0 and (len(hops[0].replicas) == 1 or not self.step_replicas)
                if chained:  # one runner: the first hop, answering with the last shard's results
                    runners = [chain.first_hop_runner(hops, gen)]
                else:
                    runners = [HopRunner(r, gen, last=r.index == last) for r in hops]
                try:
                    with trio.CancelScope(deadline=deadline):  # the caller's deadline, for all
                        if (chained or alone) and not speculate:  # the workers loop: Generate on hop 0
                            await chain.run(runners[0], result, prompt, rules, on_token, blames,
                                            self.pass_cost)
                        else:  # the client steps (a chain's passes go through hop 0's route)
                            await self._run(runners, result, prompt, rules, on_token, blames,
                                            speculate, drafter or PromptLookup(), loop=chained)
                        return result
                    raise blames.deadline_error(self.hops)  # the scope's deadline passed
                except BaseException:
                    for runner in runners:
                        runner.abort()  # RST_STREAM: the worker stops the step and releases
                    with trio.CancelScope(shield=True, deadline=gen.cleanup_deadline()):
                        async with trio.open_nursery() as nursery:
                            for runner in runners:  # (and what a routed one's hops retain)
                                nursery.start_soon(runner.release)
                    raise

    async def _run(
        self,
        runners: list[HopRunner],
        result: PipelineResult,
        prompt: str | Sequence[int],
        rules: StopRules,
        on_token: OnToken | None,
        blames: Blames,
        speculate: int = 0,
        drafter: Drafter | None = None,
        *,
        loop: bool = False,
    ) -> None:
        """The client steps every pass. ``loop`` (chain relay, speculating): plain decoding is
        a stretch of the workers' own loop (``Generate`` on the first hop) instead."""
        for runner in runners:
            with Blame(runner, blames):
                await runner.open()
        step = await self._prefill(runners, prompt, blames)
        result.prompt_tokens = step.n_past
        result.traversals = 1
        # Drafting reads the prompt's ids (a text's as the first shard echoed them; none from a
        # worker that does not) and every token generated.
        history = list(prompt) if not isinstance(prompt, str) else list(runners[0].prompt_ids or ())
        drafter = drafter if speculate else None
        planner = DraftPlanner(speculate, self.pass_cost, loop=loop) if drafter is not None else None
        synced = True  # every hop holds exactly the positions before ``token`` (none rejected)
        capacity = min(r.session.opened.kv_capacity for r in runners if r.session is not None)

        async def emit(out: pb.StepResult) -> bool:
            """Hand one step to the result and the caller; True when the generation ends."""
            out.finish_reason = rules.finish_reason(  # type: ignore[assignment]
                out.logits.token_id, out.logits.is_eog, emitted=len(result.steps) + 1,
                n_past=out.n_past, capacity=capacity)
            result.steps.append(out)
            history.append(out.logits.token_id)
            if on_token is not None:
                maybe = on_token(out)
                if inspect.isawaitable(maybe):
                    await maybe
            if out.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                return True
            # a caller that cancelled from on_token sees no token of the pass after it
            await trio.lowlevel.checkpoint_if_cancelled()
            return False

        pending = [step]
        while True:
            capacity = min(r.session.opened.kv_capacity for r in runners if r.session is not None)
            finished = False
            for step in pending:
                if finished := await emit(step):
                    break
            if finished:
                break
            token = step.logits.token_id
            result.traversals += 1
            if drafter is None or planner is None:
                pending = [await self._decode(runners, token, blames)]
                continue
            wanted = planner.drafts()
            if wanted == 0 and loop and synced and planner.cost.known:
                # Plain decoding with chain relay: a stretch of the workers' loop, then the
                # planner looks again (a text may become worth drafting).
                got: list[pb.StepResult] = []

                async def take(out: pb.StepResult) -> None:
                    if not got or got[-1].finish_reason == pb.FINISH_REASON_UNSPECIFIED:
                        got.append(out)
                        await emit(out)  # the workers stop on the same rules

                started = trio.current_time()
                with Blame(runners[0], blames):
                    await runners[0].generate(
                        take, max_tokens=min(planner.stretch(), rules.max_tokens - len(result.steps)),
                        stop_tokens=sorted(rules.stop_tokens), ignore_eos=rules.ignore_eos,
                        fed=token)
                planner.looped(len(got), trio.current_time() - started)
                result.traversals += max(len(got) - 1, 0)  # one trip along the chain per token
                if not got:
                    raise PipelineError(runners[0].hop, ShardError(
                        ErrorCode.INTERNAL, "the workers' loop returned no token"))
                if got[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    break
                step, pending = got[-1], []
                continue
            # Drafts that pay for their rows (the planner), and that, every one kept, still
            # leave a token to emit within max_tokens and fit every hop's KV budget.
            room = min(wanted, rules.max_tokens - len(result.steps) - 1, capacity - step.n_past - 1)
            drafts = list(drafter.propose(history, room))[:room] if room > 0 else []
            started = trio.current_time()
            if not drafts and synced:  # nothing to verify or roll back: a plain decode step
                pending = [await self._decode(runners, token, blames)]
            else:
                pending = await self._speculate(runners, step.n_past, [token, *drafts], blames)
            accepted = len(pending) - 1
            planner.passed(len(drafts), accepted, trio.current_time() - started)
            synced = accepted == len(drafts)  # else the hops hold rejected positions
            result.drafted_tokens += len(drafts)
            result.accepted_tokens += accepted
        for runner in runners:
            with Blame(runner, blames):
                await runner.close()

    def _check_chunk(self, chunk_tokens: int) -> None:
        """A chunk's hidden states must fit in one message of every hop that carries them."""
        def known(replicas: HopReplicas) -> list[pb.GetCapabilitiesResponse]:
            return [r.caps for r in replicas.replicas if r.caps is not None]

        for prev, hop in zip(self._replicas, self._replicas[1:]):
            both = known(prev) + known(hop)
            limit = min((c.max_message_bytes for c in both if c.max_message_bytes), default=0)
            itemsize = max(convert.WIRE_DTYPES[convert.offered_dtype(c, self.hidden_dtype)].itemsize
                           for c in known(hop))
            assert hop.reference is not None
            size = chunk_tokens * hop.reference.n_embd * itemsize
            if limit and size + 1024 > limit:
                raise PipelineError(hop.hop(), ShardError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"chunk_tokens={chunk_tokens} makes {size}-byte hidden-state messages; "
                    f"this chain accepts at most {limit} bytes per message",
                ))

    async def _prefill(
        self, runners: list[HopRunner], prompt: str | Sequence[int], blames: Blames
    ) -> pb.StepResult:
        """Stream the prompt through the chain in chunks; return the last shard's last result."""
        n = len(runners)
        last: list[pb.StepResult] = []

        async def forward(out: trio.MemorySendChannel[tuple[int, np.ndarray]] | None, o: HopOutput) -> None:
            if out is None:
                last[:] = [o.step]
            else:
                assert o.rows is not None
                await out.send((o.start, o.rows))

        async def first(out: trio.MemorySendChannel[tuple[int, np.ndarray]] | None) -> None:
            with Blame(runners[0], blames, nursery.cancel_scope):
                async with out if out is not None else nullcontext():  # closing ends the next hop
                    await runners[0].prefill_prompt(prompt, partial(forward, out))

        async def later(
            k: int,
            inbox: trio.MemoryReceiveChannel[tuple[int, np.ndarray]],
            out: trio.MemorySendChannel[tuple[int, np.ndarray]] | None,
        ) -> None:
            with Blame(runners[k], blames, nursery.cancel_scope):
                async with inbox, out if out is not None else nullcontext():
                    async for position, rows in inbox:
                        await forward(out, await runners[k].prefill_rows(position, rows))

        with unwrap_single_exception():
            async with trio.open_nursery() as nursery:
                channels = [trio.open_memory_channel[tuple[int, np.ndarray]](1) for _ in range(n - 1)]
                nursery.start_soon(first, channels[0][0] if n > 1 else None)
                for k in range(1, n):
                    out = channels[k][0] if k < n - 1 else None
                    nursery.start_soon(later, k, channels[k - 1][1], out)
        if blames.failures:
            raise blames.failures[0]
        if not last or last[0].WhichOneof("output") != "logits":
            raise PipelineError(self.hops[-1], ShardError(ErrorCode.INTERNAL, "no logits after prefill"))
        return last[0]

    def _check_speculation(self, k: int) -> None:
        """The last shard must verify k drafted tokens and the next one in one step."""
        last = self._replicas[-1]
        for replica in last.replicas:
            caps = replica.caps
            if caps is not None and caps.max_logits_positions < k + 1:
                why = ("does not verify drafted tokens (it reports no max_logits_positions: "
                       "an older worker)" if not caps.max_logits_positions else
                       f"verifies at most {caps.max_logits_positions - 1} drafted tokens a step")
                raise PipelineError(last.hop(replica), ShardError(
                    ErrorCode.UNSUPPORTED_FEATURE, f"speculate={k}: the last shard {why}"))

    async def _speculate(
        self, runners: list[HopRunner], position: int, tokens: list[int], blames: Blames
    ) -> list[pb.StepResult]:
        """One pass of ``tokens`` (the next token, then drafts) written at ``position`` on every
        hop; returns the results to emit: one per draft the model agreed with (in order) and
        the model's own token after them. A position's result looks like the decode's that
        would have produced it (its ``logits``, ``n_past``)."""
        with Blame(runners[0], blames):
            out = await runners[0].verify(position, tokens=tokens)
        for runner in runners[1:]:
            with Blame(runner, blames):
                assert out.rows is not None
                out = await runner.verify(out.start, rows=out.rows)
        last = out.step
        start = last.n_past - len(last.position_logits)
        emitted: list[pb.StepResult] = []
        for i, logits in enumerate(last.position_logits):
            emitted.append(pb.StepResult(
                step=last.step, n_past=start + i + 1, tokens_processed=1, logits=logits,
                start_position=start + i,
            ))
            if i + 1 >= len(tokens) or logits.token_id != tokens[i + 1]:
                break  # the model's own token here: the drafts after it are rejected
        return emitted

    async def _decode(self, runners: list[HopRunner], token: int, blames: Blames) -> pb.StepResult:
        """One token through every hop; the last hop's result carries the next token."""
        with Blame(runners[0], blames):
            out = await runners[0].decode(token=token)
        for runner in runners[1:]:
            with Blame(runner, blames):
                out = await runner.decode(row=out.rows)
        return out.step
