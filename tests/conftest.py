"""Shared test setup: test-support modules on the path, loopback-only UCX."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "support"))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
