"""``trio-shard api``: the OpenAI-compatible HTTP front door (``shard.api``) over one worker, a
chain (``--pipeline``) or a pool (``--workers``). Every option can also come from
``TRIO_SHARD_API_<OPTION>``."""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shard.cli.common import fail, read_chat_template, workers_source
from shard.cli.credentials import client_options
from shard.cli.env import API_ENV_PREFIX, Options
from shard.cli.options import (
    DEFAULT_API_PORT,
    add_pool_options,
    add_target,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
)

if TYPE_CHECKING:
    from shard.api.server import HttpTls

NAME = "api"


def add_parser(sub: Any) -> Options:
    """The ``api`` command's options."""
    parser = sub.add_parser(
        "api", help="serve an OpenAI-compatible HTTP API over a worker or a pipeline",
        description="Serve GET /v1/models, POST /v1/completions, POST /v1/chat/completions and "
        "POST /v1/responses (streaming as server-sent events), POST /tokenize and /detokenize, "
        "POST /v1/embeddings (a whole-model worker of a model that declares a pooling type), "
        "GET /health and GET /metrics over one worker "
        "serving a whole model (--target) or a chain of workers (--pipeline), on hypercorn "
        "(docs/api.md). Chat renders the model's own chat template, which the first worker "
        "reports. Every option can also come from TRIO_SHARD_API_<OPTION>.",
    )
    opts = Options(parser, API_ENV_PREFIX)
    add_target(opts, pipeline=True, workers=True)
    add_pool_options(opts)
    opts.add("--relay", choices=["client", "chain"], default="client",
             help="with --pipeline: who carries the hidden states between hops (see "
             "`generate --relay`; default: client)")
    opts.add("--speculate", type=non_negative_int, default=0, metavar="K",
             help="with --pipeline: draft up to K tokens by prompt lookup per pass (see "
             "`generate --speculate`; default: 0, off)")
    opts.add("--step-timeout", type=positive_float, metavar="SECONDS",
             help="a worker that answers no step within this many seconds counts as hung "
             "and its hop fails over to a replica (default: no bound but --timeout)")
    opts.add("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    opts.add("--port", type=port, default=DEFAULT_API_PORT,
             help=f"port to bind, 0 picks a free one (default: {DEFAULT_API_PORT})")
    opts.add("--model-name", metavar="NAME",
             help="the model id clients ask for (default: the name the workers report, "
             "`serve --model-name`, a packaged model's name by default; else the "
             "architecture and the first 12 hex digits of the model fingerprint, e.g. "
             "llama-0123456789ab); with --workers each model's id is the workers' own")
    opts.add("--chat-template", type=Path, metavar="FILE",
             help="render chat with this Jinja2 template instead of the model's own")
    opts.add("--api-key-file", type=Path, metavar="FILE",
             help="require 'Authorization: Bearer KEY' on /v1 routes; FILE holds one "
             "'KEY [NAME]' per line, re-read on SIGHUP")
    opts.add("--http-tls-cert", type=Path, metavar="PEM",
             help="serve HTTPS with this certificate chain (with --http-tls-key)")
    opts.add("--http-tls-key", type=Path, metavar="PEM", help="private key for --http-tls-cert")
    opts.add("--http-tls-client-ca", type=Path, metavar="PEM",
             help="require client certificates signed by this CA (mutual TLS)")
    opts.add("--insecure", action="store_true",
             help="allow serving on a non-loopback --host without --api-key-file or "
             "--http-tls-client-ca (TLS alone does not say who may generate)")
    opts.add("--cors-origin", action="extend", type=cors_origins, default=[], metavar="ORIGIN",
             help="let web pages of this origin (scheme://host[:port], or * for any) call the "
             "API from a browser: preflights answered, responses readable; repeatable or a "
             "comma list (default: none, cross-origin pages cannot read the answers)")
    opts.add("--timeout", type=positive_float, default=600.0,
             help="deadline in seconds of one generation (default: 600)")
    opts.add("--connect-timeout", type=positive_float, default=60.0,
             help="seconds to wait at start for the workers to listen, answer and serve, so "
             "the door may start with its workers (default: 60)")
    opts.add("--send-timeout", type=positive_float, default=30.0, metavar="SECONDS",
             help="a client that takes no data for this long (it stopped reading) has its "
             "generation cancelled and its sessions released (default: 30)")
    opts.add("--keepalive", type=non_negative_float, default=15.0, metavar="SECONDS",
             help="a stream silent this long (a long prompt, a slow hop) sends an SSE "
             "comment so that proxies do not cut it; 0 sends none (default: 15)")
    opts.add("--requests-per-key", type=positive_int, metavar="N",
             help="with --api-key-file: generations one key (its NAME) may run at once, "
             "more get 429, so one key cannot take every session (default: no bound)")
    opts.add("--queue-length", type=non_negative_int, default=64, metavar="N",
             help="requests per model that may wait for a session while all are in use, "
             "served in order as sessions free; more get 429 with Retry-After (0: no queue, "
             "429 at once; default: 64)")
    opts.add("--queue-timeout", type=positive_float, default=60.0, metavar="SECONDS",
             help="a request that has waited this long for a session gets 429 with "
             "Retry-After (default: 60)")
    opts.add("--max-body-bytes", type=positive_int, default=4 * 2**20,
             help="largest request body accepted, larger ones get 413 (default: 4 MiB)")
    opts.add("--max-total-body-bytes", type=positive_int, default=64 * 2**20,
             help="bytes all request bodies being received or checked may hold at once, "
             "across connections; a body past it gets 503 and its connection is closed "
             "(default: 64 MiB)")
    opts.add("--body-timeout", type=positive_float, default=30.0, metavar="SECONDS",
             help="a request body that has not arrived whole after this long gets 408 and "
             "its connection is closed (a client trickling bytes holds nothing; "
             "default: 30)")
    opts.add("--grace", type=non_negative_float, default=10.0,
             help="seconds running requests may finish after SIGTERM/SIGINT (default: 10)")
    opts.add("--log-format", choices=["text", "json"], default="text",
             help="log lines as text or as one JSON object each (default: text)")
    return opts


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 2 for options or files that cannot be used, 1 when the
    workers cannot serve or the port cannot be bound."""
    from shard.rpc.auth import TokenAuthenticator, TokenFileError, binding_refusal

    hops = args.pipeline if args.pipeline is not None else [[args.target]]
    workers = None
    if args.workers is not None:
        if args.model_name is not None:
            return fail("--model-name: with --workers each model's id is the one its workers "
                        "report (serve --model-name)", 2)
        workers = workers_source(args.workers, resolve_interval=args.resolve_interval)
        hops = None
    elif args.pipeline is None and (args.relay != "client" or args.speculate):
        return fail("--relay and --speculate need --pipeline or --workers", 2)
    try:
        options = client_options(args)
        tls = http_tls(args)
    except (ValueError, OSError, ssl.SSLError) as exc:
        return fail(f"set-up failed: {exc}", 2)
    keys = None
    if args.api_key_file is not None:
        try:
            keys = TokenAuthenticator(args.api_key_file)
        except TokenFileError as exc:
            return fail(str(exc), 2)
    # TLS alone keeps the traffic private, not the model: who may generate is the keys' or the
    # client certificates' to say.
    who = keys is not None or (tls is not None and tls.client_ca is not None)
    if binding_refusal(args.host, tls=False, authenticated=who, insecure=args.insecure):
        return fail(f"refusing to serve the API on non-loopback address {args.host or '(all)'!r} "
                    "without API keys or client certificates: anyone who can connect could "
                    "generate with the model. Add --api-key-file, or --http-tls-client-ca (with "
                    "--http-tls-cert/--http-tls-key), or pass --insecure.", 2)
    if args.requests_per_key is not None and keys is None:
        return fail("--requests-per-key needs --api-key-file (requests are counted by key)", 2)
    from shard.api.limits import Limits

    if args.max_total_body_bytes < args.max_body_bytes:
        return fail("--max-total-body-bytes must be at least --max-body-bytes", 2)
    limits = Limits(max_body_bytes=args.max_body_bytes, send_timeout=args.send_timeout,
                    keepalive=args.keepalive or None, requests_per_key=args.requests_per_key,
                    body_timeout=args.body_timeout, max_total_body_bytes=args.max_total_body_bytes,
                    queue_length=args.queue_length, queue_timeout=args.queue_timeout)
    template = read_chat_template(args.chat_template)

    import functools

    import trio

    from shard.api import run_api
    from shard.chat import ChatTemplateError
    from shard.client import ShardError

    try:
        trio.run(functools.partial(
            run_api, hops, host=args.host, port=args.port, tls=tls, keys=keys,
            model_name=args.model_name, chat_template=template, relay=args.relay,
            speculate=args.speculate, step_timeout=args.step_timeout, timeout=args.timeout,
            connect_timeout=args.connect_timeout, limits=limits, grace=args.grace,
            workers=workers, probe_interval=args.probe_interval, cors_origins=args.cors_origin,
            **options,
        ))
    except ChatTemplateError as exc:
        return fail(str(exc), 2)
    except ShardError as exc:
        return fail(f"the workers cannot serve: {exc}")
    except OSError as exc:
        return fail(f"cannot serve on {args.host}:{args.port}: {exc.strerror or exc}")
    return 0


def cors_origins(text: str) -> list[str]:
    """``--cors-origin``'s text -> its origins (argparse's usage error for a bad one)."""
    from shard.api.cors import parse_origins

    try:
        return parse_origins(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def http_tls(args: argparse.Namespace) -> HttpTls | None:
    """The front door's own TLS, None for plaintext; ValueError for half a pair."""
    from shard.api.server import HttpTls

    if (args.http_tls_cert is None) != (args.http_tls_key is None):
        raise ValueError("--http-tls-cert and --http-tls-key go together")
    if args.http_tls_cert is None:
        if args.http_tls_client_ca is not None:
            raise ValueError("--http-tls-client-ca needs --http-tls-cert and --http-tls-key")
        return None
    return HttpTls(args.http_tls_cert, args.http_tls_key, args.http_tls_client_ca)
