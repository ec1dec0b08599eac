"""Log output for operators: ``text`` (one readable line) or ``json`` (one object per line).

Why JSON lines: log shippers (Loki, Elasticsearch, CloudWatch) index fields without fragile
regexes. Structured fields travel on the record as ``record.fields`` (a dict, set with
``extra={"fields": {...}}``): the text format already shows them inside the message as
``key=value``, the JSON format adds each one as a top-level key next to ``time``, ``level``,
``logger`` and ``message``.

Values are quoted so that a client-chosen string (a session id with spaces or a newline) can
neither break a line nor forge another field.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, Mapping):
            for key, value in fields.items():
                out.setdefault(str(key), value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of the record (tests swap it)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def configure(level: str = "INFO", fmt: str = "text") -> None:
    """Send log records of ``level`` and above to stderr in ``fmt``.

    Calling it again replaces the handler it installed before; handlers installed by others
    (a test runner's) are left alone.
    """
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, not {fmt!r}")
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(old)
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)


def kv(fields: Mapping[str, object]) -> str:
    """``key=value`` pairs for a text line; strings that need it are JSON-quoted."""
    return " ".join(f"{key}={_value(value)}" for key, value in fields.items())


def _value(value: object) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int | float):
        return str(value)
    text = str(value)
    if text and text.isprintable() and not any(c in text for c in ' "=\\'):
        return text
    return json.dumps(text, ensure_ascii=False)


__all__ = ["FORMATS", "JsonFormatter", "configure", "kv"]
