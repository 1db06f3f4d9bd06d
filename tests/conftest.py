"""Shared test setup: test-support modules on the path, loopback-only UCX, fixed hypothesis draws."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from hypothesis import settings

from kvlink.procs.shm import remove_orphans

sys.path.insert(0, str(Path(__file__).parent / "support"))
os.environ.setdefault("UCX_NET_DEVICES", "lo")

# Property tests draw the same examples on every run, so CI reproduces what was checked here.
settings.register_profile("kvlink", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kvlink"))


_SESSION_STARTED = time.time()


def pytest_sessionfinish(session: object, exitstatus: int) -> None:
    """Every process the suite started is stopped by now: unlink the shared-memory segments it
    created that no live process uses (servers the tests killed on purpose leave vLLM's)."""
    removed = remove_orphans(since=_SESSION_STARTED)
    if removed:
        print(f"\nremoved {len(removed)} orphaned shared-memory segment(s) from /dev/shm")
