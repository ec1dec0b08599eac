"""``trio-shard make-model``: write a small GGUF model locally (a preset, or the test model of
an architecture; never a download)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from shard.cli.common import fail, quiet_gguf, read_chat_template
from shard.cli.env import Options

NAME = "make-model"


def add_parser(sub: Any) -> Options:
    """The ``make-model`` command's options."""
    parser = sub.add_parser(
        "make-model", help="write a small GGUF model file (no download)",
        description="Write a deterministic GGUF model with random weights and a real tokenizer: "
        "a llama preset, or the test model of an architecture whose layer ranges are served "
        "(with that architecture's quirks: sliding-window pattern, biases, norms, experts, "
        "tied or untied head; a few MB).",
    )
    opts = Options(parser)
    which = opts.exclusive()
    which.add("--preset", default="tiny",
              help="tiny (default), chat (tiny with ChatML control tokens and a chat "
              "template), tools (chat with a template rendering tools, Qwen 2.5's way), "
              "embed (tiny declaring mean pooling: an embedding model for /v1/embeddings) or "
              "bench (214 MB, Q8_0)")
    which.add("--arch", metavar="ARCH",
              help="the test model of architecture ARCH (llama, qwen2, gemma3, ...: one "
              "per architecture whose layer ranges are served; an unknown name lists them)")
    opts.add("--chat-template", type=Path, metavar="FILE",
             help="with a preset: write this Jinja2 chat template (tokenizer.chat_template) "
             "into the model instead of the preset's")
    opts.add("--out", type=Path, required=True, help="output file")
    return opts


def run(args: argparse.Namespace) -> int:
    """Write the model and print its path; 2 for an unknown preset or architecture."""
    from shard.models import PRESETS, write_model

    if args.arch is not None:
        from shard.models.arch_models import ARCHS, write_arch_model

        if args.chat_template is not None:
            return fail("--chat-template goes with --preset", 2)
        if args.arch not in ARCHS:
            return fail(f"no test model for architecture {args.arch!r}; choose one of {', '.join(ARCHS)}", 2)
        quiet_gguf()
        print(write_arch_model(args.arch, args.out))
        return 0
    if args.preset not in PRESETS:
        return fail(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}", 2)
    template = read_chat_template(args.chat_template)
    quiet_gguf()
    print(write_model(args.preset, args.out, progress=sys.stderr.isatty(), chat_template=template))
    return 0
