"""Chat templates: a conversation rendered into the one prompt text the model was trained on.

A GGUF model carries its template as ``tokenizer.chat_template`` (Jinja2, the format
transformers defined); the first shard reports it with the texts of its BOS, EOS and end-of-turn
tokens in its capabilities (``GetCapabilitiesResponse.chat``), so a client renders a
conversation without the model file. Rendering follows transformers and llama.cpp's server: a
sandboxed, immutable Jinja2 environment (a template cannot reach Python objects or change the
messages), ``trim_blocks`` and ``lstrip_blocks``, the ``raise_exception`` and ``strftime_now``
helpers and a ``tojson`` filter that keeps non-ASCII text. The rendered text is tokenized with
special tokens parsed (``parse_special``), so its markers become the model's control tokens.

Message contents are the users' text, so special-token texts in them must stay text: the
whole rendered prompt is tokenized with special tokens parsed, and a message saying
``<|im_end|><|im_start|>system`` would otherwise open a system turn of its own. Every special
text the first shard reports (``ChatTemplate.special_texts``) found in a message's content is
broken by a WORD JOINER (U+2060) after its first character before rendering: it then tokenizes
as the plain text it is.

BOS: a template usually writes ``bos_token`` itself, and a tokenizer that adds BOS would then
put a second one in front; as llama.cpp does, a leading ``bos_token`` is dropped from the text
when the tokenizer adds one (``ChatTemplate.add_bos``).

A leaf module (Jinja2 and the generated protocol code only): the CLI and the HTTP front door
share it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shard.v1 import shard_pb2 as pb

__all__ = ["WORD_JOINER", "ChatTemplate", "ChatTemplateError"]

WORD_JOINER = "\u2060"


class ChatTemplateError(ValueError):
    """A template that does not compile, or that refused to render a conversation (its own
    ``raise_exception``, e.g. roles that do not alternate)."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
        autoescape=False,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _trie_pattern(texts: set[str]) -> str:
    """A regular expression matching any of ``texts``, the longest first, in time linear in
    the text searched.

    Why a trie: a plain alternation of N texts is tried branch by branch at every position, and
    a real model has thousands of special texts sharing their first character (Gemma 3: 6,250,
    most starting with ``<``): a 1 MB message of ``<`` would hold the front door's event loop for
    tens of seconds.
    As a trie each position tries one branch per distinct next character."""
    trie: dict[str, dict] = {}
    for text in texts:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}  # a text ends here

    def emit(node: dict[str, dict]) -> str:
        out = ""
        while len(node) == 1 and "" not in node:  # a chain without branches: no group
            (ch, node), = node.items()
            out += re.escape(ch)
        branches = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return out
        group = "(?:" + "|".join(branches) + ")"
        return out + (group + "?" if "" in node else group)  # greedy: the longer text first

    return emit(trie)


@dataclass(frozen=True)
class ChatTemplate:
    """One model's chat template, compiled once; ``render`` a conversation with it."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    eot_token: str = ""
    add_bos: bool = False
    special_texts: tuple[str, ...] = ()
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)
    _special: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.source.strip():
            raise ChatTemplateError("the chat template is empty")
        try:
            compiled = _environment().from_string(self.source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from None
        object.__setattr__(self, "_compiled", compiled)
        texts = {t for t in self.special_texts if t}
        object.__setattr__(self, "_special", re.compile(_trie_pattern(texts)) if texts else None)

    def neutralise(self, content: str) -> str:
        """``content`` with every special-token text broken by U+2060 (see the module doc)."""
        if self._special is None:
            return content
        return self._special.sub(lambda m: m.group()[0] + WORD_JOINER + m.group()[1:], content)

    @classmethod
    def of(cls, chat: pb.ChatTemplate, override: str | None = None) -> ChatTemplate | None:
        """The template a first shard reports (``override``: an operator's own text instead);
        None when there is neither."""
        source = override if override is not None else chat.template
        if not source:
            return None
        return cls(source, chat.bos_token, chat.eos_token, chat.eot_token, chat.add_bos,
                   tuple(chat.special_texts))

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The prompt text for ``messages`` (each a mapping with ``role`` and ``content``),
        ending with the assistant's turn opened when ``add_generation_prompt``."""
        safe = [{**m, "content": self.neutralise(m["content"])} if isinstance(m.get("content"), str)
                else dict(m) for m in messages]
        try:
            text = self._compiled.render(
                messages=safe, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **extra,
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template's own failure, whatever it is
            raise ChatTemplateError(f"the chat template failed to render: {exc!r}") from None
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]  # the tokenizer adds it
        return text
