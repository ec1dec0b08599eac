"""``trio-shard`` command line: argument parsing and wiring only, no logic of its own.

Commands: ``serve`` (run a worker), ``generate`` and ``caps`` (talk to a worker), and
``make-model`` (write a small GGUF file locally).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import ssl
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily at run time so --help stays fast
    import trio

    from shard.rpc.server import RunningServer

DEFAULT_PORT = 50051


def _int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers in ``[minimum, maximum]``, with a clear message."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)
_port = _int_at_least(0, 65535)


def _target(text: str) -> str:
    """HOST:PORT (an IPv6 host in brackets), checked here so that a typo is a usage error."""
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return text


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-shard",
        description="Serve one shard of a GGUF language model over gRPC (Shard protocol v1).",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default: INFO)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve", help="serve a GGUF model over gRPC",
        description="Load a GGUF model with llama.cpp and serve the Shard protocol. Without "
        "--model, serves the embedded tiny model (written locally on first use, no download).",
    )
    serve.add_argument("--model", type=Path, help="GGUF file (default: the embedded tiny model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=DEFAULT_PORT,
                       help=f"port to bind, 0 picks a free one (default: {DEFAULT_PORT})")
    serve.add_argument("--threads", type=_positive_int, help="llama.cpp threads (default: half the cores, at most 8)")
    serve.add_argument("--ctx", type=_positive_int, default=4096,
                       help="total KV context, shared evenly by sessions (default: 4096)")
    serve.add_argument("--max-sessions", type=_positive_int, default=4,
                       help="most concurrently open sessions (default: 4)")
    serve.add_argument("--batch", type=_positive_int, default=512,
                       help="prefill batch size in tokens (default: 512)")
    serve.add_argument("--tls-cert", type=Path, metavar="PEM",
                       help="serve TLS with this certificate chain (with --tls-key)")
    serve.add_argument("--tls-key", type=Path, metavar="PEM", help="private key for --tls-cert")
    serve.add_argument("--tls-client-ca", type=Path, metavar="PEM",
                       help="require client certificates signed by this CA (mutual TLS)")
    serve.add_argument("--grace", type=_non_negative_float, default=10.0,
                       help="seconds running sessions may finish after SIGTERM/SIGINT before "
                       "they are cancelled; a second signal stops at once (default: 10)")
    serve.add_argument("--resume-ttl", type=_non_negative_float, default=60.0,
                       help="seconds a session's KV cache is kept after its stream ends without "
                       "release, for resume (default: 60)")

    gen = sub.add_parser(
        "generate", help="generate text from a running worker",
        description="Stream generated text from a worker serving a whole model.",
    )
    gen.add_argument("prompt", metavar="PROMPT", help="prompt text")
    _add_target(gen)
    gen.add_argument("--max-tokens", type=_positive_int, default=64,
                     help="most tokens to generate (default: 64)")
    gen.add_argument("--temperature", type=_non_negative_float, default=0.0,
                     help="sampling temperature, 0 = greedy (default: 0)")
    gen.add_argument("--seed", type=_non_negative_int, default=0, help="sampling seed (default: 0)")
    gen.add_argument("--timeout", type=_non_negative_float, default=60.0,
                     help="deadline in seconds for the whole call (default: 60)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object with 'text' and 'tokens' instead of streaming")

    caps = sub.add_parser("caps", help="show what a running worker serves")
    _add_target(caps)
    caps.add_argument("--timeout", type=_non_negative_float, default=10.0,
                      help="deadline in seconds (default: 10)")
    caps.add_argument("--json", action="store_true", help="print JSON")

    mk = sub.add_parser(
        "make-model", help="write a small GGUF model file (no download)",
        description="Write a deterministic GGUF model with random weights and a real tokenizer.",
    )
    mk.add_argument("--preset", default="tiny", help="tiny (default) or bench (214 MB, Q8_0)")
    mk.add_argument("--out", type=Path, required=True, help="output file")
    return parser


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=_target, default=f"127.0.0.1:{DEFAULT_PORT}",
                   help=f"worker address HOST:PORT (default: 127.0.0.1:{DEFAULT_PORT})")
    p.add_argument("--tls-ca", type=Path, metavar="PEM",
                   help="connect with TLS, trusting this CA bundle")
    p.add_argument("--tls-cert", type=Path, metavar="PEM",
                   help="client certificate chain for mutual TLS (with --tls-key)")
    p.add_argument("--tls-key", type=Path, metavar="PEM", help="client private key")


def _tls_pair_given(args: argparse.Namespace) -> bool:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    return args.tls_cert is not None


def _server_ssl_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """TLS for ``serve``: certificate + key, and with --tls-client-ca, required client certs."""
    if not _tls_pair_given(args):
        if args.tls_client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(args.tls_cert, args.tls_key)
    if args.tls_client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(args.tls_client_ca)
    return ctx


def _client_ssl_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """TLS for ``generate``/``caps``: enabled by --tls-ca (or a client certificate)."""
    pair = _tls_pair_given(args)
    if args.tls_ca is None and not pair:
        return None
    ctx = ssl.create_default_context(cafile=args.tls_ca)
    if pair:
        ctx.load_cert_chain(args.tls_cert, args.tls_key)
    return ctx


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    handler = {
        "serve": _cmd_serve,
        "generate": _cmd_generate,
        "caps": _cmd_caps,
        "make-model": _cmd_make_model,
    }[args.command]
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `trio-shard caps | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # quiet exit flush
        return 0


def _fail(message: str, code: int = 1) -> int:
    print(f"trio-shard: error: {message}", file=sys.stderr)
    return code


def _cmd_make_model(args: argparse.Namespace) -> int:
    from shard.models import PRESETS, write_model

    if args.preset not in PRESETS:
        return _fail(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}", 2)
    path = write_model(args.preset, args.out, progress=sys.stderr.isatty())
    print(path)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import trio

    from shard.engine import EngineError, LoadSpec
    from shard.engine.llama import LlamaCppEngine
    from shard.models import ensure_model
    from shard.rpc.errors import unwrap_single_exception
    from shard.rpc.server import serve

    model = args.model if args.model is not None else ensure_model("tiny")
    spec = LoadSpec(
        model_path=model,
        n_ctx=args.ctx,
        n_threads=args.threads,
        max_sessions=args.max_sessions,
        n_batch=args.batch,
    )
    try:
        ssl_context = _server_ssl_context(args)
    except (ValueError, OSError, ssl.SSLError) as exc:
        return _fail(f"TLS set-up failed: {exc}", 2)
    logging.getLogger("shard").info("model: %s", model)

    async def run() -> None:
        async with LlamaCppEngine() as engine:
            with unwrap_single_exception():  # report OSError / EngineError, not a group
                async with trio.open_nursery() as nursery:
                    # The port is bound first (health NOT_READY while loading), then the load.
                    server = await nursery.start(functools.partial(
                        serve, engine, host=args.host, port=args.port, load=spec,
                        resume_ttl=args.resume_ttl, ssl_context=ssl_context,
                    ))
                    nursery.start_soon(_stop_on_signal, server, nursery.cancel_scope, args.grace)

    try:
        trio.run(run)
    except EngineError as exc:
        return _fail(f"{exc.code}: {exc.message}")
    except OSError as exc:
        return _fail(f"cannot serve on {args.host}:{args.port}: {exc.strerror or exc}")
    return 0


async def _stop_on_signal(server: RunningServer, scope: trio.CancelScope, grace: float) -> None:
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


def _cmd_generate(args: argparse.Namespace) -> int:
    import trio

    try:
        ssl_context = _client_ssl_context(args)
    except (ValueError, OSError, ssl.SSLError) as exc:
        return _fail(f"TLS set-up failed: {exc}", 2)

    from shard.client import ShardClient, ShardError
    from shard.v1 import shard_pb2 as pb

    async def run() -> int:
        text: list[str] = []
        tokens: list[int] = []
        finish = pb.FINISH_REASON_UNSPECIFIED
        async with ShardClient.connect(
            args.target, timeout=args.timeout, ssl_context=ssl_context
        ) as client:
            async for chunk in client.generate_text(
                args.prompt,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                seed=args.seed,
            ):
                tokens.append(chunk.token_id)
                text.append(chunk.text)
                finish = chunk.finish_reason or finish
                if not args.json and chunk.text:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
        if args.json:
            reason = pb.FinishReason.Name(finish).removeprefix("FINISH_REASON_").lower()
            print(json.dumps({"text": "".join(text), "tokens": tokens, "finish_reason": reason}))
        else:
            sys.stdout.write("\n")
        return 0

    try:
        return trio.run(run)
    except ShardError as exc:
        return _fail(str(exc))


def _cmd_caps(args: argparse.Namespace) -> int:
    import trio

    try:
        ssl_context = _client_ssl_context(args)
    except (ValueError, OSError, ssl.SSLError) as exc:
        return _fail(f"TLS set-up failed: {exc}", 2)

    from shard.client import ShardClient, ShardError

    async def run() -> dict[str, object]:
        async with ShardClient.connect(
            args.target, timeout=args.timeout, ssl_context=ssl_context
        ) as client:
            return await client.capabilities_dict()

    try:
        caps = trio.run(run)
    except ShardError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(caps, indent=2, sort_keys=True))
    else:
        width = max(len(k) for k in caps)
        for key, value in caps.items():
            print(f"{key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
