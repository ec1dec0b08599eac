"""How often a reused prefix changes a real model's greedy tokens, over many real conversations.

llama.cpp's float sums depend on the shapes of the batches that computed a position (its matrix
kernels take one row and a block of rows by different paths), so a prompt computed in one step
and the same prompt computed as a cached history (its replies decoded one token a step) plus the
rest in one step give slightly different logits, and a near-tie between the top two tokens can
then flip. This bench measures it on the packaged real
models (SmolLM2 135M Instruct, Gemma 3 270M; ``shard.models.real``), engine in process.

Each of ``--conversations`` chats (user messages drawn with ``--seed`` from fixed topics and
templates, rendered with the model's chat template, each turn resending the whole conversation
as a chat UI does) runs ``--turns`` turns of ``--tokens`` greedy tokens (fewer at end of turn)
on three sessions that see the same tokens:

  cached        an engine with the prefix cache: a new session per turn, the whole prompt in one
                prefill, which copies the previous turn's history from the cache and computes the
                rest in one step
  same_chunks   a cacheless engine (``prefix_cache_tokens=0``), one session for the conversation
                that computes exactly the cached run's steps: the previous turn's history stays,
                is cut where the new prompt departs from it, and the rest is one step
  other_chunks  the cacheless engine, a new session per turn prefilling the whole prompt in one
                step: the float-sum effect without any cache (a cacheless server's result)

All three decode the cached run's tokens (teacher forcing), so one flip does not derail the rest
of the conversation. For each reference it reports the turns and conversations whose greedy
tokens differ from the cached run's, the first differing position of each, and the top-2
log-probability margin there (of the cached run and of the reference: equal to the logit margin),
beside how many of all positions had margins that small, and the largest drift of the chosen
token's log-probability. ``same_chunks`` must show no difference at all (the cache copies cells
the cacheless engine computes bit for bit); ``other_chunks`` is what llama-server's users live
with (its prompt cache reuses a slot's cells alike). Nothing here is timed.

    python -m bench.engine.prefix_flips [--quick] [--models smollm2-135m-instruct,gemma3-270m]
        [--conversations 100] [--turns 3] [--tokens 48] [--seed 0] [--threads 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from bench.common import options
from bench.common.environment import environment, load_average, save_record, sha256_file
from shard.chat import ChatTemplate
from shard.engine import DecodeRequest, LoadSpec, PrefillRequest, StepResult
from shard.engine.llama import LlamaCppEngine
from shard.models.real import resolve_model

MODELS = ("smollm2-135m-instruct", "gemma3-270m")
#: Gemma 3 270M is a base model whose GGUF carries no template: Gemma 3's chat format (a system
#: message goes in front of the first user message, as Gemma's own template does).
GEMMA3_CHAT = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] != 'system' %}"
    "{% set head = messages[0]['content'] + '\\n\\n' if loop.index0 == 1 and "
    "messages[0]['role'] == 'system' else '' %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' + head"
    " + (m['content'] | trim) + '<end_of_turn>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
#: The report counts the positions whose top-2 margin (log-probability) is below each of these.
MARGINS = (0.05, 0.1, 0.25, 0.5)
N_CTX = 1024  # one session: a conversation of a few turns fits

TOPICS = (
    "photosynthesis", "the French Revolution", "black holes", "sourdough bread", "compound interest",
    "the water cycle", "machine learning", "the Roman Empire", "volcanoes", "jazz music",
    "vaccines", "the stock market", "climate change", "chess openings", "the human heart",
    "renewable energy", "Shakespeare's plays", "plate tectonics", "honeybees", "the internet",
    "marathon training", "coffee brewing", "the Moon landing", "recycling", "electric cars",
    "origami", "the immune system", "ancient Egypt", "gardening tomatoes", "prime numbers",
)
SYSTEMS = (None, "You are a concise assistant.", "You are a patient teacher who uses examples.",
           "Answer like a friendly expert.")
OPENERS = (
    "Can you explain {t} in simple terms?", "What are three interesting facts about {t}?",
    "I'm writing a school report on {t}. Where should I start?", "Why does {t} matter?",
    "Give me a short introduction to {t}.", "What is the most common misconception about {t}?",
    "How would you describe {t} to a ten-year-old?", "Tell me something surprising about {t}.",
)
FOLLOW_UPS = (
    "Can you give a concrete example?", "Why is that?", "Summarize that in one sentence.",
    "How is this related to {u}?", "What would a beginner get wrong here?",
    "Can you say more about the second point?", "Is there a good book about {t}?",
    "Thanks! And what about {u}?", "Make it shorter, please.", "What happens next?",
)


def conversations(seed: int, n: int, turns: int) -> list[tuple[str | None, list[str]]]:
    """``n`` conversations (system message or None, user messages), the same for one seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        topic, other = rng.sample(TOPICS, 2)
        users = [rng.choice(OPENERS).format(t=topic)]
        users += [rng.choice(FOLLOW_UPS).format(t=topic, u=other) for _ in range(turns - 1)]
        out.append((rng.choice(SYSTEMS), users))
    return out


def chat_template(engine: LlamaCppEngine, model: str) -> ChatTemplate:
    """The model's own chat template, Gemma 3's format where the GGUF has none."""
    chat = engine.capabilities().chat
    source = chat.template or (GEMMA3_CHAT if model.startswith("gemma3") else "")
    if not source:
        raise SystemExit(f"{model}: no chat template")
    return ChatTemplate(source, chat.bos_token, chat.eos_token, chat.eot_token, chat.add_bos,
                        chat.special_texts)


def margin(step: StepResult) -> float:
    """Top-2 log-probability margin of a step's last position (the logit margin)."""
    assert step.logits is not None
    top = step.logits.top
    return top[0].logprob - top[1].logprob


def top_of(step: StepResult) -> tuple[tuple[int, float], ...]:
    assert step.logits is not None
    return tuple((t.token_id, t.logprob) for t in step.logits.top)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Verdict:
    """One reference's comparison with the cached run over one turn's positions."""

    first_diff: int | None = None  # the first position (of the turn's tokens) whose greedy differs
    margin: float | None = None  # the cached run's top-2 margin there
    ref_margin: float | None = None  # the reference's
    identical: bool = True  # every position's top-k log-probabilities bit-identical
    #: The largest difference of the cached run's chosen token's log-probability from the
    #: reference's (where the reference's top-k holds it): how far the float sums drift.
    drift: float = 0.0

    def see(self, i: int, got: StepResult, ref: StepResult) -> None:
        if top_of(got) != top_of(ref):
            self.identical = False
            (token, logprob), theirs = top_of(got)[0], dict(top_of(ref))
            if token in theirs:
                self.drift = max(self.drift, abs(logprob - theirs[token]))
        assert got.logits is not None and ref.logits is not None
        if self.first_diff is None and got.logits.token_id != ref.logits.token_id:
            self.first_diff, self.margin, self.ref_margin = i, margin(got), margin(ref)


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    tokens: list[int]
    margins: list[float]
    same_chunks: Verdict = field(default_factory=Verdict)
    other_chunks: Verdict = field(default_factory=Verdict)


@dataclass
class Engines:
    """The cached engine (a budget of one session's cells, so one entry: a conversation never
    hits another's history, and the same-chunks reference knows which cells it copied) and a
    cacheless one."""

    cached: LlamaCppEngine
    plain: LlamaCppEngine
    chat: ChatTemplate


@asynccontextmanager
async def engines(model: str, threads: int, sessions: int = 1) -> AsyncIterator[Engines]:
    """``sessions`` sessions on the cached engine, one more on the cacheless one (at least two),
    ``N_CTX`` cells each."""
    path = resolve_model(model)
    async with LlamaCppEngine() as cached, LlamaCppEngine() as plain:
        await cached.load(LoadSpec(model_path=path, n_ctx=sessions * N_CTX, max_sessions=sessions,
                                   n_threads=threads, prefix_cache_tokens=N_CTX))
        n = max(2, sessions + 1)
        await plain.load(LoadSpec(model_path=path, n_ctx=n * N_CTX, max_sessions=n,
                                  n_threads=threads))
        yield Engines(cached, plain, chat_template(cached, model))


async def forget_cache(engine: LlamaCppEngine) -> None:
    """Make the cache's one entry a history no conversation starts with (one ``!`` token)."""
    await engine.open_session("forget")
    await engine.prefill(PrefillRequest("forget", tokens=engine.tokenize("!", add_bos=False)))
    await engine.release("forget")


async def converse(e: Engines, index: int, system: str | None, users: Sequence[str],
                   n_tokens: int) -> list[Turn]:
    """One conversation on the three sessions (module doc): its turns' records."""
    await forget_cache(e.cached)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    held: list[int] = []  # what the same-chunks session holds: the previous turn's history
    out = []
    await e.plain.open_session("same")
    try:
        for k, user in enumerate(users):
            messages.append({"role": "user", "content": user})
            prompt = list(e.cached.tokenize(e.chat.render(messages), add_bos=e.chat.add_bos,
                                            parse_special=True))
            await e.cached.open_session("cached")
            await e.plain.open_session("other")
            try:
                got = await e.cached.prefill(PrefillRequest("cached", tokens=prompt))
                c = got.cached_tokens
                expected = min(common_prefix(held, prompt), len(prompt) - 1)
                assert c == expected, (index, k, c, expected)  # the cache took the previous turn
                await e.plain.truncate("same", c)
                same = await e.plain.prefill(PrefillRequest("same", tokens=prompt[c:], position=c))
                other = await e.plain.prefill(PrefillRequest("other", tokens=prompt))
                turn = Turn(index, k, len(prompt), c, [], [])
                for i in range(n_tokens):
                    assert got.logits is not None
                    turn.same_chunks.see(i, got, same)
                    turn.other_chunks.see(i, got, other)
                    token = got.logits.token_id
                    turn.tokens.append(token)
                    turn.margins.append(margin(got))
                    if got.logits.is_eog or i == n_tokens - 1:
                        break
                    got = await e.cached.decode(DecodeRequest("cached", token=token))
                    same = await e.plain.decode(DecodeRequest("same", token=token))
                    other = await e.plain.decode(DecodeRequest("other", token=token))
            finally:
                await e.cached.release("cached")
                await e.plain.release("other")
            out.append(turn)
            assert got.logits is not None
            held = prompt + turn.tokens[:-1]  # the last token was never fed back
            said = turn.tokens[:-1] if got.logits.is_eog else turn.tokens  # without its EOT
            text = b"".join(e.cached.token_piece(t) for t in said).decode("utf-8", "replace")
            messages.append({"role": "assistant", "content": text.strip()})
    finally:
        await e.plain.release("same")
    return out


def summary(turns: Sequence[Turn], which: str) -> dict[str, Any]:
    """One reference's differences from the cached run."""
    verdicts = [(t, getattr(t, which)) for t in turns]
    flips = [(t, v) for t, v in verdicts if v.first_diff is not None]
    return {
        "turns_differing": len(flips),
        "conversations_differing": len({t.conversation for t, _ in flips}),
        "turns_bit_identical": sum(v.identical for _, v in verdicts),
        "max_logprob_drift": round(max((v.drift for _, v in verdicts), default=0.0), 6),
        "flips": [{"conversation": t.conversation, "turn": t.turn, "position": v.first_diff,
                   "cached_margin": round(v.margin or 0.0, 6),
                   "reference_margin": round(v.ref_margin or 0.0, 6)} for t, v in flips],
    }


async def measure(model: str, args: argparse.Namespace) -> dict[str, Any]:
    chats = conversations(args.seed, args.conversations, args.turns)
    turns: list[Turn] = []
    async with engines(model, args.threads) as e:
        for i, (system, users) in enumerate(chats):
            turns += await converse(e, i, system, users, args.tokens)
            if (i + 1) % 10 == 0:
                print(f"{model}: {i + 1}/{len(chats)} conversations", file=sys.stderr, flush=True)
    margins = [m for t in turns for m in t.margins]
    later = [t for t in turns if t.turn > 0]
    return {
        "conversations": len(chats),
        "turns": len(turns),
        "later_turns": len(later),  # a first turn computes the same steps in every run
        "positions": len(margins),
        "median_margin": round(statistics.median(margins), 4),
        "positions_with_margin_below": {str(x): sum(m < x for m in margins) for x in MARGINS},
        "mean_prompt_tokens": round(sum(t.prompt_tokens for t in turns) / len(turns), 1),
        "mean_cached_tokens_later_turns": round(
            sum(t.cached_tokens for t in later) / len(later), 1) if later else 0.0,
        "same_chunks": summary(turns, "same_chunks"),
        "other_chunks": summary(turns, "other_chunks"),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help="comma-separated packaged models (default: %(default)s)")
    parser.add_argument("--conversations", type=int, default=100)
    parser.add_argument("--turns", type=int, default=3, help="user turns per conversation")
    options.add_tokens(parser, 48, "greedy tokens per turn at most (default: 48)")
    options.add_seed(parser)
    options.add_threads(parser, 1, "llama.cpp threads per engine (default: 1)")
    options.add_quick(parser, "3 conversations of 2 turns of 16 tokens: checks the harness")
    options.add_out(parser, options.RESULTS / "prefix_flips.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.tokens = 3, 2, 16
    env = environment(None, args.threads)
    results = {}
    for model in args.models.split(","):
        path = resolve_model(model)
        results[model] = {"model": str(path), "model_sha256": sha256_file(path),
                          **trio.run(measure, model, args)}
    env["load_average_after"] = load_average()
    save_record(args.out, {"environment": env, "results": results})
    for model, r in results.items():
        for which in ("same_chunks", "other_chunks"):
            s = r[which]
            print(f"{model:<22} {which:<12} turns differing {s['turns_differing']}/{r['turns']}, "
                  f"conversations {s['conversations_differing']}/{r['conversations']}, "
                  f"bit-identical turns {s['turns_bit_identical']}/{r['turns']}, largest margin "
                  f"at a flip {max((f['cached_margin'] for f in s['flips']), default=0):.3f}, "
                  f"drift {s['max_logprob_drift']:.3g}")


if __name__ == "__main__":
    main()
