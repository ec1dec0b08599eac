"""Trio client for the Shard protocol (used by the CLI, the tests and the bench).

Quick start::

    async with ShardClient.connect("127.0.0.1:50051", timeout=30) as client:
        caps = await client.capabilities()
        async for chunk in client.generate_text("hello", max_tokens=16, temperature=0.8, seed=1):
            print(chunk.text, end="", flush=True)        # chunk.token_id, .piece, .finish_reason

        async with client.session(session_id="chat-1") as s:   # explicit steps
            first = await s.prefill(tokens=[1, 104, 105])
            nxt = await s.decode(first.logits.token_id)
            async for step in s.generate(max_tokens=8):         # continues from `nxt`
                ...
            await s.close(retain=True)                          # keep the KV cache for resume

Why not purerpc's client as is: it never sends ``grpc-timeout``; a server
RST_STREAM or a dropped connection leaves a call waiting forever; breaking out of a bidi
iterator crashes Trio; errors of streaming calls arrive wrapped in exception groups; its task
groups span the caller's code. The wire side (purerpc's gRPC-over-h2 codec with
our own connection loop) lives in ``shard.rpc.transport`` with the server's, so purerpc's
internals stay in one module; this package adds the calls, sessions and typed errors:

* every call carries ``grpc-timeout`` (the remaining time to its deadline) and the client also
  enforces the deadline itself;
* a call that is cancelled, times out or is left early sends RST_STREAM, so the server stops
  and releases the session (it does not keep generating for nobody);
* a reset stream, a GOAWAY or a lost connection ends the affected calls with an error;
* every failure is a ``ShardError`` (``.code``, ``.retryable``, ``.grpc_status``) rebuilt from
  the status and the ``shard-error-bin`` trailer, never a raw exception group;
* session streams grant credit automatically as the caller consumes results, so a caller that
  stops reading pauses the worker instead of filling buffers;
* a result the worker split into chunks (a boundary result over ``max_message_bytes``) is
  reassembled, so callers always see one ``StepResult`` per step; what is buffered for it is
  bounded (at most the session's KV capacity in rows, and ``max_result_bytes`` if set);
* ``wait_for_ready()`` waits for a worker that is still loading to serve (gRPC's
  wait-for-ready), polling ``Health``.

Resource handling: ``connect()`` owns a nursery with the connection's reader and writer tasks
and closes the socket on exit; each call owns one HTTP/2 stream and frees it when it ends. The
connection tasks are shielded until the ``connect()`` block ends, so a caller cancelled from
outside still resets its streams (and can release sessions) instead of dropping the connection,
which would make the worker retain them.

The package, by what each module owns: ``connection`` (``ShardClient``: connecting, the unary
calls, opening sessions), ``session`` (``ClientSession``, a session stream with its credit, and
``StepStream``), ``guard`` (one task at a time per session), ``chunks`` (a result split into
chunks), ``requests`` (the step requests), ``options`` (``sampling``, ``cache_expectation``,
``TOKEN_CREDIT``), ``text`` (``generate``/``generate_text``'s iterators), ``handoff``
(``move_session``).
"""

from shard.rpc.errors import ErrorCode, ShardError

from .connection import ShardClient
from .group import GroupStream
from .handoff import move_session
from .options import TOKEN_CREDIT, cache_expectation, check_sampling_support, sampling
from .session import ClientSession, StateStream, StepStream
from .text import OneShot, TextChunk, TextStream

__all__ = [
    "TOKEN_CREDIT",
    "ClientSession",
    "ErrorCode",
    "GroupStream",
    "OneShot",
    "ShardClient",
    "ShardError",
    "StateStream",
    "StepStream",
    "TextChunk",
    "TextStream",
    "cache_expectation",
    "check_sampling_support",
    "move_session",
    "sampling",
]
