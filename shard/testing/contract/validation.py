"""Contract tests of bad input: every malformed request gets its typed error before any work and
leaves every session as it was; the reserved MTP and aux-state hooks fail closed."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from shard.engine import (
    AuxState,
    AuxStateKind,
    DecodeRequest,
    EngineError,
    IllegalTransition,
    InvalidInput,
    MtpRequest,
    PrefillRequest,
    SamplingParams,
    UnknownSession,
    UnsupportedFeature,
)

from ..factories import EngineFactory, EngineOptions, ShardPart
from .harness import (
    assert_layer_range_refused,
    assert_same_logits,
    decode,
    decode_fresh,
    prefill,
    prompt_tokens,
)


class BadInput:
    """Malformed requests get typed errors and change nothing."""

    async def test_bad_input_gets_typed_errors_and_leaves_sessions_untouched(
        self, engine_factory: EngineFactory
    ) -> None:
        async with engine_factory.open() as engine:
            caps = engine.capabilities()
            good = prompt_tokens(engine, 6)
            await engine.open_session("s")
            await engine.open_session("bystander")
            r = await prefill(engine, "s", good)
            assert r.logits is not None
            await prefill(engine, "bystander", prompt_tokens(engine, 8, salt=1))
            snapshot = engine.sessions()
            hidden = np.zeros((2, caps.n_embd), dtype=np.float32)
            too_long = prompt_tokens(engine, caps.n_ctx_per_session + 1)

            bad_requests: list[tuple[type[EngineError], Callable[[], Awaitable[Any]]]] = [
                (InvalidInput, lambda: prefill(engine, "s", ())),
                (InvalidInput, lambda: prefill(engine, "s", (-1,))),
                (InvalidInput, lambda: prefill(engine, "s", (caps.n_vocab,))),
                (InvalidInput, lambda: prefill(engine, "s", (1, 2**40))),
                (InvalidInput, lambda: prefill(engine, "s", (1, True))),
                (InvalidInput, lambda: prefill(engine, "s", (1, 5.0))),  # type: ignore[arg-type]
                (InvalidInput, lambda: prefill(engine, "s", too_long)),
                (InvalidInput, lambda: prefill(engine, "s", good, position=7)),
                (InvalidInput, lambda: prefill(engine, "s", good, position=-1)),
                (InvalidInput, lambda: prefill(engine, "s", good, top_k_logprobs=-1)),
                (InvalidInput, lambda: prefill(engine, "s", good, top_k_logprobs=65)),
                (InvalidInput, lambda: prefill(engine, "s", good, position=True)),
                (InvalidInput, lambda: prefill(engine, "s", good, top_k_logprobs=True)),
                (InvalidInput, lambda: engine.prefill(PrefillRequest("s"))),
                (InvalidInput, lambda: engine.prefill(
                    PrefillRequest("s", tokens=good, hidden_states=hidden))),
                (InvalidInput, lambda: engine.prefill(PrefillRequest("s", hidden_states=hidden))),
                (InvalidInput, lambda: decode(engine, "s", -3)),
                (InvalidInput, lambda: decode(engine, "s", caps.n_vocab)),
                (InvalidInput, lambda: engine.decode(DecodeRequest("s"))),
                (InvalidInput, lambda: engine.decode(
                    DecodeRequest("s", hidden_state=hidden[:1]))),
                (UnknownSession, lambda: prefill(engine, "ghost", good)),
                (UnknownSession, lambda: decode(engine, "ghost", 5)),
                (UnknownSession, lambda: prefill(engine, ["s"], good)),  # type: ignore[arg-type]
                # Malformed fields must be this request's error, never an engine fault.
                (InvalidInput, lambda: prefill(engine, "s", good, sampling=None)),
                (InvalidInput, lambda: decode(engine, "s", 5, sampling="greedy")),
                (UnsupportedFeature, lambda: prefill(engine, "s", good, aux_state="state")),
                (UnsupportedFeature, lambda: decode(engine, "s", 5, aux_state=b"")),
            ]
            for expected, call in bad_requests:
                with pytest.raises(expected):
                    await call()
                assert engine.sessions() == snapshot
                assert engine.health().ready
            with pytest.raises(InvalidInput):
                engine.tokenize(123)  # type: ignore[arg-type]
            with pytest.raises(InvalidInput):
                engine.token_piece(caps.n_vocab)
            with pytest.raises(InvalidInput):
                SamplingParams(temperature=float("nan"))
            with pytest.raises(InvalidInput):
                SamplingParams(top_p=0.0)
            for bad_params in ({"top_k": 2.5}, {"seed": 1.5}, {"top_k": True}, {"temperature": "1"},
                               {"top_p": None}):
                with pytest.raises(InvalidInput):
                    SamplingParams(**{"temperature": 1.0, **bad_params})
            assert engine.cancel(["s"]) is False  # type: ignore[arg-type]
            assert await engine.release(["s"]) is False  # type: ignore[arg-type]
            assert engine.metrics().kv_cells_used == 6 + 8
            # Both sessions still compute exactly as before.
            again = await decode(engine, "s", r.logits.token_id)
            assert_same_logits(again, await decode_fresh(engine, "ref", good, r.logits.token_id))

    @pytest.mark.parametrize("part", [ShardPart.LAST, ShardPart.MIDDLE], ids=lambda p: p.value)
    async def test_bad_hidden_states_on_a_later_shard(
        self, engine_factory: EngineFactory, part: ShardPart
    ) -> None:
        if not engine_factory.layer_ranges:
            await assert_layer_range_refused(engine_factory, part)
            return
        async with engine_factory.open(EngineOptions(part=part, pieces=3)) as engine:
            caps = engine.capabilities()
            assert not caps.is_first and caps.is_last is (part is ShardPart.LAST)
            d = caps.n_embd
            await engine.open_session("s")
            await engine.open_session("bystander")
            rng = np.random.default_rng(0)
            ok = rng.standard_normal((5, d)).astype(np.float32)
            await engine.prefill(PrefillRequest("s", hidden_states=ok))
            await engine.prefill(PrefillRequest("bystander", hidden_states=ok[:3]))
            snapshot = engine.sessions()
            nan = ok.copy()
            nan[1, 2] = np.nan
            inf = ok.copy()
            inf[0, 0] = np.inf
            too_long = np.zeros((caps.n_ctx_per_session + 1, d), dtype=np.float32)
            bad_hidden = [
                ok[:, : d - 1],  # wrong width
                np.zeros((3, d + 1), dtype=np.float32),
                ok[0],  # 1-D
                ok.reshape(1, 5, d),  # 3-D
                np.zeros((0, d), dtype=np.float32),  # no rows
                ok.astype(np.float64),  # wrong dtype
                nan,
                inf,
                too_long,
            ]
            for value in bad_hidden:
                with pytest.raises(InvalidInput):
                    await engine.prefill(PrefillRequest("s", hidden_states=value, position=5))
                assert engine.sessions() == snapshot
            for row in (ok[:2], nan[1:2], ok[0], ok[:1, :-1]):
                with pytest.raises(InvalidInput):
                    await engine.decode(DecodeRequest("s", hidden_state=row))
            with pytest.raises(InvalidInput):
                await prefill(engine, "s", (1, 5, 6))  # token ids need a first shard
            with pytest.raises(InvalidInput):
                await decode(engine, "s", 5)
            with pytest.raises(IllegalTransition):
                engine.tokenize("hello")
            assert engine.sessions() == snapshot
            assert engine.metrics().kv_cells_used == 8
            r = await engine.decode(DecodeRequest("s", hidden_state=ok[:1]))
            assert r.n_past == 6
            if caps.is_last:
                assert r.logits is not None and r.boundary is None
            else:
                assert r.logits is None and r.boundary is not None
                assert r.boundary.hidden_states.shape == (1, d) and r.boundary.start_position == 5
            assert engine.session_info("s").tokens is None  # ids are unknown past layer 0

    async def test_reserved_hooks_fail_closed(self, engine_factory: EngineFactory) -> None:
        async with engine_factory.open() as engine:
            await engine.open_session("s")
            tokens = prompt_tokens(engine, 5)
            aux = AuxState(AuxStateKind.RECURRENT, b"\0" * 16, (4,))
            with pytest.raises(UnsupportedFeature):
                await prefill(engine, "s", tokens, mtp=MtpRequest(n_draft=2))
            with pytest.raises(UnsupportedFeature):
                await prefill(engine, "s", tokens, aux_state=aux)
            assert engine.session_info("s").n_past == 0
            r = await prefill(engine, "s", tokens)
            assert r.mtp is None and r.aux_state is None
            assert r.logits is not None
            with pytest.raises(UnsupportedFeature):
                await decode(engine, "s", r.logits.token_id, mtp=MtpRequest(n_draft=1))
            with pytest.raises(UnsupportedFeature):
                await decode(engine, "s", r.logits.token_id,
                             aux_state=AuxState(AuxStateKind.CROSS_ATTENTION, b"", (0,)))
            assert engine.session_info("s").n_past == 5
            assert engine.health().ready
