"""Options that can also come from environment variables (``TRIO_SHARD_*``), over public argparse.

Why a table of our own: the command line is the operator's, but a container or a service unit
configures a worker through its environment. Each option of ``serve``, ``api`` and the global
``--log-level`` is declared through ``Options.add``, which names its variable (``env_name``),
records (dest, variable, conversion) in ``Options.table`` and, when the variable is set at
parser-build time, makes its text the option's default. argparse converts a string default with
the option's ``type`` only when the option is absent and only in the (sub)command being run,
so another command's variables are never read, the command line wins, and a bad value is a
usage error naming the variable (exit status 2). ``config_lines`` prints the effective values
back in the form they are read in (``serve --print-config``).
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

ENV_PREFIX = "TRIO_SHARD_"
API_ENV_PREFIX = "TRIO_SHARD_API_"
TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off", ""})


def env_name(option: str, prefix: str = ENV_PREFIX) -> str:
    """``prefix`` + a long option in upper case with ``_`` for ``-`` (``--max-sessions`` ->
    ``TRIO_SHARD_MAX_SESSIONS``)."""
    return prefix + option.removeprefix("--").upper().replace("-", "_")


class _EnvText(str):
    """An option's default taken from its variable: text argparse still has to convert."""


@dataclass(frozen=True)
class EnvOption:
    """One option that can come from the environment: ``raw`` is its variable's text when the
    variable was set at parser-build time (None: unset, or empty for a value option)."""

    dest: str
    variable: str
    option: str  # the long option, e.g. --max-sessions
    convert: Callable[[str], object]  # the variable's text -> the option's value
    default: object
    type: Callable[[str], object] | None = None
    choices: Any = None
    flag: bool = False  # store_true / store_false: 1 means the option is given
    const: object = None  # a flag's value when given
    many: bool = False  # an ``extend`` option: its value is a list
    raw: str | None = None

    def render(self, value: object) -> str:
        """``value`` as this option's variable would hold it (shell-quoted)."""
        if self.flag:
            return "1" if value == self.const else "0"
        if self.many and isinstance(value, list | tuple):  # its list, as its variable holds it
            return shlex.quote(",".join(map(str, value)))
        return "" if value is None else shlex.quote(str(value))

    def source(self, value: object) -> str:
        """Where ``value`` came from: the command line, the environment or the default."""
        if self.raw is not None:
            try:
                from_env = self.convert(self.raw)
            except (argparse.ArgumentTypeError, ValueError, TypeError):
                return "command line"  # a bad variable is only accepted when overridden
            return "environment" if value == from_env else "command line"
        return "default" if value == self.default else "command line"


class _Flag(argparse.Action):
    """``store_true``/``store_false`` with a ``type``: argparse applies it to a string default,
    which is how a flag's variable (``1``, ``no``, ...) becomes its value."""

    def __init__(self, option_strings: Sequence[str], dest: str, const: object, default: object = None,
                 type: Callable[[str], object] | None = None, required: bool = False,
                 help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, const=const, default=default, type=type,
                         required=required, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, self.const)


class _Extend(argparse.Action):
    """A repeatable option whose ``type`` gives a list each time (``--cors-origin A,B
    --cors-origin C``): the lists add up, and the command line's replace the variable's."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        items = getattr(namespace, self.dest, None)
        if items is None or items is self.default or isinstance(items, str):
            items = []
        setattr(namespace, self.dest, [*items, *values])


def _flag_value(text: str, *, const: object, default: object) -> object:
    word = text.strip().lower()
    if word not in TRUE | FALSE:
        raise ValueError(f"expected one of {', '.join(sorted(TRUE | FALSE - {''}))}")
    return const if word in TRUE else default


def _value(text: str, *, type: Callable[[str], object] | None, choices: Any) -> object:
    value = type(str(text)) if type is not None else str(text)
    if choices is not None and value not in choices:
        raise ValueError(f"invalid choice {value!r} (choose from {', '.join(map(str, choices))})")
    return value


def _option_type(option: EnvOption, parser: argparse.ArgumentParser) -> Callable[[str], object]:
    """The ``type`` argparse is given: the option's own for command-line text, ``convert`` for
    its default from the environment, where a bad value is ``parser``'s usage error naming the
    variable."""

    def parse(text: str) -> object:
        if not isinstance(text, _EnvText):
            return option.type(text) if option.type is not None else text
        try:
            return option.convert(text)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            parser.error(f"environment variable {option.variable}={str(text)!r}: {exc}")

    parse.__name__ = getattr(option.type, "__name__", "str")  # argparse's "invalid X value"
    return parse


class Options:
    """Declares one command's options on ``parser`` (or ``container``, a group of it); with a
    ``prefix``, each long option also defaults from its variable in ``environ`` and is listed
    in ``table``. Without one, ``add`` is plain ``add_argument``."""

    def __init__(self, parser: argparse.ArgumentParser, prefix: str | None = None,
                 environ: Mapping[str, str] | None = None,
                 table: list[EnvOption] | None = None, container: Any = None) -> None:
        self.parser = parser
        self.container = parser if container is None else container
        self.prefix = prefix
        self.environ = os.environ if environ is None else environ
        self.table: list[EnvOption] = [] if table is None else table

    def exclusive(self, *, required: bool = False) -> Options:
        """The same declarations into a new mutually exclusive group (the same table)."""
        group = self.container.add_mutually_exclusive_group(required=required)
        return Options(self.parser, self.prefix, self.environ, self.table, group)

    def add(self, *flags: str, **kwargs: Any) -> None:
        """``add_argument(*flags, **kwargs)``, the option's variable named in its help and its
        text, when set, the default (a single value, a flag or an ``extend`` list from its type;
        anything else is a TypeError)."""
        longs = [f for f in flags if f.startswith("--")]
        if self.prefix is None or not longs:
            self.container.add_argument(*flags, **kwargs)
            return
        variable = env_name(longs[0], self.prefix)
        dest = kwargs.get("dest") or longs[0][2:].replace("-", "_")  # argparse's own rule
        action = kwargs.pop("action", "store")
        if action in ("store_true", "store_false"):
            const = action == "store_true"
            default = kwargs.pop("default", not const)
            option = EnvOption(
                dest=dest, variable=variable, option=longs[0], default=default, flag=True, const=const,
                convert=lambda text: _flag_value(text, const=const, default=default))
            kwargs.update(action=_Flag, const=const, default=default)
        elif action in ("store", "extend") and kwargs.get("nargs") is None:
            if action == "extend":  # a list from its type, each time given (``_Extend``)
                kwargs["action"] = _Extend
            type_, choices = kwargs.get("type"), kwargs.get("choices")
            option = EnvOption(
                dest=dest, variable=variable, option=longs[0], default=kwargs.get("default"),
                type=type_, choices=choices, many=action == "extend",
                convert=lambda text: _value(text, type=type_, choices=choices))
        else:
            raise TypeError(f"{longs[0]}: only a single value or a flag can come from {variable}")
        raw = self.environ.get(variable)
        if raw is not None and (option.flag or raw != ""):  # empty: unset, but "" is a flag's 0
            option = replace(option, raw=raw)
            kwargs["default"] = _EnvText(raw)
        kwargs["type"] = _option_type(option, self.parser)
        if kwargs.get("help") is not argparse.SUPPRESS:
            kwargs["help"] = f"{kwargs.get('help') or ''} [env {variable}]".strip()
        self.container.add_argument(*flags, **kwargs)
        self.table.append(option)


def config_lines(options: Sequence[EnvOption], args: argparse.Namespace) -> list[str]:
    """One ``VARIABLE=value  # source`` line per option: given back as the environment (the
    comments dropped, the shell quoting undone) they configure exactly the same."""
    return [f"{o.variable}={o.render(getattr(args, o.dest))}  # {o.source(getattr(args, o.dest))}"
            for o in options]


__all__ = ["API_ENV_PREFIX", "ENV_PREFIX", "EnvOption", "Options", "config_lines", "env_name"]
