"""Drive a chain of shard workers as one model: the pipeline client.

Quick start::

    async with Pipeline.connect(["10.0.0.1:50051", "10.0.0.2:50051"], timeout=60) as pipe:
        result = await pipe.generate("hello", max_tokens=32)
        print(result.tokens)

Why a library call of its own (not a router): a router adds placement, retries and billing;
this is the smallest correct chain, used by ``trio-shard generate --pipeline``, the tests and
the bench, and a reference for routers. What it guarantees:

* **Compatibility first.** ``connect`` reads every worker's capabilities and refuses the chain
  unless all report the same ``model_fingerprint``, ``n_layers_total`` and ``n_embd`` and their
  layer ranges tile ``[0, n_layers_total)`` in order, without gap or overlap. Each session is then
  opened with ``expected_model_fingerprint`` and ``expected_layer_range``, so a worker swapped in
  between is refused by the worker itself (INCOMPATIBLE_MODEL).
* **One session per shard**, ids ``<id>.<hop>``. Hidden states travel in float32, or float16 on
  the hops whose worker offers it when the caller asks for it (``hidden_dtype``); the client
  validates every tensor it receives (dtype, shape, rows, finite) before forwarding it.
* **Pipelined prefill.** The first shard computes the prompt ``chunk_tokens`` positions at a time
  and streams each chunk's boundary (``Prefill.chunk_tokens``); one Trio task per later hop
  forwards chunk ``i`` to its shard while the shard before it computes chunk ``i+1``. Hops are
  connected by memory channels of capacity 1, so at most one chunk waits per hop.
* **Decoding** sends each chosen token through the chain; the last shard samples (its
  ``Logits.token_id`` is the token), with the same stop rules as the worker's ``Generate``, so the
  result equals a whole-model worker's ``Generate`` token for token.
* **Deadlines.** The caller's deadline is absolute and bounds the whole ``generate`` (one Trio
  deadline scope): every hop's session stream is opened with the time left, rounded *down*, as its
  ``grpc-timeout`` (the worker releases the session when it expires, the client resets the
  stream), so no hop's deadline falls after the caller's.
* **Failure semantics.** A failure, a deadline or a cancellation at any hop resets every hop's
  stream and then calls ``Release`` on every shard (shielded), through a new connection where
  the old one was lost (a live worker retains a session whose connection dropped), so no live
  shard keeps a session or KV cells. The cleanup takes at most ``RELEASE_TIMEOUT`` seconds and
  never ends later than ``CLEANUP_GRACE`` seconds after the caller's deadline. The error raised
  is a ``PipelineError`` (a ``ShardError``) that names the failing hop: index, target and layer
  range.
"""

from __future__ import annotations

import inspect
import logging
import math
import secrets
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from shard.client import ClientSession, ShardClient, sampling
from shard.rpc import convert
from shard.rpc.errors import ErrorCode, ShardError, unwrap_single_exception
from shard.v1 import shard_pb2 as pb

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "Hop",
    "Pipeline",
    "PipelineError",
    "PipelineResult",
    "check_chain",
]

log = logging.getLogger(__name__)

DEFAULT_CHUNK_TOKENS = 32
RELEASE_TIMEOUT = 2.0  # seconds the cleanup (Release on every hop, shielded) may take at most...
CLEANUP_GRACE = 0.5  # ...and how long it may go on after the caller's deadline
#: Hop streams get the time left minus this, rounded down, as their timeout, so that a hop's
#: deadline is never after the caller's although the client computes it a moment later.
HOP_DEADLINE_MARGIN = 0.001
_DEFAULT: Any = object()

OnToken = Callable[[pb.StepResult], "Awaitable[None] | None"]


@dataclass(frozen=True)
class Hop:
    """One shard of the chain, as its worker described itself."""

    index: int
    target: str
    caps: pb.GetCapabilitiesResponse | None = None

    @property
    def layers(self) -> tuple[int, int] | None:
        if self.caps is None:
            return None
        return self.caps.layer_range.start, self.caps.layer_range.end

    def __str__(self) -> str:
        if self.layers is None:
            return f"hop {self.index} ({self.target})"
        return f"hop {self.index} ({self.target}, layers [{self.layers[0]}, {self.layers[1]}))"


class PipelineError(ShardError):
    """A ``ShardError`` that says which hop failed (``hop_index``, ``target``)."""

    def __init__(self, hop: Hop, err: ShardError) -> None:
        super().__init__(
            err.code,
            f"{hop}: {err.message}",
            retryable=err.retryable,
            session_id=err.session_id,
            reason=err.reason,
            supported_versions=err.supported_versions,
            grpc_status=err.grpc_status,
        )
        self.hop_index = hop.index
        self.target = hop.target
        self.cause = err


def _incompatible(hop: Hop, message: str) -> PipelineError:
    return PipelineError(hop, ShardError(ErrorCode.INCOMPATIBLE_MODEL, message))


def check_chain(hops: Sequence[Hop]) -> None:
    """Refuse a chain whose shards are not one model cut into consecutive ranges."""
    if not hops:
        raise ValueError("a pipeline needs at least one worker")
    first = hops[0].caps
    assert first is not None
    end = 0
    for hop in hops:
        caps = hop.caps
        assert caps is not None
        if caps.model_fingerprint != first.model_fingerprint:
            raise _incompatible(
                hop, f"serves model {caps.model_fingerprint}, hop 0 serves {first.model_fingerprint}"
            )
        if (caps.n_layers_total, caps.n_embd) != (first.n_layers_total, first.n_embd):
            raise _incompatible(hop, "n_layers_total / n_embd differ from hop 0's")
        start, stop = caps.layer_range.start, caps.layer_range.end
        if stop <= start:
            raise _incompatible(hop, f"reports the empty layer range [{start}, {stop})")
        if start != end:
            what = "a gap" if start > end else "an overlap"
            raise _incompatible(
                hop, f"starts at layer {start} but the previous hops end at {end} ({what})"
            )
        end = stop
    if end != first.n_layers_total:
        raise _incompatible(hops[-1], f"the chain ends at layer {end} of {first.n_layers_total}")


@dataclass
class PipelineResult:
    """What ``generate`` produced: the last shard's StepResult per token (``finish_reason`` set
    on the last one, as a worker's Generate does) and the prompt length."""

    steps: list[pb.StepResult] = field(default_factory=list)
    prompt_tokens: int = 0

    @property
    def tokens(self) -> list[int]:
        return [s.logits.token_id for s in self.steps]

    @property
    def finish_reason(self) -> int:
        return self.steps[-1].finish_reason if self.steps else pb.FINISH_REASON_UNSPECIFIED


def _hidden(step: pb.StepResult, hop: Hop, session: ClientSession) -> tuple[int, np.ndarray]:
    """Validate a non-last hop's output; return (first position, float32 rows)."""
    if step.WhichOneof("output") != "hidden_states":
        raise ShardError(ErrorCode.INTERNAL, "expected hidden states from a non-last shard")
    assert hop.caps is not None
    rows = convert.tensor_to_array(
        step.hidden_states, hop.caps.n_embd, session.session_id,
        dtype=session.hidden_dtype, rows=step.tokens_processed or None,
    )
    return step.n_past - rows.shape[0], rows


class Pipeline:
    """Connections to every shard of a checked chain. Create with ``Pipeline.connect``."""

    def __init__(
        self,
        hops: list[Hop],
        clients: list[ShardClient],
        *,
        timeout: float | None,
        hidden_dtype: str,
        ssl_context: ssl.SSLContext | None = None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> None:
        self.hops = hops
        self._clients = clients
        self.timeout = timeout
        self.hidden_dtype = hidden_dtype
        self._ssl_context = ssl_context  # to reconnect for a Release (see ``_release``)
        self._metadata = tuple(metadata)

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        targets: Sequence[str],
        *,
        timeout: float | None = 30.0,
        hidden_dtype: str = convert.HIDDEN_DTYPE,
        ssl_context: ssl.SSLContext | None = None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
        wait_for_ready: bool = False,
    ) -> AsyncIterator[Pipeline]:
        """Connect to every worker (in order: first shard first) and check the chain.

        ``timeout``: default deadline of each ``generate``, and of connecting (one deadline for
        all hops); None for none. ``hidden_dtype``: "float32" (default) or "float16" on the hops
        whose worker offers it. ``wait_for_ready``: wait (within ``timeout``) for workers that
        are still loading to serve, instead of failing with ``NOT_READY`` at once (see
        ``ShardClient.wait_for_ready``).
        """
        if hidden_dtype not in convert.WIRE_DTYPES:
            raise ValueError(f"hidden_dtype must be one of {sorted(convert.WIRE_DTYPES)}")
        if not targets:
            raise ValueError("a pipeline needs at least one worker")
        deadline = _deadline(timeout)
        async with AsyncExitStack() as stack:
            clients: list[ShardClient] = []
            hops: list[Hop] = []
            for i, target in enumerate(targets):
                try:
                    client = await stack.enter_async_context(
                        ShardClient.connect(
                            target, timeout=timeout, ssl_context=ssl_context, metadata=metadata
                        )
                    )
                    if wait_for_ready:
                        await client.wait_for_ready(timeout=_left(deadline))
                    caps = await client.capabilities(timeout=_left(deadline))
                except ShardError as err:
                    raise PipelineError(Hop(i, target), err) from None
                clients.append(client)
                hops.append(Hop(i, target, caps))
            check_chain(hops)
            yield cls(
                hops, clients, timeout=timeout, hidden_dtype=hidden_dtype,
                ssl_context=ssl_context, metadata=metadata,
            )

    # ---- generation ----------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_tokens: Sequence[int] = (),
        ignore_eos: bool = False,
        top_logprobs: int = 0,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        session_id: str | None = None,
        timeout: float | None = _DEFAULT,
        on_token: OnToken | None = None,
    ) -> PipelineResult:
        """Prefill ``prompt`` (text, tokenized by the first shard with BOS, or token ids) through
        the chain, then generate up to ``max_tokens`` tokens; same stop rules and results as a
        whole-model worker's ``Generate``. ``on_token`` (sync or async) sees each token's
        StepResult as it arrives. Every shard's session is released when this returns or fails.
        """
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        self._check_chunk(chunk_tokens)
        if timeout is _DEFAULT:
            timeout = self.timeout
        deadline = _deadline(timeout)
        sid = session_id if session_id is not None else f"p-{secrets.token_hex(8)}"
        params = sampling(temperature, top_k=top_k, top_p=top_p, seed=seed)
        sessions: list[ClientSession] = []
        attempted = 0
        blames = _Blames()
        try:
            with trio.CancelScope(deadline=deadline):  # the caller's deadline, for everything
                for hop in self.hops:
                    attempted += 1
                    sessions.append(await self._open(hop, f"{sid}.{hop.index}", deadline, blames))
                result = PipelineResult()
                step = await self._prefill(
                    sessions, prompt, params, top_logprobs, chunk_tokens, blames
                )
                result.prompt_tokens = step.n_past
                capacity = min(s.opened.kv_capacity for s in sessions)
                stop = frozenset(stop_tokens)
                while True:
                    token = step.logits.token_id
                    if step.logits.is_eog and not ignore_eos:
                        step.finish_reason = pb.FINISH_REASON_EOG
                    elif token in stop:
                        step.finish_reason = pb.FINISH_REASON_STOP_TOKEN
                    elif len(result.steps) + 1 >= max_tokens:
                        step.finish_reason = pb.FINISH_REASON_LENGTH
                    elif step.n_past + 1 > capacity:
                        step.finish_reason = pb.FINISH_REASON_CONTEXT_FULL
                    result.steps.append(step)
                    if on_token is not None:
                        maybe = on_token(step)
                        if inspect.isawaitable(maybe):
                            await maybe
                    if step.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        break
                    step = await self._decode(sessions, token, params, top_logprobs, blames)
                for hop, session in zip(self.hops, sessions, strict=True):
                    with _Blame(hop, blames):
                        await session.close()
                return result
            raise blames.deadline_error(self.hops)  # the scope's deadline passed
        except BaseException:
            for session in sessions:
                session.abort()  # RST_STREAM: the worker stops the step and releases
            cleanup_deadline = min(trio.current_time() + RELEASE_TIMEOUT, deadline + CLEANUP_GRACE)
            with trio.CancelScope(shield=True, deadline=cleanup_deadline):
                await self._release(sid, attempted)
            raise

    def _wire_dtype(self, hop: Hop) -> str:
        """The dtype asked of ``hop``: the caller's choice if the worker offers it."""
        assert hop.caps is not None
        if self.hidden_dtype in hop.caps.hidden_wire_dtypes:
            return self.hidden_dtype
        return convert.HIDDEN_DTYPE

    def _check_chunk(self, chunk_tokens: int) -> None:
        """A chunk's hidden states must fit in one message of every hop that carries them."""
        for prev, hop in zip(self.hops, self.hops[1:]):
            assert hop.caps is not None
            limit = min(hop.caps.max_message_bytes, prev.caps.max_message_bytes if prev.caps else 0)
            size = chunk_tokens * hop.caps.n_embd * convert.WIRE_DTYPES[self._wire_dtype(hop)].itemsize
            if limit and size + 1024 > limit:
                raise PipelineError(hop, ShardError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"chunk_tokens={chunk_tokens} makes {size}-byte hidden-state messages; "
                    f"this chain accepts at most {limit} bytes per message",
                ))

    async def _open(self, hop: Hop, sid: str, deadline: float, blames: _Blames) -> ClientSession:
        """Open the hop's session with the remaining budget, rounded down, as its grpc-timeout."""
        assert hop.caps is not None
        want = self._wire_dtype(hop)
        with _Blame(hop, blames):
            timeout = _hop_timeout(deadline)
            if timeout is not None and timeout <= 0:
                raise ShardError(ErrorCode.DEADLINE_EXCEEDED, "the pipeline deadline expired")
            session = await self._clients[hop.index].open_session(
                sid,
                expected_model_fingerprint=hop.caps.model_fingerprint,
                expected_layer_range=hop.layers,
                # float32 is not asked for, so a v1.0 exchange stays byte for byte the same
                hidden_wire_dtype="" if want == convert.HIDDEN_DTYPE else want,
                timeout=timeout,
            )
        return session

    async def _prefill(
        self,
        sessions: list[ClientSession],
        prompt: str | Sequence[int],
        params: pb.SamplingParams,
        top_logprobs: int,
        chunk_tokens: int,
        blames: _Blames,
    ) -> pb.StepResult:
        """Stream the prompt through the chain in chunks; return the last shard's last result."""
        hops, n = self.hops, len(self.hops)
        last: list[pb.StepResult] = []
        text = prompt if isinstance(prompt, str) else None
        tokens = None if isinstance(prompt, str) else list(prompt)

        async def first(out: trio.MemorySendChannel[tuple[int, np.ndarray]] | None) -> None:
            hop, session = hops[0], sessions[0]
            with _Blame(hop, blames, nursery.cancel_scope):
                async with out if out is not None else nullcontext():  # closing ends the next hop
                    steps = session.prefill_chunks(
                        tokens, text=text, chunk_tokens=chunk_tokens, sampling=params,
                        top_logprobs=top_logprobs,
                    )
                    async for step in steps:
                        if out is None:
                            last[:] = [step]
                        else:
                            await out.send(_hidden(step, hop, session))

        async def later(
            k: int,
            inbox: trio.MemoryReceiveChannel[tuple[int, np.ndarray]],
            out: trio.MemorySendChannel[tuple[int, np.ndarray]] | None,
        ) -> None:
            hop, session = hops[k], sessions[k]
            with _Blame(hop, blames, nursery.cancel_scope):
                async with inbox, out if out is not None else nullcontext():
                    async for position, rows in inbox:
                        step = await session.prefill(
                            hidden_states=rows, position=position, sampling=params,
                            top_logprobs=top_logprobs,
                        )
                        if out is None:
                            last[:] = [step]
                        else:
                            await out.send(_hidden(step, hop, session))

        with unwrap_single_exception():
            async with trio.open_nursery() as nursery:
                channels = [trio.open_memory_channel[tuple[int, np.ndarray]](1) for _ in range(n - 1)]
                nursery.start_soon(first, channels[0][0] if n > 1 else None)
                for k in range(1, n):
                    out = channels[k][0] if k < n - 1 else None
                    nursery.start_soon(later, k, channels[k - 1][1], out)
        if blames.failures:
            raise blames.failures[0]
        if not last or last[0].WhichOneof("output") != "logits":
            raise PipelineError(hops[-1], ShardError(ErrorCode.INTERNAL, "no logits after prefill"))
        return last[0]

    async def _decode(
        self,
        sessions: list[ClientSession],
        token: int,
        params: pb.SamplingParams,
        top_logprobs: int,
        blames: _Blames,
    ) -> pb.StepResult:
        """One token through every hop; the last hop's result carries the next token."""
        rows: np.ndarray | None = None
        step = pb.StepResult()
        for hop, session in zip(self.hops, sessions, strict=True):
            with _Blame(hop, blames):
                if rows is None:
                    step = await session.decode(token, sampling=params, top_logprobs=top_logprobs)
                else:
                    step = await session.decode(
                        hidden_state=rows, sampling=params, top_logprobs=top_logprobs
                    )
                if hop.index < len(self.hops) - 1:
                    _, rows = _hidden(step, hop, session)
        if step.WhichOneof("output") != "logits":
            raise PipelineError(self.hops[-1], ShardError(ErrorCode.INTERNAL, "no logits from the last shard"))
        return step

    async def _release(self, sid: str, attempted: int) -> None:
        """Release the session on every hop that may hold one, concurrently, within the
        enclosing scope's deadline; never raises.

        A hop whose connection was lost is released through a new connection: a live worker
        retains a session whose connection dropped (for resume), and nobody would resume it.
        """

        async def release(hop: Hop) -> None:
            name = f"{sid}.{hop.index}"
            client = self._clients[hop.index]
            try:
                if client.connected:
                    try:
                        await client.release(name, timeout=_left(trio.current_effective_deadline()))
                        return
                    except ShardError:
                        if client.connected:
                            raise
                async with ShardClient.connect(
                    hop.target, timeout=_left(trio.current_effective_deadline()),
                    ssl_context=self._ssl_context, metadata=self._metadata,
                ) as fresh:
                    await fresh.release(name)
            except Exception as exc:  # a dead worker: it freed the session with its process
                log.warning("%s: release of %s failed: %s", hop, name, exc)

        async with trio.open_nursery() as nursery:
            for hop in self.hops[:attempted]:
                nursery.start_soon(release, hop)


def _deadline(timeout: float | None) -> float:
    return math.inf if timeout is None else trio.current_time() + timeout


def _left(deadline: float) -> float | None:
    """Seconds until ``deadline`` (None for none), for a call's ``timeout``."""
    return None if math.isinf(deadline) else deadline - trio.current_time()


def _hop_timeout(deadline: float) -> float | None:
    """A hop stream's timeout: the time left until ``deadline`` less ``HOP_DEADLINE_MARGIN``,
    rounded *down* to what ``grpc-timeout`` carries (whole seconds from 99 s, microseconds
    below), so that the transport, which rounds up, never sends more than the time left."""
    left = _left(deadline)
    if left is None:
        return None
    left -= HOP_DEADLINE_MARGIN
    if left >= 99:
        return float(math.floor(left))
    return math.floor(left * 1e6) / 1e6


@dataclass
class _Blames:
    """Which hop one ``generate``'s failure is blamed on."""

    #: The first error of a prefill task (the others are cancelled rather than raising).
    failures: list[PipelineError] = field(default_factory=list)
    #: Hops whose call a cancellation interrupted (the pipeline's deadline, or the caller's).
    interrupted: list[int] = field(default_factory=list)

    def deadline_error(self, hops: Sequence[Hop]) -> PipelineError:
        """The error for the pipeline's deadline scope having passed. A hop's own call deadline
        falls just before it, but both usually pass in one scheduler tick, and the hop's call
        then ends in a cancellation: name the first hop whose call it interrupted, else the
        last hop (the deadline passed in ``on_token``, handling that hop's result)."""
        if self.failures:
            return self.failures[0]
        hop = hops[min(self.interrupted)] if self.interrupted else hops[-1]
        return PipelineError(hop, ShardError(ErrorCode.DEADLINE_EXCEEDED, "the pipeline deadline expired"))


class _Blame:
    """Turn a ``ShardError`` inside the block into a ``PipelineError`` naming ``hop``, and note
    in ``blames`` when a cancellation interrupted the block.

    In a prefill task (``scope`` given) the first error is recorded in ``blames.failures`` and
    the sibling tasks are cancelled instead of raising, so the caller gets one error, not an
    exception group.
    """

    def __init__(self, hop: Hop, blames: _Blames, scope: trio.CancelScope | None = None) -> None:
        self._hop, self._blames, self._scope = hop, blames, scope

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if isinstance(exc, trio.Cancelled):
            self._blames.interrupted.append(self._hop.index)
        if exc is None or not isinstance(exc, ShardError):
            return False
        err = exc if isinstance(exc, PipelineError) else PipelineError(self._hop, exc)
        if self._scope is None:
            raise err from None
        if not self._blames.failures:
            self._blames.failures.append(err)
        self._scope.cancel()
        return True
