"""A raw-socket HTTP/2 peer for tests that must send what no well-behaved client sends.

Frames are built and parsed with hyperframe and headers coded with hpack (the libraries under
h2), so a test can send an oversized frame header, junk, half a message or nothing at all, and
still read exactly what the server answered (GOAWAY, RST_STREAM, statuses).
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable
from typing import Any

import hpack
import trio
from google.protobuf.message import Message
from hyperframe.frame import (
    DataFrame,
    Frame,
    HeadersFrame,
    PingFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame_header(length: int, kind: int, flags: int = 0, stream_id: int = 0) -> bytes:
    """The 9-byte frame header, for frames hyperframe would refuse to build."""
    return length.to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big")


def grpc_message(message: Message | bytes) -> bytes:
    data = message if isinstance(message, bytes) else message.SerializeToString()
    return struct.pack(">?I", False, len(data)) + data


class RawConnection:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()
        self.encoder, self.decoder = hpack.Encoder(), hpack.Decoder()
        self.next_stream_id = 1
        self.eof = False
        self.answer = True  # acknowledge SETTINGS and PINGs (False: a peer that went silent)

    @classmethod
    async def open(cls, host: str, port: int) -> RawConnection:
        return cls(await trio.open_tcp_stream(host, port))

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def handshake(self, *, window: int = 0) -> None:
        """Preface and an empty SETTINGS frame (optionally a bigger connection window)."""
        data = PREFACE + SettingsFrame(0).serialize()
        if window:
            data += WindowUpdateFrame(0, window_increment=window).serialize()
        await self.send(data)

    def headers(self, path: str, *, end_stream: bool = False) -> tuple[int, bytes]:
        sid, self.next_stream_id = self.next_stream_id, self.next_stream_id + 2
        block = self.encoder.encode([
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "test"),
            ("te", "trailers"), ("content-type", "application/grpc"),
        ])
        flags = {"END_HEADERS"} | ({"END_STREAM"} if end_stream else set())
        return sid, HeadersFrame(sid, data=block, flags=flags).serialize()

    async def start(self, path: str, message: Message | bytes, *, end: bool) -> int:
        """Open a stream and send one message (and END_STREAM if ``end``)."""
        sid, data = self.headers(path)
        flags = {"END_STREAM"} if end else set()
        await self.send(data + DataFrame(sid, data=grpc_message(message), flags=flags).serialize())
        return sid

    async def next_frame(self) -> Any | None:
        """The next frame from the server (SETTINGS and PINGs are acknowledged), None at EOF."""
        while True:
            if len(self.buffer) >= 9:
                frame, length = Frame.parse_frame_header(memoryview(bytes(self.buffer[:9])))
                if len(self.buffer) >= 9 + length:
                    body = bytes(self.buffer[9:9 + length])
                    del self.buffer[:9 + length]
                    if frame is None:
                        continue
                    frame.parse_body(memoryview(body))
                    await self._answer(frame)
                    return frame
            try:
                data = await self.stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self.eof = True
                return None
            self.buffer += data

    async def _answer(self, frame: Any) -> None:
        reply = b""
        if isinstance(frame, HeadersFrame):
            frame.decoded = dict(self.decoder.decode(frame.data, raw=False))
        elif isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
            reply = SettingsFrame(0, flags={"ACK"}).serialize()
        elif isinstance(frame, PingFrame) and "ACK" not in frame.flags:
            reply = PingFrame(0, opaque_data=frame.opaque_data, flags={"ACK"}).serialize()
        if reply and self.answer:
            with contextlib.suppress(trio.BrokenResourceError):  # the server may have closed
                await self.send(reply)

    async def until(self, predicate: Callable[[Any], bool], timeout: float = 10) -> Any:
        """The first frame matching ``predicate`` (frames before it are dropped)."""
        with trio.fail_after(timeout):
            while (frame := await self.next_frame()) is not None:
                if predicate(frame):
                    return frame
        raise AssertionError("the server closed the connection")

    async def headers_of(self, stream_id: int) -> dict[str, str]:
        """The headers frame on ``stream_id`` that carries ``grpc-status``."""
        frame = await self.until(lambda f: isinstance(f, HeadersFrame)
                                 and f.stream_id == stream_id and "grpc-status" in f.decoded)
        return frame.decoded

    async def closed_within(self, seconds: float) -> list[Any]:
        """Read until the server closes (fails after ``seconds``); the frames seen."""
        frames = []
        with trio.fail_after(seconds):
            while (frame := await self.next_frame()) is not None:
                frames.append(frame)
        return frames
