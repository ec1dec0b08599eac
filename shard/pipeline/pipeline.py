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
  connected by memory channels of capacity 1, so at most one chunk waits per hop. A route of
  one hop (a whole-model worker) sends the prompt as one ``Prefill`` by default: nothing
  overlaps there, and the worker's scheduler already cuts a long prompt into ticks.
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
  replays the hop's history (kept by ``shard.pipeline.history``/``shard.pipeline.replay``: token
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

import secrets
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio

from shard.client import ShardClient, sampling
from shard.deadlines import HOP_DEADLINE_MARGIN, absolute_deadline
from shard.rpc import convert
from shard.rpc.errors import ShardError, unwrap_single_exception
from shard.stops import StopRules
from shard.v1 import shard_pb2 as pb

from . import chain, stepping
from .checks import (check_chain, check_chunk, check_grammar, check_prompt_logprobs,
                     check_sampling, check_speculation, hop_targets)
from .choices import OnChoiceToken, generate_choices
from .drafting import Drafter, PromptLookup
from .errors import Blames, Hop, PipelineError
from .gathering import HopGroups
from .groups import BatchGroups, default_groups
from .replay import DEFAULT_REPLAY_BYTES, ReplayBudget
from .replicas import HopReplicas, Replica
from .prefix import PrefixTurn
from .result import PipelineResult
from .generation import CLEANUP_GRACE, RELEASE_TIMEOUT, Failover, Generation
from .held import release_session
from .runner import HopRunner
from .speculation import PassCost
from .generation import OnToken

__all__ = [
    "CLEANUP_GRACE",
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_REPLAY_BYTES",
    "TIMED_ONE_HOP_CHUNK_TOKENS",
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

#: Prompt positions per prefill step over several hops. Chunks let the hops overlap (hop k+1
#: computes chunk i while hop k computes chunk i+1), which needs chunks small beside the prompt;
#: but every chunk costs a message per hop and a native step of fewer rows, which llama.cpp
#: computes at a lower rate per position the smaller it is. 128 was the best or tied over 2
#: and 3 hops in bench/pipeline/prefill.py, beside 32 to 512 (docs/benchmarks.md, "Pipelined
#: prefill").
DEFAULT_CHUNK_TOKENS = 128
#: Over one hop a prompt goes as one Prefill (``chunk_tokens`` 0): no hop waits for it, and the
#: worker cuts it into ticks of ``--batch-tokens`` rows among the other sessions' steps anyway
#: (a Cancel lands at the end of the running tick). With a ``step_timeout``, though, a step must
#: answer within it whatever the prompt's length, so one hop then takes this many positions a
#: step: about one tick of a worker's default ``--batch``, a step long enough to cost nothing
#: beside the whole prompt's, short enough for a step timeout to find a hung worker.
TIMED_ONE_HOP_CHUNK_TOKENS = 512
RELAY_MODES = ("client", "chain")
_DEFAULT: Any = object()


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
        #: workers can; False: always replay the history there (shard.pipeline.handoff).
        self.handoff = handoff
        self._ssl_context = ssl_context  # to reconnect for a Release (see ``release_session``)
        self._metadata = tuple(metadata)
        # What a pass through this chain costs, learned across generations (speculation drafts
        # only as many tokens as pay for their rows; shard.pipeline.speculation).
        self.pass_cost = PassCost()
        #: Group steps (``shard.pipeline.gathering``): set by ``connect``, which owns their tasks.
        self.groups: HopGroups | None = None

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
        group_steps: bool = False,
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
        both workers report ``session_handoff``; default True). ``group_steps``: the client relay
        sends a batch group's decodes to each hop as one message per tick where the worker
        takes them (protocol 1.3; see ``shard.pipeline.gathering``). Default False (one
        message per session): at 16 sessions over 2 hops the gatherers' waits cost more
        throughput than the messages they save (docs/benchmarks.md, "Group steps").

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
                    if group_steps:
                        pipe.groups = HopGroups(connections.start_soon, closing,
                                                pipe.batch_groups.running)
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

    def prefill_chunk(self, chunk_tokens: int | None = None) -> int:
        """The prompt positions one prefill step takes: ``chunk_tokens`` when given (0: the
        whole prompt in one step, a route of one hop only: several need chunks that fit a
        message), else ``DEFAULT_CHUNK_TOKENS`` over several hops and, over one hop, 0, or
        ``TIMED_ONE_HOP_CHUNK_TOKENS`` with a ``step_timeout`` (which bounds every step)."""
        one_hop = len(self._replicas) == 1
        if chunk_tokens is None:
            if not one_hop:
                return DEFAULT_CHUNK_TOKENS
            return 0 if self.step_timeout is None else TIMED_ONE_HOP_CHUNK_TOKENS
        if chunk_tokens < 0 or (chunk_tokens == 0 and not one_hop):
            raise ValueError("chunk_tokens must be >= 1 (0, the whole prompt in one step, "
                             "only on a route of one hop)")
        return chunk_tokens

    async def generate_choices(
        self, prompt: str | Sequence[int], n: int, *, seed: int = 0,
        on_token: OnChoiceToken | None = None, **options: Any,
    ) -> list[PipelineResult]:
        """``n`` choices of ``prompt``, choice ``i`` sampled with ``seed + i``, the prompt
        prefilled once and forked on every hop (``shard.pipeline.choices``); ``options`` as
        ``generate``'s."""
        return await generate_choices(self, prompt, n, seed=seed, on_token=on_token, **options)

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
        chunk_tokens: int | None = None,
        session_id: str | None = None,
        timeout: float | None = _DEFAULT,
        on_token: OnToken | None = None,
        speculate: int = 0,
        drafter: Drafter | None = None,
        parse_special: bool = False,
        route: Sequence[str] | None = None,
        result: PipelineResult | None = None,
        grammar_kind: str = "",
        grammar: str = "",
        min_p: float = 0.0,
        repeat_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        penalty_last_n: int = 64,
        logit_bias: Mapping[int, float] | None = None,
        fork_of: str | None = None,
        client_steps: bool = False,
        prompt_logprobs: bool = False,
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

        ``result``: the (empty) result to fill, so a caller that cancels the generation from
        ``on_token`` still reads what it got (``prompt_tokens``, ``cached_tokens``).

        ``chunk_tokens``: prompt positions the first shard computes per prefill step, each
        step's result sent on at once; by default ``prefill_chunk()``'s choice (see there).
        ``grammar_kind``/``grammar``: the last shard constrains every generated token to the
        grammar (``shard.client.options.sampling``); it starts at the prompt's end, which every
        step after the prompt names, so replays and hand-offs continue it.
        ``min_p``, the penalties and ``logit_bias`` (``shard.client.sampling``) need a last
        shard that honours them (every replica reporting ``sampling_penalties``); each hop
        is sent the token ids, so the last one penalizes the session's whole history.

        ``fork_of``: the ``session_id`` of a running generation of this pipeline whose
        sessions are idle: every hop's session starts as a copy of that one's (a worker without
        forks: a plain session), so a prompt that starts with what they hold is computed from
        there on (``generate_choices``). ``client_steps``: the client sends every step, never
        the workers' own loop, so the sessions are idle while ``on_token`` runs.

        ``prompt_logprobs`` (``prompt`` as token ids): the prompt goes through the chain in
        scoring passes instead of a prefill (``shard.pipeline.scoring``), and
        ``result.prompt_logprobs`` holds each prompt token's log-prob but the first's with the
        top ``top_logprobs`` alternatives at its position; ``max_tokens`` may then be 0 (the
        prompt alone). Needs every worker to report ``input_logprobs``; the client steps.
        """
        if max_tokens < (0 if prompt_logprobs else 1):
            raise ValueError("max_tokens must be >= 1 (>= 0 with prompt_logprobs)")
        if prompt_logprobs and isinstance(prompt, str):
            raise ValueError("prompt_logprobs needs the prompt's token ids")
        window = check_prompt_logprobs(self._replicas) if prompt_logprobs else 0
        chunk_tokens = self.prefill_chunk(chunk_tokens)
        if speculate < 0:
            raise ValueError("speculate must be >= 0")
        check_chunk(self._replicas, chunk_tokens, self.hidden_dtype)
        hops = self._replicas
        if route is not None:
            if len(route) != len(hops) or any(
                    t not in {r.target for r in h.replicas} for t, h in zip(route, hops)):
                raise ValueError("route must name one replica of each hop, first hop first")
            hops = [h.starting_at(t) for h, t in zip(hops, route)]
        if speculate:
            check_speculation(self._replicas[-1], speculate)
        params = sampling(temperature, top_k=top_k, top_p=top_p, seed=seed, min_p=min_p,
                          repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                          frequency_penalty=frequency_penalty, penalty_last_n=penalty_last_n,
                          logit_bias=logit_bias, grammar_kind=grammar_kind, grammar=grammar)
        check_sampling(self._replicas[-1], params)
        if grammar_kind:
            check_grammar(self._replicas[-1], grammar_kind)
        if timeout is _DEFAULT:
            timeout = self.timeout
        deadline = absolute_deadline(timeout)
        blames = Blames(self.hops)
        result = result if result is not None else PipelineResult()
        rules = StopRules.of(max_tokens, stop_tokens, ignore_eos)
        with self.batch_groups.member() as group, unwrap_single_exception():
            async with trio.open_nursery() as retirements:  # releases of failed-over sessions
                gen = Generation(
                    sid=session_id if session_id is not None else f"p-{secrets.token_hex(8)}",
                    deadline=deadline,
                    sampling=params,
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
                    groups=self.groups,
                    parse_special=parse_special,
                    handoff=self.handoff,
                    fork_of=fork_of or "",
                    score_window=window,
                )
                last = len(hops) - 1
                chained = self.relay == "chain" and last > 0
                # A whole-model worker without replicas decodes in its own loop; with replicas
                # the client steps, so that a draining worker hands over at the next token
                # (the hand-over is checked before each step the client sends).
                alone = last == 0 and (len(hops[0].replicas) == 1 or not self.step_replicas)
                turn = PrefixTurn(prompt, gen)  # the prefix every hop holds, and its one retry
                while True:
                    if chained:  # one runner: the first hop, answering with the last shard's results
                        runners = [chain.first_hop_runner(hops, gen)]
                    else:
                        runners = [HopRunner(r, gen, last=r.index == last) for r in hops]
                    try:
                        with trio.CancelScope(deadline=deadline):  # the caller's deadline, for all
                            if ((chained or alone) and not speculate and not client_steps
                                    and not window):  # the workers loop: Generate on hop 0
                                await chain.run(runners[0], result, prompt, rules, on_token, blames,
                                                self.pass_cost)
                            else:  # the client steps (a chain's passes go through hop 0's route)
                                await stepping.run(runners, result, prompt, rules, on_token, blames,
                                                   self.pass_cost, speculate,
                                                   drafter or PromptLookup(), loop=chained)
                            return result
                        raise blames.deadline_error(self.hops)  # the scope's deadline passed
                    except BaseException as exc:
                        for runner in runners:
                            runner.abort()  # RST_STREAM: the worker stops the step and releases
                        with trio.CancelScope(shield=True, deadline=gen.cleanup_deadline()):
                            async with trio.open_nursery() as nursery:
                                for runner in runners:  # (and what a routed one's hops retain)
                                    nursery.start_soon(runner.release)
                        if not turn.retry(exc, runners, result):
                            raise
