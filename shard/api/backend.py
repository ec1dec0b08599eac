"""The workers behind the front door: one ``Pipeline`` (a single whole-model worker is a
pipeline of one hop) or a pool of workers (``shard.pool``: every model it serves, each
generation on the least-loaded complete route), and one generation as a stream of text deltas.

Why the pipeline client for one worker too: failover to replicas, batch groups, speculation and
every later change to the client reach the front door without a second code path; a one-hop
pipeline decodes in the worker's own loop (``Generate``), as ``trio-shard generate`` does.

A generation runs in the caller's task and sends each ``Delta`` into a bounded channel: a slow
HTTP client slows its own generation (back-pressure), never buffers it. A matched stop sequence
cancels the generation; ``Pipeline.generate`` then resets and releases its sessions on every
hop, as it does when the HTTP client disconnects and the request's task is cancelled.
"""

from __future__ import annotations

import logging
import math
import secrets
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from shard.chat import ChatTemplate, ChatTemplateError
from shard.client import ShardClient
from shard.client.waiting import connect_waiting
from shard.engine import EMBEDDING_POOLING
from shard.pipeline import Pipeline, PipelineResult
from shard.pool import Pool
from shard.pool import model_id as pool_model_id
from shard.rpc.convert import embeds_per_call
from shard.rpc.errors import ErrorCode, ShardError
from shard.v1 import shard_pb2 as pb

from .choices import ChoiceText, best
from .echo import prompt_delta
from .errors import RETRY_AFTER_SECONDS, ApiError, from_shard_error
from .queue import WaitQueue
from .text import Delta

__all__ = ["Backend", "Catalog", "DeltaSink", "Outcome", "PipelineRoutes", "PoolRoutes", "Request", "Routes"]

log = logging.getLogger(__name__)

#: Seconds a health answer is reused (``Backend.not_serving``).
HEALTH_TTL = 1.0


@dataclass(frozen=True)
class Request:
    """One generation, checked: what the pipeline is asked for."""

    prompt: str | list[int]
    max_tokens: int | None  # None: until the context is full
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh one (OpenAI samples differently every time)
    stops: tuple[str, ...] = ()
    top_logprobs: int = 0
    parse_special: bool = True
    prompt_param: str = "prompt"  # the request field a too-long prompt is blamed on
    #: Constrained decoding: (grammar kind, text, the request field a bad grammar is blamed
    #: on); None: none.
    constraint: tuple[str, str, str] | None = None
    #: llama.cpp's samplers (``Pipeline.generate``): off by default.
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    #: Choices returned, and generated (``best_of`` >= ``n``: the best ``n`` are returned).
    n: int = 1
    best_of: int = 1
    #: ``echo`` with ``logprobs``: each choice's text starts with the prompt's tokens and
    #: their log-probs (``shard.api.echo``); ``max_tokens`` may be 0.
    echo_logprobs: bool = False
    #: Texts kept in the answer where the model writes them as a control token (which has
    #: no text otherwise): a tool call format's markers, for its parser (``ToolPlan``).
    preserved: tuple[str, ...] = ()


@dataclass
class Outcome:
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    #: Prompt positions the workers took from their prefix cache (OpenAI's
    #: ``usage.prompt_tokens_details.cached_tokens``).
    cached_tokens: int = 0
    #: Each returned choice's finish reason, by index (``n`` > 1; the first is ``finish_reason``).
    finish_reasons: tuple[str, ...] = ()

    @classmethod
    def total(cls, outcomes: Sequence[Outcome]) -> Outcome:
        """Several generations' tokens added up (usage of a request of several prompts); the
        first one's finish reason."""
        return cls(outcomes[0].finish_reason, sum(o.prompt_tokens for o in outcomes),
                   sum(o.completion_tokens for o in outcomes), sum(o.cached_tokens for o in outcomes))


class DeltaSink(Protocol):
    """Where a generation's text goes: a memory channel, or one that tags it with its choice."""

    async def send(self, delta: Delta, /) -> None: ...

    def send_nowait(self, delta: Delta, /) -> None:
        """Without waiting; ``trio.WouldBlock`` when there is no room."""


class Routes(Protocol):
    """Where one model's generations run: a fixed pipeline, or a pool's least-loaded route."""

    def lease(self, prompt: str | Sequence[int] | None = None, *, whole: bool = False,
              sessions: int = 1,
              ) -> AbstractAsyncContextManager[tuple[Pipeline, Sequence[str] | None]]: ...

    @property
    def first(self) -> pb.GetCapabilitiesResponse | None: ...

    @property
    def context(self) -> int: ...

    def capacity(self) -> int | None: ...

    def route_capacity(self) -> int | None:
        """The most sessions one route takes: what bounds one request's choices."""
        ...

    async def not_serving(self) -> list[str]: ...


class PipelineRoutes:
    """One pipeline for every generation (``api --target`` / ``--pipeline``)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    @asynccontextmanager
    async def lease(self, prompt: str | Sequence[int] | None = None, *, whole: bool = False,
                    sessions: int = 1,
                    ) -> AsyncIterator[tuple[Pipeline, Sequence[str] | None]]:
        if whole and len(self.pipeline.hops) > 1:
            raise ShardError(ErrorCode.UNSUPPORTED_FEATURE, f"the model is served as a pipeline "
                             f"of {len(self.pipeline.hops)} workers: no worker serves it whole")
        yield self.pipeline, None

    @property
    def first(self) -> pb.GetCapabilitiesResponse | None:
        return self.pipeline.hops[0].caps

    @property
    def context(self) -> int:
        return min(h.caps.n_ctx_per_session for h in self.pipeline.hops if h.caps is not None)

    def capacity(self) -> int | None:
        """The smallest ``max_sessions`` of the chain's hops (a generation opens a session on
        each hop's serving replica), None when unknown."""
        return min((h.caps.max_sessions for h in self.pipeline.hops if h.caps is not None),
                   default=0) or None

    def route_capacity(self) -> int | None:
        return self.capacity()  # (one route)

    async def not_serving(self) -> list[str]:
        return [f"{hop}: {why}" for hop, why in await self.pipeline.serving(timeout=2.0)]


class PoolRoutes:
    """One model of a pool (``api --workers``): each generation on the route that holds its
    prompt's prefix, else the least-loaded one (``shard.pool.routing``)."""

    def __init__(self, pool: Pool, model: str) -> None:
        self.pool = pool
        self.model = model

    @asynccontextmanager
    async def lease(self, prompt: str | Sequence[int] | None = None, *, whole: bool = False,
                    sessions: int = 1) -> AsyncIterator[tuple[Pipeline, Sequence[str] | None]]:
        async with self.pool.lease(self.model, prompt, whole=whole, sessions=sessions) as chosen:
            yield chosen.pipeline, chosen.route

    @property
    def first(self) -> pb.GetCapabilitiesResponse | None:
        return self.pool.first_caps(self.model)

    @property
    def context(self) -> int:
        return self.pool.context(self.model)

    def capacity(self) -> int | None:
        return self.pool.capacity(self.model)

    def route_capacity(self) -> int | None:
        return self.pool.route_capacity(self.model)

    async def not_serving(self) -> list[str]:
        await trio.lowlevel.checkpoint()
        return [w for w in self.pool.not_serving() if w.startswith(f"model {self.model}:")]


class Backend:
    """One model the front door serves, over its routes (see the module docstring)."""

    def __init__(
        self, pipeline: Pipeline | Routes, *, model_id: str | None = None,
        chat_template: str | None = None, speculate: int = 0, timeout: float | None = None,
    ) -> None:
        self.routes: Routes = PipelineRoutes(pipeline) if isinstance(pipeline, Pipeline) else pipeline
        self.speculate = speculate
        self.timeout = timeout
        self._health: tuple[float, list[str]] | None = None  # (when, the answer)
        self._template = chat_template
        self._chat_of: str | None = None  # the fingerprint ``chat`` was made for
        self._chat: ChatTemplate | None = None
        #: (model fingerprint, texts) -> the control tokens among ``texts``: id -> text
        self._preserved: dict[tuple[str, tuple[str, ...]], dict[int, bytes]] = {}
        first = self.routes.first
        #: The id clients ask for; default ``<architecture>-<12 hex digits of the fingerprint>``
        #: or the name the workers report (``serve --model-name``).
        self.model_id = model_id or (pool_model_id(first) if first is not None else "model")
        if first is not None:
            self._chat_for(first)

    @property
    def pipeline(self) -> Pipeline | None:
        """The single pipeline (None for a pool's model)."""
        return self.routes.pipeline if isinstance(self.routes, PipelineRoutes) else None

    @property
    def first(self) -> pb.GetCapabilitiesResponse:
        """The first shard's capabilities (vocabulary, chat template, parse_special)."""
        first = self.routes.first
        if first is None:
            raise ApiError(503, f"the model {self.model_id!r} has no complete route now",
                           type="server_error", code="service_unavailable",
                           headers={"Retry-After": "1"})
        return first

    @property
    def chat(self) -> ChatTemplate | None:
        """The chat template (the operator's file over the model's own), None without one."""
        first = self.routes.first
        return self._chat_for(first) if first is not None else self._chat

    def _chat_for(self, first: pb.GetCapabilitiesResponse) -> ChatTemplate | None:
        """A model's own template that does not compile leaves chat off (completions still
        serve); an operator's file that does not is an error at start."""
        if self._chat_of == first.model_fingerprint:
            return self._chat
        try:
            self._chat = ChatTemplate.of(first.chat, self._template)
        except ChatTemplateError as exc:
            if self._template is not None:
                raise
            log.error("%s: chat is off: the model's own %s", self.model_id, exc)
            self._chat = None
        self._chat_of = first.model_fingerprint
        return self._chat

    @classmethod
    @asynccontextmanager
    async def connect(
        cls, hops: Sequence[Sequence[str]], *, model_id: str | None = None, relay: str = "client",
        ssl_context: ssl.SSLContext | None = None, metadata: Sequence[tuple[str, str]] = (),
        chat_template: str | None = None, speculate: int = 0, timeout: float | None = None,
        step_timeout: float | None = None, connect_timeout: float | None = 30.0,
    ) -> AsyncIterator[Backend]:
        """Connect to every hop (``hops``: each a list of replica targets, first hop first),
        waiting within ``connect_timeout`` for workers still loading, and for workers not
        listening yet (a door started with its workers): a connection refused is tried again
        until then, a worker that answers and refuses (another model, bad credentials) is not
        (``shard.client.waiting``)."""

        def waiting(err: ShardError) -> None:
            log.info("waiting up to %gs for the workers: %s", connect_timeout, err)

        async with connect_waiting(lambda: Pipeline.connect(
                [list(h) for h in hops], timeout=connect_timeout, ssl_context=ssl_context,
                metadata=metadata, wait_for_ready=True, step_timeout=step_timeout, relay=relay),
                connect_timeout, on_wait=waiting) as pipeline:
            yield cls(pipeline, model_id=model_id, chat_template=chat_template,
                      speculate=speculate, timeout=timeout)

    @property
    def context(self) -> int:
        """The most positions one generation may hold (the chain's smallest session)."""
        return self.routes.context

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text of a conversation (``tools``: the template's ``tools``, as
        transformers passes them); a 400 without a template or when it refuses."""
        if self.chat is None:
            raise ApiError(400, "this model has no chat template (its GGUF carries none and the "
                           "front door was started without --chat-template): use /v1/completions",
                           param="messages", code="chat_template_missing")
        if not self.first.parse_special:
            raise ApiError(503, "the first worker does not parse special tokens (parse_special): "
                           "upgrade it to serve chat", type="server_error", code="worker_too_old")
        try:
            return self.chat.render(messages, **({"tools": list(tools)} if tools else {}))
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages", code="chat_template_error") from None

    async def tokenize(self, text: str | None = None, *, tokens: Sequence[int] | None = None,
                       add_bos: bool = False, parse_special: bool = True,
                       with_pieces: bool = False, param: str = "content") -> pb.TokenizeResponse:
        """The first worker's ids for ``text`` or bytes of ``tokens`` (``Tokenize``, the worker
        serving the first hop now); raises ``ApiError``."""
        try:
            async with self.routes.lease() as (pipeline, route):
                client, _ = _first_worker(pipeline, route)
                with trio.fail_after(self.timeout if self.timeout is not None else math.inf):
                    return await client.tokenize(text, tokens=tokens, add_bos=add_bos,
                                                 parse_special=parse_special,
                                                 with_pieces=with_pieces)
        except trio.TooSlowError:
            raise ApiError(504, "the first worker did not tokenize in time", type="timeout_error",
                           code="timeout") from None
        except ShardError as err:
            error = from_shard_error(err, prompt_param=param)
            if err.code == ErrorCode.INVALID_ARGUMENT:  # too long, or an id outside the vocabulary
                error.param = param
            raise error from None

    async def control_tokens(self, texts: Sequence[str]) -> dict[int, bytes]:
        """The ids of those ``texts`` that are each one control token of the model, with their
        text (``Request.preserved``): the texts the first worker reports as control tokens
        (``ChatTemplate.special_texts``), tokenized by it once per model."""
        chat = self.chat
        wanted = tuple(t for t in texts if chat is not None and t in chat.special_texts)
        if not wanted:
            return {}
        key = (self.first.model_fingerprint, wanted)
        if key not in self._preserved:
            ids: dict[int, bytes] = {}
            for text in wanted:
                try:
                    got = await self.tokenize(text, with_pieces=True, param="messages")
                except ApiError as err:
                    if err.code != "unsupported_feature":
                        raise
                    return {}  # a worker older than Tokenize: the marker keeps no text
                if len(got.tokens) == 1 and not got.pieces[0]:
                    ids[got.tokens[0]] = text.encode()
            self._preserved[key] = ids
        return self._preserved[key]

    async def embed(self, inputs: Sequence[str | Sequence[int]], *, dimensions: int | None = None,
                    normalize: bool = True) -> list[pb.Embedding]:
        """One pooled embedding per input, in order, from a worker serving the whole model
        (``Embed``; over a pool, the least-loaded such replica), in as many calls as the
        worker's messages need (``embeds_per_call``); raises ``ApiError``: a 400 when the model
        declares no pooling type or no worker serves it whole, as llama-server refuses, and
        when ``dimensions`` asks for another size than the model's (no model here shortens
        its embeddings)."""
        first = self.first
        pooling = first.pooling_type or "none"
        if pooling not in EMBEDDING_POOLING:
            raise ApiError(400, f"the model {self.model_id!r} has pooling type {pooling!r}, which "
                           "is not OAI compatible: it computes no embeddings (a model whose GGUF "
                           "declares mean, cls or last pooling does)", param="model",
                           code="unsupported_parameter")
        if dimensions is not None and dimensions != first.n_embd:
            raise ApiError(400, f"dimensions: the model's embeddings have {first.n_embd} "
                           "dimensions, and it cannot shorten them", param="dimensions",
                           code="unsupported_parameter")
        out: list[pb.Embedding] = []
        try:
            async with self.routes.lease(whole=True) as (pipeline, route):
                client, caps = _first_worker(pipeline, route)
                if not caps.embeddings:
                    raise ApiError(400, f"the worker serving {self.model_id!r} does not embed "
                                   "(it is older than the Embed call)", param="model",
                                   code="unsupported_parameter")
                per_call = embeds_per_call(caps.n_embd, caps.max_message_bytes)
                with trio.fail_after(self.timeout if self.timeout is not None else math.inf):
                    for start in range(0, len(inputs), per_call):
                        chunk = inputs[start:start + per_call]
                        try:
                            got = await client.embed(chunk, normalize=normalize)
                        except ShardError as err:
                            if start == 0 or err.code != ErrorCode.INVALID_ARGUMENT:
                                raise
                            err.message = f"inputs from {start} on: {err.message}"
                            raise
                        out.extend(got.embeddings)
        except trio.TooSlowError:
            raise ApiError(504, "the worker did not embed in time", type="timeout_error",
                           code="timeout") from None
        except ShardError as err:
            if err.code == ErrorCode.UNSUPPORTED_FEATURE:  # served as a pipeline, or no pooling
                raise ApiError(400, f"the model {self.model_id!r} cannot compute embeddings "
                               f"here: {err.message}", param="model",
                               code="unsupported_parameter") from None
            error = from_shard_error(err, prompt_param="input")
            if err.code == ErrorCode.INVALID_ARGUMENT:
                error.param = "input"
            raise error from None
        return out

    async def _prompt_tokens(self, request: Request) -> tuple[list[int], list[bytes]]:
        """The prompt's ids (a text's as the first worker tokenizes it at position 0, with
        BOS) and each one's bytes, for echoing it."""
        p = request.prompt
        if isinstance(p, str):
            got = await self.tokenize(p, add_bos=True, parse_special=request.parse_special,
                                      with_pieces=True, param=request.prompt_param)
            return list(got.tokens), list(got.pieces)
        got = await self.tokenize(tokens=p, with_pieces=True, param=request.prompt_param)
        return list(p), list(got.pieces)

    async def not_serving(self) -> list[str]:
        """Why the front door cannot serve now: one line per hop none of whose replicas serves
        (logged). The answer is kept for ``HEALTH_TTL`` seconds, so probes cannot multiply into
        Health calls on every worker."""
        now = trio.current_time()
        if self._health is None or now - self._health[0] > HEALTH_TTL:
            failing = await self.routes.not_serving()
            if failing:
                log.warning("not serving: %s", "; ".join(failing))
            self._health = (trio.current_time(), failing)
        return self._health[1]

    async def generate(self, request: Request, out: DeltaSink, *,
                       queue: WaitQueue | None = None) -> Outcome:
        """Run one generation, sending each ``Delta`` to ``out``; raises ``ApiError``.
        ``queue``: the model's wait for a free session (None: a full worker's refusal is
        answered at once). ``request.n`` > 1 or ``best_of``: that many choices, the prompt
        prefilled once (``Pipeline.generate_choices``), deltas tagged with their choice's index
        (``shard.api.choices``); a held choice's deltas go out once the best are known.
        ``echo_logprobs``: the prompt is scored (``Pipeline.generate(prompt_logprobs=True)``: in
        the generation itself for one choice, before it for several or for ``max_tokens`` 0)
        and each choice's first delta is the echoed prompt."""
        total = max(request.n, request.best_of)
        preserved = await self.control_tokens(request.preserved) if request.preserved else {}
        choices = [ChoiceText(i, request.stops, held=total > request.n, preserved=preserved)
                   for i in range(total)]
        counts = {"prompt": 0}
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        got = PipelineResult()
        kind, grammar, grammar_param = request.constraint or ("", "", "")
        prompt, pieces = (await self._prompt_tokens(request) if request.echo_logprobs
                          else (request.prompt, None))
        echoed = False

        async def send(delta: Delta | None) -> None:
            if delta is not None:
                try:  # room in the channel: no second checkpoint for this token
                    out.send_nowait(delta)
                except trio.WouldBlock:  # a slow client: wait for room (back-pressure)
                    await out.send(delta)

        async def echo() -> None:
            """Every choice's echoed prompt, once, before any generated token (the prompt's
            log-probs are all in ``got`` by then)."""
            nonlocal echoed
            if pieces is not None and not echoed:
                echoed = True
                delta = prompt_delta(pieces, got.prompt_logprobs)
                for choice in choices:
                    await send(choice.echo(delta))

        async def on_choice(i: int, step: pb.StepResult) -> bool:
            """Count and send a choice's token; True once a stop sequence ended the choice."""
            if not counts["prompt"]:
                counts["prompt"] = step.n_past  # the first token is sampled after the prompt
                await echo()
            choice = choices[i]
            await send(choice.push(step))
            return choice.stopped

        async def on_token(step: pb.StepResult) -> None:
            if await on_choice(0, step):
                scope.cancel()  # the generation's sessions are reset and released

        async def attempt() -> None:
            async with self.routes.lease(prompt, sessions=total) as (pipeline, route):
                context = min(h.caps.n_ctx_per_session for h in pipeline.hops if h.caps)
                # no generation outlives the context: a larger limit is the context's
                limit = context if request.max_tokens is None else min(request.max_tokens, context)
                options = dict(
                    max_tokens=limit,
                    temperature=request.temperature, top_p=request.top_p,
                    top_logprobs=request.top_logprobs, timeout=self.timeout,
                    speculate=self.speculate, parse_special=request.parse_special, route=route,
                    grammar_kind=kind, grammar=grammar,
                    top_k=request.top_k, min_p=request.min_p,
                    repeat_penalty=request.repeat_penalty,
                    presence_penalty=request.presence_penalty,
                    frequency_penalty=request.frequency_penalty, logit_bias=request.logit_bias,
                )
                within = request.echo_logprobs and total == 1 and limit > 0
                if request.echo_logprobs and not within:  # the prompt scored alone first
                    await pipeline.generate(prompt, seed=seed, result=got, prompt_logprobs=True,
                                            **{**options, "max_tokens": 0})
                    if not limit:
                        return
                if total == 1:
                    await pipeline.generate(prompt, seed=seed, on_token=on_token, result=got,
                                            prompt_logprobs=within, **options)
                    return
                results = await pipeline.generate_choices(
                    prompt, total, seed=seed, on_token=on_choice, **options)
                got.cached_tokens = results[0].cached_tokens

        with trio.CancelScope() as scope:
            try:
                if queue is None:
                    await attempt()
                else:  # its turn among the model's requests; again after a full worker's refusal
                    await queue.run(attempt, started=lambda: any(c.tokens for c in choices),
                                    places=total)  # a session per choice
            except ShardError as err:
                raise from_shard_error(err, prompt_param=request.prompt_param,
                                       grammar_param=grammar_param) from None
        await echo()  # (nothing generated: max_tokens 0)
        for choice in choices:
            if request.max_tokens == 0:
                choice.finish = pb.FINISH_REASON_LENGTH
            delta = choice.end()
            if delta is not None:
                await out.send(delta)
        kept = best(choices, request.n) if total > request.n else choices
        for choice in kept:
            for delta in choice.held or ():
                await out.send(delta)
        return Outcome(kept[0].reason, counts["prompt"] or got.prompt_tokens,
                       sum(c.tokens for c in choices),
                       got.cached_tokens, tuple(c.reason for c in kept))


def _first_worker(pipeline: Pipeline, route: Sequence[str] | None,
                  ) -> tuple[ShardClient, pb.GetCapabilitiesResponse]:
    """The client and capabilities of the worker a lease's first hop runs on: the route's
    (a pool's pick) or the hop's serving replica now."""
    target = route[0] if route else pipeline.hops[0].target
    (replica,) = [r for r in pipeline.replicas[0] if r.target == target]
    assert replica.client is not None and replica.caps is not None
    return replica.client, replica.caps


class Catalog:
    """The models a front door serves, by id: one ``Backend`` (``--target``/``--pipeline``), or
    every model of a pool with a complete route now (``--workers``; a backend is made for a
    model when it first appears and kept, since its routes are the pool's to choose)."""

    def __init__(
        self, backend: Backend | None = None, *, pool: Pool | None = None,
        chat_template: str | None = None, speculate: int = 0, timeout: float | None = None,
    ) -> None:
        assert (backend is None) != (pool is None), "one backend or one pool"
        self.pool = pool
        self._backends: dict[str, Backend] = {backend.model_id: backend} if backend else {}
        self._options = {"chat_template": chat_template, "speculate": speculate,
                         "timeout": timeout}

    def ids(self) -> list[str]:
        """The model ids served now (``/v1/models``)."""
        if self.pool is None:
            return list(self._backends)
        return sorted(self.pool.servable())

    def only(self) -> str | None:
        """The one model served now, None when there are several or none: a request that
        names no model gets it (as llama-server's and Ollama's)."""
        ids = self.ids()
        return ids[0] if len(ids) == 1 else None

    def find(self, model: str) -> Backend | None:
        """The backend of ``model``, None when it is not served now."""
        if self.pool is None:
            return self._backends.get(model)
        if model not in self.pool.servable():
            return None
        backend = self._backends.get(model)
        if backend is None:
            backend = self._backends[model] = Backend(
                PoolRoutes(self.pool, model), model_id=model, **self._options)  # type: ignore[arg-type]
        return backend

    def max_context(self) -> int:
        """The largest context of a model served now (what one request may use at most)."""
        if self.pool is None:
            return max(b.context for b in self._backends.values())
        return max((self.pool.context(m) for m in self.pool.servable()), default=1)

    def get(self, model: str) -> Backend:
        """The backend of ``model``; a 404 naming the models served otherwise."""
        backend = self.find(model)
        if backend is None and self.pool is not None and model in self.pool.known_models():
            why = "; ".join(w for w in self.pool.not_serving() if w.startswith(f"model {model}:"))
            raise ApiError(503, f"the model {model!r} has no complete route now ({why}): retry "
                           "later", type="server_error", code="service_unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        if backend is None:
            served = ", ".join(repr(m) for m in self.ids()) or "none now"
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                           f"{served}", param="model", code="model_not_found")
        return backend

    async def not_serving(self) -> list[str]:
        """Why the door is not ready (empty: it is): a single backend while no replica of some
        hop serves; a pool while a model it knows has no complete route (or none is known)."""
        if self.pool is None:
            (backend,) = self._backends.values()
            return await backend.not_serving()
        await trio.lowlevel.checkpoint()
        return self.pool.not_serving()
