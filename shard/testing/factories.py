"""Engine factories for the contract suite: how to build and load each engine under test.

A factory is deliberately small: a name, a function that creates an *unloaded* engine and a
function that turns engine-independent ``EngineOptions`` into that engine's ``LoadSpec``. The
suite needs the unloaded engine too (to test the CREATED state), so factories never load.

To run the contract suite on a new engine, write one ``EngineFactory`` for it (see
``docs/engine.md``, "Running the contract suite on a new engine").
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from shard.engine import LayerRange, LoadSpec, ShardEngine
from shard.engine.fake import FakeEngine, FakeModel, FakeScript


class ShardPart(enum.Enum):
    """Which part of the model an engine under test serves, when it is cut into ``pieces``."""

    WHOLE = "whole"  # every layer: takes tokens, returns logits
    FIRST = "first"  # the first piece: takes tokens, returns boundary hidden states
    MIDDLE = "middle"  # the middle piece (3 pieces or more): hidden states in and out
    LAST = "last"  # the last piece: takes hidden states, returns logits

    def layer_range(self, n_layers_total: int, pieces: int = 2) -> LayerRange | None:
        """This part's range when the model is cut into ``pieces`` near-equal ranges (the cuts
        are ``i * n_layers_total // pieces``, so the parts of one ``pieces`` tile the model)."""
        if self is ShardPart.WHOLE:
            return None
        if not 2 <= pieces <= n_layers_total:
            raise ValueError(f"cannot cut {n_layers_total} layers into {pieces} pieces")
        if self is ShardPart.MIDDLE and pieces < 3:
            raise ValueError("a middle part needs at least 3 pieces")
        index = {ShardPart.FIRST: 0, ShardPart.MIDDLE: pieces // 2, ShardPart.LAST: pieces - 1}[self]
        return LayerRange(index * n_layers_total // pieces, (index + 1) * n_layers_total // pieces)


@dataclass(frozen=True)
class EngineOptions:
    """Engine-independent load options used by the suite (each factory maps them to a LoadSpec).

    The defaults give 4 sessions of 256 positions and small batches, so a few-hundred-token
    prompt is many chunks on llama.cpp (long enough to be cancelled while running).
    """

    n_ctx: int = 1024
    max_sessions: int = 4
    n_batch: int = 8
    part: ShardPart = ShardPart.WHOLE
    pieces: int = 2  # how many parts the model is cut into (``part`` is one of them)

    def layer_range(self, n_layers_total: int) -> LayerRange | None:
        return self.part.layer_range(n_layers_total, self.pieces)


@dataclass(frozen=True)
class EngineFactory:
    """Creates an unloaded engine and the LoadSpec for given options.

    ``layer_ranges`` declares whether the engine serves a part of a model. An engine that does
    not must refuse a layer range at load with UnsupportedFeature (fail closed); the suite checks
    whichever was declared, so flipping support without updating the factory fails loudly.
    """

    name: str
    create: Callable[[], ShardEngine]
    load_spec: Callable[[EngineOptions], LoadSpec]
    layer_ranges: bool = True
    description: str = field(default="", compare=False)
    #: The same engine over a model that declares a pooling type (the contract's embedding
    #: tests); None when this factory's model declares one itself.
    pooled: EngineFactory | None = field(default=None, compare=False)

    @asynccontextmanager
    async def open(self, options: EngineOptions | None = None) -> AsyncIterator[ShardEngine]:
        """A loaded engine, closed on exit (also when the test already closed it)."""
        engine = self.create()
        async with engine:
            await engine.load(self.load_spec(options or EngineOptions()))
            yield engine

    def __str__(self) -> str:
        return self.name


def fake_factory(
    model: FakeModel | None = None, script: FakeScript | None = None, *, name: str = "fake"
) -> EngineFactory:
    """The deterministic fake engine (instant, no files)."""
    fake_model = model if model is not None else FakeModel()
    fake_script = script if script is not None else FakeScript()

    def create() -> ShardEngine:
        return FakeEngine(fake_model, fake_script)

    def load_spec(options: EngineOptions) -> LoadSpec:
        return LoadSpec(
            model_path=None,
            layer_range=options.layer_range(fake_model.n_layers_total),
            n_ctx=options.n_ctx,
            max_sessions=options.max_sessions,
            n_batch=options.n_batch,
        )

    pooled = (None if fake_model.pooling_type else
              fake_factory(dataclasses.replace(fake_model, pooling_type="mean"), fake_script,
                           name=f"{name}-pooled"))
    return EngineFactory(name, create, load_spec, True, "FakeEngine (shard.engine.fake)", pooled)


def llama_factory(
    preset: str = "tiny", *, n_threads: int = 2, layer_ranges: bool = True, name: str = "llama"
) -> EngineFactory:
    """The llama.cpp engine on a locally written GGUF model (``shard.models.ensure_model``).

    A part of the model is served from its cached slice (``shard.models.ensure_slice``, written
    on first use): the engine loads slices, it never cuts a whole file itself.
    ``shard.engine.llama`` is imported lazily so that merely importing the testing package never
    loads llama.cpp.
    """

    def create() -> ShardEngine:
        from shard.engine.llama import LlamaCppEngine

        return LlamaCppEngine()

    def load_spec(options: EngineOptions) -> LoadSpec:
        from shard.models import ensure_model, ensure_slice, get_preset

        layer_range = options.layer_range(get_preset(preset).n_layer)
        path = ensure_model(preset)
        return LoadSpec(
            model_path=path if layer_range is None else ensure_slice(path, layer_range),
            layer_range=layer_range,
            n_ctx=options.n_ctx,
            max_sessions=options.max_sessions,
            n_batch=options.n_batch,
            n_threads=n_threads,
        )

    from shard.models import get_preset

    pooled = (None if get_preset(preset).pooling_type else
              llama_factory("embed", n_threads=n_threads, name=f"{name}-embed"))
    return EngineFactory(name, create, load_spec, layer_ranges,
                         f"LlamaCppEngine on the {preset!r} model", pooled)


__all__ = ["EngineFactory", "EngineOptions", "ShardPart", "fake_factory", "llama_factory"]
