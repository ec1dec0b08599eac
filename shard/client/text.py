"""One-shot generation in a fresh session (``ShardClient.generate``) and its text
(``ShardClient.generate_text``): the convenience layer over a session's ``generate``."""

from __future__ import annotations

import codecs
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from shard.v1 import shard_pb2 as pb

from .session import ClientSession, StepStream

__all__ = ["OneShot", "TextChunk", "TextStream"]


class OneShot:
    """``ShardClient.generate``: a session opened on first use (``open_session()``), closed
    when exhausted, reset on error, cancellation or ``aclose()``."""

    def __init__(self, open_session: Callable[[], Awaitable[ClientSession]], request: pb.Generate) -> None:
        self._open_session = open_session  # (a session asking for ``TOKEN_CREDIT``)
        self._request = request
        self._session: ClientSession | None = None
        self._steps: StepStream | None = None
        self._done = False

    def __aiter__(self) -> OneShot:
        return self

    async def __anext__(self) -> pb.StepResult:
        if self._done:
            raise StopAsyncIteration
        try:
            if self._steps is None:
                self._session = await self._open_session()
                self._steps = StepStream(self._session, self._session._request(generate=self._request))
            return await self._steps.__anext__()
        except StopAsyncIteration:
            self._done = True
            assert self._session is not None
            await self._session.close()
            raise
        except BaseException:
            self._done = True
            if self._session is not None:
                self._session.abort()
            raise

    async def aclose(self) -> None:
        """Stop now: reset the stream so the worker releases the session at once."""
        if not self._done:
            self._done = True
            if self._session is not None:
                self._session.abort()
        await trio.lowlevel.checkpoint()


@dataclass(frozen=True)
class TextChunk:
    """One generated token as text. ``text`` is what the token completes: it may be empty
    while a UTF-8 character is still incomplete, and the last chunk flushes the decoder."""

    text: str
    token_id: int
    piece: bytes  # the token's raw bytes
    logprob: float
    finish_reason: int  # pb.FinishReason; FINISH_REASON_UNSPECIFIED except on the last token
    n_past: int

    def __str__(self) -> str:
        return self.text


class TextStream:
    """``ShardClient.generate_text``: a ``TextChunk`` per token of a ``OneShot``."""

    def __init__(self, steps: OneShot) -> None:
        self._steps = steps
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __aiter__(self) -> TextStream:
        return self

    async def __anext__(self) -> TextChunk:
        step = await self._steps.__anext__()
        last = step.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        lg = step.logits
        return TextChunk(
            text=self._decoder.decode(lg.piece, final=last),
            token_id=lg.token_id,
            piece=lg.piece,
            logprob=lg.logprob,
            finish_reason=step.finish_reason,
            n_past=step.n_past,
        )

    async def aclose(self) -> None:
        await self._steps.aclose()
