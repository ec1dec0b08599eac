"""Several choices of one prompt, the prompt computed once (OpenAI's ``n``, ``best_of``).

Why forks: ``n`` independent generations would each compute the whole prompt on every hop.
Here choice 0 prefills it; at its first token, while every hop's session is idle (choice 0 is
client-stepped, so nothing runs while its ``on_token`` waits), choices 1..n-1 open forks of
its sessions on every hop (``OpenSession.fork_of``: the worker copies the KV cells). Each fork
then prefills the same prompt, of which it holds everything: the worker computes only the last
position again (a prefill recomputes at least one), which gives the choice its own first token,
sampled with its own seed (``seed + i``). Once every fork has its first token (or ended), every
choice goes on concurrently, each on its own sessions. A worker that cannot fork, or a fork
refused (the source failed over meanwhile), opens a plain session: that choice computes the
prompt itself, with the same results.
"""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import trio

from shard.v1 import shard_pb2 as pb

from .result import PipelineResult

if TYPE_CHECKING:
    from .pipeline import Pipeline

#: ``on_token`` of ``generate_choices``: the choice's index and its step.
OnChoiceToken = Callable[[int, pb.StepResult], "Awaitable[None] | None"]


async def generate_choices(
    pipeline: Pipeline,
    prompt: str | Sequence[int],
    n: int,
    *,
    seed: int = 0,
    on_token: OnChoiceToken | None = None,
    session_id: str | None = None,
    **options: Any,
) -> list[PipelineResult]:
    """``n`` generations of ``prompt``, choice ``i`` sampled with ``seed + i`` (equal at
    temperature 0), the prompt prefilled once (see the module docstring). ``on_token(i,
    step)`` sees each choice's tokens as they come (the choices interleave). ``options``: the
    other ``Pipeline.generate`` options, the same for every choice. A failure of any choice
    stops them all and is raised."""
    if not isinstance(n, int) or n < 1:
        raise ValueError("n must be an integer >= 1")
    base = session_id if session_id is not None else f"p-{secrets.token_hex(8)}"
    results = [PipelineResult() for _ in range(n)]
    forks_started = False
    opened = [trio.Event() for _ in range(n)]  # the choice's first token, or its end
    opened[0].set()

    async def deliver(i: int, step: pb.StepResult) -> None:
        if on_token is not None:
            maybe = on_token(i, step)
            if inspect.isawaitable(maybe):
                await maybe

    async with trio.open_nursery() as nursery:

        async def choice(i: int) -> None:
            async def token(step: pb.StepResult) -> None:
                opened[i].set()
                await deliver(i, step)

            try:
                await pipeline.generate(prompt, seed=seed + i, session_id=f"{base}-{i}",
                                        fork_of=base, on_token=token, result=results[i],
                                        **options)
            finally:
                opened[i].set()  # (a choice that ended without a token holds nothing up)

        async def first(step: pb.StepResult) -> None:
            nonlocal forks_started
            if not forks_started:  # the prompt is held on every hop, every session idle
                forks_started = True
                for i in range(1, n):
                    nursery.start_soon(choice, i)
                for event in opened:
                    await event.wait()
            await deliver(0, step)

        await pipeline.generate(prompt, seed=seed, session_id=base, on_token=first,
                                result=results[0], client_steps=n > 1, **options)
    return results


__all__ = ["OnChoiceToken", "generate_choices"]
