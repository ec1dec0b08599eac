"""Hidden states in 8 bits on the wire (q8_0, issue 55): bytes, accuracy on real models, and
time to first token through a slow link.

Three parts, each printed and written to ``wire_q8.json``:

* ``bytes``: per position per hop, for every wire dtype, at the widths of the models
  measured (the tensor's data, and a ``--prefill``-row Prefill message serialized, per row).
* ``accuracy``: each ``--models`` model split ``--splits`` ways into layer-range slices, run
  engine to engine in this process (``LlamaCppEngine``, one per part). The first ``--positions``
  + 1 tokens of real text (this checkout's README.md, then docs/pipelines.md) are prefilled 64
  positions at a time, teacher-forced, once per wire dtype: every part's hidden states go
  through that dtype's codec (``shard.rpc.hidden_codec``: encoded and decoded, as a worker
  does) before the next part. The last part's logits of every position (all of them: read by
  wrapping the engine's ``_make_result``, since the engine interface returns at most 64 top
  log-probabilities) are compared with float32's: top-1 agreement, mean and largest
  KL(float32 || dtype) of the next-token distribution. The row ``float32+1e-6`` perturbs every
  value by a relative 1e-6 instead: what the model's own arithmetic (llama.cpp quantizes
  activations for its quantized weights) makes of any change at all, the floor for every lossy
  dtype. A dtype the sender refuses (float16 on states beyond 65504) is reported as refused.
  ``--float-weights`` runs a copy of each model whose weights are dequantized to float32
  (``float_weights``): llama.cpp then quantizes no activations, so the rows measure the codecs
  alone. ``top1_agreement_above_margin`` counts only the positions where float32's top-1 leads
  its top-2 by more than ``--margin`` nats (no near-tie a rounding may flip). ``--outliers``
  adds ``q8_0_outliers`` with other channel counts.
* ``ttft``: a ``--prefill``-token prompt (``max_tokens=1``) through ``--hops`` live workers
  (``trio-shard serve --layers``, one llama.cpp thread each, all on this machine) of
  ``--ttft-model``, each behind a simulated link (bench/common/links.py) capped at ``--mbit``
  Mbit/s each way with ``--rtt`` ms round trip; the wire dtypes alternate for
  ``--rounds`` rounds, medians and the q8_0/float32 ratio reported; the same without the
  bandwidth cap (``/uncapped``) in the same rounds, and the difference (``link_s``: what the
  cap added). The client relays (each boundary crosses two links). The time on the wire shrinks with the bytes; the compute does
  not, so the ratio depends on how fast the workers compute: a model that computes slowly on
  this machine hides the link. The default model is the bench preset (``n_embd`` 1024, random
  weights): wider rows than SmolLM2's 576, so the link matters more.

    python -m bench.pipeline.wire_q8 [--quick] [--models smollm2-135m-instruct,gemma3-270m]
        [--splits 2,3] [--positions 1000] [--ttft-model bench] [--prefill 2048] [--mbit 100]
        [--rtt 2] [--hops 2] [--rounds 3] [--parts bytes,accuracy,ttft] [--out-dir DIR]
        [--float-weights] [--float-dir DIR] [--margin 0.1] [--outliers 1,16]

Timing lives here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import AsyncExitStack, ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import trio

from bench.common import options
from bench.common.environment import environment, load_average
from bench.common.links import open_link
from bench.common.processes import shard_server, wait_serving
from shard.rpc import convert
from shard.rpc.errors import ShardError
from shard.rpc.hidden_codec import CODECS, HiddenCodec, Q8OutliersCodec
from shard.v1 import shard_pb2 as pb

DTYPES = ("float32", "float16", "q8_0", "q8_0_outliers")
#: The accuracy part's reference for what any inexact transport costs: float32 with a relative
#: noise of 1e-6 (a few float32 ulps) on every value, seeded.
NOISE = "float32+1e-6"
UNCAPPED = "/uncapped"  # the same links without the bandwidth cap: what computing takes
CHUNK = 64  # positions per teacher-forced step: the last shard's max_logits_positions
TEXTS = ("README.md", "docs/pipelines.md")


def even_cuts(n_layers: int, parts: int) -> list[tuple[int, int]]:
    bounds = [round(i * n_layers / parts) for i in range(parts + 1)]
    return list(zip(bounds, bounds[1:]))


def model_path(name: str) -> Path:
    from shard.models import ensure_model
    from shard.models.real import REAL_MODELS, ensure_real_model

    return ensure_real_model(name) if name in REAL_MODELS else ensure_model(name)


def float_weights(source: Path, out_dir: Path) -> Path:
    """A copy of ``source`` with every quantized tensor dequantized to float32 (``gguf``'s own
    dequantizers), written once to ``out_dir``.

    Why: for quantized weights ggml's CPU matmul quantizes the *activations* too (to Q8_0,
    Q8_1 or Q8_K blocks), so any change to a hidden state, however small, flips roundings in
    the next matmul. With float32 weights nothing is rounded to 8 bits but the wire, so the
    accuracy part then measures the codec alone. The weights keep their quantized values
    (dequantized exactly), so the model is the same one, computed in float32.
    """
    import gguf

    out = out_dir / f"{source.stem}.f32.gguf"
    if out.is_file():
        return out
    reader = gguf.GGUFReader(source)
    arch = str(bytes(reader.fields[gguf.Keys.General.ARCHITECTURE].parts[-1]), "utf-8")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = (int(gguf.LlamaFileType.ALL_F32) if field.name == gguf.Keys.General.FILE_TYPE
                 else field.contents())
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.ascontiguousarray(
            gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


# ---- bytes ---------------------------------------------------------------------------------


def wire_bytes(n_embd: int, rows: int) -> dict[str, dict[str, float]]:
    """Per position: the tensor's data and a ``rows``-row Prefill request (serialized, with the
    5-byte gRPC prefix) divided by ``rows``, per dtype, and each one's share of float32's."""
    out: dict[str, dict[str, float]] = {}
    x = np.random.default_rng(0).standard_normal((rows, n_embd)).astype(np.float32)
    for dtype in DTYPES:
        tensor = convert.array_to_tensor(x, dtype)
        msg = pb.SessionRequest(prefill=pb.Prefill(hidden_states=tensor, position=pb.Position(value=0)))
        out[dtype] = {"data_per_position": len(tensor.data) / rows,
                      "message_per_position": round((msg.ByteSize() + 5) / rows, 2)}
    for dtype in DTYPES:
        out[dtype]["x_float32"] = round(
            out[dtype]["message_per_position"] / out["float32"]["message_per_position"], 4)
    return out


# ---- accuracy ------------------------------------------------------------------------------


def real_text_tokens(engine: Any, n: int) -> list[int]:
    root = options.CHECKOUT
    text = "\n\n".join((root / name).read_text() for name in TEXTS)
    tokens = engine.tokenize(text, add_bos=True)
    if len(tokens) < n:
        raise SystemExit(f"the text gives {len(tokens)} tokens, fewer than {n}")
    return list(tokens[:n])


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


async def teacher_forced(name: str, parts: int, positions: int, threads: int, *,
                         float_dir: Path | None = None, margin: float = 0.1,
                         outliers: tuple[int, ...] = ()) -> dict[str, Any]:
    """Top-1 agreement and KL of every wire dtype against float32, ``parts`` slices of ``name``
    (its float32-weight copy in ``float_dir`` if given); agreement also counted over the
    positions whose float32 top-1 leads its top-2 by more than ``margin`` nats (no near-tie);
    each of ``outliers`` adds the row ``q8_0_outliers/<k>``: that codec with ``k`` channels a
    row sent apart instead of its wire count (how many are worth their bytes)."""
    from shard.engine import LayerRange, LoadSpec, PrefillRequest
    from shard.engine.llama import LlamaCppEngine
    from shard.models import ensure_slice
    from shard.models.header import read_model_info

    source = model_path(name)
    if float_dir is not None:
        source = await trio.to_thread.run_sync(float_weights, source, float_dir)
    cuts = even_cuts(read_model_info(source).block_count, parts)
    sessions = len(DTYPES) + 1 + len(outliers)  # one per transport
    logits: list[np.ndarray] = []
    async with AsyncExitStack() as stack:
        engines = []
        for a, b in cuts:
            path = await trio.to_thread.run_sync(ensure_slice, source, LayerRange(a, b))
            engine = await stack.enter_async_context(LlamaCppEngine())
            await engine.load(LoadSpec(model_path=path, layer_range=LayerRange(a, b),
                                       n_ctx=sessions * (positions + CHUNK + 16),
                                       max_sessions=sessions, n_threads=threads))
            engines.append(engine)
        last = engines[-1]
        make = last._make_result

        def spy(slot: Any, caps: Any, plan: Any, raw: Any, *args: Any, **kwargs: Any) -> Any:
            logits.append(np.array(raw, dtype=np.float32, copy=True).reshape(-1, caps.n_vocab))
            return make(slot, caps, plan, raw, *args, **kwargs)

        last._make_result = spy  # type: ignore[method-assign]
        tokens = real_text_tokens(engines[0], positions + 1)
        rng = np.random.default_rng(0)
        transports = {d: partial(through, CODECS[d]) for d in DTYPES}
        transports[NOISE] = lambda h: (h * (1 + 1e-6 * rng.standard_normal(h.shape))).astype(np.float32)
        for k in outliers:
            transports[f"q8_0_outliers/{k}"] = partial(through, Q8OutliersCodec(k))
        for name_ in transports:
            for i, engine in enumerate(engines):
                await engine.open_session(f"{name_}.{i}")
        agree = {d: 0 for d in transports if d != "float32"}
        agree_clear = dict(agree)
        clear = 0  # positions whose float32 margin exceeds ``margin``
        kl: dict[str, list[float]] = {d: [] for d in agree}
        refused: dict[str, str] = {}
        for start in range(0, positions, CHUNK):
            chunk = tokens[start:min(start + CHUNK, positions)]
            rows: dict[str, np.ndarray] = {}
            for dtype, transport in transports.items():
                if dtype in refused:
                    continue
                hidden = None
                for i, engine in enumerate(engines):
                    req = (PrefillRequest(f"{dtype}.{i}", tokens=chunk, position=start) if i == 0
                           else PrefillRequest(f"{dtype}.{i}", hidden_states=hidden,
                                               position=start, all_logits=engine is last,
                                               top_k_logprobs=0))
                    logits.clear()
                    result = await engine.prefill(req)
                    if engine is not last:
                        try:
                            hidden = transport(np.asarray(result.boundary.hidden_states))
                        except ShardError as err:  # the sender refuses: float16 overflow
                            refused[dtype] = f"{err.reason} at position >= {start}"
                            break
                else:
                    (rows[dtype],) = logits
            ref = log_softmax(rows["float32"])
            top = ref.argmax(axis=1)
            best2 = np.partition(ref, -2, axis=1)[:, -2:]
            sure = best2[:, 1] - best2[:, 0] > margin
            clear += int(sure.sum())
            for dtype in agree:
                if dtype not in refused:
                    other = log_softmax(rows[dtype])
                    same = other.argmax(axis=1) == top
                    agree[dtype] += int(same.sum())
                    agree_clear[dtype] += int((same & sure).sum())
                    kl[dtype] += (np.exp(ref) * (ref - other)).sum(axis=1).tolist()
        for name_ in transports:
            for i, engine in enumerate(engines):
                await engine.release(f"{name_}.{i}")
    return {
        "model": name, "parts": parts, "layers": [f"{a}:{b}" for a, b in cuts],
        "weights": "float32 copy" if float_dir is not None else "as packaged",
        "positions": positions, "margin_nats": margin, "positions_above_margin": clear,
        **{dtype: ({"refused": refused[dtype]} if dtype in refused else
                   {"top1_agreement": round(agree[dtype] / positions, 4),
                    "top1_agreement_above_margin": round(agree_clear[dtype] / max(clear, 1), 4),
                    "kl_mean": float(f"{statistics.fmean(kl[dtype]):.3g}"),
                    "kl_max": float(f"{max(kl[dtype]):.3g}")}) for dtype in agree},
    }


def through(codec: HiddenCodec, h: np.ndarray) -> np.ndarray:
    """``h`` as the next part receives it over the wire in ``codec``'s dtype."""
    return codec.decode(codec.encode(h), h.shape[0], h.shape[1])

# ---- time to first token through a slow link -----------------------------------------------


async def ttft_rounds(targets: list[str], n_vocab: int, prefill: int, rounds: int,
                      bytes_per_s: float, rtt_ms: float) -> dict[str, list[float]]:
    from shard.pipeline import Pipeline

    for target in targets:
        await wait_serving(target)
    rng = np.random.default_rng(prefill)
    prompt = [1, *(int(t) for t in rng.integers(3, n_vocab, prefill - 1))]
    times: dict[str, list[float]] = {f"{d}{cap}": [] for cap in ("", UNCAPPED) for d in DTYPES}
    for r in range(rounds + 1):  # round 0 warms every code path up and is dropped
        for cap in ("", UNCAPPED):
            for dtype in DTYPES:
                async with AsyncExitStack() as stack:
                    links = [await stack.enter_async_context(open_link(
                        t, one_way_delay_s=rtt_ms / 2000,
                        bandwidth_bytes_per_s=None if cap else bytes_per_s)) for t in targets]
                    pipe = await stack.enter_async_context(Pipeline.connect(
                        [lk.target for lk in links], timeout=600, hidden_dtype=dtype))
                    start = time.perf_counter()
                    await pipe.generate(prompt if r else prompt[:16], max_tokens=1)
                    if r:
                        times[f"{dtype}{cap}"].append(time.perf_counter() - start)
    return times


def run_ttft(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    from shard.models.header import read_model_info

    model = model_path(args.ttft_model)
    info = read_model_info(model)
    ranges = [f"{a}:{b}" for a, b in even_cuts(info.block_count, args.hops)]
    with ExitStack() as stack:
        servers = [stack.enter_context(shard_server(
            model, threads=args.threads, ctx=args.prefill + 64, max_sessions=1,
            log=logs / f"wire_q8-{i}.log", extra=["--layers", r])) for i, r in enumerate(ranges)]
        times = trio.run(ttft_rounds, [s.target for s in servers], info.n_vocab or 256,
                         args.prefill, args.rounds, args.mbit * 1e6 / 8, args.rtt)
    med = {d: statistics.median(v) for d, v in times.items()}
    wire = {d: med[d] - med[d + UNCAPPED] for d in DTYPES}
    return {
        "model": args.ttft_model, "n_embd": info.n_embd, "layers": ranges,
        "prefill_tokens": args.prefill, "mbit_per_s": args.mbit, "rtt_ms": args.rtt,
        "rounds": args.rounds,
        "ttft_s": {d: [round(t, 3) for t in v] for d, v in times.items()},
        "median_s": {d: round(t, 3) for d, t in med.items()},
        "x_float32": {d: round(med[d] / med["float32"], 3) for d in DTYPES},
        "link_s": {d: round(t, 3) for d, t in wire.items()},
        "link_x_float32": {d: round(t / wire["float32"], 3) if wire["float32"] > 0 else None
                           for d, t in wire.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pipeline.wire_q8",
                                description=__doc__.splitlines()[0])
    options.add_quick(p, "SmolLM2 only, 2 parts, 128 positions; the tiny model's TTFT over a "
                      "256-token prefill, 1 round")
    p.add_argument("--models", default=None,
                   help="models of the accuracy part (default smollm2-135m-instruct,gemma3-270m)")
    p.add_argument("--splits", default=None, help="parts per model (default 2,3)")
    p.add_argument("--positions", type=int, default=None,
                   help="teacher-forced positions (default 1000)")
    p.add_argument("--ttft-model", default=None,
                   help="model (preset or packaged name) of the TTFT part (default bench)")
    p.add_argument("--prefill", type=int, default=None, help="TTFT prompt length (default 2048)")
    p.add_argument("--mbit", type=float, default=100.0, help="link bandwidth, each way (Mbit/s)")
    p.add_argument("--rtt", type=float, default=2.0, help="link round trip (ms, default 2)")
    p.add_argument("--hops", type=int, default=2, help="workers of the TTFT part (default 2)")
    options.add_rounds(p, None, "TTFT rounds per dtype, alternating (default 3)")
    options.add_threads(p, 1, "llama.cpp threads per engine")
    p.add_argument("--float-weights", action="store_true",
                   help="accuracy on a copy of each model with its weights dequantized to "
                        "float32 (no 8-bit activations in llama.cpp's matmuls)")
    p.add_argument("--float-dir", type=Path, default=Path("/tmp/trio-shard-f32"),
                   help="where --float-weights writes the copies (default /tmp/trio-shard-f32)")
    p.add_argument("--margin", type=float, default=0.1,
                   help="agreement is also counted over positions whose float32 top-1 leads "
                        "its top-2 by more than this many nats (default 0.1)")
    p.add_argument("--outliers", default="",
                   help="also measure q8_0_outliers with these numbers (comma-separated) of "
                        "channels a row sent apart instead of its wire count (default none)")
    p.add_argument("--parts", default="bytes,accuracy,ttft", help="which parts to run")
    options.add_out_dir(p)
    args = p.parse_args(argv)
    q = args.quick
    models = (args.models or ("smollm2-135m-instruct" if q else
                              "smollm2-135m-instruct,gemma3-270m")).split(",")
    splits = [int(s) for s in (args.splits or ("2" if q else "2,3")).split(",")]
    positions = args.positions or (128 if q else 1000)
    args.ttft_model = args.ttft_model or ("tiny" if q else "bench")
    args.prefill = args.prefill or (256 if q else 2048)
    args.rounds = args.rounds or (1 if q else 3)
    parts = set(args.parts.split(","))
    outliers = tuple(int(k) for k in args.outliers.split(",") if k)
    env = environment(model_path(args.ttft_model), args.threads,
                      argv=["-m", "bench.pipeline.wire_q8", *(sys.argv[1:] if argv is None else argv)])
    report: dict[str, Any] = {"environment": env}
    if "bytes" in parts:
        from shard.models.header import read_model_info

        widths = {m: read_model_info(model_path(m)).n_embd
                  for m in [*models, args.ttft_model]}
        report["bytes"] = {m: {"n_embd": w, **wire_bytes(w, args.prefill)} for m, w in widths.items()}
        for m, row in report["bytes"].items():
            print(f"{m} (n_embd {row['n_embd']}): " + ", ".join(
                f"{d} {row[d]['message_per_position']} B/position ({row[d]['x_float32']}x)"
                for d in DTYPES), flush=True)
    if "accuracy" in parts:
        report["accuracy"] = []
        for m in models:
            for n in splits:
                row = trio.run(partial(teacher_forced, m, n, positions, args.threads,
                                       float_dir=args.float_dir if args.float_weights else None,
                                       margin=args.margin, outliers=outliers))
                report["accuracy"].append(row)
                print(json.dumps(row), flush=True)
    if "ttft" in parts:
        report["ttft"] = run_ttft(args, args.out_dir / "logs")
        t = report["ttft"]
        print(f"TTFT {t['prefill_tokens']}-token prefill, {t['model']} over {args.hops} hops at "
              f"{t['mbit_per_s']:g} Mbit/s: " + ", ".join(
                  f"{d} {t['median_s'][d]} s ({t['x_float32'][d]}x; uncapped "
                  f"{t['median_s'][d + UNCAPPED]} s, the cap added {t['link_s'][d]} s)"
                  for d in DTYPES), flush=True)
    env["load_average_after"] = load_average()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "wire_q8.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
