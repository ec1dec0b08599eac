"""``python -m shard.cli``: the ``trio-shard`` command."""

from shard.cli.main import main

raise SystemExit(main())
