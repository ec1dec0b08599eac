"""The benchmark harness measures what it says it measures (work counted, never time).

* The ``Llama`` baseline's timed loop evaluates exactly the requested tokens, counted by
  llama.cpp itself; the old loop (``eval(prompt)`` + ``generate(prompt, reset=False)``) is shown
  to evaluate the prompt again, so the counter can tell them apart.
* The raw ceilings evaluate ``n_seq * n_tokens`` tokens and generate what ``Llama`` generates.
* Rates from token arrival times, the summary and the ratios are checked on fixed inputs.
* A ``--quick`` run on the tiny model (a subset of variants, a real ``trio-shard serve``)
  writes the JSON with its environment, ratios, the workers' RSS (a 2-shard pipeline included)
  and the chart.
* The failover bench kills the middle worker of a real 3-worker chain and its replica replays
  exactly the prompt's positions.
* The network bench runs a 2-hop pipeline through delayed links (bench/common/links.py).
* The hot-path bench reads two workers' CPU and native time per pass, alternating them, and
  the client's CPU (ours and grpcio's).
* The CPU-budget bench's burner really spends, in CPU time, what every token asks of it.
* The multi-turn chat bench resends the whole conversation each turn and reads the door's
  cached tokens.
* The turn-costs bench decodes every variant at both contexts, its cached session really
  starts from the prefix cache and its fresh one does not.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.engine.decode_throughput import (
    Measurement,
    token_times,
    paired_ratios,
    ratios,
    stream_stats,
    summarize,
)
from bench.engine.raw_loops import LlamaBaseline, RawDecoder, buggy_llama_baseline
from shard.models import ensure_model

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_model("tiny")


def test_llama_baseline_times_exactly_the_requested_tokens(tiny: Path) -> None:
    with RawDecoder(tiny, n_ctx=256, n_seq_max=1, threads=1) as raw:
        prompt = raw.tokenize(PROMPT)
    assert len(prompt) > 5
    with LlamaBaseline(tiny, n_ctx=256, threads=1) as baseline:
        for n in (1, 7):
            result = baseline.run(prompt, n)
            assert (result.tokens, result.evaluated) == (n, n)
            assert len(result.first_tokens) == n + 1  # the first token came before the clock
        # The old bench loop re-evaluated the whole prompt inside its timed part.
        assert buggy_llama_baseline(baseline, prompt, 7) == len(prompt) + 6


def test_raw_ceilings_evaluate_every_sequence_and_match_llama(tiny: Path) -> None:
    with RawDecoder(tiny, n_ctx=4 * 256, n_seq_max=4, threads=1) as raw:
        prompt = raw.tokenize(PROMPT)
        single = raw.run(prompt, 1, 6)
        batched = raw.run(prompt, 3, 6)
        with pytest.raises(ValueError):
            raw.run(prompt, 5, 6)  # more sequences than the context holds
    assert (single.tokens, single.evaluated) == (6, 6)
    assert (batched.tokens, batched.evaluated) == (18, 18)
    with LlamaBaseline(tiny, n_ctx=256, threads=1) as baseline:
        reference = baseline.run(prompt, 6).first_tokens
    assert single.first_tokens == reference  # the same greedy tokens: the same work
    assert batched.first_tokens == reference


def test_stream_stats_single_stream() -> None:
    m = stream_stats("v", 1, 1, [10.0], [[10.5, 10.6, 10.7, 10.8, 10.9]])
    assert m.tokens == 4
    assert m.seconds == pytest.approx(0.4)
    assert m.tok_s == pytest.approx(10.0)
    assert m.per_session_tok_s == [pytest.approx(10.0)]
    assert m.ttft_s == [pytest.approx(0.5)]


def test_stream_stats_counts_only_while_every_stream_decodes() -> None:
    # Stream 0 decodes alone for a while (fast), then both share the time (slower each).
    a = [0.0, 0.1, 0.2, 1.2, 2.2, 3.2, 4.2, 5.2, 6.2]
    b = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    m = stream_stats("v", 2, 1, [0.0, 0.9], [a, b])
    # window (1.0, 6.2]: a's 1.2..6.2 (6 tokens) and b's 2.0..6.0 (5 tokens)
    assert (m.tokens, m.seconds) == (11, pytest.approx(5.2))
    assert m.ttft_s == [pytest.approx(0.0), pytest.approx(0.1)]
    with pytest.raises(RuntimeError):
        stream_stats("v", 1, 1, [0.0], [[1.0]])  # one event: no decode rate


def test_http_streams_are_counted_in_tokens_not_events() -> None:
    # llama-server: an event may carry several tokens (held-back UTF-8 pieces); the last one none.
    events = [(1.0, {"content": "a", "tokens_predicted": 1}), (2.0, {"content": "bc", "tokens_predicted": 3}),
              (3.0, {"content": "", "tokens_predicted": 3, "stop": True})]
    assert token_times(events, 3) == [1.0, 2.0, 2.0]
    with pytest.raises(RuntimeError):
        token_times(events, 4)  # fewer tokens than requested: refuse, never pad
    # llama-cpp-python: only the count and the first and final chunk are trusted.
    chunks = [(1.0, {"choices": [{"text": "a", "finish_reason": None}]}),
              (1.5, {"choices": [{"text": "", "finish_reason": None}]}),
              (2.0, {"choices": [{"text": "", "finish_reason": "length"}]})]
    assert token_times(chunks, 4) == [1.0, 2.0, 2.0, 2.0]
    with pytest.raises(RuntimeError):
        token_times(chunks[:2], 4)  # did not end with finish_reason "length"


def _m(variant: str, c: int, tok_s: float, rnd: int = 1) -> Measurement:
    return Measurement(variant, c, rnd, 10, 10 / tok_s, tok_s, [tok_s / c] * c)


def test_summary_takes_medians_and_ratios_compare_like_with_like() -> None:
    ms = [
        _m("raw", 1, 100), _m("raw", 1, 120, 2), _m("raw", 1, 80, 3),
        _m("raw", 4, 300), _m("server_generate", 1, 90), _m("server_generate", 4, 150),
        _m("client_step", 1, 80), _m("engine", 1, 95),
    ]
    summary = summarize(ms)
    assert summary["raw"][1]["tok_s"] == 100
    assert (summary["raw"][1]["tok_s_min"], summary["raw"][1]["tok_s_max"]) == (80, 120)
    r = ratios(summary)
    assert r["server_generate_vs_raw"] == 0.9
    assert r["client_step_vs_raw"] == 0.8
    assert r["engine_vs_raw"] == 0.95
    assert r["server_generate_c4_vs_raw_batched_4"] == 0.5
    assert r["server_generate_c1_vs_raw_batched_1"] == 0.9
    assert "llama_server_vs_raw" not in r  # not measured, not invented


def test_paired_ratios_compare_within_each_round() -> None:
    # The machine got twice as slow in round 2: every variant of that round slowed alike.
    ms = [_m("raw", 1, 100, 1), _m("server_generate", 1, 90, 1),
          _m("raw", 1, 50, 2), _m("server_generate", 1, 45, 2),
          _m("raw", 1, 100, 3), _m("server_generate", 1, 90, 3)]
    assert paired_ratios(ms)["server_generate_vs_raw"] == 0.9


def test_quick_run_writes_report_with_environment_and_ratios(tiny: Path, tmp_path: Path) -> None:
    variants = "raw,llama_cpp.Llama,engine,server_generate,client_step,pipeline_2shard"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine.decode_throughput", "--quick", "--model", str(tiny),
         "--variants", variants, "--concurrency", "1,2", "--tokens", "4", "--threads", "1",
         "--out-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "server_generate_vs_raw" in proc.stdout  # the ratios are printed
    report = json.loads((tmp_path / "decode_throughput.json").read_text())

    env = report["environment"]
    assert env["model_sha256"] == hashlib.sha256(tiny.read_bytes()).hexdigest()
    assert "AVX" in env["llama_cpp_system_info"] or "CPU" in env["llama_cpp_system_info"]
    assert env["threads"] == 1 and env["cores"] >= 1 and env["llama_cpp_python"]
    assert len(env["load_average_before"]) == 3 and len(env["load_average_after"]) == 3
    assert "--quick" in env["command"] and "llama_cpp_build" in env

    assert set(report["ratios"]) >= {
        "server_generate_vs_raw", "client_step_vs_raw", "engine_vs_raw", "llama_vs_raw",
        "server_generate_c1_vs_raw_batched_1", "server_generate_c2_vs_raw_batched_2",
        "pipeline_2shard_vs_raw",
    }
    assert all(v > 0 for v in report["ratios"].values())
    assert set(report["summary"]["server_generate"]) == {"1", "2"}
    assert set(report["summary"]["raw"]) == {"1", "2"}
    assert "ttft_ms_median" in report["summary"]["server_generate"]["2"]
    assert report["not_run"] == {}
    assert report["pipeline_tokens_equal_whole"] is True
    assert set(report["rss_mib"]) == {"whole", "layers_0_2", "layers_2_4"}
    assert all(v > 0 for v in report["rss_mib"].values())
    for m in report["measurements"]:  # every stream timed exactly --tokens decode steps
        if m["variant"] in ("raw", "llama_cpp.Llama", "engine", "client_step", "pipeline_2shard"):
            assert m["tokens"] == 4 * m["concurrency"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert report["chart"] is None and "matplotlib" in report["chart_not_written"]
    else:
        assert (tmp_path / "decode_throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_batching_bench_runs_every_part(tmp_path: Path) -> None:
    """A smoke run of bench/engine/batching.py on the tiny model: it imports, runs every part and
    prints each line (the numbers are the benchmark's business, not the test's)."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine.batching", "--preset", "tiny", "--tokens", "4",
         "--rounds", "1", "--threads", "1", "--sessions", "2", "--prompt", "96",
         "--batch-tokens", "32", "--short-prompt", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "llama_cpp_system_info" in out and "N=2: median ratio engine/raw" in out
    assert "arrival: 96-token prompt during 4 decodes" in out
    assert "sharing: 96-token prompt alone" in out


def test_seq_runs_bench_counts_one_ubatch_per_tick_with_a_cache_entry(tmp_path: Path) -> None:
    """A smoke run of bench/engine/seq_runs.py on the tiny model, which also checks what it
    exists to show: with a prefix cache entry stored between sessions, 16 sessions' decode
    ticks still run as one ubatch (the entry moved above their ids)."""
    out = tmp_path / "seq_runs.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine.seq_runs", "--model", "tiny", "--steps", "3",
         "--rounds", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    for variant in ("cache-off", "cache-on"):
        assert results[variant]["ticks"] >= 2
        assert results[variant]["ubatches_per_tick"] == 1.0, results


def test_contention_bench_runs_every_scenario(tmp_path: Path) -> None:
    """A smoke run of bench/worker/contention.py on the tiny model with small sizes: every scenario
    runs against a real worker and the oversized requests are refused."""
    out = tmp_path / "contention.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.worker.contention", "--quick", "--threads", "1", "--out", str(out),
         "--logs", str(tmp_path / "logs")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    results = report["results"]
    assert {k.split("_max")[0].split("_batch")[0] for k in results} == {
        "starved_prompt", "decode_deadline", "huge_request"}
    for key, value in results.items():
        if key.startswith("starved_prompt"):
            assert value["first_token_s"] > 0
        elif key.startswith("decode_deadline"):
            assert value["decode_steps"] >= 1
    huge = results["huge_request"]
    assert huge["text_16mib_refused"] == huge["token_ids_4m_refused"] == "INVALID_ARGUMENT"
    assert report["environment"]["model"].endswith(".gguf")


def test_contention_bench_repeats_one_scenario(tmp_path: Path) -> None:
    """``--scenarios decode_deadline --repeat 2``: only that scenario, each batch size run
    twice in fresh workers, every run's step timeouts listed."""
    out = tmp_path / "contention.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.worker.contention", "--quick", "--threads", "1", "--out", str(out),
         "--logs", str(tmp_path / "logs"), "--scenarios", "decode_deadline", "--repeat", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {f"decode_deadline_batch_tokens_{b}" for b in ("default", 512, 64)}
    for value in results.values():
        assert len(value["runs"]) == len(value["step_timeouts_per_run"]) == 2
        assert all(r["decode_steps"] >= 1 for r in value["runs"])
    bad = subprocess.run([sys.executable, "-m", "bench.worker.contention", "--scenarios", "nope"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown scenario nope" in bad.stderr


def test_floods_bench_cuts_every_flooding_connection(tmp_path: Path) -> None:
    """A smoke run of bench/worker/floods.py on the tiny model: the attacker process floods, every
    connection it made got GOAWAY(ENHANCE_YOUR_CALM), the neighbour kept generating."""
    out = tmp_path / "floods.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.worker.floods", "--quick", "--seconds", "0.5", "--kinds", "pings,resets",
         "--threads", "1", "--out", str(out), "--logs", str(tmp_path / "logs")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"quiet", "pings", "resets"}
    for kind in ("pings", "resets"):
        run = results[kind]["this_checkout"]
        assert run["connections"] >= 1 and run["goaway_enhance_your_calm"] == run["connections"], run
        assert run["tokens_during_flood"] > 0


def test_busy_client_bench_soaks_grpcio_and_reports_cuts(tmp_path: Path) -> None:
    """A smoke run of bench/worker/busy_client.py: grpcio generations for 2 s on one channel against
    the zero-compute fake worker; tokens counted, no connection cut."""
    out = tmp_path / "busy.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.worker.busy_client", "--quick", "--seconds", "2", "--streams", "4",
         "--out", str(out), "--logs", str(tmp_path / "logs")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    run = record["results"]["this_checkout"]
    assert run["tokens"] > 0 and run["generations_finished"] >= 1, run
    assert run["connections_cut"] == 0 and run["client_errors"] == {}, run
    assert record["environment"]["model"] is None and record["streams"] == 4


def test_a_worker_root_runs_the_bench_helper_by_the_name_it_has_there(tmp_path: Path) -> None:
    """``--worker-root`` may name a checkout from before bench/ was grouped (bench/fake_worker.py
    at the top): the fake worker is started there by the module name that checkout has."""
    from bench.common.processes import FAKE_WORKER, module_in

    assert module_in(None, *FAKE_WORKER) == module_in(ROOT, *FAKE_WORKER) == "bench.common.fake_worker"
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "fake_worker.py").write_text("")
    assert module_in(tmp_path, *FAKE_WORKER) == "bench.fake_worker"
    with pytest.raises(FileNotFoundError):
        module_in(tmp_path / "elsewhere", *FAKE_WORKER)


def test_session_steps_bench_counts_every_token_of_both_workers(tmp_path: Path) -> None:
    """A ``--quick`` run of bench/worker/session_steps.py against this checkout as the other one too:
    every round generated all its tokens (the bench asserts it), both workers have medians for
    each session count, and the ratios compare them."""
    out = tmp_path / "steps.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.worker.session_steps", "--quick", "--worker-root", str(ROOT),
         "--out", str(out), "--logs", str(tmp_path / "logs")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    results = record["results"]
    for name in ("this", "other"):
        assert set(results["medians"][name]) == {"2", "4"}
        for row in results["medians"][name].values():
            assert row["tokens_per_s"] > 0 and row["worker_cpu_us"] >= 0
    assert set(results["ratios"]) == {"2", "4"} and record["environment"]["model"] is None
    assert results["fake_row_us"] > 0  # the fake model's own compute per row, apart
    bad = subprocess.run([sys.executable, "-m", "bench.worker.session_steps", "--sessions", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "must be positive" in bad.stderr


def test_stack_floor_bench_streams_every_message_to_every_reader(tmp_path: Path) -> None:
    """A ``--quick`` run of bench/worker/stack_floor.py: both floor servers (hardened transport and
    stock purerpc) each read whole by grpcio and by the Shard client transport, and the worker's
    Generate by both readers; every pass counted its messages (the bench asserts it)."""
    out = tmp_path / "floor.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.worker.stack_floor", "--quick", "--out", str(out),
         "--logs", str(tmp_path / "logs")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert set(record["medians"]) == {
        f"floor_{impl}_{reader}" for impl in ("transport", "purerpc") for reader in ("grpcio", "shard")
    } | {"paced_transport_grpcio", "paced_transport_shard", "worker_generate_shard",
         "worker_generate_grpcio"}
    assert all(m["messages"] == 500 for m in record["medians"].values())
    assert set(record["worker_over_floor"]) == {
        f"{floor}_{reader}" for floor in ("floor", "paced") for reader in ("grpcio", "shard")}


def test_wakeups_bench_times_every_way_at_every_pace(tmp_path: Path) -> None:
    """A ``--quick`` run of bench/worker/wakeups.py: every way of waking up was measured at both
    paces (CPU per wake-up, never negative), beside Trio's warm scheduling round; bad
    arguments are refused."""
    out = tmp_path / "wakeups.json"
    proc = subprocess.run([sys.executable, "-m", "bench.worker.wakeups", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    medians = json.loads(out.read_text())["results"]["medians"]
    assert set(medians) == {f"{way}_{pace}ms" for way in ("time_sleep", "epoll", "trio_sleep", "trio_woken")
                            for pace in (1, 5)} | {"trio_warm"}
    assert all(v >= 0 for v in medians.values())
    bad = subprocess.run([sys.executable, "-m", "bench.worker.wakeups", "--paces", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "must be positive" in bad.stderr


def test_failover_bench_replays_the_whole_history(tmp_path: Path) -> None:
    """A smoke run of bench/pipeline/failover.py on the tiny model: each trial kills the middle worker
    after the first token and the replica replays exactly the prompt's positions."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.pipeline.failover", "--preset", "tiny", "--histories", "16,40",
         "--tokens", "4", "--relays", "client,chain", "--out-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "failover.json").read_text())
    assert [(t["history"], t["relay"]) for t in report["trials"]] == [
        (16, "client"), (16, "chain"), (40, "client"), (40, "chain")]
    for trial in report["trials"]:
        assert trial["positions_replayed"] == trial["history"]  # killed after the prefill
        # tiny: n_embd 64, float32; chain relay keeps no row log
        assert trial["log_bytes"] == (trial["history"] * 64 * 4 if trial["relay"] == "client" else 0)
    assert [(m["relay"], m["history"]) for m in report["medians"]] == [
        ("client", 16), ("client", 40), ("chain", 16), ("chain", 40)]
    assert report["environment"]["model"].endswith(".gguf")


def test_pipeline_network_bench_reports_client_and_chain_modes_per_rtt(tmp_path: Path) -> None:
    """A ``--quick`` run of bench/pipeline/network.py (tiny model, 2 hops through delayed links):
    the JSON has its environment and a ``client`` and a ``chain`` mode row per RTT, and a 20 ms
    round trip per link delays the first token by at least two round trips (a lower bound, not a
    speed); the speculating modes' rows say they gave the plain run's tokens."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.pipeline.network", "--quick", "--out-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "pipeline_network.json").read_text())
    assert report["environment"]["model"].endswith(".gguf")
    for mode in ("client", "chain"):
        rows = report["modes"][mode]
        assert [(r["hops"], r["rtt_ms"]) for r in rows] == [(2, 0.0), (2, 20.0)]
        for r in rows:
            assert r["tokens"] == 8 and r["prefill_tokens"] == 64
            assert r["tok_s"] > 0 and r["prefill_ms"] > 0
        # Two round trips through the delayed links at least (the prompt to the first hop and
        # its rows or token back; on to the second hop and back), whatever the machine's load.
        # (Comparing with the undelayed run's time failed under load: 416 ms at 0 ms, 92.6 at 20.)
        assert rows[1]["ttft_ms"] >= 2 * 20
    assert [(r["hops"], r["rtt_ms"]) for r in report["ratios"]] == [(2, 0.0), (2, 20.0)]
    for mode in ("speculate", "chain-speculate"):  # the speculating run gave the plain run's tokens
        spec = report["modes"][mode]
        assert [(r["hops"], r["rtt_ms"], r["k"]) for r in spec] == [(2, 0.0, 4), (2, 20.0, 4)]
        for r in spec:
            assert r["identical_tokens"] is True and r["tokens"] == 8
            assert r["plain_traversals"] == 8 >= r["traversals"] == 8 - r["accepted"]


def test_hot_path_bench_measures_both_workers_every_pass(tmp_path: Path) -> None:
    """A ``--quick`` run of bench/worker/hot_path.py against this checkout twice (``--worker-root``):
    every timed pass of both workers (``Generate`` read by ``ShardClient`` and by grpcio, and
    ``Decode``) generated its tokens, read the engine's native time (the counter moved), the
    worker's CPU and the client's, and the ratios compare the two. With ``--floor`` the floor
    server answered both modes at the pace of the round's native steps."""
    out = tmp_path / "hot_path.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.worker.hot_path", "--quick", "--grpcio", "--floor",
         "--worker-root", str(ROOT), "--out", str(out), "--logs", str(tmp_path / "logs")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["passes"]) == {"this", "other", "floor"}
    floor = report["passes"].pop("floor")
    assert set(floor) == {"generate", "decode"} == set(report["over_floor"])
    for mode, rows in floor.items():
        assert [r["messages"] for r in rows] == [64]
        assert rows[0]["pace_us"] == report["passes"]["this"][mode][0]["native_us"]
        assert rows[0]["wall_us"] >= rows[0]["pace_us"]  # each message waited its step
    engine_cpu = 0.0
    for per_mode in report["passes"].values():
        assert set(per_mode) == {"generate", "decode", "generate_grpcio"}
        for rows in per_mode.values():
            assert len(rows) == report["settings"]["rounds"] == 1
            for row in rows:
                assert row["tokens"] == 64
                assert row["native_us"] > 0 and row["wall_us"] > row["native_us"]
                assert row["engine_cpu_us"] >= 0
                engine_cpu += row["engine_cpu_us"]
                assert 10 < row["client_cpu_us"] < 5 * row["wall_us"]  # per token, not per pass
    # A thread's CPU is counted in clock ticks (10 ms): one quick pass of the tiny model may
    # fall between two (0 once in a local run under load); the six passes together may not.
    assert engine_cpu > 0
    assert set(report["ratios"]) == {"generate", "decode", "generate_grpcio"}
    assert report["environment"]["model"].endswith(".gguf")


def test_colocated_bench_times_every_mode_next_to_a_busy_neighbour(tmp_path: Path) -> None:
    """A ``--quick`` run of bench/engine/colocated.py with one busy process: every mode timed the
    tokens it claims (counted from arrivals; four streams for ``sessions4``), the whole worker
    and the two-worker pipeline chose the same tokens, and the report names the native build."""
    out = tmp_path / "colocated.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine.colocated", "--quick", "--busy", "1",
         "--out", str(out), "--logs", str(tmp_path / "logs")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["busy"] == 1 and report["settings"]["tokens"] == 16
    timed = report["tokens_timed"]["this"]
    assert timed["generate"] == timed["decode"] == timed["pipeline"] == [16]
    assert 16 < timed["sessions4"][0] <= 64  # four streams, counted while all of them decode
    assert report["tokens_agree"] == {"this": True}  # the same greedy tokens three ways
    native = report["native_ms_per_step"]["this"]
    assert native["generate"][0] > 0 and len(native["pipeline_hops"][0]) == 2
    assert all(ms > 0 for ms in native["pipeline_hops"][0])  # both hops computed
    assert "llama-cpp-python" in report["system_info"]["this"]
    assert "ratios" not in report  # one checkout: nothing to compare


def test_cpu_budget_burner_spends_what_each_token_asks(tiny: Path) -> None:
    """bench/engine/cpu_budget.py: every timed loop evaluates its tokens, and the burner process really
    spends the CPU time it was asked for after each of them (its own rusage, read at exit)."""
    from bench.engine.cpu_budget import run_threads

    result = run_threads(tiny, 1, [0, 50_000], n_tokens=8, rounds=2)
    assert [row["evaluated"] for row in result["rows"]] == [[8, 8], [8, 8]]
    asked = result["burner_asked_s"]
    assert asked == pytest.approx(2 * 8 * 50_000 / 1e6)  # far above its start-up's CPU
    assert 0.9 * asked <= result["burner_cpu_s"] <= asked + 1.0  # spun, not slept
    assert result["rows"][1]["budget_us"] == 50_000 and "cost_per_cpu_us" in result["rows"][1]


def test_pipeline_throughput_bench_reports_every_configuration(tmp_path: Path) -> None:
    """A ``--quick`` run of bench/pipeline/throughput.py (tiny model, chain relay only; 2
    simulated hops of bench/common/fake_worker.py): every configuration and session count has a row with
    each worker's busy fraction and CPU per step, every pipeline row a ratio to the whole model,
    and the before/after rows name their batch groups."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.pipeline.throughput", "--quick", "--relays", "chain",
         "--tokens", "8", "--out-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "pipeline_throughput.json").read_text())
    rows = report["rows"]
    configs = {(r["config"], r["sessions"], r.get("groups")) for r in rows}
    for n in (1, 4):
        assert {("whole_1core", n, None), ("whole_2threads", n, None),
                ("hops2_cut2", n, "before"), ("hops2_cut2", n, "after")} <= configs
    assert {("sim_hops2", n, g) for n in (4, 8) for g in ("before", "after")} <= configs
    for r in rows:
        assert r["tokens_per_s"] > 0 and len(r["busy"]) == len(r["cpu_us_per_step"])
        assert len(r["busy"]) == (2 if "hops2" in r["config"] else 1)
        assert len(r["loop_cpu_us_per_step"]) == len(r["compute_cpu"]) == len(r["busy"])
    # per thread (/proc counts in 10 ms ticks, so a short window may read 0 for one row): the
    # workers' event loops spent CPU on their steps, the real workers' engine threads computed
    assert any(x > 0 for r in rows for x in r["loop_cpu_us_per_step"])
    assert any(x > 0 for r in rows if not r["config"].startswith("sim") for x in r["compute_cpu"])
    assert all(r["cores_used"] >= 0 for r in rows) and any(r["cores_used"] > 0 for r in rows)
    assert len(report["ratios"]) == sum(1 for r in rows if "hops" in r["config"])
    assert report["environment"]["model"].endswith(".gguf")


def test_api_abuse_bench_runs_each_kind_against_both_doors(tmp_path: Path) -> None:
    """A short run of bench/api/abuse.py on the tiny model against this checkout twice
    (``--door-root``): every door answered the neighbour and the probe, the trickling bodies
    were still held (the window is shorter than the body timeout), and the stop sequences ran
    through the door and through each checkout's text assembler."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.api.abuse", "--model", "tiny", "--seconds", "1",
         "--slow-seconds", "1", "--slow-connections", "3", "--kinds", "slow_bodies,stops",
         "--door-root", str(ROOT), "--out-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "api_abuse.json").read_text())
    assert set(report["results"]) == {"this", "other"}
    for rows in report["results"].values():
        assert set(rows) == {"quiet", "slow_bodies", "stops"}
        for row in rows.values():
            assert row["neighbour_events"] > 0 and row["health_answers"] > 0
        assert rows["slow_bodies"]["slow_bodies"] == {"held_open": 3}
        assert rows["stops"]["assembler_stop_chars"] == 1024 and rows["stops"]["assembler_s"] > 0


def test_pool_spread_bench_puts_half_the_generations_on_each_route(tmp_path: Path) -> None:
    """A small run of bench/api/pool_spread.py on the tiny model: both configurations run, the
    two-route pool splits the generations evenly, and the result file records both rates."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.api.pool_spread", "--model", "tiny", "--sessions", "4",
         "--tokens", "4", "--rounds", "1", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((tmp_path / "pool_spread.json").read_text())
    assert record["rounds"]["spread"] == [[2, 2]]
    assert record["results"]["two_routes_tokens_per_s"] > 0
    assert record["results"]["one_route_tokens_per_s"] > 0


def test_chat_turns_bench_resends_the_conversation_and_reports_every_turn(tmp_path: Path) -> None:
    """A quick run of bench/api/chat_turns.py (the tiny model with a chat template, no
    llama-server): every variant ran every turn, each turn's prompt holds the previous one's,
    the cached door and both pools (a 2-part pool; two replicas, whose door routes every turn
    after the first by its prefix) reused the conversation so far and the cacheless door
    nothing, and the summary has a median row per turn and the last-over-first ratio."""
    out = tmp_path / "chat_turns.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.api.chat_turns", "--quick", "--out", str(out),
         "--logs", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    variants = ["door", "door_nocache", "door_fa_off", "pool_parts", "pool_replicas"]
    assert record["config"]["variants"] == variants
    (rounds,) = record["rounds"]
    for variant, rows in rounds.items():
        assert [r["turn"] for r in rows] == [1, 2, 3]
        prompts = [r["prompt_tokens"] for r in rows]
        assert all(b > a for a, b in zip(prompts, prompts[1:])), (variant, prompts)
        assert all(r["completion_tokens"] >= 1 and r["ttft_ms"] > 0 for r in rows)
    assert all(r["cached_tokens"] == 0 for r in rounds["door_nocache"])
    for variant in ("door", "door_fa_off", "pool_parts", "pool_replicas"):
        rows = rounds[variant]
        assert all(0 < rows[t]["cached_tokens"] < rows[t]["prompt_tokens"] for t in (1, 2))
        assert rows[1]["cached_tokens"] >= rows[0]["prompt_tokens"] - 1, variant
    assert record["pool_picks"] == [{"pool_parts": {"load": 1, "prefix": 2},
                                     "pool_replicas": {"load": 1, "prefix": 2}}]
    results = record["results"]
    assert set(results["per_turn"]) == set(variants)
    assert all(len(rows) == 3 for rows in results["per_turn"].values())
    assert set(results["last_over_first_ttft"]) == set(variants)
    assert results["over_llama_server_ttft"] == {}
    assert record["environment"]["model"].endswith(".gguf")


def test_cold_prefill_bench_times_every_layer_on_the_same_ids(tmp_path: Path) -> None:
    """A quick run of bench/api/cold_prefill.py (the tiny model with a chat template, no
    llama-server): every variant (the three flash-attention settings of the engine, the
    worker, the door) computed the same number of prompt positions, and the summary has
    each one's median and tokens/s, with no ratio to a llama-server that did not run."""
    out = tmp_path / "cold_prefill.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.api.cold_prefill", "--quick", "--prompt", "64,96",
         "--out", str(out), "--logs", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    variants = ["engine", "engine_fa_on", "engine_fa_off", "worker", "door"]
    assert record["config"]["variants"] == variants
    assert record["config"]["flash_attn"] == {"engine": None, "engine_fa_on": True,
                                              "engine_fa_off": False}
    (rounds,) = record["rounds"]
    for n in (64, 96):
        assert sorted(rounds[str(n)]) == sorted(variants)
        assert all(r["prompt_n"] == n and r["s"] > 0 for r in rounds[str(n)].values())
        per = record["results"][str(n)]
        assert list(per) == variants
        assert all(r["tokens_per_s"] > 0 and "over_llama_server" not in r for r in per.values())
    assert record["environment"]["model"].endswith(".gguf")


def test_concurrent_chats_bench_measures_every_level_and_traces_the_doors_stages(
        tmp_path: Path) -> None:
    """A quick run of bench/api/concurrent_chats.py (the tiny chat model, door only, traced):
    every level ran as many chats as it names, each counted its tokens and the door's and the
    worker's CPU per token, and the door's stages to the first token come in their order."""
    out = tmp_path / "concurrent_chats.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.api.concurrent_chats", "--quick", "--trace", "--out",
         str(out), "--logs", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["config"]["variants"] == ["door"] and record["config"]["levels"] == [1, 4]
    (rnd,) = record["rounds"]
    for level, row in rnd["door"].items():
        assert level in ("1", "4")
        assert int(level) <= row["tokens"] <= int(level) * 16
        assert row["tok_s"] > 0 and row["ttft_ms_p50"] <= row["ttft_ms_p90"]
        assert row["cpu_ms_per_tok"] == pytest.approx(
            row["cpu_ms_per_tok_door"] + row["cpu_ms_per_tok_worker"])
    stages = record["results"]["door_stages_ms_p50"]
    assert set(stages) == {"1", "4"}
    for s in stages.values():
        # (a one-hop route sends its Prefill right behind OpenSession: "opened" may come
        # before or after "prefill_sent", but after "open_sent" and before the first step)
        order = ["generate", "pipeline", "open_sent", "prefill_sent", "first_step",
                 "token", "delta", "written"]
        assert [s[k] for k in order] == sorted(s[k] for k in order), s
        assert s["open_sent"] <= s["opened"] <= s["first_step"], s
        assert s["render"] > 0


def test_turn_costs_bench_decodes_every_variant_and_the_cached_one_from_the_cache(tmp_path: Path) -> None:
    """A ``--quick`` run of bench/engine/turn_costs.py: raw, engine and engine_cached decoded
    the requested steps at both contexts; only engine_cached's prompt came from the prefix
    cache (all but its last 27 positions); the first step was taken with and without a copy."""
    out = tmp_path / "turn_costs.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine.turn_costs", "--quick", "--threads", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["environment"]["threads"] == 1 and "--quick" in report["environment"]["command"]
    decode = [m for m in report["measurements"] if m["part"] == "decode"]
    assert {(m["variant"], m["context"]) for m in decode} == {
        (v, n) for v in ("raw", "engine", "engine_cached") for n in (40, 120)}
    for m in decode:
        assert m["cached_tokens"] == (m["context"] - 27 if m["variant"] == "engine_cached" else 0), m
        assert m["wall_ms"] > 0 and m["cpu_ms"] >= 0
    assert {m["variant"] for m in report["measurements"] if m["part"] == "copy"} == {"own", "copied"}
    assert set(report["summary"]["ratios"]) >= {"engine_over_raw_wall_at_120", "engine_cached_over_engine_cpu_at_40"}
