"""Benches of chains of workers: tokens/s through real and simulated hops (``throughput``),
over simulated network links (``network``), chunked prefill across shards (``prefill``) and
what a lost or drained hop costs (``failover``)."""
