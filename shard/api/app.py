"""The OpenAI-compatible HTTP front door as a Starlette app (served by hypercorn on Trio).

Routes: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``,
``POST /v1/chat/completions`` and ``POST /v1/responses`` (whole bodies, or server-sent events
with ``stream: true``),
``GET /health`` (200 only while a replica of every hop serves; over a pool, while every model
its workers report has a complete route) and ``GET /metrics``
(Prometheus); ``POST /tokenize`` and ``/detokenize`` (llama-server's, ``shard.api.tokens``);
``POST /v1/embeddings`` (a whole model that declares a pooling type, ``shard.api.embeddings``). With ``cors_origins`` the
web pages of those origins may call it (``shard.api.cors``). ``/v1`` routes need ``Authorization: Bearer KEY`` when the app has keys; health
and metrics do not (probes and scrapers; they show counts, never text).

Request bodies are read up to ``Limits.max_body_bytes`` (413 past it), must be a JSON object (400
otherwise) and are checked by the Pydantic models of ``shard.api.schemas`` before any worker is
asked: unknown and unsupported parameters are refused with a 400 naming them.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import aclosing
from typing import Any

import trio
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from shard.rpc.auth import TokenAuthenticator

from .backend import Backend, Catalog, Request
from .bodies import BodyBudget, Holding, count_values, value_limit
from .cors import CorsMiddleware
from .embeddings import embedding_inputs, embedding_reply, embedding_values
from .errors import ApiError
from .limits import DEFAULT_LIMITS, KeySlots, Limits
from .metrics import ApiMetrics
from .queue import Queues
from .replies import ChatReply, CompletionReply, Reply, system_fingerprint
from .responses import ResponsesReply, ResponsesRequest
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    GenerationRequest,
    Model,
    ModelList,
)
from .streaming import GenerationResponse
from .tokens import DetokenizeRequest, TokenizeRequest, detokenized, tokenized
from .tools import plan_tools

__all__ = ["build_app"]

log = logging.getLogger(__name__)

#: Bodies from this size on are counted (``shard.api.bodies``), then decoded, checked and
#: rendered (chat) in a worker thread: a 4 MiB conversation of many short messages takes the
#: better part of a second of Python, which on the event loop would stall every other request's
#: stream for as long.
OFF_LOOP_BYTES = 64 * 1024
#: ``max_tokens`` of a completion that gives none (or null), as OpenAI's.
DEFAULT_COMPLETION_TOKENS = 16


def build_app(
    backend: Backend | Catalog, *, keys: TokenAuthenticator | None = None, limits: Limits = DEFAULT_LIMITS,
    metrics: ApiMetrics | None = None, loopback_hosts_only: bool = False,
    cors_origins: Sequence[str] = (),
) -> Starlette:
    """The front door over ``backend`` (one model, or a ``Catalog`` of them); ``keys``: the
    accepted API keys (None: no key needed), ``limits``: what a request and a key may take.
    ``loopback_hosts_only``: refuse requests whose ``Host`` is not a loopback name (a door on
    loopback without keys: a web page that rebinds its own name to 127.0.0.1 would otherwise
    be same-origin with it and read its answers). ``cors_origins``: the web origins whose pages
    may call it (``shard.api.cors``; empty: none, ``*``: any)."""
    metrics = metrics if metrics is not None else ApiMetrics()
    catalog = backend if isinstance(backend, Catalog) else Catalog(backend)
    created = int(time.time())
    max_body_bytes = limits.max_body_bytes
    slots = KeySlots(limits.requests_per_key)
    queues = Queues(length=limits.queue_length, timeout=limits.queue_timeout, metrics=metrics)
    bodies = BodyBudget(limits.max_total_body_bytes)

    def model_card(model_id: str) -> Model:
        backend = catalog.find(model_id)
        return Model(id=model_id, created=created,
                     context_length=backend.context if backend is not None else None)

    def principal(request: HttpRequest) -> str | None:
        if loopback_hosts_only and not _loopback_host(request.headers.get("host", "")):
            raise ApiError(403, "this server answers requests for a loopback host only (it has "
                           "no API keys)", code="host_not_allowed")
        if keys is None:
            return None
        scheme, _, key = request.headers.get("authorization", "").strip().partition(" ")
        who = keys.principal(key.strip().encode()) if scheme.lower() == "bearer" and key.strip() else None
        if who is None:
            raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)",
                           code="invalid_api_key")
        return who

    async def read(request: HttpRequest, holding: Holding) -> bytes:
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            # Also what keeps a web page's form posts out: a browser sends application/json to
            # another origin only after a CORS preflight, which this server answers only for
            # the origins the operator lists (``cors_origins``).
            raise ApiError(415, f"the body must be application/json, not {media or 'untyped'}",
                           code="unsupported_media_type")
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            raise ApiError(413, f"request body over {max_body_bytes} bytes", code="body_too_large")
        chunks, total = [], 0
        with trio.move_on_after(limits.body_timeout) as waited:
            async with aclosing(request.stream()) as stream:  # closed when a check raises too
                async for chunk in stream:
                    total += len(chunk)
                    if total > max_body_bytes:
                        raise ApiError(413, f"request body over {max_body_bytes} bytes",
                                       code="body_too_large")
                    holding.add(len(chunk))
                    chunks.append(chunk)
        if waited.cancelled_caught:
            raise ApiError(408, f"the request body did not arrive within {limits.body_timeout:g} "
                           "s", code="request_timeout", headers={"Connection": "close"})
        return b"".join(chunks)

    def beyond_context(raw: dict[str, Any], backend: Backend, model: type[Any]) -> None:
        """Refuse a conversation of more messages, or a prompt of more token ids, than a
        session has positions (each message renders to one token at least) before validating
        it: validation is one call into pydantic-core that holds the GIL, and a 4 MiB body of
        short messages would hold it for a good part of a second, stalling every stream on the
        event loop."""
        limit = backend.context
        params = ("messages", "prompt", "input", "tokens") if model is not EmbeddingRequest else ()
        for param in params:  # (an embedding's inputs: shard.api.embeddings bounds each)
            items = raw.get(param)
            if param == "prompt" and isinstance(items, list) and items and isinstance(items[0], list):
                items = max(items, key=lambda p: len(p) if isinstance(p, list) else 0)  # [[ids]]
            if isinstance(items, list) and len(items) > limit:
                raise ApiError(400, f"{param} holds {len(items)} items, more than the {limit} "
                               "positions of a session", param=param, code="context_length_exceeded")

    def decode(data: bytes, model: type[Any]) -> tuple[Any, Backend]:
        try:
            raw = json.loads(data, parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, nesting
            raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(raw, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        named = raw.get("model")
        if named is None:  # absent or null: the one model served, if one
            named = catalog.only()
        backend = catalog.find(named) if isinstance(named, str) else None
        if backend is not None:
            beyond_context(raw, backend, model)
        try:
            body = model.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(x) for x in first["loc"]) or None
            kind = "unknown parameter" if first["type"] == "extra_forbidden" else first["msg"]
            raise ApiError(400, f"{param}: {kind}", param=param, code="invalid_parameter") from None
        refused = body.unsupported()
        if refused is not None:
            raise ApiError(400, refused[1], param=refused[0], code="unsupported_parameter")
        if backend is None and body.model is None:
            served = ", ".join(repr(m) for m in catalog.ids()) or "none now"
            raise ApiError(400, f"model: required, this server serves {served}", param="model",
                           code="invalid_parameter")
        return body, backend if backend is not None else catalog.get(body.model)  # type: ignore[arg-type]

    def sampling(body: GenerationRequest, backend: Backend) -> dict[str, Any]:
        bias = body.token_biases
        if bias and max(bias) >= backend.first.n_vocab:
            raise ApiError(400, f"logit_bias: token id {max(bias)} is not in "
                           f"[0, {backend.first.n_vocab})", param="logit_bias",
                           code="invalid_parameter")
        return {"temperature": 1.0 if body.temperature is None else body.temperature,
                "top_p": 1.0 if body.top_p is None else body.top_p,
                "seed": None if body.seed is None else body.seed % 2**64,
                "stops": body.stops, "top_k": body.top_k or 0, "min_p": body.min_p or 0.0,
                "repeat_penalty": 1.0 if body.repeat_penalty is None else body.repeat_penalty,
                "presence_penalty": body.presence_penalty or 0.0,
                "frequency_penalty": body.frequency_penalty or 0.0, "logit_bias": bias,
                **choices(body, backend)}

    def choices(body: GenerationRequest, backend: Backend) -> dict[str, int]:
        """``n`` and ``best_of``: each choice takes a session on every hop of the one route
        the request runs on, so more than the largest route's sessions could never run (400;
        checked here, before the wait for a route: a pool's other routes do not add up for
        it, and the lease then takes a route that fits); fewer wait in the model's queue as
        one request."""
        n = body.n or 1
        best_of = getattr(body, "best_of", None) or n
        capacity = backend.routes.route_capacity()
        if capacity is not None and best_of > capacity:
            param = "best_of" if best_of > n else "n"
            raise ApiError(400, f"{param}={best_of} choices need as many sessions on one "
                           f"route, and the model's largest route has {capacity}", param=param,
                           code="unsupported_parameter")
        return {"n": n, "best_of": best_of}

    def encodable(text: str, param: str) -> None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate ("\ud800" is valid JSON)
            raise ApiError(400, f"{param} is not valid Unicode (a lone surrogate)", param=param,
                           code="invalid_parameter") from None

    def checked_prompt(prompt: str | list[int], backend: Backend) -> str | list[int]:
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_parameter")
        if isinstance(prompt, str):
            encodable(prompt, "prompt")
        elif not all(0 <= t < backend.first.n_vocab for t in prompt):
            raise ApiError(400, f"token ids must be in [0, {backend.first.n_vocab})",
                           param="prompt", code="invalid_parameter")
        return prompt

    def include_usage(body: GenerationRequest) -> bool:
        return body.stream_options is not None and body.stream_options.include_usage

    def completion_job(data: bytes) -> tuple[GenerationRequest, Backend, list[Request], Reply]:
        body, backend = decode(data, CompletionRequest)
        assert isinstance(body, CompletionRequest)
        prompts = [checked_prompt(p, backend) for p in body.prompts]
        jobs = [Request(prompt=p, max_tokens=DEFAULT_COMPLETION_TOKENS if body.max_tokens is None
                        else body.max_tokens, top_logprobs=body.logprobs or 0,
                        constraint=body.constraint(), echo_logprobs=body.echo_logprobs,
                        **sampling(body, backend)) for p in prompts]
        n = body.n or 1  # each prompt's choices follow one another (OpenAI's order)
        # (with logprobs each choice's first delta is its prompt: shard.api.echo)
        echo = ([p for p in prompts if isinstance(p, str) for _ in range(n)]
                if body.echo and not body.echo_logprobs else [])
        return body, backend, jobs, CompletionReply(
            backend.model_id, logprobs=body.logprobs, include_usage=include_usage(body),
            fingerprint=system_fingerprint(backend.first.model_fingerprint), echo=echo)

    def chat_job(data: bytes) -> tuple[GenerationRequest, Backend, list[Request], Reply]:
        body, backend = decode(data, ChatCompletionRequest)
        assert isinstance(body, ChatCompletionRequest)
        for i, m in enumerate(body.messages):
            encodable(m.text, f"messages.{i}.content")
            for c in m.tool_calls or ():
                encodable(c.function.arguments, f"messages.{i}.tool_calls")
        tools = plan_tools(body, backend.chat)  # (tools, tool_choice, tool messages)
        text = backend.render_chat(tools.messages, tools=tools.tools)
        job = Request(prompt=text, max_tokens=body.token_limit,
                      top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0,
                      prompt_param="messages", constraint=tools.constraint or body.constraint(),
                      preserved=tools.preserved, **sampling(body, backend))
        return body, backend, [job], ChatReply(
            backend.model_id, logprobs=bool(body.logprobs), include_usage=include_usage(body),
            fingerprint=system_fingerprint(backend.first.model_fingerprint),
            tool_format=tools.parse, n=job.n)

    def responses_job(data: bytes) -> tuple[ResponsesRequest, Backend, list[Request], Reply]:
        body, backend = decode(data, ResponsesRequest)
        for param, text in body.texts():
            encodable(text, param)
        tools = plan_tools(body.chat_request(), backend.chat)  # as a chat request's
        text = backend.render_chat(tools.messages, tools=tools.tools)
        job = Request(prompt=text, max_tokens=body.max_output_tokens, prompt_param="input",
                      temperature=1.0 if body.temperature is None else body.temperature,
                      top_p=1.0 if body.top_p is None else body.top_p,
                      constraint=tools.constraint, preserved=tools.preserved)
        return body, backend, [job], ResponsesReply(backend.model_id, body, tools.parse)

    async def generation(
        request: HttpRequest, endpoint: str,
        prepare: Callable[[bytes], tuple[GenerationRequest | ResponsesRequest, Backend,
                                         list[Request], Reply]],
    ) -> GenerationResponse:
        """Check the body and build the job; a large body in a worker thread (see
        ``OFF_LOOP_BYTES``)."""
        started = trio.current_time()
        who = principal(request)
        with bodies.hold() as holding:
            data = await read(request, holding)
            if len(data) < OFF_LOOP_BYTES:
                body, backend, jobs, reply = prepare(data)
            else:  # counted first, a chunk at a time: decoding 100,000s of values holds the GIL
                await count_values(data, value_limit(catalog.max_context()))
                body, backend, jobs, reply = await trio.to_thread.run_sync(prepare, data)
        queue = queues.of(backend.model_id, backend.routes.capacity)
        return GenerationResponse(backend, jobs, reply, stream=bool(body.stream), endpoint=endpoint,
                                  metrics=metrics, started=started, principal=who, user=body.user,
                                  limits=limits, slots=slots, queue=queue)

    async def completions(request: HttpRequest) -> GenerationResponse:
        return await generation(request, "completions", completion_job)

    async def chat_completions(request: HttpRequest) -> GenerationResponse:
        return await generation(request, "chat_completions", chat_job)

    async def responses(request: HttpRequest) -> GenerationResponse:
        return await generation(request, "responses", responses_job)

    async def decoded(request: HttpRequest, model: type[Any],
                      values: int | None = None) -> tuple[Any, Backend]:
        """A body that starts no generation, read and checked as a generation's is (``values``:
        the most JSON values it may hold, a generation's by default)."""
        principal(request)
        with bodies.hold() as holding:
            data = await read(request, holding)
            if len(data) < OFF_LOOP_BYTES:
                return decode(data, model)
            limit = values if values is not None else value_limit(catalog.max_context())
            await count_values(data, limit)  # see ``generation``
            return await trio.to_thread.run_sync(decode, data, model)

    async def tokenize(request: HttpRequest) -> Response:
        body, backend = await decoded(request, TokenizeRequest)
        encodable(body.content, "content")
        reply = await backend.tokenize(body.content, add_bos=body.add_special,
                                       parse_special=body.parse_special,
                                       with_pieces=body.with_pieces)
        return JSONResponse(tokenized(reply, body.with_pieces))

    async def detokenize(request: HttpRequest) -> Response:
        body, backend = await decoded(request, DetokenizeRequest)
        if not all(0 <= t < backend.first.n_vocab for t in body.tokens):
            raise ApiError(400, f"token ids must be in [0, {backend.first.n_vocab})",
                           param="tokens", code="invalid_parameter")
        reply = await backend.tokenize(tokens=body.tokens, param="tokens")
        return JSONResponse(detokenized(reply))

    async def embeddings(request: HttpRequest) -> Response:
        """Pooled embeddings from a worker serving a whole model that declares a pooling type
        (``shard.api.embeddings``); a 400 for a text model or a pipeline, as llama-server's."""
        body, backend = await decoded(request, EmbeddingRequest,
                                      values=embedding_values(catalog.max_context()))
        first = backend.first
        items = embedding_inputs(body, n_vocab=first.n_vocab, context=backend.context)
        with slots.take(principal(request)):  # a key's embeddings count as its generations do
            got = await backend.embed(items, dimensions=body.dimensions)
        return JSONResponse(embedding_reply(backend.model_id, got,
                                            as_base64=body.encoding_format == "base64"))

    async def models(request: HttpRequest) -> Response:
        principal(request)
        return JSONResponse(ModelList(data=[model_card(m) for m in catalog.ids()]).model_dump())

    async def model(request: HttpRequest) -> Response:
        principal(request)
        if catalog.find(request.path_params["model"]) is None:
            raise ApiError(404, f"the model {request.path_params['model']!r} does not exist",
                           param="model", code="model_not_found")
        return JSONResponse(model_card(request.path_params["model"]).model_dump())

    async def health(request: HttpRequest) -> Response:
        if await catalog.not_serving():  # the hops and why: in the log, not for anyone asking
            return JSONResponse({"status": "unavailable"}, status_code=503)
        ids = catalog.ids()
        if catalog.pool is None:
            return JSONResponse({"status": "ok", "model": ids[0]})
        return JSONResponse({"status": "ok", "models": ids})

    async def prometheus(request: HttpRequest) -> Response:
        if catalog.pool is not None:
            metrics.show_pool(catalog.pool)
        return Response(metrics.render(), media_type=metrics.content_type)

    def counted(endpoint: str, handler: Any) -> Any:
        """Refusals before a generation starts are counted and answered in OpenAI's shape; a
        generation's own response counts itself (``GenerationResponse``)."""

        async def run(request: HttpRequest) -> Any:
            try:
                response = await handler(request)
            except ApiError as err:
                metrics.requests.labels(endpoint, str(err.status)).inc()
                return err.response()
            if not isinstance(response, GenerationResponse):
                metrics.requests.labels(endpoint, str(response.status_code)).inc()
            return response

        return run

    routes = [
        Route("/v1/models", counted("models", models), methods=["GET"]),
        Route("/v1/models/{model:path}", counted("models", model), methods=["GET"]),
        Route("/v1/completions", counted("completions", completions), methods=["POST"]),
        Route("/v1/chat/completions", counted("chat_completions", chat_completions), methods=["POST"]),
        Route("/v1/responses", counted("responses", responses), methods=["POST"]),
        Route("/tokenize", counted("tokenize", tokenize), methods=["POST"]),
        Route("/detokenize", counted("detokenize", detokenize), methods=["POST"]),
        Route("/v1/embeddings", counted("embeddings", embeddings), methods=["POST"]),
        Route("/health", counted("health", health), methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
    middleware = [Middleware(CorsMiddleware, origins=cors_origins)] if cors_origins else []
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={
        404: _not_found, 405: _not_allowed,
    })
    app.state.metrics = metrics
    return app


def _no_constant(name: str) -> Any:
    """``NaN``, ``Infinity`` and ``-Infinity`` are not JSON (RFC 8259): refused as by the
    tokenizer that counts a large body first (``shard.api.bodies``)."""
    raise ValueError(f"{name} is not a JSON value")


def _loopback_host(host: str) -> bool:
    """Whether a ``Host`` header names this machine by a loopback name or address."""
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


async def _not_found(request: HttpRequest, exc: Exception) -> Response:
    return ApiError(404, f"no route {request.url.path}", code="not_found").response()


async def _not_allowed(request: HttpRequest, exc: Exception) -> Response:
    return ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                    code="method_not_allowed").response()
