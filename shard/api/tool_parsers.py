"""A model's answer into text and tool calls, as it streams: one parser per call format.

Formats (``FORMATS``), the ones the chat templates GGUF models ship most write:

* ``hermes`` (Hermes 2 Pro, Qwen 2/2.5/3, and the door's generic tool prompt): any number of
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, text around them.
* ``llama3`` (Llama 3.1-3.3): the whole answer is one call, ``{"name": ..., "parameters":
  {...}}``, optionally after ``<|python_tag|>``.
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``
  (or the newer ``[TOOL_CALLS]name[ARGS]{...}``), to the end of the answer.

A parser is fed text deltas and returns ``Text``, ``CallStart`` and ``CallArgs`` events; the
whole answer is the same parser fed once (``parse``), so a stream and a whole body agree
whatever the split. Text that may be the start of a call is held back until it is decided.
Where a call opens with its name first (``{"name": "f", "arguments": ``), its arguments
stream as the model writes them (the raw JSON text, the closing ``}`` held back); a call in
another shape is sent whole when it ends (its arguments re-encoded), and a block that is no
call at all is sent as text.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["FORMATS", "Call", "CallArgs", "CallStart", "Event", "Parsed", "Text", "ToolCallParser",
           "new_call_id", "new_mistral_call_id", "parse", "parser_for"]

FORMATS = ("hermes", "llama3", "mistral")


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    text: str


Event = Text | CallStart | CallArgs


@dataclass
class Call:
    id: str
    name: str
    arguments: str


@dataclass
class Parsed:
    """Events folded: the text and the calls (as a client accumulates them)."""

    content: str
    calls: list[Call]

    @classmethod
    def of(cls, events: Sequence[Event]) -> Parsed:
        content, calls = "", []
        for e in events:
            if isinstance(e, Text):
                content += e.text
            elif isinstance(e, CallStart):
                calls.append(Call(e.id, e.name, ""))
            else:
                calls[e.index].arguments += e.text
        return cls(content, calls)


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


_ALNUM = string.ascii_letters + string.digits


def new_mistral_call_id() -> str:
    """A call id as Mistral writes them: 9 letters and digits. Mistral's chat templates
    (7B Instruct v0.3, Nemo, Small) refuse any other id in the history they are given back
    (``raise_exception("Tool call IDs should be alphanumeric strings with length 9!")``)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


# ---- a small prefix matcher: "this text opens a call", "could it still?" ------------------------

_WS = ("ws",)
_NAME = ("name",)
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
Pattern = tuple[tuple[str, ...], ...]


def _lit(text: str) -> tuple[str, str]:
    return ("lit", text)


def _match(pattern: Pattern, text: str) -> tuple[str, int, str]:
    """(``full`` | ``partial`` | ``fail``, where the match ends, the name it captured).
    ``partial``: the whole text is the start of a match. Whitespace is ``\\s*`` (greedy: no
    literal of a pattern starts with whitespace)."""
    at, name = 0, ""
    for piece in pattern:
        if piece is _WS:
            while at < len(text) and text[at].isspace():
                at += 1
        elif piece is _NAME:
            start = at
            while at < len(text) and text[at] in _NAME_CHARS:
                at += 1
            name = text[start:at]
        else:
            lit = piece[1]
            rest = text[at:at + len(lit)]
            if rest != lit:
                return ("partial", len(text), name) if lit.startswith(rest) and \
                    at + len(rest) == len(text) else ("fail", at, name)
            at += len(lit)
        if at == len(text) and piece is not pattern[-1]:
            return "partial", at, name
    return "full", at, name


def _held_from(pattern: Pattern, text: str) -> int:
    """The earliest position from which the rest of ``text`` is (the start of) a whole match
    of ``pattern``: what must be held back; ``len(text)`` when none."""
    for p in range(len(text)):
        status, end, _ = _match(pattern, text[p:])
        if status == "partial" or (status == "full" and end == len(text) - p):
            return p
    return len(text)


def _name_first(opener: str, args_key: str) -> Pattern:
    return (_lit(opener), _WS, _lit("{"), _WS, _lit('"name"'), _WS, _lit(":"), _WS, _lit('"'),
            _NAME, _lit('"'), _WS, _lit(","), _WS, _lit(f'"{args_key}"'), _WS, _lit(":"))


def _arguments_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _call_of(obj: Any, keys: Sequence[str] = ("arguments", "parameters")) -> tuple[str, str] | None:
    """(name, arguments) of a call object, None when ``obj`` is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in keys:
        if key in obj:
            return obj["name"], _arguments_text(obj[key])
    return None


# ---- parsers ------------------------------------------------------------------------------------


def _before_marker(buf: str, marker: str) -> tuple[int, bool]:
    """(where ``marker`` starts in ``buf``, True), or (how much of ``buf`` cannot be the start
    of it, False): text up to there is decided."""
    at = buf.find(marker)
    if at >= 0:
        return at, True
    keep = next((k for k in range(min(len(marker) - 1, len(buf)), 0, -1)
                 if marker.startswith(buf[-k:])), 0)
    return len(buf) - keep, False


class ToolCallParser:
    """``feed`` every text delta, then ``finish``; each returns the events to send."""

    def __init__(self, ids: Callable[[], str] = new_call_id) -> None:
        self._ids = ids
        self.calls = 0

    def _start(self, name: str) -> CallStart:
        self.calls += 1
        return CallStart(self.calls - 1, self._ids(), name)

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError


class _Blocks(ToolCallParser):
    """Calls that open with one of ``openers`` and close with ``\\s*}\\s*`` then ``closer``
    (the end of the answer when ``closer`` is empty); ``anywhere``: a call may open after
    text (the first opener; else only at the start of the answer)."""

    def __init__(self, openers: Sequence[str], args_keys: Sequence[str], closer: str, *,
                 anywhere: bool, ids: Callable[[], str] = new_call_id) -> None:
        super().__init__(ids)
        self._openers = sorted(openers, key=len, reverse=True)
        self._closer, self._anywhere = closer, anywhere
        self._keys = tuple(args_keys)
        self._heads = [_name_first(o, k) for o in openers for k in args_keys]
        self._tail: Pattern = (_WS, _lit("}"), _WS, *((_lit(closer),) if closer else ()))
        self._buf = ""
        self._state = "text"  # text | head (an opener seen) | args | block | plain
        self._args_sent = False

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def _opener_of(self, buf: str) -> str:
        return next(o for o in self._openers if buf.startswith(o))

    def _step(self, out: list[Event]) -> bool:
        """Decide what the buffer allows; True when the state changed (look again)."""
        buf, state = self._buf, self._state
        if state == "plain":
            if buf:
                out.append(Text(buf))
            self._buf = ""
            return False
        if state == "text":
            if self.calls:  # whitespace after a call is not content
                self._buf = buf = buf.lstrip()
                if not buf:
                    return False
            if not self._anywhere:
                rest = buf.lstrip()
                if not rest:
                    return False
                self._buf, self._state = rest, "head"
                return True
            at, found = _before_marker(buf, self._openers[0])
            if at:
                out.append(Text(buf[:at]))
                self._buf = buf[at:]
            if found:
                self._state = "head"
            return found
        if state == "head":
            results = [_match(h, buf) for h in self._heads]
            for status, end, name in results:
                if status == "full":
                    out.append(self._start(name))
                    self._buf, self._state, self._args_sent = buf[end:], "args", False
                    return True
            if any(status == "partial" for status, _, _ in results):
                return False
            opener = self._opener_of(buf)
            if buf[len(opener):].lstrip().startswith("{"):
                self._state = "block"  # a call in another shape, or no call: seen whole
            elif self._anywhere:
                out.append(Text(opener))
                self._buf, self._state = buf[len(opener):], "text"
            else:
                self._state = "plain"
            return True
        if state == "args":
            if not self._args_sent:
                self._buf = buf = buf.lstrip()
                if not buf:
                    return False
                self._args_sent = True
            if self._closer:
                end = buf.find(self._closer)
                if end >= 0:
                    args = self._trimmed(buf[:end])
                    if args:
                        out.append(CallArgs(self.calls - 1, args))
                    self._buf, self._state = buf[end + len(self._closer):], "text"
                    return True
            held = _held_from(self._tail, buf)
            if held:
                out.append(CallArgs(self.calls - 1, buf[:held]))
                self._buf = buf[held:]
            return False
        # block: decided when it closes
        if self._closer:
            end = buf.find(self._closer)
            if end >= 0:
                self._whole_block(buf[:end + len(self._closer)], out)
                self._buf, self._state = buf[end + len(self._closer):], "text"
                return True
        return False

    @staticmethod
    def _trimmed(args: str) -> str:
        """Arguments without the call object's closing brace (and the whitespace around it)."""
        args = args.rstrip()
        return args[:-1].rstrip() if args.endswith("}") else args

    def _whole_block(self, block: str, out: list[Event]) -> None:
        inner = block[len(self._opener_of(block)):len(block) - len(self._closer)]
        try:
            call = _call_of(json.loads(inner), self._keys)
        except ValueError:
            call = None
        if call is None:
            out.append(Text(block))
            return
        out.append(self._start(call[0]))
        out.append(CallArgs(self.calls - 1, call[1]))

    def finish(self) -> list[Event]:
        out = self.feed("")
        buf, self._buf = self._buf, ""
        if self._state == "args":
            args = buf if self._closer else self._trimmed(buf)
            if args:
                out.append(CallArgs(self.calls - 1, args))
        elif self._state == "block" and not self._closer:
            self._whole_block(buf, out)
        elif buf:
            out.append(Text(buf))
        return out


class _Mistral(ToolCallParser):
    """``[TOOL_CALLS]`` then the calls, decided at the end of the answer."""

    MARK = "[TOOL_CALLS]"

    def __init__(self, ids: Callable[[], str] = new_mistral_call_id) -> None:
        super().__init__(ids)
        self._buf = ""
        self._marked = False  # the marker seen: the rest is calls

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        if self._marked:
            return []
        at, self._marked = _before_marker(self._buf, self.MARK)
        released, self._buf = self._buf[:at], self._buf[at:]
        return [Text(released)] if released else []

    def finish(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if not self._marked:
            return [Text(buf)] if buf else []
        calls = self._calls(buf[len(self.MARK):].strip())
        if calls is None:
            return [Text(buf)]
        out: list[Event] = []
        for name, args in calls:
            out.append(self._start(name))
            out.append(CallArgs(self.calls - 1, args))
        return out

    @staticmethod
    def _calls(body: str) -> list[tuple[str, str]] | None:
        try:
            value = json.loads(body)
        except ValueError:
            name, sep, args = body.partition("[ARGS]")  # [TOOL_CALLS]name[ARGS]{...}
            if not sep or not name.strip() or not args.strip():
                return None
            return [(name.strip(), args.strip())]
        items = value if isinstance(value, list) else [value]
        calls = [_call_of(item) for item in items]
        if not calls or any(c is None for c in calls):
            return None
        return calls  # type: ignore[return-value]


def parser_for(fmt: str, ids: Callable[[], str] | None = None) -> ToolCallParser:
    """A fresh parser of the call format ``fmt`` (one of ``FORMATS``); ``ids`` makes each
    call's id (by default ``new_call_id``, Mistral's format ``new_mistral_call_id``)."""
    if ids is None:
        ids = new_mistral_call_id if fmt == "mistral" else new_call_id
    if fmt == "hermes":
        return _Blocks(("<tool_call>",), ("arguments",), "</tool_call>", anywhere=True, ids=ids)
    if fmt == "llama3":
        return _Blocks(("<|python_tag|>", ""), ("parameters", "arguments"), "", anywhere=False,
                       ids=ids)
    if fmt == "mistral":
        return _Mistral(ids)
    raise ValueError(f"unknown tool call format {fmt!r}")


def parse(fmt: str, text: str, ids: Callable[[], str] | None = None) -> Parsed:
    """The whole answer ``text``: its content and calls."""
    parser = parser_for(fmt, ids)
    return Parsed.of(parser.feed(text) + parser.finish())
