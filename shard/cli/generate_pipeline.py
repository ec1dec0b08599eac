"""``generate --pipeline`` / ``--workers`` (docs/pipelines.md): one generation through a chain
of workers or a route a pool leases, and ``--prompts-file``: many prompts at once through one
pipeline, one JSON line each as it ends."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path
from typing import Any

from shard.cli.common import client_setup, fail, workers_source
from shard.cli.generation import GenerateOutput, finish_generate, prompt_for, until_sigint

log = logging.getLogger("shard.cli.generate")


def waiting(timeout: float) -> Any:
    """What ``connect_waiting`` calls once when it waits for a worker (``--log-level INFO``)."""
    return lambda err: log.info("waiting up to %gs for the workers: %s", timeout, err)


def run_pipeline(args: argparse.Namespace) -> int:
    """``generate --pipeline``/``--workers``: the same output as one worker's generate."""
    options = client_setup(args)
    if args.workers is not None:
        workers_source(args.workers, resolve_interval=args.resolve_interval)  # checked first
    out = GenerateOutput(as_json=args.json)

    async def run() -> bool:
        """Generate; True when Ctrl-C interrupted it (after every session was released)."""
        import trio

        deadline = trio.current_time() + args.timeout

        async def generate() -> None:
            async with open_route(args, options) as (pipe, route):
                prompt, parse_special = prompt_for(args, args.prompt, pipe.hops[0].caps)
                result = await pipe.generate(
                    prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                    seed=args.seed, chunk_tokens=args.chunk_tokens, on_token=out.on_step(),
                    timeout=deadline - trio.current_time(), speculate=args.speculate,
                    parse_special=parse_special, route=route,
                )
            out.failovers = [f.as_dict() for f in result.failovers]
            out.stats = {"traversals": result.traversals}
            if args.speculate:
                out.stats.update(drafted_tokens=result.drafted_tokens,
                                 accepted_tokens=result.accepted_tokens)

        return await until_sigint(generate)

    return finish_generate(run, out)


@contextlib.asynccontextmanager
async def open_route(args: argparse.Namespace, options: dict[str, object]) -> Any:
    """(pipeline, route) for one generation: ``--pipeline``'s chain (route None), or with
    ``--workers`` a route the pool leases for ``--model-name`` (the only model by default),
    waiting within ``--timeout`` for one to be complete."""
    if args.workers is None:
        async with connect_pipeline(args, options) as pipe:
            yield pipe, None
        return
    import trio

    from shard.client import ErrorCode, ShardError
    from shard.pool import Pool, parse_workers

    source = parse_workers(args.workers, resolve_interval=args.resolve_interval)
    async with Pool.open(
        source, probe_interval=args.probe_interval, connect_timeout=min(args.timeout, 10.0) or None,
        hidden_dtype=args.hidden_dtype, step_timeout=args.step_timeout,
        replay_bytes=int(args.replay_mib * 2**20), relay=args.relay,
        batch_groups=args.batch_groups, timeout=args.timeout, **options,  # type: ignore[arg-type]
    ) as pool:
        with trio.move_on_after(args.timeout):
            await pool.settle(args.timeout)  # every listed worker answered once
            await pool.wait_for(args.model_name)
        models = pool.servable()
        model = args.model_name
        if model is None and len(models) > 1:
            raise ShardError(ErrorCode.INVALID_ARGUMENT, f"the pool serves {len(models)} models "
                             f"({', '.join(sorted(models))}): choose one with --model-name")
        if model is None and models:
            (model,) = models
        if model is None or model not in models:
            why = "; ".join(pool.not_serving()) or f"it serves {', '.join(sorted(models))}"
            raise ShardError(ErrorCode.NOT_READY, f"the pool {source.describe} cannot serve "
                             f"{'model ' + repr(model) if model else 'any model'}: {why}")
        async with pool.lease(model) as lease:
            yield lease.pipeline, lease.route


def connect_pipeline(args: argparse.Namespace, options: dict[str, object]) -> Any:
    """``Pipeline.connect`` with generate's options (an async context manager), tried again
    within ``--timeout`` while a worker is not listening yet, as the door does
    (``shard.client.waiting``; a worker still loading is waited for by ``wait_for_ready``)."""
    import trio

    from shard.client.waiting import connect_waiting
    from shard.pipeline import Pipeline

    deadline = trio.current_time() + args.timeout
    return connect_waiting(lambda: Pipeline.connect(
        args.pipeline, timeout=max(deadline - trio.current_time(), 0.0),
        hidden_dtype=args.hidden_dtype, wait_for_ready=True, step_timeout=args.step_timeout,
        replay_bytes=int(args.replay_mib * 2**20), relay=args.relay,
        batch_groups=args.batch_groups, **options,  # type: ignore[arg-type]
    ), args.timeout, on_wait=waiting(args.timeout))


def read_prompts(path: str) -> list[str]:
    """The non-empty lines of ``--prompts-file`` ('-': stdin)."""
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def run_many(args: argparse.Namespace) -> int:
    """``generate --pipeline --prompts-file``: every prompt at once through one pipeline, one
    JSON line per prompt as it ends (``GenerateOutput``'s object with its ``index``)."""
    try:
        prompts = read_prompts(args.prompts_file)
    except (OSError, UnicodeDecodeError) as exc:
        return fail(f"cannot read --prompts-file: {exc}", 2)
    if not prompts:
        return fail("--prompts-file holds no prompt (one per non-empty line)", 2)
    options = client_setup(args)

    import trio

    from shard.client import ShardError

    outs = [GenerateOutput(as_json=True, index=i) for i in range(len(prompts))]
    failed: list[int] = []

    async def run() -> bool:
        deadline = trio.current_time() + args.timeout

        async def one(pipe: Any, i: int) -> None:
            out = outs[i]
            try:
                prompt, parse_special = prompt_for(args, prompts[i], pipe.hops[0].caps)
                result = await pipe.generate(
                    prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                    seed=args.seed, chunk_tokens=args.chunk_tokens, on_token=out.on_step(),
                    timeout=deadline - trio.current_time(), speculate=args.speculate,
                    parse_special=parse_special,
                )
            except ShardError as exc:  # this prompt's failure; the others go on
                failed.append(i)
                out.close(error=exc)
                print(f"trio-shard: prompt {i}: {exc}", file=sys.stderr)
                return
            out.failovers = [f.as_dict() for f in result.failovers]
            out.stats = {"traversals": result.traversals}
            out.close()
            out.done = True

        async def generate() -> None:
            async with connect_pipeline(args, options) as pipe, trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, pipe, i)

        return await until_sigint(generate)

    try:
        interrupted = trio.run(run)
    except ShardError as exc:  # connecting failed: no prompt started
        return fail(str(exc))
    if interrupted:
        for out in outs:
            if not out.done and out.index not in failed:
                out.close(interrupted=True)
        return 130
    return 1 if failed else 0
