"""Run ``python -m shard.cli ...`` with a Trio instrument that counts the event loop's work.

Why: on a shared 2-vCPU machine the CPU time per token moves by 10-20% from one pass to the
next, so a change of a few percent on the hot path cannot be seen in it. How many scheduler
passes (one ``epoll_wait`` each) and task steps a served token takes is nearly exact, and it
is what the hand-offs between tasks cost. ``bench/worker/hot_path.py --scheduler`` starts its workers
through this module and reads the counts around every pass.

Used as a command prefix (``bench.common.processes.shard_server(wrap=...)``)::

    python bench/worker/scheduler_counts.py COUNTS_FILE -- PYTHON -m shard.cli ARGS...

``SIGUSR1`` writes a snapshot to ``COUNTS_FILE`` (atomically, by rename): ``{"passes": N,
"steps": {task name: N}}``. This file imports nothing from ``bench`` so that a worker run from
another checkout (``PYTHONPATH``) uses that checkout's ``shard`` package.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import trio


class Counter(trio.abc.Instrument):
    """Scheduler passes and task steps, by task name (the function's qualified name)."""

    def __init__(self) -> None:
        self.passes = 0
        self.steps: collections.Counter[str] = collections.Counter()

    def before_io_wait(self, timeout: float) -> None:
        self.passes += 1

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps[task.name.rsplit(".", 1)[-1]] += 1

    def snapshot(self) -> dict[str, Any]:
        return {"passes": self.passes, "steps": dict(self.steps)}


def main() -> None:
    counts, sep, *command = sys.argv[1:]
    if sep != "--" or command[1:3] != ["-m", "shard.cli"]:
        raise SystemExit("usage: scheduler_counts.py COUNTS_FILE -- PYTHON -m shard.cli ARGS...")
    target = Path(counts)
    counter = Counter()

    def write(_signum: int, _frame: Any) -> None:
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(counter.snapshot()))
        os.replace(tmp, target)

    signal.signal(signal.SIGUSR1, write)
    run = trio.run

    def instrumented(*args: Any, **kwargs: Any) -> Any:
        kwargs["instruments"] = [*kwargs.get("instruments", ()), counter]
        return run(*args, **kwargs)

    trio.run = instrumented  # type: ignore[assignment]  # the CLI's own trio.run
    if not os.environ.get("PYTHONPATH"):  # this checkout's package (else: the one named there)
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import shard.cli

    sys.argv = ["trio-shard", *command[3:]]
    shard.cli.main()


if __name__ == "__main__":
    main()
