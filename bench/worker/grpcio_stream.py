"""A server-driven ``Generate`` read by the official ``grpcio`` client (C-core), for the benches.

Why a second client: the project's ``ShardClient`` is Python over h2; ``grpcio`` moves the
HTTP/2 work into C, so measuring both (bench/worker/hot_path.py ``--grpcio``) shows how much of a
token's client CPU is ours and how much any gRPC client costs. Blocking: run it in a thread;
``connect`` first, so that the timed stream does not include the connection's handshake.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from shard.rpc.versions import current_proto
from shard.v1 import shard_pb2 as pb

_END = object()


class _Requests:
    """The request stream: fed by the reading loop (credit), half-closed by ``end``."""

    def __init__(self, version: pb.ProtocolVersion) -> None:
        self._q: queue.Queue[Any] = queue.Queue()
        self._version = version

    def put(self, **kind: Any) -> None:
        self._q.put(pb.SessionRequest(version=self._version, **kind))

    def end(self) -> None:
        self._q.put(_END)

    def __iter__(self) -> Iterator[pb.SessionRequest]:
        while (item := self._q.get()) is not _END:
            yield item


def connect(target: str, timeout: float = 60.0) -> grpc.Channel:
    """A grpcio channel to ``target``, connected (so a timed stream does not pay the handshake)."""
    channel = grpc.insecure_channel(target)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except BaseException:
        channel.close()
        raise
    return channel


def generate(
    channel: grpc.Channel, prompt: Sequence[int], max_tokens: int, *,
    version: pb.ProtocolVersion | None = None, timeout: float = 600.0,
) -> list[int]:
    """Greedy ``Generate`` of ``max_tokens`` tokens (EOS ignored) in a fresh session, released at
    the end; returns the tokens. ``version``: the protocol version sent (default: this
    checkout's; an older worker needs the one it speaks). Credit goes back once half the window
    is used, as ``ShardClient`` grants it."""
    session = channel.stream_stream(
        "/shard.v1.Shard/Session", request_serializer=pb.SessionRequest.SerializeToString,
        response_deserializer=pb.SessionResponse.FromString)
    reqs = _Requests(version if version is not None else current_proto())
    reqs.put(open=pb.OpenSession(session_id=f"grpcio-{time.monotonic_ns()}"))
    responses = session(iter(reqs), timeout=timeout)
    tokens: list[int] = []
    try:
        opened = next(responses)
        if opened.WhichOneof("kind") != "opened":
            raise RuntimeError(f"expected SessionOpened, got {opened.WhichOneof('kind')}")
        window = outstanding = max(1, opened.opened.credit)
        g = pb.Generate(max_tokens=max_tokens, ignore_eos=True)
        g.tokens.ids.extend(prompt)
        reqs.put(generate=g)
        for msg in responses:
            kind = msg.WhichOneof("kind")
            if kind == "error":
                raise RuntimeError(f"worker error: {msg.error}")
            if kind != "step":
                continue
            tokens.append(msg.step.logits.token_id)
            if msg.step.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                break
            outstanding -= 1
            if outstanding <= window // 2:
                reqs.put(credit=pb.Credit(messages=window - outstanding))
                outstanding = window
        reqs.put(close=pb.CloseSession(retain=False))
        reqs.end()
        for _ in responses:  # the usage, SessionClosed, then the status
            pass
    finally:
        reqs.end()
        responses.cancel()
    if len(tokens) != max_tokens:
        raise RuntimeError(f"grpcio Generate streamed {len(tokens)} tokens, expected {max_tokens}")
    return tokens
