"""The layer every bench builds on: command-line options (``options``), the environment record
written beside every result (``environment``), servers as subprocesses and their clients
(``processes``), and the helper processes and proxies benches start: the fake worker
(``fake_worker``), the stack's floor (``floor_server``) and simulated links (``links``)."""
