"""Shared test setup: test-support modules on the path, loopback-only UCX, fixed hypothesis draws."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent / "support"))
os.environ.setdefault("UCX_NET_DEVICES", "lo")

# Property tests draw the same examples on every run, so CI reproduces what was checked here.
settings.register_profile("kvlink", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kvlink"))
