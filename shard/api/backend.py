"""The workers behind the front door: one ``Pipeline`` (a single whole-model worker is a
pipeline of one hop), its shared connections, and one generation as a stream of text deltas.

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
import secrets
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from shard.chat import ChatTemplate, ChatTemplateError
from shard.pipeline import Pipeline
from shard.rpc.errors import ShardError
from shard.v1 import shard_pb2 as pb

from .errors import ApiError, from_shard_error
from .text import Alternative, Delta, TextAssembler, TokenOut

__all__ = ["Backend", "Outcome", "Request"]

log = logging.getLogger(__name__)

_LENGTH = frozenset({pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_CONTEXT_FULL})
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


@dataclass
class Outcome:
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int


class Backend:
    """One pipeline, shared by every request (see the module docstring)."""

    def __init__(
        self, pipeline: Pipeline, *, model_id: str | None = None, chat_template: str | None = None,
        speculate: int = 0, timeout: float | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.speculate = speculate
        self.timeout = timeout
        self._health: tuple[float, list[str]] | None = None  # (when, the answer)
        first = pipeline.hops[0].caps
        assert first is not None
        self.first = first
        #: The id clients ask for; default ``<architecture>-<12 hex digits of the fingerprint>``.
        self.model_id = model_id or f"{first.architecture or 'model'}-{first.model_fingerprint[:12]}"
        #: The chat template (the operator's file over the model's own), None without one. A
        #: model's own template that does not compile leaves chat off (completions still
        #: serve); an operator's file that does not is an error at start.
        try:
            self.chat = ChatTemplate.of(first.chat, chat_template)
        except ChatTemplateError as exc:
            if chat_template is not None:
                raise
            log.error("chat is off: the model's own %s", exc)
            self.chat = None

    @classmethod
    @asynccontextmanager
    async def connect(
        cls, hops: Sequence[Sequence[str]], *, model_id: str | None = None, relay: str = "client",
        ssl_context: ssl.SSLContext | None = None, metadata: Sequence[tuple[str, str]] = (),
        chat_template: str | None = None, speculate: int = 0, timeout: float | None = None,
        step_timeout: float | None = None, connect_timeout: float | None = 30.0,
    ) -> AsyncIterator[Backend]:
        """Connect to every hop (``hops``: each a list of replica targets, first hop first),
        waiting within ``connect_timeout`` for workers still loading."""
        async with Pipeline.connect(
            [list(h) for h in hops], timeout=connect_timeout, ssl_context=ssl_context,
            metadata=metadata, wait_for_ready=True, step_timeout=step_timeout, relay=relay,
        ) as pipeline:
            yield cls(pipeline, model_id=model_id, chat_template=chat_template,
                      speculate=speculate, timeout=timeout)

    @property
    def context(self) -> int:
        """The most positions one generation may hold (the chain's smallest session)."""
        return min(h.caps.n_ctx_per_session for h in self.pipeline.hops if h.caps is not None)

    def render_chat(self, messages: Sequence[dict[str, str]]) -> str:
        """The prompt text of a conversation; a 400 without a template or when it refuses."""
        if self.chat is None:
            raise ApiError(400, "this model has no chat template (its GGUF carries none and the "
                           "front door was started without --chat-template): use /v1/completions",
                           param="messages", code="chat_template_missing")
        if not self.first.parse_special:
            raise ApiError(503, "the first worker does not parse special tokens (parse_special): "
                           "upgrade it to serve chat", type="server_error", code="worker_too_old")
        try:
            return self.chat.render(messages)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages", code="chat_template_error") from None

    async def not_serving(self) -> list[str]:
        """Why the front door cannot serve now: one line per hop none of whose replicas serves
        (logged). The answer is kept for ``HEALTH_TTL`` seconds, so probes cannot multiply into
        Health calls on every worker."""
        now = trio.current_time()
        if self._health is None or now - self._health[0] > HEALTH_TTL:
            failing = [f"{hop}: {why}" for hop, why in await self.pipeline.serving(timeout=2.0)]
            if failing:
                log.warning("not serving: %s", "; ".join(failing))
            self._health = (trio.current_time(), failing)
        return self._health[1]

    async def generate(self, request: Request, out: trio.MemorySendChannel[Delta]) -> Outcome:
        """Run one generation, sending each ``Delta`` to ``out``; raises ``ApiError``."""
        text = TextAssembler(request.stops)
        counts = {"prompt": 0, "completion": 0}
        finish = pb.FINISH_REASON_UNSPECIFIED
        seed = request.seed if request.seed is not None else secrets.randbits(63)

        async def on_token(step: pb.StepResult) -> None:
            nonlocal finish
            if not counts["completion"]:
                counts["prompt"] = step.n_past  # the first token is sampled after the prompt
            counts["completion"] += 1
            lg = step.logits
            delta = text.push(TokenOut(lg.piece, lg.logprob, tuple(
                Alternative(t.piece, t.logprob) for t in lg.top)))
            finish = step.finish_reason
            if delta:
                await out.send(delta)
            if text.stopped:
                scope.cancel()  # the generation's sessions are reset and released

        with trio.CancelScope() as scope:
            try:
                await self.pipeline.generate(
                    # no generation outlives the context: a larger limit is the context's
                    request.prompt, max_tokens=min(request.max_tokens or self.context, self.context),
                    temperature=request.temperature, top_p=request.top_p, seed=seed,
                    top_logprobs=request.top_logprobs, timeout=self.timeout, on_token=on_token,
                    speculate=self.speculate, parse_special=request.parse_special,
                )
            except ShardError as err:
                raise from_shard_error(err, prompt_param=request.prompt_param) from None
        if not text.stopped:
            delta = text.finish()
            if delta:
                await out.send(delta)
        reason = "length" if finish in _LENGTH and not text.stopped else "stop"
        return Outcome(reason, counts["prompt"], counts["completion"])
