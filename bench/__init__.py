"""The benchmarks, grouped by what they measure; each runs as ``python -m bench.<group>.<name>``.

* ``common``: what every bench shares: options, the environment record, processes, the fake
  worker, the floor server, simulated links.
* ``engine``: llama.cpp and the engine: decode throughput against its ceilings, batching, the
  layer boundary, the CPU left to Python, workers sharing the cores.
* ``worker``: one live worker's serving stack: CPU per token, the stack's floor, wake-ups,
  cancellation, contention, floods, soaks, busy clients, profiles.
* ``pipeline``: chains of workers: throughput, simulated networks, chunked prefill, failover.
* ``api``: the OpenAI-compatible front door and the pool behind it.

Results go to bench/results (not kept in git) unless ``--out``/``--out-dir`` says otherwise;
docs/benchmarks.md reports them.
"""
