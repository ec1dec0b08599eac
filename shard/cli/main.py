"""The ``trio-shard`` parser, composed from each command module's ``add_parser``, and ``main``,
which runs the chosen command's ``run`` and turns its outcome into the exit status."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from shard.cli import (
    api,
    caps,
    generate,
    health,
    make_model,
    metrics,
    plan,
    pool,
    serve,
)
from shard.cli import slice as slice_  # (the module; not the builtin)
from shard.cli.common import Failure, fail
from shard.cli.env import ENV_PREFIX, EnvOption, Options

#: The commands in the order ``--help`` lists them; each module has NAME, add_parser and run.
COMMANDS = (serve, generate, caps, health, metrics, make_model, slice_, pool, plan, api)

GLOBAL = ""  # the environment table of the options before the command (--log-level)


def _build() -> tuple[argparse.ArgumentParser, dict[str, list[EnvOption]]]:
    """The parser and, per command (``GLOBAL`` for the global options), the options that
    default from the environment."""
    parser = argparse.ArgumentParser(
        prog="trio-shard",
        description="Serve one shard of a GGUF language model over gRPC (Shard protocol v1).",
    )
    top = Options(parser, ENV_PREFIX)
    top.add("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
            help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    tables = {GLOBAL: top.table}
    for command in COMMANDS:
        tables[command.NAME] = command.add_parser(sub).table
    return parser, tables


def build_parser() -> argparse.ArgumentParser:
    """The ``trio-shard`` parser; the ``TRIO_SHARD_*`` variables set now are its defaults."""
    return _build()[0]


def environment_options(command: str = GLOBAL) -> list[EnvOption]:
    """The options of ``command`` (``GLOBAL``: those before the command) that can come from
    the environment, with the variables set now; empty for a command without any."""
    return _build()[1].get(command, [])


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's), configure logging and run the command; the
    exit status: 0, 1 (it failed), 2 (bad options or files), 130 (Ctrl-C)."""
    from shard import logs

    parser, tables = _build()
    args = parser.parse_args(argv)
    logs.configure(args.log_level, getattr(args, "log_format", "text"))
    if args.command == serve.NAME and args.print_config:
        return serve.print_config(tables[GLOBAL] + tables[serve.NAME], args)
    command = next(c for c in COMMANDS if c.NAME == args.command)
    try:
        return command.run(args)
    except Failure as exc:
        return fail(exc.message, exc.code)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `trio-shard caps | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # quiet exit flush
        return 0
