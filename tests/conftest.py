"""Hypothesis profiles for the whole suite.

Every run gets the profile active on import (hypothesis' own default, or its ``ci`` profile
where a CI variable is set) without a deadline (``suite``, below). ``--hypothesis-profile=long``
raises every property test's example budget; the RPC fuzzer (tests/test_rpc_fuzz.py) then runs until
``SHARD_FUZZ_SECONDS`` (default 600) have passed::

    SHARD_FUZZ_SECONDS=3600 python -m pytest tests/test_rpc_fuzz.py --hypothesis-profile=long -s
"""

import signal

import pytest
from hypothesis import settings

#: Example budget of the long profile; also how the fuzzer recognises it.
LONG_EXAMPLES = 1_000_000

settings.register_profile("long", max_examples=LONG_EXAMPLES, deadline=None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long profile runs for as long as it is told (``SHARD_FUZZ_SECONDS``): the per-test
    timeout (pyproject.toml), there to stop a hung test, does not apply to it."""
    if settings.default.max_examples >= LONG_EXAMPLES:
        for item in items:
            item.add_marker(pytest.mark.timeout(0))


def sigint_default() -> None:
    """``preexec_fn`` for a child process a test interrupts with SIGINT.

    A test run started in the background by a non-interactive shell inherits SIGINT ignored;
    Python then installs no KeyboardInterrupt handler in the child, which would never stop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# Hypothesis' default deadline (200 ms an example) is an assertion on wall-clock speed: on a loaded
# machine one example paused by the scheduler failed a property that holds (DeadlineExceeded, or
# Flaky when its replay was quick). Tests assert behaviour only, so no run has one; a hung example
# is the per-test timeout's to stop. ``--hypothesis-profile`` still loads the profile it names.
settings.register_profile("suite", parent=settings.default, deadline=None)
settings.load_profile("suite")
