"""A multi-turn chat through the door, replayed as a chat UI sends it, beside llama-server.

Each turn resends the whole conversation (the user's fixed messages and the assistant's own
previous answers) as a streamed greedy ``POST /v1/chat/completions`` of up to ``--tokens``
tokens, so the prompt grows by about one answer a turn. Without a prefix cache every turn
prefills the whole conversation again and its time to first token grows with it; with one it
computes only the new part. Variants, each started fresh for every round (so turn 1 finds
nothing cached) and alternating in a rotating order:

* ``door``: one ``trio-shard serve`` (``--threads``, ``--ctx 8192 --max-sessions 4``: the same
  context per session as llama-server's slots) behind ``trio-shard api``, the prefix cache at
  its default;
* ``door_nocache``: the same with ``--prefix-cache-tokens 0``;
* ``door_fa_off``: the same as ``door`` with ``serve --flash-attn off`` (llama-server keeps
  flash attention on, its auto choice on CPU);
* ``pool_parts``: a 2-part pool: ``serve --part 1/2`` and ``--part 2/2`` (each ``--threads``,
  the same context, ``--prefix-cache-tokens`` one session's context on both, since a layer
  range has none by default) behind ``trio-shard api --workers A,B``: one complete route of
  two hops, each turn's cached prefix taken on both;
* ``pool_replicas``: two whole-model workers (as ``door``'s) behind ``api --workers A,B``: two
  routes, and the pool must send each turn back to the worker that cached the conversation
  (prefix routing; by load alone the turns would alternate). The door's route picks during
  the chat (``trio_shard_api_pool_picks_total``: by prefix, by load, balance) are recorded for
  both pool variants;
* ``llama_server``: llama.cpp's server (``--llama-server PATH``: ``-t T -c 8192 -np 4``, its
  default ``cache_prompt`` on), same GGUF.

Per turn: time to first token (to the first event with text), prompt tokens, cached tokens
(``usage.prompt_tokens_details.cached_tokens``; llama-server also reports ``timings.cache_n``
and ``timings.prompt_n``, recorded), tokens/s (tokens after the first over first to last text
event). Reported: medians over rounds per turn, the last turn's over the first turn's time to
first token per variant, and each door variant's over llama-server's per turn (medians of each
round's own ratio). Ratios come from one run on one machine (the environment is recorded).

    python -m bench.api.chat_turns [--model smollm2-135m-instruct|chat|FILE] [--rounds 3]
        [--turns 8] [--tokens 130] [--threads 2] [--llama-server PATH] [--variants V,...]
        [--out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import trio

from bench.common import options
from bench.common.environment import environment, save_record
from bench.common.processes import free_port, http_server, shard_server, stream_sse, wait_serving
from shard.models import ensure_model
from shard.models.real import resolve_model

#: The user's side of the conversation: fixed text, each asking for a long answer so that a
#: turn adds about ``--tokens`` tokens of the assistant's besides its own.
USER_MESSAGES = (
    "I want to learn to bake bread at home. Explain how yeast makes dough rise.",
    "What kind of flour should I buy, and why does the protein content matter?",
    "Walk me through kneading: how long, how do I know when it is done?",
    "My kitchen is cold in winter. How do I help the dough rise anyway?",
    "How do I shape a round loaf so that it holds its form in the oven?",
    "Why do bakers put steam in the oven, and how can I do that at home?",
    "How can I tell the bread is baked through without cutting it open?",
    "Finally, how should I store the bread so it stays fresh for days?",
)
CTX = 8192  # llama-server's -c, and the worker's --ctx: 2048 a session/slot with 4 of them
SLOTS = 4
VARIANTS = ("door", "door_nocache", "door_fa_off", "pool_parts", "pool_replicas", "llama_server")
POOLS = ("pool_parts", "pool_replicas")
_PICKS = re.compile(r'^trio_shard_api_pool_picks_total\{by="(\w+)",model="m"\} ([0-9.e+]+)$', re.M)


def model_path(name: str) -> Path:
    """A generated preset's file (``chat``: the tiny model with a chat template), a packaged
    model's cached file, or a GGUF path."""
    if name in ("tiny", "bench", "chat"):
        return ensure_model(name, progress=sys.stderr.isatty())
    return resolve_model(name)


def turn(port: int, messages: list[dict[str, str]], tokens: int) -> tuple[dict[str, Any], str]:
    """One streamed greedy chat turn: its measurements and the assistant's answer."""
    sent, events = stream_sse(port, "/v1/chat/completions", {
        "model": "m", "messages": messages, "max_tokens": tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}})
    stamps: list[float] = []
    text: list[str] = []
    for t, e in events:
        piece = (e["choices"][0].get("delta") or {}).get("content") if e.get("choices") else None
        if piece:
            stamps.append(t)
            text.append(piece)
    if not stamps:
        raise RuntimeError(f"port {port}: a turn streamed no text")
    usage = next(e["usage"] for _, e in reversed(events) if e.get("usage"))
    row: dict[str, Any] = {
        "ttft_ms": round((stamps[0] - sent) * 1e3, 2),
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "completion_tokens": usage["completion_tokens"],
        # tokens, not events: a token whose text is held back shares an event
        "tokens_per_s": round((usage["completion_tokens"] - 1) / (stamps[-1] - stamps[0]), 2)
        if len(stamps) > 1 else 0.0,
    }
    timings = next((e["timings"] for _, e in reversed(events) if e.get("timings")), None)
    if timings is not None:  # llama-server's own account of the prompt
        row["server_prompt_n"] = timings.get("prompt_n")
        row["server_cache_n"] = timings.get("cache_n")
    return row, "".join(text)


def chat(port: int, turns: int, tokens: int) -> list[dict[str, Any]]:
    """The conversation, turn by turn, the whole of it resent each time as a chat UI does."""
    messages: list[dict[str, str]] = []
    rows = []
    for i in range(turns):
        messages.append({"role": "user", "content": USER_MESSAGES[i % len(USER_MESSAGES)]})
        row, answer = turn(port, messages, tokens)
        messages.append({"role": "assistant", "content": answer})
        rows.append({"turn": i + 1, **row})
    return rows


def warm_up(port: int) -> None:
    """One short completion that shares no text with the chat: the first native steps are
    paid before timing, and nothing the chat could reuse is cached."""
    stream_sse(port, "/v1/completions", {"model": "m", "prompt": "0 1 2 3", "max_tokens": 4,
                                         "temperature": 0, "stream": True})


@contextmanager
def started(variant: str, args: argparse.Namespace, logs: Path) -> Iterator[int]:
    """The variant's servers, fresh; yields the HTTP port the chat talks to."""
    port = free_port()
    with ExitStack() as stack:
        if variant == "llama_server":
            cmd = [str(args.llama_server), "-m", str(args.model), "-t", str(args.threads),
                   "-c", str(CTX), "-np", str(SLOTS), "--host", "127.0.0.1", "--port", str(port)]
            stack.enter_context(http_server(cmd, port=port, ready_path="/health",
                                            log=logs / "chat_turns_llama_server.log"))
        elif variant in POOLS:
            cache = ["--model-name", "m", "--prefix-cache-tokens", str(CTX // SLOTS)]
            parts = ([["--part", "1/2"], ["--part", "2/2"]] if variant == "pool_parts"
                     else [[], []])
            workers = [stack.enter_context(shard_server(
                args.model, threads=args.threads, ctx=CTX, max_sessions=SLOTS,
                extra=[*cache, *part], log=logs / f"chat_turns_{variant}_worker{i}.log"))
                for i, part in enumerate(parts)]
            for w in workers:
                trio.run(wait_serving, w.target)
            cmd = [sys.executable, "-m", "shard.cli", "api", "--workers",
                   ",".join(w.target for w in workers), "--port", str(port)]
            stack.enter_context(http_server(cmd, port=port, ready_path="/health",
                                            log=logs / f"chat_turns_{variant}_api.log"))
        else:
            extra = {"door_nocache": ["--prefix-cache-tokens", "0"],
                     "door_fa_off": ["--flash-attn", "off"]}.get(variant, [])
            worker = stack.enter_context(shard_server(
                args.model, threads=args.threads, ctx=CTX, max_sessions=SLOTS, extra=extra,
                log=logs / f"chat_turns_{variant}_worker.log"))
            trio.run(wait_serving, worker.target)
            cmd = [sys.executable, "-m", "shard.cli", "api", "--target", worker.target,
                   "--port", str(port), "--model-name", "m"]
            stack.enter_context(http_server(cmd, port=port, ready_path="/health",
                                            log=logs / f"chat_turns_{variant}_api.log"))
        warm_up(port)
        yield port


def pool_picks(port: int) -> dict[str, int]:
    """The door's route picks so far by kind (a pool variant's ``/metrics``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        page = reply.read().decode()
    return {by: int(float(n)) for by, n in _PICKS.findall(page)}


def summarize(rounds: list[dict[str, list[dict[str, Any]]]], variants: list[str]) -> dict[str, Any]:
    """Medians per variant and turn; the last turn's time to first token over the first's and
    each door variant's over llama-server's per turn, as medians of each round's own ratio."""
    keys = ("ttft_ms", "prompt_tokens", "cached_tokens", "completion_tokens", "tokens_per_s")
    out: dict[str, Any] = {"per_turn": {}, "last_over_first_ttft": {}, "over_llama_server_ttft": {}}
    for v in variants:
        turns = len(rounds[0][v])
        out["per_turn"][v] = [
            {"turn": t + 1, **{k: round(statistics.median(r[v][t][k] for r in rounds), 2) for k in keys}}
            for t in range(turns)]
        out["last_over_first_ttft"][v] = round(statistics.median(
            r[v][-1]["ttft_ms"] / r[v][0]["ttft_ms"] for r in rounds), 3)
    if "llama_server" in variants:
        for v in variants:
            if v != "llama_server":
                out["over_llama_server_ttft"][v] = [
                    round(statistics.median(r[v][t]["ttft_ms"] / r["llama_server"][t]["ttft_ms"]
                                            for r in rounds), 3)
                    for t in range(len(rounds[0][v]))]
    return out


def print_table(summary: dict[str, Any], variants: list[str]) -> None:
    head = "turn | " + " | ".join(f"{v} ttft ms (prompt/cached, tok/s)" for v in variants)
    ratios = summary["over_llama_server_ttft"]
    if ratios:
        head += " | " + " | ".join(f"{v}/llama_server" for v in ratios)
    print(head)
    for t, _ in enumerate(summary["per_turn"][variants[0]]):
        cells = []
        for v in variants:
            row = summary["per_turn"][v][t]
            cells.append(f"{row['ttft_ms']:.0f} ({row['prompt_tokens']:.0f}/{row['cached_tokens']:.0f}, "
                         f"{row['tokens_per_s']:.1f})")
        cells += [f"{ratios[v][t]:.2f}x" for v in ratios]
        print(f"{t + 1} | " + " | ".join(cells))
    print("last turn / turn 1 ttft: " + ", ".join(
        f"{v} {x:.2f}x" for v, x in summary["last_over_first_ttft"].items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_model(p, "smollm2-135m-instruct (default), a packaged model's name, a "
                      "generated preset (chat: the tiny model with a chat template) or a GGUF file",
                      type=str, default=None)
    options.add_rounds(p, 3, "rounds, the variants alternating within each (default 3)")
    p.add_argument("--turns", type=int, default=None,
                   help=f"turns of the conversation (default {len(USER_MESSAGES)})")
    options.add_tokens(p, None, "max_tokens a turn (default 130)")
    options.add_threads(p, 2, "llama.cpp threads of the worker and of llama-server (default 2)")
    p.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary: also run it")
    p.add_argument("--variants", type=lambda t: t.split(","), default=None,
                   help=f"which of {', '.join(VARIANTS)} to run (default: all; llama_server "
                   "only with --llama-server)")
    options.add_quick(p, "3 turns of 16 tokens, 1 round, the chat preset (checks the harness)")
    options.add_out(p, options.RESULTS / "chat_turns.json")
    options.add_logs(p)
    args = p.parse_args(argv)
    if args.quick:
        args.model = args.model or "chat"
        args.turns = args.turns or 3
        args.tokens = args.tokens or 16
        args.rounds = 1
    args.model = model_path(args.model or "smollm2-135m-instruct")
    args.turns = args.turns or len(USER_MESSAGES)
    args.tokens = args.tokens or 130
    if min(args.rounds, args.turns, args.tokens) < 1:
        p.error("--rounds, --turns and --tokens must be at least 1")
    if args.llama_server is not None and not args.llama_server.is_file():
        p.error(f"--llama-server {args.llama_server}: no such file")
    variants = [v for v in VARIANTS if v != "llama_server" or args.llama_server is not None]
    if args.variants is not None:
        unknown = set(args.variants) - set(variants)
        if unknown:
            p.error(f"--variants: unknown or unavailable {', '.join(sorted(unknown))}")
        variants = [v for v in variants if v in args.variants]
    env = environment(args.model, args.threads,
                      argv=sys.argv if argv is None else ["bench.api.chat_turns", *argv])
    rounds: list[dict[str, list[dict[str, Any]]]] = []
    picks: list[dict[str, dict[str, int]]] = []  # per round, per pool variant: the chat's picks
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        got: dict[str, list[dict[str, Any]]] = {}
        picked: dict[str, dict[str, int]] = {}
        for v in order:
            with started(v, args, args.logs) as port:
                before = pool_picks(port) if v in POOLS else {}
                got[v] = chat(port, args.turns, args.tokens)
                if v in POOLS:  # (the warm-up's pick left out)
                    picked[v] = {by: n - before.get(by, 0) for by, n in pool_picks(port).items()}
            print(f"round {r} {v}: ttft ms " + " ".join(f"{x['ttft_ms']:.0f}" for x in got[v])
                  + (f"; route picks {picked[v]}" if v in picked else ""), flush=True)
        rounds.append(got)
        picks.append(picked)
    summary = summarize(rounds, variants)
    print_table(summary, variants)
    record = {
        "bench": "chat_turns",
        "environment": env,
        "config": {"model": str(args.model), "rounds": args.rounds, "turns": args.turns,
                   "max_tokens": args.tokens, "threads": args.threads, "ctx": CTX, "slots": SLOTS,
                   "llama_server": str(args.llama_server) if args.llama_server else None,
                   "variants": variants, "user_messages": list(USER_MESSAGES[:args.turns])},
        "rounds": rounds,
        "pool_picks": picks,
        "results": summary,
    }
    save_record(args.out, record)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
