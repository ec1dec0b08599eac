"""``trio-shard`` command line: argument parsing and wiring only, no logic of its own.

Commands, one module each: ``serve`` (run a worker), ``api`` (the HTTP front door),
``generate`` (``generate_pipeline`` for a chain or a pool), ``caps``, ``health``, ``metrics``
(talk to a worker), ``pool`` (look at a pool), ``make-model``, ``slice`` and ``plan`` (model
files, locally). Shared option types and groups are ``options``, credentials ``credentials``.

Configuration: every ``serve`` option (and the global ``--log-level``) can also come from an
environment variable, ``TRIO_SHARD_`` + the long option name in upper case with ``_`` for
``-`` (``--max-sessions`` -> ``TRIO_SHARD_MAX_SESSIONS``), every ``api`` option from
``TRIO_SHARD_API_<OPTION>``; the command line wins (``shard.cli.env``). ``serve
--print-config`` shows the effective values and where each came from.
"""

from shard.cli.env import env_name
from shard.cli.main import build_parser, environment_options, main

__all__ = ["build_parser", "env_name", "environment_options", "main"]
