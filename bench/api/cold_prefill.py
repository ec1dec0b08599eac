"""A cold prompt's prefill at every layer of the stack, beside llama-server.

One prompt of ``--prompt`` token ids (the same ids everywhere; a new text each round, so
nothing is cached anywhere), one token generated, timed at each layer, the variants
alternating in a rotating order within each round:

* ``llama_server``: llama.cpp's server (``--llama-server PATH``: ``-t T -c 8192 -np 4``, same
  GGUF), ``POST /completion`` with ``cache_prompt: false`` and ``n_predict: 1``: its own
  ``timings.prompt_ms`` (``llama_server``) and the request's wall time (``llama_server_wall``);
* ``engine``: ``LlamaCppEngine`` in this process (``n_ctx 8192``, 4 sessions, ``--threads``),
  one ``prefill`` of the ids; ``engine_fa_on`` / ``engine_fa_off`` the same with
  ``flash_attn=True`` / ``False`` (``engine``: llama.cpp's choice), the flash-attention A/B;
* ``worker``: one ``trio-shard serve`` (``--ctx 8192 --max-sessions 4
  --prefix-cache-tokens 0``) through ``ShardClient.generate(ids, max_tokens=1)``, to the first
  result;
* ``door``: ``trio-shard api`` over that worker, a streamed ``POST /v1/completions`` of the
  ids with ``max_tokens`` 1, to the first event with a choice (time to first token).

Reported per prompt length: medians over rounds of each variant's time and prompt tokens/s,
and each variant's tokens/s over llama-server's (from its own prompt timing), as the median of
each round's own ratio. Ratios come from one run on one machine (the environment is recorded).

    python -m bench.api.cold_prefill [--model smollm2-135m-instruct|chat|FILE]
        [--prompt 1000[,2000]] [--rounds 5] [--threads 2] [--llama-server PATH] [--out FILE]
        [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from bench.api.chat_turns import model_path
from bench.common import options
from bench.common.environment import environment, save_record
from bench.common.processes import free_port, http_server, shard_server, stream_sse, wait_serving
from shard.client import ShardClient
from shard.engine import LoadSpec, PrefillRequest

CTX = 8192  # llama-server's -c and the worker's --ctx: 2048 a session/slot with 4 of them
SLOTS = 4
#: In-process engines by flash-attention setting (None: llama.cpp decides, as llama-server's
#: default ``-fa auto`` does).
ENGINES: dict[str, bool | None] = {"engine": None, "engine_fa_on": True, "engine_fa_off": False}
VARIANTS = ("llama_server", *ENGINES, "worker", "door")
#: Plain words for the prompts: a seeded text of them tokenizes to natural-looking pieces.
WORDS = ("the of and to in is that it was for on are with as his they be at one have this from "
         "or had by word but what some we can out other were all there when up use your how "
         "said an each she which do their time if will way about many then them write would "
         "like so these her long make thing see him two has look more day could go come did "
         "number sound no most people my over know water than call first who may down side "
         "been now find any new work part take get place made live where after back little "
         "only round man year came show every good me give our under name very through just "
         "form sentence great think say help low line differ turn cause much mean before move "
         "right boy old too same tell does set three want air well also play small end put "
         "home read hand port large spell add even land here must big high such follow act "
         "why ask men change went light kind off need house picture try us again animal point "
         "mother world near build self earth father head stand own page should country found "
         "answer school grow study still learn plant cover food sun four between state keep "
         "eye never last let thought city tree cross farm hard start might story saw far sea "
         "draw left late run while press close night real life few north").split()


def prompt_text(round_no: int, words: int) -> str:
    """A round's text: ``words`` seeded plain words, different every round (nothing cached)."""
    rng = random.Random(round_no)
    return f"Round {round_no}. " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def post_json(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.load(resp)


class Stack:
    """Every variant, started once: llama-server, the worker and the door (processes), the
    in-process engines; ``time(variant, ids)`` times one cold prefill of ``ids``."""

    def __init__(self, engines: dict[str, Any], worker: ShardClient, door_port: int,
                 server_port: int | None) -> None:
        self.engines, self.worker, self.door_port = engines, worker, door_port
        self.server_port = server_port
        self._sessions = 0

    async def time(self, variant: str, ids: list[int]) -> dict[str, Any]:
        if variant == "llama_server":
            return await trio.to_thread.run_sync(self._llama_server, ids)
        if variant == "door":
            return await trio.to_thread.run_sync(self._door, ids)
        if variant == "worker":
            start, first = time.perf_counter(), None
            async for step in self.worker.generate(ids, max_tokens=1):  # one result, then the end
                if first is None:
                    first = {"s": time.perf_counter() - start, "prompt_n": step.n_past}
            if first is None:
                raise RuntimeError("the worker sent no result")
            return first
        engine = self.engines[variant]
        self._sessions += 1
        sid = f"cold-{self._sessions}"
        await engine.open_session(sid)
        try:
            start = time.perf_counter()
            result = await engine.prefill(PrefillRequest(sid, tokens=tuple(ids), top_k_logprobs=0))
            return {"s": time.perf_counter() - start, "prompt_n": result.tokens_processed}
        finally:
            await engine.release(sid)

    def _llama_server(self, ids: list[int]) -> dict[str, Any]:
        assert self.server_port is not None
        start = time.perf_counter()
        got = post_json(self.server_port, "/completion",
                        {"prompt": ids, "n_predict": 1, "cache_prompt": False})
        wall = time.perf_counter() - start
        timings = got["timings"]
        return {"s": timings["prompt_ms"] / 1e3, "wall_s": wall,
                "prompt_n": timings["prompt_n"]}

    def _door(self, ids: list[int]) -> dict[str, Any]:
        sent, events = stream_sse(self.door_port, "/v1/completions", {
            "model": "m", "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}})
        first = next((t for t, e in events if e.get("choices")), None)
        if first is None:
            raise RuntimeError("the door streamed no choice")
        usage = next(e["usage"] for _, e in reversed(events) if e.get("usage"))
        return {"s": first - sent, "prompt_n": usage["prompt_tokens"]}


@asynccontextmanager
async def started(args: argparse.Namespace) -> AsyncIterator[Stack]:
    """Every variant's servers and engines, up for the whole run."""
    from shard.engine.llama import LlamaCppEngine

    logs: Path = args.logs
    with ExitStack() as procs:
        server_port = None
        if args.llama_server is not None:
            server_port = free_port()
            procs.enter_context(http_server(
                [str(args.llama_server), "-m", str(args.model), "-t", str(args.threads),
                 "-c", str(CTX), "-np", str(SLOTS), "--host", "127.0.0.1",
                 "--port", str(server_port)],
                port=server_port, ready_path="/health", log=logs / "cold_prefill_llama_server.log"))
        worker = procs.enter_context(shard_server(
            args.model, threads=args.threads, ctx=CTX, max_sessions=SLOTS,
            extra=["--prefix-cache-tokens", "0"], log=logs / "cold_prefill_worker.log"))
        await wait_serving(worker.target)
        door_port = free_port()
        procs.enter_context(http_server(
            [sys.executable, "-m", "shard.cli", "api", "--target", worker.target,
             "--port", str(door_port), "--model-name", "m"],
            port=door_port, ready_path="/health", log=logs / "cold_prefill_api.log"))
        async with AsyncExitStack() as stack:
            engines = {}
            for name, flash in ENGINES.items():
                engine = await stack.enter_async_context(LlamaCppEngine(flash_attn=flash))
                await engine.load(LoadSpec(model_path=args.model, n_ctx=CTX, max_sessions=SLOTS,
                                           n_threads=args.threads))
                engines[name] = engine
            client = await stack.enter_async_context(ShardClient.connect(worker.target,
                                                                         timeout=600))
            yield Stack(engines, client, door_port, server_port)


async def measure(args: argparse.Namespace, variants: list[str],
                  log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every round: for each prompt length, each variant once, in a rotating order."""
    rounds: list[dict[str, Any]] = []
    async with started(args) as stack:
        tokenize = stack.engines["engine"].tokenize
        warm = list(tokenize(prompt_text(-1, 16), add_bos=True))
        for v in variants:  # the first native steps are paid before timing
            await stack.time(v, warm)
        for r in range(args.rounds):
            got: dict[str, Any] = {}
            for n in args.prompt:
                text = prompt_text(r, n)  # more than n tokens: a word is a token or more
                ids = list(tokenize(text, add_bos=True))[:n]
                if len(ids) < n:
                    raise RuntimeError(f"round {r}: the text is {len(ids)} tokens, not {n}")
                order = variants[r % len(variants):] + variants[:r % len(variants)]
                got[str(n)] = {v: await stack.time(v, ids) for v in order}
                log(f"round {r} prompt {n}: " + " ".join(
                    f"{v} {got[str(n)][v]['s'] * 1e3:.0f} ms" for v in variants))
            rounds.append(got)
    return rounds


def summarize(rounds: list[dict[str, Any]], variants: list[str], prompts: list[int]) -> dict[str, Any]:
    """Per prompt length: median seconds and tokens/s per variant, and each variant's tokens/s
    over llama-server's (its own prompt timing) as the median of each round's ratio."""
    out: dict[str, Any] = {}
    names = [*variants, *(["llama_server_wall"] if "llama_server" in variants else [])]

    def seconds(row: dict[str, Any], name: str) -> float:
        return row["llama_server"]["wall_s"] if name == "llama_server_wall" else row[name]["s"]

    for n in prompts:
        rows = [r[str(n)] for r in rounds]
        per: dict[str, Any] = {}
        for name in names:
            s = statistics.median(seconds(row, name) for row in rows)
            per[name] = {"median_ms": round(s * 1e3, 1), "tokens_per_s": round(n / s, 1)}
            if "llama_server" in variants:
                per[name]["over_llama_server"] = round(statistics.median(
                    seconds(row, "llama_server") / seconds(row, name) for row in rows), 3)
        out[str(n)] = per
    return out


def print_table(summary: dict[str, Any]) -> None:
    for n, per in summary.items():
        print(f"prompt {n} tokens: variant | median ms | tok/s | over llama-server")
        for name, row in per.items():
            ratio = row.get("over_llama_server")
            print(f"  {name:>17} | {row['median_ms']:9.1f} | {row['tokens_per_s']:7.1f} | "
                  + (f"{ratio:.2f}x" if ratio is not None else "-"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_model(p, "smollm2-135m-instruct (default), a packaged model's name, a "
                      "generated preset (chat: the tiny model with a chat template) or a GGUF file",
                      type=str, default=None)
    p.add_argument("--prompt", default=None,
                   help="prompt lengths in tokens, comma-separated (default 1000,2000)")
    options.add_rounds(p, 5, "rounds, the variants alternating within each (default 5)")
    options.add_threads(p, 2, "llama.cpp threads of every engine, the worker and llama-server "
                        "(default 2)")
    p.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary: also run it")
    options.add_quick(p, "one round of a 200-token prompt, the chat preset (checks the harness)")
    options.add_out(p, options.RESULTS / "cold_prefill.json")
    options.add_logs(p)
    args = p.parse_args(argv)
    if args.quick:
        args.model = args.model or "chat"
        args.prompt = args.prompt or "200"
        args.rounds = 1
    args.model = model_path(args.model or "smollm2-135m-instruct")
    try:
        args.prompt = [int(x) for x in (args.prompt or "1000,2000").split(",")]
    except ValueError:
        p.error("--prompt takes comma-separated token counts")
    if min(args.rounds, *args.prompt) < 1 or max(args.prompt) > CTX // SLOTS:
        p.error(f"--rounds must be at least 1 and --prompt within 1..{CTX // SLOTS}")
    if args.llama_server is not None and not args.llama_server.is_file():
        p.error(f"--llama-server {args.llama_server}: no such file")
    variants = [v for v in VARIANTS if v != "llama_server" or args.llama_server is not None]
    env = environment(args.model, args.threads,
                      argv=sys.argv if argv is None else ["bench.api.cold_prefill", *argv])
    rounds = trio.run(measure, args, variants, lambda line: print(line, flush=True))
    summary = summarize(rounds, variants, args.prompt)
    print_table(summary)
    record = {
        "bench": "cold_prefill",
        "environment": env,
        "config": {"model": str(args.model), "rounds": args.rounds, "prompt_tokens": args.prompt,
                   "threads": args.threads, "ctx": CTX, "slots": SLOTS,
                   "llama_server": str(args.llama_server) if args.llama_server else None,
                   "variants": variants,
                   "flash_attn": dict(ENGINES)},
        "rounds": rounds,
        "results": summary,
    }
    save_record(args.out, record)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
