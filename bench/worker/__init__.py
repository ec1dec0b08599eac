"""Benches of one live worker's serving stack (transport, session, scheduler), mostly as CPU
time per token: ``hot_path``, ``session_steps``, the stack's floor (``stack_floor``,
``floor_reads``) and a wake-up's cost (``wakeups``); its behaviour under pressure:
``cancel_latency``, ``contention``, ``floods``, ``busy_client`` (grpcio, ``grpcio_stream``),
``soak``; and where a step's time goes (``profile_server``, ``scheduler_counts``)."""
