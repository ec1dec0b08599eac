"""A worker process serving the batched fake engine: scheduling measured without compute.

``python -m bench.common.fake_worker --layers 0:4 --tick-ms 8 --row-ms 1`` serves the Shard protocol
like ``trio-shard serve`` (same server, same scheduler, same relay), but each tick of the
engine sleeps ``tick-ms + row-ms x rows`` milliseconds instead of computing: a machine of any
speed and any number of hops can be simulated on this one, and what the bench measures is the
scheduling alone (how busy each hop keeps, how much Python time a step costs around its tick).

A hop's costs are the whole model's shared by its layers: with ``--per-layer``, ``tick-ms`` and
``row-ms`` are per layer and the worker's tick costs them times its range's length, so H hops of
a model cost each what one whole-model worker costs in total.

It logs ``serving shard.v1.Shard on HOST:PORT`` as ``trio-shard serve`` does (``bench.common.processes``
reads the port from it). Bench-only: the fake model is ``FakeModel(n_layers_total, n_embd)``,
random but deterministic, the same in every process.
"""

from __future__ import annotations

import argparse
import logging
import sys

import trio

from shard.engine import LayerRange, LoadSpec
from shard.engine.fake import FakeEngine, FakeModel, FakeScript
from shard.rpc.server import serve


#: The fake model's seed: the same weights in every process.
SEED = 11


def parse_layers(text: str) -> LayerRange | None:
    if not text:
        return None
    start, _, end = text.partition(":")
    return LayerRange(int(start), int(end))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.common.fake_worker", description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="", help="START:END (default: the whole model)")
    p.add_argument("--n-layers", type=int, default=16, help="the fake model's layers (default 16)")
    p.add_argument("--n-embd", type=int, default=64, help="the fake model's width (default 64)")
    p.add_argument("--tick-ms", type=float, default=8.0, help="a tick's fixed cost (default 8)")
    p.add_argument("--row-ms", type=float, default=1.0, help="a tick's cost per row (default 1)")
    p.add_argument("--per-layer", action="store_true",
                   help="--tick-ms and --row-ms are per layer: scaled by the range's length")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--max-sessions", type=int, default=64)
    p.add_argument("--ctx", type=int, default=64 * 512)
    p.add_argument("--allow-relay", action="store_true", help="relay routes (loopback peers)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    layers = parse_layers(args.layers)
    scale = 1.0
    if args.per_layer:
        scale = (layers.end - layers.start) if layers is not None else args.n_layers
    model = FakeModel(n_layers_total=args.n_layers, n_embd=args.n_embd, seed=SEED)
    engine = FakeEngine(model=model, script=FakeScript(
        batched=True, tick_latency=args.tick_ms * scale / 1000, row_latency=args.row_ms * scale / 1000))
    spec = LoadSpec(n_ctx=args.ctx, max_sessions=args.max_sessions, layer_range=layers)
    relay = None
    if args.allow_relay:
        from shard.relay import ChainRelay

        relay = ChainRelay()

    async def run() -> None:
        async with engine:
            await serve(engine, host="127.0.0.1", port=args.port, load=spec, relay=relay)

    try:
        trio.run(run)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
