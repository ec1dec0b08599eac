"""A real model end to end: Gemma 3 270M Q4_K_M (18 blocks; shard/models/real.py assembles it
from the packages ``make models`` installs; without them every test here fails with the message
naming them: none is skipped).

* The whole-model worker (``trio-shard serve --model gemma3-270m``, a real process) generates
  the same 64 greedy tokens as llama-cpp-python's ``Llama``. The worker leaves flash attention
  to llama.cpp ("auto", which turns it on for this model on CPU) while ``Llama`` 0.3.36 turns it
  off unless told, so the oracle passes ``flash_attn=True``: without it a near-tie flips the
  10th token of this prompt.
* Chains of 2 and 3 ``trio-shard serve --layers`` workers, driven by ``trio-shard generate
  --pipeline ... --json``, print exactly what the whole-model worker prints over 64 tokens.
  These need gemma3 layer-range slicing (issue 15); until it lands, ``serve --layers`` refuses
  the architecture and they fail with that message.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from shard.models.real import REAL_MODELS, ensure_real_model
from test_cli import running_worker  # the README flow's worker harness (real processes)

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m"
PIN = REAL_MODELS[MODEL]
# Varied text, no end of generation within 64 tokens (a prompt that loops at once would make
# the comparisons weak).
PROMPT = "Once upon a time, in a small village by the sea,"
N_TOKENS = 64
CHAINS = {
    "2-workers": ["0:7", "7:18"],
    "3-workers": ["0:5", "5:11", "11:18"],
}
CLI = [sys.executable, "-m", "shard.cli", "--log-level", "WARNING"]
ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def _generate(*where: str) -> dict[str, Any]:
    out = _cli("generate", *where, "--max-tokens", str(N_TOKENS), "--temperature", "0", "--json",
               "--timeout", "300", PROMPT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _caps(target: str) -> dict[str, Any]:
    out = _cli("caps", "--target", target, "--json", "--timeout", "60")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def gemma3() -> Path:
    return ensure_real_model(MODEL)


@pytest.fixture(scope="module")
def whole(gemma3: Path) -> Iterator[dict[str, Any]]:
    """What the whole-model worker, served by the model's name, generates (and its caps)."""
    with running_worker("--model", MODEL) as (target, _):
        result = _generate("--target", target)  # waits while the worker loads; caps does not
        result["caps"] = _caps(target)
    yield result


def _llama_greedy(path: Path, prompt: str, n: int) -> list[int]:
    import llama_cpp  # tests may use llama_cpp directly; shard/ may not

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=512, n_threads=1, seed=0,
                          flash_attn=True, verbose=False)
    try:
        tokens = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        out: list[int] = []
        for tok in llm.generate(tokens, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            out.append(int(tok))
            if len(out) == n or tok == llm.token_eos():
                break
        return out
    finally:
        llm.close()


def test_whole_model_worker_equals_llama_cpp_python(gemma3: Path, whole: dict[str, Any]) -> None:
    caps = whole["caps"]
    assert caps["architecture"] == "gemma3"
    assert caps["n_layers_total"] == PIN.block_count and caps["layer_range"] == [0, PIN.block_count]
    assert caps["model_fingerprint"] == PIN.sha256  # the worker serves exactly the pinned file
    assert whole["finish_reason"] == "length" and len(whole["tokens"]) == N_TOKENS
    assert len(set(whole["tokens"])) > 20  # varied text: the comparison means something
    assert whole["tokens"] == _llama_greedy(gemma3, PROMPT, N_TOKENS)


@pytest.mark.parametrize("ranges", list(CHAINS.values()), ids=list(CHAINS))
def test_pipeline_equals_the_whole_model_worker(
    gemma3: Path, whole: dict[str, Any], ranges: Sequence[str]
) -> None:
    with ExitStack() as stack:
        targets = [
            stack.enter_context(running_worker("--model", str(gemma3), "--layers", r))[0]
            for r in ranges
        ]
        piped = _generate("--pipeline", ",".join(targets))  # waits for workers still loading
        speculated = _generate("--pipeline", ",".join(targets), "--speculate", "4")
        for target, r in zip(targets, ranges, strict=True):
            caps = _caps(target)  # (caps does not wait: asked once every worker served)
            assert caps["layer_range"] == [int(x) for x in r.split(":")]
            assert caps["model_fingerprint"] == PIN.sha256  # every shard names the whole model
    want = {k: v for k, v in whole.items() if k != "caps"}
    assert piped.pop("traversals") == len(want["tokens"])  # one pass per token
    assert piped["tokens"] == want["tokens"]
    assert piped == want  # text and finish reason too
    # speculative verification: the same text in fewer passes (prompt lookup drafts)
    assert speculated["tokens"] == want["tokens"] and speculated["text"] == want["text"]
    assert speculated["traversals"] == len(want["tokens"]) - speculated["accepted_tokens"]


def test_decode_bench_runs_on_the_real_model(gemma3: Path, tmp_path: Path) -> None:
    """``python -m bench.engine.decode_throughput --model <the real file>``: whole-model variants, and
    the 2-shard pipeline cut at 9 of 18 blocks, with the whole model's tokens."""
    from shard.models import RANGE_ARCHITECTURES

    bench = [sys.executable, "-m", "bench.engine.decode_throughput", "--tokens", "4", "--rounds", "1",
             "--threads", "1", "--concurrency", "1", "--out-dir", str(tmp_path)]
    proc = subprocess.run(
        [*bench, "--model", str(gemma3), "--variants", "raw,engine,server_generate,pipeline_2shard"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "decode_throughput.json").read_text())
    assert report["environment"]["model_sha256"] == PIN.sha256
    assert set(report["summary"]) >= {"raw", "engine", "server_generate"}
    assert "gemma3" in RANGE_ARCHITECTURES
    assert report["not_run"] == {}
    assert report["settings"]["pipeline_ranges"] == [[0, 9], [9, 18]]
    assert report["pipeline_tokens_equal_whole"] is True
    # The model by name, and a cut outside the model refused before any work.
    bad = subprocess.run([*bench, "--model", MODEL, "--split", "18"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert "--split 18: must be between 1 and 17 for this 18-block model" in bad.stderr


def test_planned_parts_tile_the_model_and_three_equal_the_whole_model(
    gemma3: Path, whole: dict[str, Any]
) -> None:
    """``trio-shard plan`` for 2, 3 and 4 parts: contiguous ranges tiling the 18 blocks, each
    priced as the slicer writes it (a slice's file is its planned bytes plus its header), balanced
    where the sizes allow (Gemma 3 ties its 178 MB head to the embeddings, so the first and last
    parts both hold them: from 3 parts on, those two are the smallest they can be, one block
    each, and the middle parts share the rest evenly). ``serve --part i/3`` serves the same
    ranges, and the three workers generate the whole model's tokens, under the packaged
    model's name."""
    plans = {}
    for n in (2, 3, 4):
        out = _cli("plan", "--model", MODEL, "--parts", str(n), "--json")
        assert out.returncode == 0, out.stderr
        plans[n] = json.loads(out.stdout)["parts"]
        ranges = [tuple(int(x) for x in p["layers"].split(":")) for p in plans[n]]
        assert ranges[0][0] == 0 and ranges[-1][1] == PIN.block_count
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:]))
        sizes = [p["bytes"] for p in plans[n]]
        if n == 2:
            assert max(sizes) / min(sizes) <= 1.15
        else:
            assert ranges[0] == (0, 1) and ranges[-1] == (PIN.block_count - 1, PIN.block_count)
            middle = sizes[1:-1]
            assert max(middle) / min(middle) <= 1.15
    from shard.engine import LayerRange
    from shard.models import ensure_slice

    for p in plans[3]:  # the bytes a part holds are the bytes its slice file carries
        a, b = (int(x) for x in p["layers"].split(":"))
        size = ensure_slice(gemma3, LayerRange(a, b)).stat().st_size
        assert p["bytes"] <= size <= p["bytes"] + 8 * 2**20, (p, size)
    with ExitStack() as stack:
        targets = [stack.enter_context(running_worker("--model", MODEL, "--part", f"{i}/3"))[0]
                   for i in (1, 2, 3)]
        piped = _generate("--pipeline", ",".join(targets))
        for target, p in zip(targets, plans[3], strict=True):
            caps = _caps(target)
            assert caps["layer_range"] == [int(x) for x in p["layers"].split(":")]
            assert caps["model_name"] == MODEL
    piped.pop("traversals")
    assert piped == {k: v for k, v in whole.items() if k != "caps"}
