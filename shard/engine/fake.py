"""A deterministic fake ShardEngine: no model file, no native code, scriptable.

The fake is a real (tiny) causal model rather than a table of canned answers, so that every
property the contract suite checks on llama.cpp also holds here for the same reason:

* a byte-level vocabulary: ``0`` ``<unk>``, ``1`` ``<s>`` (BOS), ``2`` ``</s>`` (EOS) and
  ``3..258`` the bytes ``0x00..0xFF`` (ids above 258, if ``n_vocab`` is larger, are unused);
* ``n_layers_total`` blocks. Block ``g`` keeps, per position, a running state
  ``s[p] = 0.5 * s[p-1] + x[p]`` (its "KV cell") and outputs
  ``x + tanh(A_g @ x + B_g @ s)``, rounded to float32 at every block boundary;
* weights are drawn from ``numpy.random.PCG64([seed, kind, block])``, so a shard serving blocks
  ``[a, b)`` holds exactly the blocks the whole model holds there. Chaining a fake first shard
  into a fake last shard therefore gives logits *identical* to the whole fake model, as layer
  ranges do on llama.cpp;
* the LM head is scaled so greedy choices have a clear margin; ``<unk>``/``<s>`` are all but
  impossible and EOS is rare but reachable.

Outputs are a pure function of (seed, layer range, input history): every position is computed
one at a time in float64, whatever the batching, prefix reuse or rollback that led to it.

Scripting (``FakeScript``): a per-step latency (``trio.sleep`` per token step, so tests using
``autojump_clock`` run instantly), a scripted ``EngineFailure`` at the N-th compute step or at
load, and an ``on_step`` hook (sync or async) called before every step, e.g. to gate a step on a
``trio.Event`` or to raise an arbitrary exception.

Resource handling: the fake keeps its own KV bookkeeping (a list of per-position block states
per sequence id), maintained only through ``_impl_compute``/``_impl_truncate``; it is what
``metrics().kv_cells_used`` reports, so the contract suite's leak checks test real bookkeeping
rather than the base class's view of the sessions.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import numpy as np
import trio

from . import grammar, sampling
from .base import ComputePlan, ShardEngine, Slot, StreamRun
from .batching import Piece, Step, TickPlanner
from .errors import EngineError, EngineFailure, IncompatibleState, InvalidInput
from .scheduler import BatchScheduler, Job
from .types import (
    POOLING_TYPES,
    Capabilities,
    ChatTemplate,
    LayerRange,
    LayerRangeSupport,
    LoadSpec,
    SamplingParams,
)

log = logging.getLogger(__name__)

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
_SPECIAL_TEXT = {BOS_ID: "<s>", EOS_ID: "</s>"}  # what parse_special turns into these tokens
_SPECIAL_ID = {text: token for token, text in _SPECIAL_TEXT.items()}
_SPECIAL = re.compile("(" + "|".join(map(re.escape, _SPECIAL_ID)) + ")")
BYTE_OFFSET = 3  # token id of byte 0x00
BYTE_VOCAB = BYTE_OFFSET + 256  # smallest vocabulary the byte tokenizer fits in

_KIND_EMBD, _KIND_BLOCK, _KIND_HEAD = 1, 2, 3
_HEAD_SCALE = 8.0  # logit spread: top-1 usually has a clear margin, sampling still varies
_EOS_BIAS = -1.5
_SPECIAL_BIAS = -30.0


@dataclass(frozen=True)
class FakeModel:
    """The fake "weights": every output is derived from these fields (and the layer range)."""

    n_layers_total: int = 4
    n_embd: int = 16
    n_vocab: int = BYTE_VOCAB
    architecture: str = "fake-llama"
    seed: int = 0
    #: A chat template (Jinja2) reported by a first shard, rendered with ``<s>``/``</s>`` as
    #: BOS, EOS and end of turn; "" for none.
    chat_template: str = ""
    #: The pooling type the model declares (``POOLING_TYPES``; "" none): with one, a whole
    #: fake model embeds, pooling its last block's outputs as llama.cpp does.
    pooling_type: str = ""

    def __post_init__(self) -> None:
        if self.n_layers_total < 1:
            raise InvalidInput("n_layers_total must be >= 1")
        if self.n_embd < 1:
            raise InvalidInput("n_embd must be >= 1")
        if self.n_vocab < BYTE_VOCAB:
            raise InvalidInput(f"the byte tokenizer needs n_vocab >= {BYTE_VOCAB}")
        if not 0 <= self.seed < 2**63:
            raise InvalidInput("seed must be in [0, 2**63)")
        if self.pooling_type and self.pooling_type not in POOLING_TYPES:
            raise InvalidInput(f"pooling_type must be one of {', '.join(POOLING_TYPES)} or empty")

    def fingerprint(self) -> str:
        """Stable hex digest of the whole model's config (identical for every shard of it)."""
        fields = asdict(self)
        if not fields["chat_template"]:
            del fields["chat_template"]  # the fingerprints of models without one stay as they were
        if not fields["pooling_type"]:
            del fields["pooling_type"]  # (as the chat template)
        blob = json.dumps({"format": "fake-v1", **fields}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class FakeStep:
    """Passed to ``FakeScript.on_step`` before each compute step."""

    session_id: str
    seq_id: int
    position: int  # absolute position about to be computed
    index: int  # 1-based count of compute steps since load, across all sessions


StepHook = Callable[[FakeStep], "Awaitable[None] | None"]


@dataclass(frozen=True)
class FakeScript:
    """Scripted behaviour: latency and failures. The default is instant and never fails.

    ``batched``: computes go through the batching scheduler as on llama.cpp (ticks holding the
    rows of several sessions, ``LoadSpec.batch_tokens`` / ``max_batch_sessions``, layer ranges
    that do not end the model never mixing a prompt chunk with other rows), and a tick takes
    ``tick_latency + row_latency * rows`` seconds instead of ``step_latency`` per position:
    scripted step costs for tests of scheduling, contention and step deadlines.
    """

    step_latency: float = 0.0  # seconds slept (trio.sleep) before each token step
    load_latency: float = 0.0
    fail_at_step: int | None = None  # raise EngineFailure at this 1-based compute step
    fail_on_load: bool = False
    on_step: StepHook | None = None
    batched: bool = False
    tick_latency: float = 0.0
    row_latency: float = 0.0
    #: Appended to the engine's ``kv_layout``: a replica whose KV is laid out otherwise (as
    #: another llama.cpp build's may be), for tests of a refused hand-off; None: the engine
    #: cannot move sessions at all (``kv_layout`` "", as an older worker's).
    kv_layout_tag: str | None = ""

    def __post_init__(self) -> None:
        for name in ("step_latency", "load_latency", "tick_latency", "row_latency"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise InvalidInput(f"{name} must be a finite number >= 0")
        if self.fail_at_step is not None and self.fail_at_step < 1:
            raise InvalidInput("fail_at_step counts from 1")


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, *key]))


class _Weights:
    """The blocks of one layer range, plus embeddings (first shard) and head (last shard)."""

    def __init__(self, model: FakeModel, layers: LayerRange) -> None:
        d = model.n_embd
        scale = 1.0 / math.sqrt(d)
        self.blocks = [
            (
                _rng(model.seed, _KIND_BLOCK, g, 0).standard_normal((d, d)) * scale,
                _rng(model.seed, _KIND_BLOCK, g, 1).standard_normal((d, d)) * scale,
            )
            for g in range(layers.start, layers.end)
        ]
        self.embd: np.ndarray | None = None
        self.head: np.ndarray | None = None
        self.bias: np.ndarray | None = None
        if layers.start == 0:
            self.embd = _rng(model.seed, _KIND_EMBD).standard_normal((model.n_vocab, d)).astype(
                np.float32
            )
        if layers.end == model.n_layers_total:
            self.head = _rng(model.seed, _KIND_HEAD).standard_normal((model.n_vocab, d)) * scale
            bias = np.zeros(model.n_vocab)
            bias[[UNK_ID, BOS_ID]] = _SPECIAL_BIAS
            bias[EOS_ID] = _EOS_BIAS
            bias[BYTE_VOCAB:] = _SPECIAL_BIAS
            self.bias = bias


class FakeEngine(ShardEngine):
    """Deterministic in-process engine implementing the ShardEngine hooks (see module doc)."""

    def __init__(self, model: FakeModel | None = None, script: FakeScript | None = None) -> None:
        super().__init__()
        self.model = model if model is not None else FakeModel()
        self.script = script if script is not None else FakeScript()
        self._weights: _Weights | None = None
        self._layers: LayerRange | None = None
        self._kv: dict[int, list[np.ndarray]] = {}  # seq_id -> per-position block states
        self._steps = 0
        self._scheduler: BatchScheduler | None = None  # batched mode, set at load

    # ---- hooks -----------------------------------------------------------------------------

    async def _impl_load(self, spec: LoadSpec) -> Capabilities:
        await trio.sleep(self.script.load_latency)
        if self.script.fail_on_load:
            raise EngineFailure("scripted load failure")
        m = self.model
        layers = spec.layer_range if spec.layer_range is not None else LayerRange(0, m.n_layers_total)
        if layers.end > m.n_layers_total:
            raise InvalidInput(
                f"layer range [{layers.start}, {layers.end}) exceeds the model's "
                f"{m.n_layers_total} layers"
            )
        per_session = spec.n_ctx // spec.max_sessions
        if per_session < 1:
            raise InvalidInput(f"n_ctx {spec.n_ctx} cannot hold {spec.max_sessions} sessions")
        self._weights = _Weights(m, layers)
        self._layers = layers
        if self.script.batched:
            last = layers.end == m.n_layers_total
            planner = TickPlanner(
                min(spec.batch_tokens or spec.n_batch, spec.n_batch),
                min(spec.max_batch_sessions or spec.max_sessions, spec.max_sessions),
                mix=last,
            )
            self._compute_stops_itself = True  # a scheduler job (BatchScheduler.compute)
            self._scheduler = BatchScheduler(
                planner, self._run_tick, counters=self._counters, stats=self._tick_stats,
                is_open=lambda slot: not slot.releasing and self._slots.get(slot.session_id) is slot,
            )
        return Capabilities(
            engine="fake",
            model_fingerprint=m.fingerprint(),
            architecture=m.architecture,
            n_layers_total=m.n_layers_total,
            layer_range=layers,
            n_embd=m.n_embd,
            n_vocab=m.n_vocab,
            n_ctx=spec.n_ctx,
            n_ctx_per_session=per_session,
            max_sessions=spec.max_sessions,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            max_token_bytes=len(_SPECIAL_TEXT[EOS_ID]),  # a byte per token, or a special one
            chat=ChatTemplate(m.chat_template, _SPECIAL_TEXT[BOS_ID], _SPECIAL_TEXT[EOS_ID],
                              _SPECIAL_TEXT[EOS_ID], add_bos=True,
                              special_texts=tuple(_SPECIAL_ID)) if layers.start == 0 else ChatTemplate(),
            layer_ranges=LayerRangeSupport(True, "any boundary (the fake model computes every range)"),
            kv_layout="" if self.script.kv_layout_tag is None
            else f"fake-kv/f64/{layers.count}x{m.n_embd}{self.script.kv_layout_tag}",
            prefix_cache_tokens=spec.prefix_cache_tokens,
            pooling_type=m.pooling_type,
            prefix_cache_detail="released histories, one sequence each, copied to a new "
            "session (as on llama.cpp)" if spec.prefix_cache_tokens else "off (budget 0)",
        )

    async def _impl_compute(self, slot: Slot, plan: ComputePlan) -> np.ndarray:
        if self._scheduler is not None:
            scheduler = self._scheduler
            job = _FakeJob(slot, plan, scheduler.new_step(slot, plan), trio.current_time())
            await scheduler.compute(job)
            if job.error is not None:
                raise job.error
            return job.result
        cells = self._cells_to_keep(slot, plan)
        outputs: list[np.ndarray] = []
        for i in range(plan.n_new):
            position = plan.keep + i
            await self._before_step(slot, position)
            slot.cancel.raise_if_set(slot.session_id)
            if i == 0:  # nothing changes before the first position is computed
                slot.touch()
                cells = self._start_cells(slot, plan)
            outputs.append(self._compute_position(plan, i, cells))
        return self._output(outputs, plan)

    def _impl_group_scheduler(self) -> BatchScheduler | None:
        return self._scheduler

    def _impl_group_job(self, slot: Slot, plan: ComputePlan) -> Job | None:
        scheduler = self._scheduler
        if scheduler is None:
            return None
        return _FakeJob(slot, plan, scheduler.new_step(slot, plan), trio.current_time())

    async def _impl_stream(self, slot: Slot, run: StreamRun) -> None:
        scheduler = self._scheduler
        if scheduler is None or run.plan is None:
            return await super()._impl_stream(slot, run)

        def job_for(plan: ComputePlan) -> _FakeJob:
            job = _FakeJob(slot, plan, scheduler.new_step(slot, plan), trio.current_time())
            job.sampling = run.sampling
            return job

        def follow(job: Job) -> Job | None:
            if job.error is not None:
                return None
            assert isinstance(job, _FakeJob)
            plan = run.step(job.result, job.chosen)
            return None if plan is None else job_for(plan)

        last = await scheduler.stream(job_for(run.plan), follow)
        if last.error is not None:
            raise last.error

    def _cells_to_keep(self, slot: Slot, plan: ComputePlan) -> list[np.ndarray]:
        """The cells the plan starts from: the session's, or the prefix cache entry's it copies."""
        seq = slot.seq_id if plan.copy_from is None else plan.copy_from
        cells = self._kv.get(seq, [])
        if len(cells) < plan.keep:
            raise EngineFailure(
                f"fake KV cache holds {len(cells)} positions but the plan keeps {plan.keep}"
            )
        return cells

    def _start_cells(self, slot: Slot, plan: ComputePlan) -> list[np.ndarray]:
        """The session's cells cut to ``plan.keep``, or a copy of the entry's first ``keep``
        (``plan.copy_from``: the prefix cache) replacing them. (A cell is never changed in
        place, so a copy of the list copies the cells.)"""
        if plan.copy_from is not None:
            cells = self._kv[slot.seq_id] = self._kv[plan.copy_from][: plan.keep]
            return cells
        cells = self._kv.setdefault(slot.seq_id, [])
        del cells[plan.keep :]
        return cells

    def _compute_position(self, plan: ComputePlan, i: int, cells: list[np.ndarray]) -> np.ndarray:
        """Row ``i`` of the plan at position ``keep + i``; appends its block states."""
        weights = self._weights
        assert weights is not None
        if plan.tokens is not None:
            assert weights.embd is not None
            x = weights.embd[plan.tokens[i]]
        else:
            assert plan.hidden is not None
            x = plan.hidden[i]
        hidden, states = self._forward(x, cells[-1] if cells else None)
        cells.append(states)
        return hidden

    def _output(self, outputs: list[np.ndarray], plan: ComputePlan) -> np.ndarray:
        weights = self._weights
        assert weights is not None
        if weights.head is not None:
            if plan.all_logits:
                return np.stack([self._logits(o) for o in outputs])
            return self._logits(outputs[-1])
        return np.stack(outputs)

    async def _run_tick(self, tick: list[tuple[Job, Piece]]) -> None:
        """Batched mode: one scripted tick. Like a native step it computes every piece it was
        given (a cancelled job left the queue before the tick); a failing job fails alone."""
        rows = sum(piece.count for _, piece in tick)
        script = self.script
        hooked = script.on_step is not None or script.fail_at_step is not None
        seconds = script.tick_latency + script.row_latency * rows
        await trio.sleep(seconds)
        self._counters["native_step_us_total"] += int(seconds * 1e6)  # the scripted "native" step
        for job, piece in tick:
            assert isinstance(job, _FakeJob)
            plan, slot = job.plan, job.slot
            try:
                if not job.started:
                    self._cells_to_keep(slot, plan)
                    job.start()
                    self._start_cells(slot, plan)
                cells = self._kv[slot.seq_id]
                for i in range(piece.start, piece.start + piece.count):
                    if hooked:
                        await self._on_step(slot, plan.keep + i)
                    else:  # (what ``_on_step`` does without a script hook: no coroutine per row)
                        self._steps += 1
                    job.outputs.append(self._compute_position(plan, i, cells))
                job.step.done_rows += piece.count
                if piece.completes:
                    job.finish(result=self._output(job.outputs, job.plan))
            except EngineError as exc:
                job.finish(error=exc)
            except Exception as exc:  # noqa: BLE001 - the base class turns it into EngineFailure
                job.finish(error=exc)
        self._mask_tick([(job.slot, job.plan) for job, _ in tick if job.finished and job.error is None])
        self._choose_beside(tick)

    def _choose_beside(self, tick: list[tuple[Job, Piece]]) -> None:
        """The token and log-sum-exp of every plain greedy stream step this tick finished, for all
        its rows at once, kept beside each row as the llama engine's native thread keeps them
        (``Claimed``): each result is then built without a pass over the vocabulary per row
        (``ShardEngine._make_result``). A row that is not finite gets none and is refused there."""
        jobs = [job for job, _ in tick if isinstance(job, _FakeJob) and job.finished
                and job.error is None and job.sampling is not None and job.sampling.plain_greedy
                and isinstance(job.result, np.ndarray) and job.result.ndim == 1]
        if not jobs:
            return
        try:
            tokens, lses, finite = sampling.greedy_rows(np.stack([job.result for job in jobs]))
        except Exception:  # noqa: BLE001 - rows of unequal shapes: each is chosen alone, checked
            log.exception("fake engine: a tick's rows could not be chosen together")
            return
        for job, token, lse, ok in zip(jobs, tokens, lses, finite):
            if ok:
                job.chosen = (job.sampling, token, lse)

    async def _impl_embed(self, tokens: tuple[int, ...]) -> np.ndarray:
        """Every position through every block from an empty state that only this call sees
        (no sequence, no cell), then pooled as the model declares: the mean of the outputs,
        the first (CLS) or the last."""
        await trio.lowlevel.checkpoint()
        weights = self._weights
        assert weights is not None and weights.embd is not None
        prev: np.ndarray | None = None
        outputs = []
        for token in tokens:
            hidden, prev = self._forward(weights.embd[token], prev)
            outputs.append(hidden.astype(np.float64))
        pooling = self.model.pooling_type
        if pooling == "cls":
            return outputs[0].astype(np.float32)
        if pooling == "last":
            return outputs[-1].astype(np.float32)
        return np.mean(outputs, axis=0).astype(np.float32)

    async def _impl_truncate(self, slot: Slot, keep: int) -> None:
        cells = self._kv.get(slot.seq_id)
        if cells is not None:
            del cells[keep:]
            if not cells:
                del self._kv[slot.seq_id]
        await trio.lowlevel.checkpoint()

    async def _impl_fork(self, source: Slot, slot: Slot) -> None:
        # (a cell is never changed in place: a copy of the list copies the cells)
        await trio.lowlevel.checkpoint()
        cells = self._kv.get(source.seq_id, [])[: source.n_past]
        if len(cells) != source.n_past:
            raise EngineFailure(f"fake KV cache holds {len(cells)} positions, the session {source.n_past}")
        if cells:
            self._kv[slot.seq_id] = list(cells)

    async def _impl_forget_cells(self, seq_ids: list[int]) -> None:
        for seq in seq_ids:
            self._kv.pop(seq, None)
        await trio.lowlevel.checkpoint()

    async def _impl_move_cells(self, source: int, seq: int) -> None:
        # (before the checkpoint: a step planned from the moved entry finds it at ``seq``)
        cells = self._kv.pop(source, None)
        if cells:
            self._kv[seq] = cells
        await trio.lowlevel.checkpoint()

    def _cell_shape(self) -> tuple[int, int]:
        assert self._weights is not None
        return len(self._weights.blocks), self.model.n_embd

    async def _impl_export(self, slot: Slot) -> bytes:
        await trio.lowlevel.checkpoint()
        cells = self._kv.get(slot.seq_id, [])[: slot.n_past]
        if len(cells) != slot.n_past:
            raise EngineFailure(f"fake KV cache holds {len(cells)} positions, the session {slot.n_past}")
        return np.stack(cells).astype("<f8").tobytes() if cells else b""

    async def _impl_import(self, slot: Slot, data: bytes, n_past: int) -> None:
        await trio.lowlevel.checkpoint()
        blocks, width = self._cell_shape()
        if len(data) != n_past * blocks * width * 8:
            raise IncompatibleState(
                f"{len(data)} bytes do not hold {n_past} positions of {blocks}x{width} float64 "
                "block states", session_id=slot.session_id)
        states = np.frombuffer(data, dtype="<f8").reshape(n_past, blocks, width)
        if not np.isfinite(states).all():
            raise IncompatibleState("the state holds NaN or infinite values",
                                    session_id=slot.session_id)
        self._kv[slot.seq_id] = [row.astype(np.float64) for row in states]

    def _impl_state_bound(self, n_past: int) -> int:
        blocks, width = self._cell_shape()
        return n_past * blocks * width * 8

    def _impl_tokenize(self, text: str, add_bos: bool, parse_special: bool) -> list[int]:
        ids = [BOS_ID] if add_bos else []
        parts = _SPECIAL.split(text) if parse_special else [text]
        for part in parts:
            special = _SPECIAL_ID.get(part) if parse_special else None
            if special is not None:
                ids.append(special)
            else:
                ids.extend(BYTE_OFFSET + b for b in part.encode("utf-8"))
        return ids

    def _impl_token_piece(self, token_id: int) -> bytes:
        if BYTE_OFFSET <= token_id < BYTE_VOCAB:
            return bytes((token_id - BYTE_OFFSET,))
        return b""  # control and unused tokens render as nothing, as in llama.cpp

    def _impl_is_eog(self, token_id: int) -> bool:
        return token_id == EOS_ID

    def _impl_grammar_tokenizer(self) -> object:
        pieces = [b"<unk>", b"<s>", b"</s>", *(bytes((b,)) for b in range(256))]
        pieces += [b""] * (self.model.n_vocab - len(pieces))  # unused ids: never allowed

        def encode(text: bytes) -> list[int]:
            return [BYTE_OFFSET + b for b in text]

        return grammar.tokenizer_from_pieces(pieces, [EOS_ID], [UNK_ID, BOS_ID, EOS_ID], encode)

    def _impl_kv_cells_used(self) -> int:
        return sum(len(cells) for cells in self._kv.values())

    async def _impl_close(self) -> None:
        self._kv.clear()
        self._weights = None
        await trio.lowlevel.checkpoint()

    # ---- numerics --------------------------------------------------------------------------

    async def _before_step(self, slot: Slot, position: int) -> None:
        await trio.sleep(self.script.step_latency)  # a checkpoint even when the latency is 0
        await self._on_step(slot, position)

    async def _on_step(self, slot: Slot, position: int) -> None:
        self._steps += 1
        index = self._steps
        if self.script.on_step is not None:
            maybe = self.script.on_step(FakeStep(slot.session_id, slot.seq_id, position, index))
            if inspect.isawaitable(maybe):
                await maybe
        if self.script.fail_at_step is not None and index == self.script.fail_at_step:
            raise EngineFailure(f"scripted failure at compute step {index}")

    def _forward(self, x: np.ndarray, prev: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """One position through this shard's blocks; returns (float32 output, block states).
        (``ndarray.dot``, not ``@``: the same BLAS product for these 2-D by 1-D float64
        operands, without the matmul ufunc's dispatch, a microsecond a row.)"""
        weights = self._weights
        assert weights is not None
        h = np.asarray(x, dtype=np.float32).astype(np.float64)
        states = np.empty((len(weights.blocks), h.shape[0]))
        for i, (a, b) in enumerate(weights.blocks):
            s = h if prev is None else 0.5 * prev[i] + h
            states[i] = s
            h = (h + np.tanh(a.dot(h) + b.dot(s))).astype(np.float32).astype(np.float64)
        return h.astype(np.float32), states

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        weights = self._weights
        assert weights is not None and weights.head is not None and weights.bias is not None
        h = hidden.astype(np.float64)
        h = h / (math.sqrt(h.dot(h)) + 1e-6) * math.sqrt(h.shape[0])  # (np.linalg.norm's value)
        return (weights.head.dot(h) * _HEAD_SCALE + weights.bias).astype(np.float32)


class _FakeJob(Job):
    """A batched-mode job and the rows it computed so far."""

    def __init__(self, slot: Slot, plan: ComputePlan, step: Step, submitted: float) -> None:
        super().__init__(slot, plan, step, submitted)
        self.outputs: list[np.ndarray] = []
        #: A stream step's sampling, and (sampling, token, log-sum-exp) once its tick chose.
        self.sampling: SamplingParams | None = None
        self.chosen: tuple[SamplingParams, int, float] | None = None


__all__ = ["FakeEngine", "FakeModel", "FakeScript", "FakeStep", "StepHook"]
