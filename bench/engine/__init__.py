"""Benches of llama.cpp and the engine: what a decode step costs with and without the worker
around it (``decode_throughput`` and its ceilings in ``raw_loops``), batching concurrent
sessions (``batching``), a layer range's boundary (``boundary``), what Python work per token
costs the compute (``cpu_budget``) and workers sharing one machine's cores (``colocated``)."""
