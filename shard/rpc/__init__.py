"""Shard protocol transport, sessions and servicer (depends on shard.engine, never the reverse)."""

import logging as _logging

# hpack (under h2, on both the server and the client side) logs every header block it encodes
# or decodes at DEBUG, the ``authorization`` header included. Capped for the whole package so
# that a bearer token never reaches a log, whatever the log level (tests/test_auth.py checks).
_logging.getLogger("hpack").setLevel(_logging.INFO)
