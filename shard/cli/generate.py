"""``trio-shard generate``: stream generated text from one worker serving a whole model; with
``--pipeline``/``--workers``/``--prompts-file`` from a chain (``generate_pipeline``)."""

from __future__ import annotations

import argparse
from typing import Any

from shard.cli.common import client_setup, fail
from shard.cli.env import Options
from shard.cli.generate_pipeline import run_many, run_pipeline, waiting
from shard.cli.generation import GenerateOutput, finish_generate, prompt_for, until_sigint
from shard.cli.options import (
    add_pool_options,
    add_target,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from shard.rpc.hidden_codec import CODECS

NAME = "generate"


def add_parser(sub: Any) -> Options:
    """The ``generate`` command's options."""
    parser = sub.add_parser(
        "generate", help="generate text from a running worker",
        description="Stream generated text from a worker serving a whole model, or with "
        "--pipeline from a chain of workers serving consecutive layer ranges of one model "
        "(see docs/pipelines.md). Workers that are not listening yet or still loading are "
        "waited for, within --timeout, like gRPC's wait-for-ready (as `trio-shard api` "
        "waits within --connect-timeout).",
    )
    opts = Options(parser)
    prompts = opts.exclusive(required=True)
    prompts.add("prompt", metavar="PROMPT", nargs="?",
                help="prompt text (or --prompts-file)")
    add_target(opts, pipeline=True, workers=True)
    opts.add("--model-name", metavar="NAME",
             help="with --workers: which model of the pool (default: the only one)")
    add_pool_options(opts)
    prompts.add("--prompts-file", metavar="FILE",
                help="with --pipeline, instead of PROMPT: one prompt per line of FILE ('-': "
                "stdin), generated at once through one pipeline (its connections shared, "
                "the generations spread over --batch-groups so that the hops compute "
                "different groups at the same time); prints one JSON object per prompt, "
                "one per line, as each ends: 'index' (its line among the prompts, from 0) "
                "and what --json prints; a failed one has 'error' and does not stop the "
                "others; exit status 1 if any failed")
    opts.add("--batch-groups", type=non_negative_int, metavar="N",
             help="with --pipeline: concurrent generations move through the hops in N "
             "groups (default: one per hop; 0: none; docs/pipelines.md, \"Throughput under "
             "concurrency\")")
    special = opts.exclusive()
    special.add("--chat", action="store_true",
                help="send the prompt as one user message of a conversation: rendered "
                "with the model's chat template (the first worker reports it) and "
                "tokenized with special tokens parsed, as `trio-shard api` does")
    special.add("--parse-special", action="store_true",
                help="tokenize the prompt with special tokens parsed: their texts (e.g. "
                "'<|im_end|>') become the model's control tokens instead of plain text")
    opts.add("--max-tokens", type=positive_int, default=64,
             help="most tokens to generate (default: 64)")
    opts.add("--temperature", type=non_negative_float, default=0.0,
             help="sampling temperature, 0 = greedy (default: 0)")
    opts.add("--seed", type=non_negative_int, default=0, help="sampling seed (default: 0)")
    opts.add("--timeout", type=non_negative_float, default=60.0,
             help="deadline in seconds for the whole call, including the wait for "
             "workers that are not listening yet (connection refused: tried again) or "
             "still loading (NOT_READY) to serve (default: 60)")
    opts.add("--json", action="store_true",
             help="print one JSON object with 'text', 'tokens' and 'finish_reason' "
             "instead of streaming (after Ctrl-C: what was received, with "
             "'interrupted': true; exit status 130; after a failure: what was received, "
             "with 'error': code, message, retryable and, with --pipeline, the hop and "
             "its target; exit status 1); with --pipeline also 'traversals' "
             "(passes through the chain) and 'failovers' "
             "if a hop moved to a replica (hop, from, to, reason, handover, positions "
             "replayed, recovery_ms)")
    opts.add("--hidden-dtype", choices=list(CODECS), default="float32",
             help="with --pipeline: hidden states on the wire; float16 halves the bytes, "
             "q8_0 (8-bit blocks, lossy) takes about a quarter, q8_0_outliers the same "
             "with each row's 4 largest channels sent exact (more accurate on models "
             "with outlier channels, e.g. Gemma 3), on hops whose worker offers it "
             "(default: float32)")
    opts.add("--chunk-tokens", type=positive_int,
             help="with --pipeline: prefill chunk size in tokens; shard k+1 computes "
             "chunk i while shard k computes chunk i+1 (default: 128 over several hops; "
             "over one hop the whole prompt in one step, or 512 a step with --step-timeout)")
    opts.add("--step-timeout", type=positive_float, metavar="SECONDS",
             help="with --pipeline: a worker that answers no step (a decode, a prefill "
             "chunk) within this many seconds counts as hung and its hop fails over to a "
             "replica (default: no bound but --timeout)")
    opts.add("--replay-mib", type=non_negative_float, default=256.0, metavar="MIB",
             help="with --pipeline: most MiB of boundary hidden states kept to replay on "
             "a replica (hops with replicas only); past it those hops can no longer fail "
             "over in this generation (default: 256)")
    opts.add("--speculate", type=non_negative_int, default=0, metavar="K",
             help="with --pipeline: each pass through the chain also carries up to K "
             "tokens drafted by prompt lookup (n-grams of the prompt and of the "
             "output so far), verified by the last shard in the same pass: the same "
             "tokens, fewer passes when the text repeats itself; each pass drafts only "
             "as many as its measured costs say pay, none when drafting would be slower "
             "than plain decoding; --json then reports "
             "'traversals', 'drafted_tokens' and 'accepted_tokens' (default: 0, off)")
    opts.add("--relay", choices=["client", "chain"], default="client",
             help="with --pipeline: who carries the hidden states between hops: this "
             "client (client, star) or the workers themselves (chain: the client talks to "
             "the first hop only; every hop but the last must run `serve --allow-relay`, "
             "the last too for its tokens to come straight back to the first hop; a hop's "
             "replicas take over as with client relay, the history replayed through the "
             "first hop) (default: client)")
    return opts


def run(args: argparse.Namespace) -> int:
    """Check the option combinations, then generate from one worker or through a chain."""
    if args.prompts_file is not None and not args.pipeline:
        return fail("--prompts-file needs --pipeline (one pipeline serves them all at once)", 2)
    if args.batch_groups is not None and not args.pipeline:
        return fail("--batch-groups needs --pipeline", 2)
    if args.model_name is not None and args.workers is None:
        return fail("--model-name goes with --workers", 2)
    if args.prompts_file is not None:
        return run_many(args)
    if args.pipeline or args.workers is not None:
        return run_pipeline(args)
    if args.speculate:
        return fail("--speculate needs --pipeline (a single worker's generate runs on the "
                    "worker; --pipeline HOST:PORT drives one worker from the client)", 2)
    options = client_setup(args)

    from shard.client import ShardClient
    from shard.client.waiting import connect_waiting

    out = GenerateOutput(as_json=args.json)

    async def generate() -> bool:
        """Generate; True when Ctrl-C interrupted it (after the session was released)."""
        import trio

        deadline = trio.current_time() + args.timeout
        async with connect_waiting(lambda: ShardClient.connect(
                args.target, timeout=args.timeout, **options),  # type: ignore[arg-type]
                args.timeout, on_wait=waiting(args.timeout)) as client:

            async def stream() -> None:
                await client.wait_for_ready()  # a worker still loading: wait, like gRPC
                prompt, parse_special = prompt_for(args, args.prompt, await client.capabilities())
                async for chunk in client.generate_text(
                    prompt,
                    max_tokens=args.max_tokens,
                    temperature=args.temperature,
                    seed=args.seed,
                    timeout=deadline - trio.current_time(),
                    parse_special=parse_special,
                ):
                    out.add(chunk.token_id, chunk.text, chunk.finish_reason)

            return await until_sigint(stream)

    return finish_generate(generate, out)
