"""``trio-shard caps``: what a running worker serves (its capabilities)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from shard.cli.common import ask_worker
from shard.cli.env import Options
from shard.cli.options import add_target, non_negative_float

NAME = "caps"


def add_parser(sub: Any) -> Options:
    """The ``caps`` command's options."""
    parser = sub.add_parser("caps", help="show what a running worker serves")
    opts = Options(parser)
    add_target(opts)
    opts.add("--timeout", type=non_negative_float, default=10.0,
             help="deadline in seconds (default: 10)")
    opts.add("--json", action="store_true", help="print JSON")
    return opts


def run(args: argparse.Namespace) -> int:
    """Print the worker's capabilities (``--json``: whole, else one line per key)."""
    caps = ask_worker(args, lambda client: client.capabilities_dict())
    if args.json:
        print(json.dumps(caps, indent=2, sort_keys=True))
    else:
        width = max(len(k) for k in caps)
        for key, value in caps.items():
            if key == "chat" and isinstance(value, dict):  # a template and thousands of texts
                value = chat_summary(value)
            print(f"{key:<{width}}  {value}")
    return 0


def chat_summary(chat: dict[str, Any]) -> str:
    """``caps``' one line for the chat template (``--json`` prints it whole)."""
    template = chat.get("template", "")
    parts = [f"template of {len(template)} characters" if template else "no template"]
    parts += [f"{name} {chat[key]!r}" for key, name in
              (("bos_token", "bos"), ("eos_token", "eos"), ("eot_token", "end of turn")) if chat.get(key)]
    parts.append(f"{len(chat.get('special_texts', []))} special-token texts")
    return ", ".join(parts)
