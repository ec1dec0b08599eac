"""What every form of ``generate`` shares (one worker, ``--pipeline``, ``--workers``,
``--prompts-file``): the prompt as sent (``--chat``, ``--parse-special``), what is printed
(``GenerateOutput``), and Ctrl-C as a cancellation that releases the sessions first."""

from __future__ import annotations

import argparse
import codecs
import json
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from shard.cli.common import fail

if TYPE_CHECKING:
    from shard.client import ShardError
    from shard.v1 import shard_pb2 as pb


def prompt_for(args: argparse.Namespace, prompt: str, caps: Any) -> tuple[str, bool]:
    """The text to send for ``prompt`` and whether its special tokens are parsed (``--chat``:
    the first worker's chat template renders it as a user message; ``--parse-special``)."""
    from shard.chat import ChatTemplate, ChatTemplateError
    from shard.client import ErrorCode, ShardError

    if not args.chat:
        return prompt, args.parse_special
    template = ChatTemplate.of(caps.chat) if caps is not None else None
    if template is None:
        raise ShardError(ErrorCode.INVALID_ARGUMENT, "--chat: the model has no chat template "
                         "(its GGUF carries none); drop --chat")
    try:
        return template.render([{"role": "user", "content": prompt}]), True
    except ChatTemplateError as exc:
        raise ShardError(ErrorCode.INVALID_ARGUMENT, f"--chat: {exc}") from None


class GenerateOutput:
    """What ``generate`` prints (one worker or a pipeline): each token's text as it arrives,
    then the JSON object with ``--json``, else a newline after the streamed text; also when
    Ctrl-C interrupted it (the JSON then says ``"interrupted": true``) or it failed (the JSON
    then holds what was received and ``"error"``: the code, message and, for a pipeline, the
    hop; the error also goes to stderr)."""

    def __init__(self, *, as_json: bool, index: int | None = None) -> None:
        self.as_json = as_json
        self.index = index  # --prompts-file: the prompt's line among the prompts
        self.done = False
        self.text: list[str] = []
        self.tokens: list[int] = []
        self.finish = 0  # FINISH_REASON_UNSPECIFIED until the last token
        self.failovers: list[dict[str, object]] = []  # a pipeline's hops that moved, if any
        self.stats: dict[str, int] = {}  # a pipeline's passes through the chain, drafts

    def add(self, token_id: int, text: str, finish_reason: int) -> None:
        self.tokens.append(token_id)
        self.text.append(text)
        self.finish = finish_reason or self.finish
        if not self.as_json and text:
            sys.stdout.write(text)
            sys.stdout.flush()

    def on_step(self) -> Callable[[pb.StepResult], None]:
        """A pipeline's ``on_token``: each step's token added as one worker's generate adds
        it, its UTF-8 pieces decoded across steps."""
        from shard.v1 import shard_pb2 as pb

        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def emit(step: pb.StepResult) -> None:
            last = step.finish_reason != pb.FINISH_REASON_UNSPECIFIED
            self.add(step.logits.token_id, decoder.decode(step.logits.piece, final=last),
                     step.finish_reason)

        return emit

    def close(self, *, interrupted: bool = False, error: ShardError | None = None) -> None:
        from shard.v1 import shard_pb2 as pb

        if self.as_json:
            reason = pb.FinishReason.Name(self.finish).removeprefix("FINISH_REASON_").lower()
            result: dict[str, object] = {} if self.index is None else {"index": self.index}
            result.update({"text": "".join(self.text), "tokens": self.tokens,
                           "finish_reason": reason, **self.stats})
            if self.failovers:
                result["failovers"] = self.failovers
            if interrupted:
                result["interrupted"] = True
            if error is not None:
                failed: dict[str, object] = {"code": error.code.name, "message": error.message,
                                             "retryable": error.retryable}
                hop = getattr(error, "hop_index", None)  # a PipelineError names its hop
                if hop is not None:
                    failed.update(hop=hop, target=getattr(error, "target", ""))
                result["error"] = failed
            print(json.dumps(result), flush=True)
        elif error is None or self.text:  # (end the streamed text's line)
            sys.stdout.write("\n")


def finish_generate(run: Callable[[], Awaitable[bool]], out: GenerateOutput) -> int:
    """Run ``generate``'s Trio part: 1 with the error on a ShardError, else print the end of
    the output (what was received, after Ctrl-C) and 0, or 130 after Ctrl-C."""
    import trio

    from shard.client import ShardError

    try:
        interrupted = trio.run(run)
    except ShardError as exc:
        out.close(error=exc)  # what was received, and (with --json) the error
        return fail(str(exc))
    out.close(interrupted=interrupted)
    return 130 if interrupted else 0


async def until_sigint(fn: Callable[[], Awaitable[object]]) -> bool:
    """Run ``fn``; Ctrl-C (SIGINT) *cancels* it and returns True.

    Why not Trio's KeyboardInterrupt: it can land in any task, e.g. a connection's reader, and
    kill the connection before the cleanup (reset the streams, Release the sessions) can use it.
    A cancellation inside the connection's block runs that cleanup in order.
    """
    import signal

    import trio

    from shard.rpc.errors import unwrap_single_exception

    interrupted = False
    with unwrap_single_exception(), trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def cancel_on_signal() -> None:
                nonlocal interrupted
                async for _ in signals:
                    interrupted = True
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(cancel_on_signal)
            await fn()
            nursery.cancel_scope.cancel()
    return interrupted
