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
from typing import Any, Protocol

import trio

from shard.v1 import shard_pb2 as pb

from .result import PipelineResult

#: ``on_token`` of ``generate_choices``: the choice's index and its step; True (or an
#: awaitable of True) ends that choice alone (a stop sequence), its sessions released.
OnChoiceToken = Callable[[int, pb.StepResult], "Awaitable[bool | None] | bool | None"]


class Generates(Protocol):
    """What this needs of a ``Pipeline``: its ``generate``."""

    async def generate(self, prompt: str | Sequence[int], **options: Any) -> PipelineResult: ...


async def generate_choices(
    pipeline: Generates,
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
    step)`` sees each choice's tokens as they come (the choices interleave); it ends the
    choice by returning True (what it got stays in its result). ``options``: the
    other ``Pipeline.generate`` options, the same for every choice. A failure of any choice
    stops them all and is raised (the first one, as a single generation raises it)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError("n must be an integer >= 1")
    base = session_id if session_id is not None else f"p-{secrets.token_hex(8)}"
    results = [PipelineResult() for _ in range(n)]
    opened = [trio.Event() for _ in range(n)]  # the choice's first token, or its end
    opened[0].set()
    scopes = [trio.CancelScope() for _ in range(n)]  # each choice's own: it may end alone

    async def deliver(i: int, step: pb.StepResult) -> None:
        if on_token is not None:
            maybe = on_token(i, step)
            if inspect.isawaitable(maybe):
                maybe = await maybe
            if maybe is True:
                scopes[i].cancel()  # its generation resets and releases its sessions

    try:
        await _run(pipeline, prompt, n, seed, base, results, opened, scopes, deliver, options)
    except BaseExceptionGroup as group:
        exc = _first_failure(group)
        raise exc from exc.__cause__
    return results


async def _run(pipeline: Generates, prompt: str | Sequence[int], n: int, seed: int, base: str,
               results: list[PipelineResult], opened: list[trio.Event],
               scopes: list[trio.CancelScope],
               deliver: Callable[[int, pb.StepResult], Awaitable[None]],
               options: dict[str, Any]) -> None:
    """Choice 0, and the forks it starts at its first token, in one nursery."""
    forks_started = False
    async with trio.open_nursery() as nursery:

        async def choice(i: int) -> None:
            async def token(step: pb.StepResult) -> None:
                opened[i].set()
                await deliver(i, step)

            try:
                with scopes[i]:
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

        with scopes[0]:
            await pipeline.generate(prompt, seed=seed, session_id=base, on_token=first,
                                    result=results[0], client_steps=n > 1, **options)


def _first_failure(group: BaseExceptionGroup) -> BaseException:
    """What a failed ``generate_choices`` raises: the first choice's failure as it is (a
    ``PipelineError`` the caller maps, as a single generation's), the others being its
    consequences or the same; a group of cancellations only stays a group (trio's own)."""
    failures, _ = group.split(lambda e: not isinstance(e, trio.Cancelled))
    if failures is None:
        return group
    exc: BaseException = failures
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


__all__ = ["Generates", "OnChoiceToken", "generate_choices"]
